//! The connection record: what one end of a link publishes in the rendezvous store so
//! the other end can bring its queue pair to RTR and write into its memory.
//!
//! A fixed-size little-endian binary record with a magic, a version and an exact length,
//! so a stranger's value, a truncated one or one from another build is refused with a
//! [`Error::Handshake`] that names both ranks. Pure: no verbs, tested without hardware.

use crate::error::{Error, Result};
use crate::transport::rdma::proto::Params;

const MAGIC: [u8; 4] = *b"FRDM";
const VERSION: u16 = 1;
const FLAG_LITTLE_ENDIAN: u8 = 1;

/// Bytes of an encoded record.
pub const RECORD_LEN: usize = 4 + 2 + 1 + 1 // magic, version, flags, link layer
    + 8 + 4 + 4 + 4 // comm id, from, to, channel
    + 2 + 1 + 1 + 16 // lid, mtu, reserved, gid
    + 4 + 4 // qpn, psn
    + 8 + 4 + 8 + 4 // ring addr + rkey, credit addr + rkey
    + 4 + 4 + 4; // slots, slot bytes, credit batch

/// Which link a record is for: the job, the two ranks (publisher first) and the
/// channel code ([`crate::transport::Channel::code`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkId {
    /// The job's communicator id.
    pub comm_id: u64,
    /// The rank that published the record.
    pub from: u32,
    /// The rank it is meant for.
    pub to: u32,
    /// The channel code.
    pub channel: u32,
}

/// One end of a link, as its peer needs to see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnRecord {
    /// The link this end belongs to.
    pub link: LinkId,
    /// `ibv_port_attr::link_layer` (1 InfiniBand, 2 Ethernet/RoCE).
    pub link_layer: u8,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The port's active MTU as an `ibv_mtu` code (1 = 256 B .. 5 = 4096 B).
    pub mtu: u8,
    /// The GID at the configured index (needed on RoCE, where addressing is by GID).
    pub gid: [u8; 16],
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number this end sends (24 bits, random).
    pub psn: u32,
    /// Address of the receive ring, remote-writable.
    pub ring_addr: u64,
    /// Remote key of the ring.
    pub ring_rkey: u32,
    /// Address of the 8-byte credit word, remote-writable.
    pub credit_addr: u64,
    /// Remote key of the credit word.
    pub credit_rkey: u32,
    /// Ring shape (must equal the peer's).
    pub params: Params,
}

fn hs(peer: u32, detail: String) -> Error {
    Error::Handshake {
        peer: format!("rank {peer}"),
        detail,
    }
}

