//! `--checkpoint-dir DIR --checkpoint-every K`: a run saves its model, its optimizer and its
//! progress (the step reached and the losses so far) with `tp::distributed::checkpoint` every
//! `K` steps, and a run started on a folder that holds a committed checkpoint continues from it,
//! at any world size and in any layout (the checkpoint reshards). The batches are a function of
//! the step (docs/models.md, "Batches"), so the step is the whole data position. A checkpoint
//! records `--seed`, `--steps` and `--dtype`; a run with others is refused (the batches, the
//! schedule or the precision would change mid-run).
//!
//! Fault injection for the resume tests: `TENSORPLAY_GPT_KILL_AT=<step>:<rank>` makes that rank
//! SIGKILL itself after that step (and its checkpoint, if one is due), in the first round of a
//! launcher only; `<step>:<rank>:node` SIGKILLs its parent process first (the node's
//! `tensorplay-run`, so an elastic job goes on without that node).

use std::path::PathBuf;

use tensorplay as tp;
use tp::distributed::checkpoint::{self as dcp, AppState, StateDict, StateValue};
use tp::nn::Module;
use tp::optim::AdamW;

use super::Res;

/// Where and how often a run checkpoints, and the run's settings a checkpoint must share to
/// be continued.
#[derive(Debug, Clone)]
pub(crate) struct Checkpointing {
    /// The folder holding the latest committed checkpoint (`metadata.json` commits it).
    pub(crate) dir: PathBuf,
    /// Steps between checkpoints.
    pub(crate) every: usize,
    /// `--seed`, `--steps` (the schedule's length) and `--dtype`, as a resumed run must repeat
    /// them.
    pub(crate) config: serde_json::Value,
}

/// The progress entries: `step` (steps done), `losses` (each step's loss, as the bits of the
/// float, so they come back exactly) and `config` (the run's settings).
fn progress(step: usize, losses: &[f64], config: &serde_json::Value) -> StateDict {
    let mut p = StateDict::new();
    p.insert("step".into(), StateValue::Value(serde_json::json!(step)));
    let bits: Vec<u64> = losses.iter().map(|l| l.to_bits()).collect();
    p.insert("losses".into(), StateValue::Value(serde_json::json!(bits)));
    p.insert("config".into(), StateValue::Value(config.clone()));
    p
}

impl Checkpointing {
    /// Loads the committed checkpoint in the folder into `model` and `opt` (collective) and
    /// returns `(steps done, their losses)`; `(0, [])` when the folder holds none.
    pub(crate) fn resume<M: Module + ?Sized>(
        &self,
        model: &mut M,
        opt: &mut AdamW,
    ) -> Res<(usize, Vec<f64>)> {
        if !self.dir.join("metadata.json").is_file() {
            return Ok((0, Vec::new()));
        }
        let mut app = AppState {
            model,
            optimizer: Some(opt),
        };
        let mut p = progress(0, &[], &serde_json::Value::Null);
        dcp::load_state(
            &mut [("app", &mut app), ("progress", &mut p)],
            &self.dir,
            None,
        )?;
        // every rank read the same values: every rank refuses alike
        let saved = p["config"].as_value().cloned().unwrap_or_default();
        if saved != self.config {
            return Err(format!(
                "the checkpoint in {} is of a run with {saved}; this run has {} (resume with the \
                 same --seed, --steps and --dtype, or use another folder)",
                self.dir.display(),
                self.config
            )
            .into());
        }
        let step: usize = p["step"].to()?;
        let bits: Vec<u64> = p["losses"].to()?;
        if bits.len() != step {
            return Err(format!(
                "the checkpoint in {} is at step {step} but holds {} losses",
                self.dir.display(),
                bits.len()
            )
            .into());
        }
        if tp::distributed::get_rank(None)? == 0 {
            eprintln!(
                "resumed from the checkpoint at step {step} in {}",
                self.dir.display()
            );
        }
        Ok((step, bits.into_iter().map(f64::from_bits).collect()))
    }

    /// After step `done` (counted from 1): a checkpoint when one is due (collective), then the
    /// fault injection.
    pub(crate) fn after_step<M: Module + ?Sized>(
        &self,
        done: usize,
        model: &mut M,
        opt: &mut AdamW,
        losses: &[f64],
        rank: usize,
    ) -> Res<()> {
        if done.is_multiple_of(self.every) {
            let app = AppState {
                model,
                optimizer: Some(opt),
            };
            dcp::save_state(
                &[
                    ("app", &app),
                    ("progress", &progress(done, losses, &self.config)),
                ],
                &self.dir,
                None,
            )?;
            if rank == 0 {
                eprintln!("checkpoint at step {done} in {}", self.dir.display());
            }
        }
        maybe_kill(done, rank);
        Ok(())
    }
}

/// `TENSORPLAY_GPT_KILL_AT` (see the module's docs).
fn maybe_kill(step: usize, rank: usize) {
    let Ok(spec) = std::env::var("TENSORPLAY_GPT_KILL_AT") else {
        return;
    };
    let first_round = std::env::var("TENSORPLAY_RESTART_COUNT").map_or(true, |c| c == "0");
    let here = format!("{step}:{rank}");
    let node = spec == format!("{here}:node");
    if !first_round || (spec != here && !node) {
        return;
    }
    let kill = |pid: u32| {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    };
    if node {
        eprintln!(
            "rank {rank}: killing my node's launcher after step {step} (TENSORPLAY_GPT_KILL_AT)"
        );
        kill(std::os::unix::process::parent_id());
    }
    eprintln!("rank {rank}: killing myself after step {step} (TENSORPLAY_GPT_KILL_AT)");
    kill(std::process::id());
    // not reached: the signal ends this process
    std::process::exit(137);
}
