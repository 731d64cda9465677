//! The lazy connection handshake of one link end, through the rendezvous store, with
//! the queue-pair transitions passed in: no verbs here, so it is tested against a real
//! store without hardware.
//!
//! Each end has a record key and a progress counter (see [`Keys`]): 1 once its record
//! is published, 2 once its queue pair is in RTR (and RTS) and so may be written to.
//! [`Handshake::start`] publishes (counter 1); [`Handshake::advance`], called on every
//! poll of the link and asking the store at most once per [`POLL_EVERY`], fetches and
//! checks the peer's record once its counter reaches 1, runs the transitions, bumps its
//! own counter to 2, and reports [`Step::Ready`] once the peer's counter is 2 too.
//! Neither end ever waits inside a call, so ranks may connect their links in any order.
//!
//! There is no deadline here: the peer's counter reaches 2 only when the peer polls
//! the link, which may be long after start-up (a rank busy before its first
//! collective, a point-to-point link the peer has not used yet). A link that never
//! connects moves no bytes, so the operation waiting on it fails with the
//! communicator's operation timeout, which names the peer.

use super::lock;
use super::record::{ConnRecord, LinkId};
use crate::error::{Error, Result};
use crate::rendezvous::StoreClient;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often a connecting end asks the store whether its peer has moved on.
pub const POLL_EVERY: Duration = Duration::from_millis(1);

/// The rendezvous keys of one link, seen from one end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    /// Where this end publishes its record.
    pub mine: String,
    /// This end's progress counter.
    pub my_state: String,
    /// Where the peer publishes its record.
    pub theirs: String,
    /// The peer's progress counter.
    pub their_state: String,
}

impl Keys {
    /// The keys of `link` (job, channel, this end `from`, peer `to`).
    pub fn new(link: &LinkId) -> Self {
        let k = |a: u32, b: u32| format!("rdma/{:016x}/ch{}/{a}-{b}", link.comm_id, link.channel);
        Keys {
            mine: k(link.from, link.to),
            my_state: format!("{}/state", k(link.from, link.to)),
            theirs: k(link.to, link.from),
            their_state: format!("{}/state", k(link.to, link.from)),
        }
    }
}

/// Where a handshake stands after [`Handshake::advance`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The peer has not caught up yet; call again.
    Waiting,
    /// Both queue pairs are in RTS: writes may be posted to the peer described.
    Ready(ConnRecord),
}

/// One end's side of the handshake.
pub struct Handshake {
    store: Arc<Mutex<StoreClient>>,
    keys: Keys,
    local: ConnRecord,
    next_poll: Instant,
    /// The peer's record, once this end has made its transitions.
    peer: Option<ConnRecord>,
}

impl Handshake {
    /// Publishes `local` and sets this end's counter to 1. The peer writes nothing
    /// before this end's counter reaches 2 (after `to_rts` in [`Handshake::advance`]),
    /// so the receive requests must be posted by then.
    pub fn start(store: Arc<Mutex<StoreClient>>, local: ConnRecord) -> Result<Self> {
        let keys = Keys::new(&local.link);
        {
            let mut s = lock(&store);
            s.set(&keys.mine, &local.encode())?;
            s.add(&keys.my_state, 1)?;
        }
        Ok(Handshake {
            store,
            keys,
            local,
            next_poll: Instant::now(),
            peer: None,
        })
    }

