//! The acceptor: who this rank is in handshakes, the thread that accepts connections
//! and checks each one's hello and proof, and the connections it files for
//! [`TcpConnector::accept_from`].

use super::*;

/// Who this rank is in the job, as its handshakes say.
#[derive(Clone)]
pub(super) struct Identity {
    pub(super) rank: usize,
    pub(super) world_size: usize,
    pub(super) comm_id: u64,
    pub(super) token: Option<Arc<[u8]>>,
}

impl Identity {
    pub(super) fn of(ctx: &ConnectCtx) -> Self {
        Identity {
            rank: ctx.rank,
            world_size: ctx.world_size,
            comm_id: ctx.comm_id,
            token: ctx.token.as_deref().map(Arc::from),
        }
    }

    /// A hello to job rank `to` on `channel` of `group`.
    pub(super) fn hello(&self, to: usize, channel: Channel, group: u64, status: u16) -> Hello {
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
pub(super) const ACCEPTOR_PROOF: &str = "ferroccl link acceptor";
pub(super) const DIALER_PROOF: &str = "ferroccl link dialer";

/// Acceptor side of a handshake that passed its checks: writes `reply` and, for a job
/// with a token, proves the token and checks the dialer's proof (then confirms with one
/// byte). `Err` says why the dialer was refused.
pub(super) fn accept_with_proof(
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
pub(super) fn read_exact_by(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
) -> io::Result<()> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))?;
    s.read_exact(buf)
}

/// Which stream an accepted connection is: (group, the dialer's job rank, channel).
pub(super) type LinkKey = (u64, usize, Channel);

/// Connections from lower ranks, accepted and acknowledged by the acceptor thread
/// whatever this rank is doing, so a peer dialling it never waits on its main thread;
/// and the beacons of this rank's communicators, by group, which it answers status
/// queries from.
#[derive(Default)]
pub(super) struct Accepted {
    pub(super) state: Mutex<AcceptState>,
    pub(super) cv: Condvar,
    pub(super) stop: AtomicBool,
    pub(super) beacons: Mutex<HashMap<u64, Arc<Beacon>>>,
}

#[derive(Default)]
pub(super) struct AcceptState {
    pub(super) ready: HashMap<LinkKey, TcpStream>,
    /// Links already handed out (a second connection for one is refused).
    pub(super) taken: HashSet<LinkKey>,
    /// Strangers turned away, for the error if an awaited peer never comes.
    pub(super) refused: Vec<String>,
    /// Groups this rank has closed ([`Connector::close`]): their connections are
    /// refused, so a peer linking now fails at once instead of waiting.
    pub(super) closed: HashSet<u64>,
}

pub(super) fn lock_state(a: &Accepted) -> MutexGuard<'_, AcceptState> {
    lock(&a.state)
}

/// Accepts until told to stop; each connection's handshake runs on its own short-lived
/// thread so a silent stranger delays nobody.
pub(super) fn accept_loop(listener: TcpListener, me: Identity, acc: &Arc<Accepted>) {
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
pub(super) fn handshake_incoming(mut s: TcpStream, from: SocketAddr, me: Identity, acc: &Accepted) {
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
