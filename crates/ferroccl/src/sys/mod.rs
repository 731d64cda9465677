//! Thin, safe wrappers over the operating system calls the transports need beyond
//! `std`: POSIX shared memory ([`shm`]), cross-memory attach ([`cma`]) and CPU counts
//! ([`cpu`]); and byte copies that dodge a slow case of the C library's ([`mem`]).
//! Every `unsafe` block for them lives here.

pub(crate) mod cma;
pub(crate) mod cpu;
pub(crate) mod mem;
pub(crate) mod shm;
