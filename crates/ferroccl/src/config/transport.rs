//! Which transport links the ranks ([`TransportKind`]) and each transport's options.

use super::{DEFAULT_SHM_RING_BYTES, DEFAULT_SHM_SINGLE_COPY_MIN, DEFAULT_SOCKET_BUFFER};
use crate::error::{Error, Result};

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
    /// CUDA IPC's memory peers.
    pub cuda_ipc: CudaIpcOptions,
}

/// Options of the `cuda-ipc` transport's memory peers.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct CudaIpcOptions {
    /// Order the ranks' steps on the device (`FERROCCL_CUDA_ORDER=device`): a step
    /// waits for a peer with a stream wait on a counter the peer's stream writes
    /// (`cuStreamWaitValue32`/`cuStreamWriteValue32` on registered host memory), so a
    /// collective is enqueued whole, with no host round trip per step. Default off
    /// (`host`: the host waits for each peer's counter, then orders by its event):
    /// device order has run only on the simulated stream so far, not yet on a GPU.
    /// Every rank must agree; one that differs fails the first device call.
    pub device_order: bool,
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
    /// `FERROCCL_RDMA_GID_INDEX` in [`Config::from_env`](super::Config::from_env). Default 0.
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
