//! Starting RPC ([`init_rpc`]): checks, rendezvous through the job's store, the QUIC endpoint and
//! the shared-memory path, and the store barrier that `init_rpc` and `shutdown` wait in.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tensorplay_collectives::rendezvous::{InitMethod, rendezvous_scoped};
use tensorplay_collectives::store::Store;

use super::options::{RpcBackendOptions, WorkerInfo, check_device_maps};
use super::server::accept_loop;
#[cfg(doc)]
use super::shutdown::shutdown;
use super::{AGENT, Agent, INIT, LAST_STORE, is_initialized};
use crate::rref::RRefContext;
use crate::shm::{self, ShmDir};
use crate::tls::{self, Identity, JobVerifier};
use crate::{Error, Result};

/// The most transport threads [`RpcBackendOptions::num_worker_threads`] may ask for.
const MAX_WORKER_THREADS: usize = 1024;

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
        InitMethod::Env => {
            // torchrun's variables, else Slurm's or Open MPI's (as the rendezvous reads them)
            let var = |n: &str| tensorplay_collectives::launch_env::lookup_env(n).map(|f| f.value);
            (
                var("MASTER_ADDR")?,
                var("MASTER_PORT")?.trim().parse().ok()?,
            )
        }
    };
    (h.as_str(), p).to_socket_addrs().ok()?.next()
}

/// Starts RPC in this process (`torch.distributed.rpc.init_rpc`): rendezvous through the
/// job's store (shared with the process group, under its own prefix; either may come first),
/// a fresh certificate whose fingerprint is published there, a QUIC endpoint, and a barrier
/// until all `world_size` workers are up. Names must be unique, non-empty, shorter than 128
/// characters of `[A-Za-z0-9_:-]`. After [`shutdown`](crate::shutdown), `init_rpc` may be
/// called again.
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
        rrefs: RRefContext::new(rank),
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
pub(super) fn stop_runtime(rt: tokio::runtime::Runtime) {
    if tokio::runtime::Handle::try_current().is_ok() {
        rt.shutdown_background();
    } else {
        rt.shutdown_timeout(Duration::from_secs(1));
    }
}

/// Adds worker `rank` to the barrier `key` and waits until `n` workers arrived; when they do
/// not within `timeout`, [`Error::WorkerUnreachable`] names the workers that never arrived
/// (`workers` gives their names when known) and `what` they did not reach.
pub(super) fn store_barrier(
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
