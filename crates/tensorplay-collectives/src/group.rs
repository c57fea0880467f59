//! Process groups: `init_process_group`, the default group, `new_group`, rank translation.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::backend::{Backend, HostBackend, make_backend};
use crate::recorder::GroupRecorder;
use crate::rendezvous::{InitMethod, rendezvous};
use crate::store::{PrefixStore, Store};
use crate::work::Sequencer;
use crate::{Error, Result};

/// The default timeout of collectives and rendezvous (PyTorch: 10 minutes for NCCL, 30 for
/// gloo; ours is shorter so that a dead rank is reported while someone is still watching).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Options of `init_process_group` (`torch.distributed.init_process_group` keyword
/// arguments).
#[derive(Debug, Clone)]
pub struct InitOptions {
    /// `"env://"` (default: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) or
    /// `"tcp://host:port"` (then `rank` and `world_size` are required).
    pub init_method: String,
    /// This process's rank; overrides `RANK`.
    pub rank: Option<usize>,
    /// Number of processes; overrides `WORLD_SIZE`.
    pub world_size: Option<usize>,
    /// Timeout of rendezvous and of every collective on the default group.
    pub timeout: Duration,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            init_method: "env://".into(),
            rank: None,
            world_size: None,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// What a member of a group holds: the group's backend and its cpu control channel (the
/// cross-rank checks and barriers; for a `"cpu"` group the same connections as the backend).
pub(crate) struct Member {
    pub(crate) backend: Box<dyn Backend>,
    pub(crate) control: Arc<dyn HostBackend>,
}

impl Member {
    fn new(
        backend: &str,
        store: Arc<dyn Store>,
        ranks: &[usize],
        rank: usize,
        local_rank: usize,
        timeout: Duration,
    ) -> Result<Member> {
        let (backend, control) = make_backend(backend, store, ranks, rank, local_rank, timeout)?;
        Ok(Member { backend, control })
    }

    /// [`Member::new`] for a group of the global `ranks`: errors name global ranks.
    fn for_ranks(
        backend: &str,
        store: Arc<dyn Store>,
        ranks: &[usize],
        rank: usize,
        local_rank: usize,
        timeout: Duration,
    ) -> Result<Member> {
        Member::new(backend, store, ranks, rank, local_rank, timeout)
            .map_err(|e| crate::ops::to_global(ranks, e))
    }
}

pub(crate) struct GroupInner {
    pub(crate) name: String,
    /// Global rank of each group rank.
    pub(crate) ranks: Vec<usize>,
    /// This process's global rank.
    pub(crate) global_rank: usize,
    /// This process's rank in the group; `None` for a non-member handle.
    pub(crate) group_rank: Option<usize>,
    /// The backend and control channel; `None` for a non-member handle.
    pub(crate) member: Option<Member>,
    pub(crate) timeout: Duration,
    pub(crate) seq: Arc<Sequencer>,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) backend_name: String,
    /// The flight recorder of this group on this rank.
    pub(crate) recorder: Arc<GroupRecorder>,
    /// The point-to-point lanes (one thread per peer and direction, started on first use).
    pub(crate) lanes: crate::ops::Lanes,
}

/// A process group (`torch.distributed.ProcessGroup`): a set of ranks, a backend and a
/// timeout. Cheap to clone. Operations on one group run in the order they are issued.
#[derive(Clone)]
pub struct ProcessGroup {
    pub(crate) inner: Arc<GroupInner>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ProcessGroup({}, backend={}, ranks={:?}, rank={:?})",
            self.inner.name, self.inner.backend_name, self.inner.ranks, self.inner.group_rank
        )
    }
}

