//! Fuzzing the receive path end to end: a rank whose peer "link" serves arbitrary
//! bytes (pure garbage, or a valid frame header followed by garbage) runs every
//! collective and a tagged recv. Whatever arrives, the call returns a typed error —
//! never a panic, a hang, or an allocation sized by the attacker.

use ferroccl::testing::internals::{Fingerprint, FrameHeader, OpKind, HEADER_LEN};
use ferroccl::transport::{Beacon, Channel, Connector, Link, LinkError, Links, Waiter};
use ferroccl::{Algorithm, Communicator, Config, DataType, Error, ReduceOp};
use proptest::prelude::*;
use std::io::{IoSlice, IoSliceMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A link that reads from a fixed byte string (then reports the peer closed) and
/// swallows whatever is written.
struct FuzzLink {
    peer: usize,
    data: Arc<Vec<u8>>,
    pos: usize,
}

impl Link for FuzzLink {
    fn peer(&self) -> usize {
        self.peer
    }
    fn try_write(&mut self, bufs: &[IoSlice<'_>]) -> Result<usize, LinkError> {
        Ok(bufs.iter().map(|b| b.len()).sum())
    }
    fn try_read(&mut self, bufs: &mut [IoSliceMut<'_>]) -> Result<usize, LinkError> {
        if self.pos >= self.data.len() {
            return Err(LinkError::Closed);
        }
        let mut n = 0;
        for b in bufs.iter_mut() {
            let take = b.len().min(self.data.len() - self.pos);
            b[..take].copy_from_slice(&self.data[self.pos..self.pos + take]);
            self.pos += take;
            n += take;
        }
        Ok(n)
    }
    fn shutdown(&mut self) {}
    fn raw_counts(&self) -> (u64, u64) {
        (0, self.pos as u64)
    }
}

struct FuzzConnector(Arc<Vec<u8>>);

impl Connector for FuzzConnector {
    fn connect(
        &mut self,
        peer: usize,
        _ch: Channel,
        _d: Instant,
    ) -> ferroccl::Result<Box<dyn Link>> {
        Ok(Box::new(FuzzLink {
            peer,
            data: self.0.clone(),
            pos: 0,
        }))
    }
    fn peer_status(&mut self, _peer: usize, _d: Instant) -> ferroccl::Result<Option<(u64, u8)>> {
        Ok(None)
    }
}

struct NoWait;

impl Waiter for NoWait {
    fn wait(&mut self, _t: Duration) -> std::io::Result<()> {
        Ok(())
    }
}

/// Rank 0 of `n` whose every peer speaks `data`.
fn victim(n: usize, data: Vec<u8>) -> Communicator {
    let mut cfg = Config::new(0, n, "");
    cfg.tuning.timeout = Duration::from_secs(2);
    cfg.tuning.busy_poll = Duration::ZERO;
    let links = Links::new(
        Box::new(FuzzConnector(Arc::new(data))),
        Box::new(NoWait),
        Arc::new(Beacon::default()),
    );
    Communicator::with_links(cfg, links).expect("links")
}

/// Runs one operation of kind `which` on a fresh victim and returns its error. Every
/// operation is one in which rank 0 must receive (an operation in which it only sends
/// may rightly complete: it needs nothing from its peers).
fn attack(n: usize, which: u8, data: Vec<u8>) -> Error {
    let c = victim(n, data);
    let t0 = Instant::now();
    let r = match which % 7 {
        0 => c.all_reduce(&mut vec![1.0f32; 100], ReduceOp::Sum),
        1 => c.all_reduce(&mut vec![1i64; 100_000], ReduceOp::Max),
        2 => c.reduce_scatter(&vec![1u8; 64 * n], &mut [0u8; 64], ReduceOp::Sum),
        3 => c.all_gather(&[7i32; 10], &mut vec![0i32; 10 * n]),
        4 => c.broadcast(&mut vec![0.5f64; 300], 1),
        5 => c.reduce(&mut vec![half::bf16::ONE; 500], ReduceOp::Prod, 0),
        _ => c.recv(&mut vec![0u8; 4096], 1, 3),
    };
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    r.expect_err("garbage cannot complete an operation")
}

fn typed(e: &Error) -> bool {
    matches!(
        e,
        Error::Protocol { .. }
            | Error::PeerClosed { .. }
            | Error::Mismatch { .. }
            | Error::Timeout { .. }
    )
}

/// A well-formed header for a frame the victim does not expect (any kind, seq, count,
/// and a length up to 4 GiB), so decoding succeeds and the mismatch/length paths run.
fn forged_header() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<u8>(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
    )
        .prop_map(|(k, seq, count, step, seg, len)| {
            let kinds = [
                OpKind::AllReduce,
                OpKind::Broadcast,
                OpKind::SendRecv,
                OpKind::Reduce,
            ];
            FrameHeader {
                fp: Fingerprint {
                    kind: kinds[k as usize % kinds.len()],
                    seq: seq % 3,
                    dtype: DataType::ALL[(k as usize / 4) % DataType::ALL.len()],
                    op: ReduceOp::ALL.get(k as usize % 6).copied(),
                    count: count % 200_000,
                    root: (k % 2 == 0).then_some(1),
                    algo: [
                        Algorithm::Ring,
                        Algorithm::RecursiveDoubling,
                        Algorithm::Chain,
                        Algorithm::Direct,
                    ][(k as usize / 16) % 4],
                    comm: 0,
                },
                step: step % 4,
                seg: seg % 3,
                len,
            }
            .encode()
            .to_vec()
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn garbage_on_the_wire_is_a_typed_error(n in 2usize..6, which in any::<u8>(),
                                            data in proptest::collection::vec(any::<u8>(), 0..600)) {
        let e = attack(n, which, data);
        prop_assert!(typed(&e), "{e}");
    }

    #[test]
    fn forged_headers_are_a_typed_error(n in 2usize..6, which in any::<u8>(), hdr in forged_header(),
                                       tail in proptest::collection::vec(any::<u8>(), 0..300)) {
        let mut data = hdr;
        data.extend(tail);
        let e = attack(n, which, data);
        prop_assert!(typed(&e), "{e}");
    }
}

#[test]
fn the_handshake_decoder_takes_any_bytes() {
    use ferroccl::testing::internals::Hello;
    let mut x = 0x243F_6A88_85A3_08D3u64;
    for _ in 0..20_000 {
        let mut b = [0u8; 40];
        for v in b.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *v = x as u8;
        }
        if let Ok(h) = Hello::decode(&b) {
            assert_eq!(Hello::decode(&h.encode()), Ok(h));
        }
    }
    assert_eq!(HEADER_LEN, 48);
}
