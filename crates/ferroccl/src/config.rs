//! Everything a communicator needs, passed in explicitly: who this rank is in which job
//! ([`Job`]), how collectives run ([`Tuning`]), and which transport links the ranks,
//! with its options ([`TransportOptions`]).
//!
//! [`Config::from_env`] fills a config from a launcher's environment (the only place
//! the library reads environment variables is [`crate::rendezvous`]); embedders and
//! tests use [`Config::builder`]:
//!
//! ```
//! use ferroccl::{Config, TransportKind};
//! use std::time::Duration;
//!
//! let cfg = Config::builder(0, 4, "10.0.0.1:29500")
//!     .timeout(Duration::from_secs(30))
//!     .segment_bytes(1 << 20)
//!     .transport(TransportKind::Tcp)
//!     .build()?;
//! assert_eq!(cfg.job.world_size, 4);
//! assert_eq!(cfg.tuning.segment_bytes, 1 << 20);
//! # Ok::<(), ferroccl::Error>(())
//! ```
//!
//! Every struct here is `#[non_exhaustive]`: fields can be read and changed, and new
//! ones can be added without breaking anyone who builds configs through the builder.

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default for [`Tuning::timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default for [`Tuning::connect_timeout`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest timeout (of a wait or of the join) a [`Config`] takes: 7 days. Longer
/// ones are refused rather than overflowing a deadline.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);
/// Default for [`Tuning::segment_bytes`].
pub const DEFAULT_SEGMENT_BYTES: usize = 512 << 10;
/// Default for [`TcpOptions::socket_buffer`].
pub const DEFAULT_SOCKET_BUFFER: usize = 4 << 20;
/// Default for [`ShmOptions::ring_bytes`].
///
/// 1 MiB: a ring that small stays in a core's 1 MiB L2 and the shared L3 between its
/// writer and its reader, where a 4 MiB one (the first default) cycled its writes
/// through memory the caches had already let go. Measured on the 2-core development
/// machine, `ferroccl bench` with 1 MiB rings against 4 MiB, 6 interleaved pairs per
/// cell, 9 collectives × n = 2, 4 × 64 KiB / 1 MiB / 16 MiB: the median time ratio was
/// 0.64–0.99 in 48 of the 54 cells (all-to-all at n = 4 0.64 at 1 MiB and 0.72 at
/// 16 MiB, broadcast at 64 KiB 0.73–0.74, reduce 0.78–0.88), level in two and slower
/// in four, all at n = 4 on 2 CPUs: reduce-scatter 1.12 / 1.25 at 64 KiB / 1 MiB and
/// send/recv 1.09 / 1.15, where a writer that may run further ahead waits less often
/// for a reader that shares its CPU. A quarter of the shared memory, too.
pub const DEFAULT_SHM_RING_BYTES: usize = 1 << 20;
/// Default for [`ShmOptions::single_copy_min`].
///
/// Off: on the machine measured (a 2-core VM), pulling frames from the writer's memory
/// gave 0.34-0.73x the ring's all-reduce busbw at most sizes from 64 KiB to 64 MiB
/// (2 and 4 ranks), and at best the same (4 ranks, 4-16 MiB): the kernel pins the
/// writer's pages on every call, and a writer waits for its reader on every frame
/// instead of running ahead into the ring. Measure yours with `tools/ab-bench` (see the
/// book's Performance chapter) before turning it on.
pub const DEFAULT_SHM_SINGLE_COPY_MIN: usize = 0;
/// Default for [`Tuning::trace_capacity`].
pub const DEFAULT_TRACE_CAPACITY: usize = 2048;
/// Default for [`Tuning::busy_poll`].
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_millis(1);
/// Default for [`Tuning::small_message_bytes`].
pub const DEFAULT_SMALL_MESSAGE_BYTES: usize = 64 << 10;
/// Default rendezvous port, as torchrun's.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// A communicator's configuration; see the [module docs](self).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Who this process is, in which job, and where the job meets.
    pub job: Job,
    /// How collectives run: deadlines, pipelining, algorithm thresholds.
    pub tuning: Tuning,
    /// Which transport links the ranks, and its options.
    pub transport: TransportOptions,
}

pub use crate::algo::select::AllReduceAlgo;

/// An on/off setting as a user writes it: `on`, `1`, `true` or `off`, `0`, `false`.
fn on_off(v: &str) -> std::result::Result<bool, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "on" | "1" | "true" => Ok(true),
        "off" | "0" | "false" => Ok(false),
        _ => Err(format!("{v:?} is neither `on` nor `off`")),
    }
}

impl std::str::FromStr for AllReduceAlgo {
    type Err = Error;
    /// `auto`, `ring`, `rd` (or `recursive-doubling`), `rabenseifner`, `tree`, `hier`
    /// (or `hierarchical`), `one-shot`, `two-shot`; anything else is an error naming them, never a fallback.
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Self::Auto,
            "ring" => Self::Ring,
            "rd" | "recursive-doubling" | "doubling" => Self::RecursiveDoubling,
            "rabenseifner" | "rab" => Self::Rabenseifner,
            "tree" => Self::Tree,
            "hier" | "hierarchical" => Self::Hierarchical,
            "one-shot" | "oneshot" => Self::OneShot,
            "two-shot" | "twoshot" => Self::TwoShot,
            other => {
                return Err(Error::Config(format!(
                    "unknown all-reduce algorithm '{other}': use auto, ring, rd, rabenseifner, \
                     tree, hier, one-shot or two-shot"
                )))
            }
        })
    }
}

/// A network model: time of a message of `S` bytes is `alpha + S / bandwidth`, and
/// combining `S` bytes takes `S / reduce` ([`Tuning::cost_model`]; `ferroccl simulate`
/// plays the algorithms' plans on the same model).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct CostModel {
    /// Seconds per message.
    pub alpha: f64,
    /// Bytes per second of a rank's link.
    pub bandwidth: f64,
    /// Bytes per second a rank combines.
    pub reduce: f64,
    /// `(alpha, bandwidth)` of links between ranks of one host, when they differ from
    /// the links between hosts ([`CostModel::within_host`]); `None`: the same. What
    /// the hierarchical all-reduce's prediction uses within hosts.
    pub within_host: Option<(f64, f64)>,
}

impl CostModel {
    /// A model of `alpha` seconds per message, links of `bandwidth` bytes/s, combining
    /// at `reduce` bytes/s; each must be finite, `alpha >= 0` and the rates > 0.
    pub fn new(alpha: f64, bandwidth: f64, reduce: f64) -> Result<Self> {
        if !(alpha.is_finite() && alpha >= 0.0) {
            return Err(Error::Config(format!(
                "cost model: alpha {alpha} s is not >= 0"
            )));
        }
        for (what, v) in [("bandwidth", bandwidth), ("reduce", reduce)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::Config(format!(
                    "cost model: {what} {v} B/s is not > 0"
                )));
            }
        }
        Ok(Self {
            alpha,
            bandwidth,
            reduce,
            within_host: None,
        })
    }

    /// This model with links of `alpha` seconds and `bandwidth` bytes/s between ranks
    /// of one host (shared memory, say).
    pub fn within_host(mut self, alpha: f64, bandwidth: f64) -> Result<Self> {
        let m = Self::new(alpha, bandwidth, self.reduce)?;
        self.within_host = Some((m.alpha, m.bandwidth));
        Ok(self)
    }
}

impl std::fmt::Display for CostModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "alpha {:.3} us, link {:.3} GB/s, reduce {:.3} GB/s",
            self.alpha * 1e6,
            self.bandwidth / 1e9,
            self.reduce / 1e9
        )
    }
}

impl std::str::FromStr for CostModel {
    type Err = Error;
    /// `alpha_us=20,link_gbs=12.5,reduce_gbs=10`: α in microseconds, link and
    /// reduction rates in GB/s (10⁹ bytes per second); optionally the links within a
    /// host, `host_alpha_us=1,host_link_gbs=5` (both). Every key once, nothing else.
    fn from_str(s: &str) -> Result<Self> {
        let (mut a, mut l, mut r) = (None, None, None);
        let (mut ha, mut hl) = (None, None);
        let form = "alpha_us=20,link_gbs=12.5,reduce_gbs=10";
        for part in s.split(',') {
            let (k, v) = part.split_once('=').ok_or_else(|| {
                Error::Config(format!(
                    "cost model '{s}': '{part}' is not key=value (e.g. {form})"
                ))
            })?;
            let v: f64 = v.trim().parse().map_err(|_| {
                Error::Config(format!("cost model '{s}': '{}' is not a number", v.trim()))
            })?;
            let slot = match k.trim() {
                "alpha_us" => &mut a,
                "link_gbs" => &mut l,
                "reduce_gbs" => &mut r,
                "host_alpha_us" => &mut ha,
                "host_link_gbs" => &mut hl,
                other => {
                    return Err(Error::Config(format!(
                        "cost model '{s}': unknown key '{other}' (e.g. {form})"
                    )))
                }
            };
            if slot.replace(v).is_some() {
                return Err(Error::Config(format!(
                    "cost model '{s}': '{}' given twice",
                    k.trim()
                )));
            }
        }
        let m = match (a, l, r) {
            (Some(a), Some(l), Some(r)) => CostModel::new(a * 1e-6, l * 1e9, r * 1e9)?,
            _ => {
                return Err(Error::Config(format!(
                    "cost model '{s}': needs alpha_us, link_gbs and reduce_gbs (e.g. {form})"
                )))
            }
        };
        match (ha, hl) {
            (None, None) => Ok(m),
            (Some(a), Some(l)) => m.within_host(a * 1e-6, l * 1e9),
            _ => Err(Error::Config(format!(
                "cost model '{s}': host_alpha_us and host_link_gbs go together"
            ))),
        }
    }
}

impl CostModel {
    /// The model in a `ferroccl bench --law RATE --json FILE` file: its `fit` object's
    /// `alpha_s`, `beta_s_per_byte` and `reduce_bytes_per_s` (the bench's own CPU
    /// reduction rate, f32 sum). `what` names the file in errors.
    pub fn from_law_json(text: &str, what: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("cost model {what}: not JSON ({e})")))?;
        let fit = v.get("fit").filter(|f| f.is_object()).ok_or_else(|| {
            Error::Config(format!(
                "cost model {what}: no \"fit\" object (write it with `ferroccl bench --law RATE --json FILE` over several sizes)"
            ))
        })?;
        let num = |k: &str| {
            fit.get(k).and_then(|x| x.as_f64()).ok_or_else(|| {
                Error::Config(format!(
                    "cost model {what}: fit has no number \"{k}\"{}",
                    if k == "reduce_bytes_per_s" {
                        " (an older bench wrote it: run `ferroccl bench --law` again)"
                    } else {
                        ""
                    }
                ))
            })
        };
        let (alpha, beta, reduce) = (
            num("alpha_s")?,
            num("beta_s_per_byte")?,
            num("reduce_bytes_per_s")?,
        );
        if !(beta.is_finite() && beta > 0.0) {
            return Err(Error::Config(format!(
                "cost model {what}: beta_s_per_byte {beta} is not > 0"
            )));
        }
        CostModel::new(alpha, 1.0 / beta, reduce).map_err(|e| Error::Config(format!("{what}: {e}")))
    }
}

/// Where [`Tuning::cost_model`] comes from: what `FERROCCL_COST_MODEL` and
/// `ferroccl bench --cost-model` say.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum CostModelSpec {
    /// This model.
    Given(CostModel),
    /// Measured on the communicator's own links when it is made
    /// ([`Tuning::measure_cost_model`]).
    Measure,
}

impl CostModelSpec {
    /// `measure`; `@FILE`, a `ferroccl bench --law RATE --json FILE` file (read now,
    /// see [`CostModel::from_law_json`]); or `alpha_us=20,link_gbs=12.5,reduce_gbs=10`.
    pub fn parse(s: &str) -> Result<Self> {
        let s = s.trim();
        if s == "measure" {
            Ok(CostModelSpec::Measure)
        } else if let Some(path) = s.strip_prefix('@') {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::Config(format!("cost model file {path}: {e}")))?;
            CostModel::from_law_json(&text, path).map(CostModelSpec::Given)
        } else {
            s.parse().map(CostModelSpec::Given)
        }
    }

    /// Sets `t` to it.
    pub fn apply(self, t: &mut Tuning) {
        match self {
            CostModelSpec::Given(m) => {
                t.cost_model = Some(m);
                t.measure_cost_model = false;
            }
            CostModelSpec::Measure => {
                t.cost_model = None;
                t.measure_cost_model = true;
            }
        }
    }
}

/// This process's place in a job: rank, size, and the rendezvous.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Job {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank among the processes of this host (which GPU a rank uses, for example).
    pub local_rank: usize,
    /// How many ranks run on this host, when the launcher says
    /// ([`crate::rendezvous::LaunchEnv::local_world_size`]): where the transport does
    /// not know the hosts (TCP), it tells whether they outnumber the CPUs (see
    /// [`Tuning::busy_poll`]). Default: none.
    pub local_world_size: Option<usize>,
    /// `host:port` of the rendezvous store (`MASTER_ADDR:MASTER_PORT`).
    pub master_addr: String,
    /// When true (the default), rank 0 serves the store at `master_addr`; when false,
    /// the store is run by someone else (a test harness, another service).
    pub serve_store: bool,
    /// The job token (`FERROCCL_TOKEN`; `ferroccl launch` makes one): when set, every
    /// connection — to the rendezvous store and between ranks — proves it by HMAC
    /// challenge-response, and anything that cannot is refused. Never sent in clear.
    /// Must be the same on every rank. Default: none.
    pub token: Option<Vec<u8>>,
    /// The launcher's name for this job (`ferroccl launch`'s id, torchrun's run id, the
    /// Slurm job and step, Open MPI's job; see [`crate::rendezvous::LaunchEnv::job_id`]).
    /// Rank 0's store refuses a rank that names another job, and both jobs' ranks say
    /// "another job (…) is using the store at host:port" instead of failing on each
    /// other's ranks. Default: none (no check).
    pub job_id: Option<String>,
    /// `master_addr` is a PyTorch `TCPStore` that torchrun's agent serves
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`): rank 0 serves ferroccl's store on a free
    /// port instead and publishes its address there, and the others read it there (see
    /// [`crate::rendezvous::TorchStore`]). Default: false.
    pub agent_store: bool,
}

