//! `ferroccl bench --device cuda` and `--transport cuda-ipc` on a machine without a GPU
//! (or a build without the `cuda` feature): the real binary exits non-zero at once and
//! prints the typed error. On a GPU host the test says SKIPPED (gpu-check covers it).
//! Every run is killed and the test failed if it has not exited within [`DEADLINE`].

use crate::common;

use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(30);

/// Runs `ferroccl ARGS` under the deadline: (exit code, stdout, stderr).
fn ferroccl(args: &[&str]) -> (Option<i32>, String, String) {
    let o = common::proc::ferroccl(args, DEADLINE);
    (o.status.code(), o.stdout, o.stderr)
}

#[cfg(feature = "cuda")]
fn has_gpu() -> bool {
    ferroccl::cuda::probe().is_ok()
}

#[cfg(not(feature = "cuda"))]
fn has_gpu() -> bool {
    false
}

/// The one line the binary must print for this build on this machine.
fn expected_error(args: &[&str]) -> &'static str {
    if cfg!(feature = "cuda") {
        "ferroccl bench: CUDA is not available: no CUDA"
    } else if args.contains(&"cuda-ipc") {
        "ferroccl bench: transport cuda-ipc is not available"
    } else {
        "ferroccl bench: --device cuda is not available: this build has no CUDA support"
    }
}

#[test]
fn bench_on_cuda_without_a_gpu_exits_non_zero_with_the_typed_error() {
    if has_gpu() {
        eprintln!("SKIPPED bench_on_cuda_without_a_gpu_exits_non_zero_with_the_typed_error: this machine has a GPU");
        return;
    }
    for args in [
        &[
            "bench", "--device", "cuda", "-b", "1K", "-e", "1K", "--ranks", "2",
        ][..],
        &[
            "bench",
            "reduce_scatter",
            "--device",
            "cuda",
            "--transport",
            "local",
        ][..],
        &[
            "bench",
            "--device",
            "cuda",
            "--transport",
            "cuda-ipc",
            "--ranks",
            "2",
        ][..],
        &["bench", "--transport", "cuda-ipc"][..],
    ] {
        let (code, out, err) = ferroccl(args);
        assert_eq!(
            code,
            Some(2),
            "`ferroccl {}`: stdout {out:?} stderr {err:?}",
            args.join(" ")
        );
        let want = expected_error(args);
        assert!(
            err.lines().any(|l| l.starts_with(want)),
            "`ferroccl {}` should say {want:?}; stderr: {err:?}",
            args.join(" ")
        );
        assert!(!err.contains("panicked"), "a panic: {err}");
        assert!(out.is_empty(), "no table without a GPU: {out:?}");
    }
}

#[test]
fn gpu_check_without_a_gpu_exits_non_zero_with_the_typed_error() {
    if has_gpu() {
        eprintln!("SKIPPED gpu_check_without_a_gpu_exits_non_zero_with_the_typed_error: this machine has a GPU");
        return;
    }
    let dir = std::env::temp_dir().join(format!("ferroccl-gpu-check-test-{}", std::process::id()));
    let json = dir.with_extension("json");
    let (code, out, err) = ferroccl(&["gpu-check", "--json", json.to_str().unwrap()]);
    assert_eq!(code, Some(2), "stdout {out:?} stderr {err:?}");
    let want = if cfg!(feature = "cuda") {
        "ferroccl gpu-check: CUDA is not available: no CUDA"
    } else {
        "ferroccl gpu-check: gpu-check is not available: this build has no CUDA support"
    };
    assert!(
        err.lines().any(|l| l.starts_with(want)),
        "want {want:?}; stderr {err:?}"
    );
    assert!(!json.exists(), "no JSON without a GPU");
}
