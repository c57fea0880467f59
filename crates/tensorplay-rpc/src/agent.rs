//! The RPC agent: one per process between `init_rpc` and `shutdown`. It owns a tokio runtime,
//! a QUIC endpoint (server and client), one connection per peer it has called, and serves the
//! streams peers open: each call is one bidirectional stream (request frame, response frame).
//! User functions run on the thread that read the request, after it handed the transport's
//! work to another thread (`block_in_place`, see [`run_blocking`]), so a function that itself
//! makes RPCs (even to the caller, even many deep) cannot starve the transport, and a cheap
//! function costs no extra thread hand-off. Large tensors to workers of this host go through
//! shared memory ([`crate::shm`]).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock};
use std::time::{Duration, Instant};

use tensorplay_collectives::rendezvous::{InitMethod, rendezvous_scoped};
use tensorplay_collectives::store::Store;
use tensorplay_core::{Device, Tensor};

use crate::frame::{Envelope, RemoteErr, kind, read_frame, write_frame};
use crate::future::{Promise, RpcFuture};
use crate::rref::RRefContext;
use crate::shm::{self, ShmDir};
use crate::tls::{self, Identity, JobVerifier};
use crate::wire::{Encoder, Wire, decode_args, decode_value, encode_value};
use crate::{Error, Result};

/// A worker of the RPC group (`torch.distributed.rpc.WorkerInfo`): its unique name and its id
/// (its rank, `0..world_size`). Equal by value; travels in RPCs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerInfo {
    /// The worker's name.
    pub name: String,
    /// The worker's id (rank).
    pub id: usize,
}

impl std::fmt::Display for WorkerInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WorkerInfo(id={}, name={})", self.id, self.name)
    }
}

/// Where a call goes: a worker's name, its rank, or its [`WorkerInfo`].
#[derive(Debug, Clone)]
pub enum To {
    /// By name.
    Name(String),
    /// By rank (worker id).
    Rank(usize),
}

impl From<&str> for To {
    fn from(s: &str) -> To {
        To::Name(s.to_string())
    }
}
impl From<String> for To {
    fn from(s: String) -> To {
        To::Name(s)
    }
}
impl From<&String> for To {
    fn from(s: &String) -> To {
        To::Name(s.clone())
    }
}
impl From<usize> for To {
    fn from(r: usize) -> To {
        To::Rank(r)
    }
}
impl From<&WorkerInfo> for To {
    fn from(w: &WorkerInfo) -> To {
        To::Rank(w.id)
    }
}
impl From<WorkerInfo> for To {
    fn from(w: WorkerInfo) -> To {
        To::Rank(w.id)
    }
}

/// Options of [`init_rpc`] (`TensorPipeRpcBackendOptions`).
#[derive(Debug, Clone)]
pub struct RpcBackendOptions {
    /// Default timeout of every call, `to_here` and the shutdown barrier (default 60 s);
    /// `Duration::ZERO` means no timeout.
    pub rpc_timeout: Duration,
    /// Threads of the transport's runtime (default 1: each extra thread adds hand-offs
    /// between threads to every call, which cost more latency than they win on small
    /// machines). A running user function hands its thread's transport work to another
    /// thread first, so this never limits nesting or concurrency. At most 1024; 0 means 1.
    pub num_worker_threads: usize,
    /// `"env://"` (default: `MASTER_ADDR`, `MASTER_PORT`) or `"tcp://host:port"`.
    pub init_method: String,
    /// By callee worker name: where a tensor on each of this worker's devices lands on that
    /// worker (`TensorPipeRpcBackendOptions.device_maps`; set with
    /// [`RpcBackendOptions::set_device_map`]). Checked by [`init_rpc`]: every name must be
    /// another worker of the job, and no two devices may map to the same target. Tensors
    /// between workers are host tensors today, which a map leaves on the CPU, as in PyTorch.
    pub device_maps: HashMap<String, HashMap<Device, Device>>,
}

impl Default for RpcBackendOptions {
    fn default() -> Self {
        RpcBackendOptions {
            rpc_timeout: Duration::from_secs(60),
            num_worker_threads: 1,
            init_method: "env://".into(),
            device_maps: HashMap::new(),
        }
    }
}

impl RpcBackendOptions {
    /// Adds `map` (this worker's device -> `to`'s device) to the device map towards worker
    /// `to` (`set_device_map`); entries for the same source device are replaced.
    ///
    /// ```
    /// use std::collections::HashMap;
    /// use tensorplay as tp;
    /// use tp::Device;
    /// let mut o = tp::distributed::rpc::RpcBackendOptions::default();
    /// o.set_device_map("worker1", HashMap::from([(Device::Cuda(0), Device::Cuda(1))]));
    /// assert_eq!(o.device_maps["worker1"][&Device::Cuda(0)], Device::Cuda(1));
    /// ```
    pub fn set_device_map(&mut self, to: &str, map: HashMap<Device, Device>) -> &mut Self {
        self.device_maps
            .entry(to.to_string())
            .or_default()
            .extend(map);
        self
    }
}

