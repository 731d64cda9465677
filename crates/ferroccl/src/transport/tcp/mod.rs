//! TCP transport: one connection per peer, non-blocking, driven through mio.
//!
//! Connection set-up goes through the rendezvous store: every rank listens on an
//! ephemeral port of the interface it reaches the store through, publishes
//! `addr/<rank>`, and for each pair of linked ranks the lower rank connects to the
//! higher. The first bytes each way are a [`Hello`]: magic number, protocol version,
//! communicator id, the sender's rank and world size, the rank it means to reach, the
//! channel and the group. Anything else is rejected — a stranger or a leftover process
//! from an earlier job gets a refusal and a log line, and does not disturb the job.
//!
//! # Groups
//!
//! A sub-communicator (`Communicator::split`) gets connections of its own, made by a
//! connector that shares this rank's listener, acceptor, address book and store
//! connection ([`Connector::group`]): its hellos carry the group's id, and the acceptor
//! files each connection under (group, rank, channel), so the same two ranks may be
//! linked in the job and in any number of groups at once, each link a stream of its
//! own. A TCP stream cannot carry two communicators' frames without a demultiplexer
//! (one communicator's large frame would hold the other's behind it, and a rank
//! waiting in one for a frame stuck behind the other's would wait forever), so groups
//! do not share the job's links: they share everything that made them. Ranks in the
//! hello stay the job's; a group's connector maps its own ranks to them.
//!
//! Data sockets get `TCP_NODELAY` and large kernel buffers (see
//! [`crate::config::TcpOptions::socket_buffer`]).

use super::{
    Beacon, Channel, Connector, GroupSpec, Joined, Link, LinkError, Links, Transport, Waiter,
};
use crate::config::TcpCongestion;
use crate::error::{Error, Result};
use crate::rendezvous::{auth, StoreClient};
use crate::sync::lock;
use mio::{Events, Interest, Poll, Token};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::collections::{HashMap, HashSet};
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod accept;
mod hello;
mod socket;

use accept::*;
use hello::*;
pub use hello::{Hello, FLAG_AUTH, PROTOCOL_VERSION};
pub(crate) use socket::congestion_in_effect;
use socket::*;

/// The TCP transport (the default): see the module docs.
pub(crate) struct Tcp;

impl Transport for Tcp {
    fn name(&self) -> &str {
        "tcp"
    }

    fn connect(&self, job: Joined) -> Result<Links> {
        endpoint(ConnectCtx::of(job))
    }
}

/// A connected data link.
struct TcpLink {
    peer: usize,
    stream: mio::net::TcpStream,
    sent: u64,
    received: u64,
}

fn classify(e: io::Error) -> std::result::Result<usize, LinkError> {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::UnexpectedEof
        | io::ErrorKind::NotConnected => Err(LinkError::Closed),
        _ => Err(LinkError::Io(e)),
    }
}

impl Link for TcpLink {
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

    fn class(&self) -> &'static str {
        "tcp"
    }
}

struct TcpWaiter {
    poll: Poll,
    events: Events,
    waker: Option<Arc<mio::Waker>>,
}

/// The poller token of a waiter's waker (links use `2·peer + channel`).
pub(crate) const WAKER_TOKEN: Token = Token(usize::MAX);

/// A [`super::Waker`] ending a wait in `poll` (which it registers); `None` if the
/// poller refuses one (the waits then end on their own, at the latest after their
/// timeout slice).
pub(crate) fn poll_waker(poll: &Poll) -> Option<Arc<mio::Waker>> {
    mio::Waker::new(poll.registry(), WAKER_TOKEN)
        .map(Arc::new)
        .map_err(|e| tracing::debug!("no waker for the poller: {e}"))
        .ok()
}

impl TcpWaiter {
    fn new(poll: Poll) -> Self {
        let waker = poll_waker(&poll);
        TcpWaiter {
            poll,
            events: Events::with_capacity(64),
            waker,
        }
    }
}