impl ConnRecord {
    /// The record as stored.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(RECORD_LEN);
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.push(if cfg!(target_endian = "little") {
            FLAG_LITTLE_ENDIAN
        } else {
            0
        });
        b.push(self.link_layer);
        b.extend_from_slice(&self.link.comm_id.to_le_bytes());
        b.extend_from_slice(&self.link.from.to_le_bytes());
        b.extend_from_slice(&self.link.to.to_le_bytes());
        b.extend_from_slice(&self.link.channel.to_le_bytes());
        b.extend_from_slice(&self.lid.to_le_bytes());
        b.push(self.mtu);
        b.push(0);
        b.extend_from_slice(&self.gid);
        b.extend_from_slice(&self.qpn.to_le_bytes());
        b.extend_from_slice(&self.psn.to_le_bytes());
        b.extend_from_slice(&self.ring_addr.to_le_bytes());
        b.extend_from_slice(&self.ring_rkey.to_le_bytes());
        b.extend_from_slice(&self.credit_addr.to_le_bytes());
        b.extend_from_slice(&self.credit_rkey.to_le_bytes());
        for v in [
            self.params.slots,
            self.params.slot_bytes,
            self.params.credit_batch,
        ] {
            // Params::validate bounds all three far below u32::MAX.
            b.extend_from_slice(&(v as u32).to_le_bytes());
        }
        debug_assert_eq!(b.len(), RECORD_LEN);
        b
    }

    /// Decodes the record `expect.from` published for `expect.to` and checks it
    /// against what this end expects: the same job, link and channel, the same byte
    /// order and link layer, and the same ring shape as `params`. Every refusal is an
    /// [`Error::Handshake`] naming both ranks.
    pub fn decode(bytes: &[u8], expect: LinkId, params: &Params, link_layer: u8) -> Result<Self> {
        let (me, peer) = (expect.to, expect.from);
        let bad = |what: String| {
            hs(
                peer,
                format!("rank {me} refused its connection record: {what}"),
            )
        };
        if bytes.len() != RECORD_LEN {
            return Err(bad(format!("{} bytes, expected {RECORD_LEN}", bytes.len())));
        }
        let mut r = Reader(bytes);
        if r.take::<4>() != MAGIC {
            return Err(bad("bad magic (not a ferroccl RDMA record)".into()));
        }
        let version = u16::from_le_bytes(r.take());
        if version != VERSION {
            return Err(bad(format!(
                "version {version}, this build speaks {VERSION}"
            )));
        }
        let [flags] = r.take();
        let ours = if cfg!(target_endian = "little") {
            FLAG_LITTLE_ENDIAN
        } else {
            0
        };
        if flags != ours {
            return Err(bad(
                "the peer's byte order differs from this host's (credit words are native-endian)"
                    .into(),
            ));
        }
        let [ll] = r.take();
        let link = LinkId {
            comm_id: r.u64(),
            from: r.u32(),
            to: r.u32(),
            channel: r.u32(),
        };
        if link != expect {
            return Err(bad(format!(
                "it is for {link:?}, expected {expect:?} (another job, or a mixed-up key)"
            )));
        }
        if ll != link_layer {
            return Err(bad(format!(
                "rank {peer}'s port has link layer {ll}, rank {me}'s has {link_layer} \
                 (InfiniBand and RoCE ports cannot be connected)"
            )));
        }
        let lid = u16::from_le_bytes(r.take());
        let [mtu, reserved] = r.take();
        if reserved != 0 {
            return Err(bad(format!("reserved byte is {reserved}, not 0")));
        }
        if !(1..=5).contains(&mtu) {
            return Err(bad(format!("MTU code {mtu} is not an ibv_mtu (1..=5)")));
        }
        let gid = r.take::<16>();
        let qpn = r.u32();
        let psn = r.u32();
        if qpn >> 24 != 0 || psn >> 24 != 0 {
            return Err(bad(format!(
                "queue pair number {qpn:#x} or PSN {psn:#x} does not fit in 24 bits"
            )));
        }
        let rec = ConnRecord {
            link,
            link_layer: ll,
            lid,
            mtu,
            gid,
            qpn,
            psn,
            ring_addr: r.u64(),
            ring_rkey: r.u32(),
            credit_addr: r.u64(),
            credit_rkey: r.u32(),
            params: Params {
                slots: r.u32() as usize,
                slot_bytes: r.u32() as usize,
                credit_batch: r.u32() as usize,
            },
        };
        if rec.params != *params {
            let shape = |p: &Params| {
                format!(
                    "{} slots of {} bytes, credits every {}",
                    p.slots, p.slot_bytes, p.credit_batch
                )
            };
            return Err(hs(
                peer,
                format!(
                    "ring shapes differ: rank {me} uses {}, rank {peer} uses {} \
                     (every rank must use the same RDMA parameters)",
                    shape(params),
                    shape(&rec.params)
                ),
            ));
        }
        Ok(rec)
    }
}

