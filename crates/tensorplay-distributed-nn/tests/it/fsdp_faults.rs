//! `fully_shard` given bad input or hit by faults, across real processes: every rank gets a
//! clear error naming the rank, the group and what was expected — never a hang or a panic.

use std::time::{Duration, Instant};

use tensorplay_collectives::{self as dist, device_mesh::init_device_mesh};
use tensorplay_core::nn::{Linear, Module, ModuleFields, Sequential};
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::parallel::DistributedDataParallel as Ddp;
use tensorplay_distributed_nn::parallel::fsdp::{
    FsdpError, FsdpOptions, MixedPrecisionPolicy, fully_shard,
};
use tensorplay_testkit::cpu_world;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Linear layers of `dims`, from a fixed seed.
fn mlp(dims: &[usize]) -> tp::Result<Sequential> {
    tp::manual_seed(3);
    let mut m = Sequential::new();
    for w in dims.windows(2) {
        m = m.add(Linear::new(w[0], w[1], true)?);
    }
    Ok(m)
}

/// `res` is an error whose message contains every one of `needles`.
fn fails_with<T>(case: &str, res: tp::Result<T>, needles: &[&str]) -> Result<(), String> {
    match res {
        Ok(_) => Err(format!("{case}: accepted")),
        Err(e) => {
            let msg = format!("{e:?}");
            match needles.iter().find(|n| !msg.contains(*n)) {
                Some(n) => Err(format!("{case}: the error lacks {n:?}: {msg}")),
                None => Ok(()),
            }
        }
    }
}