/// How collectives run. Values that shape the traffic (`segment_bytes`,
/// `small_message_bytes`) must be equal on every rank; a disagreement is reported as
/// [`Error::Mismatch`], never silently wrong data.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Tuning {
    /// The longest any collective waits without progress before it fails with
    /// [`Error::Timeout`] and poisons the communicator. Default 60 s.
    pub timeout: Duration,
    /// The longest start-up may take: reaching the store while rank 0 comes up, and
    /// connecting to peers. Default 60 s.
    pub connect_timeout: Duration,
    /// Pipelining granularity: ring chunks are cut into segments of at most this many
    /// bytes, and segment `j+1` is received while segment `j` is reduced and forwarded.
    /// Broadcast and reduce chains over 3 ranks or more cut finer, down to 64 KiB, where
    /// that shortens the pipeline's fill (see `comm::collectives::chain_segment`).
    /// Default 512 KiB.
    pub segment_bytes: usize,
    /// How long a collective keeps polling its links (yielding the CPU between polls)
    /// before it sleeps until the kernel wakes it. Waking a sleeping thread costs tens
    /// of microseconds, which dominates small messages; polling a little first avoids
    /// it. `Duration::ZERO` always sleeps. Default 1 ms (on loopback, 1 MiB all-reduce
    /// medians: 243 µs vs 314 µs with 300 µs at 2 ranks, 1349 vs 1598 µs at 4). Each
    /// wait first spins a few microseconds without yielding, unless the transport
    /// knows this host runs more ranks than the CPUs they may use (then the peer a
    /// rank waits for often needs its CPU).
    pub busy_poll: Duration,
    /// Bind each rank (the thread that makes the communicator, and every thread it
    /// starts afterwards: the communicator's own, a compute pool made later) to its own
    /// even share of this host's CPUs, when the ranks of this host do not outnumber
    /// them and nothing placed the process already (its affinity mask is the whole
    /// host). Without it the scheduler sometimes keeps two ranks that wake each other on
    /// one CPU for a whole run, while the other idles: on the 2-core development
    /// machine a 1 KiB all-reduce at 2 ranks then took 20–30 µs instead of 2–3 µs, in
    /// some runs and not others. Default on; `FERROCCL_BIND=off` leaves placement to
    /// the scheduler (or to `taskset`, `numactl`, Slurm).
    pub bind_cpus: bool,
    /// All-reduces of at most this many bytes use recursive doubling (`log2 n` steps,
    /// each moving the whole buffer) instead of the ring (`2(n-1)` steps, each moving
    /// `1/n` of it): for small messages latency, not bandwidth, is the cost. 0 always
    /// uses the ring. Default 64 KiB, where the two cross over on loopback TCP at 2 and
    /// 4 ranks.
    pub small_message_bytes: usize,
    /// Which all-reduce algorithm runs: chosen by size ([`AllReduceAlgo::Auto`], the
    /// default) or forced (`FERROCCL_ALGO=ring|rd|rabenseifner|tree|hier` in
    /// [`Config::from_env`], `ferroccl bench --algo`). Must be the same on every rank
    /// (a disagreement is a [`Error::Mismatch`]).
    pub all_reduce_algo: AllReduceAlgo,
    /// A model of the network, for [`AllReduceAlgo::Auto`] to choose per call the
    /// algorithm with the least predicted time (ring, recursive doubling,
    /// Rabenseifner, tree) instead of the size rule. `FERROCCL_COST_MODEL` in
    /// [`Config::from_env`], `ferroccl bench --cost-model`. Must be the same on every
    /// rank. Default: none.
    pub cost_model: Option<CostModel>,
    /// Measure [`Tuning::cost_model`] on the communicator's links when it is made
    /// ([`crate::Communicator::measure_cost_model`]: a few ring all-reduces, about
    /// 0.1–1 s); `FERROCCL_COST_MODEL=measure`. Must be the same on every rank.
    /// Default: false.
    pub measure_cost_model: bool,
    /// The clock [`Tuning::timeout`] is measured on: the system's, or a [`Clock::manual`]
    /// one that tests advance by hand so that a timeout fires exactly when they say.
    pub clock: Clock,
    /// Operations the flight recorder keeps ([`crate::trace`]): the last this many, for
    /// dumps on failure, on `SIGUSR1` and at exit. 0 records nothing. Default 2048
    /// (`FERROCCL_TRACE_CAPACITY` in [`Config::from_env`]).
    pub trace_capacity: usize,
}

