//! Meeting on a framework's key-value store: the store `torch.distributed` hands its
//! backend, as a [`Board`], and the configuration of a rank that was told its rank and
//! world size.

use ferroccl::rendezvous::Board;
use ferroccl::{Config, Error};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDelta, PyList};
use std::time::Duration;

/// The store `torch.distributed` hands its backend (any object with `set(key, bytes)`,
/// `get(key) -> bytes` and `wait([key], timedelta)`), as a [`Board`].
pub(crate) struct PyBoard {
    pub(crate) store: Py<PyAny>,
}

impl Board for PyBoard {
    fn set(&mut self, key: &str, value: &[u8]) -> ferroccl::Result<()> {
        Python::attach(|py| {
            self.store
                .call_method1(py, "set", (key, PyBytes::new(py, value)))
                .map(drop)
                .map_err(|e| Error::Rendezvous(format!("setting {key:?} on the store: {e}")))
        })
    }

    fn wait_get(&mut self, key: &str, timeout: Duration) -> ferroccl::Result<Vec<u8>> {
        Python::attach(|py| {
            let delta = PyDelta::new(
                py,
                0,
                i32::try_from(timeout.as_secs()).unwrap_or(i32::MAX),
                timeout.subsec_micros() as i32,
                true,
            )
            .map_err(|e| Error::Rendezvous(e.to_string()))?;
            let keys = PyList::new(py, [key]).map_err(|e| Error::Rendezvous(e.to_string()))?;
            self.store
                .call_method1(py, "wait", (keys, delta))
                .map_err(|e| {
                    Error::Rendezvous(format!("waiting {timeout:?} for {key:?} on the store: {e}"))
                })?;
            self.store
                .call_method1(py, "get", (key,))
                .and_then(|v| v.extract::<Vec<u8>>(py))
                .map_err(|e| Error::Rendezvous(format!("reading {key:?} from the store: {e}")))
        })
    }
}

/// The configuration of rank `rank` of `world_size`, as the framework told it: the
/// `FERROCCL_*` settings and the launcher's identity come from the environment
/// ([`Config::from_lookup`]), but another launcher family's rank variables would take
/// precedence over the values given, so they are hidden.
pub(crate) fn config_for(rank: usize, world_size: usize) -> ferroccl::Result<Config> {
    Config::from_lookup(move |k: &str| match k {
        "RANK" => Some(rank.to_string()),
        "WORLD_SIZE" => Some(world_size.to_string()),
        k if k.starts_with("OMPI_COMM_WORLD_")
            || k.starts_with("PMI_")
            || k.starts_with("SLURM_")
            || k == "MPI_LOCALRANKID" =>
        {
            None
        }
        k => std::env::var(k).ok(),
    })
}
