//! Gradient checks of the differentiable collectives across real processes (`spawn`, the "cpu"
//! backend over 127.0.0.1).
//!
//! Every rank `r` computes `loss_r = Σ_j Σ_i (w_rji · y_j[i] + u_rji · y_j[i]²)` of its outputs
//! `y_j` with rank-dependent weights, and calls `backward` on it. The gradient on rank `r` must
//! be `d(Σ_k loss_k)/dx_r`: it is compared with central finite differences of the summed loss
//! `L = Σ_k loss_k`, perturbing one element of one rank's input at a time (every rank recomputes
//! its forward; `L` comes from a blocking all-reduce of the scalar losses under `no_grad`).
//! Double backward is checked the same way, against finite differences of the first
//! derivatives, and against hand-derived exact values. Everything is float64; the forward
//! values are checked against a single-process reference too.

use std::time::Duration;

use tensorplay_collectives::{self as dist, InitOptions, ProcessGroup};
use tensorplay_core::autograd::{self, GradOptions};
use tensorplay_core::{self as tp, Tensor};
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

/// Finite-difference step.
const EPS: f64 = 1e-6;
/// Relative tolerance of analytic against finite-difference derivatives.
const FD_TOL: f64 = 1e-6;

fn init(timeout_s: u64) -> dist::Result<()> {
    dist::init_process_group(
        "cpu",
        InitOptions {
            timeout: Duration::from_secs(timeout_s),
            ..Default::default()
        },
    )
}

// ---------------------------------------------------------------------------------------------
// values and weights

/// Input element `i` of tensor `j` on global rank `r`: distinct across ranks for fixed
/// `(j, i, salt)` (7 is invertible mod 11), at least 0.25 apart (no ties for Max/Min), never 0.
fn val(r: usize, j: usize, i: usize, salt: usize) -> f64 {
    ((r * 7 + i * 3 + j * 5 + salt) % 11) as f64 * 0.25 - 1.2
}

fn vals(r: usize, j: usize, n: usize, salt: usize) -> Vec<f64> {
    (0..n).map(|i| val(r, j, i, salt)).collect()
}

/// Linear loss weight of element `i` of output `j` on global rank `r` (never 0).
fn w_at(r: usize, j: usize, i: usize) -> f64 {
    0.5 * ((r * 5 + j * 3 + i * 2) % 7) as f64 - 1.3
}

/// Quadratic loss weight.
fn u_at(r: usize, j: usize, i: usize) -> f64 {
    0.1 * ((r + 2 * j + 3 * i) % 5) as f64 + 0.05
}

/// Weight of the first derivatives in the double-backward check (never 0).
fn v_at(r: usize, j: usize, i: usize) -> f64 {
    0.3 * ((r * 3 + j + i * 5) % 7) as f64 - 0.8
}

fn weights(shape: &[usize], f: impl Fn(usize) -> f64) -> tp::Result<Tensor> {
    let n = shape.iter().product::<usize>();
    Tensor::from_vec((0..n).map(f).collect::<Vec<f64>>(), shape)
}

/// `loss_r` as a differentiable scalar.
fn loss_tensor(rank: usize, ys: &[Tensor]) -> tp::Result<Tensor> {
    let mut acc = Tensor::scalar(0.0f64);
    for (j, y) in ys.iter().enumerate() {
        let w = weights(y.shape(), |i| w_at(rank, j, i))?;
        let u = weights(y.shape(), |i| u_at(rank, j, i))?;
        let term = y.mul(&w)?.add(&y.mul(y)?.mul(&u)?)?.sum()?;
        acc = acc.add(&term)?;
    }
    Ok(acc)
}

/// `loss_r` in plain f64.
fn loss_value(rank: usize, ys: &[Tensor]) -> tp::Result<f64> {
    let mut acc = 0.0;
    for (j, y) in ys.iter().enumerate() {
        for (i, v) in y.to_vec_f64()?.into_iter().enumerate() {
            acc += w_at(rank, j, i) * v + u_at(rank, j, i) * v * v;
        }
    }
    Ok(acc)
}

