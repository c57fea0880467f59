//! One rank alone passes bad arguments to a list collective (`all_gather`, `gather`,
//! `scatter`, `all_to_all`, `all_to_all_single`): every rank must fail that call, the bad rank
//! with its own error and the others naming it, and the group must stay in step, so that the
//! next, correct call of the same collective gives every rank the right values. One group
//! carries all the cases in sequence, which is what would pair a rank's next call with the
//! others' previous one if any rank left a call early.

use tensorplay_collectives::{self as dist, ReduceOp};
use tensorplay_core::{DType, Tensor};

use super::{TestResult, as_f64, check, init};

const N: usize = 3;
const BAD: usize = 1;

/// Checks that `r` is an error, of the bad rank's own arguments on [`BAD`] and naming [`BAD`]
/// (`others` in the message) on the other ranks.
fn failed(case: &str, rank: usize, r: dist::Result<()>, mine: &str, others: &str) -> TestResult {
    let Err(e) = r else {
        return Err(format!("case {case}: rank {rank} returned Ok").into());
    };
    // the rank is a field: the bad rank's own InvalidArgument, a Mismatch naming it elsewhere
    let named = match &e {
        dist::Error::InvalidArgument { rank: r, .. } => rank == BAD && *r == BAD as i64,
        dist::Error::Mismatch { detail, .. } => rank != BAD && detail.ranks().contains(&BAD),
        _ => false,
    };
    if !named {
        return Err(
            format!("case {case}: rank {rank}'s error does not name rank {BAD}: {e:?}").into(),
        );
    }
    // the words a person reads
    let e = e.to_string();
    let want = if rank == BAD { mine } else { others };
    if !e.contains(want) {
        return Err(format!("case {case}: rank {rank}'s error lacks {want:?}: {e}").into());
    }
    if e.contains("rank -1") {
        return Err(format!("case {case}: rank {rank}'s error says rank -1: {e}").into());
    }
    Ok(())
}

fn f32s(v: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(v, shape).expect("tensor")
}

/// Rank `r`'s value for slot `s` of a correct call: distinct per (rank, slot, case).
fn val(r: usize, s: usize, case: usize) -> f32 {
    (100 * case + 10 * r + s) as f32
}

fn all_gather_ok(rank: usize, case: usize) -> TestResult {
    let list: Vec<Tensor> = (0..N)
        .map(|_| Tensor::zeros(&[2], DType::F32))
        .collect::<Result<_, _>>()?;
    dist::all_gather(&list, &f32s(vec![val(rank, 0, case); 2], &[2]), None)?;
    for (r, t) in list.iter().enumerate() {
        check(
            &format!("case {case}: all_gather slot {r} on rank {rank}"),
            as_f64(t),
            vec![f64::from(val(r, 0, case)); 2],
        )?;
    }
    Ok(())
}

fn gather_ok(rank: usize, case: usize) -> TestResult {
    let list: Vec<Tensor> = (0..N)
        .map(|_| Tensor::zeros(&[2], DType::F32))
        .collect::<Result<_, _>>()?;
    let mine = f32s(vec![val(rank, 0, case); 2], &[2]);
    dist::gather(&mine, (rank == 0).then_some(&list[..]), 0, None)?;
    if rank == 0 {
        for (r, t) in list.iter().enumerate() {
            check(
                &format!("case {case}: gather slot {r}"),
                as_f64(t),
                vec![f64::from(val(r, 0, case)); 2],
            )?;
        }
    }
    Ok(())
}

fn scatter_ok(rank: usize, case: usize) -> TestResult {
    let list: Vec<Tensor> = (0..N)
        .map(|r| f32s(vec![val(r, 1, case); 2], &[2]))
        .collect();
    let out = Tensor::zeros(&[2], DType::F32)?;
    dist::scatter(&out, (rank == 0).then_some(&list[..]), 0, None)?;
    check(
        &format!("case {case}: scatter on rank {rank}"),
        as_f64(&out),
        vec![f64::from(val(rank, 1, case)); 2],
    )
}

fn all_to_all_ok(rank: usize, case: usize) -> TestResult {
    let inputs: Vec<Tensor> = (0..N)
        .map(|s| f32s(vec![val(rank, s, case)], &[1]))
        .collect();
    let outs: Vec<Tensor> = (0..N)
        .map(|_| Tensor::zeros(&[1], DType::F32))
        .collect::<Result<_, _>>()?;
    dist::all_to_all(&outs, &inputs, None)?;
    for (r, t) in outs.iter().enumerate() {
        check(
            &format!("case {case}: all_to_all from {r} on rank {rank}"),
            as_f64(t),
            vec![f64::from(val(r, rank, case))],
        )?;
    }
    Ok(())
}

fn all_to_all_single_ok(rank: usize, case: usize) -> TestResult {
    let input = f32s((0..N).map(|s| val(rank, s, case)).collect(), &[N]);
    let out = Tensor::zeros(&[N], DType::F32)?;
    dist::all_to_all_single(&out, &input, None, None, None)?;
    let want: Vec<f64> = (0..N).map(|r| f64::from(val(r, rank, case))).collect();
    check(
        &format!("case {case}: all_to_all_single on rank {rank}"),
        as_f64(&out),
        want,
    )
}

