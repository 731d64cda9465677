//! The queue pair over ibverbs (feature `rdma`).
