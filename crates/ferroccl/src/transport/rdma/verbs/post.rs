//! Pure translations between the protocol and verbs: a [`WorkRequest`] into the
//! numbers of one `ibv_post_send`/`ibv_post_recv` ([`plan`]), a work completion into a
//! [`Completion`] ([`completion`]), and the attributes of the INIT → RTR → RTS
//! transitions ([`init_attr`], [`rtr_attr`], [`rts_attr`]). No verbs call happens here,
//! so all of it is tested without hardware; `driver` only copies these numbers into
//! the C structures and makes the calls.

use super::record::ConnRecord;
use crate::transport::rdma::proto::{Completion, Params, WorkRequest};
use ibverbs_sys as ffi;

/// The port every queue pair uses.
pub const PORT: u8 = 1;
/// `min_rnr_timer` (code 12 = 0.64 ms): receive requests never run out under the
/// protocol, so an RNR NAK means a peer that is behind, not one that is gone.
pub const MIN_RNR_TIMER: u8 = 12;
/// Local ACK timeout, 4.096 µs · 2^18 ≈ 1.07 s per try (NCCL's `NCCL_IB_TIMEOUT` is
/// 18 on older releases, 20 on newer).
pub const TIMEOUT: u8 = 18;
/// Transport retries before a write fails with "retry exceeded" (the maximum).
pub const RETRY_CNT: u8 = 7;
/// RNR retries; 7 means "retry forever" in the verbs encoding.
pub const RNR_RETRY: u8 = 7;

/// Where this end's registered memory is, and how to reach the peer's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Regions {
    /// Ring shape of the link.
    pub params: Params,
    /// Local bounce buffer (`ring_bytes`).
    pub bounce_addr: u64,
    /// Local key of the bounce buffer (and of the credit source word after it).
    pub bounce_lkey: u32,
    /// The local 8-byte word a credit write is sent from.
    pub credit_src_addr: u64,
    /// The peer's ring.
    pub peer_ring_addr: u64,
    /// Remote key of the peer's ring.
    pub peer_ring_rkey: u32,
    /// The peer's credit word.
    pub peer_credit_addr: u64,
    /// Remote key of the peer's credit word.
    pub peer_credit_rkey: u32,
}

impl Regions {
    /// The local part of `Regions` and the peer's from its connection record.
    pub fn new(
        params: Params,
        bounce_addr: u64,
        bounce_lkey: u32,
        credit_src_addr: u64,
        peer: &ConnRecord,
    ) -> Self {
        Regions {
            params,
            bounce_addr,
            bounce_lkey,
            credit_src_addr,
            peer_ring_addr: peer.ring_addr,
            peer_ring_rkey: peer.ring_rkey,
            peer_credit_addr: peer.credit_addr,
            peer_credit_rkey: peer.credit_rkey,
        }
    }
}

/// One RDMA write, as the numbers `ibv_post_send` needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendPost {
    /// Identifies the completion.
    pub wr_id: u64,
    /// `IBV_WR_RDMA_WRITE_WITH_IMM` or `IBV_WR_RDMA_WRITE`.
    pub opcode: ffi::ibv_wr_opcode::Type,
    /// Local source address, `lkey` and length (`len == 0`: no scatter entry).
    pub local_addr: u64,
    /// Local key of the source.
    pub lkey: u32,
    /// Bytes written.
    pub len: u32,
    /// Remote destination and its key.
    pub remote_addr: u64,
    /// Remote key of the destination.
    pub rkey: u32,
    /// The immediate in network byte order, as `ibv_send_wr::imm_data` wants it.
    pub imm_be: Option<u32>,
    /// For a credit write: the value the driver stores in the credit source word
    /// before posting (at most one credit write is in flight, so the word is free).
    pub credit: Option<u64>,
}

/// What to post for one protocol work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Post {
    /// An RDMA write on the send queue (always signalled).
    Send(SendPost),
    /// A receive request with no scatter list.
    Recv {
        /// Identifies the receive completion.
        wr_id: u64,
    },
}

