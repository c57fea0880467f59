//! MPI itself: initialised once per process (at the first `"mpi"` group or launcher call) with
//! `MPI_THREAD_MULTIPLE`, finalised at exit (MPI cannot be initialised again after
//! `MPI_Finalize`, so `destroy_process_group` leaves it running); the world communicator; the
//! launcher that gives `init_process_group("mpi", ..)` its ranks.

use std::sync::OnceLock;

use mpi::Threading;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::Root;
use tensorplay_collectives::launcher::{LaunchWorld, Launcher};
use tensorplay_collectives::{Error, Result};

/// A communicator usable from any thread.
pub(crate) struct Comm(pub(crate) SimpleCommunicator);

// SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE (checked in `runtime`, which every
// `Comm` comes from), under which MPI calls on one communicator may be made from several
// threads at once; the handle itself is an immutable pointer-sized id.
unsafe impl Send for Comm {}
// SAFETY: as for `Send`: MPI_THREAD_MULTIPLE makes concurrent calls on the handle legal.
unsafe impl Sync for Comm {}

/// The process's MPI: its world communicator.
pub(crate) struct Runtime {
    pub(crate) world: Comm,
    /// This process's rank among those of its host, and whether all are on this host.
    local_rank: usize,
    single_host: bool,
}

static RUNTIME: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();

/// At exit: `MPI_Finalize`, unless an operation of this process timed out or lost a peer:
/// then `MPI_Abort` (exit code 1), so that `mpirun` ends the other ranks now. (Open MPI's
/// finalize waits for every rank to finalize: a rank leaving on a timeout would otherwise wait
/// there for ranks that are stuck.)
extern "C" fn finalize_at_exit() {
    if !mpi::is_initialized() || mpi::is_finalized() {
        return;
    }
    if tensorplay_collectives::recorder::failure_seen() {
        // SAFETY: MPI is initialised and not finalised (checked above); MPI_Abort may be
        // called from any thread under MPI_THREAD_MULTIPLE and ends the process.
        unsafe {
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 1);
        }
        return;
    }
    // SAFETY: MPI is initialised and not finalised (checked above); this runs once, at
    // process exit, after main returned (no tensorplay call of this process is made after it).
    unsafe {
        mpi::ffi::MPI_Finalize();
    }
}

fn init() -> std::result::Result<Runtime, String> {
    let threading = if mpi::is_initialized() {
        // the program initialised MPI itself: keep its level, if enough
        mpi::environment::threading_support()
    } else {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or("MPI was initialised by another thread at the same time")?;
        // finalised at exit, not when a group is destroyed (MPI cannot start again)
        std::mem::forget(universe);
        // SAFETY: `finalize_at_exit` is an `extern "C" fn()` that lives for the whole
        // program; atexit only stores the pointer.
        if unsafe { libc::atexit(finalize_at_exit) } != 0 {
            return Err("could not register MPI_Finalize at exit (atexit failed)".into());
        }
        threading
    };
    if threading != Threading::Multiple {
        return Err(format!(
            "the MPI library provides thread support {threading:?}; the mpi backend needs \
             MPI_THREAD_MULTIPLE (sends and receives run beside collectives on other \
             threads): use an MPI built with it (Debian's Open MPI is)"
        ));
    }
    let world = SimpleCommunicator::world();
    let node = world.split_shared(0);
    Ok(Runtime {
        local_rank: node.rank() as usize,
        single_host: node.size() == world.size(),
        world: Comm(world),
    })
}

/// MPI, initialised on first use.
///
/// # Errors
/// MPI cannot be initialised with `MPI_THREAD_MULTIPLE`.
pub(crate) fn runtime() -> Result<&'static Runtime> {
    RUNTIME
        .get_or_init(init)
        .as_ref()
        .map_err(|e| Error::Backend {
            backend: "mpi".into(),
            detail: e.clone().into(),
        })
}

/// The launcher of jobs started by `mpirun`/`srun`: ranks from `MPI_COMM_WORLD`, the store's
/// address broadcast from rank 0.
pub(crate) struct MpiLauncher;

impl Launcher for MpiLauncher {
    fn world(&self) -> Result<LaunchWorld> {
        let rt = runtime()?;
        Ok(LaunchWorld {
            rank: rt.world.0.rank() as usize,
            size: rt.world.0.size() as usize,
            local_rank: rt.local_rank,
            single_host: rt.single_host,
        })
    }

    fn broadcast_from_first(&self, value: Option<Vec<u8>>) -> Result<Vec<u8>> {
        let rt = runtime()?;
        let root = rt.world.0.process_at_rank(0);
        let mut len = value.as_ref().map_or(0u64, |v| v.len() as u64);
        root.broadcast_into(&mut len);
        let mut buf = value.unwrap_or_else(|| vec![0u8; len as usize]);
        root.broadcast_into(&mut buf[..]);
        Ok(buf)
    }
}
