//! Running one record's case on this rank: the inputs built, the collective called, the loss
//! of the format's weights taken backward, outputs and gradients compared.

use tensorplay_collectives::{self as dist, ProcessGroup};
use tensorplay_core::{DType, Device, Tensor};
use tensorplay_distributed_nn::functional as df;

use crate::Record;
use crate::case::{param_rank, param_splits, parse_op};
use crate::compare::{compare, compare_one};

/// The loss weight of output `k` on rank `rank`:
/// `(arange(numel) % 7 + 1) * (rank + 1) + 0.25 * k`, float64, of `shape`.
pub fn weight(rank: usize, shape: &[usize], k: usize) -> tensorplay_core::Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|i| ((i % 7) + 1) as f64 * (rank + 1) as f64 + 0.25 * k as f64)
        .collect();
    Tensor::from_vec(v, shape)
}

/// Runs one record's case on this rank in `dtype` (inputs and loss weights cast to it);
/// `Ok(None)` when outputs and gradients match, `Ok(Some(line))` with the first difference,
/// `Err` when the case failed.
pub(crate) fn run_case(
    rec: &Record,
    g: &ProcessGroup,
    device: Device,
    dtype: DType,
) -> tensorplay_core::Result<Option<String>> {
    let inputs = rec
        .inputs
        .iter()
        .map(|t| {
            Ok(Tensor::from_vec(t.data.clone(), &t.shape)?
                .to_dtype(dtype)?
                .to_device(device)?
                .requires_grad_(true))
        })
        .collect::<tensorplay_core::Result<Vec<_>>>()?;
    let bad = |e: String| tensorplay_core::Error::external(dist::Error::Io(e));
    let op = parse_op(rec.params.get("op")).map_err(bad)?;
    let src = param_rank(rec, "src").map_err(bad)?.unwrap_or(0);
    let dst = param_rank(rec, "dst").map_err(bad)?.unwrap_or(0);
    let ins = param_splits(rec, "input_split_sizes").map_err(bad)?;
    let outs = param_splits(rec, "output_split_sizes").map_err(bad)?;
    let x = &inputs[0];
    let gp = Some(g);
    let outputs: Vec<Tensor> = match rec.func.as_str() {
        "broadcast" => vec![df::broadcast(x, src, gp)?],
        "reduce" => vec![df::reduce(x, dst, op, gp)?],
        "all_reduce" => vec![df::all_reduce(x, op, gp)?],
        "gather" => df::gather(x, dst, gp)?,
        "scatter" => vec![df::scatter(Some(&inputs), src, gp)?],
        "all_gather" => df::all_gather(x, gp)?,
        "reduce_scatter" => vec![df::reduce_scatter(&inputs, op, gp)?],
        "all_to_all" => df::all_to_all(&inputs, gp)?,
        "all_to_all_single" => vec![df::all_to_all_single(
            x,
            outs.as_deref(),
            ins.as_deref(),
            gp,
        )?],
        other => return Err(bad(format!("unknown fn {other:?}"))),
    };
    // the loss on the host (the core computes on the CPU)
    let mut loss: Option<Tensor> = None;
    for (k, y) in outputs.iter().enumerate() {
        let term = y
            .to_device(Device::Cpu)?
            .mul(&weight(rec.rank, y.shape(), k)?.to_dtype(dtype)?)?
            .sum()?;
        loss = Some(match loss {
            Some(l) => l.add(&term)?,
            None => term,
        });
    }
    if let Some(l) = loss.as_ref().filter(|l| l.requires_grad()) {
        l.backward()?;
    }
    if rec.compare_outputs
        && let Some(d) = compare("outputs", &rec.outputs, &outputs, dtype)?
    {
        return Ok(Some(d));
    }
    let grads: Vec<Option<Tensor>> = inputs.iter().map(Tensor::grad).collect();
    for (i, (want, got)) in rec.grads.iter().zip(&grads).enumerate() {
        let Some(got) = got else {
            return Ok(Some(format!("grads[{i}]: expected a gradient, got none")));
        };
        if let Some(d) = compare_one(&format!("grads[{i}]"), want, got, dtype)? {
            return Ok(Some(d));
        }
    }
    Ok(None)
}
