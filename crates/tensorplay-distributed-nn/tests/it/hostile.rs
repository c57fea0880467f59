//! Hostile inputs to the differentiable collectives: overflowing split sizes, 0-d, empty and
//! 9-d tensors, Bool and int64 tensors, ranks disagreeing on every argument, roots outside the
//! group, odd scatter placeholders, expanded inputs, `no_grad`, reused outputs, `retain_graph`,
//! one-member groups. Each is a clear error on every rank (the bad rank with its own, the others
//! naming it) or a correct result — never a panic, hang or wrong value — and the group stays
//! usable after each error.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use tensorplay_collectives::{self as dist, InitOptions, ProcessGroup};
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::functional::{self as df, ReduceOp};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn init(timeout_s: u64) -> dist::Result<()> {
    dist::init_process_group(
        "cpu",
        InitOptions {
            timeout: Duration::from_secs(timeout_s),
            ..Default::default()
        },
    )
}

fn f64s(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).expect("tensor")
}

/// Failures collected by one rank, reported together at the end.
struct Log {
    rank: usize,
    fails: Vec<String>,
}

impl Log {
    fn new(rank: usize) -> Log {
        Log {
            rank,
            fails: vec![],
        }
    }

    /// Runs `f`, recording its error or panic.
    fn run(&mut self, what: &str, f: impl FnOnce() -> TestResult) {
        let t0 = Instant::now();
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.fails.push(format!("case {what:?}: {e}")),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                self.fails.push(format!("case {what:?}: PANIC {msg}"));
            }
        }
        let dt = t0.elapsed();
        if dt > Duration::from_secs(3) {
            self.fails.push(format!("case {what:?}: took {dt:?}"));
        }
    }

    fn finish(self) -> TestResult {
        if self.fails.is_empty() {
            return Ok(());
        }
        Err(format!(
            "rank {}: {} failure(s):\n  {}",
            self.rank,
            self.fails.len(),
            self.fails.join("\n  ")
        )
        .into())
    }
}

/// `r` failed on every rank: rank `bad` (every rank when `None`) with an error mentioning
/// `own`, the others naming rank `bad`; never a timeout.
fn fails_everywhere<T>(r: tp::Result<T>, rank: usize, bad: Option<usize>, own: &str) -> TestResult {
    let e = match r {
        Ok(_) => return Err(format!("rank {rank} succeeded").into()),
        Err(e) => e.to_string(),
    };
    if e.contains("timed out") {
        return Err(format!("rank {rank} timed out instead of failing at once: {e}").into());
    }
    let want = match bad {
        Some(b) if b != rank => format!("{b}"),
        _ => own.to_string(),
    };
    if !e.contains(&want) {
        return Err(format!("rank {rank}'s error should mention {want:?}: {e}").into());
    }
    Ok(())
}

/// The group still computes the right sum, forward and backward.
fn still_works(group: Option<&ProcessGroup>) -> TestResult {
    let n = match group {
        Some(g) => g.size(),
        None => dist::get_world_size(None)?,
    };
    let x = f64s(&[1.0, 2.0], &[2]).requires_grad_(true);
    let y = df::all_reduce(&x, ReduceOp::Sum, group)?;
    let want = vec![n as f64, 2.0 * n as f64];
    if y.to_vec::<f64>()? != want {
        return Err(format!("all_reduce after the error gave {:?}", y.to_vec::<f64>()?).into());
    }
    y.sum()?.backward()?;
    let g = x.grad().ok_or("no grad")?.to_vec::<f64>()?;
    if g != vec![n as f64; 2] {
        return Err(format!("all_reduce's gradient after the error is {g:?}").into());
    }
    Ok(())
}

fn eq(what: &str, got: Vec<f64>, want: Vec<f64>) -> TestResult {
    if got.len() != want.len() || got.iter().zip(&want).any(|(a, b)| (a - b).abs() > 1e-12) {
        return Err(format!("{what}: got {got:?}, want {want:?}").into());
    }
    Ok(())
}

/// What every case of a world is given: its rank and the groups the world made before its
/// cases (every rank makes every group, in the same order).
struct World {
    rank: usize,
    groups: Vec<ProcessGroup>,
}

/// One named check, run on every rank of its world; `arg` is what its cases differ in (`()`
/// where a case is its own function).
struct Case<A: 'static = ()> {
    name: &'static str,
    arg: A,
    run: fn(&World, A) -> TestResult,
}

/// What rank `rank` calls on a group of 2 in a case of ranks calling different collectives.
type PairCall = fn(usize, &ProcessGroup) -> tp::Result<()>;

/// Runs `case` on this rank: its error, panic or slowness is recorded under its name.
fn check<A: Copy>(log: &mut Log, w: &World, case: &Case<A>) {
    log.run(case.name, || (case.run)(w, case.arg));
}

