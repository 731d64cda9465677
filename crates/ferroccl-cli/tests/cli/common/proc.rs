//! Running the `ferroccl` binary from tests: outside any launcher's environment, with
//! stdin closed, output collected, and a deadline after which it is killed and the
//! test fails showing what it printed.

use std::io::Read;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The binary under test.
pub const EXE: &str = env!("CARGO_BIN_EXE_ferroccl");

/// Variables through which launchers hand out ranks; a test's commands must not
/// inherit them from whatever runs the tests.
pub const LAUNCHER_VARS: [&str; 16] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_STEP_ID",
    "SLURM_JOB_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
    "FERROCCL_JOB_ID",
];

/// What a finished command left.
pub struct Output {
    /// Its exit status.
    pub status: ExitStatus,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

fn reader(mut r: impl Read + Send + 'static) -> (Arc<Mutex<Vec<u8>>>, std::thread::JoinHandle<()>) {
    let buf = Arc::new(Mutex::new(Vec::new()));
    let b = buf.clone();
    let h = std::thread::spawn(move || {
        let mut chunk = [0u8; 8192];
        while let Ok(n) = r.read(&mut chunk) {
            if n == 0 {
                break;
            }
            b.lock().unwrap().extend_from_slice(&chunk[..n]);
        }
    });
    (buf, h)
}

fn lossy(b: &Mutex<Vec<u8>>) -> String {
    String::from_utf8_lossy(&b.lock().unwrap()).into_owned()
}

/// Runs `cmd` to completion, killing it and failing the test if it outlives
/// `deadline`. Output is read as it comes, so a chatty command never blocks on a
/// full pipe.
pub fn run_cmd(mut cmd: Command, deadline: Duration) -> Output {
    // The test's own environment must not leak in; what the test set stays.
    let set: Vec<std::ffi::OsString> = cmd.get_envs().map(|(k, _)| k.to_owned()).collect();
    for v in LAUNCHER_VARS {
        if !set.iter().any(|k| k == v) {
            cmd.env_remove(v);
        }
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let (out, ho) = reader(child.stdout.take().expect("piped"));
    let (err, he) = reader(child.stderr.take().expect("piped"));
    let end = Instant::now() + deadline;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            let _ = (ho.join(), he.join());
            return Output {
                status,
                stdout: lossy(&out),
                stderr: lossy(&err),
            };
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            // Not joining the readers: a grandchild may still hold the pipes.
            std::thread::sleep(Duration::from_millis(100));
            panic!(
                "command did not finish within {deadline:?}\nstdout:\n{}\nstderr:\n{}",
                lossy(&out),
                lossy(&err)
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs `ferroccl ARGS` with [`run_cmd`].
pub fn ferroccl(args: &[&str], deadline: Duration) -> Output {
    let mut c = Command::new(EXE);
    c.args(args);
    run_cmd(c, deadline)
}
