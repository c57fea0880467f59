//! The parameter-server run (the second of three): two RPC workers, "trainer" and "ps".
//! The hidden layers live in a `RemoteModule` on "ps", the trainer holds the head;
//! distributed autograd carries the backward pass to "ps" and a `DistributedOptimizer`
//! updates the parameters on both.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tensorplay as tp;
use tensorplay_examples::resume::{self, Progress};
use tensorplay_examples::wine;
use tp::distributed::nn::{self as dnn, LayerSpec, LinearArgs, RemoteModule};
use tp::distributed::optim::{DistributedOptimizer, OptimizerKind};
use tp::distributed::{autograd as dist_autograd, rpc};
use tp::nn::{self, Module};
use tp::{Tensor, no_grad};
use wine::CLASSES;

use crate::args::Opts;
use crate::report::{Report, finished, record_done};
use crate::train::{adam, copy_linear, reference, train};
use crate::{BATCH, HIDDEN, Res, WORLD};

fn hidden_spec(f: usize) -> Vec<LayerSpec> {
    let lin = |i, o| {
        LayerSpec::Linear(LinearArgs {
            in_features: i,
            out_features: o,
            bias: true,
        })
    };
    vec![
        lin(f, HIDDEN),
        LayerSpec::ReLU,
        lin(HIDDEN, HIDDEN),
        LayerSpec::ReLU,
    ]
}

/// The commit file of the parameter-server run's checkpoint: `{"step": S}` names the files of
/// step S (the ps's layers and optimizer state, saved by the ps itself; the trainer's head,
/// optimizer state and progress).
fn ps_index(dir: &Path) -> PathBuf {
    dir.join("parameter-server.json")
}

fn ps_tag(step: usize) -> String {
    format!("parameter-server.step{step}")
}

pub(crate) fn parameter_server(rank: usize, init: &str, o: &Opts) -> Res<Report> {
    const RUN: &str = "parameter-server";
    if let Some(r) = finished(o, RUN, rank)? {
        return Ok(r);
    }
    dnn::register_module::<nn::Sequential>();
    rpc::register("bytes_sent", |(): ()| Ok(rpc::bytes_sent()?));
    // the ps builds the hidden layers from its own generator
    tp::manual_seed(o.seed + 1);
    let name = if rank == 0 { "trainer" } else { "ps" };
    rpc::init_rpc(
        name,
        rank,
        WORLD,
        rpc::RpcBackendOptions {
            init_method: init.to_string(),
            rpc_timeout: Duration::from_secs(120),
            ..Default::default()
        },
    )?;
    if rank != 0 {
        // the ps serves until the trainer is done
        rpc::shutdown(true)?;
        return Ok(Report::empty());
    }
    let (train_set, test, f) = wine::load()?;
    let batches = wine::batches(&train_set, f, BATCH)?;
    let hidden = RemoteModule::<nn::Sequential>::new("ps/cpu", hidden_spec(f))?;
    tp::manual_seed(o.seed);
    let mut head = nn::Linear::new(HIDDEN, CLASSES, true)?;
    // the reference: a copy of the remote layers' state and of the head
    let full = {
        let copy = hidden.get_module_rref().to_here(None)?;
        let state = copy.read().state_dict()?;
        let mut layers = <nn::Sequential as dnn::RemoteConstructible>::construct(&hidden_spec(f))?;
        {
            let _g = no_grad();
            let state = state
                .into_iter()
                .map(|(k, v)| Ok((k, v.detach().deep_clone()?)))
                .collect::<tp::Result<_>>()?;
            layers.load_state_dict(&state, true)?;
        }
        layers.push(Box::new(copy_linear(&head)?));
        layers
    };
    let mut params = hidden.remote_parameters(true)?;
    for p in head.parameters() {
        params.push(rpc::RRef::new(p)?);
    }
    let opt = DistributedOptimizer::new(OptimizerKind::Adam(adam()), &params)?;
    let mut start = Progress::default();
    if let Some(c) = &o.checkpoint
        && ps_index(&c.dir).is_file()
    {
        let index_path = ps_index(&c.dir);
        let step = std::fs::read(&index_path)
            .map_err(|e| e.to_string())
            .and_then(|b| {
                serde_json::from_slice::<serde_json::Value>(&b).map_err(|e| e.to_string())
            })
            .and_then(|v| v["step"].as_u64().ok_or_else(|| "no \"step\"".to_string()))
            .map_err(|e| format!("checkpoint {}: {e}", index_path.display()))?
            as usize;
        let tag = ps_tag(step);
        let dir = c.dir.display().to_string();
        // each owner loads its own part
        hidden.load_on_owner(&format!("{dir}/{tag}.ps-layers.safetensors"))?;
        opt.load_on_owners(&dir, &format!("{tag}.optim"))?;
        let file = c.dir.join(format!("{tag}.trainer.safetensors"));
        let (t, m) = tp::serialize::load_with_metadata(&file)?;
        let u = resume::unpack(t, &m, &file.display().to_string())?;
        head.load_state_dict(&u.model, true)?;
        start = u.progress;
    }
    let loss_fn = nn::CrossEntropyLoss::new();
    let p = train(
        o,
        RUN,
        rank,
        &batches,
        start,
        |x, y| {
            let ctx = dist_autograd::context()?;
            let h = hidden.forward(x)?;
            let loss = loss_fn.forward(&head.call(&h)?, y)?;
            let value = loss.item_f64()?;
            dist_autograd::backward(ctx.id(), &[loss], false)?;
            opt.step(ctx.id())?;
            Ok(value)
        },
        |p| {
            let Some(c) = &o.checkpoint else {
                return Ok(());
            };
            let tag = ps_tag(p.step);
            let dir = c.dir.display().to_string();
            // the owners save their own parameters and optimizer states, asked by RPC
            hidden.save_on_owner(&format!("{dir}/{tag}.ps-layers.safetensors"))?;
            opt.save_on_owners(&dir, &format!("{tag}.optim"))?;
            let (t, m) = resume::pack(&head.state_dict()?, None, p);
            tp::serialize::save_with_metadata(
                &t,
                &m,
                c.dir.join(format!("{tag}.trainer.safetensors")),
            )?;
            // the commit point, then the files of earlier steps go
            let index = serde_json::json!({ "step": p.step }).to_string();
            tp::serialize::write_atomically(ps_index(&c.dir), index.as_bytes())?;
            for e in std::fs::read_dir(&c.dir)?.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with("parameter-server.step") && !n.starts_with(&format!("{tag}.")) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
            Ok(())
        },
    )?;
    let accuracy = {
        let _g = no_grad();
        let h = hidden.forward(&Tensor::from_slice(&test.x, &[test.rows(), f])?)?;
        wine::accuracy(&head.call(&h)?, &test.y)?
    };
    let ps_bytes: u64 = rpc::rpc_sync("ps", "bytes_sent", (), None)?;
    let rpc_bytes = rpc::bytes_sent()? + ps_bytes;
    drop(opt);
    drop(hidden);
    rpc::shutdown(true)?;
    let reference = reference(&full, &batches, p.losses.len())?;
    let r = Report {
        accuracy,
        losses: p.losses,
        reference,
        epoch_losses: p.epoch_losses,
        wall: Duration::from_secs_f64(p.wall),
        collective_bytes: 0,
        rpc_bytes,
    };
    record_done(o, RUN, rank, &r)?;
    Ok(r)
}
