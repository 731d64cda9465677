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

/// Protocol version carried in every handshake; bumped on any wire change.
pub const PROTOCOL_VERSION: u16 = 2;
const HELLO_MAGIC: [u8; 4] = *b"FCCH";
const HELLO_LEN: usize = 40;

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

/// Socket settings for data links.
#[derive(Clone, Debug)]
pub(crate) struct SocketOpts {
    /// `SO_SNDBUF`/`SO_RCVBUF` in bytes (the kernel caps it at `net.core.[rw]mem_max`);
    /// 0 leaves the kernel's autotuning alone.
    pub socket_buffer: usize,
    /// How long connecting to peers may take in all.
    pub connect_timeout: Duration,
    /// The congestion control each socket is given.
    pub congestion: TcpCongestion,
}

/// The first message on a data connection, each way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version of the sender.
    pub version: u16,
    /// 0: a request or an acceptance; otherwise a refusal code.
    pub status: u16,
    /// The job's communicator id (from the store).
    pub comm_id: u64,
    /// The sender's rank.
    pub rank: u32,
    /// The sender's world size.
    pub world_size: u32,
    /// The rank the sender wants to reach (request) or answers as (reply).
    pub to_rank: u32,
    /// Which stream this connection is ([`Channel::code`]).
    pub channel: u16,
    /// [`FLAG_AUTH`]: the sender's job has a token and a proof exchange follows.
    pub flags: u16,
    /// The group the connection belongs to: 0 for the job's own links, a
    /// sub-communicator's id otherwise ([`super::GroupSpec::id`]).
    pub group: u64,
}

/// [`Hello::flags`] bit: the sender authenticates with the job token (HMAC
/// challenge-response after the hello).
pub const FLAG_AUTH: u16 = 1;

/// Refusal codes carried in [`Hello::status`].
mod refuse {
    pub const VERSION: u16 = 1;
    pub const COMM_ID: u16 = 2;
    pub const RANK: u16 = 3;
    pub const DUPLICATE: u16 = 4;
    pub const AUTH: u16 = 5;
    pub const CLOSED: u16 = 6;

    pub fn text(code: u16) -> &'static str {
        match code {
            VERSION => "protocol version differs",
            COMM_ID => "communicator id differs (a process from another job?)",
            RANK => "rank, world size or channel not expected here",
            DUPLICATE => "this rank is already connected",
            AUTH => "job token missing or different (authentication failed)",
            CLOSED => "this rank has closed that communicator (it failed, or is gone)",
            _ => "unknown refusal",
        }
    }
}

