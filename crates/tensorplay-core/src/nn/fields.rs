//! [`ModuleFields`]: what a module holds (its core, parameters, buffers and children), the part
//! of a module that `#[derive(Module)]` writes; and [`AsModule`].

use super::hooks::ModuleCore;
use super::module::Module;
use crate::Tensor;

/// What a module holds: its [`ModuleCore`], its own parameters and buffers, and its direct
/// children, each with its attribute name. It is [`Module`]'s supertrait: the recursive
/// methods of [`Module`] (`named_parameters`, `state_dict`, `train`, `to`, the visitors)
/// walk the tree through it.
///
/// Write it with `#[derive(Module)]`, which reads it off the struct's fields (see the derive's
/// documentation, re-exported as [`macro@crate::nn::Module`]); implement it by hand only for a
/// module whose children are not fields, such as [`crate::nn::Sequential`]. The methods are
/// callable on any `dyn Module`; on a concrete type, bring this trait into scope
/// (`use tensorplay::nn::ModuleFields`).
///
/// # Compile errors of the derive
///
/// A field whose type is not a module, not a tensor, not plain data and not marked
/// `#[module(skip)]` (here an options enum) is refused at the field:
///
/// ```compile_fail,E0277
/// use tensorplay::nn::{self, Module, ModuleCore};
///
/// #[derive(Module)]
/// struct Gelu {
///     approximate: nn::functional::Approximate, // needs #[module(skip)]
///     core: ModuleCore,
/// }
/// ```
///
/// A module without its `ModuleCore`:
///
/// ```compile_fail
/// use tensorplay::{Tensor, nn::Module};
///
/// #[derive(Module)]
/// struct Scale {
///     w: Tensor,
/// }
/// ```
///
/// A `Vec` of modules (hold them in an `nn::ModuleList`):
///
/// ```compile_fail
/// use tensorplay::nn::{Linear, Module, ModuleCore};
///
/// #[derive(Module)]
/// struct Stack {
///     layers: Vec<Linear>,
///     core: ModuleCore,
/// }
/// ```
///
/// A buffer that is not a tensor, and a tuple struct (fields name the parameters):
///
/// ```compile_fail
/// use tensorplay::nn::{Module, ModuleCore};
///
/// #[derive(Module)]
/// struct Counter {
///     #[module(buffer)]
///     steps: usize,
///     core: ModuleCore,
/// }
/// ```
///
/// ```compile_fail
/// use tensorplay::{Tensor, nn::{Module, ModuleCore}};
///
/// #[derive(Module)]
/// struct Pair(Tensor, ModuleCore);
/// ```
///
/// The same structs compile once fixed (`crate = ".."` names the root the generated code
/// uses; here the facade's, which a crate depending on `tensorplay` alone gets by default):
///
/// ```
/// use tensorplay::{Tensor, nn::{self, Linear, Module, ModuleCore, ModuleList}};
///
/// #[derive(Module)]
/// #[module(crate = "tensorplay")]
/// struct Gelu {
///     #[module(skip)]
///     approximate: nn::functional::Approximate,
///     core: ModuleCore,
/// }
/// #[derive(Module)]
/// struct Stack {
///     layers: ModuleList<Linear>,
///     #[module(buffer)]
///     steps: Tensor,
///     core: ModuleCore,
/// }
/// ```
pub trait ModuleFields {
    /// The training flag and hooks of this module.
    fn core(&self) -> &ModuleCore;

    /// Mutable access to the training flag and hooks of this module.
    fn core_mut(&mut self) -> &mut ModuleCore;

    /// This module's own parameters (not its children's), with their attribute names.
    fn local_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    /// Mutable slots of this module's own parameters, in the order of
    /// [`ModuleFields::local_parameters`]; used by [`Module::to_device`] to replace them.
    fn local_parameters_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        Vec::new()
    }

    /// This module's own buffers (state that is saved but not trained, like running means).
    fn local_buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    /// Mutable slots of this module's own buffers, in the order of
    /// [`ModuleFields::local_buffers`].
    fn local_buffers_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        Vec::new()
    }

    /// The direct sub-modules with their names (`named_children`).
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        Vec::new()
    }

    /// Mutable access to the direct sub-modules, in the order of
    /// [`ModuleFields::named_children`].
    fn named_children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        Vec::new()
    }
}

/// A module as a `dyn Module` (implemented for every sized module), which lets the visitors
/// of [`Module`] hand a module itself to a callback.
pub trait AsModule {
    /// `self` as a module trait object.
    fn as_module(&self) -> &dyn Module;
    /// `self` as a mutable module trait object.
    fn as_module_mut(&mut self) -> &mut dyn Module;
}

impl<T: Module> AsModule for T {
    fn as_module(&self) -> &dyn Module {
        self
    }
    fn as_module_mut(&mut self) -> &mut dyn Module {
        self
    }
}

/// A boxed module holds what the boxed one holds.
impl<M: ModuleFields + ?Sized> ModuleFields for Box<M> {
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
}
