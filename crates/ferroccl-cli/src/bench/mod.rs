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

mod bufs;
mod check;
#[cfg(feature = "cuda")]
mod device;
mod report;
mod typed;

use crate::law::RingLaw;
use clap::Args;
use ferroccl::transport::TransportKind;
use ferroccl::{Communicator, Config, DataType, ReduceOp};
use std::time::Duration;
use typed::bench_typed;

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
    /// Timed iterations per size, run exactly (nccl-tests' -n). Without it: at least
    /// 20, and as many more as fill 20 ms by the warm-up's pace (the same count on
    /// every rank), so that a small size's mean rests on thousands of operations
    /// rather than on 20 that one interruption can double.
    #[arg(short = 'n', long = "iters", value_parser = crate::args::iters)]
    pub iters: Option<usize>,
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

/// Timed iterations per size when `-n` is not given: at least this many...
pub const MIN_ITERS: usize = 20;
/// ... and as many as fill this long.
pub const AUTO_TIME: Duration = Duration::from_millis(20);
/// The most the automatic count runs.
const AUTO_MAX_ITERS: usize = 100_000;

/// How many timed iterations a size gets: `given` exactly (`-n`), else at least
/// [`MIN_ITERS`] and as many as fill [`AUTO_TIME`] at `per_op` seconds per operation
/// (the warm-up's pace, the slowest rank's; unknown without a warm-up), at most
/// 100,000.
pub fn iters_for(given: Option<usize>, per_op: Option<f64>) -> usize {
    if let Some(n) = given {
        return n;
    }
    match per_op {
        Some(t) if t.is_finite() && t > 0.0 => {
            let fill = (AUTO_TIME.as_secs_f64() / t)
                .ceil()
                .min(AUTO_MAX_ITERS as f64) as usize;
            fill.max(MIN_ITERS)
        }
        _ => MIN_ITERS,
    }
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

/// What the arguments name, once `validate` has checked them.
#[derive(Clone, Copy)]
struct Checked {
    coll: Coll,
    dtype: DataType,
    op: ReduceOp,
    transport: TransportKind,
}

/// Returns whether every result checked out.
fn run(a: BenchArgs) -> ferroccl::Result<bool> {
    let v = validate(&a)?;
    let launched = ferroccl::rendezvous::detect_env()?.is_some();
    if let Some(dir) = &a.trace {
        // Before any communicator: it sets FERROCCL_TRACE_DIR, for ranks started as
        // processes too. A launcher's ranks share the directory: none clears it.
        crate::trace::record_into(dir, !launched)?;
    }
    if launched {
        return run_launched(&a, v);
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
    match v.transport {
        TransportKind::Local => run_threads(&a, v),
        _ => run_processes(&a),
    }
}

/// Every check of the arguments that needs no communicator, in the order the errors
/// are reported: the names, `--law`, the sizes, the tuning flags, what this host can
/// run, then the transport and the device this build and machine have.
fn validate(a: &BenchArgs) -> ferroccl::Result<Checked> {
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
    config_for(a, Config::new(0, a.ranks.max(1), "127.0.0.1:1")).validate()?;
    if let Some(k) = a.split {
        if k == 0 {
            return Err(ferroccl::Error::InvalidArgument(
                "--split 0: groups need at least 1 rank".into(),
            ));
        }
    }
    check_host(a)?;
    if a.iters == Some(0) {
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
    check_device(a, transport)?;
    Ok(Checked {
        coll,
        dtype,
        op,
        transport,
    })
}

/// What this host can run (CPUs, processes, files) first, then the memory: every rank
/// of this host holds its buffers at once.
fn check_host(a: &BenchArgs) -> ferroccl::Result<()> {
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
    Ok(())
}

/// This process is one rank of a job a launcher started.
fn run_launched(a: &BenchArgs, v: Checked) -> ferroccl::Result<bool> {
    let Checked {
        coll,
        dtype,
        op,
        transport,
    } = v;
    let mut cfg = config_for(a, Config::from_env()?);
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
    let r = on_group(a, &comm, |c| {
        rank_main(a, coll, dtype, op, c, transport.name())
    });
    crate::trace::finish(&comm, a.trace.as_deref(), r)
}

/// `--transport local`: every rank a thread of this process, over in-process links.
fn run_threads(a: &BenchArgs, v: Checked) -> ferroccl::Result<bool> {
    let Checked {
        coll, dtype, op, ..
    } = v;
    let base = config_for(a, Config::default());
    let comms = Communicator::local_group(a.ranks, &base)?;
    let results: Vec<ferroccl::Result<bool>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
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

/// Every other transport: this very command again, once per rank, under our own
/// launcher.
fn run_processes(a: &BenchArgs) -> ferroccl::Result<bool> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_count_runs_exactly() {
        for n in [1, 20, 7777] {
            assert_eq!(iters_for(Some(n), Some(1e-9)), n);
            assert_eq!(iters_for(Some(n), None), n);
        }
    }

    #[test]
    fn the_automatic_count_fills_the_time_and_never_goes_below_the_minimum() {
        let fill = AUTO_TIME.as_secs_f64();
        // 1 us per operation: 20 ms takes 20,000 of them.
        assert_eq!(iters_for(None, Some(1e-6)), (fill / 1e-6).round() as usize);
        // Slow operations: the minimum, however long it takes.
        assert_eq!(iters_for(None, Some(fill)), MIN_ITERS);
        assert_eq!(iters_for(None, Some(10.0)), MIN_ITERS);
        // Just under the minimum's worth of time: the minimum.
        assert_eq!(iters_for(None, Some(fill / 19.0)), MIN_ITERS);
        assert_eq!(iters_for(None, Some(fill / 25.0)), 25);
        // Absurdly fast (a clock that did not move): capped.
        assert_eq!(iters_for(None, Some(1e-15)), AUTO_MAX_ITERS);
        // No pace (no warm-up), or a nonsense one: the minimum.
        for t in [
            None,
            Some(0.0),
            Some(-1.0),
            Some(f64::NAN),
            Some(f64::INFINITY),
        ] {
            assert_eq!(iters_for(None, t), MIN_ITERS, "{t:?}");
        }
    }
}
