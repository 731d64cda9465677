//! In-process transport: bounded byte pipes between threads of one process.
//!
//! It behaves like a socket pair with a fixed buffer (writes stop when the pipe is
//! full), so the algorithms exercise the same partial-write and would-block paths as
//! over TCP, deterministically and without ports.

use super::{Link, LinkError, Links, Waiter};
use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Bytes a pipe holds before writes would block (like a socket buffer).
pub const PIPE_CAPACITY: usize = 4 << 20;

#[derive(Default)]
struct Pipe {
    data: VecDeque<u8>,
    closed: bool,
}

/// A rank's doorbell: bumped whenever a peer writes to or reads from one of its pipes.
#[derive(Default)]
struct Bell {
    generation: Mutex<u64>,
    cv: Condvar,
}

impl Bell {
    fn ring(&self) {
        let mut g = lock(&self.generation);
        *g = g.wrapping_add(1);
        self.cv.notify_all();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic in another rank's thread must not cascade into this one: the data is
    // plain bytes and stays consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct LocalLink {
    peer: usize,
    tx: Arc<Mutex<Pipe>>,
    rx: Arc<Mutex<Pipe>>,
    peer_bell: Arc<Bell>,
    capacity: usize,
    sent: u64,
    received: u64,
}

impl Link for LocalLink {
    fn peer(&self) -> usize {
        self.peer
    }

    fn try_write(&mut self, bufs: &[IoSlice<'_>]) -> Result<usize, LinkError> {
        let mut pipe = lock(&self.tx);
        if pipe.closed {
            return Err(LinkError::Closed);
        }
        let mut room = self.capacity.saturating_sub(pipe.data.len());
        let mut n = 0;
        for b in bufs {
            if room == 0 {
                break;
            }
            let take = b.len().min(room);
            pipe.data.extend(&b[..take]);
            room -= take;
            n += take;
        }
        drop(pipe);
        if n > 0 {
            self.sent += n as u64;
            self.peer_bell.ring();
        }
        Ok(n)
    }

    fn try_read(&mut self, bufs: &mut [IoSliceMut<'_>]) -> Result<usize, LinkError> {
        let mut pipe = lock(&self.rx);
        if pipe.data.is_empty() {
            return if pipe.closed {
                Err(LinkError::Closed)
            } else {
                Ok(0)
            };
        }
        let mut n = 0;
        for b in bufs.iter_mut() {
            let take = b.len().min(pipe.data.len());
            if take == 0 {
                continue;
            }
            let (front, back) = pipe.data.as_slices();
            let f = take.min(front.len());
            b[..f].copy_from_slice(&front[..f]);
            b[f..take].copy_from_slice(&back[..take - f]);
            pipe.data.drain(..take);
            n += take;
            if pipe.data.is_empty() {
                break;
            }
        }
        drop(pipe);
        if n > 0 {
            self.received += n as u64;
            self.peer_bell.ring();
        }
        Ok(n)
    }

    fn shutdown(&mut self) {
        lock(&self.tx).closed = true;
        lock(&self.rx).closed = true;
        self.peer_bell.ring();
    }

    fn raw_counts(&self) -> (u64, u64) {
        (self.sent, self.received)
    }
}

impl Drop for LocalLink {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct LocalWaiter {
    bell: Arc<Bell>,
    seen: u64,
}

impl Waiter for LocalWaiter {
    fn wait(&mut self, timeout: Duration) -> std::io::Result<()> {
        let g = lock(&self.bell.generation);
        let seen = self.seen;
        let (g, _) = self
            .bell
            .cv
            .wait_timeout_while(g, timeout, |g| *g == seen)
            .unwrap_or_else(|e| e.into_inner());
        self.seen = *g;
        Ok(())
    }
}

/// Builds links for `n` ranks in one process: `peers(r)` lists the ranks that rank `r`
/// is linked to (the relation must be symmetric). Returns one [`Links`] per rank.
pub fn group(n: usize, capacity: usize, peers: impl Fn(usize) -> Vec<usize>) -> Vec<Links> {
    let bells: Vec<Arc<Bell>> = (0..n).map(|_| Arc::new(Bell::default())).collect();
    // pipes[a][b] carries bytes from a to b.
    let pipes: Vec<Vec<Arc<Mutex<Pipe>>>> = (0..n)
        .map(|_| {
            (0..n)
                .map(|_| Arc::new(Mutex::new(Pipe::default())))
                .collect()
        })
        .collect();
    (0..n)
        .map(|r| {
            let mut links: Vec<Option<Box<dyn Link>>> = (0..n).map(|_| None).collect();
            for p in peers(r) {
                if p == r || p >= n || links[p].is_some() {
                    continue;
                }
                links[p] = Some(Box::new(LocalLink {
                    peer: p,
                    tx: pipes[r][p].clone(),
                    rx: pipes[p][r].clone(),
                    peer_bell: bells[p].clone(),
                    capacity,
                    sent: 0,
                    received: 0,
                }));
            }
            let seen = *lock(&bells[r].generation);
            Links {
                links,
                waiter: Box::new(LocalWaiter {
                    bell: bells[r].clone(),
                    seen,
                }),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_flow_and_full_pipe_blocks() {
        let mut g = group(2, 8, |r| vec![1 - r]);
        let mut b = g.pop().unwrap();
        let mut a = g.pop().unwrap();
        let la = a.links[1].as_mut().unwrap();
        let n = la
            .try_write(&[IoSlice::new(b"hello "), IoSlice::new(b"world")])
            .unwrap();
        assert_eq!(n, 8, "pipe of 8 bytes takes 8");
        assert_eq!(la.try_write(&[IoSlice::new(b"x")]).unwrap(), 0);
        let lb = b.links[0].as_mut().unwrap();
        let mut buf = [0u8; 5];
        let mut buf2 = [0u8; 5];
        let got = lb
            .try_read(&mut [IoSliceMut::new(&mut buf), IoSliceMut::new(&mut buf2)])
            .unwrap();
        assert_eq!(got, 8);
        assert_eq!(&buf, b"hello");
        assert_eq!(&buf2[..3], b" wo");
        assert_eq!(lb.raw_counts(), (0, 8));
        // The writer's bell rang when the reader drained, so its wait returns at once.
        a.waiter.wait(Duration::from_secs(5)).unwrap();
        la_shutdown_is_seen(a, b);
    }

    fn la_shutdown_is_seen(mut a: Links, mut b: Links) {
        a.links[1].as_mut().unwrap().shutdown();
        let lb = b.links[0].as_mut().unwrap();
        let mut buf = [0u8; 4];
        assert!(matches!(
            lb.try_read(&mut [IoSliceMut::new(&mut buf)]),
            Err(LinkError::Closed)
        ));
    }
}