/// Which transport links the ranks, and the options of each.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct TransportOptions {
    /// The transport [`crate::Communicator::init`] uses.
    pub kind: TransportKind,
    /// TCP links (also the control links of `cuda-ipc`).
    pub tcp: TcpOptions,
    /// RDMA verbs links.
    pub rdma: RdmaOptions,
    /// Shared-memory links (`shm`, and `auto` between ranks of one host).
    pub shm: ShmOptions,
}

/// Options of shared-memory links.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ShmOptions {
    /// Bytes of one direction's ring: a link of one channel between two ranks holds two
    /// rings (plus a 4 KiB header each) in shared memory. Default 1 MiB
    /// ([`DEFAULT_SHM_RING_BYTES`]). The lower rank of each pair makes both rings with
    /// its own value.
    pub ring_bytes: usize,
    /// A collective's frame payload of at least this many bytes moves in one copy: the
    /// reader copies it straight from the writer's memory (`process_vm_readv`) instead
    /// of through the ring, where the kernel allows it (checked per link; otherwise
    /// the ring). 0 turns single copy off. `FERROCCL_SHM_SINGLE_COPY` (bytes or `off`).
    /// Default off ([`DEFAULT_SHM_SINGLE_COPY_MIN`] says why).
    pub single_copy_min: usize,
    /// Appended to this rank's host identity: ranks with different tags are on
    /// different hosts as far as `auto` is concerned. For tests that emulate several
    /// hosts with threads of one process; empty by default.
    #[doc(hidden)]
    pub host_tag: String,
    /// When every rank of the job is on this host, collectives read their peers'
    /// memory directly (symmetric memory: one workspace per rank that every rank maps;
    /// one-shot and two-shot all-reduce) instead of streaming frames through the
    /// rings. Default on; `FERROCCL_SHM_SYMMETRIC=off` turns it off (every rank must
    /// agree: one that says off turns it off for all).
    pub symmetric: bool,
}

