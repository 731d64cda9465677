//! Run-time compilation of `cuda/reduce.cu` with NVRTC, through cudarc's `nvrtc::result`
//! layer (so every call is checked and nothing here can panic on a compiler error).
//!
//! This part needs no GPU and no driver: only `libnvrtc.so.13` (found by the dynamic
//! loader, so through `LD_LIBRARY_PATH`) and the `cuda_fp16.h` / `cuda_bf16.h` headers
//! (found through [`include_dirs`]). CI uses it to compile every kernel for `sm_90`.

use crate::error::{Error, Result};
use crate::reduce::{DataType, ReduceOp};
use cudarc::nvrtc::{result, sys};
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The kernel source, embedded in the binary (a GPU host needs no source tree).
pub const SOURCE: &str = include_str!("../../../../cuda/reduce.cu");

/// Element types with device kernels: every [`DataType`].
pub const DTYPES: [DataType; 7] = DataType::ALL;

/// The suffix of a kernel name for `dt` (`f32`, `f16`, `bf16`, ...).
pub fn dtype_suffix(dt: DataType) -> &'static str {
    match dt {
        DataType::F32 => "f32",
        DataType::F64 => "f64",
        DataType::F16 => "f16",
        DataType::BF16 => "bf16",
        DataType::I32 => "i32",
        DataType::I64 => "i64",
        DataType::U8 => "u8",
    }
}

/// `ferroccl_reduce_<dt>_<op>`: `dst = a op b`. `None` where the op is undefined
/// for the type (Avg on integers).
pub fn reduce_name(dt: DataType, op: ReduceOp) -> Option<String> {
    crate::reduce::check_op(dt, op).ok()?;
    Some(format!(
        "ferroccl_reduce_{}_{}",
        dtype_suffix(dt),
        op.name()
    ))
}

/// `ferroccl_reduce_copy_<dt>_<op>`: the fused receive-reduce-copy (two outputs).
pub fn reduce_copy_name(dt: DataType, op: ReduceOp) -> Option<String> {
    crate::reduce::check_op(dt, op).ok()?;
    Some(format!(
        "ferroccl_reduce_copy_{}_{}",
        dtype_suffix(dt),
        op.name()
    ))
}

/// `ferroccl_scale_<dt>`: Avg's final division (float types only).
pub fn scale_name(dt: DataType) -> Option<String> {
    dt.is_float()
        .then(|| format!("ferroccl_scale_{}", dtype_suffix(dt)))
}

/// Every `extern "C"` entry point `cuda/reduce.cu` must define.
pub fn entry_names() -> Vec<String> {
    let mut v = Vec::new();
    for dt in DTYPES {
        for op in ReduceOp::ALL {
            v.extend(reduce_name(dt, op));
            v.extend(reduce_copy_name(dt, op));
        }
        v.extend(scale_name(dt));
    }
    v
}

/// Whether `libnvrtc` can be loaded (checked once; cudarc would panic on first use
/// without it).
pub fn nvrtc_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| super::library_loads(&["libnvrtc.so", "libnvrtc.so.13"]))
}

/// The typed error for a missing NVRTC.
pub fn nvrtc_missing() -> Error {
    Error::Unavailable {
        what: "NVRTC (CUDA run-time compiler)".into(),
        why: "libnvrtc.so.13 not found: install the CUDA 13.0 toolkit or the nvidia-cuda-nvrtc==13.0.* wheel and put its lib directory on LD_LIBRARY_PATH".into(),
    }
}

/// NVRTC's version, `(major, minor)`.
pub fn version() -> Result<(i32, i32)> {
    if !nvrtc_present() {
        return Err(nvrtc_missing());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers; the library is present.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::Cuda {
            call: "nvrtcVersion".into(),
            detail: format!("{e:?}"),
        })?;
    Ok((major, minor))
}

