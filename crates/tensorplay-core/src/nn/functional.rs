//! Stateless forms of the layers and losses (`torch.nn.functional`).

use super::layers::EmbeddingFn;
use super::loss::CrossEntropyFn;
use crate::autograd::apply;
use crate::backend::{self, DeviceStorage as _};
use crate::random::default_generator;
use crate::{Error, Result, Tensor};

pub use super::attention::scaled_dot_product_attention;
pub use super::normalization::layer_norm;

/// `input @ weight^T + bias` (`F.linear`): `input` `[.., in]`, `weight` `[out, in]`, `bias`
/// `[out]`, result `[.., out]`. The transpose is a view (no copy) and the bias is added by
/// broadcasting.
///
/// Errors: [`Error::ShapeMismatch`] when `input`'s last dimension is not `in` or the bias is
/// not `[out]`; [`Error::DTypeMismatch`] when the dtypes of input, weight and bias differ.
pub fn linear(input: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let inputs: Vec<&Tensor> = [input, weight].into_iter().chain(bias).collect();
    if let Some(x) = crate::amp::to_lower(&inputs)? {
        return linear(&x[0], &x[1], x.get(2));
    }
    if weight.ndim() != 2 {
        return Err(Error::invalid(
            "linear",
            "weight",
            "a 2-d tensor [out_features, in_features]",
            format!("shape {:?}", weight.shape()),
        ));
    }
    if input.ndim() == 0 || input.shape()[input.ndim() - 1] != weight.shape()[1] {
        return Err(Error::ShapeMismatch {
            op: "linear",
            lhs: input.shape().to_vec(),
            rhs: weight.shape().to_vec(),
        });
    }
    if input.dtype() != weight.dtype() {
        return Err(Error::DTypeMismatch {
            op: "linear",
            lhs: input.dtype(),
            rhs: weight.dtype(),
        });
    }
    if let Some(b) = bias {
        if b.dtype() != weight.dtype() {
            return Err(Error::DTypeMismatch {
                op: "linear",
                lhs: weight.dtype(),
                rhs: b.dtype(),
            });
        }
        if b.shape() != [weight.shape()[0]] {
            return Err(Error::ShapeMismatch {
                op: "linear (bias)",
                lhs: vec![weight.shape()[0]],
                rhs: b.shape().to_vec(),
            });
        }
    }
    // batch dimensions are folded into the rows of one matrix product (as PyTorch does), so
    // the weight's gradient is one product too, not a batch of them summed
    let k = weight.shape()[1];
    let mut out_shape = input.shape().to_vec();
    *out_shape.last_mut().unwrap_or(&mut 0) = weight.shape()[0];
    let folded = if input.ndim() > 2 && input.is_contiguous() {
        Some(input.reshape(&[input.numel() / k.max(1), k])?)
    } else if input.ndim() == 2 {
        Some(input.clone())
    } else {
        None
    };
    // the bias added inside the product: one pass over the output
    if let (Some(x), Some(b)) = (&folded, bias)
        && let Some(y) = crate::ops::addmm::addmm(x, weight, b)?
    {
        return y.reshape(&out_shape);
    }
    let y = match &folded {
        Some(x) => x.matmul(&weight.t()?)?.reshape(&out_shape)?,
        None => input.matmul(&weight.t()?)?,
    };
    match bias {
        Some(b) => y.add(b),
        None => Ok(y),
    }
}

/// `max(x, 0)` elementwise (`F.relu`).
pub fn relu(input: &Tensor) -> Result<Tensor> {
    input.relu()
}

