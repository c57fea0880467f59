//! `checkpoint::state_dict` across real processes (worlds 2 and 3, dimensions 0 of 7 and 3
//! rows that 3 does not divide): the whole state dict of a fully sharded model against one
//! process's, bit for bit; whole and sharded dicts set into fresh models; the same keys for
//! plain, DDP, tensor-parallel and fully sharded models; the optimizer's state by name against
//! one process's, and resumed runs (from state dicts and from `save_sharded`) against
//! uninterrupted ones, bit for bit; bad input refused on every rank.

use std::collections::BTreeMap;
use std::time::Duration;

use tensorplay_collectives::device_mesh::DeviceMesh;
use tensorplay_collectives::{self as dist};
use tensorplay_core::nn::{Linear, Module, ModuleFields, Sequential, Tanh};
use tensorplay_core::optim::{AdamW, AdamWOptions, Optimizer};
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::checkpoint::state_dict::{
    OptimizerStateDict, StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    model_state_dict_placements, set_model_state_dict, set_optimizer_state_dict,
};
use tensorplay_distributed_nn::checkpoint::{load_sharded, save_sharded};
use tensorplay_distributed_nn::parallel::DistributedDataParallel;
use tensorplay_distributed_nn::parallel::fsdp::{FsdpOptions, fully_shard, shard_placement};
use tensorplay_distributed_nn::parallel::tensor::{
    ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module,
};
use tensorplay_testkit::{TempDir, Tol, check_close, cpu_world};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;
type Dict = BTreeMap<String, Tensor>;

const TIMEOUT: Duration = Duration::from_secs(60);
/// Rows of the whole batch (2 and 3 divide it).
const BATCH: usize = 12;
const WORLDS: [usize; 2] = [2, 3];

/// Linear 5 -> 7 -> 6 -> 3 with Tanh between, float64, from `seed`: dimensions 0 of 7 and 3.
pub(super) fn mlp(seed: u64) -> tp::Result<Sequential> {
    tp::manual_seed(seed);
    let dims = [5, 7, 6, 3];
    let mut m = Sequential::new();
    for (k, w) in dims.windows(2).enumerate() {
        let l = Linear::new(w[0], w[1], true)?;
        let leaf = |t: &Tensor| -> tp::Result<Tensor> {
            Ok(t.detach()
                .to_dtype(DType::F64)?
                .deep_clone()?
                .requires_grad_(true))
        };
        let b = l.bias.as_ref().map(leaf).transpose()?;
        m = m.add(Linear::from_weights(leaf(&l.weight)?, b)?);
        if k + 2 < dims.len() {
            m = m.add(Tanh::new());
        }
    }
    Ok(m)
}

/// Every layer fully sharded, then the root.
pub(super) fn sharded(seed: u64) -> tp::Result<Sequential> {
    let mut m = mlp(seed)?;
    for (_, child) in m.named_children_mut() {
        if !child.local_parameters().is_empty() {
            fully_shard(child, FsdpOptions::default())?;
        }
    }
    fully_shard(&mut m, FsdpOptions::default())?;
    Ok(m)
}

pub(super) fn adamw(params: Vec<Tensor>) -> tp::Result<AdamW> {
    AdamW::new(
        params,
        AdamWOptions {
            lr: 1e-2,
            weight_decay: 0.01,
            ..Default::default()
        },
    )
}

/// Rows `from..from + n` of step `k`'s batch: `(input, target)`.
fn rows(k: usize, from: usize, n: usize) -> tp::Result<(Tensor, Tensor)> {
    let f = |i: usize, j: usize, s: f64| ((k * 17 + i * 13 + j * 7) as f64 * s).sin();
    let x: Vec<f64> = (from..from + n)
        .flat_map(|i| (0..5).map(move |j| f(i, j, 0.37)))
        .collect();
    let y: Vec<f64> = (from..from + n)
        .flat_map(|i| (0..3).map(move |j| f(i, j, 0.23)))
        .collect();
    Ok((Tensor::from_vec(x, &[n, 5])?, Tensor::from_vec(y, &[n, 3])?))
}

