//! The [`Module`] trait (`torch.nn.Module`).

use std::collections::{BTreeMap, BTreeSet};

use super::fields::{AsModule, ModuleFields};
use super::hooks::{ForwardHook, ForwardPreHook, RemovableHandle};
use crate::{Device, Error, IntoDevice, Result, Tensor};

/// A layer or a model made of layers, like `torch.nn.Module`.
///
/// A module is a struct with `#[derive(Module)]`, which writes what it holds (its
/// [`ModuleCore`](super::ModuleCore), parameters, buffers and children: the supertrait
/// [`ModuleFields`]) from its fields, and an `impl Module` that writes [`Module::forward`].
/// Everything else is provided: recursive `named_parameters` with dotted names, `state_dict`,
/// `train`/`eval`, `zero_grad`, `to`, the visitors ([`Module::named_modules`],
/// [`Module::apply`], [`Module::modules_mut`]) and the forward hooks run by [`Module::call`].
/// The trait is object-safe: `Box<dyn Module>` is what [`crate::nn::Sequential`] holds. To
/// change how a module moves between devices, override [`Module::to_device`]; [`Module::to`]
/// (which takes a [`Device`] or a string) calls it.
///
/// Methods that change a module's state return `Result`, because a module that only proxies
/// a remote one implements this trait too and refuses them with [`Error::NotSupported`].
///
/// ```
/// use tensorplay::{self as tp, nn::{self, Module}, Tensor};
///
/// #[derive(Module)]
/// struct Mlp {
///     fc1: nn::Linear,
///     fc2: nn::Linear,
///     scale: Tensor,         // a parameter
///     dropout: f64,          // plain data, not listed
///     core: nn::ModuleCore,
/// }
///
/// impl Module for Mlp {
///     fn forward(&self, x: &Tensor) -> tp::Result<Tensor> {
///         self.fc2.call(&self.fc1.call(x)?.relu()?)?.mul(&self.scale)
///     }
/// }
///
/// let mlp = Mlp {
///     fc1: nn::Linear::new(4, 8, true)?,
///     fc2: nn::Linear::new(8, 2, false)?,
///     scale: tp::ones(&[2])?.requires_grad_(true),
///     dropout: 0.1,
///     core: nn::ModuleCore::new(),
/// };
/// let names: Vec<String> = mlp.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["scale", "fc1.weight", "fc1.bias", "fc2.weight"]);
/// assert_eq!(mlp.call(&tp::randn(&[3, 4])?)?.shape(), [3, 2]);
/// # Ok::<(), tp::Error>(())
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a module (it does not implement `nn::Module`)",
    note = "#[derive(Module)] makes every field a child module unless it is the `ModuleCore`, a \
            `Tensor` (a parameter), plain data (numbers, bool, String) or marked #[module(skip)]"
)]
pub trait Module: ModuleFields + AsModule + Send + Sync {
    /// Computes the output from `input`. Prefer [`Module::call`], which also runs the forward
    /// hooks (as `module(x)` does in PyTorch).
    fn forward(&self, input: &Tensor) -> Result<Tensor>;

