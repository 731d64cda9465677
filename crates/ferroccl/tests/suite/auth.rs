//! Job-token authentication: a job with a token forms and computes; a rank, a store or
//! a peer without the token (or with another job's) is refused with a typed error; the
//! token itself never crosses the wire.

use crate::common;

use common::test_config;
use ferroccl::rendezvous::{StoreClient, StoreServer};
use ferroccl::testing::internals::{Hello, FLAG_AUTH, PROTOCOL_VERSION};
use ferroccl::{Communicator, Config, Error, ReduceOp};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

const TOKEN: &[u8] = b"0123456789abcdef-job-token-of-this-test";

fn cfg(rank: usize, n: usize, store: &StoreServer, token: Option<&[u8]>) -> Config {
    let mut c = test_config();
    c.job.rank = rank;
    c.job.world_size = n;
    c.job.master_addr = store.local_addr().to_string();
    c.job.serve_store = false;
    c.tuning.connect_timeout = Duration::from_secs(5);
    // Rank 1 is often played by hand over TCP (`auto` would wait for it to say which
    // host it is on); shared-memory links make the same handshake (tests/suite/shm.rs).
    c.transport.kind = ferroccl::TransportKind::Tcp;
    c.job.token = token.map(<[u8]>::to_vec);
    c
}

/// Runs `n` ranks with the given tokens against `store`; returns each rank's outcome.
fn job(store: &StoreServer, tokens: &[Option<&'static [u8]>]) -> Vec<ferroccl::Result<Vec<f32>>> {
    let n = tokens.len();
    let (tx, rx) = mpsc::channel();
    for (r, t) in tokens.iter().enumerate() {
        let c = cfg(r, n, store, *t);
        let tx = tx.clone();
        std::thread::spawn(move || {
            let out = Communicator::init(c).and_then(|comm| {
                let mut v = vec![1.0f32; 70_000];
                comm.all_reduce(&mut v, ReduceOp::Sum)?;
                comm.barrier()?;
                Ok(v)
            });
            let _ = tx.send((r, out));
        });
    }
    let mut res: Vec<Option<ferroccl::Result<Vec<f32>>>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let (r, out) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("every rank returns");
        res[r] = Some(out);
    }
    res.into_iter().map(|o| o.expect("reported")).collect()
}

#[test]
fn a_job_with_a_token_forms_and_computes() {
    let store =
        StoreServer::bind_with_token("127.0.0.1:0".parse().unwrap(), 3, Some(TOKEN.to_vec()))
            .unwrap();
    for (r, out) in job(&store, &[Some(TOKEN), Some(TOKEN), Some(TOKEN)])
        .into_iter()
        .enumerate()
    {
        let v = out.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(v.iter().all(|&x| x == 3.0));
    }
}

#[test]
fn the_store_refuses_a_client_without_the_token_or_with_another() {
    let store =
        StoreServer::bind_with_token("127.0.0.1:0".parse().unwrap(), 2, Some(TOKEN.to_vec()))
            .unwrap();
    let addr = store.local_addr().to_string();
    // No token: the first request is refused, saying a token is required.
    let mut c = StoreClient::connect(&addr, Duration::from_secs(5)).unwrap();
    let e = c.join(0, 2).unwrap_err();
    assert!(
        matches!(e, Error::Rendezvous(_)) && e.to_string().contains("job token"),
        "{e}"
    );
    // Another token: the client sees the store cannot prove ours.
    let e = StoreClient::connect_with_token(&addr, Duration::from_secs(5), Some(b"another job"))
        .unwrap_err();
    assert!(
        e.to_string().contains("could not prove the job token"),
        "{e}"
    );
    // The right token works, and the store still serves.
    let mut ok =
        StoreClient::connect_with_token(&addr, Duration::from_secs(5), Some(TOKEN)).unwrap();
    ok.join(1, 2).unwrap();
    // A store without a token refuses a client that brings one (a misconfigured job).
    let open = StoreServer::bind("127.0.0.1:0".parse().unwrap(), 2).unwrap();
    let e = StoreClient::connect_with_token(
        &open.local_addr().to_string(),
        Duration::from_secs(5),
        Some(TOKEN),
    )
    .unwrap_err();
    assert!(e.to_string().contains("no job token"), "{e}");
}