impl Hello {
    /// Serialises the handshake.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.status.to_le_bytes());
        b[8..16].copy_from_slice(&self.comm_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.rank.to_le_bytes());
        b[20..24].copy_from_slice(&self.world_size.to_le_bytes());
        b[24..28].copy_from_slice(&self.to_rank.to_le_bytes());
        b[28..30].copy_from_slice(&self.channel.to_le_bytes());
        b[30..32].copy_from_slice(&self.flags.to_le_bytes());
        b[32..40].copy_from_slice(&self.group.to_le_bytes());
        b
    }

    /// Parses a handshake; a wrong magic number is an error (the version is checked by
    /// the caller, so it can answer with a refusal that says why).
    pub fn decode(b: &[u8; HELLO_LEN]) -> std::result::Result<Self, String> {
        if b[0..4] != HELLO_MAGIC {
            return Err(format!(
                "wrong magic number {:02x?} (expected {:02x?} \"FCCH\"): not a ferroccl peer",
                &b[0..4],
                HELLO_MAGIC
            ));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        Ok(Hello {
            version: u16_at(4),
            status: u16_at(6),
            comm_id: u64_at(8),
            rank: u32_at(16),
            world_size: u32_at(20),
            to_rank: u32_at(24),
            channel: u16_at(28),
            flags: u16_at(30),
            group: u64_at(32),
        })
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

fn new_socket(addr: &SocketAddr, opts: &SocketOpts) -> Result<Socket> {
    let s = Socket::new(
        Domain::for_address(*addr),
        Type::STREAM,
        Some(Protocol::TCP),
    )
    .map_err(|e| Error::io("creating a socket", e))?;
    if opts.socket_buffer > 0 {
        // Set before connect/listen so the window scale is negotiated for it.
        s.set_send_buffer_size(opts.socket_buffer)
            .and_then(|()| s.set_recv_buffer_size(opts.socket_buffer))
            .map_err(|e| Error::io("setting a socket's buffer sizes", e))?;
    }
    // Accepted sockets inherit the listener's.
    set_congestion(&s, &opts.congestion)?;
    Ok(s)
}

/// The congestion control `s` runs.
fn congestion_of(s: &Socket) -> io::Result<String> {
    let name = s.tcp_congestion()?;
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}

/// The congestion control a link made with `want` runs, and the system's default
/// (what a new socket runs before ferroccl sets it): a throwaway socket, set the way
/// every link's is.
pub(crate) fn congestion_in_effect(want: &TcpCongestion) -> Result<(String, String)> {
    let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))
        .map_err(|e| Error::io("creating a socket", e))?;
    let system = congestion_of(&s).map_err(|e| Error::io("reading TCP_CONGESTION", e))?;
    set_congestion(&s, want)?;
    let now = congestion_of(&s).map_err(|e| Error::io("reading TCP_CONGESTION", e))?;
    Ok((now, system))
}

/// What [`TcpCongestion::Auto`] did to a socket.
#[derive(Debug, PartialEq, Eq)]
enum AutoCongestion {
    /// The system's choice is not BBR: left alone.
    Kept,
    /// BBR, replaced by this one.
    Replaced(&'static str),
    /// BBR, and neither replacement could be set.
    Stuck,
}

/// [`TcpCongestion::Auto`]'s rule, apart from the socket: a socket running `current`
/// keeps it unless it is BBR (`bbr`, `bbr2`, `bbr3`...), which is replaced by the
/// first of cubic and reno that `set` accepts.
fn auto_congestion(current: &str, mut set: impl FnMut(&str) -> bool) -> AutoCongestion {
    if !current.starts_with("bbr") {
        return AutoCongestion::Kept;
    }
    ["cubic", "reno"]
        .into_iter()
        .find(|alt| set(alt))
        .map_or(AutoCongestion::Stuck, AutoCongestion::Replaced)
}

/// Gives `s` the congestion control `want` asks for (see [`TcpCongestion`]).
fn set_congestion(s: &Socket, want: &TcpCongestion) -> Result<()> {
    static SAID: std::sync::Once = std::sync::Once::new();
    match want {
        TcpCongestion::Named(name) => s.set_tcp_congestion(name.as_bytes()).map_err(|e| {
            let why = match e.raw_os_error() {
                Some(libc::ENOENT) => "this kernel does not have it \
                    (net.ipv4.tcp_available_congestion_control lists what it has)"
                    .to_string(),
                Some(libc::EPERM) => "this user may not use it \
                    (net.ipv4.tcp_allowed_congestion_control; CAP_NET_ADMIN may use any)"
                    .to_string(),
                _ => e.to_string(),
            };
            Error::Unavailable {
                what: format!("TCP congestion control {name:?}"),
                why,
            }
        }),
        TcpCongestion::Auto => {
            let current = congestion_of(s).unwrap_or_default();
            match auto_congestion(&current, |alt| s.set_tcp_congestion(alt.as_bytes()).is_ok()) {
                AutoCongestion::Kept => {}
                AutoCongestion::Replaced(alt) => SAID.call_once(|| {
                    tracing::info!(
                        "TCP links run {alt} instead of the system's {current}: BBR's \
                         ProbeRTT stalls each link 200 ms every 10 s, and a ring with it \
                         (FERROCCL_TCP_CONGESTION=system keeps {current})"
                    )
                }),
                AutoCongestion::Stuck => SAID.call_once(|| {
                    tracing::warn!(
                        "TCP links stay on the system's {current} (neither cubic nor reno \
                         may be set): expect large all-reduces some 5-10 % over the ring \
                         law from its ProbeRTT stalls"
                    )
                }),
            }
            Ok(())
        }
        TcpCongestion::System => Ok(()),
    }
}

/// Binds the data listener on `ip`, port chosen by the kernel.
pub(crate) fn listen(ip: IpAddr, opts: &SocketOpts) -> Result<TcpListener> {
    let addr = SocketAddr::new(ip, 0);
    let s = new_socket(&addr, opts)?;
    s.bind(&SockAddr::from(addr)).map_err(|e| {
        if e.kind() == io::ErrorKind::AddrInUse {
            Error::AddrInUse {
                addr,
                what: "data listener".into(),
            }
        } else {
            Error::io(format!("binding the data listener on {addr}"), e)
        }
    })?;
    s.listen(1024)
        .map_err(|e| Error::io("listen on the data listener", e))?;
    let l: TcpListener = s.into();
    l.set_nonblocking(true)
        .map_err(|e| Error::io("data listener non-blocking", e))?;
    Ok(l)
}

/// Reads a hello: its magic first, so that a stranger that sends a few bytes of
/// something else and hangs up is named as one (the decoder refuses the magic), not
/// as a short read.
fn read_hello(s: &mut TcpStream, deadline: Instant) -> io::Result<[u8; HELLO_LEN]> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))?;
    let mut b = [0u8; HELLO_LEN];
    s.read_exact(&mut b[..4])?;
    if b[..4] == HELLO_MAGIC {
        s.read_exact(&mut b[4..])?;
    }
    Ok(b)
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

