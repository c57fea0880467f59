//! Deferred initialisation of a fully sharded model, in real processes: built on the meta
//! device, `fully_shard` applied, `to_empty` and `reset_parameters` on every rank. Each rank's
//! shards must equal the rows of a whole model built eagerly and reset from the same seed, the
//! sharded model must compute the whole model's loss, and the peak bytes allocated while
//! building it must stay near the rank's shards, far below the whole model.

use tensorplay_core::nn::Module;
use tensorplay_core::{self as tp, DType, Device};
use tensorplay_testkit::{check_close, cpu_world};

use crate::fsdp::{Case, Model, TIMEOUT, TestResult, Wrap, build, case, gathered_in, loss, rows};

const CASES: [Case; 3] = [
    case(
        "gpt nested, float32",
        Model::Gpt,
        Wrap::Nested,
        true,
        DType::F32,
    ),
    case(
        "gpt root only, float64",
        Model::Gpt,
        Wrap::RootOnly,
        true,
        DType::F64,
    ),
    case(
        "gpt nested, float64, kept",
        Model::Gpt,
        Wrap::Nested,
        false,
        DType::F64,
    ),
];

fn bytes(ps: &[tp::Tensor]) -> usize {
    ps.iter()
        .map(|p| p.numel() * p.dtype().size_in_bytes())
        .sum()
}

fn check(c: &Case, rank: usize, world: usize) -> TestResult {
    let name = format!("{} at world {world}, rank {rank}", c.name);
    // the reference: the whole model built eagerly, reset from the seed
    let mut whole = build(c, false)?;
    tp::manual_seed(21);
    whole.reset_parameters()?;
    let whole_bytes = bytes(&whole.parameters());

    let base = tp::memory::allocated_bytes();
    tp::memory::reset_peak();
    let mut m = tp::with_default_device(Device::Meta, || build(c, false))?;
    if tp::memory::peak_allocated_bytes() > base {
        return Err(format!("{name}: building on the meta device allocated").into());
    }
    let handles = crate::fsdp::wrap(c, m.as_mut())?;
    m.to_empty(Device::Cpu)?;
    tp::manual_seed(21);
    m.reset_parameters()?;
    let peak = tp::memory::peak_allocated_bytes() - base;

    let shards = m.parameters();
    let mine = bytes(&shards);
    let largest = shards
        .iter()
        .map(|p| p.numel() * p.dtype().size_in_bytes())
        .max()
        .unwrap_or(0);
    // the shards, the host copy of the one being filled, and small change
    let bound = mine + largest + 1024;
    if peak > bound || bound >= whole_bytes {
        return Err(format!(
            "{name}: peak {peak} bytes while building, bound {bound} (shards {mine}, largest \
             {largest}), whole model {whole_bytes}"
        )
        .into());
    }
    for ((n, shard), (wn, w)) in m
        .named_parameters()
        .into_iter()
        .zip(whole.named_parameters())
    {
        if n != wn || shard.device() != Device::Cpu {
            return Err(format!("{name}: {n} on {} against {wn}", shard.device()).into());
        }
        if gathered_in(&shard, None)? != w.to_vec_f64()? {
            return Err(format!("{name}: {n} is not the whole model's {wn}").into());
        }
    }
    // the materialised model gathers and computes: the whole batch's loss on every rank
    let (x, y) = rows(c, 0, crate::fsdp::BATCH)?;
    let got = loss(c, m.as_ref(), &x, &y)?.to_vec_f64()?;
    let want = loss(c, whole.as_ref(), &x, &y)?.to_vec_f64()?;
    check_close(
        &format!("{name}: loss"),
        &got,
        &want,
        crate::fsdp::tol(c.dtype),
    )?;
    drop(handles);
    Ok(())
}

/// Built on the meta device, sharded, allocated and reset: the shards are the whole model's
/// rows, and the rank never held more than its shards.
#[test]
fn deferred_initialisation_gives_each_rank_the_whole_models_rows() {
    for world in [2, 3] {
        cpu_world(world, TIMEOUT, move |rank| -> TestResult {
            for c in &CASES {
                check(c, rank, world)?;
            }
            Ok(())
        });
    }
}
