//! The `"cpu"` backend's transports in real processes: every collective on the shared-memory
//! path and with it off (`TENSORPLAY_SHM=0`), world sizes 1-4, at the chunk boundaries (a
//! test-only 1 KiB slot reaches them with small tensors), mixed "hosts" (the test-only
//! `TENSORPLAY_SHM_TEST_HOST`), concurrent groups and async ops, and a rank SIGKILLed inside a
//! shared-memory collective. Values are compared with single-process results; integer dtypes
//! exactly.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tensorplay_collectives::{self as dist, ReduceOp, SpawnOptions};
use tensorplay_core::{DType, Tensor};

use super::{
    TestResult, all_collectives, as_f64, check, init, ops_for, reduce_ref, tensor, values,
};

/// The slot size the tests use (bytes): 256 f32 or 128 f64/i64 elements per chunk.
const SLOT: usize = 1024;

/// Exact for int64 (the paths must agree bit for bit), within tolerance for floats.
fn check_dt(dt: DType, what: &str, got: &Tensor, want: Vec<f64>) -> TestResult {
    if dt == DType::I64 {
        let g = got.to_vec::<i64>()?;
        let w: Vec<i64> = want.iter().map(|&v| v as i64).collect();
        if g != w {
            return Err(format!("{what}: got {g:?}, want {w:?}").into());
        }
        return Ok(());
    }
    check(what, as_f64(got), want)
}

/// Lengths around the chunk boundaries for elements of `es` bytes: empty, one, odd, a slot
/// +/- 1, the one-shot limit (four slots) and one past it, several chunks.
fn lengths(es: usize) -> Vec<usize> {
    let per = SLOT / es;
    vec![
        0,
        1,
        7,
        per - 1,
        per,
        per + 1,
        4 * per,
        4 * per + 1,
        9 * per + 3,
    ]
}