/// Reads fixed-size fields from a slice whose length was checked first.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let (head, rest) = self.0.split_at(N);
        self.0 = rest;
        let mut a = [0u8; N];
        a.copy_from_slice(head);
        a
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ConnRecord {
        ConnRecord {
            link: LinkId {
                comm_id: 0x0123_4567_89ab_cdef,
                from: 3,
                to: 5,
                channel: 1,
            },
            link_layer: 2,
            lid: 0x1234,
            mtu: 5,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            qpn: 0x00ab_cdef,
            psn: 0x0012_3456,
            ring_addr: 0x7f00_dead_0000,
            ring_rkey: 0xcafe,
            credit_addr: 0x7f00_beef_0040,
            credit_rkey: 0xf00d,
            params: Params::default(),
        }
    }

    fn decode(b: &[u8]) -> Result<ConnRecord> {
        let s = sample();
        ConnRecord::decode(b, s.link, &s.params, s.link_layer)
    }

    fn refusal(b: &[u8]) -> String {
        match decode(b) {
            Err(Error::Handshake { peer, detail }) => {
                assert_eq!(peer, "rank 3");
                detail
            }
            other => panic!("expected a handshake error, got {other:?}"),
        }
    }

    #[test]
    fn round_trip() {
        let b = sample().encode();
        assert_eq!(b.len(), RECORD_LEN);
        assert_eq!(decode(&b).unwrap(), sample());
    }

    #[test]
    fn wrong_lengths_are_refused() {
        let b = sample().encode();
        assert!(refusal(&b[..RECORD_LEN - 1]).contains("bytes, expected"));
        let mut long = b.clone();
        long.push(0);
        assert!(refusal(&long).contains("bytes, expected"));
        assert!(refusal(&[]).contains("bytes, expected"));
    }

    #[test]
    fn corrupt_headers_are_refused() {
        let mut b = sample().encode();
        b[0] ^= 1;
        assert!(refusal(&b).contains("magic"));
        let mut b = sample().encode();
        b[4] = 9;
        assert!(refusal(&b).contains("version 9"));
        let mut b = sample().encode();
        b[6] ^= FLAG_LITTLE_ENDIAN;
        assert!(refusal(&b).contains("byte order"));
    }

    #[test]
    fn records_for_other_links_are_refused() {
        let s = sample();
        for link in [
            LinkId {
                comm_id: 1,
                ..s.link
            },
            LinkId { from: 4, ..s.link },
            LinkId { to: 6, ..s.link },
            LinkId {
                channel: 0,
                ..s.link
            },
        ] {
            let b = ConnRecord { link, ..s }.encode();
            assert!(refusal(&b).contains("expected LinkId"), "{link:?}");
        }
    }

    #[test]
    fn mismatched_ring_shapes_name_both_ranks() {
        let s = sample();
        let other = Params {
            slots: 8,
            ..s.params
        };
        let d = refusal(&ConnRecord { params: other, ..s }.encode());
        assert!(d.contains("rank 5 uses 16 slots"), "{d}");
        assert!(d.contains("rank 3 uses 8 slots"), "{d}");
    }

    #[test]
    fn mixed_link_layers_and_bad_fields_are_refused() {
        let s = sample();
        let d = refusal(&ConnRecord { link_layer: 1, ..s }.encode());
        assert!(d.contains("link layer"), "{d}");
        assert!(refusal(&ConnRecord { mtu: 0, ..s }.encode()).contains("MTU code 0"));
        assert!(refusal(&ConnRecord { qpn: 1 << 24, ..s }.encode()).contains("24 bits"));
        assert!(refusal(&ConnRecord { psn: 1 << 24, ..s }.encode()).contains("24 bits"));
    }

    #[test]
    fn every_single_byte_corruption_is_refused_or_decodes_to_what_it_says() {
        // Flipping any byte either is refused or yields a record differing from the
        // original: nothing decodes to the original by accident, and nothing panics.
        let b = sample().encode();
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0x80;
            if let Ok(r) = decode(&c) {
                assert_ne!(r, sample(), "byte {i}");
                assert_eq!(r.encode(), c, "byte {i}");
            }
        }
    }
}