/// Checks `maps` against the job's workers (see [`RpcBackendOptions::device_maps`]).
fn check_device_maps(
    maps: &HashMap<String, HashMap<Device, Device>>,
    me: &str,
    workers: &[WorkerInfo],
) -> Result<()> {
    for (to, map) in maps {
        if to == me || !workers.iter().any(|w| w.name == *to) {
            return Err(Error::invalid(
                "init_rpc",
                "device_maps",
                "names of the other workers of the job",
                format!("a map for {to:?}, which is not another worker"),
            ));
        }
        let mut targets: Vec<Device> = map.values().copied().collect();
        targets.sort_by_key(|d| format!("{d}"));
        if let Some(w) = targets.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::invalid(
                "init_rpc",
                "device_maps",
                "a one-to-one map of devices",
                format!("two devices mapped to {} on {to:?}", w[0]),
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// the function registry

/// What a call's handler gets besides its arguments.
pub(crate) struct CallCtx {
    /// The caller.
    pub(crate) caller: usize,
}

type Handler = Arc<dyn Fn(&CallCtx, &[u8], Vec<Tensor>) -> Result<Encoder> + Send + Sync>;

type RemoteHandler =
    Arc<dyn Fn(&CallCtx, &[u8], Vec<Tensor>) -> Result<crate::rref::Stored> + Send + Sync>;

pub(crate) struct Registered {
    pub(crate) sig: String,
    pub(crate) handler: Handler,
    /// The same function keeping its result as an RRef's value.
    pub(crate) remote: RemoteHandler,
}

pub(crate) static REGISTRY: LazyLock<RwLock<HashMap<String, Arc<Registered>>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));

/// The signature string checked between caller and callee.
pub(crate) fn signature<A, R>() -> String {
    format!(
        "({}) -> {}",
        std::any::type_name::<A>(),
        std::any::type_name::<R>()
    )
}

/// Registers `f` as the remote function `name`: any worker of the job may call it with
/// [`rpc_sync`], [`rpc_async`] or [`remote`](crate::remote). Workers built from the same code
/// register the same functions (call `register` before `init_rpc`, or at least before a peer
/// calls). `A` is the argument (a tuple for several), `R` the result; a caller using other
/// types gets an error naming both signatures. Registering a name again replaces it.
///
/// ```
/// use tensorplay as tp;
/// use tp::Tensor;
/// use tp::distributed::rpc;
///
/// rpc::register("add", |(a, b): (Tensor, Tensor)| a.add(&b));
/// ```
pub fn register<A, R, F>(name: &str, f: F)
where
    A: Wire,
    R: Wire + Clone + Sync,
    F: Fn(A) -> tensorplay_core::Result<R> + Send + Sync + 'static,
{
    let f = Arc::new(f);
    let (fname, f2, fname2) = (name.to_string(), f.clone(), name.to_string());
    let handler: Handler = Arc::new(move |ctx: &CallCtx, payload: &[u8], tensors| {
        let args: A = decode_args(
            payload,
            tensors,
            ctx.caller,
            &format!("arguments of {fname}"),
        )?;
        let r = f(args).map_err(from_core)?;
        encode_value(&r, ctx.caller)
    });
    let remote: RemoteHandler = Arc::new(move |ctx: &CallCtx, payload: &[u8], tensors| {
        let args: A = decode_args(
            payload,
            tensors,
            ctx.caller,
            &format!("arguments of {fname2}"),
        )?;
        Ok(crate::rref::Stored::new(f2(args).map_err(from_core)?))
    });
    REGISTRY.write().unwrap_or_else(|e| e.into_inner()).insert(
        name.to_string(),
        Arc::new(Registered {
            sig: signature::<A, R>(),
            handler,
            remote,
        }),
    );
}

/// A core error back into an RPC error, unwrapping RPC errors carried as `External`.
pub(crate) fn from_core(e: tensorplay_core::Error) -> Error {
    if let Some(inner) = e.downcast_ref::<Error>() {
        return inner.clone();
    }
    Error::Core(e)
}

// ---------------------------------------------------------------------------------------------
// the agent

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

/// The most transport threads [`RpcBackendOptions::num_worker_threads`] may ask for.
const MAX_WORKER_THREADS: usize = 1024;

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

fn check_name(name: &str) -> Result<()> {
    let bad = |why: &str| Error::invalid("init_rpc", "name", why, format!("{name:?}"));
    if name.is_empty() {
        return Err(bad("a non-empty worker name"));
    }
    if name.len() >= 128 {
        return Err(bad("a worker name shorter than 128 characters"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | ':'))
    {
        return Err(bad(
            "a worker name of letters, digits, '_', '-' and ':' (Worker name must match [A-Za-z0-9_:-]+)",
        ));
    }
    Ok(())
}

/// The address to bind: loopback when the master is local, else the address this host uses
/// to reach the master.
fn local_ip(store_addr: Option<SocketAddr>) -> IpAddr {
    match store_addr {
        Some(a) if a.ip().is_loopback() => a.ip(),
        Some(a) => UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
            .and_then(|s| {
                s.connect(a)?;
                s.local_addr()
            })
            .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |l| l.ip()),
        None => IpAddr::V4(Ipv4Addr::LOCALHOST),
    }
}

fn master_addr(init: &InitMethod) -> Option<SocketAddr> {
    use std::net::ToSocketAddrs;
    let (h, p) = match init {
        InitMethod::Tcp { host, port } => (host.clone(), *port),
        InitMethod::Env => (
            std::env::var("MASTER_ADDR").ok()?,
            std::env::var("MASTER_PORT").ok()?.parse().ok()?,
        ),
    };
    (h.as_str(), p).to_socket_addrs().ok()?.next()
}

/// Starts RPC in this process (`torch.distributed.rpc.init_rpc`): rendezvous through the
/// job's store (shared with the process group, under its own prefix; either may come first),
/// a fresh certificate whose fingerprint is published there, a QUIC endpoint, and a barrier
/// until all `world_size` workers are up. Names must be unique, non-empty, shorter than 128
/// characters of `[A-Za-z0-9_:-]`. After [`shutdown`], `init_rpc` may be called again.
///
/// # Errors
/// [`Error::InvalidArgument`] for a bad or duplicate name, a bad rank, world size (at most
/// `u32::MAX`), thread count or init method, or when RPC is already initialised (or being
/// initialised by another thread); store and rendezvous errors ([`Error::Collectives`]) when the
/// other workers do not arrive within the timeout; [`Error::Transport`] when the endpoint cannot
/// be created.
pub fn init_rpc(
    name: &str,
    rank: usize,
    world_size: usize,
    options: RpcBackendOptions,
) -> Result<()> {
    check_name(name)?;
    // one initialisation at a time: a second thread gets an error instead of a second agent
    let _init = match INIT.try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => {
            return Err(Error::invalid(
                "init_rpc",
                "state",
                "RPC not initialized yet in this process (call shutdown first)",
                "RPC is being initialized by another thread",
            ));
        }
    };
    if is_initialized() {
        return Err(Error::invalid(
            "init_rpc",
            "state",
            "RPC not initialized yet in this process (call shutdown first)",
            "RPC is already initialized",
        ));
    }
    if options.num_worker_threads > MAX_WORKER_THREADS {
        return Err(Error::invalid(
            "init_rpc",
            "num_worker_threads",
            format!("at most {MAX_WORKER_THREADS} threads"),
            options.num_worker_threads,
        ));
    }
    if rank >= world_size {
        return Err(Error::invalid(
            "init_rpc",
            "rank",
            format!("a rank in 0..{world_size}"),
            rank,
        ));
    }
    // ranks travel as u32 (and the store counts arrivals in an i64)
    if world_size > u32::MAX as usize {
        return Err(Error::invalid(
            "init_rpc",
            "world_size",
            format!("at most {} workers", u32::MAX),
            world_size,
        ));
    }
    let init: InitMethod = options.init_method.parse()?;
    crate::autograd::register_builtins();
    crate::optim::register_builtins();
    crate::optim::reset();
    let rdv_timeout = if options.rpc_timeout.is_zero() {
        Duration::from_secs(3600)
    } else {
        options.rpc_timeout
    };
    let info = rendezvous_scoped(&init, Some(rank), Some(world_size), rdv_timeout, "rpc")?;
    let store = info.store;
    *LAST_STORE.lock().unwrap_or_else(|e| e.into_inner()) = Some(store.clone());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(options.num_worker_threads.max(1))
        .thread_name(format!("tp-rpc-{name}"))
        .enable_all()
        .build()
        .map_err(|e| Error::Transport(format!("starting the runtime: {e}")))?;
    let handle = runtime.handle().clone();
    let mut runtime = RuntimeGuard(Some(runtime));
    let id = Identity::generate()?;
    // bind first, publish our address and fingerprint, then learn everyone's
    let ip = local_ip(master_addr(&init));
    let socket =
        UdpSocket::bind((ip, 0)).map_err(|e| Error::Transport(format!("bind {ip}: {e}")))?;
    let sref = socket2::SockRef::from(&socket);
    let _ = sref.set_recv_buffer_size(8 << 20);
    let _ = sref.set_send_buffer_size(8 << 20);
    let addr = socket
        .local_addr()
        .map_err(|e| Error::Transport(e.to_string()))?;
    store.set(&format!("name/{rank}"), name.as_bytes())?;
    store.set(&format!("addr/{rank}"), addr.to_string().as_bytes())?;
    store.set(
        &format!("fp/{rank}"),
        tls::hex(&id.fingerprint()).as_bytes(),
    )?;
    // the shared-memory path: our directory, and which peers share this host's /dev/shm
    let shm_root = Path::new(shm::ROOT);
    let shm_dir = if shm::enabled() {
        ShmDir::create(shm_root, shm::min_bytes(), shm::budget())
            .inspect_err(|e| tracing::debug!(error = %e, "no shared-memory path"))
            .ok()
    } else {
        None
    };
    store.set(
        &format!("shm/{rank}"),
        shm_dir
            .as_ref()
            .map(ShmDir::advert)
            .unwrap_or_default()
            .as_bytes(),
    )?;
    let mut workers = Vec::with_capacity(world_size);
    let mut addrs = Vec::with_capacity(world_size);
    let mut fps = Vec::with_capacity(world_size);
    for r in 0..world_size {
        let n = String::from_utf8_lossy(&store.get(&format!("name/{r}"))?).to_string();
        let a: SocketAddr = String::from_utf8_lossy(&store.get(&format!("addr/{r}"))?)
            .parse()
            .map_err(|_| Error::Transport(format!("worker {r} published a bad address")))?;
        let f = tls::unhex(&String::from_utf8_lossy(&store.get(&format!("fp/{r}"))?))
            .ok_or_else(|| Error::Transport(format!("worker {r} published a bad fingerprint")))?;
        workers.push(WorkerInfo { name: n, id: r });
        addrs.push(a);
        fps.push(f);
    }
    let shm_peers: Vec<Option<PathBuf>> = (0..world_size)
        .map(|r| {
            let advert = store.get(&format!("shm/{r}"))?;
            Ok(shm_dir
                .as_ref()
                .and_then(|_| shm::confirm_peer(shm_root, &advert)))
        })
        .collect::<Result<_>>()?;
    let confirmed: Vec<String> = (0..world_size)
        .filter(|&r| shm_peers[r].is_some())
        .map(|r| r.to_string())
        .collect();
    store.set(
        &format!("shm-confirmed/{rank}"),
        confirmed.join(",").as_bytes(),
    )?;
    let shm_send: Vec<bool> = (0..world_size)
        .map(|r| {
            let c = store.get(&format!("shm-confirmed/{r}"))?;
            Ok(shm_dir.is_some()
                && String::from_utf8_lossy(&c)
                    .split(',')
                    .any(|x| x == rank.to_string()))
        })
        .collect::<Result<_>>()?;
    tracing::debug!(
        worker = name,
        ?shm_send,
        "shared-memory path to these ranks"
    );
    // every worker learns whether any device map is bad, so that none waits for the others
    let maps = check_device_maps(&options.device_maps, name, &workers);
    let verdict = maps
        .as_ref()
        .err()
        .map(ToString::to_string)
        .unwrap_or_default();
    store.set(&format!("device-maps/{rank}"), verdict.as_bytes())?;
    maps?;
    for w in &workers {
        let v = store.get(&format!("device-maps/{}", w.id))?;
        if !v.is_empty() {
            return Err(Error::invalid(
                "init_rpc",
                "device_maps",
                "valid device maps on every worker",
                format!(
                    "worker {:?} (rank {}) failed: {}",
                    w.name,
                    w.id,
                    String::from_utf8_lossy(&v)
                ),
            ));
        }
    }
    if let Some(dup) = workers
        .iter()
        .find(|w| workers.iter().filter(|v| v.name == w.name).count() > 1)
    {
        let ranks: Vec<usize> = workers
            .iter()
            .filter(|v| v.name == dup.name)
            .map(|v| v.id)
            .collect();
        return Err(Error::invalid(
            "init_rpc",
            "name",
            "a worker name that is unique in the job",
            format!(
                "{:?}, which is not unique (ranks {ranks:?} use it)",
                dup.name
            ),
        ));
    }
    let verifier = JobVerifier::new(fps.clone());
    let server = tls::server_config(&id, verifier.clone())?;
    let client = tls::client_config(&id, verifier)?;
    let endpoint = {
        let _g = handle.enter();
        let mut ep = quinn::Endpoint::new(
            quinn::EndpointConfig::default(),
            Some(server),
            socket,
            Arc::new(quinn::TokioRuntime),
        )
        .map_err(|e| Error::Transport(format!("QUIC endpoint: {e}")))?;
        ep.set_default_client_config(client);
        ep
    };
    let agent = Arc::new(Agent {
        me: WorkerInfo {
            name: name.to_string(),
            id: rank,
        },
        workers,
        addrs,
        handle: handle.clone(),
        runtime: Mutex::new(runtime.0.take()),
        endpoint: endpoint.clone(),
        conns: Mutex::new(HashMap::new()),
        fingerprints: fps,
        default_timeout: Mutex::new(options.rpc_timeout),
        store: store.clone(),
        inflight: AtomicUsize::new(0),
        serving: AtomicUsize::new(0),
        rrefs: RRefContext::default(),
        contexts: Mutex::new(crate::proto::context::ContextTable::new(
            rank,
            crate::autograd::released_horizon(options.rpc_timeout),
        )),
        shutdowns: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
        shm: shm_dir,
        shm_peers,
        shm_send,
    });
    handle.spawn(accept_loop(agent.clone(), endpoint));
    *AGENT.write().unwrap_or_else(|e| e.into_inner()) = Some(agent.clone());
    // everyone serves before anyone returns
    let infos = agent.workers.clone();
    if let Err(e) = store_barrier(
        &*store,
        "init",
        rank,
        world_size,
        rdv_timeout,
        "init_rpc",
        &infos,
    ) {
        AGENT.write().unwrap_or_else(|e| e.into_inner()).take();
        agent.close();
        return Err(e);
    }
    tracing::debug!(worker = name, rank, world_size, %addr, "rpc initialized");
    Ok(())
}

