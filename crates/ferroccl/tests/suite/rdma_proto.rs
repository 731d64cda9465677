//! The RDMA protocol core on its own: two endpoints joined by a hand-driven network
//! that lands writes and delivers completions in random interleavings — send
//! completions in *any* order, more than RC allows — and checks, at every landing,
//! that no unread ring slot is overwritten, and at the end that every byte arrived in
//! order exactly once with credits never above the ring size.

use ferroccl::testing::internals::rdma_proto::{
    encode_imm, Completion, Endpoint, Params, ProtoError, WorkRequest,
};
use proptest::prelude::*;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// One direction of a link (A sends to B) plus B's credit writes back to A.
struct Net {
    p: Params,
    a: Endpoint,
    b: Endpoint,
    bounce_a: Vec<u8>,
    ring_b: Vec<u8>,
    credit_word_a: u64,
    recvs_b: u64,
    /// A's writes to B, executed in posting order (RC).
    a_to_b: VecDeque<WorkRequest>,
    /// B's writes to A (credits), in posting order.
    b_to_a: VecDeque<WorkRequest>,
    /// A's send completions, delivered in any order.
    sq_a: Vec<Completion>,
    /// B's send completions (its credit writes).
    sq_b: Vec<Completion>,
    /// B's receive completions, in order.
    rq_b: VecDeque<Completion>,
    /// The stream A offers and what B has read of it.
    stream: Vec<u8>,
    offered: usize,
    read: Vec<u8>,
    /// Sequence number of the next write landing at B.
    landed: u64,
}

impl Net {
    fn new(p: Params, stream: Vec<u8>) -> Self {
        Net {
            p,
            a: Endpoint::new(p),
            b: Endpoint::new(p),
            bounce_a: vec![0; p.ring_bytes()],
            ring_b: vec![0xEE; p.ring_bytes()],
            credit_word_a: 0,
            recvs_b: Endpoint::initial_recvs(&p).len() as u64,
            a_to_b: VecDeque::new(),
            b_to_a: VecDeque::new(),
            sq_a: Vec::new(),
            sq_b: Vec::new(),
            rq_b: VecDeque::new(),
            stream,
            offered: 0,
            read: Vec::new(),
            landed: 0,
        }
    }

    fn flush(&mut self) {
        while let Some(wr) = self.a.poll_transmit() {
            match wr {
                WorkRequest::PostRecv { .. } => panic!("A receives nothing in this test"),
                wr => self.a_to_b.push_back(wr),
            }
        }
        while let Some(wr) = self.b.poll_transmit() {
            match wr {
                WorkRequest::PostRecv { .. } => self.recvs_b += 1,
                WorkRequest::WriteCredit { .. } => self.b_to_a.push_back(wr),
                wr => panic!("B sends no data in this test: {wr:?}"),
            }
        }
    }

    /// A offers up to `n` more bytes of the stream.
    fn offer(&mut self, n: usize) -> usize {
        let end = (self.offered + n).min(self.stream.len());
        let before = self.offered;
        while self.offered < end {
            let Some(slot) = self.a.writable() else { break };
            // The bounce slot's previous write (sequence k - S) has completed: a write
            // still in flight may be re-read by the NIC (an RC retransmission after a
            // lost ACK re-executes the write at the peer).
            let seq = self.a.tx.next_seq();
            if let Some(prev) = seq.checked_sub(self.p.slots as u64) {
                let in_flight =
                    self.a_to_b.iter().any(
                        |wr| matches!(wr, WorkRequest::WriteData { wr_id, .. } if *wr_id == prev),
                    ) || self.sq_a.contains(&Completion::Sent { wr_id: prev });
                assert!(
                    !in_flight,
                    "bounce slot of #{prev} reused before its completion"
                );
            }
            let take = (end - self.offered).min(self.p.slot_bytes);
            let at = slot * self.p.slot_bytes;
            self.bounce_a[at..at + take]
                .copy_from_slice(&self.stream[self.offered..self.offered + take]);
            // Credits never exceed the ring.
            assert!(self.a.tx.credits() <= self.p.slots as u64);
            self.a.commit(take);
            self.offered += take;
        }
        self.flush();
        self.offered - before
    }

    /// B reads up to `n` bytes.
    fn read(&mut self, n: usize) -> usize {
        let mut got = 0;
        while got < n {
            let Some((slot, off, avail)) = self.b.readable() else {
                break;
            };
            let take = avail.min(n - got);
            let at = slot * self.p.slot_bytes + off;
            self.read.extend_from_slice(&self.ring_b[at..at + take]);
            // Scribble over what was read: a later unread-overwrite or double delivery
            // shows up as wrong bytes.
            self.ring_b[at..at + take].fill(0xEE);
            self.b.consume(take);
            got += take;
        }
        self.flush();
        got
    }

