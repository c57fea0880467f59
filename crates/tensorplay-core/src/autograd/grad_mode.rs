//! Thread-local gradient mode (`torch.no_grad`, `torch.set_grad_enabled`).

use std::cell::Cell;

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether operations on this thread record autograd history.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Turns history recording on or off for this thread; returns a guard that restores the
/// previous mode when dropped.
pub fn set_grad_enabled(enabled: bool) -> GradModeGuard {
    let prev = GRAD_ENABLED.with(|g| g.replace(enabled));
    GradModeGuard { prev }
}

/// Disables history recording on this thread until the guard is dropped (`torch.no_grad()`).
///
/// ```
/// use tensorplay as tp;
/// let w = tp::ones(&[2])?.requires_grad_(true);
/// let y = {
///     let _g = tp::no_grad();
///     w.mul_scalar(2.0)?
/// };
/// assert!(!y.requires_grad());
/// # Ok::<(), tp::Error>(())
/// ```
pub fn no_grad() -> GradModeGuard {
    set_grad_enabled(false)
}

/// Restores the previous gradient mode on drop.
#[must_use = "the mode is restored as soon as the guard is dropped"]
pub struct GradModeGuard {
    prev: bool,
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.prev));
    }
}