    /// Every parameter of this module and its descendants with dotted names such as
    /// `"0.weight"` (`named_parameters`): own parameters first, then each child's in order.
    ///
    /// A parameter registered more than once (a **tied weight**: the same tensor handle held
    /// by two modules, such as a language model's embedding and output head) is listed once,
    /// under its first name, as PyTorch's `named_parameters()` does; so optimizers step it
    /// once and its gradient is the sum over both uses.
    ///
    /// A module with an [`AttachedState`](super::AttachedState) (a fully sharded one) lists
    /// what the state puts in place of its parameters: their local shards.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = self.local_parameters();
        for (name, child) in self.named_children() {
            for (n, p) in child.named_parameters() {
                out.push((format!("{name}.{n}"), p));
            }
        }
        if let Some(a) = self.core().attached() {
            for (_, p) in out.iter_mut() {
                if let Some(s) = a.parameter_in_place_of(p) {
                    *p = s;
                }
            }
        }
        let mut seen = BTreeSet::new();
        out.retain(|(_, p)| seen.insert(p.id()));
        out
    }

    /// The tensors of [`Module::named_parameters`] (`parameters()`), ready for an optimizer.
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters()
            .into_iter()
            .map(|(_, p)| p)
            .collect()
    }

    /// Every buffer of this module and its descendants with dotted names (`named_buffers`).
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        let mut out = self.local_buffers();
        for (name, child) in self.named_children() {
            for (n, b) in child.named_buffers() {
                out.push((format!("{name}.{n}"), b));
            }
        }
        out
    }

    /// Parameters and buffers by dotted name, detached from the graph (`state_dict()`). The
    /// tensors share storage with the module, as in PyTorch; deep-clone them to snapshot.
    fn state_dict(&self) -> Result<BTreeMap<String, Tensor>> {
        Ok(self
            .named_parameters()
            .into_iter()
            .chain(self.named_buffers())
            .map(|(n, t)| (n, t.detach()))
            .collect())
    }

    /// Copies the values of `state_dict` into this module's parameters and buffers in place,
    /// without recording autograd (`load_state_dict`). Values are converted to each
    /// parameter's dtype and device.
    ///
    /// Errors ([`Error::InvalidArgument`], naming the keys): with `strict`, when a key of the
    /// module is missing from `state_dict` or `state_dict` has a key the module lacks; always,
    /// when a value's shape differs from the parameter's; [`Error::MetaTensor`] when a parameter
    /// or a value to load is on the meta device (allocate the module with
    /// [`Module::to_empty`] first). Nothing is copied when it errors.
    fn load_state_dict(
        &mut self,
        state_dict: &BTreeMap<String, Tensor>,
        strict: bool,
    ) -> Result<()> {
        let own: Vec<(String, Tensor)> = self
            .named_parameters()
            .into_iter()
            .chain(self.named_buffers())
            .collect();
        if strict {
            let own_keys: BTreeSet<&str> = own.iter().map(|(n, _)| n.as_str()).collect();
            let missing: Vec<&str> = own_keys
                .iter()
                .copied()
                .filter(|k| !state_dict.contains_key(*k))
                .collect();
            let unexpected: Vec<&str> = state_dict
                .keys()
                .map(String::as_str)
                .filter(|k| !own_keys.contains(k))
                .collect();
            if !missing.is_empty() || !unexpected.is_empty() {
                return Err(Error::invalid(
                    "load_state_dict",
                    "state_dict",
                    "exactly the module's keys (strict=true)",
                    format!("missing keys {missing:?}, unexpected keys {unexpected:?}"),
                ));
            }
        }
        for (name, t) in &own {
            // a tensor on the meta device has no elements to copy to or from: refuse before
            // copying anything, so that nothing is half loaded
            if let Some(v) = state_dict.get(name)
                && (t.device().is_meta() || v.device().is_meta())
            {
                return Err(Error::MetaTensor {
                    op: "load_state_dict",
                });
            }
            if let Some(v) = state_dict.get(name)
                && v.shape() != t.shape()
            {
                let sharded = match t.sharded_by() {
                    Some(by) => format!(
                        " (a shard made by {by}: this rank's rows only; load the state dict \
                         this rank saved)"
                    ),
                    None => String::new(),
                };
                return Err(Error::invalid(
                    "load_state_dict",
                    "state_dict",
                    format!("shape {:?} for key {name:?}{sharded}", t.shape()),
                    format!("shape {:?}", v.shape()),
                ));
            }
        }
        let _g = crate::no_grad();
        for (name, t) in &own {
            if let Some(v) = state_dict.get(name) {
                t.copy_(v)?;
            }
        }
        Ok(())
    }

    /// Sets training mode on this module and all descendants (`train(mode)`); it changes the
    /// behaviour of layers such as [`crate::nn::Dropout`].
    fn train(&mut self, mode: bool) -> Result<()> {
        self.core_mut().set_training(mode);
        for (_, child) in self.named_children_mut() {
            child.train(mode)?;
        }
        Ok(())
    }

    /// Evaluation mode: `train(false)` (`eval()`).
    fn eval(&mut self) -> Result<()> {
        self.train(false)
    }

    /// Whether this module is in training mode (`.training`).
    fn is_training(&self) -> bool {
        self.core().training()
    }

    /// Clears the gradient of every parameter (`zero_grad(set_to_none=True)`, PyTorch 2's
    /// default), and those an attached state keeps aside (a fully sharded module's gradients
    /// accumulated without sync).
    fn zero_grad(&self) -> Result<()> {
        for p in self.parameters() {
            p.set_grad(None);
        }
        for (_, m) in self.named_modules() {
            if let Some(a) = m.core().attached() {
                a.zero_grad();
            }
        }
        Ok(())
    }

    /// Sets `requires_grad` on every parameter (`requires_grad_`). Errors on a parameter that
    /// is not a floating leaf.
    fn requires_grad_(&mut self, requires_grad: bool) -> Result<()> {
        for p in self.parameters() {
            p.set_requires_grad(requires_grad)?;
        }
        Ok(())
    }

    /// Moves every parameter and buffer to `device` (`module.to(device)` with a [`Device`]):
    /// each is replaced by a new leaf on the device that keeps its `requires_grad` (and its
    /// `.grad`, moved as well). Either every tensor moves or none does; errors with
    /// [`Error::CudaUnavailable`] when CUDA is asked for and cannot be used, and with
    /// [`Error::NotSupported`] when a module of the tree is fully sharded (move it before).
    ///
    /// This is the method to override (a module that cannot move refuses here). Callers
    /// usually write [`Module::to`], which also takes a device string and calls this;
    /// [`Module::cpu`] and [`Module::cuda`] call it too.
    fn to_device(&mut self, device: Device) -> Result<()> {
        if let Some((name, m)) = self
            .named_modules()
            .into_iter()
            .find(|(_, m)| m.core().attached().is_some())
        {
            let kind = m.core().attached().map_or("", |a| a.kind());
            return Err(Error::NotSupported {
                op: "Module::to_device",
                detail: format!(
                    "on a module {kind} was applied to (at {:?}): move the module first",
                    name
                ),
            });
        }
        let mut moved = Vec::new();
        for (_, p) in self
            .named_parameters()
            .into_iter()
            .chain(self.named_buffers())
        {
            moved.push(move_leaf(&p, device)?);
        }
        let mut it = moved.into_iter();
        replace_all(self, &mut |slot| {
            if let Some(t) = it.next() {
                *slot = t;
            }
        });
        Ok(())
    }

    /// Gives every parameter and buffer on the meta device memory on `device`, in place and
    /// uninitialised (zeros here) — PyTorch's `module.to_empty(device=...)`, the second step of
    /// deferred initialisation: build the model under
    /// [`with_default_device(Device::Meta, ..)`](crate::with_default_device) (no memory),
    /// apply `fully_shard` (each rank then holds meta shards), call this (each rank allocates
    /// its shards only), then [`Module::reset_parameters`] or load a checkpoint. Tensors with
    /// memory are left as they are. Every handle of a parameter (an optimizer's, a fully
    /// sharded module's) sees the change.
    ///
    /// ```
    /// use tensorplay::{self as tp, nn::{self, Module}, Device};
    ///
    /// let mut layer = tp::with_default_device(Device::Meta, || nn::Linear::new(3, 2, true))?;
    /// layer.to_empty(Device::Cpu)?;
    /// layer.reset_parameters()?;
    /// assert_eq!(layer.weight.device(), Device::Cpu);
    /// assert!(layer.weight.abs()?.max()?.item::<f32>()? <= 1.0 / 3f32.sqrt());
    /// # Ok::<(), tp::Error>(())
    /// ```
    ///
    /// Errors: `device` is the meta device ([`Error::InvalidArgument`]); memory that cannot be
    /// allocated; a CUDA device that cannot be used.
    fn to_empty(&mut self, device: Device) -> Result<()> {
        if device.is_meta() {
            return Err(Error::invalid(
                "Module::to_empty",
                "device",
                "a device with memory (\"cpu\" or \"cuda:N\")",
                device,
            ));
        }
        let mut tensors: Vec<Tensor> = Vec::new();
        for (_, m) in self.named_modules() {
            tensors.extend(m.local_parameters().into_iter().map(|(_, t)| t));
            tensors.extend(m.local_buffers().into_iter().map(|(_, t)| t));
        }
        // a fully sharded module's tensors lead to their local shards
        let shards: Vec<Tensor> = tensors.iter().filter_map(Tensor::local_shard).collect();
        tensors.extend(shards);
        for t in &tensors {
            t.materialize(device)?;
        }
        Ok(())
    }

    /// Initialises this module's parameters again as its constructor does, and its
    /// descendants' (`reset_parameters`; the default calls it on every child, and the layers
    /// override it: [`crate::nn::Linear`], [`crate::nn::Embedding`],
    /// [`crate::nn::LayerNorm`], [`crate::nn::MultiheadAttention`]). The random draws go
    /// through [`crate::nn::init`]: one seed per parameter from the default generator, so a
    /// fully sharded rank fills its shards with the values the whole model's rows get, and the
    /// result does not depend on the sharding. The values differ from the constructor's own
    /// draws (which take the elements one by one from the generator), not their distribution.
    /// On the meta device it does nothing.
    ///
    /// Errors: as the [`crate::nn::init`] functions.
    fn reset_parameters(&mut self) -> Result<()> {
        for (_, child) in self.named_children_mut() {
            child.reset_parameters()?;
        }
        Ok(())
    }

    /// Moves every parameter and buffer to `device` (`model.to("cuda")`), like
    /// [`Tensor::to`]: a [`Device`] or a string such as `"cpu"`, `"cuda"`, `"cuda:1"`; see
    /// [`Module::to_device`] for what moves. It works on a `Box<dyn Module>` too (a box of a
    /// module is a module); on a bare `&mut dyn Module` call [`Module::to_device`], since
    /// this method is generic and so not callable on a trait object.
    ///
    /// Errors: [`Error::InvalidDevice`] for a bad string (nothing moves),
    /// [`Error::CudaUnavailable`] when CUDA is asked for and cannot be used, and whatever
    /// the module's [`Module::to_device`] refuses with.
    ///
    /// ```
    /// use tensorplay::{self as tp, nn::{self, Module}, Device};
    ///
    /// let mut model = nn::Sequential::new().add(nn::Linear::new(2, 2, true)?);
    /// model.to("cpu")?;
    /// model.to(Device::Cpu)?;
    /// assert!(model.parameters().iter().all(|p| p.device() == Device::Cpu));
    /// assert!(matches!(model.to("tpu"), Err(tp::Error::InvalidDevice { .. })));
    ///
    /// let mut boxed: Box<dyn Module> = Box::new(nn::Linear::new(2, 2, false)?);
    /// boxed.to("cpu")?;
    /// # Ok::<(), tp::Error>(())
    /// ```
    fn to(&mut self, device: impl IntoDevice) -> Result<()>
    where
        Self: Sized,
    {
        self.to_device(device.into_device()?)
    }

    /// `to_device(Device::Cpu)`.
    fn cpu(&mut self) -> Result<()> {
        self.to_device(Device::Cpu)
    }

    /// `to_device(Device::Cuda(ordinal))`.
    fn cuda(&mut self, ordinal: usize) -> Result<()> {
        self.to_device(Device::Cuda(ordinal))
    }

    /// Registers a hook run by every [`Module::call`] after `forward`, with the input (as the
    /// pre-hooks left it) and the output; a hook returning `Some(t)` replaces the output for
    /// the hooks after it and the caller (`register_forward_hook`). Hooks run in registration
    /// order; the handle's [`RemovableHandle::remove`] takes this one off.
    fn register_forward_hook(&mut self, hook: ForwardHook) -> Result<RemovableHandle> {
        Ok(self.core_mut().push_hook(hook))
    }

    /// Registers a hook run by every [`Module::call`] before `forward`, with the input; a hook
    /// returning `Some(t)` replaces the input for the hooks after it and `forward`
    /// (`register_forward_pre_hook`). Hooks run in registration order; the handle's
    /// [`RemovableHandle::remove`] takes this one off.
    fn register_forward_pre_hook(&mut self, hook: ForwardPreHook) -> Result<RemovableHandle> {
        Ok(self.core_mut().push_pre_hook(hook))
    }

    /// Runs the forward pre-hooks, [`Module::forward`] and then the forward hooks
    /// (`module(input)`); errors with the first error of any of them.
    fn call(&self, input: &Tensor) -> Result<Tensor> {
        let core = self.core();
        let replaced = core.run_forward_pre_hooks(input)?;
        let input = replaced.as_ref().unwrap_or(input);
        let out = self.forward(input)?;
        core.run_forward_hooks(input, out)
    }

    /// The direct sub-modules (`children()`), in the order of
    /// [`ModuleFields::named_children`].
    fn children(&self) -> Vec<&dyn Module> {
        self.named_children().into_iter().map(|(_, m)| m).collect()
    }

    /// This module and every descendant, in pre-order (a module before its children, children
    /// in order), with dotted names: this module is `""`, a grandchild `"h.0"`
    /// (`named_modules()`). A module held twice is listed twice (Rust modules have one owner).
    fn named_modules(&self) -> Vec<(String, &dyn Module)> {
        let mut out = vec![(String::new(), self.as_module())];
        for (name, child) in self.named_children() {
            for (n, m) in child.named_modules() {
                out.push((join(&name, &n), m));
            }
        }
        out
    }

    /// The modules of [`Module::named_modules`] without their names (`modules()`).
    fn modules(&self) -> Vec<&dyn Module> {
        self.named_modules().into_iter().map(|(_, m)| m).collect()
    }

    /// Calls `f` on this module and every descendant with its dotted name, in the order of
    /// [`Module::named_modules`], with mutable access: the visitor that rewrites a tree
    /// (sharding parameters, replacing children). A module's children are listed after `f`
    /// has seen the module, so `f` may replace them. Stops at the first error of `f`.
    fn named_modules_mut(
        &mut self,
        f: &mut dyn FnMut(&str, &mut dyn Module) -> Result<()>,
    ) -> Result<()> {
        f("", self.as_module_mut())?;
        for (name, child) in self.named_children_mut() {
            child.named_modules_mut(&mut |n, m| f(&join(&name, n), m))?;
        }
        Ok(())
    }

    /// [`Module::named_modules_mut`] without the names.
    fn modules_mut(&mut self, f: &mut dyn FnMut(&mut dyn Module) -> Result<()>) -> Result<()> {
        self.named_modules_mut(&mut |_, m| f(m))
    }

    /// Calls `f` on every descendant and then on this module (post-order: children first, as
    /// PyTorch's `module.apply(fn)`), typically to initialise parameters. Stops at the first
    /// error of `f`.
    ///
    /// ```
    /// use tensorplay::{self as tp, nn::{self, Module}};
    ///
    /// let mut model = nn::Sequential::new()
    ///     .add(nn::Linear::new(3, 4, true)?)
    ///     .add(nn::ReLU::new())
    ///     .add(nn::Linear::new(4, 2, true)?);
    /// // zero every bias
    /// model.apply(&mut |m| {
    ///     for (name, p) in m.local_parameters() {
    ///         if name == "bias" {
    ///             let _g = tp::no_grad();
    ///             p.fill_(0.0)?;
    ///         }
    ///     }
    ///     Ok(())
    /// })?;
    /// assert_eq!(model.state_dict()?["2.bias"].to_vec::<f32>()?, [0.0, 0.0]);
    /// # Ok::<(), tp::Error>(())
    /// ```
    fn apply(&mut self, f: &mut dyn FnMut(&mut dyn Module) -> Result<()>) -> Result<()> {
        for (_, child) in self.named_children_mut() {
            child.apply(f)?;
        }
        f(self.as_module_mut())
    }
}

