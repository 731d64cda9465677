//! The exception classes, one per [`ErrorClass`], and the one conversion from
//! [`ferroccl::Error`] into them ([`to_py`]).
//!
//! [`class_of`] matches [`ErrorClass`] with no catch-all: a class added to the library
//! fails to compile here until it has an exception (and the library's
//! `Error::class` does the same for a new error variant).

use ferroccl::{Error, ErrorClass};
use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

create_exception!(
    ferroccl,
    FerrocclError,
    PyRuntimeError,
    "Any ferroccl failure."
);

/// Declares each exception class, a subclass of `FerrocclError`, and `register`,
/// which adds them all to the module: one line per class.
macro_rules! exceptions {
    ($($name:ident => $doc:literal,)*) => {
        $(create_exception!(ferroccl, $name, FerrocclError, $doc);)*

        /// Adds every exception class to the module.
        pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
            let py = m.py();
            m.add("FerrocclError", py.get_type::<FerrocclError>())?;
            $(m.add(stringify!($name), py.get_type::<$name>())?;)*
            Ok(())
        }
    };
}

exceptions! {
    InvalidArgumentError => "An argument ferroccl cannot use (sizes, ranks, roots).",
    UnsupportedError => "An operation, type or transport ferroccl does not support (here).",
    ConfigError => "A configuration or launcher environment ferroccl cannot use.",
    RendezvousError => "The ranks could not meet: the store, a port in use, another job, a handshake.",
    PeerClosedError => "A peer's connection closed (it died or aborted).",
    PeerFailedError => "Another rank failed first; `origin` names it, `cause` says why and `cause_kind` is the root cause's kind (e.g. `Io`).",
    ProtocolError => "A peer sent something that breaks the protocol.",
    MismatchError => "Ranks called different collectives (operation, size, type, root), or made a group of different members.",
    TimeoutError => "An operation made no progress within the timeout.",
    AbortedError => "The communicator was aborted.",
    PoisonedError => "The communicator failed earlier and can no longer be used.",
    CudaError => "A CUDA driver or NVRTC call failed.",
    IoError => "An I/O error outside a running collective (binding a port, connecting, a file).",
}

/// The exception of a class.
fn class_of(c: ErrorClass, msg: String) -> PyErr {
    match c {
        ErrorClass::InvalidArgument => InvalidArgumentError::new_err(msg),
        ErrorClass::Unsupported => UnsupportedError::new_err(msg),
        ErrorClass::Config => ConfigError::new_err(msg),
        ErrorClass::Rendezvous => RendezvousError::new_err(msg),
        ErrorClass::PeerClosed => PeerClosedError::new_err(msg),
        ErrorClass::PeerFailed => PeerFailedError::new_err(msg),
        ErrorClass::Protocol => ProtocolError::new_err(msg),
        ErrorClass::Mismatch => MismatchError::new_err(msg),
        ErrorClass::Timeout => TimeoutError::new_err(msg),
        ErrorClass::Aborted => AbortedError::new_err(msg),
        ErrorClass::Poisoned => PoisonedError::new_err(msg),
        ErrorClass::Cuda => CudaError::new_err(msg),
        ErrorClass::Io => IoError::new_err(msg),
    }
}

/// The Python exception for `e`, with the facts it carries as attributes (`rank`,
/// `peer`, `origin`, `cause`, `op`; `kind` is the Rust variant's name).
///
/// A rank told of another's failure gets [`Error::PeerFailed`]; when its root cause is
/// a mismatch or a timeout, its class is the root cause's (a mismatch found by rank
/// `origin` is a `MismatchError` on every rank, with `origin` and `told_by` set), so
/// that code can catch the same class on every rank.
pub(crate) fn to_py(py: Python<'_>, e: &Error) -> PyErr {
    let class = match (e.class(), e.root_cause().class()) {
        (ErrorClass::PeerFailed, root @ (ErrorClass::Mismatch | ErrorClass::Timeout)) => root,
        (class, _) => class,
    };
    let err = class_of(class, e.to_string());
    let value = err.value(py);
    let _ = value.setattr("kind", e.kind());
    let set = |k: &str, v: usize| {
        let _ = value.setattr(k, v);
    };
    match e {
        Error::PeerClosed { rank, peer, op } | Error::Protocol { rank, peer, op, .. } => {
            set("rank", *rank);
            set("peer", *peer);
            let _ = value.setattr("op", op);
        }
        Error::Mismatch { rank, peer, .. } => {
            set("rank", *rank);
            set("peer", *peer);
        }
        Error::PeerFailed {
            rank,
            peer,
            origin,
            cause,
            op,
        } => {
            set("rank", *rank);
            set("told_by", *peer);
            set("origin", *origin);
            let _ = value.setattr("cause", cause.to_string());
            let _ = value.setattr("cause_kind", e.root_cause().kind());
            let _ = value.setattr("op", op);
        }
        Error::Timeout {
            rank, op, after, ..
        } => {
            set("rank", *rank);
            let _ = value.setattr("op", op);
            let _ = value.setattr("after", after.as_secs_f64());
        }
        Error::Aborted { rank, op } => {
            set("rank", *rank);
            let _ = value.setattr("op", op);
        }
        _ => {}
    }
    err
}

/// The error of a call on a communicator that was closed.
pub(crate) fn closed() -> PyErr {
    PoisonedError::new_err("the communicator is closed")
}
