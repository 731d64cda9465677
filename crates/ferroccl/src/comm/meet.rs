//! Where a rank meets its job: rank 0 serves the rendezvous store (at `MASTER_ADDR:
//! MASTER_PORT`, or on a free port published on a [`Board`]: torchrun's agent store, a
//! framework's store), and every rank learns the store's address.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::rendezvous::{Board, StoreClient, StoreServer, TorchStore};
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

/// How long a rank 0 that found its port taken spends asking who holds it.
const WHO_TIMEOUT: Duration = Duration::from_secs(2);

/// The store this rank serves (rank 0, unless someone else serves it) and the address
/// every rank joins.
pub(super) fn meet(cfg: &Config) -> Result<(Option<StoreServer>, String)> {
    let j = &cfg.job;
    if j.agent_store {
        return via_agent_store(cfg);
    }
    if j.rank != 0 || !j.serve_store {
        return Ok((None, j.master_addr.clone()));
    }
    let addr = resolve(&j.master_addr)?;
    match StoreServer::bind_job(addr, j.world_size, j.token.clone(), j.job_id.clone()) {
        Ok(server) => Ok((Some(server), j.master_addr.clone())),
        Err(e @ Error::AddrInUse { .. }) => Err(who_holds(addr, j.job_id.as_deref()).unwrap_or(e)),
        Err(e) => Err(e),
    }
}

/// The key under which rank 0 publishes ferroccl's store in torchrun's agent store:
/// per job identity, which carries torchrun's restart count, so that a restarted job
/// never reads the address of the attempt before it.
fn agent_key(cfg: &Config) -> String {
    format!(
        "ferroccl/{}/store",
        cfg.job.job_id.as_deref().unwrap_or("job")
    )
}

/// torchrun's agent holds `MASTER_ADDR:MASTER_PORT` with a PyTorch TCPStore: rank 0
/// serves ferroccl's store on a free port and publishes its address there; the other
/// ranks wait for it.
fn via_agent_store(cfg: &Config) -> Result<(Option<StoreServer>, String)> {
    let j = &cfg.job;
    let mut agent = TorchStore::connect(&j.master_addr, cfg.tuning.connect_timeout)?;
    // Reached over loopback, the agent runs on this host, and the other hosts reach it
    // by MASTER_ADDR's name (which may resolve to a loopback alias here, as Debian's
    // /etc/hosts does): serve on every interface and publish that name. Otherwise
    // serve and publish the address this host reaches the agent from.
    let local = agent.local_addr()?;
    let (bind, host) = if local.ip().is_loopback() {
        let name = j
            .master_addr
            .rsplit_once(':')
            .map_or("127.0.0.1", |(h, _)| h);
        (unspecified(local), name.to_owned())
    } else {
        let host = match local {
            SocketAddr::V4(a) => a.ip().to_string(),
            SocketAddr::V6(a) => format!("[{}]", a.ip()),
        };
        (SocketAddr::new(local.ip(), 0), host)
    };
    let hint = "did it start, and is TORCHELASTIC_USE_AGENT_STORE set alike on every rank?";
    via_board(cfg, &mut agent, bind, &host, hint)
}

/// Port 0 on every interface of `like`'s family.
fn unspecified(like: SocketAddr) -> SocketAddr {
    let any: std::net::IpAddr = match like {
        SocketAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
    };
    SocketAddr::new(any, 0)
}

/// Meets through a [`Board`]: rank 0 serves the store on every interface (port 0) and
/// publishes `advertise:port`; the others wait for that address.
pub(super) fn on_board(
    cfg: &Config,
    board: &mut dyn Board,
    advertise: &str,
) -> Result<(Option<StoreServer>, String)> {
    let bind = unspecified(SocketAddr::from(([0, 0, 0, 0], 0)));
    let hint = "did it start, and does every rank use the same store?";
    via_board(cfg, board, bind, advertise, hint)
}

/// Rank 0 serves the store at `bind` and publishes `host:port` on `board`; the others
/// wait for it there (`hint` completes the error of a rank that waited in vain).
fn via_board(
    cfg: &Config,
    board: &mut dyn Board,
    bind: SocketAddr,
    host: &str,
    hint: &str,
) -> Result<(Option<StoreServer>, String)> {
    let j = &cfg.job;
    let key = agent_key(cfg);
    if j.rank == 0 {
        let server = StoreServer::bind_job(bind, j.world_size, j.token.clone(), j.job_id.clone())?;
        let addr = format!("{host}:{}", server.local_addr().port());
        board.set(&key, addr.as_bytes())?;
        tracing::debug!(store = %addr, ?key, "published the store on the board");
        Ok((Some(server), addr))
    } else {
        let value = board
            .wait_get(&key, cfg.tuning.connect_timeout)
            .map_err(|e| match e {
                Error::Rendezvous(m) => Error::Rendezvous(format!(
                    "{m}: rank 0 did not publish ferroccl's store ({hint})"
                )),
                e => e,
            })?;
        let addr = String::from_utf8(value).map_err(|_| {
            Error::Rendezvous(format!(
                "key '{key}' on the rendezvous board is not an address"
            ))
        })?;
        Ok((None, addr))
    }
}

/// Asks whatever holds `addr` which job's store it is: [`Error::OtherJob`] when it is
/// another named job's ferroccl store; `None` (keep the bind error) otherwise.
fn who_holds(addr: SocketAddr, ours: Option<&str>) -> Option<Error> {
    let mut c = StoreClient::connect(&addr.to_string(), WHO_TIMEOUT).ok()?;
    let theirs = c.who_within(WHO_TIMEOUT).ok()??;
    if ours == Some(theirs.as_str()) {
        // Our own job's store: a second rank 0 of this job; the bind error says it.
        return None;
    }
    Some(Error::OtherJob {
        addr: addr.to_string(),
        theirs,
        ours: ours
            .unwrap_or("a job its launcher gave no identity")
            .to_owned(),
    })
}

pub(super) fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::Config(format!("cannot resolve master address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("master address {addr:?} resolves to nothing")))
}
