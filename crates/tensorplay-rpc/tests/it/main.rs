//! The integration tests of `tensorplay-rpc`: RPC, RRefs, distributed autograd and optimizer, security and hostile peers. One binary, one module per
//! concern (`cargo test -p tensorplay-rpc --test it MODULE::`).

mod common;
mod dist_autograd;
mod dist_hostile;
mod dist_optimizer;
mod failures;
mod fuzz;
mod hostile;
mod init;
mod rpc;
mod rref;
mod security;
mod shm_path;
mod smoke;
mod tracing_spans;
