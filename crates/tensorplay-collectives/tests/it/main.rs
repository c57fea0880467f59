//! The integration tests of `tensorplay-collectives`: the collectives: stores, the cpu backend, spawn, hostile peers (the multi-process worlds are the `multiprocess` target). One binary, one module per
//! concern (`cargo test -p tensorplay-collectives --test it MODULE::`).

mod cpu_backend;
mod hostile;
mod proptest_collectives;
mod spawn;
mod spawn_report;
mod store;
