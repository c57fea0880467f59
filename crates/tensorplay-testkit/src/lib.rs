//! `tensorplay-testkit`: what the workspace's tests share, so that no test file carries its own
//! copy (unpublished; a dev-dependency only).
//!
//! - [`close`]: tolerance checks of values against a reference ("equals one process" within
//!   a stated tolerance), naming the case and the first element that differs;
//! - [`world`]: a spawned world of real processes on the "cpu" backend, initialised and torn
//!   down around the test's body;
//! - [`tmp`]: temporary folders under `std::env::temp_dir()`, removed on drop;
//! - [`names`]: the libtest name of a test, for tests that re-run one of their own in a fresh
//!   process (`--exact NAME`) from a module of a one-binary test target;
//! - [`hostile`]: bytes a hostile peer or a corrupt file would hold (truncations, bit flips,
//!   oversized length prefixes), built from a valid message.

pub mod backend_suite;
pub mod bits;
pub mod close;
pub mod generator;
pub mod hostile;
pub mod names;
pub mod tmp;
pub mod world;

pub use bits::{element_bits, le_bytes};
pub use close::{Tol, assert_close, check_close};
pub use generator::generator_lock;
pub use names::test_name;
pub use tmp::TempDir;
pub use world::{SharedDir, cpu_world, cpu_world_in};
