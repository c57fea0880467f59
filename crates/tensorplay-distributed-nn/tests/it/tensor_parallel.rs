//! Megatron-style tensor parallelism built from the differentiable collectives: a
//! column-parallel `Linear` (weight split by output features; input replicated through a
//! "copy to group" step: identity forward, all-reduce backward), `tanh`, then a row-parallel
//! `Linear` (weight split by input features; partial outputs summed with
//! `functional::all_reduce(Sum)`; bias added once, after the sum). Outputs and gradients of
//! every rank are compared with the single-process pair `Linear -> tanh -> Linear`
//! (float64, tolerance 1e-10), for world sizes 2, 3 and 4, and on subgroups.
//!
//! # The gradient convention, and the losses used here
//!
//! Every rank calls `backward` on its own loss and receives `d(Σ_k loss_k)/dθ_r`. After the
//! row-parallel all-reduce every rank holds the same output `y` (= the single-process
//! output), so if every rank computed the full loss `L(y)`, `Σ_k loss_k = W·L` and the
//! gradients of everything before the all-reduce (both weight shards, the first bias shard, the
//! input) would be `W` times the single-process ones. The test uses two losses that make the
//! comparison exact, and checks the `W`-times case as well:
//!
//! - **mean**: `loss_r = L(y_r) / W` on every rank, so `Σ_k loss_k = L`. Every shard's gradient
//!   is exactly the matching slice of the single-process gradient, and so is the input's (the
//!   copy-to-group backward sums the ranks' partial input gradients). The replicated bias `b2`
//!   only feeds its own rank's output, so each rank's copy gets `dL/db2 / W`; summed over the
//!   ranks (what a data-parallel gradient sync of a replicated parameter does) it is `dL/db2`.
//! - **rank 0 only**: `loss_0 = L(y_0)`, `loss_r = 0·L(y_r)` on the other ranks (they still call
//!   backward: the backward collectives need every rank). Then `Σ_k loss_k = L` again: shards
//!   and input exact, `b2`'s gradient `dL/db2` on rank 0 and zero elsewhere.
//! - **full loss on every rank** (no scaling): shards and input get `W·dL/dθ`, `b2` `dL/db2`.

use std::time::Duration;
use tensorplay_testkit::cpu_world;

use tensorplay_collectives::{self as dist, ProcessGroup, ReduceOp};
use tensorplay_core::Tensor;
use tensorplay_core::nn::functional::linear;
use tensorplay_distributed_nn::functional as df;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;
type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const TIMEOUT: Duration = Duration::from_secs(30);
const TOL: f64 = 1e-10;

/// Batch, input features, hidden features (divisible by 2, 3 and 4), output features.
const B: usize = 3;
const D_IN: usize = 4;
const H: usize = 12;
const D_OUT: usize = 5;

// ---------------------------------------------------------------------------------------------
// the parallel building blocks

/// Megatron's `f` ("copy to tensor-parallel region"), the library's public helper: identity
/// forward, all-reduce (Sum) of the gradient backward, so that a replicated input receives the
/// full gradient on every rank.
fn copy_to_group(x: &Tensor, group: Option<&ProcessGroup>) -> R<Tensor> {
    Ok(df::copy_to_group(x, group)?)
}

/// The full (single-process) parameters, input and loss weights: deterministic values, the same
/// on every rank.
struct Problem {
    x: Vec<f64>,
    w1: Vec<f64>,
    b1: Vec<f64>,
    w2: Vec<f64>,
    b2: Vec<f64>,
    /// `L(y) = Σ y ⊙ c`.
    c: Vec<f64>,
}

fn values(n: usize, seed: f64) -> Vec<f64> {
    (0..n)
        .map(|i| 0.8 * (0.37 * i as f64 + seed).sin() + 0.1 * (1.3 * i as f64 * seed).cos())
        .collect()
}

impl Problem {
    fn new() -> Problem {
        Problem {
            x: values(B * D_IN, 0.3),
            w1: values(H * D_IN, 1.1),
            b1: values(H, 2.7),
            w2: values(D_OUT * H, 0.9),
            b2: values(D_OUT, 3.3),
            c: values(B * D_OUT, 5.1),
        }
    }
}

