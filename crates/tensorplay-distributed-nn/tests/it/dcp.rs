//! `checkpoint::save` / `checkpoint::load` across real processes: a model saved by each
//! layout (one process without a group, DDP, tensor parallel, fully sharded, both: 2-D) at its
//! world size loads into every layout at other world sizes, its whole tensors bit for bit the
//! saved ones; shared and per-rank values come back; bad checkpoints are refused on every rank
//! with nothing changed.

use std::path::Path;
use std::time::Duration;

use tensorplay_collectives::device_mesh::{DeviceMesh, init_device_mesh};
use tensorplay_collectives::spawn::is_spawned_child;
use tensorplay_collectives::{self as dist};
use tensorplay_core::nn::{Module, ModuleFields, Sequential};
use tensorplay_core::{self as tp};
use tensorplay_distributed_nn::checkpoint::state_dict::get_model_state_dict;
use tensorplay_distributed_nn::checkpoint::{self as dcp, AppState, StateValue, model_state};
use tensorplay_distributed_nn::parallel::DistributedDataParallel;
use tensorplay_distributed_nn::parallel::fsdp::{FsdpOptions, fully_shard};
use tensorplay_distributed_nn::parallel::tensor::{
    ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module,
};
use tensorplay_testkit::{SharedDir, cpu_world_in, generator_lock};

use super::state_dict::{adamw, full, mlp, pair_from, same, sharded, step};

pub(super) type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const TIMEOUT: Duration = Duration::from_secs(60);
/// The seed of the saved weights (a loaded model starts from another).
pub(super) const SAVED: u64 = 11;

/// How a model is split over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Layout {
    /// One process without a process group (PyTorch's `no_dist`).
    Alone,
    Ddp,
    Tp,
    Fsdp,
    /// Tensor parallel over pairs of ranks, then fully sharded over the pairs (mesh
    /// `[world / 2, 2]`, names `dp`, `tp`).
    TwoD,
}

/// [`pair_from`]'s model of `seed` laid out as `layout` on this rank.
pub(super) fn build(layout: Layout, seed: u64) -> tp::Result<Box<dyn Module>> {
    let mut m: Sequential = pair_from(seed)?;
    Ok(match layout {
        Layout::Alone => Box::new(m),
        Layout::Ddp => Box::new(DistributedDataParallel::new(m)?),
        Layout::Tp => {
            let mesh = DeviceMesh::from_group(&dist::default_group("test")?, "tp")?;
            let (col, row) = (ColwiseParallel::new(), RowwiseParallel::new());
            let plan: Vec<(&str, &dyn ParallelStyle)> = vec![("0", &col), ("2", &row)];
            parallelize_module(&mut m, &mesh, &plan)?;
            Box::new(m)
        }
        Layout::Fsdp => {
            if let Some((_, first)) = m.named_children_mut().into_iter().next() {
                fully_shard(first, FsdpOptions::default())?;
            }
            fully_shard(&mut m, FsdpOptions::default())?;
            Box::new(m)
        }
        Layout::TwoD => {
            let world = dist::get_world_size(None)?;
            let mesh = init_device_mesh(&[world / 2, 2], &["dp", "tp"])?;
            let (col, row) = (ColwiseParallel::new(), RowwiseParallel::new());
            let plan: Vec<(&str, &dyn ParallelStyle)> = vec![("0", &col), ("2", &row)];
            parallelize_module(&mut m, mesh.sub_mesh("tp")?, &plan)?;
            let options = || FsdpOptions {
                mesh: mesh.sub_mesh("dp").ok().cloned(),
                ..FsdpOptions::default()
            };
            if let Some((_, first)) = m.named_children_mut().into_iter().next() {
                fully_shard(first, options())?;
            }
            fully_shard(&mut m, options())?;
            Box::new(m)
        }
    })
}

/// Saves the model of [`SAVED`] as `layout`, with a shared step and each rank's own value.
pub(super) fn save_as(layout: Layout, dir: &Path, rank: usize) -> TestResult {
    let m = build(layout, SAVED)?;
    let mut sd = model_state(&*m, "model")?;
    sd.insert("step".into(), StateValue::Value(serde_json::json!(7)));
    sd.insert(
        "rank".into(),
        StateValue::RankValue(serde_json::json!(100 + rank)),
    );
    let md = dcp::save(&sd, dir, None)?;
    if md.tensors.len() != 4 {
        return Err(format!("metadata lists {} tensors", md.tensors.len()).into());
    }
    Ok(())
}

