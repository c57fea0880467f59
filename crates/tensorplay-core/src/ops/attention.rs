//! The fused attention operation of the CPU (`kernels::attention`): the autograd function and
//! the layouts it reads and writes. [`fused_sdpa`] says whether a call can take it and runs it;
//! `nn::functional::scaled_dot_product_attention` falls back to the composed math otherwise.

use super::{float_dispatch, with_all};
use crate::autograd::{Context, Function, apply, is_grad_enabled};
use crate::kernels::attention::{self as kernel, Dims, Mask, MaskMat, Mat};
use crate::kernels::math::Elem;
use crate::storage::StorageElement;
use crate::{DType, Layout, Result, Tensor};

const OP: &str = "scaled_dot_product_attention";

/// The offsets of the `[.., rows, cols]` matrices of a view (its batch dimensions in row-major
/// order) and its stride along rows.
fn matrices(l: &Layout) -> (Vec<usize>, usize) {
    let nd = l.shape.len();
    let batch = Layout {
        shape: l.shape[..nd - 2].to_vec(),
        strides: l.strides[..nd - 2].to_vec(),
        offset: l.offset,
    };
    (batch.offsets(), l.strides[nd - 2])
}

/// `t` itself when its last dimension is contiguous, else a contiguous copy.
fn rows_contiguous(t: &Tensor) -> Result<Tensor> {
    if t.layout().strides.last() == Some(&1) || t.shape().last() == Some(&1) {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// The mask a fused call applies.
#[derive(Clone)]
enum MaskKind {
    None,
    Causal,
    /// Bool or additive, broadcast to `[.., L, S]` by the layout kept here.
    Tensor(Tensor, Layout),
}

struct FusedAttention {
    mask: MaskKind,
    scale: f64,
}

impl FusedAttention {
    fn dims(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Dims {
        let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
        let nd = qs.len();
        Dims {
            bh: qs[..nd - 2].iter().product(),
            l: qs[nd - 2],
            s: ks[nd - 2],
            e: qs[nd - 1],
            ev: vs[nd - 1],
        }
    }

    /// Runs `f` with the kernel's mask over the host elements.
    fn with_mask<T: Elem + StorageElement, R>(
        &self,
        f: impl FnOnce(&Mask<'_, T>) -> R,
    ) -> Result<R> {
        match &self.mask {
            MaskKind::None => Ok(f(&Mask::None)),
            MaskKind::Causal => Ok(f(&Mask::Causal)),
            MaskKind::Tensor(m, l) => {
                let (offsets, row) = matrices(l);
                let col = l.strides[l.shape.len() - 1];
                if m.dtype() == DType::Bool {
                    m.with_slice(OP, |data: &[bool], _| {
                        f(&Mask::Bool(MaskMat {
                            data,
                            offsets,
                            row,
                            col,
                        }))
                    })
                } else {
                    m.with_slice(OP, |data: &[T], _| {
                        f(&Mask::Add(MaskMat {
                            data,
                            offsets,
                            row,
                            col,
                        }))
                    })
                }
            }
        }
    }

    fn forward_typed<T: Elem + StorageElement>(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let d = self.dims(q, k, v);
        let batch = q.shape()[..q.ndim() - 2].to_vec();
        // 4-d inputs ([B, H, L, E]) are written as [B, L, H, Ev] and returned as its permuted
        // view, so merging the heads afterwards is free
        let heads_last = batch.len() == 2;
        let (out_offsets, out_row): (Vec<usize>, usize) = if heads_last {
            let h = batch[1];
            let offs = (0..d.bh)
                .map(|m| (m / h) * d.l * h * d.ev + (m % h) * d.ev)
                .collect();
            (offs, h * d.ev)
        } else {
            ((0..d.bh).map(|m| m * d.l * d.ev).collect(), d.ev)
        };
        let (out, lse) = self.with_mask::<T, _>(|mask| {
            with_all::<T, _>(&[q, k, v], OP, |s| {
                let mat = |i: usize| {
                    let (offsets, row) = matrices(s[i].1);
                    Mat {
                        data: s[i].0,
                        offsets,
                        row,
                    }
                };
                kernel::forward(
                    &mat(0),
                    &mat(1),
                    &mat(2),
                    mask,
                    d,
                    self.scale,
                    &out_offsets,
                    out_row,
                    d.bh * d.l * d.ev,
                )
            })
        })??;
        let y = if heads_last {
            Tensor::from_vec(out, &[batch[0], d.l, batch[1], d.ev])?.permute(&[0, 2, 1, 3])?
        } else {
            let mut shape = batch.clone();
            shape.extend([d.l, d.ev]);
            Tensor::from_vec(out, &shape)?
        };
        let lse: Vec<T> = lse.into_iter().map(T::store).collect();
        Ok((y, Tensor::from_vec(lse, &[d.bh, d.l])?))
    }

    fn backward_typed<T: Elem + StorageElement>(
        &self,
        saved: &[Tensor],
        g: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let (q, k, v, o, lse) = (&saved[0], &saved[1], &saved[2], &saved[3], &saved[4]);
        let d = self.dims(q, k, v);
        let g = rows_contiguous(g)?;
        let lse = lse
            .to_vec::<T>()?
            .into_iter()
            .map(T::load)
            .collect::<Vec<_>>();
        let (dq, dk, dv) = self.with_mask::<T, _>(|mask| {
            with_all::<T, _>(&[q, k, v, o, &g], OP, |s| {
                let mat = |i: usize| {
                    let (offsets, row) = matrices(s[i].1);
                    Mat {
                        data: s[i].0,
                        offsets,
                        row,
                    }
                };
                kernel::backward(
                    &mat(0),
                    &mat(1),
                    &mat(2),
                    &mat(3),
                    &mat(4),
                    mask,
                    &lse,
                    d,
                    self.scale,
                )
            })
        })??;
        Ok(vec![
            Some(Tensor::from_vec(dq, q.shape())?),
            Some(Tensor::from_vec(dk, k.shape())?),
            Some(Tensor::from_vec(dv, v.shape())?),
        ])
    }

    /// The gradients from differentiable operations, for a backward that is itself recorded.
    fn backward_composed(&self, saved: &[Tensor], g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (q, k, v) = (&saved[0], &saved[1], &saved[2]);
        let mut scores = q.matmul(&k.transpose(-2, -1)?)?.mul_scalar(self.scale)?;
        match &self.mask {
            MaskKind::None => {}
            MaskKind::Causal => {
                let (l, s) = (q.shape()[q.ndim() - 2], k.shape()[k.ndim() - 2]);
                let bias = super::mask::causal_bias(l, s, scores.dtype())?;
                scores = scores.add(&bias)?;
            }
            MaskKind::Tensor(m, _) if m.dtype() == DType::Bool => {
                scores = scores.masked_fill(&m.logical_not()?, f64::NEG_INFINITY)?;
            }
            MaskKind::Tensor(m, _) => scores = scores.add(m)?,
        }
        let p = scores.softmax(-1)?;
        let dv = p.transpose(-2, -1)?.matmul(g)?;
        let dp = g.matmul(&v.transpose(-2, -1)?)?;
        let ds = p.mul(&dp.sub(&dp.mul(&p)?.sum_dims(&[-1], true)?)?)?;
        let dq = ds.matmul(k)?.mul_scalar(self.scale)?;
        let dk = ds.transpose(-2, -1)?.matmul(q)?.mul_scalar(self.scale)?;
        Ok(vec![Some(dq), Some(dk), Some(dv)])
    }
}

impl Function for FusedAttention {
    fn name(&self) -> &str {
        "ScaledDotProductFlashAttentionForCpuBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
        let (y, lse) = float_dispatch!(q.dtype(), OP, T => self.forward_typed::<T>(q, k, v)?);
        ctx.save_for_backward(&[q, k, v, &y, &lse]);
        Ok(vec![y])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let saved = ctx.saved_tensors()?;
        if is_grad_enabled() {
            return self.backward_composed(&saved, &g[0]);
        }
        float_dispatch!(saved[0].dtype(), OP, T => self.backward_typed::<T>(&saved, &g[0]))
    }
}

/// Attention by the fused CPU kernel when it applies (host tensors with the same batch
/// dimensions, at least one key, no dropout, a mask that does not require grad), else `None`
/// (the caller composes the math). Inputs are already checked by the caller; `mask` is a bool
/// or additive mask of the query's dtype broadcastable to `[.., L, S]`.
pub(crate) fn fused_sdpa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    is_causal: bool,
    dropout_p: f64,
    scale: f64,
) -> Option<Result<Tensor>> {
    let nd = q.ndim();
    let on_host = |t: &Tensor| !t.device().is_cuda();
    if dropout_p != 0.0
        || ![q, k, v].into_iter().all(on_host)
        || k.ndim() != nd
        || v.ndim() != nd
        || k.shape()[..nd - 2] != q.shape()[..nd - 2]
        || v.shape()[..nd - 2] != q.shape()[..nd - 2]
        || k.shape()[nd - 2] == 0
        || mask.is_some_and(|m| !on_host(m) || m.requires_grad())
    {
        return None;
    }
    let run = || -> Result<Tensor> {
        let mut target = q.shape()[..nd - 1].to_vec();
        target.push(k.shape()[nd - 2]);
        let mask = match mask {
            Some(m) => MaskKind::Tensor(m.clone(), m.layout().broadcast_to(&target, OP)?),
            None if is_causal => MaskKind::Causal,
            None => MaskKind::None,
        };
        let (q, k, v) = (
            rows_contiguous(q)?,
            rows_contiguous(k)?,
            rows_contiguous(v)?,
        );
        Ok(apply(FusedAttention { mask, scale }, &[&q, &k, &v])?.remove(0))
    };
    Some(run())
}