impl Waiter for TcpWaiter {
    fn wait(&mut self, timeout: Duration) -> io::Result<()> {
        match self.poll.poll(&mut self.events, Some(timeout)) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            r => r,
        }
    }

    fn waker(&self) -> Option<super::Waker> {
        let w = self.waker.clone()?;
        Some(super::Waker::new(move || {
            let _ = w.wake();
        }))
    }
}

/// What a rank needs to know to connect its links.
pub(crate) struct ConnectCtx {
    /// This rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// The job's communicator id.
    pub comm_id: u64,
    /// The store through which addresses are exchanged.
    pub store: StoreClient,
    /// Socket settings.
    pub opts: SocketOpts,
    /// The job token every data connection proves (HMAC; never sent), if any.
    pub token: Option<Vec<u8>>,
}

impl ConnectCtx {
    /// The context of a rank that has joined its job.
    pub(crate) fn of(job: Joined) -> Self {
        ConnectCtx {
            rank: job.config.job.rank,
            world_size: job.config.job.world_size,
            comm_id: job.comm_id,
            opts: SocketOpts {
                socket_buffer: job.config.transport.tcp.socket_buffer,
                connect_timeout: job.config.tuning.connect_timeout,
                congestion: job.config.transport.tcp.congestion.clone(),
            },
            token: job.config.job.token.clone(),
            store: job.store,
        }
    }
}

fn hs_err(peer: impl Into<String>, detail: impl Into<String>) -> Error {
    Error::Handshake {
        peer: peer.into(),
        detail: detail.into(),
    }
}

/// Publishes this rank's data address in the store and returns the rank's
/// [`Links`]: a connector that dials higher ranks and accepts lower ones, and a waiter
/// over every link it makes.
pub(crate) fn endpoint(ctx: ConnectCtx) -> Result<Links> {
    let (connector, poll, beacon) = endpoint_parts(ctx)?;
    Ok(Links::new(
        Box::new(connector),
        Box::new(TcpWaiter::new(poll)),
        beacon,
    ))
}

/// The parts of [`endpoint`], for a transport that makes some of its links, or their
/// control connections, over TCP (`shm`): the connector, the poller its links are
/// registered with, and the beacon its acceptor answers status queries from.
pub(crate) fn endpoint_parts(mut ctx: ConnectCtx) -> Result<(TcpConnector, Poll, Arc<Beacon>)> {
    let listener = listen(ctx.store.local_addr().ip(), &ctx.opts)?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("reading the data listener's address", e))?;
    ctx.store
        .set(&format!("addr/{}", ctx.rank), addr.to_string().as_bytes())?;
    let poll = Poll::new().map_err(|e| Error::io("creating the poller", e))?;
    let registry = poll
        .registry()
        .try_clone()
        .map_err(|e| Error::io("cloning the poller's registry", e))?;
    let accepted = Arc::new(Accepted::default());
    let beacon = Arc::new(Beacon::default());
    lock(&accepted.beacons).insert(0, beacon.clone());
    let me = Identity::of(&ctx);
    {
        let (acc, me) = (accepted.clone(), me.clone());
        std::thread::Builder::new()
            .name(format!("ferroccl-accept{}", ctx.rank))
            .spawn(move || accept_loop(listener, me, &acc))
            .map_err(|e| Error::io("starting the connection acceptor", e))?;
    }
    let members: Arc<[usize]> = (0..ctx.world_size).collect();
    let ep = Arc::new(Endpoint {
        me,
        opts: ctx.opts,
        store: Mutex::new(ctx.store),
        addrs: Mutex::new(HashMap::new()),
        accepted,
    });
    Ok((
        TcpConnector {
            rank: ep.me.rank,
            ep,
            group: 0,
            members,
            registry,
        },
        poll,
        beacon,
    ))
}

