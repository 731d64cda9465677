//! Sockets: options, congestion control, listening, dialling with retries.

use super::*;

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

pub(super) fn new_socket(addr: &SocketAddr, opts: &SocketOpts) -> Result<Socket> {
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
pub(super) fn congestion_of(s: &Socket) -> io::Result<String> {
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
pub(super) enum AutoCongestion {
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
pub(super) fn auto_congestion(current: &str, mut set: impl FnMut(&str) -> bool) -> AutoCongestion {
    if !current.starts_with("bbr") {
        return AutoCongestion::Kept;
    }
    ["cubic", "reno"]
        .into_iter()
        .find(|alt| set(alt))
        .map_or(AutoCongestion::Stuck, AutoCongestion::Replaced)
}

/// Gives `s` the congestion control `want` asks for (see [`TcpCongestion`]).
pub(super) fn set_congestion(s: &Socket, want: &TcpCongestion) -> Result<()> {
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

pub(super) fn connect_with_retry(
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
