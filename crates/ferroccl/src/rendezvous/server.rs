//! The rank-0 store: accept loop, one thread per connection, the shared key-value state,
//! and the server's side of the job-token exchange.

use super::proto::{
    encode_response, read_header, read_request_body, ErrorCode, ReadError, Request, Response,
    WireError,
};
use crate::error::{Error, Result};
use crate::sync::{lock, wait, wait_timeout_while};
use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hash, Hasher};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How often the accept loop looks at the shutdown flag while nobody connects.
const ACCEPT_POLL: Duration = Duration::from_millis(20);
/// How long a client may take to send the rest of a frame once its header arrived.
const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the server waits on a client that does not read its reply.
const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Stack of a connection thread; it holds no large buffers on the stack.
const CONN_STACK: usize = 256 * 1024;

#[derive(Default)]
struct State {
    kv: HashMap<String, Vec<u8>>,
    joined: HashSet<u64>,
}

/// What the accept thread, the connection threads and the owner share.
struct Shared {
    addr: SocketAddr,
    world_size: usize,
    comm_id: u64,
    /// The job token every connection must prove (see `Job::token` in `crate::config`), if
    /// any.
    token: Option<Vec<u8>>,
    /// The launcher's identity of the job this store serves (see `Job::job_id` in
    /// `crate::config`), if known.
    job_id: Option<String>,
    shutdown: AtomicBool,
    state: Mutex<State>,
    /// Signalled whenever a key changes, and at shutdown.
    changed: Condvar,
    /// A handle on every open connection, so that dropping the server can close them.
    conns: Mutex<HashMap<u64, TcpStream>>,
}

/// The rank-0 key-value store. Dropping it stops serving.
///
/// One accept thread plus one thread per connection; a job has at most a few thousand
/// ranks, each with one connection.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and serves a job of `world_size` ranks.
    ///
    /// An address already in use is [`Error::AddrInUse`]. A fresh random communicator id
    /// is drawn here and handed to every rank that joins.
    pub fn bind(addr: SocketAddr, world_size: usize) -> Result<Self> {
        Self::bind_with_token(addr, world_size, None)
    }

    /// [`StoreServer::bind`] for a job with a token: every connection must first prove
    /// it by HMAC challenge-response (see `Job::token` in `crate::config`); anything else is
    /// refused.
    pub fn bind_with_token(
        addr: SocketAddr,
        world_size: usize,
        token: Option<Vec<u8>>,
    ) -> Result<Self> {
        Self::bind_job(addr, world_size, token, None)
    }

    /// [`StoreServer::bind_with_token`] for a job the launcher names (`job_id`, see
    /// `Job::job_id` in `crate::config`): a JOIN from a rank that names another job is
    /// refused with [`Error::OtherJob`] on that rank, and this store says so in its log;
    /// a JOIN that names no job is served as before.
    pub fn bind_job(
        addr: SocketAddr,
        world_size: usize,
        token: Option<Vec<u8>>,
        job_id: Option<String>,
    ) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::InvalidArgument(
                "a rendezvous store needs a world size of at least 1".into(),
            ));
        }
        let listener = bind_listener(addr)?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io(format!("reading the address of the store at {addr}"), e))?;
        let shared = Arc::new(Shared {
            addr: local,
            world_size,
            comm_id: new_comm_id(local),
            token,
            job_id: job_id.filter(|j| !j.is_empty()),
            shutdown: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            conns: Mutex::new(HashMap::new()),
        });
        let for_thread = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("ferroccl-store-accept".into())
            .spawn(move || accept_loop(listener, for_thread))
            .map_err(|e| Error::io("starting the rendezvous store thread", e))?;
        tracing::debug!(addr = %local, world_size, "rendezvous store listening");
        Ok(Self {
            addr: local,
            shared,
            accept: Some(accept),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The communicator id every rank receives from [`StoreClient::join`](super::StoreClient::join).
    pub fn comm_id(&self) -> u64 {
        self.shared.comm_id
    }

    /// The number of ranks this store serves.
    pub fn world_size(&self) -> usize {
        self.shared.world_size
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        // The accept thread sees the flag within ACCEPT_POLL and closes the listener.
        // Only it registers connections, so once it is gone the registry is complete.
        if let Some(handle) = self.accept.take() {
            if handle.join().is_err() {
                tracing::warn!(addr = %self.addr, "rendezvous store accept thread panicked");
            }
        }
        for (_, stream) in lock(&self.shared.conns).drain() {
            // Unblocks the connection thread's read; it may already be closed.
            let _ = stream.shutdown(Shutdown::Both);
        }
        // Wake GET waiters; notifying under the lock means none can miss it.
        let _state = lock(&self.shared.state);
        self.shared.changed.notify_all();
    }
}

fn bind_listener(addr: SocketAddr) -> Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let context =
        |what: &str, e| Error::io(format!("{what} for the rendezvous store at {addr}"), e);
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
        .map_err(|e| context("creating a socket", e))?;
    // Lets rank 0 of the next job rebind while old connections sit in TIME_WAIT; unlike
    // SO_REUSEPORT it does not let two live listeners share the port.
    socket
        .set_reuse_address(true)
        .map_err(|e| context("setting SO_REUSEADDR", e))?;
    socket.bind(&addr.into()).map_err(|e| {
        if e.kind() == io::ErrorKind::AddrInUse {
            Error::AddrInUse {
                addr,
                what: "rendezvous store".into(),
            }
        } else {
            context("binding", e)
        }
    })?;
    socket.listen(4096).map_err(|e| context("listening", e))?;
    let listener: TcpListener = socket.into();
    listener
        .set_nonblocking(true)
        .map_err(|e| context("making the listener non-blocking", e))?;
    Ok(listener)
}