/// The agent's runtime while `init_rpc` builds the agent: stopped (see [`stop_runtime`]) when
/// the initialisation fails.
struct RuntimeGuard(Option<tokio::runtime::Runtime>);

impl Drop for RuntimeGuard {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            stop_runtime(rt);
        }
    }
}

/// Stops the agent's runtime, waiting a moment for its threads; without waiting when called
/// from async code (a user's runtime, or a function running on the agent's own), where
/// blocking to drop a runtime would panic.
fn stop_runtime(rt: tokio::runtime::Runtime) {
    if tokio::runtime::Handle::try_current().is_ok() {
        rt.shutdown_background();
    } else {
        rt.shutdown_timeout(Duration::from_secs(1));
    }
}

/// Adds worker `rank` to the barrier `key` and waits until `n` workers arrived; when they do
/// not within `timeout`, [`Error::WorkerUnreachable`] names the workers that never arrived
/// (`workers` gives their names when known) and `what` they did not reach.
fn store_barrier(
    store: &dyn Store,
    key: &str,
    rank: usize,
    n: usize,
    timeout: Duration,
    what: &str,
    workers: &[WorkerInfo],
) -> Result<()> {
    store.set(&format!("barrier/{key}/r{rank}"), b"1")?;
    let arrived = store.add(&format!("barrier/{key}"), 1)?;
    if arrived >= n as i64 {
        store.set(&format!("barrier/{key}/done"), b"1")?;
    }
    let done = format!("barrier/{key}/done");
    match store.wait(&[&done], timeout) {
        Ok(()) => Ok(()),
        Err(tensorplay_collectives::Error::Timeout { .. }) => {
            let missing: Vec<String> = (0..n)
                .filter(|r| {
                    !store
                        .check(&[&format!("barrier/{key}/r{r}")])
                        .unwrap_or(false)
                })
                .map(|r| {
                    workers
                        .get(r)
                        .map_or_else(|| format!("rank {r}"), |w| format!("{} (rank {r})", w.name))
                })
                .collect();
            Err(Error::WorkerUnreachable {
                worker: missing.join(", "),
                op: what.to_string(),
                detail: format!("did not reach {what} within {timeout:?} (dead, or still busy)"),
            })
        }
        Err(other) => Err(Error::Collectives(other)),
    }
}