impl ProcessGroup {
    /// This process's rank in the group (`group.rank()`), `0..size()`; `None` for a process
    /// that is not a member (where PyTorch returns -1, `GroupMember.NON_GROUP_MEMBER`).
    pub fn rank(&self) -> Option<usize> {
        self.inner.group_rank
    }
    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.ranks.len()
    }
    /// Whether this process belongs to the group.
    pub fn is_member(&self) -> bool {
        self.inner.group_rank.is_some()
    }
    /// The global ranks of the group's members, in group-rank order.
    pub fn ranks(&self) -> &[usize] {
        &self.inner.ranks
    }
    /// The backend's name (`"cpu"`, `"nccl"`, or a registered one).
    pub fn backend(&self) -> &str {
        &self.inner.backend_name
    }
    /// The timeout of this group's operations.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }
    /// The global rank of group rank `group_rank` (`get_global_rank`).
    pub fn global_rank(&self, group_rank: usize) -> Result<usize> {
        self.inner.ranks.get(group_rank).copied().ok_or_else(|| {
            Error::invalid(
                "get_global_rank",
                self.inner.global_rank as i64,
                "group_rank",
                format!("< group size {}", self.size()),
                group_rank,
            )
        })
    }
    /// The group rank of global rank `global_rank` (`get_group_rank`); an error when it is not
    /// a member.
    pub fn group_rank(&self, global_rank: usize) -> Result<usize> {
        self.inner
            .ranks
            .iter()
            .position(|&r| r == global_rank)
            .ok_or_else(|| {
                Error::invalid(
                    "get_group_rank",
                    self.inner.global_rank as i64,
                    "global_rank",
                    format!("one of the group's ranks {:?}", self.inner.ranks),
                    global_rank,
                )
            })
    }
    /// This process's global rank.
    pub fn my_global_rank(&self) -> usize {
        self.inner.global_rank
    }
    /// The group's store (prefixed for the group).
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }
    /// How this group's collectives travel: `"shm"` (the `"cpu"` backend with every rank on
    /// one host: shared memory), `"tcp"`, `"shm+tcp"` (several hosts: shared memory inside
    /// each, TCP between them), `"nccl"`, or `""` on a non-member handle.
    pub fn transport(&self) -> &'static str {
        self.inner
            .member
            .as_ref()
            .map_or("", |m| m.backend.transport())
    }
    /// Bytes this process has sent through the group's backend (on the shared-memory
    /// transport: the bytes it wrote into its slots for peers to read).
    pub fn bytes_sent(&self) -> u64 {
        self.inner
            .member
            .as_ref()
            .map_or(0, |m| m.backend.bytes_sent())
    }
}

struct World {
    group: ProcessGroup,
    store: Arc<dyn Store>,
    next_group_id: u64,
    local_rank: usize,
}

static WORLD: Mutex<Option<World>> = Mutex::new(None);

fn world() -> std::sync::MutexGuard<'static, Option<World>> {
    WORLD.lock().unwrap_or_else(|e| e.into_inner())
}

/// Initialises the default process group (`torch.distributed.init_process_group`): rendezvous
/// through the store named by `options.init_method`, then connects the backend.
///
/// `backend` is `"cpu"` (host tensors over shared memory and TCP; `"gloo"` is accepted as an
/// alias), `"nccl"` (CUDA tensors; registered by the facade's `nccl` feature), or a name given
/// to [`register_backend`](crate::register_backend). Errors: already initialised, a bad init method or environment variable, a
/// rendezvous timeout naming the ranks that did not join, or a backend that cannot run here
/// (for NCCL: no CUDA driver, no `libnccl`, not enough GPUs), each with what to do about it.
pub fn init_process_group(backend: &str, options: InitOptions) -> Result<()> {
    let mut w = world();
    if w.is_some() {
        return Err(Error::invalid(
            "init_process_group",
            -1,
            "default group",
            "no default group yet (call destroy_process_group first)",
            "already initialized",
        ));
    }
    let init: InitMethod = options.init_method.parse()?;
    // under a launcher (mpirun): its ranks, and the store's address from its rank 0
    let (init, rank, world_size, local_rank) =
        crate::launcher::launched(backend, init, options.rank, options.world_size)?;
    let mut info = rendezvous(&init, rank, world_size, options.timeout)?;
    if let Some(l) = local_rank {
        info.local_rank = l;
    }
    let pg_store: Arc<dyn Store> = Arc::new(PrefixStore::new("pg/world", info.store.clone()));
    let b = Member::new(
        backend,
        pg_store.clone(),
        &(0..info.world_size).collect::<Vec<_>>(),
        info.rank,
        info.local_rank,
        options.timeout,
    )?;
    let group = ProcessGroup {
        inner: Arc::new(GroupInner {
            name: "world".into(),
            ranks: (0..info.world_size).collect(),
            global_rank: info.rank,
            group_rank: Some(info.rank),
            member: Some(b),
            timeout: options.timeout,
            seq: Sequencer::new(info.rank, (0..info.world_size).collect()),
            store: pg_store,
            backend_name: backend.to_string(),
            recorder: GroupRecorder::new(
                "world",
                backend,
                &(0..info.world_size).collect::<Vec<_>>(),
            ),
            lanes: Default::default(),
        }),
    };
    crate::recorder::agree_job_id(&*group.inner.store, info.rank, options.timeout)?;
    if let Some((master, prefix)) = &info.dial {
        crate::recorder::start_watcher(*master, prefix.clone());
    }
    *w = Some(World {
        group,
        store: info.store,
        next_group_id: 0,
        local_rank: info.local_rank,
    });
    Ok(())
}

/// Tears down the default group (`destroy_process_group`); groups made by `new_group` stay
/// usable until dropped. Errors when no default group exists.
pub fn destroy_process_group() -> Result<()> {
    let mut w = world();
    if w.take().is_none() {
        return Err(Error::NotInitialized {
            op: "destroy_process_group".into(),
        });
    }
    crate::recorder::WORLD_GENERATION.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    Ok(())
}

