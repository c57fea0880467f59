//! Exclusive use of the process-wide default generator in tests that run side by side in one
//! process: a test that seeds it and compares the draws holds [`generator_lock`] meanwhile, so
//! another test's draws cannot come in between.

use std::sync::{Mutex, MutexGuard, PoisonError};

static GENERATOR: Mutex<()> = Mutex::new(());

/// Holds the default generator for this test until the guard drops (a failed holder does not
/// poison it for the others).
pub fn generator_lock() -> MutexGuard<'static, ()> {
    GENERATOR.lock().unwrap_or_else(PoisonError::into_inner)
}
