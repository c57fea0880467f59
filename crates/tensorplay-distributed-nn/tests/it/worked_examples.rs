//! The worked examples of the reference research on `torch.distributed.nn.functional`
//! (section 3, "Bug reports, issues and PRs ... with test specifications"; appendix A; the
//! measured examples of section 1.3), run against `tensorplay_distributed_nn::functional` and the
//! blocking collectives under it, in real processes over the "cpu" backend.
//!
//! Every test spawns one world (of the largest world size it needs); smaller worlds of the
//! same example run on subgroups `{0, .., w-1}` of it. Values are the reference's, except where
//! our documented semantics deliberately differ from PyTorch's (said at each place):
//! - `reduce` returns zeros on the ranks other than `dst` (PyTorch: backend-dependent partial
//!   results, pytorch/pytorch#76527);
//! - the backward of `Avg`, `Max`, `Min` and `Product` is the true adjoint (PyTorch re-applies
//!   the forward op, or ignores the op, in backward).
//!
//! Loss convention (as in the reference): unless stated, `loss_r = (r + 1) · Σ y_r`, so the
//! upstream gradient on rank `r` is `r + 1` everywhere, and a gradient value shows which ranks'
//! upstream gradients were combined. Every rank calls `backward` on its own loss; the gradient on
//! rank `r` is `d(Σ_k loss_k)/dx_r`.

use std::time::{Duration, Instant};
use tensorplay_testkit::cpu_world;

use tensorplay_collectives::{self as dist, ProcessGroup, ReduceOp};
use tensorplay_core::{DType, Tensor};
use tensorplay_distributed_nn::functional as df;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;
type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;
/// A bad `all_to_all_single` call: what, `input_split_sizes`, what the error must mention.
type SplitCase<'a> = (&'a str, Option<&'a [usize]>, &'a [&'a str]);

/// Timeout of every group: long enough for a loaded machine, short enough that a hang fails.
const TIMEOUT: Duration = Duration::from_secs(30);

const DIFF_OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Product,
];

/// Runs `f` on every rank of a world of `n` processes ([`cpu_world`]).
fn world(n: usize, f: impl Fn(usize) -> TestResult) {
    cpu_world(n, TIMEOUT, f);
}

/// `new_group(ranks)` (every rank of the world calls it); `Some` on members only.
fn group(rank: usize, ranks: &[usize]) -> R<Option<ProcessGroup>> {
    let g = dist::new_group(ranks, None, Some(TIMEOUT))?;
    Ok(ranks.contains(&rank).then_some(g))
}

fn t64(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).expect("tensor")
}

fn leaf(v: &[f64], shape: &[usize]) -> Tensor {
    t64(v, shape).requires_grad_(true)
}

/// `n` copies of `v`.
fn full(n: usize, v: f64) -> Vec<f64> {
    vec![v; n]
}

/// `[start, start + 1, ..]`, `n` values.
fn arange(n: usize, start: f64) -> Vec<f64> {
    (0..n).map(|i| start + i as f64).collect()
}

fn vals(t: &Tensor) -> R<Vec<f64>> {
    Ok(t.to_vec_f64()?)
}

fn grad(t: &Tensor) -> R<Vec<f64>> {
    Ok(t.grad().ok_or("no gradient")?.to_vec_f64()?)
}

/// `w · Σ y`.
fn wsum(y: &Tensor, w: f64) -> R<Tensor> {
    Ok(y.mul_scalar(w)?.sum()?)
}

/// `Σ y ⊙ w` (elementwise weights, logical order).
fn dot(y: &Tensor, w: &[f64]) -> R<Tensor> {
    Ok(y.mul(&t64(w, y.shape()))?.sum()?)
}

/// Equal (NaN equals NaN), up to a relative 1e-12 for the values that are not integers.
fn close(what: &str, got: &[f64], want: &[f64]) -> TestResult {
    Ok(tensorplay_testkit::check_close(
        what,
        got,
        want,
        tensorplay_testkit::Tol::scaled(1e-12),
    )?)
}

/// Every element of a list of tensors, in order.
fn flat(ts: &[Tensor]) -> R<Vec<f64>> {
    let mut v = Vec::new();
    for t in ts {
        v.extend(vals(t)?);
    }
    Ok(v)
}

/// `Σ_i Σ ys[i] · w(i)`.
fn list_loss(ys: &[Tensor], w: impl Fn(usize) -> f64) -> R<Tensor> {
    let mut acc: Option<Tensor> = None;
    for (i, y) in ys.iter().enumerate() {
        let term = wsum(y, w(i))?;
        acc = Some(match acc {
            Some(a) => a.add(&term)?,
            None => term,
        });
    }
    Ok(acc.ok_or("empty list")?)
}

/// The error of a call that must fail, as text.
fn must_fail<T>(what: &str, res: tensorplay_core::Result<T>) -> R<String> {
    match res {
        Ok(_) => Err(format!("{what}: expected an error, got a result").into()),
        Err(e) => Ok(e.to_string()),
    }
}

fn must_fail_coll<T>(what: &str, res: dist::Result<T>) -> R<String> {
    match res {
        Ok(_) => Err(format!("{what}: expected an error, got a result").into()),
        Err(e) => Ok(e.to_string()),
    }
}

fn contains_all(what: &str, msg: &str, parts: &[&str]) -> TestResult {
    for p in parts {
        if !msg.contains(p) {
            return Err(format!("{what}: error {msg:?} does not mention {p:?}").into());
        }
    }
    Ok(())
}

/// Bit patterns of a tensor's elements.
fn bits(t: &Tensor) -> R<Vec<u64>> {
    Ok(tensorplay_testkit::element_bits(t)?)
}

/// One section of a worked example, run on every rank of its world.
struct Case {
    /// What it checks; a failure names it.
    name: &'static str,
    /// The section, given this rank.
    run: fn(usize) -> TestResult,
}

/// Runs `case` on this rank; its error names it.
fn check(case: &Case, rank: usize) -> TestResult {
    (case.run)(rank).map_err(|e| format!("case {:?}: {e}", case.name).into())
}

/// Issue #192920's (3,2) base on rank `r`: `[[10r+1, 100+r], [10r+2, 200+r], [10r+3, 300+r]]`;
/// column 0 is the view, column 1 the neighbouring memory that must survive.
fn column_base(r: f64) -> Tensor {
    t64(
        &[
            10.0 * r + 1.0,
            100.0 + r,
            10.0 * r + 2.0,
            200.0 + r,
            10.0 * r + 3.0,
            300.0 + r,
        ],
        &[3, 2],
    )
}

/// The logical (2,3) row-major `v` stored as the transpose of a (3,2), viewed as (2,3).
fn transposed(v: &[f64]) -> R<Tensor> {
    let s = [v[0], v[3], v[1], v[4], v[2], v[5]];
    Ok(t64(&s, &[3, 2]).t()?)
}

// ---------------------------------------------------------------------------------------------
// section 3: issues

/// pytorch/pytorch#58005: `all_reduce`'s gradient is `W` times "the" gradient when every rank
/// computes the same loss — by the per-rank-loss convention (kept by the maintainers, and ours).
#[test]
fn issue_58005_all_reduce_gradient_scale() {
    world(3, |rank| {
        let r = rank as f64;
        // W = 2 (subgroup {0, 1} of the world of 3)
        if let Some(g) = group(rank, &[0, 1])? {
            let x = leaf(&[r + 1.0], &[1]);
            let y = df::all_reduce(&x, ReduceOp::Sum, Some(&g))?;
            close("W=2 y", &vals(&y)?, &[3.0])?;
            y.sum()?.backward()?;
            close("W=2 dx, loss Σy", &grad(&x)?, &[2.0])?;

            let x = leaf(&[r + 1.0], &[1]);
            let y = df::all_reduce(&x, ReduceOp::Sum, Some(&g))?;
            wsum(&y, r + 1.0)?.backward()?;
            close("W=2 dx, loss (r+1)y", &grad(&x)?, &[3.0])?;
        }
        // W = 3
        let x = leaf(&[r + 1.0], &[1]);
        let y = df::all_reduce(&x, ReduceOp::Sum, None)?;
        close("W=3 y", &vals(&y)?, &[6.0])?;
        wsum(&y, r + 1.0)?.backward()?;
        close("W=3 dx, loss (r+1)y", &grad(&x)?, &[6.0])?;
        Ok(())
    });
}

/// pytorch/pytorch#73515: `loss = cat(all_gather(x)).sum()` gives an expanded (stride-0)
/// upstream gradient; the backward must accept it.
#[test]
fn issue_73515_all_gather_expanded_gradient() {
    world(2, |rank| {
        let r = rank as f64;
        let x = leaf(&full(4, r + 1.0), &[4]);
        let ys = df::all_gather(&x, None)?;
        close(
            "all_gather y",
            &flat(&ys)?,
            &[1., 1., 1., 1., 2., 2., 2., 2.],
        )?;
        Tensor::cat(&ys, 0)?.sum()?.backward()?;
        close("all_gather dx", &grad(&x)?, &full(4, 2.0))?;

        // reduce_scatter of [full(2, r + i)]: y_r = Σ_k (k + r) = 1 + 2r; loss y.sum()
        let xs: Vec<Tensor> = (0..2).map(|i| leaf(&full(2, r + i as f64), &[2])).collect();
        let y = df::reduce_scatter(&xs, ReduceOp::Sum, None)?;
        close("reduce_scatter y", &vals(&y)?, &full(2, 1.0 + 2.0 * r))?;
        y.sum()?.backward()?;
        for (i, x) in xs.iter().enumerate() {
            close(&format!("reduce_scatter dx[{i}]"), &grad(x)?, &full(2, 1.0))?;
        }
        Ok(())
    });
}