    /// Lands A's oldest write at B.
    fn land_a_to_b(&mut self) -> bool {
        let Some(wr) = self.a_to_b.pop_front() else {
            return false;
        };
        let (wr_id, imm) = match wr {
            WorkRequest::WriteData {
                wr_id,
                slot,
                len,
                imm,
            } => {
                // The slot's previous occupant (sequence landed - S) must be freed.
                let seq = self.landed;
                assert!(
                    seq < self.b.rx.freed() + self.p.slots as u64,
                    "slot #{seq} overwrites unread data (freed {})",
                    self.b.rx.freed()
                );
                assert_eq!(slot as u64, seq % self.p.slots as u64);
                self.landed += 1;
                let at = slot * self.p.slot_bytes;
                let (src, dst) = (&self.bounce_a[at..at + len], &mut self.ring_b[at..at + len]);
                dst.copy_from_slice(src);
                (wr_id, imm)
            }
            WorkRequest::WriteClose { wr_id, imm } => (wr_id, imm),
            wr => panic!("unexpected {wr:?}"),
        };
        assert!(self.recvs_b > 0, "receiver not ready (no receive posted)");
        self.recvs_b -= 1;
        self.rq_b.push_back(Completion::Received { imm });
        self.sq_a.push(Completion::Sent { wr_id });
        true
    }

    fn land_b_to_a(&mut self) -> bool {
        let Some(wr) = self.b_to_a.pop_front() else {
            return false;
        };
        let WorkRequest::WriteCredit { wr_id, freed } = wr else {
            panic!("unexpected {wr:?}")
        };
        assert!(freed >= self.credit_word_a, "credit word went backwards");
        self.credit_word_a = freed;
        self.sq_b.push(Completion::Sent { wr_id });
        true
    }

    /// Delivers A's send completion number `pick` (mod the pending count) and shows A
    /// its credit word.
    fn complete_a(&mut self, pick: usize) -> bool {
        let news = !self.sq_a.is_empty();
        if news {
            let c = self.sq_a.remove(pick % self.sq_a.len());
            self.a.on_completion(c).unwrap();
        }
        let before = self.a.tx.credits();
        self.a.on_credit(self.credit_word_a).unwrap();
        self.flush();
        news || self.a.tx.credits() != before
    }

    fn complete_b(&mut self, pick: usize, recv_first: bool) -> bool {
        let send = !self.sq_b.is_empty();
        let recv = !self.rq_b.is_empty();
        if recv && (recv_first || !send) {
            let c = self.rq_b.pop_front().unwrap();
            self.b.on_completion(c).unwrap();
        } else if send {
            let c = self.sq_b.remove(pick % self.sq_b.len());
            self.b.on_completion(c).unwrap();
        }
        self.flush();
        send || recv
    }
}

#[derive(Clone, Debug)]
enum Step {
    Offer(usize),
    Read(usize),
    LandAB,
    LandBA,
    CompleteA(usize),
    CompleteB(usize, bool),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (1usize..3000).prop_map(Step::Offer),
        (1usize..3000).prop_map(Step::Read),
        Just(Step::LandAB),
        Just(Step::LandBA),
        any::<usize>().prop_map(Step::CompleteA),
        (any::<usize>(), any::<bool>()).prop_map(|(a, b)| Step::CompleteB(a, b)),
    ]
}

fn params() -> impl Strategy<Value = Params> {
    (1usize..=8, 1usize..=600)
        .prop_flat_map(|(slots, slot_bytes)| (Just(slots), Just(slot_bytes), 1usize..=slots))
        .prop_map(|(slots, slot_bytes, credit_batch)| Params {
            slots,
            slot_bytes,
            credit_batch,
        })
}

fn run_case(p: Params, len: usize, seed: u64, steps: Vec<Step>) {
    let stream: Vec<u8> = (0..len)
        .map(|i| (seed.wrapping_mul(i as u64 + 1) >> 17) as u8)
        .collect();
    let mut net = Net::new(p, stream);
    for s in steps {
        match s {
            Step::Offer(n) => {
                net.offer(n);
            }
            Step::Read(n) => {
                net.read(n);
            }
            Step::LandAB => {
                net.land_a_to_b();
            }
            Step::LandBA => {
                net.land_b_to_a();
            }
            Step::CompleteA(k) => {
                net.complete_a(k);
            }
            Step::CompleteB(k, f) => {
                net.complete_b(k, f);
            }
        }
        assert!(net.read.len() <= net.offered);
        assert_eq!(
            &net.read[..],
            &net.stream[..net.read.len()],
            "bytes out of order"
        );
    }
    // Then drive everything fairly: it must finish (no deadlock) within a bound.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut k = seed as usize;
    while net.read.len() < len {
        assert!(Instant::now() < deadline, "no progress: deadlock");
        k = k.wrapping_mul(31).wrapping_add(7);
        let moved = (net.offer(1 << 20) > 0)
            | net.land_a_to_b()
            | net.complete_b(k, k & 1 == 0)
            | (net.read(1 << 20) > 0)
            | net.land_b_to_a()
            | net.complete_a(k);
        assert!(
            moved || net.read.len() == len,
            "nothing can move with {} of {len} bytes read: deadlock",
            net.read.len()
        );
    }
    assert_eq!(net.read, net.stream, "every byte once, in order");
    // Close after the data: B sees it after everything.
    net.a.close();
    net.flush();
    while net.land_a_to_b() | net.complete_b(0, true) | net.complete_a(0) | net.land_b_to_a() {}
    assert!(net.b.rx.peer_closed());
    assert!(net.b.readable().is_none());
    assert!(net.a.quiet(), "A has nothing left in flight");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Random interleavings of offers, reads, landings and completions.
    #[test]
    fn stream_arrives_in_order_exactly_once(p in params(), len in 0usize..20_000, seed in any::<u64>(),
                                            steps in prop::collection::vec(step(), 0..400)) {
        run_case(p, len, seed, steps);
    }
}

