//! `ferroccl bench COLLECTIVE`: the nccl-tests `*_perf` tables, for ferroccl.
//!
//! algbw = S/t and busbw = algbw × factor, with nccl-tests' factors: all-reduce
//! 2(n-1)/n; reduce-scatter and all-gather (n-1)/n with S the full (gathered) size;
//! all-to-all, gather and scatter (n-1)/n with S the whole buffer of `n` blocks;
//! broadcast, reduce and sendrecv 1. One more column, `wire`: the payload bytes each
//! rank sent (the most any rank sent), counted by its links, over the law for that
//! collective.
//!
//! `--split K` benches every group of `K` consecutive ranks as a child communicator
//! (`Communicator::split`), all at once, each group's first rank printing its table;
//! `--group 0,1` benches the child of the ranks listed while the others wait.
//!
//! Under a launcher (`ferroccl launch`, `mpirun`, `srun`, `torchrun`) each process is one
//! rank and rank 0 prints. Started bare, it runs `--ranks N` local ranks itself: as
//! processes through `ferroccl launch` for `--transport tcp`, as threads for `local`.

#[cfg(feature = "cuda")]
mod device;

use crate::law::{host_law, Fit, HostLaw, RingLaw};
use clap::Args;
use ferroccl::transport::TransportKind;
use ferroccl::{Communicator, Config, DataType, Element, ReduceOp};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// Arguments of `ferroccl bench` (the nccl-tests flags, plus ours).
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Collective to measure: all_reduce, reduce_scatter, all_gather, broadcast,
    /// reduce, all_to_all, gather, scatter, sendrecv (each rank sends to the next and
    /// receives from the one before).
    #[arg(default_value = "all_reduce")]
    pub collective: String,
    /// Smallest message size in bytes (suffixes K, M, G).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = crate::args::size)]
    pub min_bytes: usize,
    /// Largest message size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = crate::args::size)]
    pub max_bytes: usize,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub step_factor: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value = "20", value_parser = crate::args::iters)]
    pub iters: usize,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup_iters", default_value = "5", value_parser = crate::args::iters)]
    pub warmup: usize,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    pub check: u8,
    /// Data type: float, double, half, bfloat16, int32, int64, uint8.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub dtype: String,
    /// Reduction: sum, prod, min, max, avg.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub op: String,
    /// Root rank (rooted collectives only).
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    pub root: usize,
    /// Ranks to start when not run under a launcher.
    #[arg(long = "ranks", default_value = "4", value_parser = crate::args::ranks)]
    pub ranks: usize,
    /// With --ranks (no launcher): start every rank again when one fails, up to this
    /// many times (see `ferroccl launch --max-restarts`).
    #[arg(long = "max-restarts", default_value_t = 0)]
    pub max_restarts: usize,
    /// Transport: auto (shared memory between ranks of one host, TCP between hosts),
    /// tcp, shm, local (threads in one process), rdma (feature `rdma`), or cuda-ipc
    /// (feature `cuda`; needs --device cuda). Default: FERROCCL_TRANSPORT, else auto.
    #[arg(long = "transport")]
    pub transport: Option<String>,
    /// Where the buffers live: cpu, or cuda (device buffers; feature `cuda`; rank r
    /// uses GPU local_rank % device count). Without a GPU, `cuda` fails with the typed error.
    #[arg(long = "device", default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
    /// Segment size in bytes (pipelining granularity): the ring's, and the most a
    /// broadcast or reduce chain over 3+ ranks uses (it cuts finer, down to 64 KiB).
    #[arg(long = "segment-bytes", value_parser = crate::args::size)]
    pub segment_bytes: Option<usize>,
    /// Seconds a collective may wait without progress.
    #[arg(long = "timeout", default_value = "60", value_parser = crate::args::seconds, allow_negative_numbers = true)]
    pub timeout: Duration,
    /// Seconds start-up may take (reaching the store, connecting to peers).
    #[arg(long = "connect-timeout", default_value = "60", value_parser = crate::args::seconds, allow_negative_numbers = true)]
    pub connect_timeout: Duration,
    /// All-reduces up to this size use recursive doubling instead of the ring (0: always ring).
    #[arg(long = "small-message-bytes", value_parser = crate::args::size)]
    pub small_message_bytes: Option<usize>,
    /// All-reduce algorithm: auto (rd up to --small-message-bytes, ring above; hier above
    /// on hosts of 2 or more ranks each), ring, rd (recursive doubling), rabenseifner
    /// (recursive halving then doubling), tree (pipelined double binary tree; broadcast
    /// and reduce then run down a binary tree too) or hier (hierarchical: within hosts,
    /// then k rings between hosts); on one host over shm/auto (symmetric memory) auto is
    /// rd over the rings for small sizes and two-shot above, and one-shot (every rank
    /// reduces everything) or two-shot may be forced. Ranks started by a launcher also read FERROCCL_ALGO; this flag wins.
    #[arg(long = "algo", value_parser = ["auto", "ring", "rd", "rabenseifner", "tree", "hier", "hierarchical", "one-shot", "two-shot"])]
    pub algo: Option<String>,
    /// With --algo auto: choose per size by a network model instead of the size rule:
    /// `measure` (timed on the links at start), `@FILE` (a `bench --law RATE --json
    /// FILE` fit), or `alpha_us=20,link_gbs=12.5,reduce_gbs=10` (also
    /// FERROCCL_COST_MODEL).
    #[arg(long = "cost-model", value_parser = |s: &str| ferroccl::CostModelSpec::parse(s).map_err(|e| e.to_string()))]
    pub cost_model: Option<ferroccl::CostModelSpec>,
    /// Congestion control of TCP links: auto (the system's unless it is BBR, whose
    /// ProbeRTT stalls a ring; then cubic or reno), system, or a name such as cubic
    /// (also FERROCCL_TCP_CONGESTION).
    #[arg(long = "tcp-congestion", value_parser = |s: &str| ferroccl::TcpCongestion::parse(s).map_err(|e| e.to_string()))]
    pub tcp_congestion: Option<ferroccl::TcpCongestion>,
    /// Microseconds a waiting rank polls its links before sleeping (see
    /// Config::busy_poll), 0 to 10,000,000 (10 s).
    #[arg(long = "busy-poll-us", value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
    pub busy_poll_us: Option<u64>,
    /// Timing: `avg` (nccl-tests: back-to-back iterations, mean, max over ranks) or
    /// `median` (each iteration after a barrier, max over ranks, median: how the peer
    /// scripts in shared/peers time, for like-for-like comparisons).
    #[arg(long = "stat", default_value = "avg", value_parser = ["avg", "median"])]
    pub stat: String,
    /// Also write the rows as JSON to this file (rank 0).
    #[arg(long = "json")]
    pub json: Option<std::path::PathBuf>,
    /// Check the ring law on links of this rate (`1gbit`, `500mbit`, `2.5gbit`, `1.25GB`):
    /// per size the predicted time 2(n-1)α + 2(n-1)/n·S/RATE (α fitted) and
    /// measured/predicted, then the least-squares α-β fit. Ring collectives only
    /// (all_reduce, reduce_scatter, all_gather); all_reduce never takes recursive
    /// doubling. An all_reduce that runs hierarchical (hosts of k >= 2 ranks) is held
    /// to its own law instead: 2(k-1)+2(H-1) steps and 2(H-1)/H·S/RATE, the bytes each
    /// host sends to other hosts over its link of RATE.
    ///
    /// `--law mem` (all_reduce on one host's symmetric memory): the memory-bandwidth
    /// law instead. Per size, this host's copy and reduce rates measured in the same
    /// run (every rank at once, on buffers of that size), the bytes the algorithm that
    /// ran copies and reduces, the time those need at those rates, and
    /// measured/predicted.
    #[arg(long = "law", value_parser = parse_law)]
    pub law: Option<LawArg>,
    /// Record every rank's flight recorder into DIR/rank-<rank>.jsonl: at the end of
    /// the run, and on a failure. Read them with `ferroccl trace DIR`. Started bare,
    /// the bench first removes dumps of an earlier run from DIR.
    #[arg(long = "trace", value_name = "DIR")]
    pub trace: Option<std::path::PathBuf>,
    /// Operations each rank's flight recorder keeps (default 2048, or
    /// FERROCCL_TRACE_CAPACITY); 0 records nothing (to measure what recording costs).
    #[arg(long = "trace-capacity", value_name = "N")]
    pub trace_capacity: Option<usize>,
    /// Bench child communicators of K consecutive ranks each (`split`), all at once;
    /// each group's first rank prints its table. The job's world size must be a
    /// multiple of K.
    #[arg(long = "split", value_name = "K", conflicts_with = "group")]
    pub split: Option<usize>,
    /// Bench the child communicator of the ranks listed (`group`, e.g. `0,1`), in that
    /// order; the other ranks wait until it is done. Its first rank prints.
    #[arg(long = "group", value_name = "RANKS", value_delimiter = ',')]
    pub group: Option<Vec<usize>>,
}

