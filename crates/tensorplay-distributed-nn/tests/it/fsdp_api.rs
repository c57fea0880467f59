//! The rest of PyTorch's `FSDPModule` surface, across real processes (world 2), each against
//! the single-process run of the whole batch: `unshard(async_op=True)`, explicit forward
//! prefetching, `set_is_last_backward` with gradients synchronised every micro-batch,
//! `ignored_params`, and a method other than `forward` run as the forward
//! (`register_fsdp_forward_method`).

use tensorplay_core::nn::Module;
use tensorplay_core::optim::Optimizer;
use tensorplay_core::{self as tp, Tensor};
use tensorplay_distributed_nn::parallel::fsdp::{FsdpEvent, FsdpOptions, fully_shard};
use tensorplay_testkit::{check_close, cpu_world};

use super::fsdp::{BATCH, CASES, TIMEOUT, TestResult, build, gathered, loss, rows, tol, wrap};

/// The MLP of `fsdp::CASES[0]` (float64; layers 0, 2 and 4 each a group, then the root).
const C: super::fsdp::Case = CASES[0];

/// Every parameter's gradient (shards gathered) against the reference's.
fn same_grads(what: &str, m: &dyn Module, r: &dyn Module) -> TestResult {
    for ((n, s), (_, q)) in m.named_parameters().iter().zip(r.named_parameters()) {
        let g = s.grad().ok_or_else(|| format!("{what}: no grad of {n}"))?;
        let h = q
            .grad()
            .ok_or_else(|| format!("{what}: no reference grad of {n}"))?;
        check_close(
            &format!("{what}: grad of {n}"),
            &gathered(&g)?,
            &h.to_vec_f64()?,
            tol(C.dtype),
        )?;
    }
    Ok(())
}

/// The rank's rows of micro-batch `k` and the whole micro-batch.
fn micro(rank: usize, k: usize) -> tp::Result<((Tensor, Tensor), (Tensor, Tensor))> {
    let per = BATCH / 2;
    Ok((
        rows(&C, k * BATCH + rank * per, per)?,
        rows(&C, k * BATCH, BATCH)?,
    ))
}

/// `unshard_async`: the handle's wait fills the parameters; a forward right after an
/// unwaited one uses the gather in flight; values equal one process.
fn unshard_async(rank: usize) -> TestResult {
    let mut m = build(&C, false)?;
    let handles = wrap(&C, m.as_mut())?;
    let reference = build(&C, false)?;
    let first = &handles[0];
    first.unshard_async()?.wait()?;
    if !first.is_unsharded() {
        return Err("wait() left the group sharded".into());
    }
    first.reshard()?;
    let _in_flight = first.unshard_async()?;
    let ((x, y), (xa, ya)) = micro(rank, 0)?;
    loss(&C, m.as_ref(), &x, &y)?.backward()?;
    loss(&C, reference.as_ref(), &xa, &ya)?.backward()?;
    same_grads("after unshard_async", m.as_ref(), reference.as_ref())
}

/// `set_modules_to_forward_prefetch`: layer 0's hook issues the all-gathers of layers 2 and 4
/// before its forward ends; an empty list prefetches nothing (layer 2's gather comes after
/// layer 0's forward ends); gradients stay those of one process.
fn explicit_prefetch(rank: usize) -> TestResult {
    for explicit in [true, false] {
        let what = if explicit { "two groups" } else { "none" };
        let mut m = build(&C, false)?;
        let h = wrap(&C, m.as_mut())?;
        let reference = build(&C, false)?;
        let list = if explicit { vec![&h[1], &h[2]] } else { vec![] };
        h[0].set_modules_to_forward_prefetch(&list)?;
        h[0].set_modules_to_backward_prefetch(&[])?;
        for step in 0..2 {
            for g in &h {
                g.take_events();
            }
            let ((x, y), (xa, ya)) = micro(rank, step)?;
            m.zero_grad()?;
            reference.zero_grad()?;
            loss(&C, m.as_ref(), &x, &y)?.backward()?;
            loss(&C, reference.as_ref(), &xa, &ya)?.backward()?;
            same_grads(
                &format!("{what}, step {step}"),
                m.as_ref(),
                reference.as_ref(),
            )?;
        }
        // the second step's events (the first learns the implicit order)
        let h0 = h[0].take_events();
        let end0 = h0
            .iter()
            .find(|(_, e)| *e == FsdpEvent::ForwardEnd)
            .map(|(n, _)| *n)
            .ok_or("no forward end of layer 0")?;
        for (k, g) in [(2, &h[1]), (4, &h[2])] {
            let gather = g
                .take_events()
                .iter()
                .find(|(_, e)| *e == FsdpEvent::AllGather)
                .map(|(n, _)| *n)
                .ok_or("no all-gather")?;
            let early = gather < end0;
            // without a list, layer 4 is never gathered early (layer 2 would prefetch it
            // implicitly, but only once its own forward starts, after layer 0's ended)
            if early != explicit {
                return Err(format!(
                    "{what}: layer {k}'s all-gather at {gather}, layer 0's forward ended at {end0}"
                )
                .into());
            }
        }
    }
    Ok(())
}