/// Loads into a model of another seed laid out as `layout`; checks every value.
fn load_as(layout: Layout, dir: &Path, rank: usize, saved_world: usize) -> TestResult {
    let m = build(layout, 99)?;
    let mut sd = model_state(&*m, "model")?;
    sd.insert("step".into(), StateValue::Value(serde_json::json!(0)));
    sd.insert(
        "rank".into(),
        StateValue::RankValue(serde_json::Value::Null),
    );
    dcp::load(&mut sd, dir, None)?;
    same(
        &format!("{layout:?} rank {rank}"),
        &get_model_state_dict(&*m, full())?,
        &pair_from(SAVED)?.state_dict()?,
    )?;
    let step = sd["step"].as_value().cloned();
    let own = sd["rank"].as_value().cloned();
    let want_own = serde_json::json!(100 + rank % saved_world);
    if step != Some(serde_json::json!(7)) || own != Some(want_own.clone()) {
        return Err(format!("values: step {step:?}, own {own:?} (want 7, {want_own})").into());
    }
    Ok(())
}

/// Runs `f(rank)` at `world` ranks, or in this process without a group for [`Layout::Alone`].
pub(super) fn at(
    layout: Layout,
    world: usize,
    dir: &SharedDir,
    f: impl Fn(usize) -> TestResult,
) -> Result<(), String> {
    if layout == Layout::Alone {
        // the test process's work: the ranks of the other worlds re-run the test from its
        // start and skip it
        if is_spawned_child() {
            return Ok(());
        }
        // this test process draws the weights: no other test's draws in between
        let _g = generator_lock();
        return f(0).map_err(|e| e.to_string());
    }
    cpu_world_in(world, TIMEOUT, dir, f);
    Ok(())
}

#[test]
fn saved_on_n_loads_on_m_in_every_layout() {
    let root = SharedDir::new("dcp-reshard");
    let saves = [
        (Layout::Alone, 1),
        (Layout::Ddp, 2),
        (Layout::Tp, 2),
        (Layout::Fsdp, 2),
        (Layout::Fsdp, 3),
        (Layout::Tp, 3),
        (Layout::TwoD, 4),
    ];
    let loads = [
        (Layout::Alone, 1),
        (Layout::Fsdp, 2),
        (Layout::Fsdp, 4),
        (Layout::Tp, 2),
        (Layout::Ddp, 3),
        (Layout::TwoD, 4),
        (Layout::TwoD, 2),
    ];
    let check = |name: String, r: Result<(), String>| {
        if let Err(e) = r {
            panic!("{name}: {e}");
        }
    };
    for (saved, n) in saves {
        let sub = format!("{saved:?}-{n}");
        check(
            format!("save {sub}"),
            at(saved, n, &root, |rank| {
                save_as(saved, &root.dir().join(&sub), rank)
            }),
        );
        for (loaded, m) in loads {
            check(
                format!("{sub} -> {loaded:?} at {m}"),
                at(loaded, m, &root, |rank| {
                    load_as(loaded, &root.dir().join(&sub), rank, n)
                }),
            );
        }
    }
}

/// The MLP of `seed` laid out as `layout` (fully sharded: every layer, then the root; its odd
/// widths split over no tensor-parallel group, so those layouts keep it whole).
fn mlp_as(layout: Layout, seed: u64) -> tp::Result<Box<dyn Module>> {
    Ok(match layout {
        Layout::Alone | Layout::Tp | Layout::TwoD => Box::new(mlp(seed)?),
        Layout::Ddp => Box::new(DistributedDataParallel::new(mlp(seed)?)?),
        Layout::Fsdp => Box::new(sharded(seed)?),
    })
}