impl ShmOptions {
    /// Parses [`ShmOptions::single_copy_min`] as given by a user: `off` (0), or a size
    /// in bytes with an optional `K`/`M` (KiB, MiB) suffix.
    pub fn parse_single_copy(v: &str) -> std::result::Result<usize, String> {
        let t = v.trim();
        if t.eq_ignore_ascii_case("off") || t == "0" {
            return Ok(0);
        }
        let (num, mul) = match t.char_indices().last() {
            Some((i, 'k' | 'K')) => (&t[..i], 1usize << 10),
            Some((i, 'm' | 'M')) => (&t[..i], 1 << 20),
            _ => (t, 1),
        };
        num.parse::<usize>()
            .ok()
            .and_then(|n| n.checked_mul(mul))
            .ok_or_else(|| {
                format!("{v:?} is neither `off` nor a size in bytes (e.g. 65536 or 64K)")
            })
    }
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions {
            ring_bytes: DEFAULT_SHM_RING_BYTES,
            single_copy_min: DEFAULT_SHM_SINGLE_COPY_MIN,
            host_tag: String::new(),
            symmetric: true,
        }
    }
}

/// Options of TCP links.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TcpOptions {
    /// `SO_SNDBUF`/`SO_RCVBUF` in bytes (the kernel caps it at `net.core.[rw]mem_max`);
    /// 0 leaves the kernel's autotuning alone. Default 4 MiB.
    pub socket_buffer: usize,
    /// The congestion control of every link (`FERROCCL_TCP_CONGESTION`). Default
    /// [`TcpCongestion::Auto`]: the system's, unless that is BBR.
    pub congestion: TcpCongestion,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            socket_buffer: DEFAULT_SOCKET_BUFFER,
            congestion: TcpCongestion::Auto,
        }
    }
}

