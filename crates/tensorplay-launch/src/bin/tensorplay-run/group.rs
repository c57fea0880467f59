//! One round of the local group: starts this node's `--nproc-per-node` children with their
//! environment, forwards their output (each line prefixed with `[rank N] `), watches them, and
//! returns how the round ended: success, a failure (with the blame report: the rank that failed
//! first, its last lines, the consequences, the flight recorder's diagnosis), an interrupt
//! (Ctrl-C, SIGTERM, SIGHUP: forwarded to the children as SIGINT), or a stop asked for from
//! outside (another launcher started a new round).
//!
//! When a child fails, the others get [`FAIL_GRACE`] to end on their own (to compare failure
//! reports and write their flight recorders), then SIGTERM, then SIGKILL after `--kill-grace`.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tensorplay_collectives::recorder;
use tensorplay_collectives::spawn::blame::{self, Ended, Exit};

/// The longest piece of a child's line forwarded at once (64 KiB).
const MAX_LINE: u64 = 64 * 1024;

/// How long the other ranks may take to end on their own after the first failure, before the
/// launcher stops them.
const FAIL_GRACE: Duration = Duration::from_secs(3);

/// How many of a child's last lines are kept for the failure report.
const KEEP_LINES: usize = 8;

/// How often the `watch` callback of [`run`] is asked whether to stop the round.
const WATCH_EVERY: Duration = Duration::from_millis(150);

/// A child's last lines (both streams), for the failure report.
type Tail = Arc<Mutex<VecDeque<String>>>;

/// What one round of the local group runs, and where.
pub(crate) struct Spec<'a> {
    /// The program and its arguments.
    pub(crate) command: &'a [String],
    /// Children on this node (`LOCAL_WORLD_SIZE`).
    pub(crate) nproc: usize,
    /// This node's rank in the round (`GROUP_RANK`).
    pub(crate) node_rank: usize,
    /// Nodes in the round (`WORLD_SIZE` = `nnodes` x `nproc`).
    pub(crate) nnodes: usize,
    /// The children's `MASTER_ADDR`.
    pub(crate) master_addr: &'a str,
    /// The children's `MASTER_PORT`.
    pub(crate) master_port: u16,
    /// Failure restarts made before this round (`TENSORPLAY_RESTART_COUNT`).
    pub(crate) restarts: usize,
    /// `--max-restarts` (`TORCHELASTIC_MAX_RESTARTS`).
    pub(crate) max_restarts: usize,
    /// Where the children write their flight recorders (read after a failure).
    pub(crate) fr_dir: &'a Path,
    /// Whether to give the children `TENSORPLAY_FR_DIR=fr_dir` (else they inherit the
    /// launcher's environment).
    pub(crate) set_fr_dir: bool,
    /// The time between SIGTERM and SIGKILL when children are stopped (`--kill-grace`).
    pub(crate) kill_grace: Duration,
}

/// A failed round.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    /// The full report (as the launcher printed it before restarts existed).
    pub(crate) report: String,
    /// One line: the root cause and its last output line.
    pub(crate) summary: String,
}

/// How a round of the local group ended.
#[derive(Debug)]
pub(crate) enum Outcome<E> {
    /// Every child exited with code 0.
    Success,
    /// A child failed (the others were stopped).
    Failed(Failure),
    /// Ctrl-C, SIGTERM or SIGHUP: the message for the user.
    Interrupted(String),
    /// `watch` asked to stop the round; the children were stopped.
    Stopped(E),
}