#[test]
fn model_and_optimizer_resume_at_other_world_sizes() {
    let root = SharedDir::new("dcp-resume");
    let dir = root.dir().join("app");
    // two AdamW steps fully sharded at world 2, saved
    at(Layout::Fsdp, 2, &root, |rank| {
        let mut m = sharded(5)?;
        let mut o = adamw(m.parameters())?;
        for k in 0..2 {
            step(&m, &mut o, k, rank, 2)?;
        }
        let app = AppState {
            model: &mut m,
            optimizer: Some(&mut o),
        };
        dcp::save_state(&[("app", &app)], &dir, None)?;
        Ok(())
    })
    .unwrap_or_else(|e| panic!("save: {e}"));
    // the uninterrupted run, in one process: four steps on the whole batch
    let want = {
        let _g = generator_lock();
        let m = mlp(5).unwrap();
        let mut o = adamw(m.parameters()).unwrap();
        for k in 0..4 {
            step(&m, &mut o, k, 0, 1).unwrap();
        }
        m.state_dict().unwrap()
    };
    for (layout, world) in [
        (Layout::Alone, 1),
        (Layout::Fsdp, 2),
        (Layout::Fsdp, 4),
        (Layout::Ddp, 3),
    ] {
        let r = at(layout, world, &root, |rank| {
            let mut m = mlp_as(layout, 77)?;
            let mut o = adamw(m.parameters())?;
            {
                let mut app = AppState {
                    model: &mut *m,
                    optimizer: Some(&mut o),
                };
                dcp::load_state(&mut [("app", &mut app)], &dir, None)?;
            }
            for k in 2..4 {
                step(&*m, &mut o, k, rank, world)?;
            }
            let got = get_model_state_dict(&*m, full())?;
            for (k, w) in &want {
                tensorplay_testkit::check_close(
                    &format!("{layout:?} at {world}, rank {rank}: {k}"),
                    &got[k].to_vec_f64()?,
                    &w.to_vec_f64()?,
                    tensorplay_testkit::Tol::scaled(1e-12),
                )?;
            }
            Ok(())
        });
        if let Err(e) = r {
            panic!("resume as {layout:?} at {world}: {e}");
        }
    }
}

/// A damage done to a saved checkpoint (in the test process, between the worlds), and what
/// the load must say on every rank.
type Damage = (&'static str, fn(&Path) -> std::io::Result<()>, &'static str);

/// The first rank file of the checkpoint in `dir`.
fn rank_file(dir: &Path) -> std::io::Result<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    files
        .into_iter()
        .next()
        .ok_or_else(|| std::io::Error::other("no rank file"))
}

/// Edits the metadata's JSON with `f`.
fn edit_metadata(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) -> std::io::Result<()> {
    let path = dir.join(dcp::METADATA_FILE);
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    f(&mut v);
    std::fs::write(&path, v.to_string())
}

const DAMAGES: [Damage; 9] = [
    (
        "no checkpoint",
        |d| std::fs::remove_file(d.join(dcp::METADATA_FILE)),
        "no committed checkpoint",
    ),
    (
        "a truncated rank file",
        |d| {
            let f = rank_file(d)?;
            let len = std::fs::metadata(&f)?.len();
            std::fs::OpenOptions::new()
                .write(true)
                .open(&f)?
                .set_len(len - 9)
        },
        "truncated",
    ),
    (
        "a flipped bit",
        |d| {
            let f = rank_file(d)?;
            let mut b = std::fs::read(&f)?;
            let last = b.len() - 1;
            b[last] ^= 0x10;
            std::fs::write(&f, b)
        },
        "fails its checksum",
    ),
    (
        "a missing rank file",
        |d| std::fs::remove_file(rank_file(d)?),
        "could not open it",
    ),
    (
        "metadata of another program",
        |d| std::fs::write(d.join(dcp::METADATA_FILE), b"{\"step\": 3}"),
        "not the metadata of a tensorplay checkpoint",
    ),
    (
        "truncated metadata",
        |d| {
            let p = d.join(dcp::METADATA_FILE);
            let b = std::fs::read(&p)?;
            std::fs::write(&p, &b[..b.len() / 2])
        },
        "not JSON",
    ),
    (
        "overlapping pieces",
        |d| {
            edit_metadata(d, |v| {
                let c = &mut v["tensors"]["model.0.weight"]["chunks"];
                let first = c[0].clone();
                if let Some(a) = c.as_array_mut() {
                    a.push(first);
                }
            })
        },
        "overlap",
    ),
    (
        "a hole",
        |d| {
            edit_metadata(d, |v| {
                if let Some(a) = v["tensors"]["model.0.weight"]["chunks"].as_array_mut() {
                    a.pop();
                }
            })
        },
        "a piece is missing",
    ),
    (
        "a rank file holding another step's values",
        |d| {
            // the same layout with the last tensor's values changed, as a file of the same
            // shapes saved at another step would be (only the checksums can tell)
            let f = rank_file(d)?;
            let mut b = std::fs::read(&f)?;
            let n = b.len();
            for x in &mut b[n - 48..] {
                *x = x.wrapping_add(1);
            }
            std::fs::write(&f, b)
        },
        "from another save",
    ),
];

