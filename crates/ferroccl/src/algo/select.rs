//! Every decision a call takes before it runs, in one pure place: which algorithm,
//! whether the hierarchical algorithms can run on the hosts, how segments are cut,
//! which peers a rank links to when it starts, and whether a call reads its peers'
//! memory (pull) or streams bytes over links (push).
//!
//! The communicator (`comm/`) only builds a [`Policy`] from its configuration and its
//! links, checks the call, fingerprints it and runs what this module decides; every
//! rank decides alike because every input here is the same on every rank (the
//! algorithm is in every frame's fingerprint, so a disagreement is a mismatch, not a
//! hang). Tested without a communicator (the tests at the bottom).

use super::sim::{choose_by_model, Network};
use super::{doubling, schedule, Algorithm, HostLayout};

/// Which algorithm an all-reduce uses (`Tuning::all_reduce_algo`, `FERROCCL_ALGO`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum AllReduceAlgo {
    /// Recursive doubling up to `Tuning::small_message_bytes`, the ring above
    /// (hierarchical above on jobs of two or more hosts with the same number `k >= 2`
    /// of ranks each; with `Tuning::cost_model`, the least predicted time). On
    /// symmetric memory (one host), recursive doubling over the rings up to a few KiB
    /// and two-shot above.
    #[default]
    Auto,
    /// The ring: `2(n-1)` steps, `2(n-1)/n·S` bytes per rank.
    Ring,
    /// Recursive doubling: `log2 n` steps, the whole buffer at each (one frame, so
    /// buffers over 4 GiB run the ring).
    RecursiveDoubling,
    /// Rabenseifner: the ring's bytes in `2·log2 n` steps (host buffers streamed over
    /// links; a transport that reads peers' memory runs the ring).
    Rabenseifner,
    /// The pipelined double binary tree: `O(log n)` latency for any `n`, half the
    /// buffer up and down each of two trees (host buffers streamed over links; a
    /// transport that reads peers' memory runs the ring).
    Tree,
    /// Hierarchical: within each host a reduce-scatter, between hosts `k` rings on
    /// `1/k` each, within each host an all-gather. Needs the job's host list (every
    /// communicator made by `Communicator::init` has one) and the same number of
    /// ranks on every host; otherwise an all-reduce fails with `Error::Unavailable`.
    Hierarchical,
    /// One-shot on symmetric memory (every rank of the job on one host, over `shm` or
    /// `auto`) and on device memory over CUDA IPC: each rank reduces all `n` buffers
    /// itself. Elsewhere the ring.
    OneShot,
    /// Two-shot on symmetric memory and on device memory over CUDA IPC: each rank
    /// reduces `1/n`, then all copy. Elsewhere the ring.
    TwoShot,
}

/// Up to how many bytes an all-reduce of `n` ranks on symmetric memory streams over the
/// rings instead (recursive doubling, one frame each way): below it a round trip of
/// frames beats reading the peers' memory, whose fingerprint exchange is itself such a
/// round trip. Measured with `ferroccl bench --algo two-shot` against
/// `FERROCCL_SHM_SYMMETRIC=off` on the 2-core development machine (3 and 2
/// interleaved runs, quiet): at 2 ranks 1 KiB took 1.6–1.9 µs over the rings and
/// 2.0–3.0 µs two-shot, 4 KiB tied, 16 KiB 4.6–5.6 against 4.1–5.0; at 4 ranks (two
/// per CPU) 16 KiB 26.7–29.2 µs against 28.4–32.7, 64 KiB 70.9–86.9 against 45.0–57.2.
pub(crate) fn sym_push_max(n: usize) -> usize {
    if n <= 2 {
        8 << 10
    } else {
        32 << 10
    }
}

/// Up to how many bytes `auto` takes one-shot on symmetric memory: none. Measured as
/// [`sym_push_max`], one-shot never beat two-shot (2 ranks: 1 KiB 1.8–3.7 µs against
/// 2.0–3.0, 64 KiB 11.8–13.9 against 10.0–11.5; 4 ranks: 64 KiB 86 against 45–57):
/// it saves one synchronisation, but the fingerprint exchange before it costs as much,
/// and it reads `(n-1)·S` from the peers where two-shot reads `2(n-1)/n·S`. It stays
/// for `--algo one-shot` (a machine whose synchronisations cost more may differ).
pub(crate) fn one_shot_max(_n: usize) -> usize {
    0
}

