//! Exact semantics of the differentiable collectives across real processes (`spawn`, the "cpu"
//! backend): world size 1 is the identity; strided, transposed and stride-0 inputs and
//! upstream gradients give the contiguous results; Max/Min split the gradient between tied
//! holders and route it to NaN holders; a rank that skips a backward collective is named in a
//! timeout error; the blocking collectives refuse tensors that require grad.

use std::time::Duration;

use tensorplay_collectives::{self as dist, InitOptions};
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::functional::{self as df, ReduceOp};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Every differentiable reduce op.
const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Product,
];

fn init(timeout_s: u64) -> dist::Result<()> {
    dist::init_process_group(
        "cpu",
        InitOptions {
            timeout: Duration::from_secs(timeout_s),
            ..Default::default()
        },
    )
}

/// Distinct across ranks for fixed `(j, i, salt)`, never 0.
fn val(r: usize, j: usize, i: usize, salt: usize) -> f64 {
    ((r * 7 + i * 3 + j * 5 + salt) % 11) as f64 * 0.25 - 1.2
}

fn vals(r: usize, j: usize, n: usize, salt: usize) -> Vec<f64> {
    (0..n).map(|i| val(r, j, i, salt)).collect()
}

/// Loss weight of element `i` of output `j` on rank `r` (never 0).
fn w_at(r: usize, j: usize, i: usize) -> f64 {
    0.5 * ((r * 5 + j * 3 + i * 2) % 7) as f64 - 1.3
}

fn f64_tensor(v: Vec<f64>, shape: &[usize]) -> tp::Result<Tensor> {
    Tensor::from_vec(v, shape)
}

// ---------------------------------------------------------------------------------------------
// world size 1

/// One call of a function at world size 1: `(name, outputs of x)`.
type Call1 = (String, Box<dyn Fn(&Tensor) -> tp::Result<Vec<Tensor>>>);

fn calls_world_1() -> Vec<Call1> {
    let mut v: Vec<Call1> = vec![
        (
            "broadcast".into(),
            Box::new(|x| Ok(vec![df::broadcast(x, 0, None)?])),
        ),
        ("gather".into(), Box::new(|x| df::gather(x, 0, None))),
        (
            "scatter".into(),
            Box::new(|x| Ok(vec![df::scatter(Some(std::slice::from_ref(x)), 0, None)?])),
        ),
        ("all_gather".into(), Box::new(|x| df::all_gather(x, None))),
        (
            "all_to_all".into(),
            Box::new(|x| df::all_to_all(std::slice::from_ref(x), None)),
        ),
        (
            "all_to_all_single (no splits)".into(),
            Box::new(|x| Ok(vec![df::all_to_all_single(x, None, None, None)?])),
        ),
        (
            "all_to_all_single (splits)".into(),
            Box::new(|x| {
                let n = [x.shape()[0]];
                Ok(vec![df::all_to_all_single(x, Some(&n), Some(&n), None)?])
            }),
        ),
    ];
    for op in OPS {
        v.push((
            format!("all_reduce {op:?}"),
            Box::new(move |x| Ok(vec![df::all_reduce(x, op, None)?])),
        ));
        v.push((
            format!("reduce {op:?}"),
            Box::new(move |x| Ok(vec![df::reduce(x, 0, op, None)?])),
        ));
        v.push((
            format!("reduce_scatter {op:?}"),
            Box::new(move |x| Ok(vec![df::reduce_scatter(std::slice::from_ref(x), op, None)?])),
        ));
    }
    v
}

