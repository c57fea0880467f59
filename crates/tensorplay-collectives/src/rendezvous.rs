//! Rendezvous: how ranks find each other (`init_method` of `init_process_group`).
//!
//! Rank 0 starts a [`TcpStoreServer`](crate::store::TcpStoreServer) in its process, every rank
//! connects a [`TcpStore`] to it, and all ranks then meet in a barrier on the store so that
//! [`rendezvous`] returns only when the whole world has joined.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::store::{Store, TcpStore};
use crate::{Error, Result};

/// The key counting the ranks that joined the rendezvous barrier.
pub const JOINED_KEY: &str = "rdzv/joined";
/// The key set by the last rank to join, releasing the others.
pub const COMPLETE_KEY: &str = "rdzv/complete";

/// How ranks find the store (`init_method`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InitMethod {
    /// `env://`: `MASTER_ADDR`, `MASTER_PORT` (and `RANK`, `WORLD_SIZE`, `LOCAL_RANK`) from
    /// the environment, as set by [`spawn`](crate::spawn()) or `torchrun`.
    Env,
    /// `tcp://host:port`: the store server runs on rank 0 at `host:port`.
    Tcp {
        /// Host name or IP address of rank 0.
        host: String,
        /// Port of the store server.
        port: u16,
    },
}

impl FromStr for InitMethod {
    type Err = Error;

    /// Parses `"env://"` or `"tcp://host:port"` (IPv6 hosts in brackets: `tcp://[::1]:29500`).
    fn from_str(s: &str) -> Result<InitMethod> {
        let bad = |why: &str| {
            Error::invalid(
                "init_method",
                -1,
                "init_method",
                format!("\"env://\" or \"tcp://host:port\" ({why})"),
                format!("{s:?}"),
            )
        };
        if s == "env://" {
            return Ok(InitMethod::Env);
        }
        let Some(rest) = s.strip_prefix("tcp://") else {
            return Err(bad("unknown scheme"));
        };
        let rest = rest.trim_end_matches('/');
        let Some((host, port)) = rest.rsplit_once(':') else {
            return Err(bad("missing port"));
        };
        let host = match host.strip_prefix('[') {
            Some(h) => h
                .strip_suffix(']')
                .ok_or_else(|| bad("an IPv6 host must be in brackets: tcp://[::1]:29500"))?,
            None => host,
        };
        if host.is_empty() {
            return Err(bad("missing host"));
        }
        let port: u16 = port
            .parse()
            .map_err(|_| bad("the port is not a number in 0..=65535"))?;
        Ok(InitMethod::Tcp {
            host: host.to_string(),
            port,
        })
    }
}

/// The result of [`rendezvous`]: this process's place in the world and the shared store.
#[derive(Clone)]
pub struct RendezvousInfo {
    /// This process's global rank.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank on this machine (`LOCAL_RANK`, else the global rank).
    pub local_rank: usize,
    /// The store shared by all ranks (rank 0 hosts its server).
    pub store: Arc<dyn Store>,
    /// The store server's address and this rendezvous' key prefix, for a second connection
    /// (the flight recorder's watcher).
    pub(crate) dial: Option<(std::net::SocketAddr, String)>,
}

impl std::fmt::Debug for RendezvousInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RendezvousInfo")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .finish_non_exhaustive()
    }
}

/// `var` (one of torchrun's variables) as a number, or the Slurm or Open MPI variable standing
/// for it (see [`crate::launch_env`]); an error names the variable actually read.
fn env_usize(var: &str, rank: i64) -> Result<Option<usize>> {
    if let Some(std::env::VarError::NotUnicode(v)) = std::env::var(var).err() {
        return Err(Error::invalid(
            "rendezvous",
            rank,
            var,
            "a non-negative integer",
            format!("{v:?}"),
        ));
    }
    match crate::launch_env::lookup_env(var) {
        None => Ok(None),
        Some(f) => f.value.trim().parse::<usize>().map(Some).map_err(|_| {
            Error::invalid(
                "rendezvous",
                rank,
                &f.from,
                "a non-negative integer",
                format!("{:?}", f.value),
            )
        }),
    }
}

