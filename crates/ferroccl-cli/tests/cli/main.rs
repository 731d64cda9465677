//! The `ferroccl` binary's test suite: one test binary, so linking is paid once. Each
//! module is one subcommand or scenario; `cargo test -p ferroccl-cli --test cli AREA::`
//! runs one.

mod common;

mod book;
mod cuda_cli;
mod emulated_cluster;
mod fault_injection;
mod launch;
mod plan;
mod plot;
mod processes;
mod rdma_device;
mod trace;
#[cfg(feature = "candle")]
mod train_cli;