/// One AdamW step on this rank's rows of step `k`'s batch (`world` 1: the whole batch).
pub(super) fn step(
    m: &dyn Module,
    o: &mut AdamW,
    k: usize,
    rank: usize,
    world: usize,
) -> tp::Result<()> {
    let n = BATCH / world;
    let (x, y) = rows(k, rank * n, n)?;
    o.zero_grad()?;
    m.call(&x)?.sub(&y)?.pow_scalar(2.0)?.mean()?.backward()?;
    o.step()
}

/// `got` equals `want` bit for bit, key by key (shapes and values).
pub(super) fn same(what: &str, got: &Dict, want: &Dict) -> Result<(), String> {
    let keys = |d: &Dict| d.keys().cloned().collect::<Vec<_>>();
    if keys(got) != keys(want) {
        return Err(format!(
            "{what}: keys {:?}, want {:?}",
            keys(got),
            keys(want)
        ));
    }
    for (k, w) in want {
        let g = &got[k];
        let bits = |t: &Tensor| -> Result<Vec<u64>, String> {
            let v = t.to_vec_f64().map_err(|e| e.to_string())?;
            Ok(v.into_iter().map(f64::to_bits).collect())
        };
        if g.shape() != w.shape() || bits(g)? != bits(w)? {
            return Err(format!(
                "{what}: {k:?} differs: shape {:?} {:?}, want {:?} {:?}",
                g.shape(),
                g.to_vec_f64(),
                w.shape(),
                w.to_vec_f64()
            ));
        }
    }
    Ok(())
}

pub(super) fn full() -> StateDictOptions {
    StateDictOptions {
        full_state_dict: true,
        ..Default::default()
    }
}

/// The sharded dict `local` is this rank's rows of `whole`, as the placements say.
fn rows_of_whole(what: &str, m: &Sequential, local: &Dict, whole: &Dict) -> TestResult {
    let placements = model_state_dict_placements(m)?;
    for (k, t) in local {
        let p = &placements[k];
        let w = &whole[k];
        if p.global_shape != w.shape() || p.local_shape != t.shape() {
            return Err(format!("{what}: {k:?} placement {p:?} for local {:?}", t.shape()).into());
        }
        let want: Vec<f64> = match p.chunks.as_slice() {
            [] => Vec::new(),
            [c] => w.narrow(0, c.offsets[0], c.sizes[0])?.to_vec_f64()?,
            more => return Err(format!("{what}: {k:?} has {} chunks", more.len()).into()),
        };
        check_close(&format!("{what}: {k}"), &t.to_vec_f64()?, &want, Tol::EXACT)?;
    }
    Ok(())
}

#[test]
fn full_state_dict_is_the_single_process_one() {
    for world in WORLDS {
        cpu_world(world, TIMEOUT, |rank| -> TestResult {
            let what = format!("world {world}, rank {rank}");
            let m = sharded(7)?;
            let want = mlp(7)?.state_dict()?;
            same(&what, &get_model_state_dict(&m, full())?, &want)?;
            // the module's own state_dict is the local dict: shards, with their placement
            let local = get_model_state_dict(&m, StateDictOptions::default())?;
            same(
                &format!("{what}, module state_dict"),
                &m.state_dict()?,
                &local,
            )?;
            rows_of_whole(&what, &m, &local, &want)?;
            let (_, w0) = &m.named_parameters()[0];
            let p = shard_placement(w0)?.ok_or("0.weight is no shard")?;
            let chunk = 7usize.div_ceil(world);
            if p.chunks[0].offsets != [rank * chunk, 0] || p.mesh_size != world {
                return Err(format!("{what}: 0.weight placement {p:?}").into());
            }
            // cpu_offload: rank 0 alone holds the whole dict
            let opts = StateDictOptions {
                cpu_offload: true,
                ..full()
            };
            let got = get_model_state_dict(&m, opts)?;
            let empty = Dict::new();
            same(&what, &got, if rank == 0 { &want } else { &empty })?;
            Ok(())
        });
    }
}

