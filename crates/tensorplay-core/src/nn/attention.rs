//! Attention: [`scaled_dot_product_attention`] (`torch.nn.functional.scaled_dot_product_attention`,
//! the math path) and the [`MultiheadAttention`] module (`torch.nn.MultiheadAttention`,
//! batch-first).

use std::fmt;

use super::functional;
use super::layers::Linear;
use super::{Module, ModuleCore};
use crate::ops::attention::fused_sdpa;
use crate::ops::mask::causal_bias;
use crate::{DType, Error, Result, Tensor};

/// Attention of `query` over `key`/`value` (`torch.nn.functional.scaled_dot_product_attention`):
/// `softmax(query @ key^T * scale + mask) @ value`, with dropout on the attention weights.
///
/// - `query`: `[.., L, E]`; `key`: `[.., S, E]`; `value`: `[.., S, Ev]`; the leading (batch,
///   head) dimensions broadcast. The output is `[.., L, Ev]` of the common float dtype.
/// - `attn_mask`: optional, broadcastable to `[.., L, S]`: a **bool** mask says which keys each
///   query may attend to (true = attend, as in PyTorch's function; the causal mask is `tril`
///   of ones; [`MultiheadAttention::attend`]'s bool mask means the opposite, as in PyTorch's
///   module), a **float** mask is added to the scores.
/// - `dropout_p`: the probability of zeroing an attention weight (the survivors are scaled by
///   `1 / (1 - p)`), applied whenever it is non-zero, as PyTorch's function does; pass 0 in
///   evaluation.
/// - `is_causal`: query `i` sees keys `0..=i` only (a lower-triangular mask aligned to the top
///   left, as PyTorch's `is_causal`).
/// - `scale`: the factor on the scores; `None` is `1 / sqrt(E)`.
///
/// A query row whose keys are all masked gives NaN, as PyTorch's math path does.
/// Differentiable in `query`, `key` and `value` (and a float mask).
///
/// Errors: [`Error::InvalidArgument`] when `attn_mask` and `is_causal` are both given, when an
/// input has fewer than 2 dimensions, when `E` differs between query and key or `S` between key
/// and value, when key or value differs from the query in dtype, when a mask is neither bool nor
/// of the query's dtype, or `dropout_p` is outside `[0, 1]`; [`Error::ShapeMismatch`] when the batch
/// dimensions or the mask do not broadcast; [`Error::UnsupportedDType`] for integer inputs.
///
/// ```
/// use tensorplay::{self as tp, nn::functional::scaled_dot_product_attention as sdpa};
/// let q = tp::randn(&[2, 4, 5, 8])?; // [batch, heads, L, E]
/// let k = tp::randn(&[2, 4, 5, 8])?;
/// let v = tp::randn(&[2, 4, 5, 8])?;
/// let y = sdpa(&q, &k, &v, None, 0.0, true, None)?;
/// assert_eq!(y.shape(), [2, 4, 5, 8]);
/// // the first query sees only the first key: its output is that key's value
/// let first = y.narrow(2, 0, 1)?.sub(&v.narrow(2, 0, 1)?)?.abs()?.max()?.item::<f32>()?;
/// assert!(first < 1e-6);
/// # Ok::<(), tp::Error>(())
/// ```
pub fn scaled_dot_product_attention(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    attn_mask: Option<&Tensor>,
    dropout_p: f64,
    is_causal: bool,
    scale: Option<f64>,
) -> Result<Tensor> {
    const OP: &str = "scaled_dot_product_attention";
    // autocast: the floating inputs (an additive float mask too) in the low dtype
    let inputs: Vec<&Tensor> = [query, key, value]
        .into_iter()
        .chain(attn_mask.filter(|m| m.dtype().is_float()))
        .collect();
    if let Some(x) = crate::amp::to_lower(&inputs)? {
        let mask = if x.len() == 4 { x.get(3) } else { attn_mask };
        return scaled_dot_product_attention(
            &x[0], &x[1], &x[2], mask, dropout_p, is_causal, scale,
        );
    }
    for (name, t) in [("query", query), ("key", key), ("value", value)] {
        if t.ndim() < 2 {
            return Err(Error::invalid(
                OP,
                name,
                "a tensor [.., sequence, features] of at least 2 dimensions",
                format!("shape {:?}", t.shape()),
            ));
        }
        if !t.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: t.dtype(),
                expected: "float32 or float64 query, key and value",
            });
        }
    }
    for (name, t) in [("key", key), ("value", value)] {
        if t.dtype() != query.dtype() {
            return Err(Error::invalid(
                OP,
                name,
                format!("{}, the query's dtype", query.dtype()),
                t.dtype().to_string(),
            ));
        }
    }
    if let Some(m) = attn_mask
        && m.dtype() != DType::Bool
        && m.dtype() != query.dtype()
    {
        return Err(Error::invalid(
            OP,
            "attn_mask",
            format!(
                "a bool mask (true = may attend) or an additive {} mask, the query's dtype",
                query.dtype()
            ),
            m.dtype().to_string(),
        ));
    }
    let (qs, ks, vs) = (query.shape(), key.shape(), value.shape());
    let e = qs[qs.len() - 1];
    let (l, s) = (qs[qs.len() - 2], ks[ks.len() - 2]);
    if ks[ks.len() - 1] != e {
        return Err(Error::invalid(
            OP,
            "key",
            format!("{e} features, as the query has"),
            format!("shape {ks:?} for a query of shape {qs:?}"),
        ));
    }
    if vs[vs.len() - 2] != s {
        return Err(Error::invalid(
            OP,
            "value",
            format!("{s} positions, as the key has"),
            format!("shape {vs:?} for a key of shape {ks:?}"),
        ));
    }
    if attn_mask.is_some() && is_causal {
        return Err(Error::invalid(
            OP,
            "attn_mask",
            "no explicit mask when is_causal is true",
            "both an attn_mask and is_causal=true",
        ));
    }
    if !(0.0..=1.0).contains(&dropout_p) {
        return Err(Error::invalid(
            OP,
            "dropout_p",
            "a probability in [0, 1]",
            format!("{dropout_p}"),
        ));
    }
    let scale = scale.unwrap_or_else(|| 1.0 / (e.max(1) as f64).sqrt());
    if let Some(m) = attn_mask {
        let mut target = qs[..qs.len() - 1].to_vec();
        target.push(s);
        let fits =
            crate::layout::broadcast_shapes(m.shape(), &target, OP).is_ok_and(|out| out == target);
        // a mask that does not fit is named by the composed path below
        if fits
            && let Some(y) = fused_sdpa(query, key, value, attn_mask, is_causal, dropout_p, scale)
        {
            return y;
        }
    } else if let Some(y) = fused_sdpa(query, key, value, None, is_causal, dropout_p, scale) {
        return y;
    }
    let mut scores = query.matmul(&key.transpose(-2, -1)?)?.mul_scalar(scale)?;
    if is_causal {
        let bias = causal_bias(l, s, scores.dtype())?.to_device(scores.device())?;
        scores = scores.add(&bias)?;
    } else if let Some(m) = attn_mask {
        let target = scores.shape().to_vec();
        let out = crate::layout::broadcast_shapes(m.shape(), &target, OP)?;
        if out != target {
            return Err(Error::ShapeMismatch {
                op: "scaled_dot_product_attention (attn_mask must broadcast to [.., L, S])",
                lhs: target,
                rhs: m.shape().to_vec(),
            });
        }
        scores = if m.dtype() == DType::Bool {
            scores.masked_fill(&m.logical_not()?, f64::NEG_INFINITY)?
        } else {
            scores.add(m)?
        };
    }
    let mut weights = scores.softmax(-1)?;
    if dropout_p > 0.0 {
        weights = functional::dropout(&weights, dropout_p, true)?;
    }
    weights.matmul(value)
}

