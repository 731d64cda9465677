//! `ferroccl._native`: the communicator for Python. The package `ferroccl` wraps it
//! (`python/ferroccl/__init__.py`); `_native.pyi` types it.
//!
//! One file per concept: [`errors`] (the exception classes and the one conversion
//! from `ferroccl::Error`), [`buffer`] (buffers from Python and all the binding's
//! `unsafe`), [`worker`] (the queue of operations, its threads, and the reports that
//! complete Python's futures), [`device`] (a collective on CUDA memory ordered with
//! its caller's stream), [`store`] (meeting on a framework's store), and
//! [`communicator`] (the methods Python calls). This file only registers them.

mod buffer;
mod communicator;
mod device;
mod errors;
mod store;
mod worker;

use pyo3::prelude::*;

/// A fresh random job token (64 hex digits).
#[pyfunction]
fn new_token() -> String {
    ferroccl::rendezvous::new_token()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<communicator::PyCommunicator>()?;
    m.add_class::<worker::Ticket>()?;
    m.add_class::<device::PyDeviceOp>()?;
    m.add_function(wrap_pyfunction!(new_token, m)?)?;
    m.add_function(wrap_pyfunction!(worker::shutdown, m)?)?;
    errors::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("has_cuda", device::BUILT)?;
    Ok(())
}