/// What `--law` checks: the ring law on links of a rate, or the memory-bandwidth law.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LawArg {
    /// Links of this many bytes per second.
    Rate(f64),
    /// This host's memory (`mem`).
    Mem,
}

fn parse_law(s: &str) -> Result<LawArg, String> {
    if matches!(s.trim().to_ascii_lowercase().as_str(), "mem" | "memory") {
        return Ok(LawArg::Mem);
    }
    crate::plan::parse_rate("--law", s)
        .map(LawArg::Rate)
        .map_err(|e| e.to_string())
}

impl BenchArgs {
    /// The link rate `--law RATE` gave.
    fn law_rate(&self) -> Option<f64> {
        match self.law {
            Some(LawArg::Rate(r)) => Some(r),
            _ => None,
        }
    }
}

/// One line of the table.
#[derive(Clone, Debug)]
pub struct Row {
    pub bytes: usize,
    pub count: usize,
    pub oop_us: f64,
    pub oop_wrong: u64,
    pub ip_us: f64,
    pub ip_wrong: u64,
    /// Payload bytes sent per rank per operation (max over ranks).
    pub wire_bytes: f64,
    /// Header bytes sent per rank per operation (max over ranks).
    pub header_bytes: f64,
    /// On a job of several hosts of several ranks (all_reduce): payload bytes per
    /// operation sent within a host (max over ranks) and to other hosts (max over
    /// hosts of the sum over its ranks).
    pub hosts: Option<(f64, f64)>,
}

/// The subcommand: `Ok(false)` when a result was wrong (`#wrong` above 0).
pub fn main(a: BenchArgs) -> crate::error::Result<bool> {
    Ok(run(a)?)
}

fn config_for(a: &BenchArgs, base: Config) -> Config {
    let mut c = base;
    if let Some(s) = a.segment_bytes {
        c.tuning.segment_bytes = s;
    }
    c.tuning.timeout = a.timeout;
    c.tuning.connect_timeout = a.connect_timeout;
    if let Some(b) = a.small_message_bytes {
        c.tuning.small_message_bytes = b;
    }
    if let Some(us) = a.busy_poll_us {
        c.tuning.busy_poll = Duration::from_micros(us);
    }
    if let Some(t) = &a.tcp_congestion {
        c.transport.tcp.congestion = t.clone();
    }
    if let Some(n) = a.trace_capacity {
        c.tuning.trace_capacity = n;
    }
    if a.law_rate().is_some() {
        // The law is the ring's: recursive doubling would follow another one.
        c.tuning.small_message_bytes = 0;
    }
    if let Some(m) = a.cost_model {
        m.apply(&mut c.tuning);
    }
    if let Some(algo) = &a.algo {
        // clap admits only the names the parser knows.
        if let Ok(algo) = algo.parse() {
            c.tuning.all_reduce_algo = algo;
        }
    }
    c
}

/// The collectives the bench measures, with nccl-tests' bus factors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Coll {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Reduce,
    AllToAll,
    Gather,
    Scatter,
    SendRecv,
}

impl Coll {
    fn parse(s: &str) -> ferroccl::Result<Self> {
        Ok(match s.replace('-', "_").as_str() {
            "all_reduce" | "allreduce" => Coll::AllReduce,
            "reduce_scatter" | "reducescatter" => Coll::ReduceScatter,
            "all_gather" | "allgather" => Coll::AllGather,
            "broadcast" | "bcast" => Coll::Broadcast,
            "reduce" => Coll::Reduce,
            "all_to_all" | "alltoall" => Coll::AllToAll,
            "gather" => Coll::Gather,
            "scatter" => Coll::Scatter,
            "sendrecv" | "send_recv" => Coll::SendRecv,
            _ => {
                return Err(ferroccl::Error::InvalidArgument(format!(
                    "unknown collective {s:?}: expected all_reduce, reduce_scatter, all_gather, \
                     broadcast, reduce, all_to_all, gather, scatter or sendrecv"
                )))
            }
        })
    }

    fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "all_reduce",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::AllGather => "all_gather",
            Coll::Broadcast => "broadcast",
            Coll::Reduce => "reduce",
            Coll::AllToAll => "all_to_all",
            Coll::Gather => "gather",
            Coll::Scatter => "scatter",
            Coll::SendRecv => "sendrecv",
        }
    }

    /// busbw / algbw (nccl-tests doc/PERFORMANCE.md).
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::ReduceScatter
            | Coll::AllGather
            | Coll::AllToAll
            | Coll::Gather
            | Coll::Scatter => (n - 1.0) / n,
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv => 1.0,
        }
    }

    /// The most payload bytes any rank sends for a size of `bytes`, by the algorithm's
    /// law: the ring's 2(n-1)/n·S or (n-1)/n·S, the chain's S, all-to-all's and a
    /// scatter root's (n-1)/n·S, a gathered rank's S/n, sendrecv's S.
    fn wire_law(self, n: usize, bytes: usize) -> f64 {
        if n == 1 {
            return 0.0;
        }
        match self {
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv => bytes as f64,
            Coll::Gather => bytes as f64 / n as f64,
            c => c.bus_factor(n) * bytes as f64,
        }
    }

    /// The ring law this collective follows, when it runs on the ring.
    fn ring_law(self, n: usize) -> Option<RingLaw> {
        match self {
            Coll::AllReduce => Some(RingLaw::all_reduce(n)),
            Coll::ReduceScatter | Coll::AllGather => Some(RingLaw::half(n)),
            _ => None,
        }
    }

    fn reduces(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::ReduceScatter | Coll::Reduce)
    }

    fn rooted(self) -> bool {
        matches!(
            self,
            Coll::Broadcast | Coll::Reduce | Coll::Gather | Coll::Scatter
        )
    }

    /// Elements of the whole buffer are split in equal blocks per rank.
    fn blocked(self) -> bool {
        matches!(
            self,
            Coll::ReduceScatter | Coll::AllGather | Coll::AllToAll | Coll::Gather | Coll::Scatter
        )
    }

    /// What the busbw factor says, for the header.
    fn factor_text(self) -> &'static str {
        match self {
            Coll::AllReduce => "2(n-1)/n",
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv => "1",
            _ => "(n-1)/n",
        }
    }

    /// The law the `wire` column divides by, for the header.
    fn law_text(self) -> &'static str {
        match self {
            Coll::AllReduce => "the ring law 2(n-1)/n*S",
            Coll::ReduceScatter | Coll::AllGather => "the ring law (n-1)/n*S",
            Coll::AllToAll => "the all-to-all law (n-1)/n*S (every rank)",
            Coll::Gather => "the gather law S/n (every rank but the root)",
            Coll::Scatter => "the scatter law (n-1)/n*S (the root)",
            Coll::SendRecv => "S (every rank sends its buffer to the next)",
            Coll::Broadcast | Coll::Reduce => "the chain law S",
        }
    }
}