#[test]
fn a_rank_with_another_token_is_refused_by_the_job() {
    let store =
        StoreServer::bind_with_token("127.0.0.1:0".parse().unwrap(), 2, Some(TOKEN.to_vec()))
            .unwrap();
    let out = job(&store, &[Some(TOKEN), Some(b"old job's token")]);
    let e = out[1].as_ref().unwrap_err();
    assert!(matches!(e, Error::Rendezvous(_)), "{e}");
    assert!(out[0].is_err(), "rank 0 cannot complete without its peer");
}

/// A process that knows the job's address and communicator id but not its token (an
/// old job reusing the port, say) plays rank 1: rank 0 refuses it at the handshake.
#[test]
fn a_peer_that_cannot_prove_the_token_is_refused() {
    let store =
        StoreServer::bind_with_token("127.0.0.1:0".parse().unwrap(), 2, Some(TOKEN.to_vec()))
            .unwrap();
    let mut client = StoreClient::connect_with_token(
        &store.local_addr().to_string(),
        Duration::from_secs(5),
        Some(TOKEN),
    )
    .unwrap();
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
    let fake = std::thread::spawn(move || {
        let mut s = common::accept_within(&listener, Duration::from_secs(20));
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut hello = [0u8; 40 + 16];
        s.read_exact(&mut hello).unwrap();
        let h = Hello::decode(hello[..40].try_into().unwrap()).unwrap();
        assert_eq!(
            h.flags & FLAG_AUTH,
            FLAG_AUTH,
            "the dialer announces authentication"
        );
        let reply = Hello {
            version: PROTOCOL_VERSION,
            status: 0,
            comm_id,
            rank: 1,
            world_size: 2,
            to_rank: 0,
            channel: h.channel,
            flags: FLAG_AUTH,
            group: 0,
        };
        let mut out = reply.encode().to_vec();
        out.extend_from_slice(&[7u8; 16]); // a nonce
        out.extend_from_slice(&[9u8; 32]); // a proof made without the token
        let _ = s.write_all(&out);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        rest
    });
    let (tx, rx) = mpsc::channel();
    let c = cfg(0, 2, &store, Some(TOKEN));
    std::thread::spawn(move || {
        let _ = tx.send(Communicator::init(c).map(|_| ()));
    });
    let e = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("rank 0 returns")
        .unwrap_err();
    assert!(matches!(e, Error::Handshake { .. }), "{e}");
    assert!(
        e.to_string().contains("could not prove the job token"),
        "{e}"
    );
    let sent_after = fake.join().unwrap();
    assert!(
        sent_after.is_empty(),
        "rank 0 sent nothing more to a peer that failed the proof"
    );
}

/// A stranger that knows the job's communicator id (an old job reusing the port, say)
/// but not its token gets as far as the proof and is refused there, with a verdict byte
/// of 0; the job then forms and computes undisturbed — over TCP and over shared
/// memory, whose links make the same handshake.
#[test]
fn a_stranger_with_a_wrong_proof_does_not_disturb_the_job() {
    for kind in [ferroccl::TransportKind::Tcp, ferroccl::TransportKind::Shm] {
        stranger_with_a_wrong_proof(kind);
    }
}

