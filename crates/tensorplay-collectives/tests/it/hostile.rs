//! Hostile inputs to the collectives: bad arguments on one rank or all, views as outputs,
//! mismatched calls across ranks, bad init methods. Every case must give every rank an `Err`
//! (never a panic or a hang) and must not write outside a destination view. Cases that shut a
//! group down run in their own `new_group`, so that one spawned world covers many of them.

use std::time::{Duration, Instant};

use tensorplay_collectives::{self as dist, InitOptions, ProcessGroup, ReduceOp, SpawnOptions};
use tensorplay_core::{DType, Tensor};

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

fn vals(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().expect("values")
}

/// Asserts that `r` is an error whose message contains every one of `needles`.
fn expect_err<T: std::fmt::Debug>(what: &str, r: dist::Result<T>, needles: &[&str]) -> TestResult {
    match r {
        Ok(v) => Err(format!("{what}: expected an error, got Ok({v:?})").into()),
        Err(e) => {
            let m = e.to_string();
            for n in needles {
                if !m.contains(n) {
                    return Err(format!("{what}: error lacks {n:?}: {m}").into());
                }
            }
            Ok(())
        }
    }
}

fn eq(what: &str, got: Vec<f64>, want: Vec<f64>) -> TestResult {
    if got != want {
        return Err(format!("{what}: got {got:?}, want {want:?}").into());
    }
    Ok(())
}

/// The world still works: an all-reduce of ones over `group` gives its size.
fn still_works(what: &str, group: Option<&ProcessGroup>) -> TestResult {
    let n = dist::get_world_size(group)? as f64;
    let t = f64s(&[1.0, 1.0], &[2]);
    dist::all_reduce(&t, ReduceOp::Sum, group).map_err(|e| format!("{what}: group broken: {e}"))?;
    eq(what, vals(&t), vec![n, n])
}