#[test]
fn set_gives_the_shards_of_the_saved_model() {
    // (case, full_state_dict, broadcast_from_rank0)
    let cases = [
        ("sharded round trip", false, false),
        ("whole dict on every rank", true, false),
        ("whole dict on rank 0, broadcast", true, true),
    ];
    for world in WORLDS {
        cpu_world(world, TIMEOUT, |rank| -> TestResult {
            for (case, full_sd, bcast) in cases {
                let what = format!("{case}: world {world}, rank {rank}");
                let saved = sharded(7)?;
                let opts = StateDictOptions {
                    full_state_dict: full_sd,
                    broadcast_from_rank0: bcast,
                    ..Default::default()
                };
                let mut dict = get_model_state_dict(&saved, opts)?;
                if bcast && rank != 0 {
                    dict.clear();
                }
                let mut fresh = sharded(99)?;
                set_model_state_dict(&mut fresh, &dict, opts)?;
                same(&what, &fresh.state_dict()?, &saved.state_dict()?)?;
                // and the gathered weights compute what the saved model computes
                let x = rows(0, 0, 4)?.0;
                let (a, b) = (fresh.call(&x)?, saved.call(&x)?);
                check_close(&what, &a.to_vec_f64()?, &b.to_vec_f64()?, Tol::EXACT)?;
            }
            Ok(())
        });
    }
}

#[test]
fn one_process_without_a_group() -> TestResult {
    // every option works without a process group: the whole model is local
    let m = mlp(7)?;
    let mut o = adamw(m.parameters())?;
    step(&m, &mut o, 0, 0, 1)?;
    let opts = [
        StateDictOptions::default(),
        StateDictOptions {
            cpu_offload: true,
            broadcast_from_rank0: true,
            ..full()
        },
    ];
    for opts in opts {
        let what = format!("{opts:?}");
        let sd = get_model_state_dict(&m, opts)?;
        same(&what, &sd, &m.state_dict()?)?;
        let osd = get_optimizer_state_dict(&m, &o, opts)?;
        let mut fresh = mlp(99)?;
        let mut fo = adamw(fresh.parameters())?;
        set_model_state_dict(&mut fresh, &sd, opts)?;
        set_optimizer_state_dict(&fresh, &mut fo, &osd, opts)?;
        step(&m, &mut o, 1, 0, 1)?;
        step(&fresh, &mut fo, 1, 0, 1)?;
        same(&what, &fresh.state_dict()?, &m.state_dict()?)?;
    }
    Ok(())
}

/// Linear 4 -> 6 -> 4 with Tanh, float64: 6 divides by 2 and 3, for tensor parallelism.
fn pair() -> tp::Result<Sequential> {
    pair_from(11)
}

/// [`pair`]'s model drawn from `seed`.
pub(super) fn pair_from(seed: u64) -> tp::Result<Sequential> {
    tp::manual_seed(seed);
    let leaf = |t: &Tensor| -> tp::Result<Tensor> {
        Ok(t.detach()
            .to_dtype(DType::F64)?
            .deep_clone()?
            .requires_grad_(true))
    };
    let mut s = Sequential::new();
    for (i, o) in [(4, 6), (6, 4)] {
        let l = Linear::new(i, o, true)?;
        let b = l.bias.as_ref().map(leaf).transpose()?;
        s = s.add(Linear::from_weights(leaf(&l.weight)?, b)?);
        if i == 4 {
            s = s.add(Tanh::new());
        }
    }
    Ok(s)
}