/// pytorch/pytorch#130515: `src` is a global rank; on subgroups whose group ranks differ from
/// the global ranks, the source must still receive its gradient.
#[test]
fn issue_130515_broadcast_subgroup_global_src() {
    world(4, |rank| {
        let r = rank as f64;
        let g1 = group(rank, &[1])?;
        let g123 = group(rank, &[1, 2, 3])?;
        // group {1}: global 1 broadcasts ones(3) from src = 1 -> dx = 1 (PyTorch < 2.15: 0)
        if let Some(g) = &g1 {
            let x = leaf(&full(3, 1.0), &[3]);
            let y = df::broadcast(&x, 1, Some(g))?;
            close("group {1} y", &vals(&y)?, &full(3, 1.0))?;
            y.sum()?.backward()?;
            close("group {1} dx", &grad(&x)?, &full(3, 1.0))?;
        }
        if let Some(g) = &g123 {
            // group {1,2,3}, src = global 2, x_r = [r+1], loss (r+1)y: y = 3 on the members,
            // dx = 0, 9 (= 2 + 3 + 4), 0 on global 1, 2, 3 [measured 2.15]
            let x = leaf(&[r + 1.0], &[1]);
            let y = df::broadcast(&x, 2, Some(g))?;
            close("group {1,2,3} y", &vals(&y)?, &[3.0])?;
            wsum(&y, r + 1.0)?.backward()?;
            let want = if rank == 2 { 9.0 } else { 0.0 };
            close("group {1,2,3} dx", &grad(&x)?, &[want])?;

            // the same rank namespace for reduce: dst = global 3 gets 2 + 3 + 4 = 9, the others
            // zeros (ours); dx = g_dst = 4 on every member
            let x = leaf(&[r + 1.0], &[1]);
            let y = df::reduce(&x, 3, ReduceOp::Sum, Some(g))?;
            let want = if rank == 3 { 9.0 } else { 0.0 };
            close("group {1,2,3} reduce y", &vals(&y)?, &[want])?;
            wsum(&y, r + 1.0)?.backward()?;
            close("group {1,2,3} reduce dx", &grad(&x)?, &[4.0])?;
        }
        Ok(())
    });
}

/// pytorch/pytorch#82851: scatter and gather inside group {2, 3} with a global `src`/`dst`
/// (PyTorch 2.15 still raises there).
#[test]
fn issue_82851_scatter_gather_subgroup() {
    world(4, |rank| {
        let r = rank as f64;
        let Some(g) = group(rank, &[2, 3])? else {
            return Ok(());
        };
        // scatter from global 2; the receiver passes None
        let list = (rank == 2).then(|| vec![leaf(&[20.0], &[1]), leaf(&[21.0], &[1])]);
        let y = df::scatter(list.as_deref(), 2, Some(&g))?;
        close(
            "scatter y",
            &vals(&y)?,
            &[if rank == 2 { 20.0 } else { 21.0 }],
        )?;
        wsum(&y, r + 1.0)?.backward()?;
        if let Some(l) = &list {
            // element i's gradient is member i's upstream gradient: 3 (global 2), 4 (global 3)
            close("scatter dxs[0]", &grad(&l[0])?, &[3.0])?;
            close("scatter dxs[1]", &grad(&l[1])?, &[4.0])?;
        }

        // the receiver passes placeholders instead: they get zero gradients
        let list = if rank == 2 {
            vec![leaf(&[20.0], &[1]), leaf(&[21.0], &[1])]
        } else {
            vec![leaf(&[0.0], &[1]), leaf(&[0.0], &[1])]
        };
        let y = df::scatter(Some(&list), 2, Some(&g))?;
        close("scatter y (placeholders)", &vals(&y)?, &[20.0 + r - 2.0])?;
        wsum(&y, r + 1.0)?.backward()?;
        let want: [[f64; 1]; 2] = if rank == 2 {
            [[3.0], [4.0]]
        } else {
            [[0.0], [0.0]]
        };
        close("scatter dxs[0] (placeholders)", &grad(&list[0])?, &want[0])?;
        close("scatter dxs[1] (placeholders)", &grad(&list[1])?, &want[1])?;

        // gather to global 3: x_r = r + 1; loss_r = Σ_i (i+1)·y[i] -> dx = g_dst[group rank]
        let x = leaf(&[r + 1.0], &[1]);
        let ys = df::gather(&x, 3, Some(&g))?;
        let want = if rank == 3 { [3.0, 4.0] } else { [0.0, 0.0] };
        close("gather y", &flat(&ys)?, &want)?;
        list_loss(&ys, |i| i as f64 + 1.0)?.backward()?;
        close("gather dx", &grad(&x)?, &[r - 1.0])?;
        Ok(())
    });
}

/// pytorch/pytorch#121587: the blocking collective is not differentiable, so it refuses a
/// tensor that requires grad (pointing at `nn::functional`) instead of acting as the identity in
/// backward; the functional version gives `dx = 2·W = 6` for `W = 3`, `y = 2x`.
#[test]
fn issue_121587_blocking_all_reduce_in_graph() {
    world(3, |rank| {
        let r = rank as f64;
        let x = leaf(&[r + 1.0], &[1]);
        let y = x.mul_scalar(2.0)?;
        let msg = must_fail(
            "blocking all_reduce of a tensor that requires grad",
            dist::all_reduce(&y, ReduceOp::Sum, None).map_err(Into::into),
        )?;
        contains_all("blocking all_reduce", &msg, &["nn::functional"])?;
        close(
            "y untouched by the refused call",
            &vals(&y)?,
            &[2.0 * (r + 1.0)],
        )?;

        let z = df::all_reduce(&y, ReduceOp::Sum, None)?;
        close("z", &vals(&z)?, &[12.0])?;
        z.sum()?.backward()?;
        close("dx", &grad(&x)?, &[6.0])?;
        Ok(())
    });
}

/// pytorch/pytorch#190007: `all_reduce` with `Avg` must have a backward (the mean of the
/// upstream gradients).
#[test]
fn issue_190007_all_reduce_avg_backward() {
    world(3, |rank| {
        let r = rank as f64;
        if let Some(g) = group(rank, &[0, 1])? {
            let x = leaf(&[r + 1.0], &[1]);
            let y = df::all_reduce(&x, ReduceOp::Avg, Some(&g))?;
            close("W=2 y", &vals(&y)?, &[1.5])?;
            y.sum()?.backward()?;
            close("W=2 dx, loss Σy", &grad(&x)?, &[1.0])?;

            let x = leaf(&[r + 1.0], &[1]);
            let y = df::all_reduce(&x, ReduceOp::Avg, Some(&g))?;
            wsum(&y, r + 1.0)?.backward()?;
            close("W=2 dx, loss (r+1)y", &grad(&x)?, &[1.5])?;
        }
        let x = leaf(&[r + 1.0], &[1]);
        let y = df::all_reduce(&x, ReduceOp::Avg, None)?;
        close("W=3 y", &vals(&y)?, &[2.0])?;
        wsum(&y, r + 1.0)?.backward()?;
        close("W=3 dx, loss (r+1)y", &grad(&x)?, &[2.0])?;
        Ok(())
    });
}

/// pytorch/pytorch#76527: the blocking `reduce` leaves the other ranks' buffers bit-identical
/// (gloo leaves half-reduced data there); `functional::reduce` returns zeros there (our
/// documented choice; PyTorch: backend-dependent), and its backward is `dx = g_dst` on every
/// rank.
#[test]
fn issue_76527_reduce_non_dst_untouched() {
    world(2, |rank| {
        let r = rank as f64;
        let input: [f64; 4] = if rank == 0 {
            [1.0, 2.0, 3.0, 4.0]
        } else {
            [4.0, 5.0, 6.0, 7.0]
        };
        // the issue's case: SUM to 0
        let t = t64(&input, &[2, 2]);
        dist::reduce(&t, 0, ReduceOp::Sum, None)?;
        if rank == 0 {
            close("dst", &vals(&t)?, &[5.0, 7.0, 9.0, 11.0])?;
        } else if bits(&t)? != bits(&t64(&input, &[2, 2]))? {
            return Err(format!("non-dst buffer changed: {:?}", vals(&t)?).into());
        }
        // every op, both roots, float64 and float32, values whose bits are easy to disturb
        // (-0.0, a subnormal, a NaN, a non-representable decimal)
        let odd = [0.1 * (r + 1.0), -0.0, 1e-310 * (r + 1.0), f64::NAN, 3.0 - r];
        for dt in [DType::F64, DType::F32] {
            for op in DIFF_OPS {
                for dst in 0..2 {
                    let t = t64(&odd, &[5]).to_dtype(dt)?;
                    let before = bits(&t)?;
                    dist::reduce(&t, dst, op, None)?;
                    if rank != dst && bits(&t)? != before {
                        return Err(format!(
                            "{dt} {op:?} dst {dst}: non-dst buffer changed to {:?}",
                            vals(&t)?
                        )
                        .into());
                    }
                }
            }
        }

        // functional: non-dst gets zeros; dx = g_dst everywhere (loss_r = Σ y ⊙ w_r,
        // w_r = [1, 2, 3, 4] + 10r); the input is not written
        for dst in 0..2 {
            let x = leaf(&input, &[2, 2]);
            let y = df::reduce(&x, dst, ReduceOp::Sum, None)?;
            let want = if rank == dst {
                vec![5.0, 7.0, 9.0, 11.0]
            } else {
                vec![0.0; 4]
            };
            close(&format!("functional reduce to {dst}: y"), &vals(&y)?, &want)?;
            close("functional reduce: input untouched", &vals(&x)?, &input)?;
            dot(&y, &arange(4, 1.0 + 10.0 * r))?.backward()?;
            let g_dst = arange(4, 1.0 + 10.0 * dst as f64);
            close(
                &format!("functional reduce to {dst}: dx"),
                &grad(&x)?,
                &g_dst,
            )?;
        }
        Ok(())
    });
}

/// pytorch/pytorch#162338: AVG reduce-scatter on the CPU backend must average (gloo summed).
/// Forward values with the blocking `reduce_scatter_tensor`; the `Avg`/`Max` gradients with
/// `functional::reduce_scatter` (true adjoints: PyTorch gives `i + 1` for every op).
#[test]
fn issue_162338_reduce_scatter_avg() {
    world(3, |rank| {
        let r = rank as f64;
        // x_r = arange(6) + 100r, output block r = elements 2r, 2r+1
        let x = arange(6, 100.0 * r);
        let cases = [
            (ReduceOp::Avg, [100.0 + 2.0 * r, 101.0 + 2.0 * r]),
            (ReduceOp::Sum, [300.0 + 6.0 * r, 303.0 + 6.0 * r]),
            (ReduceOp::Max, [200.0 + 2.0 * r, 201.0 + 2.0 * r]),
            (ReduceOp::Min, [2.0 * r, 2.0 * r + 1.0]),
        ];
        for dt in [DType::F64, DType::F32] {
            for (op, want) in cases {
                let out = Tensor::zeros(&[2], dt)?;
                dist::reduce_scatter_tensor(&out, &t64(&x, &[6]).to_dtype(dt)?, op, None)?;
                close(&format!("blocking {op:?} {dt}"), &vals(&out)?, &want)?;
            }
        }
        // functional: list element i = x_r[2i..2i+2]; loss (r+1)·Σy
        let grads_for = |op: ReduceOp| -> R<(Vec<f64>, Vec<Vec<f64>>)> {
            let xs: Vec<Tensor> = (0..3).map(|i| leaf(&x[2 * i..2 * i + 2], &[2])).collect();
            let y = df::reduce_scatter(&xs, op, None)?;
            wsum(&y, r + 1.0)?.backward()?;
            Ok((vals(&y)?, xs.iter().map(grad).collect::<R<Vec<_>>>()?))
        };
        let (y, g) = grads_for(ReduceOp::Avg)?;
        close("functional Avg y", &y, &cases[0].1)?;
        for (i, gi) in g.iter().enumerate() {
            // (i + 1) / W on every rank
            close(
                &format!("Avg dxs[{i}]"),
                gi,
                &full(2, (i as f64 + 1.0) / 3.0),
            )?;
        }
        let (y, g) = grads_for(ReduceOp::Max)?;
        close("functional Max y", &y, &cases[2].1)?;
        for (i, gi) in g.iter().enumerate() {
            // rank 2 holds every maximum
            let want = if rank == 2 { i as f64 + 1.0 } else { 0.0 };
            close(&format!("Max dxs[{i}]"), gi, &full(2, want))?;
        }
        // ops that do not apply to the dtype error (on every rank), never fall back
        let xs: Vec<Tensor> = (0..3).map(|i| t64(&x[2 * i..2 * i + 2], &[2])).collect();
        must_fail(
            "functional reduce_scatter BAnd on float64",
            df::reduce_scatter(&xs, ReduceOp::BAnd, None),
        )?;
        let xi = t64(&x, &[6]).to_dtype(DType::I64)?;
        must_fail_coll(
            "blocking reduce_scatter_tensor Avg on int64",
            dist::reduce_scatter_tensor(
                &Tensor::zeros(&[2], DType::I64)?,
                &xi,
                ReduceOp::Avg,
                None,
            ),
        )?;
        // still in step
        let y = df::all_reduce(&t64(&[1.0], &[1]), ReduceOp::Sum, None)?;
        close("after the errors", &vals(&y)?, &[3.0])?;
        Ok(())
    });
}