/// Every collective at every boundary length, against single-process results.
fn boundary_collectives(
    rank: usize,
    members: &[usize],
    group: Option<&dist::ProcessGroup>,
) -> TestResult {
    let k = members.len();
    let me = members
        .iter()
        .position(|&m| m == rank)
        .ok_or("not a member")?;
    for dt in [DType::F32, DType::F64, DType::I64] {
        let es = if dt == DType::F32 { 4 } else { 8 };
        for len in lengths(es) {
            let tag = format!("{dt} len {len} (world {k})");
            let xs: Vec<Vec<f64>> = (0..k).map(|r| values(members[r], len, 1)).collect();
            for op in ops_for(dt) {
                let t = tensor(&xs[me], &[len], dt);
                dist::all_reduce(&t, op, group)?;
                check_dt(
                    dt,
                    &format!("all_reduce {op:?} {tag}"),
                    &t,
                    reduce_ref(op, &xs),
                )?;
            }
            let root = members[k - 1];
            let t = tensor(&xs[me], &[len], dt);
            dist::reduce(&t, root, ReduceOp::Sum, group)?;
            let want = if me == k - 1 {
                reduce_ref(ReduceOp::Sum, &xs)
            } else {
                xs[me].clone()
            };
            check_dt(dt, &format!("reduce to {root} {tag}"), &t, want)?;
            let t = tensor(&values(rank, len, 2), &[len], dt);
            dist::broadcast(&t, root, group)?;
            check_dt(
                dt,
                &format!("broadcast from {root} {tag}"),
                &t,
                values(root, len, 2),
            )?;
            // all_gather, uneven: rank r contributes len + r elements
            let outs: Vec<Tensor> = (0..k)
                .map(|r| Tensor::zeros(&[len + r], dt))
                .collect::<Result<_, _>>()?;
            dist::all_gather(
                &outs,
                &tensor(&values(rank, len + me, 3), &[len + me], dt),
                group,
            )?;
            for (r, o) in outs.iter().enumerate() {
                check_dt(
                    dt,
                    &format!("all_gather block {r} {tag}"),
                    o,
                    values(members[r], len + r, 3),
                )?;
            }
            let out = Tensor::zeros(&[k * len], dt)?;
            dist::all_gather_into_tensor(&out, &tensor(&values(rank, len, 4), &[len], dt), group)?;
            let want: Vec<f64> = members.iter().flat_map(|&m| values(m, len, 4)).collect();
            check_dt(dt, &format!("all_gather_into_tensor {tag}"), &out, want)?;
            // reduce_scatter: blocks of len
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let ys: Vec<Vec<f64>> = (0..k).map(|r| values(members[r], k * len, 5)).collect();
                let full = reduce_ref(op, &ys);
                let out = Tensor::zeros(&[len], dt)?;
                dist::reduce_scatter_tensor(&out, &tensor(&ys[me], &[k * len], dt), op, group)?;
                check_dt(
                    dt,
                    &format!("reduce_scatter {op:?} {tag}"),
                    &out,
                    full[me * len..(me + 1) * len].to_vec(),
                )?;
            }
            // gather to and scatter from the first member
            let list: Vec<Tensor> = (0..k)
                .map(|_| Tensor::zeros(&[len], dt))
                .collect::<Result<_, _>>()?;
            let x = tensor(&values(rank, len, 6), &[len], dt);
            dist::gather(&x, (me == 0).then_some(list.as_slice()), members[0], group)?;
            if me == 0 {
                for (r, l) in list.iter().enumerate() {
                    check_dt(
                        dt,
                        &format!("gather block {r} {tag}"),
                        l,
                        values(members[r], len, 6),
                    )?;
                }
            }
            let src: Vec<Tensor> = (0..k)
                .map(|r| tensor(&values(r * 10, len, 7), &[len], dt))
                .collect();
            let out = Tensor::zeros(&[len], dt)?;
            dist::scatter(&out, (me == 0).then_some(src.as_slice()), members[0], group)?;
            check_dt(dt, &format!("scatter {tag}"), &out, values(me * 10, len, 7))?;
            // all_to_all_single, uneven: rank r sends len + r + 2s elements to s
            let size = |from: usize, to: usize| len + from + 2 * to;
            let in_splits: Vec<usize> = (0..k).map(|s| size(me, s)).collect();
            let out_splits: Vec<usize> = (0..k).map(|r| size(r, me)).collect();
            let n_in: usize = in_splits.iter().sum();
            let output = Tensor::zeros(&[out_splits.iter().sum::<usize>()], dt)?;
            let input = tensor(&values(rank, n_in, 9), &[n_in], dt);
            dist::all_to_all_single(&output, &input, Some(&out_splits), Some(&in_splits), group)?;
            let mut want = Vec::new();
            for (r, &m) in members.iter().enumerate() {
                let theirs: Vec<usize> = (0..k).map(|s| size(r, s)).collect();
                let start: usize = theirs[..me].iter().sum();
                let v = values(m, theirs.iter().sum(), 9);
                want.extend_from_slice(&v[start..start + theirs[me]]);
            }
            check_dt(dt, &format!("all_to_all_single {tag}"), &output, want)?;
            dist::barrier(group)?;
        }
    }
    Ok(())
}

fn spawn_env(n: usize, env: &[(&str, &str)]) -> SpawnOptions {
    let mut o = SpawnOptions::new(n);
    o.timeout = Some(Duration::from_secs(300));
    o.env = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    o.env
        .push(("TENSORPLAY_SHM_SLOT_BYTES".into(), SLOT.to_string()));
    o
}

