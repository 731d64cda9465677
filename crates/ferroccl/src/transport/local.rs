//! In-process transport: bounded byte pipes between threads of one process.
//!
//! It behaves like a socket pair with a fixed buffer (writes stop when the pipe is
//! full), so the algorithms exercise the same partial-write and would-block paths as
//! over TCP, deterministically and without ports.

use super::{Beacon, Channel, Connector, GroupSpec, Link, LinkError, Links, Waiter, Waker};
use crate::sync::{lock, wait_timeout_while};
use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, IoSliceMut};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

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

    fn class(&self) -> &'static str {
        "local"
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
        let g = wait_timeout_while(&self.bell.cv, g, timeout, |g| *g == seen);
        self.seen = *g;
        Ok(())
    }

    fn waker(&self) -> Option<Waker> {
        let bell = self.bell.clone();
        Some(Waker::new(move || bell.ring()))
    }
}

/// Which stream a pipe is: (group, from rank, to rank, channel), ranks of the fabric.
type PipeKey = (u64, usize, usize, Channel);
type PipeMap = HashMap<PipeKey, Arc<Mutex<Pipe>>>;

/// The pipes of one in-process job, made on first use. `pipes[(g, a, b, ch)]` carries
/// bytes from rank `a` to rank `b` on channel `ch` of group `g` (0: the job's own
/// links). A rank's bell rings for its pipes of every group: its waiters (one per
/// communicator) may wake for another's bytes, which a waiter is allowed to.
struct Fabric {
    bells: Vec<Arc<Bell>>,
    beacons: Mutex<HashMap<(u64, usize), Arc<Beacon>>>,
    capacity: usize,
    pipes: Mutex<PipeMap>,
    /// `(group, rank)`s closed ([`Connector::close`]): their pipes, made before or
    /// after, read as closed.
    closed: Mutex<std::collections::HashSet<(u64, usize)>>,
}

impl Fabric {
    fn pipe(&self, key: PipeKey) -> Arc<Mutex<Pipe>> {
        let closed = {
            let c = lock(&self.closed);
            c.contains(&(key.0, key.1)) || c.contains(&(key.0, key.2))
        };
        lock(&self.pipes)
            .entry(key)
            .or_insert_with(|| {
                Arc::new(Mutex::new(Pipe {
                    closed,
                    ..Pipe::default()
                }))
            })
            .clone()
    }

    /// Closes rank `rank`'s pipes of `group`, now and to come, and wakes everyone.
    fn close(&self, group: u64, rank: usize) {
        lock(&self.closed).insert((group, rank));
        for (k, p) in lock(&self.pipes).iter() {
            if k.0 == group && (k.1 == rank || k.2 == rank) {
                lock(p).closed = true;
            }
        }
        for b in &self.bells {
            b.ring();
        }
    }

    fn beacon(&self, group: u64, rank: usize) -> Arc<Beacon> {
        lock(&self.beacons)
            .entry((group, rank))
            .or_default()
            .clone()
    }
}

struct LocalConnector {
    /// This rank, in this connector's order.
    rank: usize,
    /// The fabric rank of each of this connector's ranks.
    members: Arc<[usize]>,
    group: u64,
    fabric: Arc<Fabric>,
}

impl LocalConnector {
    fn links(fabric: &Arc<Fabric>, group: u64, members: Arc<[usize]>, rank: usize) -> Links {
        let me = members[rank];
        let seen = *lock(&fabric.bells[me].generation);
        Links::new(
            Box::new(LocalConnector {
                rank,
                members,
                group,
                fabric: fabric.clone(),
            }),
            Box::new(LocalWaiter {
                bell: fabric.bells[me].clone(),
                seen,
            }),
            fabric.beacon(group, me),
        )
    }
}

impl Connector for LocalConnector {
    fn connect(
        &mut self,
        peer: usize,
        channel: Channel,
        _deadline: Instant,
    ) -> crate::error::Result<Box<dyn Link>> {
        super::check_peer(self.rank, peer, self.members.len())?;
        let (me, p) = (self.members[self.rank], self.members[peer]);
        Ok(Box::new(LocalLink {
            peer,
            tx: self.fabric.pipe((self.group, me, p, channel)),
            rx: self.fabric.pipe((self.group, p, me, channel)),
            peer_bell: self.fabric.bells[p].clone(),
            capacity: self.fabric.capacity,
            sent: 0,
            received: 0,
        }))
    }

    fn peer_status(
        &mut self,
        peer: usize,
        _deadline: Instant,
    ) -> crate::error::Result<Option<(u64, u8)>> {
        super::check_peer(self.rank, peer, self.members.len())?;
        Ok(self.fabric.beacon(self.group, self.members[peer]).get())
    }

    fn close(&mut self) {
        self.fabric.close(self.group, self.members[self.rank]);
    }

    fn group(&mut self, spec: &GroupSpec) -> crate::error::Result<Links> {
        let rank = spec.check(self.rank, self.members.len(), self.group)?;
        let members: Arc<[usize]> = spec.members.iter().map(|&m| self.members[m]).collect();
        Ok(LocalConnector::links(&self.fabric, spec.id, members, rank))
    }
}

/// Builds the connectors and waiters of `n` ranks in one process, rank order. A link
/// is a pair of bounded pipes of `capacity` bytes, made when a rank first connects.
pub fn group(n: usize, capacity: usize) -> Vec<Links> {
    let fabric = Arc::new(Fabric {
        bells: (0..n).map(|_| Arc::new(Bell::default())).collect(),
        beacons: Mutex::new(HashMap::new()),
        capacity,
        pipes: Mutex::new(HashMap::new()),
        closed: Mutex::new(Default::default()),
    });
    let members: Arc<[usize]> = (0..n).collect();
    (0..n)
        .map(|r| LocalConnector::links(&fabric, 0, members.clone(), r))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_flow_and_full_pipe_blocks() {
        let mut g = group(2, 8);
        let mut b = g.pop().unwrap();
        let mut a = g.pop().unwrap();
        let far = Instant::now() + Duration::from_secs(1);
        let mut la = a.connector.connect(1, Channel::Collective, far).unwrap();
        let mut lb = b.connector.connect(0, Channel::Collective, far).unwrap();
        // The other channel is a different stream.
        let mut lp = b.connector.connect(0, Channel::P2p, far).unwrap();
        let n = la
            .try_write(&[IoSlice::new(b"hello "), IoSlice::new(b"world")])
            .unwrap();
        assert_eq!(n, 8, "pipe of 8 bytes takes 8");
        assert_eq!(la.try_write(&[IoSlice::new(b"x")]).unwrap(), 0);
        let mut buf = [0u8; 5];
        assert_eq!(lp.try_read(&mut [IoSliceMut::new(&mut buf)]).unwrap(), 0);
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
        la.shutdown();
        let mut buf = [0u8; 4];
        assert!(matches!(
            lb.try_read(&mut [IoSliceMut::new(&mut buf)]),
            Err(LinkError::Closed)
        ));
    }
}