fn required<T>(v: Option<T>, var: &str, rank: i64) -> Result<T> {
    v.ok_or_else(|| {
        Error::invalid(
            "rendezvous",
            rank,
            var,
            format!("the environment variable {var} to be set (env://)"),
            "not set",
        )
    })
}

/// Rendezvous for `init_process_group`: finds rank, world size and the master's address,
/// starts the store server on rank 0, connects every rank, and waits until all `world_size`
/// ranks joined (see [`rendezvous_barrier`]). `timeout` (seconds-scale) bounds the whole
/// call and becomes the store's timeout.
///
/// With `env://`, `MASTER_ADDR`, `MASTER_PORT` and (unless given explicitly) `RANK` and
/// `WORLD_SIZE` are read from the environment; `LOCAL_RANK` is optional (defaults to the
/// rank). With `tcp://host:port`, `rank` and `world_size` come from the arguments or, when
/// `None`, from `RANK` / `WORLD_SIZE`. Rank 0 binds the unspecified address (`0.0.0.0` or `::`)
/// on the port, so other machines can reach it.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the variable or argument when one is missing or invalid
/// (including `rank >= world_size` and two processes claiming the same rank);
/// [`Error::Store`] when rank 0 cannot bind the port; [`Error::Timeout`] when the store could
/// not be reached or not all ranks joined within `timeout` (saying how many did).
pub fn rendezvous(
    init: &InitMethod,
    rank: Option<usize>,
    world_size: Option<usize>,
    timeout: Duration,
) -> Result<RendezvousInfo> {
    rendezvous_scoped(init, rank, world_size, timeout, "pg")
}

/// The stores of this process by master address: the process group and RPC of one job share
/// the store at `MASTER_ADDR:MASTER_PORT`, whichever is initialised first (rank 0 hosts one
/// server), and each initialisation works under its own key prefix.
///
/// They are kept for the life of the process: when rank 0 destroys its process group, the
/// other ranks may still be using the store (leaving the group, or already rendezvousing for
/// the job's next initialisation, such as RPC); stopping the server then would cut them off.
static SHARED: std::sync::Mutex<Vec<SharedStore>> = std::sync::Mutex::new(Vec::new());

/// A store: its master address key, the store, and how many times it was reused.
type SharedStore = (String, Arc<dyn Store>, usize);

