//! The collectives suite every backend passes: each collective, dtype and op (list forms,
//! uneven sizes, strided views, async order, point-to-point), run on every rank of a world
//! already initialised (by `spawn`, or by `mpirun` for the `"mpi"` backend) and compared with
//! the same computation done in one process. [`all_collectives`] runs it on a world or group;
//! [`COLLECTIVE_CASES`] names each check, so a failure says which.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use tensorplay_collectives::{self as dist, ReduceOp};
use tensorplay_core::{DType, Tensor};

/// A check's outcome: the first failure, naming its case.
pub type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Rank `r`'s input: deterministic small integers (exact in every dtype and op).
pub fn values(r: usize, n: usize, salt: usize) -> Vec<f64> {
    (0..n)
        .map(|i| (((r + 1) * 7 + i * 3 + salt) % 5) as f64 - 1.0)
        .collect()
}

/// `v` as a tensor of `shape` in `dt` (panics on a bad shape: a test bug).
pub fn tensor(v: &[f64], shape: &[usize], dt: DType) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape)
        .and_then(|t| t.to_dtype(dt))
        .expect("tensor")
}

/// `t`'s elements as float64.
pub fn as_f64(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().expect("values")
}

/// `op` applied across the ranks' inputs `xs`, elementwise, in one process (`Avg`
/// divides by their number).
pub fn reduce_ref(op: ReduceOp, xs: &[Vec<f64>]) -> Vec<f64> {
    let n = xs.len();
    (0..xs[0].len())
        .map(|i| {
            let col = xs.iter().map(|x| x[i]);
            match op {
                ReduceOp::Sum => col.sum(),
                ReduceOp::Avg => col.sum::<f64>() / n as f64,
                ReduceOp::Product => col.product(),
                ReduceOp::Max => col.fold(f64::NEG_INFINITY, f64::max),
                ReduceOp::Min => col.fold(f64::INFINITY, f64::min),
                ReduceOp::BAnd => col.map(|v| v as i64).reduce(|a, b| a & b).unwrap_or(0) as f64,
                ReduceOp::BOr => col.map(|v| v as i64).reduce(|a, b| a | b).unwrap_or(0) as f64,
                ReduceOp::BXor => col.map(|v| v as i64).reduce(|a, b| a ^ b).unwrap_or(0) as f64,
            }
        })
        .collect()
}

/// The reduction ops `dt` takes (bitwise ops for int64 only, `Avg` for floating dtypes).
pub fn ops_for(dt: DType) -> Vec<ReduceOp> {
    let mut v = vec![
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
    ];
    if dt == DType::I64 {
        v.extend([ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor]);
    } else {
        v.push(ReduceOp::Avg);
    }
    v
}

/// `got` equals `want` within 1e-5 relative; the error names `what` and both.
pub fn check(what: &str, got: Vec<f64>, want: Vec<f64>) -> TestResult {
    if got.len() != want.len()
        || got
            .iter()
            .zip(&want)
            .any(|(a, b)| (a - b).abs() > 1e-5 * (1.0 + b.abs()))
    {
        return Err(format!("{what}: got {got:?}, want {want:?}").into());
    }
    Ok(())
}

/// The dtypes every collective case runs in.
pub const DTYPES: [DType; 3] = [DType::F32, DType::F64, DType::I64];

/// Where a world's case runs: this rank, the world size, the group and its members.
#[derive(Clone, Copy)]
pub struct Ctx<'a> {
    /// The global rank.
    pub rank: usize,
    /// The world size.
    pub n: usize,
    /// The group the collectives run on (`None`: the world).
    pub group: Option<&'a dist::ProcessGroup>,
    /// The group's global ranks.
    pub members: &'a [usize],
    /// This rank's position in `members`.
    pub me: usize,
    /// The group's size.
    pub k: usize,
}