/// A random 64-bit id, never 0, without a `rand` dependency: `RandomState` is seeded
/// from the OS, and time, pid and address make ids from different stores differ further.
fn new_comm_id(addr: SocketAddr) -> u64 {
    let mut h = RandomState::new().build_hasher();
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
        .hash(&mut h);
    std::process::id().hash(&mut h);
    addr.hash(&mut h);
    match h.finish() {
        0 => 1,
        id => id,
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut next_id: u64 = 0;
    while !shared.shutdown.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                next_id += 1;
                if let Err(e) = spawn_connection(&shared, stream, peer, next_id) {
                    tracing::warn!(%peer, error = %e, "rendezvous store could not serve a connection");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(ACCEPT_POLL),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // E.g. out of file descriptors: keep serving those already connected.
                tracing::warn!(addr = %shared.addr, error = %e, "rendezvous store accept failed");
                std::thread::sleep(ACCEPT_POLL);
            }
        }
    }
}

fn spawn_connection(
    shared: &Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    id: u64,
) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(SERVER_WRITE_TIMEOUT))?;
    lock(&shared.conns).insert(id, stream.try_clone()?);
    let for_thread = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name(format!("ferroccl-store-conn-{id}"))
        .stack_size(CONN_STACK)
        .spawn(move || {
            serve_connection(&for_thread, stream, peer);
            lock(&for_thread.conns).remove(&id);
        });
    if let Err(e) = spawned {
        lock(&shared.conns).remove(&id);
        return Err(e);
    }
    Ok(())
}

fn serve_connection(shared: &Shared, mut stream: TcpStream, peer: SocketAddr) {
    let mut auth = if shared.token.is_some() {
        AuthState::Required
    } else {
        AuthState::Open
    };
    loop {
        // Between requests a client may stay idle for the whole job: no read timeout.
        let request = read_header(&mut stream).and_then(|header| {
            if let Err(e) = stream.set_read_timeout(Some(BODY_TIMEOUT)) {
                return Err(ReadError::Io(e));
            }
            let request = read_request_body(&mut stream, header);
            if let Err(e) = stream.set_read_timeout(None) {
                return Err(ReadError::Io(e));
            }
            request
        });
        let request = match request {
            Ok(request) => request,
            Err(ReadError::Closed) => return,
            Err(ReadError::Io(e)) => {
                if !shared.shutdown.load(Ordering::SeqCst) {
                    tracing::debug!(%peer, error = %e, "rendezvous store connection failed");
                }
                return;
            }
            Err(ReadError::Wire(err)) => {
                reject(&mut stream, peer, &err);
                return;
            }
        };
        let response = match shared.authenticate(&mut auth, request, peer) {
            Ok(request) => shared.handle(request),
            Err(response) => response,
        };
        let closes = matches!(&response, Response::Error { code, .. }
            if ErrorCode::from_u8(*code).is_some_and(ErrorCode::closes_connection));
        if stream.write_all(&encode_response(&response)).is_err() || closes {
            return;
        }
    }
}

