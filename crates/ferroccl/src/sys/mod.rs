//! Thin, safe wrappers over the operating system calls the transports need beyond
//! `std`: POSIX shared memory ([`shm`]). Every `unsafe` block for them lives here.

pub(crate) mod shm;
