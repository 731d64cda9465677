//! A rank's connection to the store: connect with retry and backoff, the client's side
//! of the job-token exchange, and JOIN, SET, GET, ADD and WHO.

use super::proto::{
    encode_request, read_response, ErrorCode, ReadError, Request, Response, MAX_JOB_ID_LEN,
    MAX_KEY_LEN, MAX_VALUE_LEN,
};
use crate::error::{Error, Result};
use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// First pause between connection attempts; it doubles up to [`MAX_BACKOFF`].
const INITIAL_BACKOFF: Duration = Duration::from_millis(10);
/// Longest pause between connection attempts.
const MAX_BACKOFF: Duration = Duration::from_millis(250);
/// How long a JOIN, SET or ADD may wait for its reply, and any request for its send.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// How much longer than its own timeout a GET waits for the reply: a quarter of the
/// timeout, from 100 ms to 5 s (a short GET, such as a timed-out rank's lookup of a
/// peer's address, must not outlast its caller's deadline by seconds).
fn get_margin(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(5))
}

/// What is left until `end`, at least 50 ms (a reply that is on its way gets to land).
fn left(end: Instant) -> Duration {
    end.saturating_duration_since(Instant::now())
        .max(Duration::from_millis(50))
}

/// A connection to the store.
///
/// Every call has a deadline. After an I/O or protocol failure the connection is
/// broken and later calls fail at once; connect again to go on.
pub struct StoreClient {
    stream: TcpStream,
    local: SocketAddr,
    addr: String,
    broken: Option<String>,
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreClient")
            .field("addr", &self.addr)
            .field("local", &self.local)
            .field("broken", &self.broken)
            .finish()
    }
}

/// Why one connection attempt failed.
enum Attempt {
    /// Worth retrying (refused, unreachable, name not resolvable yet).
    Retry(String),
    /// Retrying cannot help (the address is malformed).
    Fatal(Error),
}

fn try_connect(addr: &str, timeout: Duration) -> std::result::Result<TcpStream, Attempt> {
    let resolved: Vec<SocketAddr> = match addr.to_socket_addrs() {
        Ok(it) => it.collect(),
        Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
            return Err(Attempt::Fatal(Error::InvalidArgument(format!(
                "rendezvous store address '{addr}' is not host:port: {e}"
            ))))
        }
        Err(e) => return Err(Attempt::Retry(format!("resolving {addr}: {e}"))),
    };
    let mut last = format!("{addr} resolved to no addresses");
    for sa in resolved {
        match TcpStream::connect_timeout(&sa, timeout) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = format!("connecting to {sa}: {e}"),
        }
    }
    Err(Attempt::Retry(last))
}

