//! Tagged point-to-point messages between two ranks, on their own channel.

use super::Communicator;
use crate::algo::{self, Algorithm, In, Land, Out, Plan};
use crate::engine::Data;
use crate::error::Result;
use crate::reduce::{Element, NoCombine};
use crate::transport::Channel;
use crate::wire::{Fingerprint, OpKind};
use std::mem::size_of;

impl Communicator {
    /// Sends `buf` to rank `peer` with a `tag`. Messages between two ranks are matched in
    /// the order they were sent: the receiver's next `recv` from this rank must name the
    /// same tag, type and length, or both fail with [`crate::Error::Mismatch`]. Returns
    /// once the data is handed to the transport.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize, tag: u32) -> Result<()> {
        let (fp, seg) = self.p2p_start::<T>("send", peer, tag, buf.len(), true)?;
        let bytes: &[u8] = bytemuck::cast_slice(buf);
        let plan = Plan {
            outs: algo::frames(bytes.len(), seg)
                .map(|(j, r)| Out::segment(peer, j, r, None))
                .collect(),
            ins: vec![],
            lanes: None,
        };
        self.run_now(|e| e.stream(Channel::P2p, &fp, &plan, Data::Read(bytes), &mut NoCombine))
    }

    /// Receives into `buf` the next message from rank `peer`, which must carry `tag`
    /// and exactly `buf.len()` elements of this type (see [`Self::send`]).
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize, tag: u32) -> Result<()> {
        let (fp, seg) = self.p2p_start::<T>("recv", peer, tag, buf.len(), false)?;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        let plan = Plan {
            outs: vec![],
            ins: algo::frames(bytes.len(), seg)
                .map(|(j, r)| In::segment(peer, j, r, Land::Copy))
                .collect(),
            lanes: None,
        };
        self.run_now(|e| e.stream(Channel::P2p, &fp, &plan, Data::Write(bytes), &mut NoCombine))
    }

    /// Checks `peer`, takes the next sequence number of messages sent to it (`sending`)
    /// or received from it, and returns the message's fingerprint and segment bytes.
    fn p2p_start<T: Element>(
        &self,
        what: &str,
        peer: usize,
        tag: u32,
        count: usize,
        sending: bool,
    ) -> Result<(Fingerprint, usize)> {
        let (n, r) = (self.world_size, self.rank);
        self.check(peer < n && peer != r, || {
            format!("{what}: rank {r} cannot exchange messages with rank {peer} (group of {n})")
        })?;
        let seq = {
            let mut s = self.p2p_seq.borrow_mut();
            let counter = if sending {
                &mut s.0[peer]
            } else {
                &mut s.1[peer]
            };
            *counter += 1;
            *counter - 1
        };
        let fp = Fingerprint {
            kind: OpKind::SendRecv,
            seq,
            dtype: T::DTYPE,
            op: None,
            count: count as u64,
            root: Some(tag),
            algo: Algorithm::Direct,
        };
        Ok((
            fp,
            algo::segment_bytes(self.cfg.tuning.segment_bytes, size_of::<T>()),
        ))
    }
}
