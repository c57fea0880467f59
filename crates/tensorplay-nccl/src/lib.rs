//! `tensorplay-nccl`: the `"nccl"` process-group backend, CUDA tensors between GPUs through
//! NCCL. The only crate of the stack that calls NCCL; all of its `unsafe` lives here.
//!
//! - **Loading**: NCCL is opened at run time (`libnccl.so.2`, as NCCL ships, or `libnccl.so`;
//!   by the loader's path, then from [`search_dirs`], which include pip's `nvidia-nccl-cu*`
//!   package in a virtual environment). Builds need no CUDA toolkit and no NCCL.
//! - **Setup**: one communicator per group on a stream of this process's GPU
//!   (`cuda:LOCAL_RANK`); rank 0's unique id travels through the group's store;
//!   `ncclCommInitRank` waits at most the group's timeout.
//! - **Calls**: every collective of the contract, the list forms and all-to-all as NCCL groups
//!   of broadcasts, reduces, sends and receives; float32, float64, int64 and bool (as uint8:
//!   `Sum` reduces as `Max`, `Product` as `Min`).
//! - **Timeouts that hold**: a call polls an event behind its work against its deadline and, on
//!   expiry, aborts the communicator (`ncclCommAbort`) and returns
//!   [`Error::Timeout`](tensorplay_collectives::Error::Timeout) naming the call; later calls on
//!   the group fail at once.
//!
//! The checks every backend gets (dtypes, shapes, roots agreeing across ranks; rank
//! translation; issue order; barrier) run above it, over the group's cpu control channel.
//!
//! ```no_run
//! // the facade registers the backend (its `nccl` feature, on by default):
//! use tensorplay as tp;
//! use tp::distributed as dist;
//! # fn main() -> tp::Result<()> {
//! dist::init_process_group("nccl", Default::default())?;
//! let x = tp::ones(&[4])?.to("cuda")?;
//! dist::all_reduce(&x, dist::ReduceOp::Sum, None)?;
//! # Ok(())
//! # }
//! ```

mod backend;
mod calls;
mod comm;
mod device;
mod ffi;

use std::sync::OnceLock;

pub use backend::NcclBackend;
pub use device::device_for;
pub use ffi::{library, library_in, search_dirs};

/// Registers the `"nccl"` backend with the collectives' registry (once per process; later
/// calls do nothing). The facade calls it before creating groups.
pub fn register() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let _ = tensorplay_collectives::register_backend("nccl", |ctx| {
            Ok(Box::new(NcclBackend::new(ctx)?)
                as Box<dyn tensorplay_collectives::backend::Backend>)
        });
    });
}
