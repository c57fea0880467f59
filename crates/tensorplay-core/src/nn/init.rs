//! Filling parameters in place (`torch.nn.init`), one random stream per tensor.
//!
//! Each random fill draws **one seed** from the default generator and takes element `i` of
//! the tensor (row-major) from the counter-based stream of that seed at position `i`. So a
//! tensor's values depend only on the generator's state when it is filled, not on how it is
//! split: a rank holding rows `a..b` of a parameter (marked with [`Tensor::mark_rows_of`], as
//! `fully_shard` marks its shards) fills exactly the values rows `a..b` of the whole parameter
//! would get, drawing only those. That is what makes deferred initialisation of a fully
//! sharded model equal to initialising the whole model and then sharding it.
//!
//! The functions write without recording history (as PyTorch's run under `no_grad`). Given a
//! fully sharded module's parameter, whose values live in its local shard
//! ([`Tensor::set_local_shard`]), they fill the shard. On the meta device they do nothing and
//! draw nothing. Random fills need a float tensor ([`Error::UnsupportedDType`] otherwise, on
//! the meta device too); a tensor marked with rows that do not fit in the whole tensor is an
//! [`Error::InvalidArgument`].
//!
//! ```
//! use tensorplay::{self as tp, nn::init, DType, Tensor};
//!
//! let whole = Tensor::zeros(&[4, 3], DType::F64)?;
//! let rows = Tensor::zeros(&[2, 3], DType::F64)?;
//! rows.mark_rows_of(&[4, 3], 1); // rows 1..3 of a [4, 3] tensor
//! tp::manual_seed(5);
//! init::normal_(&whole, 0.0, 0.02)?;
//! tp::manual_seed(5);
//! init::normal_(&rows, 0.0, 0.02)?;
//! assert_eq!(rows.to_vec::<f64>()?, whole.narrow(0, 1, 2)?.to_vec::<f64>()?);
//! # Ok::<(), tp::Error>(())
//! ```

use crate::random::{Stream, default_generator};
use crate::{DType, Error, Result, Tensor};

/// What a fill writes to and where its elements sit in the whole tensor.
struct Target {
    tensor: Tensor,
    /// Index in the whole tensor of the target's first element.
    first: usize,
}

/// The tensor holding `t`'s values here and its place in the whole tensor; `None` on the
/// meta device (nothing to fill). `random`: the fill draws, so the dtype must be float (checked
/// on the meta device too).
fn target(op: &'static str, t: &Tensor, random: bool) -> Result<Option<Target>> {
    let tensor = t.local_shard().unwrap_or_else(|| t.clone());
    if random && !tensor.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op,
            dtype: tensor.dtype(),
            expected: "a floating dtype (float32, float64, bfloat16 or float16)",
        });
    }
    if tensor.device().is_meta() {
        return Ok(None);
    }
    if !tensor.is_contiguous() {
        return Err(Error::invalid(
            op,
            "tensor",
            "a contiguous tensor (a parameter)",
            format!("a view with strides {:?}", tensor.layout().strides()),
        ));
    }
    let Some((whole, first_row)) = tensor.rows_of() else {
        return Ok(Some(Target { tensor, first: 0 }));
    };
    // the rows this tensor holds must be rows of the whole tensor, of the same width
    let (rows, row_numel) = match whole.split_first() {
        Some((&d0, rest)) => (d0, rest.iter().product::<usize>()),
        None => (1, 1),
    };
    let (held, held_row) = match (tensor.shape().split_first(), whole.is_empty()) {
        (Some((&d0, rest)), false) => (d0, rest.iter().product::<usize>()),
        _ => (tensor.numel(), 1),
    };
    let fits = held_row == row_numel && first_row.checked_add(held).is_some_and(|end| end <= rows);
    if !fits {
        return Err(Error::invalid(
            op,
            "tensor",
            format!(
                "rows of the whole tensor of shape {whole:?} it was marked with \
                 (Tensor::mark_rows_of): rows of {row_numel} elements ending by row {rows}"
            ),
            format!(
                "shape {:?} marked as starting at row {first_row}",
                tensor.shape()
            ),
        ));
    }
    Ok(Some(Target {
        tensor,
        first: first_row * row_numel,
    }))
}

/// Writes `values` (all of the target's elements, in order) into the target.
fn write(t: &Target, values: Vec<f64>) -> Result<()> {
    let host = if t.tensor.dtype() == DType::F64 {
        Tensor::from_vec(values, t.tensor.shape())?
    } else {
        Tensor::from_vec(
            values.into_iter().map(|x| x as f32).collect(),
            t.tensor.shape(),
        )?
    };
    let _g = crate::no_grad();
    t.tensor.copy_(&host)
}

/// Fills `t` from `U(low, high)` (`torch.nn.init.uniform_`), from one seed drawn from the
/// default generator. Errors: `low > high`, or bounds (or their difference) not finite; a
/// non-float tensor; a non-contiguous view; rows marked with [`Tensor::mark_rows_of`] that
/// are not rows of the whole tensor.
pub fn uniform_(t: &Tensor, low: f64, high: f64) -> Result<()> {
    const OP: &str = "init::uniform_";
    if !(low <= high && (high - low).is_finite()) {
        return Err(Error::invalid(
            OP,
            "high",
            "finite bounds with low <= high",
            format!("low={low}, high={high}"),
        ));
    }
    let Some(tg) = target(OP, t, true)? else {
        return Ok(());
    };
    let seed = default_generator().next_u64();
    let mut v = vec![0.0; tg.tensor.numel()];
    Stream::new(seed).uniform(tg.first, &mut v);
    v.iter_mut().for_each(|x| *x = low + (high - low) * *x);
    write(&tg, v)
}

/// Fills `t` from `N(mean, std^2)` (`torch.nn.init.normal_`), from one seed drawn from the
/// default generator. Errors: `std` negative or not finite, `mean` not finite; a non-float
/// tensor; a non-contiguous view; rows marked with [`Tensor::mark_rows_of`] that are not rows
/// of the whole tensor.
pub fn normal_(t: &Tensor, mean: f64, std: f64) -> Result<()> {
    const OP: &str = "init::normal_";
    if !(mean.is_finite() && std.is_finite() && std >= 0.0) {
        return Err(Error::invalid(
            OP,
            "std",
            "a finite mean and a finite std >= 0",
            format!("mean={mean}, std={std}"),
        ));
    }
    let Some(tg) = target(OP, t, true)? else {
        return Ok(());
    };
    let seed = default_generator().next_u64();
    let mut v = vec![0.0; tg.tensor.numel()];
    Stream::new(seed).normal(tg.first, &mut v);
    v.iter_mut().for_each(|x| *x = mean + std * *x);
    write(&tg, v)
}

/// Fills `t` with `value` converted to its dtype (`torch.nn.init.constant_`); draws nothing.
/// Errors: a value an int64 tensor cannot hold (NaN, infinite, out of range); a
/// non-contiguous view; rows marked with [`Tensor::mark_rows_of`] that are not rows of the
/// whole tensor.
pub fn constant_(t: &Tensor, value: f64) -> Result<()> {
    const OP: &str = "init::constant_";
    let Some(tg) = target(OP, t, false)? else {
        return Ok(());
    };
    let _g = crate::no_grad();
    tg.tensor.fill_(value)
}

/// Fills `t` with zeros (`torch.nn.init.zeros_`).
pub fn zeros_(t: &Tensor) -> Result<()> {
    constant_(t, 0.0)
}

/// Fills `t` with ones (`torch.nn.init.ones_`).
pub fn ones_(t: &Tensor) -> Result<()> {
    constant_(t, 1.0)
}
