//! The device kernels compile: every entry of `cuda/reduce.cu` is built for `sm_90` with
//! NVRTC alone (no GPU, no driver), so a mistake in `cuda/` fails CI.
//!
//! NVRTC comes from the CUDA 13.0 toolkit or the `nvidia-cuda-nvrtc==13.0.*` wheel
//! (its `lib` directory on `LD_LIBRARY_PATH`; headers through `FERROCCL_CUDA_INCLUDE`,
//! see `ferroccl::cuda`). Without it the test says it skipped — unless
//! `FERROCCL_REQUIRE_NVRTC=1` (set by CI), where a missing NVRTC fails.

use crate::common;

use ferroccl::cuda::nvrtc;
use ferroccl::{DataType, ReduceOp};
use std::time::Duration;

/// NVRTC compiles the whole file in a few seconds; allow for a loaded CI machine.
const DEADLINE: Duration = Duration::from_secs(300);

fn required() -> bool {
    std::env::var("FERROCCL_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

#[test]
fn every_kernel_compiles_for_sm_90() {
    if !nvrtc::nvrtc_present() {
        assert!(
            !required(),
            "FERROCCL_REQUIRE_NVRTC=1 but {}",
            nvrtc::nvrtc_missing()
        );
        eprintln!(
            "SKIPPED every_kernel_compiles_for_sm_90: {}",
            nvrtc::nvrtc_missing()
        );
        return;
    }
    let (major, minor) = nvrtc::version().expect("nvrtcVersion");
    eprintln!(
        "NVRTC {major}.{minor}; include dirs {:?}",
        nvrtc::include_dirs()
    );
    // The GPUs run driver 580 (CUDA 13.0): PTX from a newer NVRTC would not load there.
    if required() {
        assert_eq!(
            (major, minor),
            (13, 0),
            "CI must compile with the NVRTC of the GPUs' CUDA (13.0)"
        );
    }
    let ptx = common::with_deadline(DEADLINE, || nvrtc::compile(90));
    let ptx = ptx.unwrap_or_else(|e| panic!("cuda/reduce.cu does not compile for sm_90: {e}"));
    if let Some(path) = std::env::var_os("FERROCCL_DUMP_PTX") {
        std::fs::write(path, &ptx).expect("writing FERROCCL_DUMP_PTX");
    }
    assert!(
        ptx.contains(".target sm_90"),
        "PTX is not for sm_90: {}",
        &ptx[..ptx.len().min(400)]
    );
    let entries = nvrtc::ptx_entries(&ptx);
    let expected = nvrtc::entry_names();
    let missing: Vec<&String> = expected.iter().filter(|n| !entries.contains(n)).collect();
    assert!(
        missing.is_empty(),
        "entries missing from the PTX: {missing:?}"
    );
    // 7 types × 4 ops × 2 forms, + 4 float types × (Avg × 2 forms + scale).
    assert_eq!(expected.len(), 7 * 4 * 2 + 4 * 3);
    for dt in [DataType::F16, DataType::BF16, DataType::F32, DataType::F64] {
        for op in ReduceOp::ALL {
            assert!(entries.contains(&nvrtc::reduce_name(dt, op).unwrap()));
            assert!(entries.contains(&nvrtc::reduce_copy_name(dt, op).unwrap()));
        }
    }
    // Every reduction takes the 16-byte vector path in its body: a v4 of 32-bit or a
    // v2 of 64-bit lanes (f16/bf16 lanes travel as 32-bit half2 pairs).
    for name in expected
        .iter()
        .filter(|n| !n.starts_with("ferroccl_scale_"))
    {
        let body = kernel_body(&ptx, name);
        let vec16 = [
            ".v4.u32", ".v4.b32", ".v4.f32", ".v2.u64", ".v2.b64", ".v2.f64",
        ];
        assert!(
            vec16
                .iter()
                .any(|v| body.contains(&format!("ld.global{v}"))),
            "{name} has no 16-byte vector load"
        );
        assert!(
            vec16
                .iter()
                .any(|v| body.contains(&format!("st.global{v}"))),
            "{name} has no 16-byte vector store"
        );
    }
    eprintln!("compiled {} kernels for sm_90", entries.len());
}

/// The PTX text of one `.entry`, up to the next one.
fn kernel_body<'a>(ptx: &'a str, name: &str) -> &'a str {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("{name} not in PTX"));
    let rest = &ptx[start + 1..];
    let end = rest.find(".entry ").map_or(rest.len(), |e| e);
    &rest[..end]
}

#[test]
fn avg_on_integers_has_no_kernel() {
    assert!(nvrtc::reduce_name(DataType::I32, ReduceOp::Avg).is_none());
    assert!(nvrtc::scale_name(DataType::U8).is_none());
    assert_eq!(
        nvrtc::reduce_name(DataType::BF16, ReduceOp::Max).as_deref(),
        Some("ferroccl_reduce_bf16_max")
    );
}
