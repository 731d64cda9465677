//! Dumps on `SIGUSR1` and at process exit.
//!
//! The signal handler only writes one byte to a pipe (async-signal-safe); a watcher
//! thread reads it and dumps every live recorder. The handler is installed when the
//! first communicator is made, and only if `SIGUSR1` still has its default
//! disposition (a program that handles `SIGUSR1` itself keeps its handler), and not
//! at all with `FERROCCL_TRACE_SIGNAL=0`.

use super::recorder::{env_dir, Registry};
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Once;

static INSTALL: Once = Once::new();
/// The pipe's write end, for the handler.
static PIPE_WR: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_sigusr1(_: libc::c_int) {
    let fd = PIPE_WR.load(Ordering::Relaxed);
    if fd >= 0 {
        let b = 1u8;
        // SAFETY: write(2) is async-signal-safe; the byte outlives the call.
        unsafe { libc::write(fd, (&b as *const u8).cast(), 1) };
    }
}

extern "C" fn at_exit() {
    if let Some(dir) = env_dir() {
        Registry::dump_all(&dir, "exit");
    }
}

/// Where a signal dump goes: `FERROCCL_TRACE_DIR`, else `./ferroccl-trace`.
fn signal_dir() -> PathBuf {
    env_dir().unwrap_or_else(|| PathBuf::from("ferroccl-trace"))
}

pub(super) fn install() {
    INSTALL.call_once(|| {
        // SAFETY: registering a plain extern "C" function with atexit.
        unsafe { libc::atexit(at_exit) };
        if std::env::var("FERROCCL_TRACE_SIGNAL").is_ok_and(|v| v == "0") {
            return;
        }
        // Leave a handler the program installed alone.
        // SAFETY: querying the current disposition into a zeroed sigaction.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: a null new action only reads the current one into `old`.
        if unsafe { libc::sigaction(libc::SIGUSR1, std::ptr::null(), &mut old) } != 0
            || old.sa_sigaction != libc::SIG_DFL
        {
            return;
        }
        let mut fds = [0i32; 2];
        // SAFETY: fds has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return;
        }
        PIPE_WR.store(fds[1], Ordering::Relaxed);
        let rd = fds[0];
        let spawned = std::thread::Builder::new()
            .name("ferroccl-trace-signal".into())
            .spawn(move || loop {
                let mut b = [0u8; 64];
                // SAFETY: reading into a local buffer of its length.
                let n = unsafe { libc::read(rd, b.as_mut_ptr().cast(), b.len()) };
                if n > 0 {
                    let dir = signal_dir();
                    let k = Registry::dump_all(&dir, "signal");
                    tracing::info!(
                        "SIGUSR1: dumped {k} flight recorder(s) to {}",
                        dir.display()
                    );
                } else if n < 0
                    && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
                {
                    continue;
                } else {
                    return;
                }
            });
        if spawned.is_err() {
            return;
        }
        // SAFETY: installing a handler that only calls write(2).
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction = on_sigusr1 as extern "C" fn(libc::c_int) as usize;
        act.sa_flags = libc::SA_RESTART;
        // SAFETY: act is a valid, fully initialised sigaction.
        unsafe {
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(libc::SIGUSR1, &act, std::ptr::null_mut());
        }
    });
}
