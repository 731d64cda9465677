//! The config's unit tests: the environment parser, the builder, the clock and the
//! option parsers.

use super::*;

/// Every variable the launcher environment is read from.
const ENV_VARS: [&str; 41] = [
    "FERROCCL_ALGO",
    "FERROCCL_BIND",
    "FERROCCL_BUSY_POLL_US",
    "FERROCCL_COST_MODEL",
    "FERROCCL_CUDA_ORDER",
    "FERROCCL_JOB_ID",
    "FERROCCL_RDMA_GID_INDEX",
    "FERROCCL_SHM_SINGLE_COPY",
    "FERROCCL_SHM_SYMMETRIC",
    "FERROCCL_TCP_CONGESTION",
    "FERROCCL_TOKEN",
    "FERROCCL_TRACE_CAPACITY",
    "FERROCCL_TRANSPORT",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MPI_LOCALNRANKS",
    "MPI_LOCALRANKID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_NAMESPACE",
    "PMI_KVSNAME",
    "PMI_RANK",
    "PMI_SIZE",
    "RANK",
    "SLURM_CPUS_PER_TASK",
    "SLURM_JOBID",
    "SLURM_JOB_ID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_PROCID",
    "SLURM_STEPID",
    "SLURM_STEP_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "WORLD_SIZE",
];

fn env_value() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    prop_oneof![
        (0u64..10).prop_map(|v| v.to_string()),
        any::<u64>().prop_map(|v| v.to_string()),
        any::<i64>().prop_map(|v| v.to_string()),
        Just("99999999999999999999999".to_string()),
        Just("nan".to_string()),
        Just("inf".to_string()),
        Just("-1".to_string()),
        Just("".to_string()),
        "[ -~]{0,12}",
        any::<String>(),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(3000))]
    /// No environment panics the parser: whatever it accepts is a config that
    /// validates, with the rank inside the world.
    #[test]
    fn no_environment_panics_the_parser(
        vals in proptest::collection::vec(
            proptest::option::of(env_value()), ENV_VARS.len()..=ENV_VARS.len())
    ) {
        let get = |k: &str| {
            ENV_VARS.iter().position(|v| *v == k).and_then(|i| vals[i].clone())
        };
        if let Ok(c) = Config::from_lookup(get) {
            proptest::prop_assert!(c.job.rank < c.job.world_size, "{c:?}");
            proptest::prop_assert!(c.validate().is_ok(), "{c:?}");
        }
    }
}

/// The environment of rank 0 of 1 with `var` set to `v` (none when `var` is empty).
fn alone_with(var: &'static str, v: &'static str) -> impl Fn(&str) -> Option<String> {
    move |k: &str| match k {
        "RANK" => Some("0".to_string()),
        "WORLD_SIZE" => Some("1".to_string()),
        _ if !var.is_empty() && k == var => Some(v.to_string()),
        _ => None,
    }
}

#[test]
fn busy_poll_comes_from_the_environment_in_microseconds() {
    let env = |v| alone_with("FERROCCL_BUSY_POLL_US", v);
    let c = Config::from_lookup(env("250")).unwrap();
    assert_eq!(c.tuning.busy_poll, Duration::from_micros(250));
    let e = Config::from_lookup(env("1ms")).unwrap_err().to_string();
    assert!(
        e.contains("FERROCCL_BUSY_POLL_US") && e.contains("microseconds"),
        "{e}"
    );
}

#[test]
fn cuda_order_comes_from_the_environment() {
    let env = |v| alone_with("FERROCCL_CUDA_ORDER", v);
    let default = Config::from_lookup(alone_with("", ""));
    assert!(!default.unwrap().transport.cuda_ipc.device_order);
    assert!(
        Config::from_lookup(env(" device "))
            .unwrap()
            .transport
            .cuda_ipc
            .device_order
    );
    assert!(
        !Config::from_lookup(env("host"))
            .unwrap()
            .transport
            .cuda_ipc
            .device_order
    );
    let e = Config::from_lookup(env("gpu")).unwrap_err().to_string();
    assert!(
        e.contains("FERROCCL_CUDA_ORDER") && e.contains("host or device"),
        "{e}"
    );
}

#[test]
fn builder_checks_what_it_builds() {
    let c = Config::builder(1, 3, "h:1")
        .segment_bytes(4096)
        .token(b"t".to_vec())
        .build()
        .unwrap();
    assert_eq!((c.job.rank, c.job.world_size, c.job.local_rank), (1, 3, 1));
    assert_eq!(c.tuning.segment_bytes, 4096);
    assert_eq!(c.job.token.as_deref(), Some(&b"t"[..]));
    for (b, needle) in [
        (Config::builder(3, 3, "h:1"), "out of range"),
        (Config::builder(0, 0, "h:1"), "at least 1"),
        (
            Config::builder(0, 1, "h:1").segment_bytes(0),
            "segment_bytes",
        ),
        (
            Config::builder(0, 1, "h:1").timeout(Duration::ZERO),
            "positive",
        ),
    ] {
        let e = b.build().unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    }
}

#[test]
fn manual_clock_moves_only_when_told() {
    let c = Clock::manual();
    let t0 = c.now();
    std::thread::sleep(Duration::from_millis(2));
    assert_eq!(c.now(), t0, "a manual clock stands still");
    c.clone().advance(Duration::from_secs(90));
    assert_eq!(c.now() - t0, Duration::from_secs(90), "clones share it");
    let s = Clock::system();
    s.advance(Duration::from_secs(1000));
    assert!(s.now() < Instant::now() + Duration::from_secs(1));
}

#[test]
fn single_copy_sizes_parse() {
    assert_eq!(ShmOptions::parse_single_copy("off"), Ok(0));
    assert_eq!(ShmOptions::parse_single_copy(" OFF "), Ok(0));
    assert_eq!(ShmOptions::parse_single_copy("65536"), Ok(65536));
    assert_eq!(ShmOptions::parse_single_copy("64K"), Ok(64 << 10));
    assert_eq!(ShmOptions::parse_single_copy("2m"), Ok(2 << 20));
    for bad in ["", "K", "-1", "64KB", "lots", "99999999999999999999M"] {
        let e = ShmOptions::parse_single_copy(bad).unwrap_err();
        assert!(e.contains("neither `off`"), "{bad}: {e}");
    }
}

#[test]
fn tcp_congestion_names_parse() {
    assert_eq!(TcpCongestion::parse("auto").unwrap(), TcpCongestion::Auto);
    assert_eq!(
        TcpCongestion::parse("system").unwrap(),
        TcpCongestion::System
    );
    assert_eq!(
        TcpCongestion::parse("cubic").unwrap(),
        TcpCongestion::Named("cubic".into())
    );
    for bad in ["", "Cubic", "cubic;rm", "a_name_of_16_byt"] {
        let e = TcpCongestion::parse(bad).unwrap_err();
        assert!(e.to_string().contains("congestion"), "{bad:?}: {e}");
    }
    assert_eq!(TcpOptions::default().congestion, TcpCongestion::Auto);
}

#[test]
fn transport_names_parse_back() {
    for k in TransportKind::ALL {
        assert_eq!(TransportKind::parse(k.name()).unwrap(), k);
    }
    let e = TransportKind::parse("carrier-pigeon")
        .unwrap_err()
        .to_string();
    assert!(e.contains("auto, tcp, shm, local, rdma, cuda-ipc"), "{e}");
}