/// `set_is_last_backward(false)` on all micro-batches but the last, gradients synchronised
/// every time: the shards' `.grad` after the last equals the single-process sum.
fn last_backward(rank: usize) -> TestResult {
    const MICRO: usize = 3;
    let mut m = build(&C, false)?;
    let handles = wrap(&C, m.as_mut())?;
    let root = handles.last().ok_or("no root")?;
    let reference = build(&C, false)?;
    for k in 0..MICRO {
        root.set_is_last_backward(k + 1 == MICRO);
        let ((x, y), (xa, ya)) = micro(rank, k)?;
        loss(&C, m.as_ref(), &x, &y)?.backward()?;
        loss(&C, reference.as_ref(), &xa, &ya)?.backward()?;
    }
    same_grads("after 3 micro-batches", m.as_ref(), reference.as_ref())
}

/// `set_is_last_backward(false)` on the last micro-batch, then a step: the step is refused
/// on every rank, naming the cause, before anything changes (it would skip the shards whose
/// gradients are still in flight); after a backward marked last it goes through.
fn step_before_last_backward(rank: usize) -> TestResult {
    let mut m = build(&C, false)?;
    let handles = wrap(&C, m.as_mut())?;
    let root = handles.last().ok_or("no root")?;
    let mut opt = tp::optim::SGD::new(m.parameters(), Default::default())?;
    root.set_is_last_backward(false);
    let ((x, y), _) = micro(rank, 0)?;
    loss(&C, m.as_ref(), &x, &y)?.backward()?;
    let before: Vec<Vec<f64>> = m
        .parameters()
        .iter()
        .map(|p| p.to_vec_f64())
        .collect::<tp::Result<_>>()?;
    match opt.step() {
        Err(e) if format!("{e}").contains("set_is_last_backward(true)") => {}
        other => return Err(format!("a step with a reduce-scatter in flight: {other:?}").into()),
    }
    for (p, b) in m.parameters().iter().zip(before) {
        if p.to_vec_f64()? != b {
            return Err("the refused step changed a parameter".into());
        }
    }
    // the next backward, marked last, completes the gradients and a step goes through
    root.set_is_last_backward(true);
    loss(&C, m.as_ref(), &x, &y)?.backward()?;
    opt.step()?;
    Ok(())
}

/// Prefetch lists that differ between ranks are refused on every rank (all-gathers issued
/// in different orders would pair different groups' shards).
fn prefetch_lists_differ(rank: usize) -> TestResult {
    let mut m = build(&C, false)?;
    let h = wrap(&C, m.as_mut())?;
    let list = if rank == 0 { vec![&h[2]] } else { vec![&h[1]] };
    match h[0].set_modules_to_forward_prefetch(&list) {
        Err(e)
            if format!("{e}").contains("prefetch list") && format!("{e}").contains("rank 1's") =>
        {
            Ok(())
        }
        other => Err(format!("different lists: {other:?}").into()),
    }
}

/// `ignored_params` naming a tensor that is not the module's is refused.
fn ignored_not_in_module(_rank: usize) -> TestResult {
    let mut m = build(&C, false)?;
    let stranger = Tensor::zeros(&[3], C.dtype)?;
    let res = fully_shard(
        m.as_mut(),
        FsdpOptions {
            ignored_params: vec![stranger],
            ..Default::default()
        },
    );
    match res {
        Err(e) if format!("{e}").contains("ignored_params[0]") => Ok(()),
        other => Err(format!("a stranger ignored: {other:?}").into()),
    }
}

