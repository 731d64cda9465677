//! A client of PyTorch's c10d `TCPStore`, as far as rendezvous needs: torchrun's agent
//! serves one on `MASTER_ADDR:MASTER_PORT` and tells its workers so with
//! `TORCHELASTIC_USE_AGENT_STORE=True`. ferroccl does not move its rendezvous into it:
//! rank 0 serves ferroccl's own store on a free port and publishes its address in the
//! agent's store (SET), and the other ranks wait for that key (WAIT) and read it (GET).
//!
//! # The protocol
//!
//! One byte of command, then its arguments; strings and byte arrays are a `u64`
//! length then the bytes; integers are little-endian (the server's native order on
//! every platform PyTorch ships). Two generations are in use:
//!
//! | command | PyTorch 1.13 (Debian 12's python3-torch) | PyTorch 2.x |
//! |---|---|---|
//! | VALIDATE `u32` 0x3C85F7CE | — | 0, first on every connection |
//! | SET key value (no reply) | 0 | 1 |
//! | GET key → value | 2 | 3 |
//! | WAIT `u64` n, n keys → `u8` 0 (STOP_WAITING) | 5 | 6 |
//! | CANCEL_WAIT → `u8` 1 (WAIT_CANCELED) | — | 12 |
//! | PING `u32` nonce → the nonce | — | 13 |
//!
//! Which one a server speaks is found with one write and no timing: VALIDATE followed
//! by a PING whose nonce is `0xFFFF_FFFF`. A 2.x server answers the nonce. A 1.13
//! server reads the same bytes as a SET whose key length is about 2^64, fails to
//! allocate it, and closes the connection (it goes on serving everyone else: checked
//! against Debian's 1.13); the client then connects again and speaks 1.13. Torch 2.x
//! releases before PING existed close the connection too and are then refused with a
//! message naming the versions that work.

use crate::error::{Error, Result};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// VALIDATE's magic number (PyTorch 2.x).
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// The PING nonce of the probe: with VALIDATE before it, a 1.13 server reads an
/// impossible key length.
const PROBE_NONCE: u32 = 0xFFFF_FFFF;
/// How long one request may wait for its reply (WAIT has its own deadline).
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest value read back; ferroccl publishes an address.
const MAX_VALUE: u64 = 64 * 1024;

/// Which generation of the protocol a server speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TorchProtocol {
    /// PyTorch 1.13: no validation; SET 0, GET 2, WAIT 5.
    V1,
    /// PyTorch 2.x with PING: VALIDATE first; SET 1, GET 3, WAIT 6, CANCEL_WAIT 12.
    V2,
}

impl TorchProtocol {
    fn set(self) -> u8 {
        match self {
            Self::V1 => 0,
            Self::V2 => 1,
        }
    }
    fn get(self) -> u8 {
        match self {
            Self::V1 => 2,
            Self::V2 => 3,
        }
    }
    fn wait(self) -> u8 {
        match self {
            Self::V1 => 5,
            Self::V2 => 6,
        }
    }
}

/// A connection to a PyTorch `TCPStore`.
#[derive(Debug)]
pub struct TorchStore {
    stream: TcpStream,
    addr: String,
    protocol: TorchProtocol,
}

