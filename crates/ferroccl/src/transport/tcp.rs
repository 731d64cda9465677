//! TCP transport: one connection per peer, non-blocking, driven through mio.
//!
//! Connection set-up goes through the rendezvous store: every rank listens on an
//! ephemeral port of the interface it reaches the store through, publishes
//! `addr/<rank>`, and for each pair of linked ranks the lower rank connects to the
//! higher. The first bytes each way are a [`Hello`]: magic number, protocol version,
//! communicator id, the sender's rank and world size, and the rank it means to reach.
//! Anything else is rejected — a stranger or a leftover process from an earlier job gets
//! a refusal and a log line, and does not disturb the job.
//!
//! Data sockets get `TCP_NODELAY` and large kernel buffers (see
//! [`crate::config::TcpOptions::socket_buffer`]).

use super::{Beacon, Channel, Connector, Joined, Link, LinkError, Links, Transport, Waiter};
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
pub const PROTOCOL_VERSION: u16 = 1;
const HELLO_MAGIC: [u8; 4] = *b"FCCH";
const HELLO_LEN: usize = 32;

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

    pub fn text(code: u16) -> &'static str {
        match code {
            VERSION => "protocol version differs",
            COMM_ID => "communicator id differs (a process from another job?)",
            RANK => "rank, world size or channel not expected here",
            DUPLICATE => "this rank is already connected",
            AUTH => "job token missing or different (authentication failed)",
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
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[8..16]);
        Ok(Hello {
            version: u16_at(4),
            status: u16_at(6),
            comm_id: u64::from_le_bytes(id),
            rank: u32_at(16),
            world_size: u32_at(20),
            to_rank: u32_at(24),
            channel: u16_at(28),
            flags: u16_at(30),
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
}

impl Waiter for TcpWaiter {
    fn wait(&mut self, timeout: Duration) -> io::Result<()> {
        match self.poll.poll(&mut self.events, Some(timeout)) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            r => r,
        }
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
                what: "data listener",
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

fn read_hello(s: &mut TcpStream, deadline: Instant) -> io::Result<[u8; HELLO_LEN]> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))?;
    let mut b = [0u8; HELLO_LEN];
    s.read_exact(&mut b)?;
    Ok(b)
}