/// One world of `n` ranks on one path; the transport is asserted, so a path that silently fell
/// back fails.
fn world_on_path(n: usize, shm: bool) -> TestResult {
    let opts = spawn_env(n, &[("TENSORPLAY_SHM", if shm { "1" } else { "0" })]);
    dist::spawn_with(opts, move |rank| -> TestResult {
        init(60)?;
        let want = if n > 1 && shm { "shm" } else { "tcp" };
        let g = dist::default_group("test")?;
        assert_eq!(g.transport(), want, "world {n}, shm {shm}");
        let members: Vec<usize> = (0..n).collect();
        all_collectives(rank, n, None, &members)?;
        boundary_collectives(rank, &members, None)?;
        assert_eq!(
            g.bytes_sent() > 0,
            n > 1,
            "bytes_sent counts both transports"
        );
        dist::destroy_process_group()?;
        Ok(())
    })
    .map_err(|e| format!("world {n}, shared memory {shm}: {e}"))?;
    Ok(())
}

// one spawned world per test (spawn re-executes the test, so one spawn call per test)
macro_rules! worlds {
    ($($name:ident: $n:expr, $shm:expr;)*) => {$(
        #[test]
        fn $name() -> TestResult {
            world_on_path($n, $shm)
        }
    )*};
}

worlds! {
    world_1_shm: 1, true;
    world_1_tcp: 1, false;
    world_2_shm: 2, true;
    world_2_tcp: 2, false;
    world_3_shm: 3, true;
    world_3_tcp: 3, false;
    world_4_shm: 4, true;
    world_4_tcp: 4, false;
}

/// Ranks 0, 2, 3 on one "host", rank 1 alone on another: hierarchical collectives in the
/// world and in a subgroup of another rank order; plus concurrent groups and async ops.
#[test]
fn mixed_hosts_subgroups_and_concurrent_groups() -> TestResult {
    let opts = spawn_env(4, &[("TENSORPLAY_SHM_TEST_HOST", "a,b,a,a")]);
    dist::spawn_with(opts, |rank| -> TestResult {
        init(60)?;
        assert_eq!(dist::default_group("test")?.transport(), "shm+tcp");
        all_collectives(rank, 4, None, &[0, 1, 2, 3])?;
        boundary_collectives(rank, &[0, 1, 2, 3], None)?;
        let g = dist::new_group(&[3, 1, 2], None, None)?;
        let same_host = dist::new_group(&[2, 0, 3], None, None)?;
        if rank != 0 {
            assert_eq!(g.transport(), "shm+tcp");
            boundary_collectives(rank, &[3, 1, 2], Some(&g))?;
        }
        if rank != 1 {
            assert_eq!(same_host.transport(), "shm");
            all_collectives(rank, 3, Some(&same_host), &[2, 0, 3])?;
        }
        // two groups of the same ranks, each with an async all_reduce in flight at once
        let g1 = dist::new_group(&[0, 2, 3], None, None)?;
        let g2 = dist::new_group(&[0, 2, 3], None, None)?;
        if rank != 1 {
            let n = 50_000;
            let a = Tensor::ones(&[n], DType::F32)?;
            let b = Tensor::full(&[n], 2.0, DType::F64)?;
            let wa = dist::all_reduce_async(&a, ReduceOp::Sum, Some(&g1))?;
            let wb = dist::all_reduce_async(&b, ReduceOp::Sum, Some(&g2))?;
            let c = Tensor::ones(&[7], DType::I64)?;
            let wc = dist::all_reduce_async(&c, ReduceOp::Sum, Some(&g1))?;
            wb.wait(Some(Duration::from_secs(30)))?;
            wa.wait(Some(Duration::from_secs(30)))?;
            wc.wait(Some(Duration::from_secs(30)))?;
            check("concurrent group 1", as_f64(&a), vec![3.0; n])?;
            check("concurrent group 2", as_f64(&b), vec![6.0; n])?;
            check("async after async", as_f64(&c), vec![3.0; 7])?;
        }
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

/// Entries of `/dev/shm` named by one of `pids` (our objects carry their creator's pid).
fn shm_entries_of(pids: &[String]) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir("/dev/shm") else {
        return vec![];
    };
    rd.flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            n.starts_with("tensorplay-") && pids.iter().any(|p| n.contains(&format!("-{p}-")))
        })
        .collect()
}

