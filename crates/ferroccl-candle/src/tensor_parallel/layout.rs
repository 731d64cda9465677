//! The pure decisions of tensor parallelism, tested without a network: the P × T × D
//! mesh and each rank's place in it, the shards of a cut dimension, and the checks
//! every rank runs on what all ranks declared (so that every rank reaches the same
//! verdict from the same gathered facts).

use crate::error::{Error, Result};
use std::ops::Range;

/// A job cut into `pipeline` stages × `tensor` tensor-parallel ranks × `data`
/// replicas (P × T × D), Megatron-LM's order: tensor-parallel ranks are neighbours
/// (they talk most: two all-reduces per block), then stages, then replicas. Rank
/// r = t + T × (s + P × d); with T = 1 that is [`crate::pipeline::Layout::split`]'s
/// P × D (stage r mod P of replica r / P).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mesh {
    /// Pipeline stages P.
    pub pipeline: usize,
    /// Tensor-parallel ranks T.
    pub tensor: usize,
    /// Data-parallel replicas D.
    pub data: usize,
}

/// Where one rank sits in a [`Mesh`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coords {
    /// Its pipeline stage, `0..P`.
    pub stage: usize,
    /// Its tensor-parallel rank, `0..T`.
    pub tensor: usize,
    /// Its replica, `0..D`.
    pub replica: usize,
}

impl Mesh {
    /// The mesh of `pipeline` × `tensor` over a job of `world` ranks, the replicas
    /// making up the rest; `InvalidArgument` when P × T does not divide the
    /// job.
    pub fn for_world(world: usize, pipeline: usize, tensor: usize) -> Result<Mesh> {
        let pt = pipeline.saturating_mul(tensor);
        if pt == 0 || !world.is_multiple_of(pt) {
            return Err(Error::invalid(format!(
                "{pipeline} pipeline stage(s) × {tensor} tensor-parallel rank(s) do not divide \
                 the job's {world} ranks"
            )));
        }
        Ok(Mesh {
            pipeline,
            tensor,
            data: world / pt,
        })
    }

    /// P × T × D.
    pub fn size(&self) -> usize {
        self.pipeline
            .saturating_mul(self.tensor)
            .saturating_mul(self.data)
    }

    /// `InvalidArgument` unless every factor is at least 1 and P × T × D is
    /// the job's `world` ranks.
    pub fn check(&self, world: usize) -> Result<()> {
        let Mesh {
            pipeline: p,
            tensor: t,
            data: d,
        } = *self;
        if p == 0 || t == 0 || d == 0 || self.size() != world {
            return Err(Error::invalid(format!(
                "a layout of {p} pipeline stage(s) × {t} tensor-parallel rank(s) × {d} \
                 replica(s) is {} ranks, not the job's {world}",
                self.size()
            )));
        }
        Ok(())
    }

    /// Rank `rank`'s place (see the type's docs).
    pub fn coords(&self, rank: usize) -> Coords {
        let (t, p) = (self.tensor.max(1), self.pipeline.max(1));
        Coords {
            tensor: rank % t,
            stage: (rank / t) % p,
            replica: rank / (t * p),
        }
    }

    /// The rank at `c`; the inverse of [`Mesh::coords`].
    pub fn rank_of(&self, c: Coords) -> usize {
        c.tensor + self.tensor * (c.stage + self.pipeline * c.replica)
    }

    /// The verdict every rank reaches on the meshes all ranks asked for (`asked[r]` is
    /// rank r's), as rank `me`: `Mismatch` naming the first rank that asked
    /// for another mesh than `me`, else [`Mesh::check`] against the job's size.
    pub fn agree(me: usize, asked: &[Mesh]) -> Result<Mesh> {
        let mine = *asked
            .get(me)
            .ok_or_else(|| Error::invalid(format!("rank {me} outside a job of {}", asked.len())))?;
        if let Some((peer, theirs)) = asked.iter().enumerate().find(|(_, m)| **m != mine) {
            return Err(ferroccl::Error::Mismatch {
                rank: me,
                peer,
                ours: format!("layout {}", mine.name()),
                theirs: format!("layout {}", theirs.name()),
            }
            .into());
        }
        mine.check(asked.len())?;
        Ok(mine)
    }

    /// `P × T × D`, as the book draws it (docs/book/src/training/tensor-parallel.md).
    pub fn name(&self) -> String {
        format!(
            "{} × {} × {} (pipeline × tensor × data)",
            self.pipeline, self.tensor, self.data
        )
    }