/// `shm to 1, 3; tcp to 2`: which peers each class of link reaches, or `none`.
fn describe_links(links: &[(usize, &'static str)]) -> String {
    let mut by: Vec<(&str, Vec<String>)> = Vec::new();
    for (peer, class) in links {
        match by.iter_mut().find(|(c, _)| c == class) {
            Some((_, peers)) => peers.push(peer.to_string()),
            None => by.push((class, vec![peer.to_string()])),
        }
    }
    if by.is_empty() {
        return "none".into();
    }
    by.iter()
        .map(|(c, peers)| format!("{c} to {}", peers.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The transport `FERROCCL_TRANSPORT` names, or `auto` when it is unset.
fn transport_from_env() -> ferroccl::Result<TransportKind> {
    match std::env::var("FERROCCL_TRANSPORT") {
        Ok(t) if !t.trim().is_empty() => TransportKind::parse(t.trim())
            .map_err(|e| ferroccl::Error::InvalidArgument(format!("FERROCCL_TRANSPORT: {e}"))),
        _ => Ok(TransportKind::Auto),
    }
}

/// Returns whether every result checked out.
fn run(a: BenchArgs) -> ferroccl::Result<bool> {
    let coll = Coll::parse(&a.collective)?;
    let dtype = DataType::parse(&a.dtype)?;
    let op = ReduceOp::parse(&a.op)?;
    if coll.reduces() {
        ferroccl::reduce::check_op(dtype, op)?;
    }
    let transport = match &a.transport {
        Some(t) => TransportKind::parse(t)?,
        None => transport_from_env()?,
    };
    if a.law == Some(LawArg::Mem) && coll != Coll::AllReduce {
        return Err(ferroccl::Error::InvalidArgument(format!(
            "--law mem is for all_reduce (one-shot and two-shot on one host's shared memory), not {}",
            coll.name()
        )));
    }
    if a.law_rate().is_some() && coll.ring_law(2).is_none() {
        return Err(ferroccl::Error::InvalidArgument(format!(
            "--law is for the ring collectives (all_reduce, reduce_scatter, all_gather); {} runs on a chain",
            coll.name()
        )));
    }
    if a.step_factor < 2 && a.min_bytes != a.max_bytes {
        return Err(ferroccl::Error::InvalidArgument(
            "-f must be at least 2".into(),
        ));
    }
    if a.min_bytes > a.max_bytes {
        return Err(ferroccl::Error::InvalidArgument(format!(
            "-b {} is larger than -e {}",
            a.min_bytes, a.max_bytes
        )));
    }
    let esize = dtype.size();
    for (flag, v) in [("-b", a.min_bytes), ("-e", a.max_bytes)] {
        if v < esize || v % esize != 0 {
            return Err(ferroccl::Error::InvalidArgument(format!(
                "{flag} {v}: sizes are whole {} elements of {esize} B, from {esize} B (the sizes between -b and -e are rounded down to whole elements)",
                a.dtype
            )));
        }
    }
    // The tuning flags, checked once here rather than by every rank it starts.
    config_for(&a, Config::new(0, a.ranks.max(1), "127.0.0.1:1")).validate()?;
    if let Some(k) = a.split {
        if k == 0 {
            return Err(ferroccl::Error::InvalidArgument(
                "--split 0: groups need at least 1 rank".into(),
            ));
        }
    }
    // What this host can run (CPUs, processes, files) first, then the memory: every
    // rank of this host holds its buffers at once.
    let local = if ferroccl::rendezvous::detect_env()?.is_some() {
        1
    } else {
        crate::args::host_can_run(
            &crate::args::Host::read(),
            a.ranks,
            crate::args::RankNeeds::ferroccl(a.ranks, 0),
        )
        .map_err(|e| ferroccl::Error::InvalidArgument(format!("--ranks {}: {e}", a.ranks)))?;
        a.ranks
    };
    let need = (local as u64).saturating_mul(crate::args::bench_memory(a.max_bytes));
    let have = crate::args::Host::read().mem_available;
    if need > have {
        return Err(ferroccl::Error::InvalidArgument(format!(
            "-e {}: {local} rank(s) of this host need about {} MiB for buffers of that size; {} MiB is available",
            a.max_bytes,
            need >> 20,
            have >> 20
        )));
    }
    if a.iters == 0 {
        return Err(ferroccl::Error::InvalidArgument(
            "-n must be at least 1".into(),
        ));
    }

    if !matches!(
        transport,
        TransportKind::Tcp | TransportKind::Local | TransportKind::Auto | TransportKind::Shm
    ) {
        // Say at once, once, when this build or machine lacks the transport.
        ferroccl::transport::builtin(transport)?.probe(&Config::default())?;
    }
    check_device(&a, transport)?;
    let launched = ferroccl::rendezvous::detect_env()?.is_some();
    if let Some(dir) = &a.trace {
        // Before any communicator: it sets FERROCCL_TRACE_DIR, for ranks started as
        // processes too. A launcher's ranks share the directory: none clears it.
        crate::trace::record_into(dir, !launched)?;
    }
    if launched {
        let mut cfg = config_for(&a, Config::from_env()?);
        if transport != TransportKind::Local {
            cfg.transport.kind = transport;
        }
        if a.root >= cfg.job.world_size {
            return Err(ferroccl::Error::InvalidArgument(format!(
                "-r {} is not a rank of {} ranks",
                a.root, cfg.job.world_size
            )));
        }
        let comm = Communicator::init(cfg)?;
        let r = on_group(&a, &comm, |c| {
            rank_main(&a, coll, dtype, op, c, transport.name())
        });
        return crate::trace::finish(&comm, a.trace.as_deref(), r);
    }
    if a.ranks == 0 {
        return Err(ferroccl::Error::InvalidArgument(
            "--ranks must be at least 1".into(),
        ));
    }
    if a.root >= a.ranks {
        return Err(ferroccl::Error::InvalidArgument(format!(
            "-r {} is not a rank of {} ranks",
            a.root, a.ranks
        )));
    }
    match transport {
        TransportKind::Local => {
            let base = config_for(&a, Config::default());
            let comms = Communicator::local_group(a.ranks, &base)?;
            let results: Vec<ferroccl::Result<bool>> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .map(|c| {
                        let a = &a;
                        s.spawn(move || {
                            let r = on_group(a, &c, |c| rank_main(a, coll, dtype, op, c, "local"));
                            crate::trace::finish(&c, a.trace.as_deref(), r)
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(ferroccl::Error::InvalidArgument(
                                "a rank thread panicked".into(),
                            ))
                        })
                    })
                    .collect()
            });
            let mut ok = true;
            for r in results {
                ok &= r?;
            }
            Ok(ok)
        }
        _ => {
            // Re-run this very command once per rank under our own launcher.
            let exe = std::env::current_exe()
                .map_err(|e| ferroccl::Error::io("locating the ferroccl binary", e))?;
            let mut cmd: Vec<std::ffi::OsString> = vec![exe.into_os_string()];
            cmd.extend(std::env::args_os().skip(1));
            let opts = crate::launch::LaunchOptions {
                bare_stdout_rank: Some(0),
                max_restarts: a.max_restarts,
                rank_needs: crate::args::RankNeeds::ferroccl(
                    a.ranks,
                    crate::args::bench_memory(a.max_bytes),
                ),
                ..Default::default()
            };
            match crate::launch::run(a.ranks, &cmd, &opts) {
                Ok(()) => Ok(true),
                Err(e) => {
                    eprintln!("ferroccl bench: {e}");
                    Ok(false)
                }
            }
        }
    }
}

/// Runs `body` on the communicator the bench measures: `comm` itself; with `--split
/// K`, the child of this rank's K consecutive ranks (every group at once); with
/// `--group LIST`, the child of the ranks listed, while the others wait for it in a
/// barrier of the job.
fn on_group(
    a: &BenchArgs,
    comm: &Communicator,
    body: impl FnOnce(&Communicator) -> ferroccl::Result<bool>,
) -> ferroccl::Result<bool> {
    let (n, rank) = (comm.world_size(), comm.rank());
    let check_root = |c: &Communicator| {
        if a.root >= c.world_size() {
            return Err(ferroccl::Error::InvalidArgument(format!(
                "-r {} is not a rank of the group of {} ranks",
                a.root,
                c.world_size()
            )));
        }
        Ok(())
    };
    if let Some(k) = a.split {
        if k == 0 || !n.is_multiple_of(k) {
            return Err(ferroccl::Error::InvalidArgument(format!(
                "--split {k}: the job's {n} ranks do not split into groups of {k}"
            )));
        }
        let g = rank / k;
        let child = comm
            .split(Some(g as u32), rank as i64)?
            .ok_or_else(|| ferroccl::Error::InvalidArgument("--split: no group".into()))?;
        check_root(&child)?;
        if child.rank() == 0 {
            println!(
                "# group {g} of {}: job ranks {:?}, communicator {:#018x}",
                n / k,
                child.job_ranks(),
                child.id()
            );
        }
        return body(&child);
    }
    if let Some(list) = &a.group {
        let r = match comm.group(list)? {
            Some(child) => {
                check_root(&child)?;
                if child.rank() == 0 {
                    println!(
                        "# group of job ranks {:?} (the others wait), communicator {:#018x}",
                        child.job_ranks(),
                        child.id()
                    );
                }
                body(&child)
            }
            None => Ok(true),
        };
        // The ranks outside the group wait for it; a failure inside it fails them too.
        comm.barrier()?;
        return r;
    }
    body(comm)
}

/// `--device cuda` and `--transport cuda-ipc` need the `cuda` feature and a GPU: say
/// which is missing, at once, with the typed error.
fn check_device(a: &BenchArgs, transport: TransportKind) -> ferroccl::Result<()> {
    if a.device != "cuda" {
        if transport == TransportKind::CudaIpc {
            return Err(ferroccl::Error::InvalidArgument(
                "--transport cuda-ipc moves device buffers: add --device cuda".into(),
            ));
        }
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        ferroccl::cuda::probe().map(|_| ())
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(ferroccl::Error::Unavailable {
            what: "--device cuda".into(),
            why: "this build has no CUDA support (build with --features cuda)".into(),
        })
    }
}

/// Message sizes in bytes: from -b to -e by -f, each rounded down to whole elements
/// (and, for the blocked collectives, to whole blocks of one element per rank at least).
fn sizes(a: &BenchArgs, unit: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = a.min_bytes.max(unit);
    loop {
        v.push(s / unit * unit);
        if s >= a.max_bytes || a.step_factor < 2 {
            break;
        }
        s = s.saturating_mul(a.step_factor).min(a.max_bytes);
    }
    v.dedup();
    v
}

fn rank_main(
    a: &BenchArgs,
    coll: Coll,
    dtype: DataType,
    op: ReduceOp,
    c: &Communicator,
    tname: &str,
) -> ferroccl::Result<bool> {
    #[cfg(feature = "cuda")]
    if a.device == "cuda" {
        return device::rank_main(a, coll, dtype, op, c, tname);
    }
    with_dtype!(dtype, bench_typed(a, coll, op, c, tname))
}

/// Rank `r`'s input element `i`: small integers, so every reduction order gives the
/// exact same answer in every type and the check can be exact.
fn value(op: ReduceOp, r: usize, i: usize) -> f64 {
    match op {
        ReduceOp::Prod => 1.0 + (i + r).is_multiple_of(7) as u8 as f64,
        _ => ((i * 7 + r * 13) % 17) as f64,
    }
}

fn expected(op: ReduceOp, n: usize, i: usize) -> f64 {
    let xs = (0..n).map(|r| value(op, r, i));
    match op {
        ReduceOp::Sum => xs.sum(),
        ReduceOp::Avg => xs.sum::<f64>() / n as f64,
        ReduceOp::Prod => xs.product(),
        ReduceOp::Min => xs.fold(f64::INFINITY, f64::min),
        _ => xs.fold(f64::NEG_INFINITY, f64::max),
    }
}

fn fill<T: Element>(v: &mut [T], op: ReduceOp, r: usize, first: usize) {
    for (k, x) in v.iter_mut().enumerate() {
        *x = T::from_f64(value(op, r, first + k));
    }
}

fn wrong<T: Element>(x: T, want: f64) -> bool {
    let want = T::from_f64(want);
    if T::DTYPE.is_float() {
        let (g, w) = (x.to_f64(), want.to_f64());
        // Written so that a NaN result counts as wrong.
        let close = (g - w).abs() <= 1e-2 * w.abs().max(1.0);
        !close
    } else {
        x != want
    }
}

/// Wrong elements of this rank's result of `coll` over `count` elements (the whole
/// buffer's count; the rank's block for the blocked collectives is derived).
fn count_wrong<T: Element>(
    coll: Coll,
    res: &[T],
    op: ReduceOp,
    n: usize,
    rank: usize,
    root: usize,
    count: usize,
) -> u64 {
    let block = count / n;
    let bad =
        |it: &mut dyn Iterator<Item = (T, f64)>| it.filter(|&(x, w)| wrong(x, w)).count() as u64;
    match coll {
        Coll::AllReduce => bad(&mut res[..count]
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, expected(op, n, i)))),
        Coll::ReduceScatter => bad(&mut res[..block]
            .iter()
            .enumerate()
            .map(|(k, &x)| (x, expected(op, n, rank * block + k)))),
        Coll::AllGather => bad(&mut res[..count]
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, value(ReduceOp::Sum, i / block.max(1), i % block.max(1))))),
        Coll::Broadcast => bad(&mut res[..count]
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, value(ReduceOp::Sum, root, i)))),
        Coll::Reduce if rank == root => bad(&mut res[..count]
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, expected(op, n, i)))),
        Coll::Reduce => 0,
        // Block q came from rank q's block for this rank.
        Coll::AllToAll => bad(&mut res[..count].iter().enumerate().map(|(i, &x)| {
            let (q, k) = (i / block.max(1), i % block.max(1));
            (x, value(ReduceOp::Sum, q, rank * block + k))
        })),
        Coll::Gather if rank == root => bad(&mut res[..count]
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, value(ReduceOp::Sum, i / block.max(1), i % block.max(1))))),
        Coll::Gather => 0,
        Coll::Scatter => bad(&mut res[..block]
            .iter()
            .enumerate()
            .map(|(k, &x)| (x, value(ReduceOp::Sum, root, rank * block + k)))),
        Coll::SendRecv => bad(&mut res[..count]
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, value(ReduceOp::Sum, (rank + n - 1) % n, i)))),
    }
}