/// pytorch/pytorch#144045 / #168092 (NCCL one-rank AVG left the last 8 elements at 0): with one
/// rank every function and op is the identity, forward and backward, bit for bit. Sizes 1, 7,
/// 8, 9, 10, 4097; float32 and float64 (the core has no bf16/f16).
#[test]
fn issue_144045_world_size_1_identity() {
    world(1, |_rank| {
        for dt in [DType::F32, DType::F64] {
            for n in [1usize, 7, 8, 9, 10, 4097] {
                // non-integer values and upstream gradients
                let xv: Vec<f64> = (0..n)
                    .map(|i| ((i * 7919) % 1000) as f64 / 37.0 - 13.1)
                    .collect();
                let wv: Vec<f64> = (0..n)
                    .map(|i| ((i * 104_729) % 997) as f64 / 19.0 - 20.3)
                    .collect();
                let mk = || -> R<Tensor> { Ok(t64(&xv, &[n]).to_dtype(dt)?.requires_grad_(true)) };
                let w = t64(&wv, &[n]).to_dtype(dt)?;
                let (x_bits, w_bits) = (bits(&mk()?)?, bits(&w)?);
                let check = |what: &str, x: &Tensor, y: &Tensor| -> TestResult {
                    let what = format!("{what} {dt} n={n}");
                    if bits(y)? != x_bits {
                        return Err(format!("{what}: output differs from the input").into());
                    }
                    y.mul(&w)?.sum()?.backward()?;
                    let g = x.grad().ok_or_else(|| format!("{what}: no gradient"))?;
                    if bits(&g)? != w_bits {
                        return Err(
                            format!("{what}: gradient differs from the upstream one").into()
                        );
                    }
                    Ok(())
                };
                let x = mk()?;
                check("broadcast", &x, &df::broadcast(&x, 0, None)?)?;
                for op in DIFF_OPS {
                    let x = mk()?;
                    check(&format!("reduce {op:?}"), &x, &df::reduce(&x, 0, op, None)?)?;
                    let x = mk()?;
                    check(
                        &format!("all_reduce {op:?}"),
                        &x,
                        &df::all_reduce(&x, op, None)?,
                    )?;
                    let x = mk()?;
                    let y = df::reduce_scatter(std::slice::from_ref(&x), op, None)?;
                    check(&format!("reduce_scatter {op:?}"), &x, &y)?;
                    // the blocking collective too
                    let t = t64(&xv, &[n]).to_dtype(dt)?;
                    dist::all_reduce(&t, op, None)?;
                    if bits(&t)? != x_bits {
                        return Err(format!("blocking all_reduce {op:?} {dt} n={n}").into());
                    }
                }
                let x = mk()?;
                check("gather", &x, &df::gather(&x, 0, None)?.remove(0))?;
                let x = mk()?;
                check(
                    "scatter",
                    &x,
                    &df::scatter(Some(std::slice::from_ref(&x)), 0, None)?,
                )?;
                let x = mk()?;
                check("all_gather", &x, &df::all_gather(&x, None)?.remove(0))?;
                let x = mk()?;
                check(
                    "all_to_all",
                    &x,
                    &df::all_to_all(std::slice::from_ref(&x), None)?.remove(0),
                )?;
                let x = mk()?;
                check(
                    "all_to_all_single",
                    &x,
                    &df::all_to_all_single(&x, None, None, None)?,
                )?;
                let x = mk()?;
                let y = df::all_to_all_single(&x, Some(&[n]), Some(&[n]), None)?;
                check("all_to_all_single (splits)", &x, &y)?;
            }
        }
        Ok(())
    });
}

/// pytorch/pytorch#177371: uneven `all_to_all_single` (LocalTensorMode crashed); the exact
/// exchange and its backward, with and without `output_split_sizes`.
#[test]
fn issue_177371_uneven_all_to_all_single() {
    world(3, |rank| {
        let r = rank as f64;
        let splits: [[usize; 3]; 3] = [[3, 2, 1], [2, 2, 2], [1, 2, 3]];
        let want_y: [[f64; 6]; 3] = [
            [0., 1., 2., 10., 11., 20.],
            [3., 4., 12., 13., 21., 22.],
            [5., 14., 15., 23., 24., 25.],
        ];
        let want_dx: [[f64; 6]; 3] = [
            [1., 2., 3., 101., 102., 201.],
            [4., 5., 103., 104., 202., 203.],
            [6., 105., 106., 204., 205., 206.],
        ];
        for give_out in [true, false] {
            let x = leaf(&arange(6, 10.0 * r), &[6]);
            // the output splits are the same lists here (out_r[j] = in_j[r] holds)
            let out = give_out.then_some(&splits[rank][..]);
            let y = df::all_to_all_single(&x, out, Some(&splits[rank]), None)?;
            close(
                &format!("y (out splits {give_out})"),
                &vals(&y)?,
                &want_y[rank],
            )?;
            dot(&y, &arange(6, 1.0 + 100.0 * r))?.backward()?;
            close(
                &format!("dx (out splits {give_out})"),
                &grad(&x)?,
                &want_dx[rank],
            )?;
        }
        Ok(())
    });
}

/// pytorch/pytorch#117486 / #101380: split sizes that disagree between ranks are an error on
/// every rank naming the pair (NCCL hangs, gloo returns a never-written slot), within the
/// timeout; and the local split errors.
#[test]
fn issue_117486_mismatched_splits_error() {
    world(2, |rank| {
        // rank 0: 3 rows, sends 2 to itself and 1 to rank 1; rank 1 expects 2 from rank 0
        let (x, ins, outs): (Vec<f64>, [usize; 2], [usize; 2]) = if rank == 0 {
            (vec![0.0, 1.0, 2.0], [2, 1], [2, 2])
        } else {
            (vec![10.0, 11.0, 12.0, 13.0], [2, 2], [2, 2])
        };
        let start = Instant::now();
        let msg = must_fail(
            "mismatched splits",
            df::all_to_all_single(&t64(&x, &[x.len()]), Some(&outs), Some(&ins), None),
        )?;
        contains_all(
            "mismatched splits",
            &msg,
            &["rank 0 sends 1 row(s) to rank 1", "expects 2"],
        )?;
        if start.elapsed() >= TIMEOUT || msg.contains("timed out") {
            return Err(format!("the mismatch was not detected before the timeout: {msg}").into());
        }

        // local errors: rank 0 alone passes bad arguments, both ranks fail, rank 0 with its
        // own reason, rank 1 naming rank 0. Rank 0's input has 5 rows.
        let good = t64(&[1.0, 2.0], &[2]);
        let five = t64(&arange(5, 0.0), &[5]);
        let bad_cases: [SplitCase<'_>; 3] = [
            (
                "splits None, dim 0 = 5",
                None,
                &["divisible by the group size 2", "first dimension 5"],
            ),
            (
                "a split list of length 1",
                Some(&[5]),
                &["input_split_sizes", "2 sizes", "1 sizes [5]"],
            ),
            (
                "splits summing to 4 for 5 rows",
                Some(&[2, 2]),
                &["input_split_sizes", "(5)", "sum 4"],
            ),
        ];
        for (what, splits, parts) in bad_cases {
            let res = if rank == 0 {
                df::all_to_all_single(&five, None, splits, None)
            } else {
                df::all_to_all_single(&good, None, None, None)
            };
            let msg = must_fail(what, res)?;
            if rank == 0 {
                contains_all(what, &msg, parts)?;
            } else {
                contains_all(what, &msg, &["[0]"])?;
            }
        }
        // still in step
        let y = df::all_reduce(&t64(&[1.0], &[1]), ReduceOp::Sum, None)?;
        close("after the errors", &vals(&y)?, &[2.0])?;
        Ok(())
    });
}

/// pytorch/pytorch#156627: `all_gather` of tensors of different shapes (gloo refuses or
/// aborts the process): supported, forward and backward.
#[test]
fn issue_156627_uneven_all_gather() {
    world(2, |rank| {
        let r = rank as f64;
        // x_r = full(r+1, r)
        let x = leaf(&full(rank + 1, r), &[rank + 1]);
        let ys = df::all_gather(&x, None)?;
        if ys[0].shape() != [1] || ys[1].shape() != [2] {
            return Err(format!("shapes {:?} {:?}", ys[0].shape(), ys[1].shape()).into());
        }
        close("y", &flat(&ys)?, &[0.0, 1.0, 1.0])?;
        // loss_r = Σ_i Σ_j y[i][j]·(100r + 10i + j + 1): dx_r[j] = Σ_k (100k + 10r + j + 1)
        let mut loss = dot(&ys[0], &[100.0 * r + 1.0])?;
        loss = loss.add(&dot(&ys[1], &[100.0 * r + 11.0, 100.0 * r + 12.0])?)?;
        loss.backward()?;
        let want: &[f64] = if rank == 0 { &[102.0] } else { &[122.0, 124.0] };
        close("dx", &grad(&x)?, want)?;
        Ok(())
    });
}

