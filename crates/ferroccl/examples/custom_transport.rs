//! A transport of your own: ranks linked by Unix-domain sockets, plugged into
//! `Communicator::init_with`. It is the whole `Link` contract in one file — non-blocking
//! streams, a waiter that sleeps until one may move, a connector that makes links on
//! demand and answers status queries, addresses traded through the job's store — and
//! the collectives run on it unchanged.
//!
//! ```sh
//! cargo run -p ferroccl --example custom_transport
//! ```

use ferroccl::transport::{
    Beacon, Channel, Connector, Joined, Link, LinkError, Links, Transport, Waiter,
};
use ferroccl::{Communicator, Config, Error, ReduceOp, Result};
use mio::{Events, Interest, Poll, Token};
use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The transport: `connect` is called once per rank, after the rendezvous.
struct UnixSockets;

impl Transport for UnixSockets {
    fn name(&self) -> &str {
        "unix"
    }

    fn connect(&self, mut job: Joined) -> Result<Links> {
        let (rank, n, comm_id) = (job.rank(), job.world_size(), job.comm_id);
        // One listening socket per rank, named by the job's id so jobs never meet.
        let path = std::env::temp_dir().join(format!("ferroccl-{comm_id:016x}-{rank}.sock"));
        let _ = std::fs::remove_file(&path);
        let listener =
            UnixListener::bind(&path).map_err(|e| Error::io(format!("binding {path:?}"), e))?;
        job.store
            .set(&format!("unix/{rank}"), path.to_string_lossy().as_bytes())?;
        let beacon = Arc::new(Beacon::default());
        let accepted = Arc::new(Accepted::default());
        {
            let (acc, b) = (accepted.clone(), beacon.clone());
            std::thread::spawn(move || accept_loop(listener, &acc, &b));
        }
        let poll = Poll::new().map_err(|e| Error::io("creating the poller", e))?;
        let registry = poll
            .registry()
            .try_clone()
            .map_err(|e| Error::io("cloning the registry", e))?;
        Ok(Links::new(
            Box::new(UnixConnector {
                rank,
                n,
                job,
                path,
                registry,
                accepted,
                next_token: 0,
            }),
            Box::new(UnixWaiter {
                poll,
                events: Events::with_capacity(64),
            }),
            beacon,
        ))
    }
}

/// The first 8 bytes a dialer sends: its rank and the channel it wants.
fn hello(rank: usize, ch: Channel) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&(rank as u32).to_le_bytes());
    b[4..].copy_from_slice(&ch.code().to_le_bytes());
    b
}

/// Connections from lower ranks, accepted by a thread of their own so that a peer
/// dialling this rank never waits on this rank's collective thread.
#[derive(Default)]
struct Accepted {
    ready: Mutex<HashMap<(usize, Channel), UnixStream>>,
    cv: Condvar,
}

fn accept_loop(listener: UnixListener, acc: &Accepted, beacon: &Beacon) {
    for stream in listener.incoming() {
        let Ok(mut s) = stream else { continue };
        let mut b = [0u8; 8];
        if s.set_read_timeout(Some(Duration::from_secs(5))).is_err()
            || s.read_exact(&mut b).is_err()
        {
            continue; // a stranger that says nothing is dropped
        }
        let peer = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
        match Channel::from_code(u32::from_le_bytes([b[4], b[5], b[6], b[7]])) {
            // A status query is answered here, whatever this rank's thread is doing.
            Some(Channel::Status) => {
                let _ = s.write_all(&beacon.raw().to_le_bytes());
            }
            Some(ch) => {
                acc.ready.lock().unwrap().insert((peer, ch), s);
                acc.cv.notify_all();
            }
            None => {}
        }
    }
}

struct UnixConnector {
    rank: usize,
    n: usize,
    job: Joined,
    path: PathBuf,
    registry: mio::Registry,
    accepted: Arc<Accepted>,
    next_token: usize,
}

impl Drop for UnixConnector {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl UnixConnector {
    /// Dials `peer`'s socket (its path from the store) and says who we are.
    fn dial(&mut self, peer: usize, ch: Channel, deadline: Instant) -> Result<UnixStream> {
        let left = deadline.saturating_duration_since(Instant::now());
        let path = self.job.store.get(&format!("unix/{peer}"), left)?;
        let path = String::from_utf8_lossy(&path).into_owned();
        loop {
            match UnixStream::connect(&path) {
                Ok(mut s) => {
                    s.write_all(&hello(self.rank, ch))
                        .map_err(|e| Error::io(format!("greeting rank {peer}"), e))?;
                    return Ok(s);
                }
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(Error::io(format!("connecting to rank {peer} at {path}"), e)),
            }
        }
    }
}

impl Connector for UnixConnector {
    fn connect(&mut self, peer: usize, ch: Channel, deadline: Instant) -> Result<Box<dyn Link>> {
        if peer >= self.n || peer == self.rank {
            return Err(Error::InvalidArgument(format!("no peer rank {peer}")));
        }
        // The lower rank of a pair dials; the higher one takes the accepted stream.
        let std_stream = if self.rank < peer {
            self.dial(peer, ch, deadline)?
        } else {
            let mut ready = self.accepted.ready.lock().unwrap();
            loop {
                if let Some(s) = ready.remove(&(peer, ch)) {
                    break s;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::Handshake {
                        peer: format!("rank {peer}"),
                        detail: "did not connect before the deadline".into(),
                    });
                }
                ready = self.accepted.cv.wait_timeout(ready, left).unwrap().0;
            }
        };
        std_stream
            .set_nonblocking(true)
            .map_err(|e| Error::io("non-blocking socket", e))?;
        let mut stream = mio::net::UnixStream::from_std(std_stream);
        // Registered for both directions: the waiter wakes when either may move.
        self.next_token += 1;
        self.registry
            .register(
                &mut stream,
                Token(self.next_token),
                Interest::READABLE | Interest::WRITABLE,
            )
            .map_err(|e| Error::io("registering a link", e))?;
        Ok(Box::new(UnixLink {
            peer,
            stream,
            sent: 0,
            received: 0,
        }))
    }

