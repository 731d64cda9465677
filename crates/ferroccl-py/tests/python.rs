//! Runs the Python tests (`tests/test_*.py`, pytest) against the extension module this
//! build made: the package's Python files and the `_native` library are staged into a
//! temporary folder, which goes first on `PYTHONPATH`.
//!
//! The interpreters are those `FERROCCL_PYTHON` lists (separated by `:`; each runs the
//! whole suite), else the first of `/usr/bin/python3` and `python3` that has pytest and
//! NumPy. Without one the test says SKIPPED and passes, unless `FERROCCL_REQUIRE_TORCH=1`
//! (CI), which also requires `import torch` to work in each: then the torch.distributed
//! backend's tests run too (they skip without torch). The mesh-based tests
//! (`test_torch2.py`) skip on torch 1.x; `FERROCCL_REQUIRE_TORCH2=1` (CI, which lists
//! Debian's Python with its torch 1.13 and a virtual environment with a PyPI torch 2.x)
//! requires one of the interpreters to have a torch 2.x.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(900);

fn works(python: &str, code: &str) -> bool {
    Command::new(python)
        .args(["-c", code])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The extension module cargo built for this test run.
fn native_library() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let deps = exe.parent().expect("the deps folder");
    for dir in [deps, deps.parent().unwrap_or(deps)] {
        let p = dir.join("lib_native.so");
        if p.exists() {
            return p;
        }
    }
    panic!("lib_native.so was not built next to {}", exe.display());
}

fn stage(root: &Path) {
    let pkg = root.join("ferroccl");
    let _ = std::fs::remove_dir_all(&pkg);
    std::fs::create_dir_all(&pkg).expect("staging folder");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/ferroccl");
    for e in std::fs::read_dir(&src).expect("python/ferroccl") {
        let p = e.expect("an entry").path();
        if p.extension().is_some_and(|x| x == "py") {
            std::fs::copy(&p, pkg.join(p.file_name().expect("a name"))).expect("copy");
        }
    }
    std::fs::copy(native_library(), pkg.join("_native.abi3.so")).expect("copy the extension");
}

/// Runs the suite under `python`; panics on a failure or after the deadline.
fn run_suite(python: &str, root: &Path) {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    eprintln!("== the Python tests under {python}");
    let mut child = Command::new(python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"])
        .arg(&tests)
        .env("PYTHONPATH", root)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .spawn()
        .expect("start pytest");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for pytest") {
            break s;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("the Python tests under {python} did not finish in {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        status.success(),
        "the Python tests under {python} failed ({status}): see above"
    );
}

#[test]
fn python_tests() {
    let required = std::env::var("FERROCCL_REQUIRE_TORCH").is_ok_and(|v| v == "1");
    let pythons: Vec<String> = match std::env::var("FERROCCL_PYTHON") {
        Ok(list) => list
            .split(':')
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect(),
        Err(_) => ["/usr/bin/python3", "python3"]
            .into_iter()
            .find(|p| works(p, "import pytest, numpy"))
            .map(String::from)
            .into_iter()
            .collect(),
    };
    if pythons.is_empty() {
        assert!(
            !required,
            "FERROCCL_REQUIRE_TORCH=1 but no python3 with pytest and numpy (set FERROCCL_PYTHON)"
        );
        eprintln!("SKIPPED: no python3 with pytest and numpy");
        return;
    }
    for python in &pythons {
        assert!(
            works(python, "import pytest, numpy"),
            "{python} cannot import pytest and numpy"
        );
        if required {
            assert!(
                works(python, "import torch.distributed"),
                "FERROCCL_REQUIRE_TORCH=1 but {python} cannot import torch.distributed"
            );
        }
    }
    if std::env::var("FERROCCL_REQUIRE_TORCH2").is_ok_and(|v| v == "1") {
        assert!(
            pythons
                .iter()
                .any(|p| works(p, "import torch.distributed.device_mesh")),
            "FERROCCL_REQUIRE_TORCH2=1 but none of {pythons:?} has a torch 2.x"
        );
    }
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pyroot");
    stage(&root);
    for python in &pythons {
        run_suite(python, &root);
    }
}
