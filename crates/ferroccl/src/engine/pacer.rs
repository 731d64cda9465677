//! Waiting with a deadline: what every executor does when nothing can move.

use super::{Health, MAX_WAIT_SLICE};
use crate::config::{Clock, Tuning};
use crate::error::{Error, Result};
use crate::transport::{LinkError, Waiter};
use crate::wire::{read_notice, Fingerprint, FrameError, Peer};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a pull wait sleeps per round once it has polled for
/// [`Tuning::busy_poll`]: short, because a GPU finishing a phase wakes nobody.
const PULL_SLEEP: Duration = Duration::from_micros(50);

/// Idle rounds after progress that only spin (a CPU hint, no system call) before the
/// busy-poll window yields the CPU: a peer on shared memory answers within a few
/// hundred nanoseconds, far less than one `sched_yield` costs (over shm at 2 ranks,
/// 1 KiB all-reduce: yield and clock reads were most of the time). Bounded to a few
/// microseconds. Ranks that share CPUs with more ranks of this host than there are
/// CPUs skip it ([`Pacer::new`]'s `spin`): their peer is often waiting for this very
/// CPU, and spinning only delays it (over shm at 4 ranks on 2 CPUs, 1 KiB all-reduce:
/// 41.6 µs with the spin, 13.3 µs without; at 2 ranks the spin halves it).
const SPIN_ROUNDS: u32 = 64;

/// Turns a frame-level failure into the crate error naming who and what.
/// A link that failed is read once more for a notice the peer left before closing it.
pub(crate) fn frame_error(
    rank: usize,
    e: FrameError,
    link: &mut Peer,
    peer: usize,
    fp: &Fingerprint,
) -> Error {
    with_notice(rank, e, link, peer, fp, Some(fp))
}

/// [`frame_error`] for a point-to-point message: what a failed peer left unread on the
/// link before its notice are its own messages to this rank, of any sequence number,
/// not a call to compare `fp` with, so they are skipped. (Taken for one, a send that
/// failed because its receiver died was reported as a mismatch between the send and
/// the first message the dead rank had sent this way.)
pub(crate) fn p2p_frame_error(
    rank: usize,
    e: FrameError,
    link: &mut Peer,
    peer: usize,
    fp: &Fingerprint,
) -> Error {
    with_notice(rank, e, link, peer, fp, None)
}

/// `e`, or for a failed link the notice on it ([`read_notice`], skipping frames of
/// `of_call`, of any call when `None`), as the crate error.
fn with_notice(
    rank: usize,
    e: FrameError,
    link: &mut Peer,
    peer: usize,
    fp: &Fingerprint,
    of_call: Option<&Fingerprint>,
) -> Error {
    let e = match e {
        FrameError::Link(_) => read_notice(link, of_call).unwrap_or(e),
        e => e,
    };
    typed(rank, e, peer, fp)
}

/// A frame-level failure (a notice already looked for) as the crate error.
fn typed(rank: usize, e: FrameError, peer: usize, fp: &Fingerprint) -> Error {
    match e {
        FrameError::Notice { origin, cause } => Error::PeerFailed {
            rank,
            peer,
            origin,
            cause: Box::new(Error::from_wire(&cause)),
            op: fp.to_string(),
        },
        FrameError::Link(LinkError::Closed) => Error::PeerClosed {
            rank,
            peer,
            op: fp.to_string(),
        },
        FrameError::Link(LinkError::Io(source)) => Error::io(
            format!("rank {rank}: link to rank {peer} failed during {fp}"),
            source,
        ),
        FrameError::Unexpected {
            got: Err(detail), ..
        } => Error::Protocol {
            rank,
            peer,
            op: fp.to_string(),
            detail,
        },
        FrameError::Unexpected {
            got: Ok(h),
            expected,
        } => {
            if h.fp != expected.fp {
                Error::Mismatch {
                    rank,
                    peer,
                    ours: expected.fp.to_string(),
                    theirs: h.fp.to_string(),
                }
            } else if (h.step, h.seg) == (expected.step, expected.seg) && h.len != expected.len {
                // The same call, split otherwise between the ranks (a v-collective's
                // counts that add up alike).
                Error::Mismatch {
                    rank,
                    peer,
                    ours: format!(
                        "{} expecting {} bytes in segment {} of step {} from rank {peer}",
                        expected.fp, expected.len, expected.seg, expected.step
                    ),
                    theirs: format!("{} sending {} bytes there", h.fp, h.len),
                }
            } else {
                Error::Protocol {
                    rank,
                    peer,
                    op: fp.to_string(),
                    detail: format!(
                        "expected step {} segment {} of {} bytes, got step {} segment {} of {} bytes",
                        expected.step, expected.seg, expected.len, h.step, h.seg, h.len
                    ),
                }
            }
        }
    }
}