/// Which TCP congestion control ferroccl's links run (`TCP_CONGESTION` on each socket).
///
/// A collective keeps one long flow per link busy, and a ring waits for its slowest
/// link at every step. BBR (v1 and later) drains its flow to four packets for 200 ms
/// whenever it has not seen the path's minimum round trip for 10 s (ProbeRTT), which a
/// busy link with a queue never shows: each link stalls that long every 10 s, at a
/// different moment, and the ring stalls with it. On `tools/emulated-cluster` at
/// 1 Gbit/s (4 hosts, 64 MiB) that cost 10–12 % over the ring law; cubic and reno
/// stay at the link's framing floor. So by default a link replaces BBR with cubic
/// (reno where cubic is not allowed) and leaves every other choice alone.
#[derive(Clone, Debug, PartialEq, Eq, Default, Hash)]
#[non_exhaustive]
pub enum TcpCongestion {
    /// The system's default (`net.ipv4.tcp_congestion_control`), unless it is BBR
    /// (`bbr*`): then cubic, or reno where cubic is not allowed for this user; when
    /// neither can be set, BBR stays (logged once).
    #[default]
    Auto,
    /// Whatever the kernel gives a new socket, BBR included.
    System,
    /// This algorithm, e.g. `cubic`; one the kernel lacks or does not allow this user
    /// is an [`Error::Unavailable`] when the links are made.
    Named(String),
}

impl TcpCongestion {
    /// Parses `auto`, `system`, or an algorithm's name (what
    /// `net.ipv4.tcp_available_congestion_control` lists: lowercase letters, digits
    /// and `_`, at most 15 bytes).
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(TcpCongestion::Auto),
            "system" => Ok(TcpCongestion::System),
            _ if !s.is_empty()
                && s.len() < 16
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') =>
            {
                Ok(TcpCongestion::Named(s.to_string()))
            }
            _ => Err(Error::InvalidArgument(format!(
                "TCP congestion control {s:?}: expected auto, system, or an algorithm's name \
                 such as cubic (net.ipv4.tcp_available_congestion_control lists them)"
            ))),
        }
    }
}

/// Options of RDMA verbs links.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct RdmaOptions {
    /// GID table index (port 1): InfiniBand routes by LID and ignores it; RoCE routes by
    /// GID, and RoCE v2 often needs an index other than 0 (`show_gids`). From
    /// `FERROCCL_RDMA_GID_INDEX` in [`Config::from_env`]. Default 0.
    pub gid_index: u8,
}

/// The transports built into this library ([`crate::transport::builtin`] makes each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
#[non_exhaustive]
pub enum TransportKind {
    /// The default: shared memory between ranks of one host (same boot, hostname,
    /// user, and network, IPC and mount namespaces), TCP between the others.
    #[default]
    Auto,
    /// TCP sockets, one connection per linked peer.
    Tcp,
    /// Shared memory (`transport::shm`): every rank must be on this host; a rank on
    /// another is refused by name ([`Error::Unavailable`]).
    Shm,
    /// In-process pipes: only for ranks that are threads of one process
    /// ([`crate::Communicator::local_group`]).
    Local,
    /// RDMA verbs (`transport::rdma`): needs the `rdma` feature and an RDMA device;
    /// without either, [`crate::Communicator::init`] says which is missing.
    Rdma,
    /// CUDA IPC (feature `cuda`): device-buffer collectives read the neighbours' GPU
    /// memory directly; host-buffer ones run over TCP links, which this transport also
    /// makes. Ranks must share one node (one GPU or several).
    CudaIpc,
}