/// At world size 1 every function and op returns a new tensor equal to its input, and the
/// gradient reaching the input is the upstream gradient, exactly (float32 and float64, sizes
/// around the 8-element boundary and a large one).
#[test]
fn world_size_1_is_the_identity_forward_and_backward() -> TestResult {
    dist::spawn::spawn(1, |_rank| -> TestResult {
        init(30)?;
        for dt in [DType::F32, DType::F64] {
            for n in [1usize, 7, 8, 9, 10, 4097] {
                let xv: Vec<f64> = (0..n)
                    .map(|i| (i * 37 % 101) as f64 * 0.013 - 0.6)
                    .collect();
                let gv: Vec<f64> = (0..n).map(|i| (i * 53 % 97) as f64 * 0.01 - 0.4).collect();
                let gt = f64_tensor(gv, &[n])?.to_dtype(dt)?;
                for (name, f) in calls_world_1() {
                    let what = format!("{name} {dt} n={n}");
                    let x = f64_tensor(xv.clone(), &[n])?
                        .to_dtype(dt)?
                        .requires_grad_(true);
                    let ys = f(&x)?;
                    assert_eq!(ys.len(), 1, "{what}: one output");
                    let y = &ys[0];
                    assert_eq!(y.dtype(), dt, "{what}: dtype");
                    assert_eq!(y.shape(), &[n], "{what}: shape");
                    assert!(!y.shares_storage_with(&x), "{what}: a new tensor");
                    assert_eq!(y.to_vec_f64()?, x.to_vec_f64()?, "{what}: forward");
                    y.backward_with(Some(&gt), false, false)?;
                    let g = x.grad().ok_or_else(|| format!("{what}: no gradient"))?;
                    assert_eq!(g.dtype(), dt, "{what}: gradient dtype");
                    assert_eq!(g.to_vec_f64()?, gt.to_vec_f64()?, "{what}: backward");
                }
            }
        }
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// layouts

/// How an input of logical shape `[3, 2]` is laid out.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Layout {
    Contiguous,
    /// `leaf.t()` of a `[2, 3]` leaf (strides `[1, 3]`).
    Transposed,
    /// `leaf.narrow(1, 1, 2)` of a `[3, 4]` leaf (columns 1 and 2).
    Narrow,
    /// `leaf.select(2, 1)` of a `[3, 2, 2]` leaf (strides `[4, 2]`).
    Column,
}

const LAYOUTS: [Layout; 4] = [
    Layout::Contiguous,
    Layout::Transposed,
    Layout::Narrow,
    Layout::Column,
];

/// A leaf and the `[3, 2]` view of it holding `v` (row-major logical values).
fn input(layout: Layout, v: &[f64]) -> tp::Result<(Tensor, Tensor)> {
    let leaf = match layout {
        Layout::Contiguous => f64_tensor(v.to_vec(), &[3, 2])?,
        Layout::Transposed => {
            let t: Vec<f64> = (0..6).map(|k| v[(k % 3) * 2 + k / 3]).collect();
            f64_tensor(t, &[2, 3])?
        }
        Layout::Narrow => {
            let mut t = vec![99.0; 12];
            for r in 0..3 {
                t[r * 4 + 1] = v[r * 2];
                t[r * 4 + 2] = v[r * 2 + 1];
            }
            f64_tensor(t, &[3, 4])?
        }
        Layout::Column => {
            let mut t = vec![-99.0; 12];
            for (k, &x) in v.iter().enumerate() {
                t[k * 2 + 1] = x;
            }
            f64_tensor(t, &[3, 2, 2])?
        }
    }
    .requires_grad_(true);
    let x = match layout {
        Layout::Contiguous => leaf.clone(),
        Layout::Transposed => leaf.t()?,
        Layout::Narrow => leaf.narrow(1, 1, 2)?,
        Layout::Column => leaf.select(2, 1)?,
    };
    assert_eq!(x.shape(), &[3, 2]);
    assert_eq!(
        x.is_contiguous(),
        layout == Layout::Contiguous,
        "{layout:?}"
    );
    Ok((leaf, x))
}

/// The leaf's gradient at the view's elements (logical order); elsewhere it must be 0.
fn view_grad(layout: Layout, leaf: &Tensor) -> tp::Result<Vec<f64>> {
    let Some(g) = leaf.grad() else {
        return Ok(vec![0.0; 6]);
    };
    let all = g.to_vec_f64()?;
    let (inside, outside): (Vec<f64>, Vec<f64>) = match layout {
        Layout::Contiguous => (all, vec![]),
        Layout::Transposed => (g.t()?.to_vec_f64()?, vec![]),
        Layout::Narrow => (
            g.narrow(1, 1, 2)?.to_vec_f64()?,
            (0..3).flat_map(|r| [all[r * 4], all[r * 4 + 3]]).collect(),
        ),
        Layout::Column => (g.select(2, 1)?.to_vec_f64()?, g.select(2, 0)?.to_vec_f64()?),
    };
    assert!(
        outside.iter().all(|&v| v == 0.0),
        "{layout:?}: gradient outside the view: {outside:?}"
    );
    Ok(inside)
}

/// How the upstream gradient of each `[3, 2]` output is produced.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Upstream {
    /// `(y * w).sum()`: a contiguous gradient `w`.
    Plain,
    /// `(y.t() * wᵀ).sum()`: the gradient `w` arrives transposed.
    Transposed,
    /// `y.sum() * c`: the stride-0 gradient of `sum`.
    Stride0,
}

/// The loss of `ys` on `rank`, and the logical upstream gradient of each output.
fn upstream_loss(up: Upstream, rank: usize, ys: &[Tensor]) -> tp::Result<(Tensor, Vec<Vec<f64>>)> {
    let mut acc = Tensor::scalar(0.0f64);
    let mut grads = vec![];
    for (j, y) in ys.iter().enumerate() {
        let n = y.numel();
        let (term, g) = match up {
            Upstream::Plain => {
                let w: Vec<f64> = (0..n).map(|i| w_at(rank, j, i)).collect();
                (y.mul(&f64_tensor(w.clone(), y.shape())?)?.sum()?, w)
            }
            Upstream::Transposed => {
                let w: Vec<f64> = (0..n).map(|i| w_at(rank, j, i)).collect();
                let wt = f64_tensor(w.clone(), y.shape())?.t()?.contiguous()?;
                (y.t()?.mul(&wt)?.sum()?, w)
            }
            Upstream::Stride0 => {
                let c = w_at(rank, j, 0);
                (y.sum()?.mul_scalar(c)?, vec![c; n])
            }
        };
        acc = acc.add(&term)?;
        grads.push(g);
    }
    Ok((acc, grads))
}

/// The same loss with a contiguous upstream gradient: `Σ_j (y_j * g_j).sum()`.
fn plain_loss(ys: &[Tensor], grads: &[Vec<f64>]) -> tp::Result<Tensor> {
    let mut acc = Tensor::scalar(0.0f64);
    for (y, g) in ys.iter().zip(grads) {
        acc = acc.add(&y.mul(&f64_tensor(g.clone(), y.shape())?)?.sum()?)?;
    }
    Ok(acc)
}

/// A rank's outputs from its inputs.
type Forward<'a> = Box<dyn Fn(&[Tensor]) -> tp::Result<Vec<Tensor>> + 'a>;

/// A function of `[3, 2]` inputs, for the layout checks.
struct LayoutCase<'a> {
    name: String,
    /// Number of inputs (1, or the group size for the list functions).
    inputs: usize,
    /// Global rank whose inputs take the layout under test; the others stay contiguous.
    /// `None`: every rank.
    only: Option<usize>,
    /// Whether this rank passes its inputs (scatter receivers do not).
    passes: bool,
    f: Forward<'a>,
}

