//! The rendezvous store over real loopback sockets, through the public API only.
//!
//! Every test runs its body under a deadline, so a broken store fails the test instead
//! of hanging it.

use ferroccl::rendezvous::{StoreClient, StoreServer, MAX_KEY_LEN, MAX_VALUE_LEN};
use ferroccl::Error;
use std::net::{SocketAddr, TcpListener};
use std::sync::mpsc;
use std::time::{Duration, Instant};

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

fn server(world_size: usize) -> StoreServer {
    StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), world_size)
        .unwrap_or_else(|e| panic!("bind: {e}"))
}

fn client(server: &StoreServer) -> StoreClient {
    StoreClient::connect(&server.local_addr().to_string(), Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("connect: {e}"))
}

/// A loopback port that nobody listens on (bound, then released).
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind: {e}"));
    l.local_addr()
        .unwrap_or_else(|e| panic!("local_addr: {e}"))
        .port()
}

#[test]
fn ranks_publish_and_find_each_other_across_threads() {
    within(Duration::from_secs(20), || {
        let world_size = 7;
        let server = server(world_size);
        let addr = server.local_addr().to_string();
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let addr = addr.clone();
                std::thread::spawn(move || -> Result<(u64, Vec<Vec<u8>>), Error> {
                    let mut c = StoreClient::connect(&addr, Duration::from_secs(2))?;
                    let id = c.join(rank, world_size)?;
                    c.set(&format!("addr/{rank}"), format!("peer-{rank}").as_bytes())?;
                    let all = (0..world_size)
                        .map(|r| c.get(&format!("addr/{r}"), Duration::from_secs(5)))
                        .collect::<Result<Vec<_>, _>>()?;
                    Ok((id, all))
                })
            })
            .collect();
        for (rank, h) in handles.into_iter().enumerate() {
            let (id, all) = match h.join() {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => panic!("rank {rank}: {e}"),
                Err(_) => panic!("rank {rank} panicked"),
            };
            assert_eq!(
                id,
                server.comm_id(),
                "rank {rank} got another communicator id"
            );
            for (r, v) in all.iter().enumerate() {
                assert_eq!(
                    v,
                    format!("peer-{r}").as_bytes(),
                    "rank {rank} reading rank {r}"
                );
            }
        }
    });
}

#[test]
fn get_waits_for_a_later_set() {
    within(Duration::from_secs(20), || {
        let server = server(2);
        let mut setter = client(&server);
        let mut getter = client(&server);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            setter.set("late", b"here")
        });
        let started = Instant::now();
        let got = getter.get("late", Duration::from_secs(10));
        let waited = started.elapsed();
        assert_eq!(got.ok().as_deref(), Some(&b"here"[..]));
        assert!(
            waited >= Duration::from_millis(250),
            "returned after {waited:?}"
        );
        assert!(matches!(t.join(), Ok(Ok(()))));
    });
}

#[test]
fn get_of_an_unset_key_times_out_with_an_error() {
    within(Duration::from_secs(20), || {
        let server = server(1);
        let mut c = client(&server);
        let started = Instant::now();
        let r = c.get("nobody/sets/this", Duration::from_millis(300));
        let waited = started.elapsed();
        match r {
            Err(Error::Rendezvous(msg)) => assert!(msg.contains("nobody/sets/this"), "{msg}"),
            other => panic!("expected Error::Rendezvous, got {other:?}"),
        }
        assert!(
            waited >= Duration::from_millis(280),
            "gave up after {waited:?}"
        );
        // The connection is still good after a timeout.
        assert!(c.set("k", b"v").is_ok());
        assert_eq!(c.get("k", Duration::ZERO).ok().as_deref(), Some(&b"v"[..]));
    });
}

