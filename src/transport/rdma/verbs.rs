//! The RDMA transport over ibverbs (feature `rdma`): device discovery and the typed
//! errors for machines without RDMA.
//!
//! Status: [`probe`] and the no-device errors are real and tested. The queue-pair
//! driver (protection domain, completion queue, one RC queue pair per link, ring and
//! bounce registration, connection data through the rendezvous store, and a
//! [`super::QueuePair`] over them) is not written yet: where a device exists,
//! [`endpoint`] says so with [`Error::Unavailable`] rather than pretend. The protocol it
//! will drive ([`super::proto`], [`super::RdmaLink`]) is the one the simulated queue
//! pair tests.

use super::proto::Params;
use crate::error::{Error, Result};
use crate::rendezvous::StoreClient;
use crate::transport::Links;

/// What a rank needs to set up its RDMA links.
pub struct VerbsCtx {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// The job's communicator id (from the store).
    pub comm_id: u64,
    /// The rendezvous store, for exchanging connection data.
    pub store: StoreClient,
    /// Ring shape of every link.
    pub params: Params,
}

/// The error for "no RDMA device on this machine", with the reason verbs gave.
fn no_device(why: String) -> Error {
    Error::Unavailable {
        what: "transport rdma".into(),
        why: format!("no RDMA device found ({why})"),
    }
}

/// Turns the outcome of `ibv_get_device_list` into a device count or the typed error:
/// a failure (`ENOSYS` where the kernel has no RDMA support) and an empty list both
/// mean no device.
pub fn classify(list: std::io::Result<usize>) -> Result<usize> {
    match list {
        Err(e) => Err(no_device(format!("ibv_get_device_list: {e}"))),
        Ok(0) => Err(no_device(
            "ibv_get_device_list returned an empty list".into(),
        )),
        Ok(n) => Ok(n),
    }
}

/// Lists the RDMA devices and opens the first, returning its name.
///
/// Wraps `ibv_get_device_list(3)` and `ibv_open_device(3)`.
pub fn probe() -> Result<String> {
    let list = match ibverbs::devices() {
        Ok(l) => l,
        Err(e) => return classify(Err(e)).map(|_| String::new()),
    };
    classify(Ok(list.len()))?;
    let dev = list
        .get(0)
        .ok_or_else(|| no_device("ibv_get_device_list returned an empty list".into()))?;
    let name = dev
        .name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "an unnamed device".into());
    dev.open()
        .map_err(|e| Error::io(format!("opening RDMA device {name}"), e))?;
    Ok(name)
}

/// The links of one rank over RDMA. Not written yet: returns why (see the module docs).
pub fn endpoint(ctx: VerbsCtx) -> Result<Links> {
    let name = probe()?;
    ctx.params.validate().map_err(Error::Config)?;
    Err(Error::Unavailable {
        what: "transport rdma".into(),
        why: format!(
            "RDMA device {name} found, but the verbs queue-pair driver is not implemented in \
             this build (rank {} of {}); the protocol runs over the simulated queue pair only",
            ctx.rank, ctx.world_size
        ),
    })
}