#[test]
fn peer_violations_are_errors_not_panics() {
    let p = Params {
        slots: 2,
        slot_bytes: 16,
        credit_batch: 1,
    };
    // Wrong tag: slot #1 arriving first.
    let mut e = Endpoint::new(p);
    let r = e.on_completion(Completion::Received {
        imm: encode_imm(1, 4),
    });
    assert!(matches!(r, Err(ProtoError::Violation(_))), "{r:?}");
    // Once failed, it stays failed and posts nothing.
    assert!(e.failed().is_some());
    assert!(e.poll_transmit().is_none());
    // Too long for a slot, and empty.
    let mut e = Endpoint::new(p);
    assert!(e
        .on_completion(Completion::Received {
            imm: encode_imm(0, 17)
        })
        .is_err());
    let mut e = Endpoint::new(p);
    assert!(e
        .on_completion(Completion::Received {
            imm: encode_imm(0, 0)
        })
        .is_err());
    // Overrun: a third slot while two are unread.
    let mut e = Endpoint::new(p);
    for s in 0..2 {
        e.on_completion(Completion::Received {
            imm: encode_imm(s, 16),
        })
        .unwrap();
    }
    assert!(matches!(
        e.on_completion(Completion::Received {
            imm: encode_imm(2, 16)
        }),
        Err(ProtoError::Violation(m)) if m.contains("overran")
    ));
    // Credits for slots never sent.
    let mut e = Endpoint::new(p);
    assert!(matches!(e.on_credit(1), Err(ProtoError::Violation(_))));
    // A send completion nobody posted.
    let mut e = Endpoint::new(p);
    assert!(e.on_completion(Completion::Sent { wr_id: 5 }).is_err());
    // A local failure poisons the end.
    let mut e = Endpoint::new(p);
    let r = e.on_completion(Completion::Failed {
        wr_id: 0,
        status: "local protection error".into(),
        peer_lost: false,
    });
    assert!(matches!(r, Err(ProtoError::Failed(_))), "{r:?}");
    // A lost peer ends writing, but what already arrived can still be read.
    let mut e = Endpoint::new(p);
    e.on_completion(Completion::Received {
        imm: encode_imm(0, 3),
    })
    .unwrap();
    e.on_completion(Completion::Failed {
        wr_id: 1 << 62,
        status: "retry exceeded".into(),
        peer_lost: true,
    })
    .unwrap();
    assert!(e.lost().is_some());
    assert_eq!(e.writable(), None);
    assert_eq!(e.readable(), Some((0, 0, 3)));
    assert!(
        e.poll_transmit().is_none(),
        "nothing is posted to a lost peer"
    );
}

#[test]
fn credits_bound_the_sender() {
    let p = Params {
        slots: 3,
        slot_bytes: 4,
        credit_batch: 3,
    };
    let mut e = Endpoint::new(p);
    for _ in 0..3 {
        assert!(e.writable().is_some());
        e.commit(4);
    }
    assert_eq!(e.writable(), None, "no credit after S slots");
    // Send completions alone free the bounce slots, not the peer's ring.
    for seq in 0..3u64 {
        let wr = e.poll_transmit().unwrap();
        let WorkRequest::WriteData { wr_id, .. } = wr else {
            panic!("{wr:?}")
        };
        assert_eq!(wr_id, seq);
        e.on_completion(Completion::Sent { wr_id }).unwrap();
    }
    assert_eq!(e.writable(), None);
    e.on_credit(1).unwrap();
    assert_eq!(e.writable(), Some(0), "one freed slot is one credit");
    assert_eq!(e.tx.credits(), 1);
    // A stale credit word changes nothing.
    e.on_credit(0).unwrap();
    assert_eq!(e.tx.credits(), 1);
}
