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
            Ok(Err(e)) => self.fails.push(format!("{what}: {e}")),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                self.fails.push(format!("{what}: PANIC {msg}"));
            }
        }
        let dt = t0.elapsed();
        if dt > Duration::from_secs(3) {
            self.fails.push(format!("{what}: took {dt:?}"));
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

// ---------------------------------------------------------------------------------------------
// one rank's bad arguments

#[test]
fn hostile_arguments_w2() -> TestResult {
    dist::spawn::spawn(2, |rank| -> TestResult {
        init(6)?;
        let mut log = Log::new(rank);
        let other = 1 - rank;

        // all_to_all_single: split sizes that overflow when summed
        log.run("a2as overflowing input splits on rank 1", || {
            let x = Tensor::zeros(&[0, 2], DType::F64)?;
            let s: &[usize] = if rank == 1 { &[usize::MAX, 1] } else { &[0, 0] };
            let r = df::all_to_all_single(&x, None, Some(s), None);
            fails_everywhere(r, rank, Some(1), "input_split_sizes")?;
            still_works(None)
        });
        log.run("a2as overflowing input splits on every rank", || {
            let x = Tensor::zeros(&[0, 2], DType::F64)?;
            let r = df::all_to_all_single(&x, None, Some(&[usize::MAX, 1]), None);
            fails_everywhere(r, rank, None, "input_split_sizes")?;
            still_works(None)
        });
        log.run("blocking a2as overflowing splits on every rank", || {
            let x = Tensor::zeros(&[0, 2], DType::F64)?;
            let out = Tensor::zeros(&[0, 2], DType::F64)?;
            let s: &[usize] = &[usize::MAX, 1];
            let r = dist::all_to_all_single(&out, &x, None, Some(s), None);
            fails_everywhere(r.map_err(tp::Error::from), rank, None, "input_split_sizes")?;
            let r = dist::all_to_all_single(&out, &x, Some(s), None, None);
            fails_everywhere(r.map_err(tp::Error::from), rank, None, "output_split_sizes")?;
            still_works(None)
        });
        log.run("a2as huge output splits on rank 0", || {
            let x = Tensor::zeros(&[2, 2], DType::F64)?;
            let s: &[usize] = if rank == 0 { &[usize::MAX, 1] } else { &[1, 1] };
            let r = df::all_to_all_single(&x, Some(s), Some(&[1, 1]), None);
            fails_everywhere(r, rank, Some(0), "output_split_sizes")?;
            still_works(None)
        });
        log.run("a2as output split above i64::MAX on rank 1", || {
            let x = Tensor::zeros(&[2, 2], DType::F64)?;
            let s: &[usize] = if rank == 1 { &[1 << 63, 0] } else { &[1, 1] };
            let r = df::all_to_all_single(&x, Some(s), Some(&[1, 1]), None);
            let e = r.err().ok_or("succeeded")?.to_string();
            if !e.contains("9223372036854775808") {
                return Err(format!("the size should be printed as given: {e}").into());
            }
            still_works(None)
        });
        log.run("a2as output splits of wrong length on rank 1", || {
            let x = Tensor::zeros(&[2, 2], DType::F64)?;
            let s: &[usize] = if rank == 1 { &[1, 1, 0] } else { &[1, 1] };
            let r = df::all_to_all_single(&x, Some(s), None, None);
            fails_everywhere(r, rank, Some(1), "output_split_sizes")?;
            still_works(None)
        });
        log.run("a2as 0-d input on rank 0", || {
            let x = if rank == 0 {
                Tensor::scalar(1.0f64)
            } else {
                Tensor::zeros(&[2], DType::F64)?
            };
            let r = df::all_to_all_single(&x, None, None, None);
            fails_everywhere(r, rank, Some(0), "input")?;
            still_works(None)
        });
        log.run("a2as trailing shape differs", || {
            let x = Tensor::zeros(&[2, 1 + rank], DType::F64)?;
            let r = df::all_to_all_single(&x, None, None, None);
            fails_everywhere(r, rank, None, "shape")?;
            still_works(None)
        });
        log.run("a2as dtype differs", || {
            let x = Tensor::zeros(&[2], if rank == 0 { DType::F64 } else { DType::F32 })?;
            let r = df::all_to_all_single(&x, None, None, None);
            fails_everywhere(r, rank, None, "dtype")?;
            still_works(None)
        });

        // 9 dimensions, every function, on one rank
        let nine = |r: usize| -> tp::Result<Tensor> {
            if r == rank {
                Tensor::zeros(&[1, 1, 1, 1, 1, 1, 1, 2, 3], DType::F64)
            } else {
                Tensor::zeros(&[1, 1, 1, 1, 1, 1, 1, 3, 2], DType::F64)
            }
        };
        log.run("9-d all_reduce", || {
            let r = df::all_reduce(&nine(0)?, ReduceOp::Sum, None);
            fails_everywhere(r, rank, None, "dimensions")?;
            still_works(None)
        });
        log.run("9-d broadcast", || {
            let r = df::broadcast(&nine(0)?, 0, None);
            fails_everywhere(r, rank, None, "dimensions")?;
            still_works(None)
        });
        log.run("9-d reduce", || {
            let r = df::reduce(&nine(0)?, 0, ReduceOp::Sum, None);
            fails_everywhere(r, rank, None, "dimensions")?;
            still_works(None)
        });
        log.run("9-d on one rank: all_reduce, broadcast, reduce", || {
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
        });
        log.run("9-d blocking collectives, shapes that differ", || {
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
        });
        log.run("9-d all_gather on rank 1", || {
            let x = if rank == 1 {
                nine(1)?
            } else {
                Tensor::zeros(&[2], DType::F64)?
            };
            let r = df::all_gather(&x, None);
            fails_everywhere(r, rank, Some(1), "dimensions")?;
            still_works(None)
        });
        log.run("9-d reduce_scatter on rank 0", || {
            let x = if rank == 0 {
                nine(0)?
            } else {
                Tensor::zeros(&[6], DType::F64)?
            };
            let r = df::reduce_scatter(&[x.clone(), x], ReduceOp::Sum, None);
            fails_everywhere(r, rank, Some(0), "dimensions")?;
            still_works(None)
        });
        log.run("9-d reduce_scatter on every rank", || {
            let x = nine(0)?;
            let r = df::reduce_scatter(&[x.clone(), x], ReduceOp::Sum, None);
            fails_everywhere(r, rank, None, "dimensions")?;
            still_works(None)
        });

        // Bool tensors
        let b = || Tensor::zeros(&[2], DType::Bool).expect("bool");
        let f = || Tensor::zeros(&[2], DType::F64).expect("f64");
        let bad_on = |r: usize| if rank == r { b() } else { f() };
        log.run("bool all_reduce on rank 1", || {
            let r = df::all_reduce(&bad_on(1), ReduceOp::Sum, None);
            fails_everywhere(r, rank, Some(1), "bool")?;
            still_works(None)
        });
        log.run("bool broadcast on rank 0", || {
            let r = df::broadcast(&bad_on(0), 0, None);
            fails_everywhere(r, rank, Some(0), "bool")?;
            still_works(None)
        });
        log.run("bool reduce on rank 1", || {
            let r = df::reduce(&bad_on(1), 0, ReduceOp::Max, None);
            fails_everywhere(r, rank, Some(1), "bool")?;
            still_works(None)
        });
        log.run("bool gather on rank 1", || {
            let r = df::gather(&bad_on(1), 0, None);
            fails_everywhere(r, rank, Some(1), "bool")?;
            still_works(None)
        });
        log.run("bool scatter on src", || {
            let l = [bad_on(0), bad_on(0)];
            let r = df::scatter(Some(&l), 0, None);
            fails_everywhere(r, rank, Some(0), "bool")?;
            still_works(None)
        });
        log.run("bool reduce_scatter on rank 1", || {
            let r = df::reduce_scatter(&[bad_on(1), bad_on(1)], ReduceOp::Sum, None);
            fails_everywhere(r, rank, Some(1), "bool")?;
            still_works(None)
        });
        log.run("bool all_to_all on rank 0", || {
            let r = df::all_to_all(&[bad_on(0), bad_on(0)], None);
            fails_everywhere(r, rank, Some(0), "bool")?;
            still_works(None)
        });
        log.run("bool all_to_all_single on rank 1", || {
            let r = df::all_to_all_single(&bad_on(1), None, None, None);
            fails_everywhere(r, rank, Some(1), "bool")?;
            still_works(None)
        });

        // int64: forward works, Avg is an error
        log.run("int64 forward", || {
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
        });
        log.run("int64 Avg on every function", || {
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
        });
        log.run("int64 Avg on rank 1 only", || {
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
        });
        log.run("bitwise op on floats", || {
            fails_everywhere(
                df::all_reduce(&f(), ReduceOp::BAnd, None),
                rank,
                None,
                "BAnd",
            )?;
            still_works(None)
        });

        // an expanded view too big to materialize, on one rank
        let huge = || Tensor::scalar(1.0f64).expand(&[1 << 50]).expect("expand");
        log.run(
            "reduce_scatter: a huge expanded view in a bad list on rank 1",
            || {
                let l = if rank == 1 { [huge(), f()] } else { [f(), f()] };
                let r = df::reduce_scatter(&l, ReduceOp::Sum, None);
                fails_everywhere(r, rank, Some(1), "input_list[1]")?;
                still_works(None)
            },
        );
        log.run(
            "all_reduce, broadcast, reduce: a huge expanded view on rank 1",
            || {
                let x = if rank == 1 { huge() } else { f() };
                let r = df::all_reduce(&x, ReduceOp::Sum, None);
                fails_everywhere(r, rank, Some(1), "memory")?;
                let r = df::broadcast(&x, 0, None);
                fails_everywhere(r, rank, Some(1), "memory")?;
                let r = df::reduce(&x, 0, ReduceOp::Max, None);
                fails_everywhere(r, rank, Some(1), "memory")?;
                still_works(None)
            },
        );

        // ranks disagreeing on shapes, dtypes and roots
        let sh = || Tensor::zeros(&[2 + rank], DType::F64).expect("t");
        let dt =
            || Tensor::zeros(&[2], if rank == 0 { DType::F64 } else { DType::F32 }).expect("t");
        log.run("all_reduce shapes differ", || {
            fails_everywhere(
                df::all_reduce(&sh(), ReduceOp::Sum, None),
                rank,
                None,
                "shape",
            )?;
            still_works(None)
        });
        log.run("all_reduce dtypes differ", || {
            fails_everywhere(
                df::all_reduce(&dt(), ReduceOp::Sum, None),
                rank,
                None,
                "dtype",
            )?;
            still_works(None)
        });
        log.run("all_reduce ops differ", || {
            let op = if rank == 0 {
                ReduceOp::Sum
            } else {
                ReduceOp::Max
            };
            fails_everywhere(df::all_reduce(&f(), op, None), rank, None, "op Max")?;
            still_works(None)
        });
        log.run("broadcast shapes differ", || {
            fails_everywhere(df::broadcast(&sh(), 0, None), rank, None, "shape")?;
            still_works(None)
        });
        log.run("broadcast src differs", || {
            fails_everywhere(df::broadcast(&f(), rank, None), rank, None, "src")?;
            still_works(None)
        });
        log.run("reduce dtypes differ", || {
            fails_everywhere(
                df::reduce(&dt(), 0, ReduceOp::Sum, None),
                rank,
                None,
                "dtype",
            )?;
            still_works(None)
        });
        log.run("reduce dst differs", || {
            fails_everywhere(
                df::reduce(&f(), rank, ReduceOp::Sum, None),
                rank,
                None,
                "dst",
            )?;
            still_works(None)
        });
        log.run(
            "broadcast dtypes, reduce shapes and ops, reduce_scatter ops differ",
            || {
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
            },
        );
        log.run("reduce_scatter shapes differ", || {
            let r = df::reduce_scatter(&[sh(), sh()], ReduceOp::Sum, None);
            fails_everywhere(r, rank, None, "shape")?;
            still_works(None)
        });
        log.run("reduce_scatter dtypes differ", || {
            let r = df::reduce_scatter(&[dt(), dt()], ReduceOp::Sum, None);
            fails_everywhere(r, rank, None, "dtype")?;
            still_works(None)
        });
        log.run("all_gather dtypes differ", || {
            fails_everywhere(df::all_gather(&dt(), None), rank, None, "dtype")?;
            still_works(None)
        });
        log.run("gather dtypes differ", || {
            fails_everywhere(df::gather(&dt(), 0, None), rank, None, "dtype")?;
            still_works(None)
        });
        log.run("gather dst differs", || {
            fails_everywhere(df::gather(&f(), rank, None), rank, None, "dst")?;
            still_works(None)
        });
        log.run("scatter src differs", || {
            let l = [f(), f()];
            fails_everywhere(df::scatter(Some(&l), rank, None), rank, None, "src")?;
            still_works(None)
        });
        log.run("all_to_all dtypes differ", || {
            fails_everywhere(df::all_to_all(&[dt(), dt()], None), rank, None, "dtype")?;
            still_works(None)
        });
        log.run("all_to_all shapes of a pair differ", || {
            // what rank 0 sends to rank 1 has 2 elements, but rank 1 receives whatever is sent
            let r = df::all_to_all(&[sh(), sh()], None)?;
            if r[other].shape() != [2 + other] {
                return Err(format!("received shape {:?}", r[other].shape()).into());
            }
            still_works(None)
        });

        // roots outside the world
        for (name, call) in [
            ("broadcast", 0usize),
            ("reduce", 1),
            ("gather", 2),
            ("scatter", 3),
        ] {
            for bad in [None, Some(0usize), Some(1)] {
                log.run(&format!("{name} root 7 on {bad:?}"), || {
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
                });
            }
        }

        // scatter placeholders: odd shapes, counts and dtypes are ignored off src
        log.run("scatter odd placeholders", || {
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
        });
        log.run("scatter mixed dtypes on src", || {
            let l = [f(), Tensor::zeros(&[2], DType::F32)?];
            let r = df::scatter(if rank == 0 { Some(&l[..]) } else { None }, 0, None);
            fails_everywhere(r, rank, Some(0), "tensors[1]")?;
            still_works(None)
        });
        log.run("scatter wrong count on src", || {
            let l = [f(), f(), f()];
            let r = df::scatter(Some(&l[..]), 0, None);
            fails_everywhere(r, rank, Some(0), "tensors")?;
            still_works(None)
        });

        log.finish()?;
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// autograd corner cases

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

#[test]
fn hostile_autograd_w2() -> TestResult {
    dist::spawn::spawn(2, |rank| -> TestResult {
        init(6)?;
        let mut log = Log::new(rank);

        // 0-d and empty tensors through every function, forward and backward
        for shape in [vec![], vec![0], vec![2, 0], vec![0, 3]] {
            log.run(&format!("shape {shape:?} through every function"), || {
                let n: usize = shape.iter().product();
                let x = Tensor::from_vec(vec![rank as f64 + 1.5; n], &shape)?.requires_grad_(true);
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
            });
        }

        // an expanded (stride-0) input
        log.run("expanded input through every function", || {
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
        });

        // inside no_grad: values, no graph, no backward collectives
        log.run("no_grad", || {
            let x = f64s(&[rank as f64 + 1.0, 2.0], &[2]).requires_grad_(true);
            let _ng = tp::no_grad();
            for (name, ys) in every_function(&x, 0)? {
                if ys.iter().any(Tensor::requires_grad) {
                    return Err(format!("{name} requires grad under no_grad").into());
                }
            }
            drop(_ng);
            still_works(None)
        });

        // outputs reused as inputs, backward twice
        log.run("reused outputs and retain_graph", || {
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
        });

        // NaN and inf through Max, Min, Product
        log.run("nan and inf", || {
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
        });

        // blocking collectives: refuse tensors that require grad, accept detach() and no_grad
        log.run("blocking collectives and requires_grad", || {
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
        });

        // losses built differently on each rank still run the backward collectives in the
        // same order (shapes equal, so a different order would silently pair wrong gradients)
        log.run("asymmetric losses over two collectives", || {
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
        });

        // the async collectives judge grad mode where they are called, not on the worker
        log.run("async collectives and requires_grad", || {
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
        });

        log.finish()?;
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// groups

#[test]
fn hostile_groups_w3() -> TestResult {
    dist::spawn::spawn(3, |rank| -> TestResult {
        init(6)?;
        let mut log = Log::new(rank);
        let solo: Vec<ProcessGroup> = (0..3)
            .map(|r| dist::new_group(&[r], None, None))
            .collect::<dist::Result<_>>()?;
        let pair = dist::new_group(&[0, 2], None, Some(Duration::from_secs(2)))?;
        let mine = &solo[rank];

        log.run("one-member group, every function", || {
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
        });
        log.run("one-member group, root of another rank", || {
            let x = f64s(&[1.0], &[1]);
            let other = (rank + 1) % 3;
            fails_everywhere(df::broadcast(&x, other, Some(mine)), rank, None, "src")?;
            fails_everywhere(df::gather(&x, other, Some(mine)), rank, None, "dst")?;
            Ok(())
        });
        log.run("non-member calls", || {
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
        });
        if rank != 1 {
            let g = Some(&pair);
            log.run("root outside the subgroup", || {
                let x = f64s(&[1.0], &[1]);
                fails_everywhere(df::broadcast(&x, 1, g), rank, None, "src")?;
                fails_everywhere(df::reduce(&x, 1, ReduceOp::Sum, g), rank, None, "dst")?;
                fails_everywhere(df::gather(&x, 1, g), rank, None, "dst")?;
                let l = [x.clone(), x.clone()];
                fails_everywhere(df::scatter(Some(&l), 1, g), rank, None, "src")?;
                still_works(g)
            });
            log.run("requires grad on one rank only: a named timeout", || {
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
            });
        }

        log.finish()?;
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// ranks calling different functions, aliased inputs, devices

#[test]
fn hostile_mixed_w2() -> TestResult {
    dist::spawn::spawn(2, |rank| -> TestResult {
        init(6)?;
        let mut log = Log::new(rank);
        let x = || f64s(&[rank as f64 + 1.0, 2.0], &[2]);

        // ranks calling different collectives: descriptors of different lengths fail the call
        // on every rank with an error saying so (the backend then shuts that group down, so each
        // case has a group of its own); descriptors of one length fail it and the group goes on
        type Pair = Box<dyn Fn(usize, &ProcessGroup) -> tp::Result<()>>;
        let pairs: Vec<(&str, Pair)> = vec![
            (
                "all_gather on rank 0, gather on rank 1",
                Box::new(|rank, g| {
                    let x = f64s(&[1.0], &[1]);
                    if rank == 0 {
                        df::all_gather(&x, Some(g)).map(|_| ())
                    } else {
                        df::gather(&x, 0, Some(g)).map(|_| ())
                    }
                }),
            ),
            (
                "all_reduce on rank 0, all_gather on rank 1",
                Box::new(|rank, g| {
                    let x = f64s(&[1.0], &[1]);
                    if rank == 0 {
                        df::all_reduce(&x, ReduceOp::Sum, Some(g)).map(|_| ())
                    } else {
                        df::all_gather(&x, Some(g)).map(|_| ())
                    }
                }),
            ),
            (
                "blocking all_reduce on rank 0, reduce on rank 1",
                Box::new(|rank, g| {
                    let t = Tensor::zeros(&[2], DType::F64)?;
                    Ok(if rank == 0 {
                        dist::all_reduce(&t, ReduceOp::Sum, Some(g))
                    } else {
                        dist::reduce(&t, 0, ReduceOp::Sum, Some(g))
                    }?)
                }),
            ),
            (
                "all_gather_metadata with lengths that differ",
                Box::new(|rank, g| {
                    let d = vec![1i64; 2 + rank];
                    dist::all_gather_metadata("hostile", &d, Ok(()), Some(g))?;
                    Ok(())
                }),
            ),
        ];
        for (what, f) in &pairs {
            let g = dist::new_group(&[0, 1], None, None)?;
            log.run(what, || {
                let e = f(rank, &g).err().ok_or("succeeded")?.to_string();
                if e.contains("timed out") || !e.contains("different collectives?") {
                    return Err(format!("unclear error: {e}").into());
                }
                still_works(None)
            });
        }
        log.run("blocking all_reduce on rank 0, broadcast on rank 1", || {
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
        });
        log.run("all_gather_metadata, empty", || {
            let r = dist::all_gather_metadata("hostile", &[], Ok(()), None)?;
            if r != vec![Vec::<i64>::new(); 2] {
                return Err(format!("{r:?}").into());
            }
            still_works(None)
        });

        // the same tensor twice in a list: its gradient is the sum of both
        log.run("aliased list elements", || {
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
        });

        // uneven and zero-size shapes
        log.run(
            "uneven shapes, 0-d and empty, through the shape-learning functions",
            || {
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
            },
        );
        log.run("a2as zero-size splits, one list given", || {
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
        });

        // reduce and reduce_scatter with NaN: the holder gets the gradient
        log.run("reduce and reduce_scatter Max with NaN", || {
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
        });

        // zero-size tensors with huge dimensions
        log.run(
            "huge empty dims: a2as rows that overflow on the receiver",
            || {
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
            },
        );
        log.run(
            "huge empty dims: all_gather, gather, all_to_all, scatter",
            || {
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
            },
        );
        // zero and unbounded timeouts
        for (name, t) in [
            ("zero", Duration::ZERO),
            ("huge", Duration::from_secs(1 << 62)),
        ] {
            let g = dist::new_group(&[0, 1], None, Some(t));
            log.run(&format!("{name} timeout"), || {
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
                        y.sum()?.backward()?;
                    }
                    Err(e) => {
                        let e = e.to_string();
                        if !e.contains("timed out") {
                            return Err(format!("unclear error: {e}").into());
                        }
                    }
                }
                Ok(())
            });
        }

        // a CUDA tensor without a GPU: a clear error, here or from the collective
        log.run("cuda tensor", || {
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
        });

        log.finish()?;
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}
