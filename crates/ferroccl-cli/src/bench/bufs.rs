//! One rank's send and receive buffers, and each collective's out-of-place and
//! in-place forms on them.

use super::check::fill;
use super::Coll;
use ferroccl::{Communicator, Element, ReduceOp};

/// Buffers of one rank: `send` holds this rank's input for the largest size.
pub(super) struct Bufs<T> {
    pub(super) send: Vec<T>,
    pub(super) recv: Vec<T>,
}

impl<T: Element> Bufs<T> {
    /// Sets up the input of `coll` for `count` elements (whole-buffer count).
    pub(super) fn prepare(
        &mut self,
        coll: Coll,
        op: ReduceOp,
        n: usize,
        rank: usize,
        count: usize,
    ) {
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
    pub(super) fn out_of_place(
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
    pub(super) fn reset_in_place(&mut self, coll: Coll, n: usize, rank: usize, count: usize) {
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
    pub(super) fn in_place(
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
    pub(super) fn in_place_result(
        &self,
        coll: Coll,
        n: usize,
        rank: usize,
        count: usize,
    ) -> Vec<T> {
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