fn layout_cases(rank: usize, w: usize) -> Vec<LayoutCase<'static>> {
    let case = |name: &str, inputs: usize, f: Forward<'static>| LayoutCase {
        name: name.into(),
        inputs,
        only: None,
        passes: true,
        f,
    };
    let mut v = vec![
        case(
            "broadcast from 1",
            1,
            Box::new(|xs| Ok(vec![df::broadcast(&xs[0], 1, None)?])),
        ),
        LayoutCase {
            only: Some(1),
            ..case(
                "broadcast from 1 (layout on src only)",
                1,
                Box::new(|xs| Ok(vec![df::broadcast(&xs[0], 1, None)?])),
            )
        },
        case("gather to 0", 1, Box::new(|xs| df::gather(&xs[0], 0, None))),
        LayoutCase {
            passes: rank == 2,
            ..case(
                "scatter from 2",
                w,
                Box::new(move |xs| {
                    let list = (rank == 2).then_some(xs);
                    Ok(vec![df::scatter(list, 2, None)?])
                }),
            )
        },
        case("all_gather", 1, Box::new(|xs| df::all_gather(&xs[0], None))),
        case("all_to_all", w, Box::new(|xs| df::all_to_all(xs, None))),
        case(
            "all_to_all_single",
            1,
            Box::new(|xs| Ok(vec![df::all_to_all_single(&xs[0], None, None, None)?])),
        ),
    ];
    for op in OPS {
        v.push(case(
            &format!("all_reduce {op:?}"),
            1,
            Box::new(move |xs| Ok(vec![df::all_reduce(&xs[0], op, None)?])),
        ));
    }
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Product] {
        v.push(case(
            &format!("reduce {op:?} to 2"),
            1,
            Box::new(move |xs| Ok(vec![df::reduce(&xs[0], 2, op, None)?])),
        ));
        v.push(case(
            &format!("reduce_scatter {op:?}"),
            w,
            Box::new(move |xs| Ok(vec![df::reduce_scatter(xs, op, None)?])),
        ));
    }
    v
}

