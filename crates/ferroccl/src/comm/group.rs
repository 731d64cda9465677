//! Sub-communicators: [`Communicator::split`], [`Communicator::group`] and
//! [`Communicator::split_by_host`].
//!
//! Each is collective over the parent: every rank of the parent calls it, in the same
//! place of its sequence of calls, and the ranks trade what they asked for (color and
//! key, or a digest of the list) in one all-gather (kind `split` on the wire, so a rank
//! that called something else fails with a mismatch naming both calls). Every rank
//! then computes the same children from the same table. A child is a communicator of
//! its own: its ranks `0..m`, its sequence numbers, its id on every frame and in every
//! handshake, its own links (made through the parent's transport endpoint: the same
//! listener, addresses and store, no new rendezvous; see [`crate::transport::Connector::group`]
//! for why links are not shared), its own engines and background threads, its tuning
//! (the parent's), its flight recorder (dumped under `comm-<id>/`), and its host layout
//! (the parent's hosts, restricted to its ranks). Its errors name each rank it names
//! by its job rank too. A failure poisons the communicator it happened on: the
//! parent and the other children of a split go on (a rank that dies poisons every
//! communicator it belongs to, as each of them loses a link to it, and only those).

use super::{Communicator, Family};
use crate::algo::{ring, schedule, Algorithm};
use crate::engine::Data;
use crate::error::{Error, Result};
use crate::reduce::{DataType, NoCombine};
use crate::sync::lock;
use crate::transport::{Channel, GroupSpec};
use crate::wire::OpKind;
use std::sync::Arc;

/// A communicator id derived from `base` (the parent's), a domain `tag` and `data`:
/// the same on every rank that derives it from the same things, never 0 (the job's
/// own), and 64 bits of FNV-1a mixed by splitmix64's finaliser, so that a job's
/// communicators do not collide.
pub(super) fn derive(base: u64, tag: &[u8], data: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: u8| {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    };
    base.to_le_bytes().into_iter().for_each(&mut eat);
    tag.iter().copied().for_each(&mut eat);
    for d in data {
        d.to_le_bytes().into_iter().for_each(&mut eat);
    }
    let mut z = h;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    z.max(1)
}

/// One rank's entry in a split's table: its color (-1: none), its key, and (for
/// `group`) the digest of the list it passed.
type Entry = [i64; 3];

