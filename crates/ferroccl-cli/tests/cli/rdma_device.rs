//! Asking for the RDMA transport where it cannot run gives a typed error that says
//! what is missing — the `rdma` feature, or (with it) an RDMA device — from the
//! library and from `ferroccl bench`, and never hangs.
//!
//! The feature tests assume a machine without RDMA (CI, this project's machines):
//! there `ibv_get_device_list` fails with ENOSYS or returns an empty list.

use ferroccl::transport::TransportKind;
use ferroccl::{Communicator, Config, Error};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Whether this build has the RDMA transport.
const BUILT: bool = cfg!(feature = "rdma");

/// What the error must say on this build.
#[cfg(feature = "rdma")]
const MISSING: &str = "no RDMA device found";
#[cfg(not(feature = "rdma"))]
const MISSING: &str = "\"rdma\" feature";

fn rdma_config() -> Config {
    // A store address nobody serves: the error must come before any rendezvous.
    let mut c = Config::new(0, 2, "127.0.0.1:9");
    c.transport.kind = TransportKind::Rdma;
    c.job.serve_store = false;
    c.tuning.connect_timeout = Duration::from_secs(3);
    c
}

#[test]
fn the_rdma_transport_follows_the_feature() {
    // The name always parses; whether the transport is built in is the registry's
    // answer, and without the feature it names the feature.
    assert_eq!(TransportKind::parse("rdma").unwrap(), TransportKind::Rdma);
    assert_eq!(TransportKind::Rdma.name(), "rdma");
    let built = ferroccl::transport::builtin(TransportKind::Rdma);
    assert_eq!(built.is_ok(), BUILT, "the registry follows the feature");
    match built {
        Ok(t) => assert_eq!(t.name(), "rdma"),
        Err(e) => assert!(
            matches!(&e, Error::Unavailable { why, .. } if why.contains(MISSING)),
            "{e}"
        ),
    }
}

/// The error comes before any rendezvous: the store address is nobody's, so a
/// rendezvous would have failed with `StoreUnreachable` instead.
#[test]
fn init_without_rdma_is_a_typed_error_at_once() {
    let e = Communicator::init(rdma_config()).unwrap_err();
    match &e {
        Error::Unavailable { what, why } => {
            assert_eq!(what, "transport rdma");
            assert!(why.contains(MISSING), "{why}");
        }
        other => panic!("expected Unavailable, got {other}"),
    }
    assert!(ferroccl::testing::internals::rdma_probe().is_err());
}

#[cfg(feature = "rdma")]
#[test]
fn both_no_device_outcomes_read_the_same() {
    use ferroccl::testing::internals::rdma_verbs::classify;
    let enosys = classify(Err(std::io::Error::from_raw_os_error(libc::ENOSYS))).unwrap_err();
    let empty = classify(Ok(0)).unwrap_err();
    for e in [enosys, empty] {
        assert!(
            matches!(&e, Error::Unavailable { why, .. } if why.contains("no RDMA device found")),
            "{e}"
        );
    }
    assert_eq!(classify(Ok(2)).unwrap(), 2);
}

#[test]
fn bench_with_rdma_prints_the_error_and_fails() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferroccl"))
        .args([
            "bench",
            "--transport",
            "rdma",
            "--ranks",
            "2",
            "-b",
            "64",
            "-e",
            "64",
        ])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let end = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            panic!("ferroccl bench --transport rdma did not exit within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!status.success(), "exit status {status}");
    assert!(
        stderr.contains("transport rdma") && stderr.contains(MISSING),
        "{stderr}"
    );
}

/// The verbs driver's own entry point refuses bad ring parameters before touching a
/// device, and without a device says so in the same words as `probe`.
#[cfg(feature = "rdma")]
#[test]
fn verbs_endpoint_without_a_device_is_the_typed_error() {
    use ferroccl::rendezvous::{StoreClient, StoreServer};
    use ferroccl::testing::internals::{rdma_proto::Params, rdma_verbs as verbs};
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), 1).unwrap();
    let ctx = |params| verbs::VerbsCtx {
        rank: 0,
        world_size: 1,
        comm_id: server.comm_id(),
        store: StoreClient::connect(&server.local_addr().to_string(), Duration::from_secs(5))
            .unwrap(),
        params,
        gid_index: 0,
    };
    let bad = Params {
        slots: 0,
        ..Params::default()
    };
    match verbs::endpoint(ctx(bad)) {
        Err(Error::Config(why)) => assert!(why.contains("0 slots"), "{why}"),
        Err(e) => panic!("expected a configuration error, got {e}"),
        Ok(_) => panic!("a ring of 0 slots was accepted"),
    }
    match verbs::endpoint(ctx(Params::default())) {
        Err(Error::Unavailable { what, why }) => {
            assert_eq!(what, "transport rdma");
            assert!(why.contains(MISSING), "{why}");
        }
        Err(e) => panic!("expected Unavailable, got {e}"),
        Ok(_) => panic!("this test assumes a machine without RDMA devices"),
    }
}
