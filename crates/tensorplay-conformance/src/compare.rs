//! The comparison rule: expected and actual tensors, value by value, within [`RTOL`] in
//! float64 and [`tolerance`] in the other dtypes.

use tensorplay_core::{DType, Device, Tensor};

use crate::TensorData;

/// Relative tolerance of the comparison rule in float64: `|a - e| <= RTOL * max(1, |e|)`.
pub const RTOL: f64 = 1e-9;

/// The relative tolerance of the comparison rule in `dtype`: `|a - round(e)| <= tol *
/// max(1, |e|)`, where `round(e)` is the float64 expectation rounded to `dtype`. float64:
/// [`RTOL`]. Otherwise two machine epsilons (bfloat16: 2^-6, float16: 2^-9, float32: 2^-22):
/// the inputs and the loss weights are rounded to `dtype` before the collective (one rounding
/// each), the collective rounds its float32 sum once, and a product or a tie's division once
/// more. Over the repository's four files the largest difference measured is within one
/// epsilon in bfloat16 (half an epsilon fails 14 of the 528 world-4 records); the outputs of
/// the files' cases are of the order of their inputs, so the bound is relative to
/// `max(1, |e|)` as in float64. Non-floating dtypes: [`RTOL`].
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => RTOL,
        d => tensorplay_core::finfo(d).map_or(RTOL, |f| 2.0 * f.eps),
    }
}

/// The first difference between expected and actual tensors, as `what[i][j]: expected e got a`.
pub(crate) fn compare(
    what: &str,
    want: &[TensorData],
    got: &[Tensor],
    dtype: DType,
) -> tensorplay_core::Result<Option<String>> {
    if want.len() != got.len() {
        return Ok(Some(format!(
            "{what}: expected {} tensors got {}",
            want.len(),
            got.len()
        )));
    }
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        if let Some(d) = compare_one(&format!("{what}[{i}]"), w, g, dtype)? {
            return Ok(Some(d));
        }
    }
    Ok(None)
}

/// The first difference between one expected and one actual tensor.
pub(crate) fn compare_one(
    what: &str,
    want: &TensorData,
    got: &Tensor,
    dtype: DType,
) -> tensorplay_core::Result<Option<String>> {
    if got.shape() != want.shape.as_slice() {
        return Ok(Some(format!(
            "{what}: expected shape {:?} got {:?}",
            want.shape,
            got.shape()
        )));
    }
    if got.dtype() != dtype {
        return Ok(Some(format!(
            "{what}: expected dtype {dtype} got {}",
            got.dtype()
        )));
    }
    let vals = got.to_device(Device::Cpu)?.to_vec_f64()?;
    let rounded = Tensor::from_vec(want.data.clone(), &[want.data.len()])?
        .to_dtype(dtype)?
        .to_vec_f64()?;
    let tol = tolerance(dtype);
    for (j, ((&e, &r), &a)) in want.data.iter().zip(&rounded).zip(&vals).enumerate() {
        let close = (a - r).abs() <= tol * e.abs().max(1.0);
        if !close {
            return Ok(Some(format!("{what}[{j}]: expected {e} got {a}")));
        }
    }
    Ok(None)
}