/// What every connector of one rank shares, the job's own and its groups': who the
/// rank is in the job, its socket settings, the store, the peers' addresses, and the
/// acceptor (stopped when the last connector goes).
struct Endpoint {
    me: Identity,
    opts: SocketOpts,
    store: Mutex<StoreClient>,
    addrs: Mutex<HashMap<usize, SocketAddr>>,
    accepted: Arc<Accepted>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.accepted.stop.store(true, Ordering::Relaxed);
    }
}

/// Makes TCP links (see the module docs) for the job or for one of its groups; `shm`
/// also uses it for control connections.
pub(crate) struct TcpConnector {
    ep: Arc<Endpoint>,
    /// The group this connector's links belong to (0: the job's own).
    group: u64,
    /// The job rank of each of this connector's ranks, in its order.
    members: Arc<[usize]>,
    /// This rank, in this connector's order.
    rank: usize,
    registry: mio::Registry,
}

impl Drop for TcpConnector {
    fn drop(&mut self) {
        if self.group == 0 {
            return;
        }
        // A group's connector goes with its communicator: peers asking about the group
        // hear that this rank is in no operation of it, and connections filed for it
        // and never taken are closed.
        lock(&self.ep.accepted.beacons).remove(&self.group);
        let mut st = lock_state(&self.ep.accepted);
        st.ready.retain(|k, _| k.0 != self.group);
        st.taken.retain(|k| k.0 != self.group);
    }
}

impl TcpConnector {
    /// The job rank of this connector's rank `p`.
    fn job_rank(&self, p: usize) -> usize {
        self.members[p]
    }

    fn hello(&self, to_job_rank: usize, channel: Channel, status: u16) -> Hello {
        self.ep.me.hello(to_job_rank, channel, self.group, status)
    }

    /// Where job rank `p` listens (asked of the store once per rank, for every
    /// connector of this rank).
    fn peer_addr(&self, p: usize, deadline: Instant) -> Result<SocketAddr> {
        if let Some(a) = lock(&self.ep.addrs).get(&p) {
            return Ok(*a);
        }
        let me = self.ep.me.rank;
        let wait = deadline.saturating_duration_since(Instant::now());
        let raw = lock(&self.ep.store)
            .get(&format!("addr/{p}"), wait)
            .map_err(|e| {
                Error::Rendezvous(format!(
                "rank {me}: rank {p} did not publish its address within {wait:?}: has it started, \
                 with the same MASTER_ADDR:MASTER_PORT and WORLD_SIZE? ({e})"
            ))
            })?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let addr: SocketAddr = text.parse().map_err(|_| {
            Error::Rendezvous(format!("rank {p} published an unparsable address {text:?}"))
        })?;
        lock(&self.ep.addrs).insert(p, addr);
        Ok(addr)
    }

    /// Connects to higher job rank `p` and completes the handshake.
    fn dial(&self, p: usize, ch: Channel, deadline: Instant) -> Result<TcpStream> {
        let addr = self.peer_addr(p, deadline)?;
        let who = format!("rank {p} at {addr}");
        let mut s = connect_with_retry(&addr, &self.ep.opts, deadline).map_err(|e| match e {
            Error::Io { source, .. } => hs_err(&who, format!("could not connect: {source}")),
            e => e,
        })?;
        self.handshake_out(&mut s, p, ch, deadline, &who)?;
        Ok(s)
    }

