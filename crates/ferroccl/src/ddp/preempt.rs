//! Preemption: a SIGTERM from a scheduler (Slurm, Kubernetes) becomes "stop after this
//! step, checkpoint, exit so that the job is restarted".
//!
//! A signal reaches one rank, or all of them at slightly different moments, and a rank
//! that stops on its own leaves the others waiting in the next collective. So the
//! decision is collective: after every step each rank calls
//! [`Preemption::agreed`], a one-byte all-reduce (max) of "was I asked to stop?", and
//! every rank gets the same answer at the same step. The trainer then writes its
//! checkpoint (rank 0) and every rank exits with [`PREEMPTED_EXIT_CODE`], which
//! `ferroccl launch --max-restarts` treats as "start the job again".
//!
//! ```no_run
//! # fn main() -> ferroccl::Result<()> {
//! use ferroccl::ddp::{Preemption, PREEMPTED_EXIT_CODE};
//! let comm = ferroccl::Communicator::from_env()?;
//! let preempt = Preemption::install()?;
//! for step in 0.. {
//!     // ... forward, backward, all-reduce, optimizer step ...
//!     if preempt.agreed(&comm)? {
//!         // rank 0: write the checkpoint of `step`
//!         std::process::exit(PREEMPTED_EXIT_CODE);
//!     }
//! #   let _ = step;
//! }
//! # Ok(()) }
//! ```

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};

/// The exit status of a rank that stopped because the job was preempted, after its
/// checkpoint was written: 75, `EX_TEMPFAIL` ("try again later").
pub const PREEMPTED_EXIT_CODE: i32 = 75;

/// Set by the SIGTERM handler.
static SIGNALLED: AtomicBool = AtomicBool::new(false);
static INSTALL: Once = Once::new();

extern "C" fn on_sigterm(_: libc::c_int) {
    // An atomic store is async-signal-safe.
    SIGNALLED.store(true, Ordering::SeqCst);
}

/// Whether this process was asked to stop, and the collective that agrees on it.
#[derive(Clone, Debug, Default)]
pub struct Preemption {
    /// A request of this handle's own ([`Preemption::request`]), beside the signal.
    local: Arc<AtomicBool>,
}

impl Preemption {
    /// Handles SIGTERM from now on by remembering it (the process is no longer killed
    /// by it: it stops when [`Preemption::agreed`] says so). Idempotent; SIGINT is left
    /// alone, so Ctrl-C still stops at once.
    pub fn install() -> Result<Self> {
        let mut failed = None;
        INSTALL.call_once(|| {
            // SAFETY: a zeroed sigaction is a valid value to fill in.
            let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
            act.sa_sigaction = on_sigterm as extern "C" fn(libc::c_int) as usize;
            act.sa_flags = libc::SA_RESTART;
            // SAFETY: act is fully initialised and its handler only stores an atomic.
            let rc = unsafe {
                libc::sigemptyset(&mut act.sa_mask);
                libc::sigaction(libc::SIGTERM, &act, std::ptr::null_mut())
            };
            if rc != 0 {
                failed = Some(std::io::Error::last_os_error());
            }
        });
        match failed {
            Some(e) => Err(Error::io("installing the SIGTERM handler", e)),
            None => Ok(Self::default()),
        }
    }

    /// A handle that only [`Preemption::request`] (and a SIGTERM, if one is installed)
    /// triggers: for tests, and for programs with their own signal handling.
    pub fn manual() -> Self {
        Self::default()
    }

    /// Asks this rank to stop, as a SIGTERM would.
    pub fn request(&self) {
        self.local.store(true, Ordering::SeqCst);
    }

    /// Whether this rank was asked to stop (no communication).
    pub fn requested(&self) -> bool {
        self.local.load(Ordering::SeqCst) || SIGNALLED.load(Ordering::SeqCst)
    }

    /// Collective: whether any rank was asked to stop. Every rank calls it at the same
    /// point (after each step) and all get the same answer.
    pub fn agreed(&self, comm: &Communicator) -> Result<bool> {
        let mut flag = [u8::from(self.requested())];
        comm.all_reduce(&mut flag, ReduceOp::Max)?;
        Ok(flag[0] != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rank_asked_to_stop_stops_every_rank_at_the_same_step() {
        let comms = Communicator::local_group(3, &Default::default()).unwrap();
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let p = Preemption::manual();
                    for step in 0..10u32 {
                        // Rank 2 is told at step 4; nobody else ever is.
                        if c.rank() == 2 && step == 4 {
                            p.request();
                        }
                        if p.agreed(&c).unwrap() {
                            return (c.rank(), step, p.requested());
                        }
                    }
                    (c.rank(), u32::MAX, p.requested())
                })
            })
            .collect();
        // A hang (a rank that never agrees) fails in seconds, not at the 60 s timeout.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let got: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            let _ = tx.send(got);
        });
        let mut got = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("every rank stops within 20 s");
        got.sort();
        assert_eq!(got, vec![(0, 4, false), (1, 4, false), (2, 4, true)]);
    }
}