/// Where `cuda_fp16.h` may be: `$FERROCCL_CUDA_INCLUDE` (a `:`-separated list), then
/// `$CUDA_HOME/include`, `$CUDA_PATH/include`, `/usr/local/cuda/include`. Only
/// directories that hold `cuda_fp16.h` are returned. NVRTC 13.0 does not carry these
/// headers built in: with an empty list the compile fails, and its error says so.
///
/// This is the one place the CUDA module reads the environment.
pub fn include_dirs() -> Vec<PathBuf> {
    let mut cands: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("FERROCCL_CUDA_INCLUDE") {
        cands.extend(std::env::split_paths(&v));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            cands.push(PathBuf::from(v).join("include"));
        }
    }
    cands.push(PathBuf::from("/usr/local/cuda/include"));
    let mut out: Vec<PathBuf> = Vec::new();
    for c in cands {
        if c.join("cuda_fp16.h").is_file() && !out.contains(&c) {
            out.push(c);
        }
    }
    out
}

/// Compiles [`SOURCE`] to PTX for `sm_<cc>` (for example `90`), with the default
/// (IEEE) division and no flush-to-zero. Returns the PTX text.
pub fn compile(cc: u32) -> Result<String> {
    if !nvrtc_present() {
        return Err(nvrtc_missing());
    }
    let cuda_err = |call: &'static str, e: result::NvrtcError| Error::Cuda {
        call: call.into(),
        detail: format!("{e:?}"),
    };
    let src = CString::new(SOURCE).map_err(|_| Error::Cuda {
        call: "nvrtcCreateProgram".into(),
        detail: "kernel source contains a NUL byte".into(),
    })?;
    let name = c"ferroccl_reduce.cu";
    let prog =
        result::create_program(&src, Some(name)).map_err(|e| cuda_err("nvrtcCreateProgram", e))?;
    let guard = Program(prog);
    let mut opts = vec![
        format!("--gpu-architecture=sm_{cc}"),
        "--std=c++17".to_string(),
        "--prec-div=true".to_string(),
        "--ftz=false".to_string(),
        "--fmad=false".to_string(),
    ];
    for d in include_dirs() {
        opts.push(format!("--include-path={}", d.display()));
    }
    // SAFETY: `prog` is a live program; the options are plain strings.
    if let Err(e) = unsafe { result::compile_program(guard.0, &opts) } {
        // SAFETY: the program exists; the log is a NUL-terminated buffer.
        let log = unsafe { result::get_program_log(guard.0) }
            .ok()
            .map(|raw| {
                let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
                CStr::from_bytes_until_nul(&bytes)
                    .map(|c| c.to_string_lossy().into_owned())
                    .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
            })
            .unwrap_or_default();
        let hint = if opts.iter().any(|o| o.starts_with("--include-path")) {
            ""
        } else {
            " (no directory with cuda_fp16.h found: set FERROCCL_CUDA_INCLUDE or CUDA_HOME)"
        };
        return Err(Error::Cuda {
            call: "nvrtcCompileProgram".into(),
            detail: format!("{e:?}{hint} with options {opts:?}:\n{log}"),
        });
    }
    // SAFETY: compiled successfully above.
    let raw = unsafe { result::get_ptx(guard.0) }.map_err(|e| cuda_err("nvrtcGetPTX", e))?;
    let bytes: Vec<u8> = raw
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8(bytes).map_err(|_| Error::Cuda {
        call: "nvrtcGetPTX".into(),
        detail: "PTX is not UTF-8".into(),
    })
}

/// Owns an `nvrtcProgram`; destroys it on drop, logging (never panicking) on failure.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once.
        if let Err(e) = unsafe { result::destroy_program(self.0) } {
            tracing::warn!("nvrtcDestroyProgram failed: {e:?}");
        }
    }
}

/// The `.entry` names in a PTX text.
pub fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| {
            let rest = l.trim_start().strip_prefix(".visible .entry ")?;
            Some(rest.split('(').next()?.trim().to_string())
        })
        .collect()
}
