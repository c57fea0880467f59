//! Layers: Linear, ReLU, Tanh, Sigmoid, GELU, Sequential, Embedding, Dropout.

use std::fmt;

use super::functional;
use super::{Module, ModuleCore, ModuleFields};
use crate::autograd::{Context, Function, apply};
use crate::backend::{self, DeviceStorage as _, IndexKind};
use crate::layout::checked_numel;
use crate::ops::float_dispatch;
use crate::random::default_generator;
use crate::storage::{StorageElement, try_vec};
use crate::{DType, Error, Result, Tensor};

// ---------------------------------------------------------------------------------------------
// Linear

/// `y = x W^T + b` (`torch.nn.Linear`).
///
/// `weight` has shape `[out_features, in_features]`, `bias` `[out_features]`; inputs are
/// `[.., in_features]` and outputs `[.., out_features]`.
#[derive(Module)]
pub struct Linear {
    /// The weight, `[out_features, in_features]`.
    pub weight: Tensor,
    /// The bias, `[out_features]`, when the layer has one.
    pub bias: Option<Tensor>,
    core: ModuleCore,
}

/// `1/sqrt(in_features)`, PyTorch's bound for a Linear layer's weight and bias (0 without
/// inputs).
fn linear_bound(in_features: usize) -> f64 {
    if in_features == 0 {
        0.0
    } else {
        1.0 / (in_features as f64).sqrt()
    }
}

/// A float32 parameter of `shape` from `U(-bound, bound)`, drawn element by element from the
/// default generator, on the default device: on the meta device nothing is drawn or
/// allocated. Errors when it has more elements than fit in memory.
pub(super) fn uniform_param(op: &'static str, shape: &[usize], bound: f64) -> Result<Tensor> {
    let device = crate::get_default_device();
    if device.is_meta() {
        return Ok(crate::ops::creation::meta(op, shape, DType::F32)?.requires_grad_(true));
    }
    let n = checked_numel(shape, op)?;
    let mut v = try_vec(n, 0.0f32, op, "shape")?;
    let mut g = default_generator();
    for x in &mut v {
        *x = (-bound + 2.0 * bound * g.uniform()) as f32;
    }
    drop(g);
    Ok(Tensor::from_vec(v, shape)?
        .to_device(device)?
        .requires_grad_(true))
}

impl Linear {
    /// A float32 layer with PyTorch's default initialisation (`reset_parameters`:
    /// `kaiming_uniform_(a=sqrt(5))`, which is `U(-1/sqrt(in), 1/sqrt(in))` for the weight, and
    /// the same bound for the bias), drawn from the default generator, weight first.
    /// With `in_features == 0` the bound is 0. On the default device
    /// ([`crate::with_default_device`]; on the meta device nothing is drawn). Errors when the
    /// weight has more elements than fit in memory.
    pub fn new(in_features: usize, out_features: usize, bias: bool) -> Result<Linear> {
        let bound = linear_bound(in_features);
        let weight = uniform_param("Linear::new", &[out_features, in_features], bound)?;
        let bias = if bias {
            Some(uniform_param("Linear::new", &[out_features], bound)?)
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            core: ModuleCore::new(),
        })
    }

    /// A layer with the given parameters (used as they are; they are not copied). Errors when
    /// `weight` is not 2-d, or `bias` is not `[out_features]` or differs in dtype.
    pub fn from_weights(weight: Tensor, bias: Option<Tensor>) -> Result<Linear> {
        if weight.ndim() != 2 {
            return Err(Error::invalid(
                "Linear::from_weights",
                "weight",
                "a 2-d tensor [out_features, in_features]",
                format!("shape {:?}", weight.shape()),
            ));
        }
        if let Some(b) = &bias {
            if b.shape() != [weight.shape()[0]] {
                return Err(Error::ShapeMismatch {
                    op: "Linear::from_weights (bias)",
                    lhs: vec![weight.shape()[0]],
                    rhs: b.shape().to_vec(),
                });
            }
            if b.dtype() != weight.dtype() {
                return Err(Error::DTypeMismatch {
                    op: "Linear::from_weights",
                    lhs: weight.dtype(),
                    rhs: b.dtype(),
                });
            }
        }
        Ok(Linear {
            weight,
            bias,
            core: ModuleCore::new(),
        })
    }

    /// `in_features`.
    pub fn in_features(&self) -> usize {
        self.weight.shape()[1]
    }

    /// `out_features`.
    pub fn out_features(&self) -> usize {
        self.weight.shape()[0]
    }
}