/// One named check of a world scenario, run on every rank of the world.
pub struct Case {
    /// What it checks; a failure names it.
    pub name: &'static str,
    /// The check.
    pub run: fn(&Ctx<'_>) -> TestResult,
}

/// Runs `case`: [`check_named`] with its name.
pub fn check_case(case: &Case, cx: &Ctx<'_>) -> TestResult {
    check_named(case.name, || (case.run)(cx))
}

/// Runs `f`; its error, or a panic of an assertion in it, becomes an error naming `name`.
pub fn check_named(name: &str, f: impl FnOnce() -> TestResult) -> TestResult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("case {name:?}: {e}").into()),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("case {name:?}: panicked: {msg}").into())
        }
    }
}

/// Every collective, dtype and op, against single-process results.
pub const COLLECTIVE_CASES: &[Case] = &[
    Case {
        name: "all_reduce, reduce, broadcast",
        run: reduce_ops,
    },
    Case {
        name: "all_gather",
        run: all_gather_uneven,
    },
    Case {
        name: "all_gather_into_tensor",
        run: all_gather_into_tensor,
    },
    Case {
        name: "reduce_scatter",
        run: reduce_scatter,
    },
    Case {
        name: "gather, scatter",
        run: gather_scatter,
    },
    Case {
        name: "all_to_all",
        run: all_to_all_uneven,
    },
    Case {
        name: "all_to_all_single",
        run: all_to_all_single_uneven,
    },
    Case {
        name: "column view",
        run: strided_views,
    },
    Case {
        name: "mixed layouts",
        run: mixed_layouts,
    },
    Case {
        name: "async order",
        run: async_order,
    },
    Case {
        name: "isend/irecv ring",
        run: p2p_ring,
    },
];

/// Every collective, dtype and op in one world (or group), against single-process results:
/// [`COLLECTIVE_CASES`] in order, stopping at the first that fails.
pub fn all_collectives(
    rank: usize,
    n: usize,
    group: Option<&dist::ProcessGroup>,
    members: &[usize],
) -> TestResult {
    let me = members.iter().position(|&m| m == rank).expect("member");
    let k = members.len();
    let cx = Ctx {
        rank,
        n,
        group,
        members,
        me,
        k,
    };
    for case in COLLECTIVE_CASES {
        check_case(case, &cx)?;
    }
    dist::barrier(group)?;
    Ok(())
}

/// All_reduce, reduce and broadcast: every op, length and root.
fn reduce_ops(cx: &Ctx<'_>) -> TestResult {
    let &Ctx {
        rank,
        n,
        group,
        members,
        me,
        k,
        ..
    } = cx;
    for dt in DTYPES {
        for &len in &[0usize, 1, 7, 1000] {
            for op in ops_for(dt) {
                let xs: Vec<Vec<f64>> = (0..k).map(|r| values(members[r], len, 1)).collect();
                let t = tensor(&xs[me], &[len], dt);
                dist::all_reduce(&t, op, group)?;
                check(
                    &format!("all_reduce {op:?} {dt} len {len} (world {n})"),
                    as_f64(&t),
                    reduce_ref(op, &xs),
                )?;
                // reduce to every root; non-roots unchanged
                for (root_idx, &root) in members.iter().enumerate() {
                    let t = tensor(&xs[me], &[len], dt);
                    dist::reduce(&t, root, op, group)?;
                    let want = if me == root_idx {
                        reduce_ref(op, &xs)
                    } else {
                        xs[me].clone()
                    };
                    check(&format!("reduce {op:?} {dt} to {root}"), as_f64(&t), want)?;
                }
            }
            // broadcast from every root
            for (root_idx, &root) in members.iter().enumerate() {
                let t = tensor(&values(rank, len, 2), &[len], dt);
                dist::broadcast(&t, root, group)?;
                check(
                    &format!("broadcast {dt} from {root}"),
                    as_f64(&t),
                    values(members[root_idx], len, 2),
                )?;
            }
        }
    }
    Ok(())
}

/// All_gather, uneven shapes.
fn all_gather_uneven(cx: &Ctx<'_>) -> TestResult {
    let &Ctx {
        rank,
        group,
        members,
        me,
        k,
        ..
    } = cx;
    for dt in DTYPES {
        // all_gather with uneven shapes: rank r has r+1 rows of 3
        let rows = |r: usize| r + 1;
        let mine = tensor(&values(rank, rows(me) * 3, 3), &[rows(me), 3], dt);
        let outs: Vec<Tensor> = (0..k)
            .map(|r| Tensor::zeros(&[rows(r), 3], dt).expect("zeros"))
            .collect();
        dist::all_gather(&outs, &mine, group)?;
        for r in 0..k {
            check(
                &format!("all_gather {dt} block {r}"),
                as_f64(&outs[r]),
                values(members[r], rows(r) * 3, 3),
            )?;
        }
    }
    Ok(())
}

