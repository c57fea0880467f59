//! `tensorplay-rpc`: remote procedure calls and remote references between workers
//! (`torch.distributed.rpc`), over QUIC.
//!
//! ```no_run
//! use tensorplay_core::{self as tp, Tensor};
//! use tensorplay_rpc as rpc;
//!
//! fn main() -> rpc::Result<()> {
//!     // every worker registers the same functions, then joins (env://: MASTER_ADDR, MASTER_PORT)
//!     rpc::register("add", |(a, b): (Tensor, Tensor)| a.add(&b));
//!     let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
//!     rpc::init_rpc(&format!("worker{rank}"), rank, 2, Default::default())?;
//!     if rank == 0 {
//!         let x = tp::ones(&[2, 2])?;
//!         let y: Tensor = rpc::rpc_sync("worker1", "add", (x.clone(), x), None)?;
//!         let r: rpc::RRef<Tensor> = rpc::remote("worker1", "add", (y.clone(), y), None)?;
//!         println!("{:?}", r.to_here(None)?.to_vec::<f32>()?); // [4, 4, 4, 4]
//!     }
//!     rpc::shutdown(true)
//! }
//! ```
//!
//! # How it works
//!
//! - **Functions** are registered by name with typed arguments and results ([`register`]);
//!   arguments travel through the [`Wire`] trait, tensors beside the message (not re-encoded)
//!   and straight into the receiver's storage.
//! - **Transport**: one QUIC connection (quinn) per pair of workers that talk, one stream per
//!   call; the message header is an rkyv archive, validated before use. Windows and socket
//!   buffers are raised for large tensors.
//! - **Shared memory** between workers of one host: tensors of 64 KiB and more go through a
//!   segment in `/dev/shm` instead of the QUIC stream (chosen automatically, confirmed per
//!   pair of workers at [`init_rpc`]; `TENSORPLAY_RPC_SHM=0` turns it off). QUIC stays the
//!   path between hosts.
//! - **Security**: each worker generates a certificate at [`init_rpc`] and publishes its
//!   fingerprint through the job's store; connections from certificates outside the job are
//!   refused in the handshake, in both directions.
//! - **Threads**: the transport runs on a small tokio runtime; a user function runs on the
//!   thread that read its request once that thread has handed the transport to another one, so
//!   nested RPCs never deadlock.
//! - **Timeouts** everywhere (default 60 s, [`RpcBackendOptions::rpc_timeout`]); a worker that
//!   died is reported as [`Error::WorkerUnreachable`], a slow one as [`Error::Timeout`].
//! - **RRefs** follow PyTorch's ownership and reference-counting protocol ([`RRef`]).

mod agent;
mod error;
mod frame;
mod future;
mod rref;
mod shm;
mod tls;
mod wire;

pub use agent::{
    RpcBackendOptions, To, WorkerInfo, current_worker, get_rpc_timeout, get_worker_info,
    get_worker_infos, init_rpc, is_initialized, register, rpc_async, rpc_sync, set_rpc_timeout,
    shutdown,
};
pub use error::{Error, Result};
pub use future::{RpcFuture, wait_all};
pub use rref::{GloballyUniqueId, RRef, RRefDebugInfo, debug_info, register_method, remote};
pub use wire::{Decoder, Encoder, Wire};

#[doc(hidden)]
/// Frame decoding for fuzz tests: decodes one message from `bytes`.
pub mod fuzz {
    /// Decodes one message; never panics.
    ///
    /// # Errors
    /// Malformed input.
    pub fn decode_frame(bytes: &[u8]) -> crate::Result<usize> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .map_err(|e| crate::Error::Transport(e.to_string()))?;
        let mut r = bytes;
        let (_, tensors) = rt.block_on(crate::frame::read_frame(&mut r, None))?;
        Ok(tensors.len())
    }
}
