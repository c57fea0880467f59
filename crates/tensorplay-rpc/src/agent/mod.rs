//! The RPC agent: one per process between `init_rpc` and `shutdown`. It owns a tokio runtime,
//! a QUIC endpoint (server and client), one connection per peer it has called, and serves the
//! streams peers open: each call is one bidirectional stream (request frame, response frame).
//! User functions run on the thread that read the request, after it handed the transport's
//! work to another thread (`block_in_place`, see [`run_blocking`]), so a function that itself
//! makes RPCs (even to the caller, even many deep) cannot starve the transport, and a cheap
//! function costs no extra thread hand-off. Large tensors to workers of this host go through
//! shared memory ([`crate::shm`]).

mod client;
mod init;
mod options;
mod registry;
mod server;
mod shutdown;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tensorplay_collectives::store::Store;

use crate::rref::RRefContext;
use crate::shm::ShmDir;
use crate::{Error, Result};

pub use client::{
    bytes_sent, current_worker, get_rpc_timeout, get_worker_info, get_worker_infos, local_addr,
    rpc_async, rpc_sync, set_rpc_timeout,
};
pub use init::init_rpc;
pub use options::{RpcBackendOptions, To, WorkerInfo};
pub use registry::register;
pub(crate) use registry::{CallCtx, lookup, signature};
pub(crate) use server::{panic_message, run_blocking};
pub use shutdown::shutdown;

pub(crate) struct Agent {
    pub(crate) me: WorkerInfo,
    pub(crate) workers: Vec<WorkerInfo>,
    addrs: Vec<SocketAddr>,
    pub(crate) handle: tokio::runtime::Handle,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    endpoint: quinn::Endpoint,
    conns: Mutex<HashMap<usize, Arc<tokio::sync::OnceCell<quinn::Connection>>>>,
    fingerprints: Vec<[u8; 32]>,
    default_timeout: Mutex<Duration>,
    store: Arc<dyn Store>,
    /// Outgoing calls not finished yet.
    inflight: AtomicUsize,
    /// Incoming calls being served.
    serving: AtomicUsize,
    pub(crate) rrefs: RRefContext,
    /// The distributed-autograd contexts open on this worker.
    pub(crate) contexts: crate::autograd::Contexts,
    shutdowns: AtomicU64,
    /// Bytes sent and received (requests and responses).
    pub(crate) bytes: AtomicU64,
    /// This worker's shared-memory directory (large tensors to workers of this host).
    shm: Option<ShmDir>,
    /// By rank: the peer's shared-memory directory when this worker confirmed it can read it.
    shm_peers: Vec<Option<PathBuf>>,
    /// By rank: whether the peer confirmed it can read this worker's directory.
    shm_send: Vec<bool>,
}

static AGENT: RwLock<Option<Arc<Agent>>> = RwLock::new(None);

/// Held by the `init_rpc` in progress.
static INIT: Mutex<()> = Mutex::new(());

/// The store of the last `init_rpc`, kept after it fails or shuts down: on rank 0 it is the
/// job's store server, which the other workers may still be using (reading names after a
/// failed initialisation, leaving the shutdown barrier, or already rendezvousing again for the
/// next `init_rpc`, which reuses it under a new prefix).
static LAST_STORE: Mutex<Option<Arc<dyn Store>>> = Mutex::new(None);

/// The current agent, or `NotInitialized` naming `op`.
pub(crate) fn agent(op: &str) -> Result<Arc<Agent>> {
    AGENT
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .ok_or_else(|| Error::NotInitialized { op: op.into() })
}

/// Whether RPC is initialised in this process.
pub fn is_initialized() -> bool {
    AGENT.read().unwrap_or_else(|e| e.into_inner()).is_some()
}