#[test]
fn keys_are_the_same_for_every_layout() {
    for world in WORLDS {
        cpu_world(world, TIMEOUT, |rank| -> TestResult {
            let what = format!("world {world}, rank {rank}");
            let want = pair()?.state_dict()?;
            let keys: Vec<String> = want.keys().cloned().collect();
            let ddp = DistributedDataParallel::new(pair()?)?;
            let mut tpm = pair()?;
            let mesh = DeviceMesh::from_group(&dist::default_group("test")?, "tp")?;
            let (col, row) = (ColwiseParallel::new(), RowwiseParallel::new());
            let plan: Vec<(&str, &dyn ParallelStyle)> = vec![("0", &col), ("2", &row)];
            parallelize_module(&mut tpm, &mesh, &plan)?;
            let mut fsdp = pair()?;
            fully_shard(&mut fsdp, FsdpOptions::default())?;
            let plain = pair()?;
            let layouts: [(&str, &dyn Module); 4] = [
                ("plain", &plain),
                ("DDP", &ddp),
                ("TP", &tpm),
                ("FSDP", &fsdp),
            ];
            for (name, m) in layouts {
                let local = get_model_state_dict(m, StateDictOptions::default())?;
                let got: Vec<String> = local.keys().cloned().collect();
                if got != keys {
                    return Err(format!("{what}: {name} keys {got:?}, want {keys:?}").into());
                }
                // the whole tensors too, gathered from the tensor-parallel pieces
                same(
                    &format!("{what}: {name}"),
                    &get_model_state_dict(m, full())?,
                    &want,
                )?;
            }
            let in_order: Vec<String> = plain
                .named_parameters()
                .into_iter()
                .map(|(n, _)| n)
                .collect();
            // the optimizer's state is keyed by the same names (the Partial bias of a
            // row-parallel layer has state on rank 0 only, so the TP model is left out)
            let layouts: [(&str, &dyn Module); 3] =
                [("plain", &plain), ("DDP", &ddp), ("FSDP", &fsdp)];
            for (name, m) in layouts {
                let mut o = adamw(m.parameters())?;
                let x = Tensor::from_vec((0..12).map(|i| f64::from(i) * 0.1).collect(), &[3, 4])?;
                m.call(&x)?.pow_scalar(2.0)?.mean()?.backward()?;
                o.step()?;
                let s = get_optimizer_state_dict(m, &o, StateDictOptions::default())?;
                let got: Vec<String> = s.state.keys().cloned().collect();
                if got != keys || s.param_groups[0].params != in_order {
                    return Err(format!(
                        "{what}: {name} optimizer keys {got:?}, groups {:?}",
                        s.param_groups[0].params
                    )
                    .into());
                }
            }
            // a whole dict sets the tensor-parallel pieces
            let mut fresh = pair()?;
            parallelize_module(&mut fresh, &mesh, &plan)?;
            let zeros: Dict = want
                .iter()
                .map(|(k, t)| Ok((k.clone(), t.zeros_like()?)))
                .collect::<tp::Result<_>>()?;
            set_model_state_dict(&mut fresh, &zeros, full())?;
            set_model_state_dict(&mut fresh, &want, full())?;
            same(&what, &fresh.state_dict()?, &tpm.state_dict()?)?;
            Ok(())
        });
    }
}