/// `prefix.name`, or the one that is not empty.
fn join(prefix: &str, name: &str) -> String {
    match (prefix.is_empty(), name.is_empty()) {
        (_, true) => prefix.to_string(),
        (true, false) => name.to_string(),
        (false, false) => format!("{prefix}.{name}"),
    }
}

/// A new leaf on `device` holding `t`'s values, with its `requires_grad` and moved `.grad`.
fn move_leaf(t: &Tensor, device: Device) -> Result<Tensor> {
    let rg = t.requires_grad();
    let grad = match t.grad() {
        Some(g) => Some(g.detach().to_device(device)?),
        None => None,
    };
    let n = t.detach().to_device(device)?.detach();
    if rg {
        n.set_requires_grad(true)?;
    }
    n.set_grad(grad);
    Ok(n)
}

/// Visits every parameter slot and then every buffer slot, in the order of
/// `named_parameters` followed by `named_buffers`.
fn replace_all(m: &mut (impl Module + ?Sized), f: &mut dyn FnMut(&mut Tensor)) {
    fn params(m: &mut dyn Module, f: &mut dyn FnMut(&mut Tensor)) {
        for (_, p) in m.local_parameters_mut() {
            f(p);
        }
        for (_, c) in m.named_children_mut() {
            params(c, f);
        }
    }
    fn buffers(m: &mut dyn Module, f: &mut dyn FnMut(&mut Tensor)) {
        for (_, b) in m.local_buffers_mut() {
            f(b);
        }
        for (_, c) in m.named_children_mut() {
            buffers(c, f);
        }
    }
    for (_, p) in m.local_parameters_mut() {
        f(p);
    }
    for (_, c) in m.named_children_mut() {
        params(c, f);
    }
    for (_, b) in m.local_buffers_mut() {
        f(b);
    }
    for (_, c) in m.named_children_mut() {
        buffers(c, f);
    }
}
