//! One world of processes: spawned by the parent, and each rank's work in it.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use tensorplay_collectives::{self as dist, InitOptions, SpawnOptions};
use tensorplay_core::Device;

use crate::RunOptions;
use crate::case::Case;
use crate::execute::run_case;
use crate::summary::{Outcome, result_line};

/// Environment variable telling a spawned child which world (size) it belongs to.
pub(crate) const WORLD_ENV: &str = "TENSORPLAY_CONFORMANCE_WORLD";
/// Environment variable naming the directory where children write their results.
pub(crate) const OUT_ENV: &str = "TENSORPLAY_CONFORMANCE_OUT";

/// Spawns (in the parent) or runs (in a child) the processes of world `w`.
pub(crate) fn run_world(
    cases: &[Case],
    w: usize,
    opts: &RunOptions,
    dir: &Path,
) -> dist::Result<()> {
    let mine: Vec<&Case> = cases
        .iter()
        .filter(|c| c.world == w && c.invalid.is_none())
        .collect();
    let spawn_opts = SpawnOptions {
        timeout: Some(opts.world_timeout),
        env: vec![
            (WORLD_ENV.into(), w.to_string()),
            (OUT_ENV.into(), dir.display().to_string()),
            // the children route themselves to their world's call (the first `spawn` they
            // reach, in `run_file`), so that call is theirs whichever world this is
            (dist::spawn::SPAWN_CALLS_ENV.into(), "0".into()),
        ],
        ..SpawnOptions::new(w)
    };
    dist::spawn_with(spawn_opts, |rank| Ok(worker(rank, w, &mine, opts)?))
}

/// One rank of world `w`: every case of the world, in order.
///
/// Started by [`run_file`]'s `spawn`, it writes its outcomes to the results folder for the
/// parent to summarize. Under `tensorplay-run` (`spawn` joined the launcher's job, possibly
/// across hosts, and there is no parent and no shared folder) it judges its own records
/// instead: it prints `conformance: rank R: N passed, M failed` and every failing record, and
/// fails (so its launcher exits non-zero) when any record failed.
pub(crate) fn worker(
    rank: usize,
    w: usize,
    cases: &[&Case],
    opts: &RunOptions,
) -> dist::Result<()> {
    let mut out: Box<dyn Write> = match std::env::var_os(OUT_ENV) {
        Some(dir) => Box::new(fs::File::create(
            PathBuf::from(dir).join(format!("world{w}-rank{rank}.jsonl")),
        )?),
        None => Box::new(std::io::sink()),
    };
    let joined = std::env::var_os(OUT_ENV).is_none();
    let (mut passed, mut failures) = (0usize, Vec::new());
    tensorplay_nccl::register();
    dist::init_process_group(
        &opts.backend,
        InitOptions {
            // generous for rendezvous and new_group, which may wait for a rank stuck in a
            // failed case's collective
            timeout: opts.timeout * 3,
            ..Default::default()
        },
    )?;
    let device = if opts.backend == "nccl" {
        Device::Cuda(rank % tensorplay_core::cuda::device_count().max(1))
    } else {
        Device::Cpu
    };
    for c in cases {
        // every rank of the world creates the case's group, members or not (as new_group
        // requires), so a failure in one case cannot leave the next out of step
        let group = dist::new_group(&c.members, None, Some(opts.timeout));
        let Some(rec) = c.records.iter().find(|r| r.rank == rank) else {
            continue;
        };
        let outcome = match group
            .map_err(|e| e.to_string())
            .and_then(|g| run_case(rec, &g, device, opts.dtype).map_err(|e| e.to_string()))
        {
            Ok(None) => Outcome::Pass,
            Ok(Some(d)) => Outcome::Differs(d),
            Err(e) => Outcome::Error(e.replace('\n', " ")),
        };
        writeln!(out, "{}", result_line(&c.label, rank, &outcome))?;
        out.flush()?;
        match &outcome {
            Outcome::Pass => passed += 1,
            Outcome::Differs(d) => failures.push(format!("FAIL {} rank {rank} {d}", c.label)),
            Outcome::Error(e) => failures.push(format!("FAIL {} rank {rank}: error: {e}", c.label)),
        }
    }
    // rank 0 hosts the store: nobody leaves while others may still need it
    dist::barrier(None)?;
    dist::destroy_process_group()?;
    if joined {
        println!(
            "conformance: rank {rank}: {passed} passed, {} failed",
            failures.len()
        );
        for f in &failures {
            println!("{f}");
        }
        // a rank outside every case's group has no records (rank 0 of a file about the
        // subgroup {1, 2}); one with records must have judged them all
        let records = cases
            .iter()
            .filter(|c| c.records.iter().any(|r| r.rank == rank))
            .count();
        if !failures.is_empty() || passed != records {
            return Err(dist::Error::Io(format!(
                "conformance: rank {rank}: {} of {records} records failed",
                records - passed
            )));
        }
    }
    Ok(())
}