/// Stops RPC in this process (`torch.distributed.rpc.shutdown`). Graceful: waits until this
/// worker's outgoing calls finished, until every worker reached shutdown, and until the RRef
/// deletions it owes were delivered (so every owner's table is empty afterwards), then closes
/// the endpoint; worker 0, which serves the job's store, returns last. Not graceful: closes at
/// once. Either way `init_rpc` may be called again: the store stays open in this process for
/// it (under a new prefix).
///
/// A graceful shutdown cannot be called by a remote function (it would wait for the call
/// that runs it); a non-graceful one can.
///
/// # Errors
/// [`Error::NotInitialized`]; [`Error::Timeout`] when other workers do not reach shutdown
/// within the RPC timeout (the agent is still closed); [`Error::InvalidArgument`] for a
/// graceful shutdown inside a remote function (RPC stays initialised).
pub fn shutdown(graceful: bool) -> Result<()> {
    let a = agent("shutdown")?;
    if graceful && IN_FUNCTION.get() {
        return Err(Error::invalid(
            "shutdown",
            "graceful",
            "shutdown(true) outside remote functions (it waits for every call in flight, the one running it included), or shutdown(false)",
            "shutdown(true) called by a remote function",
        ));
    }
    let res = if graceful { a.graceful() } else { Ok(()) };
    AGENT.write().unwrap_or_else(|e| e.into_inner()).take();
    a.close();
    crate::optim::reset();
    res
}