/// `ignored_params`: the last layer's bias stays whole and local (its gradient is this rank's
/// rows' alone, unsynchronised); every other parameter is sharded and averaged.
fn ignored(rank: usize) -> TestResult {
    let mut m = build(&C, false)?;
    let bias = m
        .named_parameters()
        .into_iter()
        .find(|(n, _)| n == "4.bias")
        .ok_or("no 4.bias")?
        .1;
    fully_shard(
        m.as_mut(),
        FsdpOptions {
            ignored_params: vec![bias.clone()],
            ..Default::default()
        },
    )?;
    let listed = m
        .named_parameters()
        .into_iter()
        .find(|(n, _)| n == "4.bias")
        .ok_or("4.bias not listed")?
        .1;
    if listed.id() != bias.id() {
        return Err("the ignored bias is not listed as itself".into());
    }
    let reference = build(&C, false)?;
    let local = build(&C, false)?;
    let ((x, y), (xa, ya)) = micro(rank, 0)?;
    loss(&C, m.as_ref(), &x, &y)?.backward()?;
    loss(&C, reference.as_ref(), &xa, &ya)?.backward()?;
    loss(&C, local.as_ref(), &x, &y)?.backward()?;
    for ((n, s), ((_, q), (_, l))) in m.named_parameters().iter().zip(
        reference
            .named_parameters()
            .iter()
            .zip(local.named_parameters()),
    ) {
        let g = s.grad().ok_or_else(|| format!("no grad of {n}"))?;
        let (got, want) = if n == "4.bias" {
            (
                g.to_vec_f64()?,
                l.grad().ok_or("no local grad")?.to_vec_f64()?,
            )
        } else {
            (
                gathered(&g)?,
                q.grad().ok_or("no reference grad")?.to_vec_f64()?,
            )
        };
        check_close(&format!("grad of {n}"), &got, &want, tol(C.dtype))?;
    }
    Ok(())
}

/// `forward_method`: with the root wrapped alone, a method that calls the first layer itself
/// fails clearly outside it (the weights are freed) and equals one process inside it,
/// backward included.
fn forward_method(rank: usize) -> TestResult {
    let mut m = build(&C, false)?;
    let root = fully_shard(m.as_mut(), FsdpOptions::default())?;
    let reference = build(&C, false)?;
    let first_layer = |m: &dyn Module, x: &Tensor| -> tp::Result<Tensor> {
        let children = m.named_children();
        children[0].1.call(x)?.pow_scalar(2.0)?.mean()
    };
    let ((x, _), (xa, _)) = micro(rank, 0)?;
    match first_layer(m.as_ref(), &x) {
        Err(e) if format!("{e}").contains("freed") => {}
        other => return Err(format!("outside forward_method: {other:?}").into()),
    }
    root.forward_method(|| first_layer(m.as_ref(), &x))?
        .backward()?;
    first_layer(reference.as_ref(), &xa)?.backward()?;
    for ((n, s), (_, q)) in m
        .named_parameters()
        .iter()
        .zip(reference.named_parameters())
    {
        let g = gathered(&s.grad().ok_or_else(|| format!("no grad of {n}"))?)?;
        let want = match q.grad() {
            Some(h) => h.to_vec_f64()?,
            None => vec![0.0; g.len()], // layers the method did not use: zeros
        };
        check_close(
            &format!("forward_method: grad of {n}"),
            &g,
            &want,
            tol(C.dtype),
        )?;
    }
    if root.is_unsharded() {
        return Err("the root stayed gathered after backward".into());
    }
    Ok(())
}

#[test]
fn fsdp_module_methods_match_one_process() {
    type Case = (&'static str, fn(usize) -> TestResult);
    let cases: [Case; 8] = [
        ("unshard_async", unshard_async),
        ("set_modules_to_forward_prefetch", explicit_prefetch),
        ("set_is_last_backward", last_backward),
        ("ignored_params", ignored),
        ("forward_method", forward_method),
        ("a step before the last backward", step_before_last_backward),
        ("prefetch lists that differ", prefetch_lists_differ),
        ("ignored_params not in the module", ignored_not_in_module),
    ];
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        let check = |(name, f): Case| f(rank).map_err(|e| format!("{name}: {e}"));
        for c in cases {
            check(c)?;
        }
        Ok(())
    });
}