/// Who this rank is in the job, as its handshakes say.
#[derive(Clone)]
struct Identity {
    rank: usize,
    world_size: usize,
    comm_id: u64,
    token: Option<Arc<[u8]>>,
}

impl Identity {
    fn of(ctx: &ConnectCtx) -> Self {
        Identity {
            rank: ctx.rank,
            world_size: ctx.world_size,
            comm_id: ctx.comm_id,
            token: ctx.token.as_deref().map(Arc::from),
        }
    }

    /// A hello to job rank `to` on `channel` of `group`.
    fn hello(&self, to: usize, channel: Channel, group: u64, status: u16) -> Hello {
        Hello {
            version: PROTOCOL_VERSION,
            status,
            comm_id: self.comm_id,
            rank: self.rank as u32,
            world_size: self.world_size as u32,
            to_rank: to as u32,
            channel: channel.code() as u16,
            flags: if self.token.is_some() { FLAG_AUTH } else { 0 },
            group,
        }
    }
}

/// Label of the acceptor's proof, and of the dialer's.
const ACCEPTOR_PROOF: &str = "ferroccl link acceptor";
const DIALER_PROOF: &str = "ferroccl link dialer";

/// Acceptor side of a handshake that passed its checks: writes `reply` and, for a job
/// with a token, proves the token and checks the dialer's proof (then confirms with one
/// byte). `Err` says why the dialer was refused.
fn accept_with_proof(
    s: &mut TcpStream,
    me: &Identity,
    request: &[u8; HELLO_LEN],
    dialer_nonce: &[u8; auth::NONCE_LEN],
    reply: &[u8; HELLO_LEN],
    deadline: Instant,
) -> std::result::Result<(), String> {
    let Some(token) = &me.token else {
        return s
            .write_all(reply)
            .map_err(|e| format!("handshake reply failed: {e}"));
    };
    let ours = auth::nonce();
    let transcript: [&[u8]; 4] = [request, reply, dialer_nonce, &ours];
    let mut out = reply.to_vec();
    out.extend_from_slice(&ours);
    out.extend_from_slice(&auth::mac(token, ACCEPTOR_PROOF, &transcript));
    s.write_all(&out)
        .map_err(|e| format!("handshake reply failed: {e}"))?;
    let mut proof = [0u8; auth::MAC_LEN];
    read_exact_by(s, &mut proof, deadline)
        .map_err(|e| format!("no proof of the job token ({e})"))?;
    if !auth::verify(token, DIALER_PROOF, &transcript, &proof) {
        let _ = s.write_all(&[0]);
        return Err(
            "wrong proof of the job token (another job, or a different FERROCCL_TOKEN)".into(),
        );
    }
    s.write_all(&[1])
        .map_err(|e| format!("handshake confirmation failed: {e}"))
}