impl Agent {
    fn timeout_or_default(&self, t: Option<Duration>) -> Option<Duration> {
        let t = t.unwrap_or_else(|| {
            *self
                .default_timeout
                .lock()
                .unwrap_or_else(|e| e.into_inner())
        });
        (!t.is_zero()).then_some(t)
    }

    fn graceful(self: &Arc<Self>) -> Result<()> {
        let limit = self
            .timeout_or_default(None)
            .unwrap_or(Duration::from_secs(3600));
        let n = self.workers.len();
        let k = self.shutdowns.fetch_add(1, Ordering::SeqCst);
        // 1. our own calls are answered
        let start = Instant::now();
        while self.inflight.load(Ordering::SeqCst) > 0 && start.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(2));
        }
        // 2. everyone stopped issuing work
        store_barrier(
            &*self.store,
            &format!("shutdown{k}/a"),
            self.me.id,
            n,
            limit,
            "shutdown",
            &self.workers,
        )?;
        // 3. RRef deletions delivered to their owners (acknowledged)
        self.rrefs.flush(self, limit)?;
        // 4. every worker delivered its deletions and served its last call
        store_barrier(
            &*self.store,
            &format!("shutdown{k}/b"),
            self.me.id,
            n,
            limit,
            "shutdown",
            &self.workers,
        )?;
        let start = Instant::now();
        while self.serving.load(Ordering::SeqCst) > 0 && start.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(2));
        }
        store_barrier(
            &*self.store,
            &format!("shutdown{k}/c"),
            self.me.id,
            n,
            limit,
            "shutdown",
            &self.workers,
        )?;
        // 5. rank 0 serves the store: it leaves last, once the others are done with it (its
        //    process may exit right after). The last one out tells it; the reply to that may
        //    be lost when rank 0 is already gone, which is fine.
        let left = format!("shutdown{k}/left");
        if self.me.id != 0 {
            if self.store.add(&left, 1)? >= n as i64 - 1 {
                let _ = self.store.set(&format!("{left}/done"), b"1");
            }
        } else if n > 1 {
            let done = format!("{left}/done");
            self.store.wait(&[&done], limit).map_err(|e| match e {
                tensorplay_collectives::Error::Timeout { .. } => Error::Timeout {
                    op: "shutdown (waiting for the other workers to leave)".into(),
                    worker: "the job".into(),
                    timeout: limit,
                },
                other => Error::Collectives(other),
            })?;
        }
        Ok(())
    }

    fn close(&self) {
        self.endpoint.close(0u32.into(), b"shutdown");
        if let Some(d) = &self.shm {
            d.close();
        }
        shm::forget_peer_mappings();
        self.rrefs.clear();
        if let Some(rt) = self
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            stop_runtime(rt);
        }
    }

    /// This worker's shared-memory directory when `rank` can read it.
    fn shm_to(&self, rank: usize) -> Option<&ShmDir> {
        self.shm.as_ref().filter(|_| self.shm_send[rank])
    }

    /// `rank`'s shared-memory directory when this worker can read it.
    fn shm_from(&self, rank: usize) -> Option<&Path> {
        self.shm_peers[rank].as_deref()
    }

    /// The rank of `to`.
    pub(crate) fn resolve(&self, to: &To) -> Result<usize> {
        let known = || {
            self.workers
                .iter()
                .map(|w| format!("{}={}", w.id, w.name))
                .collect::<Vec<_>>()
                .join(", ")
        };
        match to {
            To::Rank(r) if *r < self.workers.len() => Ok(*r),
            To::Rank(r) => Err(Error::UnknownWorker {
                name: format!("rank {r}"),
                known: known(),
            }),
            To::Name(n) => self
                .workers
                .iter()
                .find(|w| &w.name == n)
                .map(|w| w.id)
                .ok_or_else(|| Error::UnknownWorker {
                    name: format!("{n:?}"),
                    known: known(),
                }),
        }
    }

    /// The connection to `rank`, connecting on first use.
    async fn conn(&self, rank: usize) -> Result<quinn::Connection> {
        let cell = {
            let mut m = self.conns.lock().unwrap_or_else(|e| e.into_inner());
            m.entry(rank)
                .or_insert_with(|| Arc::new(tokio::sync::OnceCell::new()))
                .clone()
        };
        let unreachable = |detail: String| Error::WorkerUnreachable {
            worker: self.workers[rank].name.clone(),
            op: "connect".into(),
            detail,
        };
        let c = cell
            .get_or_try_init(|| async {
                let connecting = self
                    .endpoint
                    .connect(self.addrs[rank], tls::SERVER_NAME)
                    .map_err(|e| unreachable(e.to_string()))?;
                connecting.await.map_err(|e| unreachable(e.to_string()))
            })
            .await?
            .clone();
        if let Some(reason) = c.close_reason() {
            // the connection died: forget it so the next call reconnects (and fails fast if the
            // worker is gone)
            self.conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&rank);
            return Err(unreachable(reason.to_string()));
        }
        Ok(c)
    }

    /// Sends one request to `to` and returns the response (its error turned into
    /// [`Error::Remote`]).
    pub(crate) async fn request(
        self: Arc<Self>,
        to: usize,
        mut env: Envelope,
        tensors: Vec<Tensor>,
        timeout: Option<Duration>,
        op: String,
    ) -> Result<(Envelope, Vec<Tensor>)> {
        let worker = self.workers[to].name.clone();
        let t0 = Instant::now();
        // quiet unless a subscriber enables DEBUG for this crate
        let span = tracing::debug_span!(
            "rpc",
            worker = %worker,
            function = %op,
            bytes_sent = tracing::field::Empty,
            bytes_received = tracing::field::Empty,
            latency_us = tracing::field::Empty,
        );
        let fut = {
            let this = self.clone();
            let op = op.clone();
            let worker = worker.clone();
            async move {
                let c = this.conn(to).await?;
                let lost = |e: &dyn std::fmt::Display| Error::WorkerUnreachable {
                    worker: worker.clone(),
                    op: op.clone(),
                    detail: e.to_string(),
                };
                let (mut send, mut recv) = c.open_bi().await.map_err(|e| lost(&e))?;
                env.sender = this.me.id as u32;
                let sent = write_frame(&mut send, &mut env, &tensors, this.shm_to(to))
                    .await
                    .map_err(|e| match c.close_reason() {
                        Some(r) => lost(&r),
                        None => e,
                    })?;
                let _ = send.finish();
                let resp = read_frame(&mut recv, this.shm_from(to))
                    .await
                    .map_err(|e| match c.close_reason() {
                        Some(r) => lost(&r),
                        None => match e {
                            Error::Transport(m) => lost(&m),
                            other => other,
                        },
                    })?;
                this.bytes.fetch_add(sent, Ordering::Relaxed);
                let span = tracing::Span::current();
                span.record("bytes_sent", sent);
                span.record("bytes_received", received_bytes(&resp));
                Ok::<_, Error>((resp, c))
            }
        };
        let fut = tracing::Instrument::instrument(fut, span.clone());
        let res = match timeout {
            Some(t) => match tokio::time::timeout(t, fut).await {
                Ok(r) => r,
                Err(_) => {
                    // tell a dead worker from a slow one
                    let dead = self
                        .conns
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get(&to)
                        .and_then(|c| c.get().and_then(quinn::Connection::close_reason));
                    return Err(match dead {
                        Some(r) => Error::WorkerUnreachable {
                            worker,
                            op,
                            detail: r.to_string(),
                        },
                        None => Error::Timeout {
                            op,
                            worker,
                            timeout: t,
                        },
                    });
                }
            },
            None => fut.await,
        };
        let ((resp, tensors), _c) = match res {
            Ok(((env, ts), c)) => ((env, ts), c),
            Err(e) => return Err(e),
        };
        span.record("latency_us", t0.elapsed().as_micros() as u64);
        span.in_scope(|| tracing::debug!(ok = resp.error.is_none(), "rpc done"));
        if let Some(e) = resp.error {
            return Err(Error::Remote {
                worker: e.worker,
                kind: e.kind,
                message: e.message,
            });
        }
        Ok((resp, tensors))
    }

    /// Runs `fut` on the runtime, completing a future with its result; counts it in flight.
    pub(crate) fn spawn_call<T: Send + 'static>(
        self: &Arc<Self>,
        fut: impl Future<Output = Result<T>> + Send + 'static,
    ) -> RpcFuture<T> {
        let (f, p): (RpcFuture<T>, Promise<T>) = RpcFuture::pending();
        self.inflight.fetch_add(1, Ordering::SeqCst);
        let this = self.clone();
        self.handle.spawn(async move {
            let r = fut.await;
            this.inflight.fetch_sub(1, Ordering::SeqCst);
            p.complete(r);
        });
        f
    }
}