#[test]
fn one_ranks_bad_arguments_fail_the_call_on_every_rank_and_the_next_call_is_right() -> TestResult {
    dist::spawn::spawn(N, |rank| -> TestResult {
        init(10)?;
        let bad = rank == BAD;
        let rejected = "rank(s) [1] rejected their own arguments";
        let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32).expect("zeros");
        let zs = |k: usize, shape: &[usize]| (0..k).map(|_| z(shape)).collect::<Vec<_>>();
        let mut case = 0;
        let mut next = || {
            case += 1;
            case
        };

        // all_gather: a list of the wrong length, a bool input, a wrong shape in the list (a
        // check that needs the other ranks' shapes)
        let c = next();
        let list = zs(if bad { 2 } else { N }, &[2]);
        failed(
            "all_gather list length",
            rank,
            dist::all_gather(&list, &z(&[2]), None),
            "tensor_list",
            rejected,
        )?;
        all_gather_ok(rank, c)?;
        let c = next();
        let input = if bad {
            Tensor::zeros(&[2], DType::Bool)?
        } else {
            z(&[2])
        };
        failed(
            "all_gather bool input",
            rank,
            dist::all_gather(&zs(N, &[2]), &input, None),
            "float32, float64, int64, bfloat16 or float16",
            rejected,
        )?;
        all_gather_ok(rank, c)?;
        let c = next();
        let mut list = zs(N, &[2]);
        if bad {
            list[0] = z(&[3]);
        }
        failed(
            "all_gather list shape",
            rank,
            dist::all_gather(&list, &z(&[2]), None),
            "tensor_list[0]",
            "rank 1's tensor_list[0] is float32 [3]",
        )?;
        all_gather_ok(rank, c)?;

        // gather: a dst outside the group, a bool input
        let c = next();
        let dst = if bad { 7 } else { 0 };
        let list = zs(N, &[2]);
        failed(
            "gather dst",
            rank,
            dist::gather(&z(&[2]), (rank == 0).then_some(&list[..]), dst, None),
            "dst",
            rejected,
        )?;
        gather_ok(rank, c)?;
        let c = next();
        let input = if bad {
            Tensor::zeros(&[2], DType::Bool)?
        } else {
            z(&[2])
        };
        failed(
            "gather bool input",
            rank,
            dist::gather(&input, (rank == 0).then_some(&list[..]), 0, None),
            "float32, float64, int64, bfloat16 or float16",
            rejected,
        )?;
        gather_ok(rank, c)?;

        // scatter: a src outside the group, an expanded (overlapping) output
        let c = next();
        let src = if bad { 9 } else { 0 };
        let list = zs(N, &[2]);
        failed(
            "scatter src",
            rank,
            dist::scatter(&z(&[2]), (rank == 0).then_some(&list[..]), src, None),
            "src",
            rejected,
        )?;
        scatter_ok(rank, c)?;
        let c = next();
        let out = if bad { z(&[1]).expand(&[2])? } else { z(&[2]) };
        failed(
            "scatter expanded output",
            rank,
            dist::scatter(&out, (rank == 0).then_some(&list[..]), 0, None),
            "expanded view",
            rejected,
        )?;
        scatter_ok(rank, c)?;

        // all_to_all: an output list of the wrong length, mixed dtypes
        let c = next();
        let outs = zs(if bad { 1 } else { N }, &[1]);
        failed(
            "all_to_all list length",
            rank,
            dist::all_to_all(&outs, &zs(N, &[1]), None),
            "output_list",
            rejected,
        )?;
        all_to_all_ok(rank, c)?;
        let c = next();
        let mut outs = zs(N, &[1]);
        if bad {
            outs[2] = Tensor::zeros(&[1], DType::F64)?;
        }
        failed(
            "all_to_all dtypes",
            rank,
            dist::all_to_all(&outs, &zs(N, &[1]), None),
            "one dtype",
            rejected,
        )?;
        all_to_all_ok(rank, c)?;

        // all_to_all_single: split sizes that do not sum to the rows, an output of another dtype
        let c = next();
        let splits: &[usize] = if bad { &[1, 1, 2] } else { &[1, 1, 1] };
        failed(
            "all_to_all_single splits",
            rank,
            dist::all_to_all_single(&z(&[N]), &z(&[N]), None, Some(splits), None),
            "input_split_sizes",
            rejected,
        )?;
        all_to_all_single_ok(rank, c)?;
        let c = next();
        let out = if bad {
            Tensor::zeros(&[N], DType::F64)?
        } else {
            z(&[N])
        };
        failed(
            "all_to_all_single dtype",
            rank,
            dist::all_to_all_single(&out, &z(&[N]), None, None, None),
            "input's dtype",
            rejected,
        )?;
        all_to_all_single_ok(rank, c)?;

        // and the group is still whole
        let t = f32s(vec![1.0; 2], &[2]);
        dist::all_reduce(&t, ReduceOp::Sum, None)?;
        check("the last all_reduce", as_f64(&t), vec![N as f64; 2])?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}