/// pytorch/pytorch#192920 (and #159548, #128066, #130251): column views (stride 2),
/// transposes and ranks holding the same logical tensor in different layouts give the
/// contiguous results in logical (row-major) order, and memory next to a view is not touched.
#[test]
fn issue_192920_strided_and_transposed_tensors() {
    world(2, |rank| {
        STRIDED_CASES.iter().try_for_each(|c| check(c, rank))
    });
}

/// pytorch/pytorch#84566: scatter with tensors of different sizes (gloo: "invalid tensor size
/// at index 1"). Our functional scatter allows a shape per rank; the blocking scatter allows it
/// when each receiver's buffer has its tensor's size, and otherwise fails on every rank naming
/// the index and both sizes.
#[test]
fn issue_84566_scatter_unequal_sizes() {
    world(2, |rank| {
        let r = rank as f64;
        let (a, b) = (arange(13, 0.0), arange(6, 100.0));
        // functional: the receiver passes None and learns its shape from src
        let list = (rank == 0).then(|| vec![leaf(&a, &[13]), leaf(&b, &[6])]);
        let y = df::scatter(list.as_deref(), 0, None)?;
        close(
            "functional scatter y",
            &vals(&y)?,
            if rank == 0 { &a } else { &b },
        )?;
        wsum(&y, r + 1.0)?.backward()?;
        if let Some(l) = &list {
            close("functional scatter dxs[0]", &grad(&l[0])?, &full(13, 1.0))?;
            close("functional scatter dxs[1]", &grad(&l[1])?, &full(6, 2.0))?;
        }

        // blocking, each receiver with its own size: works
        let src_list = [t64(&a, &[13]), t64(&b, &[6])];
        let out = Tensor::zeros(&[if rank == 0 { 13 } else { 6 }], DType::F64)?;
        dist::scatter(&out, (rank == 0).then_some(&src_list[..]), 0, None)?;
        close(
            "blocking scatter y",
            &vals(&out)?,
            if rank == 0 { &a } else { &b },
        )?;

        // blocking, every rank's buffer of tensors[0]'s size (PyTorch's pattern): an error on
        // every rank naming index 1 and both sizes; the buffer is not written
        let out = Tensor::zeros(&[13], DType::F64)?;
        let msg = must_fail_coll(
            "blocking scatter, unequal sizes",
            dist::scatter(&out, (rank == 0).then_some(&src_list[..]), 0, None),
        )?;
        contains_all(
            "blocking scatter",
            &msg,
            &["scatter_list[1]", "6 elements", "expects 13"],
        )?;
        close(
            "blocking scatter: buffer untouched",
            &vals(&out)?,
            &full(13, 0.0),
        )?;
        // still in step
        let y = df::all_reduce(&t64(&[1.0], &[1]), ReduceOp::Sum, None)?;
        close("after the error", &vals(&y)?, &[2.0])?;
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------------
// appendix A and section 1.3

/// Appendix A, the W = 3 rows (loss_r = (r+1)·Σy unless stated), with the correct adjoints
/// where PyTorch's are wrong (reduce with any op, all_reduce MAX/PRODUCT).
#[test]
fn appendix_a_w3_table() {
    world(3, |rank| {
        APPENDIX_A_W3_CASES.iter().try_for_each(|c| check(c, rank))
    });
}

/// Section 1.3's measured examples at W = 3 (correct adjoints where PyTorch's are wrong).
#[test]
fn section_1_3_w3_examples() {
    world(3, |rank| {
        SECTION_1_3_W3_CASES.iter().try_for_each(|c| check(c, rank))
    });
}

/// Section 1.3's measured examples at W = 2 (and appendix A's W = 2 row).
#[test]
fn section_1_3_w2_examples() {
    world(2, |rank| {
        SECTION_1_3_W2_CASES.iter().try_for_each(|c| check(c, rank))
    });
}

/// Section 1.3: the c10d docstring example of `all_to_all_single` (W = 4, uneven splits), with
/// loss_r = Σ y_r ⊙ ([1..n_r] + 100r).
#[test]
fn section_1_3_w4_all_to_all_single_docstring() {
    world(4, |rank| {
        let r = rank as f64;
        let inputs: [(usize, f64); 4] = [(6, 0.0), (9, 10.0), (5, 20.0), (7, 30.0)];
        let ins: [[usize; 4]; 4] = [[2, 2, 1, 1], [3, 2, 2, 2], [2, 1, 1, 1], [2, 2, 2, 1]];
        let outs: [[usize; 4]; 4] = [[2, 3, 2, 2], [2, 2, 1, 2], [1, 2, 1, 2], [1, 2, 1, 1]];
        let ys: [&[f64]; 4] = [
            &[0., 1., 10., 11., 12., 20., 21., 30., 31.],
            &[2., 3., 13., 14., 22., 32., 33.],
            &[4., 15., 16., 23., 34., 35.],
            &[5., 17., 18., 24., 36.],
        ];
        let dxs: [&[f64]; 4] = [
            &[1., 2., 101., 102., 201., 301.],
            &[3., 4., 5., 103., 104., 202., 203., 302., 303.],
            &[6., 7., 105., 204., 304.],
            &[8., 9., 106., 107., 205., 206., 305.],
        ];
        let (n, start) = inputs[rank];
        let x = leaf(&arange(n, start), &[n]);
        let y = df::all_to_all_single(&x, Some(&outs[rank]), Some(&ins[rank]), None)?;
        close("y", &vals(&y)?, ys[rank])?;
        dot(&y, &arange(ys[rank].len(), 1.0 + 100.0 * r))?.backward()?;
        close("dx", &grad(&x)?, dxs[rank])?;
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------------
// the tables of the long examples and their sections

/// Sections of #192920: column views, transposes and mixed layouts (world of 2).
const STRIDED_CASES: &[Case] = &[
    Case {
        name: "broadcast from 0 into column views",
        run: s_broadcast_from_0_into_column_views,
    },
    Case {
        name: "all_gather from a column view into columns 0 and 2",
        run: s_all_gather_from_a_column_view_into_colum,
    },
    Case {
        name: "reduce_scatter",
        run: s_reduce_scatter,
    },
    Case {
        name: "scatter from 1 of transposed tensors into column views",
        run: s_scatter_from_1_of_transposed_tensors_int,
    },
    Case {
        name: "gather to 0 into column views",
        run: s_gather_to_0_into_column_views,
    },
    Case {
        name: "all_to_all_single from a column view into a column view",
        run: s_all_to_all_single_from_a_column_view_int,
    },
    Case {
        name: "all_to_all between strided views",
        run: s_all_to_all_between_strided_views,
    },
    Case {
        name: "ranks holding one logical tensor in different layouts",
        run: s_ranks_holding_one_logical_tensor_in_diff,
    },
    Case {
        name: "functional broadcast, src 0 transposed, receiver contiguous",
        run: s_functional_broadcast_src_0_transposed_re,
    },
    Case {
        name: "functional all_reduce of a column view",
        run: s_functional_all_reduce_of_a_column_view,
    },
    Case {
        name: "functional all_gather of a transposed view, all_to_all_single of a column view",
        run: s_functional_all_gather_of_a_transposed_vi,
    },
];

/// The rows of appendix A (world of 3).
const APPENDIX_A_W3_CASES: &[Case] = &[
    Case {
        name: "broadcast src 2",
        run: a_broadcast_src_2,
    },
    Case {
        name: "gather to 0 and to 2",
        run: a_gather_to_0_and_to_2,
    },
    Case {
        name: "scatter src 0",
        run: a_scatter_src_0,
    },
    Case {
        name: "reduce SUM dst 0",
        run: a_reduce_sum_dst_0,
    },
    Case {
        name: "reduce_scatter SUM",
        run: a_reduce_scatter_sum,
    },
    Case {
        name: "all_gather",
        run: a_all_gather,
    },
    Case {
        name: "all_to_all equal",
        run: a_all_to_all_equal,
    },
    Case {
        name: "all_to_all_single equal",
        run: a_all_to_all_single_equal,
    },
    Case {
        name: "all_reduce",
        run: a_all_reduce,
    },
];

/// The measured examples of section 1.3 (world of 3).
const SECTION_1_3_W3_CASES: &[Case] = &[
    Case {
        name: "broadcast src 0",
        run: w3_broadcast_src_0,
    },
    Case {
        name: "scatter src 2",
        run: w3_scatter_src_2,
    },
    Case {
        name: "reduce dst 0, g_dst = 1",
        run: w3_reduce_dst_0_g_dst_1,
    },
    Case {
        name: "reduce_scatter MAX",
        run: w3_reduce_scatter_max,
    },
    Case {
        name: "reduce_scatter PRODUCT",
        run: w3_reduce_scatter_product,
    },
    Case {
        name: "all_gather, only y[0] used with weight r+1",
        run: w3_all_gather_only_y_0_used_with_weight_r_1,
    },
    Case {
        name: "all_reduce MIN",
        run: w3_all_reduce_min,
    },
    Case {
        name: "all_to_all_single with zero-size splits",
        run: w3_all_to_all_single_with_zero_size_splits,
    },
    Case {
        name: "all_to_all list form with uneven sizes",
        run: w3_all_to_all_list_form_with_uneven_sizes,
    },
    Case {
        name: "chaining",
        run: w3_chaining,
    },
    Case {
        name: "integer ops, forward only",
        run: w3_integer_ops_forward_only,
    },
];

/// The measured examples of section 1.3 (world of 2).
const SECTION_1_3_W2_CASES: &[Case] = &[
    Case {
        name: "broadcast src 0",
        run: w2_broadcast_src_0,
    },
    Case {
        name: "gather with the loss ×1000(r+1) on every rank, dst 0",
        run: w2_gather_with_the_loss_1000_r_1_on_every_r,
    },
    Case {
        name: "all_gather, the same output used twice",
        run: w2_all_gather_the_same_output_used_twice,
    },
    Case {
        name: "ties, MAX",
        run: w2_ties_max,
    },
    Case {
        name: "double backward",
        run: w2_double_backward,
    },
];

fn s_broadcast_from_0_into_column_views(rank: usize) -> TestResult {
    let r = rank as f64;
    let with_col0 = |c: [f64; 3]| [c[0], 100.0 + r, c[1], 200.0 + r, c[2], 300.0 + r];
    let mine = [10.0 * r + 1.0, 10.0 * r + 2.0, 10.0 * r + 3.0];
    let base = || column_base(r);
    // broadcast from 0 into column views
    let b = base();
    dist::broadcast(&b.select(1, 0)?, 0, None)?;
    close("broadcast column", &vals(&b)?, &with_col0([1.0, 2.0, 3.0]))?;
    // all_reduce of column views: [12, 14, 16]
    let b = base();
    dist::all_reduce(&b.select(1, 0)?, ReduceOp::Sum, None)?;
    close(
        "all_reduce column",
        &vals(&b)?,
        &with_col0([12.0, 14.0, 16.0]),
    )?;
    // reduce to 1
    let b = base();
    dist::reduce(&b.select(1, 0)?, 1, ReduceOp::Sum, None)?;
    let want = if rank == 1 { [12.0, 14.0, 16.0] } else { mine };
    close("reduce column", &vals(&b)?, &with_col0(want))?;
    Ok(())
}

fn s_all_gather_from_a_column_view_into_colum(rank: usize) -> TestResult {
    let r = rank as f64;
    let base = || column_base(r);
    // all_gather from a column view into columns 0 and 2 of a (3,3) buffer (column 1 kept)
    let out = t64(&full(9, -7.0), &[3, 3]);
    let list = [out.select(1, 0)?, out.select(1, 2)?];
    dist::all_gather(&list, &base().select(1, 0)?, None)?;
    close(
        "all_gather into columns",
        &vals(&out)?,
        &[1., -7., 11., 2., -7., 12., 3., -7., 13.],
    )?;
    Ok(())
}

fn s_reduce_scatter(rank: usize) -> TestResult {
    let r = rank as f64;
    let tr = transposed;
    // reduce_scatter: transposed inputs, output a transposed narrow view of a (3,4) buffer.
    // input_list_r[i] (2,3) = 100r + 10i + arange(6), stored as the transpose of a (3,2)
    let inputs = (0..2)
        .map(|i| tr(&arange(6, 100.0 * r + 10.0 * i as f64)))
        .collect::<R<Vec<_>>>()?;
    let obuf = t64(&full(12, -5.0), &[3, 4]);
    let ov = obuf.narrow(1, 1, 2)?.t()?; // (2,3), strides (1,4)
    dist::reduce_scatter(&ov, &inputs, ReduceOp::Sum, None)?;
    let want: Vec<f64> = arange(6, 0.0)
        .iter()
        .map(|a| 100.0 + 20.0 * r + 2.0 * a)
        .collect();
    close("reduce_scatter into a transposed view", &vals(&ov)?, &want)?;
    for row in 0..3 {
        let edge = vals(&obuf.select(0, row)?)?;
        close(
            "reduce_scatter neighbours",
            &[edge[0], edge[3]],
            &[-5.0, -5.0],
        )?;
    }
    Ok(())
}

fn s_scatter_from_1_of_transposed_tensors_int(rank: usize) -> TestResult {
    let r = rank as f64;
    let tr = transposed;
    // scatter from 1 of transposed (2,3) tensors into column views (6 elements each,
    // received in logical order)
    let list = (0..2)
        .map(|i| tr(&arange(6, 50.0 * i as f64)))
        .collect::<R<Vec<_>>>()?;
    let out = t64(&full(12, -3.0), &[6, 2]);
    dist::scatter(
        &out.select(1, 1)?,
        (rank == 1).then_some(&list[..]),
        1,
        None,
    )?;
    let mut want = Vec::new();
    for a in arange(6, 50.0 * r) {
        want.extend([-3.0, a]);
    }
    close("scatter into a column", &vals(&out)?, &want)?;
    Ok(())
}

fn s_gather_to_0_into_column_views(rank: usize) -> TestResult {
    let r = rank as f64;
    let base = || column_base(r);
    // gather to 0 into column views
    let out = t64(&full(9, -9.0), &[3, 3]);
    let list = [out.select(1, 0)?, out.select(1, 1)?];
    let dst_list = (rank == 0).then_some(&list[..]);
    dist::gather(&base().select(1, 0)?, dst_list, 0, None)?;
    let want = if rank == 0 {
        vec![1., 11., -9., 2., 12., -9., 3., 13., -9.]
    } else {
        vec![-9.0; 9]
    };
    close("gather into columns", &vals(&out)?, &want)?;
    Ok(())
}

fn s_all_to_all_single_from_a_column_view_int(rank: usize) -> TestResult {
    let r = rank as f64;
    // all_to_all_single from a column view into a column view (gloo wrote 4 contiguous
    // elements over the neighbouring column)
    let inb = t64(
        &[
            10.0 * r,
            -1.0,
            10.0 * r + 1.0,
            -1.0,
            10.0 * r + 2.0,
            -1.0,
            10.0 * r + 3.0,
            -1.0,
        ],
        &[4, 2],
    );
    let outb = t64(&full(8, -2.0), &[4, 2]);
    dist::all_to_all_single(&outb.select(1, 0)?, &inb.select(1, 0)?, None, None, None)?;
    let y: [f64; 4] = if rank == 0 {
        [0.0, 1.0, 10.0, 11.0]
    } else {
        [2.0, 3.0, 12.0, 13.0]
    };
    close(
        "all_to_all_single into a column",
        &vals(&outb)?,
        &[y[0], -2., y[1], -2., y[2], -2., y[3], -2.],
    )?;
    Ok(())
}

fn s_all_to_all_between_strided_views(rank: usize) -> TestResult {
    let r = rank as f64;
    // all_to_all between strided views: x_r[j] = rows 2j, 2j+1 of column 0 of a (4,2)
    // buffer, received into rows of column 1 of another; y_r[j] = x_j[r]
    let inb = t64(
        &[0., -4., 1., -4., 2., -4., 3., -4.].map(|v| if v < 0.0 { v } else { v + 10.0 * r }),
        &[4, 2],
    );
    let inputs = [
        inb.select(1, 0)?.narrow(0, 0, 2)?,
        inb.select(1, 0)?.narrow(0, 2, 2)?,
    ];
    let outb = t64(&full(8, -6.0), &[4, 2]);
    let outputs = [
        outb.select(1, 1)?.narrow(0, 0, 2)?,
        outb.select(1, 1)?.narrow(0, 2, 2)?,
    ];
    dist::all_to_all(&outputs, &inputs, None)?;
    let (a, b) = (2.0 * r, 10.0 + 2.0 * r);
    close(
        "all_to_all between strided views",
        &vals(&outb)?,
        &[-6., a, -6., a + 1.0, -6., b, -6., b + 1.0],
    )?;
    close(
        "all_to_all: input untouched",
        &vals(&inb.select(1, 1)?)?,
        &[-4.0; 4],
    )?;
    Ok(())
}

fn s_ranks_holding_one_logical_tensor_in_diff(rank: usize) -> TestResult {
    let r = rank as f64;
    let tr = transposed;
    // ranks holding the same logical (2,3) tensor in different layouts: rank 0 transposed,
    // rank 1 contiguous. L_r = [[0,1,2],[3,4,5]] + 10r
    let logical = arange(6, 10.0 * r);
    let mk = || -> R<Tensor> {
        if rank == 0 {
            tr(&logical)
        } else {
            Ok(t64(&logical, &[2, 3]))
        }
    };
    let t = mk()?;
    dist::all_reduce(&t, ReduceOp::Sum, None)?;
    close(
        "all_reduce, mixed layouts",
        &vals(&t)?,
        &[10., 12., 14., 16., 18., 20.],
    )?;
    for src in 0..2 {
        let t = mk()?;
        dist::broadcast(&t, src, None)?;
        close(
            &format!("broadcast from {src}, mixed layouts"),
            &vals(&t)?,
            &arange(6, 10.0 * src as f64),
        )?;
    }
    Ok(())
}

fn s_functional_broadcast_src_0_transposed_re(rank: usize) -> TestResult {
    let r = rank as f64;
    // functional broadcast, src 0 transposed, receiver contiguous: the logical values
    // arrive; the gradient reaches the transposed leaf in its own layout
    let leaf_base = if rank == 0 {
        // (3,2) storage of the transposed (2,3) view
        let s = [0., 3., 1., 4., 2., 5.];
        leaf(&s, &[3, 2])
    } else {
        leaf(&arange(6, 10.0), &[2, 3])
    };
    let x = if rank == 0 {
        leaf_base.t()?
    } else {
        leaf_base.clone()
    };
    let y = df::broadcast(&x, 0, None)?;
    close(
        "functional broadcast, mixed layouts",
        &vals(&y)?,
        &arange(6, 0.0),
    )?;
    let w = arange(6, 1.0);
    dot(&y, &w.iter().map(|v| v * (r + 1.0)).collect::<Vec<_>>())?.backward()?;
    if rank == 0 {
        // dL/dx = 3w (logical (2,3)); the leaf is its (3,2) transpose
        close(
            "functional broadcast dx (transposed leaf)",
            &grad(&leaf_base)?,
            &[3., 12., 6., 15., 9., 18.],
        )?;
    } else {
        close(
            "functional broadcast dx (receiver)",
            &grad(&leaf_base)?,
            &[0.0; 6],
        )?;
    }
    Ok(())
}

fn s_functional_all_reduce_of_a_column_view(rank: usize) -> TestResult {
    let r = rank as f64;
    let base = || column_base(r);
    // functional all_reduce of a column view: the gradient lands in column 0 of the leaf
    let lb = leaf(&base().to_vec_f64()?, &[3, 2]);
    let y = df::all_reduce(&lb.select(1, 0)?, ReduceOp::Sum, None)?;
    close(
        "functional all_reduce column",
        &vals(&y)?,
        &[12.0, 14.0, 16.0],
    )?;
    wsum(&y, r + 1.0)?.backward()?;
    close(
        "functional all_reduce column dx",
        &grad(&lb)?,
        &[3., 0., 3., 0., 3., 0.],
    )?;
    close(
        "functional all_reduce column: input untouched",
        &vals(&lb)?,
        &vals(&base())?,
    )?;
    Ok(())
}

fn s_functional_all_gather_of_a_transposed_vi(rank: usize) -> TestResult {
    let r = rank as f64;
    // functional all_gather of a transposed view, all_to_all_single of a column view
    let lb = leaf(&[0., 3., 1., 4., 2., 5.].map(|v| v + 10.0 * r), &[3, 2]);
    let ys = df::all_gather(&lb.t()?, None)?;
    close(
        "functional all_gather of a transpose",
        &flat(&ys)?,
        &[&arange(6, 0.0)[..], &arange(6, 10.0)].concat(),
    )?;
    // loss_r = (r + 1) Σ_i Σ y[i] ⊙ w, w = [1..6]: dx = 3w in logical order
    let w = arange(6, 1.0);
    dot(&ys[0], &w)?
        .add(&dot(&ys[1], &w)?)?
        .mul_scalar(r + 1.0)?
        .backward()?;
    close(
        "functional all_gather dx (transposed leaf)",
        &grad(&lb)?,
        &[3., 12., 6., 15., 9., 18.],
    )?;

    let lb = leaf(
        &[
            10.0 * r,
            -1.0,
            10.0 * r + 1.0,
            -1.0,
            10.0 * r + 2.0,
            -1.0,
            10.0 * r + 3.0,
            -1.0,
        ],
        &[4, 2],
    );
    let y = df::all_to_all_single(&lb.select(1, 0)?, None, None, None)?;
    let want: [f64; 4] = if rank == 0 {
        [0., 1., 10., 11.]
    } else {
        [2., 3., 12., 13.]
    };
    close(
        "functional all_to_all_single of a column",
        &vals(&y)?,
        &want,
    )?;
    dot(&y, &arange(4, 1.0 + 100.0 * r))?.backward()?;
    // element i of rank r's column went to rank i / 2, position 2r + i % 2
    let dx: Vec<f64> = (0..4)
        .map(|i| (100 * (i / 2) + 2 * rank + i % 2 + 1) as f64)
        .collect();
    close(
        "functional all_to_all_single dx",
        &grad(&lb)?,
        &[dx[0], 0., dx[1], 0., dx[2], 0., dx[3], 0.],
    )?;
    Ok(())
}

fn a_broadcast_src_2(rank: usize) -> TestResult {
    let r = rank as f64;
    // broadcast src 2: x_r = [r+1, 10(r+1)] -> [3, 30]; dx r2 [6, 6], others 0
    let x = leaf(&[r + 1.0, 10.0 * (r + 1.0)], &[2]);
    let y = df::broadcast(&x, 2, None)?;
    close("broadcast src 2 y", &vals(&y)?, &[3.0, 30.0])?;
    wsum(&y, r + 1.0)?.backward()?;
    close(
        "broadcast src 2 dx",
        &grad(&x)?,
        &full(2, if rank == 2 { 6.0 } else { 0.0 }),
    )?;
    Ok(())
}

fn a_gather_to_0_and_to_2(rank: usize) -> TestResult {
    let r = rank as f64;
    let rows = |what: &str, got: &[Tensor], want: &[&[f64]]| -> TestResult {
        close(what, &flat(got)?, &want.concat())
    };
    // gather, loss_r = Σ_i (10r+i+1)·Σ y[i], x_r = full(2, r+1)
    for (dst, dx) in [(0usize, r + 1.0), (2, 21.0 + r)] {
        let x = leaf(&full(2, r + 1.0), &[2]);
        let ys = df::gather(&x, dst, None)?;
        if rank == dst {
            rows("gather y", &ys, &[&[1., 1.], &[2., 2.], &[3., 3.]])?;
        } else {
            rows("gather y (non-dst)", &ys, &[&[0.0; 6]])?;
        }
        list_loss(&ys, |i| 10.0 * r + i as f64 + 1.0)?.backward()?;
        close(&format!("gather dst {dst} dx"), &grad(&x)?, &full(2, dx))?;
    }
    Ok(())
}

fn a_scatter_src_0(rank: usize) -> TestResult {
    let r = rank as f64;
    // scatter src 0: xs_r[i] = full(2, 10r+i); receivers pass placeholders (zero grads)
    let xs: Vec<Tensor> = (0..3)
        .map(|i| leaf(&full(2, 10.0 * r + i as f64), &[2]))
        .collect();
    let y = df::scatter(Some(&xs), 0, None)?;
    close("scatter y", &vals(&y)?, &full(2, r))?;
    wsum(&y, r + 1.0)?.backward()?;
    for (i, x) in xs.iter().enumerate() {
        let want = if rank == 0 { i as f64 + 1.0 } else { 0.0 };
        close(&format!("scatter dxs[{i}]"), &grad(x)?, &full(2, want))?;
    }
    Ok(())
}

fn a_reduce_sum_dst_0(rank: usize) -> TestResult {
    let r = rank as f64;
    // reduce SUM dst 0: x_r = [r+2, -(r+2), 0.5(r+1)] -> r0 [9, -9, 3]; others zeros
    // (ours; PyTorch unspecified); dx 1 everywhere
    let xr = [r + 2.0, -(r + 2.0), 0.5 * (r + 1.0)];
    let x = leaf(&xr, &[3]);
    let y = df::reduce(&x, 0, ReduceOp::Sum, None)?;
    close(
        "reduce SUM dst 0 y",
        &vals(&y)?,
        &if rank == 0 {
            [9.0, -9.0, 3.0]
        } else {
            [0.0; 3]
        },
    )?;
    wsum(&y, r + 1.0)?.backward()?;
    close("reduce SUM dst 0 dx", &grad(&x)?, &full(3, 1.0))?;

    // reduce, every op, dst 2 (g_dst = 3). PyTorch gives 3 everywhere for every op; the
    // true adjoints: SUM 3; AVG 1; MAX/MIN 3 at the holder; PRODUCT 3·Π_{k≠r} x_k.
    // Holders: elem 0 (2,3,4) max r2 min r0; elem 1 (-2,-3,-4) max r0 min r2;
    // elem 2 (0.5,1,1.5) max r2 min r0.
    let reduce_cases: [(ReduceOp, [f64; 3], [[f64; 3]; 3]); 5] = [
        (ReduceOp::Sum, [9., -9., 3.], [[3.; 3], [3.; 3], [3.; 3]]),
        (ReduceOp::Avg, [3., -3., 1.], [[1.; 3], [1.; 3], [1.; 3]]),
        (
            ReduceOp::Max,
            [4., -2., 1.5],
            [[0., 3., 0.], [0.; 3], [3., 0., 3.]],
        ),
        (
            ReduceOp::Min,
            [2., -4., 0.5],
            [[3., 0., 3.], [0.; 3], [0., 3., 0.]],
        ),
        (
            ReduceOp::Product,
            [24., -24., 0.75],
            [[36., 36., 4.5], [24., 24., 2.25], [18., 18., 1.5]],
        ),
    ];
    for (op, y2, dx) in reduce_cases {
        let x = leaf(&xr, &[3]);
        let y = df::reduce(&x, 2, op, None)?;
        close(
            &format!("reduce {op:?} dst 2 y"),
            &vals(&y)?,
            &if rank == 2 { y2 } else { [0.0; 3] },
        )?;
        wsum(&y, r + 1.0)?.backward()?;
        close(&format!("reduce {op:?} dst 2 dx"), &grad(&x)?, &dx[rank])?;
    }
    Ok(())
}

fn a_reduce_scatter_sum(rank: usize) -> TestResult {
    let r = rank as f64;
    // reduce_scatter SUM: list_r[i] = full(2, 10r+i) -> 30, 33, 36; list[i] grad = i+1
    let xs: Vec<Tensor> = (0..3)
        .map(|i| leaf(&full(2, 10.0 * r + i as f64), &[2]))
        .collect();
    let y = df::reduce_scatter(&xs, ReduceOp::Sum, None)?;
    close("reduce_scatter y", &vals(&y)?, &full(2, 30.0 + 3.0 * r))?;
    wsum(&y, r + 1.0)?.backward()?;
    for (i, x) in xs.iter().enumerate() {
        close(
            &format!("reduce_scatter dxs[{i}]"),
            &grad(x)?,
            &full(2, i as f64 + 1.0),
        )?;
    }
    Ok(())
}

fn a_all_gather(rank: usize) -> TestResult {
    let r = rank as f64;
    let rows = |what: &str, got: &[Tensor], want: &[&[f64]]| -> TestResult {
        close(what, &flat(got)?, &want.concat())
    };
    // all_gather, loss Σ_i (10r+i+1)·Σ y[i]: x_r = [r+1, 2(r+1)] -> dx 33, 36, 39
    let x = leaf(&[r + 1.0, 2.0 * (r + 1.0)], &[2]);
    let ys = df::all_gather(&x, None)?;
    rows("all_gather y", &ys, &[&[1., 2.], &[2., 4.], &[3., 6.]])?;
    list_loss(&ys, |i| 10.0 * r + i as f64 + 1.0)?.backward()?;
    close("all_gather dx", &grad(&x)?, &full(2, 33.0 + 3.0 * r))?;
    Ok(())
}

fn a_all_to_all_equal(rank: usize) -> TestResult {
    let r = rank as f64;
    let rows = |what: &str, got: &[Tensor], want: &[&[f64]]| -> TestResult {
        close(what, &flat(got)?, &want.concat())
    };
    // all_to_all equal, loss Σ stack(y): x_r[j] = full(2, 10r+j) -> y_r[j] = 10j + r
    let xs: Vec<Tensor> = (0..3)
        .map(|j| leaf(&full(2, 10.0 * r + j as f64), &[2]))
        .collect();
    let ys = df::all_to_all(&xs, None)?;
    rows(
        "all_to_all y",
        &ys,
        &[&full(2, r), &full(2, 10.0 + r), &full(2, 20.0 + r)],
    )?;
    Tensor::stack(&ys, 0)?.sum()?.backward()?;
    for (j, x) in xs.iter().enumerate() {
        close(&format!("all_to_all dxs[{j}]"), &grad(x)?, &full(2, 1.0))?;
    }
    Ok(())
}

fn a_all_to_all_single_equal(rank: usize) -> TestResult {
    let r = rank as f64;
    // all_to_all_single equal, loss Σ y·(arange + 1000r): x_r = arange(6) + 100r
    let x = leaf(&arange(6, 100.0 * r), &[6]);
    let y = df::all_to_all_single(&x, None, None, None)?;
    let y_want: Vec<f64> = (0..6)
        .map(|i| (100 * (i / 2) + 2 * rank + i % 2) as f64)
        .collect();
    close("all_to_all_single y", &vals(&y)?, &y_want)?;
    dot(&y, &arange(6, 1000.0 * r))?.backward()?;
    let dx: Vec<f64> = (0..6)
        .map(|i| (1000 * (i / 2) + 2 * rank + i % 2) as f64)
        .collect();
    close("all_to_all_single dx", &grad(&x)?, &dx)?;
    Ok(())
}

fn a_all_reduce(rank: usize) -> TestResult {
    let r = rank as f64;
    // all_reduce, x_r = [r+1, 2(r+1), -(r+1)], g_r = r+1 (G = 6)
    let ar_cases: [(ReduceOp, [f64; 3], [[f64; 3]; 3]); 4] = [
        (ReduceOp::Sum, [6., 12., -6.], [[6.; 3], [6.; 3], [6.; 3]]),
        (ReduceOp::Avg, [2., 4., -2.], [[2.; 3], [2.; 3], [2.; 3]]),
        // PyTorch: 3 everywhere (max of g)
        (
            ReduceOp::Max,
            [3., 6., -1.],
            [[0., 0., 6.], [0.; 3], [6., 6., 0.]],
        ),
        // PyTorch: 6 everywhere (product of g); correct: 6·Π_{k≠r} x_k
        (
            ReduceOp::Product,
            [6., 48., -6.],
            [[36., 144., 36.], [18., 72., 18.], [12., 48., 12.]],
        ),
    ];
    for (op, yw, dx) in ar_cases {
        let x = leaf(&[r + 1.0, 2.0 * (r + 1.0), -(r + 1.0)], &[3]);
        let y = df::all_reduce(&x, op, None)?;
        close(&format!("all_reduce {op:?} y"), &vals(&y)?, &yw)?;
        wsum(&y, r + 1.0)?.backward()?;
        close(&format!("all_reduce {op:?} dx"), &grad(&x)?, &dx[rank])?;
    }
    Ok(())
}

fn w3_broadcast_src_0(rank: usize) -> TestResult {
    let r = rank as f64;
    // broadcast src 0: rank 0 gets [6, 6]
    let x = leaf(&[r + 1.0, 10.0 * (r + 1.0)], &[2]);
    let y = df::broadcast(&x, 0, None)?;
    close("broadcast src 0 y", &vals(&y)?, &[1.0, 10.0])?;
    wsum(&y, r + 1.0)?.backward()?;
    close(
        "broadcast src 0 dx",
        &grad(&x)?,
        &full(2, if rank == 0 { 6.0 } else { 0.0 }),
    )?;
    Ok(())
}

fn w3_scatter_src_2(rank: usize) -> TestResult {
    let r = rank as f64;
    // scatter src 2: y = [20+r, 20+r]; rank 2's grads 1, 2, 3
    let xs: Vec<Tensor> = (0..3)
        .map(|i| leaf(&full(2, 10.0 * r + i as f64), &[2]))
        .collect();
    let y = df::scatter((rank == 2).then_some(&xs[..]), 2, None)?;
    close("scatter src 2 y", &vals(&y)?, &full(2, 20.0 + r))?;
    wsum(&y, r + 1.0)?.backward()?;
    if rank == 2 {
        for (i, x) in xs.iter().enumerate() {
            close(
                &format!("scatter src 2 dxs[{i}]"),
                &grad(x)?,
                &full(2, i as f64 + 1.0),
            )?;
        }
    }
    Ok(())
}

fn w3_reduce_dst_0_g_dst_1(rank: usize) -> TestResult {
    let r = rank as f64;
    // reduce dst 0, g_dst = 1: SUM 1; AVG 1/3 (PyTorch 1); MAX 1 at the holder (r2: elems
    // 0, 2; r0: elem 1); MIN mirrored; PRODUCT Π_{k≠r} x_k (PyTorch 1 everywhere)
    let xr = [r + 2.0, -(r + 2.0), 0.5 * (r + 1.0)];
    let third = 1.0 / 3.0;
    let cases: [(ReduceOp, [[f64; 3]; 3]); 5] = [
        (ReduceOp::Sum, [[1.; 3], [1.; 3], [1.; 3]]),
        (ReduceOp::Avg, [[third; 3], [third; 3], [third; 3]]),
        (ReduceOp::Max, [[0., 1., 0.], [0.; 3], [1., 0., 1.]]),
        (ReduceOp::Min, [[1., 0., 1.], [0.; 3], [0., 1., 0.]]),
        (
            ReduceOp::Product,
            [[12., 12., 1.5], [8., 8., 0.75], [6., 6., 0.5]],
        ),
    ];
    for (op, dx) in cases {
        let x = leaf(&xr, &[3]);
        let y = df::reduce(&x, 0, op, None)?;
        wsum(&y, r + 1.0)?.backward()?;
        close(&format!("reduce {op:?} dst 0 dx"), &grad(&x)?, &dx[rank])?;
    }
    // reduce AVG dst 0, x_r = [r+1], loss y.sum(): y_dst = 2, dx = 1/3 (PyTorch 1)
    let x = leaf(&[r + 1.0], &[1]);
    let y = df::reduce(&x, 0, ReduceOp::Avg, None)?;
    close(
        "reduce AVG y",
        &vals(&y)?,
        &[if rank == 0 { 2.0 } else { 0.0 }],
    )?;
    y.sum()?.backward()?;
    close("reduce AVG dx", &grad(&x)?, &[third])?;
    Ok(())
}

fn w3_reduce_scatter_max(rank: usize) -> TestResult {
    let r = rank as f64;
    // reduce_scatter MAX -> y_r = 20 + r, only rank 2's inputs get gradient (i+1);
    // AVG -> y_r = 10 + r, grads (i+1)/3 (PyTorch: i+1 for both)
    for (op, y_want, on) in [
        (ReduceOp::Max, 20.0 + r, rank == 2),
        (ReduceOp::Avg, 10.0 + r, true),
    ] {
        let xs: Vec<Tensor> = (0..3)
            .map(|i| leaf(&full(2, 10.0 * r + i as f64), &[2]))
            .collect();
        let y = df::reduce_scatter(&xs, op, None)?;
        close(
            &format!("reduce_scatter {op:?} y"),
            &vals(&y)?,
            &full(2, y_want),
        )?;
        wsum(&y, r + 1.0)?.backward()?;
        for (i, x) in xs.iter().enumerate() {
            let g = match (op, on) {
                (ReduceOp::Avg, _) => (i as f64 + 1.0) / 3.0,
                (_, true) => i as f64 + 1.0,
                _ => 0.0,
            };
            close(
                &format!("reduce_scatter {op:?} dxs[{i}]"),
                &grad(x)?,
                &full(2, g),
            )?;
        }
    }
    Ok(())
}

fn w3_reduce_scatter_product(rank: usize) -> TestResult {
    let r = rank as f64;
    // reduce_scatter PRODUCT (PyTorch: i+1 everywhere): y_r = Π_k (10k + r) = 0, 231, 528;
    // dxs[i] on rank q = (i+1)·Π_{k≠q} (10k + i), exact with the zero on rank 0
    let xs: Vec<Tensor> = (0..3)
        .map(|i| leaf(&full(2, 10.0 * r + i as f64), &[2]))
        .collect();
    let y = df::reduce_scatter(&xs, ReduceOp::Product, None)?;
    close(
        "reduce_scatter Product y",
        &vals(&y)?,
        &full(2, [0.0, 231.0, 528.0][rank]),
    )?;
    wsum(&y, r + 1.0)?.backward()?;
    let dxs: [[f64; 3]; 3] = [[200., 462., 792.], [0., 42., 132.], [0., 22., 72.]];
    for (i, x) in xs.iter().enumerate() {
        close(
            &format!("reduce_scatter Product dxs[{i}]"),
            &grad(x)?,
            &full(2, dxs[rank][i]),
        )?;
    }
    Ok(())
}

fn w3_all_gather_only_y_0_used_with_weight_r_1(rank: usize) -> TestResult {
    let r = rank as f64;
    // all_gather, only y[0] used with weight r+1: dx_0 = 6, others 0
    let x = leaf(&[r + 1.0, 2.0 * (r + 1.0)], &[2]);
    let ys = df::all_gather(&x, None)?;
    wsum(&ys[0], r + 1.0)?.backward()?;
    close(
        "all_gather y[0] only dx",
        &grad(&x)?,
        &full(2, if rank == 0 { 6.0 } else { 0.0 }),
    )?;
    Ok(())
}

fn w3_all_reduce_min(rank: usize) -> TestResult {
    let r = rank as f64;
    // all_reduce MIN -> [1, 2, -3]; and a fourth element 5 tied on all three ranks
    // (funcol's measured routing: 6 split three ways)
    let xr = [r + 1.0, 2.0 * (r + 1.0), -(r + 1.0), 5.0];
    for (op, yw, dx) in [
        (
            ReduceOp::Min,
            [1., 2., -3., 5.],
            [[6., 6., 0., 2.], [0., 0., 0., 2.], [0., 0., 6., 2.]],
        ),
        (
            ReduceOp::Max,
            [3., 6., -1., 5.],
            [[0., 0., 6., 2.], [0., 0., 0., 2.], [6., 6., 0., 2.]],
        ),
    ] {
        let x = leaf(&xr, &[4]);
        let y = df::all_reduce(&x, op, None)?;
        close(&format!("all_reduce {op:?} y"), &vals(&y)?, &yw)?;
        wsum(&y, r + 1.0)?.backward()?;
        close(&format!("all_reduce {op:?} dx"), &grad(&x)?, &dx[rank])?;
    }
    // all_reduce NaN-aware: rank 0's element 0 is NaN -> MAX/MIN are NaN there, rank 0
    // holds it and gets the whole gradient, no NaN gradients
    for op in [ReduceOp::Max, ReduceOp::Min] {
        let v0 = if rank == 0 { f64::NAN } else { r };
        let x = leaf(&[v0, r], &[2]);
        let y = df::all_reduce(&x, op, None)?;
        let e1 = if op == ReduceOp::Max { 2.0 } else { 0.0 };
        close(
            &format!("all_reduce {op:?} NaN y"),
            &vals(&y)?,
            &[f64::NAN, e1],
        )?;
        wsum(&y, r + 1.0)?.backward()?;
        let holder1 = if op == ReduceOp::Max { 2 } else { 0 };
        let want = [
            if rank == 0 { 6.0 } else { 0.0 },
            if rank == holder1 { 6.0 } else { 0.0 },
        ];
        close(&format!("all_reduce {op:?} NaN dx"), &grad(&x)?, &want)?;
    }
    Ok(())
}

fn w3_all_to_all_single_with_zero_size_splits(rank: usize) -> TestResult {
    let r = rank as f64;
    // all_to_all_single with zero-size splits (nothing sent to self):
    // x_r = [10r, 10r+1] -> y_0 = [10, 20], y_1 = [0, 21], y_2 = [1, 11]
    let x = leaf(&[10.0 * r, 10.0 * r + 1.0], &[2]);
    let splits: Vec<usize> = (0..3).map(|j| usize::from(j != rank)).collect();
    let y = df::all_to_all_single(&x, Some(&splits), Some(&splits), None)?;
    let yw: [[f64; 2]; 3] = [[10., 20.], [0., 21.], [1., 11.]];
    close("all_to_all_single zero splits y", &vals(&y)?, &yw[rank])?;
    wsum(&y, r + 1.0)?.backward()?;
    let dx: [[f64; 2]; 3] = [[2., 3.], [1., 3.], [1., 2.]];
    close("all_to_all_single zero splits dx", &grad(&x)?, &dx[rank])?;
    // all-zero splits with empty tensors
    let e = leaf(&[], &[0]);
    let y = df::all_to_all_single(&e, Some(&[0, 0, 0]), Some(&[0, 0, 0]), None)?;
    if y.shape() != [0] {
        return Err(format!("empty all_to_all_single shape {:?}", y.shape()).into());
    }
    // output_split_sizes None, input_split_sizes [2, 2, 2]: the equal exchange
    let x = leaf(&arange(6, 100.0 * r), &[6]);
    let y = df::all_to_all_single(&x, None, Some(&[2, 2, 2]), None)?;
    let y_want: Vec<f64> = (0..6)
        .map(|i| (100 * (i / 2) + 2 * rank + i % 2) as f64)
        .collect();
    close("all_to_all_single None out y", &vals(&y)?, &y_want)?;
    wsum(&y, r + 1.0)?.backward()?;
    let dx: Vec<f64> = (0..6).map(|i| (i / 2 + 1) as f64).collect();
    close("all_to_all_single None out dx", &grad(&x)?, &dx)?;
    // funcol's example: in_splits [1,2,3], out_splits [r+1]*3, x_r = arange(6) + 100r
    let x = leaf(&arange(6, 100.0 * r), &[6]);
    let outs = [rank + 1; 3];
    let y = df::all_to_all_single(&x, Some(&outs), Some(&[1, 2, 3]), None)?;
    let yw: [&[f64]; 3] = [
        &[0., 100., 200.],
        &[1., 2., 101., 102., 201., 202.],
        &[3., 4., 5., 103., 104., 105., 203., 204., 205.],
    ];
    close("all_to_all_single [1,2,3] y", &vals(&y)?, yw[rank])?;
    wsum(&y, r + 1.0)?.backward()?;
    close(
        "all_to_all_single [1,2,3] dx",
        &grad(&x)?,
        &[1., 2., 2., 3., 3., 3.],
    )?;
    Ok(())
}

fn w3_all_to_all_list_form_with_uneven_sizes(rank: usize) -> TestResult {
    let r = rank as f64;
    // all_to_all list form with uneven sizes (section 2.6): x_r[i] = (i+1)×3 of r ->
    // y_r[j] = (r+1)×3 of j; loss (r+1)·Σ cat(y) -> dxs[i] = i + 1 (the receiver's weight)
    let xs: Vec<Tensor> = (0..3)
        .map(|i| leaf(&full(3 * (i + 1), r), &[i + 1, 3]))
        .collect();
    let ys = df::all_to_all(&xs, None)?;
    for (j, y) in ys.iter().enumerate() {
        if y.shape() != [rank + 1, 3] {
            return Err(format!("all_to_all uneven y[{j}] shape {:?}", y.shape()).into());
        }
        close(
            &format!("all_to_all uneven y[{j}]"),
            &vals(y)?,
            &full(3 * (rank + 1), j as f64),
        )?;
    }
    wsum(&Tensor::cat(&ys, 0)?, r + 1.0)?.backward()?;
    for (i, x) in xs.iter().enumerate() {
        close(
            &format!("all_to_all uneven dxs[{i}]"),
            &grad(x)?,
            &full(3 * (i + 1), i as f64 + 1.0),
        )?;
    }
    Ok(())
}

fn w3_chaining(rank: usize) -> TestResult {
    let r = rank as f64;
    // chaining: all_reduce(all_reduce(x)), x_r = [r+1] -> 18, dx 9
    let x = leaf(&[r + 1.0], &[1]);
    let y = df::all_reduce(
        &df::all_reduce(&x, ReduceOp::Sum, None)?,
        ReduceOp::Sum,
        None,
    )?;
    close("chained y", &vals(&y)?, &[18.0])?;
    y.sum()?.backward()?;
    close("chained dx", &grad(&x)?, &[9.0])?;
    // 0-d tensor: y = 6, dx = 3 (loss y)
    let x = Tensor::scalar(r + 1.0).requires_grad_(true);
    let y = df::all_reduce(&x, ReduceOp::Sum, None)?;
    close("0-d y", &vals(&y)?, &[6.0])?;
    y.backward()?;
    close("0-d dx", &grad(&x)?, &[3.0])?;
    // x_r = r + 0.5: y = 4.5, dx = 3 (loss y.sum())
    let x = leaf(&[r + 0.5], &[1]);
    let y = df::all_reduce(&x, ReduceOp::Sum, None)?;
    close("half y", &vals(&y)?, &[4.5])?;
    y.sum()?.backward()?;
    close("half dx", &grad(&x)?, &[3.0])?;
    Ok(())
}

fn w3_integer_ops_forward_only(rank: usize) -> TestResult {
    let r = rank as f64;
    // integer ops, forward only: x_r = [15 ^ (1<<r), 1<<r, 6+r]
    let xi = t64(
        &[f64::from(15 ^ (1 << rank)), f64::from(1 << rank), 6.0 + r],
        &[3],
    )
    .to_dtype(DType::I64)?;
    for (op, want) in [
        (ReduceOp::BAnd, [8., 0., 0.]),
        (ReduceOp::BOr, [15., 7., 15.]),
        (ReduceOp::BXor, [8., 7., 9.]),
        (ReduceOp::Sum, [38., 7., 21.]),
        (ReduceOp::Max, [14., 4., 8.]),
    ] {
        let y = df::all_reduce(&xi, op, None)?;
        close(&format!("int64 all_reduce {op:?}"), &vals(&y)?, &want)?;
    }
    // section 1.4's op table: x_r = [r+1, -(r+1), 2^r]
    let x = t64(&[r + 1.0, -(r + 1.0), f64::from(1 << rank)], &[3]);
    for (op, want) in [
        (ReduceOp::Sum, [6., -6., 7.]),
        (ReduceOp::Avg, [2., -2., 7.0 / 3.0]),
        (ReduceOp::Product, [6., -6., 8.]),
        (ReduceOp::Min, [1., -3., 1.]),
        (ReduceOp::Max, [3., -1., 4.]),
    ] {
        close(
            &format!("all_reduce {op:?} (1.4)"),
            &vals(&df::all_reduce(&x, op, None)?)?,
            &want,
        )?;
    }
    Ok(())
}

fn w2_broadcast_src_0(rank: usize) -> TestResult {
    let r = rank as f64;
    // broadcast src 0: x_r = [r+1, 10(r+1)] -> [1, 10]; dx r0 [3, 3], r1 [0, 0]
    let x = leaf(&[r + 1.0, 10.0 * (r + 1.0)], &[2]);
    let y = df::broadcast(&x, 0, None)?;
    close("broadcast y", &vals(&y)?, &[1.0, 10.0])?;
    wsum(&y, r + 1.0)?.backward()?;
    close(
        "broadcast dx",
        &grad(&x)?,
        &full(2, if rank == 0 { 3.0 } else { 0.0 }),
    )?;
    // partial use: loss = (r+1)·y[0] -> r0 [3, 0], r1 [0, 0]
    let x = leaf(&[r + 1.0, 10.0 * (r + 1.0)], &[2]);
    let y = df::broadcast(&x, 0, None)?;
    y.select(0, 0)?.mul_scalar(r + 1.0)?.backward()?;
    close(
        "broadcast partial dx",
        &grad(&x)?,
        &[if rank == 0 { 3.0 } else { 0.0 }, 0.0],
    )?;
    // empty (0, 3) input: empty output and gradient
    let x = leaf(&[], &[0, 3]);
    let y = df::broadcast(&x, 0, None)?;
    if y.shape() != [0, 3] {
        return Err(format!("empty broadcast shape {:?}", y.shape()).into());
    }
    y.sum()?.backward()?;
    close("empty broadcast dx", &grad(&x)?, &[])?;
    // int64 forward
    let xi = t64(&[r + 1.0, 7.0], &[2]).to_dtype(DType::I64)?;
    close(
        "int64 broadcast",
        &vals(&df::broadcast(&xi, 1, None)?)?,
        &[2.0, 7.0],
    )?;
    Ok(())
}

fn w2_gather_with_the_loss_1000_r_1_on_every_r(rank: usize) -> TestResult {
    let r = rank as f64;
    // gather with the loss ×1000(r+1) on every rank, dst 0: dx = 1000 on both
    let x = leaf(&full(2, r + 1.0), &[2]);
    let ys = df::gather(&x, 0, None)?;
    list_loss(&ys, |_| 1000.0 * (r + 1.0))?.backward()?;
    close("gather ×1000 dx", &grad(&x)?, &full(2, 1000.0))?;
    Ok(())
}

fn w2_all_gather_the_same_output_used_twice(rank: usize) -> TestResult {
    let r = rank as f64;
    // all_gather, the same output used twice: loss Σ(2·y[0] + 3·y[-1]) -> dx 4, 6
    let x = leaf(&[r + 1.0], &[1]);
    let ys = df::all_gather(&x, None)?;
    let loss = wsum(&ys[0], 2.0)?.add(&wsum(&ys[1], 3.0)?)?;
    loss.backward()?;
    close(
        "all_gather twice dx",
        &grad(&x)?,
        &[if rank == 0 { 4.0 } else { 6.0 }],
    )?;
    // 2-D: loss Σ cat(y)² -> dx = 2W·x
    let xv = [r + 1.0, -2.0 * r, 0.5, 3.0 + r];
    let x = leaf(&xv, &[2, 2]);
    let ys = df::all_gather(&x, None)?;
    let c = Tensor::cat(&ys, 0)?;
    c.mul(&c)?.sum()?.backward()?;
    close("all_gather 2-D dx", &grad(&x)?, &xv.map(|v| 4.0 * v))?;
    Ok(())
}

fn w2_ties_max(rank: usize) -> TestResult {
    let r = rank as f64;
    // ties, MAX, x_r = [5, r]: dx r0 [1.5, 0], r1 [1.5, 3] (PyTorch [2, 2] on both)
    let x = leaf(&[5.0, r], &[2]);
    let y = df::all_reduce(&x, ReduceOp::Max, None)?;
    close("ties y", &vals(&y)?, &[5.0, 1.0])?;
    wsum(&y, r + 1.0)?.backward()?;
    close(
        "ties dx",
        &grad(&x)?,
        &if rank == 0 { [1.5, 0.0] } else { [1.5, 3.0] },
    )?;
    Ok(())
}

fn w2_double_backward(rank: usize) -> TestResult {
    let r = rank as f64;
    // double backward: y = all_reduce(x), x_r = [r+1], loss y²: first-order g = 12; then
    // g.backward() gives 8 = Σ_r 2W
    let x = leaf(&[r + 1.0], &[1]);
    let y = df::all_reduce(&x, ReduceOp::Sum, None)?;
    let g = tensorplay_core::autograd::grad(
        &[y.mul(&y)?.sum()?],
        std::slice::from_ref(&x),
        &[],
        tensorplay_core::autograd::GradOptions {
            create_graph: true,
            ..Default::default()
        },
    )?
    .remove(0)
    .ok_or("no first-order gradient")?;
    close("first-order g", &vals(&g)?, &[12.0])?;
    g.sum()?.backward()?;
    close("second-order dx", &grad(&x)?, &[8.0])?;
    Ok(())
}