impl fmt::Debug for Linear {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Linear(in_features={}, out_features={}, bias={})",
            self.in_features(),
            self.out_features(),
            self.bias.is_some()
        )
    }
}

impl Module for Linear {
    /// `input @ weight^T + bias`; errors when the last dimension of `input` is not
    /// `in_features` or the dtypes differ.
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        functional::linear(input, &self.weight, self.bias.as_ref())
    }
    /// `U(-1/sqrt(in_features), 1/sqrt(in_features))` for the weight and the bias, through
    /// [`crate::nn::init::uniform_`].
    fn reset_parameters(&mut self) -> Result<()> {
        let in_features = self.weight.shape().get(1).copied().unwrap_or(0);
        let bound = linear_bound(in_features);
        super::init::uniform_(&self.weight, -bound, bound)?;
        if let Some(b) = &self.bias {
            super::init::uniform_(b, -bound, bound)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// activations

macro_rules! activation {
    ($name:ident, $method:ident, $doc:literal) => {
        #[doc = $doc]
        #[derive(Debug, Default, Module)]
        pub struct $name {
            core: ModuleCore,
        }
        impl $name {
            #[doc = concat!("A new `", stringify!($name), "` layer (no parameters).")]
            pub fn new() -> $name {
                $name {
                    core: ModuleCore::new(),
                }
            }
        }
        impl Module for $name {
            fn forward(&self, input: &Tensor) -> Result<Tensor> {
                input.$method()
            }
        }
    };
}

activation!(
    ReLU,
    relu,
    "`max(x, 0)` elementwise (`torch.nn.ReLU`); float or int64 input of any shape."
);
activation!(
    Tanh,
    tanh,
    "Hyperbolic tangent elementwise (`torch.nn.Tanh`); float input of any shape."
);
activation!(
    Sigmoid,
    sigmoid,
    "Logistic sigmoid `1 / (1 + e^-x)` elementwise (`torch.nn.Sigmoid`); float input of any \
     shape, output of the same shape and dtype. Errors with `Error::UnsupportedDType` on a \
     non-float input.\n\n\
     ```\n\
     use tensorplay::{self as tp, nn::{self, Module}};\n\
     let y = nn::Sigmoid::new().call(&tp::Tensor::from_vec(vec![0.0f32, 2.0], &[2])?)?;\n\
     let v = y.to_vec::<f32>()?;\n\
     assert_eq!(v[0], 0.5);\n\
     assert!((v[1] - 0.880_797).abs() < 1e-6);\n\
     # Ok::<(), tp::Error>(())\n\
     ```"
);
/// GELU elementwise (`torch.nn.GELU`): exact by default (`x * Phi(x)`, `Phi` the standard
/// normal CDF computed with erf; `approximate='none'`), or the tanh approximation GPT-2 uses
/// with [`GELU::tanh`] (`approximate='tanh'`, see [`Tensor::gelu_tanh`]). Float input of any
/// shape, output of the same shape and dtype. Errors with `Error::UnsupportedDType` on a
/// non-float input.
///
/// ```
/// use tensorplay::{self as tp, nn::{self, Module}};
/// let x = tp::Tensor::from_vec(vec![0.0f64, 1.0, -1.0], &[3])?;
/// let v = nn::GELU::new().call(&x)?.to_vec::<f64>()?;
/// assert_eq!(v[0], 0.0);
/// assert!((v[1] - 0.841_344_746_068_542_9).abs() < 1e-12);
/// assert!((v[2] + 0.158_655_253_931_457_05).abs() < 1e-12);
/// let t = nn::GELU::tanh().call(&x)?.to_vec::<f64>()?;
/// assert!((t[1] - 0.841_191_990_608_276_8).abs() < 1e-12);
/// # Ok::<(), tp::Error>(())
/// ```
#[derive(Debug, Default, Module)]
pub struct GELU {
    #[module(skip)]
    approximate: functional::Approximate,
    core: ModuleCore,
}

impl GELU {
    /// The exact GELU (`nn.GELU()`).
    pub fn new() -> GELU {
        GELU::default()
    }
    /// The tanh approximation (`nn.GELU(approximate='tanh')`).
    pub fn tanh() -> GELU {
        GELU {
            approximate: functional::Approximate::Tanh,
            core: ModuleCore::new(),
        }
    }
    /// Which form this layer computes.
    pub fn approximate(&self) -> functional::Approximate {
        self.approximate
    }
}

impl Module for GELU {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        functional::gelu(input, self.approximate)
    }
}

// ---------------------------------------------------------------------------------------------
// Sequential

/// Layers applied one after another (`torch.nn.Sequential`); children are named `"0"`, `"1"`,
/// ... so parameters are `"0.weight"`, `"0.bias"`, ...
///
/// Each layer is run with [`Module::call`], so its forward hooks run too.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module>>,
    core: ModuleCore,
}