/// `[B, T, H*D]` -> `[B, H, T, D]`.
fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, t, e) = (x.shape()[0], x.shape()[1], x.shape()[2]);
    x.reshape(&[b, t, heads, e / heads])?.permute(&[0, 2, 1, 3])
}

/// `[B, H, T, D]` -> `[B, T, H*D]`.
fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    x.permute(&[0, 2, 1, 3])?.reshape(&[b, t, h * d])
}

/// Multi-head attention (`torch.nn.MultiheadAttention` with `batch_first=True`): the inputs are
/// projected by `in_proj_weight` (`[3E, E]`: the query, key and value projections stacked, as
/// in PyTorch) and `in_proj_bias`, split into `num_heads` heads of `E / num_heads` features,
/// attended with [`scaled_dot_product_attention`], merged, and projected by `out_proj`.
///
/// Parameters and their names follow PyTorch (`in_proj_weight`, `in_proj_bias`,
/// `out_proj.weight`, `out_proj.bias`), so state dicts carry over. Inputs are `[B, T, E]`.
/// [`Module::forward`] is self-attention (query = key = value = the input), causal when the
/// module was made with [`MultiheadAttention::causal`]; [`MultiheadAttention::attend`] takes
/// separate query, key and value and an optional mask. Attention-weight dropout is applied in
/// training mode only. The attention weights are not returned (`need_weights=False`).
///
/// ```
/// use tensorplay::{self as tp, nn::{self, Module}};
/// let mha = nn::MultiheadAttention::new(16, 4, 0.0, true)?.causal(true);
/// let x = tp::randn(&[2, 7, 16])?;
/// assert_eq!(mha.call(&x)?.shape(), [2, 7, 16]);
/// let names: Vec<String> = mha.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]);
/// # Ok::<(), tp::Error>(())
/// ```
#[derive(Module)]
pub struct MultiheadAttention {
    /// The stacked query, key and value projections, `[3 * embed_dim, embed_dim]`.
    pub in_proj_weight: Tensor,
    /// Their biases, `[3 * embed_dim]`, when the module has biases.
    pub in_proj_bias: Option<Tensor>,
    /// The output projection, `embed_dim -> embed_dim`.
    pub out_proj: Linear,
    num_heads: usize,
    dropout: f64,
    is_causal: bool,
    core: ModuleCore,
}