/// Runs `cases` (a test's tables, each case through [`check`]) on every rank of a world of `n`
/// processes, each rank making its groups with `groups` first; then fails with every case that
/// failed on that rank, by name.
fn hostile_world(
    n: usize,
    groups: impl Fn(usize) -> dist::Result<Vec<ProcessGroup>>,
    cases: impl Fn(&World, &mut Log),
) -> TestResult {
    dist::spawn::spawn(n, |rank| -> TestResult {
        init(6)?;
        let w = World {
            rank,
            groups: groups(rank)?,
        };
        let mut log = Log::new(rank);
        cases(&w, &mut log);
        log.finish()?;
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

/// A world without groups of its own.
fn no_groups(_rank: usize) -> dist::Result<Vec<ProcessGroup>> {
    Ok(vec![])
}

/// A 9-d tensor: `[1 x 7, 2, 3]` on rank `r`, `[1 x 7, 3, 2]` on the others.
fn nine_d(rank: usize) -> impl Fn(usize) -> tp::Result<Tensor> {
    move |r: usize| -> tp::Result<Tensor> {
        if r == rank {
            Tensor::zeros(&[1, 1, 1, 1, 1, 1, 1, 2, 3], DType::F64)
        } else {
            Tensor::zeros(&[1, 1, 1, 1, 1, 1, 1, 3, 2], DType::F64)
        }
    }
}

/// Bool zeros of shape `[2]`.
fn zeros_bool() -> Tensor {
    Tensor::zeros(&[2], DType::Bool).expect("bool")
}

/// Float64 zeros of shape `[2]`.
fn zeros_f64() -> Tensor {
    Tensor::zeros(&[2], DType::F64).expect("f64")
}

/// [`zeros_bool`] on rank `r`, [`zeros_f64`] on the others.
fn bool_on(rank: usize) -> impl Fn(usize) -> Tensor {
    move |r: usize| {
        if rank == r { zeros_bool() } else { zeros_f64() }
    }
}

/// An expanded view too big to materialize.
fn huge_view() -> Tensor {
    Tensor::scalar(1.0f64).expand(&[1 << 50]).expect("expand")
}

/// Float64 zeros of shape `[2 + rank]`.
fn shape_by_rank(rank: usize) -> impl Fn() -> Tensor {
    move || Tensor::zeros(&[2 + rank], DType::F64).expect("t")
}

/// Zeros of shape `[2]`: float64 on rank 0, float32 on the others.
fn dtype_by_rank(rank: usize) -> impl Fn() -> Tensor {
    move || Tensor::zeros(&[2], if rank == 0 { DType::F64 } else { DType::F32 }).expect("t")
}

/// `[rank + 1, 2]`.
fn pair_by_rank(rank: usize) -> impl Fn() -> Tensor {
    move || f64s(&[rank as f64 + 1.0, 2.0], &[2])
}

// ---------------------------------------------------------------------------------------------
// the tests: a world each, running its tables of cases

#[test]
fn hostile_arguments_w2() -> TestResult {
    hostile_world(2, no_groups, |w, log| {
        ARGUMENT_CASES.iter().for_each(|c| check(log, w, c));
        ROOT_CASES.iter().for_each(|c| check(log, w, c));
        SCATTER_CASES.iter().for_each(|c| check(log, w, c));
    })
}

#[test]
fn hostile_autograd_w2() -> TestResult {
    hostile_world(2, no_groups, |w, log| {
        SHAPE_CASES.iter().for_each(|c| check(log, w, c));
        AUTOGRAD_CASES.iter().for_each(|c| check(log, w, c));
    })
}

#[test]
fn hostile_groups_w3() -> TestResult {
    let groups = |_rank| -> dist::Result<Vec<ProcessGroup>> {
        let mut g: Vec<ProcessGroup> = (0..3)
            .map(|r| dist::new_group(&[r], None, None))
            .collect::<dist::Result<_>>()?;
        g.push(dist::new_group(
            &[0, 2],
            None,
            Some(Duration::from_secs(2)),
        )?);
        Ok(g)
    };
    hostile_world(3, groups, |w, log| {
        GROUP_CASES.iter().for_each(|c| check(log, w, c));
        if w.rank != 1 {
            SUBGROUP_CASES.iter().for_each(|c| check(log, w, c));
        }
    })
}

#[test]
fn hostile_mixed_w2() -> TestResult {
    hostile_world(2, no_groups, |w, log| {
        PAIR_CASES.iter().for_each(|c| check(log, w, c));
        MIXED_CASES.iter().for_each(|c| check(log, w, c));
        TIMEOUT_CASES.iter().for_each(|c| check(log, w, c));
        DEVICE_CASES.iter().for_each(|c| check(log, w, c));
    })
}

// ---------------------------------------------------------------------------------------------
// the tables

/// One rank's bad arguments, and arguments the ranks disagree on.
const ARGUMENT_CASES: &[Case] = &[
    // all_to_all_single: split sizes that overflow when summed
    Case {
        name: "a2as overflowing input splits on rank 1",
        arg: (),
        run: a2as_overflowing_input_splits_on_rank_1,
    },
    Case {
        name: "a2as overflowing input splits on every rank",
        arg: (),
        run: a2as_overflowing_input_splits_on_every_rank,
    },
    Case {
        name: "blocking a2as overflowing splits on every rank",
        arg: (),
        run: blocking_a2as_overflowing_splits_on_every_rank,
    },
    Case {
        name: "a2as huge output splits on rank 0",
        arg: (),
        run: a2as_huge_output_splits_on_rank_0,
    },
    Case {
        name: "a2as output split above i64::MAX on rank 1",
        arg: (),
        run: a2as_output_split_above_i64_max_on_rank_1,
    },
    Case {
        name: "a2as output splits of wrong length on rank 1",
        arg: (),
        run: a2as_output_splits_of_wrong_length_on_rank_1,
    },
    Case {
        name: "a2as 0-d input on rank 0",
        arg: (),
        run: a2as_zero_d_input_on_rank_0,
    },
    Case {
        name: "a2as trailing shape differs",
        arg: (),
        run: a2as_trailing_shape_differs,
    },
    Case {
        name: "a2as dtype differs",
        arg: (),
        run: a2as_dtype_differs,
    },
    // 9 dimensions, every function, on one rank
    Case {
        name: "9-d all_reduce",
        arg: (),
        run: nine_d_all_reduce,
    },
    Case {
        name: "9-d broadcast",
        arg: (),
        run: nine_d_broadcast,
    },
    Case {
        name: "9-d reduce",
        arg: (),
        run: nine_d_reduce,
    },
    Case {
        name: "9-d on one rank: all_reduce, broadcast, reduce",
        arg: (),
        run: nine_d_on_one_rank_all_reduce_broadcast_reduce,
    },
    Case {
        name: "9-d blocking collectives, shapes that differ",
        arg: (),
        run: nine_d_blocking_collectives_shapes_that_differ,
    },
    Case {
        name: "9-d all_gather on rank 1",
        arg: (),
        run: nine_d_all_gather_on_rank_1,
    },
    Case {
        name: "9-d reduce_scatter on rank 0",
        arg: (),
        run: nine_d_reduce_scatter_on_rank_0,
    },
    Case {
        name: "9-d reduce_scatter on every rank",
        arg: (),
        run: nine_d_reduce_scatter_on_every_rank,
    },
    // Bool tensors
    Case {
        name: "bool all_reduce on rank 1",
        arg: (),
        run: bool_all_reduce_on_rank_1,
    },
    Case {
        name: "bool broadcast on rank 0",
        arg: (),
        run: bool_broadcast_on_rank_0,
    },
    Case {
        name: "bool reduce on rank 1",
        arg: (),
        run: bool_reduce_on_rank_1,
    },
    Case {
        name: "bool gather on rank 1",
        arg: (),
        run: bool_gather_on_rank_1,
    },
    Case {
        name: "bool scatter on src",
        arg: (),
        run: bool_scatter_on_src,
    },
    Case {
        name: "bool reduce_scatter on rank 1",
        arg: (),
        run: bool_reduce_scatter_on_rank_1,
    },
    Case {
        name: "bool all_to_all on rank 0",
        arg: (),
        run: bool_all_to_all_on_rank_0,
    },
    Case {
        name: "bool all_to_all_single on rank 1",
        arg: (),
        run: bool_all_to_all_single_on_rank_1,
    },
    // int64: forward works, Avg is an error
    Case {
        name: "int64 forward",
        arg: (),
        run: int64_forward,
    },
    Case {
        name: "int64 Avg on every function",
        arg: (),
        run: int64_avg_on_every_function,
    },
    Case {
        name: "int64 Avg on rank 1 only",
        arg: (),
        run: int64_avg_on_rank_1_only,
    },
    Case {
        name: "bitwise op on floats",
        arg: (),
        run: bitwise_op_on_floats,
    },
    // an expanded view too big to materialize, on one rank
    Case {
        name: "reduce_scatter: a huge expanded view in a bad list on rank 1",
        arg: (),
        run: reduce_scatter_a_huge_expanded_view_in_a_bad_lis,
    },
    Case {
        name: "all_reduce, broadcast, reduce: a huge expanded view on rank 1",
        arg: (),
        run: all_reduce_broadcast_reduce_a_huge_expanded_view,
    },
    // ranks disagreeing on shapes, dtypes and roots
    Case {
        name: "all_reduce shapes differ",
        arg: (),
        run: all_reduce_shapes_differ,
    },
    Case {
        name: "all_reduce dtypes differ",
        arg: (),
        run: all_reduce_dtypes_differ,
    },
    Case {
        name: "all_reduce ops differ",
        arg: (),
        run: all_reduce_ops_differ,
    },
    Case {
        name: "broadcast shapes differ",
        arg: (),
        run: broadcast_shapes_differ,
    },
    Case {
        name: "broadcast src differs",
        arg: (),
        run: broadcast_src_differs,
    },
    Case {
        name: "reduce dtypes differ",
        arg: (),
        run: reduce_dtypes_differ,
    },
    Case {
        name: "reduce dst differs",
        arg: (),
        run: reduce_dst_differs,
    },
    Case {
        name: "broadcast dtypes, reduce shapes and ops, reduce_scatter ops differ",
        arg: (),
        run: broadcast_dtypes_reduce_shapes_and_ops_reduce_sc,
    },
    Case {
        name: "reduce_scatter shapes differ",
        arg: (),
        run: reduce_scatter_shapes_differ,
    },
    Case {
        name: "reduce_scatter dtypes differ",
        arg: (),
        run: reduce_scatter_dtypes_differ,
    },
    Case {
        name: "all_gather dtypes differ",
        arg: (),
        run: all_gather_dtypes_differ,
    },
    Case {
        name: "gather dtypes differ",
        arg: (),
        run: gather_dtypes_differ,
    },
    Case {
        name: "gather dst differs",
        arg: (),
        run: gather_dst_differs,
    },
    Case {
        name: "scatter src differs",
        arg: (),
        run: scatter_src_differs,
    },
    Case {
        name: "all_to_all dtypes differ",
        arg: (),
        run: all_to_all_dtypes_differ,
    },
    Case {
        name: "all_to_all shapes of a pair differ",
        arg: (),
        run: all_to_all_shapes_of_a_pair_differ,
    },
];

/// A root outside the world: `(function, the rank that passes it)` (`None`: every rank); the function is 0 broadcast, 1 reduce, 2 gather, 3 scatter.
const ROOT_CASES: &[Case<(usize, Option<usize>)>] = &[
    // roots outside the world
    Case {
        name: "broadcast root 7 on None",
        arg: (0, None),
        run: root_outside_the_world,
    },
    Case {
        name: "broadcast root 7 on Some(0)",
        arg: (0, Some(0)),
        run: root_outside_the_world,
    },
    Case {
        name: "broadcast root 7 on Some(1)",
        arg: (0, Some(1)),
        run: root_outside_the_world,
    },
    Case {
        name: "reduce root 7 on None",
        arg: (1, None),
        run: root_outside_the_world,
    },
    Case {
        name: "reduce root 7 on Some(0)",
        arg: (1, Some(0)),
        run: root_outside_the_world,
    },
    Case {
        name: "reduce root 7 on Some(1)",
        arg: (1, Some(1)),
        run: root_outside_the_world,
    },
    Case {
        name: "gather root 7 on None",
        arg: (2, None),
        run: root_outside_the_world,
    },
    Case {
        name: "gather root 7 on Some(0)",
        arg: (2, Some(0)),
        run: root_outside_the_world,
    },
    Case {
        name: "gather root 7 on Some(1)",
        arg: (2, Some(1)),
        run: root_outside_the_world,
    },
    Case {
        name: "scatter root 7 on None",
        arg: (3, None),
        run: root_outside_the_world,
    },
    Case {
        name: "scatter root 7 on Some(0)",
        arg: (3, Some(0)),
        run: root_outside_the_world,
    },
    Case {
        name: "scatter root 7 on Some(1)",
        arg: (3, Some(1)),
        run: root_outside_the_world,
    },
];

/// Scatter placeholders and lists on `src`.
const SCATTER_CASES: &[Case] = &[
    // scatter placeholders: odd shapes, counts and dtypes are ignored off src
    Case {
        name: "scatter odd placeholders",
        arg: (),
        run: scatter_odd_placeholders,
    },
    Case {
        name: "scatter mixed dtypes on src",
        arg: (),
        run: scatter_mixed_dtypes_on_src,
    },
    Case {
        name: "scatter wrong count on src",
        arg: (),
        run: scatter_wrong_count_on_src,
    },
];

/// 0-d and empty tensors (of the shape given) through every function, forward and backward.
const SHAPE_CASES: &[Case<&'static [usize]>] = &[
    // 0-d and empty tensors through every function, forward and backward
    Case {
        name: "shape [] through every function",
        arg: &[],
        run: through_every_function,
    },
    Case {
        name: "shape [0] through every function",
        arg: &[0],
        run: through_every_function,
    },
    Case {
        name: "shape [2, 0] through every function",
        arg: &[2, 0],
        run: through_every_function,
    },
    Case {
        name: "shape [0, 3] through every function",
        arg: &[0, 3],
        run: through_every_function,
    },
];

/// Autograd corner cases.
const AUTOGRAD_CASES: &[Case] = &[
    // an expanded (stride-0) input
    Case {
        name: "expanded input through every function",
        arg: (),
        run: expanded_input_through_every_function,
    },
    // inside no_grad: values, no graph, no backward collectives
    Case {
        name: "no_grad",
        arg: (),
        run: no_grad,
    },
    // outputs reused as inputs, backward twice
    Case {
        name: "reused outputs and retain_graph",
        arg: (),
        run: reused_outputs_and_retain_graph,
    },
    // NaN and inf through Max, Min, Product
    Case {
        name: "nan and inf",
        arg: (),
        run: nan_and_inf,
    },
    // blocking collectives: refuse tensors that require grad, accept detach() and no_grad
    Case {
        name: "blocking collectives and requires_grad",
        arg: (),
        run: blocking_collectives_and_requires_grad,
    },
    // losses built differently on each rank still run the backward collectives in the
    // same order (shapes equal, so a different order would silently pair wrong gradients)
    Case {
        name: "asymmetric losses over two collectives",
        arg: (),
        run: asymmetric_losses_over_two_collectives,
    },
    // the async collectives judge grad mode where they are called, not on the worker
    Case {
        name: "async collectives and requires_grad",
        arg: (),
        run: async_collectives_and_requires_grad,
    },
];

/// One-member groups and calls from non-members (the world of 3 makes one group per rank, then the pair `[0, 2]`: `World::groups` `[{0}, {1}, {2}, {0, 2}]`).
const GROUP_CASES: &[Case] = &[
    Case {
        name: "one-member group, every function",
        arg: (),
        run: one_member_group_every_function,
    },
    Case {
        name: "one-member group, root of another rank",
        arg: (),
        run: one_member_group_root_of_another_rank,
    },
    Case {
        name: "non-member calls",
        arg: (),
        run: non_member_calls,
    },
];

/// The pair `[0, 2]` (run on its members only).
const SUBGROUP_CASES: &[Case] = &[
    Case {
        name: "root outside the subgroup",
        arg: (),
        run: root_outside_the_subgroup,
    },
    Case {
        name: "requires grad on one rank only: a named timeout",
        arg: (),
        run: requires_grad_on_one_rank_only_a_named_timeout,
    },
];

/// Ranks calling different collectives (`PairCall`: what rank `rank` calls on a group of 2).
const PAIR_CASES: &[Case<PairCall>] = &[
    // descriptors of different lengths fail the call on every rank with an error saying so
    // (the backend then shuts that group down, so each case makes a group of its own);
    // descriptors of one length fail it and the group goes on
    Case {
        name: "all_gather on rank 0, gather on rank 1",
        arg: all_gather_vs_gather,
        run: different_collectives,
    },
    Case {
        name: "all_reduce on rank 0, all_gather on rank 1",
        arg: all_reduce_vs_all_gather,
        run: different_collectives,
    },
    Case {
        name: "blocking all_reduce on rank 0, reduce on rank 1",
        arg: blocking_all_reduce_vs_reduce,
        run: different_collectives,
    },
    Case {
        name: "all_gather_metadata with lengths that differ",
        arg: metadata_lengths_differ,
        run: different_collectives,
    },
];

/// Aliased inputs, uneven and zero-size shapes, NaN, huge empty dimensions.
const MIXED_CASES: &[Case] = &[
    Case {
        name: "blocking all_reduce on rank 0, broadcast on rank 1",
        arg: (),
        run: blocking_all_reduce_on_rank_0_broadcast_on_rank,
    },
    Case {
        name: "all_gather_metadata, empty",
        arg: (),
        run: all_gather_metadata_empty,
    },
    // the same tensor twice in a list: its gradient is the sum of both
    Case {
        name: "aliased list elements",
        arg: (),
        run: aliased_list_elements,
    },
    // uneven and zero-size shapes
    Case {
        name: "uneven shapes, 0-d and empty, through the shape-learning functions",
        arg: (),
        run: uneven_shapes_zero_d_and_empty_through_the_shape,
    },
    Case {
        name: "a2as zero-size splits, one list given",
        arg: (),
        run: a2as_zero_size_splits_one_list_given,
    },
    // reduce and reduce_scatter with NaN: the holder gets the gradient
    Case {
        name: "reduce and reduce_scatter Max with NaN",
        arg: (),
        run: reduce_and_reduce_scatter_max_with_nan,
    },
    // zero-size tensors with huge dimensions
    Case {
        name: "huge empty dims: a2as rows that overflow on the receiver",
        arg: (),
        run: huge_empty_dims_a2as_rows_that_overflow_on_the_r,
    },
    Case {
        name: "huge empty dims: all_gather, gather, all_to_all, scatter",
        arg: (),
        run: huge_empty_dims_all_gather_gather_all_to_all_sca,
    },
];

/// Zero and unbounded timeouts of a new group.
const TIMEOUT_CASES: &[Case<Duration>] = &[
    Case {
        name: "zero timeout",
        arg: Duration::ZERO,
        run: timeout,
    },
    Case {
        name: "huge timeout",
        arg: Duration::from_secs(1 << 62),
        run: timeout,
    },
];

/// A CUDA tensor without a GPU: a clear error, here or from the collective.
const DEVICE_CASES: &[Case] = &[
    // a CUDA tensor without a GPU: a clear error, here or from the collective
    Case {
        name: "cuda tensor",
        arg: (),
        run: cuda_tensor,
    },
];

// ---------------------------------------------------------------------------------------------
// the cases

/// Every function on `x` (one output list per function), for the shapes every rank passes.
fn every_function(x: &Tensor, src: usize) -> tp::Result<Vec<(String, Vec<Tensor>)>> {
    let mut v = vec![];
    for op in [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Product,
    ] {
        v.push((
            format!("all_reduce {op:?}"),
            vec![df::all_reduce(x, op, None)?],
        ));
        v.push((
            format!("reduce {op:?}"),
            vec![df::reduce(x, src, op, None)?],
        ));
        let l = [x.clone(), x.mul_scalar(2.0)?];
        v.push((
            format!("reduce_scatter {op:?}"),
            vec![df::reduce_scatter(&l, op, None)?],
        ));
    }
    v.push(("broadcast".into(), vec![df::broadcast(x, src, None)?]));
    v.push(("all_gather".into(), df::all_gather(x, None)?));
    v.push(("gather".into(), df::gather(x, src, None)?));
    let l = [x.clone(), x.mul_scalar(3.0)?];
    v.push(("scatter".into(), vec![df::scatter(Some(&l), src, None)?]));
    v.push(("all_to_all".into(), df::all_to_all(&l, None)?));
    if x.ndim() > 0 && x.shape()[0].is_multiple_of(2) {
        v.push((
            "all_to_all_single".into(),
            vec![df::all_to_all_single(x, None, None, None)?],
        ));
    }
    Ok(v)
}

fn a2as_overflowing_input_splits_on_rank_1(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = Tensor::zeros(&[0, 2], DType::F64)?;
    let s: &[usize] = if rank == 1 { &[usize::MAX, 1] } else { &[0, 0] };
    let r = df::all_to_all_single(&x, None, Some(s), None);
    fails_everywhere(r, rank, Some(1), "input_split_sizes")?;
    still_works(None)
}

fn a2as_overflowing_input_splits_on_every_rank(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = Tensor::zeros(&[0, 2], DType::F64)?;
    let r = df::all_to_all_single(&x, None, Some(&[usize::MAX, 1]), None);
    fails_everywhere(r, rank, None, "input_split_sizes")?;
    still_works(None)
}

fn blocking_a2as_overflowing_splits_on_every_rank(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = Tensor::zeros(&[0, 2], DType::F64)?;
    let out = Tensor::zeros(&[0, 2], DType::F64)?;
    let s: &[usize] = &[usize::MAX, 1];
    let r = dist::all_to_all_single(&out, &x, None, Some(s), None);
    fails_everywhere(r.map_err(tp::Error::from), rank, None, "input_split_sizes")?;
    let r = dist::all_to_all_single(&out, &x, Some(s), None, None);
    fails_everywhere(r.map_err(tp::Error::from), rank, None, "output_split_sizes")?;
    still_works(None)
}

fn a2as_huge_output_splits_on_rank_0(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = Tensor::zeros(&[2, 2], DType::F64)?;
    let s: &[usize] = if rank == 0 { &[usize::MAX, 1] } else { &[1, 1] };
    let r = df::all_to_all_single(&x, Some(s), Some(&[1, 1]), None);
    fails_everywhere(r, rank, Some(0), "output_split_sizes")?;
    still_works(None)
}

fn a2as_output_split_above_i64_max_on_rank_1(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = Tensor::zeros(&[2, 2], DType::F64)?;
    let s: &[usize] = if rank == 1 { &[1 << 63, 0] } else { &[1, 1] };
    let r = df::all_to_all_single(&x, Some(s), Some(&[1, 1]), None);
    let e = r.err().ok_or("succeeded")?.to_string();
    if !e.contains("9223372036854775808") {
        return Err(format!("the size should be printed as given: {e}").into());
    }
    still_works(None)
}

fn a2as_output_splits_of_wrong_length_on_rank_1(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = Tensor::zeros(&[2, 2], DType::F64)?;
    let s: &[usize] = if rank == 1 { &[1, 1, 0] } else { &[1, 1] };
    let r = df::all_to_all_single(&x, Some(s), None, None);
    fails_everywhere(r, rank, Some(1), "output_split_sizes")?;
    still_works(None)
}

fn a2as_zero_d_input_on_rank_0(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = if rank == 0 {
        Tensor::scalar(1.0f64)
    } else {
        Tensor::zeros(&[2], DType::F64)?
    };
    let r = df::all_to_all_single(&x, None, None, None);
    fails_everywhere(r, rank, Some(0), "input")?;
    still_works(None)
}

fn a2as_trailing_shape_differs(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = Tensor::zeros(&[2, 1 + rank], DType::F64)?;
    let r = df::all_to_all_single(&x, None, None, None);
    fails_everywhere(r, rank, None, "shape")?;
    still_works(None)
}

fn a2as_dtype_differs(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = Tensor::zeros(&[2], if rank == 0 { DType::F64 } else { DType::F32 })?;
    let r = df::all_to_all_single(&x, None, None, None);
    fails_everywhere(r, rank, None, "dtype")?;
    still_works(None)
}

fn nine_d_all_reduce(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let nine = nine_d(rank);
    let r = df::all_reduce(&nine(0)?, ReduceOp::Sum, None);
    fails_everywhere(r, rank, None, "dimensions")?;
    still_works(None)
}

fn nine_d_broadcast(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let nine = nine_d(rank);
    let r = df::broadcast(&nine(0)?, 0, None);
    fails_everywhere(r, rank, None, "dimensions")?;
    still_works(None)
}

fn nine_d_reduce(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let nine = nine_d(rank);
    let r = df::reduce(&nine(0)?, 0, ReduceOp::Sum, None);
    fails_everywhere(r, rank, None, "dimensions")?;
    still_works(None)
}

fn nine_d_on_one_rank_all_reduce_broadcast_reduce(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let nine = nine_d(rank);
    let x = |bad: usize| -> tp::Result<Tensor> {
        if rank == bad {
            nine(bad)
        } else {
            Tensor::zeros(&[6], DType::F64)
        }
    };
    let r = df::all_reduce(&x(1)?, ReduceOp::Max, None);
    fails_everywhere(r, rank, Some(1), "dimensions")?;
    let r = df::broadcast(&x(0)?, 0, None);
    fails_everywhere(r, rank, Some(0), "dimensions")?;
    let r = df::reduce(&x(1)?, 0, ReduceOp::Sum, None);
    fails_everywhere(r, rank, Some(1), "dimensions")?;
    still_works(None)
}

fn nine_d_blocking_collectives_shapes_that_differ(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let nine = nine_d(rank);
    let ng = tp::no_grad();
    let x = nine(0)?;
    let r = dist::all_reduce(&x, ReduceOp::Sum, None).map_err(tp::Error::from);
    fails_everywhere(r, rank, None, "shape")?;
    let r = dist::broadcast(&x, 0, None).map_err(tp::Error::from);
    fails_everywhere(r, rank, None, "shape")?;
    let a = || Tensor::zeros(&[1, 1, 1, 1, 1, 1, 1, 2, 3], DType::F64);
    let b = || Tensor::zeros(&[1, 1, 1, 1, 1, 1, 1, 3, 2], DType::F64);
    // x is a on rank 0, b on rank 1
    let r = dist::all_gather(&[b()?, a()?], &x, None).map_err(tp::Error::from);
    fails_everywhere(r, rank, None, "shape")?;
    // the shapes each rank passed: accepted
    dist::all_gather(&[a()?, b()?], &x, None)?;
    dist::all_reduce(
        &Tensor::zeros(&[1, 1, 1, 1, 1, 1, 1, 2, 3], DType::F64)?,
        ReduceOp::Sum,
        None,
    )?;
    drop(ng);
    still_works(None)
}

fn nine_d_all_gather_on_rank_1(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let nine = nine_d(rank);
    let x = if rank == 1 {
        nine(1)?
    } else {
        Tensor::zeros(&[2], DType::F64)?
    };
    let r = df::all_gather(&x, None);
    fails_everywhere(r, rank, Some(1), "dimensions")?;
    still_works(None)
}

fn nine_d_reduce_scatter_on_rank_0(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let nine = nine_d(rank);
    let x = if rank == 0 {
        nine(0)?
    } else {
        Tensor::zeros(&[6], DType::F64)?
    };
    let r = df::reduce_scatter(&[x.clone(), x], ReduceOp::Sum, None);
    fails_everywhere(r, rank, Some(0), "dimensions")?;
    still_works(None)
}

fn nine_d_reduce_scatter_on_every_rank(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let nine = nine_d(rank);
    let x = nine(0)?;
    let r = df::reduce_scatter(&[x.clone(), x], ReduceOp::Sum, None);
    fails_everywhere(r, rank, None, "dimensions")?;
    still_works(None)
}

fn bool_all_reduce_on_rank_1(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let bad_on = bool_on(rank);
    let r = df::all_reduce(&bad_on(1), ReduceOp::Sum, None);
    fails_everywhere(r, rank, Some(1), "bool")?;
    still_works(None)
}

fn bool_broadcast_on_rank_0(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let bad_on = bool_on(rank);
    let r = df::broadcast(&bad_on(0), 0, None);
    fails_everywhere(r, rank, Some(0), "bool")?;
    still_works(None)
}

fn bool_reduce_on_rank_1(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let bad_on = bool_on(rank);
    let r = df::reduce(&bad_on(1), 0, ReduceOp::Max, None);
    fails_everywhere(r, rank, Some(1), "bool")?;
    still_works(None)
}

fn bool_gather_on_rank_1(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let bad_on = bool_on(rank);
    let r = df::gather(&bad_on(1), 0, None);
    fails_everywhere(r, rank, Some(1), "bool")?;
    still_works(None)
}

fn bool_scatter_on_src(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let bad_on = bool_on(rank);
    let l = [bad_on(0), bad_on(0)];
    let r = df::scatter(Some(&l), 0, None);
    fails_everywhere(r, rank, Some(0), "bool")?;
    still_works(None)
}

fn bool_reduce_scatter_on_rank_1(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let bad_on = bool_on(rank);
    let r = df::reduce_scatter(&[bad_on(1), bad_on(1)], ReduceOp::Sum, None);
    fails_everywhere(r, rank, Some(1), "bool")?;
    still_works(None)
}

fn bool_all_to_all_on_rank_0(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let bad_on = bool_on(rank);
    let r = df::all_to_all(&[bad_on(0), bad_on(0)], None);
    fails_everywhere(r, rank, Some(0), "bool")?;
    still_works(None)
}

fn bool_all_to_all_single_on_rank_1(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let bad_on = bool_on(rank);
    let r = df::all_to_all_single(&bad_on(1), None, None, None);
    fails_everywhere(r, rank, Some(1), "bool")?;
    still_works(None)
}

fn int64_forward(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let other = 1 - rank;
    let x = Tensor::from_vec(vec![rank as i64 + 1, 10], &[2])?;
    let y = df::all_reduce(&x, ReduceOp::Sum, None)?;
    if y.to_vec::<i64>()? != vec![3, 20] {
        return Err(format!("all_reduce {:?}", y.to_vec::<i64>()?).into());
    }
    let y = df::all_reduce(&x, ReduceOp::Max, None)?;
    if y.to_vec::<i64>()? != vec![2, 10] {
        return Err(format!("all_reduce max {:?}", y.to_vec::<i64>()?).into());
    }
    let y = df::all_reduce(&x, ReduceOp::BXor, None)?;
    if y.to_vec::<i64>()? != vec![3, 0] {
        return Err(format!("all_reduce bxor {:?}", y.to_vec::<i64>()?).into());
    }
    let y = df::reduce(&x, 1, ReduceOp::Product, None)?;
    let want = if rank == 1 { vec![2, 100] } else { vec![0, 0] };
    if y.to_vec::<i64>()? != want {
        return Err(format!("reduce product {:?}", y.to_vec::<i64>()?).into());
    }
    let y = df::broadcast(&x, 1, None)?;
    if y.to_vec::<i64>()? != vec![2, 10] {
        return Err(format!("broadcast {:?}", y.to_vec::<i64>()?).into());
    }
    let ys = df::all_gather(&x, None)?;
    if ys[1].to_vec::<i64>()? != vec![2, 10] {
        return Err("all_gather".into());
    }
    let ys = df::gather(&x, 0, None)?;
    if rank == 0 && ys[1].to_vec::<i64>()? != vec![2, 10] {
        return Err("gather".into());
    }
    let l = [
        Tensor::from_vec(vec![rank as i64, 5], &[2])?,
        Tensor::from_vec(vec![7i64, rank as i64], &[2])?,
    ];
    let y = df::scatter(Some(&l), 1, None)?;
    let want = if rank == 0 { vec![1, 5] } else { vec![7, 1] };
    if y.to_vec::<i64>()? != want {
        return Err(format!("scatter {:?}", y.to_vec::<i64>()?).into());
    }
    let y = df::reduce_scatter(&l, ReduceOp::Min, None)?;
    let want = if rank == 0 { vec![0, 5] } else { vec![7, 0] };
    if y.to_vec::<i64>()? != want {
        return Err(format!("reduce_scatter {:?}", y.to_vec::<i64>()?).into());
    }
    let ys = df::all_to_all(&l, None)?;
    if ys[other].to_vec::<i64>()?
        != l[rank]
            .to_vec::<i64>()?
            .iter()
            .map(|&v| if v == rank as i64 { other as i64 } else { v })
            .collect::<Vec<_>>()
    {
        return Err(format!("all_to_all {:?}", ys[other].to_vec::<i64>()?).into());
    }
    let y = df::all_to_all_single(&x, None, None, None)?;
    if y.to_vec::<i64>()? != if rank == 0 { vec![1, 2] } else { vec![10, 10] } {
        return Err(format!("a2as {:?}", y.to_vec::<i64>()?).into());
    }
    Ok(())
}

fn int64_avg_on_every_function(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = Tensor::from_vec(vec![rank as i64, 1], &[2])?;
    fails_everywhere(df::all_reduce(&x, ReduceOp::Avg, None), rank, None, "Avg")?;
    fails_everywhere(df::reduce(&x, 0, ReduceOp::Avg, None), rank, None, "Avg")?;
    fails_everywhere(
        df::reduce_scatter(&[x.clone(), x.clone()], ReduceOp::Avg, None),
        rank,
        None,
        "Avg",
    )?;
    still_works(None)
}

fn int64_avg_on_rank_1_only(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = Tensor::from_vec(vec![rank as i64, 1], &[2])?;
    let op = if rank == 1 {
        ReduceOp::Avg
    } else {
        ReduceOp::Sum
    };
    fails_everywhere(df::all_reduce(&x, op, None), rank, Some(1), "Avg")?;
    fails_everywhere(df::reduce(&x, 0, op, None), rank, Some(1), "Avg")?;
    fails_everywhere(
        df::reduce_scatter(&[x.clone(), x.clone()], op, None),
        rank,
        Some(1),
        "Avg",
    )?;
    still_works(None)
}

fn bitwise_op_on_floats(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let f = zeros_f64;
    fails_everywhere(
        df::all_reduce(&f(), ReduceOp::BAnd, None),
        rank,
        None,
        "BAnd",
    )?;
    still_works(None)
}

fn reduce_scatter_a_huge_expanded_view_in_a_bad_lis(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let f = zeros_f64;
    let huge = huge_view;
    let l = if rank == 1 { [huge(), f()] } else { [f(), f()] };
    let r = df::reduce_scatter(&l, ReduceOp::Sum, None);
    fails_everywhere(r, rank, Some(1), "input_list[1]")?;
    still_works(None)
}

fn all_reduce_broadcast_reduce_a_huge_expanded_view(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let f = zeros_f64;
    let huge = huge_view;
    let x = if rank == 1 { huge() } else { f() };
    let r = df::all_reduce(&x, ReduceOp::Sum, None);
    fails_everywhere(r, rank, Some(1), "memory")?;
    let r = df::broadcast(&x, 0, None);
    fails_everywhere(r, rank, Some(1), "memory")?;
    let r = df::reduce(&x, 0, ReduceOp::Max, None);
    fails_everywhere(r, rank, Some(1), "memory")?;
    still_works(None)
}

fn all_reduce_shapes_differ(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let sh = shape_by_rank(rank);
    fails_everywhere(
        df::all_reduce(&sh(), ReduceOp::Sum, None),
        rank,
        None,
        "shape",
    )?;
    still_works(None)
}

fn all_reduce_dtypes_differ(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let dt = dtype_by_rank(rank);
    fails_everywhere(
        df::all_reduce(&dt(), ReduceOp::Sum, None),
        rank,
        None,
        "dtype",
    )?;
    still_works(None)
}

fn all_reduce_ops_differ(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let f = zeros_f64;
    let op = if rank == 0 {
        ReduceOp::Sum
    } else {
        ReduceOp::Max
    };
    fails_everywhere(df::all_reduce(&f(), op, None), rank, None, "op Max")?;
    still_works(None)
}

fn broadcast_shapes_differ(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let sh = shape_by_rank(rank);
    fails_everywhere(df::broadcast(&sh(), 0, None), rank, None, "shape")?;
    still_works(None)
}

fn broadcast_src_differs(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let f = zeros_f64;
    fails_everywhere(df::broadcast(&f(), rank, None), rank, None, "src")?;
    still_works(None)
}

fn reduce_dtypes_differ(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let dt = dtype_by_rank(rank);
    fails_everywhere(
        df::reduce(&dt(), 0, ReduceOp::Sum, None),
        rank,
        None,
        "dtype",
    )?;
    still_works(None)
}

fn reduce_dst_differs(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let f = zeros_f64;
    fails_everywhere(
        df::reduce(&f(), rank, ReduceOp::Sum, None),
        rank,
        None,
        "dst",
    )?;
    still_works(None)
}

fn broadcast_dtypes_reduce_shapes_and_ops_reduce_sc(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let f = zeros_f64;
    let sh = shape_by_rank(rank);
    let dt = dtype_by_rank(rank);
    fails_everywhere(df::broadcast(&dt(), 1, None), rank, None, "dtype")?;
    fails_everywhere(
        df::reduce(&sh(), 1, ReduceOp::Sum, None),
        rank,
        None,
        "shape",
    )?;
    let op = if rank == 0 {
        ReduceOp::Min
    } else {
        ReduceOp::Max
    };
    fails_everywhere(df::reduce(&f(), 1, op, None), rank, None, "op Min")?;
    let r = df::reduce_scatter(&[f(), f()], op, None);
    fails_everywhere(r, rank, None, "op Max")?;
    still_works(None)
}

fn reduce_scatter_shapes_differ(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let sh = shape_by_rank(rank);
    let r = df::reduce_scatter(&[sh(), sh()], ReduceOp::Sum, None);
    fails_everywhere(r, rank, None, "shape")?;
    still_works(None)
}

fn reduce_scatter_dtypes_differ(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let dt = dtype_by_rank(rank);
    let r = df::reduce_scatter(&[dt(), dt()], ReduceOp::Sum, None);
    fails_everywhere(r, rank, None, "dtype")?;
    still_works(None)
}

fn all_gather_dtypes_differ(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let dt = dtype_by_rank(rank);
    fails_everywhere(df::all_gather(&dt(), None), rank, None, "dtype")?;
    still_works(None)
}

fn gather_dtypes_differ(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let dt = dtype_by_rank(rank);
    fails_everywhere(df::gather(&dt(), 0, None), rank, None, "dtype")?;
    still_works(None)
}

fn gather_dst_differs(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let f = zeros_f64;
    fails_everywhere(df::gather(&f(), rank, None), rank, None, "dst")?;
    still_works(None)
}

fn scatter_src_differs(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let f = zeros_f64;
    let l = [f(), f()];
    fails_everywhere(df::scatter(Some(&l), rank, None), rank, None, "src")?;
    still_works(None)
}

fn all_to_all_dtypes_differ(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let dt = dtype_by_rank(rank);
    fails_everywhere(df::all_to_all(&[dt(), dt()], None), rank, None, "dtype")?;
    still_works(None)
}

fn all_to_all_shapes_of_a_pair_differ(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let sh = shape_by_rank(rank);
    let other = 1 - rank;
    // what rank 0 sends to rank 1 has 2 elements, but rank 1 receives whatever is sent
    let r = df::all_to_all(&[sh(), sh()], None)?;
    if r[other].shape() != [2 + other] {
        return Err(format!("received shape {:?}", r[other].shape()).into());
    }
    still_works(None)
}

fn root_outside_the_world(w: &World, (call, bad): (usize, Option<usize>)) -> TestResult {
    let rank = w.rank;
    let f = zeros_f64;
    let root = if bad.is_none_or(|b| b == rank) { 7 } else { 0 };
    let l = [f(), f()];
    let r = match call {
        0 => df::broadcast(&f(), root, None).map(|_| ()),
        1 => df::reduce(&f(), root, ReduceOp::Sum, None).map(|_| ()),
        2 => df::gather(&f(), root, None).map(|_| ()),
        _ => df::scatter(Some(&l), root, None).map(|_| ()),
    };
    let own = if call == 1 || call == 2 { "dst" } else { "src" };
    fails_everywhere(r, rank, bad, own)?;
    still_works(None)
}

fn scatter_odd_placeholders(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let src = [
        f64s(&[1.0, 2.0], &[2]).requires_grad_(true),
        f64s(&[3.0], &[1]).requires_grad_(true),
    ];
    let ph = [
        Tensor::scalar(1.0f64).requires_grad_(true),
        Tensor::zeros(&[1, 1, 1, 1, 1, 1, 1, 1, 1], DType::F32)?.requires_grad_(true),
        Tensor::zeros(&[3], DType::Bool)?,
        Tensor::zeros(&[0], DType::I64)?,
        Tensor::zeros(&[5, 0], DType::F64)?,
    ];
    let y = if rank == 0 {
        df::scatter(Some(&src), 0, None)?
    } else {
        df::scatter(Some(&ph), 0, None)?
    };
    eq(
        "scatter value",
        y.to_vec::<f64>()?,
        if rank == 0 { vec![1.0, 2.0] } else { vec![3.0] },
    )?;
    y.sum()?.backward()?;
    if rank == 0 {
        eq(
            "src grad 0",
            src[0].grad().ok_or("no grad")?.to_vec()?,
            vec![1.0, 1.0],
        )?;
        eq(
            "src grad 1",
            src[1].grad().ok_or("no grad")?.to_vec()?,
            vec![1.0],
        )?;
    } else {
        eq(
            "ph grad",
            ph[0].grad().ok_or("no grad")?.to_vec()?,
            vec![0.0],
        )?;
    }
    still_works(None)
}

fn scatter_mixed_dtypes_on_src(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let f = zeros_f64;
    let l = [f(), Tensor::zeros(&[2], DType::F32)?];
    let r = df::scatter(if rank == 0 { Some(&l[..]) } else { None }, 0, None);
    fails_everywhere(r, rank, Some(0), "tensors[1]")?;
    still_works(None)
}

fn scatter_wrong_count_on_src(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let f = zeros_f64;
    let l = [f(), f(), f()];
    let r = df::scatter(Some(&l[..]), 0, None);
    fails_everywhere(r, rank, Some(0), "tensors")?;
    still_works(None)
}

fn through_every_function(w: &World, shape: &'static [usize]) -> TestResult {
    let rank = w.rank;
    let n: usize = shape.iter().product();
    let x = Tensor::from_vec(vec![rank as f64 + 1.5; n], shape)?.requires_grad_(true);
    for (name, ys) in every_function(&x, 1)? {
        let mut loss = Tensor::scalar(0.0f64);
        for y in &ys {
            loss = loss.add(&y.sum()?)?;
        }
        loss.backward_with(None, true, false)
            .map_err(|e| format!("{name}: {e}"))?;
        let g = x.grad().ok_or_else(|| format!("{name}: no grad"))?;
        if g.shape() != x.shape() {
            return Err(format!("{name}: grad shape {:?}", g.shape()).into());
        }
        x.set_grad(None);
    }
    still_works(None)
}

fn expanded_input_through_every_function(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let base = f64s(&[rank as f64 + 2.0], &[1, 1]).requires_grad_(true);
    let x = base.expand(&[2, 3])?;
    for (name, ys) in every_function(&x, 0)? {
        let mut loss = Tensor::scalar(0.0f64);
        for y in &ys {
            loss = loss.add(&y.sum()?)?;
        }
        loss.backward_with(None, true, false)
            .map_err(|e| format!("{name}: {e}"))?;
        base.set_grad(None);
    }
    let y = df::all_reduce(&x, ReduceOp::Sum, None)?;
    eq("expanded all_reduce", y.to_vec()?, vec![5.0; 6])?;
    still_works(None)
}

fn no_grad(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = f64s(&[rank as f64 + 1.0, 2.0], &[2]).requires_grad_(true);
    let _ng = tp::no_grad();
    for (name, ys) in every_function(&x, 0)? {
        if ys.iter().any(Tensor::requires_grad) {
            return Err(format!("{name} requires grad under no_grad").into());
        }
    }
    drop(_ng);
    still_works(None)
}

fn reused_outputs_and_retain_graph(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = f64s(&[rank as f64 + 1.0, 2.0], &[2]).requires_grad_(true);
    let y = df::all_reduce(&x, ReduceOp::Sum, None)?;
    let z = df::all_reduce(&y, ReduceOp::Max, None)?;
    let ys = df::all_gather(&z, None)?;
    let w = df::reduce_scatter(&ys, ReduceOp::Product, None)?;
    let loss = w.sum()?;
    loss.backward_with(None, true, false)?;
    let g1 = x.grad().ok_or("no grad")?.to_vec::<f64>()?;
    loss.backward_with(None, true, false)?;
    let g2 = x.grad().ok_or("no grad")?.to_vec::<f64>()?;
    let twice: Vec<f64> = g1.iter().map(|v| 2.0 * v).collect();
    eq("second backward accumulates", g2, twice)?;
    // a third backward without retain_graph, then a fourth must fail on every rank
    loss.backward()?;
    let r = loss.backward();
    if r.is_ok() {
        return Err("backward through a freed graph succeeded".into());
    }
    still_works(None)
}

fn nan_and_inf(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let v = if rank == 0 {
        vec![f64::NAN, f64::INFINITY, 1.0, f64::NEG_INFINITY]
    } else {
        vec![1.0, 2.0, f64::INFINITY, 0.0]
    };
    for op in [ReduceOp::Max, ReduceOp::Min, ReduceOp::Product] {
        let x = f64s(&v, &[4]).requires_grad_(true);
        let y = df::all_reduce(&x, op, None)?;
        y.sum()?.backward()?;
        let g = x.grad().ok_or("no grad")?.to_vec::<f64>()?;
        let yv = y.to_vec::<f64>()?;
        if !yv[0].is_nan() {
            return Err(format!("{op:?}: NaN lost: {yv:?}").into());
        }
        if op != ReduceOp::Product {
            // the NaN holder gets the gradient, the other rank none
            let want0 = if rank == 0 { 2.0 } else { 0.0 };
            if g[0] != want0 {
                return Err(format!("{op:?}: grad {g:?}").into());
            }
        }
    }
    still_works(None)
}

fn blocking_collectives_and_requires_grad(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = f64s(&[1.0, 2.0], &[2]).requires_grad_(true);
    let r = dist::all_reduce(&x, ReduceOp::Sum, None);
    fails_everywhere(r.map_err(tp::Error::from), rank, None, "requires grad")?;
    let d = x.detach();
    dist::all_reduce(&d, ReduceOp::Sum, None)?;
    eq("detach all_reduce", x.to_vec()?, vec![2.0, 4.0])?;
    {
        let _ng = tp::no_grad();
        dist::all_reduce(&x, ReduceOp::Sum, None)?;
        dist::broadcast(&x, 0, None)?;
        let out = [
            Tensor::zeros(&[2], DType::F64)?,
            Tensor::zeros(&[2], DType::F64)?,
        ];
        dist::all_gather(&out, &x, None)?;
    }
    eq("no_grad all_reduce", x.to_vec()?, vec![4.0, 8.0])?;
    // a detached view of a non-leaf
    let y = x.mul_scalar(1.0)?;
    let v = y.detach().select(0, 1)?;
    dist::all_reduce(&v, ReduceOp::Sum, None)?;
    eq("detached view", y.to_vec()?, vec![4.0, 16.0])?;
    // an output that requires grad, given to all_gather
    let out = [
        Tensor::zeros(&[2], DType::F64)?.requires_grad_(true),
        Tensor::zeros(&[2], DType::F64)?,
    ];
    let r = dist::all_gather(&out, &x.detach(), None);
    fails_everywhere(r.map_err(tp::Error::from), rank, None, "requires grad")?;
    still_works(None)
}

fn asymmetric_losses_over_two_collectives(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x1 = f64s(&[1.0, 2.0], &[2]).requires_grad_(true);
    let x2 = f64s(&[3.0, 4.0], &[2]).requires_grad_(true);
    let y1 = df::all_reduce(&x1, ReduceOp::Sum, None)?;
    let y2 = df::all_reduce(&x2, ReduceOp::Sum, None)?;
    let loss = if rank == 0 {
        y1.sum()?.add(&y2.mul_scalar(2.0)?.sum()?)?
    } else {
        let mut deep = y1.mul_scalar(5.0)?;
        for _ in 0..6 {
            deep = deep.add_scalar(1.0)?.sub_scalar(1.0)?;
        }
        y2.mul_scalar(3.0)?.sum()?.add(&deep.sum()?)?
    };
    loss.backward()?;
    eq(
        "x1 grad",
        x1.grad().ok_or("no grad")?.to_vec()?,
        vec![6.0, 6.0],
    )?;
    eq(
        "x2 grad",
        x2.grad().ok_or("no grad")?.to_vec()?,
        vec![5.0, 5.0],
    )?;
    Ok(())
}

fn async_collectives_and_requires_grad(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let p = f64s(&[1.0, 2.0], &[2]).requires_grad_(true);
    {
        let _ng = tp::no_grad();
        dist::all_reduce_async(&p, ReduceOp::Sum, None)?.wait(None)?;
        dist::broadcast_async(&p, 0, None)?.wait(None)?;
        let out = Tensor::zeros(&[4], DType::F64)?;
        dist::all_gather_into_tensor_async(&out, &p, None)?.wait(None)?;
        let o = Tensor::zeros(&[1], DType::F64)?;
        dist::reduce_scatter_tensor_async(&o, &p, ReduceOp::Sum, None)?.wait(None)?;
        dist::all_to_all_single_async(&out, &out.detach(), None, None, None)?.wait(None)?;
    }
    eq("async values", p.to_vec()?, vec![2.0, 4.0])?;
    let r = dist::all_reduce_async(&p, ReduceOp::Sum, None).and_then(|w| w.wait(None));
    fails_everywhere(r.map_err(tp::Error::from), rank, None, "requires grad")?;
    still_works(None)
}

fn one_member_group_every_function(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let mine = &w.groups[rank];
    let x = f64s(&[rank as f64 + 1.0, 2.0], &[2]).requires_grad_(true);
    let g = Some(mine);
    let mut outs = vec![
        df::all_reduce(&x, ReduceOp::Product, g)?,
        df::reduce(&x, rank, ReduceOp::Max, g)?,
        df::broadcast(&x, rank, g)?,
        df::reduce_scatter(std::slice::from_ref(&x), ReduceOp::Min, g)?,
        df::scatter(Some(std::slice::from_ref(&x)), rank, g)?,
        df::all_to_all_single(&x, None, None, g)?,
    ];
    outs.extend(df::all_gather(&x, g)?);
    outs.extend(df::gather(&x, rank, g)?);
    outs.extend(df::all_to_all(std::slice::from_ref(&x), g)?);
    let mut loss = Tensor::scalar(0.0f64);
    for y in &outs {
        eq("identity", y.to_vec()?, vec![rank as f64 + 1.0, 2.0])?;
        loss = loss.add(&y.sum()?)?;
    }
    loss.backward()?;
    eq("grad", x.grad().ok_or("no grad")?.to_vec()?, vec![9.0, 9.0])?;
    Ok(())
}

fn one_member_group_root_of_another_rank(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let mine = &w.groups[rank];
    let x = f64s(&[1.0], &[1]);
    let other = (rank + 1) % 3;
    fails_everywhere(df::broadcast(&x, other, Some(mine)), rank, None, "src")?;
    fails_everywhere(df::gather(&x, other, Some(mine)), rank, None, "dst")?;
    Ok(())
}

fn non_member_calls(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let solo = &w.groups[..3];
    let x = f64s(&[1.0], &[1]);
    let g = Some(&solo[(rank + 1) % 3]);
    let what = "group";
    fails_everywhere(df::all_reduce(&x, ReduceOp::Sum, g), rank, None, what)?;
    fails_everywhere(df::broadcast(&x, 0, g), rank, None, what)?;
    fails_everywhere(df::reduce(&x, 0, ReduceOp::Sum, g), rank, None, what)?;
    fails_everywhere(df::all_gather(&x, g), rank, None, what)?;
    fails_everywhere(df::gather(&x, 0, g), rank, None, what)?;
    fails_everywhere(df::scatter(None, 0, g), rank, None, what)?;
    fails_everywhere(
        df::reduce_scatter(std::slice::from_ref(&x), ReduceOp::Sum, g),
        rank,
        None,
        what,
    )?;
    fails_everywhere(
        df::all_to_all(std::slice::from_ref(&x), g),
        rank,
        None,
        what,
    )?;
    fails_everywhere(df::all_to_all_single(&x, None, None, g), rank, None, what)?;
    Ok(())
}

fn root_outside_the_subgroup(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let g = Some(&w.groups[3]);
    let x = f64s(&[1.0], &[1]);
    fails_everywhere(df::broadcast(&x, 1, g), rank, None, "src")?;
    fails_everywhere(df::reduce(&x, 1, ReduceOp::Sum, g), rank, None, "dst")?;
    fails_everywhere(df::gather(&x, 1, g), rank, None, "dst")?;
    let l = [x.clone(), x.clone()];
    fails_everywhere(df::scatter(Some(&l), 1, g), rank, None, "src")?;
    still_works(g)
}

fn requires_grad_on_one_rank_only_a_named_timeout(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let g = Some(&w.groups[3]);
    let x = f64s(&[1.0], &[1]).requires_grad_(rank == 0);
    let y = df::all_reduce(&x, ReduceOp::Sum, g)?;
    if rank == 0 {
        let e = match y.sum()?.backward() {
            Ok(()) => return Err("backward succeeded".into()),
            Err(e) => e.to_string(),
        };
        if !e.contains("timed out") || !e.contains("rank 2") {
            return Err(format!("error should be a timeout naming rank 2: {e}").into());
        }
    }
    Ok(())
}

fn all_gather_vs_gather(rank: usize, g: &ProcessGroup) -> tp::Result<()> {
    let x = f64s(&[1.0], &[1]);
    if rank == 0 {
        df::all_gather(&x, Some(g)).map(|_| ())
    } else {
        df::gather(&x, 0, Some(g)).map(|_| ())
    }
}

fn all_reduce_vs_all_gather(rank: usize, g: &ProcessGroup) -> tp::Result<()> {
    let x = f64s(&[1.0], &[1]);
    if rank == 0 {
        df::all_reduce(&x, ReduceOp::Sum, Some(g)).map(|_| ())
    } else {
        df::all_gather(&x, Some(g)).map(|_| ())
    }
}

fn blocking_all_reduce_vs_reduce(rank: usize, g: &ProcessGroup) -> tp::Result<()> {
    let t = Tensor::zeros(&[2], DType::F64)?;
    Ok(if rank == 0 {
        dist::all_reduce(&t, ReduceOp::Sum, Some(g))
    } else {
        dist::reduce(&t, 0, ReduceOp::Sum, Some(g))
    }?)
}

fn metadata_lengths_differ(rank: usize, g: &ProcessGroup) -> tp::Result<()> {
    let d = vec![1i64; 2 + rank];
    dist::all_gather_metadata("hostile", &d, Ok(()), Some(g))?;
    Ok(())
}

fn different_collectives(w: &World, f: PairCall) -> TestResult {
    let rank = w.rank;
    let g = dist::new_group(&[0, 1], None, None)?;
    let e = f(rank, &g).err().ok_or("succeeded")?.to_string();
    if e.contains("timed out") || !e.contains("different collectives?") {
        return Err(format!("unclear error: {e}").into());
    }
    still_works(None)
}

fn blocking_all_reduce_on_rank_0_broadcast_on_rank(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let t = Tensor::zeros(&[2], DType::F64)?;
    let r = if rank == 0 {
        dist::all_reduce(&t, ReduceOp::Sum, None)
    } else {
        dist::broadcast(&t, 0, None)
    };
    let e = r.err().ok_or("succeeded")?.to_string();
    if !e.contains("all_reduce") || !e.contains("broadcast") {
        return Err(format!("unclear error: {e}").into());
    }
    still_works(None)
}

fn all_gather_metadata_empty(_w: &World, _: ()) -> TestResult {
    let r = dist::all_gather_metadata("hostile", &[], Ok(()), None)?;
    if r != vec![Vec::<i64>::new(); 2] {
        return Err(format!("{r:?}").into());
    }
    still_works(None)
}

fn aliased_list_elements(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let x = pair_by_rank(rank);
    let a = x().requires_grad_(true);
    let l = [a.clone(), a.clone()];
    let y = df::reduce_scatter(&l, ReduceOp::Sum, None)?;
    y.sum()?.backward()?;
    eq(
        "reduce_scatter",
        a.grad().ok_or("no grad")?.to_vec()?,
        vec![2.0, 2.0],
    )?;
    a.set_grad(None);
    let ys = df::all_to_all(&l, None)?;
    ys[0].add(&ys[1])?.sum()?.backward()?;
    eq(
        "all_to_all",
        a.grad().ok_or("no grad")?.to_vec()?,
        vec![2.0, 2.0],
    )?;
    a.set_grad(None);
    let y = df::scatter(Some(&l), 1, None)?;
    y.sum()?.backward()?;
    let want = if rank == 1 {
        vec![2.0, 2.0]
    } else {
        vec![0.0, 0.0]
    };
    eq("scatter", a.grad().ok_or("no grad")?.to_vec()?, want)?;
    a.set_grad(None);
    let ys = df::all_gather(&a, None)?;
    let y = df::reduce_scatter(&ys, ReduceOp::Max, None)?;
    y.sum()?.backward()?;
    Ok(())
}

fn uneven_shapes_zero_d_and_empty_through_the_shape(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let a = if rank == 0 {
        Tensor::scalar(3.0f64)
    } else {
        Tensor::zeros(&[0, 2], DType::F64)?
    }
    .requires_grad_(true);
    let ys = df::all_gather(&a, None)?;
    if ys[0].shape() != [] as [usize; 0] || ys[1].shape() != [0, 2] {
        return Err(format!("shapes {:?} {:?}", ys[0].shape(), ys[1].shape()).into());
    }
    ys[0].mul_scalar(2.0)?.add(&ys[1].sum()?)?.backward()?;
    let want = if rank == 0 { vec![4.0] } else { vec![] };
    eq(
        "all_gather grad",
        a.grad().ok_or("no grad")?.to_vec()?,
        want,
    )?;
    a.set_grad(None);
    let ys = df::gather(&a, 1, None)?;
    ys[0].sum()?.add(&ys[1].sum()?)?.backward()?;
    let want = if rank == 0 { vec![1.0] } else { vec![] };
    eq("gather grad", a.grad().ok_or("no grad")?.to_vec()?, want)?;
    a.set_grad(None);
    let l = [a.clone(), a.clone()];
    let ys = df::all_to_all(&l, None)?;
    ys[0].sum()?.add(&ys[1].sum()?)?.backward()?;
    let want = if rank == 0 { vec![2.0] } else { vec![] };
    eq(
        "all_to_all grad",
        a.grad().ok_or("no grad")?.to_vec()?,
        want,
    )?;
    a.set_grad(None);
    let ys = if rank == 0 {
        df::scatter(
            Some(&[
                Tensor::scalar(1.0f64).requires_grad_(true),
                Tensor::zeros(&[0, 2], DType::F64)?,
            ]),
            0,
            None,
        )?
    } else {
        df::scatter(None, 0, None)?
    };
    let want: &[usize] = if rank == 0 { &[] } else { &[0, 2] };
    if ys.shape() != want {
        return Err(format!("scatter shape {:?}", ys.shape()).into());
    }
    ys.sum()?.backward()?;
    still_works(None)
}

fn a2as_zero_size_splits_one_list_given(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    // rank 0 sends everything to rank 1; rank 1 keeps its 1 row
    let rows = if rank == 0 { 3 } else { 1 };
    let a = Tensor::from_vec(
        (0..rows * 2)
            .map(|v| v as f64 + 10.0 * rank as f64)
            .collect::<Vec<_>>(),
        &[rows, 2],
    )?
    .requires_grad_(true);
    let ins: &[usize] = if rank == 0 { &[0, 3] } else { &[0, 1] };
    let outs: &[usize] = if rank == 0 { &[0, 0] } else { &[3, 1] };
    let y = df::all_to_all_single(
        &a,
        if rank == 1 { Some(outs) } else { None },
        Some(ins),
        None,
    )?;
    let want_rows = if rank == 0 { 0 } else { 4 };
    if y.shape() != [want_rows, 2] {
        return Err(format!("shape {:?}", y.shape()).into());
    }
    y.mul_scalar(3.0)?.sum()?.backward()?;
    eq(
        "grad",
        a.grad().ok_or("no grad")?.to_vec()?,
        vec![3.0; rows * 2],
    )?;
    still_works(None)
}

fn reduce_and_reduce_scatter_max_with_nan(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let v = if rank == 0 {
        vec![f64::NAN, 1.0]
    } else {
        vec![2.0, 1.0]
    };
    let a = f64s(&v, &[2]).requires_grad_(true);
    let y = df::reduce(&a, 1, ReduceOp::Max, None)?;
    y.sum()?.backward()?;
    let want = if rank == 0 {
        vec![1.0, 0.5]
    } else {
        vec![0.0, 0.5]
    };
    eq("reduce", a.grad().ok_or("no grad")?.to_vec()?, want.clone())?;
    a.set_grad(None);
    let l = [a.clone(), a.clone()];
    let y = df::reduce_scatter(&l, ReduceOp::Max, None)?;
    y.sum()?.backward()?;
    let want: Vec<f64> = want.iter().map(|v| v * 2.0).collect();
    eq("reduce_scatter", a.grad().ok_or("no grad")?.to_vec()?, want)?;
    still_works(None)
}

fn huge_empty_dims_a2as_rows_that_overflow_on_the_r(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let big = usize::MAX;
    let (x, ins): (Tensor, &[usize]) = if rank == 0 {
        (Tensor::zeros(&[big, 0], DType::F64)?, &[0, big])
    } else {
        (Tensor::zeros(&[1, 0], DType::F64)?, &[0, 1])
    };
    let r = df::all_to_all_single(&x, None, Some(ins), None);
    let e = r.err().ok_or("succeeded")?;
    // a mismatch on every rank naming rank 1, the receiver that would overflow
    let named = matches!(
        e.downcast_ref::<dist::Error>(),
        Some(dist::Error::Mismatch { detail, .. }) if detail.ranks().first() == Some(&1)
    );
    if !named {
        return Err(format!("unclear error: {e:?}").into());
    }
    still_works(None)
}

fn huge_empty_dims_all_gather_gather_all_to_all_sca(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    let big = 1usize << 63;
    let x = Tensor::zeros(&[big, 0], DType::F64)?;
    let ys = df::all_gather(&x, None)?;
    if ys[1 - rank].shape() != [big, 0] {
        return Err(format!("all_gather shape {:?}", ys[1 - rank].shape()).into());
    }
    let ys = df::gather(&x, 0, None)?;
    if ys[1].shape() != [big, 0] {
        return Err(format!("gather shape {:?}", ys[1].shape()).into());
    }
    let ys = df::all_to_all(&[x.clone(), x.clone()], None)?;
    if ys[1 - rank].shape() != [big, 0] {
        return Err(format!("all_to_all shape {:?}", ys[1 - rank].shape()).into());
    }
    let l = [x.clone(), x.clone()];
    let y = df::scatter(if rank == 0 { Some(&l[..]) } else { None }, 0, None)?;
    if y.shape() != [big, 0] {
        return Err(format!("scatter shape {:?}", y.shape()).into());
    }
    still_works(None)
}

fn timeout(_w: &World, t: Duration) -> TestResult {
    let g = dist::new_group(&[0, 1], None, Some(t));
    let g = match g {
        Ok(g) => g,
        Err(e) => {
            let e = e.to_string();
            return if e.contains("timed out") {
                Ok(())
            } else {
                Err(format!("unclear error: {e}").into())
            };
        }
    };
    let x = f64s(&[1.0], &[1]).requires_grad_(true);
    match df::all_reduce(&x, ReduceOp::Sum, Some(&g)) {
        Ok(y) => {
            eq("value", y.to_vec()?, vec![2.0])?;
            // with a zero timeout the backward's all-reduce may time out too (the other rank
            // a moment late): that is a clear error as well
            if let Err(e) = y.sum()?.backward() {
                let e = e.to_string();
                if !e.contains("timed out") {
                    return Err(format!("unclear error in backward: {e}").into());
                }
            }
        }
        Err(e) => {
            let e = e.to_string();
            if !e.contains("timed out") {
                return Err(format!("unclear error: {e}").into());
            }
        }
    }
    Ok(())
}

fn cuda_tensor(w: &World, _: ()) -> TestResult {
    let rank = w.rank;
    match Tensor::zeros(&[2], DType::F64)?.to_device(tp::Device::Cuda(0)) {
        Err(e) => {
            let e = e.to_string();
            if !e.to_lowercase().contains("cuda") {
                return Err(format!("unclear error: {e}").into());
            }
        }
        Ok(t) => {
            let r = df::all_gather(&t, None);
            fails_everywhere(r, rank, None, "CPU tensor")?;
        }
    }
    Ok(())
}
