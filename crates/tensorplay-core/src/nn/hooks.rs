//! [`ModuleCore`] (a module's training flag and forward hooks) and [`RemovableHandle`].

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use crate::{Result, Tensor};

/// A forward hook: sees a module's input (as the pre-hooks left it) and output after
/// `forward`, and may replace the output by returning `Some` (`register_forward_hook`).
pub type ForwardHook = Box<dyn Fn(&Tensor, &Tensor) -> Result<Option<Tensor>> + Send + Sync>;

/// A forward pre-hook: sees a module's input before `forward` and may replace it by returning
/// `Some` (`register_forward_pre_hook`).
pub type ForwardPreHook = Box<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;

type SharedPost = Arc<dyn Fn(&Tensor, &Tensor) -> Result<Option<Tensor>> + Send + Sync>;
type SharedPre = Arc<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;

/// The hooks of one module, each with the id its handle removes it by.
#[derive(Default)]
struct Hooks {
    next_id: u64,
    pre: Vec<(u64, SharedPre)>,
    post: Vec<(u64, SharedPost)>,
}

fn lock(hooks: &Mutex<Hooks>) -> MutexGuard<'_, Hooks> {
    // a hook list is consistent after any panic (pushes and retains only)
    hooks.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The per-module state every layer keeps: the training flag and the forward hooks.
///
/// Layers hold one and hand it out through [`super::ModuleFields::core`] /
/// [`super::ModuleFields::core_mut`] (`#[derive(Module)]` writes both); the provided methods of
/// [`super::Module`] (`train`, `is_training`, `register_forward_hook`, `call`) work on it.
pub struct ModuleCore {
    training: bool,
    hooks: Arc<Mutex<Hooks>>,
}

impl ModuleCore {
    /// A core in training mode without hooks (a new module is in training mode, as in
    /// PyTorch).
    pub fn new() -> ModuleCore {
        ModuleCore {
            training: true,
            hooks: Arc::default(),
        }
    }
    /// Whether the module is in training mode.
    pub fn training(&self) -> bool {
        self.training
    }
    /// Sets the training flag of this module only.
    pub fn set_training(&mut self, mode: bool) {
        self.training = mode;
    }
    /// Appends a forward hook (run after `forward`, in registration order); the handle
    /// removes it.
    pub fn push_hook(&mut self, hook: ForwardHook) -> RemovableHandle {
        let mut h = lock(&self.hooks);
        let id = h.next_id;
        h.next_id += 1;
        h.post.push((id, Arc::from(hook)));
        self.handle(id)
    }
    /// Appends a forward pre-hook (run before `forward`, in registration order); the handle
    /// removes it.
    pub fn push_pre_hook(&mut self, hook: ForwardPreHook) -> RemovableHandle {
        let mut h = lock(&self.hooks);
        let id = h.next_id;
        h.next_id += 1;
        h.pre.push((id, Arc::from(hook)));
        self.handle(id)
    }
    fn handle(&self, id: u64) -> RemovableHandle {
        RemovableHandle {
            hooks: Arc::downgrade(&self.hooks),
            id,
        }
    }
    /// The number of forward pre-hooks and forward hooks registered now.
    pub fn hook_counts(&self) -> (usize, usize) {
        let h = lock(&self.hooks);
        (h.pre.len(), h.post.len())
    }
    /// Runs the forward pre-hooks in registration order, each on the input the previous one
    /// left; `None` when no hook replaced `input`. Stops at the first hook that errors.
    pub fn run_forward_pre_hooks(&self, input: &Tensor) -> Result<Option<Tensor>> {
        // a snapshot, so that a hook may register or remove hooks without deadlocking
        let hooks: Vec<SharedPre> = lock(&self.hooks)
            .pre
            .iter()
            .map(|(_, f)| f.clone())
            .collect();
        let mut replaced: Option<Tensor> = None;
        for hook in hooks {
            if let Some(x) = hook(replaced.as_ref().unwrap_or(input))? {
                replaced = Some(x);
            }
        }
        Ok(replaced)
    }
    /// Runs the forward hooks in registration order on `input` and the output, each seeing
    /// the output the previous one left, and returns the final output. Stops at the first
    /// hook that errors.
    pub fn run_forward_hooks(&self, input: &Tensor, output: Tensor) -> Result<Tensor> {
        let hooks: Vec<SharedPost> = lock(&self.hooks)
            .post
            .iter()
            .map(|(_, f)| f.clone())
            .collect();
        let mut out = output;
        for hook in hooks {
            if let Some(o) = hook(input, &out)? {
                out = o;
            }
        }
        Ok(out)
    }
}

impl Default for ModuleCore {
    fn default() -> Self {
        ModuleCore::new()
    }
}

impl fmt::Debug for ModuleCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (pre, post) = self.hook_counts();
        f.debug_struct("ModuleCore")
            .field("training", &self.training)
            .field("forward_pre_hooks", &pre)
            .field("forward_hooks", &post)
            .finish()
    }
}

/// The handle of a registered hook (`torch.utils.hooks.RemovableHandle`): [`remove`] takes
/// the hook off its module. Dropping the handle keeps the hook, as in PyTorch.
///
/// [`remove`]: RemovableHandle::remove
pub struct RemovableHandle {
    hooks: Weak<Mutex<Hooks>>,
    id: u64,
}

impl RemovableHandle {
    /// Removes the hook; removing it again, or after its module is dropped, does nothing.
    pub fn remove(&self) {
        if let Some(hooks) = self.hooks.upgrade() {
            let mut h = lock(&hooks);
            h.pre.retain(|(id, _)| *id != self.id);
            h.post.retain(|(id, _)| *id != self.id);
        }
    }
    /// The hook's id, unique among its module's hooks (`handle.id`).
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl fmt::Debug for RemovableHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemovableHandle")
            .field("id", &self.id)
            .finish()
    }
}
