//! Launchers: runtimes that start the job's processes themselves and know their ranks (MPI
//! under `mpirun` or `srun`). A backend crate registers one beside its backend; then
//! `init_process_group(name, ..)` takes the rank and world size from it instead of `RANK` and
//! `WORLD_SIZE`, and rank 0 hands the address of the job's store (which the cross-rank checks,
//! failure reports and flight recorder use) to the others through it, so no `MASTER_ADDR` is
//! needed.

use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};
use std::sync::{Arc, Mutex};

use crate::rendezvous::InitMethod;
use crate::{Error, Result};

/// The shape of a job as its launcher sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchWorld {
    /// This process's rank.
    pub rank: usize,
    /// Number of processes.
    pub size: usize,
    /// This process's rank among those of its host.
    pub local_rank: usize,
    /// Whether every process runs on this host.
    pub single_host: bool,
}

/// A runtime that started this process and knows the job's ranks (see the module docs).
pub trait Launcher: Send + Sync {
    /// This process's place in the job.
    ///
    /// # Errors
    /// The runtime cannot be started or asked (a clear error naming what is missing).
    fn world(&self) -> Result<LaunchWorld>;
    /// Rank 0's `value` on every rank (`value` is `None` on the others), through the runtime.
    ///
    /// # Errors
    /// The runtime's.
    fn broadcast_from_first(&self, value: Option<Vec<u8>>) -> Result<Vec<u8>>;
}

static LAUNCHERS: Mutex<Vec<(String, Arc<dyn Launcher>)>> = Mutex::new(Vec::new());

/// Registers `launcher` for the backend `name`: `init_process_group(name, ..)` without a rank
/// (in its options or `RANK`) asks it for the job's shape.
///
/// # Errors
/// [`Error::InvalidArgument`] when `name` already has one.
pub fn register_launcher(name: &str, launcher: Arc<dyn Launcher>) -> Result<()> {
    let mut l = LAUNCHERS.lock().unwrap_or_else(|e| e.into_inner());
    if l.iter().any(|(n, _)| n == name) {
        return Err(Error::invalid(
            "register_launcher",
            -1,
            "name",
            "a backend without a launcher",
            format!("{name:?}, which has one"),
        ));
    }
    l.push((name.to_string(), launcher));
    Ok(())
}

fn launcher(name: &str) -> Option<Arc<dyn Launcher>> {
    let l = LAUNCHERS.lock().unwrap_or_else(|e| e.into_inner());
    l.iter().find(|(n, _)| n == name).map(|(_, l)| l.clone())
}

/// The init method, rank, world size and local rank `init_process_group` rendezvouses with.
pub(crate) type Launched = (InitMethod, Option<usize>, Option<usize>, Option<usize>);

/// What `init_process_group(backend, ..)` rendezvouses with: `init` and the given rank and
/// world size unchanged, unless `backend` has a launcher and no rank was given (neither in
/// the options nor in `RANK`): then the launcher's rank, size and local rank, and the store
/// at rank 0's address (`MASTER_ADDR`/`MASTER_PORT` when set; else `127.0.0.1` on one host,
/// this host's name's address on several, and a free port), shared through the launcher.
pub(crate) fn launched(
    backend: &str,
    init: InitMethod,
    rank: Option<usize>,
    world_size: Option<usize>,
) -> Result<Launched> {
    let env_rank = crate::launch_env::lookup_env("RANK").is_some();
    let Some(l) = launcher(backend).filter(|_| rank.is_none() && !env_rank) else {
        return Ok((init, rank, world_size, None));
    };
    if !matches!(init, InitMethod::Env) {
        return Ok((init, rank, world_size, None));
    }
    let w = l.world()?;
    let r = w.rank as i64;
    let value = if w.rank == 0 {
        let host = match crate::launch_env::lookup_env("MASTER_ADDR") {
            Some(f) => f.value,
            None if w.single_host => Ipv4Addr::LOCALHOST.to_string(),
            None => host_address(r)?.to_string(),
        };
        let port = match crate::launch_env::lookup_env("MASTER_PORT") {
            Some(f) => f.value.parse::<u16>().map_err(|_| {
                Error::invalid("init_process_group", r, "MASTER_PORT", "a port", f.value)
            })?,
            None => free_port(r)?,
        };
        Some(format!("{host}|{port}").into_bytes())
    } else {
        None
    };
    let shared = l.broadcast_from_first(value)?;
    let text = String::from_utf8_lossy(&shared).into_owned();
    let (host, port) = text
        .split_once('|')
        .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
        .ok_or_else(|| {
            Error::invalid(
                "init_process_group",
                r,
                "the store address from rank 0",
                "host|port",
                &text,
            )
        })?;
    Ok((
        InitMethod::Tcp { host, port },
        Some(w.rank),
        Some(w.size),
        Some(w.local_rank),
    ))
}

/// This host's address as its name resolves (not loopback), for ranks on other hosts.
fn host_address(rank: i64) -> Result<IpAddr> {
    let name = hostname().unwrap_or_default();
    (name.as_str(), 0)
        .to_socket_addrs()
        .ok()
        .into_iter()
        .flatten()
        .map(|a| a.ip())
        .find(|ip| ip.is_ipv4() && !ip.is_loopback())
        .ok_or_else(|| {
            Error::invalid(
                "init_process_group",
                rank,
                "MASTER_ADDR",
                "set to rank 0's address (this host's name does not resolve to one that \
                 other hosts reach)",
                format!("not set; host name {name:?}"),
            )
        })
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
}

/// A port free now on this host (the store's server binds it a moment later).
fn free_port(rank: i64) -> Result<u16> {
    std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Error::Backend {
            backend: "init_process_group".into(),
            detail: format!("rank {rank}: no free port for the store: {e}").into(),
        })
}
