//! `tensorplay-mpi`: the `"mpi"` process-group backend, host tensors over the system's MPI
//! (Open MPI, MPICH, a vendor's MPI over UCX or RDMA): the engine CPU clusters already run.
//! The only crate of the stack that calls MPI; all of its `unsafe` lives here.
//!
//! - **Building**: the backend is behind this crate's feature `mpi` (the facade's `mpi`), off
//!   by default, so builds without an MPI installed still work; it links the system's MPI
//!   through the `mpi` crate (Debian: `apt install libopenmpi-dev openmpi-bin libclang-dev`).
//!   Without the feature, [`register`] registers nothing and asking for `"mpi"` says how to
//!   build with it.
//! - **Starting**: under `mpirun`/`srun`, `init_process_group("mpi", ..)` takes the rank and
//!   world size from MPI itself; rank 0 broadcasts the address of the job's store (its
//!   cross-rank checks, failure reports and flight recorder) through MPI, so `MASTER_ADDR` is
//!   not needed. Every group (`new_group` too) gets its own communicator.
//! - **Calls**: every collective and point-to-point call of the backend contract; float32,
//!   float64 and int64 reduced by MPI, bfloat16 and float16 (which Open MPI 4.1 lacks) moved as
//!   bytes and reduced in float32 with one rounding.
//! - **Timeouts**: MPI calls have none and cannot be cancelled. A watchdog prints the report a
//!   timeout would carry (with the flight recorder's diagnosis) and ends the job with
//!   `MPI_Abort` and exit code [`TIMEOUT_EXIT_CODE`].
//! - **One MPI per process**: MPI is initialised once (`MPI_THREAD_MULTIPLE`, checked) and
//!   finalised at exit; `destroy_process_group` leaves it running.
//!
//! ```no_run
//! // mpirun -np 2 target/release/my_job
//! use tensorplay as tp;
//! use tp::distributed as dist;
//! # fn main() -> tp::Result<()> {
//! dist::init_process_group("mpi", Default::default())?;
//! let x = tp::ones(&[4])?;
//! dist::all_reduce(&x, dist::ReduceOp::Sum, None)?;
//! # Ok(())
//! # }
//! ```

#[cfg(feature = "mpi")]
mod backend;
#[cfg(feature = "mpi")]
mod runtime;
#[cfg(feature = "mpi")]
mod watchdog;

#[cfg(feature = "mpi")]
pub use backend::MpiBackend;

/// The exit code of a job whose call ran past its group's timeout: the watchdog ended it with
/// `MPI_Abort(.., 124)` and `mpirun` returns it.
pub const TIMEOUT_EXIT_CODE: i32 = 124;

/// Whether this build has the MPI backend (the crate's feature `mpi`).
pub const BUILT_WITH_MPI: bool = cfg!(feature = "mpi");

/// Registers the `"mpi"` backend and its launcher with the collectives' registry (once per
/// process; later calls do nothing). The facade calls it before creating groups. Without the
/// feature `mpi` it registers nothing: asking for `"mpi"` then fails with an error that says
/// how to build it.
pub fn register() {
    #[cfg(feature = "mpi")]
    {
        static ONCE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
        ONCE.get_or_init(|| {
            let _ = tensorplay_collectives::register_backend("mpi", |ctx| {
                let host = std::sync::Arc::new(MpiBackend::new(ctx)?);
                Ok(Box::new(tensorplay_collectives::backend::HostTensors::new(
                    "mpi", host,
                ))
                    as Box<dyn tensorplay_collectives::backend::Backend>)
            });
            let _ = tensorplay_collectives::launcher::register_launcher(
                "mpi",
                std::sync::Arc::new(runtime::MpiLauncher),
            );
        });
    }
}
