//! The reducing collectives: `all_reduce`, `reduce`, `reduce_scatter`, `reduce_scatter_tensor`.

use tensorplay_core::Tensor;

use super::check::{DESC, agree, checks_enabled, fmt_shape, op_code, op_label, shape_desc};
use super::stage::{self, Out};
use super::{Call, blocking, call, check_writable, queued, resolve};
use crate::group::ProcessGroup;
use crate::work::Work;
use crate::{ReduceOp, Result};

/// In-place all-reduce (`dist.all_reduce(tensor, op, group)`): every rank's `tensor` becomes the
/// reduction over ranks. Avg is for floating dtypes, bitwise ops for int64.
///
/// # Errors
/// Not initialised, not a member, a tensor the group's backend does not move (device, dtype,
/// requires grad), an op that does not apply to the dtype, ranks that disagree on shape or op
/// ([`Error::Mismatch`](crate::Error::Mismatch) on every rank), a timeout or a failed peer.
#[track_caller]
pub fn all_reduce(tensor: &Tensor, op: ReduceOp, group: Option<&ProcessGroup>) -> Result<()> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "all_reduce")?;
    let t = tensor.clone();
    blocking(&g, "all_reduce", site, Some(tensor), || {
        all_reduce_impl(&g, &t, op)
    })
}

/// [`all_reduce`] with `async_op=True`: returns a [`Work`] to wait on.
#[track_caller]
pub fn all_reduce_async(
    tensor: &Tensor,
    op: ReduceOp,
    group: Option<&ProcessGroup>,
) -> Result<Work> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "all_reduce")?;
    let t = tensor.clone();
    let g2 = g.clone();
    queued(&g, "all_reduce", site, Some(tensor), move || {
        all_reduce_impl(&g2, &t, op)
    })
}

fn all_reduce_impl(g: &ProcessGroup, t: &Tensor, op: ReduceOp) -> Result<()> {
    let c = call(g, "all_reduce")?;
    let local = c
        .accept("tensor", t)
        .and_then(|_| check_writable(&c, "tensor", t))
        .and_then(|_| c.check_op(op, t.dtype()));
    if !checks_enabled() {
        local?;
    } else {
        let mut d = shape_desc(t);
        d.push(op_code(op));
        let all = c.exchange_local(&d, local)?;
        agree(&c, &all, 0..DESC, "dtype and shape", fmt_shape)?;
        agree(&c, &all, DESC..DESC + 1, "the reduce op", |v| {
            format!("op {}", op_label(v[0]))
        })?;
    }
    let out = Out::new(t)?;
    c.run(|b| b.all_reduce(out.t(), op, c.timeout()))?;
    out.finish()
}

/// Reduces every rank's `tensor` into global rank `dst`'s `tensor` (`dist.reduce`); the other
/// ranks' tensors are left unchanged (PyTorch leaves partial results there).
///
/// # Errors
/// As [`all_reduce`], and `dst` outside the group.
#[track_caller]
pub fn reduce(
    tensor: &Tensor,
    dst: usize,
    op: ReduceOp,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "reduce")?;
    blocking(&g, "reduce", site, Some(tensor), || {
        let c = call(&g, "reduce")?;
        let root = c.root("dst", dst);
        let local = root
            .as_ref()
            .map(|_| ())
            .map_err(Clone::clone)
            .and_then(|_| c.accept("tensor", tensor))
            .and_then(|_| check_writable(&c, "tensor", tensor))
            .and_then(|_| c.check_op(op, tensor.dtype()));
        if !checks_enabled() {
            local?;
        } else {
            let mut d = shape_desc(tensor);
            d.extend([dst as i64, op_code(op)]);
            let all = c.exchange_local(&d, local)?;
            agree(&c, &all, 0..DESC, "dtype and shape", fmt_shape)?;
            agree(&c, &all, DESC..DESC + 2, "dst and op", |v| {
                format!("dst {} op {}", v[0], op_label(v[1]))
            })?;
        }
        let root = root?;
        let out = Out::new(tensor)?;
        c.run(|b| b.reduce(out.t(), op, root, c.timeout()))?;
        out.finish()
    })
}