/// Seconds per operation, the same on every rank, and the bytes this rank's links
/// moved during the iterations: with `--stat avg` the mean of back-to-back iterations
/// (max over ranks); with `--stat median` each iteration timed after a barrier, the
/// max over ranks per iteration, then the median. Barriers move headers but no
/// payload, so the payload count is the operations' alone.
/// The payload bytes are also given split `(within this rank's host, to other hosts)`
/// when the communicator knows the hosts.
fn timed(
    c: &Communicator,
    a: &BenchArgs,
    mut op: impl FnMut() -> ferroccl::Result<()>,
) -> ferroccl::Result<Timed> {
    let before = (c.wire_stats(), c.wire_stats_by_host());
    let sent = |c: &Communicator| {
        let by_host = before
            .1
            .as_ref()
            .zip(c.wire_stats_by_host())
            .map(|(b, a)| (a.0.since(&b.0).payload_sent, a.1.since(&b.1).payload_sent));
        (c.wire_stats().since(&before.0), by_host)
    };
    if a.stat == "median" {
        let mut ts = Vec::with_capacity(a.iters.min(1 << 20));
        for _ in 0..a.iters {
            c.barrier()?;
            let t0 = Instant::now();
            op()?;
            ts.push(t0.elapsed().as_secs_f64());
        }
        let (wire, by_host) = sent(c);
        c.all_reduce(&mut ts, ReduceOp::Max)?;
        ts.sort_by(f64::total_cmp);
        return Ok((ts[ts.len() / 2], wire, by_host));
    }
    let t0 = Instant::now();
    for _ in 0..a.iters {
        op()?;
    }
    let secs = t0.elapsed().as_secs_f64() / a.iters as f64;
    let (wire, by_host) = sent(c);
    Ok((max_over_ranks(c, secs)?, wire, by_host))
}

/// Seconds per operation, the payload bytes this rank sent, and those split by host.
type Timed = (f64, ferroccl::WireStats, Option<(u64, u64)>);

fn max_over_ranks(c: &Communicator, x: f64) -> ferroccl::Result<f64> {
    let mut v = [x];
    c.all_reduce(&mut v, ReduceOp::Max)?;
    Ok(v[0])
}

/// Buffers of one rank: `send` holds this rank's input for the largest size.
struct Bufs<T> {
    send: Vec<T>,
    recv: Vec<T>,
}

