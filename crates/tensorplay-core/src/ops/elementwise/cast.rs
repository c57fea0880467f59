//! Dtype casts (`to_dtype`): differentiable between floating types.

use super::unary_map;
use crate::autograd::{Context, Function};
use crate::backend::DeviceStorage as _;
use crate::ops::{any_dispatch, device_map};
use crate::{DType, Element, Result, Tensor};

fn cast_kernel(x: &Tensor, to: DType) -> Result<Tensor> {
    if let Some(r) = device_map(x, |c, l| c.copy_as(l, to)) {
        return r;
    }
    any_dispatch!(x.dtype(), S => {
        any_dispatch!(to, D => {
            unary_map::<S, D>(x, "to_dtype", |v| D::from_f64(Element::to_f64(v)))
        })
    })
}

/// The cast of one tensor to `to`; its backward casts the gradient back to `from`.
pub(super) struct Cast {
    pub(super) from: DType,
    pub(super) to: DType,
}
impl Function for Cast {
    fn name(&self) -> &str {
        "ToCopyBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![cast_kernel(inputs[0], self.to)?])
    }
    fn backward(&self, _ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g[0].to_dtype(self.from)?)])
    }
}