/// [`rendezvous`] for one user of the job's store (`scope`: `"pg"` for process groups, `"rpc"`
/// for RPC): reuses this process's live store for the same master address when there is one,
/// and returns the store under the prefix `"<scope><n>/"`, `n` counting this scope's
/// initialisations in this process (every process initialises in the same order, so the
/// prefixes agree, and a re-initialisation after shutdown starts from clean keys).
///
/// # Errors
/// As [`rendezvous`].
pub fn rendezvous_scoped(
    init: &InitMethod,
    rank: Option<usize>,
    world_size: Option<usize>,
    timeout: Duration,
    scope: &str,
) -> Result<RendezvousInfo> {
    let start = Instant::now();
    let rank = match rank {
        Some(r) => r,
        None => required(env_usize("RANK", -1)?, "RANK", -1)?,
    };
    let r = rank as i64;
    let world_size = match world_size {
        Some(w) => w,
        None => required(env_usize("WORLD_SIZE", r)?, "WORLD_SIZE", r)?,
    };
    if world_size == 0 {
        return Err(Error::invalid(
            "rendezvous",
            r,
            "world_size",
            "at least 1",
            0,
        ));
    }
    if rank >= world_size {
        return Err(Error::invalid(
            "rendezvous",
            r,
            "rank",
            format!("a rank in 0..{world_size} (world_size = {world_size})"),
            rank,
        ));
    }
    let local_rank = env_usize("LOCAL_RANK", r)?.unwrap_or(rank);
    let (host, port) = match init {
        InitMethod::Tcp { host, port } => (host.clone(), *port),
        InitMethod::Env => {
            let host = crate::launch_env::lookup_env("MASTER_ADDR")
                .map(|f| f.value)
                .ok_or_else(|| {
                    Error::invalid(
                        "rendezvous",
                        r,
                        "MASTER_ADDR",
                        "the environment variable MASTER_ADDR to be set (env://)",
                        "not set",
                    )
                })?;
            let port = required(env_usize("MASTER_PORT", r)?, "MASTER_PORT", r)?;
            let port = u16::try_from(port).map_err(|_| {
                Error::invalid("rendezvous", r, "MASTER_PORT", "a port in 0..=65535", port)
            })?;
            (host, port)
        }
    };
    let master = crate::store::tcp::resolve(&host, port)?;
    let key = master.to_string();
    let cached = {
        let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        shared
            .iter_mut()
            .find(|(k, _, _)| *k == key)
            .map(|(_, s, uses)| {
                *uses += 1;
                s.clone()
            })
    };
    let store: Arc<dyn Store> = match cached {
        Some(s) => s,
        None => {
            let s = connect_store(rank, master, port, timeout)?;
            SHARED
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((key.clone(), s.clone(), 1));
            s
        }
    };
    let generation = {
        let mut gens = SCOPES.lock().unwrap_or_else(|e| e.into_inner());
        let k = format!("{key}/{scope}");
        match gens.iter_mut().find(|(kk, _)| *kk == k) {
            Some((_, n)) => {
                *n += 1;
                *n
            }
            None => {
                gens.push((k, 0));
                0
            }
        }
    };
    let prefix = format!("{scope}{generation}/");
    let store: Arc<dyn Store> = Arc::new(crate::store::PrefixStore::new(prefix.clone(), store));
    let left = timeout.saturating_sub(start.elapsed());
    rendezvous_barrier(&*store, rank, world_size, left)?;
    Ok(RendezvousInfo {
        rank,
        world_size,
        local_rank,
        store,
        dial: Some((master, prefix)),
    })
}

/// How many times each scope initialised on each master address, in this process.
static SCOPES: std::sync::Mutex<Vec<(String, usize)>> = std::sync::Mutex::new(Vec::new());

/// Starts the store server (rank 0) or connects to it.
fn connect_store(
    rank: usize,
    master: std::net::SocketAddr,
    port: u16,
    timeout: Duration,
) -> Result<Arc<dyn Store>> {
    let r = rank as i64;
    let store: TcpStore = if rank == 0 {
        let bind_ip: IpAddr = if master.is_ipv4() {
            Ipv4Addr::UNSPECIFIED.into()
        } else {
            Ipv6Addr::UNSPECIFIED.into()
        };
        TcpStore::new_server_or_client(&bind_ip.to_string(), port, true, timeout)
            .map_err(|e| match e {
                Error::Store(m) => Error::Store(format!("rendezvous on rank 0: {m}")),
                other => other,
            })?
            .reaching(master)
    } else {
        TcpStore::connect(master, timeout).map_err(|e| with_rank(e, r))?
    };
    Ok(Arc::new(store))
}

fn with_rank(e: Error, rank: i64) -> Error {
    match e {
        Error::Timeout {
            op,
            timeout,
            detail,
            ..
        } => Error::Timeout {
            op,
            rank,
            timeout,
            detail,
        },
        other => other,
    }
}

