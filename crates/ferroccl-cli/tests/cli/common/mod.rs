//! What the CLI's tests share: running the binary with a deadline, and the library's
//! harness.
#![allow(dead_code)]

pub mod proc;

pub use ferroccl::testing::accept_within;