    /// The dialer's half of the handshake on a fresh connection to job rank `p`: hello
    /// (and nonce), the reply checked field by field, and for a job with a token the
    /// proof exchange (the acceptor's proof checked, ours sent, the acceptor's verdict
    /// read).
    fn handshake_out(
        &self,
        s: &mut TcpStream,
        p: usize,
        ch: Channel,
        deadline: Instant,
        who: &str,
    ) -> Result<()> {
        let me = &self.ep.me;
        let io = |e: io::Error| hs_err(who, format!("handshake I/O failed: {e}"));
        let request = self.hello(p, ch, 0).encode();
        let ours = auth::nonce();
        let mut out = request.to_vec();
        if me.token.is_some() {
            out.extend_from_slice(&ours);
        }
        s.write_all(&out).map_err(io)?;
        let reply = read_hello(s, deadline).map_err(io)?;
        let h = Hello::decode(&reply).map_err(|d| hs_err(who, d))?;
        if h.status != 0 {
            return Err(hs_err(
                who,
                format!("refused our connection: {}", refuse::text(h.status)),
            ));
        }
        if h.version != PROTOCOL_VERSION {
            return Err(hs_err(
                who,
                format!(
                    "protocol version {} (ours is {PROTOCOL_VERSION})",
                    h.version
                ),
            ));
        }
        if h.comm_id != me.comm_id {
            return Err(hs_err(
                who,
                format!(
                    "communicator id {:#018x} differs from ours {:#018x}",
                    h.comm_id, me.comm_id
                ),
            ));
        }
        if h.rank as usize != p
            || h.world_size as usize != me.world_size
            || h.to_rank as usize != me.rank
            || h.channel as u32 != ch.code()
            || h.group != self.group
        {
            return Err(hs_err(
                who,
                format!(
                    "answered as rank {} of {} (to rank {}, channel {}, group {:#x}), \
                     expected rank {p} of {} (group {:#x})",
                    h.rank, h.world_size, h.to_rank, h.channel, h.group, me.world_size, self.group
                ),
            ));
        }
        let Some(token) = &me.token else {
            return Ok(());
        };
        if h.flags & FLAG_AUTH == 0 {
            return Err(hs_err(who, "answered without the job token's proof"));
        }
        let mut theirs = [0u8; auth::NONCE_LEN];
        let mut proof = [0u8; auth::MAC_LEN];
        read_exact_by(s, &mut theirs, deadline).map_err(io)?;
        read_exact_by(s, &mut proof, deadline).map_err(io)?;
        let transcript: [&[u8]; 4] = [&request, &reply, &ours, &theirs];
        if !auth::verify(token, ACCEPTOR_PROOF, &transcript, &proof) {
            return Err(hs_err(
                who,
                "could not prove the job token: another job, or a different FERROCCL_TOKEN",
            ));
        }
        s.write_all(&auth::mac(token, DIALER_PROOF, &transcript))
            .map_err(io)?;
        let mut verdict = [0u8; 1];
        read_exact_by(s, &mut verdict, deadline).map_err(io)?;
        if verdict[0] != 1 {
            return Err(hs_err(
                who,
                "refused our proof of the job token: a different FERROCCL_TOKEN?",
            ));
        }
        Ok(())
    }

