//! The [`Module`] trait (`torch.nn.Module`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::{Device, Error, IntoDevice, Result, Tensor};

/// A forward hook: sees a module's input and output after `forward` and may replace the
/// output by returning `Some` (`register_forward_hook`).
pub type ForwardHook = Box<dyn Fn(&Tensor, &Tensor) -> Result<Option<Tensor>> + Send + Sync>;

/// A forward pre-hook: sees a module's input before `forward` and may replace it by returning
/// `Some` (`register_forward_pre_hook`).
pub type ForwardPreHook = Box<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;

/// The per-module state every layer keeps: the training flag and the forward hooks.
///
/// Layers hold one and hand it out through [`Module::core`] / [`Module::core_mut`]; the
/// provided methods of [`Module`] (`train`, `is_training`, `register_forward_hook`, `call`)
/// work on it.
pub struct ModuleCore {
    training: bool,
    hooks: Vec<ForwardHook>,
    pre_hooks: Vec<ForwardPreHook>,
}

impl ModuleCore {
    /// A core in training mode without hooks (a new module is in training mode, as in
    /// PyTorch).
    pub fn new() -> ModuleCore {
        ModuleCore {
            training: true,
            hooks: Vec::new(),
            pre_hooks: Vec::new(),
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
    /// The registered forward hooks, in registration order.
    pub fn hooks(&self) -> &[ForwardHook] {
        &self.hooks
    }
    /// Appends a forward hook.
    pub fn push_hook(&mut self, hook: ForwardHook) {
        self.hooks.push(hook);
    }
    /// The registered forward pre-hooks, in registration order.
    pub fn pre_hooks(&self) -> &[ForwardPreHook] {
        &self.pre_hooks
    }
    /// Appends a forward pre-hook.
    pub fn push_pre_hook(&mut self, hook: ForwardPreHook) {
        self.pre_hooks.push(hook);
    }
}

impl Default for ModuleCore {
    fn default() -> Self {
        ModuleCore::new()
    }
}

impl fmt::Debug for ModuleCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModuleCore")
            .field("training", &self.training)
            .field("hooks", &self.hooks.len())
            .field("pre_hooks", &self.pre_hooks.len())
            .finish()
    }
}

/// A layer or a model made of layers, like `torch.nn.Module`.
///
/// Implementors write [`Module::forward`], hand out their [`ModuleCore`], and list their own
/// parameters (`local_parameters` / `local_parameters_mut`), buffers and children; everything
/// else (recursive `named_parameters` with dotted names, `state_dict`, `train`/`eval`,
/// `zero_grad`, `to`, hooks) is provided. The trait is object-safe: `Box<dyn Module>` is what
/// [`crate::nn::Sequential`] holds. To change how a module moves between devices, override
/// [`Module::to_device`]; [`Module::to`] (which takes a [`Device`] or a string) calls it.
///
/// Methods that change a module's state return `Result`, because a module that only proxies
/// a remote one implements this trait too and refuses them with [`Error::Unsupported`].
pub trait Module: Send + Sync {
    /// Computes the output from `input`. Prefer [`Module::call`], which also runs the forward
    /// hooks (as `module(x)` does in PyTorch).
    fn forward(&self, input: &Tensor) -> Result<Tensor>;

    /// The training flag and hooks of this module.
    fn core(&self) -> &ModuleCore;

    /// Mutable access to the training flag and hooks of this module.
    fn core_mut(&mut self) -> &mut ModuleCore;