impl Sequential {
    /// An empty container (its forward is the identity).
    pub fn new() -> Sequential {
        Sequential::default()
    }

    /// A container of `layers`, in order.
    pub fn from_vec(layers: Vec<Box<dyn Module>>) -> Sequential {
        Sequential {
            layers,
            core: ModuleCore::new(),
        }
    }

    /// Appends a layer (builder style).
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, layer: impl Module + 'static) -> Sequential {
        self.layers.push(Box::new(layer));
        self
    }

    /// Appends a boxed layer.
    pub fn push(&mut self, layer: Box<dyn Module>) {
        self.layers.push(layer);
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether there are no layers.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Layer `i`, if any.
    pub fn get(&self, i: usize) -> Option<&dyn Module> {
        self.layers.get(i).map(|l| &**l)
    }

    /// Mutable access to layer `i`, if any.
    pub fn get_mut(&mut self, i: usize) -> Option<&mut (dyn Module + 'static)> {
        self.layers.get_mut(i).map(|l| &mut **l)
    }
}

impl fmt::Debug for Sequential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sequential({} layers)", self.layers.len())
    }
}

impl Module for Sequential {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let mut x = input.clone();
        for l in &self.layers {
            x = l.call(&x)?;
        }
        Ok(x)
    }
}

impl ModuleFields for Sequential {
    fn core(&self) -> &ModuleCore {
        &self.core
    }
    fn core_mut(&mut self) -> &mut ModuleCore {
        &mut self.core
    }
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| (i.to_string(), &**l))
            .collect()
    }
    fn named_children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        self.layers
            .iter_mut()
            .enumerate()
            .map(|(i, l)| (i.to_string(), &mut **l as &mut dyn Module))
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Embedding

/// A lookup table (`torch.nn.Embedding`): `weight` is `[num_embeddings, embedding_dim]`, the
/// input holds int64 indices of any shape, the output is `[.., embedding_dim]`.
#[derive(Module)]
pub struct Embedding {
    /// The table, `[num_embeddings, embedding_dim]`.
    pub weight: Tensor,
    core: ModuleCore,
}

