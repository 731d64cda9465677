//! Thin, safe wrappers over the operating system calls the transports need beyond
//! `std`: POSIX shared memory ([`shm`]) and cross-memory attach ([`cma`]). Every
//! `unsafe` block for them lives here.

pub(crate) mod cma;
pub(crate) mod shm;
