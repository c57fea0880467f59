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
//! | `torch.nn.parallel.DistributedDataParallel` | [`nn::parallel::DistributedDataParallel`] |
//! | `torch.utils.data` (`DataLoader`, `DistributedSampler`) | [`utils::data`] |
//! | `torch.utils.checkpoint`, `checkpoint_wrapper` | [`utils::checkpoint`] |
//! | `torch.optim` | [`optim`] |
//! | `torch.cuda` | [`cuda`] |
//! | `torch.distributed` | [`distributed`] |
//! | `torch.distributed.rpc` | [`distributed::rpc`] |
//! | `torch.distributed.autograd` | [`distributed::autograd`] |
//! | `torch.distributed.optim` | [`distributed::optim`] |
//! | `torch.distributed.nn` | [`distributed::nn`] |
//! | `torch.multiprocessing.spawn` | [`distributed::spawn()`] |
//! | `torchrun` | the `tensorplay-run` binary of this crate (see the README) |
//! | `torch.distributed.fsdp.fully_shard` | [`distributed::fsdp::fully_shard`] |
//! | `torch.distributed.checkpoint.state_dict` | [`distributed::checkpoint::state_dict`] |
//! | (nanoGPT, Megatron-LM) | `models` (feature `models`): a GPT and its tensor-parallel form |
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
//!
//! # Distributed
//!
//! A differentiable all-reduce between two processes started by
//! [`spawn`](distributed::spawn()) (`torch.multiprocessing.spawn`; the README's first Quick
//! start example):
//!
//! ```no_run
//! use tensorplay as tp;
//! use tp::distributed as dist;
//! use tp::distributed::nn::functional as df;
//!
//! fn main() -> tp::Result<()> {
//!     dist::spawn(2, |_rank| {
//!         dist::init_process_group("cpu", Default::default())?;
//!         let x = tp::randn(&[4, 8])?.requires_grad_(true);
//!         let y = df::all_reduce(&x, dist::ReduceOp::Sum, None)?; // differentiable all-reduce
//!         y.sum()?.backward()?; // the gradient flows back through the collective
//!         assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![2.0; 32]);
//!         dist::destroy_process_group()?;
//!         Ok(())
//!     })?;
//!     Ok(())
//! }
//! ```
//!
//! Data-parallel training: [`nn::parallel`]; modules on other workers, distributed autograd
//! and the distributed optimizer: [`distributed::nn::RemoteModule`], [`distributed::autograd`],
//! [`distributed::optim`]; checkpoints: [`save`], [`load`], [`distributed::checkpoint`].
//!
//! # Guides
//!
//! The repository's `docs/` folder has one page per layer ([docs/README.md] lists them),
//! among them:
//!
//! - [core.md]: tensors, autograd, `nn`, `optim`;
//! - [collectives.md]: process groups, the cpu and NCCL backends, `spawn`, `tensorplay-run`;
//! - [data-parallel.md]: `DistributedDataParallel`, `DistributedSampler`, `DataLoader`;
//! - [fully-sharded.md]: fully sharded data parallelism, `fully_shard`;
//! - [rpc.md], [distributed-autograd.md], [distributed-nn.md] and [remote-training.md] (a
//!   `RemoteModule` trained with distributed autograd and `DistributedOptimizer`, a complete
//!   program);
//! - [checkpoints.md], [models.md], [debugging.md];
//! - [pytorch-names.md]: PyTorch's names and their tensorplay equivalents, and
//!   [decisions.md]: every place where PyTorch's behaviour was not copied exactly.
//!
//! [docs/README.md]: https://example.invalid/tensorplay/blob/main/docs/README.md
//! [core.md]: https://example.invalid/tensorplay/blob/main/docs/core.md
//! [collectives.md]: https://example.invalid/tensorplay/blob/main/docs/collectives.md
//! [data-parallel.md]: https://example.invalid/tensorplay/blob/main/docs/data-parallel.md
//! [fully-sharded.md]: https://example.invalid/tensorplay/blob/main/docs/fully-sharded.md
//! [rpc.md]: https://example.invalid/tensorplay/blob/main/docs/rpc.md
//! [distributed-autograd.md]: https://example.invalid/tensorplay/blob/main/docs/distributed-autograd.md
//! [distributed-nn.md]: https://example.invalid/tensorplay/blob/main/docs/distributed-nn.md
//! [remote-training.md]: https://example.invalid/tensorplay/blob/main/docs/remote-training.md
//! [checkpoints.md]: https://example.invalid/tensorplay/blob/main/docs/checkpoints.md
//! [models.md]: https://example.invalid/tensorplay/blob/main/docs/models.md
//! [debugging.md]: https://example.invalid/tensorplay/blob/main/docs/debugging.md
//! [pytorch-names.md]: https://example.invalid/tensorplay/blob/main/docs/pytorch-names.md
//! [decisions.md]: https://example.invalid/tensorplay/blob/main/docs/decisions.md
//!
//! Features: `cuda` (CUDA tensors; default), `nccl` (the `"nccl"` process-group backend;
//! default, implies `cuda`), `rpc` (RPC, `RemoteModule` and distributed autograd; default) and
//! `models` (`tp::models`, the GPT; off by default) and `mpi` (the `"mpi"` process-group
//! backend over the system's MPI, for jobs started by `mpirun` or `srun`; off by default: it
//! links MPI, so building it needs MPI installed). CUDA and NCCL are loaded at run time, so
//! default builds run on machines without GPUs; `default-features = false` builds without
//! cudarc. The `tensorplay-gpu-check` binary (feature `nccl`) checks a GPU machine's NCCL and
//! CUDA paths.

