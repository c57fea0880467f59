//! The rounds of a job: the local group is started again after a failure while
//! `--max-restarts` allows it, on one node by itself ([`local`]) or, with several nodes, in
//! step with the other launchers through their rendezvous ([`with_launchers`]).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tensorplay_collectives::recorder;

use crate::elastic::{After, Event, Finish, Joined, Launchers};
use crate::group::{self, Failure, Outcome};

/// What every round runs, from the flags.
pub(crate) struct Job<'a> {
    /// The program and its arguments.
    pub(crate) command: &'a [String],
    /// `--nproc-per-node`.
    pub(crate) nproc: usize,
    /// `--kill-grace`.
    pub(crate) kill_grace: Duration,
    /// `--max-restarts`.
    pub(crate) max_restarts: usize,
    /// Set by the SIGINT/SIGTERM/SIGHUP handler.
    pub(crate) interrupted: &'a AtomicBool,
}

const INTERRUPTED: &str =
    "interrupted (SIGINT, SIGTERM or SIGHUP; forwarded to every rank as SIGINT)";

/// Where each round's flight recorders go.
///
/// `TENSORPLAY_FR_DIR` set: that folder with one round (as before restarts existed), else a
/// `round-<r>` folder in it per round, cleared before the round. Unset: the job's default
/// folder, named after the round's master address and port (so new per round), cleared
/// before the round and removed when the job succeeds.
struct Dumps {
    user: Option<PathBuf>,
    rounds: bool,
    defaults: Vec<PathBuf>,
}

impl Dumps {
    fn new(rounds: bool) -> Dumps {
        Dumps {
            user: std::env::var_os(recorder::FR_DIR_ENV).map(PathBuf::from),
            rounds,
            defaults: Vec::new(),
        }
    }

    /// The folder of round `r` and whether the children must be told it.
    fn round(&mut self, r: u64, addr: &str, port: u16) -> (PathBuf, bool) {
        match &self.user {
            Some(d) if !self.rounds => (d.clone(), false),
            Some(d) => {
                let d = d.join(format!("round-{r}"));
                let _ = std::fs::remove_dir_all(&d);
                (d, true)
            }
            None => {
                // the default folder is this job's: a stale one from an earlier job on the
                // same port goes
                let d = recorder::job_dump_dir(addr, &port.to_string());
                let _ = std::fs::remove_dir_all(&d);
                self.defaults.push(d.clone());
                (d, false)
            }
        }
    }