/// The barrier of [`rendezvous`], usable on any store: registers `rank` (failing when another
/// process already claimed it), adds 1 to [`JOINED_KEY`], and waits up to `timeout` until
/// `world_size` ranks joined. The last rank to join sets [`COMPLETE_KEY`], which releases the
/// others (no polling).
///
/// # Errors
/// [`Error::InvalidArgument`] when `rank >= world_size` or the rank was claimed twice;
/// [`Error::Timeout`] saying how many of `world_size` ranks joined; store errors as returned
/// by the store.
pub fn rendezvous_barrier(
    store: &dyn Store,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<()> {
    let r = rank as i64;
    if rank >= world_size {
        return Err(Error::invalid(
            "rendezvous",
            r,
            "rank",
            format!("a rank in 0..{world_size}"),
            rank,
        ));
    }
    if store.add(&format!("rdzv/rank/{rank}"), 1)? > 1 {
        return Err(Error::invalid(
            "rendezvous",
            r,
            "rank",
            "a rank no other process uses",
            format!("{rank}, which another process already claimed"),
        ));
    }
    let joined = store.add(JOINED_KEY, 1)?;
    // a rank arriving after rank 0 gave up must not release the others: it reads the note
    let abandoned =
        store.check(&[COMPLETE_KEY])? && store.get(COMPLETE_KEY)?.starts_with(ABANDONED);
    if joined >= world_size as i64 && !abandoned {
        store.set(COMPLETE_KEY, b"1")?;
    }
    let start = Instant::now();
    let every = report_interval();
    // the missing ranks as last seen, kept for when the store's host has gone
    let mut known: Option<Vec<String>> = None;
    let waited = loop {
        let left = timeout.saturating_sub(start.elapsed());
        match store.wait(&[COMPLETE_KEY], left.min(every)) {
            // the store rounds a wait down to whole milliseconds: within 50 ms of the deadline
            // this is the final timeout, not another slice
            Err(Error::Timeout { .. }) if start.elapsed() + Duration::from_millis(50) < timeout => {
                let (joined, missing) = who_joined(store, world_size, joined);
                if let Some(m) = &missing {
                    known = Some(m.clone());
                }
                waiting_note(&format!(
                    "rendezvous: rank {rank} has waited {:.0}s of {:.0}s: {joined} of \
                     {world_size} ranks joined; waiting for ranks {}",
                    start.elapsed().as_secs_f64(),
                    timeout.as_secs_f64(),
                    list(missing.as_deref().or(known.as_deref()))
                ));
            }
            other => break other,
        }
    };
    match waited {
        Ok(()) => match store.get(COMPLETE_KEY) {
            Ok(v) if v.starts_with(ABANDONED) => {
                // rank 0 gave up and published who was missing; say so, and let it go
                let _ = store.add(ABANDON_SEEN_KEY, 1);
                let missing = String::from_utf8_lossy(&v[ABANDONED.len()..]).into_owned();
                Err(Error::Timeout {
                    op: "rendezvous".into(),
                    rank: r,
                    timeout,
                    // the missing ranks arrive as rank 0 published them, as words
                    detail: crate::detail!(
                        "rank ",
                        crate::Part::Rank(0),
                        format!(
                            ", which hosts the store, timed out waiting for the world of \
                             {world_size}: missing ranks: {missing}"
                        )
                    ),
                })
            }
            _ => Ok(()),
        },
        Err(Error::Timeout { .. }) => {
            let (joined, missing) = who_joined(store, world_size, joined);
            if missing.as_ref().is_some_and(Vec::is_empty) {
                // the last rank arrived just as the wait ended: the others are released
                return Ok(());
            }
            let missing = missing.or(known);
            if rank == 0 {
                // the store's host leaves with this error: first tell the others who was
                // missing, and wait (briefly) until they have read it
                let mut v = ABANDONED.to_vec();
                v.extend_from_slice(list(missing.as_deref()).as_bytes());
                if store.set(COMPLETE_KEY, &v).is_ok() {
                    let others = joined.saturating_sub(1);
                    let until = Instant::now() + Duration::from_secs(2);
                    while store.add(ABANDON_SEEN_KEY, 0).unwrap_or(others) < others
                        && Instant::now() < until
                    {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            Err(Error::Timeout {
                op: "rendezvous".into(),
                rank: r,
                timeout,
                detail: format!(
                    "only {joined} of {world_size} ranks joined (missing ranks: {})",
                    list(missing.as_deref())
                )
                .into(),
            })
        }
        // rank 0 hosts the store: when it gave up first, the others lose the server
        Err(Error::Store(m)) => Err(Error::Store(format!(
            "rendezvous on rank {r}: {m}; the store host rank 0 left before {} arrived \
             ({joined} of {world_size} ranks had joined when this rank did)",
            match &known {
                Some(k) => format!("ranks {}", k.join(", ")),
                None => "every rank".to_string(),
            }
        ))),
        Err(e) => Err(e),
    }
}

/// The value rank 0 puts in [`COMPLETE_KEY`] when it gives up, before the missing ranks.
const ABANDONED: &[u8] = b"abandoned; missing: ";
/// Counts the ranks that read rank 0's "abandoned" note.
const ABANDON_SEEN_KEY: &str = "rdzv/abandon_seen";

/// `0, 3` (or "unknown" when the store could not say).
fn list(missing: Option<&[String]>) -> String {
    match missing {
        Some([]) => "none".into(),
        Some(m) => m.join(", "),
        None => "unknown (the store did not answer)".into(),
    }
}

/// How many ranks joined the barrier, and which did not (as strings, for messages); `None`
/// for the missing ranks when the store could not be asked.
fn who_joined(store: &dyn Store, world_size: usize, joined: i64) -> (i64, Option<Vec<String>>) {
    let joined = store.add(JOINED_KEY, 0).unwrap_or(joined);
    let mut missing = Vec::new();
    for q in 0..world_size {
        match store.check(&[&format!("rdzv/rank/{q}")]) {
            Ok(true) => {}
            Ok(false) => missing.push(q.to_string()),
            Err(_) => return (joined, None),
        }
    }
    (joined, Some(missing))
}

/// Sets how often (in seconds, default 10) a rank still waiting in rendezvous says who it waits
/// for.
pub const RDZV_REPORT_ENV: &str = "TENSORPLAY_RDZV_REPORT_SECS";

/// The interval of the "still waiting" notes: [`RDZV_REPORT_ENV`] seconds (at least 0.1), or
/// 10 s.
pub(crate) fn report_interval() -> Duration {
    std::env::var(RDZV_REPORT_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(Duration::from_secs(10), |s| {
            Duration::from_secs_f64(s.clamp(0.1, 86_400.0))
        })
}

/// A note that a rank is still waiting for others: at `info` level through `tracing`, and on
/// stderr as well when the process was started by `tensorplay-run` (`TENSORPLAY_RUN=1`), whose
/// output a person is watching.
pub(crate) fn waiting_note(msg: &str) {
    tracing::info!("{msg}");
    if std::env::var_os("TENSORPLAY_RUN").is_some_and(|v| v == "1") {
        eprintln!("{msg}");
    }
}

/// A port for a job's store that is free now and unlikely to be taken before rank 0 binds it:
/// chosen at random below the kernel's ephemeral range (`ip_local_port_range`, from 32768 by
/// default), where outgoing connections never take a port, and checked free on every address.
/// A port from the ephemeral range (what binding port 0 gives) can be taken between the check
/// and rank 0's bind by any connection the machine opens, which made busy test runs fail with
/// "Address already in use". Falls back to an ephemeral port when none below is free.
///
/// # Errors
/// When not even an ephemeral port can be bound.
pub fn free_port() -> std::io::Result<u16> {
    use std::hash::{BuildHasher, Hasher};
    let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    let (from, to) = (10000u16, low.max(10001));
    let free = |p: u16| {
        std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, p)).is_ok()
            && std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, p)).is_ok()
    };
    for _ in 0..64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let p = from + (h.finish() % u64::from(to - from)) as u16;
        if free(p) {
            return Ok(p);
        }
    }
    std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
}