/// Publishes this rank's data address in the store and returns the rank's
/// [`Links`]: a connector that dials higher ranks and accepts lower ones, and a waiter
/// over every link it makes.
pub(crate) fn endpoint(ctx: ConnectCtx) -> Result<Links> {
    let (connector, poll, beacon) = endpoint_parts(ctx)?;
    Ok(Links::new(
        Box::new(connector),
        Box::new(TcpWaiter {
            poll,
            events: Events::with_capacity(64),
        }),
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
    {
        let (acc, me, b) = (accepted.clone(), Identity::of(&ctx), beacon.clone());
        std::thread::Builder::new()
            .name(format!("ferroccl-accept{}", ctx.rank))
            .spawn(move || accept_loop(listener, me, &acc, &b))
            .map_err(|e| Error::io("starting the connection acceptor", e))?;
    }
    Ok((
        TcpConnector {
            ctx,
            registry,
            addrs: HashMap::new(),
            accepted,
        },
        poll,
        beacon,
    ))
}

/// Makes TCP links (see the module docs); `shm` also uses it for control connections.
pub(crate) struct TcpConnector {
    ctx: ConnectCtx,
    registry: mio::Registry,
    addrs: HashMap<usize, SocketAddr>,
    accepted: Arc<Accepted>,
}

impl Drop for TcpConnector {
    fn drop(&mut self) {
        self.accepted.stop.store(true, Ordering::Relaxed);
    }
}

/// Who this rank is, as its handshakes say.
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

    fn hello(&self, to: usize, channel: Channel, status: u16) -> Hello {
        Hello {
            version: PROTOCOL_VERSION,
            status,
            comm_id: self.comm_id,
            rank: self.rank as u32,
            world_size: self.world_size as u32,
            to_rank: to as u32,
            channel: channel.code() as u16,
            flags: if self.token.is_some() { FLAG_AUTH } else { 0 },
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

/// Connections from lower ranks, accepted and acknowledged by the acceptor thread
/// whatever this rank is doing, so a peer dialling it never waits on its main thread.
#[derive(Default)]
struct Accepted {
    state: Mutex<AcceptState>,
    cv: Condvar,
    stop: AtomicBool,
}

#[derive(Default)]
struct AcceptState {
    ready: HashMap<(usize, Channel), TcpStream>,
    /// Links already handed out (a second connection for one is refused).
    taken: HashSet<(usize, Channel)>,
    /// Strangers turned away, for the error if an awaited peer never comes.
    refused: Vec<String>,
}

fn lock_state(a: &Accepted) -> MutexGuard<'_, AcceptState> {
    lock(&a.state)
}

/// Accepts until told to stop; each connection's handshake runs on its own short-lived
/// thread so a silent stranger delays nobody.
fn accept_loop(listener: TcpListener, me: Identity, acc: &Arc<Accepted>, beacon: &Arc<Beacon>) {
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
                    let (acc, beacon, who) = (acc.clone(), beacon.clone(), me.clone());
                    let spawned = std::thread::Builder::new()
                        .name("ferroccl-handshake".into())
                        .spawn(move || handshake_incoming(s, from, who, &acc, &beacon));
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
fn handshake_incoming(
    mut s: TcpStream,
    from: SocketAddr,
    me: Identity,
    acc: &Accepted,
    beacon: &Beacon,
) {
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
    let key = (h.rank as usize, ch.unwrap_or(Channel::Collective));
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
    } else if !status_query && {
        let st = lock_state(acc);
        st.taken.contains(&key) || st.ready.contains_key(&key)
    } {
        refuse::DUPLICATE
    } else {
        0
    };
    if code != 0 {
        let _ = s.write_all(&me.hello(key.0, key.1, code).encode());
        return refuse_with(
            acc,
            format!(
                "{from} claiming rank {} of {} (comm {:#018x}, version {}, channel {}): {}",
                h.rank,
                h.world_size,
                h.comm_id,
                h.version,
                h.channel,
                refuse::text(code)
            ),
        );
    }
    // No lock is held during the exchange: a slow or hostile dialer delays nobody.
    let reply = me.hello(key.0, key.1, 0).encode();
    if let Err(why) = accept_with_proof(&mut s, &me, &raw, &dialer_nonce, &reply, deadline) {
        return refuse_with(acc, format!("{from} (rank {}): {why}", key.0));
    }
    if status_query {
        // A peer asks what this rank is doing: answer from the beacon, whatever this
        // rank's own thread is doing, and hang up.
        let _ = s.write_all(&beacon.raw().to_le_bytes());
        return;
    }
    let mut st = lock_state(acc);
    if st.taken.contains(&key) || st.ready.contains_key(&key) {
        drop(st);
        return refuse_with(acc, format!("{from}: rank {} connected twice", key.0));
    }
    st.ready.insert(key, s);
    drop(st);
    acc.cv.notify_all();
}

impl TcpConnector {
    fn hello(&self, to: usize, channel: Channel, status: u16) -> Hello {
        Identity::of(&self.ctx).hello(to, channel, status)
    }

    fn peer_addr(&mut self, p: usize, deadline: Instant) -> Result<SocketAddr> {
        if let Some(a) = self.addrs.get(&p) {
            return Ok(*a);
        }
        let me = self.ctx.rank;
        let wait = deadline.saturating_duration_since(Instant::now());
        let raw = self
            .ctx
            .store
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
        self.addrs.insert(p, addr);
        Ok(addr)
    }

    /// Connects to higher rank `p` and completes the handshake.
    fn dial(&mut self, p: usize, ch: Channel, deadline: Instant) -> Result<TcpStream> {
        let addr = self.peer_addr(p, deadline)?;
        let who = format!("rank {p} at {addr}");
        let mut s = connect_with_retry(&addr, &self.ctx.opts, deadline).map_err(|e| match e {
            Error::Io { source, .. } => hs_err(&who, format!("could not connect: {source}")),
            e => e,
        })?;
        self.handshake_out(&mut s, p, ch, deadline, &who)?;
        Ok(s)
    }

    /// The dialer's half of the handshake on a fresh connection to rank `p`: hello (and
    /// nonce), the reply checked field by field, and for a job with a token the proof
    /// exchange (the acceptor's proof checked, ours sent, the acceptor's verdict read).
    fn handshake_out(
        &self,
        s: &mut TcpStream,
        p: usize,
        ch: Channel,
        deadline: Instant,
        who: &str,
    ) -> Result<()> {
        let me = self.ctx.rank;
        let io = |e: io::Error| hs_err(who, format!("handshake I/O failed: {e}"));
        let request = self.hello(p, ch, 0).encode();
        let ours = auth::nonce();
        let mut out = request.to_vec();
        if self.ctx.token.is_some() {
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
        if h.comm_id != self.ctx.comm_id {
            return Err(hs_err(
                who,
                format!(
                    "communicator id {:#018x} differs from ours {:#018x}",
                    h.comm_id, self.ctx.comm_id
                ),
            ));
        }
        if h.rank as usize != p
            || h.world_size as usize != self.ctx.world_size
            || h.to_rank as usize != me
            || h.channel as u32 != ch.code()
        {
            return Err(hs_err(
                who,
                format!(
                    "answered as rank {} of {} (to rank {}, channel {}), expected rank {p} of {}",
                    h.rank, h.world_size, h.to_rank, h.channel, self.ctx.world_size
                ),
            ));
        }
        let Some(token) = &self.ctx.token else {
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

    /// Waits for lower rank `p`'s connection on `ch`, accepted by the acceptor thread.
    fn accept_from(&mut self, p: usize, ch: Channel, deadline: Instant) -> Result<TcpStream> {
        let me = self.ctx.rank;
        let mut st = lock_state(&self.accepted);
        loop {
            if let Some(s) = st.ready.remove(&(p, ch)) {
                st.taken.insert((p, ch));
                return Ok(s);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let mut detail = format!(
                    "rank {me}: rank {p} did not connect ({ch:?} channel) within {:?}",
                    self.ctx.opts.connect_timeout
                );
                if !st.refused.is_empty() {
                    detail.push_str(&format!("; refused meanwhile: {}", st.refused.join("; ")));
                }
                return Err(hs_err(format!("rank {p}"), detail));
            }
            st = self
                .accepted
                .cv
                .wait_timeout(st, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

impl TcpConnector {
    /// Asks rank `p`'s acceptor for its beacon.
    fn ask_status(&mut self, p: usize, deadline: Instant) -> Result<Option<(u64, u8)>> {
        let addr = self.peer_addr(p, deadline)?;
        let who = format!("rank {p} at {addr}");
        let mut s = connect_with_retry(&addr, &self.ctx.opts, deadline)?;
        let io = |e: io::Error| hs_err(&who, format!("status query failed: {e}"));
        self.handshake_out(&mut s, p, Channel::Status, deadline, &who)?;
        let mut b = [0u8; 8];
        s.read_exact(&mut b).map_err(io)?;
        Ok(Beacon::decode(u64::from_le_bytes(b)))
    }
}

impl Connector for TcpConnector {
    fn peer_status(&mut self, peer: usize, deadline: Instant) -> Result<Option<(u64, u8)>> {
        super::check_peer(self.ctx.rank, peer, self.ctx.world_size)?;
        self.ask_status(peer, deadline)
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
}

impl TcpConnector {
    /// The connected, handshaken (and, with a job token, authenticated) stream to
    /// `peer` on `channel`, still blocking: the lower rank dials, the higher accepts.
    pub(crate) fn stream(
        &mut self,
        peer: usize,
        channel: Channel,
        deadline: Instant,
    ) -> Result<TcpStream> {
        let me = self.ctx.rank;
        super::check_peer(me, peer, self.ctx.world_size)?;
        if peer > me {
            self.dial(peer, channel, deadline)
        } else {
            self.accept_from(peer, channel, deadline)
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
    pub(crate) fn store(&mut self) -> &mut StoreClient {
        &mut self.ctx.store
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
        };
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        let mut b = h.encode();
        b[..4].copy_from_slice(b"GET ");
        assert!(Hello::decode(&b).unwrap_err().contains("magic"));
    }
}