#[test]
fn damaged_checkpoints_are_refused_on_every_rank_and_change_nothing() {
    let root = SharedDir::new("dcp-damage");
    for (i, (name, damage, needle)) in DAMAGES.into_iter().enumerate() {
        let dir = root.dir().join(format!("case{i}"));
        let saved = at(Layout::Fsdp, 2, &root, |rank| {
            save_as(Layout::Fsdp, &dir, rank)
        });
        saved.unwrap_or_else(|e| panic!("{name}: save: {e}"));
        if !is_spawned_child() {
            damage(&dir).unwrap_or_else(|e| panic!("{name}: damaging: {e}"));
        }
        let r = at(Layout::Fsdp, 2, &root, |rank| {
            let m = build(Layout::Fsdp, 99)?;
            let mut sd = model_state(&*m, "model")?;
            let e = match dcp::load(&mut sd, &dir, None) {
                Ok(()) => return Err(format!("{name}: rank {rank} loaded it").into()),
                Err(e) => e.to_string(),
            };
            // the rank at fault says why; the others name it and repeat its reason
            if !e.contains(needle) {
                return Err(format!("{name}: rank {rank}'s error: {e}").into());
            }
            same(
                &format!("{name}: rank {rank} unchanged"),
                &get_model_state_dict(&*m, full())?,
                &pair_from(99)?.state_dict()?,
            )?;
            Ok(())
        });
        r.unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn states_that_do_not_fit_the_checkpoint_are_refused() {
    let root = SharedDir::new("dcp-misfit");
    let dir = root.dir().join("ckpt");
    at(Layout::Fsdp, 2, &root, |rank| {
        save_as(Layout::Fsdp, &dir, rank)
    })
    .unwrap_or_else(|e| panic!("save: {e}"));
    type Misfit = (
        &'static str,
        fn(&mut dcp::StateDict) -> tp::Result<()>,
        &'static str,
    );
    let misfits: [Misfit; 3] = [
        (
            "another shape",
            |sd| {
                let t = tp::Tensor::zeros(&[5, 4], tp::DType::F64)?;
                sd.insert("model.0.weight".into(), StateValue::tensor(&t));
                Ok(())
            },
            "is saved as F64 of shape [6, 4]; the model's is F64 of shape [5, 4]",
        ),
        (
            "another dtype",
            |sd| {
                let t = tp::Tensor::zeros(&[6, 4], tp::DType::F32)?;
                sd.insert("model.0.weight".into(), StateValue::tensor(&t));
                Ok(())
            },
            "the model's is F32",
        ),
        (
            "a name the checkpoint lacks",
            |sd| {
                let t = tp::Tensor::zeros(&[2], tp::DType::F64)?;
                sd.insert("model.extra".into(), StateValue::tensor(&t));
                Ok(())
            },
            "no tensor \"model.extra\"",
        ),
    ];
    for (name, misfit, needle) in misfits {
        let r = at(Layout::Fsdp, 2, &root, |rank| {
            let m = build(Layout::Fsdp, 99)?;
            let mut sd = model_state(&*m, "model")?;
            misfit(&mut sd)?;
            match dcp::load(&mut sd, &dir, None) {
                Ok(()) => Err(format!("{name}: rank {rank} loaded it").into()),
                Err(e) if e.to_string().contains(needle) => Ok(()),
                Err(e) => Err(format!("{name}: rank {rank}'s error: {e}").into()),
            }
        });
        r.unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn random_state_and_data_position_resume() {
    let root = SharedDir::new("dcp-rng");
    let dir = root.dir().join("ckpt");
    let sampler = |world: usize, rank: usize| {
        tensorplay_distributed_nn::data::DistributedSampler::new(40, Some(world), Some(rank))
            .map(|s| s.seed(3))
    };
    at(Layout::Ddp, 2, &root, |rank| {
        tp::manual_seed(10 + rank as u64);
        let _ = tp::randn(&[3])?;
        let mut data = dcp::StateDict::new();
        // each rank took 6 of its indices: 12 of the epoch's 40
        data.insert(
            "sampler".into(),
            StateValue::value(&sampler(2, rank)?.state_dict(6))?,
        );
        dcp::save_state(&[("rng", &dcp::RandomState), ("data", &data)], &dir, None)?;
        let want = tp::randn(&[4])?.to_vec::<f32>()?;
        tp::manual_seed(99);
        dcp::load_state(
            &mut [("rng", &mut dcp::RandomState), ("data", &mut data)],
            &dir,
            None,
        )?;
        let got = tp::randn(&[4])?.to_vec::<f32>()?;
        if got != want {
            return Err(format!("rank {rank}: draws after the load {got:?}, want {want:?}").into());
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("world 2: {e}"));
    // three ranks resume the epoch where the two left it
    at(Layout::Ddp, 3, &root, |rank| {
        let mut data = dcp::StateDict::new();
        data.insert(
            "sampler".into(),
            StateValue::value(&sampler(3, rank)?.state_dict(0))?,
        );
        dcp::load_state(
            &mut [("rng", &mut dcp::RandomState), ("data", &mut data)],
            &dir,
            None,
        )?;
        let state: tensorplay_distributed_nn::data::SamplerState = data["sampler"].to()?;
        let mut s = sampler(3, rank)?;
        s.load_state_dict(&state)?;
        if state.position != 12 || s.num_samples() != 10 {
            return Err(format!(
                "rank {rank}: position {}, {} samples left",
                state.position,
                s.num_samples()
            )
            .into());
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("world 3: {e}"));
}

#[test]
fn misuse_is_refused_on_every_rank_before_anything_is_written() {
    let root = SharedDir::new("dcp-misuse");
    let dir = root.dir().join("ckpt");
    at(Layout::Fsdp, 2, &root, |rank| {
        save_as(Layout::Fsdp, &dir, rank)
    })
    .unwrap_or_else(|e| panic!("save: {e}"));
    let r = at(Layout::Fsdp, 2, &root, |rank| {
        let m = build(Layout::Fsdp, SAVED)?;
        let sd = model_state(&*m, "model")?;
        // a name that is a shared value on rank 0 and a per-rank value on rank 1
        let mut odd = sd.clone();
        let v = serde_json::json!(1);
        odd.insert(
            "step".into(),
            if rank == 0 {
                StateValue::Value(v)
            } else {
                StateValue::RankValue(v)
            },
        );
        match dcp::save(&odd, &dir, None) {
            Err(e) if e.to_string().contains("the same names, of the same kinds") => {}
            other => return Err(format!("kinds differ: rank {rank}: {other:?}").into()),
        }
        // a save while an async save into the folder is in flight
        let handle = dcp::async_save(&sd, &dir, None)?;
        let second = dcp::save(&sd, &dir, None);
        handle.wait()?;
        match second {
            Err(e) if e.to_string().contains("still in flight") => {}
            other => return Err(format!("overlap: rank {rank}: {other:?}").into()),
        }
        // the optimizer asked for where none was saved: nothing changes, the model included
        let mut fresh = build(Layout::Fsdp, 99)?;
        let mut o = adamw(fresh.parameters())?;
        let mut app = AppState {
            model: &mut *fresh,
            optimizer: Some(&mut o),
        };
        match dcp::load_state(&mut [("model", &mut app)], &dir, None) {
            Err(e) if e.to_string().contains("no optimizer state") => {}
            other => return Err(format!("no optimizer: rank {rank}: {other:?}").into()),
        }
        same(
            &format!("rank {rank}: unchanged after the refused load"),
            &get_model_state_dict(&*fresh, full())?,
            &pair_from(99)?.state_dict()?,
        )?;
        // another optimizer than the saved one's: refused before the model is written
        let app_dir = dir.with_file_name("app");
        let mut m = build(Layout::Fsdp, SAVED)?;
        let mut o = adamw(m.parameters())?;
        let app = AppState {
            model: &mut *m,
            optimizer: Some(&mut o),
        };
        dcp::save_state(&[("app", &app)], &app_dir, None)?;
        let mut fresh = build(Layout::Fsdp, 99)?;
        let mut sgd = tp::optim::SGD::new(fresh.parameters(), Default::default())?;
        let mut app = AppState {
            model: &mut *fresh,
            optimizer: Some(&mut sgd),
        };
        match dcp::load_state(&mut [("app", &mut app)], &app_dir, None) {
            Err(e)
                if e.to_string()
                    .contains("the state of AdamW; the optimizer is SGD") => {}
            other => return Err(format!("another optimizer: rank {rank}: {other:?}").into()),
        }
        same(
            &format!("rank {rank}: unchanged after the refused optimizer"),
            &get_model_state_dict(&*fresh, full())?,
            &pair_from(99)?.state_dict()?,
        )?;
        Ok(())
    });
    r.unwrap_or_else(|e| panic!("{e}"));
}