/// Translates `wr` into what to post, checking that every byte it touches lies in
/// the registered memory (the protocol's own invariants make a failure here a bug,
/// but a bug must not become a wild DMA).
pub fn plan(wr: &WorkRequest, r: &Regions) -> Result<Post, String> {
    let b = r.params.slot_bytes as u64;
    Ok(match *wr {
        WorkRequest::WriteData {
            wr_id,
            slot,
            len,
            imm,
        } => {
            if slot >= r.params.slots || len == 0 || len > r.params.slot_bytes {
                return Err(format!(
                    "write of {len} bytes at slot {slot} is outside the registered ring \
                     ({} slots of {} bytes)",
                    r.params.slots, r.params.slot_bytes
                ));
            }
            let off = slot as u64 * b;
            Post::Send(SendPost {
                wr_id,
                opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
                local_addr: r.bounce_addr + off,
                lkey: r.bounce_lkey,
                len: len as u32,
                remote_addr: r.peer_ring_addr + off,
                rkey: r.peer_ring_rkey,
                imm_be: Some(imm.to_be()),
                credit: None,
            })
        }
        WorkRequest::WriteCredit { wr_id, freed } => Post::Send(SendPost {
            wr_id,
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            local_addr: r.credit_src_addr,
            lkey: r.bounce_lkey,
            len: 8,
            remote_addr: r.peer_credit_addr,
            rkey: r.peer_credit_rkey,
            imm_be: None,
            credit: Some(freed),
        }),
        WorkRequest::WriteClose { wr_id, imm } => Post::Send(SendPost {
            wr_id,
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            local_addr: 0,
            lkey: 0,
            len: 0,
            // A zero-length write names no remote bytes; the ring's address and key
            // are valid anyway.
            remote_addr: r.peer_ring_addr,
            rkey: r.peer_ring_rkey,
            imm_be: Some(imm.to_be()),
            credit: None,
        }),
        WorkRequest::PostRecv { wr_id } => Post::Recv { wr_id },
    })
}

/// What a failed work completion's status means, and whether it says the peer is
/// gone or unreachable (the link ends, data already received can still be read)
/// rather than a fault at this end or a bug (the link fails).
pub fn explain(status: ffi::ibv_wc_status::Type) -> (&'static str, bool) {
    use ffi::ibv_wc_status::*;
    match status {
        IBV_WC_RETRY_EXC_ERR => (
            "transport retry counter exceeded: the peer stopped acknowledging \
             (its process exited, its queue pair was destroyed, or the fabric path is down)",
            true,
        ),
        IBV_WC_RNR_RETRY_EXC_ERR => (
            "RNR retry counter exceeded: the peer had no receive request posted \
             (its queue pair is gone or stuck)",
            true,
        ),
        IBV_WC_WR_FLUSH_ERR => (
            "work request flushed: the queue pair had already entered the error state",
            true,
        ),
        IBV_WC_REM_ACCESS_ERR => (
            "remote access error: the peer refused the write (wrong rkey or address, \
             or memory outside its registered ring)",
            false,
        ),
        IBV_WC_REM_INV_REQ_ERR => (
            "remote invalid request: the peer's queue pair does not accept this operation",
            false,
        ),
        IBV_WC_REM_OP_ERR => (
            "remote operation error: the peer's queue pair failed while executing the write",
            false,
        ),
        IBV_WC_LOC_LEN_ERR => ("local length error", false),
        IBV_WC_LOC_QP_OP_ERR => ("local queue pair operation error", false),
        IBV_WC_LOC_PROT_ERR => (
            "local protection error: a scatter entry is outside its memory region",
            false,
        ),
        IBV_WC_LOC_ACCESS_ERR => ("local access error", false),
        IBV_WC_BAD_RESP_ERR => ("bad response from the peer", false),
        IBV_WC_FATAL_ERR => ("fatal device error", false),
        IBV_WC_RESP_TIMEOUT_ERR => ("response timeout", false),
        IBV_WC_GENERAL_ERR => ("general error", false),
        _ => ("unexpected work completion status", false),
    }
}

/// The fields of one `ibv_wc` the protocol cares about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wc {
    /// The work request's identifier.
    pub wr_id: u64,
    /// `None` for success, else the status and the vendor syndrome.
    pub error: Option<(ffi::ibv_wc_status::Type, u32)>,
    /// The completion's opcode (meaningful on success only).
    pub opcode: ffi::ibv_wc_opcode::Type,
    /// The immediate as received (network byte order), if the completion has one.
    pub imm_be: Option<u32>,
}