    /// One step, at `now`. `to_rts` moves the queue pair through RTR to RTS towards the
    /// peer record it is given; it runs once. A refused record is the
    /// [`Error::Handshake`] of [`ConnRecord::decode`]; a failed transition or store
    /// call is the error it gave.
    pub fn advance(
        &mut self,
        now: Instant,
        to_rts: impl FnOnce(&ConnRecord) -> std::io::Result<()>,
    ) -> Result<Step> {
        if now < self.next_poll {
            return Ok(Step::Waiting);
        }
        self.next_poll = now + POLL_EVERY;
        let store = self.store.clone();
        let mut s = lock(&store);
        let (me, peer) = (self.local.link.from, self.local.link.to);
        let rec = match self.peer {
            Some(rec) => rec,
            None => {
                if s.add(&self.keys.their_state, 0)? < 1 {
                    return Ok(Step::Waiting);
                }
                let bytes = s.get(&self.keys.theirs, POLL_EVERY)?;
                let expect = LinkId {
                    from: peer,
                    to: me,
                    ..self.local.link
                };
                let rec =
                    ConnRecord::decode(&bytes, expect, &self.local.params, self.local.link_layer)?;
                to_rts(&rec).map_err(|e| {
                    Error::io(
                        format!("rank {me}: moving the queue pair to rank {peer} to RTR/RTS"),
                        e,
                    )
                })?;
                s.add(&self.keys.my_state, 1)?;
                self.peer = Some(rec);
                rec
            }
        };
        if s.add(&self.keys.their_state, 0)? < 2 {
            return Ok(Step::Waiting);
        }
        Ok(Step::Ready(rec))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::StoreServer;
    use crate::transport::rdma::proto::Params;
    use std::cell::Cell;

    fn record(from: u32, to: u32, params: Params) -> ConnRecord {
        ConnRecord {
            link: LinkId {
                comm_id: 0x77,
                from,
                to,
                channel: 0,
            },
            link_layer: 1,
            lid: from as u16 + 1,
            mtu: 5,
            gid: [from as u8; 16],
            qpn: 100 + from,
            psn: 200 + from,
            ring_addr: 0x1000 * u64::from(from + 1),
            ring_rkey: 10 + from,
            credit_addr: 0x9000,
            credit_rkey: 10 + from,
            params,
        }
    }

    fn store(server: &StoreServer) -> Arc<Mutex<StoreClient>> {
        let c =
            StoreClient::connect(&server.local_addr().to_string(), Duration::from_secs(5)).unwrap();
        Arc::new(Mutex::new(c))
    }

    fn server() -> StoreServer {
        StoreServer::bind("127.0.0.1:0".parse().unwrap(), 2).unwrap()
    }

    /// Drives both ends, `a` first, until both are ready or `limit` passes.
    fn drive(a: &mut Handshake, b: &mut Handshake) -> (ConnRecord, ConnRecord, usize) {
        let limit = Instant::now() + Duration::from_secs(5);
        let transitions = Cell::new(0);
        let rts = |_: &ConnRecord| {
            transitions.set(transitions.get() + 1);
            Ok(())
        };
        let (mut ra, mut rb) = (None, None);
        while ra.is_none() || rb.is_none() {
            assert!(Instant::now() < limit, "handshake did not finish");
            let now = Instant::now() + POLL_EVERY;
            if ra.is_none() {
                if let Step::Ready(r) = a.advance(now, rts).unwrap() {
                    ra = Some(r);
                }
            }
            if rb.is_none() {
                if let Step::Ready(r) = b.advance(now, rts).unwrap() {
                    rb = Some(r);
                }
            }
        }
        (ra.unwrap(), rb.unwrap(), transitions.get())
    }

    #[test]
    fn both_ends_learn_each_other_and_transition_once() {
        let server = server();
        let p = Params::default();
        let mut a = Handshake::start(store(&server), record(0, 1, p)).unwrap();
        // The peer starts late: `a` must keep waiting, not fail.
        let now = Instant::now() + POLL_EVERY;
        assert_eq!(a.advance(now, |_| Ok(())).unwrap(), Step::Waiting);
        let mut b = Handshake::start(store(&server), record(1, 0, p)).unwrap();
        let (ra, rb, transitions) = drive(&mut b, &mut a);
        assert_eq!(ra, record(0, 1, p), "b got a's record");
        assert_eq!(rb, record(1, 0, p), "a got b's record");
        assert_eq!(transitions, 2, "one RTR/RTS per end");
    }

    #[test]
    fn asking_too_soon_does_not_touch_the_store() {
        let server = server();
        let p = Params::default();
        let mut a = Handshake::start(store(&server), record(0, 1, p)).unwrap();
        let t = Instant::now() + POLL_EVERY;
        assert_eq!(a.advance(t, |_| Ok(())).unwrap(), Step::Waiting);
        let _b = Handshake::start(store(&server), record(1, 0, p)).unwrap();
        // The peer's record is there now, but within the poll interval `a` does not
        // ask, so it makes no transition.
        let ran = Cell::new(0);
        let rts = |_: &ConnRecord| {
            ran.set(ran.get() + 1);
            Ok(())
        };
        assert_eq!(a.advance(t, rts).unwrap(), Step::Waiting);
        assert_eq!(ran.get(), 0);
        // One interval later it does; the peer has not said it is in RTR yet.
        assert_eq!(a.advance(t + POLL_EVERY, rts).unwrap(), Step::Waiting);
        assert_eq!(ran.get(), 1);
        // And it waits as long as that takes: there is no deadline here.
        let much_later = t + Duration::from_secs(3600);
        assert_eq!(a.advance(much_later, rts).unwrap(), Step::Waiting);
        assert_eq!(ran.get(), 1, "the transitions run once");
    }

    #[test]
    fn mismatched_ring_shapes_fail_before_any_transition() {
        let server = server();
        let p = Params::default();
        let q = Params { slots: 4, ..p };
        let mut a = Handshake::start(store(&server), record(0, 1, p)).unwrap();
        let _b = Handshake::start(store(&server), record(1, 0, q)).unwrap();
        let ran = Cell::new(false);
        let r = a.advance(Instant::now() + POLL_EVERY, |_| {
            ran.set(true);
            Ok(())
        });
        match r {
            Err(Error::Handshake { peer, detail }) => {
                assert_eq!(peer, "rank 1");
                assert!(detail.contains("rank 0 uses 16 slots"), "{detail}");
                assert!(detail.contains("rank 1 uses 4 slots"), "{detail}");
            }
            other => panic!("expected a handshake error, got {other:?}"),
        }
        assert!(!ran.get(), "no transition towards a refused peer");
    }

    #[test]
    fn a_failed_transition_is_an_error_naming_the_peer() {
        let server = server();
        let p = Params::default();
        let mut a = Handshake::start(store(&server), record(0, 1, p)).unwrap();
        let _b = Handshake::start(store(&server), record(1, 0, p)).unwrap();
        let e = a
            .advance(Instant::now() + POLL_EVERY, |_| {
                Err(std::io::Error::from_raw_os_error(libc::EINVAL))
            })
            .unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("rank 0: moving the queue pair to rank 1"),
            "{e}"
        );
    }

    #[test]
    fn keys_name_the_job_channel_and_direction() {
        let l = record(2, 5, Params::default()).link;
        let a = Keys::new(&l);
        let b = Keys::new(&LinkId {
            from: 5,
            to: 2,
            ..l
        });
        assert_eq!(
            (a.mine.clone(), a.my_state.clone()),
            (b.theirs, b.their_state)
        );
        assert_ne!(a.mine, a.theirs);
        assert!(a.mine.contains("0000000000000077") && a.mine.contains("ch0"));
        assert_ne!(a.mine, Keys::new(&LinkId { channel: 1, ..l }).mine);
        assert_ne!(a.mine, Keys::new(&LinkId { comm_id: 1, ..l }).mine);
    }
}