/// Up to how many bytes `auto` takes one-shot from the slots on symmetric memory
/// (where the slots hold that many, [`crate::transport::Slots`]), instead of recursive
/// doubling over the rings. Measured on the 2-core development machine (`ferroccl
/// bench all_reduce`, medians, 2 interleaved runs of each build, in place): n = 2:
/// 1 KiB 0.40–0.42 µs against 0.52–0.54, 2 KiB 0.45–0.46 against 0.55–0.56, 4 KiB
/// 0.71–0.73 against 0.67 (the slot's extra copy out, and a reduce that reads the
/// peer's slot, cost more than the round trip saves from there); n = 3: 1–2 KiB
/// 4.4–4.5 µs against 4.6–5.5, 4 KiB level, 8 KiB 5.6–5.7 against 5.1–5.4; n = 4
/// (two ranks per CPU, where each hand-over waits for a rank to be scheduled and
/// one-shot has one where recursive doubling has two): 1 KiB 6.5–6.8 µs against
/// 7.8–12.8, 16 KiB 8.5–10.1 against 11.0–11.4, 32 KiB 12.9–13.1 against 10.7–14.7.
pub(crate) fn slot_max(n: usize) -> usize {
    if n <= 3 {
        2 << 10
    } else {
        16 << 10
    }
}

/// Up to how many bytes an all-reduce of `n` ranks on symmetric shared memory runs
/// two-shot; above, the ring streams through the shared-memory rings. Measured on the
/// 2-core development machine (`ferroccl bench all_reduce`, symmetric memory on
/// against off, in-place medians, 3 interleaved repetitions on a quiet machine,
/// min–max): n = 2: 4 MiB two-shot 151–188 µs against the rings' 189–201, 8 MiB
/// 607–679 against 451–493, 16 MiB 2.38–2.71 ms against 1.35–1.71; n = 4: 4 MiB
/// 0.74–1.12 ms against 1.16–1.56, 8 MiB 2.66–3.21 against 2.24–3.37, 16 MiB 5.2–7.0
/// against 5.7–6.6 (and at 64 MiB the rings 1.2–1.8× faster in two other sittings). A
/// ring's segments pass through a ring that stays in the caches (4 MiB then, 1 MiB
/// since: `DEFAULT_SHM_RING_BYTES`); two-shot's
/// workspaces of that size do not. With many ranks the ring's `2(n-1)` steps cost more
/// than the caches save: on a 16-core host (an H100 machine's Xeon, 300 MiB L3; one
/// sitting, `tools/many-ranks`, medians of 20) 16 MiB took 8.5 ms two-shot against the
/// ring's 10.4 at n = 8, and 14.4 against 34.3 at n = 16; so 16 MiB from 8 ranks
/// (above it nothing was measured; between 5 and 7 ranks neither).
pub(crate) fn sym_two_shot_max(n: usize) -> usize {
    if n >= 8 {
        16 << 20
    } else {
        4 << 20
    }
}

/// Elements per block of a two-shot all-reduce on `n` ranks (elements of `es` bytes,
/// `segment` the configured segment): `n` segments, so that each rank's part of a
/// block is one segment. Two-shot runs its blocks one after the other, each copied
/// in, reduced and copied out while it is still in the caches (`engine/shot.rs`).
/// Measured against one block the size of the buffer (`bench --algo two-shot`, 512
/// KiB segments, in-place medians of 3–4 interleaved repetitions, min/median/max):
/// n = 2: 2 MiB 82/85/157 µs against 86/109/402, 4 MiB 140/143/337 against
/// 146/175/788, 8 MiB 677/683/718 against 891/973/1370; n = 4: 4 MiB 728/793 against
/// 906/1177/1348, 2 MiB level, 8 MiB level (2.7–3.0 ms against 2.4–3.5).
pub(crate) fn two_shot_block(n: usize, es: usize, segment: usize) -> usize {
    (n.max(1) * segment / es.max(1)).max(n.max(1))
}