    /// This module's own parameters (not its children's), with their attribute names.
    fn local_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    /// Mutable slots of this module's own parameters, in the order of
    /// [`Module::local_parameters`]; used by [`Module::to_device`] to replace them.
    fn local_parameters_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        Vec::new()
    }

    /// This module's own buffers (state that is saved but not trained, like running means).
    fn local_buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    /// Mutable slots of this module's own buffers, in the order of [`Module::local_buffers`].
    fn local_buffers_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        Vec::new()
    }

    /// The direct sub-modules with their names (`named_children`).
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        Vec::new()
    }

    /// Mutable access to the direct sub-modules, in the order of [`Module::named_children`].
    fn named_children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        Vec::new()
    }

    /// Every parameter of this module and its descendants with dotted names such as
    /// `"0.weight"` (`named_parameters`): own parameters first, then each child's in order.
    ///
    /// A parameter registered more than once (a **tied weight**: the same tensor handle held
    /// by two modules, such as a language model's embedding and output head) is listed once,
    /// under its first name, as PyTorch's `named_parameters()` does; so optimizers step it
    /// once and its gradient is the sum over both uses.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = self.local_parameters();
        for (name, child) in self.named_children() {
            for (n, p) in child.named_parameters() {
                out.push((format!("{name}.{n}"), p));
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
    /// when a value's shape differs from the parameter's. Nothing is copied when it errors.
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
            if let Some(v) = state_dict.get(name)
                && v.shape() != t.shape()
            {
                return Err(Error::invalid(
                    "load_state_dict",
                    "state_dict",
                    format!("shape {:?} for key {name:?}", t.shape()),
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
    /// default).
    fn zero_grad(&self) -> Result<()> {
        for p in self.parameters() {
            p.set_grad(None);
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
    /// [`Error::CudaUnavailable`] when CUDA is asked for and cannot be used.
    ///
    /// This is the method to override (a module that cannot move refuses here). Callers
    /// usually write [`Module::to`], which also takes a device string and calls this;
    /// [`Module::cpu`] and [`Module::cuda`] call it too.
    fn to_device(&mut self, device: Device) -> Result<()> {
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

    /// Registers a hook run after every [`Module::call`] with the input and the output; a hook
    /// returning `Some(t)` replaces the output (`register_forward_hook`). Hooks run in
    /// registration order.
    fn register_forward_hook(&mut self, hook: ForwardHook) -> Result<()> {
        self.core_mut().push_hook(hook);
        Ok(())
    }

    /// Registers a hook run before every [`Module::forward`] in [`Module::call`] with the
    /// input; a hook returning `Some(t)` replaces the input that `forward` (and the next
    /// pre-hooks, and the forward hooks) see (`register_forward_pre_hook`). Hooks run in
    /// registration order.
    fn register_forward_pre_hook(&mut self, hook: ForwardPreHook) -> Result<()> {
        self.core_mut().push_pre_hook(hook);
        Ok(())
    }

    /// Runs the forward pre-hooks, [`Module::forward`], then the forward hooks
    /// (`module(input)`).
    fn call(&self, input: &Tensor) -> Result<Tensor> {
        let mut replaced = None;
        for hook in self.core().pre_hooks() {
            if let Some(x) = hook(replaced.as_ref().unwrap_or(input))? {
                replaced = Some(x);
            }
        }
        let input = replaced.as_ref().unwrap_or(input);
        let mut out = self.forward(input)?;
        for hook in self.core().hooks() {
            if let Some(o) = hook(input, &out)? {
                out = o;
            }
        }
        Ok(out)
    }
}

/// A boxed module is a module: every method is forwarded to the boxed one (so its overrides,
/// such as a [`Module::to_device`] that refuses, are kept). This is what makes
/// `boxed.to("cpu")` work on a `Box<dyn Module>`: [`Module::to`] needs `Self: Sized`, which
/// the box is and `dyn Module` is not.
impl<M: Module + ?Sized> Module for Box<M> {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        (**self).forward(input)
    }
    fn core(&self) -> &ModuleCore {
        (**self).core()
    }
    fn core_mut(&mut self) -> &mut ModuleCore {
        (**self).core_mut()
    }
    fn local_parameters(&self) -> Vec<(String, Tensor)> {
        (**self).local_parameters()
    }
    fn local_parameters_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        (**self).local_parameters_mut()
    }
    fn local_buffers(&self) -> Vec<(String, Tensor)> {
        (**self).local_buffers()
    }
    fn local_buffers_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        (**self).local_buffers_mut()
    }
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        (**self).named_children()
    }
    fn named_children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        (**self).named_children_mut()
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        (**self).named_parameters()
    }
    fn parameters(&self) -> Vec<Tensor> {
        (**self).parameters()
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        (**self).named_buffers()
    }
    fn state_dict(&self) -> Result<BTreeMap<String, Tensor>> {
        (**self).state_dict()
    }
    fn load_state_dict(
        &mut self,
        state_dict: &BTreeMap<String, Tensor>,
        strict: bool,
    ) -> Result<()> {
        (**self).load_state_dict(state_dict, strict)
    }
    fn train(&mut self, mode: bool) -> Result<()> {
        (**self).train(mode)
    }
    fn eval(&mut self) -> Result<()> {
        (**self).eval()
    }
    fn is_training(&self) -> bool {
        (**self).is_training()
    }
    fn zero_grad(&self) -> Result<()> {
        (**self).zero_grad()
    }
    fn requires_grad_(&mut self, requires_grad: bool) -> Result<()> {
        (**self).requires_grad_(requires_grad)
    }
    fn to_device(&mut self, device: Device) -> Result<()> {
        (**self).to_device(device)
    }
    fn cpu(&mut self) -> Result<()> {
        (**self).cpu()
    }
    fn cuda(&mut self, ordinal: usize) -> Result<()> {
        (**self).cuda(ordinal)
    }
    fn register_forward_hook(&mut self, hook: ForwardHook) -> Result<()> {
        (**self).register_forward_hook(hook)
    }
    fn register_forward_pre_hook(&mut self, hook: ForwardPreHook) -> Result<()> {
        (**self).register_forward_pre_hook(hook)
    }
    fn call(&self, input: &Tensor) -> Result<Tensor> {
        (**self).call(input)
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