/// The bytes of a received message: its payload and its tensors' data.
fn received_bytes(m: &(Envelope, Vec<Tensor>)) -> u64 {
    let tensors: usize =
        m.1.iter()
            .map(|t| t.numel() * t.dtype().size_in_bytes())
            .sum();
    (m.0.payload.len() + tensors) as u64
}

// ---------------------------------------------------------------------------------------------
// serving

async fn accept_loop(agent: Arc<Agent>, endpoint: quinn::Endpoint) {
    while let Some(incoming) = endpoint.accept().await {
        let agent = agent.clone();
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else {
                // a refused handshake (a foreign certificate) or a lost peer
                return;
            };
            let Some(peer) = peer_rank(&agent, &conn) else {
                conn.close(1u32.into(), b"unknown certificate");
                return;
            };
            while let Ok((send, recv)) = conn.accept_bi().await {
                let agent = agent.clone();
                tokio::spawn(serve_stream(agent, peer, send, recv));
            }
        });
    }
}

/// The rank whose certificate the peer presented.
fn peer_rank(agent: &Agent, conn: &quinn::Connection) -> Option<usize> {
    let id = conn.peer_identity()?;
    let certs = id
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .ok()?;
    let fp = tls::fingerprint(certs.first()?);
    agent.fingerprints.iter().position(|f| *f == fp)
}