impl Communicator {
    /// Splits this communicator, as `MPI_Comm_split` and `ncclCommSplit` do: ranks that
    /// pass the same `Some(color)` form a child communicator, ranked by `(key, rank
    /// here)`; a rank that passes `None` takes part in the call but joins no child and
    /// gets `None`. Collective: every rank calls it, at the same place in its sequence
    /// of calls. The children are independent communicators (see the module docs):
    /// collectives on the parent and on its children may be in flight together (in
    /// scopes), children can be split again, and a failure on one poisons that one
    /// alone.
    ///
    /// ```
    /// use ferroccl::{Communicator, Config, ReduceOp};
    /// let comms = Communicator::local_group(4, &Config::default())?;
    /// std::thread::scope(|t| {
    ///     let ranks: Vec<_> = comms.into_iter().map(|comm| t.spawn(move || -> ferroccl::Result<()> {
    ///         // Even and odd ranks each form a communicator of 2.
    ///         let half = comm.split(Some(comm.rank() as u32 % 2), 0)?.expect("a member");
    ///         let mut v = [comm.rank() as i64];
    ///         half.all_reduce(&mut v, ReduceOp::Sum)?;
    ///         assert_eq!(v[0], if comm.rank() % 2 == 0 { 0 + 2 } else { 1 + 3 });
    ///         assert_eq!((half.rank(), half.world_size()), (comm.rank() / 2, 2));
    ///         Ok(())
    ///     })).collect();
    ///     ranks.into_iter().try_for_each(|h| h.join().expect("a rank panicked"))
    /// })?;
    /// # Ok::<(), ferroccl::Error>(())
    /// ```
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let mine = [color.map_or(-1, i64::from), key, 0];
        let (table, seq) = self.exchange_entries(mine)?;
        let Some(c) = color else { return Ok(None) };
        let mut members: Vec<usize> = (0..self.world_size)
            .filter(|&q| table[q][0] == i64::from(c))
            .collect();
        members.sort_by_key(|&q| (table[q][1], q));
        let id = derive(self.family.base, b"split", &[seq, u64::from(c)]);
        self.child(id, members).map(Some)
    }

    /// The child communicator of the ranks listed, in that order (`ranks[i]` becomes
    /// rank `i`), as `torch.distributed.new_group(ranks)`: collective over this
    /// communicator, every rank passing the same list; ranks not listed get `None`.
    /// Lists that differ between ranks fail on every rank, in this call, with
    /// [`Error::Mismatch`] (and this communicator stays usable); a list that names a
    /// rank twice or out of range is refused with [`Error::InvalidArgument`].
    pub fn group(&self, ranks: &[usize]) -> Result<Option<Communicator>> {
        let n = self.world_size;
        self.check_list(ranks)?;
        let digest = derive(
            0,
            b"list",
            &ranks.iter().map(|&r| r as u64).collect::<Vec<_>>(),
        );
        let position = ranks.iter().position(|&r| r == self.rank);
        let mine = [
            position.map_or(-1, |_| 0),
            position.map_or(0, |p| p as i64),
            digest as i64,
        ];
        let (table, seq) = self.exchange_entries(mine)?;
        if let Some(q) = (0..n).find(|&q| table[q][2] != digest as i64) {
            return Err(Error::Mismatch {
                rank: self.rank,
                peer: q,
                ours: format!("group #{seq} of ranks {ranks:?}"),
                theirs: format!(
                    "group #{seq} of another list of ranks (digest {:#018x})",
                    table[q][2] as u64
                ),
            });
        }
        if position.is_none() {
            return Ok(None);
        }
        let id = derive(self.family.base, b"group", &[seq, digest]);
        self.child(id, ranks.to_vec()).map(Some)
    }

    /// The child communicator of the ranks listed (`ranks[i]` becomes rank `i`), made
    /// by its members alone: for frameworks whose non-members never reach the backend
    /// (`torch.distributed.new_group` calls its backend on the members only). Every
    /// member passes the same list and the same `nonce` (say, how many groups of this
    /// list it made before), which name the child; the links are made through this
    /// communicator's transport, as for [`Communicator::group`]. Unlike `group`, the
    /// ranks do not trade their lists first: a member whose list or nonce differs
    /// names another child, and the members fail to connect to it within
    /// `connect_timeout` ([`Error::Timeout`] or [`Error::Handshake`]) instead of a
    /// [`Error::Mismatch`]. A list without this rank, with a rank twice or out of range
    /// is refused with [`Error::InvalidArgument`].
    pub fn group_of_members(&self, ranks: &[usize], nonce: u64) -> Result<Communicator> {
        self.check_list(ranks)?;
        if !ranks.contains(&self.rank) {
            // Nobody waits for this rank: the communicator stays usable.
            return Err(Error::InvalidArgument(format!(
                "group_of_members: rank {} is not in {ranks:?}; only members call it",
                self.rank
            )));
        }
        let mut data: Vec<u64> = ranks.iter().map(|&r| r as u64).collect();
        data.push(nonce);
        let id = derive(self.family.base, b"members", &data);
        self.child(id, ranks.to_vec())
    }

    /// The child communicator of the ranks on this rank's host (ranked as here):
    /// [`Communicator::split`] by host. Every rank gets one. Needs the host list
    /// ([`Communicator::host_layout`]); links made elsewhere without one get
    /// [`Error::Unavailable`].
    pub fn split_by_host(&self) -> Result<Communicator> {
        let Some(hosts) = self.family.hosts.clone() else {
            return Err(Error::Unavailable {
                what: "split_by_host".into(),
                why: "this communicator's links do not say which ranks share a host".into(),
            });
        };
        // The host's first rank names it: the same color on every rank of the host.
        let first = hosts
            .iter()
            .position(|h| *h == hosts[self.rank])
            .unwrap_or(self.rank);
        self.split(Some(first as u32), self.rank as i64)?
            .ok_or_else(|| Error::InvalidArgument("split_by_host: no child".into()))
    }

    /// This communicator's id: 0 for the job's own (made by [`Communicator::init`] and
    /// friends), a child's otherwise (on every frame, in every handshake, in its flight
    /// recorder's directory `comm-<id>`).
    pub fn id(&self) -> u64 {
        self.family.id
    }

    /// This rank's rank in the job (the communicator made by [`Communicator::init`]).
    pub fn job_rank(&self) -> usize {
        self.family.global[self.rank]
    }

    /// The job rank of each rank of this communicator, by rank.
    pub fn job_ranks(&self) -> &[usize] {
        &self.family.global
    }

    /// Refuses a list of ranks that names one twice or out of range.
    fn check_list(&self, ranks: &[usize]) -> Result<()> {
        let n = self.world_size;
        let mut seen = vec![false; n];
        for &r in ranks {
            if r >= n || std::mem::replace(&mut seen[r], true) {
                return Err(self.refuse(Error::InvalidArgument(format!(
                    "group: rank {r} is out of range or listed twice in {ranks:?} \
                     (a communicator of {n})"
                ))));
            }
        }
        Ok(())
    }

    /// Every rank's `mine`, by rank, traded in one all-gather of kind `split` (which
    /// takes a sequence number, returned too: the same on every rank).
    fn exchange_entries(&self, mine: Entry) -> Result<(Vec<Entry>, u64)> {
        let n = self.world_size;
        let fp = self.fingerprint(
            OpKind::Split,
            DataType::I64,
            None,
            3 * n,
            None,
            Algorithm::Ring,
        );
        let seq = fp.seq;
        let mut table = vec![[0i64; 3]; n];
        table[self.rank] = mine;
        let chunks = schedule::chunks_from_counts(&vec![3; n]);
        let seg = self.cfg.tuning.segment_bytes;
        let rank = self.rank;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut table);
        // Always over the links: it is a few bytes, and every transport has links.
        self.run_now(|e| {
            let plan = ring::all_gather(rank, n, &chunks, 8, ring::seg_elems(&chunks, 8, seg));
            e.stream(
                Channel::Collective,
                &fp,
                &plan,
                Data::Write(bytes),
                &mut NoCombine,
            )
        })?;
        Ok((table, seq))
    }

    /// The child of id `id` whose rank `i` is this communicator's rank `members[i]`
    /// (this rank among them): its links through this communicator's transport, then
    /// a communicator on them, linked to its neighbours.
    fn child(&self, id: u64, members: Vec<usize>) -> Result<Communicator> {
        let me = members
            .iter()
            .position(|&q| q == self.rank)
            .ok_or_else(|| Error::InvalidArgument("internal: not a member of the child".into()))?;
        let spec = GroupSpec {
            id,
            members: members.clone(),
        };
        self.wait_collectives();
        let links = lock(&self.shared.engine).group_links(&spec)?;
        let mut cfg = self.cfg.clone();
        cfg.job.rank = me;
        cfg.job.world_size = members.len();
        let family = Family {
            id,
            base: id,
            global: members.iter().map(|&q| self.family.global[q]).collect(),
            hosts: self.family.hosts.as_ref().map(|h| {
                members
                    .iter()
                    .map(|&q| h[q].clone())
                    .collect::<Arc<[String]>>()
            }),
        };
        Communicator::assemble(
            cfg,
            links,
            self._store_server.clone(),
            &self.transport,
            family,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::derive;

    #[test]
    fn ids_are_never_zero_and_differ_by_every_input() {
        let a = derive(1, b"split", &[0, 3]);
        assert_ne!(a, 0);
        assert_eq!(a, derive(1, b"split", &[0, 3]), "the same everywhere");
        for b in [
            derive(2, b"split", &[0, 3]),
            derive(1, b"group", &[0, 3]),
            derive(1, b"split", &[1, 3]),
            derive(1, b"split", &[0, 4]),
            derive(1, b"split", &[0]),
        ] {
            assert_ne!(a, b);
        }
        let ids: std::collections::HashSet<u64> =
            (0..10_000).map(|c| derive(7, b"split", &[0, c])).collect();
        assert_eq!(ids.len(), 10_000);
    }
}