/// Tells a peer that broke the protocol why (if it can still hear) and lets it go.
fn reject(stream: &mut TcpStream, peer: SocketAddr, err: &WireError) {
    tracing::warn!(%peer, code = ?err.code, "rendezvous store rejected a connection: {}", err.message);
    let frame = encode_response(&Response::Error {
        code: err.code as u8,
        message: err.message.clone(),
    });
    if stream.write_all(&frame).is_err() || stream.shutdown(Shutdown::Write).is_err() {
        return;
    }
    // Closing with unread input would send a reset, which can destroy the error frame
    // before the peer reads it; read (and discard) a bounded amount first.
    if stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .is_err()
    {
        return;
    }
    let until = Instant::now() + Duration::from_millis(500);
    let mut buf = [0u8; 4096];
    let mut total = 0usize;
    while total < 64 * 1024 && Instant::now() < until {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => total += n,
        }
    }
}

/// Where a connection stands with the job token.
enum AuthState {
    /// The store has no token.
    Open,
    /// Nothing proven yet.
    Required,
    /// Challenge sent; waiting for the client's proof.
    Challenged {
        client: [u8; super::auth::NONCE_LEN],
        server: [u8; super::auth::NONCE_LEN],
    },
    /// The client proved the token.
    Proven,
}

impl Shared {
    /// Runs the authentication exchange; hands back the requests a connection may make
    /// (all of them once the token is proven, or when the store has none).
    fn authenticate(
        &self,
        st: &mut AuthState,
        request: Request,
        peer: SocketAddr,
    ) -> std::result::Result<Request, Response> {
        let refuse = |why: &str| {
            tracing::warn!(%peer, "rendezvous store refused a client: {why}");
            Self::error(ErrorCode::Unauthorized, why.to_owned())
        };
        match (&*st, request, self.token.as_deref()) {
            (AuthState::Open | AuthState::Proven, Request::Auth { .. } | Request::Proof { .. }, None) => Err(refuse(
                "this job's store uses no job token but the client sent one: is FERROCCL_TOKEN set on some ranks only?",
            )),
            (AuthState::Open | AuthState::Proven, request, _) => Ok(request),
            // Who holds this port is no secret, and a rank 0 that cannot bind asks it.
            (_, Request::Who, _) => Ok(Request::Who),
            (AuthState::Required, Request::Auth { nonce }, Some(token)) => {
                let server = super::auth::nonce();
                let mac = super::auth::mac(token, "ferroccl store server", &[&nonce, &server]);
                *st = AuthState::Challenged { client: nonce, server };
                Err(Response::Challenge { nonce: server, mac })
            }
            (AuthState::Challenged { client, server }, Request::Proof { mac }, Some(token)) => {
                if super::auth::verify(token, "ferroccl store client", &[client, server], &mac) {
                    *st = AuthState::Proven;
                    Err(Response::Done)
                } else {
                    Err(refuse("the client's proof of the job token is wrong: another job, or a different FERROCCL_TOKEN"))
                }
            }
            _ => Err(refuse(
                "this job requires a job token: authenticate first (set the same FERROCCL_TOKEN on every rank)",
            )),
        }
    }

    fn error(code: ErrorCode, message: String) -> Response {
        Response::Error {
            code: code as u8,
            message,
        }
    }