impl<T: Element> Bufs<T> {
    /// Sets up the input of `coll` for `count` elements (whole-buffer count).
    fn prepare(&mut self, coll: Coll, op: ReduceOp, n: usize, rank: usize, count: usize) {
        match coll {
            // This rank's block of the gathered buffer.
            Coll::AllGather | Coll::Gather => {
                fill(&mut self.send[..count / n], ReduceOp::Sum, rank, 0)
            }
            Coll::Broadcast | Coll::AllToAll | Coll::Scatter | Coll::SendRecv => {
                fill(&mut self.send[..count], ReduceOp::Sum, rank, 0)
            }
            _ => fill(&mut self.send[..count], op, rank, 0),
        }
    }

    /// One out-of-place operation; the result is in `recv`.
    fn out_of_place(
        &mut self,
        c: &Communicator,
        coll: Coll,
        op: ReduceOp,
        root: usize,
        count: usize,
    ) -> ferroccl::Result<()> {
        let n = c.world_size();
        let (send, recv) = (&self.send, &mut self.recv);
        match coll {
            Coll::AllReduce => c.all_reduce_into(&send[..count], &mut recv[..count], op),
            Coll::ReduceScatter => c.reduce_scatter(&send[..count], &mut recv[..count / n], op),
            Coll::AllGather => c.all_gather(&send[..count / n], &mut recv[..count]),
            Coll::Broadcast => {
                recv[..count].copy_from_slice(&send[..count]);
                c.broadcast(&mut recv[..count], root)
            }
            Coll::Reduce => c.reduce_into(&send[..count], &mut recv[..count], op, root),
            Coll::AllToAll => c.all_to_all(&send[..count], &mut recv[..count]),
            Coll::Gather => c.gather(&send[..count / n], &mut recv[..count], root),
            Coll::Scatter => c.scatter(&send[..count], &mut recv[..count / n], root),
            Coll::SendRecv => {
                let r = c.rank();
                c.p2p_batch(|b| {
                    b.send(&send[..count], (r + 1) % n, 0).recv(
                        &mut recv[..count],
                        (r + n - 1) % n,
                        0,
                    );
                })
            }
        }
    }

    /// Refills `recv` as the in-place form's input.
    fn reset_in_place(&mut self, coll: Coll, n: usize, rank: usize, count: usize) {
        match coll {
            // The in-place exchange receives into `send`: refill `recv` anew.
            Coll::SendRecv => fill(&mut self.recv[..count], ReduceOp::Sum, rank, 0),
            Coll::AllGather | Coll::Gather => {
                let b = count / n;
                let (send, recv) = (&self.send, &mut self.recv);
                recv[rank * b..(rank + 1) * b].copy_from_slice(&send[..b]);
            }
            _ => self.recv[..count].copy_from_slice(&self.send[..count]),
        }
    }

    /// One in-place operation on `recv`.
    fn in_place(
        &mut self,
        c: &Communicator,
        coll: Coll,
        op: ReduceOp,
        root: usize,
        count: usize,
    ) -> ferroccl::Result<()> {
        let buf = &mut self.recv[..count];
        match coll {
            Coll::AllReduce => c.all_reduce(buf, op),
            Coll::ReduceScatter => c.reduce_scatter_in_place(buf, op),
            Coll::AllGather => c.all_gather_in_place(buf),
            Coll::Broadcast => c.broadcast(buf, root),
            Coll::Reduce => c.reduce(buf, op, root),
            Coll::AllToAll => c.all_to_all_in_place(buf),
            Coll::Gather => c.gather_in_place(buf, root),
            Coll::Scatter => c.scatter_in_place(buf, root),
            Coll::SendRecv => {
                // The other buffer: what `recv` holds goes right, `send` receives.
                let (r, n) = (c.rank(), c.world_size());
                let (send, recv) = (&mut self.send, &self.recv);
                c.p2p_batch(|b| {
                    b.send(&recv[..count], (r + 1) % n, 0).recv(
                        &mut send[..count],
                        (r + n - 1) % n,
                        0,
                    );
                })
            }
        }
    }

    /// The in-place result laid out as the out-of-place one (this rank's block first).
    fn in_place_result(&self, coll: Coll, n: usize, rank: usize, count: usize) -> Vec<T> {
        match coll {
            Coll::ReduceScatter | Coll::Scatter => {
                let b = count / n;
                self.recv[rank * b..(rank + 1) * b].to_vec()
            }
            Coll::SendRecv => self.send[..count].to_vec(),
            _ => self.recv[..count].to_vec(),
        }
    }
}

