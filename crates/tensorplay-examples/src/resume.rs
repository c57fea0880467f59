//! Checkpoints of `wine_distributed`'s runs: a run's progress (the step reached, the losses so
//! far, the running epoch total, the wall time so far) with its model and optimizer state, and
//! the results of runs already finished, so that a job killed and restarted prints the same
//! result lines as one that was not.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tensorplay as tp;
use tp::Tensor;
use tp::optim::OptimizerState;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// `--checkpoint-dir DIR --checkpoint-every K`.
#[derive(Clone, Debug)]
pub struct Checkpoints {
    /// The folder the checkpoints are written to and read from.
    pub dir: PathBuf,
    /// Steps between checkpoints.
    pub every: usize,
}

/// Where a run stands.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// Steps done (over all epochs).
    pub step: usize,
    /// The losses of the first compared steps.
    pub losses: Vec<f64>,
    /// The mean loss of every finished epoch.
    pub epoch_losses: Vec<f64>,
    /// The current epoch's sum of loss x rows so far.
    pub total: f64,
    /// Seconds of training before this process (the runs before a restart).
    pub wall: f64,
}

/// Floats as text that parses back to the same bits (Rust prints the shortest such form).
fn floats(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:?}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn parse_floats(s: &str) -> Res<Vec<f64>> {
    if s.is_empty() {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(|x| {
            x.parse::<f64>()
                .map_err(|e| format!("bad float {x:?}: {e}").into())
        })
        .collect()
}

fn get<'a>(m: &'a BTreeMap<String, String>, k: &str) -> Res<&'a str> {
    m.get(k)
        .map(String::as_str)
        .ok_or_else(|| format!("checkpoint lacks `{k}`").into())
}

impl Progress {
    fn to_metadata(&self, m: &mut BTreeMap<String, String>) {
        m.insert("progress.step".into(), self.step.to_string());
        m.insert("progress.losses".into(), floats(&self.losses));
        m.insert("progress.epoch_losses".into(), floats(&self.epoch_losses));
        m.insert("progress.total".into(), format!("{:?}", self.total));
        m.insert("progress.wall".into(), format!("{:?}", self.wall));
    }

    fn from_metadata(m: &BTreeMap<String, String>) -> Res<Progress> {
        Ok(Progress {
            step: get(m, "progress.step")?.parse()?,
            losses: parse_floats(get(m, "progress.losses")?)?,
            epoch_losses: parse_floats(get(m, "progress.epoch_losses")?)?,
            total: get(m, "progress.total")?.parse()?,
            wall: get(m, "progress.wall")?.parse()?,
        })
    }
}

/// One file's tensors and header: a model's `state_dict` (keys `model.*`), an optimizer's
/// state (`optim.*`) and the progress.
pub fn pack(
    model: &BTreeMap<String, Tensor>,
    opt: Option<&OptimizerState>,
    p: &Progress,
) -> (BTreeMap<String, Tensor>, BTreeMap<String, String>) {
    let mut t: BTreeMap<String, Tensor> = model
        .iter()
        .map(|(k, v)| (format!("model.{k}"), v.clone()))
        .collect();
    let mut m = BTreeMap::new();
    if let Some(o) = opt {
        let (ot, om) = o.to_tensors();
        t.extend(ot.into_iter().map(|(k, v)| (format!("optim.{k}"), v)));
        m.extend(om.into_iter().map(|(k, v)| (format!("optim.{k}"), v)));
    }
    p.to_metadata(&mut m);
    (t, m)
}

/// What [`pack`] packed.
pub struct Unpacked {
    /// The model's state dict.
    pub model: BTreeMap<String, Tensor>,
    /// The optimizer's state, where the run has one on this rank.
    pub opt: Option<OptimizerState>,
    /// How far the run had come.
    pub progress: Progress,
}

/// What [`pack`] packed into `file` (named in the errors).
pub fn unpack(
    t: BTreeMap<String, Tensor>,
    m: &BTreeMap<String, String>,
    file: &str,
) -> Res<Unpacked> {
    unpack_inner(t, m).map_err(|e| format!("checkpoint {file}: {e}").into())
}

fn unpack_inner(t: BTreeMap<String, Tensor>, m: &BTreeMap<String, String>) -> Res<Unpacked> {
    let mut model = BTreeMap::new();
    let mut ot = BTreeMap::new();
    for (k, v) in t {
        if let Some(k) = k.strip_prefix("model.") {
            model.insert(k.to_string(), v);
        } else if let Some(k) = k.strip_prefix("optim.") {
            ot.insert(k.to_string(), v);
        }
    }
    let om: BTreeMap<String, String> = m
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("optim.")?.to_string(), v.clone())))
        .collect();
    let opt = if om.is_empty() {
        None
    } else {
        Some(OptimizerState::from_tensors(ot, &om)?)
    };
    Ok(Unpacked {
        model,
        opt,
        progress: Progress::from_metadata(m)?,
    })
}