/// Outputs and input gradients (logical order) of one run.
type Run = (Vec<Vec<f64>>, Vec<Vec<f64>>);

fn layout_run(
    rank: usize,
    case: &LayoutCase<'_>,
    layout: Layout,
    up: Upstream,
    reference: Option<&[Vec<f64>]>,
) -> tp::Result<(Run, Vec<Vec<f64>>)> {
    let layout = match case.only {
        Some(r) if r != rank => Layout::Contiguous,
        _ => layout,
    };
    let n = if case.passes { case.inputs } else { 0 };
    let pairs = (0..n)
        .map(|j| input(layout, &vals(rank, j, 6, 1)))
        .collect::<tp::Result<Vec<_>>>()?;
    let xs: Vec<Tensor> = pairs.iter().map(|(_, x)| x.clone()).collect();
    let ys = (case.f)(&xs)?;
    let (loss, grads) = match reference {
        None => upstream_loss(up, rank, &ys)?,
        Some(g) => (plain_loss(&ys, g)?, g.to_vec()),
    };
    loss.backward()?;
    let outs = ys
        .iter()
        .map(Tensor::to_vec_f64)
        .collect::<tp::Result<Vec<_>>>()?;
    let gs = pairs
        .iter()
        .map(|(leaf, _)| view_grad(layout, leaf))
        .collect::<tp::Result<Vec<_>>>()?;
    Ok(((outs, gs), grads))
}