async fn serve_stream(
    agent: Arc<Agent>,
    peer: usize,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    agent.serving.fetch_add(1, Ordering::SeqCst);
    let (mut resp, tensors) = match read_frame(&mut recv, agent.shm_from(peer)).await {
        Ok((env, ts)) if env.sender as usize == peer => dispatch(&agent, peer, env, ts).await,
        Ok((env, _)) => (
            error_env(
                &agent,
                &Error::Serialization(format!(
                    "message claims to come from rank {} but the connection is rank {peer}'s",
                    env.sender
                )),
            ),
            vec![],
        ),
        // malformed input: answer with the error if the stream still works, never panic
        Err(e) => (error_env(&agent, &e), vec![]),
    };
    resp.kind = kind::RESPONSE;
    resp.sender = agent.me.id as u32;
    let written = write_frame(&mut send, &mut resp, &tensors, agent.shm_to(peer)).await;
    if let Ok(n) = &written {
        agent.bytes.fetch_add(*n, Ordering::Relaxed);
    }
    if let Err(e) = written {
        // a response that cannot be encoded becomes an error response
        let mut env = error_env(&agent, &e);
        let _ = write_frame(&mut send, &mut env, &[], None).await;
    }
    let _ = send.finish();
    agent.serving.fetch_sub(1, Ordering::SeqCst);
}

pub(crate) fn error_env(agent: &Agent, e: &Error) -> Envelope {
    let me = || agent.me.name.clone();
    let (worker, kind, message) = match e {
        // an error of a nested call still names the worker where it happened
        Error::Remote {
            worker,
            kind,
            message,
        } => (
            if worker.is_empty() {
                me()
            } else {
                worker.clone()
            },
            kind.clone(),
            message.clone(),
        ),
        Error::Autograd { worker, message } => (worker.clone(), "Autograd".into(), message.clone()),
        Error::Core(c) => (me(), crate::error::core_kind(c), c.to_string()),
        other => (me(), other.kind(), other.to_string()),
    };
    Envelope {
        kind: kind::RESPONSE,
        error: Some(RemoteErr {
            worker,
            kind,
            message,
        }),
        ..Envelope::default()
    }
}

/// Runs a user function (which may block, sleep or make RPCs itself), catching panics.
///
/// On the agent's multi-threaded runtime the function runs right here, on the I/O thread that
/// read the request, through `block_in_place`: the runtime first hands this thread's queue of
/// tasks to another thread, so the transport keeps running while the function blocks, and
/// nested calls cannot deadlock. Compared with `spawn_blocking`, a cheap function saves two
/// thread hand-offs (to the pool and back) on the critical path of every call. Elsewhere (a
/// current-thread runtime) it falls back to tokio's blocking pool.
pub(crate) async fn run_blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let guarded = move || {
        let was = IN_FUNCTION.replace(true);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        IN_FUNCTION.set(was);
        r
    };
    let r = match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(guarded),
        _ => tokio::task::spawn_blocking(guarded)
            .await
            .map_err(|e| Error::Transport(format!("worker task failed: {e}")))?,
    };
    r.unwrap_or_else(|p| {
        Err(Error::Remote {
            worker: String::new(),
            kind: "Panic".into(),
            message: panic_message(&*p),
        })
    })
}

/// The message of a caught panic.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

