//! Connection set-up: strangers are refused without disturbing the job, and a peer
//! that answers with the wrong magic, version or communicator id is a typed error.

use crate::common;

use common::test_config;
use ferroccl::rendezvous::{StoreClient, StoreServer};
use ferroccl::testing::internals::{Hello, PROTOCOL_VERSION};
use ferroccl::{Communicator, Config, Error, ReduceOp};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

fn cfg(rank: usize, n: usize, store: &StoreServer) -> Config {
    let mut c = test_config();
    c.job.rank = rank;
    c.job.world_size = n;
    c.job.master_addr = store.local_addr().to_string();
    c.job.serve_store = false;
    c.tuning.connect_timeout = Duration::from_secs(5);
    // Rank 1 is often played by hand over TCP (`auto` would wait for it to say which
    // host it is on); shared-memory links make the same handshake (tests/suite/shm.rs).
    c.transport.kind = ferroccl::TransportKind::Tcp;
    c
}

/// Starts rank 0 of a 2-rank job whose "rank 1" is `fake`, a function that plays the
/// peer on a raw socket. Returns rank 0's init result.
fn rank0_against_fake(
    fake: impl FnOnce(TcpStream, u64) + Send + 'static,
) -> ferroccl::Result<Communicator> {
    let store = StoreServer::bind("127.0.0.1:0".parse().unwrap(), 2).unwrap();
    let mut client =
        StoreClient::connect(&store.local_addr().to_string(), Duration::from_secs(5)).unwrap();
    let comm_id = client.join(1, 2).unwrap();
    // Rank 0 gathers every rank's host once it has linked.
    client.set("host/1", b"the fake rank's host").unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    client
        .set(
            "addr/1",
            listener.local_addr().unwrap().to_string().as_bytes(),
        )
        .unwrap();
    let t = std::thread::spawn(move || {
        let s = common::accept_within(&listener, Duration::from_secs(20));
        fake(s, comm_id);
    });
    let (tx, rx) = mpsc::channel();
    let c = cfg(0, 2, &store);
    std::thread::spawn(move || {
        let _ = tx.send(Communicator::init(c));
    });
    let r = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("rank 0 init did not return within 20 s");
    let _ = t.join();
    drop(store);
    r
}

fn read_hello(s: &mut TcpStream) -> Hello {
    let mut b = [0u8; 40];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.read_exact(&mut b).unwrap();
    Hello::decode(&b).unwrap()
}

#[test]
fn peer_with_wrong_magic_is_rejected() {
    let r = rank0_against_fake(|mut s, _| {
        let _ = read_hello(&mut s);
        s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n....")
            .unwrap();
    });
    match r {
        Err(Error::Handshake { peer, detail }) => {
            assert!(peer.contains("rank 1"), "{peer}");
            assert!(detail.contains("magic"), "{detail}");
        }
        other => panic!("expected a handshake error, got {other:?}"),
    }
}

#[test]
fn peer_with_wrong_communicator_id_is_rejected() {
    let r = rank0_against_fake(|mut s, comm_id| {
        let h = read_hello(&mut s);
        let reply = Hello {
            version: PROTOCOL_VERSION,
            status: 0,
            comm_id: comm_id ^ 1,
            rank: 1,
            world_size: 2,
            to_rank: h.rank,
            channel: h.channel,
            flags: 0,
            group: 0,
        };
        s.write_all(&reply.encode()).unwrap();
    });
    match r {
        Err(Error::Handshake { detail, .. }) => {
            assert!(detail.contains("communicator id"), "{detail}")
        }
        other => panic!("expected a handshake error, got {other:?}"),
    }
}

#[test]
fn peer_with_other_protocol_version_is_rejected() {
    let r = rank0_against_fake(|mut s, comm_id| {
        let h = read_hello(&mut s);
        let reply = Hello {
            version: PROTOCOL_VERSION + 1,
            status: 0,
            comm_id,
            rank: 1,
            world_size: 2,
            to_rank: h.rank,
            channel: h.channel,
            flags: 0,
            group: 0,
        };
        s.write_all(&reply.encode()).unwrap();
    });
    match r {
        Err(Error::Handshake { detail, .. }) => {
            assert!(detail.contains("protocol version"), "{detail}")
        }
        other => panic!("expected a handshake error, got {other:?}"),
    }
}

#[test]
fn the_request_carries_magic_version_comm_id_and_ranks() {
    let (tx, rx) = mpsc::channel();
    let _ = rank0_against_fake(move |mut s, comm_id| {
        let h = read_hello(&mut s);
        let _ = tx.send((h, comm_id));
        // Hang up: rank 0 must fail, not wait forever.
    });
    let (h, comm_id) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(h.version, PROTOCOL_VERSION);
    assert_eq!(h.comm_id, comm_id);
    assert_eq!((h.rank, h.world_size, h.to_rank), (0, 2, 1));
}

