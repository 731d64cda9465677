//! Thin, safe wrappers over the operating system calls the transports need beyond
//! `std`: POSIX shared memory ([`shm`]). Every `unsafe` block for them lives here.

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod shm;