    /// As three words for a collective.
    pub(crate) fn words(&self) -> [i64; 3] {
        [self.pipeline, self.tensor, self.data].map(|v| v.min(i64::MAX as usize) as i64)
    }

    /// From [`Mesh::words`] (negative words, which no rank sends, become 0).
    pub(crate) fn from_words(w: &[i64]) -> Mesh {
        let u = |i: usize| w.get(i).map_or(0, |&v| v.max(0) as usize);
        Mesh {
            pipeline: u(0),
            tensor: u(1),
            data: u(2),
        }
    }
}

/// The indices of a dimension of `n` that tensor-parallel rank `t` of `tp` holds: the
/// dimension read as `blocks` equal blocks, each cut into `tp` contiguous parts, rank
/// t holding part t of every block. One block is Megatron's plain cut; a fused Q, K, V
/// projection is three (each rank holds its heads' rows of Q, of K and of V). A
/// dimension that does not cut evenly is `InvalidArgument`.
pub fn shard_ranges(n: usize, blocks: usize, t: usize, tp: usize) -> Result<Vec<Range<usize>>> {
    let parts = blocks.saturating_mul(tp);
    if parts == 0 || t >= tp || !n.is_multiple_of(parts) {
        return Err(Error::invalid(format!(
            "a dimension of {n} does not cut into {tp} equal tensor-parallel shards{}",
            if blocks > 1 {
                format!(" in each of its {blocks} blocks")
            } else {
                String::new()
            }
        )));
    }
    let (block, part) = (n / blocks, n / parts);
    Ok((0..blocks)
        .map(|b| b * block + t * part..b * block + (t + 1) * part)
        .collect())
}

/// Which way a layer is cut across the tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Column-parallel: the output dimension (the weight's rows), in `blocks` blocks.
    Column {
        /// Blocks of the output dimension cut separately (3 for a fused Q, K, V).
        blocks: usize,
    },
    /// Row-parallel: the input dimension (the weight's columns).
    Row,
    /// Attention heads (the check of a self-attention block's head count).
    Heads,
}

/// What one rank declares about a tensor-parallel layer before any of its weights
/// move: how it is cut and the whole layer's sizes (`heads` for [`Cut::Heads`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Declared {
    /// How it is cut.
    pub cut: Cut,
    /// The whole layer's input features (a block's hidden size for heads).
    pub in_features: usize,
    /// The whole layer's output features (the head count for heads).
    pub out_features: usize,
}

impl Declared {
    /// In words, for messages.
    pub fn name(&self) -> String {
        match self.cut {
            Cut::Column { blocks: 1 } => format!(
                "a column-parallel layer {} → {}",
                self.in_features, self.out_features
            ),
            Cut::Column { blocks } => format!(
                "a column-parallel layer {} → {} in {blocks} blocks",
                self.in_features, self.out_features
            ),
            Cut::Row => format!(
                "a row-parallel layer {} → {}",
                self.in_features, self.out_features
            ),
            Cut::Heads => format!(
                "self-attention of hidden size {} in {} heads",
                self.in_features, self.out_features
            ),
        }
    }

    /// Why this layer cannot be cut over `tp` ranks, if it cannot.
    pub fn cut_error(&self, tp: usize) -> Option<String> {
        let (n, blocks, what) = match self.cut {
            Cut::Column { blocks } => (self.out_features, blocks, "output dimension"),
            Cut::Row => (self.in_features, 1, "input dimension (hidden size)"),
            Cut::Heads => {
                let (h, heads) = (self.in_features, self.out_features);
                if heads == 0 || !h.is_multiple_of(heads) {
                    return Some(format!(
                        "hidden size {h} is not {heads} heads of equal size"
                    ));
                }
                (heads, 1, "head count")
            }
        };
        let parts = blocks.saturating_mul(tp);
        (parts == 0 || !n.is_multiple_of(parts)).then(|| {
            format!(
                "its {what} of {n}{} does not cut into {tp} equal tensor-parallel shards",
                if blocks > 1 {
                    format!(" ({blocks} blocks)")
                } else {
                    String::new()
                }
            )
        })
    }