fn forward(
    rank: usize,
    from: impl Read + Send + 'static,
    to_stderr: bool,
    tail: Tail,
    done: std::sync::mpsc::Sender<()>,
) {
    std::thread::spawn(move || {
        let mut r = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            // the prefix and the line: one write, so that lines of the two streams and of
            // other ranks never interleave mid-line on a shared terminal or file
            line.clear();
            line.extend_from_slice(format!("[rank {rank}] ").as_bytes());
            // a line longer than MAX_LINE bytes is forwarded in pieces (memory stays bounded)
            match r.by_ref().take(MAX_LINE).read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    {
                        let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                        if t.len() == KEEP_LINES {
                            t.pop_front();
                        }
                        let prefix = format!("[rank {rank}] ").len();
                        t.push_back(
                            String::from_utf8_lossy(&line[prefix..])
                                .trim_end()
                                .to_string(),
                        );
                    }
                    let _ = if to_stderr {
                        let mut e = std::io::stderr().lock();
                        e.write_all(&line).and_then(|()| e.flush())
                    } else {
                        let mut o = std::io::stdout().lock();
                        o.write_all(&line).and_then(|()| o.flush())
                    };
                }
            }
        }
        let _ = done.send(());
    });
}

/// Sends `sig` to a child's process group: the child and whatever it started (a wrapper
/// script's program, its helpers), which would otherwise outlive a stopped round.
fn signal(child: &Child, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        signal_group(pid, sig);
    }
}

/// Sends `sig` to process group `pgid` (a child's, made with `process_group(0)`).
fn signal_group(pgid: libc::pid_t, sig: libc::c_int) {
    // SAFETY: kill(2) on the process group of a child we started; the group's id is not
    // reused while any of its processes lives, and the call fails harmlessly once none does.
    unsafe {
        libc::kill(-pgid, sig);
    }
}