    /// Waits for lower job rank `p`'s connection on `ch` of this connector's group,
    /// accepted by the acceptor thread.
    fn accept_from(&self, p: usize, ch: Channel, deadline: Instant) -> Result<TcpStream> {
        let me = self.ep.me.rank;
        let key = (self.group, p, ch);
        let acc = &self.ep.accepted;
        let mut st = lock_state(acc);
        loop {
            if let Some(s) = st.ready.remove(&key) {
                st.taken.insert(key);
                return Ok(s);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let group = match self.group {
                    0 => String::new(),
                    g => format!(" of group {g:#x}"),
                };
                let mut detail = format!(
                    "rank {me}: rank {p} did not connect ({ch:?} channel{group}) within {:?}",
                    self.ep.opts.connect_timeout
                );
                if !st.refused.is_empty() {
                    detail.push_str(&format!("; refused meanwhile: {}", st.refused.join("; ")));
                }
                return Err(hs_err(format!("rank {p}"), detail));
            }
            st = acc
                .cv
                .wait_timeout(st, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Asks job rank `p`'s acceptor for its beacon in this connector's group.
    fn ask_status(&self, p: usize, deadline: Instant) -> Result<Option<(u64, u8)>> {
        let addr = self.peer_addr(p, deadline)?;
        let who = format!("rank {p} at {addr}");
        let mut s = connect_with_retry(&addr, &self.ep.opts, deadline)?;
        let io = |e: io::Error| hs_err(&who, format!("status query failed: {e}"));
        self.handshake_out(&mut s, p, Channel::Status, deadline, &who)?;
        let left = deadline.saturating_duration_since(Instant::now());
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .map_err(io)?;
        let mut b = [0u8; 8];
        s.read_exact(&mut b).map_err(io)?;
        Ok(Beacon::decode(u64::from_le_bytes(b)))
    }

    /// [`TcpConnector::ask_status`] of each of `peers` (ranks of this connector's
    /// group), on a thread each, all by `deadline`.
    fn ask_all(&self, peers: &[usize], deadline: Instant) -> Vec<Result<Option<(u64, u8)>>> {
        std::thread::scope(|s| {
            let asks: Vec<_> = peers
                .iter()
                .map(|&p| {
                    s.spawn(move || {
                        super::check_peer(self.rank, p, self.members.len())?;
                        let started = Instant::now();
                        self.ask_status(self.job_rank(p), deadline).map_err(|e| {
                            match Instant::now() >= deadline {
                                // The address lookup failed (the store is silent):
                                // the peer itself was never asked.
                                _ if matches!(e, Error::Rendezvous(_)) => e,
                                // There but silent: no answer by the deadline.
                                true => Error::Timeout {
                                    rank: self.rank,
                                    op: "status query".into(),
                                    after: started.elapsed(),
                                    waiting_for: format!("rank {p}'s answer"),
                                    peers: e.to_string(),
                                },
                                false => e,
                            }
                        })
                    })
                })
                .collect();
            asks.into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::Rendezvous("a status query thread panicked".into()))
                    })
                })
                .collect()
        })
    }

    /// The connector of a group of this connector's ranks (see [`Connector::group`]):
    /// the same listener, addresses and store, its own poller (the parts of
    /// [`endpoint_parts`]).
    pub(crate) fn subgroup(&self, spec: &GroupSpec) -> Result<(TcpConnector, Poll, Arc<Beacon>)> {
        let rank = spec.check(self.rank, self.members.len(), self.group)?;
        let poll = Poll::new().map_err(|e| Error::io("creating the poller", e))?;
        let registry = poll
            .registry()
            .try_clone()
            .map_err(|e| Error::io("cloning the poller's registry", e))?;
        let beacon = Arc::new(Beacon::default());
        lock(&self.ep.accepted.beacons).insert(spec.id, beacon.clone());
        Ok((
            TcpConnector {
                ep: self.ep.clone(),
                group: spec.id,
                members: spec.members.iter().map(|&m| self.members[m]).collect(),
                rank,
                registry,
            },
            poll,
            beacon,
        ))
    }
}

impl Connector for TcpConnector {
    fn peer_status(&mut self, peer: usize, deadline: Instant) -> Result<Option<(u64, u8)>> {
        super::check_peer(self.rank, peer, self.members.len())?;
        self.ask_status(self.job_rank(peer), deadline)
    }

    fn peers_status(
        &mut self,
        peers: &[usize],
        deadline: Instant,
    ) -> Vec<Result<Option<(u64, u8)>>> {
        self.ask_all(peers, deadline)
    }

    fn connect(
        &mut self,
        peer: usize,
        channel: Channel,
        deadline: Instant,
    ) -> Result<Box<dyn Link>> {
        let s = self.stream(peer, channel, deadline)?;
        let stream = self.register(s, peer, channel)?;
        Ok(Box::new(TcpLink {
            peer,
            stream,
            sent: 0,
            received: 0,
        }))
    }

    fn ready(&mut self, peer: usize, channel: Channel) -> bool {
        self.ready_now(peer, channel)
    }

    fn close(&mut self) {
        self.close_group();
    }

