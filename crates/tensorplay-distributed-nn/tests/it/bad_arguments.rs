//! One rank's bad arguments fail the call on every rank — that rank with its own error, the
//! others with an error naming it — and the group stays usable: no hang, no timeout.

use std::time::Duration;

use tensorplay_collectives::{self as dist, InitOptions, ReduceOp};
use tensorplay_core::{DType, Tensor};
use tensorplay_distributed_nn::functional as df;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn f64s(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).expect("tensor")
}

/// `r` failed on every rank: rank `bad` with an error mentioning `own`, the others naming it;
/// never a timeout.
fn fails_everywhere<T>(
    what: &str,
    r: tensorplay_core::Result<T>,
    rank: usize,
    bad: usize,
    own: &str,
) -> TestResult {
    let Err(e) = r else {
        return Err(format!("{what}: rank {rank} succeeded").into());
    };
    // the rank is a field: the bad rank's own InvalidArgument (or a core error of its tensor),
    // a Mismatch naming it on the others; never a timeout
    let named = match e.downcast_ref::<dist::Error>() {
        Some(dist::Error::InvalidArgument { rank: r, .. }) => rank == bad && *r == bad as i64,
        Some(dist::Error::Mismatch { detail, .. }) => {
            rank != bad && detail.parts().get(1) == Some(&dist::Part::Ranks(vec![bad]))
        }
        Some(_) => false,
        None => rank == bad,
    };
    if !named {
        return Err(format!("{what}: rank {rank}'s error should name rank {bad}: {e:?}").into());
    }
    // the bad rank's own words name its argument
    let e = e.to_string();
    if rank == bad && !e.contains(own) {
        return Err(format!("{what}: rank {rank}'s error should mention {own:?}: {e}").into());
    }
    Ok(())
}

/// The group still computes the right sum.
fn still_works(rank: usize) -> TestResult {
    let x = f64s(&[rank as f64 + 1.0], &[1]).requires_grad_(true);
    let y = df::all_reduce(&x, ReduceOp::Sum, None)?;
    assert_eq!(y.to_vec::<f64>()?, vec![3.0]);
    y.sum()?.backward()?;
    assert_eq!(x.grad().expect("grad").to_vec::<f64>()?, vec![2.0]);
    Ok(())
}

#[test]
fn one_ranks_bad_list_fails_every_rank_and_the_group_goes_on() -> TestResult {
    dist::spawn(2, |rank| -> TestResult {
        dist::init_process_group(
            "cpu",
            InitOptions {
                timeout: Duration::from_secs(60),
                ..Default::default()
            },
        )?;
        let t = || f64s(&[1.0, 2.0], &[2]).requires_grad_(true);
        // reduce_scatter: rank 1's list is one short
        let list: Vec<Tensor> = if rank == 1 { vec![t()] } else { vec![t(), t()] };
        let r = df::reduce_scatter(&list, ReduceOp::Sum, None);
        fails_everywhere("reduce_scatter short list", r, rank, 1, "input_list")?;
        still_works(rank)?;
        // reduce_scatter: rank 0's list mixes shapes
        let list = if rank == 0 {
            vec![t(), f64s(&[1.0], &[1])]
        } else {
            vec![t(), t()]
        };
        let r = df::reduce_scatter(&list, ReduceOp::Sum, None);
        fails_everywhere("reduce_scatter mixed shapes", r, rank, 0, "input_list[1]")?;
        still_works(rank)?;
        // all_to_all: rank 1 passes three tensors
        let list: Vec<Tensor> = (0..if rank == 1 { 3 } else { 2 }).map(|_| t()).collect();
        let r = df::all_to_all(&list, None);
        fails_everywhere("all_to_all long list", r, rank, 1, "inputs")?;
        still_works(rank)?;
        // all_gather: rank 0 passes a bool tensor
        let x = if rank == 0 {
            Tensor::zeros(&[2], DType::Bool)?
        } else {
            t()
        };
        let r = df::all_gather(&x, None);
        fails_everywhere("all_gather bool", r, rank, 0, "tensor")?;
        still_works(rank)?;
        // all_to_all_single: rank 1's splits do not sum to its rows
        let x = f64s(&[1.0, 2.0, 3.0, 4.0], &[4, 1]);
        let splits: &[usize] = if rank == 1 { &[1, 2] } else { &[2, 2] };
        let r = df::all_to_all_single(&x, None, Some(splits), None);
        fails_everywhere("all_to_all_single splits", r, rank, 1, "input_split_sizes")?;
        still_works(rank)?;
        // scatter: src (rank 0) passes no tensors
        let list = [t(), t()];
        let r = df::scatter(if rank == 0 { None } else { Some(&list[..]) }, 0, None);
        fails_everywhere("scatter without tensors on src", r, rank, 0, "tensors")?;
        still_works(rank)?;
        // gather: dst outside the world on rank 1
        let r = df::gather(&t(), if rank == 1 { 7 } else { 0 }, None);
        fails_everywhere("gather bad dst", r, rank, 1, "dst")?;
        still_works(rank)?;
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

/// A rank that skips a backward pass and calls the same collective with the same shape does
/// not get its data mixed with the other rank's backward collective: both calls fail, naming
/// the backward.
#[test]
fn a_skipped_backward_never_pairs_with_a_forward_collective() -> TestResult {
    dist::spawn(2, |rank| -> TestResult {
        dist::init_process_group(
            "cpu",
            InitOptions {
                timeout: Duration::from_secs(60),
                ..Default::default()
            },
        )?;
        let x = f64s(&[1.0, 2.0], &[2]).requires_grad_(true);
        let y = df::all_reduce(&x, ReduceOp::Sum, None)?;
        let r = if rank == 0 {
            y.sum()?.backward().map(|_| ())
        } else {
            let m = f64s(&[100.0, 100.0], &[2]);
            dist::all_reduce(&m, ReduceOp::Sum, None)
                .map_err(tensorplay_core::Error::from)
                .map(|_| ())
        };
        let e = match r {
            Ok(()) => return Err(format!("rank {rank}: the mismatched calls succeeded").into()),
            Err(e) => e.to_string(),
        };
        if !e.contains("(in backward)") {
            return Err(format!("rank {rank}: the error should name the backward: {e}").into());
        }
        still_works(rank)?;
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}