impl TransportKind {
    /// Every transport name [`TransportKind::parse`] knows, in the order the docs list them.
    pub const ALL: [TransportKind; 6] = [
        TransportKind::Auto,
        TransportKind::Tcp,
        TransportKind::Shm,
        TransportKind::Local,
        TransportKind::Rdma,
        TransportKind::CudaIpc,
    ];

    /// Parses a name: `auto`, `tcp`, `shm`, `local`, `rdma` (or `ibverbs`), `cuda-ipc`
    /// (or `cuda_ipc`). Whether the transport is built in and can run here is checked when
    /// a communicator is made ([`Error::Unavailable`]); an unknown name is an error here.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(TransportKind::Auto),
            "tcp" => Ok(TransportKind::Tcp),
            "shm" => Ok(TransportKind::Shm),
            "local" => Ok(TransportKind::Local),
            "rdma" | "ibverbs" => Ok(TransportKind::Rdma),
            "cuda-ipc" | "cuda_ipc" => Ok(TransportKind::CudaIpc),
            _ => Err(Error::InvalidArgument(format!(
                "unknown transport {s:?}: expected one of auto, tcp, shm, local, rdma, cuda-ipc"
            ))),
        }
    }

    /// The name [`TransportKind::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Auto => "auto",
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
            TransportKind::Local => "local",
            TransportKind::Rdma => "rdma",
            TransportKind::CudaIpc => "cuda-ipc",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The clock collective timeouts are measured on.
///
/// [`Clock::system`] (the default) is the monotonic system clock. [`Clock::manual`]
/// stands still until [`Clock::advance`] moves it, so a test can make a collective time
/// out at an exact moment instead of racing a wall-clock sleep. Only deadlines read it:
/// how long a rank polls before it sleeps ([`Tuning::busy_poll`]) is always real time.
#[derive(Clone, Debug, Default)]
pub struct Clock(Option<Arc<Manual>>);

#[derive(Debug)]
struct Manual {
    start: Instant,
    /// Nanoseconds advanced so far.
    offset: AtomicU64,
}

impl Clock {
    /// The system's monotonic clock.
    pub fn system() -> Self {
        Clock(None)
    }

    /// A clock that moves only when [`Clock::advance`] is called. Clones share it.
    pub fn manual() -> Self {
        Clock(Some(Arc::new(Manual {
            start: Instant::now(),
            offset: AtomicU64::new(0),
        })))
    }

    /// The current time.
    pub fn now(&self) -> Instant {
        match &self.0 {
            None => Instant::now(),
            Some(m) => m.start + Duration::from_nanos(m.offset.load(Ordering::Acquire)),
        }
    }

    /// Moves a manual clock forward by `by` (every clone sees it); a no-op on the
    /// system clock.
    pub fn advance(&self, by: Duration) {
        if let Some(m) = &self.0 {
            let ns = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
            m.offset.fetch_add(ns, Ordering::AcqRel);
        }
    }

    /// Whether this is a manual clock.
    pub fn is_manual(&self) -> bool {
        self.0.is_some()
    }
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            busy_poll: DEFAULT_BUSY_POLL,
            bind_cpus: true,
            small_message_bytes: DEFAULT_SMALL_MESSAGE_BYTES,
            all_reduce_algo: AllReduceAlgo::Auto,
            cost_model: None,
            measure_cost_model: false,
            clock: Clock::system(),
            trace_capacity: DEFAULT_TRACE_CAPACITY,
        }
    }
}

impl Default for Config {
    /// Rank 0 of a job of one, meeting at `127.0.0.1:29500`, with every default: the
    /// base [`crate::Communicator::local_group`] takes.
    fn default() -> Self {
        Config::new(0, 1, format!("127.0.0.1:{DEFAULT_MASTER_PORT}"))
    }
}

impl Config {
    /// A config for `rank` of `world_size` meeting at `master_addr`, with defaults
    /// (checked when the communicator is made; [`Config::builder`] checks at `build`).
    pub fn new(rank: usize, world_size: usize, master_addr: impl Into<String>) -> Self {
        Config {
            job: Job {
                rank,
                world_size,
                local_rank: rank,
                local_world_size: None,
                master_addr: master_addr.into(),
                serve_store: true,
                token: None,
                job_id: None,
                agent_store: false,
            },
            tuning: Tuning::default(),
            transport: TransportOptions::default(),
        }
    }

    /// A builder for `rank` of `world_size` meeting at `master_addr`.
    pub fn builder(
        rank: usize,
        world_size: usize,
        master_addr: impl Into<String>,
    ) -> ConfigBuilder {
        ConfigBuilder(Config::new(rank, world_size, master_addr))
    }