thread_local! {
    /// Set while this thread runs a remote function (see [`run_blocking`]).
    static IN_FUNCTION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

async fn dispatch(
    agent: &Arc<Agent>,
    peer: usize,
    env: Envelope,
    tensors: Vec<Tensor>,
) -> (Envelope, Vec<Tensor>) {
    let r = match env.kind {
        kind::CALL => call_function(agent, peer, &env, tensors).await,
        kind::CHILD_ACCEPT => crate::rref::child_accepted(agent, &env).map(|_| Encoder::default()),
        _ => crate::rref::dispatch(agent, peer, env, tensors).await,
    };
    match r {
        Ok(enc) => (
            Envelope {
                payload: enc.bytes,
                autograd: enc.autograd,
                ..Envelope::default()
            },
            enc.tensors,
        ),
        Err(e) => (error_env(agent, &e), vec![]),
    }
}

/// Looks up a registered function and checks the caller's signature.
pub(crate) fn lookup(func: &str, sig: &str) -> Result<Arc<Registered>> {
    let reg = REGISTRY
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(func)
        .cloned()
        .ok_or_else(|| Error::Remote {
            worker: String::new(),
            kind: "UnknownFunction".into(),
            message: format!(
                "no function named {func:?} is registered on this worker (register it with tensorplay::distributed::rpc::register on every worker)"
            ),
        })?;
    if reg.sig != sig {
        return Err(Error::Remote {
            worker: String::new(),
            kind: "Signature".into(),
            message: format!(
                "function {func:?} is registered as {} but was called as {sig}",
                reg.sig
            ),
        });
    }
    Ok(reg)
}

async fn call_function(
    agent: &Arc<Agent>,
    peer: usize,
    env: &Envelope,
    tensors: Vec<Tensor>,
) -> Result<Encoder> {
    let reg = lookup(&env.func, &env.sig)?;
    let payload = env.payload.clone();
    let (ctx, tensors) = crate::autograd::incoming(&env.autograd, peer, tensors, true)?;
    let me = agent.me.id;
    run_blocking(move || {
        crate::autograd::respond(ctx, me, peer, || {
            (reg.handler)(&CallCtx { caller: peer }, &payload, tensors)
        })
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// the public calls

/// Calls the registered function `func` on worker `to` with `args` and blocks for its result
/// (`rpc_sync`). `timeout`: `None` uses the default (see [`RpcBackendOptions`]), `Some(ZERO)`
/// waits forever. Calls to this worker itself work; `func` may itself make RPCs.
///
/// Do not call it from async code running on a runtime (use [`rpc_async`] and `.await`).
///
/// # Errors
/// [`Error::Remote`] with the worker's name, a `kind` and a message: the variant name of the
/// function's error (`InvalidArgument`, `ShapeMismatch`, `Custom`, ...), or `UnknownFunction`
/// (not registered there), `Signature` (the argument or result types differ from the
/// registered ones; the message names both), `Panic` (the function panicked);
/// [`Error::Timeout`]; [`Error::WorkerUnreachable`] when the worker died or cannot be reached;
/// [`Error::UnknownWorker`]; [`Error::NotInitialized`]; [`Error::Serialization`] when a value
/// cannot be encoded or a reply cannot be decoded.
pub fn rpc_sync<A: Wire, R: Wire>(
    to: impl Into<To>,
    func: &str,
    args: A,
    timeout: Option<Duration>,
) -> Result<R> {
    rpc_async(to, func, args, timeout)?.wait()
}

/// Like [`rpc_sync`] but returns at once with an [`RpcFuture`] of the result (`rpc_async`).
///
/// # Errors
/// As [`rpc_sync`]; arguments that cannot be encoded and unknown workers are reported here,
/// everything else through the future.
pub fn rpc_async<A: Wire, R: Wire>(
    to: impl Into<To>,
    func: &str,
    args: A,
    timeout: Option<Duration>,
) -> Result<RpcFuture<R>> {
    let a = agent("rpc_async")?;
    let to = a.resolve(&to.into())?;
    let enc = encode_value(&args, to)?;
    let env = Envelope {
        kind: kind::CALL,
        func: func.to_string(),
        sig: signature::<A, R>(),
        autograd: crate::autograd::request_header(&enc.tensors, a.me.id, to),
        payload: enc.bytes,
        ..Envelope::default()
    };
    let timeout = a.timeout_or_default(timeout);
    let op = format!("rpc {func}");
    let what = format!("result of {func}");
    let a2 = a.clone();
    let forks = enc.forks;
    Ok(a.spawn_call(async move {
        let r = a2.clone().request(to, env, enc.tensors, timeout, op).await;
        crate::rref::after_send(&a2, forks, r.is_ok());
        let (resp, tensors) = r?;
        let (_, tensors) = crate::autograd::incoming(&resp.autograd, to, tensors, false)?;
        decode_value::<R>(&resp.payload, tensors, to, &what)
    }))
}

/// The UDP address this worker's QUIC endpoint listens on (for tests that play a foreign
/// peer).
///
/// # Errors
/// [`Error::NotInitialized`]; [`Error::Transport`] when the socket has no address.
#[doc(hidden)]
pub fn local_addr() -> Result<SocketAddr> {
    agent("local_addr")?
        .endpoint
        .local_addr()
        .map_err(|e| Error::Transport(e.to_string()))
}

/// Bytes this worker has sent since `init_rpc`: its requests and its responses, message
/// headers and tensor data (also the data that went through shared memory).
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn bytes_sent() -> Result<u64> {
    Ok(agent("bytes_sent")?.bytes.load(Ordering::Relaxed))
}

/// This worker's [`WorkerInfo`] (`get_worker_info()`).
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn current_worker() -> Result<WorkerInfo> {
    Ok(agent("get_worker_info")?.me.clone())
}

/// The [`WorkerInfo`] of a worker by name or rank (`get_worker_info(name)`).
///
/// # Errors
/// [`Error::UnknownWorker`], [`Error::NotInitialized`].
pub fn get_worker_info(to: impl Into<To>) -> Result<WorkerInfo> {
    let a = agent("get_worker_info")?;
    let r = a.resolve(&to.into())?;
    Ok(a.workers[r].clone())
}

/// Every worker of the job, by id.
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn get_worker_infos() -> Result<Vec<WorkerInfo>> {
    Ok(agent("get_worker_infos")?.workers.clone())
}

/// The default timeout of calls issued from now on (`rpc.get_rpc_timeout`).
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn get_rpc_timeout() -> Result<Duration> {
    Ok(*agent("get_rpc_timeout")?
        .default_timeout
        .lock()
        .unwrap_or_else(|e| e.into_inner()))
}

/// Changes the default timeout of calls issued from now on (`rpc._set_rpc_timeout`); calls in
/// flight keep theirs. `Duration::ZERO` means no timeout.
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn set_rpc_timeout(timeout: Duration) -> Result<()> {
    *agent("set_rpc_timeout")?
        .default_timeout
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = timeout;
    Ok(())
}