/// All_gather_into_tensor, also in place.
fn all_gather_into_tensor(cx: &Ctx<'_>) -> TestResult {
    let &Ctx {
        rank,
        group,
        members,
        me,
        k,
        ..
    } = cx;
    for dt in DTYPES {
        // all_gather_into_tensor, also in place (input is a view of the output)
        let out = Tensor::zeros(&[k * 2, 2], dt)?;
        dist::all_gather_into_tensor(&out, &tensor(&values(rank, 4, 4), &[2, 2], dt), group)?;
        let want: Vec<f64> = members.iter().flat_map(|&m| values(m, 4, 4)).collect();
        check(
            &format!("all_gather_into_tensor {dt}"),
            as_f64(&out),
            want.clone(),
        )?;
        let out2 = Tensor::zeros(&[k * 2, 2], dt)?;
        out2.narrow(0, me * 2, 2)?
            .copy_(&tensor(&values(rank, 4, 4), &[2, 2], dt))?;
        dist::all_gather_into_tensor(&out2, &out2.narrow(0, me * 2, 2)?, group)?;
        check(
            &format!("in-place all_gather_into_tensor {dt}"),
            as_f64(&out2),
            want,
        )?;
    }
    Ok(())
}

/// Reduce_scatter, list and tensor.
fn reduce_scatter(cx: &Ctx<'_>) -> TestResult {
    let &Ctx {
        group,
        members,
        me,
        k,
        ..
    } = cx;
    for dt in DTYPES {
        // reduce_scatter (list and tensor)
        for op in ops_for(dt) {
            let xs: Vec<Vec<f64>> = (0..k).map(|r| values(members[r], 3 * k, 5)).collect();
            let full = reduce_ref(op, &xs);
            let out = Tensor::zeros(&[3], dt)?;
            dist::reduce_scatter_tensor(&out, &tensor(&xs[me], &[3 * k], dt), op, group)?;
            check(
                &format!("reduce_scatter_tensor {op:?} {dt}"),
                as_f64(&out),
                full[me * 3..me * 3 + 3].to_vec(),
            )?;
            let list: Vec<Tensor> = (0..k)
                .map(|j| tensor(&xs[me][j * 3..j * 3 + 3], &[3], dt))
                .collect();
            let out = Tensor::zeros(&[3], dt)?;
            dist::reduce_scatter(&out, &list, op, group)?;
            check(
                &format!("reduce_scatter {op:?} {dt}"),
                as_f64(&out),
                full[me * 3..me * 3 + 3].to_vec(),
            )?;
        }
    }
    Ok(())
}

/// Gather and scatter, every root.
fn gather_scatter(cx: &Ctx<'_>) -> TestResult {
    let &Ctx {
        rank,
        group,
        members,
        me,
        k,
        ..
    } = cx;
    for dt in DTYPES {
        // gather / scatter with every root
        for (root_idx, &root) in members.iter().enumerate() {
            let x = tensor(&values(rank, 2, 6), &[2], dt);
            let list: Vec<Tensor> = (0..k)
                .map(|_| Tensor::zeros(&[2], dt).expect("zeros"))
                .collect();
            dist::gather(&x, (me == root_idx).then_some(list.as_slice()), root, group)?;
            if me == root_idx {
                for r in 0..k {
                    check(
                        &format!("gather {dt} to {root} block {r}"),
                        as_f64(&list[r]),
                        values(members[r], 2, 6),
                    )?;
                }
            }
            let out = Tensor::zeros(&[2], dt)?;
            let src: Vec<Tensor> = (0..k)
                .map(|r| tensor(&values(r * 10, 2, 7), &[2], dt))
                .collect();
            dist::scatter(
                &out,
                (me == root_idx).then_some(src.as_slice()),
                root,
                group,
            )?;
            check(
                &format!("scatter {dt} from {root}"),
                as_f64(&out),
                values(me * 10, 2, 7),
            )?;
        }
    }
    Ok(())
}