#[test]
fn world_size_mismatch_names_both_sizes() {
    within(Duration::from_secs(20), || {
        let server = server(8);
        let mut c = client(&server);
        match c.join(3, 4) {
            Err(Error::Env(msg)) => {
                assert!(msg.contains("rank 3"), "{msg}");
                assert!(msg.contains("WORLD_SIZE=4"), "{msg}");
                assert!(msg.contains("8 ranks"), "{msg}");
                assert!(msg.contains(&server.local_addr().to_string()), "{msg}");
            }
            other => panic!("expected Error::Env, got {other:?}"),
        }
        // The mismatch did not register rank 3: it can still join correctly.
        assert_eq!(c.join(3, 8).ok(), Some(server.comm_id()));
    });
}

#[test]
fn a_rank_cannot_join_twice() {
    within(Duration::from_secs(20), || {
        let server = server(4);
        let mut first = client(&server);
        let mut second = client(&server);
        assert_eq!(first.join(2, 4).ok(), Some(server.comm_id()));
        match second.join(2, 4) {
            Err(Error::Rendezvous(msg)) => assert!(msg.contains("rank 2 joined twice"), "{msg}"),
            other => panic!("expected Error::Rendezvous, got {other:?}"),
        }
        assert_eq!(second.join(1, 4).ok(), Some(server.comm_id()));
    });
}

#[test]
fn an_out_of_range_rank_is_refused() {
    within(Duration::from_secs(20), || {
        let server = server(4);
        let mut c = client(&server);
        match c.join(4, 4) {
            Err(Error::Rendezvous(msg)) => {
                assert!(msg.contains("rank 4 is out of range"), "{msg}")
            }
            other => panic!("expected Error::Rendezvous, got {other:?}"),
        }
    });
}

#[test]
fn add_is_an_atomic_counter() {
    within(Duration::from_secs(20), || {
        let server = server(8);
        let addr = server.local_addr().to_string();
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let addr = addr.clone();
                std::thread::spawn(move || -> Result<Vec<i64>, Error> {
                    let mut c = StoreClient::connect(&addr, Duration::from_secs(2))?;
                    (0..25).map(|_| c.add("arrivals", 1)).collect()
                })
            })
            .collect();
        let mut seen: Vec<i64> = Vec::new();
        for h in handles {
            match h.join() {
                Ok(Ok(v)) => seen.extend(v),
                other => panic!("adder failed: {other:?}"),
            }
        }
        // Every increment saw a distinct value: no lost updates.
        seen.sort_unstable();
        assert_eq!(seen, (1..=200).collect::<Vec<i64>>());
        let mut c = client(&server);
        assert_eq!(
            c.get("arrivals", Duration::ZERO).ok().as_deref(),
            Some(&b"200"[..])
        );
        assert_eq!(c.add("arrivals", -200).ok(), Some(0));
        // A key that holds something else is not a counter.
        assert!(c.set("text", b"hello").is_ok());
        assert!(matches!(c.add("text", 1), Err(Error::Rendezvous(_))));
        assert!(c.set("big", i64::MAX.to_string().as_bytes()).is_ok());
        assert!(matches!(c.add("big", 1), Err(Error::Rendezvous(_))));
    });
}

#[test]
fn oversize_keys_and_values_are_refused_by_the_client() {
    within(Duration::from_secs(20), || {
        let server = server(1);
        let mut c = client(&server);
        let big = vec![0u8; MAX_VALUE_LEN + 1];
        assert!(matches!(c.set("k", &big), Err(Error::InvalidArgument(_))));
        let long_key = "k".repeat(MAX_KEY_LEN + 1);
        assert!(matches!(
            c.set(&long_key, b"v"),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            c.get(&long_key, Duration::ZERO),
            Err(Error::InvalidArgument(_))
        ));
        // Nothing was sent, so the connection is fine; the limits themselves are allowed.
        let max = vec![9u8; MAX_VALUE_LEN];
        assert!(c.set(&"k".repeat(MAX_KEY_LEN), &max).is_ok());
        let back = c.get(&"k".repeat(MAX_KEY_LEN), Duration::ZERO);
        assert_eq!(back.ok().map(|v| v.len()), Some(MAX_VALUE_LEN));
    });
}