    fn peer_status(&mut self, peer: usize, deadline: Instant) -> Result<Option<(u64, u8)>> {
        let mut s = self.dial(peer, Channel::Status, deadline)?;
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        s.set_read_timeout(Some(left))
            .map_err(|e| Error::io("status query", e))?;
        let mut b = [0u8; 8];
        s.read_exact(&mut b)
            .map_err(|e| Error::io(format!("status of rank {peer}"), e))?;
        Ok(Beacon::decode(u64::from_le_bytes(b)))
    }
}

/// One link: a non-blocking stream that never blocks and counts its bytes.
struct UnixLink {
    peer: usize,
    stream: mio::net::UnixStream,
    sent: u64,
    received: u64,
}

/// Would-block is "nothing moved"; a reset or broken pipe is the peer gone.
fn classify(e: io::Error) -> std::result::Result<usize, LinkError> {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::UnexpectedEof => Err(LinkError::Closed),
        _ => Err(LinkError::Io(e)),
    }
}

impl Link for UnixLink {
    fn peer(&self) -> usize {
        self.peer
    }

    fn try_write(&mut self, bufs: &[IoSlice<'_>]) -> std::result::Result<usize, LinkError> {
        match self.stream.write_vectored(bufs) {
            Ok(0) if bufs.iter().any(|b| !b.is_empty()) => Err(LinkError::Closed),
            Ok(n) => {
                self.sent += n as u64;
                Ok(n)
            }
            Err(e) => classify(e),
        }
    }

    fn try_read(&mut self, bufs: &mut [IoSliceMut<'_>]) -> std::result::Result<usize, LinkError> {
        match self.stream.read_vectored(bufs) {
            // End of stream with room to read: the peer closed.
            Ok(0) if bufs.iter().any(|b| !b.is_empty()) => Err(LinkError::Closed),
            Ok(n) => {
                self.received += n as u64;
                Ok(n)
            }
            Err(e) => classify(e),
        }
    }

    fn shutdown(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    fn raw_counts(&self) -> (u64, u64) {
        (self.sent, self.received)
    }
}

/// Sleeps in `poll(2)` until some registered link may move (or the timeout passes).
struct UnixWaiter {
    poll: Poll,
    events: Events,
}

impl Waiter for UnixWaiter {
    fn wait(&mut self, timeout: Duration) -> io::Result<()> {
        match self.poll.poll(&mut self.events, Some(timeout)) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            r => r,
        }
    }
}

/// What each rank does on the new transport.
fn rank_main(comm: &Communicator) -> Result<String> {
    let (r, n) = (comm.rank(), comm.world_size());
    // Large enough to be cut into pipelined segments.
    let mut grads = vec![r as f32 + 1.0; 3 << 20];
    comm.all_reduce(&mut grads, ReduceOp::Sum)?;
    assert!(grads.iter().all(|&x| x == (n * (n + 1) / 2) as f32));
    let mut w = vec![r as u8; 1000];
    comm.broadcast(&mut w, n - 1)?;
    assert!(w.iter().all(|&x| x == (n - 1) as u8));
    // Point-to-point around the ring, on its own channel.
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    let mut got = [0i64; 4];
    if r % 2 == 0 {
        comm.send(&[r as i64; 4], right, 7)?;
        comm.recv(&mut got, left, 7)?;
    } else {
        comm.recv(&mut got, left, 7)?;
        comm.send(&[r as i64; 4], right, 7)?;
    }
    assert_eq!(got, [left as i64; 4]);
    // The links' own byte counts agree with the engine's.
    let stats = comm.wire_stats();
    let (written, read) = comm.raw_byte_counts();
    assert_eq!(written, stats.payload_sent + stats.header_sent);
    assert_eq!(read, stats.payload_recv + stats.header_recv);
    Ok(format!(
        "rank {r} of {n} over unix sockets: all_reduce {}, broadcast ok, got {:?} from rank {left}, {written} bytes written",
        grads[0], got[0]
    ))
}

fn main() -> Result<()> {
    let n = 3;
    // A free port for rank 0's store.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| Error::io("finding a free port", e))?
        .port();
    let out: Vec<Result<String>> = std::thread::scope(|t| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                t.spawn(move || {
                    let cfg = Config::builder(r, n, format!("127.0.0.1:{port}"))
                        .timeout(Duration::from_secs(30))
                        .build()?;
                    let comm = Communicator::init_with(cfg, &UnixSockets)?;
                    rank_main(&comm)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    });
    for r in out {
        println!("{}", r?);
    }
    Ok(())
}