fn bench_typed<T: Element>(
    a: &BenchArgs,
    coll: Coll,
    op: ReduceOp,
    c: &Communicator,
    tname: &str,
) -> ferroccl::Result<bool> {
    let n = c.world_size();
    if a.law.is_some() && n < 2 {
        // One rank sends nothing: there is no link whose law could be checked.
        return Err(ferroccl::Error::InvalidArgument(
            "--law needs at least 2 ranks".into(),
        ));
    }
    let rank = c.rank();
    let root = a.root;
    let esize = std::mem::size_of::<T>();
    let unit = if coll.blocked() { esize * n } else { esize };
    let sizes = sizes(a, unit);
    let max_count = sizes.iter().max().copied().unwrap_or(0) / esize;
    let mut bufs = Bufs {
        send: vec![T::default(); max_count],
        recv: vec![T::default(); max_count],
    };
    let printer = rank == 0;
    let op_name = if coll.reduces() { op.name() } else { "none" };
    let root_col: i64 = if coll.rooted() { root as i64 } else { -1 };
    if printer {
        println!(
            "# ferroccl bench: {}, {n} ranks, transport {tname}, segment {} B, busy-poll {:?}, timeout {:?}",
            coll.name(),
            c.config().tuning.segment_bytes,
            c.config().tuning.busy_poll,
            c.config().tuning.timeout
        );
        let links = c.link_classes();
        println!("# links of rank 0: {}", describe_links(&links));
        if links.iter().any(|(_, class)| *class == "tcp") {
            let want = &c.config().transport.tcp.congestion;
            let (now, system) = ferroccl::transport::tcp_congestion_in_effect(want)?;
            println!("# tcp congestion control: {now} (system default {system})");
        }
        println!(
            "# minBytes {} maxBytes {} step: {}(factor) warmup iters: {} iters: {} validation: {} timing: {}",
            a.min_bytes, a.max_bytes, a.step_factor, a.warmup, a.iters, a.check, a.stat
        );
        println!("#");
        println!(
            "# busbw = algbw x {}; wire: payload bytes the busiest rank sent per operation, counted by its links, over {}",
            coll.factor_text(),
            match coll {
                Coll::AllReduce if c.host_layout().and_then(|l| l.shape()).is_some_and(|(h, k)| h >= 2 && k >= 2) =>
                    "the ring law 2(n-1)/n*S (hier: 2(k-1)/k*S + 2(H-1)/H*S/k, H hosts of k ranks)",
                c => c.law_text(),
            }
        );
        if coll == Coll::SendRecv {
            println!("# in-place: the same exchange from the other buffer (a batch borrows its send and receive buffers apart)");
        }
        if let Some(rate) = a.law_rate() {
            println!(
                "# law: ring on links of {:.4} Gbit/s ({} B/s){}",
                rate * 8e-9,
                rate,
                match (coll, c.config().tuning.all_reduce_algo) {
                    (Coll::AllReduce, ferroccl::AllReduceAlgo::Auto) => {
                        "; all_reduce forced onto the ring for every size (small_message_bytes = 0; hierarchical on hosts of 2 or more ranks)"
                    }
                    (Coll::AllReduce, _) => "; all_reduce runs what --algo names",
                    _ => "",
                }
            );
        } else if coll == Coll::AllReduce {
            let t = &c.config().tuning;
            match (t.all_reduce_algo, t.cost_model) {
                (ferroccl::AllReduceAlgo::Auto, Some(m)) => println!(
                    "# algo: per size, the least time predicted on {m}{} (rab: Rabenseifner, tree: double binary tree)",
                    if t.measure_cost_model { " (measured on these links)" } else { "" }
                ),
                (ferroccl::AllReduceAlgo::Auto, None)
                    if c.all_reduce_algorithm(1 << 20) == ferroccl::Algorithm::TwoShot =>
                {
                    // Symmetric memory: the largest power of two of each algorithm.
                    let last = |a: ferroccl::Algorithm| {
                        (0..40)
                            .map(|k| 1usize << k)
                            .filter(|&b| c.all_reduce_algorithm(b) == a)
                            .last()
                            .unwrap_or(0)
                    };
                    let (rd, two) = (
                        last(ferroccl::Algorithm::RecursiveDoubling),
                        last(ferroccl::Algorithm::TwoShot),
                    );
                    println!(
                        "# algo: every rank on this host, symmetric memory: rd (recursive doubling over the rings) up to {rd} B, 2shot up to {two} B (each rank reduces 1/n of all the ranks' memory, then copies the rest; wire 'mem': no payload crossed a link), ring through the rings above"
                    )
                }
                (ferroccl::AllReduceAlgo::Auto, None) => println!(
                    "# algo: ring (hier on hosts of 2 or more ranks each), or rd (recursive doubling) for messages up to {} B: fewer steps, more bytes",
                    t.small_message_bytes
                ),
                (forced, _) => println!(
                    "# algo: {forced:?} for every size (rab: Rabenseifner, recursive halving then doubling; tree: double binary tree)"
                ),
            }
        }
        let blank = ["", "", "", "", ""];
        println!(
            "#{:>11} {:>12} {:>8} {:>6} {:>6}   {:>8} {:>7} {:>7} {:>6}   {:>8} {:>7} {:>7} {:>6} {:>7} {:>5}",
            blank[0], blank[1], blank[2], blank[3], blank[4], "out-of-place", "", "", "", "in-place", "", "", "", "", ""
        );
        println!(
            "#{:>11} {:>12} {:>8} {:>6} {:>6}   {:>8} {:>7} {:>7} {:>6}   {:>8} {:>7} {:>7} {:>6} {:>7} {:>5}",
            "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "wire", "algo"
        );
        println!(
            "#{:>11} {:>12} {:>8} {:>6} {:>6}   {:>8} {:>7} {:>7} {:>6}   {:>8} {:>7} {:>7} {:>6} {:>7} {:>5}",
            "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "(x law)", ""
        );
    }
    let factor = coll.bus_factor(n);
    // On several hosts of several ranks, all_reduce's bytes are also counted per link
    // class (within a host, between hosts).
    let hosts_of: Option<Vec<Vec<usize>>> = c
        .host_layout()
        .filter(|l| {
            matches!(
                coll,
                Coll::AllReduce | Coll::ReduceScatter | Coll::AllGather
            ) && l.shape().is_some_and(|(h, k)| h >= 2 && k >= 2)
        })
        .map(|l| l.hosts().to_vec());
    let mut rows = Vec::new();
    let mut total_wrong = 0u64;
    for &bytes in &sizes {
        let count = bytes / esize;
        bufs.prepare(coll, op, n, rank, count);
        for _ in 0..a.warmup {
            bufs.out_of_place(c, coll, op, root, count)?;
        }
        c.barrier()?;
        let (oop, wire, by_host) = timed(c, a, || bufs.out_of_place(c, coll, op, root, count))?;
        let oop_wrong = if a.check != 0 {
            count_wrong(coll, &bufs.recv, op, n, rank, root, count)
        } else {
            0
        };

        // In place: the buffer is reduced again each iteration; it is refilled and
        // run once more for the check.
        bufs.reset_in_place(coll, n, rank, count);
        for _ in 0..a.warmup {
            bufs.in_place(c, coll, op, root, count)?;
        }
        c.barrier()?;
        let (ip, _, _) = timed(c, a, || bufs.in_place(c, coll, op, root, count))?;
        let ip_wrong = if a.check != 0 {
            bufs.reset_in_place(coll, n, rank, count);
            bufs.in_place(c, coll, op, root, count)?;
            let res = bufs.in_place_result(coll, n, rank, count);
            count_wrong(coll, &res, op, n, rank, root, count)
        } else {
            0
        };

        let wire_bytes = max_over_ranks(c, wire.payload_sent as f64 / a.iters as f64)?;
        let header_bytes = max_over_ranks(c, wire.header_sent as f64 / a.iters as f64)?;
        // Every rank has the same layout, so every rank takes part or none does.
        let hosts = match (&hosts_of, by_host) {
            (Some(hosts), Some((within, between))) => {
                let within = max_over_ranks(c, within as f64 / a.iters as f64)?;
                let mut per = vec![0.0f64; n];
                per[rank] = between as f64 / a.iters as f64;
                c.all_reduce(&mut per, ReduceOp::Sum)?;
                let busiest = hosts
                    .iter()
                    .map(|h| h.iter().map(|&r| per[r]).sum::<f64>())
                    .fold(0.0, f64::max);
                Some((within, busiest))
            }
            _ => None,
        };
        let mut w = [oop_wrong as f64, ip_wrong as f64];
        c.all_reduce(&mut w, ReduceOp::Sum)?;
        let row = Row {
            bytes,
            count,
            oop_us: oop * 1e6,
            oop_wrong: w[0] as u64,
            ip_us: ip * 1e6,
            ip_wrong: w[1] as u64,
            wire_bytes,
            header_bytes,
            hosts,
        };
        total_wrong += row.oop_wrong + row.ip_wrong;
        if printer {
            let law = match hier_shape(c, coll, bytes) {
                // Per rank: 2(k-1)/k·S within its host and 2(H-1)/H·S/k to the others
                // (all-reduce); half of each for reduce-scatter and all-gather.
                Some((h, k)) => {
                    let (h, k) = (h as f64, k as f64);
                    let half = if coll == Coll::AllReduce { 1.0 } else { 0.5 };
                    half * (2.0 * (k - 1.0) / k + 2.0 * (h - 1.0) / (h * k)) * bytes as f64
                }
                None => coll.wire_law(n, bytes),
            };
            let on_memory = coll == Coll::AllReduce
                && matches!(
                    c.all_reduce_algorithm(bytes),
                    ferroccl::Algorithm::OneShot | ferroccl::Algorithm::TwoShot
                );
            let wire_col = if on_memory {
                // Read from the peers' memory: nothing crosses a link.
                "mem".into()
            } else if law > 0.0 {
                format!("{:.3}", row.wire_bytes / law)
            } else {
                "-".into()
            };
            let algo = match coll {
                Coll::AllReduce => match c.all_reduce_algorithm(bytes) {
                    ferroccl::Algorithm::Ring => "ring",
                    ferroccl::Algorithm::Rabenseifner => "rab",
                    ferroccl::Algorithm::Tree => "tree",
                    ferroccl::Algorithm::Hierarchical => "hier",
                    ferroccl::Algorithm::OneShot => "1shot",
                    ferroccl::Algorithm::TwoShot => "2shot",
                    _ => "rd",
                },
                Coll::ReduceScatter | Coll::AllGather => match c.reduce_scatter_algorithm() {
                    ferroccl::Algorithm::Hierarchical => "hier",
                    _ => "ring",
                },
                Coll::AllToAll => "pair",
                Coll::Gather | Coll::Scatter => "star",
                Coll::SendRecv => "p2p",
                _ if c.rooted_algorithm() == ferroccl::Algorithm::Tree => "tree",
                _ => "chain",
            };
            let gb = |us: f64| bytes as f64 / (us * 1e-6) / 1e9;
            let wrong_col = |w: u64| {
                if a.check != 0 {
                    w.to_string()
                } else {
                    "N/A".into()
                }
            };
            println!(
                "{:>12} {:>12} {:>8} {:>6} {:>6}   {:>8.2} {:>7.2} {:>7.2} {:>6}   {:>8.2} {:>7.2} {:>7.2} {:>6} {:>7} {:>5}",
                bytes,
                count,
                T::DTYPE.name(),
                op_name,
                root_col,
                row.oop_us,
                gb(row.oop_us),
                gb(row.oop_us) * factor,
                wrong_col(row.oop_wrong),
                row.ip_us,
                gb(row.ip_us),
                gb(row.ip_us) * factor,
                wrong_col(row.ip_wrong),
                wire_col,
                algo
            );
        }
        rows.push(row);
    }
    // Every rank measures the memory at once (the law's rates are what the ranks get
    // while they all copy); rank 0 prints.
    let mem_rates = if a.law == Some(LawArg::Mem) {
        Some(mem_rates(c, &rows)?)
    } else {
        None
    };
    if let (true, Some(rates)) = (printer, &mem_rates) {
        print_mem_law(c, &rows, rates);
    }
    if printer {
        let avg_busbw = rows
            .iter()
            .map(|r| r.bytes as f64 / (r.ip_us * 1e-6) / 1e9 * factor)
            .sum::<f64>()
            / rows.len().max(1) as f64;
        println!(
            "# Out of bounds values : {} {}",
            total_wrong,
            if total_wrong == 0 { "OK" } else { "FAILED" }
        );
        println!("# Avg bus bandwidth    : {avg_busbw:.4} ");
        println!("#");
        if let Some(hosts) = &hosts_of {
            print_host_laws(&rows, hosts, coll != Coll::AllReduce, |b| {
                hier_shape(c, coll, b).is_some()
            });
        }
        // The hierarchical all-reduce is held to its own law, on each host's link.
        let largest = rows.last().map_or(0, |r| r.bytes);
        let law = match (a.law_rate(), coll.ring_law(n), hier_shape(c, coll, largest)) {
            (Some(rate), Some(_), Some((h, k))) if coll == Coll::AllReduce => {
                Some(print_law(&rows, RingLaw::hierarchical(h, k), rate, n, true))
            }
            (Some(rate), Some(_), Some((h, k))) => Some(print_law(
                &rows,
                RingLaw::hierarchical_half(h, k),
                rate,
                n,
                true,
            )),
            (Some(rate), Some(law), _) => Some(print_law(&rows, law, rate, n, false)),
            _ => None,
        };
        if let Some(path) = &a.json {
            let meta = JsonMeta {
                coll,
                n,
                tname,
                dt: T::DTYPE,
                op: op_name,
                root: root_col,
                factor,
                law,
            };
            write_json(path, &meta, &rows)?;
        }
    }
    Ok(total_wrong == 0)
}