/// All_to_all, uneven sizes.
fn all_to_all_uneven(cx: &Ctx<'_>) -> TestResult {
    let &Ctx {
        rank,
        group,
        members,
        me,
        k,
        ..
    } = cx;
    for dt in DTYPES {
        // all_to_all with uneven sizes: rank r sends (r + s + 1) elements to s
        let sizes = |from: usize, to: usize| from + to + 1;
        let inputs: Vec<Tensor> = (0..k)
            .map(|s| {
                tensor(
                    &values(rank * 100 + s, sizes(me, s), 8),
                    &[sizes(me, s)],
                    dt,
                )
            })
            .collect();
        let outputs: Vec<Tensor> = (0..k)
            .map(|r| Tensor::zeros(&[sizes(r, me)], dt).expect("zeros"))
            .collect();
        dist::all_to_all(&outputs, &inputs, group)?;
        for r in 0..k {
            check(
                &format!("all_to_all {dt} from {r}"),
                as_f64(&outputs[r]),
                values(members[r] * 100 + me, sizes(r, me), 8),
            )?;
        }
    }
    Ok(())
}

/// All_to_all_single, uneven splits.
fn all_to_all_single_uneven(cx: &Ctx<'_>) -> TestResult {
    let &Ctx {
        rank,
        group,
        members,
        me,
        k,
        ..
    } = cx;
    for dt in DTYPES {
        let sizes = |from: usize, to: usize| from + to + 1;
        // all_to_all_single with uneven splits (rows of 2)
        let in_splits: Vec<usize> = (0..k).map(|s| sizes(me, s)).collect();
        let out_splits: Vec<usize> = (0..k).map(|r| sizes(r, me)).collect();
        let rows_in: usize = in_splits.iter().sum();
        let rows_out: usize = out_splits.iter().sum();
        let input = tensor(&values(rank, rows_in * 2, 9), &[rows_in, 2], dt);
        let output = Tensor::zeros(&[rows_out, 2], dt)?;
        dist::all_to_all_single(&output, &input, Some(&out_splits), Some(&in_splits), group)?;
        let mut want = Vec::new();
        for (r, &m) in members.iter().enumerate() {
            let their_in: Vec<usize> = (0..k).map(|s| sizes(r, s)).collect();
            let start: usize = their_in[..me].iter().sum();
            let v = values(m, their_in.iter().sum::<usize>() * 2, 9);
            want.extend_from_slice(&v[start * 2..(start + their_in[me]) * 2]);
        }
        check(&format!("all_to_all_single {dt}"), as_f64(&output), want)?;
    }
    Ok(())
}

/// A column view; the other column untouched.
fn strided_views(cx: &Ctx<'_>) -> TestResult {
    let &Ctx {
        rank,
        group,
        members,
        ..
    } = cx;
    // strided views: a column of a (3, 2) matrix; the other column must stay untouched
    let base = Tensor::from_vec(
        (0..6).map(|i| (i + 10 * rank) as f32).collect::<Vec<f32>>(),
        &[3, 2],
    )?;
    let col = base.select(1, 0)?;
    dist::all_reduce(&col, ReduceOp::Sum, group)?;
    let want_col: Vec<f64> = (0..3)
        .map(|i| members.iter().map(|&m| (2 * i + 10 * m) as f64).sum())
        .collect();
    check("all_reduce of a column view", as_f64(&col), want_col)?;
    let other: Vec<f64> = (0..3).map(|i| (2 * i + 1 + 10 * rank) as f64).collect();
    check(
        "the other column is untouched",
        as_f64(&base.select(1, 1)?),
        other,
    )?;
    Ok(())
}