/// Strided, transposed, narrowed and column-view inputs, and transposed and stride-0 upstream
/// gradients, give exactly the outputs and gradients of the contiguous computation, for every
/// function (W = 3).
#[test]
fn strided_inputs_and_gradients_match_the_contiguous_computation() -> TestResult {
    dist::spawn::spawn(3, |rank| -> TestResult {
        init(30)?;
        for case in layout_cases(rank, 3) {
            for up in [Upstream::Plain, Upstream::Transposed, Upstream::Stride0] {
                for layout in LAYOUTS {
                    let what = format!("{} {layout:?} input, {up:?} upstream", case.name);
                    let (got, grads) = layout_run(rank, &case, layout, up, None)?;
                    let (want, _) = layout_run(rank, &case, Layout::Contiguous, up, Some(&grads))?;
                    assert_eq!(got.0, want.0, "{what}: forward on rank {rank}");
                    assert_eq!(got.1, want.1, "{what}: gradients on rank {rank}");
                    // the check is not vacuous: some rank receives a nonzero gradient
                    let nonzero = got.1.iter().flatten().filter(|&&g| g != 0.0).count();
                    let count = f64_tensor(vec![nonzero as f64], &[1])?;
                    dist::all_reduce(&count, ReduceOp::Sum, None)?;
                    assert!(count.item_f64()? > 0.0, "{what}: all gradients are 0");
                }
            }
        }
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Max / Min: ties and NaN

/// `Σ_k w_k[i]` over the ranks `ks` (the summed upstream gradient of element `i`).
fn summed_w(ks: impl Iterator<Item = usize>, j: usize, i: usize) -> f64 {
    ks.map(|k| w_at(k, j, i)).sum()
}

fn close(what: &str, got: &[f64], want: &[f64]) {
    tensorplay_testkit::assert_close(what, got, want, tensorplay_testkit::Tol::scaled(1e-14));
}

fn linear_loss(rank: usize, ys: &[Tensor]) -> tp::Result<Tensor> {
    let mut acc = Tensor::scalar(0.0f64);
    for (j, y) in ys.iter().enumerate() {
        let w: Vec<f64> = (0..y.numel()).map(|i| w_at(rank, j, i)).collect();
        acc = acc.add(&y.mul(&f64_tensor(w, y.shape())?)?.sum()?)?;
    }
    Ok(acc)
}

fn grad_of(x: &Tensor) -> tp::Result<Vec<f64>> {
    x.grad().expect("a gradient").to_vec_f64()
}

/// W = 4: element `i` is held by the ranks `r` with `r + i < 4` (4, 3, 2 and 1 holders): each
/// holder receives `G / count`, the others exactly 0 (all_reduce, reduce and reduce_scatter).
#[test]
fn max_min_ties_split_the_gradient_evenly() -> TestResult {
    dist::spawn::spawn(4, |rank| -> TestResult {
        init(30)?;
        let w = 4;
        for (op, ext) in [(ReduceOp::Max, 10.0), (ReduceOp::Min, -10.0)] {
            let held = |r: usize, i: usize| r + i < w;
            let xv: Vec<f64> = (0..w)
                .map(|i| if held(rank, i) { ext } else { rank as f64 })
                .collect();
            let expect = |g: &dyn Fn(usize) -> f64| -> Vec<f64> {
                (0..w)
                    .map(|i| {
                        if held(rank, i) {
                            g(i) / (w - i) as f64
                        } else {
                            0.0
                        }
                    })
                    .collect()
            };
            // all_reduce: G_i = Σ_k w_k[i]
            let x = f64_tensor(xv.clone(), &[w])?.requires_grad_(true);
            let y = df::all_reduce(&x, op, None)?;
            assert_eq!(y.to_vec_f64()?, vec![ext; w], "all_reduce {op:?} forward");
            linear_loss(rank, &[y])?.backward()?;
            close(
                &format!("all_reduce {op:?} ties, rank {rank}"),
                &grad_of(&x)?,
                &expect(&|i| summed_w(0..w, 0, i)),
            );
            // reduce to 1: G_i = w_1[i]
            let x = f64_tensor(xv.clone(), &[w])?.requires_grad_(true);
            let y = df::reduce(&x, 1, op, None)?;
            linear_loss(rank, &[y])?.backward()?;
            close(
                &format!("reduce {op:?} ties, rank {rank}"),
                &grad_of(&x)?,
                &expect(&|i| w_at(1, 0, i)),
            );
            // reduce_scatter: every list element has the pattern; element j goes to rank j,
            // whose upstream gradient is w_j
            let xs: Vec<Tensor> = (0..w)
                .map(|_| Ok(f64_tensor(xv.clone(), &[w])?.requires_grad_(true)))
                .collect::<tp::Result<_>>()?;
            let y = df::reduce_scatter(&xs, op, None)?;
            linear_loss(rank, &[y])?.backward()?;
            for (j, x) in xs.iter().enumerate() {
                close(
                    &format!("reduce_scatter {op:?} ties, rank {rank}, list element {j}"),
                    &grad_of(x)?,
                    &expect(&|i| w_at(j, 0, i)),
                );
            }
        }
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

/// W = 4: a NaN on rank 2 at element 1, and on ranks 1 and 3 at element 2. The result is NaN
/// there; the gradient goes to the NaN holders (split between two), the other ranks get exactly
/// 0 there and no NaN anywhere; the other elements go to the holder of the extremum.
#[test]
fn max_min_route_the_gradient_to_nan_holders() -> TestResult {
    dist::spawn::spawn(4, |rank| -> TestResult {
        init(30)?;
        let w = 4;
        let input = |r: usize| -> Vec<f64> {
            let mut v = vals(r, 0, 4, 3);
            if r == 2 {
                v[1] = f64::NAN;
            }
            if r == 1 || r == 3 {
                v[2] = f64::NAN;
            }
            v
        };
        for op in [ReduceOp::Max, ReduceOp::Min] {
            // the share of each element that reaches `rank` (holders split evenly)
            let share: Vec<f64> = (0..4)
                .map(|i| {
                    let col: Vec<f64> = (0..w).map(|r| input(r)[i]).collect();
                    let holders: Vec<usize> = if col.iter().any(|v| v.is_nan()) {
                        (0..w).filter(|&r| col[r].is_nan()).collect()
                    } else {
                        let e = if op == ReduceOp::Max {
                            col.iter().copied().fold(f64::NEG_INFINITY, f64::max)
                        } else {
                            col.iter().copied().fold(f64::INFINITY, f64::min)
                        };
                        (0..w).filter(|&r| col[r] == e).collect()
                    };
                    if holders.contains(&rank) {
                        1.0 / holders.len() as f64
                    } else {
                        0.0
                    }
                })
                .collect();
            let x = f64_tensor(input(rank), &[4])?.requires_grad_(true);
            let y = df::all_reduce(&x, op, None)?.to_vec_f64()?;
            assert!(
                y[1].is_nan() && y[2].is_nan(),
                "{op:?}: NaN propagates: {y:?}"
            );
            assert!(!y[0].is_nan() && !y[3].is_nan(), "{op:?}: {y:?}");
            let x = f64_tensor(input(rank), &[4])?.requires_grad_(true);
            let y = df::all_reduce(&x, op, None)?;
            linear_loss(rank, &[y])?.backward()?;
            let g = grad_of(&x)?;
            assert!(
                g.iter().all(|v| !v.is_nan()),
                "{op:?}: no NaN gradient: {g:?}"
            );
            let want: Vec<f64> = (0..4).map(|i| summed_w(0..w, 0, i) * share[i]).collect();
            close(&format!("all_reduce {op:?} NaN, rank {rank}"), &g, &want);
            // reduce to 3
            let x = f64_tensor(input(rank), &[4])?.requires_grad_(true);
            let y = df::reduce(&x, 3, op, None)?;
            linear_loss(rank, &[y])?.backward()?;
            let g = grad_of(&x)?;
            let want: Vec<f64> = (0..4).map(|i| w_at(3, 0, i) * share[i]).collect();
            close(&format!("reduce {op:?} NaN, rank {rank}"), &g, &want);
            // reduce_scatter: list element j is the same input, reduced onto rank j
            let xs: Vec<Tensor> = (0..w)
                .map(|_| Ok(f64_tensor(input(rank), &[4])?.requires_grad_(true)))
                .collect::<tp::Result<_>>()?;
            let y = df::reduce_scatter(&xs, op, None)?;
            linear_loss(rank, &[y])?.backward()?;
            for (j, x) in xs.iter().enumerate() {
                let want: Vec<f64> = (0..4).map(|i| w_at(j, 0, i) * share[i]).collect();
                close(
                    &format!("reduce_scatter {op:?} NaN, rank {rank}, element {j}"),
                    &grad_of(x)?,
                    &want,
                );
            }
        }
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// a rank that skips the backward collective

/// A differentiable collective of one `[2]` input per rank, for the skip checks.
type Collective = fn(&Tensor, &dist::ProcessGroup) -> tp::Result<Vec<Tensor>>;

fn skip_collectives() -> Vec<(&'static str, Collective)> {
    vec![
        ("all_reduce", |x, g| {
            Ok(vec![df::all_reduce(x, ReduceOp::Sum, Some(g))?])
        }),
        ("all_reduce Max", |x, g| {
            Ok(vec![df::all_reduce(x, ReduceOp::Max, Some(g))?])
        }),
        ("broadcast", |x, g| Ok(vec![df::broadcast(x, 0, Some(g))?])),
        ("all_gather", |x, g| df::all_gather(x, Some(g))),
        ("all_to_all_single", |x, g| {
            let n = g.size();
            let xs = x.expand(&[n, 2])?.contiguous()?;
            Ok(vec![df::all_to_all_single(&xs, None, None, Some(g))?])
        }),
    ]
}

/// In a world of `n`, rank `skipper`'s loss ignores the collective's output, so it runs no
/// backward collective: the other ranks fail after the group's 2 s timeout with an error
/// naming it (not a hang), while the skipper stays alive on a world barrier with a longer
/// timeout. One fresh group per collective.
fn skipped_backward(n: usize, skipper: usize) -> TestResult {
    dist::spawn::spawn(n, move |rank| -> TestResult {
        init(60)?;
        let ranks: Vec<usize> = (0..n).collect();
        for (name, f) in skip_collectives() {
            let g = dist::new_group(&ranks, None, Some(Duration::from_secs(2)))?;
            let x = f64_tensor(vec![1.0 + rank as f64, 2.0], &[2])?.requires_grad_(true);
            let ys = f(&x, &g)?;
            if rank == skipper {
                x.sum()?.backward()?; // ignores ys
            } else {
                let mut loss = Tensor::scalar(0.0f64);
                for y in &ys {
                    loss = loss.add(&y.sum()?)?;
                }
                let start = std::time::Instant::now();
                let e = loss
                    .backward()
                    .expect_err("the backward collective must fail");
                let msg = e.to_string();
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "{name}: took {:?}: {msg}",
                    start.elapsed()
                );
                assert!(msg.contains("timed out"), "{name}: a timeout: {msg}");
                assert!(
                    msg.contains(&format!("rank {skipper}")),
                    "{name}: the error names rank {skipper}: {msg}"
                );
            }
            dist::barrier(None)?;
        }
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

#[test]
fn a_rank_that_skips_the_backward_collective_is_named_world_3() -> TestResult {
    skipped_backward(3, 2)
}

#[test]
fn a_rank_that_skips_the_backward_collective_is_named_world_4() -> TestResult {
    skipped_backward(4, 1)
}

// ---------------------------------------------------------------------------------------------
// the blocking collectives are not differentiable

/// Every blocking collective given a tensor that requires grad while grad mode is on.
fn blocking_calls(x: &Tensor, w: usize) -> Vec<(&'static str, dist::Result<()>)> {
    let z = || Tensor::zeros(&[2], DType::F64).expect("zeros");
    let zs = || (0..w).map(|_| z()).collect::<Vec<_>>();
    let xs = vec![x.clone(); w];
    let rank = dist::get_rank(None).expect("rank");
    vec![
        ("all_reduce", dist::all_reduce(x, ReduceOp::Sum, None)),
        ("broadcast", dist::broadcast(x, 0, None)),
        ("reduce", dist::reduce(x, 0, ReduceOp::Sum, None)),
        ("all_gather", dist::all_gather(&zs(), x, None)),
        (
            "all_gather_into_tensor",
            dist::all_gather_into_tensor(
                &Tensor::zeros(&[2 * w], DType::F64).expect("zeros"),
                x,
                None,
            ),
        ),
        (
            "reduce_scatter",
            dist::reduce_scatter(&z(), &xs, ReduceOp::Sum, None),
        ),
        (
            "reduce_scatter_tensor",
            dist::reduce_scatter_tensor(
                &Tensor::zeros(&[1], DType::F64).expect("zeros"),
                x,
                ReduceOp::Sum,
                None,
            ),
        ),
        (
            "gather",
            dist::gather(x, (rank == 0).then_some(&zs()[..]), 0, None),
        ),
        (
            "scatter",
            dist::scatter(&z(), (rank == 0).then_some(&xs[..]), 0, None),
        ),
        ("all_to_all", dist::all_to_all(&zs(), &xs, None)),
        (
            "all_to_all_single",
            dist::all_to_all_single(&z(), x, None, None, None),
        ),
    ]
}

/// With grad mode on, the blocking collectives refuse a tensor that requires grad with an
/// error pointing to `nn::functional`; under `no_grad`, or on `detach()`, they work.
#[test]
fn blocking_collectives_refuse_tensors_that_require_grad() -> TestResult {
    dist::spawn::spawn(2, |rank| -> TestResult {
        init(30)?;
        let x = f64_tensor(vec![rank as f64 + 1.0, 10.0], &[2])?.requires_grad_(true);
        for (name, r) in blocking_calls(&x, 2) {
            let e = r.expect_err(name).to_string();
            if name == "scatter" && rank != 0 {
                // a receiver passes no tensor that requires grad: it fails with src, naming it
                assert!(e.contains("source rank 0"), "{name}: {e}");
                continue;
            }
            assert!(e.contains("nn::functional"), "{name}: {e}");
            assert!(e.contains("requires grad"), "{name}: {e}");
        }
        assert_eq!(x.to_vec_f64()?, vec![rank as f64 + 1.0, 10.0], "untouched");
        // still in step: under no_grad every call works
        {
            let _ng = tp::no_grad();
            for (name, r) in blocking_calls(&x, 2) {
                r.map_err(|e| format!("{name} under no_grad: {e}"))?;
            }
        }
        // on detach(): works, in place on the shared storage (as in PyTorch)
        let x = f64_tensor(vec![rank as f64 + 1.0, 10.0], &[2])?.requires_grad_(true);
        dist::all_reduce(&x.detach(), ReduceOp::Sum, None)?;
        assert_eq!(x.to_vec_f64()?, vec![3.0, 20.0]);
        // a tensor that does not require grad is fine with grad mode on
        let plain = f64_tensor(vec![1.0], &[1])?;
        dist::all_reduce(&plain, ReduceOp::Sum, None)?;
        assert_eq!(plain.to_vec_f64()?, vec![2.0]);
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}