struct JsonMeta<'a> {
    coll: Coll,
    n: usize,
    tname: &'a str,
    dt: DataType,
    op: &'a str,
    root: i64,
    factor: f64,
    law: Option<LawReport>,
}

/// What `--law` found: the law, the link rate it was given, and the fit (if any).
struct LawReport {
    law: RingLaw,
    rate: f64,
    fit: Option<Fit>,
    /// Bytes per second this rank's CPU combines (f32 sum): the model's third number,
    /// written next to the fit for `FERROCCL_COST_MODEL=@FILE`.
    reduce: f64,
}

impl LawReport {
    /// α used for predictions: the fitted one, 0 when there is no fit.
    fn alpha(&self) -> f64 {
        self.fit.map_or(0.0, |f| f.alpha_s)
    }

    /// Predicted seconds for `bytes`: steps × α (fitted) + factor × S / RATE.
    fn predict_s(&self, bytes: usize) -> f64 {
        self.law
            .predict_s(bytes as f64, self.alpha(), 1.0 / self.rate)
    }
}

/// `(hosts, ranks per host)` when `coll` of `bytes` runs hierarchical.
fn hier_shape(c: &Communicator, coll: Coll, bytes: usize) -> Option<(usize, usize)> {
    let algo = match coll {
        Coll::AllReduce => c.all_reduce_algorithm(bytes),
        Coll::ReduceScatter | Coll::AllGather => c.reduce_scatter_algorithm(),
        _ => return None,
    };
    (algo == ferroccl::Algorithm::Hierarchical)
        .then(|| c.host_layout().and_then(|l| l.shape()))
        .flatten()
}

/// Prints the bytes per link class (lines starting `hosts`): within a host per rank,
/// between hosts per host, each against the law of the algorithm that ran
/// (`hier(bytes)`: the hierarchical one, else the ring's).
fn print_host_laws(rows: &[Row], hosts: &[Vec<usize>], half: bool, hier: impl Fn(usize) -> bool) {
    println!(
        "# bytes per link class: within a host (busiest rank) and between hosts (busiest host, its ranks summed), per operation"
    );
    println!(
        "#{:>5} {:>11} {:>5} {:>12} {:>12} {:>7} {:>12} {:>12} {:>7}",
        "", "size", "algo", "within", "law", "wire", "between", "law", "wire"
    );
    println!(
        "#{:>5} {:>11} {:>5} {:>12} {:>12} {:>7} {:>12} {:>12} {:>7}",
        "", "(B)", "", "(B/rank)", "(B/rank)", "(x law)", "(B/host)", "(B/host)", "(x law)"
    );
    for r in rows {
        let Some((within, between)) = r.hosts else {
            continue;
        };
        let h = hier(r.bytes);
        let Some(HostLaw {
            within: lw,
            between: lb,
        }) = host_law(h, hosts)
        else {
            continue;
        };
        // Reduce-scatter and all-gather move half an all-reduce's bytes on every link.
        let s = r.bytes as f64 * if half { 0.5 } else { 1.0 };
        let x = |got: f64, law: f64| {
            if law > 0.0 {
                format!("{:.3}", got / law)
            } else {
                "-".into()
            }
        };
        println!(
            "hosts {:>11} {:>5} {:>12.0} {:>12.0} {:>7} {:>12.0} {:>12.0} {:>7}",
            r.bytes,
            if h { "hier" } else { "ring" },
            within,
            lw * s,
            x(within, lw * s),
            between,
            lb * s,
            x(between, lb * s)
        );
    }
    println!("#");
}

/// This host's copy and reduce rates (bytes per second) at each row's size: every rank
/// times a `memcpy` and an f32 `y += x` over buffers of that size at once (after a
/// barrier), the median of several runs, and the slowest rank's time counts.
fn mem_rates(c: &Communicator, rows: &[Row]) -> ferroccl::Result<Vec<(f64, f64)>> {
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let len = (r.bytes / 4).max(1);
        // Both page-aligned: glibc's `rep movsb` copy runs many times slower when the
        // destination sits a few bytes past the source modulo a page (see the
        // library's `sys/mem.rs`), which would measure the allocator, not the memory.
        let (sbuf, mut dbuf) = (vec![1.0f32; len + 1024], vec![0.0f32; len + 1024]);
        let page = |v: &[f32]| (4096 - (v.as_ptr() as usize % 4096)) % 4096 / 4;
        let (so, d_o) = (page(&sbuf), page(&dbuf));
        let src = &sbuf[so..so + len];
        let dst = &mut dbuf[d_o..d_o + len];
        // Enough repetitions to time a few ms, at least 5.
        let reps = (((8usize << 20) / (len * 4)).clamp(5, 2000)) | 1;
        let mut time = |f: &mut dyn FnMut(&mut [f32])| -> ferroccl::Result<f64> {
            f(dst);
            c.barrier()?;
            let mut ts: Vec<f64> = (0..reps)
                .map(|_| {
                    let t0 = Instant::now();
                    f(dst);
                    t0.elapsed().as_secs_f64()
                })
                .collect();
            ts.sort_by(f64::total_cmp);
            let mut t = [ts[reps / 2]];
            c.all_reduce(&mut t, ReduceOp::Max)?;
            Ok(t[0])
        };
        let copy = time(&mut |d| d.copy_from_slice(std::hint::black_box(src)))?;
        let reduce = time(&mut |d| {
            ferroccl::reduce::reduce_into(d, std::hint::black_box(src), ReduceOp::Sum)
        })?;
        let b = (len * 4) as f64;
        out.push((b / copy, b / reduce));
    }
    Ok(out)
}