    /// Reads the launcher environment (torchrun, Slurm, Open MPI, PMI; see
    /// [`crate::rendezvous::detect_env`]). `MASTER_ADDR` defaults to `127.0.0.1` and
    /// `MASTER_PORT` to 29500; the launcher's job identity becomes [`Job::job_id`],
    /// `TORCHELASTIC_USE_AGENT_STORE` [`Job::agent_store`]; `FERROCCL_TOKEN`, when set,
    /// becomes [`Job::token`], and
    /// `FERROCCL_RDMA_GID_INDEX` [`RdmaOptions::gid_index`], `FERROCCL_TRACE_CAPACITY`
    /// [`Tuning::trace_capacity`], `FERROCCL_BUSY_POLL_US` [`Tuning::busy_poll`] (in
    /// microseconds), `FERROCCL_TRANSPORT` [`TransportOptions::kind`],
    /// `FERROCCL_TCP_CONGESTION` [`TcpOptions::congestion`].
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`Config::from_env`] over any variable lookup: for a caller that knows some of
    /// the values itself (a framework's backend is told its rank and world size, and
    /// reads the `FERROCCL_*` settings from the environment).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let env = crate::rendezvous::detect_from(get)?.ok_or_else(|| {
            Error::Env(
                "no launcher environment found: set RANK and WORLD_SIZE (torchrun), or run under \
                 srun, mpirun or `ferroccl launch`"
                    .into(),
            )
        })?;
        let host = env.master_addr.unwrap_or_else(|| "127.0.0.1".into());
        let port = env.master_port.unwrap_or(DEFAULT_MASTER_PORT);
        let addr = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let mut c = Config::new(env.rank, env.world_size, addr);
        c.job.local_rank = env.local_rank.unwrap_or(0);
        c.job.local_world_size = env.local_world_size;
        c.job.token = env.token.map(String::into_bytes);
        c.job.job_id = env.job_id;
        c.job.agent_store = env.agent_store;
        c.transport.rdma.gid_index = env.rdma_gid_index.unwrap_or(0);
        if let Some(n) = env.trace_capacity {
            c.tuning.trace_capacity = n;
        }
        if let Some(us) = env.busy_poll_us {
            c.tuning.busy_poll = Duration::from_micros(us);
        }
        if let Some(a) = &env.algo {
            c.tuning.all_reduce_algo = a
                .parse()
                .map_err(|e: Error| Error::Env(format!("FERROCCL_ALGO: {e}")))?;
        }
        if let Some(m) = &env.cost_model {
            CostModelSpec::parse(m)
                .map_err(|e| Error::Env(format!("FERROCCL_COST_MODEL: {e}")))?
                .apply(&mut c.tuning);
        }
        if let Some(t) = &env.transport {
            c.transport.kind = TransportKind::parse(t)
                .map_err(|e| Error::Env(format!("FERROCCL_TRANSPORT: {e}")))?;
        }
        if let Some(v) = &env.shm_single_copy {
            c.transport.shm.single_copy_min = ShmOptions::parse_single_copy(v)
                .map_err(|e| Error::Env(format!("FERROCCL_SHM_SINGLE_COPY: {e}")))?;
        }
        if let Some(v) = &env.bind {
            c.tuning.bind_cpus =
                on_off(v).map_err(|e| Error::Env(format!("FERROCCL_BIND: {e}")))?;
        }
        if let Some(v) = &env.shm_symmetric {
            c.transport.shm.symmetric =
                on_off(v).map_err(|e| Error::Env(format!("FERROCCL_SHM_SYMMETRIC: {e}")))?;
        }
        if let Some(t) = &env.tcp_congestion {
            c.transport.tcp.congestion = TcpCongestion::parse(t)
                .map_err(|e| Error::Env(format!("FERROCCL_TCP_CONGESTION: {e}")))?;
        }
        Ok(c)
    }

    /// This config with rank `rank` of `world_size` (local rank `rank` too): for making
    /// one rank's config out of a job-wide base.
    pub fn for_rank(&self, rank: usize, world_size: usize) -> Config {
        let mut c = self.clone();
        c.job.rank = rank;
        c.job.local_rank = rank;
        c.job.world_size = world_size;
        c
    }

    /// Checks every value; what [`crate::Communicator::init`] and
    /// [`ConfigBuilder::build`] call.
    pub fn validate(&self) -> Result<()> {
        let (j, t) = (&self.job, &self.tuning);
        if j.world_size == 0 {
            return Err(Error::Config("world_size must be at least 1".into()));
        }
        if j.rank >= j.world_size {
            return Err(Error::Config(format!(
                "rank {} is out of range for world_size {}",
                j.rank, j.world_size
            )));
        }
        if t.segment_bytes == 0 || t.segment_bytes > (1 << 30) {
            return Err(Error::Config(format!(
                "segment_bytes {} must be in 1..=1 GiB",
                t.segment_bytes
            )));
        }
        if t.small_message_bytes > u32::MAX as usize {
            return Err(Error::Config(format!(
                "small_message_bytes {} must fit a frame (< 4 GiB)",
                t.small_message_bytes
            )));
        }
        let ring = self.transport.shm.ring_bytes;
        if !(4096..=1 << 30).contains(&ring) {
            return Err(Error::Config(format!(
                "shm ring_bytes {ring} must be in 4 KiB..=1 GiB"
            )));
        }
        if t.timeout.is_zero() || t.connect_timeout.is_zero() {
            return Err(Error::Config("timeouts must be positive".into()));
        }
        if t.timeout > MAX_TIMEOUT || t.connect_timeout > MAX_TIMEOUT {
            return Err(Error::Config(format!(
                "timeouts must be at most {} s (7 days); got {:?} and a connect timeout of {:?}",
                MAX_TIMEOUT.as_secs(),
                t.timeout,
                t.connect_timeout
            )));
        }
        Ok(())
    }
}

