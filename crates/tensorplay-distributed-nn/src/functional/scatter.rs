//! One-to-all collectives: [`broadcast`] and [`scatter`].

use tensorplay_collectives::{self as coll, ProcessGroup};
use tensorplay_core::autograd::{Context, Function, apply, is_grad_enabled};
use tensorplay_core::{DType, Device, Result, Tensor};

use super::ReduceOp;
use super::agreement::{SHAPE_LEN, agree_root, dtype_code, dtype_of, push_shape, read_shape};
use super::group::Grp;
use super::tensors::{check_tensor, fail_together, fresh, joined, zeros};
use super::{gather, reduce};

/// Broadcasts global rank `src`'s `tensor` to every rank of the group (differentiable
/// `dist.broadcast`); returns a new tensor of `tensor`'s shape and dtype on every rank.
///
/// Backward: a SUM [`reduce`] of the upstream gradients to `src`, so `src` receives
/// `Σ_k g_k` and the other ranks zeros. Every rank passes a tensor of the same shape and dtype
/// (its values are ignored off `src`); `src`'s layout need not match the others'.
///
/// # Errors
/// `src` not in the group, a dtype other than float32, float64, bfloat16, float16 or int64 or more than
/// [`MAX_DIMS`](super::MAX_DIMS) dimensions, ranks disagreeing on shape, dtype or `src` (on every rank, naming
/// them), timeouts and peer failures of the collectives.
pub fn broadcast(tensor: &Tensor, src: usize, group: Option<&ProcessGroup>) -> Result<Tensor> {
    let gp = Grp::new(group, "broadcast")?;
    if let Err(e) = check_tensor(&gp, "broadcast", "tensor", tensor) {
        return fail_together(e, |t| coll::broadcast(t, src, gp.pg()));
    }
    Ok(apply(Broadcast { gp, src }, &[tensor])?.remove(0))
}

struct Broadcast {
    gp: Grp,
    src: usize,
}

impl Function for Broadcast {
    fn name(&self) -> &str {
        "BroadcastBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let y = joined(fresh(inputs[0]), |t| {
            coll::broadcast(t, self.src, self.gp.pg())
        })?;
        coll::broadcast(&y, self.src, self.gp.pg())?;
        Ok(vec![y])
    }
    fn backward(&self, _ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            Ok(vec![Some(reduce(
                &grads[0],
                self.src,
                ReduceOp::Sum,
                self.gp.pg(),
            )?)])
        })
    }
}

/// Scatters global rank `src`'s `tensors` (one per rank of the group, group-rank order):
/// rank `r` receives a new tensor equal to `tensors[r]` (differentiable `dist.scatter`).
///
/// On `src`, `tensors` is required (`W` tensors of one dtype; their shapes may differ). The
/// other ranks pass `None` — or placeholders, which are ignored and receive zero gradients —
/// and learn the shape and dtype from `src`. Whether the result takes part in autograd is
/// decided by `src` (whether its tensors require grad), so that every rank runs the backward
/// collective or none does.
///
/// Backward: a [`gather`] of the upstream gradients to `src`: on `src`
/// `d tensors[i] = g_i`; elsewhere zeros.
///
/// # Errors
/// `src` not in the group; on `src`, a missing list, a length other than the group size, or
/// mixed dtypes; ranks disagreeing on `src`; timeouts and peer failures.
pub fn scatter(
    tensors: Option<&[Tensor]>,
    src: usize,
    group: Option<&ProcessGroup>,
) -> Result<Tensor> {
    const OP: &str = "scatter";
    let gp = Grp::new(group, OP)?;
    let len = 3 + gp.size * SHAPE_LEN;
    let is_src = gp.global == src;
    let desc = gp.root(OP, "src", src).and_then(|_| {
        let mut d = vec![src as i64, 0, 0];
        if !is_src {
            d.resize(len, 0);
            return Ok(d);
        }
        let list = tensors.ok_or_else(|| {
            gp.err(
                OP,
                "tensors",
                format!("{} tensors on the source rank", gp.size),
                "None",
            )
        })?;
        if list.len() != gp.size {
            return Err(gp.err(
                OP,
                "tensors",
                format!("{} tensors (one per rank of the group)", gp.size),
                list.len(),
            ));
        }
        for (i, t) in list.iter().enumerate() {
            let arg = format!("tensors[{i}]");
            check_tensor(&gp, OP, &arg, t)?;
            if t.dtype() != list[0].dtype() {
                return Err(gp.err(OP, &arg, format!("dtype {}", list[0].dtype()), t.dtype()));
            }
        }
        let rg = is_grad_enabled() && list.iter().any(Tensor::requires_grad);
        d[1] = i64::from(rg);
        d[2] = dtype_code(list[0].dtype());
        for t in list {
            push_shape(&mut d, t.shape());
        }
        Ok(d)
    });
    let all = gp.exchange("the shape exchange of scatter", desc, len)?;
    agree_root(&gp, OP, "src", &all, |d| d[0])?;
    let root = gp.root(OP, "src", src)?;
    let meta = &all[root];
    let src_rg = meta[1] != 0;
    let dtype = dtype_of(meta[2]);
    let shape = read_shape(&meta[3 + gp.rank * SHAPE_LEN..]);
    let device = tensors
        .and_then(|l| l.first())
        .map_or(Device::Cpu, Tensor::device);
    let mut f = Scatter {
        gp: gp.clone(),
        src,
        shape,
        dtype,
        device,
        placeholders: vec![],
    };
    if is_src {
        let list = tensors.unwrap_or_default();
        let refs: Vec<&Tensor> = list.iter().collect();
        return Ok(apply(f, &refs)?.remove(0));
    }
    let mut refs: Vec<&Tensor> = tensors.map(|l| l.iter().collect()).unwrap_or_default();
    if src_rg && is_grad_enabled() {
        // record a node even without placeholders that require grad: this rank must run the
        // backward gather with src
        let anchor = Tensor::zeros(&[0], (dtype, Device::Cpu))?.requires_grad_(true);
        refs.push(&anchor);
        f.placeholders = refs
            .iter()
            .map(|t| (t.shape().to_vec(), t.dtype(), t.device()))
            .collect();
        Ok(apply(f, &refs)?.remove(0))
    } else {
        let _ng = tensorplay_core::no_grad();
        Ok(apply(f, &refs)?.remove(0))
    }
}

struct Scatter {
    gp: Grp,
    src: usize,
    shape: Vec<usize>,
    dtype: DType,
    device: Device,
    /// Shape, dtype and device of each input on a receiving rank (placeholders, anchor).
    placeholders: Vec<(Vec<usize>, DType, Device)>,
}

impl Function for Scatter {
    fn name(&self) -> &str {
        "ScatterBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let out = zeros(&self.shape, self.dtype, self.device)?;
        if self.gp.global == self.src {
            let list = inputs
                .iter()
                .map(|t| fresh(t))
                .collect::<Result<Vec<_>>>()?;
            coll::scatter(&out, Some(&list), self.src, self.gp.pg())?;
        } else {
            coll::scatter(&out, None, self.src, self.gp.pg())?;
        }
        Ok(vec![out])
    }
    fn backward(&self, ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            let gathered = gather(&grads[0], self.src, self.gp.pg())?;
            if self.gp.global == self.src {
                return Ok(gathered.into_iter().map(Some).collect());
            }
            // placeholders (and the anchor) get zeros of their own shapes
            let _ = ctx;
            self.placeholders
                .iter()
                .map(|(shape, dt, dev)| Ok(Some(zeros(shape, *dt, *dev)?)))
                .collect()
        })
    }
}