fn leaf(v: &[f64], shape: &[usize]) -> R<Tensor> {
    Ok(Tensor::from_vec(v.to_vec(), shape)?.requires_grad_(true))
}

fn grad(t: &Tensor) -> R<Vec<f64>> {
    Ok(t.grad().ok_or("no gradient")?.to_vec_f64()?)
}

fn close(what: &str, got: &[f64], want: &[f64]) -> TestResult {
    let bad = got.len() != want.len()
        || got
            .iter()
            .zip(want)
            .any(|(a, b)| (a - b).abs() > TOL * b.abs().max(1.0));
    if bad {
        return Err(format!("{what}: got {got:?}, want {want:?}").into());
    }
    Ok(())
}

fn scaled(v: &[f64], s: f64) -> Vec<f64> {
    v.iter().map(|a| a * s).collect()
}

/// Single-process reference: output and the gradients of `L` (x, w1, b1, w2, b2).
struct Reference {
    y: Vec<f64>,
    dx: Vec<f64>,
    dw1: Tensor,
    db1: Tensor,
    dw2: Tensor,
    db2: Vec<f64>,
}

fn reference(p: &Problem) -> R<Reference> {
    let x = leaf(&p.x, &[B, D_IN])?;
    let w1 = leaf(&p.w1, &[H, D_IN])?;
    let b1 = leaf(&p.b1, &[H])?;
    let w2 = leaf(&p.w2, &[D_OUT, H])?;
    let b2 = leaf(&p.b2, &[D_OUT])?;
    let h = linear(&x, &w1, Some(&b1))?.tanh()?;
    let y = linear(&h, &w2, Some(&b2))?;
    let c = Tensor::from_vec(p.c.clone(), &[B, D_OUT])?;
    y.mul(&c)?.sum()?.backward()?;
    Ok(Reference {
        y: y.to_vec_f64()?,
        dx: grad(&x)?,
        dw1: w1.grad().ok_or("no dw1")?,
        db1: b1.grad().ok_or("no db1")?,
        dw2: w2.grad().ok_or("no dw2")?,
        db2: grad(&b2)?,
    })
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Loss {
    /// `L / W` on every rank.
    Mean,
    /// `L` on the group's rank 0, `0·L` elsewhere.
    RankZero,
    /// `L` on every rank (gradients of the sharded part come out `W` times).
    Full,
}

/// One forward/backward of the tensor-parallel pair on this rank (group rank `gr` of `w`),
/// checked against the reference.
fn check_tp(p: &Problem, rf: &Reference, group: Option<&ProcessGroup>, loss: Loss) -> TestResult {
    let w = dist::get_world_size(group)?;
    let gr = dist::get_rank(group)?;
    let s = H / w;
    let lo = gr * s;
    let what = |name: &str| format!("{name} (W={w}, group rank {gr}, {loss:?} loss)");

    // this rank's shards: rows lo..lo+s of w1 and b1, columns lo..lo+s of w2
    let w1_full = Tensor::from_vec(p.w1.clone(), &[H, D_IN])?;
    let w2_full = Tensor::from_vec(p.w2.clone(), &[D_OUT, H])?;
    let w1 = leaf(&w1_full.narrow(0, lo, s)?.to_vec_f64()?, &[s, D_IN])?;
    let b1 = leaf(&p.b1[lo..lo + s], &[s])?;
    let w2 = leaf(&w2_full.narrow(1, lo, s)?.to_vec_f64()?, &[D_OUT, s])?;
    let b2 = leaf(&p.b2, &[D_OUT])?;
    let x = leaf(&p.x, &[B, D_IN])?;

    // column-parallel Linear (+ tanh): [B, s], this rank's slice of the hidden features
    let h = linear(&copy_to_group(&x, group)?, &w1, Some(&b1))?.tanh()?;
    // row-parallel Linear: partial products summed over the group, the bias added once
    let partial = linear(&h, &w2, None)?;
    let y = df::all_reduce(&partial, ReduceOp::Sum, group)?.add(&b2)?;
    close(&what("output"), &y.to_vec_f64()?, &rf.y)?;

    let c = Tensor::from_vec(p.c.clone(), &[B, D_OUT])?;
    let full = y.mul(&c)?.sum()?;
    let scale = match loss {
        Loss::Mean => 1.0 / w as f64,
        Loss::RankZero => f64::from(u8::from(gr == 0)),
        Loss::Full => 1.0,
    };
    full.mul_scalar(scale)?.backward()?;

    // everything before the all-reduce: Σ_k loss_k = L (mean, rank zero) or W·L (full)
    let k = if loss == Loss::Full { w as f64 } else { 1.0 };
    close(
        &what("dw1 shard"),
        &grad(&w1)?,
        &scaled(&rf.dw1.narrow(0, lo, s)?.to_vec_f64()?, k),
    )?;
    close(
        &what("db1 shard"),
        &grad(&b1)?,
        &scaled(&rf.db1.narrow(0, lo, s)?.to_vec_f64()?, k),
    )?;
    close(
        &what("dw2 shard"),
        &grad(&w2)?,
        &scaled(&rf.dw2.narrow(1, lo, s)?.to_vec_f64()?, k),
    )?;
    close(&what("dx"), &grad(&x)?, &scaled(&rf.dx, k))?;

    // the replicated bias after the all-reduce only feeds its own rank's loss
    let db2 = grad(&b2)?;
    close(&what("db2"), &db2, &scaled(&rf.db2, scale))?;
    if loss == Loss::Mean {
        // summed over the group (a replicated parameter's gradient sync): dL/db2
        let summed = df::all_reduce(&Tensor::from_vec(db2, &[D_OUT])?, ReduceOp::Sum, group)?;
        close(
            &what("db2 summed over the group"),
            &summed.to_vec_f64()?,
            &rf.db2,
        )?;
    }
    Ok(())
}

/// Runs `f` on every rank of a world of `n` processes ([`cpu_world`]).
fn world(n: usize, f: impl Fn(usize) -> TestResult) {
    cpu_world(n, TIMEOUT, f);
}

/// The three losses over the default group of a world of `n`.
fn whole_world(n: usize) {
    world(n, |_rank| {
        let p = Problem::new();
        let rf = reference(&p)?;
        for loss in [Loss::Mean, Loss::RankZero, Loss::Full] {
            check_tp(&p, &rf, None, loss)?;
        }
        Ok(())
    });
}

#[test]
fn tensor_parallel_mlp_world_2() {
    whole_world(2);
}

#[test]
fn tensor_parallel_mlp_world_3() {
    whole_world(3);
}

#[test]
fn tensor_parallel_mlp_world_4() {
    whole_world(4);
}

/// Two tensor-parallel groups side by side in a world of 4, `{0, 2}` and `{1, 3}` (group ranks
/// differ from global ranks), as in a 2 × 2 data × tensor mesh.
#[test]
fn tensor_parallel_mlp_subgroups_of_world_4() {
    world(4, |rank| {
        let p = Problem::new();
        let rf = reference(&p)?;
        let even = dist::new_group(&[0, 2], None, Some(TIMEOUT))?;
        let odd = dist::new_group(&[1, 3], None, Some(TIMEOUT))?;
        let mine = if rank % 2 == 0 { &even } else { &odd };
        for loss in [Loss::Mean, Loss::RankZero, Loss::Full] {
            check_tp(&p, &rf, Some(mine), loss)?;
        }
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------------
// the plan API: parallelize_module on a Sequential, against the same reference

mod plan {
    use super::*;
    use tensorplay_collectives::device_mesh::{DeviceMesh, init_device_mesh};
    use tensorplay_core::Error;
    use tensorplay_core::nn::{Linear, Module, Sequential, Tanh};
    use tensorplay_distributed_nn::parallel::tensor::{
        ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module,
    };
    use tensorplay_distributed_nn::tensor::Placement;

    /// The full pair `Linear -> tanh -> Linear` of the problem, as a Sequential ("0", "1", "2").
    fn full_model(p: &Problem) -> R<Sequential> {
        let l1 = Linear::from_weights(leaf(&p.w1, &[H, D_IN])?, Some(leaf(&p.b1, &[H])?))?;
        let l2 = Linear::from_weights(leaf(&p.w2, &[D_OUT, H])?, Some(leaf(&p.b2, &[D_OUT])?))?;
        Ok(Sequential::new().add(l1).add(Tanh::new()).add(l2))
    }

    /// One plan over the world's (or a sub-mesh's) ranks.
    struct Case {
        name: &'static str,
        first: ColwiseParallel,
        /// The second layer's style; `None`: the second layer stays whole (replicated).
        second: Option<RowwiseParallel>,
        /// World sizes the case runs at (the extents must divide).
        worlds: &'static [usize],
    }

    const CASES: &[Case] = &[
        Case {
            name: "Megatron pair",
            first: ColwiseParallel::new(),
            second: Some(RowwiseParallel::new()),
            worlds: &[2, 3, 4],
        },
        Case {
            name: "replicated between the layers",
            first: ColwiseParallel::new().output_layouts(Placement::Replicate),
            second: Some(RowwiseParallel::new().input_layouts(Placement::Replicate)),
            worlds: &[2, 3, 4],
        },
        Case {
            name: "3 stacked blocks, gathered, then a whole layer",
            first: ColwiseParallel::new()
                .stacked(3)
                .output_layouts(Placement::Replicate),
            second: None,
            worlds: &[2, 4],
        },
    ];

    /// Runs `c` on this rank of `mesh` (1-D) and compares output and gradients with `rf`.
    fn check(c: &Case, p: &Problem, rf: &Reference, mesh: &DeviceMesh) -> TestResult {
        let (r, w) = (mesh.get_local_rank(0)?, mesh.size(0)?);
        let what = |s: &str| format!("case {:?}: {s} (rank {r} of {w})", c.name);
        let mut model = full_model(p)?;
        let mut plan: Vec<(&str, &dyn ParallelStyle)> = vec![("0", &c.first)];
        if let Some(s) = &c.second {
            plan.push(("2", s));
        }
        parallelize_module(&mut model, mesh, &plan)?;
        let x = leaf(&p.x, &[B, D_IN])?;
        let y = model.call(&x)?;
        close(&what("output"), &y.to_vec_f64()?, &rf.y)?;
        // every rank computes the full loss
        let cw = Tensor::from_vec(p.c.clone(), &[B, D_OUT])?;
        y.mul(&cw)?.sum()?.backward()?;
        close(&what("dx"), &grad(&x)?, &rf.dx)?;
        let want = [
            (
                "0.weight",
                c.first.shard_parameter("weight", &rf.dw1, r, w)?,
            ),
            ("0.bias", c.first.shard_parameter("bias", &rf.db1, r, w)?),
        ];
        let params: std::collections::BTreeMap<String, Tensor> =
            model.named_parameters().into_iter().collect();
        for (name, g) in &want {
            close(&what(name), &grad(&params[*name])?, &g.to_vec_f64()?)?;
        }
        let (w2, b2) = (&params["2.weight"], &params["2.bias"]);
        let db2 = Tensor::from_vec(rf.db2.clone(), &[D_OUT])?;
        match &c.second {
            Some(s) => {
                let dw2 = s.shard_parameter("weight", &rf.dw2, r, w)?;
                close(&what("2.weight"), &grad(w2)?, &dw2.to_vec_f64()?)?;
                // the bias is Partial: rank 0 holds and trains it, the others hold zeros
                let value =
                    s.shard_parameter("bias", &Tensor::from_vec(p.b2.clone(), &[D_OUT])?, r, w)?;
                close(
                    &what("2.bias value"),
                    &b2.to_vec_f64()?,
                    &value.to_vec_f64()?,
                )?;
                if r == 0 {
                    close(&what("2.bias"), &grad(b2)?, &rf.db2)?;
                } else if b2.requires_grad() || b2.grad().is_some() {
                    return Err(what("2.bias on a rank > 0 must be a frozen zero").into());
                }
            }
            None => {
                close(&what("2.weight"), &grad(w2)?, &rf.dw2.to_vec_f64()?)?;
                close(&what("2.bias"), &grad(b2)?, &db2.to_vec_f64()?)?;
            }
        }
        Ok(())
    }

    fn plans_at(n: usize) {
        world(n, |_rank| {
            let p = Problem::new();
            let rf = reference(&p)?;
            let mesh = DeviceMesh::from_group(&dist::default_group("test")?, "tp")?;
            for c in CASES.iter().filter(|c| c.worlds.contains(&n)) {
                check(c, &p, &rf, &mesh)?;
            }
            Ok(())
        });
    }

    #[test]
    fn parallelize_module_world_2() {
        plans_at(2);
    }

    #[test]
    fn parallelize_module_world_3() {
        plans_at(3);
    }

    #[test]
    fn parallelize_module_world_4() {
        plans_at(4);
    }

    /// A plan that must fail: (what, the plan, the mesh, the argument the error names).
    type BadPlan<'a> = (
        &'a str,
        Vec<(&'a str, &'a dyn ParallelStyle)>,
        &'a DeviceMesh,
        &'a str,
    );

    /// A [2, 2] mesh: tensor parallelism over `mesh["tp"]` (ranks {0, 1} and {2, 3}), and the
    /// plan's errors, each naming its argument.
    #[test]
    fn parallelize_module_on_a_2d_mesh_and_errors() {
        world(4, |rank| {
            let p = Problem::new();
            let rf = reference(&p)?;
            let mesh = init_device_mesh(&[2, 2], &["dp", "tp"])?;
            assert_eq!(mesh["tp"].ranks(), [rank / 2 * 2, rank / 2 * 2 + 1]);
            for c in CASES.iter().filter(|c| c.worlds.contains(&2)) {
                check(c, &p, &rf, &mesh["tp"])?;
            }
            let col = ColwiseParallel::new();
            let dtensor = ColwiseParallel::new().use_local_output(false);
            let sharded_out = RowwiseParallel::new().output_layouts(Placement::Shard(0));
            let five = ColwiseParallel::new().stacked(5);
            let bad: [BadPlan<'_>; 6] = [
                (
                    "unknown name",
                    vec![("3", &col)],
                    &mesh["tp"],
                    "parallelize_plan",
                ),
                (
                    "a module without weight",
                    vec![("1", &col)],
                    &mesh["tp"],
                    "parallelize_plan",
                ),
                ("a 2-D mesh", vec![("0", &col)], &mesh, "device_mesh"),
                (
                    "DTensor output",
                    vec![("0", &dtensor)],
                    &mesh["tp"],
                    "use_local_output",
                ),
                (
                    "sharded row-wise output",
                    vec![("2", &sharded_out)],
                    &mesh["tp"],
                    "output_layouts",
                ),
                (
                    "5 blocks of 12 rows",
                    vec![("0", &five)],
                    &mesh["tp"],
                    "module",
                ),
            ];
            for (name, plan, m, arg) in bad {
                let mut model = full_model(&p)?;
                match parallelize_module(&mut model, m, &plan) {
                    Err(Error::InvalidArgument { arg: a, .. }) if a == arg => {}
                    other => return Err(format!("{name}: expected {arg}, got {other:?}").into()),
                }
            }
            // a wildcard matches every child
            let mut model = full_model(&p)?;
            match parallelize_module(&mut model, &mesh["tp"], &[("*", &col)]) {
                Err(Error::InvalidArgument { arg, got, .. }) => {
                    assert_eq!(arg, "parallelize_plan");
                    assert!(got.contains("`1`"), "{got}"); // Tanh, the first without weight
                }
                other => return Err(format!("wildcard: {other:?}").into()),
            }
            Ok(())
        });
    }
}