/// Builds a [`Config`]; [`ConfigBuilder::build`] checks it.
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until build() is called"]
pub struct ConfigBuilder(Config);

impl ConfigBuilder {
    /// [`Job::local_rank`].
    pub fn local_rank(mut self, r: usize) -> Self {
        self.0.job.local_rank = r;
        self
    }
    /// [`Job::serve_store`].
    pub fn serve_store(mut self, yes: bool) -> Self {
        self.0.job.serve_store = yes;
        self
    }
    /// [`Job::token`].
    pub fn token(mut self, token: impl Into<Vec<u8>>) -> Self {
        self.0.job.token = Some(token.into());
        self
    }
    /// [`Job::job_id`].
    pub fn job_id(mut self, id: impl Into<String>) -> Self {
        self.0.job.job_id = Some(id.into());
        self
    }
    /// [`Job::agent_store`].
    pub fn agent_store(mut self, yes: bool) -> Self {
        self.0.job.agent_store = yes;
        self
    }
    /// [`Tuning::timeout`].
    pub fn timeout(mut self, d: Duration) -> Self {
        self.0.tuning.timeout = d;
        self
    }
    /// [`Tuning::connect_timeout`].
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.0.tuning.connect_timeout = d;
        self
    }
    /// [`Tuning::segment_bytes`].
    pub fn segment_bytes(mut self, n: usize) -> Self {
        self.0.tuning.segment_bytes = n;
        self
    }
    /// [`Tuning::busy_poll`].
    pub fn busy_poll(mut self, d: Duration) -> Self {
        self.0.tuning.busy_poll = d;
        self
    }
    /// [`Tuning::all_reduce_algo`].
    pub fn all_reduce_algo(mut self, a: AllReduceAlgo) -> Self {
        self.0.tuning.all_reduce_algo = a;
        self
    }
    /// [`Tuning::small_message_bytes`].
    pub fn small_message_bytes(mut self, n: usize) -> Self {
        self.0.tuning.small_message_bytes = n;
        self
    }
    /// [`Tuning::trace_capacity`].
    pub fn trace_capacity(mut self, n: usize) -> Self {
        self.0.tuning.trace_capacity = n;
        self
    }
    /// [`Tuning::clock`].
    pub fn clock(mut self, c: Clock) -> Self {
        self.0.tuning.clock = c;
        self
    }
    /// [`TransportOptions::kind`].
    pub fn transport(mut self, kind: TransportKind) -> Self {
        self.0.transport.kind = kind;
        self
    }
    /// [`TcpOptions::socket_buffer`].
    pub fn socket_buffer(mut self, bytes: usize) -> Self {
        self.0.transport.tcp.socket_buffer = bytes;
        self
    }

    /// [`TcpOptions::congestion`].
    pub fn tcp_congestion(mut self, c: TcpCongestion) -> Self {
        self.0.transport.tcp.congestion = c;
        self
    }

    /// [`ShmOptions::ring_bytes`].
    pub fn shm_ring_bytes(mut self, bytes: usize) -> Self {
        self.0.transport.shm.ring_bytes = bytes;
        self
    }

    /// [`ShmOptions::single_copy_min`] (0: off).
    pub fn shm_single_copy_min(mut self, bytes: usize) -> Self {
        self.0.transport.shm.single_copy_min = bytes;
        self
    }
    /// [`RdmaOptions::gid_index`].
    pub fn rdma_gid_index(mut self, i: u8) -> Self {
        self.0.transport.rdma.gid_index = i;
        self
    }
    /// The config, if every value is valid.
    pub fn build(self) -> Result<Config> {
        self.0.validate()?;
        Ok(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every variable the launcher environment is read from.
    const ENV_VARS: [&str; 40] = [
        "FERROCCL_ALGO",
        "FERROCCL_BIND",
        "FERROCCL_BUSY_POLL_US",
        "FERROCCL_COST_MODEL",
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

    #[test]
    fn busy_poll_comes_from_the_environment_in_microseconds() {
        let env = |v: &'static str| {
            move |k: &str| match k {
                "RANK" => Some("0".to_string()),
                "WORLD_SIZE" => Some("1".to_string()),
                "FERROCCL_BUSY_POLL_US" => Some(v.to_string()),
                _ => None,
            }
        };
        let c = Config::from_lookup(env("250")).unwrap();
        assert_eq!(c.tuning.busy_poll, Duration::from_micros(250));
        let e = Config::from_lookup(env("1ms")).unwrap_err().to_string();
        assert!(
            e.contains("FERROCCL_BUSY_POLL_US") && e.contains("microseconds"),
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
}
