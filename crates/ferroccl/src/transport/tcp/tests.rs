//! The TCP transport's unit tests.

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
        let allowed = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
            .unwrap_or_default();
        // reno may always be set by root, and by anyone where it is allowed.
        if crate::sys::shm::effective_uid() == 0 || allowed.split_whitespace().any(|a| a == "reno")
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
