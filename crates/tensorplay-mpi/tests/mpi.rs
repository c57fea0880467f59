//! The `"mpi"` backend under `mpirun` (`cargo xtask test-mpi` runs this binary at world sizes
//! 2, 3 and 4 with `--test-threads=1`; every rank runs the same tests in the same order, one
//! process group for the whole binary). Values against single-process results: the suite
//! every backend passes (tensorplay-testkit's `backend_suite`) on the world and on subgroups,
//! bfloat16 and float16, strided inputs, and errors naming global ranks.

use std::sync::OnceLock;
use std::time::Duration;

use tensorplay::distributed as dist;
use tensorplay_core::{DType, Tensor};
use tensorplay_testkit::backend_suite::{
    TestResult, all_collectives, as_f64, check, check_named, tensor, values,
};

/// The world, initialised once per process from MPI (no `RANK`, no `MASTER_ADDR`).
fn world() -> (usize, usize) {
    static W: OnceLock<(usize, usize)> = OnceLock::new();
    *W.get_or_init(|| {
        tensorplay_mpi::register();
        dist::init_process_group(
            "mpi",
            dist::InitOptions {
                timeout: Duration::from_secs(60),
                ..Default::default()
            },
        )
        .expect("init_process_group(\"mpi\") under mpirun");
        (
            dist::get_rank(None).expect("rank"),
            dist::get_world_size(None).expect("size"),
        )
    })
}

/// Runs `f` and fails the test with the case's error.
fn run(f: impl FnOnce() -> TestResult) {
    if let Err(e) = f() {
        panic!("rank {}: {e}", world().0);
    }
}

#[test]
fn a_world_started_by_mpirun_takes_its_ranks_from_mpi() {
    let (rank, n) = world();
    run(|| {
        check_named("ranks from MPI", || {
            let env_rank: Option<usize> = std::env::var("OMPI_COMM_WORLD_RANK")
                .ok()
                .and_then(|v| v.parse().ok());
            if let Some(r) = env_rank {
                assert_eq!(rank, r, "tensorplay's rank is MPI's");
            }
            assert_eq!(dist::get_backend(None)?, "mpi");
            assert_eq!(dist::default_group("test")?.transport(), "mpi");
            assert!(n >= 1);
            Ok(())
        })
    });
}

#[test]
fn every_collective_dtype_and_op_equals_one_process() {
    let (rank, n) = world();
    run(|| all_collectives(rank, n, None, &(0..n).collect::<Vec<_>>()));
}

#[test]
fn subgroups_are_communicators_of_their_own() {
    let (rank, n) = world();
    run(|| {
        // every rank creates every group, in the same order
        let tail: Vec<usize> = (1..n).collect();
        let reversed: Vec<usize> = (0..n).rev().collect();
        let evens: Vec<usize> = (0..n).step_by(2).collect();
        for members in [tail, reversed, evens] {
            if members.is_empty() {
                continue;
            }
            let g = dist::new_group(&members, None, None)?;
            check_named(&format!("subgroup {members:?}"), || {
                if members.contains(&rank) {
                    all_collectives(rank, n, Some(&g), &members)
                } else {
                    let t = Tensor::zeros(&[1], DType::F32)?;
                    assert!(dist::all_reduce(&t, dist::ReduceOp::Sum, Some(&g)).is_err());
                    Ok(())
                }
            })?;
        }
        dist::barrier(None)?;
        Ok(())
    });
}

#[test]
fn bfloat16_and_float16_reduce_in_float32_with_one_rounding() {
    let (rank, n) = world();
    run(|| {
        for dt in [DType::BF16, DType::F16] {
            check_named(
                &format!("{dt} all_reduce, reduce_scatter, broadcast"),
                || {
                    // exact small integers: the one rounding keeps them
                    let x = tensor(&values(rank, 6 * n, 1), &[6 * n], dt);
                    dist::all_reduce(&x, dist::ReduceOp::Sum, None)?;
                    let want: Vec<f64> = (0..6 * n)
                        .map(|i| (0..n).map(|r| values(r, 6 * n, 1)[i]).sum())
                        .collect();
                    check("all_reduce sum", as_f64(&x), want.clone())?;
                    // average: divided in float32 before the rounding
                    let y = tensor(&[(rank + 1) as f64; 4], &[4], dt);
                    dist::all_reduce(&y, dist::ReduceOp::Avg, None)?;
                    let avg = (1..=n).sum::<usize>() as f64 / n as f64;
                    let rounded = Tensor::from_vec(vec![avg], &[1])?.to_dtype(dt)?;
                    check("all_reduce avg", as_f64(&y), vec![as_f64(&rounded)[0]; 4])?;
                    let out = Tensor::zeros(&[6], dt)?;
                    let inp = tensor(&values(rank, 6 * n, 2), &[6 * n], dt);
                    dist::reduce_scatter_tensor(&out, &inp, dist::ReduceOp::Sum, None)?;
                    let want: Vec<f64> = (0..6)
                        .map(|i| (0..n).map(|r| values(r, 6 * n, 2)[rank * 6 + i]).sum())
                        .collect();
                    check("reduce_scatter_tensor", as_f64(&out), want)?;
                    let b = tensor(&values(rank, 5, 3), &[5], dt);
                    dist::broadcast(&b, n - 1, None)?;
                    check("broadcast", as_f64(&b), values(n - 1, 5, 3))?;
                    Ok(())
                },
            )?;
        }
        Ok(())
    });
}

#[test]
fn a_receive_of_another_size_is_an_error_not_an_abort() {
    let (rank, n) = world();
    if n < 2 {
        return;
    }
    run(|| {
        check_named("recv of another size", || {
            if rank == 0 {
                dist::send(&Tensor::ones(&[3], DType::F32)?, 1, None, 7)?;
            } else if rank == 1 {
                let e = dist::recv(&Tensor::zeros(&[2], DType::F32)?, 0, None, 7).unwrap_err();
                assert!(e.to_string().contains("12 bytes"), "{e}");
            }
            dist::barrier(None)?;
            Ok(())
        })
    });
}