/// `s_r = Σ_j Σ_i v_rji · g_j[i]` of this rank's first derivatives, differentiable.
fn weighted_grads(rank: usize, gs: &[Option<Tensor>]) -> tp::Result<Tensor> {
    let mut acc = Tensor::scalar(0.0f64);
    for (j, g) in gs.iter().enumerate() {
        if let Some(g) = g {
            let v = weights(g.shape(), |i| v_at(rank, j, i))?;
            acc = acc.add(&g.mul(&v)?.sum()?)?;
        }
    }
    Ok(acc)
}

fn weighted_grads_value(rank: usize, gs: &[Option<Tensor>]) -> tp::Result<f64> {
    let mut acc = 0.0;
    for (j, g) in gs.iter().enumerate() {
        if let Some(g) = g {
            for (i, v) in g.to_vec_f64()?.into_iter().enumerate() {
                acc += v_at(rank, j, i) * v;
            }
        }
    }
    Ok(acc)
}

/// Reference reduction of the columns of `xs` (one row per rank).
fn reduce_ref(op: ReduceOp, xs: &[Vec<f64>]) -> Vec<f64> {
    let n = xs.len() as f64;
    (0..xs[0].len())
        .map(|i| {
            let col = xs.iter().map(|x| x[i]);
            match op {
                ReduceOp::Sum => col.sum(),
                ReduceOp::Avg => col.sum::<f64>() / n,
                ReduceOp::Product => col.product(),
                ReduceOp::Max => col.fold(f64::NEG_INFINITY, f64::max),
                ReduceOp::Min => col.fold(f64::INFINITY, f64::min),
                other => panic!("not a differentiable op: {other:?}"),
            }
        })
        .collect()
}

/// `|a - b| <= tol (1 + |b|)`; false when either is NaN.
fn within(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * (1.0 + b.abs())
}

