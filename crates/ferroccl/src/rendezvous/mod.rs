//! Who am I, and where are my peers.
//!
//! [`detect_env`] reads the launcher's environment (torchrun, Slurm, Open MPI, PMI); this
//! module is the only place in the crate that reads launcher variables (the CUDA layer
//! reads where the CUDA headers are, `FERROCCL_CUDA_INCLUDE`, and nothing else does). The
//! [`StoreServer`] is a small TCP key-value store that rank 0 serves at
//! `MASTER_ADDR:MASTER_PORT`; every rank joins it with a [`StoreClient`], publishes its
//! listening address and looks up its peers'.
//!
//! # Wire protocol (version 1)
//!
//! Every message, both ways, is one frame: a 12-byte header then a body. Integers are
//! little-endian.
//!
//! ```text
//! offset  size  field
//!      0     4  magic, the bytes "FCRV"
//!      4     2  protocol version (1)
//!      6     1  kind (below)
//!      7     1  reserved, must be 0
//!      8     4  body length in bytes
//!     12     *  body
//! ```
//!
//! | kind   | direction | body                                                   |
//! |--------|-----------|--------------------------------------------------------|
//! | `0x01` JOIN   | request | rank `u64`, world size `u64`, job identity (UTF-8, the rest; may be empty) |
//! | `0x02` SET    | request | key length `u32`, key (UTF-8), value (the rest)  |
//! | `0x03` GET    | request | key length `u32`, key, timeout in ms `u64`       |
//! | `0x04` ADD    | request | key length `u32`, key, delta `i64`               |
//! | `0x05` AUTH   | request | the client's nonce (16 bytes), when the job has a token |
//! | `0x06` PROOF  | request | the client's HMAC over the exchange (32 bytes)   |
//! | `0x07` TIME   | request | empty; answered with COUNT, the store's clock in ns |
//! | `0x08` WHO    | request | empty; answered with VALUE, the store's job identity (also before authentication) |
//! | `0x81` JOINED | reply   | communicator id `u64`                            |
//! | `0x82` DONE   | reply   | empty (answers SET)                              |
//! | `0x83` VALUE  | reply   | the value (answers GET)                          |
//! | `0x84` COUNT  | reply   | new counter value `i64` (answers ADD)            |
//! | `0x85` CHALLENGE | reply | the server's nonce and HMAC (answers AUTH)      |
//! | `0xFF` ERROR  | reply   | error code `u8`, message (UTF-8, the rest)       |
//!
//! Each body length is checked against the largest body its kind can have before
//! anything is allocated; keys are at most [`MAX_KEY_LEN`] bytes and values at most
//! [`MAX_VALUE_LEN`]. A peer with the wrong magic or version, an unknown kind, an
//! oversized or malformed frame gets an ERROR frame (when it can still be written) and
//! its connection is closed; everyone else is served on.
//!
//! ADD keeps its counter in the same key space as SET, as decimal ASCII, so a GET of a
//! counter returns e.g. `b"3"`.
//!
//! # Layout
//!
//! A JOIN that names a job other than the store's is refused (ERROR code 10, "other
//! job"): two jobs given one `MASTER_PORT` fail at once, each naming the other.
//!
//! `env.rs` reads the launcher environment; `hosts.rs` trades which host each rank is on; `proto.rs` is the wire protocol above, pure
//! encoding and decoding; `server.rs` is the [`StoreServer`] and `client.rs` the
//! [`StoreClient`]; `auth.rs` is the job-token challenge-response that both of them, and
//! the TCP transport between ranks, use; `torch.rs` is a client of PyTorch's
//! `TCPStore`, for torchrun's agent store. A store with a token answers an unauthenticated
//! request with ERROR code 9 (unauthorized).

pub(crate) mod auth;
mod client;
mod env;
pub(crate) mod hosts;
mod proto;
mod server;
mod torch;

pub use client::StoreClient;
pub use env::{detect_env, detect_from, LaunchEnv};
pub use proto::{MAX_JOB_ID_LEN, MAX_KEY_LEN, MAX_VALUE_LEN};
pub use server::StoreServer;
pub use torch::{TorchProtocol, TorchStore};

use crate::error::Result;
use std::time::Duration;

/// A key-value store outside ferroccl that every rank of a job reaches: torchrun's
/// agent store ([`TorchStore`]), or the store a framework hands its backend (the
/// `torch.distributed` store that `ferroccl.torch` is given). Rank 0 serves
/// ferroccl's own store on a free port and publishes its address on the board; the
/// others wait for it there ([`crate::Communicator::init_on_board`]). Nothing else
/// travels through it.
pub trait Board {
    /// Sets `key` to `value`.
    fn set(&mut self, key: &str, value: &[u8]) -> Result<()>;
    /// Waits until `key` is set, at most `timeout`, and returns its value; a
    /// [`crate::Error::Rendezvous`] naming the key when it is not set in time.
    fn wait_get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
}

impl Board for TorchStore {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        TorchStore::set(self, key, value)
    }
    fn wait_get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        TorchStore::wait_get(self, key, timeout)
    }
}

/// A fresh random job token (32 bytes from the operating system, as 64 hex digits), for
/// a launcher to hand every rank of one job as `FERROCCL_TOKEN` ([`crate::config::Job::token`]).
pub fn new_token() -> String {
    let (a, b) = (auth::nonce(), auth::nonce());
    a.iter()
        .chain(b.iter())
        .map(|x| format!("{x:02x}"))
        .collect()
}
