//! The all-reduces that are not plans over links: one-shot and two-shot over memory
//! peers that read every rank's workspace (symmetric shared memory, where `auto`
//! takes two-shot; CUDA IPC's peers and their simulation when forced).
//!
//! Both keep the pull executor's counter discipline (`pull.rs`): every rank's
//! progress counter grows by the same span per call, a value says which stage this
//! rank has finished, a peer reads only what a counter it has seen covers, and a
//! call's first write into the workspace waits for the previous call's readers. The
//! fingerprint goes to every peer once this rank's first bytes are published, so the
//! exchange — a round trip with every peer — is also the wait for them; nothing a
//! peer could read of this rank is touched before a rank whose call differs would
//! have failed that exchange.

use super::{Engine, Pacer, PullCall};
use crate::error::{Error, Result};
use crate::transport::{MemPeers, Region};
use crate::wire::Fingerprint;
use std::ops::Range;

/// Which all-reduce [`Engine::pull_shot`] runs (see [`crate::algo::Algorithm::OneShot`]
/// and `TwoShot`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shot {
    One,
    /// Two-shot over blocks of `block` elements (the last one shorter), one after the
    /// other (`algo::select::two_shot_block` says how long).
    Two {
        block: usize,
    },
}

/// The byte range of chunk `q` of `n` of a buffer of `count` elements of `es` bytes:
/// element-aligned, sizes differing by at most one element.
pub(crate) fn shot_chunk(q: usize, n: usize, count: usize, es: usize) -> Range<usize> {
    (q * count / n) * es..((q + 1) * count / n) * es
}

/// The element ranges of `count` elements cut in blocks of `block` (at least one
/// block, empty when `count` is 0; `block` 0 is one block).
pub(crate) fn shot_blocks(count: usize, block: usize) -> Vec<Range<usize>> {
    let block = if block == 0 { count.max(1) } else { block };
    let k = count.div_ceil(block).max(1);
    (0..k)
        .map(|j| (j * block).min(count)..((j + 1) * block).min(count))
        .collect()
}

impl Engine {
    /// One-shot or two-shot all-reduce of the call's input into its output (equal
    /// lengths) over memory peers that read every rank's workspace:
    ///
    /// - one-shot: the input into this rank's workspace (`base + 1`), the fingerprint
    ///   with every peer, and once every peer has published, the output is `x0 op x1
    ///   op … op x(n-1)` from the workspaces, left to right (bit for bit the same on
    ///   every rank), then `base + 2`: done reading;
    /// - two-shot, block `j` of `k` after block `j - 1`: the block's input but this
    ///   rank's chunk into the workspace (`base + 2j + 1`); once every peer has done
    ///   the same, chunk `r` of the block — which this rank alone computes, from its
    ///   own input (in place) and then the others' in rank order — into the output and
    ///   the workspace (`base + 2j + 2`); the next block's input into the workspace
    ///   (`base + 2j + 3`), so that the peers' reductions of the next block need not
    ///   wait for this rank's copies of this one; then every other chunk `q` of the
    ///   block from rank `q`'s workspace once it has published it. At the end
    ///   `base + 2k + 1`: done reading. A block's bytes stay in the caches from its
    ///   copy-in to its last read, where one block the size of the buffer went out to
    ///   memory and back; nothing is read before the fingerprints met.
    pub(crate) fn pull_shot(
        &mut self,
        fp: &Fingerprint,
        shot: Shot,
        call: &PullCall,
    ) -> Result<()> {
        let (rank, n) = (self.rank, self.world_size);
        self.on_memory(
            fp,
            |e, mem| match shot {
                Shot::One => e.one_shot(mem, fp, call),
                Shot::Two { block } => e.two_shot(mem, fp, call, block),
            },
            || (0..n).filter(|&q| q != rank).collect(),
        )
    }

    /// What both shots do first: the call checked, the previous call's readers done
    /// with this rank's workspace, the call begun. Returns the peers, the pacer of the
    /// call's waits and the counter base.
    fn shot_begin(
        &mut self,
        mem: &mut dyn MemPeers,
        fp: &Fingerprint,
        call: &PullCall,
    ) -> Result<(Vec<usize>, Pacer, u64)> {
        let (rank, n) = (self.rank, self.world_size);
        let len = call.mem.input_len;
        if call.mem.output_len != len || call.input_at != 0 || call.bytes < len {
            return Err(Error::InvalidArgument(format!(
                "internal: {fp} on memory peers needs input and output of one length"
            )));
        }
        let peers: Vec<usize> = (0..n).filter(|&q| q != rank).collect();
        self.beacon.set(fp.seq, fp.kind.code());
        let base = self.pull.base;
        let mut pacer = Pacer::new(&self.cfg, self.health.clone(), self.spin);
        let prev = self.previous_readers_done(mem, &mut pacer, fp, base)?;
        mem.begin(&call.mem, len, &peers)?;
        for &q in &prev {
            mem.order_after(q)?;
        }
        Ok((peers, pacer, base))
    }

    /// Waits until every one of `peers` has published `at_least`, ordering this
    /// rank's later work after theirs.
    fn shot_wait_all(
        &mut self,
        mem: &mut dyn MemPeers,
        pacer: &mut Pacer,
        fp: &Fingerprint,
        peers: &[usize],
        at_least: u64,
        what: &str,
    ) -> Result<()> {
        for &q in peers {
            self.after(mem, pacer, fp, q, at_least, || format!("rank {q} {what}"))?;
            pacer.moved();
        }
        Ok(())
    }