impl Embedding {
    /// A float32 table initialised from `N(0, 1)` with the default generator (PyTorch's
    /// default `normal_`).
    pub fn new(num_embeddings: usize, embedding_dim: usize) -> Result<Embedding> {
        let weight =
            Tensor::randn(&[num_embeddings, embedding_dim], DType::F32)?.requires_grad_(true);
        Ok(Embedding {
            weight,
            core: ModuleCore::new(),
        })
    }

    /// A layer over the given table (used as it is). Errors when it is not 2-d float.
    pub fn from_weights(weight: Tensor) -> Result<Embedding> {
        if weight.ndim() != 2 || !weight.dtype().is_float() {
            return Err(Error::invalid(
                "Embedding::from_weights",
                "weight",
                "a 2-d float tensor [num_embeddings, embedding_dim]",
                format!("shape {:?} of {}", weight.shape(), weight.dtype()),
            ));
        }
        Ok(Embedding {
            weight,
            core: ModuleCore::new(),
        })
    }
}

impl fmt::Debug for Embedding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Embedding({}, {})",
            self.weight.shape()[0],
            self.weight.shape()[1]
        )
    }
}

impl Module for Embedding {
    /// Rows of `weight` picked by `input` (int64, any shape). Errors: [`Error::UnsupportedDType`]
    /// for non-int64 indices, [`Error::IndexOutOfBounds`] for an index outside
    /// `0..num_embeddings`.
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        functional::embedding(input, &self.weight)
    }
    /// `N(0, 1)` through [`crate::nn::init::normal_`].
    fn reset_parameters(&mut self) -> Result<()> {
        super::init::normal_(&self.weight, 0.0, 1.0)
    }
}

/// Checks the indices and returns them as a vector.
pub(crate) fn embedding_indices(
    indices: &Tensor,
    num: usize,
    op: &'static str,
) -> Result<Vec<i64>> {
    if indices.dtype() != DType::I64 {
        return Err(Error::UnsupportedDType {
            op,
            dtype: indices.dtype(),
            expected: "int64 indices",
        });
    }
    let idx = indices.to_vec::<i64>()?;
    if let Some(&bad) = idx.iter().find(|&&i| i < 0 || i as usize >= num) {
        return Err(Error::IndexOutOfBounds {
            op,
            index: bad,
            dim: 0,
            size: num,
        });
    }
    Ok(idx)
}

/// Gathers rows `idx` of the contiguous `[num, dim]` table.
fn gather_rows(table: &Tensor, idx: &[i64], out_shape: &[usize]) -> Result<Tensor> {
    let dim = table.shape()[1];
    let table = table.contiguous()?;
    if let Some(r) = backend::on_device(&table, |c, l| {
        if !table.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "embedding",
                dtype: table.dtype(),
                expected: "a floating dtype (float32, float64, bfloat16 or float16)",
            });
        }
        let c = c.copy_as(l, table.dtype())?;
        let it = c.upload(&crate::CpuStorage::I64(idx.to_vec()))?;
        c.index(
            IndexKind::Select,
            &it,
            (1, table.shape()[0], idx.len(), dim),
        )
    }) {
        return Ok(backend::device_tensor(r?, out_shape));
    }
    float_dispatch!(table.dtype(), "embedding", T => {
        let v = table.with_slice("embedding", |s: &[T], l| {
            let base = l.offset;
            let mut out = Vec::with_capacity(idx.len() * dim);
            for &i in idx {
                let o = base + i as usize * dim;
                out.extend_from_slice(&s[o..o + dim]);
            }
            out
        })?;
        Ok(Tensor::from_cpu(T::into_storage(v), out_shape))
    })
}