    fn group(&mut self, spec: &GroupSpec) -> Result<Links> {
        let (connector, poll, beacon) = self.subgroup(spec)?;
        Ok(Links::new(
            Box::new(connector),
            Box::new(TcpWaiter::new(poll)),
            beacon,
        ))
    }
}

impl TcpConnector {
    /// The connected, handshaken (and, with a job token, authenticated) stream to
    /// `peer` (this connector's rank) on `channel`, still blocking: the lower job rank
    /// dials, the higher accepts.
    pub(crate) fn stream(
        &mut self,
        peer: usize,
        channel: Channel,
        deadline: Instant,
    ) -> Result<TcpStream> {
        super::check_peer(self.rank, peer, self.members.len())?;
        let (me, p) = (self.ep.me.rank, self.job_rank(peer));
        if p > me {
            self.dial(p, channel, deadline)
        } else {
            self.accept_from(p, channel, deadline)
        }
    }

    /// `s` (from [`TcpConnector::stream`]) made non-blocking, without Nagle, and
    /// registered with this connector's poller, so its waiter wakes for it.
    pub(crate) fn register(
        &self,
        s: TcpStream,
        peer: usize,
        channel: Channel,
    ) -> Result<mio::net::TcpStream> {
        let setup = |s: &TcpStream| -> io::Result<()> {
            s.set_nodelay(true)?;
            s.set_read_timeout(None)?;
            s.set_nonblocking(true)
        };
        setup(&s).map_err(|e| Error::io(format!("configuring the link to rank {peer}"), e))?;
        let mut stream = mio::net::TcpStream::from_std(s);
        let token = Token(peer * 2 + channel.code() as usize);
        self.registry
            .register(&mut stream, token, Interest::READABLE | Interest::WRITABLE)
            .map_err(|e| Error::io("registering a link with the poller", e))?;
        Ok(stream)
    }

    /// The job's store, for a transport that trades more through it.
    pub(crate) fn store(&self) -> MutexGuard<'_, StoreClient> {
        lock(&self.ep.store)
    }

    /// Whether [`TcpConnector::stream`] to `peer` returns without waiting for it: this
    /// rank dials it, or its connection has been accepted already.
    pub(crate) fn ready_now(&self, peer: usize, channel: Channel) -> bool {
        let Some(&p) = self.members.get(peer) else {
            return true; // connect says why
        };
        p > self.ep.me.rank
            || lock_state(&self.ep.accepted)
                .ready
                .contains_key(&(self.group, p, channel))
    }

    /// This group's connections accepted from lower ranks and never taken up, each
    /// with its job rank and channel; from now on a link for them is refused as taken.
    /// For a layer above that must undo what a dialler did for a link nobody made
    /// (`shm` removes the ring names offered on them).
    pub(crate) fn take_unclaimed(&self) -> Vec<(usize, Channel, TcpStream)> {
        let mut st = lock_state(&self.ep.accepted);
        let mine: Vec<(LinkKey, TcpStream)> =
            st.ready.extract_if(|k, _| k.0 == self.group).collect();
        st.taken.extend(mine.iter().map(|(k, _)| *k));
        mine.into_iter().map(|(k, s)| (k.1, k.2, s)).collect()
    }

    /// Refuses this group's connections from now on, and closes those accepted and
    /// not taken up (see [`Connector::close`]).
    pub(crate) fn close_group(&self) {
        let mut st = lock_state(&self.ep.accepted);
        st.closed.insert(self.group);
        st.ready.retain(|k, _| k.0 != self.group);
    }

    /// This rank, in this connector's order.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// The job rank of each of this connector's ranks.
    pub(crate) fn members(&self) -> &[usize] {
        &self.members
    }

    /// This connector's group (0: the job's own links).
    pub(crate) fn group_id(&self) -> u64 {
        self.group
    }
}

#[cfg(test)]
mod tests;