pub use tensorplay_core::autograd::is_grad_enabled;
pub use tensorplay_core::{
    CpuCapability, CpuStorage, DType, Device, Element, FInfo, FloatElement, IntoDevice, Layout,
    ShapeArg, Storage, StorageElement, Tensor, TensorId, TensorOptions, arange, autocast, autograd,
    bf16, broadcast_shapes, cat, cpu_capability, cuda, f16, finfo, full, get_autocast_dtype,
    get_default_device, get_num_threads, get_rng_state, is_autocast_enabled, load, manual_seed,
    memory, no_grad, ones, optim, rand, randint, randn, random, save, serialize,
    set_cpu_capability, set_default_device, set_grad_enabled, set_num_threads, set_rng_state,
    stack, with_default_device, zeros,
};

/// `torch.amp`: automatic mixed precision; [`GradScaler`](amp::GradScaler) scales the loss for
/// float16 training (see `docs/low-precision.md`).
pub mod amp {
    pub use tensorplay_core::amp::{
        AutocastGuard, AutocastOptions, FoundInfSync, GradScaler, GradScalerOptions,
        GradScalerState, autocast, autocast_with, get_autocast_dtype, is_autocast_enabled,
    };
}

/// `torch.nn`: layers, losses, `functional`, `utils`, and `parallel`
/// (`DistributedDataParallel`).
pub mod nn {
    pub use tensorplay_core::nn::{
        AsModule, CrossEntropyLoss, Dropout, Embedding, ForwardHook, ForwardPreHook, GELU,
        LayerNorm, Linear, MSELoss, Module, ModuleCore, ModuleFields, ModuleList,
        MultiheadAttention, ReLU, RemovableHandle, Sequential, Sigmoid, Tanh, functional, init,
        utils,
    };

    /// `torch.nn.parallel`: data-parallel training
    /// ([`DistributedDataParallel`](parallel::DistributedDataParallel)); the module page
    /// explains how a step runs. A PyTorch-style loop with a
    /// [`DistributedSampler`](crate::utils::data::DistributedSampler):
    ///
    /// ```no_run
    /// use tensorplay::{self as tp, nn::{self, Module}, optim::{Optimizer, SGD, SgdOptions}};
    /// use tp::distributed as dist;
    /// use tp::nn::parallel::DistributedDataParallel as Ddp;
    /// use tp::utils::data::{DataLoader, DistributedSampler, TensorDataset};
    ///
    /// fn main() -> tp::Result<()> {
    ///     dist::init_process_group("cpu", Default::default())?; // env:// (tensorplay-run sets it)
    ///     let data = TensorDataset::new(vec![tp::randn(&[1000, 16])?, tp::randint(0, 4, &[1000])?])?;
    ///     let sampler = DistributedSampler::new(data.len(), None, None)?; // this rank's shard
    ///     let mut loader = DataLoader::new(&data, 32)?.sampler(Box::new(sampler));
    ///     let model = nn::Sequential::new()
    ///         .add(nn::Linear::new(16, 64, true)?)
    ///         .add(nn::ReLU::new())
    ///         .add(nn::Linear::new(64, 4, true)?);
    ///     let ddp = Ddp::new(model)?; // broadcasts rank 0's parameters
    ///     let mut opt = SGD::new(ddp.parameters(), SgdOptions { lr: 0.1, ..Default::default() })?;
    ///     for epoch in 0..10 {
    ///         loader.set_epoch(epoch); // a new shuffle, the same on every rank
    ///         for batch in &loader {
    ///             let batch = batch?;
    ///             opt.zero_grad()?;
    ///             let loss = nn::CrossEntropyLoss::new().forward(&ddp.call(&batch[0])?, &batch[1])?;
    ///             loss.backward()?; // all-reduces overlap this backward
    ///             opt.step()?;
    ///         }
    ///     }
    ///     dist::barrier(None)?; // no rank leaves while another still needs it
    ///     dist::destroy_process_group()?;
    ///     Ok(())
    /// }
    /// ```
    pub mod parallel {
        #[doc(inline)]
        pub use tensorplay_distributed_nn::parallel::{
            CommFuture, CommHook, DdpError, DdpOptions, DistributedDataParallel, GradBucket,
            NoSync, StepStats, default_hooks,
        };
    }
}