#[test]
fn binding_a_taken_port_is_addr_in_use() {
    within(Duration::from_secs(20), || {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind: {e}"));
        let addr = taken
            .local_addr()
            .unwrap_or_else(|e| panic!("local_addr: {e}"));
        match StoreServer::bind(addr, 2) {
            Err(Error::AddrInUse { addr: a, what }) => {
                assert_eq!(a, addr);
                assert_eq!(what, "rendezvous store");
            }
            Err(e) => panic!("expected Error::AddrInUse, got {e}"),
            Ok(_) => panic!("bound a port another listener holds"),
        }
    });
}

#[test]
fn connecting_to_nobody_gives_up_at_the_deadline() {
    within(Duration::from_secs(20), || {
        let addr = format!("127.0.0.1:{}", free_port());
        let started = Instant::now();
        let r = StoreClient::connect(&addr, Duration::from_millis(300));
        let waited = started.elapsed();
        match r {
            Err(Error::StoreUnreachable {
                addr: a,
                after,
                detail,
            }) => {
                assert_eq!(a, addr);
                assert!(after >= Duration::from_millis(300), "after {after:?}");
                assert!(!detail.is_empty());
            }
            Err(e) => panic!("expected Error::StoreUnreachable, got {e}"),
            Ok(_) => panic!("connected to a port nobody listens on"),
        }
        assert!(
            waited >= Duration::from_millis(280),
            "gave up after {waited:?}"
        );
    });
}

#[test]
fn connect_retries_until_rank_0_comes_up() {
    within(Duration::from_secs(20), || {
        let port = free_port();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let s = StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], port)), 1);
            let ok = s.is_ok();
            let _ = tx.send(ok);
            // Keep serving until the client is done.
            std::thread::sleep(Duration::from_secs(3));
            drop(s);
        });
        // A hostname, not an address: resolution must work too.
        let mut c = StoreClient::connect(&format!("localhost:{port}"), Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("connect: {e}"));
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).ok(), Some(true));
        assert!(c.join(0, 1).is_ok());
        assert!(c.local_addr().ip().is_loopback());
        assert_ne!(c.local_addr().port(), port);
    });
}

#[test]
fn a_malformed_address_fails_at_once() {
    within(Duration::from_secs(20), || {
        for addr in ["no-port-here", "127.0.0.1:notaport", "127.0.0.1:99999"] {
            // A retry would outlast the test's deadline (20 s < 30 s).
            let r = StoreClient::connect(addr, Duration::from_secs(30));
            assert!(
                matches!(r, Err(Error::InvalidArgument(_))),
                "{addr}: {:?}",
                r.err()
            );
        }
    });
}

#[test]
fn dropping_the_server_is_prompt_and_frees_the_port() {
    within(Duration::from_secs(20), || {
        let server = server(2);
        let addr = server.local_addr();
        let mut c = client(&server);
        assert!(c.join(0, 2).is_ok());
        let started = Instant::now();
        drop(server);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "drop took {:?}",
            started.elapsed()
        );
        // The client learns the store is gone instead of hanging, and stays failed.
        assert!(c.set("k", b"v").is_err());
        assert!(matches!(c.set("k", b"v"), Err(Error::Rendezvous(_))));
        // The next job's rank 0 can bind the same port.
        let again = StoreServer::bind(addr, 2);
        assert!(again.is_ok(), "rebinding {addr}: {:?}", again.err());
        assert_ne!(again.map(|s| s.local_addr()).ok(), None);
    });
}

#[test]
fn each_store_draws_its_own_communicator_id() {
    let a = server(1);
    let b = server(1);
    assert_ne!(a.comm_id(), b.comm_id());
    assert_ne!(a.comm_id(), 0);
    assert_eq!(a.world_size(), 1);
    assert!(matches!(
        StoreServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), 0),
        Err(Error::InvalidArgument(_))
    ));
}
