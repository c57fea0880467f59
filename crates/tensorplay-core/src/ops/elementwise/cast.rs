//! Dtype casts (`to_dtype`): differentiable between floating types.

use super::unary_map;
use crate::autograd::{Context, Function};
use crate::backend::DeviceStorage as _;
use crate::kernels::math::Elem;
use crate::ops::{any_dispatch, device_map};
use crate::{DType, Element, Result, Tensor, bf16, f16};

fn cast_kernel(x: &Tensor, to: DType) -> Result<Tensor> {
    if let Some(r) = device_map(x, |c, l| c.copy_as(l, to)) {
        return r;
    }
    // float32 to and from the 16-bit types: the kernels' load (exact) and store (rounded to
    // nearest even), without going through float64
    match (x.dtype(), to) {
        (DType::F32, DType::BF16) => return unary_map::<f32, bf16>(x, "to_dtype", bf16::store),
        (DType::F32, DType::F16) => return unary_map::<f32, f16>(x, "to_dtype", f16::store),
        (DType::BF16, DType::F32) => return unary_map::<bf16, f32>(x, "to_dtype", bf16::load),
        (DType::F16, DType::F32) => return unary_map::<f16, f32>(x, "to_dtype", f16::load),
        _ => {}
    }
    // everything else through float64, which holds every value of every other dtype exactly,
    // so a conversion rounds once
    any_dispatch!(x.dtype(), S => {
        any_dispatch!(to, D => {
            unary_map::<S, D>(x, "to_dtype", |v| <D as Element>::from_f64(Element::to_f64(v)))
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