/// Up to how many bytes an all-reduce of `n` ranks' device memory over CUDA IPC runs
/// one-shot rather than two-shot ([`device_all_reduce`]). One-shot hands over between
/// ranks once (every rank's copy-in, then each reads all the others), two-shot twice
/// (the chunks' reductions, then the copies); on a GPU each hand-over is an
/// interprocess event wait on the stream after the host saw the peer's counter, and it
/// costs more than the extra memory one-shot moves — all ranks together `n(3n-1)·S`
/// bytes against two-shot's `(7n-6)·S` — up to a few MiB. Measured on one H100 under
/// MPS (`ferroccl bench --device cuda --transport cuda-ipc --algo …`, 20 iterations,
/// one sitting), one-shot / two-shot / ring: 2 ranks 4 KiB 29 / 47 / 54 µs, 4 MiB 32 /
/// 47 / 57, 16 MiB 70 / 73 / 98; 4 ranks 4 KiB 74 / 121 / 181, 4 MiB 89 / 125 / 193,
/// 16 MiB 374 / 175 / 280; 8 ranks 4 KiB 197 / 341 / 651, 1 MiB 204 / 359 / 668, 4 MiB
/// 322 / 391 / 736, 16 MiB 1117 / 499 / 839. So 4 MiB up to 8 ranks; beyond, where
/// nothing was measured and one-shot's traffic grows as `n²`, 1 MiB.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn device_one_shot_max(n: usize) -> usize {
    if n <= 8 {
        4 << 20
    } else {
        1 << 20
    }
}

/// The algorithm an all-reduce of `bytes` bytes of device memory runs on memory peers
/// that are device memory (CUDA IPC), where `forced` is the configured one. Every
/// hand-over between ranks costs a GPU-side event wait, so `auto` takes the algorithms
/// with fewest: one-shot up to [`device_one_shot_max`], two-shot above it — in one
/// block, not the host's cache-sized blocks, since each block is two more hand-overs,
/// and with `(7n-6)·S` bytes of memory traffic over all ranks against the ring's
/// `(9n-6)·S` (`transport::cuda_ipc`). On the H100 under MPS two-shot at 256 MiB
/// reached 352 GB/s busbw at 2 ranks against the ring's 229, and 102 against 79 at 8. Forced one-shot, two-shot (hierarchical: every
/// rank is on one host) and the ring hold; the others stream over links, which device
/// memory has none of, and run the ring as before.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn device_all_reduce(n: usize, bytes: usize, forced: AllReduceAlgo) -> Algorithm {
    match forced {
        _ if n <= 1 => Algorithm::Ring,
        AllReduceAlgo::OneShot => Algorithm::OneShot,
        AllReduceAlgo::TwoShot | AllReduceAlgo::Hierarchical => Algorithm::TwoShot,
        AllReduceAlgo::Auto if bytes <= device_one_shot_max(n) => Algorithm::OneShot,
        AllReduceAlgo::Auto => Algorithm::TwoShot,
        _ => Algorithm::Ring,
    }
}

/// The pieces (element ranges, in order, covering `count` elements of `es` bytes
/// once) in which a reduction of device memory is staged through host memory over a
/// host transport: each piece comes to the host, is reduced by a host collective of its
/// own and goes back, while the stream copies the next piece down and the previous one
/// up, so that the copies overlap the wire. One piece up to 2 MiB (nothing to overlap
/// with); above, a quarter of the buffer, at least 1 MiB and at most 16 MiB, so that
/// the first piece's copy — the one nothing hides — is short against the whole and each
/// piece's collective is long against its fixed cost.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn staged_pieces(count: usize, es: usize) -> Vec<std::ops::Range<usize>> {
    let es = es.max(1);
    let bytes = count.saturating_mul(es);
    if bytes <= 2 << 20 {
        return std::iter::once(0..count).collect();
    }
    let per = count.div_ceil(4).clamp((1 << 20) / es, (16 << 20) / es);
    (0..count.div_ceil(per))
        .map(|k| k * per..((k + 1) * per).min(count))
        .collect()
}