/// `xavier_uniform_`'s bound for `in_proj_weight` `[3E, E]`: `sqrt(6 / (fan_in + fan_out))`
/// `= sqrt(6 / 4E)` (0 when `E` is 0).
fn xavier_bound(embed_dim: usize) -> f64 {
    if embed_dim == 0 {
        0.0
    } else {
        (6.0 / (4 * embed_dim) as f64).sqrt()
    }
}

impl MultiheadAttention {
    /// A float32 module with PyTorch's initialisation (drawn from the default generator):
    /// `in_proj_weight` Xavier-uniform, biases zero, `out_proj.weight` as [`Linear::new`].
    ///
    /// Errors ([`Error::InvalidArgument`]): `num_heads` is 0 or does not divide `embed_dim`, or
    /// `dropout` is outside `[0, 1]`.
    pub fn new(
        embed_dim: usize,
        num_heads: usize,
        dropout: f64,
        bias: bool,
    ) -> Result<MultiheadAttention> {
        const OP: &str = "MultiheadAttention::new";
        if num_heads == 0 || !embed_dim.is_multiple_of(num_heads) {
            return Err(Error::invalid(
                OP,
                "num_heads",
                format!("a divisor of embed_dim = {embed_dim}"),
                format!("{num_heads}"),
            ));
        }
        if !(0.0..=1.0).contains(&dropout) {
            return Err(Error::invalid(
                OP,
                "dropout",
                "a probability in [0, 1]",
                format!("{dropout}"),
            ));
        }
        // xavier_uniform_: U(-a, a), a = sqrt(6 / (fan_in + fan_out)) = sqrt(6 / (E + 3E))
        let in_proj_weight =
            super::layers::uniform_param(OP, &[3 * embed_dim, embed_dim], xavier_bound(embed_dim))?;
        let in_proj_bias = if bias {
            Some(Tensor::zeros(&[3 * embed_dim], DType::F32)?.requires_grad_(true))
        } else {
            None
        };
        let mut out_proj = Linear::new(embed_dim, embed_dim, bias)?;
        if bias {
            out_proj.bias = Some(Tensor::zeros(&[embed_dim], DType::F32)?.requires_grad_(true));
        }
        Ok(MultiheadAttention {
            in_proj_weight,
            in_proj_bias,
            out_proj,
            num_heads,
            dropout,
            is_causal: false,
            core: ModuleCore::new(),
        })
    }

    /// This module with causal self-attention in [`Module::forward`] (query `i` sees positions
    /// `0..=i`).
    pub fn causal(mut self, is_causal: bool) -> MultiheadAttention {
        self.is_causal = is_causal;
        self
    }