/// `torch.utils`: `data` (datasets, samplers, batching, and `DistributedSampler`) and
/// `checkpoint` (activation checkpointing).
pub mod utils {
    /// `torch.utils.checkpoint` (the non-reentrant form):
    /// [`checkpoint`](checkpoint::checkpoint) recomputes a region's activations in backward
    /// instead of keeping them; [`CheckpointWrapper`](checkpoint::CheckpointWrapper) does it
    /// around a module's forward (PyTorch's `checkpoint_wrapper`).
    pub mod checkpoint {
        pub use tensorplay_core::utils::checkpoint::{CheckpointWrapper, checkpoint};
    }

    /// `torch.utils.data`: [`TensorDataset`](data::TensorDataset),
    /// [`DataLoader`](data::DataLoader), samplers, and
    /// [`DistributedSampler`](data::DistributedSampler) (`torch.utils.data.distributed`).
    pub mod data {
        pub use tensorplay_core::utils::data::{
            Batches, DataLoader, RandomSampler, Sampler, SequentialSampler, TensorDataset,
        };
        #[doc(inline)]
        pub use tensorplay_distributed_nn::data::{DistributedSampler, SamplerState};
    }
}

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
    pub use tensorplay_collectives::spawn::{
        SPAWN_CALLS_ENV, SpawnError, SpawnOptions, is_spawned_child, spawn_with,
    };
    pub use tensorplay_collectives::{
        DEFAULT_TIMEOUT, Detail, Error, InitOptions, P2POp, Part, ProcessGroup, ReduceOp, Work,
        all_gather, all_gather_into_tensor, all_gather_into_tensor_async, all_gather_object,
        all_reduce, all_reduce_async, all_to_all, all_to_all_single, all_to_all_single_async,
        backend, barrier, batch_isend_irecv, broadcast, broadcast_async, broadcast_object_list,
        default_group, destroy_process_group, dump_flight_recorder, gather, get_backend, get_rank,
        get_world_size, irecv, is_initialized, isend, launch_env, recorder, recv, reduce,
        reduce_scatter, reduce_scatter_tensor, reduce_scatter_tensor_async, register_backend,
        registered_backends, rendezvous, scatter, send, spawn, store, world_store,
    };
    #[doc(inline)]
    pub use tensorplay_distributed_nn::checkpoint;

    /// `torch.distributed.fsdp`: fully sharded data parallelism,
    /// [`fully_shard`](fsdp::fully_shard); see `docs/fully-sharded.md`.
    pub mod fsdp {
        #[doc(inline)]
        pub use tensorplay_distributed_nn::parallel::fsdp::{
            FsdpError, FsdpEvent, FsdpModule, FsdpOptions, MixedPrecisionPolicy, ShardedGradScaler,
            UnshardHandle, clip_grad_norm_, full_tensor, fully_shard, shard_placement,
        };
    }

    /// `torch.distributed.pipelining`: pipeline parallelism — [`PipelineStage`](pipelining::PipelineStage)
    /// and the schedules ([`ScheduleGPipe`](pipelining::ScheduleGPipe),
    /// [`Schedule1F1B`](pipelining::Schedule1F1B), ...), checked by a simulator before they
    /// run; see `docs/pipeline-parallel.md`.
    #[doc(inline)]
    pub use tensorplay_distributed_nn::parallel::pipelining;

    #[doc(inline)]
    pub use tensorplay_collectives::device_mesh;

    /// `torch.distributed.tensor`: how a tensor's pieces lie over a
    /// [`DeviceMesh`](device_mesh::DeviceMesh) ([`Placement`](tensor::Placement)), and
    /// [`parallel`](tensor::parallel), tensor parallelism's plan API.
    pub mod tensor {
        #[doc(inline)]
        pub use tensorplay_distributed_nn::tensor::Placement;

        /// `torch.distributed.tensor.parallel`: [`ColwiseParallel`](parallel::ColwiseParallel),
        /// [`RowwiseParallel`](parallel::RowwiseParallel) and
        /// [`parallelize_module`](parallel::parallelize_module); see `docs/tensor-parallel.md`.
        pub mod parallel {
            #[doc(inline)]
            pub use tensorplay_distributed_nn::parallel::tensor::{
                ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module,
            };
        }
    }

    /// Registers the backends this build has beyond `"cpu"` (`"nccl"` with the `nccl`
    /// feature, `"mpi"` with the `mpi` feature), once.
    fn register_builtin() {
        #[cfg(feature = "nccl")]
        tensorplay_nccl::register();
        #[cfg(feature = "mpi")]
        tensorplay_mpi::register();
    }

    /// Initialises the default process group (`torch.distributed.init_process_group`):
    /// rendezvous through the store named by `options.init_method`, then connects the backend.
    ///
    /// `backend` is `"cpu"` (host tensors over shared memory and TCP; `"gloo"` is an alias),
    /// `"nccl"` (CUDA tensors on `cuda:LOCAL_RANK`; in builds with the `nccl` feature, the
    /// default), or a name given to [`register_backend`].
    ///
    /// # Errors
    /// Already initialised, a bad init method or environment variable, a rendezvous timeout
    /// naming the ranks that did not join, an unknown backend, or a backend that cannot run
    /// here (for NCCL: no CUDA driver, no `libnccl`, not enough GPUs), each with what to do.
    pub fn init_process_group(backend: &str, options: InitOptions) -> Result<(), Error> {
        register_builtin();
        tensorplay_collectives::init_process_group(backend, options)
    }

    /// Creates a group of the given global ranks (`new_group`); every process of the world
    /// calls it with the same ranks, in the same order. `backend` defaults to the world's,
    /// `timeout` to the world's; processes outside `ranks` get a non-member handle.
    ///
    /// # Errors
    /// Not initialised, empty or repeated ranks, ranks outside the world, or a backend that
    /// cannot be created (as [`init_process_group`]).
    pub fn new_group(
        ranks: &[usize],
        backend: Option<&str>,
        timeout: Option<std::time::Duration>,
    ) -> Result<ProcessGroup, Error> {
        register_builtin();
        tensorplay_collectives::new_group(ranks, backend, timeout)
    }

    /// `torch.distributed.rpc`: remote calls and remote references between workers over QUIC.
    ///
    /// ```no_run
    /// use tensorplay as tp;
    /// use tp::Tensor;
    /// use tp::distributed::rpc;
    ///
    /// fn main() -> tp::Result<()> {
    ///     // every worker registers the same functions, then joins (env://)
    ///     rpc::register("add", |(a, b): (Tensor, Tensor)| a.add(&b));
    ///     let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    ///     rpc::init_rpc(&format!("worker{rank}"), rank, 2, Default::default())?;
    ///     if rank == 0 {
    ///         let x = tp::ones(&[2, 2])?;
    ///         let y: Tensor = rpc::rpc_sync("worker1", "add", (x.clone(), x), None)?;
    ///         let r: rpc::RRef<Tensor> = rpc::remote("worker1", "add", (y.clone(), y), None)?;
    ///         println!("{:?}", r.to_here(None)?.to_vec::<f32>()?); // [4, 4, 4, 4]
    ///     }
    ///     rpc::shutdown(true)?;
    ///     Ok(())
    /// }
    /// ```
    ///
    /// # How it works
    ///
    /// - **Functions** are registered by name with typed arguments and results
    ///   ([`register`](rpc::register)); arguments travel through the [`Wire`](rpc::Wire) trait,
    ///   tensors beside the message (not re-encoded) and straight into the receiver's storage.
    /// - **Transport**: one QUIC connection (quinn) per pair of workers that talk, one stream
    ///   per call; the message header is an rkyv archive, validated before use. Windows and
    ///   socket buffers are raised for large tensors.
    /// - **Shared memory** between workers of one host: tensors of 64 KiB and more go through a
    ///   segment in `/dev/shm` instead of the QUIC stream (chosen automatically, confirmed per
    ///   pair of workers at [`init_rpc`](rpc::init_rpc); `TENSORPLAY_RPC_SHM=0` turns it off).
    ///   QUIC stays the path between hosts.
    /// - **Security**: each worker generates a certificate at [`init_rpc`](rpc::init_rpc) and
    ///   publishes its fingerprint through the job's store; connections from certificates
    ///   outside the job are refused in the handshake, in both directions.
    /// - **Threads**: the transport runs on a small tokio runtime; a user function runs on the
    ///   thread that read its request once that thread has handed the transport to another
    ///   one, so nested RPCs never deadlock.
    /// - **Timeouts** everywhere (default 60 s,
    ///   [`RpcBackendOptions::rpc_timeout`](rpc::RpcBackendOptions::rpc_timeout)); a worker that
    ///   died is reported as [`Error::WorkerUnreachable`](rpc::Error::WorkerUnreachable), a slow
    ///   one as [`Error::Timeout`](rpc::Error::Timeout).
    /// - **RRefs** follow PyTorch's ownership and reference-counting protocol
    ///   ([`RRef`](rpc::RRef)).
    /// - **Distributed autograd** and the **distributed optimizer**: [`rpc::autograd`] (also
    ///   [`distributed::autograd`](autograd)) and [`rpc::DistributedOptimizer`] (also
    ///   [`distributed::optim`](optim)).
    #[cfg(feature = "rpc")]
    pub mod rpc {
        pub use tensorplay_rpc::{
            Decoder, Encoder, Error, GloballyUniqueId, RRef, RRefDebugInfo, Result,
            RpcBackendOptions, RpcFuture, To, Wire, WorkerInfo, bytes_sent, current_worker,
            debug_info, get_rpc_timeout, get_worker_info, get_worker_infos, init_rpc,
            is_initialized, local_addr, register, register_method, remote, rpc_async, rpc_sync,
            set_rpc_timeout, shutdown, wait_all,
        };

        /// Deprecated path: distributed autograd is [`tp::distributed::autograd`](super::autograd)
        /// (`torch.distributed.autograd`).
        #[deprecated(since = "0.1.0", note = "use tp::distributed::autograd")]
        pub mod autograd {
            #[doc(no_inline)]
            pub use tensorplay_rpc::autograd::{
                ContextGuard, ContextId, ContextInfo, DebugInfo, Gradients, backward, context,
                context_info, current_context, debug_info, get_gradients, is_valid_context,
            };
        }

        /// Deprecated path: use [`tp::distributed::optim::DistributedOptimizer`](super::optim::DistributedOptimizer).
        #[deprecated(
            since = "0.1.0",
            note = "use tp::distributed::optim::DistributedOptimizer"
        )]
        pub type DistributedOptimizer = tensorplay_rpc::DistributedOptimizer;

        /// Deprecated path: use [`tp::distributed::optim::OptimizerKind`](super::optim::OptimizerKind).
        #[deprecated(since = "0.1.0", note = "use tp::distributed::optim::OptimizerKind")]
        pub type OptimizerKind = tensorplay_rpc::OptimizerKind;
    }

    /// `torch.distributed.autograd`: contexts, the distributed backward pass and the
    /// gradients it leaves on each worker (the same items as
    /// [`rpc::autograd`], whose page has the overview).
    #[cfg(feature = "rpc")]
    pub mod autograd {
        pub use tensorplay_rpc::autograd::{
            ContextGuard, ContextId, ContextInfo, DebugInfo, Gradients, backward, context,
            context_info, current_context, debug_info, get_gradients, is_valid_context,
        };
    }

    /// `torch.distributed.optim`: the optimizer of parameters held by other workers.
    #[cfg(feature = "rpc")]
    pub mod optim {
        pub use tensorplay_rpc::{DistributedOptimizer, OptimizerKind};
    }

    /// `torch.distributed.nn`: the differentiable collectives (`functional`) and, with the
    /// feature `rpc`, `RemoteModule`.
    pub mod nn {
        #[doc(inline)]
        pub use tensorplay_distributed_nn::functional;
        #[cfg(feature = "rpc")]
        #[doc(hidden)]
        pub use tensorplay_remote_module::{__private, interface_method_name, method_name};
        #[cfg(feature = "rpc")]
        #[doc(inline)]
        pub use tensorplay_remote_module::{
            Hosted, Interface, LayerSpec, LinearArgs, REMOTE_DEVICE_FORMS, RemoteConstructible,
            RemoteDevice, RemoteModule, WorkerRef, interface, register_interface, register_module,
        };

        /// Deprecated path: data parallelism is [`tp::nn::parallel`](crate::nn::parallel)
        /// (`torch.nn.parallel`).
        #[deprecated(since = "0.1.0", note = "use tp::nn::parallel")]
        pub mod parallel {
            #[doc(no_inline)]
            pub use crate::nn::parallel::{
                CommFuture, CommHook, DdpError, DdpOptions, DistributedDataParallel, GradBucket,
                NoSync, StepStats, default_hooks,
            };
        }

        /// Deprecated path: distributed checkpoints are
        /// [`tp::distributed::checkpoint`](crate::distributed::checkpoint)
        /// (`torch.distributed.checkpoint`).
        #[deprecated(since = "0.1.0", note = "use tp::distributed::checkpoint")]
        pub mod checkpoint {
            #[doc(no_inline)]
            pub use crate::distributed::checkpoint::{
                Shard, load_sharded, save_replicated, save_sharded, sharded_exists,
            };
        }

        /// Deprecated path: `DistributedSampler` is
        /// [`tp::utils::data::DistributedSampler`](crate::utils::data::DistributedSampler)
        /// (`torch.utils.data.distributed`).
        #[deprecated(since = "0.1.0", note = "use tp::utils::data::DistributedSampler")]
        pub mod data {
            #[doc(no_inline)]
            pub use crate::utils::data::DistributedSampler;
        }
    }
}