    fn one_shot(
        &mut self,
        mem: &mut dyn MemPeers,
        fp: &Fingerprint,
        call: &PullCall,
    ) -> Result<()> {
        let (rank, n) = (self.rank, self.world_size);
        let (peers, mut pacer, base) = self.shot_begin(mem, fp, call)?;
        let len = call.mem.input_len;
        mem.copy(Region::Mine(0), Region::Input(0), len)?;
        mem.publish(base + 1)?;
        self.exchange_fingerprints(fp, &peers)?;
        self.shot_wait_all(
            mem,
            &mut pacer,
            fp,
            &peers,
            base + 1,
            "to publish its buffer",
        )?;
        // Rank `q`'s bytes; this rank's own from its workspace (the output, which may
        // be the input, is written before they are read on every rank but 0).
        let at = |q: usize| {
            if q == rank {
                Region::Mine(0)
            } else {
                Region::Peer(q, 0)
            }
        };
        let out = Region::Output(0);
        if n == 1 {
            mem.copy(out, at(rank), len)?;
        }
        // Every rank computes every byte, so all combine in rank order.
        for q in 1..n {
            let a = if q == 1 { at(0) } else { out };
            mem.combine(out, None, a, at(q), len, q == n - 1)?;
        }
        mem.publish(base + 2)?;
        self.finish(mem, &mut pacer, fp)?;
        self.pull.base = base + 2;
        self.pull.consumers = peers;
        Ok(())
    }

    fn two_shot(
        &mut self,
        mem: &mut dyn MemPeers,
        fp: &Fingerprint,
        call: &PullCall,
        block: usize,
    ) -> Result<()> {
        let (rank, n) = (self.rank, self.world_size);
        let (peers, mut pacer, base) = self.shot_begin(mem, fp, call)?;
        let es = call.mem.dtype.size();
        let blocks = shot_blocks(call.mem.input_len / es, block);
        let k = blocks.len() as u64;
        // Chunk `q` of block `b`, in bytes of the buffer.
        let chunk = |q: usize, b: &Range<usize>| {
            let c = shot_chunk(q, n, b.len(), es);
            b.start * es + c.start..b.start * es + c.end
        };
        // What the peers read of block `b` before it is reduced: all but this rank's
        // chunk.
        let copy_in = |mem: &mut dyn MemPeers, b: &Range<usize>| -> Result<()> {
            let mine = chunk(rank, b);
            for r in [b.start * es..mine.start, mine.end..b.end * es] {
                if !r.is_empty() {
                    mem.copy(Region::Mine(r.start), Region::Input(r.start), r.len())?;
                }
            }
            Ok(())
        };
        copy_in(mem, &blocks[0])?;
        mem.publish(base + 1)?;
        self.exchange_fingerprints(fp, &peers)?;
        for (j, b) in blocks.iter().enumerate() {
            let at = base + 2 * j as u64;
            self.shot_wait_all(mem, &mut pacer, fp, &peers, at + 1, "to publish its buffer")?;
            // Chunk `r`: its own input first (in place, no copy), then the others in
            // rank order; the result to the output and, for the peers, the workspace.
            let mine = chunk(rank, b);
            let (out, keep) = (Region::Output(mine.start), Region::Mine(mine.start));
            if n == 1 {
                mem.copy(out, Region::Input(mine.start), mine.len())?;
            }
            for (i, &q) in peers.iter().enumerate() {
                let a = if i == 0 {
                    Region::Input(mine.start)
                } else {
                    out
                };
                let last = i + 1 == peers.len();
                let p = Region::Peer(q, mine.start);
                mem.combine(out, last.then_some(keep), a, p, mine.len(), last)?;
            }
            mem.publish(at + 2)?;
            if let Some(next) = blocks.get(j + 1) {
                copy_in(mem, next)?;
                mem.publish(at + 3)?;
            }
            for &q in &peers {
                let c = chunk(q, b);
                self.after(mem, &mut pacer, fp, q, at + 2, || {
                    format!("rank {q} to reduce its chunk")
                })?;
                mem.copy(Region::Output(c.start), Region::Peer(q, c.start), c.len())?;
                pacer.moved();
            }
        }
        mem.publish(base + 2 * k + 1)?;
        self.finish(mem, &mut pacer, fp)?;
        self.pull.base = base + 2 * k + 1;
        self.pull.consumers = peers;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_and_chunks_cover_the_buffer_once() {
        for count in [0usize, 1, 2, 7, 64, 1000, 1001] {
            for block in [0usize, 1, 3, 64, 500, 5000] {
                let b = shot_blocks(count, block);
                assert!(!b.is_empty());
                assert_eq!(b[0].start, 0);
                assert_eq!(b.last().map(|r| r.end), Some(count));
                assert!(b
                    .windows(2)
                    .all(|w| w[0].end == w[1].start && !w[1].is_empty()));
                if block > 0 {
                    assert!(b.iter().all(|r| r.len() <= block), "{count} {block}");
                }
                for n in 1..=8 {
                    for r in &b {
                        let c: Vec<_> = (0..n).map(|q| shot_chunk(q, n, r.len(), 4)).collect();
                        assert_eq!(c[0].start, 0);
                        assert_eq!(c[n - 1].end, r.len() * 4);
                        assert!(c.windows(2).all(|w| w[0].end == w[1].start));
                    }
                }
            }
        }
    }
}
