//! The library's test suite: one binary, so linking is paid once. Each module is one
//! area; `cargo test -p ferroccl --test suite AREA::` runs one.

#[macro_use]
mod common;

mod allreduce;
mod auth;
mod book;
mod collectives;
#[cfg(feature = "cuda")]
mod cuda_device;
#[cfg(feature = "cuda")]
mod cuda_kernels;
mod ddp;
mod faults;
mod fuzz_wire;
mod groups;
mod handshake;
mod inprocess;
mod jobs;
mod layers;
mod memsim;
mod order;
mod p2p;
mod rdma_proto;
mod rdma_sim;
mod rendezvous;
mod selfsend;
mod shm;
mod slots;
mod trace;
