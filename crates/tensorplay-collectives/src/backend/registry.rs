//! The backend registry: backend names to the factories that build them
//! (`torch.distributed.Backend.register_backend`). `"cpu"` (alias `"gloo"`) is built in.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::cpu::{CpuBackend, CpuOptions};
use super::{Backend, HostBackend, HostTensors};
use crate::store::{PrefixStore, Store};
use crate::{Error, Result};

/// What a backend factory gets to build the backend of one group on this rank.
#[non_exhaustive]
pub struct BackendContext {
    /// The registered name the group asked for (`"cpu"`, `"nccl"`, ...).
    pub name: String,
    /// A store private to this backend of this group (prefixed), shared by the group's ranks:
    /// for exchanging addresses or unique ids.
    pub store: Arc<dyn Store>,
    /// This process's rank in the group.
    pub rank: usize,
    /// Number of ranks in the group.
    pub size: usize,
    /// The global rank (in the default group) of each group rank, in group-rank order
    /// (`0..size` for the default group): a backend whose runtime has its own world (MPI)
    /// builds the group's communicator from them.
    pub ranks: Vec<usize>,
    /// This process's rank among the processes of its host (`LOCAL_RANK`): the GPU it uses.
    pub local_rank: usize,
    /// The group's timeout: the backend's own setup (connecting, joining a communicator) must
    /// finish within it or fail with [`Error::Timeout`].
    pub timeout: Duration,
    /// The group's cpu control channel (already connected): a backend may use it for its own
    /// host-side agreement; the layer above uses it for the cross-rank checks and barriers.
    pub control: Arc<dyn HostBackend>,
}

impl std::fmt::Debug for BackendContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendContext")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_rank", &self.local_rank)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// A function that builds a backend for one group on this rank.
pub type BackendFactory = Arc<dyn Fn(&BackendContext) -> Result<Box<dyn Backend>> + Send + Sync>;

static REGISTRY: Mutex<Vec<(String, BackendFactory)>> = Mutex::new(Vec::new());

fn registry() -> std::sync::MutexGuard<'static, Vec<(String, BackendFactory)>> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers a backend under `name` (`Backend.register_backend`), so that
/// `init_process_group(name, ...)` and `new_group(.., Some(name), ..)` build it with `factory`.
/// Register it on every rank, before the group is created.
///
/// # Errors
/// [`Error::InvalidArgument`] when `name` is empty, is `"cpu"`/`"gloo"` (built in), or is
/// already registered.
pub fn register_backend(
    name: &str,
    factory: impl Fn(&BackendContext) -> Result<Box<dyn Backend>> + Send + Sync + 'static,
) -> Result<()> {
    let mut r = registry();
    if name.is_empty() || matches!(name, "cpu" | "gloo") || r.iter().any(|(n, _)| n == name) {
        return Err(Error::invalid(
            "register_backend",
            -1,
            "name",
            "a new backend name (\"cpu\" and \"gloo\" are built in)",
            if name.is_empty() {
                "\"\"".to_string()
            } else {
                format!("{name:?}, which is already registered")
            },
        ));
    }
    r.push((name.to_string(), Arc::new(factory)));
    Ok(())
}

/// The names of the backends that can be created here: `"cpu"` and the registered ones.
pub fn registered_backends() -> Vec<String> {
    let mut v = vec!["cpu".to_string()];
    v.extend(registry().iter().map(|(n, _)| n.clone()));
    v
}

/// Builds the control channel and the backend `name` of one group on this rank. The control
/// channel is a cpu backend over the group's store; a `"cpu"` group moves its data over that
/// same channel, so it costs nothing extra.
pub(crate) fn make_backend(
    name: &str,
    store: Arc<dyn Store>,
    ranks: &[usize],
    rank: usize,
    local_rank: usize,
    timeout: Duration,
) -> Result<(Box<dyn Backend>, Arc<dyn HostBackend>)> {
    let size = ranks.len();
    let factory = if matches!(name, "cpu" | "gloo") {
        None
    } else {
        let f = registry()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, f)| f.clone());
        Some(f.ok_or_else(|| unknown(name))?)
    };
    // listen where the other ranks reach this host: its address toward the store's server
    // (loopback, as before, when the job is on one host)
    let bind_host = store
        .local_ip()
        .filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
        .map_or_else(|| "127.0.0.1".to_string(), |ip| ip.to_string());
    let control: Arc<dyn HostBackend> = Arc::new(CpuBackend::with_options(
        store.clone(),
        rank,
        size,
        timeout,
        CpuOptions::default().with_bind_host(bind_host),
    )?);
    let backend: Box<dyn Backend> = match factory {
        None => Box::new(HostTensors::new("cpu", control.clone())),
        Some(f) => f(&BackendContext {
            name: name.to_string(),
            store: Arc::new(PrefixStore::new(format!("backend/{name}"), store)),
            rank,
            size,
            ranks: ranks.to_vec(),
            local_rank,
            timeout,
            control: control.clone(),
        })?,
    };
    Ok((backend, control))
}

fn unknown(name: &str) -> Error {
    let hint = if name == "nccl" {
        "the nccl backend (crate tensorplay-nccl) is not part of this build: build tensorplay \
         with its `nccl` feature (on by default), or call tensorplay_nccl::register() when \
         using tensorplay-collectives directly"
            .to_string()
    } else if name == "mpi" {
        "this build has no MPI backend: build tensorplay with its `mpi` feature against the \
         system's MPI (Debian: apt install libopenmpi-dev openmpi-bin libclang-dev; then \
         cargo build --features tensorplay/mpi), or call tensorplay_mpi::register() when \
         using tensorplay-collectives directly"
            .to_string()
    } else {
        format!(
            "unknown backend; expected one of {:?} (\"cpu\": host tensors over shared memory \
             and TCP; \"nccl\": CUDA tensors), or register it first with register_backend",
            registered_backends()
        )
    };
    Error::Backend {
        backend: name.to_string(),
        detail: hint.into(),
    }
}