fn check_close(what: &str, got: &[Vec<f64>], want: &[Vec<f64>], tol: f64) -> TestResult {
    let bad = got.len() != want.len()
        || got
            .iter()
            .zip(want)
            .any(|(g, w)| g.len() != w.len() || g.iter().zip(w).any(|(&a, &b)| !within(a, b, tol)));
    if bad {
        return Err(format!("{what}: got {got:?}, want {want:?}").into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// the harness

/// The group a check runs in, seen from one of its ranks.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    /// Global rank of this process.
    rank: usize,
    /// Global ranks of the group, in group-rank order.
    members: &'a [usize],
    group: Option<&'a ProcessGroup>,
}

impl Ctx<'_> {
    /// Group rank of this process.
    fn me(&self) -> usize {
        self.members
            .iter()
            .position(|&m| m == self.rank)
            .expect("a member of the group")
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    /// `Σ_k v_k` over the group (blocking, on a tensor that does not require grad).
    fn sum(&self, v: f64) -> tp::Result<f64> {
        let t = Tensor::from_vec(vec![v], &[1])?;
        dist::all_reduce(&t, ReduceOp::Sum, self.group)?;
        t.item_f64()
    }

    /// Whether `flag` holds on every rank; an error when the ranks disagree (a backward on some
    /// ranks only would make the others wait for a timeout).
    fn all(&self, what: &str, flag: bool) -> TestResult {
        let n = self.sum(f64::from(u8::from(flag)))?;
        if n != self.size() as f64 {
            return Err(format!(
                "{what}: holds on {n} of {} ranks (here: {flag})",
                self.size()
            )
            .into());
        }
        Ok(())
    }
}

/// One tensor's values and shape.
type Spec = (Vec<f64>, Vec<usize>);
/// A rank's outputs from its inputs.
type Forward<'a> = Box<dyn Fn(&[Tensor]) -> tp::Result<Vec<Tensor>> + 'a>;

/// A differentiable computation run by every rank of a group.
struct Case<'a> {
    name: String,
    /// The input tensors of a group rank (every rank knows every rank's inputs).
    inputs: Box<dyn Fn(usize) -> Vec<Spec> + 'a>,
    /// This rank's outputs, from its inputs.
    f: Forward<'a>,
    /// The expected output values of a group rank.
    want: Box<dyn Fn(usize) -> Vec<Vec<f64>> + 'a>,
    /// Whether double backward is checked too.
    double: bool,
}

fn leaves(specs: &[Spec], requires_grad: bool) -> tp::Result<Vec<Tensor>> {
    specs
        .iter()
        .map(|(v, s)| Ok(Tensor::from_vec(v.clone(), s)?.requires_grad_(requires_grad)))
        .collect()
}

/// The inputs of this rank, with element `e` of tensor `j` moved by `delta` when `k` is this
/// rank's group rank.
fn perturbed(
    cx: Ctx<'_>,
    case: &Case<'_>,
    (k, j, e, delta): (usize, usize, usize, f64),
) -> Vec<Spec> {
    let mut specs = (case.inputs)(cx.me());
    if k == cx.me() {
        specs[j].0[e] += delta;
    }
    specs
}

fn values(ts: &[Tensor]) -> tp::Result<Vec<Vec<f64>>> {
    ts.iter().map(Tensor::to_vec_f64).collect()
}

/// Every (group rank, input, element) of the case, in the same order on every rank.
fn elements(cx: Ctx<'_>, case: &Case<'_>) -> Vec<(usize, usize, usize)> {
    let mut out = vec![];
    for k in 0..cx.size() {
        for (j, (v, _)) in (case.inputs)(k).iter().enumerate() {
            out.extend((0..v.len()).map(|e| (k, j, e)));
        }
    }
    out
}

/// Compares `analytic[j][e]` (on the rank that holds it) with the central difference of the
/// group-summed `total`, for every element of every rank's inputs.
fn compare_fd(
    cx: Ctx<'_>,
    case: &Case<'_>,
    what: &str,
    analytic: &[Vec<f64>],
    total: impl Fn(Vec<Spec>) -> tp::Result<f64>,
) -> TestResult {
    for (k, j, e) in elements(cx, case) {
        let plus = total(perturbed(cx, case, (k, j, e, EPS)))?;
        let minus = total(perturbed(cx, case, (k, j, e, -EPS)))?;
        if k != cx.me() {
            continue;
        }
        let fd = (plus - minus) / (2.0 * EPS);
        let a = analytic[j][e];
        if !within(a, fd, FD_TOL) {
            return Err(format!(
                "{what}: rank {} input {j} element {e}: analytic {a}, finite differences {fd}",
                cx.rank
            )
            .into());
        }
    }
    Ok(())
}

/// First order: forward values, then `backward` against finite differences of `Σ_k loss_k`.
fn gradcheck(cx: Ctx<'_>, case: &Case<'_>) -> TestResult {
    let me = cx.me();
    let xs = leaves(&(case.inputs)(me), true)?;
    let ys = (case.f)(&xs)?;
    check_close(
        &format!(
            "{} (group {:?}): forward on rank {}",
            case.name, cx.members, cx.rank
        ),
        &values(&ys)?,
        &(case.want)(me),
        1e-12,
    )?;
    let loss = loss_tensor(cx.rank, &ys)?;
    cx.all(
        &format!("{}: loss requires grad", case.name),
        loss.requires_grad(),
    )?;
    loss.backward()?;
    let analytic = xs
        .iter()
        .map(|x| match x.grad() {
            Some(g) => {
                assert_eq!(g.shape(), x.shape(), "{}: gradient shape", case.name);
                g.to_vec_f64()
            }
            None => Ok(vec![0.0; x.numel()]),
        })
        .collect::<tp::Result<Vec<_>>>()?;
    compare_fd(cx, case, "first derivative", &analytic, |specs| {
        let _ng = tp::no_grad();
        let ys = (case.f)(&leaves(&specs, false)?)?;
        cx.sum(loss_value(cx.rank, &ys)?)
    })
}

/// This rank's first derivatives `d(Σ_k loss_k)/dx`, recorded when `create_graph`.
fn first_grads(
    cx: Ctx<'_>,
    case: &Case<'_>,
    xs: &[Tensor],
    create_graph: bool,
) -> tp::Result<Vec<Option<Tensor>>> {
    let ys = (case.f)(xs)?;
    let loss = loss_tensor(cx.rank, &ys)?;
    autograd::grad(
        &[loss],
        xs,
        &[],
        GradOptions {
            create_graph,
            allow_unused: true,
            ..Default::default()
        },
    )
}

/// Second order: with `g_k` the first derivatives on rank `k` and `s_k = Σ v_k · g_k`, the
/// double backward of `s_r` on rank `r` must equal finite differences of `Σ_k s_k`.
fn gradgradcheck(cx: Ctx<'_>, case: &Case<'_>) -> TestResult {
    let xs = leaves(&(case.inputs)(cx.me()), true)?;
    let gs = first_grads(cx, case, &xs, true)?;
    let s = weighted_grads(cx.rank, &gs)?;
    cx.all(
        &format!("{}: the first derivatives require grad", case.name),
        s.requires_grad(),
    )?;
    // `backward`, not `autograd::grad`: `grad` skips the nodes that do not lead to the
    // requested inputs, and a receiver's node can lead nowhere on its own rank while its
    // collective is needed by the others (the scatter in gather's double backward)
    s.backward()?;
    let analytic = xs
        .iter()
        .map(|x| match x.grad() {
            Some(g) => g.to_vec_f64(),
            None => Ok(vec![0.0; x.numel()]),
        })
        .collect::<tp::Result<Vec<_>>>()?;
    compare_fd(cx, case, "second derivative", &analytic, |specs| {
        let xs = leaves(&specs, true)?;
        let gs = first_grads(cx, case, &xs, false)?;
        cx.sum(weighted_grads_value(cx.rank, &gs)?)
    })
}

// ---------------------------------------------------------------------------------------------
// the cases: every function, every op

/// One input of `n` elements per rank.
fn one_input<'a>(m: &'a [usize], n: usize, salt: usize) -> Box<dyn Fn(usize) -> Vec<Spec> + 'a> {
    Box::new(move |g| vec![(vals(m[g], 0, n, salt), vec![n])])
}

