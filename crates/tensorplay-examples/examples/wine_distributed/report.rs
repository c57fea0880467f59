//! What a run reports, its record in the checkpoint folder (a finished run is not run again),
//! and the plot of the three runs.

use std::path::Path;
use std::time::Duration;

use tensorplay_examples::{plot, resume};

use crate::Res;
use crate::args::Opts;

/// What one run reports.
pub(crate) struct Report {
    pub(crate) accuracy: f64,
    /// The first [`COMPARE_STEPS`] steps' losses, checked against `reference`.
    pub(crate) losses: Vec<f64>,
    pub(crate) reference: Vec<f64>,
    /// The mean training loss of every epoch (the whole run, for the plot).
    pub(crate) epoch_losses: Vec<f64>,
    pub(crate) wall: Duration,
    pub(crate) collective_bytes: u64,
    pub(crate) rpc_bytes: u64,
}

impl Report {
    /// The report of a rank that only served (or whose run rank 0 reports).
    pub(crate) fn empty() -> Report {
        Report {
            accuracy: 0.0,
            losses: vec![],
            reference: vec![],
            epoch_losses: vec![],
            wall: Duration::ZERO,
            collective_bytes: 0,
            rpc_bytes: 0,
        }
    }
}

/// The report of `run` when a checkpoint says it finished (rank 0 reads it; the other ranks
/// only skip the run).
pub(crate) fn finished(o: &Opts, run: &str, rank: usize) -> Res<Option<Report>> {
    let Some(c) = &o.checkpoint else {
        return Ok(None);
    };
    if !resume::done_path(&c.dir, run).is_file() {
        return Ok(None);
    }
    if rank != 0 {
        return Ok(Some(Report::empty()));
    }
    let d = resume::load_done(&c.dir, run)?;
    eprintln!(
        "{run}: finished earlier; its results are read from {}",
        resume::done_path(&c.dir, run).display()
    );
    Ok(Some(Report {
        accuracy: d.accuracy,
        losses: d.losses,
        reference: d.reference,
        epoch_losses: d.epoch_losses,
        wall: Duration::from_secs_f64(d.wall),
        collective_bytes: d.collective_bytes,
        rpc_bytes: d.rpc_bytes,
    }))
}

/// Records that `run` finished with `r` (rank 0, with checkpoints on).
pub(crate) fn record_done(o: &Opts, run: &str, rank: usize, r: &Report) -> Res<()> {
    let (Some(c), 0) = (&o.checkpoint, rank) else {
        return Ok(());
    };
    resume::save_done(
        &c.dir,
        run,
        &resume::Done {
            accuracy: r.accuracy,
            losses: r.losses.clone(),
            reference: r.reference.clone(),
            epoch_losses: r.epoch_losses.clone(),
            wall: r.wall.as_secs_f64(),
            collective_bytes: r.collective_bytes,
            rpc_bytes: r.rpc_bytes,
        },
    )
}

/// Two panels (`common/plot.rs`): the first steps of each run over its single-process
/// reference (what the check compares), and the mean training loss of every epoch of the
/// whole run.
pub(crate) fn plot(path: &Path, runs: &[(&str, &Report)]) -> Res<()> {
    let steps = runs.iter().map(|(_, r)| r.losses.len()).max().unwrap_or(1);
    let epochs = runs
        .iter()
        .map(|(_, r)| r.epoch_losses.len())
        .max()
        .unwrap_or(1);
    let left = format!("first {steps} steps: distributed vs one process");
    let right = format!("all {epochs} epochs: mean training loss");
    let compared: Vec<plot::Compared<'_>> = runs
        .iter()
        .map(|(n, r)| (*n, r.reference.clone(), r.losses.clone()))
        .collect();
    let curves: Vec<plot::Curve<'_>> = runs
        .iter()
        .map(|(n, r)| {
            let points = r.epoch_losses.iter().enumerate();
            (*n, points.map(|(e, l)| (e + 1, *l)).collect())
        })
        .collect();
    plot::two_panels(
        path,
        plot::Panel {
            caption: &left,
            x_desc: "step",
            y_desc: "cross-entropy loss",
        },
        &compared,
        plot::Panel {
            caption: &right,
            x_desc: "epoch",
            y_desc: "mean cross-entropy loss",
        },
        &curves,
    )
}