/// Reduces `input_list[r]` over ranks into rank `r`'s `output` (`dist.reduce_scatter`); all
/// tensors have `output`'s shape.
///
/// # Errors
/// As [`all_reduce`], and an `input_list` of the wrong length or shapes.
#[track_caller]
pub fn reduce_scatter(
    output: &Tensor,
    input_list: &[Tensor],
    op: ReduceOp,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "reduce_scatter")?;
    blocking(&g, "reduce_scatter", site, Some(output), || {
        let c = call(&g, "reduce_scatter")?;
        let pre = (|| {
            if input_list.len() != c.size {
                return Err(c.err(
                    "input_list",
                    format!("{} tensors (one per rank)", c.size),
                    input_list.len(),
                ));
            }
            for (r, t) in input_list.iter().enumerate() {
                if t.shape() != output.shape() || t.dtype() != output.dtype() {
                    return Err(c.err(
                        &format!("input_list[{r}]"),
                        format!("output's {} {:?}", output.dtype(), output.shape()),
                        format!("{} {:?}", t.dtype(), t.shape()),
                    ));
                }
                c.accept(&format!("input_list[{r}]"), t)?;
            }
            Ok(())
        })();
        rs_check(&c, output, op, pre)?;
        let inputs = input_list
            .iter()
            .map(|t| stage::input(t, Some(output)))
            .collect::<Result<Vec<_>>>()?;
        let out = Out::new(output)?;
        c.run(|b| b.reduce_scatter(out.t(), &inputs, op, c.timeout()))?;
        out.finish()
    })
}

/// Reduces `input` (`size * output.numel()` elements, blocks in rank order) over ranks and
/// leaves block `rank` in `output` (`dist.reduce_scatter_tensor`).
///
/// # Errors
/// As [`all_reduce`], and an `input` of the wrong size or dtype.
#[track_caller]
pub fn reduce_scatter_tensor(
    output: &Tensor,
    input: &Tensor,
    op: ReduceOp,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "reduce_scatter_tensor")?;
    blocking(&g, "reduce_scatter_tensor", site, Some(output), || {
        rst_impl(&g, output, input, op)
    })
}

/// [`reduce_scatter_tensor`] with `async_op=True`.
#[track_caller]
pub fn reduce_scatter_tensor_async(
    output: &Tensor,
    input: &Tensor,
    op: ReduceOp,
    group: Option<&ProcessGroup>,
) -> Result<Work> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "reduce_scatter_tensor")?;
    let (o, i, g2) = (output.clone(), input.clone(), g.clone());
    queued(&g, "reduce_scatter_tensor", site, Some(output), move || {
        rst_impl(&g2, &o, &i, op)
    })
}

fn rst_impl(g: &ProcessGroup, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
    let c = call(g, "reduce_scatter_tensor")?;
    let pre = c.accept("input", input).and_then(|_| {
        if output.dtype() != input.dtype() || input.numel() != output.numel() * c.size {
            return Err(c.err(
                "input",
                format!(
                    "{} with {} elements (world {} x output {})",
                    output.dtype(),
                    output.numel() * c.size,
                    c.size,
                    output.numel()
                ),
                format!("{} with {} elements", input.dtype(), input.numel()),
            ));
        }
        Ok(())
    });
    rs_check(&c, output, op, pre)?;
    let inp = stage::input(input, Some(output))?;
    let out = Out::new(output)?;
    c.run(|b| b.reduce_scatter_tensor(out.t(), &inp, op, c.timeout()))?;
    out.finish()
}

/// The output's own checks and the cross-rank agreement on the output's dtype and shape and
/// the op, shared by both forms.
fn rs_check(c: &Call<'_>, output: &Tensor, op: ReduceOp, pre: Result<()>) -> Result<()> {
    let local = pre
        .and_then(|_| c.accept("output", output))
        .and_then(|_| check_writable(c, "output", output))
        .and_then(|_| c.check_op(op, output.dtype()));
    if !checks_enabled() {
        return local;
    }
    let mut d = shape_desc(output);
    d.push(op_code(op));
    let all = c.exchange_local(&d, local)?;
    agree(c, &all, 0..DESC, "output dtype and shape", fmt_shape)?;
    agree(c, &all, DESC..DESC + 1, "the reduce op", |v| {
        format!("op {}", op_label(v[0]))
    })
}
