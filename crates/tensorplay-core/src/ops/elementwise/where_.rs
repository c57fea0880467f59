//! `where`: picks elements of two tensors by a bool mask, with broadcasting.

use crate::autograd::{Context, Function};
use crate::backend::DeviceStorage as _;
use crate::layout::{Layout, broadcast_shapes};
use crate::ops::{any_dispatch, gather_strided, same_device};
use crate::storage::StorageElement;
use crate::{Error, Result, Tensor};

/// `torch.where(condition, a, b)`: differentiable in `a` and `b`.
pub(super) struct Where;
impl Function for Where {
    fn name(&self) -> &str {
        "WhereBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (c, a, b) = (inputs[0], inputs[1], inputs[2]);
        same_device("where", a, b)?;
        let shape = broadcast_shapes(
            &broadcast_shapes(c.shape(), a.shape(), "where")?,
            b.shape(),
            "where",
        )?;
        let lc = c.layout().broadcast_to(&shape, "where")?;
        let ab = binary_map_where(a, b, c, &lc, &shape)?;
        ctx.save_for_backward(&[c]);
        ctx.save_value((a.shape().to_vec(), b.shape().to_vec()));
        Ok(vec![ab])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let c = ctx.saved_tensors()?.remove(0);
        let (sa, sb) = ctx.get::<(Vec<usize>, Vec<usize>)>()?.clone();
        let z = g[0].zeros_like()?;
        Ok(vec![
            None,
            Some(g[0].where_(&c, &z)?.sum_to_size(&sa)?),
            Some(z.where_(&c, &g[0])?.sum_to_size(&sb)?),
        ])
    }
}

fn binary_map_where(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    lc: &Layout,
    shape: &[usize],
) -> Result<Tensor> {
    if let Some(r) = crate::backend::on_device2(a, b, |ca, la, cb, lb| {
        let (la, lb) = (
            la.broadcast_to(shape, "where")?,
            lb.broadcast_to(shape, "where")?,
        );
        let Some(r) = crate::backend::on_device(c, |cc, _| cc.select(lc, (ca, &la), (cb, &lb)))
        else {
            return Err(Error::DeviceMismatch {
                op: "where",
                lhs: c.device(),
                rhs: a.device(),
            });
        };
        Ok(crate::backend::device_tensor(r?, shape))
    }) {
        return r;
    }
    let mask: Vec<bool> = c.with_slice("where", |s: &[bool], _| gather_strided(s, lc))?;
    let ae = a.expand(shape)?;
    let be = b.expand(shape)?;
    any_dispatch!(a.dtype(), T => {
        let av: Vec<T> = ae.with_slice("where", |s: &[T], l| gather_strided(s, l))?;
        let bv: Vec<T> = be.with_slice("where", |s: &[T], l| gather_strided(s, l))?;
        let mut v = crate::storage::pool::take::<T>(mask.len());
        for (o, (&m, (&x, &y))) in v.iter_mut().zip(mask.iter().zip(av.iter().zip(&bv))) {
            *o = if m { x } else { y };
        }
        crate::storage::pool::give_back(av);
        crate::storage::pool::give_back(bv);
        crate::storage::pool::give_back(mask);
        Ok(Tensor::from_cpu(T::into_storage(v), shape))
    })
}