/// Misuse found when `fully_shard` is called, on every rank alike (world 2).
#[test]
fn bad_setups_fail_on_every_rank() {
    type Setup = fn(usize) -> Result<(), String>;
    let cases: [(&str, Setup); 7] = [
        ("fully_shard twice", |_| {
            let mut m = mlp(&[4, 6, 2]).map_err(|e| e.to_string())?;
            fully_shard(&mut m, FsdpOptions::default()).map_err(|e| e.to_string())?;
            fails_with(
                "twice",
                fully_shard(&mut m, FsdpOptions::default()),
                &["fully_shard", "already"],
            )
        }),
        ("ranks that disagree", |rank| {
            // rank 1's second layer is wider
            let dims: &[usize] = if rank == 1 { &[4, 6, 3] } else { &[4, 6, 2] };
            let mut m = mlp(dims).map_err(|e| e.to_string())?;
            fails_with(
                "disagree",
                fully_shard(&mut m, FsdpOptions::default()),
                &["rank 1", "\"1.weight\"", "[2, 6]", "[3, 6]"],
            )
        }),
        ("a parameter shared by sibling groups", |_| {
            tp::manual_seed(9); // the same weights on every rank
            let w = tp::randn(&[3, 3])
                .map_err(|e| e.to_string())?
                .requires_grad_(true);
            let mut m = Sequential::new()
                .add(Linear::from_weights(w.clone(), None).map_err(|e| e.to_string())?)
                .add(Linear::from_weights(w, None).map_err(|e| e.to_string())?);
            let mut children = m.named_children_mut();
            let (_, first) = children.remove(0);
            fully_shard(first, FsdpOptions::default()).map_err(|e| e.to_string())?;
            let (_, second) = children.remove(0);
            fails_with(
                "shared",
                fully_shard(second, FsdpOptions::default()),
                &["\"weight\"", "fully_shard call", "bottom-up"],
            )
        }),
        ("a 3-D mesh", |_| {
            let mesh = init_device_mesh(&[1, 1, 2], &["pp", "replicate", "shard"])
                .map_err(|e| e.to_string())?;
            let mut m = mlp(&[4, 2]).map_err(|e| e.to_string())?;
            let opts = FsdpOptions {
                mesh: Some(mesh),
                ..Default::default()
            };
            fails_with(
                "3-D",
                fully_shard(&mut m, opts),
                &["1-D mesh", "2-D", "[1, 1, 2]"],
            )
        }),
        ("a policy dtype that is not floating point", |_| {
            let mut m = mlp(&[4, 2]).map_err(|e| e.to_string())?;
            let opts = FsdpOptions {
                mp_policy: MixedPrecisionPolicy {
                    reduce_dtype: Some(DType::I64),
                    ..Default::default()
                },
                ..Default::default()
            };
            fails_with(
                "i64 policy",
                fully_shard(&mut m, opts),
                &["mp_policy.reduce_dtype", "floating", "int64"],
            )
        }),
        ("ranks with different policies", |rank| {
            let mut m = mlp(&[4, 2]).map_err(|e| e.to_string())?;
            let opts = FsdpOptions {
                mp_policy: MixedPrecisionPolicy {
                    param_dtype: (rank == 1).then_some(DType::F64),
                    ..Default::default()
                },
                ..Default::default()
            };
            fails_with(
                "policies",
                fully_shard(&mut m, opts),
                &["options", "rank 1's", "param_dtype: Some(F64)"],
            )
        }),
        ("DDP and fully_shard on one module", |_| {
            let mut ddp =
                Ddp::new(mlp(&[4, 2]).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
            fails_with(
                "fsdp over ddp",
                fully_shard(&mut ddp, FsdpOptions::default()),
                &["DistributedDataParallel was applied"],
            )?;
            let mut m = mlp(&[4, 2]).map_err(|e| e.to_string())?;
            fully_shard(&mut m, FsdpOptions::default()).map_err(|e| e.to_string())?;
            fails_with("ddp over fsdp", Ddp::new(m), &["fully_shard was applied"])
        }),
    ];
    cpu_world(2, Duration::from_secs(30), |rank| -> TestResult {
        let check = |(name, f): (&str, Setup)| f(rank).map_err(|e| format!("{name}: {e}"));
        for c in cases {
            check(c)?;
        }
        Ok(())
    });
}

/// A rank that dies between steps: the others' next forward fails within the collective
/// timeout, naming the dead rank and the group.
#[test]
fn a_dead_rank_is_named_by_the_others() {
    let res = dist::spawn(3, |rank| -> TestResult {
        dist::init_process_group(
            "cpu",
            dist::InitOptions {
                timeout: Duration::from_secs(5),
                ..Default::default()
            },
        )?;
        let mut m = mlp(&[4, 8, 2])?;
        fully_shard(&mut m, FsdpOptions::default())?;
        let x = Tensor::ones(&[2, 4], DType::F32)?;
        m.call(&x)?.sum()?.backward()?;
        if rank == 2 {
            std::process::exit(0); // gone without a word
        }
        let start = Instant::now();
        let err = m
            .call(&x)
            .err()
            .ok_or("the forward without rank 2 succeeded")?;
        if start.elapsed() > Duration::from_secs(20) {
            return Err(format!("took {:?}", start.elapsed()).into());
        }
        let f = err
            .downcast_ref::<FsdpError>()
            .ok_or_else(|| format!("not an FsdpError: {err}"))?;
        let FsdpError::Collective {
            rank: r, source, ..
        } = f
        else {
            return Err(format!("{f:?}").into());
        };
        let names_2 = match source {
            dist::Error::PeerFailed { peer, detail, .. } => {
                *peer == 2 || detail.ranks().contains(&2)
            }
            dist::Error::Timeout { detail, .. } => detail.ranks().contains(&2),
            _ => false,
        };
        if *r != rank || !names_2 || !f.to_string().contains("all-gather") {
            return Err(format!("rank {rank}: {f}").into());
        }
        Ok(())
    });
    // rank 2 exited with status 0 before reporting: spawn counts that as a failure of rank 2
    // only; ranks 0 and 1 passed their checks
    if let Err(e) = res {
        let msg = e.to_string();
        if msg.contains("rank 0") || msg.contains("rank 1 ") || !msg.contains("rank 2") {
            panic!("{msg}");
        }
    }
}

/// A rank that runs a forward the others do not (PyTorch users' hang around `generate()`):
/// it gets an error naming the group within the timeout; the others, which go on to a
/// barrier, get one too.
#[test]
fn an_extra_forward_fails_instead_of_hanging() {
    let res = dist::spawn(2, |rank| -> TestResult {
        dist::init_process_group(
            "cpu",
            dist::InitOptions {
                timeout: Duration::from_secs(3),
                ..Default::default()
            },
        )?;
        let mut m = mlp(&[4, 8, 2])?;
        fully_shard(&mut m, FsdpOptions::default())?;
        let x = Tensor::ones(&[2, 4], DType::F32)?;
        let start = Instant::now();
        let res: tp::Result<()> = if rank == 0 {
            let _g = tp::no_grad();
            m.call(&x).map(|_| ())
        } else {
            dist::barrier(None).map_err(Into::into)
        };
        let err = res.err().ok_or_else(|| format!("rank {rank} went on"))?;
        if start.elapsed() > Duration::from_secs(20) {
            return Err(format!("rank {rank} took {:?}", start.elapsed()).into());
        }
        let msg = format!("{err:?}");
        if rank == 0 && !(msg.contains("all-gather") && msg.contains("rank 0")) {
            return Err(format!("rank 0: {msg}").into());
        }
        Ok(())
    });
    if let Err(e) = res {
        panic!("{e}");
    }
}