    /// A job that succeeded leaves no default folder behind.
    fn success(&self) {
        for d in &self.defaults {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// The error when the last allowed round failed: as before restarts existed with
/// `--max-restarts 0`, else with every failure listed.
fn exhausted(job: &Job<'_>, round: u64, f: &Failure, every: &[String]) -> String {
    if job.max_restarts == 0 && every.len() <= 1 {
        return f.report.clone();
    }
    format!(
        "round {round} failed and no restarts are left (--max-restarts {}): {}\nevery failure ({}):\n  {}",
        job.max_restarts,
        f.report,
        every.len(),
        every.join("\n  ")
    )
}

/// The rounds of a job on this node alone (or of one node of a job without restarts):
/// round 0 on `first_port`, each restart on a new free port.
///
/// # Errors
/// The report of the last failure (naming every failure when there were restarts), an
/// interrupt, or a rank that could not be started.
pub(crate) fn local(
    job: &Job<'_>,
    nnodes: usize,
    node_rank: usize,
    master_addr: &str,
    first_port: u16,
) -> Result<(), String> {
    let mut dumps = Dumps::new(job.max_restarts > 0);
    let mut every: Vec<String> = Vec::new();
    let mut restarts = 0usize;
    let mut round = 0u64;
    loop {
        if job.interrupted.load(Ordering::SeqCst) {
            return Err(INTERRUPTED.into());
        }
        // a new port each round: the last one may still be held (TIME_WAIT, a slow child)
        let port = if round == 0 {
            first_port
        } else {
            tensorplay_collectives::rendezvous::free_port()
                .map_err(|e| format!("finding a free port for round {round}: {e}"))?
        };
        let (fr_dir, set_fr_dir) = dumps.round(round, master_addr, port);
        let spec = group::Spec {
            command: job.command,
            nproc: job.nproc,
            node_rank,
            nnodes,
            master_addr,
            master_port: port,
            restarts,
            max_restarts: job.max_restarts,
            fr_dir: &fr_dir,
            set_fr_dir,
            kill_grace: job.kill_grace,
        };
        match group::run(&spec, job.interrupted, &mut || None::<()>)? {
            Outcome::Success => {
                dumps.success();
                return Ok(());
            }
            Outcome::Interrupted(m) => return Err(m),
            Outcome::Stopped(()) => return Err("stopped".into()),
            Outcome::Failed(f) => {
                every.push(format!("round {round}: {}", f.summary));
                if restarts >= job.max_restarts {
                    return Err(exhausted(job, round, &f, &every));
                }
                restarts += 1;
                eprintln!(
                    "tensorplay-run: round {round} failed (restart {restarts} of {}): {}",
                    job.max_restarts, f.report
                );
                round += 1;
            }
        }
    }
}

/// The rounds of one node of a job whose launchers meet in their own rendezvous (several
/// nodes with restarts, or elastic).
///
/// # Errors
/// As [`local`], plus a rendezvous that fails (too few nodes within `--rdzv-timeout`, a store
/// that stops answering) and a job that failed on another node.
pub(crate) fn with_launchers(job: &Job<'_>, mut l: Launchers) -> Result<(), String> {
    eprintln!(
        "tensorplay-run: {} the launchers' rendezvous at {}{}",
        if l.host { "hosting" } else { "joined" },
        l.endpoint(),
        if l.host {
            " (this launcher must stay alive until the job ends)"
        } else {
            ""
        }
    );
    l.start()?;
    let mut dumps = Dumps::new(true);
    let mut own: Vec<String> = Vec::new();
    let failed = |l: &Launchers, why: String, own: &[String]| {
        let mut every = l.every_failure();
        if every.is_empty() {
            every = own.to_vec();
        }
        if every.is_empty() {
            why
        } else {
            format!(
                "{why}\nevery failure ({}):\n  {}",
                every.len(),
                every.join("\n  ")
            )
        }
    };
    loop {
        let round = match l.await_close(job.interrupted) {
            Ok(Joined::Round(r)) => r,
            Ok(Joined::Interrupted) => {
                if !l.elastic() {
                    l.fail_job(
                        "a node was interrupted (Ctrl-C, SIGTERM or SIGHUP) while joining a round",
                    );
                }
                return Err(INTERRUPTED.into());
            }
            Ok(Joined::JobDone) => {
                eprintln!("tensorplay-run: the job ended before this node could join it");
                return Ok(());
            }
            Err(e) => return Err(failed(&l, e, &own)),
        };
        let first = round.node_rank * job.nproc;
        let ranks = match job.nproc {
            1 => format!("rank {first}"),
            n => format!("ranks {first}-{}", first + n - 1),
        };
        eprintln!(
            "tensorplay-run: round {}: node {} of {}, {ranks} of {}, master {}:{}, {} of --max-restarts {} made",
            round.round,
            round.node_rank,
            round.nnodes,
            round.nnodes * job.nproc,
            round.master_addr,
            round.master_port,
            round.restarts,
            job.max_restarts
        );
        let (fr_dir, set_fr_dir) = dumps.round(round.round, &round.master_addr, round.master_port);
        let spec = group::Spec {
            command: job.command,
            nproc: job.nproc,
            node_rank: round.node_rank,
            nnodes: round.nnodes,
            master_addr: &round.master_addr,
            master_port: round.master_port,
            restarts: round.restarts,
            max_restarts: job.max_restarts,
            fr_dir: &fr_dir,
            set_fr_dir,
            kill_grace: job.kill_grace,
        };
        let outcome = match group::run(&spec, job.interrupted, &mut || l.watch()) {
            Ok(o) => o,
            Err(e) => {
                l.fail_job(&format!("node {}: {e}", round.node_rank));
                return Err(e);
            }
        };
        match outcome {
            Outcome::Success => match l.finish().map_err(|e| failed(&l, e, &own))? {
                Finish::Done(note) => {
                    if let Some(n) = note {
                        eprintln!("tensorplay-run: {n}");
                    }
                    dumps.success();
                    return Ok(());
                }
                Finish::Rejoin(note) => eprintln!("tensorplay-run: {note}"),
            },
            Outcome::Interrupted(m) => {
                // without this node a fixed-size job cannot go on: the others stop too (an
                // elastic job goes on without it)
                if !l.elastic() {
                    l.fail_job(&format!(
                        "node {} was interrupted (Ctrl-C, SIGTERM or SIGHUP)",
                        round.node_rank
                    ));
                }
                return Err(m);
            }
            Outcome::Stopped(Event::NewRound(note)) => eprintln!("tensorplay-run: {note}"),
            Outcome::Stopped(Event::JobFailed(why)) => {
                return Err(failed(
                    &l,
                    format!("{why}; this node's ranks were stopped"),
                    &own,
                ));
            }
            Outcome::Failed(f) => {
                own.push(format!(
                    "round {}, node {}: {}",
                    round.round, round.node_rank, f.summary
                ));
                match l.after_failure(&f.summary) {
                    Ok(After::Next(true, k, by)) => eprintln!(
                        "tensorplay-run: round {} failed (restart {k} of {}{}): {}",
                        round.round,
                        job.max_restarts,
                        if by.starts_with(&format!("node {} ", round.node_rank)) {
                            String::new()
                        } else {
                            format!(", started by {by}")
                        },
                        f.report
                    ),
                    Ok(After::Next(false, _, by)) => eprintln!(
                        "tensorplay-run: round {} failed while {by} opened the next round for a joining node (not counted as a restart): {}",
                        round.round, f.report
                    ),
                    Ok(After::Exhausted) => {
                        let every = l.every_failure();
                        let every = if every.is_empty() { own } else { every };
                        return Err(exhausted(job, round.round, &f, &every));
                    }
                    Err(e) => return Err(failed(&l, format!("{}\n{e}", f.report), &own)),
                }
            }
        }
    }
}