/// A TCP connection to `addr` (`host:port`), retrying refused or unreachable attempts
/// with a backoff from 10 ms to 250 ms until `deadline`: [`Error::StoreUnreachable`]
/// with the last error then, [`Error::InvalidArgument`] at once for a malformed
/// address. Every store client of the crate connects through it.
pub(super) fn connect_retrying(addr: &str, deadline: Duration) -> Result<TcpStream> {
    let start = Instant::now();
    let mut backoff = INITIAL_BACKOFF;
    loop {
        let remaining = deadline.saturating_sub(start.elapsed());
        let per_attempt = remaining.max(Duration::from_millis(10));
        let detail = match try_connect(addr, per_attempt) {
            Ok(stream) => return Ok(stream),
            Err(Attempt::Fatal(e)) => return Err(e),
            Err(Attempt::Retry(detail)) => detail,
        };
        let elapsed = start.elapsed();
        if elapsed >= deadline {
            return Err(Error::StoreUnreachable {
                addr: addr.to_owned(),
                after: elapsed,
                detail,
            });
        }
        tracing::trace!(addr, %detail, "rendezvous store not reachable yet; retrying");
        std::thread::sleep(backoff.min(deadline - elapsed));
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

impl StoreClient {
    /// Connects to `addr` (`host:port`), retrying until `deadline` passes.
    ///
    /// Refused or unreachable connections are retried with a backoff from 10 ms to
    /// 250 ms while rank 0 comes up; when `deadline` has passed the result is
    /// [`Error::StoreUnreachable`] with the last error. A malformed address is
    /// [`Error::InvalidArgument`] at once.
    pub fn connect(addr: &str, deadline: Duration) -> Result<Self> {
        Self::connect_with_token(addr, deadline, None)
    }

    /// [`StoreClient::connect`], then proves the job `token` to the store and checks
    /// that the store knows it too (HMAC challenge-response; the token never travels).
    pub fn connect_with_token(
        addr: &str,
        deadline: Duration,
        token: Option<&[u8]>,
    ) -> Result<Self> {
        // The whole of it, answers included, by `deadline`: a program that holds the
        // port and accepts, but says nothing, costs no more than that.
        let end = Instant::now() + deadline;
        let mut c = Self::connect_plain(addr, deadline)?;
        if let Some(token) = token {
            c.prove(token, end)?;
        }
        Ok(c)
    }

    fn prove(&mut self, token: &[u8], end: Instant) -> Result<()> {
        let what = "authenticating with the job token";
        let client = super::auth::nonce();
        let (server, mac) = match self.call(what, &Request::Auth { nonce: client }, left(end))? {
            Response::Challenge { nonce, mac } => (nonce, mac),
            other => return Err(self.unexpected(what, &other)),
        };
        if !super::auth::verify(token, "ferroccl store server", &[&client, &server], &mac) {
            let message = format!(
                "the store at {} could not prove the job token: a store of another job, or a different FERROCCL_TOKEN",
                self.addr
            );
            self.broken = Some(message.clone());
            return Err(Error::Rendezvous(message));
        }
        let proof = super::auth::mac(token, "ferroccl store client", &[&client, &server]);
        match self.call(what, &Request::Proof { mac: proof }, left(end))? {
            Response::Done => Ok(()),
            other => Err(self.unexpected(what, &other)),
        }
    }

    fn connect_plain(addr: &str, deadline: Duration) -> Result<Self> {
        Self::from_stream(addr, connect_retrying(addr, deadline)?)
    }

    fn from_stream(addr: &str, stream: TcpStream) -> Result<Self> {
        let context =
            |what: &str, e| Error::io(format!("{what} to the rendezvous store at {addr}"), e);
        stream
            .set_nodelay(true)
            .map_err(|e| context("setting TCP_NODELAY on the connection", e))?;
        stream
            .set_write_timeout(Some(REPLY_TIMEOUT))
            .map_err(|e| context("setting a write timeout on the connection", e))?;
        let local = stream
            .local_addr()
            .map_err(|e| context("reading the local address of the connection", e))?;
        Ok(Self {
            stream,
            local,
            addr: addr.to_owned(),
            broken: None,
        })
    }

    /// Joins as `rank` of `world_size`; returns the communicator id of the job.
    ///
    /// A `world_size` that differs from the store's is [`Error::Env`] (the launcher
    /// environments of the ranks disagree); an out-of-range or duplicate rank is
    /// [`Error::Rendezvous`].
    pub fn join(&mut self, rank: usize, world_size: usize) -> Result<u64> {
        self.join_job(rank, world_size, None)
    }

    /// [`StoreClient::join`] naming this rank's job (the launcher's job identity, see
    /// `Job::job_id` in `crate::config`): a store that serves another named job refuses
    /// it with [`Error::OtherJob`].
    pub fn join_job(
        &mut self,
        rank: usize,
        world_size: usize,
        job_id: Option<&str>,
    ) -> Result<u64> {
        self.join_job_within(rank, world_size, job_id, REPLY_TIMEOUT)
    }

    /// [`StoreClient::join_job`] waiting at most `timeout` for the store's answer
    /// (what is left of a join's connect timeout).
    pub fn join_job_within(
        &mut self,
        rank: usize,
        world_size: usize,
        job_id: Option<&str>,
        timeout: Duration,
    ) -> Result<u64> {
        let what = format!("JOIN as rank {rank} of {world_size}");
        let ours = job_id.unwrap_or_default();
        if ours.len() > MAX_JOB_ID_LEN {
            return Err(Error::InvalidArgument(format!(
                "job identity of {} bytes exceeds the store's limit of {MAX_JOB_ID_LEN} bytes",
                ours.len()
            )));
        }
        let request = Request::Join {
            rank: rank as u64,
            world_size: world_size as u64,
            job_id: ours.to_owned(),
        };
        match self.call(&what, &request, timeout)? {
            Response::Joined { comm_id } => Ok(comm_id),
            other => Err(self.unexpected(&what, &other)),
        }
    }

    /// The identity of the job this store serves, as its launcher named it (`None`:
    /// the store's job has none). Asked without the job token, so that a rank 0 that
    /// finds its port taken can say whose store holds it.
    pub fn who(&mut self) -> Result<Option<String>> {
        self.who_within(REPLY_TIMEOUT)
    }

    /// [`StoreClient::who`], waiting at most `timeout` for the answer (something other
    /// than a ferroccl store may hold the port, and never answer).
    pub fn who_within(&mut self, timeout: Duration) -> Result<Option<String>> {
        match self.call("WHO", &Request::Who, timeout)? {
            Response::Value(v) if v.is_empty() => Ok(None),
            Response::Value(v) => Ok(Some(String::from_utf8_lossy(&v).into_owned())),
            other => Err(self.unexpected("WHO", &other)),
        }
    }

    /// Publishes `value` under `key`, replacing any earlier value.
    ///
    /// A key over [`MAX_KEY_LEN`] or a value over [`MAX_VALUE_LEN`] bytes is
    /// [`Error::InvalidArgument`], and nothing is sent.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        if value.len() > MAX_VALUE_LEN {
            return Err(Error::InvalidArgument(format!(
                "value of {} bytes for key '{key}' exceeds the store's limit of {MAX_VALUE_LEN} bytes",
                value.len()
            )));
        }
        let what = format!("SET '{key}'");
        let request = Request::Set {
            key: key.to_owned(),
            value: value.to_vec(),
        };
        match self.call(&what, &request, REPLY_TIMEOUT)? {
            Response::Done => Ok(()),
            other => Err(self.unexpected(&what, &other)),
        }
    }

    /// Returns the value of `key`, waiting up to `timeout` for some rank to set it.
    ///
    /// The store does the waiting; a key still unset at `timeout` is
    /// [`Error::Rendezvous`].
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        check_key(key)?;
        let what = format!("GET '{key}'");
        let request = Request::Get {
            key: key.to_owned(),
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        };
        match self.call(&what, &request, timeout.saturating_add(get_margin(timeout)))? {
            Response::Value(v) => Ok(v),
            other => Err(self.unexpected(&what, &other)),
        }
    }

    /// Adds `delta` to the counter under `key` (absent counts as 0) and returns the new
    /// value. Atomic across ranks, so it can count arrivals at a barrier.
    ///
    /// The counter is stored as decimal ASCII, so [`get`](Self::get) reads it too; a key
    /// holding anything else, or an overflow, is [`Error::Rendezvous`].
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        check_key(key)?;
        let what = format!("ADD '{key}'");
        let request = Request::Add {
            key: key.to_owned(),
            delta,
        };
        match self.call(&what, &request, REPLY_TIMEOUT)? {
            Response::Count(n) => Ok(n),
            other => Err(self.unexpected(&what, &other)),
        }
    }

    /// Estimates this machine's clock minus the store's (nanoseconds), from the
    /// fastest of `rounds` round trips: `(offset, error bound)`, the bound being half
    /// that round trip. For the flight recorder, which puts every rank's times on the
    /// store host's clock.
    pub fn clock_offset(&mut self, rounds: usize) -> Result<(i64, u64)> {
        let now = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as i64)
        };
        let mut best: Option<(i64, u64)> = None;
        for _ in 0..rounds.max(1) {
            let t0 = now();
            let server = match self.call("TIME", &Request::Time, REPLY_TIMEOUT)? {
                Response::Count(n) => n,
                other => return Err(self.unexpected("TIME", &other)),
            };
            let t1 = now();
            let half = ((t1 - t0).max(0) / 2) as u64;
            let offset = t0 + half as i64 - server;
            if best.is_none_or(|(_, e)| half < e) {
                best = Some((offset, half));
            }
        }
        Ok(best.unwrap_or((0, 0)))
    }

    /// The local address of the connection: the interface through which this host
    /// reaches the store, and so the one to publish for peers.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Sends one request and reads its reply, turning ERROR replies into errors.
    fn call(&mut self, what: &str, request: &Request, reply_timeout: Duration) -> Result<Response> {
        if let Some(why) = &self.broken {
            return Err(Error::Rendezvous(format!(
                "{what}: the connection to the store at {} broke earlier ({why}); connect again",
                self.addr
            )));
        }
        let response = match self.exchange(what, request, reply_timeout) {
            Ok(response) => response,
            Err(e) => {
                self.broken = Some(e.to_string());
                return Err(e);
            }
        };
        let Response::Error { code, message } = response else {
            return Ok(response);
        };
        let code = ErrorCode::from_u8(code);
        if code.is_none_or(ErrorCode::closes_connection) {
            self.broken = Some(message.clone());
        }
        if code == Some(ErrorCode::OtherJob) {
            // The store's job, then ours as we sent it, one per line.
            let (theirs, ours) = message.split_once('\n').unwrap_or((&message, ""));
            return Err(Error::OtherJob {
                addr: self.addr.clone(),
                theirs: theirs.to_owned(),
                ours: ours.to_owned(),
            });
        }
        Err(match code {
            Some(ErrorCode::WorldSize) => Error::Env(message),
            _ => Error::Rendezvous(format!("{what}: {message}")),
        })
    }

    fn exchange(
        &mut self,
        what: &str,
        request: &Request,
        reply_timeout: Duration,
    ) -> Result<Response> {
        let addr = &self.addr;
        self.stream
            .set_read_timeout(Some(reply_timeout))
            .map_err(|e| Error::io(format!("{what}: setting a read timeout"), e))?;
        self.stream
            .write_all(&encode_request(request))
            .map_err(|e| Error::io(format!("{what}: sending to the store at {addr}"), e))?;
        read_response(&mut self.stream).map_err(|e| match e {
            ReadError::Closed => Error::Rendezvous(format!(
                "{what}: the store at {addr} closed the connection (did rank 0 exit?)"
            )),
            ReadError::Io(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Error::Rendezvous(format!(
                    "{what}: the store at {addr} did not answer within {reply_timeout:?}"
                ))
            }
            ReadError::Io(e) => Error::io(
                format!("{what}: reading the reply of the store at {addr}"),
                e,
            ),
            ReadError::Wire(w) => Error::Rendezvous(format!(
                "{what}: the store at {addr} sent a bad reply: {}",
                w.message
            )),
        })
    }

    fn unexpected(&mut self, what: &str, response: &Response) -> Error {
        let kind = match response {
            Response::Joined { .. } => "JOINED",
            Response::Done => "DONE",
            Response::Value(_) => "VALUE",
            Response::Count(_) => "COUNT",
            Response::Challenge { .. } => "CHALLENGE",
            Response::Error { .. } => "ERROR",
        };
        let message = format!(
            "{what}: the store at {} answered with an unexpected {kind} reply",
            self.addr
        );
        self.broken = Some(message.clone());
        Error::Rendezvous(message)
    }
}

fn check_key(key: &str) -> Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(Error::InvalidArgument(format!(
            "key of {} bytes exceeds the store's limit of {MAX_KEY_LEN} bytes",
            key.len()
        )));
    }
    Ok(())
}