#[test]
fn optimizer_state_by_name_is_the_single_process_one() {
    const STEPS: usize = 3;
    for world in WORLDS {
        cpu_world(world, TIMEOUT, |rank| -> TestResult {
            let what = format!("world {world}, rank {rank}");
            let m = sharded(7)?;
            let mut o = adamw(m.parameters())?;
            let reference = mlp(7)?;
            let mut ro = adamw(reference.parameters())?;
            for k in 0..STEPS {
                step(&m, &mut o, k, rank, world)?;
                step(&reference, &mut ro, k, 0, 1)?;
            }
            let got = get_optimizer_state_dict(&m, &o, full())?;
            let rs = ro.state_dict()?;
            let names: Vec<String> = reference
                .named_parameters()
                .into_iter()
                .map(|(n, _)| n)
                .collect();
            if got.state.len() != names.len() {
                return Err(format!("{what}: state for {:?}", got.state.keys()).into());
            }
            for (i, n) in names.iter().enumerate() {
                for (k, want) in &rs.state[&i] {
                    let g = &got.state[n][k];
                    if g.shape() != want.shape() {
                        return Err(format!("{what}: {n}.{k} shape {:?}", g.shape()).into());
                    }
                    let tol = Tol::scaled(1e-12);
                    check_close(
                        &format!("{what}: {n}.{k}"),
                        &g.to_vec_f64()?,
                        &want.to_vec_f64()?,
                        tol,
                    )?;
                }
            }
            if got.param_groups[0].params != names {
                return Err(format!("{what}: groups {:?}", got.param_groups).into());
            }
            // whole model and optimizer state into fresh ones: one more step as uninterrupted
            let model_sd = get_model_state_dict(&m, full())?;
            let mut fresh = sharded(99)?;
            let mut fo = adamw(fresh.parameters())?;
            set_model_state_dict(&mut fresh, &model_sd, full())?;
            // rank 0 alone holds the optimizer's whole state: the others receive it
            let bcast = StateDictOptions {
                broadcast_from_rank0: true,
                ..full()
            };
            let given = if rank == 0 {
                got.clone()
            } else {
                OptimizerStateDict {
                    kind: String::new(),
                    state: BTreeMap::new(),
                    param_groups: Vec::new(),
                }
            };
            set_optimizer_state_dict(&fresh, &mut fo, &given, bcast)?;
            step(&m, &mut o, STEPS, rank, world)?;
            step(&fresh, &mut fo, STEPS, rank, world)?;
            same(&what, &fresh.state_dict()?, &m.state_dict()?)?;
            let (a, b) = (
                get_optimizer_state_dict(&fresh, &fo, StateDictOptions::default())?,
                get_optimizer_state_dict(&m, &o, StateDictOptions::default())?,
            );
            for (n, s) in &b.state {
                same(&format!("{what}: optimizer {n}"), &a.state[n], s)?;
            }
            Ok(())
        });
    }
}

#[test]
fn sharded_checkpoint_resumes_bit_identically() {
    for world in WORLDS {
        cpu_world(world, TIMEOUT, |rank| -> TestResult {
            let what = format!("world {world}, rank {rank}");
            let dir = TempDir::new("state-dict-resume");
            let dir = dir.dir().to_path_buf();
            // every rank uses rank 0's folder
            let dir: Vec<std::path::PathBuf> = dist::all_gather_object(&dir, None)?;
            let dir = &dir[0];
            let m = sharded(7)?;
            let mut o = adamw(m.parameters())?;
            for k in 0..2 {
                step(&m, &mut o, k, rank, world)?;
            }
            let local = StateDictOptions::default();
            let none = BTreeMap::new();
            save_sharded(
                dir,
                "model",
                2,
                &get_model_state_dict(&m, local)?,
                &none,
                None,
            )?;
            let (t, meta) = get_optimizer_state_dict(&m, &o, local)?.to_tensors();
            save_sharded(dir, "optim", 2, &t, &meta, None)?;
            for k in 2..4 {
                step(&m, &mut o, k, rank, world)?;
            }
            // a new run from the checkpoint
            let mut r = sharded(99)?;
            let mut ro = adamw(r.parameters())?;
            let ms = load_sharded(dir, "model", None)?;
            set_model_state_dict(&mut r, &ms.tensors, local)?;
            let os = load_sharded(dir, "optim", None)?;
            let os = OptimizerStateDict::from_tensors(&os.tensors, &os.metadata)?;
            set_optimizer_state_dict(&r, &mut ro, &os, local)?;
            for k in ms.step as usize..4 {
                step(&r, &mut ro, k, rank, world)?;
            }
            same(&what, &r.state_dict()?, &m.state_dict()?)?;
            // all done before rank 0's folder goes
            dist::barrier(None)?;
            Ok(())
        });
    }
}