/// What an executor does when nothing moved: poll a little longer (yielding the CPU),
/// then sleep — in the transport's [`Waiter`], or briefly for peers that publish
/// progress in memory — and give up with [`Error::Timeout`] once
/// [`Tuning::timeout`] has passed without progress on [`Tuning::clock`], or with
/// [`Error::Aborted`] as soon as the abort flag is seen.
pub(crate) struct Pacer {
    /// Last progress, on the deadline clock.
    last: Option<Instant>,
    /// Last progress, in real time (for the busy-poll window).
    last_real: Option<Instant>,
    /// Progress came since `last` and `last_real` were read: they are read again at
    /// the next idle round that asks them, not at every progress (two clock reads per
    /// frame were a tenth of a 1 KiB all-reduce). The clocks then say when the
    /// executor first found nothing to do after it, at most one round later.
    stale: bool,
    timeout: Duration,
    busy_poll: Duration,
    clock: Clock,
    health: Arc<Health>,
    /// Idle rounds spun since the last progress (up to `spin_rounds`).
    spins: u32,
    spin_rounds: u32,
    /// The last idle round slept (past the busy-poll window).
    slept: bool,
}

impl Pacer {
    /// A pacer for one operation; `spin`: whether an idle round spins before it
    /// yields (see [`SPIN_ROUNDS`]).
    pub fn new(cfg: &Tuning, health: Arc<Health>, spin: bool) -> Self {
        Pacer {
            last: None,
            last_real: None,
            stale: true,
            timeout: cfg.timeout,
            busy_poll: cfg.busy_poll,
            clock: cfg.clock.clone(),
            health,
            spins: 0,
            spin_rounds: if spin { SPIN_ROUNDS } else { 0 },
            slept: false,
        }
    }

    /// Whether the last idle round slept: the busy-poll window is over, and a round
    /// lasts as long as the wait it slept.
    pub fn slept(&self) -> bool {
        self.slept
    }

    /// Something moved: the no-progress clock restarts.
    pub fn moved(&mut self) {
        self.stale = true;
        self.spins = 0;
    }

    /// Whether the idle rounds since the last progress are still the pure spin (no
    /// clock read, no system call): a caller that times its waits may leave the clock
    /// alone until this turns false or progress comes.
    pub fn spinning(&self) -> bool {
        self.busy_poll > Duration::ZERO && self.spins < self.spin_rounds
    }

    /// Fails if aborted or past the deadline; otherwise says whether this is still
    /// the busy-poll window and how long the deadline allows sleeping.
    fn check(
        &mut self,
        rank: usize,
        fp: &Fingerprint,
        waiting_for: impl FnOnce() -> String,
    ) -> Result<(bool, Duration)> {
        if self.health.abort.load(Ordering::Relaxed) {
            return Err(Error::Aborted {
                rank,
                op: fp.to_string(),
            });
        }
        if let Some(p) = self.health.poisoned() {
            // The communicator's other engine failed meanwhile.
            return Err(Error::Poisoned(p.why));
        }
        let now = self.clock.now();
        let real = Instant::now();
        if std::mem::take(&mut self.stale) {
            (self.last, self.last_real) = (Some(now), Some(real));
        }
        let idle = now.saturating_duration_since(self.last.unwrap_or(now));
        if idle >= self.timeout {
            return Err(Error::Timeout {
                rank,
                op: fp.to_string(),
                after: idle,
                waiting_for: waiting_for(),
                peers: String::new(),
            });
        }
        let polling =
            real.saturating_duration_since(self.last_real.unwrap_or(real)) < self.busy_poll;
        let left = if self.clock.is_manual() {
            MAX_WAIT_SLICE
        } else {
            (self.timeout - idle).min(MAX_WAIT_SLICE)
        };
        Ok((polling, left))
    }

    /// Nothing moved on links that wake `waiter`. `waiting_for` describes what is
    /// awaited, for the timeout error.
    pub fn idle(
        &mut self,
        waiter: &mut dyn Waiter,
        rank: usize,
        fp: &Fingerprint,
        waiting_for: impl FnOnce() -> String,
    ) -> Result<()> {
        if self.spinning() {
            self.spins += 1;
            std::hint::spin_loop();
            return Ok(());
        }
        let (polling, left) = self.check(rank, fp, waiting_for)?;
        self.slept = !polling;
        if polling {
            std::thread::yield_now();
            return Ok(());
        }
        waiter
            .wait(left)
            .map_err(|e| Error::io(format!("rank {rank}: waiting on links during {fp}"), e))
    }

    /// Nothing moved, and what is awaited is a value a peer publishes in memory
    /// (nothing wakes this thread): poll, then sleep in short rounds.
    pub fn idle_poll(
        &mut self,
        rank: usize,
        fp: &Fingerprint,
        waiting_for: impl FnOnce() -> String,
    ) -> Result<()> {
        // A peer on symmetric shared memory publishes within a few hundred
        // nanoseconds of this rank's own step: spin first, as over links.
        if self.spinning() {
            self.spins += 1;
            std::hint::spin_loop();
            return Ok(());
        }
        let (polling, left) = self.check(rank, fp, waiting_for)?;
        self.slept = !polling;
        if polling {
            std::thread::yield_now();
        } else {
            std::thread::sleep(PULL_SLEEP.min(left));
        }
        Ok(())
    }
}