/// Reads exactly `buf.len()` bytes, giving up at `deadline`.
fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))?;
    s.read_exact(buf)
}

/// Which stream an accepted connection is: (group, the dialer's job rank, channel).
type LinkKey = (u64, usize, Channel);

/// Connections from lower ranks, accepted and acknowledged by the acceptor thread
/// whatever this rank is doing, so a peer dialling it never waits on its main thread;
/// and the beacons of this rank's communicators, by group, which it answers status
/// queries from.
#[derive(Default)]
struct Accepted {
    state: Mutex<AcceptState>,
    cv: Condvar,
    stop: AtomicBool,
    beacons: Mutex<HashMap<u64, Arc<Beacon>>>,
}

#[derive(Default)]
struct AcceptState {
    ready: HashMap<LinkKey, TcpStream>,
    /// Links already handed out (a second connection for one is refused).
    taken: HashSet<LinkKey>,
    /// Strangers turned away, for the error if an awaited peer never comes.
    refused: Vec<String>,
    /// Groups this rank has closed ([`Connector::close`]): their connections are
    /// refused, so a peer linking now fails at once instead of waiting.
    closed: HashSet<u64>,
}

fn lock_state(a: &Accepted) -> MutexGuard<'_, AcceptState> {
    lock(&a.state)
}