/// Copies `values` into `params` in place (no autograd), by position; shapes must agree.
pub fn restore(params: &[Tensor], values: &[&Tensor]) -> Res<()> {
    if params.len() != values.len() {
        return Err(format!(
            "checkpoint has {} tensors, the model {}",
            values.len(),
            params.len()
        )
        .into());
    }
    let _g = tp::no_grad();
    for (p, v) in params.iter().zip(values) {
        p.copy_(v)?;
    }
    Ok(())
}

/// The results of a finished run, kept so that a restarted job reports it without running it
/// again.
pub struct Done {
    /// Test accuracy, 0..=1.
    pub accuracy: f64,
    /// The first compared steps' losses.
    pub losses: Vec<f64>,
    /// The single-process reference's losses over the same steps.
    pub reference: Vec<f64>,
    /// Mean loss per epoch.
    pub epoch_losses: Vec<f64>,
    /// Wall time of the run, seconds.
    pub wall: f64,
    /// Bytes moved by collectives, this rank.
    pub collective_bytes: u64,
    /// Bytes moved by RPC, this rank.
    pub rpc_bytes: u64,
}

/// Where a finished run's results are kept: `DIR/RUN.done.safetensors`.
pub fn done_path(dir: &Path, run: &str) -> PathBuf {
    dir.join(format!("{run}.done.safetensors"))
}

/// Saves a finished run's results ([`done_path`]).
///
/// # Errors
/// The file cannot be written.
pub fn save_done(dir: &Path, run: &str, d: &Done) -> Res<()> {
    let t = BTreeMap::from([
        (
            "losses".to_string(),
            Tensor::from_slice(&d.losses, &[d.losses.len()])?,
        ),
        (
            "reference".to_string(),
            Tensor::from_slice(&d.reference, &[d.reference.len()])?,
        ),
        (
            "epoch_losses".to_string(),
            Tensor::from_slice(&d.epoch_losses, &[d.epoch_losses.len()])?,
        ),
    ]);
    let m = BTreeMap::from([
        ("accuracy".to_string(), format!("{:?}", d.accuracy)),
        ("wall".to_string(), format!("{:?}", d.wall)),
        (
            "collective_bytes".to_string(),
            d.collective_bytes.to_string(),
        ),
        ("rpc_bytes".to_string(), d.rpc_bytes.to_string()),
    ]);
    tp::serialize::save_with_metadata(&t, &m, done_path(dir, run))?;
    Ok(())
}

/// Loads a finished run's results saved by [`save_done`].
///
/// # Errors
/// The file is missing, unreadable, or lacks a field.
pub fn load_done(dir: &Path, run: &str) -> Res<Done> {
    let (t, m) = tp::serialize::load_with_metadata(done_path(dir, run))?;
    let v = |k: &str| -> Res<Vec<f64>> {
        Ok(t.get(k)
            .ok_or_else(|| format!("{run}.done lacks {k}"))?
            .to_vec::<f64>()?)
    };
    Ok(Done {
        accuracy: get(&m, "accuracy")?.parse()?,
        losses: v("losses")?,
        reference: v("reference")?,
        epoch_losses: v("epoch_losses")?,
        wall: get(&m, "wall")?.parse()?,
        collective_bytes: get(&m, "collective_bytes")?.parse()?,
        rpc_bytes: get(&m, "rpc_bytes")?.parse()?,
    })
}

/// Fault injection for the restart tests: `TENSORPLAY_WINE_KILL_AT=<run>:<step>:<rank>` makes
/// that rank SIGKILL itself after that step of that run, in the first round only
/// (`TENSORPLAY_RESTART_COUNT` unset or 0).
pub fn maybe_kill(run: &str, step: usize, rank: usize) {
    let Ok(spec) = std::env::var("TENSORPLAY_WINE_KILL_AT") else {
        return;
    };
    let first_round = std::env::var("TENSORPLAY_RESTART_COUNT").map_or(true, |c| c == "0");
    if first_round && spec == format!("{run}:{step}:{rank}") {
        eprintln!(
            "rank {rank}: killing myself after step {step} of {run} (TENSORPLAY_WINE_KILL_AT)"
        );
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &std::process::id().to_string()])
            .status();
        // not reached: the signal ends this process
        std::process::exit(137);
    }
}