/// A stranger (garbage, or the right magic from another job) knocks on rank 1's data
/// port before rank 0 does. Rank 1 refuses it and the job still forms and computes.
#[test]
fn strangers_are_refused_and_do_not_disturb_the_job() {
    let store = StoreServer::bind("127.0.0.1:0".parse().unwrap(), 2).unwrap();
    let (tx, rx) = mpsc::channel();
    let c1 = cfg(1, 2, &store);
    std::thread::spawn(move || {
        let r = Communicator::init(c1).and_then(|c| {
            let mut v = vec![2.0f32; 1000];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok(v)
        });
        let _ = tx.send((1, r));
    });
    let mut client =
        StoreClient::connect(&store.local_addr().to_string(), Duration::from_secs(5)).unwrap();
    let addr = String::from_utf8(client.get("addr/1", Duration::from_secs(10)).unwrap()).unwrap();

    // 1: garbage. The connection is dropped.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.write_all(&[0xAB; 40]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 40];
    let got = s.read(&mut b).unwrap_or(0);
    assert_eq!(
        got, 0,
        "a stranger sending garbage gets no answer, just a closed socket"
    );

    // 2: a ferroccl process of another job (wrong communicator id): refused with a reason.
    let mut s = TcpStream::connect(&addr).unwrap();
    let stranger = Hello {
        version: PROTOCOL_VERSION,
        status: 0,
        comm_id: 0x1234,
        rank: 0,
        world_size: 2,
        to_rank: 1,
        channel: 0,
        flags: 0,
        group: 0,
    };
    s.write_all(&stranger.encode()).unwrap();
    let reply = read_hello(&mut s);
    assert_ne!(reply.status, 0, "the stranger must be refused");

    // Now the real rank 0 joins and the collective is right.
    let (tx0, rx0) = mpsc::channel();
    let c0 = cfg(0, 2, &store);
    std::thread::spawn(move || {
        let r = Communicator::init(c0).and_then(|c| {
            let mut v = vec![1.0f32; 1000];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok(v)
        });
        let _ = tx0.send((0, r));
    });
    for rx in [&rx, &rx0] {
        let (rank, r) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("rank finished in time");
        let v = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(v.iter().all(|&x| x == 3.0), "rank {rank} got {:?}", &v[..4]);
    }
}

#[test]
fn store_unreachable_is_a_typed_error() {
    // A port nobody listens on: bind, note the port, close.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut c = Config::new(1, 2, format!("127.0.0.1:{port}"));
    c.tuning.connect_timeout = Duration::from_millis(500);
    // Gives up at its own deadline; the test's is only there to catch a hang.
    let e = common::with_deadline(Duration::from_secs(30), move || {
        Communicator::init(c).unwrap_err()
    });
    assert!(matches!(e, Error::StoreUnreachable { .. }), "{e}");
}

/// A program that holds the store's port, accepts, and says nothing: the join gives up
/// within its connect timeout (it used to wait 30 s for the store's answer), with or
/// without a job token.
#[test]
fn a_mute_program_on_the_store_port_costs_only_the_connect_timeout() {
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = mute.local_addr().unwrap();
    for token in [None, Some(b"t0ken".to_vec())] {
        let mut c = Config::new(1, 2, addr.to_string());
        c.tuning.connect_timeout = Duration::from_millis(800);
        c.job.token = token.clone();
        let t0 = std::time::Instant::now();
        let e = common::with_deadline(Duration::from_secs(60), move || {
            Communicator::init(c).unwrap_err()
        });
        // Its own bound is the connect timeout; 20 s only tells it from the old 30 s on
        // any machine.
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "token {token:?}: {:?}: {e}",
            t0.elapsed()
        );
        assert!(
            matches!(e, Error::Rendezvous(ref m) if m.contains("did not answer")),
            "token {token:?}: {e}"
        );
    }
    drop(mute);
}

#[test]
fn master_port_in_use_is_a_typed_error() {
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap();
    let mut c = Config::new(0, 2, addr.to_string());
    c.tuning.connect_timeout = Duration::from_millis(500);
    let e = Communicator::init(c).unwrap_err();
    match e {
        Error::AddrInUse { addr: a, .. } => assert_eq!(a, addr),
        other => panic!("expected AddrInUse, got {other}"),
    }
}

#[test]
fn inconsistent_world_size_across_ranks_is_a_typed_error() {
    let store = StoreServer::bind("127.0.0.1:0".parse().unwrap(), 2).unwrap();
    let mut c = cfg(1, 3, &store); // this rank believes the job has 3 ranks
    c.tuning.connect_timeout = Duration::from_secs(2);
    let e = Communicator::init(c).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains('3') && text.contains('2'),
        "error names both sizes: {text}"
    );
}