/// Turns a polled work completion into what the protocol understands.
pub fn completion(wc: Wc) -> Completion {
    use ffi::ibv_wc_opcode::*;
    if let Some((status, vendor)) = wc.error {
        let (text, peer_lost) = explain(status);
        return Completion::Failed {
            wr_id: wc.wr_id,
            status: format!("{text} (ibv_wc_status {status}, vendor syndrome {vendor:#x})"),
            peer_lost,
        };
    }
    match (wc.opcode, wc.imm_be) {
        (IBV_WC_RECV_RDMA_WITH_IMM, Some(imm)) => Completion::Received {
            imm: u32::from_be(imm),
        },
        (IBV_WC_RDMA_WRITE, _) => Completion::Sent { wr_id: wc.wr_id },
        (op, imm) => Completion::Failed {
            wr_id: wc.wr_id,
            status: format!(
                "unexpected completion (opcode {op}, immediate {imm:?}): \
                 this link only posts RDMA writes and immediate-carrying receives"
            ),
            peer_lost: false,
        },
    }
}

/// RESET → INIT: the port, and remote write access to this end's memory.
pub fn init_attr() -> (ffi::ibv_qp_attr, ffi::ibv_qp_attr_mask) {
    use ffi::ibv_qp_attr_mask as m;
    let a = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
        pkey_index: 0,
        port_num: PORT,
        qp_access_flags: (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0,
        ..Default::default()
    };
    (
        a,
        m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS,
    )
}

/// INIT → RTR: the peer's address (LID on InfiniBand, GID on RoCE), queue pair number
/// and first PSN, and the smaller of the two ports' MTUs.
pub fn rtr_attr(
    local: &ConnRecord,
    peer: &ConnRecord,
    gid_index: u8,
) -> (ffi::ibv_qp_attr, ffi::ibv_qp_attr_mask) {
    use ffi::ibv_qp_attr_mask as m;
    let mut a = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
        path_mtu: ffi::ibv_mtu::from(local.mtu.min(peer.mtu)),
        dest_qp_num: peer.qpn,
        rq_psn: peer.psn,
        max_dest_rd_atomic: 1,
        min_rnr_timer: MIN_RNR_TIMER,
        ..Default::default()
    };
    a.ah_attr.dlid = peer.lid;
    a.ah_attr.sl = 0;
    a.ah_attr.src_path_bits = 0;
    a.ah_attr.port_num = PORT;
    if local.link_layer == ffi::IBV_LINK_LAYER_ETHERNET as u8 {
        // RoCE has no LIDs: route by GID through a global routing header.
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid.raw = peer.gid;
        a.ah_attr.grh.sgid_index = gid_index;
        a.ah_attr.grh.hop_limit = 255;
        a.ah_attr.grh.flow_label = 0;
        a.ah_attr.grh.traffic_class = 0;
    }
    (
        a,
        m::IBV_QP_STATE
            | m::IBV_QP_AV
            | m::IBV_QP_PATH_MTU
            | m::IBV_QP_DEST_QPN
            | m::IBV_QP_RQ_PSN
            | m::IBV_QP_MAX_DEST_RD_ATOMIC
            | m::IBV_QP_MIN_RNR_TIMER,
    )
}

/// RTR → RTS: this end's first PSN and the retry policy.
pub fn rts_attr(local: &ConnRecord) -> (ffi::ibv_qp_attr, ffi::ibv_qp_attr_mask) {
    use ffi::ibv_qp_attr_mask as m;
    let a = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
        sq_psn: local.psn,
        timeout: TIMEOUT,
        retry_cnt: RETRY_CNT,
        rnr_retry: RNR_RETRY,
        max_rd_atomic: 1,
        ..Default::default()
    };
    (
        a,
        m::IBV_QP_STATE
            | m::IBV_QP_SQ_PSN
            | m::IBV_QP_TIMEOUT
            | m::IBV_QP_RETRY_CNT
            | m::IBV_QP_RNR_RETRY
            | m::IBV_QP_MAX_QP_RD_ATOMIC,
    )
}

#[cfg(test)]
mod tests {
    use super::super::record::LinkId;
    use super::*;
    use crate::transport::rdma::proto::{close_imm, encode_imm};