impl TorchStore {
    /// Connects to the store at `addr` (`host:port`), retrying refused connections
    /// until `deadline`, and finds which protocol it speaks.
    pub fn connect(addr: &str, deadline: Duration) -> Result<Self> {
        let start = Instant::now();
        let mut s = Self::open(addr, deadline)?;
        let mut probe = vec![0u8];
        probe.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        probe.push(13);
        probe.extend_from_slice(&PROBE_NONCE.to_le_bytes());
        s.send(&probe, "probing the protocol")?;
        let mut echo = [0u8; 4];
        match s.stream.read_exact(&mut echo) {
            Ok(()) if u32::from_le_bytes(echo) == PROBE_NONCE => {
                s.protocol = TorchProtocol::V2;
                Ok(s)
            }
            Ok(()) => Err(Error::Rendezvous(format!(
                "torchrun's agent store at {addr} answered the protocol probe with {echo:02x?}: \
                 not a PyTorch TCPStore this build knows (PyTorch 1.13, and 2.x with PING)"
            ))),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::UnexpectedEof
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::BrokenPipe
                ) =>
            {
                // A 1.13 server, which has closed that connection.
                let mut s = Self::open(addr, deadline.saturating_sub(start.elapsed()))?;
                s.protocol = TorchProtocol::V1;
                Ok(s)
            }
            Err(e) => Err(s.io_error("probing the protocol", e)),
        }
    }

    fn open(addr: &str, deadline: Duration) -> Result<Self> {
        let stream = super::client::connect_retrying(addr, deadline).map_err(|e| match e {
            Error::StoreUnreachable {
                addr,
                after,
                detail,
            } => Error::StoreUnreachable {
                addr: format!("{addr} (torchrun's agent store)"),
                after,
                detail,
            },
            e => e,
        })?;
        let _ = stream.set_nodelay(true);
        stream
            .set_read_timeout(Some(REPLY_TIMEOUT))
            .and_then(|()| stream.set_write_timeout(Some(REPLY_TIMEOUT)))
            .map_err(|e| Error::io(format!("torchrun's agent store at {addr}"), e))?;
        Ok(Self {
            stream,
            addr: addr.to_owned(),
            protocol: TorchProtocol::V1,
        })
    }

    /// The protocol generation the server speaks.
    pub fn protocol(&self) -> TorchProtocol {
        self.protocol
    }

    /// The local address of this connection: an address of this host that the
    /// store's host can reach.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.stream
            .local_addr()
            .map_err(|e| self.io_error("reading the local address", e))
    }

    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let mut m = vec![self.protocol.set()];
        put_bytes(&mut m, key.as_bytes());
        put_bytes(&mut m, value);
        self.send(&m, "SET")
    }

    /// Waits until `key` is set, at most `timeout`, and returns its value.
    pub fn wait_get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut m = vec![self.protocol.wait()];
        m.extend_from_slice(&1u64.to_le_bytes());
        put_bytes(&mut m, key.as_bytes());
        self.send(&m, "WAIT")?;
        let waited = self
            .stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .and_then(|()| {
                let mut b = [0u8; 1];
                self.stream.read_exact(&mut b).map(|()| b[0])
            });
        let _ = self.stream.set_read_timeout(Some(REPLY_TIMEOUT));
        match waited {
            Ok(0) => {}
            Ok(other) => {
                return Err(Error::Rendezvous(format!(
                    "torchrun's agent store at {} answered WAIT with {other} instead of 0",
                    self.addr
                )))
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                if self.protocol == TorchProtocol::V2 {
                    // Leave the store's wait list tidy; the connection is dropped anyway.
                    let _ = self.send(&[12], "CANCEL_WAIT");
                }
                return Err(Error::Rendezvous(format!(
                    "key '{key}' was not set in torchrun's agent store at {} within {timeout:?}",
                    self.addr
                )));
            }
            Err(e) => return Err(self.io_error("WAIT", e)),
        }
        let mut m = vec![self.protocol.get()];
        put_bytes(&mut m, key.as_bytes());
        self.send(&m, "GET")?;
        let mut len = [0u8; 8];
        self.stream
            .read_exact(&mut len)
            .map_err(|e| self.io_error("GET", e))?;
        let len = u64::from_le_bytes(len);
        if len > MAX_VALUE {
            return Err(Error::Rendezvous(format!(
                "key '{key}' in torchrun's agent store at {} holds {len} bytes; ferroccl \
                 publishes at most {MAX_VALUE}",
                self.addr
            )));
        }
        let mut v = vec![0u8; len as usize];
        self.stream
            .read_exact(&mut v)
            .map_err(|e| self.io_error("GET", e))?;
        Ok(v)
    }

    fn send(&mut self, bytes: &[u8], what: &str) -> Result<()> {
        self.stream
            .write_all(bytes)
            .map_err(|e| self.io_error(what, e))
    }

    fn io_error(&self, what: &str, e: io::Error) -> Error {
        Error::io(
            format!(
                "{what} with torchrun's agent store (a PyTorch TCPStore) at {}",
                self.addr
            ),
            e,
        )
    }
}