/// Accepts until told to stop; each connection's handshake runs on its own short-lived
/// thread so a silent stranger delays nobody.
fn accept_loop(listener: TcpListener, me: Identity, acc: &Arc<Accepted>) {
    use std::os::fd::AsRawFd;
    while !acc.stop.load(Ordering::Relaxed) {
        let mut pfd = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let ready = unsafe { libc::poll(&mut pfd, 1, 100) };
        if ready <= 0 {
            continue;
        }
        loop {
            match listener.accept() {
                Ok((s, from)) => {
                    let (acc, who) = (acc.clone(), me.clone());
                    let spawned = std::thread::Builder::new()
                        .name("ferroccl-handshake".into())
                        .spawn(move || handshake_incoming(s, from, who, &acc));
                    if let Err(e) = spawned {
                        tracing::warn!("rank {}: cannot start a handshake thread: {e}", me.rank);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("rank {}: accept failed: {e}", me.rank);
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            }
        }
    }
}

/// Checks an incoming connection's handshake and, if it is a lower rank of this job,
/// acknowledges it and files it for [`TcpConnector::accept_from`].
fn handshake_incoming(mut s: TcpStream, from: SocketAddr, me: Identity, acc: &Accepted) {
    let refuse_with = |acc: &Accepted, why: String| {
        tracing::warn!("rank {}: refused a connection from {why}", me.rank);
        lock_state(acc).refused.push(why);
        acc.cv.notify_all();
    };
    let _ = s.set_nonblocking(false);
    // A stranger gets a short deadline of its own.
    let raw = match read_hello(&mut s, Instant::now() + Duration::from_secs(5)) {
        Ok(b) => b,
        Err(e) => return refuse_with(acc, format!("{from}: no handshake ({e})")),
    };
    let h = match Hello::decode(&raw) {
        Ok(h) => h,
        Err(d) => return refuse_with(acc, format!("{from}: {d}")),
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let wants_auth = h.flags & FLAG_AUTH != 0;
    let mut dialer_nonce = [0u8; auth::NONCE_LEN];
    if wants_auth {
        if let Err(e) = read_exact_by(&mut s, &mut dialer_nonce, deadline) {
            return refuse_with(
                acc,
                format!("{from}: no nonce after an authenticated hello ({e})"),
            );
        }
    }
    let ch = Channel::from_code(h.channel as u32);
    let key: LinkKey = (h.group, h.rank as usize, ch.unwrap_or(Channel::Collective));
    let status_query = ch == Some(Channel::Status);
    let code = if h.version != PROTOCOL_VERSION {
        refuse::VERSION
    } else if h.comm_id != me.comm_id {
        refuse::COMM_ID
    } else if wants_auth != me.token.is_some() {
        refuse::AUTH
    } else if h.world_size as usize != me.world_size
        || h.to_rank as usize != me.rank
        || ch.is_none()
        || (!status_query && h.rank as usize >= me.rank)
        || (status_query && h.rank as usize >= me.world_size)
    {
        refuse::RANK
    } else if !status_query && lock_state(acc).closed.contains(&key.0) {
        refuse::CLOSED
    } else if !status_query && {
        let st = lock_state(acc);
        st.taken.contains(&key) || st.ready.contains_key(&key)
    } {
        refuse::DUPLICATE
    } else {
        0
    };
    if code != 0 {
        let _ = s.write_all(&me.hello(key.1, key.2, key.0, code).encode());
        return refuse_with(
            acc,
            format!(
                "{from} claiming rank {} of {} (comm {:#018x}, version {}, channel {}, \
                 group {:#x}): {}",
                h.rank,
                h.world_size,
                h.comm_id,
                h.version,
                h.channel,
                h.group,
                refuse::text(code)
            ),
        );
    }
    // No lock is held during the exchange: a slow or hostile dialer delays nobody.
    let reply = me.hello(key.1, key.2, key.0, 0).encode();
    if let Err(why) = accept_with_proof(&mut s, &me, &raw, &dialer_nonce, &reply, deadline) {
        return refuse_with(acc, format!("{from} (rank {}): {why}", key.1));
    }
    if status_query {
        // A peer asks what this rank is doing in the group: answer from its beacon,
        // whatever this rank's own thread is doing, and hang up. A group this rank
        // has no communicator of (yet, or any more) answers "no operation".
        let raw = lock(&acc.beacons).get(&h.group).map_or(0, |b| b.raw());
        let _ = s.write_all(&raw.to_le_bytes());
        return;
    }
    let mut st = lock_state(acc);
    if st.closed.contains(&key.0) {
        // Closed during the handshake: the connection is dropped, the dialer reads the
        // end of it.
        return;
    }
    if st.taken.contains(&key) || st.ready.contains_key(&key) {
        drop(st);
        return refuse_with(acc, format!("{from}: rank {} connected twice", key.1));
    }
    st.ready.insert(key, s);
    drop(st);
    acc.cv.notify_all();
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
        let keys: Vec<LinkKey> = st
            .ready
            .keys()
            .filter(|k| k.0 == self.group)
            .copied()
            .collect();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            if let Some(s) = st.ready.remove(&k) {
                st.taken.insert(k);
                out.push((k.1, k.2, s));
            }
        }
        out
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

fn connect_with_retry(
    addr: &SocketAddr,
    opts: &SocketOpts,
    deadline: Instant,
) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let s = new_socket(addr, opts)?;
        match s.connect_timeout(&SockAddr::from(*addr), left.max(Duration::from_millis(1))) {
            Ok(()) => return Ok(s.into()),
            Err(e) if Instant::now() + backoff < deadline => {
                tracing::debug!("connect to {addr} failed ({e}); retrying");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
            Err(e) => return Err(Error::io(format!("connecting to {addr}"), e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_congestion_replaces_bbr_only() {
        let set = |ok: &'static [&'static str]| move |alt: &str| ok.contains(&alt);
        assert_eq!(
            auto_congestion("cubic", set(&["reno"])),
            AutoCongestion::Kept
        );
        assert_eq!(auto_congestion("reno", set(&[])), AutoCongestion::Kept);
        assert_eq!(
            auto_congestion("bbr", set(&["cubic", "reno"])),
            AutoCongestion::Replaced("cubic")
        );
        assert_eq!(
            auto_congestion("bbr2", set(&["reno"])),
            AutoCongestion::Replaced("reno")
        );
        assert_eq!(auto_congestion("bbr", set(&[])), AutoCongestion::Stuck);
        // A kept choice is never touched.
        let mut calls = 0;
        auto_congestion("cubic", |_| {
            calls += 1;
            true
        });
        assert_eq!(calls, 0);
    }

    fn opts(congestion: TcpCongestion) -> SocketOpts {
        SocketOpts {
            socket_buffer: 0,
            connect_timeout: Duration::from_secs(5),
            congestion,
        }
    }

    fn loopback() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 0))
    }

    #[test]
    fn sockets_get_the_congestion_control_asked_for() {
        // reno is always built in.
        let s = new_socket(&loopback(), &opts(TcpCongestion::Named("reno".into()))).unwrap();
        assert_eq!(congestion_of(&s).unwrap(), "reno");
        // The system's, untouched.
        let system = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
            .unwrap()
            .trim()
            .to_string();
        let s = new_socket(&loopback(), &opts(TcpCongestion::System)).unwrap();
        assert_eq!(congestion_of(&s).unwrap(), system);
        // Auto: the system's unless BBR.
        let s = new_socket(&loopback(), &opts(TcpCongestion::Auto)).unwrap();
        let got = congestion_of(&s).unwrap();
        if system.starts_with("bbr") {
            let allowed =
                std::fs::read_to_string("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
                    .unwrap_or_default();
            // reno may always be set by root, and by anyone where it is allowed.
            if crate::sys::shm::effective_uid() == 0
                || allowed.split_whitespace().any(|a| a == "reno")
            {
                assert!(got == "cubic" || got == "reno", "auto left {got}");
            }
        } else {
            assert_eq!(got, system);
        }
    }

    #[test]
    fn a_congestion_control_the_kernel_lacks_is_a_typed_error() {
        let e = new_socket(
            &loopback(),
            &opts(TcpCongestion::Named("no_such_cc".into())),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("no_such_cc") && msg.contains("does not have it"),
            "{msg}"
        );
        // Connecting says so too, not "connection refused" after retrying (port 1 has
        // no listener).
        let e = connect_with_retry(
            &SocketAddr::from(([127, 0, 0, 1], 1)),
            &opts(TcpCongestion::Named("no_such_cc".into())),
            Instant::now() + Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
    }

    #[test]
    fn accepted_links_inherit_the_listeners_congestion_control() {
        let o = opts(TcpCongestion::Named("reno".into()));
        let l = listen(IpAddr::from([127, 0, 0, 1]), &o).unwrap();
        let addr = l.local_addr().unwrap();
        let c = connect_with_retry(&addr, &o, Instant::now() + Duration::from_secs(5)).unwrap();
        l.set_nonblocking(false).unwrap();
        let (a, _) = l.accept().unwrap();
        for s in [Socket::from(c), Socket::from(a)] {
            assert_eq!(congestion_of(&s).unwrap(), "reno");
        }
    }

    #[test]
    fn hello_round_trips_and_rejects_strangers() {
        let h = Hello {
            version: PROTOCOL_VERSION,
            status: 0,
            comm_id: 0xdead_beef_0123_4567,
            rank: 3,
            world_size: 8,
            to_rank: 4,
            channel: 1,
            flags: FLAG_AUTH,
            group: 0xfeed_0000_0000_0001,
        };
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        let mut b = h.encode();
        b[..4].copy_from_slice(b"GET ");
        assert!(Hello::decode(&b).unwrap_err().contains("magic"));
    }
}