/// Ready-made models (feature `models`): the GPT of the second main job and its
/// tensor-parallel form.
#[cfg(feature = "models")]
pub mod models {
    #[doc(inline)]
    pub use tensorplay_models::{
        Block, Gpt, GptConfig, GptStage, TINY_SHAKESPEARE, gpt, gpt_stage,
    };
}

/// The one error of the stack: the core's error, into which every layer's error converts
/// (higher layers' errors are carried as [`Error::External`]; use [`Error::downcast_ref`] to
/// get, say, a [`distributed::Error`] back). Custom `autograd::Function`s and `nn::Module`s
/// return it too.
pub use tensorplay_core::Error;

/// `std::result::Result<T, E>` with `E` defaulting to [`Error`]: what the facade's functions
/// return, and what `fn main() -> tp::Result<()>` and custom modules write.
pub use tensorplay_core::Result;

/// The core page's examples (modules: derive, visitors, hooks), compiled as doc tests.
#[doc = include_str!("../../../docs/core.md")]
#[cfg(doctest)]
pub struct CoreDoctests;

/// The checkpoints page's examples, compiled as doc tests.
#[doc = include_str!("../../../docs/checkpoints.md")]
#[cfg(doctest)]
pub struct CheckpointsDoctests;

/// The tensor-parallel page's example, compiled as a doc test.
#[doc = include_str!("../../../docs/tensor-parallel.md")]
#[cfg(doctest)]
pub struct TensorParallelDoctests;

/// The fully-sharded page's example, compiled as a doc test.
#[doc = include_str!("../../../docs/fully-sharded.md")]
#[cfg(all(doctest, feature = "models"))]
pub struct FullyShardedDoctests;

/// The pipeline-parallel page's example, compiled as a doc test.
#[doc = include_str!("../../../docs/pipeline-parallel.md")]
#[cfg(all(doctest, feature = "models"))]
pub struct PipelineParallelDoctests;

/// The RPC page's examples, compiled as doc tests.
#[doc = include_str!("../../../docs/rpc.md")]
#[cfg(all(doctest, feature = "rpc"))]
pub struct RpcDoctests;

/// The remote-training page's program, compiled as a doc test (and run, compared with the
/// page, by `tests/remote_training_page.rs`).
#[doc = include_str!("../../../docs/remote-training.md")]
#[cfg(all(doctest, feature = "rpc"))]
pub struct RemoteTrainingDoctests;

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../../../README.md")]
#[cfg(all(doctest, feature = "rpc"))]
pub struct ReadmeDoctests;