fn put_bytes(m: &mut Vec<u8>, b: &[u8]) {
    m.extend_from_slice(&(b.len() as u64).to_le_bytes());
    m.extend_from_slice(b);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A fake server for one connection, answering like a 2.x store (or closing like a
    /// 1.13 one when `v1`); returns the bytes it received.
    fn fake(v1: bool) -> (String, std::thread::JoinHandle<Vec<Vec<u8>>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let h = std::thread::spawn(move || {
            let mut seen = Vec::new();
            let (mut c, _) = l.accept().unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut probe = [0u8; 10];
            c.read_exact(&mut probe).unwrap();
            seen.push(probe.to_vec());
            if v1 {
                drop(c);
                let (c2, _) = l.accept().unwrap();
                c = c2;
                c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            } else {
                c.write_all(&probe[6..]).unwrap();
            }
            // SET "ferroccl/k" "host:1" (33 bytes), WAIT for it (27): answer 0, GET it
            // (19): answer a value.
            let read = |c: &mut TcpStream, n: usize| {
                let mut b = vec![0u8; n];
                c.read_exact(&mut b).unwrap();
                b
            };
            let mut rest = read(&mut c, 33);
            rest.extend(read(&mut c, 27));
            c.write_all(&[0]).unwrap();
            rest.extend(read(&mut c, 19));
            let mut v = 3u64.to_le_bytes().to_vec();
            v.extend_from_slice(b"a:1");
            c.write_all(&v).unwrap();
            seen.push(rest);
            seen
        });
        (addr, h)
    }

    #[test]
    fn probe_tells_the_two_generations_apart_and_commands_use_their_codes() {
        for v1 in [false, true] {
            let (addr, h) = fake(v1);
            let mut s = TorchStore::connect(&addr, Duration::from_secs(5)).unwrap();
            let want = if v1 {
                TorchProtocol::V1
            } else {
                TorchProtocol::V2
            };
            assert_eq!(s.protocol(), want);
            s.set("ferroccl/k", b"host:1").unwrap();
            assert_eq!(
                s.wait_get("ferroccl/k", Duration::from_secs(5)).unwrap(),
                b"a:1"
            );
            drop(s);
            let seen = h.join().unwrap();
            // The probe: VALIDATE + magic, PING + the all-ones nonce.
            assert_eq!(
                seen[0],
                [0, 0xCE, 0xF7, 0x85, 0x3C, 13, 0xFF, 0xFF, 0xFF, 0xFF]
            );
            let mut set = vec![want.set()];
            put_bytes(&mut set, b"ferroccl/k");
            put_bytes(&mut set, b"host:1");
            let mut wait = vec![want.wait()];
            wait.extend_from_slice(&1u64.to_le_bytes());
            put_bytes(&mut wait, b"ferroccl/k");
            let mut get = vec![want.get()];
            put_bytes(&mut get, b"ferroccl/k");
            assert_eq!(seen[1], [set, wait, get].concat(), "{v1}");
        }
    }

    #[test]
    fn a_wait_that_times_out_names_the_key_and_the_store() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let h = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut probe = [0u8; 10];
            c.read_exact(&mut probe).unwrap();
            c.write_all(&probe[6..]).unwrap();
            // Never answers the WAIT; reads until the client leaves.
            let mut sink = Vec::new();
            let _ = c.read_to_end(&mut sink);
            sink
        });
        let mut s = TorchStore::connect(&addr, Duration::from_secs(5)).unwrap();
        let e = s
            .wait_get("ferroccl/x", Duration::from_millis(50))
            .unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("ferroccl/x") && msg.contains(&addr), "{msg}");
        drop(s);
        // The client cancelled its wait before leaving.
        assert_eq!(h.join().unwrap().last(), Some(&12));
    }
}
