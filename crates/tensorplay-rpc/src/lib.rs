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
pub mod autograd;
mod error;
mod frame;
mod future;
mod optim;
mod proto;
mod rref;
mod shm;
mod tls;
mod wire;

pub use agent::{
    RpcBackendOptions, To, WorkerInfo, bytes_sent, current_worker, get_rpc_timeout,
    get_worker_info, get_worker_infos, init_rpc, is_initialized, local_addr, register, rpc_async,
    rpc_sync, set_rpc_timeout, shutdown,
};
pub use error::{Error, Result};
pub use future::{RpcFuture, wait_all};
pub use optim::{DistributedOptimizer, OptimizerKind};
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

    /// A well-formed call message (of `func` with signature `sig`, from rank `sender`, with an
    /// encoded `payload` and `tensors`), as a starting point for mutations and for foreign
    /// peers in tests.
    ///
    /// # Errors
    /// Tensors that cannot be sent.
    pub fn encode_frame(
        func: &str,
        sig: &str,
        sender: u32,
        payload: &[u8],
        tensors: &[tensorplay_core::Tensor],
    ) -> crate::Result<Vec<u8>> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .map_err(|e| crate::Error::Transport(e.to_string()))?;
        let mut env = crate::frame::Envelope::new(crate::proto::message::Message::Call(
            crate::proto::message::Target {
                func: func.to_string(),
                sig: sig.to_string(),
            },
        ));
        env.sender = sender;
        env.payload = payload.to_vec();
        let mut out = Vec::new();
        rt.block_on(crate::frame::write_frame(&mut out, &mut env, tensors, None))?;
        Ok(out)
    }

    /// A message whose header describes tensors of `(dtype code, shape)` and whose prefix
    /// claims `body_len` bytes of body, followed by `body`: hostile frames for tests.
    ///
    /// # Errors
    /// The header cannot be encoded.
    pub fn raw_frame(
        tensors: &[(u8, Vec<u64>)],
        body_len: u64,
        body: &[u8],
    ) -> crate::Result<Vec<u8>> {
        let mut env = crate::frame::Envelope::new(crate::proto::message::Message::Call(
            crate::proto::message::Target {
                func: String::new(),
                sig: String::new(),
            },
        ));
        env.tensors = tensors
            .iter()
            .map(|(dtype, shape)| crate::frame::TensorDesc {
                dtype: *dtype,
                shape: shape.clone(),
                shm: None,
            })
            .collect();
        let header = rkyv::to_bytes::<rkyv::rancor::Error>(&env)
            .map_err(|e| crate::Error::Serialization(e.to_string()))?;
        let mut out = Vec::with_capacity(16 + header.len() + body.len());
        out.extend_from_slice(&crate::frame::MAGIC.to_le_bytes());
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        out.extend_from_slice(&body_len.to_le_bytes());
        out.extend_from_slice(&header);
        out.extend_from_slice(body);
        Ok(out)
    }
}