fn temp_dir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let d = std::env::temp_dir().join(format!("tp-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_default()
}

/// Rank 2 is SIGKILLed while a large shared-memory collective streams (`what`: all_reduce,
/// all_gather, reduce_scatter, or broadcast from rank 0, where the root sees the death first
/// and must not be blamed for it):
/// ranks 0 and 1 get an error naming rank 2 within their timeout, and nothing of the job is
/// left in /dev/shm.
fn killed_inside(what: &'static str) -> TestResult {
    // code before `spawn` runs in the children too: only the parent makes the directory
    let dir = match std::env::var_os("TP_TEST_DIR") {
        Some(d) => PathBuf::from(d),
        None => temp_dir(what),
    };
    let mut opts = spawn_env(3, &[("TP_TEST_DIR", dir.to_str().ok_or("path")?)]);
    opts.timeout = Some(Duration::from_secs(120));
    let r = dist::spawn_with(opts, move |rank| -> TestResult {
        let op = |t: &Tensor| match what {
            "broadcast" => dist::broadcast(t, 0, None),
            "all_gather" => {
                let out = Tensor::zeros(&[3 * t.numel()], DType::F32)?;
                dist::all_gather_into_tensor(&out, t, None)
            }
            "reduce_scatter" => {
                let out = Tensor::zeros(&[t.numel() / 3], DType::F32)?;
                dist::reduce_scatter_tensor(&out, t, ReduceOp::Sum, None)
            }
            _ => dist::all_reduce(t, ReduceOp::Sum, None),
        };
        let dir = PathBuf::from(std::env::var("TP_TEST_DIR")?);
        let victim = std::env::var_os("TP_TEST_VICTIM").is_some();
        if rank == 2 && !victim {
            // spawn stops the whole world when one of its ranks dies, so rank 2's process
            // starts the victim (the same test as rank 2 of the same job) and outlives it
            let st = std::process::Command::new(std::env::current_exe()?)
                .args(std::env::args_os().skip(1))
                .env("TP_TEST_VICTIM", "1")
                .status()?;
            std::fs::write(dir.join("victim"), format!("{st:?}"))?;
            return Ok(());
        }
        std::fs::write(
            dir.join(format!("pid{rank}")),
            std::process::id().to_string(),
        )?;
        init(8)?;
        assert_eq!(dist::default_group("test")?.transport(), "shm");
        // reduce_scatter's input is three blocks
        let n = if what == "reduce_scatter" {
            3 << 20
        } else {
            4 << 20
        };
        let t = Tensor::ones(&[n], DType::F32)?;
        op(&t)?;
        if victim {
            let out = Tensor::zeros(&[3 * t.numel()], DType::F32)?;
            let part = Tensor::zeros(&[t.numel() / 3], DType::F32)?;
            let w = match what {
                "broadcast" => dist::broadcast_async(&t, 0, None)?,
                "all_gather" => dist::all_gather_into_tensor_async(&out, &t, None)?,
                "reduce_scatter" => {
                    dist::reduce_scatter_tensor_async(&part, &t, ReduceOp::Sum, None)?
                }
                _ => dist::all_reduce_async(&t, ReduceOp::Sum, None)?,
            };
            std::thread::sleep(Duration::from_millis(3));
            // SAFETY: kill(2) on our own pid with SIGKILL; it does not return.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            drop(w);
        }
        let start = Instant::now();
        let e = loop {
            // keep calling: the first call may finish before rank 2 dies
            if let Err(e) = op(&t) {
                break e;
            }
        };
        let took = start.elapsed();
        std::fs::write(
            dir.join(format!("err{rank}")),
            format!("{}\n{e}", took.as_secs_f64()),
        )?;
        Ok(())
    });
    let pids: Vec<String> = (0..3).map(|r| read(&dir, &format!("pid{r}"))).collect();
    let outcome = (0..2)
        .map(|r| read(&dir, &format!("err{r}")))
        .collect::<Vec<_>>();
    let e = read(&dir, "victim");
    let _ = std::fs::remove_dir_all(&dir);
    r?;
    assert!(
        e.contains("9") || e.contains("KILL"),
        "the victim was killed: {e}"
    );
    eprintln!("{what}: survivors: {outcome:?}; victim: {e}");
    for (r, o) in outcome.iter().enumerate() {
        let (took, msg) = o
            .split_once('\n')
            .ok_or_else(|| format!("rank {r} wrote no error: {e}"))?;
        assert!(
            msg.contains("rank 2"),
            "rank {r}'s error names rank 2: {msg}"
        );
        assert!(
            !msg.contains("rank 1 died") && !msg.contains("rank 0 died"),
            "rank {r} blames a survivor: {msg}"
        );
        let took: f64 = took.parse()?;
        assert!(
            took < 30.0,
            "rank {r} took {took} s to notice (timeout 8 s)"
        );
    }
    assert!(
        pids.iter().all(|p| !p.is_empty()),
        "every rank wrote its pid"
    );
    let left = shm_entries_of(&pids);
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");
    Ok(())
}

#[test]
fn a_rank_killed_inside_a_shared_memory_all_reduce() -> TestResult {
    killed_inside("all_reduce")
}

#[test]
fn a_rank_killed_inside_a_shared_memory_broadcast_is_named_not_the_root() -> TestResult {
    killed_inside("broadcast")
}

/// The same inside collectives that read peers' memory directly (cross-memory attach, on by
/// default where it works; on the slot path otherwise): a dead peer is named, never a hang.
#[test]
fn a_rank_killed_inside_a_shared_memory_all_gather() -> TestResult {
    killed_inside("all_gather")
}

#[test]
fn a_rank_killed_inside_a_shared_memory_reduce_scatter() -> TestResult {
    killed_inside("reduce_scatter")
}

/// With the cross-rank argument check off, the shared-memory path itself catches ranks in
/// different calls: broadcasts with different roots, broadcast against reduce, a barrier
/// against an all_reduce (each case on a fresh group; every rank must fail).
#[test]
fn mismatched_calls_on_shared_memory_fail_on_every_rank() -> TestResult {
    let opts = spawn_env(3, &[("TENSORPLAY_COLLECTIVE_CHECK", "0")]);
    dist::spawn_with(opts, |rank| -> TestResult {
        init(10)?;
        let groups: Vec<dist::ProcessGroup> = (0..3)
            .map(|_| dist::new_group(&[0, 1, 2], None, None))
            .collect::<Result<_, _>>()?;
        let t = Tensor::ones(&[8], DType::F32)?;
        for (case, g) in groups.iter().enumerate() {
            assert_eq!(g.transport(), "shm");
            let r = match (case, rank) {
                (0, 0) => dist::broadcast(&t, 0, Some(g)),
                (0, _) => dist::broadcast(&t, 1, Some(g)),
                (1, 0) => dist::broadcast(&t, 0, Some(g)),
                (1, _) => dist::reduce(&t, 0, ReduceOp::Sum, Some(g)),
                (_, 0) => dist::barrier(Some(g)),
                (_, _) => dist::all_reduce(&t, ReduceOp::Sum, Some(g)),
            };
            let e = match r {
                Ok(()) => return Err(format!("case {case}: rank {rank} succeeded").into()),
                Err(e) => e.to_string(),
            };
            // the rank that sees the disagreement says so; the others see it shut the group
            let named = e.contains("ranks disagree") || e.contains("failed");
            assert!(named, "case {case}, rank {rank}: {e}");
        }
        Ok(())
    })?;
    Ok(())
}