    fn params() -> Params {
        Params {
            slots: 4,
            slot_bytes: 1024,
            credit_batch: 2,
        }
    }

    fn regions() -> Regions {
        Regions {
            params: params(),
            bounce_addr: 0x10_0000,
            bounce_lkey: 11,
            credit_src_addr: 0x10_1000,
            peer_ring_addr: 0x20_0000,
            peer_ring_rkey: 22,
            peer_credit_addr: 0x20_1000,
            peer_credit_rkey: 33,
        }
    }

    fn record(link_layer: u8, mtu: u8) -> ConnRecord {
        ConnRecord {
            link: LinkId {
                comm_id: 1,
                from: 0,
                to: 1,
                channel: 0,
            },
            link_layer,
            lid: 7,
            mtu,
            gid: [9; 16],
            qpn: 0x42,
            psn: 0x1234,
            ring_addr: 0,
            ring_rkey: 0,
            credit_addr: 0,
            credit_rkey: 0,
            params: params(),
        }
    }

    #[test]
    fn data_writes_go_slot_to_slot_with_the_immediate_in_network_order() {
        let imm = encode_imm(6, 100);
        let wr = WorkRequest::WriteData {
            wr_id: 5,
            slot: 2,
            len: 100,
            imm,
        };
        let Post::Send(p) = plan(&wr, &regions()).unwrap() else {
            panic!("expected a send")
        };
        assert_eq!(p.opcode, ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM);
        assert_eq!((p.local_addr, p.lkey, p.len), (0x10_0000 + 2048, 11, 100));
        assert_eq!((p.remote_addr, p.rkey), (0x20_0000 + 2048, 22));
        assert_eq!(p.imm_be, Some(imm.to_be()));
        assert_eq!(p.credit, None);
        assert_eq!(p.wr_id, 5);
    }

    #[test]
    fn writes_outside_the_ring_are_refused() {
        for (slot, len) in [(4, 1), (0, 0), (0, 1025), (usize::MAX, 1)] {
            let wr = WorkRequest::WriteData {
                wr_id: 0,
                slot,
                len,
                imm: 0,
            };
            let e = plan(&wr, &regions()).unwrap_err();
            assert!(e.contains("outside the registered ring"), "{e}");
        }
        let last = WorkRequest::WriteData {
            wr_id: 0,
            slot: 3,
            len: 1024,
            imm: 0,
        };
        let Ok(Post::Send(p)) = plan(&last, &regions()) else {
            panic!("the last full slot is inside the ring")
        };
        assert_eq!(p.local_addr + p.len as u64, 0x10_0000 + 4096);
    }

    #[test]
    fn credits_close_and_receives() {
        let r = regions();
        let Ok(Post::Send(c)) = plan(
            &WorkRequest::WriteCredit {
                wr_id: 9,
                freed: 77,
            },
            &r,
        ) else {
            panic!("expected a send")
        };
        assert_eq!(c.opcode, ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE);
        assert_eq!((c.local_addr, c.len, c.credit), (0x10_1000, 8, Some(77)));
        assert_eq!((c.remote_addr, c.rkey, c.imm_be), (0x20_1000, 33, None));
        let Ok(Post::Send(z)) = plan(
            &WorkRequest::WriteClose {
                wr_id: 3,
                imm: close_imm(),
            },
            &r,
        ) else {
            panic!("expected a send")
        };
        assert_eq!(z.len, 0);
        assert_eq!(z.imm_be, Some(close_imm().to_be()));
        assert_eq!(
            plan(&WorkRequest::PostRecv { wr_id: 8 }, &r),
            Ok(Post::Recv { wr_id: 8 })
        );
    }

    fn ok(wr_id: u64, opcode: ffi::ibv_wc_opcode::Type, imm_be: Option<u32>) -> Wc {
        Wc {
            wr_id,
            error: None,
            opcode,
            imm_be,
        }
    }

