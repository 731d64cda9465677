//! Who am I, and where are my peers.
//!
//! [`detect_env`] reads the launcher's environment (torchrun, Slurm, Open MPI, PMI); this
//! module is the only place in the crate that reads environment variables. The
//! [`StoreServer`] is a small TCP key-value store that rank 0 serves at
//! `MASTER_ADDR:MASTER_PORT`; every rank joins it with a [`StoreClient`], publishes its
//! listening address and looks up its peers'.

use crate::error::{Error, Result};
use std::net::SocketAddr;
use std::time::Duration;

/// What the launcher told this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank among the processes on this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// `MASTER_ADDR`, when set.
    pub master_addr: Option<String>,
    /// `MASTER_PORT`, when set.
    pub master_port: Option<u16>,
    /// Which launcher the variables came from: `torchrun`, `openmpi`, `pmi`, `slurm`.
    pub source: &'static str,
}

/// Reads the launcher environment of this process; `Ok(None)` when no launcher set one.
pub fn detect_env() -> Result<Option<LaunchEnv>> {
    detect_from(|k| std::env::var(k).ok())
}

/// [`detect_env`] over any variable lookup (for tests).
pub fn detect_from(_get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
    Err(Error::Env("not yet implemented".into()))
}

/// The rank-0 key-value store. Dropping it stops serving.
pub struct StoreServer {
    addr: SocketAddr,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and serves a job of `world_size` ranks.
    pub fn bind(addr: SocketAddr, _world_size: usize) -> Result<Self> {
        Err(Error::Rendezvous(format!(
            "store at {addr} not yet implemented"
        )))
    }
    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// A connection to the store.
pub struct StoreClient {
    local: SocketAddr,
}

impl StoreClient {
    /// Connects to `addr` (`host:port`), retrying until `deadline` passes.
    pub fn connect(addr: &str, _deadline: Duration) -> Result<Self> {
        Err(Error::Rendezvous(format!(
            "store client to {addr} not yet implemented"
        )))
    }
    /// Joins as `rank` of `world_size`; returns the communicator id of the job.
    pub fn join(&mut self, _rank: usize, _world_size: usize) -> Result<u64> {
        Err(Error::Rendezvous("not yet implemented".into()))
    }
    /// Publishes `value` under `key`.
    pub fn set(&mut self, _key: &str, _value: &[u8]) -> Result<()> {
        Err(Error::Rendezvous("not yet implemented".into()))
    }
    /// Returns the value of `key`, waiting up to `timeout` for some rank to set it.
    pub fn get(&mut self, _key: &str, _timeout: Duration) -> Result<Vec<u8>> {
        Err(Error::Rendezvous("not yet implemented".into()))
    }
    /// The local address of the connection: the interface through which this host
    /// reaches the store, and so the one to publish for peers.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}