/// One bad input: what the ranks pass, and a piece of every rank's error.
struct Bad {
    name: &'static str,
    full_state_dict: bool,
    broadcast: bool,
    /// Changes rank `rank`'s (whole or local) dict.
    spoil: fn(&mut Dict, usize),
    /// In every rank's error.
    says: &'static str,
}

const BAD: &[Bad] = &[
    Bad {
        name: "a key missing on rank 1",
        full_state_dict: false,
        broadcast: false,
        spoil: |d, r| {
            if r == 1 {
                d.remove("2.bias");
            }
        },
        says: "2.bias",
    },
    Bad {
        name: "an extra key",
        full_state_dict: false,
        broadcast: false,
        spoil: |d, _| {
            d.insert("9.weight".into(), Tensor::zeros(&[1], DType::F64).unwrap());
        },
        says: "9.weight",
    },
    Bad {
        name: "a wrong shape on the last rank",
        full_state_dict: true,
        broadcast: false,
        spoil: |d, r| {
            if r + 1 == dist::get_world_size(None).unwrap_or(1) {
                d.insert(
                    "0.weight".into(),
                    Tensor::zeros(&[7, 4], DType::F64).unwrap(),
                );
            }
        },
        says: "0.weight",
    },
    Bad {
        name: "whole tensors where shards are expected",
        full_state_dict: false,
        broadcast: false,
        spoil: |d, _| *d = mlp(7).unwrap().state_dict().unwrap(),
        says: "whole tensor",
    },
    Bad {
        name: "shards where whole tensors are expected",
        full_state_dict: true,
        broadcast: false,
        spoil: |_, _| {},
        says: "shard",
    },
    Bad {
        name: "a missing key on rank 0, broadcast",
        full_state_dict: true,
        broadcast: true,
        spoil: |d, r| {
            if r == 0 {
                d.remove("4.weight");
            }
        },
        says: "4.weight",
    },
];

#[test]
fn bad_input_fails_on_every_rank() {
    for world in WORLDS {
        cpu_world(world, TIMEOUT, |rank| -> TestResult {
            for c in BAD {
                let what = format!("{}: world {world}, rank {rank}", c.name);
                let saved = sharded(7)?;
                // the dict each case spoils: local shards, or whole tensors when the case's
                // own spoiling does not replace it (the shards-for-whole case passes shards)
                let mut d = if c.full_state_dict && c.says != "shard" {
                    mlp(7)?.state_dict()?
                } else {
                    get_model_state_dict(&saved, StateDictOptions::default())?
                };
                (c.spoil)(&mut d, rank);
                let mut fresh = sharded(99)?;
                let before = fresh
                    .state_dict()?
                    .into_iter()
                    .map(|(k, t)| Ok((k, t.deep_clone()?)))
                    .collect::<tp::Result<Dict>>()?;
                let opts = StateDictOptions {
                    full_state_dict: c.full_state_dict,
                    broadcast_from_rank0: c.broadcast,
                    ..Default::default()
                };
                match set_model_state_dict(&mut fresh, &d, opts) {
                    Ok(()) => return Err(format!("{what}: accepted").into()),
                    Err(e) if !e.to_string().contains(c.says) => {
                        return Err(format!("{what}: error without {:?}: {e}", c.says).into());
                    }
                    Err(_) => {}
                }
                same(&format!("{what}: unchanged"), &fresh.state_dict()?, &before)?;
            }
            // the optimizer's state under a name the model lacks
            let m = sharded(7)?;
            let mut o = adamw(m.parameters())?;
            step(&m, &mut o, 0, rank, world)?;
            let mut s = get_optimizer_state_dict(&m, &o, StateDictOptions::default())?;
            if rank == 0 {
                let v = s.state.remove("0.weight").ok_or("no 0.weight state")?;
                s.state.insert("0.wieght".into(), v);
            }
            match set_optimizer_state_dict(&m, &mut o, &s, StateDictOptions::default()) {
                Err(e) if e.to_string().contains("0.wieght") => Ok(()),
                other => Err(format!("rank {rank}: renamed optimizer state: {other:?}").into()),
            }
        });
    }
}
