//! [`ModuleList`]: an indexed list of sub-modules (`torch.nn.ModuleList`).

use std::fmt;
use std::ops::Index;

use super::{Module, ModuleCore, ModuleFields};
use crate::{Error, Result, Tensor};

/// Sub-modules held in a list (`torch.nn.ModuleList`): registered as children named `"0"`,
/// `"1"`, ... (so their parameters are `"0.weight"`, ...; `train`, `to` and `state_dict` reach
/// them), but, unlike [`crate::nn::Sequential`], not chained: the owner decides how to call
/// them. The element type is any module (`ModuleList<Block>` keeps typed access);
/// `ModuleList` alone holds boxed modules of mixed types.
///
/// [`Module::forward`] is refused with [`Error::NotSupported`], as PyTorch's `ModuleList` has
/// no `forward`.
///
/// ```
/// use tensorplay::{self as tp, nn::{self, Module}};
/// let mut layers = nn::ModuleList::new();
/// for _ in 0..3 {
///     layers.push(nn::Linear::new(4, 4, true)?);
/// }
/// let mut x = tp::randn(&[2, 4])?;
/// for layer in &layers {
///     x = layer.call(&x)?.relu()?;
/// }
/// assert_eq!(layers.len(), 3);
/// assert_eq!(layers.named_parameters()[5].0, "2.bias");
/// # Ok::<(), tp::Error>(())
/// ```
pub struct ModuleList<M: Module = Box<dyn Module>> {
    items: Vec<M>,
    core: ModuleCore,
}

impl<M: Module> ModuleList<M> {
    /// An empty list.
    pub fn new() -> ModuleList<M> {
        ModuleList {
            items: Vec::new(),
            core: ModuleCore::new(),
        }
    }

    /// A list of `items`, in order.
    pub fn from_vec(items: Vec<M>) -> ModuleList<M> {
        ModuleList {
            items,
            core: ModuleCore::new(),
        }
    }

    /// Appends a module.
    pub fn push(&mut self, module: M) {
        self.items.push(module);
    }

    /// The number of modules.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Module `i`, if any.
    pub fn get(&self, i: usize) -> Option<&M> {
        self.items.get(i)
    }

    /// Mutable access to module `i`, if any.
    pub fn get_mut(&mut self, i: usize) -> Option<&mut M> {
        self.items.get_mut(i)
    }

    /// The modules in order.
    pub fn iter(&self) -> std::slice::Iter<'_, M> {
        self.items.iter()
    }

    /// The modules in order, mutably.
    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, M> {
        self.items.iter_mut()
    }
}

impl<M: Module> Default for ModuleList<M> {
    fn default() -> Self {
        ModuleList::new()
    }
}

impl<M: Module> Index<usize> for ModuleList<M> {
    type Output = M;
    /// Module `i`; panics when out of range, as slice indexing does (use
    /// [`ModuleList::get`] for a checked access).
    fn index(&self, i: usize) -> &M {
        &self.items[i]
    }
}

impl<'a, M: Module> IntoIterator for &'a ModuleList<M> {
    type Item = &'a M;
    type IntoIter = std::slice::Iter<'a, M>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

impl<M: Module> fmt::Debug for ModuleList<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModuleList({} modules)", self.items.len())
    }
}

impl<M: Module> Module for ModuleList<M> {
    /// Refused: a `ModuleList` is not callable (iterate over it instead).
    fn forward(&self, _input: &Tensor) -> Result<Tensor> {
        Err(Error::NotSupported {
            op: "ModuleList::forward",
            detail: "here: a ModuleList is not chained: call its modules in the order you need"
                .into(),
        })
    }
}

impl<M: Module> ModuleFields for ModuleList<M> {
    fn core(&self) -> &ModuleCore {
        &self.core
    }
    fn core_mut(&mut self) -> &mut ModuleCore {
        &mut self.core
    }
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        self.items
            .iter()
            .enumerate()
            .map(|(i, m)| (i.to_string(), m as &dyn Module))
            .collect()
    }
    fn named_children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        self.items
            .iter_mut()
            .enumerate()
            .map(|(i, m)| (i.to_string(), m as &mut dyn Module))
            .collect()
    }
}