/// A collective other than all-reduce on host memory, for [`Policy::pulls`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HostCall {
    ReduceScatter,
    AllGather,
    Broadcast,
    Reduce,
    AllToAll,
    Gather,
    Scatter,
}

#[cfg(test)]
impl HostCall {
    pub(crate) const ALL: [HostCall; 7] = [
        HostCall::ReduceScatter,
        HostCall::AllGather,
        HostCall::Broadcast,
        HostCall::Reduce,
        HostCall::AllToAll,
        HostCall::Gather,
        HostCall::Scatter,
    ];
}

/// From how many bytes `call` on symmetric shared memory reads the peers' workspaces
/// (the pull executor) instead of streaming through the shared-memory rings; `None`:
/// at no size. Measured on the 2-core development machine (`ferroccl bench` with
/// `FERROCCL_SHM_SYMMETRIC=on` against `off`, 1 KiB to 16 MiB by factors of 4, n = 2
/// and 4, two sittings, quiet machine): every one of these ran slower on the pull
/// executor at every size but for ties within the noise — 16 MiB at n = 2:
/// broadcast 2.67–2.71 ms against 0.51–1.01, all-to-all 1.45–2.50 against 1.01–1.34,
/// all-gather 1.58–1.59 against 0.78–0.85, gather 1.47–1.50 against 0.46; 1 KiB:
/// 1.3–2.6 µs against 0.6–1.4. The pull executor copies a plan's whole input into the
/// workspace before any peer may read it (the rings pipeline it), lands a receive in
/// the workspace before copying it to the output (three copies of a byte against
/// the rings' two), and exchanges fingerprints with its neighbours first. All-reduce
/// is where reading the peers wins (two-shot: one pass over each peer's chunk
/// instead of the ring's copy in, copy out and re-read), decided in
/// [`Policy::all_reduce`].
pub(crate) fn sym_pull_min(_call: HostCall, _n: usize) -> Option<usize> {
    None
}

/// A network model for choosing by predicted time (`Tuning::cost_model`): a message
/// costs `alpha + S / bandwidth` seconds, combining `S` bytes `S / reduce`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Model {
    pub alpha: f64,
    pub bandwidth: f64,
    pub reduce: f64,
    /// `(alpha, bandwidth)` within a host, where it differs.
    pub within_host: Option<(f64, f64)>,
}

/// What the decisions depend on: the communicator's shape, its links and its tuning.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Policy<'a> {
    pub world_size: usize,
    /// Host-memory calls read the peers' memory (a transport whose memory peers read
    /// host memory) instead of streaming over links.
    pub host_pull: bool,
    /// The largest call (workspace bytes) the memory peers take; larger calls stream.
    pub pull_max: usize,
    /// The memory peers are symmetric shared memory with shared-memory rings beside
    /// them, where each collective takes what was measured fastest
    /// ([`sym_pull_min`]); other memory peers (CUDA IPC's, and their simulation) take
    /// every call of data they can.
    pub sym: bool,
    /// Data bytes of the memory peers' small-message slots, the same on every rank
    /// (0: none; [`crate::transport::Slots`]).
    pub slot_bytes: usize,
    /// Which ranks share a host, the same on every rank, if known.
    pub layout: Option<&'a HostLayout>,
    pub forced: AllReduceAlgo,
    pub small_message_bytes: usize,
    pub segment_bytes: usize,
    pub model: Option<Model>,
}

/// What a frame's fixed cost (its header, a system call, a wake-up) is worth in bytes
/// on the links a chain is cut for: about 5 µs at 12.5 GB/s.
pub(crate) const CHAIN_FRAME_COST_BYTES: f64 = 64.0 * 1024.0;

/// `(hosts, ranks per host)` of a layout the hierarchical algorithms improve on: two
/// hosts or more, of the same number `k >= 2` of ranks.
pub(crate) fn hierarchical_shape(l: &HostLayout) -> Option<(usize, usize)> {
    l.shape().filter(|&(h, k)| h >= 2 && k >= 2)
}

