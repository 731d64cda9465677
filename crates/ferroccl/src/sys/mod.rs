//! Thin, safe wrappers over the operating system calls the transports need beyond
//! `std`: POSIX shared memory ([`shm`]), cross-memory attach ([`cma`]) and CPU counts
//! ([`cpu`]). Every `unsafe` block for them lives here.

pub(crate) mod cma;
pub(crate) mod cpu;
pub(crate) mod shm;
