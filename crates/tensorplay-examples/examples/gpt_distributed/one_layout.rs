//! `--layout L`: one run of one layout (data-parallel, fully-sharded or tensor-parallel) at
//! `--world N` ranks (under a launcher, its `WORLD_SIZE`), without the single-process
//! reference; with `--checkpoint-dir` it checkpoints and resumes ([`Checkpointing`]), so a job
//! killed at one world size continues at another. Rank 0 prints
//! `<layout> at <N> ranks: validation loss V` (`1 rank`) and, with `--losses-out FILE`, writes the run's
//! losses there as JSON (`{"layout", "world", "losses", "val_loss"}`: every step's training loss,
//! those before a resume included).

use std::time::Duration;

use tensorplay as tp;
use tp::distributed as dist;

use tensorplay_examples::launch;

use super::args::{Layout, Opts};
use super::checkpointing::Checkpointing;
use super::runs::{self, Report};
use super::{BATCH, Corpus, Res};

/// The number of ranks: `--world`, else a launcher's `WORLD_SIZE`, else 2.
fn world_size(o: &Opts) -> Res<usize> {
    if let Some(w) = o.world {
        return Ok(w);
    }
    match dist::launch_env::lookup_env("WORLD_SIZE") {
        Some(w) => Ok(w
            .value
            .parse()
            .map_err(|e| format!("bad WORLD_SIZE {:?}: {e}", w.value))?),
        None => Ok(2),
    }
}

/// Whether `layout` can run at `world` ranks: data parallelism splits the batch's 16 rows,
/// tensor parallelism the 4 heads.
fn check_world(layout: Layout, world: usize) -> Res<()> {
    let (what, n) = match layout {
        Layout::DataParallel | Layout::FullySharded => ("the batch's rows", BATCH),
        Layout::TensorParallel => ("the attention heads", 4),
    };
    if world == 0 || !n.is_multiple_of(world) {
        return Err(format!(
            "{} runs at a world size that divides {what} ({n}), got {world}",
            layout.name()
        )
        .into());
    }
    Ok(())
}

/// The job of `--layout`: returns whether it passed (it has no checks to fail).
pub(crate) fn run(o: &Opts, layout: Layout, corpus: &Corpus) -> Res<bool> {
    let world = world_size(o)?;
    check_world(layout, world)?;
    let (rank, init_method, children) = launch::launch(world)?;
    // the ranks share the machine: one thread each (one process alone: the default rule)
    tp::set_num_threads(if world == 1 {
        o.threads.map_or(0, usize::from)
    } else {
        1
    });
    let ckpt = o.checkpoint_dir.as_ref().map(|dir| Checkpointing {
        dir: dir.clone(),
        every: o.checkpoint_every,
        config: serde_json::json!({
            "seed": o.seed,
            "steps": o.steps,
            "dtype": o.dtype.to_string(),
        }),
    });
    let report = (|| -> Res<Report> {
        dist::init_process_group(
            "cpu",
            dist::InitOptions {
                init_method,
                rank: Some(rank),
                world_size: Some(world),
                timeout: Duration::from_secs(300),
            },
        )?;
        let c = ckpt.as_ref();
        let r = match layout {
            Layout::DataParallel => runs::data_parallel((rank, world), o, corpus, c)?,
            Layout::FullySharded => runs::fully_sharded((rank, world), o, corpus, c)?,
            Layout::TensorParallel => runs::tensor_parallel(rank, o, corpus, c)?,
        };
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(r)
    })();
    let report = launch::join(children, report)?;
    if rank != 0 {
        return Ok(true);
    }
    println!(
        "{} at {world} rank{}: validation loss {:.4}",
        layout.name(),
        if world == 1 { "" } else { "s" },
        report.val_loss
    );
    if let Some(path) = &o.losses_out {
        let json = serde_json::json!({
            "layout": layout.name(),
            "world": world,
            "losses": report.losses,
            "val_loss": report.val_loss,
        });
        std::fs::write(path, json.to_string())
            .map_err(|e| format!("writing the losses to {}: {e}", path.display()))?;
    }
    Ok(true)
}
