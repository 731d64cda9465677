//! SIGINT and SIGTERM sent to the launcher, recorded for the wait loop.

use super::*;

/// The last SIGINT/SIGTERM the launcher received and has not yet forwarded (0: none).
pub(super) static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn record_signal(sig: libc::c_int) {
    PENDING_SIGNAL.store(sig, Ordering::SeqCst);
}

/// Routes SIGINT and SIGTERM to [`PENDING_SIGNAL`] while a job runs; restores the
/// previous handlers on drop.
pub(super) struct SignalGuard {
    pub(super) previous: Vec<(libc::c_int, libc::sigaction)>,
}

impl SignalGuard {
    pub(super) fn install() -> io::Result<Self> {
        PENDING_SIGNAL.store(0, Ordering::SeqCst);
        let mut guard = SignalGuard {
            previous: Vec::new(),
        };
        for sig in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: sigaction is plain data; the handler only stores to an atomic, which
            // is async-signal-safe.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = record_signal as extern "C" fn(libc::c_int) as usize;
                action.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut action.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &action, &mut old) != 0 {
                    return Err(io::Error::last_os_error());
                }
                guard.previous.push((sig, old));
            }
        }
        Ok(guard)
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        for (sig, old) in &self.previous {
            // SAFETY: restores an action the OS gave us.
            unsafe {
                libc::sigaction(*sig, old, std::ptr::null_mut());
            }
        }
    }
}