    /// As words for a collective.
    pub(crate) fn words(&self) -> [i64; 4] {
        let (kind, blocks) = match self.cut {
            Cut::Column { blocks } => (1, blocks),
            Cut::Row => (2, 0),
            Cut::Heads => (3, 0),
        };
        [kind, blocks, self.in_features, self.out_features]
            .map(|v: usize| v.min(i64::MAX as usize) as i64)
    }

    /// From [`Declared::words`]; `None` for words no rank sends.
    pub(crate) fn from_words(w: &[i64]) -> Option<Declared> {
        let u = |i: usize| w.get(i).and_then(|&v| usize::try_from(v).ok());
        let cut = match u(0)? {
            1 => Cut::Column { blocks: u(1)? },
            2 => Cut::Row,
            3 => Cut::Heads,
            _ => return None,
        };
        Some(Declared {
            cut,
            in_features: u(2)?,
            out_features: u(3)?,
        })
    }
}

/// The verdict every rank of a tensor-parallel group of `tp` reaches on what all its
/// ranks declared for one layer (`all[r]` is rank r's, `None` if unreadable), as rank
/// `me`: `Mismatch` naming the first rank whose layer differs from `me`'s
/// (shard shapes that disagree), else `InvalidArgument` when the layer does
/// not cut into `tp` equal shards (naming the size and T). The same facts give every
/// rank the same verdict.
pub fn agree_declared(me: usize, tp: usize, all: &[Option<Declared>]) -> Result<Declared> {
    let mine =
        all.get(me).copied().flatten().ok_or_else(|| {
            Error::invalid(format!("tensor-parallel rank {me}: no layer declared"))
        })?;
    if let Some((peer, theirs)) = all.iter().enumerate().find(|(_, d)| **d != Some(mine)) {
        return Err(ferroccl::Error::Mismatch {
            rank: me,
            peer,
            ours: format!("tensor-parallel rank {me} holds a shard of {}", mine.name()),
            theirs: match theirs {
                Some(d) => format!("tensor-parallel rank {peer} of {}", d.name()),
                None => format!("tensor-parallel rank {peer} declared no layer"),
            },
        }
        .into());
    }
    match mine.cut_error(tp) {
        Some(why) => Err(Error::invalid(format!("{}: {why} (T = {tp})", mine.name()))),
        None => Ok(mine),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coords_and_ranks_are_inverse_and_t1_is_the_pipelines_layout() {
        for (p, t, d) in [
            (1, 1, 1),
            (2, 2, 1),
            (2, 1, 2),
            (1, 4, 1),
            (3, 2, 2),
            (2, 4, 3),
        ] {
            let m = Mesh {
                pipeline: p,
                tensor: t,
                data: d,
            };
            // coords is one to one: rank_of undoes it.
            for r in 0..m.size() {
                let c = m.coords(r);
                assert!(c.stage < p && c.tensor < t && c.replica < d, "{c:?}");
                assert_eq!(m.rank_of(c), r);
                if t == 1 {
                    assert_eq!((c.stage, c.replica), (r % p, r / p));
                }
            }
        }
        // Tensor-parallel ranks are neighbours.
        let m = Mesh {
            pipeline: 2,
            tensor: 2,
            data: 2,
        };
        assert_eq!(m.coords(1).tensor, 1);
        assert_eq!(m.coords(1).stage, 0);
        assert_eq!(m.coords(2).stage, 1);
        assert_eq!(m.coords(4).replica, 1);
    }

    #[test]
    fn a_mesh_that_is_not_the_job_is_refused() {
        assert_eq!(
            Mesh::for_world(8, 2, 2).unwrap(),
            Mesh {
                pipeline: 2,
                tensor: 2,
                data: 2
            }
        );
        assert!(Mesh::for_world(6, 2, 2).is_err());
        assert!(Mesh::for_world(6, 0, 2).is_err());
        let m = Mesh {
            pipeline: 2,
            tensor: 2,
            data: 1,
        };
        assert!(m.check(4).is_ok());
        let e = m.check(6).unwrap_err().to_string();
        assert!(e.contains("is 4 ranks, not the job's 6"), "{e}");
        assert!(Mesh { data: 0, ..m }.check(0).is_err());
        assert_eq!(Mesh::from_words(&m.words()), m);
    }

    #[test]
    fn every_rank_reaches_the_same_verdict_on_the_meshes_asked() {
        let a = Mesh {
            pipeline: 2,
            tensor: 2,
            data: 1,
        };
        let b = Mesh { tensor: 1, ..a };
        assert_eq!(Mesh::agree(1, &[a, a, a, a]).unwrap(), a);
        for me in 0..4 {
            match Mesh::agree(me, &[a, a, b, a]) {
                Err(Error::Comm(ferroccl::Error::Mismatch { rank, peer, .. })) => {
                    assert_eq!(rank, me);
                    assert_eq!(peer, if me == 2 { 0 } else { 2 });
                }
                other => panic!("{other:?}"),
            }
        }
        // All agree on a mesh of another size: the size is named.
        assert!(matches!(
            Mesh::agree(0, &[a, a]),
            Err(Error::Comm(ferroccl::Error::InvalidArgument(w))) if w.contains("not the job's 2")
        ));
    }

    #[test]
    fn shards_tile_each_block_in_rank_order() {
        assert_eq!(shard_ranges(8, 1, 1, 2).unwrap(), vec![4..8]);
        assert_eq!(shard_ranges(12, 3, 0, 2).unwrap(), vec![0..2, 4..6, 8..10]);
        assert_eq!(shard_ranges(12, 3, 1, 2).unwrap(), vec![2..4, 6..8, 10..12]);
        for (n, blocks, tp) in [(8, 1, 4), (24, 3, 4), (6, 1, 1), (0, 1, 2)] {
            let mut all: Vec<usize> = (0..tp)
                .flat_map(|t| shard_ranges(n, blocks, t, tp).unwrap())
                .flatten()
                .collect();
            all.sort_unstable();
            assert_eq!(all, (0..n).collect::<Vec<_>>(), "{n} {blocks} {tp}");
        }
        let e = shard_ranges(510, 1, 0, 4).unwrap_err().to_string();
        assert!(e.contains("510 does not cut into 4"), "{e}");
        assert!(shard_ranges(12, 3, 0, 8).is_err());
        assert!(shard_ranges(8, 1, 2, 2).is_err());
        assert!(shard_ranges(8, 0, 0, 2).is_err());
    }

    #[test]
    fn declared_layers_agree_or_every_rank_names_the_same_cause() {
        let col = Declared {
            cut: Cut::Column { blocks: 1 },
            in_features: 784,
            out_features: 512,
        };
        assert_eq!(Declared::from_words(&col.words()), Some(col));
        assert_eq!(agree_declared(0, 4, &[Some(col); 4]).unwrap(), col);
        // One rank built a narrower layer: a mismatch on every rank.
        let narrow = Declared {
            out_features: 256,
            ..col
        };
        let all = [Some(col), Some(narrow), Some(col)];
        for me in 0..3 {
            match agree_declared(me, 3, &all) {
                Err(Error::Comm(ferroccl::Error::Mismatch { peer, theirs, .. })) => {
                    assert_eq!(peer, if me == 1 { 0 } else { 1 });
                    assert!(
                        theirs.contains(if me == 1 { "512" } else { "256" }),
                        "{theirs}"
                    );
                }
                other => panic!("{other:?}"),
            }
        }
        // A hidden size T does not divide: the size and T are named.
        let row = Declared {
            cut: Cut::Row,
            in_features: 510,
            out_features: 10,
        };
        let e = agree_declared(1, 4, &[Some(row); 4])
            .unwrap_err()
            .to_string();
        assert!(e.contains("510") && e.contains("T = 4"), "{e}");
        let heads = Declared {
            cut: Cut::Heads,
            in_features: 12,
            out_features: 6,
        };
        assert!(agree_declared(0, 2, &[Some(heads); 2]).is_ok());
        assert!(agree_declared(0, 4, &[Some(heads); 4]).is_err());
        let odd = Declared {
            in_features: 10,
            out_features: 4,
            ..heads
        };
        assert!(agree_declared(0, 1, &[Some(odd)]).is_err());
        let qkv = Declared {
            cut: Cut::Column { blocks: 3 },
            in_features: 8,
            out_features: 24,
        };
        assert!(agree_declared(0, 4, &[Some(qkv); 4]).is_ok());
        assert!(agree_declared(0, 8, &[Some(qkv); 8]).is_ok());
        assert!(agree_declared(0, 16, &[Some(qkv); 16]).is_err());
        assert!(agree_declared(0, 2, &[Some(col), None]).is_err());
        assert_eq!(Declared::from_words(&[9, 0, 1, 1]), None);
    }
}
