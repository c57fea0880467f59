//! `tensorplay`: a PyTorch-style deep-learning stack in Rust, built for distributed training.
//!
//! This facade re-exports the layers under PyTorch's module paths; depend on it and write
//! `use tensorplay as tp;`:
//!
//! | PyTorch | tensorplay |
//! |---|---|
//! | `torch.Tensor`, `torch.randn`, `torch.zeros`, ... | [`Tensor`], [`randn`], [`zeros`], ... |
//! | `torch.autograd` | [`autograd`] |
//! | `torch.nn` | [`nn`] |
//! | `torch.optim` | [`optim`] |
//!
//! ```
//! use tensorplay as tp;
//! let x = tp::randn(&[4, 3])?.requires_grad_(true);
//! let y = x.tanh()?.sum()?;
//! y.backward()?;
//! assert_eq!(x.grad().unwrap().shape(), &[4, 3]);
//! # Ok::<(), tp::Error>(())
//! ```
//!
//! Every layer's error converts into the one [`Error`] of this crate, so `?` works across
//! layers in a function returning [`Result`].

pub use tensorplay_core::autograd::is_grad_enabled;
pub use tensorplay_core::{
    CpuStorage, DType, Device, Element, FloatElement, IntoDevice, Layout, ShapeArg, Storage,
    StorageElement, Tensor, TensorId, TensorOptions, arange, autograd, broadcast_shapes, cat, cuda,
    full, get_num_threads, manual_seed, nn, no_grad, ones, optim, rand, randint, randn, random,
    set_grad_enabled, set_num_threads, stack, zeros,
};

/// `torch.distributed`: process groups, stores, collectives, `spawn`.
///
/// ```no_run
/// use tensorplay as tp;
/// use tp::distributed as dist;
///
/// fn main() -> tp::Result<()> {
///     // env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (spawn sets them)
///     dist::init_process_group("cpu", Default::default())?;
///     let x = tp::ones(&[4])?;
///     dist::all_reduce(&x, dist::ReduceOp::Sum, None)?;
///     dist::destroy_process_group()?;
///     Ok(())
/// }
/// ```
pub mod distributed {
    pub use tensorplay_collectives::rendezvous::{InitMethod, RendezvousInfo};
    pub use tensorplay_collectives::spawn::{SpawnError, SpawnOptions, spawn_with};
    pub use tensorplay_collectives::{
        DEFAULT_TIMEOUT, Error, InitOptions, ProcessGroup, ReduceOp, Work, all_gather,
        all_gather_into_tensor, all_gather_into_tensor_async, all_reduce, all_reduce_async,
        all_to_all, all_to_all_single, all_to_all_single_async, backend, barrier, broadcast,
        broadcast_async, default_group, destroy_process_group, gather, get_rank, get_world_size,
        init_process_group, irecv, is_initialized, isend, new_group, recv, reduce, reduce_scatter,
        reduce_scatter_tensor, reduce_scatter_tensor_async, rendezvous, scatter, send, spawn,
        store, world_store,
    };

    /// `torch.distributed.rpc`: remote calls and remote references between workers over QUIC.
    /// The overview (transport, shared memory and `TENSORPLAY_RPC_SHM`, security, threads,
    /// timeouts, RRefs) is in the crate docs of [`tensorplay_rpc`].
    pub mod rpc {
        pub use tensorplay_rpc::*;
    }

    /// `torch.distributed.autograd`: contexts, the distributed backward pass and the
    /// gradients it leaves on each worker (see `tensorplay_rpc::autograd`).
    pub mod autograd {
        pub use tensorplay_rpc::autograd::*;
    }

    /// `torch.distributed.optim`: the optimizer of parameters held by other workers.
    pub mod optim {
        pub use tensorplay_rpc::{DistributedOptimizer, OptimizerKind};
    }

    /// `torch.distributed.nn`: the differentiable collectives (`functional`) and `RemoteModule`.
    pub mod nn {
        #[doc(inline)]
        pub use tensorplay_distributed_nn::*;
    }
}

/// The one error of the stack: the core's error, into which every layer's error converts
/// (higher layers' errors are carried as [`Error::External`]; use [`Error::downcast_ref`] to
/// get, say, a [`distributed::Error`] back). Custom `autograd::Function`s and `nn::Module`s
/// return this [`Result`] too.
pub use tensorplay_core::{Error, Result};

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