/// Errors that every rank detects on its own, or that the cross-rank check reports on every
/// rank: the group must keep working after each.
#[test]
fn consistent_bad_arguments_keep_the_group_usable() -> TestResult {
    dist::spawn::spawn(2, |rank| -> TestResult {
        init(5)?;
        let me = rank as f64;
        let z = |s: &[usize]| Tensor::zeros(s, DType::F64).expect("zeros");
        // dtype mismatch across ranks
        let t = if rank == 0 {
            z(&[2])
        } else {
            Tensor::zeros(&[2], DType::F32)?
        };
        expect_err(
            "all_reduce dtype mismatch",
            dist::all_reduce(&t, ReduceOp::Sum, None),
            &["float64", "float32"],
        )?;
        still_works("after dtype mismatch", None)?;
        let outs = [z(&[2]), z(&[2])];
        expect_err(
            "all_gather dtype mismatch",
            dist::all_gather(&outs, &t, None),
            &["dtype"],
        )?;
        still_works("after all_gather dtype mismatch", None)?;
        // int64 with Avg, bool tensors, expanded outputs
        let i = Tensor::zeros(&[2], DType::I64)?;
        expect_err(
            "int64 Avg",
            dist::all_reduce(&i, ReduceOp::Avg, None),
            &["rank", "op", "Avg"],
        )?;
        expect_err(
            "int64 Avg reduce",
            dist::reduce(&i, 0, ReduceOp::Avg, None),
            &["rank", "op"],
        )?;
        let b = Tensor::zeros(&[2], DType::Bool)?;
        expect_err(
            "bool all_reduce",
            dist::all_reduce(&b, ReduceOp::Sum, None),
            &["rank", "bool"],
        )?;
        expect_err(
            "bool broadcast",
            dist::broadcast(&b, 0, None),
            &["rank", "bool"],
        )?;
        expect_err(
            "bool all_gather",
            dist::all_gather(&[b.clone(), b.clone()], &b, None),
            &["rank", "bool"],
        )?;
        let ex = z(&[1]).expand(&[2])?;
        expect_err(
            "expanded all_gather output",
            dist::all_gather(&[ex.clone(), ex.clone()], &z(&[2]), None),
            &["rank", "tensor_list"],
        )?;
        expect_err(
            "expanded broadcast",
            dist::broadcast(&ex, 0, None),
            &["rank"],
        )?;
        expect_err(
            "expanded recv",
            dist::recv(&ex, 1 - rank, None, 0),
            &["rank"],
        )?;
        expect_err(
            "expanded all_gather_into_tensor",
            dist::all_gather_into_tensor(&z(&[1]).expand(&[4])?, &z(&[2]), None),
            &["rank", "output"],
        )?;
        still_works("after local errors", None)?;
        // scatter: no scatter_list on the source
        expect_err(
            "scatter without list",
            dist::scatter(&z(&[2]), None, 0, None),
            &["scatter_list"],
        )?;
        still_works("after scatter without list", None)?;
        // scatter: wrong list length on the source
        let short = [z(&[2])];
        let l = if rank == 0 { Some(&short[..]) } else { None };
        expect_err(
            "scatter short list",
            dist::scatter(&z(&[2]), l, 0, None),
            &["scatter_list"],
        )?;
        still_works("after scatter short list", None)?;
        // scatter: list entries of the wrong dtype on the source
        let wrong = [z(&[2]), Tensor::zeros(&[2], DType::F32)?];
        let l = if rank == 0 { Some(&wrong[..]) } else { None };
        let r = dist::scatter(&z(&[2]), l, 0, None);
        expect_err("scatter list dtype", r, &[])?;
        still_works("after scatter list dtype", None)?;
        // all_to_all_single with splits that are wrong on every rank
        let x = z(&[4]);
        expect_err(
            "a2as splits sum",
            dist::all_to_all_single(&z(&[4]), &x, None, Some(&[1, 1]), None),
            &["rank", "input_split_sizes"],
        )?;
        expect_err(
            "a2as splits len",
            dist::all_to_all_single(&z(&[4]), &x, Some(&[4]), None, None),
            &["rank", "output_split_sizes"],
        )?;
        expect_err(
            "a2as uneven",
            dist::all_to_all_single(&z(&[3]), &z(&[3]), None, None, None),
            &["rank"],
        )?;
        still_works("after a2as errors", None)?;
        // zero-size tensors everywhere
        let e = z(&[0]);
        dist::all_reduce(&e, ReduceOp::Sum, None)?;
        dist::broadcast(&e, 1, None)?;
        dist::reduce(&e, 0, ReduceOp::Max, None)?;
        dist::all_gather(
            &[z(&[0]), z(&[0, 3])],
            &if rank == 0 { z(&[0]) } else { z(&[0, 3]) },
            None,
        )?;
        dist::all_gather_into_tensor(&z(&[0]), &e, None)?;
        dist::reduce_scatter_tensor(&e, &z(&[0]), ReduceOp::Sum, None)?;
        dist::reduce_scatter(&e, &[z(&[0]), z(&[0])], ReduceOp::Sum, None)?;
        dist::all_to_all_single(&z(&[0, 2]), &z(&[0, 2]), None, None, None)?;
        dist::all_to_all(&[z(&[0]), z(&[0])], &[z(&[0]), z(&[0])], None)?;
        let gl = [z(&[0]), z(&[0])];
        dist::gather(&e, if rank == 0 { Some(&gl[..]) } else { None }, 0, None)?;
        dist::scatter(&e, if rank == 1 { Some(&gl[..]) } else { None }, 1, None)?;
        if rank == 0 {
            dist::send(&e, 1, None, 3)?;
        } else {
            dist::recv(&e, 0, None, 3)?;
        }
        still_works("after zero-size", None)?;
        // more than 8 dims (the descriptor folds them)
        let mut shape = vec![1usize; 9];
        shape[8] = 2;
        shape[7] = 3;
        let big = f64s(
            &(0..6).map(|i| i as f64 + 10.0 * me).collect::<Vec<_>>(),
            &shape,
        );
        let gl = [
            Tensor::zeros(&shape, DType::F64)?,
            Tensor::zeros(&shape, DType::F64)?,
        ];
        dist::gather(&big, if rank == 0 { Some(&gl[..]) } else { None }, 0, None)?;
        if rank == 0 {
            eq(
                "gather 9-d block 1",
                vals(&gl[1]),
                (0..6).map(|i| i as f64 + 10.0).collect(),
            )?;
        }
        let outs = [
            Tensor::zeros(&shape, DType::F64)?,
            Tensor::zeros(&shape, DType::F64)?,
        ];
        dist::all_gather(&outs, &big, None)?;
        eq(
            "all_gather 9-d block 1",
            vals(&outs[1]),
            (0..6).map(|i| i as f64 + 10.0).collect(),
        )?;
        // send/recv to self and to ranks outside the world
        let t = z(&[2]);
        expect_err(
            "send to self",
            dist::send(&t, rank, None, 0),
            &["rank", "dst"],
        )?;
        expect_err(
            "recv from self",
            dist::recv(&t, rank, None, 0),
            &["rank", "src"],
        )?;
        expect_err(
            "send out of range",
            dist::send(&t, 7, None, 0),
            &["rank", "dst", "7"],
        )?;
        expect_err(
            "recv out of range",
            dist::recv(&t, 7, None, 0),
            &["rank", "src", "7"],
        )?;
        expect_err(
            "broadcast src out of range",
            dist::broadcast(&t, 2, None),
            &["rank", "src"],
        )?;
        expect_err(
            "gather dst out of range",
            dist::gather(&t, None, 9, None),
            &["rank", "dst"],
        )?;
        expect_err(
            "scatter src out of range",
            dist::scatter(&t, None, 9, None),
            &["rank", "src"],
        )?;
        // new_group with bad ranks
        expect_err(
            "new_group empty",
            dist::new_group(&[], None, None),
            &["rank", "ranks"],
        )?;
        expect_err(
            "new_group dup",
            dist::new_group(&[0, 0], None, None),
            &["rank", "distinct"],
        )?;
        expect_err(
            "new_group range",
            dist::new_group(&[0, 2], None, None),
            &["rank", "world size"],
        )?;
        let solo = dist::new_group(&[1], None, None)?;
        if rank == 0 {
            expect_err(
                "non-member all_reduce",
                dist::all_reduce(&t, ReduceOp::Sum, Some(&solo)),
                &["rank 0", "group"],
            )?;
            expect_err(
                "non-member barrier",
                dist::barrier(Some(&solo)),
                &["rank 0", "group"],
            )?;
            expect_err(
                "non-member send",
                dist::send(&t, 1, Some(&solo), 0),
                &["rank 0"],
            )?;
            expect_err(
                "non-member scatter",
                dist::scatter(&t, None, 1, Some(&solo)),
                &["rank 0"],
            )?;
            expect_err(
                "non-member a2a",
                dist::all_to_all(
                    std::slice::from_ref(&t),
                    std::slice::from_ref(&t),
                    Some(&solo),
                ),
                &["rank 0"],
            )?;
            expect_err(
                "non-member reduce_scatter",
                dist::reduce_scatter(&t, std::slice::from_ref(&t), ReduceOp::Sum, Some(&solo)),
                &["rank 0"],
            )?;
        } else {
            dist::all_reduce(&t, ReduceOp::Sum, Some(&solo))?;
        }
        still_works("after new_group errors", None)?;
        // init twice
        expect_err("init twice", init(5), &["already"])?;
        still_works("after init twice", None)?;
        dist::destroy_process_group()?;
        expect_err(
            "all_reduce after destroy",
            dist::all_reduce(&t, ReduceOp::Sum, None),
            &["all_reduce", "init"],
        )?;
        expect_err("barrier after destroy", dist::barrier(None), &["barrier"])?;
        expect_err(
            "new_group after destroy",
            dist::new_group(&[0], None, None),
            &["new_group"],
        )?;
        expect_err("destroy twice", dist::destroy_process_group(), &["destroy"])?;
        Ok(())
    })?;
    Ok(())
}