/// A transposed tensor on one rank, row-major on the others.
fn mixed_layouts(cx: &Ctx<'_>) -> TestResult {
    let &Ctx {
        group, members, me, ..
    } = cx;
    // a transposed tensor on one rank, row-major on the others: logical values agree
    let logical: Vec<f32> = (0..6).map(|i| i as f32).collect();
    let t = if me == 0 {
        Tensor::from_vec(logical.clone(), &[3, 2])?
            .t()?
            .contiguous()?
            .t()? // column-major memory
    } else {
        Tensor::zeros(&[3, 2], DType::F32)?
    };
    dist::broadcast(&t, members[0], group)?;
    check(
        "broadcast into different layouts",
        as_f64(&t),
        logical.iter().map(|&v| v as f64).collect(),
    )?;
    Ok(())
}

/// An async op and issue order.
fn async_order(cx: &Ctx<'_>) -> TestResult {
    let &Ctx { group, k, .. } = cx;
    // async op and issue order
    let a = tensor(&[1.0, 2.0], &[2], DType::F64);
    let w = dist::all_reduce_async(&a, ReduceOp::Sum, group)?;
    let b = tensor(&[1.0], &[1], DType::F64);
    dist::all_reduce(&b, ReduceOp::Sum, group)?;
    w.wait(Some(Duration::from_secs(20)))?;
    check(
        "async all_reduce",
        as_f64(&a),
        vec![k as f64, 2.0 * k as f64],
    )?;
    check("blocking after async", as_f64(&b), vec![k as f64])?;
    Ok(())
}

/// Isend/irecv around a ring.
fn p2p_ring(cx: &Ctx<'_>) -> TestResult {
    let &Ctx {
        rank,
        group,
        members,
        me,
        k,
        ..
    } = cx;
    // point to point around a ring
    if k > 1 {
        let next = members[(me + 1) % k];
        let prev = members[(me + k - 1) % k];
        let out = tensor(&values(rank, 5, 11), &[5], DType::F32);
        let inp = Tensor::zeros(&[5], DType::F32)?;
        let ws = dist::isend(&out, next, group, 3)?;
        let wr = dist::irecv(&inp, prev, group, 3)?;
        ws.wait(None)?;
        wr.wait(None)?;
        check("isend/irecv ring", as_f64(&inp), values(prev, 5, 11))?;
        // one batch: three messages each way around the ring, received in sending order,
        // then a blocking send that must not overtake them
        let outs: Vec<Tensor> = (0..3)
            .map(|i| tensor(&values(rank, 4 + i, 20 + i), &[4 + i], DType::F64))
            .collect();
        let ins: Vec<Tensor> = (0..3)
            .map(|i| Tensor::zeros(&[4 + i], DType::F64))
            .collect::<Result<_, _>>()?;
        let mut ops = Vec::new();
        for i in 0..3 {
            ops.push(
                dist::P2POp::irecv(&ins[i], prev, group, 7).with_label(format!("message {i}")),
            );
            ops.push(dist::P2POp::isend(&outs[i], next, group, 7));
        }
        let works = dist::batch_isend_irecv(ops)?;
        assert_eq!(works.len(), 6);
        let last = tensor(&values(rank, 2, 30), &[2], DType::F64);
        let got = Tensor::zeros(&[2], DType::F64)?;
        let wr = dist::irecv(&got, prev, group, 8)?;
        dist::send(&last, next, group, 8)?;
        for w in &works {
            w.wait(None)?;
        }
        wr.wait(None)?;
        for (i, t) in ins.iter().enumerate() {
            check(
                &format!("batch_isend_irecv message {i}"),
                as_f64(t),
                values(prev, 4 + i, 20 + i),
            )?;
        }
        check(
            "blocking send after a batch",
            as_f64(&got),
            values(prev, 2, 30),
        )?;
        // refused before anything is posted
        let e = dist::batch_isend_irecv(vec![]).unwrap_err().to_string();
        assert!(
            e.contains("p2p_op_list") && e.contains("an empty list"),
            "{e}"
        );
        let x = Tensor::zeros(&[1], DType::F64)?;
        let e = dist::batch_isend_irecv(vec![
            dist::P2POp::isend(&x, next, group, 0),
            dist::P2POp::irecv(&x, rank, group, 0),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("p2p_op_list[1].peer") && e.contains("a rank other than this one"),
            "{e}"
        );
    }
    Ok(())
}