/// The ranks a rank links to when it starts: its ring neighbours, its
/// recursive-doubling partners (at most `2 + log2 n`) and, on hosts of several ranks
/// each, its hierarchical neighbours (at most 4 more). Other peers are linked on first
/// use.
pub(crate) fn link_peers(rank: usize, n: usize, layout: Option<&HostLayout>) -> Vec<usize> {
    if n <= 1 {
        return vec![];
    }
    let mut v = vec![schedule::left(rank, n), schedule::right(rank, n)];
    v.extend(doubling::peers(rank, n));
    if let Some(l) = layout.filter(|l| hierarchical_shape(l).is_some()) {
        v.extend(l.peers(rank));
    }
    v.sort_unstable();
    v.dedup();
    v
}

impl Policy<'_> {
    /// Whether a call on host memory with data, of `bytes` bytes of workspace, runs on
    /// the memory peers (pull) rather than over the links (push): where there are
    /// memory peers and they take that many. A call without data (a barrier) always
    /// streams.
    pub fn pull(&self, bytes: usize) -> bool {
        self.host_pull && bytes <= self.pull_max
    }

    /// Whether `call` on host memory, of `bytes` bytes of workspace, reads the memory
    /// peers: where [`Policy::pull`] allows it, on symmetric shared memory only from
    /// [`sym_pull_min`] up (the rings below, or at every size where it never wins).
    pub fn pulls(&self, call: HostCall, bytes: usize) -> bool {
        self.pull(bytes)
            && (!self.sym || sym_pull_min(call, self.world_size).is_some_and(|m| bytes >= m))
    }

    /// Whether an all-reduce of `bytes` by `algo` runs on the memory peers: one-shot
    /// and two-shot do where the memory peers take it, and the ring's plan too except
    /// on symmetric shared memory (read from the peers it lost to the rings at every
    /// size: 16 MiB at n = 2 3.3 ms against 1.35); the others stream over the links.
    pub fn all_reduce_pulls(&self, algo: Algorithm, bytes: usize) -> bool {
        self.pull(bytes)
            && match algo {
                Algorithm::OneShot | Algorithm::TwoShot => true,
                Algorithm::Ring => !self.sym,
                _ => false,
            }
    }

    /// Whether an all-reduce of `bytes` by `algo` runs from the memory peers' slots:
    /// one-shot, where it reads the peers and they fit a slot.
    pub fn all_reduce_slots(&self, algo: Algorithm, bytes: usize) -> bool {
        algo == Algorithm::OneShot
            && self.pull(bytes)
            && self.slot_bytes > 0
            && bytes <= self.slot_bytes
    }

    /// The algorithm an all-reduce of `bytes` bytes of host memory uses. Forced
    /// [`AllReduceAlgo::Hierarchical`] is said as such even where it cannot run
    /// ([`Policy::runnable`] refuses it then).
    pub fn all_reduce(&self, bytes: usize) -> Algorithm {
        let n = self.world_size;
        if self.pull(bytes) {
            // Memory peers: one-shot and two-shot read every peer; small messages
            // stream over the links (recursive doubling); the ring reads its plan.
            // Forced Rabenseifner, tree or recursive doubling, or a cost model, stream
            // over the links as anywhere (below).
            match self.forced {
                _ if n <= 1 => return Algorithm::Ring,
                AllReduceAlgo::OneShot => return Algorithm::OneShot,
                // Every rank is on one host: the hierarchical algorithm's part within
                // a host (reduce-scatter, then all-gather) is what two-shot does.
                AllReduceAlgo::TwoShot | AllReduceAlgo::Hierarchical => return Algorithm::TwoShot,
                AllReduceAlgo::Ring => return Algorithm::Ring,
                AllReduceAlgo::Auto if self.model.is_none() => {
                    return if self.slot_bytes > 0 && bytes <= self.slot_bytes.min(slot_max(n)) {
                        Algorithm::OneShot
                    } else if bytes <= sym_push_max(n) && bytes <= u32::MAX as usize {
                        Algorithm::RecursiveDoubling
                    } else if bytes <= one_shot_max(n) {
                        Algorithm::OneShot
                    } else if !self.sym || bytes <= sym_two_shot_max(n) {
                        Algorithm::TwoShot
                    } else {
                        Algorithm::Ring
                    }
                }
                _ => {}
            }
        }
        let streams = n > 1;
        // Recursive doubling sends the whole buffer as one frame.
        let rd_fits = streams && bytes <= u32::MAX as usize;
        let hier = self.hierarchical_shape();
        match self.forced {
            AllReduceAlgo::RecursiveDoubling if rd_fits => Algorithm::RecursiveDoubling,
            AllReduceAlgo::Rabenseifner if streams => Algorithm::Rabenseifner,
            AllReduceAlgo::Tree if streams => Algorithm::Tree,
            AllReduceAlgo::Hierarchical => Algorithm::Hierarchical,
            AllReduceAlgo::Auto if streams => match self.model {
                // The least predicted time on the configured network.
                Some(m) => {
                    let mut net = Network::flat(m.alpha, m.bandwidth, 1.0 / m.reduce);
                    if let Some((_, k)) = hier {
                        net.ranks_per_host = k;
                        (net.intra_alpha, net.intra_beta) =
                            m.within_host.unwrap_or((m.alpha, m.bandwidth));
                    }
                    // Bytes as one-byte elements: the model needs no alignment.
                    choose_by_model(n, bytes, 1, self.segment_bytes, &net)
                }
                None if bytes <= self.small_message_bytes && rd_fits => {
                    Algorithm::RecursiveDoubling
                }
                None if hier.is_some() => Algorithm::Hierarchical,
                None => Algorithm::Ring,
            },
            _ => Algorithm::Ring,
        }
    }

    /// How a barrier runs: from the memory peers' slots where there are some (a
    /// one-shot all-reduce of nothing: every rank posts a stamp and leaves once it has
    /// seen all of them), else recursive doubling over the links.
    pub fn barrier(&self) -> Algorithm {
        if self.world_size > 1 && self.all_reduce_slots(Algorithm::OneShot, 0) {
            Algorithm::OneShot
        } else {
            Algorithm::RecursiveDoubling
        }
    }

    /// The algorithm a broadcast or reduce uses: a pipelined binary tree from the root
    /// when [`AllReduceAlgo::Tree`] is forced and the buffers stream over links, the
    /// chain otherwise. Both keep the root agreement (`chain.rs`).
    pub fn rooted(&self) -> Algorithm {
        let never_pulled = [HostCall::Broadcast, HostCall::Reduce]
            .into_iter()
            .all(|c| self.sym && sym_pull_min(c, self.world_size).is_none());
        match self.forced {
            AllReduceAlgo::Tree if self.world_size > 1 && (!self.host_pull || never_pulled) => {
                Algorithm::Tree
            }
            _ => Algorithm::Chain,
        }
    }

    /// The algorithm a reduce-scatter or all-gather of host memory uses: the
    /// hierarchical one where `auto` finds hosts of `k >= 2` ranks, at least two of
    /// them, all alike, and wherever [`AllReduceAlgo::Hierarchical`] is forced; the ring
    /// otherwise. It moves `(H-1)/H·S` over each host's link instead of the flat
    /// ring's `(N-1)/N·S`, so it is taken at every size.
    pub fn reduce_scatter(&self) -> Algorithm {
        match self.forced {
            // Memory peers are one host: the ring's plan is the part within a host.
            AllReduceAlgo::Hierarchical if !self.host_pull => Algorithm::Hierarchical,
            AllReduceAlgo::Auto if self.hierarchical_shape().is_some() => Algorithm::Hierarchical,
            _ => Algorithm::Ring,
        }
    }

    /// The algorithm an all-to-all, gather or scatter uses: direct exchanges with every
    /// peer (`direct.rs`), streamed or, where [`Policy::pulls`] says so, read from the
    /// memory peers the same way.
    pub fn direct(&self) -> Algorithm {
        Algorithm::Direct
    }

    /// `(hosts, ranks per host)` where the hierarchical algorithms can run here: hosts
    /// of `k >= 2` ranks, at least two of them, all alike, over links (not memory
    /// peers).
    pub fn hierarchical_shape(&self) -> Option<(usize, usize)> {
        self.layout
            .filter(|_| !self.host_pull)
            .and_then(hierarchical_shape)
    }

    /// `(algo, the host layout it runs on)`, or why the hierarchical algorithm cannot
    /// run here when `algo` is it. Only the hierarchical algorithm has a layout; every
    /// other one runs flat, and builds none (a small call's whole cost is counted in
    /// allocations: the flat layout of every call was three of them at 2 ranks).
    pub fn runnable(&self, algo: Algorithm) -> Result<(Algorithm, Option<HostLayout>), String> {
        if algo != Algorithm::Hierarchical {
            return Ok((algo, None));
        }
        match (self.layout, self.host_pull) {
            (_, true) => {
                Err("this transport reads peers' memory (every rank is on one host)".into())
            }
            (None, _) => Err("the transport does not say which ranks share a host \
                              (links made with Communicator::with_links and no host list)"
                .into()),
            (Some(l), _) if l.shape().is_none() => Err(format!(
                "the hosts have different numbers of ranks ({})",
                l.hosts()
                    .iter()
                    .map(|h| h.len().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            (Some(l), _) => Ok((algo, Some(l.clone()))),
        }
    }
}

/// Segment bytes of a chain over `len` bytes on `n` ranks.
///
/// Cut in `k` segments of `g` bytes, a chain takes `k + n - 2` segment times plus `k`
/// frames' fixed cost `E`: `S/B + (n-2)·g/B + (S/g)·E/B`, least at
/// `g = sqrt(S·E/(n-2))` (with `E` = [`CHAIN_FRAME_COST_BYTES`]), kept between 64 KiB
/// ([`schedule::MIN_AUTO_SEGMENT_BYTES`], the auto-sized segments' floor elsewhere
/// too; or the configured segment, if smaller) and the configured segment. Two ranks
/// have no rank in between to fill, and take the configured segment. With the
/// configured 512 KiB alone, a 1 MiB broadcast over 8 ranks was 2 segments taking 8
/// segment times, 4x `S/B`; this cuts it in 10 (1.6x). Pulled, it is `n` segments, so
/// that the chain is `n` deep.
pub(crate) fn chain_segment(
    pulled: bool,
    len: usize,
    n: usize,
    esize: usize,
    configured: usize,
) -> usize {
    if pulled {
        return super::segment_bytes(len.div_ceil(n.max(1)).max(esize), esize);
    }
    if n <= 2 {
        return super::segment_bytes(configured, esize);
    }
    let best = (len as f64 * CHAIN_FRAME_COST_BYTES / (n - 2) as f64).sqrt();
    let floor = schedule::MIN_AUTO_SEGMENT_BYTES.min(configured);
    // Whole elements in `k` even segments, none above the configured segment nor below
    // the floor; of the counts around the continuous optimum, the one the model
    // prefers (the floor can leave a short last segment).
    let es = esize.max(1);
    let elems = len.div_ceil(es);
    let fewest = elems.div_ceil((configured / es).max(1)).max(1);
    let segment =
        |k: usize| (elems.div_ceil(k.max(fewest)) * es).clamp(floor, configured.max(floor));
    let x = len as f64 / best;
    let at_floor = len / floor.max(1);
    [
        x.floor() as usize,
        x.ceil() as usize,
        fewest,
        at_floor,
        at_floor + 1,
    ]
    .into_iter()
    .map(segment)
    .min_by(|&a, &b| chain_cost(len, n, a).total_cmp(&chain_cost(len, n, b)))
    .map_or(configured, |g| super::segment_bytes(g, esize))
}

/// A chain's time under the model [`chain_segment`] minimises, in byte-times: `k`
/// segments of `g` bytes over `n` ranks take `k + n - 2` segment times plus `k` frames'
/// fixed cost.
fn chain_cost(len: usize, n: usize, g: usize) -> f64 {
    let k = len.div_ceil(g.max(1)) as f64;
    (k + n as f64 - 2.0) * g as f64 + k * CHAIN_FRAME_COST_BYTES
}

#[cfg(test)]
#[path = "select_tests.rs"]
mod tests;
