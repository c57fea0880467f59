//! `Box<M>` as a module.

use std::collections::BTreeMap;

use super::hooks::{ForwardHook, ForwardPreHook, RemovableHandle};
use super::module::Module;
use crate::{Device, Result, Tensor};

/// A boxed module is a module: every method is forwarded to the boxed one (so its overrides,
/// such as a [`Module::to_device`] that refuses, are kept). This is what makes
/// `boxed.to("cpu")` work on a `Box<dyn Module>`: [`Module::to`] needs `Self: Sized`, which
/// the box is and `dyn Module` is not.
impl<M: Module + ?Sized> Module for Box<M> {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        (**self).forward(input)
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
    fn to_empty(&mut self, device: Device) -> Result<()> {
        (**self).to_empty(device)
    }
    fn reset_parameters(&mut self) -> Result<()> {
        (**self).reset_parameters()
    }
    fn cpu(&mut self) -> Result<()> {
        (**self).cpu()
    }
    fn cuda(&mut self, ordinal: usize) -> Result<()> {
        (**self).cuda(ordinal)
    }
    fn register_forward_hook(&mut self, hook: ForwardHook) -> Result<RemovableHandle> {
        (**self).register_forward_hook(hook)
    }
    fn register_forward_pre_hook(&mut self, hook: ForwardPreHook) -> Result<RemovableHandle> {
        (**self).register_forward_pre_hook(hook)
    }
    fn call(&self, input: &Tensor) -> Result<Tensor> {
        (**self).call(input)
    }
    fn children(&self) -> Vec<&dyn Module> {
        (**self).children()
    }
    fn named_modules(&self) -> Vec<(String, &dyn Module)> {
        (**self).named_modules()
    }
    fn modules(&self) -> Vec<&dyn Module> {
        (**self).modules()
    }
    fn named_modules_mut(
        &mut self,
        f: &mut dyn FnMut(&str, &mut dyn Module) -> Result<()>,
    ) -> Result<()> {
        (**self).named_modules_mut(f)
    }
    fn modules_mut(&mut self, f: &mut dyn FnMut(&mut dyn Module) -> Result<()>) -> Result<()> {
        (**self).modules_mut(f)
    }
    fn apply(&mut self, f: &mut dyn FnMut(&mut dyn Module) -> Result<()>) -> Result<()> {
        (**self).apply(f)
    }
}
