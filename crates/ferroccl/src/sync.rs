//! The crate's one way to take a lock: poison-tolerant.
//!
//! A panic on another thread (a rank's thread in a test, a user callback) must not
//! cascade: every structure behind these locks stays consistent between statements
//! (queues, byte pipes, maps), so a poisoned lock is taken as is.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Locks `m`, ignoring poisoning.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Waits on `cv` with `g` held, ignoring poisoning.
pub(crate) fn wait<'a, T>(cv: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(g).unwrap_or_else(|e| e.into_inner())
}

/// Waits on `cv` while `cond` holds, at most `timeout`, ignoring poisoning.
pub(crate) fn wait_timeout_while<'a, T>(
    cv: &Condvar,
    g: MutexGuard<'a, T>,
    timeout: Duration,
    cond: impl FnMut(&mut T) -> bool,
) -> MutexGuard<'a, T> {
    match cv.wait_timeout_while(g, timeout, cond) {
        Ok((g, _)) => g,
        Err(e) => e.into_inner().0,
    }
}
