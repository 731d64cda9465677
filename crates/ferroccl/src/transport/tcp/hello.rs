//! The hello both ends of a data connection send first: its bytes, and the refusal
//! codes a rejected dialler reads.

use super::*;

/// Protocol version carried in every handshake; bumped on any wire change.
pub const PROTOCOL_VERSION: u16 = 2;
pub(super) const HELLO_MAGIC: [u8; 4] = *b"FCCH";
pub(super) const HELLO_LEN: usize = 40;

/// The first message on a data connection, each way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version of the sender.
    pub version: u16,
    /// 0: a request or an acceptance; otherwise a refusal code.
    pub status: u16,
    /// The job's communicator id (from the store).
    pub comm_id: u64,
    /// The sender's rank.
    pub rank: u32,
    /// The sender's world size.
    pub world_size: u32,
    /// The rank the sender wants to reach (request) or answers as (reply).
    pub to_rank: u32,
    /// Which stream this connection is ([`Channel::code`]).
    pub channel: u16,
    /// [`FLAG_AUTH`]: the sender's job has a token and a proof exchange follows.
    pub flags: u16,
    /// The group the connection belongs to: 0 for the job's own links, a
    /// sub-communicator's id otherwise ([`super::GroupSpec::id`]).
    pub group: u64,
}

/// [`Hello::flags`] bit: the sender authenticates with the job token (HMAC
/// challenge-response after the hello).
pub const FLAG_AUTH: u16 = 1;

/// Refusal codes carried in [`Hello::status`].
pub(super) mod refuse {
    pub const VERSION: u16 = 1;
    pub const COMM_ID: u16 = 2;
    pub const RANK: u16 = 3;
    pub const DUPLICATE: u16 = 4;
    pub const AUTH: u16 = 5;
    pub const CLOSED: u16 = 6;

    pub fn text(code: u16) -> &'static str {
        match code {
            VERSION => "protocol version differs",
            COMM_ID => "communicator id differs (a process from another job?)",
            RANK => "rank, world size or channel not expected here",
            DUPLICATE => "this rank is already connected",
            AUTH => "job token missing or different (authentication failed)",
            CLOSED => "this rank has closed that communicator (it failed, or is gone)",
            _ => "unknown refusal",
        }
    }
}

impl Hello {
    /// Serialises the handshake.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.status.to_le_bytes());
        b[8..16].copy_from_slice(&self.comm_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.rank.to_le_bytes());
        b[20..24].copy_from_slice(&self.world_size.to_le_bytes());
        b[24..28].copy_from_slice(&self.to_rank.to_le_bytes());
        b[28..30].copy_from_slice(&self.channel.to_le_bytes());
        b[30..32].copy_from_slice(&self.flags.to_le_bytes());
        b[32..40].copy_from_slice(&self.group.to_le_bytes());
        b
    }

    /// Parses a handshake; a wrong magic number is an error (the version is checked by
    /// the caller, so it can answer with a refusal that says why).
    pub fn decode(b: &[u8; HELLO_LEN]) -> std::result::Result<Self, String> {
        if b[0..4] != HELLO_MAGIC {
            return Err(format!(
                "wrong magic number {:02x?} (expected {:02x?} \"FCCH\"): not a ferroccl peer",
                &b[0..4],
                HELLO_MAGIC
            ));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        Ok(Hello {
            version: u16_at(4),
            status: u16_at(6),
            comm_id: u64_at(8),
            rank: u32_at(16),
            world_size: u32_at(20),
            to_rank: u32_at(24),
            channel: u16_at(28),
            flags: u16_at(30),
            group: u64_at(32),
        })
    }
}

/// Reads a hello: its magic first, so that a stranger that sends a few bytes of
/// something else and hangs up is named as one (the decoder refuses the magic), not
/// as a short read.
pub(super) fn read_hello(s: &mut TcpStream, deadline: Instant) -> io::Result<[u8; HELLO_LEN]> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))?;
    let mut b = [0u8; HELLO_LEN];
    s.read_exact(&mut b[..4])?;
    if b[..4] == HELLO_MAGIC {
        s.read_exact(&mut b[4..])?;
    }
    Ok(b)
}