    /// The number of heads.
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }

    /// `embed_dim`, the model width `E`.
    pub fn embed_dim(&self) -> usize {
        self.in_proj_weight.shape()[1]
    }

    /// Attention of `query` (`[B, L, E]`) over `key` (`[B, S, E]`) and `value` (`[B, S, E]`),
    /// with an optional `attn_mask` (`[L, S]` or broadcastable to `[B, heads, L, S]`) or
    /// `is_causal`. Returns `[B, L, E]`.
    ///
    /// A **bool** mask follows `torch.nn.MultiheadAttention`: **true = may not attend** (the
    /// causal mask is `triu(1)` of ones); a float mask is added to the scores. This is the
    /// opposite of [`scaled_dot_product_attention`]'s bool mask (true = attend), as in PyTorch,
    /// so masks written for either PyTorch function carry over unchanged.
    ///
    /// ```
    /// use tensorplay::{self as tp, DType, Tensor, nn};
    /// let mha = nn::MultiheadAttention::new(8, 2, 0.0, true)?;
    /// let x = tp::randn(&[1, 5, 8])?;
    /// let blocked = Tensor::ones(&[5, 5], DType::Bool)?.triu(1)?; // PyTorch's causal mask
    /// let a = mha.attend(&x, &x, &x, Some(&blocked), false)?;
    /// let b = mha.attend(&x, &x, &x, None, true)?;
    /// assert!(a.sub(&b)?.abs()?.max()?.item_f64()? < 1e-6);
    /// # Ok::<(), tp::Error>(())
    /// ```
    ///
    /// Errors: [`Error::InvalidArgument`] when an input is not 3-d with `E` features or the
    /// batch sizes differ, and the errors of [`scaled_dot_product_attention`].
    pub fn attend(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        attn_mask: Option<&Tensor>,
        is_causal: bool,
    ) -> Result<Tensor> {
        let e = self.embed_dim();
        let b = query.shape().first().copied();
        for (name, t) in [("query", query), ("key", key), ("value", value)] {
            if t.ndim() != 3 || t.shape()[2] != e || t.shape().first().copied() != b {
                return Err(Error::invalid(
                    "MultiheadAttention",
                    name,
                    format!("[batch, sequence, {e}] with the query's batch size"),
                    format!("shape {:?}", t.shape()),
                ));
            }
        }
        let w = |i: usize| self.in_proj_weight.narrow(0, i * e, e);
        let bias = |i: usize| -> Result<Option<Tensor>> {
            self.in_proj_bias
                .as_ref()
                .map(|b| b.narrow(0, i * e, e))
                .transpose()
        };
        let h = self.num_heads;
        let q = split_heads(&functional::linear(query, &w(0)?, bias(0)?.as_ref())?, h)?;
        let k = split_heads(&functional::linear(key, &w(1)?, bias(1)?.as_ref())?, h)?;
        let v = split_heads(&functional::linear(value, &w(2)?, bias(2)?.as_ref())?, h)?;
        let p = if self.is_training() {
            self.dropout
        } else {
            0.0
        };
        // PyTorch's MultiheadAttention masks where the bool mask is true; sdpa attends there
        let allowed = match attn_mask {
            Some(m) if m.dtype() == DType::Bool => Some(m.logical_not()?),
            Some(m) => Some(m.clone()),
            None => None,
        };
        let y = scaled_dot_product_attention(&q, &k, &v, allowed.as_ref(), p, is_causal, None)?;
        self.out_proj.call(&merge_heads(&y)?)
    }
}

impl fmt::Debug for MultiheadAttention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "MultiheadAttention(embed_dim={}, num_heads={}, dropout={}, causal={})",
            self.embed_dim(),
            self.num_heads,
            self.dropout,
            self.is_causal
        )
    }
}

impl Module for MultiheadAttention {
    /// Self-attention of `input` (`[B, T, E]`), causal when set with
    /// [`MultiheadAttention::causal`].
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        self.attend(input, input, input, None, self.is_causal)
    }
    /// As the constructor: `in_proj_weight` Xavier-uniform, `out_proj.weight` as
    /// [`Linear`]'s, biases zero, through [`crate::nn::init`].
    fn reset_parameters(&mut self) -> Result<()> {
        let e = self.in_proj_weight.shape().get(1).copied().unwrap_or(0);
        super::init::uniform_(&self.in_proj_weight, -xavier_bound(e), xavier_bound(e))?;
        if let Some(b) = &self.in_proj_bias {
            super::init::zeros_(b)?;
        }
        self.out_proj.reset_parameters()?;
        if let Some(b) = &self.out_proj.bias {
            super::init::zeros_(b)?;
        }
        Ok(())
    }
}