/// Prints the memory-bandwidth law's table (lines starting `mem`): per size the bytes
/// the algorithm that ran copies and reduces, the rates measured, the predicted time
/// and measured (in-place) over predicted.
fn print_mem_law(c: &Communicator, rows: &[Row], rates: &[(f64, f64)]) {
    use crate::law::MemLaw;
    let n = c.world_size();
    println!(
        "# memory law, n = {n}: t = copy·S/C + reduce·S/R, C and R this host's memcpy and f32 y += x rates at that size, every rank at once (slowest rank, median); meas = in-place time"
    );
    println!(
        "#{:>3} {:>11} {:>6} {:>12} {:>12} {:>8} {:>8} {:>10} {:>10} {:>9}",
        "", "size", "algo", "copied", "reduced", "C", "R", "meas", "pred", "meas/pred"
    );
    println!(
        "#{:>3} {:>11} {:>6} {:>12} {:>12} {:>8} {:>8} {:>10} {:>10} {:>9}",
        "", "(B)", "", "(B/rank)", "(B/rank)", "(GB/s)", "(GB/s)", "(us)", "(us)", ""
    );
    for (r, &(cr, rr)) in rows.iter().zip(rates) {
        let (name, law) = match c.all_reduce_algorithm(r.bytes) {
            ferroccl::Algorithm::OneShot => ("1shot", Some(MemLaw::one_shot(n))),
            ferroccl::Algorithm::TwoShot => ("2shot", Some(MemLaw::two_shot(n))),
            _ => ("other", None),
        };
        let s = r.bytes as f64;
        let pred = law.and_then(|l| l.predict_s(s, cr, rr));
        let (copied, reduced) = law.map_or(("-".into(), "-".into()), |l| {
            (format!("{:.0}", l.copy * s), format!("{:.0}", l.reduce * s))
        });
        println!(
            "mem {:>11} {:>6} {:>12} {:>12} {:>8.2} {:>8.2} {:>10.2} {:>10} {:>9}",
            r.bytes,
            name,
            copied,
            reduced,
            cr * 1e-9,
            rr * 1e-9,
            r.ip_us,
            pred.map_or("-".into(), |p| format!("{:.2}", p * 1e6)),
            pred.map_or("-".into(), |p| format!("{:.3}", r.ip_us / (p * 1e6)))
        );
    }
    if rows.iter().any(|r| {
        !matches!(
            c.all_reduce_algorithm(r.bytes),
            ferroccl::Algorithm::OneShot | ferroccl::Algorithm::TwoShot
        )
    }) {
        println!("# the memory law counts one-shot and two-shot, which run on symmetric memory (every rank on this host over shm or auto, FERROCCL_SHM_SYMMETRIC not off); other rows say '-'");
    }
    println!("#");
}

/// Prints the ring-law table (lines starting `law`) and the α-β fit, from the rows'
/// in-place times. `per_host`: the law counts the bytes each host sends to the
/// others (the hierarchical all-reduce), not each rank's.
fn print_law(rows: &[Row], law: RingLaw, rate: f64, n: usize, per_host: bool) -> LawReport {
    let points: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| (r.bytes as f64, r.ip_us * 1e-6))
        .collect();
    let rep = LawReport {
        law,
        rate,
        fit: crate::law::fit(&law, &points),
        reduce: ferroccl::reduce::measured_rate(4 << 20),
    };
    let (steps, fac) = (law.steps, law.factor);
    let (name, unit) = if per_host {
        ("hierarchical law, per host's link", "(B/host)")
    } else {
        ("ring law", "(B/rank)")
    };
    println!(
        "# {name}, n = {n}: t = {steps}·α + {fac:.4}·S/R with R = {:.4} Gbit/s and α the fitted α below{}; meas = in-place time",
        rate * 8e-9,
        if rep.fit.is_none() { " (no fit: α = 0)" } else { "" }
    );
    println!(
        "#{:>3} {:>11} {:>12} {:>12} {:>7} {:>12} {:>12} {:>9}",
        "", "size", "payload", "law", "wire", "meas", "pred", "meas/pred"
    );
    println!(
        "#{:>3} {:>11} {:>12} {:>12} {:>7} {:>12} {:>12} {:>9}",
        "", "(B)", unit, unit, "(x law)", "(us)", "(us)", ""
    );
    for r in rows {
        let lb = law.bytes_per_rank(r.bytes as f64);
        let pred_us = rep.predict_s(r.bytes) * 1e6;
        let payload = match r.hosts {
            Some((_, between)) if per_host => between,
            _ => r.wire_bytes,
        };
        println!(
            "law {:>11} {:>12.0} {:>12.0} {:>7} {:>12.2} {:>12.2} {:>9.3}",
            r.bytes,
            payload,
            lb,
            if lb > 0.0 {
                format!("{:.3}", payload / lb)
            } else {
                "-".into()
            },
            r.ip_us,
            pred_us,
            r.ip_us / pred_us
        );
    }
    match rep.fit {
        Some(f) => println!(
            "# fit over {} sizes (least squares, α >= 0): alpha = {:.2} us, beta = {:.4} ns/B, 1/beta = {:.4} Gbit/s = {:.4} of RATE",
            rows.len(),
            f.alpha_s * 1e6,
            f.beta_s_per_byte * 1e9,
            f.link_bytes_per_s() * 8e-9,
            f.link_bytes_per_s() / rate
        ),
        None => println!(
            "# fit: not possible over these {} size(s) (needs two sizes and times that grow with size)",
            rows.len()
        ),
    }
    println!(
        "# reduce (this CPU, f32 sum): {:.3} GB/s; with --json FILE, FERROCCL_COST_MODEL=@FILE chooses all-reduces by this fit",
        rep.reduce * 1e-9
    );
    println!("#");
    rep
}

fn write_json(path: &std::path::Path, m: &JsonMeta<'_>, rows: &[Row]) -> ferroccl::Result<()> {
    let mut s = String::new();
    let _ = write!(
        s,
        "{{\n  \"tool\": \"ferroccl bench\",\n  \"collective\": \"{}\",\n  \"ranks\": {},\n  \"transport\": \"{}\",\n  \"dtype\": \"{}\",\n  \"op\": \"{}\",\n  \"root\": {},\n  \"bus_factor\": {},\n",
        m.coll.name(),
        m.n,
        m.tname,
        m.dt.name(),
        m.op,
        m.root,
        m.factor
    );
    if let Some(l) = &m.law {
        let _ = writeln!(
            s,
            "  \"law\": {{\"rate_bytes_per_s\": {}, \"steps\": {}, \"factor\": {}, \"meas\": \"ip_time_us\"}},",
            l.rate, l.law.steps, l.law.factor
        );
        match l.fit {
            Some(f) => {
                let _ = writeln!(
                    s,
                    "  \"fit\": {{\"alpha_s\": {:e}, \"beta_s_per_byte\": {:e}, \"link_bytes_per_s\": {}, \"rate_bytes_per_s\": {}, \"reduce_bytes_per_s\": {}}},",
                    f.alpha_s,
                    f.beta_s_per_byte,
                    f.link_bytes_per_s(),
                    l.rate,
                    l.reduce
                );
            }
            None => s.push_str("  \"fit\": null,\n"),
        }
    }
    s.push_str("  \"rows\": [\n");
    for (i, r) in rows.iter().enumerate() {
        let gb = |us: f64| r.bytes as f64 / (us * 1e-6) / 1e9;
        if let Some(l) = &m.law {
            let pred_us = l.predict_s(r.bytes) * 1e6;
            let _ = write!(
                s,
                "    {{\"pred_time_us\": {:.3}, \"meas_over_pred\": {:.6}, ",
                pred_us,
                r.ip_us / pred_us
            );
        } else {
            s.push_str("    {");
        }
        let _ = writeln!(
            s,
            "\"bytes\": {}, \"count\": {}, \"oop_time_us\": {:.3}, \"oop_algbw_gbs\": {:.6}, \"oop_busbw_gbs\": {:.6}, \"oop_wrong\": {}, \"ip_time_us\": {:.3}, \"ip_algbw_gbs\": {:.6}, \"ip_busbw_gbs\": {:.6}, \"ip_wrong\": {}, \"payload_bytes_sent_per_rank\": {:.1}, \"header_bytes_sent_per_rank\": {:.1}, \"wire_law_bytes\": {:.1}}}{}",
            r.bytes,
            r.count,
            r.oop_us,
            gb(r.oop_us),
            gb(r.oop_us) * m.factor,
            r.oop_wrong,
            r.ip_us,
            gb(r.ip_us),
            gb(r.ip_us) * m.factor,
            r.ip_wrong,
            r.wire_bytes,
            r.header_bytes,
            m.coll.wire_law(m.n, r.bytes),
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    s.push_str("  ]\n}\n");
    std::fs::write(path, s)
        .map_err(|e| ferroccl::Error::io(format!("writing {}", path.display()), e))
}