/// Which GELU [`gelu`] computes (PyTorch's `approximate` argument).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Approximate {
    /// The exact `x * Phi(x)` (`approximate='none'`).
    #[default]
    None,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` (`approximate='tanh'`).
    Tanh,
}

/// GELU elementwise (`F.gelu`): [`Tensor::gelu`] or [`Tensor::gelu_tanh`] as `approximate`
/// says. Float input of any shape; errors with [`Error::UnsupportedDType`] otherwise.
pub fn gelu(input: &Tensor, approximate: Approximate) -> Result<Tensor> {
    match approximate {
        Approximate::None => input.gelu(),
        Approximate::Tanh => input.gelu_tanh(),
    }
}

/// Hyperbolic tangent elementwise (`F.tanh`).
pub fn tanh(input: &Tensor) -> Result<Tensor> {
    input.tanh()
}

pub(crate) fn check_dropout_p(p: f64) -> Result<()> {
    if !(0.0..1.0).contains(&p) {
        return Err(Error::invalid("dropout", "p", "a probability in [0, 1)", p));
    }
    Ok(())
}

/// Dropout (`F.dropout(input, p, training)`): when `training`, each element is zeroed with
/// probability `p` (one uniform draw per element from the default generator, kept when the
/// draw is `>= p`) and the kept ones are scaled by `1 / (1 - p)`; otherwise, or when `p == 0`,
/// the input is returned as it is. Differentiable (the mask is a constant). Float input only;
/// errors when `p` is outside `[0, 1)`.
pub fn dropout(input: &Tensor, p: f64, training: bool) -> Result<Tensor> {
    check_dropout_p(p)?;
    if !training || p == 0.0 || input.numel() == 0 {
        return Ok(input.clone());
    }
    if !input.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op: "dropout",
            dtype: input.dtype(),
            expected: "a floating dtype (float32, float64, bfloat16 or float16)",
        });
    }
    let scale = 1.0 / (1.0 - p);
    // on a device: a Philox keep-mask keyed by a seed from the default generator, so
    // manual_seed makes it reproducible
    let seed = || default_generator().int_range(0, i64::MAX) as u64;
    if let Some(mask) =
        backend::on_device(input, |c, _| c.dropout_mask(input.numel(), seed(), 0, p))
    {
        let mask = backend::device_tensor(mask?, input.shape());
        return input.mul(&mask.to_dtype(input.dtype())?.mul_scalar(scale)?);
    }
    let mask: Vec<f64> = {
        let mut g = default_generator();
        (0..input.numel())
            .map(|_| if g.uniform() >= p { scale } else { 0.0 })
            .collect()
    };
    let mask = Tensor::from_vec(mask, input.shape())?
        .to_dtype(input.dtype())?
        .to_device(input.device())?;
    input.mul(&mask)
}

/// Mean squared error `mean((input - target)^2)` (`F.mse_loss`, `reduction='mean'`), a 0-d
/// tensor. Unlike PyTorch, which broadcasts with a warning, the shapes must be equal
/// ([`Error::ShapeMismatch`] otherwise); the input must be float ([`Error::UnsupportedDType`]).
/// With a 16-bit input the squares and their mean are computed in float32 and the loss
/// rounded once to the input's dtype.
pub fn mse_loss(input: &Tensor, target: &Tensor) -> Result<Tensor> {
    if let Some(x) = crate::amp::to_fp32(&[input, target])? {
        return mse_loss(&x[0], &x[1]);
    }
    if !input.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op: "mse_loss",
            dtype: input.dtype(),
            expected: "a floating dtype (float32, float64, bfloat16 or float16)",
        });
    }
    if input.dtype().is_half() {
        let wide = |t: &Tensor| {
            if t.dtype().is_half() {
                t.float()
            } else {
                Ok(t.clone())
            }
        };
        return mse_loss(&wide(input)?, &wide(target)?)?.to_dtype(input.dtype());
    }
    if input.shape() != target.shape() {
        return Err(Error::ShapeMismatch {
            op: "mse_loss",
            lhs: input.shape().to_vec(),
            rhs: target.shape().to_vec(),
        });
    }
    let d = input.sub(target)?;
    d.mul(&d)?.mean()
}

/// Cross-entropy of logits against class indices, mean over the batch
/// (`F.cross_entropy(input, target)` with the defaults): `input` `[N, C]` float, `target` `[N]`
/// int64 in `0..C`; returns the 0-d mean of `logsumexp(input[i]) - input[i, target[i]]`.
///
/// One fused operation: the forward computes a numerically stable log-sum-exp per row (the
/// row maximum is subtracted first) and keeps only those `N` values; the backward is
/// `(softmax(input) - onehot(target)) / N * grad`. Under `create_graph` that backward is built
/// from differentiable tensor operations, so second derivatives work; otherwise, on the CPU, it
/// is one vectorised pass over the logits (the softmax recomputed from the saved log-sum-exp).
///
/// Errors: [`Error::IndexOutOfBounds`] for a class index outside `0..C` (the error names `C`),
/// [`Error::ShapeMismatch`] when `target` is not `[N]`, [`Error::UnsupportedDType`] for a
/// non-float input or non-int64 target, [`Error::InvalidArgument`] for a non-2-d input.
pub fn cross_entropy(input: &Tensor, target: &Tensor) -> Result<Tensor> {
    if let Some(x) = crate::amp::to_fp32(&[input, target])? {
        return cross_entropy(&x[0], &x[1]);
    }
    Ok(apply(CrossEntropyFn, &[input, target])?.remove(0))
}

/// Rows of `weight` (`[num, dim]`) picked by the int64 `indices` (any shape), giving
/// `[.., dim]` (`F.embedding`). The backward scatter-adds the output gradient into a zero
/// `[num, dim]` gradient (repeated indices accumulate).
///
/// Errors: [`Error::IndexOutOfBounds`] for an index outside `0..num`;
/// [`Error::UnsupportedDType`] for non-int64 indices or a non-float table.
pub fn embedding(indices: &Tensor, weight: &Tensor) -> Result<Tensor> {
    if weight.ndim() != 2 {
        return Err(Error::invalid(
            "embedding",
            "weight",
            "a 2-d tensor [num_embeddings, embedding_dim]",
            format!("shape {:?}", weight.shape()),
        ));
    }
    Ok(apply(EmbeddingFn, &[weight, indices])?.remove(0))
}