/// The embedding lookup: inputs `[weight, indices]`; backward scatter-adds into the table.
pub(crate) struct EmbeddingFn;
impl Function for EmbeddingFn {
    fn name(&self) -> &str {
        "EmbeddingBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (w, ind) = (inputs[0], inputs[1]);
        let (num, dim) = (w.shape()[0], w.shape()[1]);
        let idx = embedding_indices(ind, num, "embedding")?;
        let mut shape = ind.shape().to_vec();
        shape.push(dim);
        let out = gather_rows(w, &idx, &shape)?;
        ctx.save_for_backward(&[ind]);
        ctx.save_value(num);
        Ok(vec![out])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let ind = ctx.saved_tensors()?.remove(0);
        let num = *ctx.get::<usize>()?;
        let gw = apply(EmbeddingDenseBackward { num }, &[&g[0], &ind])?.remove(0);
        Ok(vec![Some(gw), None])
    }
}

/// Scatter-adds gradient rows into a zero `[num, dim]` table; its own backward is the lookup,
/// so double backward works.
struct EmbeddingDenseBackward {
    num: usize,
}
impl Function for EmbeddingDenseBackward {
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (g, ind) = (inputs[0], inputs[1]);
        let idx = embedding_indices(ind, self.num, "embedding_backward")?;
        let dim = *g.shape().last().unwrap_or(&0);
        let g = g.contiguous()?;
        if let Some(r) = backend::on_device(&g, |c, l| {
            if !g.dtype().is_float() {
                return Err(Error::UnsupportedDType {
                    op: "embedding_backward",
                    dtype: g.dtype(),
                    expected: "a floating dtype (float32, float64, bfloat16 or float16)",
                });
            }
            let src = c.copy_as(l, g.dtype())?;
            // one index per element: row idx[j] for every element of row j
            let per_element: Vec<i64> = idx
                .iter()
                .flat_map(|&i| std::iter::repeat_n(i, dim))
                .collect();
            let it = c.upload(&crate::CpuStorage::I64(per_element))?;
            let mut out = c.zeros_like_device(g.dtype(), self.num * dim)?;
            out.scatter_add(&it, &src, (1, self.num, idx.len(), dim))?;
            Ok(out)
        }) {
            ctx.save_for_backward(&[ind]);
            return Ok(vec![backend::device_tensor(r?, &[self.num, dim])]);
        }
        let out = float_dispatch!(g.dtype(), "embedding_backward", T => {
            let v = g.with_slice("embedding_backward", |s: &[T], l| {
                let s = &s[l.offset..l.offset + idx.len() * dim];
                let mut out = vec![T::default(); self.num * dim];
                for (r, &i) in idx.iter().enumerate() {
                    let dst = &mut out[i as usize * dim..(i as usize + 1) * dim];
                    for (d, &x) in dst.iter_mut().zip(&s[r * dim..(r + 1) * dim]) {
                        *d += x;
                    }
                }
                out
            })?;
            Tensor::from_cpu(T::into_storage(v), &[self.num, dim])
        });
        ctx.save_for_backward(&[ind]);
        Ok(vec![out])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let ind = ctx.saved_tensors()?.remove(0);
        Ok(vec![
            Some(apply(EmbeddingFn, &[&g[0], &ind])?.remove(0)),
            None,
        ])
    }
}

// ---------------------------------------------------------------------------------------------
// Dropout

/// Randomly zeroes elements with probability `p` in training mode and scales the rest by
/// `1 / (1 - p)` (`torch.nn.Dropout`); the identity in evaluation mode. Uses the default
/// generator.
#[derive(Module)]
pub struct Dropout {
    p: f64,
    core: ModuleCore,
}

impl Dropout {
    /// A dropout layer; errors when `p` is outside `[0, 1)`.
    pub fn new(p: f64) -> Result<Dropout> {
        functional::check_dropout_p(p)?;
        Ok(Dropout {
            p,
            core: ModuleCore::new(),
        })
    }

    /// The drop probability.
    pub fn p(&self) -> f64 {
        self.p
    }
}

impl fmt::Debug for Dropout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Dropout(p={})", self.p)
    }
}

impl Module for Dropout {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        functional::dropout(input, self.p, self.is_training())
    }
}