/// Inputs with zeros, for `Product`: element 0 is 0 on group rank 0, element 1 on group ranks
/// 0 and 1, element 2 nowhere.
fn zero_vals(m: &[usize], g: usize, j: usize) -> Vec<f64> {
    let mut v = vals(m[g], j, 3, 11);
    if g == 0 {
        v[0] = 0.0;
    }
    if g < 2 {
        v[1] = 0.0;
    }
    v
}

/// Rows group rank `a` sends to group rank `b` in the uneven `all_to_all_single` (some 0).
fn split(a: usize, b: usize) -> usize {
    (a + 2 * b) % 3
}

fn cases(cx: Ctx<'_>) -> Vec<Case<'_>> {
    let m = cx.members;
    let w = cx.size();
    let grp = cx.group;
    let rank = cx.rank;
    let mut v: Vec<Case<'_>> = vec![];

    // broadcast from every member
    for &src in m {
        v.push(Case {
            name: format!("broadcast from {src}"),
            inputs: one_input(m, 3, 1),
            f: Box::new(move |xs| Ok(vec![df::broadcast(&xs[0], src, grp)?])),
            want: Box::new(move |_| vec![vals(src, 0, 3, 1)]),
            double: true,
        });
    }

    // reduce: Sum to every member, every op to some member
    let mut reduces: Vec<(ReduceOp, usize)> = m.iter().map(|&d| (ReduceOp::Sum, d)).collect();
    reduces.extend(OPS.iter().enumerate().map(|(i, &op)| (op, m[(i + 1) % w])));
    for (op, dst) in reduces {
        v.push(Case {
            name: format!("reduce {op:?} to {dst}"),
            inputs: one_input(m, 3, 2),
            f: Box::new(move |xs| Ok(vec![df::reduce(&xs[0], dst, op, grp)?])),
            want: Box::new(move |g| {
                if m[g] == dst {
                    let all: Vec<Vec<f64>> = m.iter().map(|&r| vals(r, 0, 3, 2)).collect();
                    vec![reduce_ref(op, &all)]
                } else {
                    vec![vec![0.0; 3]]
                }
            }),
            double: true,
        });
    }

    // all_reduce, every op
    for op in OPS {
        v.push(Case {
            name: format!("all_reduce {op:?}"),
            inputs: one_input(m, 3, 3),
            f: Box::new(move |xs| Ok(vec![df::all_reduce(&xs[0], op, grp)?])),
            want: Box::new(move |_| {
                let all: Vec<Vec<f64>> = m.iter().map(|&r| vals(r, 0, 3, 3)).collect();
                vec![reduce_ref(op, &all)]
            }),
            double: true,
        });
    }

    // Product with zero inputs (one zero, two zeros, none)
    let zeros_all = move || -> Vec<Vec<f64>> { (0..w).map(|g| zero_vals(m, g, 0)).collect() };
    v.push(Case {
        name: "all_reduce Product with zeros".into(),
        inputs: Box::new(move |g| vec![(zero_vals(m, g, 0), vec![3])]),
        f: Box::new(move |xs| Ok(vec![df::all_reduce(&xs[0], ReduceOp::Product, grp)?])),
        want: Box::new(move |_| vec![reduce_ref(ReduceOp::Product, &zeros_all())]),
        double: true,
    });
    let last = m[w - 1];
    v.push(Case {
        name: format!("reduce Product with zeros to {last}"),
        inputs: Box::new(move |g| vec![(zero_vals(m, g, 0), vec![3])]),
        f: Box::new(move |xs| Ok(vec![df::reduce(&xs[0], last, ReduceOp::Product, grp)?])),
        want: Box::new(move |g| {
            if m[g] == last {
                vec![reduce_ref(ReduceOp::Product, &zeros_all())]
            } else {
                vec![vec![0.0; 3]]
            }
        }),
        double: true,
    });
    v.push(Case {
        name: "reduce_scatter Product with zeros".into(),
        inputs: Box::new(move |g| (0..w).map(|j| (zero_vals(m, g, j), vec![3])).collect()),
        f: Box::new(move |xs| Ok(vec![df::reduce_scatter(xs, ReduceOp::Product, grp)?])),
        want: Box::new(move |g| {
            let all: Vec<Vec<f64>> = (0..w).map(|k| zero_vals(m, k, g)).collect();
            vec![reduce_ref(ReduceOp::Product, &all)]
        }),
        double: true,
    });

    // gather to every member; shapes differ per rank
    for &dst in m {
        v.push(Case {
            name: format!("gather to {dst}"),
            inputs: Box::new(move |g| vec![(vals(m[g], 0, g + 1, 4), vec![g + 1])]),
            f: Box::new(move |xs| df::gather(&xs[0], dst, grp)),
            want: Box::new(move |g| {
                (0..w)
                    .map(|k| {
                        if m[g] == dst {
                            vals(m[k], 0, k + 1, 4)
                        } else {
                            vec![0.0; k + 1]
                        }
                    })
                    .collect()
            }),
            double: true,
        });
    }

    // scatter from every member (receivers pass None), and once with placeholders that
    // require grad on the receivers (they get zero gradients)
    let mut scatters: Vec<(usize, bool)> = m.iter().map(|&s| (s, false)).collect();
    scatters.push((last, true));
    for (src, placeholders) in scatters {
        v.push(Case {
            name: format!(
                "scatter from {src}{}",
                if placeholders {
                    " with placeholders"
                } else {
                    ""
                }
            ),
            inputs: Box::new(move |g| {
                if m[g] == src {
                    (0..w)
                        .map(|j| (vals(src, j, j + 1, 5), vec![j + 1]))
                        .collect()
                } else if placeholders {
                    (0..w)
                        .map(|j| (vals(m[g], j, j + 1, 6), vec![j + 1]))
                        .collect()
                } else {
                    vec![]
                }
            }),
            f: Box::new(move |xs| {
                let list = (rank == src || placeholders).then_some(xs);
                Ok(vec![df::scatter(list, src, grp)?])
            }),
            want: Box::new(move |g| vec![vals(src, g, g + 1, 5)]),
            // receivers hold no input to differentiate the first derivatives by
            double: false,
        });
    }

    // all_gather: equal shapes, and a different first dimension per rank
    v.push(Case {
        name: "all_gather".into(),
        inputs: one_input(m, 2, 7),
        f: Box::new(move |xs| df::all_gather(&xs[0], grp)),
        want: Box::new(move |_| m.iter().map(|&r| vals(r, 0, 2, 7)).collect()),
        double: true,
    });
    let rows = |g: usize| g % 2 + 1;
    v.push(Case {
        name: "all_gather uneven".into(),
        inputs: Box::new(move |g| vec![(vals(m[g], 0, rows(g) * 2, 8), vec![rows(g), 2])]),
        f: Box::new(move |xs| df::all_gather(&xs[0], grp)),
        want: Box::new(move |_| (0..w).map(|k| vals(m[k], 0, rows(k) * 2, 8)).collect()),
        double: true,
    });

    // reduce_scatter, every op
    for op in OPS {
        v.push(Case {
            name: format!("reduce_scatter {op:?}"),
            inputs: Box::new(move |g| (0..w).map(|j| (vals(m[g], j, 2, 9), vec![2])).collect()),
            f: Box::new(move |xs| Ok(vec![df::reduce_scatter(xs, op, grp)?])),
            want: Box::new(move |g| {
                let all: Vec<Vec<f64>> = m.iter().map(|&r| vals(r, g, 2, 9)).collect();
                vec![reduce_ref(op, &all)]
            }),
            double: true,
        });
    }

    // all_to_all: a different shape for every (sender, receiver) pair
    let len = |a: usize, b: usize| (a + b) % 2 + 1;
    v.push(Case {
        name: "all_to_all".into(),
        inputs: Box::new(move |g| {
            (0..w)
                .map(|j| (vals(m[g], j, len(g, j), 10), vec![len(g, j)]))
                .collect()
        }),
        f: Box::new(move |xs| df::all_to_all(xs, grp)),
        want: Box::new(move |g| (0..w).map(|j| vals(m[j], g, len(j, g), 10)).collect()),
        double: true,
    });

    // all_to_all_single: equal splits (None), uneven splits with and without output splits
    v.push(Case {
        name: "all_to_all_single equal splits".into(),
        inputs: Box::new(move |g| vec![(vals(m[g], 0, w * 2, 12), vec![w, 2])]),
        f: Box::new(move |xs| Ok(vec![df::all_to_all_single(&xs[0], None, None, grp)?])),
        want: Box::new(move |g| {
            vec![
                (0..w)
                    .flat_map(|k| vals(m[k], 0, w * 2, 12)[g * 2..g * 2 + 2].to_vec())
                    .collect(),
            ]
        }),
        double: true,
    });
    let me = cx.me();
    for give_out in [true, false] {
        let sent = move |a: usize| -> usize { (0..w).map(|b| split(a, b)).sum() };
        v.push(Case {
            name: format!("all_to_all_single uneven splits (output splits given: {give_out})"),
            inputs: Box::new(move |g| vec![(vals(m[g], 0, sent(g) * 2, 13), vec![sent(g), 2])]),
            f: Box::new(move |xs| {
                let ins: Vec<usize> = (0..w).map(|b| split(me, b)).collect();
                let outs: Vec<usize> = (0..w).map(|a| split(a, me)).collect();
                let outs = give_out.then_some(&outs[..]);
                Ok(vec![df::all_to_all_single(&xs[0], outs, Some(&ins), grp)?])
            }),
            want: Box::new(move |g| {
                let mut out = vec![];
                for a in 0..w {
                    let start: usize = (0..g).map(|b| split(a, b)).sum();
                    let x = vals(m[a], 0, sent(a) * 2, 13);
                    out.extend_from_slice(&x[start * 2..(start + split(a, g)) * 2]);
                }
                vec![out]
            }),
            double: true,
        });
    }
    v
}

/// Every case in one group: first derivatives, and second derivatives when `double`.
fn check_all(cx: Ctx<'_>, double: bool) -> TestResult {
    for case in cases(cx) {
        let context = |e: Box<dyn std::error::Error + Send + Sync>| {
            format!(
                "{} (group {:?}, rank {}): {e}",
                case.name, cx.members, cx.rank
            )
        };
        gradcheck(cx, &case).map_err(context)?;
        if double && case.double {
            gradgradcheck(cx, &case).map_err(context)?;
        }
    }
    Ok(())
}

fn world(n: usize, double: bool) -> TestResult {
    dist::spawn::spawn(n, move |rank| -> TestResult {
        init(60)?;
        let members: Vec<usize> = (0..n).collect();
        check_all(
            Ctx {
                rank,
                members: &members,
                group: None,
            },
            double,
        )?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// tests

#[test]
fn gradcheck_world_size_2() -> TestResult {
    world(2, true)
}

#[test]
fn gradcheck_world_size_3() -> TestResult {
    world(3, true)
}

#[test]
fn gradcheck_world_size_4() -> TestResult {
    world(4, true)
}

/// Groups {1, 2, 3} and {0, 2} / {1, 3} of a world of 4; src and dst are global ranks.
#[test]
fn gradcheck_subgroups_of_4() -> TestResult {
    dist::spawn::spawn(4, |rank| -> TestResult {
        init(60)?;
        let timeout = Some(Duration::from_secs(60));
        // every rank creates every group, in the same order
        let g123 = dist::new_group(&[1, 2, 3], None, timeout)?;
        let g02 = dist::new_group(&[0, 2], None, timeout)?;
        let g13 = dist::new_group(&[1, 3], None, timeout)?;
        if rank >= 1 {
            let members = [1, 2, 3];
            check_all(
                Ctx {
                    rank,
                    members: &members,
                    group: Some(&g123),
                },
                true,
            )?;
        }
        let (members, g) = if rank % 2 == 0 {
            ([0, 2], &g02)
        } else {
            ([1, 3], &g13)
        };
        check_all(
            Ctx {
                rank,
                members: &members,
                group: Some(g),
            },
            true,
        )?;
        // a root outside the group fails on every member (src/dst are global ranks: the
        // other pair's ranks are not in this one), and a non-member cannot call at all
        let x = Tensor::from_vec(vec![1.0f64, 2.0], &[2])?.requires_grad_(true);
        let outside = rank ^ 1;
        let errors = [
            ("broadcast", df::broadcast(&x, outside, Some(g)).err()),
            (
                "reduce",
                df::reduce(&x, outside, ReduceOp::Sum, Some(g)).err(),
            ),
            ("gather", df::gather(&x, outside, Some(g)).err()),
            ("scatter", df::scatter(None, outside, Some(g)).err()),
        ];
        for (name, e) in errors {
            let e = e.ok_or_else(|| format!("{name} to rank {outside} outside {members:?}"))?;
            // this rank's own error, naming the root it was given
            let root = if name == "broadcast" || name == "scatter" {
                "src"
            } else {
                "dst"
            };
            assert!(
                matches!(
                    e.downcast_ref::<dist::Error>(),
                    Some(dist::Error::InvalidArgument { arg, got, .. })
                        if arg == root && *got == outside.to_string()
                ),
                "{name}: {e:?}"
            );
        }
        if rank == 0 {
            let e = df::all_reduce(&x, ReduceOp::Sum, Some(&g123))
                .expect_err("rank 0 is not in [1, 2, 3]");
            assert!(
                matches!(
                    e.downcast_ref::<dist::Error>(),
                    Some(dist::Error::InvalidArgument { rank: 0, arg, .. }) if arg == "group"
                ),
                "{e:?}"
            );
            assert!(e.to_string().contains("belongs to"), "{e}");
        }
        // rank 0 hosts the store: nobody leaves before everyone is done
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

/// Hand-derived double backward, W = 2, `x_r = [r + 1]`, `loss_r = y²`:
/// - `Sum`: `y = 3`, `g_r = Σ_k 2y = 12`; `d(Σ_k g_k)/dx_r = Σ_k 2W = 8`.
/// - `Avg`: `y = 1.5`, `g_r = Σ_k 2y / W = 3`; second `Σ_k 2 / W = 2`.
/// - `Product`: `y = x_0 x_1 = 2`, `g_r = Σ_k 2y · x_other = 4 y x_other` (16 and 8);
///   `Σ_k g_k = 4 x_0 x_1 (x_0 + x_1)`, whose derivatives are `4 (2 x_0 x_1 + x_1²) = 32` and
///   `4 (x_0² + 2 x_0 x_1) = 20`.
#[test]
fn double_backward_exact_values() -> TestResult {
    dist::spawn::spawn(2, |rank| -> TestResult {
        init(30)?;
        let cases = [
            (ReduceOp::Sum, [12.0, 12.0], [8.0, 8.0]),
            (ReduceOp::Avg, [3.0, 3.0], [2.0, 2.0]),
            (ReduceOp::Product, [16.0, 8.0], [32.0, 20.0]),
        ];
        for (op, first, second) in cases {
            let x = Tensor::from_vec(vec![rank as f64 + 1.0], &[1])?.requires_grad_(true);
            let y = df::all_reduce(&x, op, None)?;
            let loss = y.mul(&y)?.sum()?;
            let g = autograd::grad(
                &[loss],
                std::slice::from_ref(&x),
                &[],
                GradOptions {
                    create_graph: true,
                    ..Default::default()
                },
            )?
            .remove(0)
            .expect("a gradient");
            assert_eq!(g.to_vec_f64()?, vec![first[rank]], "{op:?} first order");
            assert!(g.requires_grad(), "{op:?}: the gradient is recorded");
            g.sum()?.backward()?;
            let gg = x.grad().expect("second-order gradient").to_vec_f64()?;
            assert_eq!(gg, vec![second[rank]], "{op:?} second order");
        }
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

/// Gather's double backward runs the same collectives on every rank. W = 2, dst 0,
/// `x_r = [r + 1]`, `loss_r = Σ_k y_k²` (on rank 1 the outputs are zeros): `Σ_k loss_k =
/// x_0² + x_1²`, so `g_r = 2 x_r` (2 and 4) and `d(Σ_k g_k)/dx_r = 2` on both ranks. Before the
/// fix, rank 1 passed `None` to the scatter of gather's backward, so its double backward never
/// reached its own gather node while dst's did: the ranks called different collectives.
#[test]
fn gather_double_backward_exact_values() -> TestResult {
    dist::spawn::spawn(2, |rank| -> TestResult {
        init(30)?;
        let x = Tensor::from_vec(vec![rank as f64 + 1.0], &[1])?.requires_grad_(true);
        let ys = df::gather(&x, 0, None)?;
        let mut loss = Tensor::scalar(0.0f64);
        for y in &ys {
            loss = loss.add(&y.mul(y)?.sum()?)?;
        }
        let g = autograd::grad(
            &[loss],
            std::slice::from_ref(&x),
            &[],
            GradOptions {
                create_graph: true,
                ..Default::default()
            },
        )?
        .remove(0)
        .expect("a gradient");
        assert_eq!(
            g.to_vec_f64()?,
            vec![2.0 * (rank as f64 + 1.0)],
            "first order"
        );
        g.sum()?.backward()?;
        let gg = x.grad().expect("second-order gradient").to_vec_f64()?;
        assert_eq!(gg, vec![2.0], "second order");
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}
