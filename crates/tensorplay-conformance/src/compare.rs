//! The comparison rule: expected and actual tensors, value by value, within [`RTOL`].

use tensorplay_core::{Device, Tensor};

use crate::TensorData;

/// Relative tolerance of the comparison rule: `|a - e| <= RTOL * max(1, |e|)`.
pub const RTOL: f64 = 1e-9;

/// The first difference between expected and actual tensors, as `what[i][j]: expected e got a`.
pub(crate) fn compare(
    what: &str,
    want: &[TensorData],
    got: &[Tensor],
) -> tensorplay_core::Result<Option<String>> {
    if want.len() != got.len() {
        return Ok(Some(format!(
            "{what}: expected {} tensors got {}",
            want.len(),
            got.len()
        )));
    }
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        if let Some(d) = compare_one(&format!("{what}[{i}]"), w, g)? {
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
) -> tensorplay_core::Result<Option<String>> {
    if got.shape() != want.shape.as_slice() {
        return Ok(Some(format!(
            "{what}: expected shape {:?} got {:?}",
            want.shape,
            got.shape()
        )));
    }
    let vals = got.to_device(Device::Cpu)?.to_vec_f64()?;
    for (j, (&e, &a)) in want.data.iter().zip(&vals).enumerate() {
        let close = (a - e).abs() <= RTOL * e.abs().max(1.0);
        if !close {
            return Ok(Some(format!("{what}[{j}]: expected {e} got {a}")));
        }
    }
    Ok(None)
}