/// Strided views as outputs: values land in logical order, the memory around them is untouched.
#[test]
fn views_as_outputs() -> TestResult {
    dist::spawn::spawn(2, |rank| -> TestResult {
        init(5)?;
        let me = rank as f64;
        // a 3x4 base filled with -1; outputs are a column (stride 4) and a transposed 2x2 block
        let base = || f64s(&[-1.0; 12], &[3, 4]);
        let mine = f64s(&[me * 10.0 + 1.0, me * 10.0 + 2.0, me * 10.0 + 3.0], &[3]);
        // all_gather into two columns of one base
        let b = base();
        let outs = [b.select(1, 1)?, b.select(1, 3)?];
        dist::all_gather(&outs, &mine, None)?;
        eq(
            "all_gather into columns",
            vals(&b),
            vec![
                -1.0, 1.0, -1.0, 11.0, -1.0, 2.0, -1.0, 12.0, -1.0, 3.0, -1.0, 13.0,
            ],
        )?;
        // all_gather into a transposed 2x2 view
        let b = base();
        let src = f64s(
            &[me * 10.0, me * 10.0 + 1.0, me * 10.0 + 2.0, me * 10.0 + 3.0],
            &[2, 2],
        );
        let tv = b.narrow(0, 0, 2)?.narrow(1, 1, 2)?.t()?;
        let other = Tensor::zeros(&[2, 2], DType::F64)?;
        let outs = if rank == 0 {
            [other.clone(), tv.clone()]
        } else {
            [tv.clone(), other.clone()]
        };
        dist::all_gather(&outs, &src, None)?;
        let peer = (1 - rank) as f64 * 10.0;
        eq(
            "transposed view logical",
            vals(&tv),
            vec![peer, peer + 1.0, peer + 2.0, peer + 3.0],
        )?;
        eq(
            "transposed view memory",
            vals(&b),
            vec![
                -1.0,
                peer,
                peer + 2.0,
                -1.0,
                -1.0,
                peer + 1.0,
                peer + 3.0,
                -1.0,
                -1.0,
                -1.0,
                -1.0,
                -1.0,
            ],
        )?;
        // gather into columns on rank 1
        let b = base();
        let gl = [b.select(1, 0)?, b.select(1, 2)?];
        dist::gather(&mine, if rank == 1 { Some(&gl[..]) } else { None }, 1, None)?;
        if rank == 1 {
            eq(
                "gather into columns",
                vals(&b),
                vec![
                    1.0, -1.0, 11.0, -1.0, 2.0, -1.0, 12.0, -1.0, 3.0, -1.0, 13.0, -1.0,
                ],
            )?;
        } else {
            eq("gather non-dst untouched", vals(&b), vec![-1.0; 12])?;
        }
        // scatter into a column
        let b = base();
        let col = b.select(1, 2)?;
        let sl = [f64s(&[1.0, 2.0, 3.0], &[3]), f64s(&[4.0, 5.0, 6.0], &[3])];
        dist::scatter(&col, if rank == 0 { Some(&sl[..]) } else { None }, 0, None)?;
        let want: Vec<f64> = if rank == 0 {
            vec![1.0, 2.0, 3.0]
        } else {
            vec![4.0, 5.0, 6.0]
        };
        let mut mem = vec![-1.0; 12];
        for (i, w) in want.iter().enumerate() {
            mem[i * 4 + 2] = *w;
        }
        eq("scatter into column", vals(&b), mem)?;
        // scatter from a list of transposed views
        let src2 = f64s(&[1.0, 2.0, 3.0, 4.0], &[2, 2]).t()?;
        let out = Tensor::zeros(&[2, 2], DType::F64)?;
        let sl = [src2.clone(), src2.clone()];
        dist::scatter(&out, if rank == 0 { Some(&sl[..]) } else { None }, 0, None)?;
        eq(
            "scatter from transposed",
            vals(&out),
            vec![1.0, 3.0, 2.0, 4.0],
        )?;
        // recv into a transposed view; send from a column
        let b = base();
        if rank == 0 {
            let col = f64s(&[5.0, 6.0, 7.0, 8.0, 9.0, 10.0], &[3, 2]).select(1, 1)?;
            dist::send(&col, 1, None, 1)?;
        } else {
            let v = b.narrow(1, 0, 3)?.narrow(0, 0, 1)?.t()?; // [3, 1], strides [1, 4]
            dist::recv(&v, 0, None, 1)?;
            eq(
                "recv into transposed",
                vals(&b),
                vec![
                    6.0, 8.0, 10.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0,
                ],
            )?;
        }
        // all_to_all into columns, all_to_all_single into a transposed output
        let b = base();
        let outs = [b.select(1, 1)?, b.select(1, 2)?];
        let ins = [f64s(&[me, me, me], &[3]), f64s(&[me + 5.0; 3], &[3])];
        dist::all_to_all(&outs, &ins, None)?;
        let (a, c) = if rank == 0 { (0.0, 1.0) } else { (5.0, 6.0) };
        eq(
            "all_to_all into columns",
            vals(&b),
            vec![-1.0, a, c, -1.0, -1.0, a, c, -1.0, -1.0, a, c, -1.0],
        )?;
        let out = Tensor::zeros(&[2, 2], DType::F64)?.t()?;
        dist::all_to_all_single(
            &out,
            &f64s(&[me, me + 1.0, me + 2.0, me + 3.0], &[2, 2]),
            None,
            None,
            None,
        )?;
        let want = if rank == 0 {
            vec![0.0, 1.0, 1.0, 2.0]
        } else {
            vec![2.0, 3.0, 3.0, 4.0]
        };
        eq("all_to_all_single into transposed", vals(&out), want)?;
        // reduce_scatter into a column
        let b = base();
        let col = b.select(1, 0)?;
        let il = [f64s(&[1.0, 2.0, 3.0], &[3]), f64s(&[4.0, 5.0, 6.0], &[3])];
        dist::reduce_scatter(&col, &il, ReduceOp::Sum, None)?;
        let want = if rank == 0 {
            [2.0, 4.0, 6.0]
        } else {
            [8.0, 10.0, 12.0]
        };
        let mut mem = vec![-1.0; 12];
        for (i, w) in want.iter().enumerate() {
            mem[i * 4] = *w;
        }
        eq("reduce_scatter into column", vals(&b), mem)?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

/// Bad arguments on one rank only, and ranks calling different collectives: every rank must
/// get an error within a few timeouts. Each case runs in a fresh group over both ranks.
#[test]
fn one_rank_wrong_gives_every_rank_an_error() -> TestResult {
    dist::spawn::spawn_with(
        SpawnOptions {
            timeout: Some(Duration::from_secs(120)),
            ..SpawnOptions::new(2)
        },
        |rank| -> TestResult {
            init(10)?;
            let z = |s: &[usize]| Tensor::zeros(s, DType::F64).expect("zeros");
            let to = Some(Duration::from_secs(2));
            let mut report = Vec::new();
            let mut case =
                |name: &str, f: &dyn Fn(&ProcessGroup) -> dist::Result<()>| -> TestResult {
                    let g = dist::new_group(&[0, 1], None, to)?;
                    let start = Instant::now();
                    let r = f(&g);
                    let took = start.elapsed();
                    let after = {
                        let t = f64s(&[1.0], &[1]);
                        dist::all_reduce(&t, ReduceOp::Sum, Some(&g)).map(|_| vals(&t))
                    };
                    let line = format!(
                        "rank {rank} {name}: {:?} after {:.1}s; group after: {:?}",
                        r.as_ref().map_err(|e| e.to_string()),
                        took.as_secs_f64(),
                        after.map_err(|e| e.to_string()),
                    );
                    report.push(line.clone());
                    // a send completes once the bytes are handed over: only the receiver can
                    // detect a wrong size or tag (as in PyTorch)
                    let sender_ok = name.starts_with("recv") && rank == 1;
                    if r.is_ok() && !sender_ok {
                        return Err(format!("no error: {line}").into());
                    }
                    if took > Duration::from_secs(8) {
                        return Err(format!("too slow: {line}").into());
                    }
                    still_works(name, None)
                };
            let one = rank == 1;
            case("all_gather short list on rank 1", &|g| {
                let outs = if one {
                    vec![z(&[2])]
                } else {
                    vec![z(&[2]), z(&[2])]
                };
                dist::all_gather(&outs, &z(&[2]), Some(g))
            })?;
            case("all_gather wrong out shape on rank 1", &|g| {
                let outs = [z(&[2]), z(&[if one { 3 } else { 2 }])];
                dist::all_gather(&outs, &z(&[2]), Some(g))
            })?;
            case("gather short list on dst", &|g| {
                let gl = [z(&[2])];
                dist::gather(&z(&[2]), if one { Some(&gl[..]) } else { None }, 1, Some(g))
            })?;
            case("gather missing list on dst", &|g| {
                dist::gather(&z(&[2]), None, 1, Some(g))
            })?;
            case("gather wrong shape on dst", &|g| {
                let gl = [z(&[3]), z(&[2])];
                dist::gather(&z(&[2]), if one { Some(&gl[..]) } else { None }, 1, Some(g))
            })?;
            case("scatter list dtype on src", &|g| {
                let sl = [z(&[2]), Tensor::zeros(&[2], DType::F32).expect("zeros")];
                dist::scatter(&z(&[2]), if one { Some(&sl[..]) } else { None }, 1, Some(g))
            })?;
            case("all_to_all short list on rank 1", &|g| {
                let n = if one { 1 } else { 2 };
                let l: Vec<Tensor> = (0..n).map(|_| z(&[1])).collect();
                dist::all_to_all(&l, &l, Some(g))
            })?;
            case("all_to_all dtype on rank 1", &|g| {
                let dt = if one { DType::F32 } else { DType::F64 };
                let l: Vec<Tensor> = (0..2)
                    .map(|_| Tensor::zeros(&[1], dt).expect("z"))
                    .collect();
                dist::all_to_all(&l, &l, Some(g))
            })?;
            case("reduce_scatter short list on rank 1", &|g| {
                let n = if one { 1 } else { 2 };
                let l: Vec<Tensor> = (0..n).map(|_| z(&[2])).collect();
                dist::reduce_scatter(&z(&[2]), &l, ReduceOp::Sum, Some(g))
            })?;
            case("reduce_scatter wrong shape on rank 1", &|g| {
                let l = [z(&[2]), z(&[if one { 3 } else { 2 }])];
                dist::reduce_scatter(&z(&[2]), &l, ReduceOp::Sum, Some(g))
            })?;
            case("a2as splits not summing on rank 1", &|g| {
                let s: &[usize] = if one { &[1, 2] } else { &[2, 2] };
                dist::all_to_all_single(&z(&[4]), &z(&[4]), None, Some(s), Some(g))
            })?;
            case("a2as splits wrong length on rank 1", &|g| {
                let s: &[usize] = if one { &[4] } else { &[2, 2] };
                dist::all_to_all_single(&z(&[4]), &z(&[4]), Some(s), None, Some(g))
            })?;
            case("agit wrong output size on rank 1", &|g| {
                dist::all_gather_into_tensor(&z(&[if one { 3 } else { 4 }]), &z(&[2]), Some(g))
            })?;
            case("int64 Avg on rank 1 only", &|g| {
                let dt = if one { DType::I64 } else { DType::F64 };
                let t = Tensor::zeros(&[2], dt).expect("z");
                dist::all_reduce(&t, ReduceOp::Avg, Some(g))
            })?;
            case("all_reduce vs broadcast", &|g| {
                let t = z(&[2]);
                if one {
                    dist::broadcast(&t, 0, Some(g))
                } else {
                    dist::all_reduce(&t, ReduceOp::Sum, Some(g))
                }
            })?;
            // different collectives on the two ranks: a clear mismatch, and the group survives
            let g = dist::new_group(&[0, 1], None, to)?;
            let t = z(&[2]);
            let r = if one {
                dist::broadcast(&t, 0, Some(&g))
            } else {
                dist::all_reduce(&t, ReduceOp::Sum, Some(&g))
            };
            expect_err(
                "all_reduce vs broadcast message",
                r,
                &["all_reduce", "broadcast"],
            )?;
            still_works("group after all_reduce vs broadcast", Some(&g))?;
            case("recv with a wrong-size buffer", &|g| {
                if one {
                    dist::send(&z(&[3]), 0, Some(g), 0)
                } else {
                    dist::recv(&z(&[2]), 1, Some(g), 0).map(|_| ())
                }
            })?;
            case("recv with a wrong tag", &|g| {
                if one {
                    dist::send(&z(&[2]), 0, Some(g), 1)
                } else {
                    dist::recv(&z(&[2]), 1, Some(g), 2).map(|_| ())
                }
            })?;
            case("Work::wait tiny timeout, peer never joins", &|g| {
                if one {
                    std::thread::sleep(Duration::from_millis(2500));
                    Err(dist::Error::Store("rank 1 skipped on purpose".into()))
                } else {
                    let w = dist::all_reduce_async(&z(&[2]), ReduceOp::Sum, Some(g))?;
                    let e = w.wait(Some(Duration::from_millis(10)));
                    if let Err(e) = &e
                        && !e.to_string().contains("all_reduce")
                    {
                        return Err(dist::Error::Store(format!("unclear: {e}")));
                    }
                    e?;
                    w.wait(None)
                }
            })?;
            println!("{}", report.join("\n"));
            dist::destroy_process_group()?;
            Ok(())
        },
    )?;
    Ok(())
}

/// Bad init methods and environment variables: clear errors, no hang, nothing initialized.
#[test]
fn bad_init_methods() -> TestResult {
    let opts = |m: &str, rank: Option<usize>, ws: Option<usize>| InitOptions {
        init_method: m.into(),
        rank,
        world_size: ws,
        timeout: Duration::from_secs(2),
    };
    for m in [
        "",
        "tcp://",
        "tcp://host",
        "tcp://:29500",
        "tcp://h:99999",
        "tcp://h:-1",
        "file:///tmp/x",
        "env:/",
        "tcp://[::1",
    ] {
        expect_err(
            m,
            dist::init_process_group("cpu", opts(m, Some(0), Some(1))),
            &["init_method"],
        )?;
    }
    expect_err(
        "rank >= world",
        dist::init_process_group("cpu", opts("tcp://127.0.0.1:1", Some(3), Some(2))),
        &["rank", "3"],
    )?;
    expect_err(
        "world 0",
        dist::init_process_group("cpu", opts("tcp://127.0.0.1:1", Some(0), Some(0))),
        &["world_size"],
    )?;
    if !dist::spawn::is_spawned_child() {
        expect_err(
            "bad backend",
            dist::init_process_group("mpi", opts("tcp://127.0.0.1:0", Some(0), Some(1))),
            &["mpi"],
        )?;
    }
    let start = Instant::now();
    let e = dist::init_process_group(
        "cpu",
        opts("tcp://nonexistent.invalid:29500", Some(1), Some(2)),
    );
    expect_err("unresolvable host", e, &[])?;
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
    assert!(!dist::is_initialized());
    for (var, val, needle) in [
        ("RANK", "5", "rank"),
        ("WORLD_SIZE", "abc", "WORLD_SIZE"),
        ("MASTER_PORT", "70000", "MASTER_PORT"),
        ("RANK", "-1", "RANK"),
        ("LOCAL_RANK", "x", "LOCAL_RANK"),
    ] {
        // the children of every iteration re-run this test up to its first spawn call, so
        // the case travels in the environment, not in the closure
        let r = dist::spawn_with(
            SpawnOptions {
                env: vec![
                    (var.into(), val.into()),
                    ("TP_BAD_INIT_CASE".into(), format!("{var}|{needle}")),
                ],
                ..SpawnOptions::new(1)
            },
            |_| -> TestResult {
                let case = std::env::var("TP_BAD_INIT_CASE").unwrap_or_default();
                let (var, needle) = case.split_once('|').unwrap_or(("?", "?"));
                expect_err(var, init(2), &[needle])?;
                assert!(!dist::is_initialized());
                Ok(())
            },
        );
        if let Err(e) = r {
            return Err(format!("{var}={val}: {e}").into());
        }
    }
    Ok(())
}