    #[test]
    fn successful_completions() {
        use ffi::ibv_wc_opcode::*;
        assert_eq!(
            completion(ok(4, IBV_WC_RDMA_WRITE, None)),
            Completion::Sent { wr_id: 4 }
        );
        let imm = encode_imm(1, 10);
        assert_eq!(
            completion(ok(0, IBV_WC_RECV_RDMA_WITH_IMM, Some(imm.to_be()))),
            Completion::Received { imm }
        );
        for c in [
            ok(1, IBV_WC_RECV_RDMA_WITH_IMM, None),
            ok(1, IBV_WC_RECV, None),
            ok(1, IBV_WC_RDMA_READ, None),
        ] {
            assert!(
                matches!(completion(c), Completion::Failed { peer_lost: false, ref status, .. } if status.contains("unexpected completion")),
                "{c:?}"
            );
        }
    }

    #[test]
    fn failed_completions_say_what_and_whether_the_peer_is_gone() {
        use ffi::ibv_wc_status::*;
        let fail = |status| {
            completion(Wc {
                wr_id: 12,
                error: Some((status, 0x81)),
                opcode: 0,
                imm_be: None,
            })
        };
        for (status, lost, words) in [
            (IBV_WC_RETRY_EXC_ERR, true, "retry counter exceeded"),
            (IBV_WC_RNR_RETRY_EXC_ERR, true, "RNR retry"),
            (IBV_WC_WR_FLUSH_ERR, true, "flushed"),
            (IBV_WC_REM_ACCESS_ERR, false, "remote access error"),
            (IBV_WC_LOC_PROT_ERR, false, "local protection error"),
            (IBV_WC_FATAL_ERR, false, "fatal"),
            (999, false, "unexpected work completion status"),
        ] {
            match fail(status) {
                Completion::Failed {
                    wr_id,
                    status: text,
                    peer_lost,
                } => {
                    assert_eq!(wr_id, 12);
                    assert_eq!(peer_lost, lost, "{text}");
                    assert!(text.contains(words), "{text}");
                    assert!(text.contains(&format!("ibv_wc_status {status}")), "{text}");
                    assert!(text.contains("0x81"), "{text}");
                }
                other => panic!("expected a failure, got {other:?}"),
            }
        }
    }

    #[test]
    fn transitions_carry_the_peer_and_the_retry_policy() {
        use ffi::ibv_qp_attr_mask as m;
        let (a, mask) = init_attr();
        assert_eq!(a.qp_state, ffi::ibv_qp_state::IBV_QPS_INIT);
        assert_eq!(a.port_num, PORT);
        assert_eq!(
            a.qp_access_flags,
            (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
                .0
        );
        assert_eq!((mask & m::IBV_QP_ACCESS_FLAGS).0, m::IBV_QP_ACCESS_FLAGS.0);

        let ib = ffi::IBV_LINK_LAYER_INFINIBAND as u8;
        let (local, peer) = (
            record(ib, 5),
            ConnRecord {
                mtu: 3,
                ..record(ib, 3)
            },
        );
        let (a, mask) = rtr_attr(&local, &peer, 0);
        assert_eq!(a.qp_state, ffi::ibv_qp_state::IBV_QPS_RTR);
        assert_eq!(a.path_mtu, ffi::IBV_MTU_1024, "the smaller MTU");
        assert_eq!((a.dest_qp_num, a.rq_psn), (0x42, 0x1234));
        assert_eq!((a.ah_attr.dlid, a.ah_attr.is_global), (7, 0));
        assert_eq!(a.min_rnr_timer, MIN_RNR_TIMER);
        assert_eq!((mask & m::IBV_QP_AV).0, m::IBV_QP_AV.0);

        let eth = ffi::IBV_LINK_LAYER_ETHERNET as u8;
        let (a, _) = rtr_attr(&record(eth, 4), &record(eth, 4), 3);
        assert_eq!(a.ah_attr.is_global, 1);
        assert_eq!(a.ah_attr.grh.sgid_index, 3);
        // SAFETY: `raw` is the only way this union is written.
        assert_eq!(unsafe { a.ah_attr.grh.dgid.raw }, [9; 16]);

        let (a, mask) = rts_attr(&local);
        assert_eq!(a.qp_state, ffi::ibv_qp_state::IBV_QPS_RTS);
        assert_eq!(a.sq_psn, 0x1234);
        assert_eq!((a.timeout, a.retry_cnt, a.rnr_retry), (18, 7, 7));
        assert_eq!((mask & m::IBV_QP_SQ_PSN).0, m::IBV_QP_SQ_PSN.0);
    }
}