/// Whether the default group exists (`is_initialized`).
pub fn is_initialized() -> bool {
    world().is_some()
}

/// The default group, or [`Error::NotInitialized`] naming `op`.
pub fn default_group(op: &str) -> Result<ProcessGroup> {
    world()
        .as_ref()
        .map(|w| w.group.clone())
        .ok_or_else(|| Error::NotInitialized { op: op.to_string() })
}

/// This process's rank in `group` (default: the world) (`get_rank`), `0..world size`: the same
/// number [`spawn`](crate::spawn()) passes to its function for the world.
///
/// # Errors
/// [`Error::NotInitialized`] without a default group; [`Error::InvalidArgument`] naming this
/// process's global rank and the group's members when it does not belong to `group` (where
/// PyTorch returns -1).
pub fn get_rank(group: Option<&ProcessGroup>) -> Result<usize> {
    let g = match group {
        Some(g) => g.clone(),
        None => default_group("get_rank")?,
    };
    g.rank().ok_or_else(|| {
        Error::invalid(
            "get_rank",
            g.my_global_rank() as i64,
            "group",
            format!("a group this process belongs to (members: {:?})", g.ranks()),
            format!("group {:?} without rank {}", g.ranks(), g.my_global_rank()),
        )
    })
}

/// The default group's backend name, `"cpu"` or `"nccl"` (`get_backend`); of `group` when
/// given.
///
/// # Errors
/// [`Error::NotInitialized`] without a default group.
pub fn get_backend(group: Option<&ProcessGroup>) -> Result<String> {
    Ok(match group {
        Some(g) => g.backend().to_string(),
        None => default_group("get_backend")?.backend().to_string(),
    })
}

/// Number of ranks in `group` (default: the world) (`get_world_size`).
pub fn get_world_size(group: Option<&ProcessGroup>) -> Result<usize> {
    Ok(match group {
        Some(g) => g.size(),
        None => default_group("get_world_size")?.size(),
    })
}

/// The store of the default group's rendezvous, shared with other users of it (RPC) under
/// their own prefixes.
pub fn world_store() -> Result<Arc<dyn Store>> {
    world()
        .as_ref()
        .map(|w| w.store.clone())
        .ok_or_else(|| Error::NotInitialized {
            op: "world_store".into(),
        })
}

/// Creates a group of the given global ranks (`new_group`). Every process of the world must
/// call it, with the same ranks, in the same order as its other `new_group` calls (as in
/// PyTorch); processes outside `ranks` get a non-member handle whose collectives return an
/// error. `backend` defaults to the world's; `timeout` to the world's.
///
/// Errors: not initialised, empty or repeated ranks, ranks outside the world.
pub fn new_group(
    ranks: &[usize],
    backend: Option<&str>,
    timeout: Option<Duration>,
) -> Result<ProcessGroup> {
    let (world_group, store, id, local_rank) = {
        let mut w = world();
        let w = w.as_mut().ok_or_else(|| Error::NotInitialized {
            op: "new_group".into(),
        })?;
        let id = w.next_group_id;
        w.next_group_id += 1;
        (w.group.clone(), w.store.clone(), id, w.local_rank)
    };
    let me = world_group.inner.global_rank;
    let n = world_group.size();
    if ranks.is_empty() {
        return Err(Error::invalid(
            "new_group",
            me as i64,
            "ranks",
            "at least one rank",
            "[]",
        ));
    }
    let mut seen = vec![false; n];
    for &r in ranks {
        if r >= n {
            return Err(Error::invalid(
                "new_group",
                me as i64,
                "ranks",
                format!("ranks < world size {n}"),
                format!("{ranks:?}"),
            ));
        }
        if std::mem::replace(&mut seen[r], true) {
            return Err(Error::invalid(
                "new_group",
                me as i64,
                "ranks",
                "distinct ranks",
                format!("{ranks:?}"),
            ));
        }
    }
    let backend_name = backend.unwrap_or_else(|| world_group.backend()).to_string();
    let timeout = timeout.unwrap_or_else(|| world_group.timeout());
    let gstore: Arc<dyn Store> = Arc::new(PrefixStore::new(format!("pg/group{id}"), store));
    let group_rank = ranks.iter().position(|&r| r == me);
    let b = match group_rank {
        Some(gr) => Some(Member::for_ranks(
            &backend_name,
            gstore.clone(),
            ranks,
            gr,
            local_rank,
            timeout,
        )?),
        None => None,
    };
    Ok(ProcessGroup {
        inner: Arc::new(GroupInner {
            name: format!("group{id}"),
            ranks: ranks.to_vec(),
            global_rank: me,
            group_rank,
            member: b,
            timeout,
            seq: Sequencer::new(me, ranks.to_vec()),
            store: gstore,
            recorder: GroupRecorder::new(&format!("group{id}"), &backend_name, ranks),
            backend_name,
            lanes: Default::default(),
        }),
    })
}
