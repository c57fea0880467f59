//! [`ModuleCore`] (a module's training flag, forward hooks and the state a parallelism API
//! attaches in place), [`AttachedState`] and [`RemovableHandle`].

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use crate::{Error, Result, Tensor};

/// A forward hook: sees a module's input (as the pre-hooks left it) and output after
/// `forward`, and may replace the output by returning `Some` (`register_forward_hook`).
pub type ForwardHook = Box<dyn Fn(&Tensor, &Tensor) -> Result<Option<Tensor>> + Send + Sync>;

/// A forward pre-hook: sees a module's input before `forward` and may replace it by returning
/// `Some` (`register_forward_pre_hook`).
pub type ForwardPreHook = Box<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;

type SharedPost = Arc<dyn Fn(&Tensor, &Tensor) -> Result<Option<Tensor>> + Send + Sync>;
type SharedPre = Arc<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;

/// State that a parallelism API attaches to a module in place, as PyTorch's `fully_shard`
/// turns a module into an FSDP module: the API keeps its state here (reachable from the
/// module, for nested calls to find) and says which tensors the module's parameter listing
/// shows instead of its own.
pub trait AttachedState: Send + Sync + 'static {
    /// The API that attached it (`"fully_shard"`), for errors.
    fn kind(&self) -> &'static str;
    /// The tensor [`super::Module::named_parameters`] lists in place of `param` (a parameter
    /// of this module or of a descendant), or `None` to list `param` itself. Fully sharded
    /// data parallelism lists each parameter's local shard, so optimizers see the shards.
    fn parameter_in_place_of(&self, param: &Tensor) -> Option<Tensor>;
    /// The state itself, for the API to downcast.
    fn as_any(&self) -> &dyn std::any::Any;
    /// Called by [`super::Module::zero_grad`]: clears gradients the state keeps outside the
    /// listed parameters (fully sharded data parallelism's unsynced whole gradients). Nothing
    /// by default.
    fn zero_grad(&self) {}
}

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
    attached: Option<Arc<dyn AttachedState>>,
}

impl ModuleCore {
    /// A core in training mode without hooks (a new module is in training mode, as in
    /// PyTorch).
    pub fn new() -> ModuleCore {
        ModuleCore {
            training: true,
            hooks: Arc::default(),
            attached: None,
        }
    }
    /// Attaches a parallelism API's state (see [`AttachedState`]). Errors
    /// ([`Error::InvalidArgument`]) when a state is attached already, naming both APIs: a
    /// module is fully sharded once.
    pub fn attach(&mut self, state: Arc<dyn AttachedState>) -> Result<()> {
        if let Some(a) = &self.attached {
            return Err(Error::invalid(
                state.kind(),
                "module",
                "a module no parallelism API has taken over",
                format!("a module {} was applied to already", a.kind()),
            ));
        }
        self.attached = Some(state);
        Ok(())
    }
    /// The attached state, if any.
    pub fn attached(&self) -> Option<&Arc<dyn AttachedState>> {
        self.attached.as_ref()
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
            .field("attached", &self.attached.as_ref().map(|a| a.kind()))
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
