//! The integration tests of `tensorplay-distributed-nn`: the differentiable collectives, DDP and tensor parallelism. One binary, one module per
//! concern (`cargo test -p tensorplay-distributed-nn --test it MODULE::`).

mod bad_arguments;
mod dcp;
mod dcp_async;
mod dcp_consolidate;
mod dcp_layouts;
mod ddp;
mod ddp_low_precision;
mod fsdp;
mod fsdp_2d;
mod fsdp_api;
mod fsdp_checkpoint;
mod fsdp_deferred;

mod fsdp_faults;
mod fsdp_memory;
mod fsdp_misuse;
mod fsdp_precision;
mod grad_scaler;
mod gradcheck;
mod hostile;
mod pipelining;
mod pipelining_faults;
mod pipelining_stages;
mod semantics;
mod state_dict;
mod tensor_parallel;
mod worked_examples;