    fn handle(&self, request: Request) -> Response {
        match request {
            Request::Join {
                rank,
                world_size,
                job_id,
            } => self.join(rank, world_size, &job_id),
            Request::Who => Response::Value(self.job_id.clone().unwrap_or_default().into_bytes()),
            Request::Set { key, value } => {
                lock(&self.state).kv.insert(key, value);
                self.changed.notify_all();
                Response::Done
            }
            Request::Get { key, timeout_ms } => self.get(&key, timeout_ms),
            Request::Add { key, delta } => self.add(key, delta),
            Request::Time => Response::Count(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as i64),
            ),
            // Only reachable once authenticated; a second exchange is not expected.
            Request::Auth { .. } | Request::Proof { .. } => {
                Self::error(ErrorCode::Unauthorized, "already authenticated".into())
            }
        }
    }

    fn join(&self, rank: u64, world_size: u64, job_id: &str) -> Response {
        // Another job's rank first: its world size and rank mean nothing here.
        if let Some(ours) = &self.job_id {
            if !job_id.is_empty() && job_id != ours {
                tracing::warn!(
                    store = %self.addr,
                    "a rank of another job ({job_id}) tried to join this job's store ({ours}); \
                     refused: give each job its own MASTER_PORT"
                );
                return Self::error(ErrorCode::OtherJob, format!("{ours}\n{job_id}"));
            }
        }
        let maybe_other = if job_id.is_empty() || self.job_id.is_none() {
            " (or another job, launched without a job identity, is using this store's port)"
        } else {
            ""
        };
        if world_size != self.world_size as u64 {
            return Self::error(
                ErrorCode::WorldSize,
                format!(
                    "rank {rank} has WORLD_SIZE={world_size} but the store at {} serves a job \
                     of {} ranks{maybe_other}",
                    self.addr, self.world_size
                ),
            );
        }
        if rank >= world_size {
            return Self::error(
                ErrorCode::RankRange,
                format!(
                    "rank {rank} is out of range for a job of {world_size} ranks (ranks are \
                     0..{world_size})"
                ),
            );
        }
        if !lock(&self.state).joined.insert(rank) {
            return Self::error(
                ErrorCode::DuplicateRank,
                format!(
                    "rank {rank} joined twice: two processes of this job were launched with \
                     rank {rank}{maybe_other}"
                ),
            );
        }
        tracing::debug!(rank, world_size, store = %self.addr, "rank joined the rendezvous store");
        Response::Joined {
            comm_id: self.comm_id,
        }
    }

    fn get(&self, key: &str, timeout_ms: u64) -> Response {
        let timeout = Duration::from_millis(timeout_ms);
        // A timeout too long to represent waits until the key is set or the store stops.
        let deadline = Instant::now().checked_add(timeout);
        let mut state = lock(&self.state);
        loop {
            if self.shutdown.load(Ordering::SeqCst) {
                return Self::error(ErrorCode::ShuttingDown, "the store is shutting down".into());
            }
            if let Some(value) = state.kv.get(key) {
                return Response::Value(value.clone());
            }
            state = match deadline {
                None => wait(&self.changed, state),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Self::error(
                            ErrorCode::Timeout,
                            format!("key '{key}' was not set within {timeout:?}"),
                        );
                    }
                    wait_timeout_while(&self.changed, state, deadline - now, |state| {
                        !state.kv.contains_key(key) && !self.shutdown.load(Ordering::SeqCst)
                    })
                }
            };
        }
    }

    fn add(&self, key: String, delta: i64) -> Response {
        let mut state = lock(&self.state);
        let current = match state.kv.get(&key) {
            None => 0,
            Some(v) => match std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
            {
                Some(n) => n,
                None => {
                    return Self::error(
                        ErrorCode::NotCounter,
                        format!("key '{key}' holds a value that is not a counter"),
                    )
                }
            },
        };
        let Some(new) = current.checked_add(delta) else {
            return Self::error(
                ErrorCode::NotCounter,
                format!("counter '{key}' would overflow: {current} + {delta}"),
            );
        };
        state.kv.insert(key, new.to_string().into_bytes());
        drop(state);
        self.changed.notify_all();
        Response::Count(new)
    }
}

#[cfg(test)]
mod tests {
    use super::super::client::StoreClient;
    use super::super::proto::{header, kind, read_response};
    use super::*;
    use std::sync::mpsc;