/// Runs one round of the local group (see the module's docs). `watch` is called about every
/// 150 ms while no child has failed: when it returns `Some`, the children are stopped
/// (SIGTERM, then SIGKILL after `kill_grace`) and the round ends as [`Outcome::Stopped`].
///
/// # Errors
/// When a child cannot be started (the ones started are killed).
pub(crate) fn run<E>(
    spec: &Spec<'_>,
    interrupted: &AtomicBool,
    watch: &mut dyn FnMut() -> Option<E>,
) -> Result<Outcome<E>, String> {
    let world = spec.nnodes * spec.nproc;
    let base = spec.node_rank * spec.nproc;
    let mut children: Vec<(usize, Child)> = Vec::new();
    // the children's process groups (each its own, led by the child)
    let mut groups: Vec<libc::pid_t> = Vec::new();
    let tails: Vec<Tail> = (0..spec.nproc).map(|_| Tail::default()).collect();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let mut streams = 0usize;
    for (local, tail) in tails.iter().enumerate() {
        let rank = base + local;
        let mut cmd = Command::new(&spec.command[0]);
        cmd.args(&spec.command[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", spec.nproc.to_string())
            .env("GROUP_RANK", spec.node_rank.to_string())
            .env("MASTER_ADDR", spec.master_addr)
            .env("MASTER_PORT", spec.master_port.to_string())
            .env("TENSORPLAY_RUN", "1")
            .env("TENSORPLAY_RESTART_COUNT", spec.restarts.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", spec.restarts.to_string())
            .env("TORCHELASTIC_MAX_RESTARTS", spec.max_restarts.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // its own process group: stopping a rank stops what it started too (the launcher
            // forwards Ctrl-C, so the terminal's SIGINT is not needed)
            .process_group(0);
        if spec.set_fr_dir {
            cmd.env(recorder::FR_DIR_ENV, spec.fr_dir);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for (_, c) in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!(
                    "could not start rank {rank} ({:?}): {e}",
                    spec.command[0]
                ));
            }
        };
        if let Ok(pid) = libc::pid_t::try_from(child.id()) {
            groups.push(pid);
        }
        if let Some(o) = child.stdout.take() {
            forward(rank, o, false, tail.clone(), done_tx.clone());
            streams += 1;
        }
        if let Some(e) = child.stderr.take() {
            forward(rank, e, true, tail.clone(), done_tx.clone());
            streams += 1;
        }
        children.push((rank, child));
    }
    let start = Instant::now();
    let mut interrupt: Option<String> = None;
    let mut external: Option<E> = None;
    let mut exits: Vec<Exit> = Vec::new();
    let mut first_failure: Option<Instant> = None;
    let mut stop_sent: Option<Instant> = None;
    let mut killed = false;
    let mut last_watch = Instant::now();
    let mut running: Vec<(usize, Child)> = children;
    while !running.is_empty() {
        if interrupt.is_none() && interrupted.load(Ordering::SeqCst) {
            for (_, c) in &running {
                signal(c, libc::SIGINT);
            }
            interrupt = Some(
                "interrupted (SIGINT, SIGTERM or SIGHUP; forwarded to every rank as SIGINT)".into(),
            );
            // SIGINT is the stop signal here: SIGKILL follows after the grace period
            stop_sent.get_or_insert_with(Instant::now);
        }
        let mut still = Vec::with_capacity(running.len());
        for (rank, mut c) in running {
            let how = match c.try_wait() {
                Ok(Some(status)) => ended(status),
                Ok(None) => {
                    still.push((rank, c));
                    continue;
                }
                Err(_) => Ended::Code(-1),
            };
            exits.push(Exit {
                rank,
                at: start.elapsed(),
                how,
                message: String::new(),
                stopped: stop_sent.is_some(),
            });
        }
        running = still;
        let failed = exits.iter().any(|e| !e.how.success());
        if failed && first_failure.is_none() {
            first_failure = Some(Instant::now());
        }
        // another launcher may have started a new round: asked only while this round is
        // healthy (a local failure is handled by the caller, a stop is already under way)
        if first_failure.is_none()
            && stop_sent.is_none()
            && !running.is_empty()
            && last_watch.elapsed() >= WATCH_EVERY
        {
            last_watch = Instant::now();
            if let Some(e) = watch() {
                external = Some(e);
                for (_, c) in &running {
                    signal(c, libc::SIGTERM);
                }
                stop_sent = Some(Instant::now());
            }
        }
        // the others get a moment to end on their own (and to write their flight recorders)
        // before they are told to stop
        let stop_now = first_failure.is_some_and(|t| t.elapsed() >= FAIL_GRACE);
        if stop_now && stop_sent.is_none() && !running.is_empty() {
            for (_, c) in &running {
                signal(c, libc::SIGTERM);
            }
            stop_sent = Some(Instant::now());
        }
        if !killed
            && !running.is_empty()
            && stop_sent.is_some_and(|t| t.elapsed() > spec.kill_grace)
        {
            killed = true;
            for (_, c) in &mut running {
                signal(c, libc::SIGKILL);
                let _ = c.kill();
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // a round that did not succeed leaves nothing behind: what the ranks started (a wrapper
    // script's program that outlived it) goes with them
    if interrupt.is_some() || external.is_some() || exits.iter().any(|e| !e.how.success()) {
        for &pgid in &groups {
            signal_group(pgid, libc::SIGKILL);
        }
    }
    // let the forwarding threads print the last lines (a grandchild may keep a stream open:
    // wait a little only)
    let deadline = Instant::now() + Duration::from_secs(2);
    for _ in 0..streams {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    for e in &mut exits {
        let t = tails[e.rank - base]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // the spawn marker is spawn's own protocol, not a word of the report
        e.message = t
            .iter()
            .map(|l| l.replace("tensorplay-spawn-error: ", ""))
            .collect::<Vec<_>>()
            .join("\n");
    }
    if let Some(i) = interrupt {
        return Ok(Outcome::Interrupted(i));
    }
    if let Some(e) = external {
        return Ok(Outcome::Stopped(e));
    }
    let Some(v) = blame::root_cause(&exits) else {
        return Ok(Outcome::Success);
    };
    let stopped: Vec<usize> = exits.iter().filter(|e| e.stopped).map(|e| e.rank).collect();
    let mut msg = match blame::implicated(&exits, &v, &stopped) {
        Some(imp) => implicated_report(&imp, &v, &exits),
        None => report(&v, &exits),
    };
    if let Ok((dumps, _)) = recorder::read_dumps(spec.fr_dir) {
        msg.push_str(&format!(
            "\nflight recorder ({}; `tensorplay-fr {}` prints this again):\n{}",
            spec.fr_dir.display(),
            spec.fr_dir.display(),
            recorder::diagnose(&dumps).to_string().trim_end()
        ));
    }
    Ok(Outcome::Failed(Failure {
        summary: summary(&msg, &v, &exits),
        report: msg,
    }))
}

/// One line for the list of every failure: the report's first line (the root cause) and the
/// root's last output line.
fn summary(report: &str, v: &blame::Verdict, exits: &[Exit]) -> String {
    let first = report.lines().next().unwrap_or("").trim_end();
    let first = first.strip_suffix("; its last lines:").unwrap_or(first);
    let last = exits
        .iter()
        .find(|e| e.rank == v.root)
        .and_then(|e| e.message.lines().last())
        .map(str::trim)
        .filter(|l| !l.is_empty());
    match last {
        Some(l) if !first.contains(l) => format!("{first}: {l}"),
        _ => first.to_string(),
    }
}

/// How `st` ended.
fn ended(st: ExitStatus) -> Ended {
    use std::os::unix::process::ExitStatusExt;
    match (st.code(), st.signal()) {
        (Some(c), _) => Ended::Code(c),
        (None, Some(s)) => Ended::Signal(s),
        _ => Ended::Code(-1),
    }
}

/// The failure report: the root cause with its last lines, the other ranks that failed on
/// their own account, then the consequences.
fn report(v: &blame::Verdict, exits: &[Exit]) -> String {
    let find = |r: usize| exits.iter().find(|e| e.rank == r);
    let how = |e: &Exit| match e.how {
        Ended::Code(c) => format!("exited with code {c}"),
        Ended::Signal(s) => format!("was killed by signal {s}"),
    };
    let mut out = String::new();
    if let Some(root) = find(v.root) {
        out.push_str(&format!(
            "rank {} {} (the first rank to fail)",
            root.rank,
            how(root)
        ));
        if !root.message.is_empty() {
            out.push_str(&format!(
                "; its last lines:\n    {}",
                root.message.replace('\n', "\n    ")
            ));
        }
    }
    let listed = |ranks: &[usize]| -> Vec<String> {
        ranks
            .iter()
            .filter_map(|&r| find(r))
            .filter(|e| !e.stopped)
            .map(|e| {
                let last = e.message.lines().last().unwrap_or("").trim();
                format!("rank {} {} ({last})", e.rank, how(e))
            })
            .collect()
    };
    let own = listed(&v.own_failures);
    if !own.is_empty() {
        out.push_str(&format!(
            "\n{}: {}",
            blame::own_failures_label(own.len()),
            own.join("; ")
        ));
    }
    let then = listed(&v.consequences);
    if !then.is_empty() {
        out.push_str(&format!("\nthen, as a consequence: {}", then.join("; ")));
    }
    let stopped: Vec<usize> = v
        .consequences
        .iter()
        .filter_map(|&r| find(r))
        .filter(|e| e.stopped)
        .map(|e| e.rank)
        .collect();
    if !stopped.is_empty() {
        out.push_str(&format!("\nstopped by the launcher: ranks {stopped:?}"));
    }
    out
}

/// The failure report when the first rank to fail blames a rank that did not fail itself.
fn implicated_report(imp: &blame::Implicated, v: &blame::Verdict, exits: &[Exit]) -> String {
    let what = match imp.why {
        blame::Why::StillRunning => format!(
            "was still running when rank {} failed waiting for it (stuck, or it skipped a collective the others called)",
            imp.named_by
        ),
        blame::Why::ExitedEarly => format!(
            "exited with code 0 while rank {} still expected it in a collective (did it skip or return early?)",
            imp.named_by
        ),
    };
    let mut out = format!("rank {} {what} (the likely cause)\n", imp.rank);
    let rest = report(v, exits);
    out.push_str(&rest.replacen(
        " (the first rank to fail)",
        " (the first rank to fail, because of it)",
        1,
    ));
    out
}