fn stranger_with_a_wrong_proof(kind: ferroccl::TransportKind) {
    let cfg = |rank, n, store: &StoreServer, token| {
        let mut c = cfg(rank, n, store, token);
        c.transport.kind = kind;
        c
    };
    let store =
        StoreServer::bind_with_token("127.0.0.1:0".parse().unwrap(), 2, Some(TOKEN.to_vec()))
            .unwrap();
    let (tx, rx) = mpsc::channel();
    let c1 = cfg(1, 2, &store, Some(TOKEN));
    std::thread::spawn(move || {
        let r = Communicator::init(c1).and_then(|c| {
            let mut v = vec![2.0f32; 10];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok(v)
        });
        let _ = tx.send(r);
    });
    let mut probe = StoreClient::connect_with_token(
        &store.local_addr().to_string(),
        Duration::from_secs(5),
        Some(TOKEN),
    )
    .unwrap();
    let addr = String::from_utf8(probe.get("addr/1", Duration::from_secs(10)).unwrap()).unwrap();
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hello = Hello {
        version: PROTOCOL_VERSION,
        status: 0,
        comm_id: store.comm_id(),
        rank: 0,
        world_size: 2,
        to_rank: 1,
        channel: 0,
        flags: FLAG_AUTH,
        group: 0,
    };
    let mut out = hello.encode().to_vec();
    out.extend_from_slice(&[1u8; 16]);
    s.write_all(&out).unwrap();
    let mut reply = [0u8; 40 + 16 + 32];
    s.read_exact(&mut reply).unwrap();
    assert_eq!(
        Hello::decode(reply[..40].try_into().unwrap())
            .unwrap()
            .status,
        0
    );
    s.write_all(&[9u8; 32]).unwrap(); // a proof made without the token
    let mut verdict = [0u8; 1];
    s.read_exact(&mut verdict).unwrap();
    assert_eq!(verdict[0], 0, "the wrong proof is refused");
    drop(s);
    // The real rank 0 joins and the job computes.
    let (tx0, rx0) = mpsc::channel();
    let c0 = cfg(0, 2, &store, Some(TOKEN));
    std::thread::spawn(move || {
        let r = Communicator::init(c0).and_then(|c| {
            let mut v = vec![1.0f32; 10];
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok(v)
        });
        let _ = tx0.send(r);
    });
    for rx in [&rx0, &rx] {
        let v = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("rank returns")
            .expect("rank succeeds");
        assert!(v.iter().all(|&x| x == 3.0), "{v:?}");
    }
}

#[test]
fn the_token_never_crosses_the_wire() {
    // A fake store records everything an authenticating client sends.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let rec = std::thread::spawn(move || {
        let mut s = common::accept_within(&listener, Duration::from_secs(20));
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = s.read(&mut buf) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        got
    });
    let _ = StoreClient::connect_with_token(&addr, Duration::from_secs(3), Some(TOKEN));
    let got = rec.join().unwrap();
    assert!(!got.is_empty(), "the client spoke");
    assert!(
        !got.windows(TOKEN.len()).any(|w| w == TOKEN),
        "the token appeared on the wire"
    );
}

/// Status queries after a timeout authenticate too, and still say where a peer is.
#[test]
fn hang_localisation_works_in_a_job_with_a_token() {
    let store =
        StoreServer::bind_with_token("127.0.0.1:0".parse().unwrap(), 2, Some(TOKEN.to_vec()))
            .unwrap();
    let (tx, rx) = mpsc::channel();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The timeout runs on a manual clock, advanced once rank 0 is in its all-reduce.
    let clock = ferroccl::Clock::manual();
    let (s2, d2) = (started.clone(), done.clone());
    let tick = crate::common::ticker(
        clock.clone(),
        move || s2.load(std::sync::atomic::Ordering::SeqCst),
        move || d2.load(std::sync::atomic::Ordering::SeqCst),
    );
    for r in 0..2 {
        let mut c = cfg(r, 2, &store, Some(TOKEN));
        c.tuning.timeout = Duration::from_millis(500);
        c.tuning.clock = clock.clone();
        let (tx, done, started) = (tx.clone(), done.clone(), started.clone());
        std::thread::spawn(move || {
            let out = Communicator::init(c).and_then(|comm| {
                comm.barrier()?;
                if r == 1 {
                    // Stay silent (but reachable) until rank 0 has its answer.
                    let end = std::time::Instant::now() + Duration::from_secs(15);
                    while !done.load(std::sync::atomic::Ordering::SeqCst)
                        && std::time::Instant::now() < end
                    {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    return Ok(None);
                }
                started.store(true, std::sync::atomic::Ordering::SeqCst);
                let e = comm
                    .all_reduce(&mut [1.0f32; 8], ReduceOp::Sum)
                    .unwrap_err();
                done.store(true, std::sync::atomic::Ordering::SeqCst);
                Ok(Some(e))
            });
            let _ = tx.send((r, out));
        });
    }
    for _ in 0..2 {
        let (r, out) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("ranks return");
        if r == 0 {
            let e = out.expect("rank 0 ran").expect("an error");
            let t = e.to_string();
            assert!(t.contains("rank 1 is at #0 (barrier)"), "{t}");
        }
    }
    tick.join().unwrap();
}