    /// Runs `f` on a thread and fails the test if it does not finish within `limit`.
    fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(limit) {
            Ok(v) => v,
            Err(e) => panic!("test body did not finish within {limit:?}: {e}"),
        }
    }

    fn loopback_server(world_size: usize) -> StoreServer {
        match StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), world_size) {
            Ok(s) => s,
            Err(e) => panic!("bind: {e}"),
        }
    }

    /// Sends `bytes` on a raw connection and returns the reply frame, if any.
    fn raw_exchange(addr: SocketAddr, bytes: &[u8]) -> Option<Response> {
        let mut s = TcpStream::connect(addr).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
        s.write_all(bytes).ok()?;
        read_response(&mut s).ok()
    }

    fn assert_serves_a_proper_client(addr: SocketAddr) {
        let mut c = StoreClient::connect(&addr.to_string(), Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("connect: {e}"));
        c.set("after-stranger", b"ok")
            .unwrap_or_else(|e| panic!("set: {e}"));
        let v = c.get("after-stranger", Duration::from_secs(1));
        assert_eq!(v.ok().as_deref(), Some(&b"ok"[..]));
    }

    #[test]
    fn strangers_are_rejected_and_the_server_serves_on() {
        within(Duration::from_secs(20), || {
            let server = loopback_server(2);
            let addr = server.local_addr();
            let mut wrong_version = header(kind::JOIN, 16);
            wrong_version[4..6].copy_from_slice(&2u16.to_le_bytes());
            wrong_version.extend_from_slice(&[0; 16]);
            let strangers: [(&[u8], &str); 3] = [
                (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "magic"),
                (&[0xde, 0xad, 0xbe, 0xef, 1, 0, 1, 0, 0, 0, 0, 0], "magic"),
                (&wrong_version, "version 2"),
            ];
            for (bytes, needle) in strangers {
                match raw_exchange(addr, bytes) {
                    Some(Response::Error { code, message }) => {
                        assert_eq!(code, ErrorCode::Malformed as u8);
                        assert!(message.contains(needle), "{message}");
                    }
                    other => panic!("stranger {bytes:?} got {other:?}"),
                }
            }
            // A stranger that sends a few bytes and hangs up must not hurt either.
            if let Ok(mut s) = TcpStream::connect(addr) {
                let _ = s.write_all(b"FC");
            }
            assert_serves_a_proper_client(addr);
        });
    }

    #[test]
    fn oversize_value_is_refused_without_reading_it() {
        within(Duration::from_secs(20), || {
            let server = loopback_server(2);
            let addr = server.local_addr();
            // Claims a 4 GiB SET but sends only a few bytes of it: the error must come
            // back at once, which it cannot if the server waited for (or allocated) the body.
            let mut bytes = header(kind::SET, u32::MAX);
            bytes.extend_from_slice(&1u32.to_le_bytes());
            bytes.push(b'k');
            let started = Instant::now();
            match raw_exchange(addr, &bytes) {
                Some(Response::Error { code, message }) => {
                    assert_eq!(code, ErrorCode::TooLarge as u8);
                    assert!(message.contains("exceeds"), "{message}");
                }
                other => panic!("got {other:?}"),
            }
            assert!(started.elapsed() < Duration::from_secs(2));
            assert_serves_a_proper_client(addr);
        });
    }

    #[test]
    fn a_dropped_server_wakes_waiting_clients() {
        within(Duration::from_secs(20), || {
            let server = loopback_server(1);
            let addr = server.local_addr().to_string();
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let r = StoreClient::connect(&addr, Duration::from_secs(2))
                    .and_then(|mut c| c.get("never", Duration::from_secs(60)));
                let _ = tx.send(r);
            });
            std::thread::sleep(Duration::from_millis(200));
            let started = Instant::now();
            drop(server);
            assert!(
                started.elapsed() < Duration::from_secs(1),
                "drop took {:?}",
                started.elapsed()
            );
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok(Err(Error::Rendezvous(_))) | Ok(Err(Error::Io { .. })) => {}
                other => panic!("expected an error once the store is gone, got {other:?}"),
            }
        });
    }
}
