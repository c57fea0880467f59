//! The parent side of [`spawn`](super::spawn()): starting the children, forwarding and keeping
//! their output, waiting for them, and naming the root cause when the job fails
//! ([`blame`](super::blame)).

use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::blame::{self, Ended, Exit};
use super::{
    FAIL_MARKER, MAX_OUTPUT, SPAWN_CALLS_ENV, SPAWN_PATH_ENV, SPAWN_RANK_ENV, SPAWN_VERBOSE_ENV,
    SpawnOptions,
};
use crate::{Error, Result};

/// What the parent keeps of a child's output: the last [`MAX_OUTPUT`] bytes or so (memory
/// stays bounded however long the child runs) and the child's last failure message.
#[derive(Default)]
struct Captured {
    /// The newest whole lines, trimmed to the last `MAX_OUTPUT` bytes when it doubles.
    tail: Vec<u8>,
    /// Whether older output was dropped.
    dropped: bool,
    /// The text after the last [`FAIL_MARKER`] seen on the child's stderr, wherever it stood
    /// in its line (a partial line or a progress bar may precede it).
    marker: Option<String>,
}

/// How long the other ranks may take to end on their own after the first failure: up to 1 s
/// comparing failure reports (`ops/failure_report.rs`), up to 2 s writing flight recorders.
const FAIL_GRACE: Duration = Duration::from_secs(3);

/// How much of a failure message is quoted in a reason (4 KiB).
const MAX_MARKER: usize = 4096;

/// A started child: the process, its merged output and the threads that read it.
struct Running {
    child: Child,
    output: Arc<Mutex<Captured>>,
    readers: Vec<JoinHandle<()>>,
    readers_done: Arc<AtomicUsize>,
    status: Option<ExitStatus>,
    /// Why waiting for it failed, when it did.
    wait_error: Option<String>,
}

pub(super) fn run_parent(opts: &SpawnOptions, path: &[usize], calls: &[usize]) -> Result<()> {
    let spawn_err = |reason: String| Error::Spawn {
        rank: 0,
        reason,
        output: String::new(),
    };
    let exe = std::env::current_exe()
        .map_err(|e| spawn_err(format!("could not start: cannot find the executable: {e}")))?;
    let args: Vec<String> = match std::thread::current().name() {
        // `--include-ignored`: a test run with `--ignored` must run in its children too (left
        // out, libtest would skip it there and every rank would exit 0 without running `f`)
        Some(name) if name != "main" => vec![
            name.to_string(),
            "--exact".into(),
            "--include-ignored".into(),
            "--nocapture".into(),
            "--test-threads=1".into(),
            "-q".into(),
        ],
        _ => std::env::args().skip(1).collect(),
    };
    let port = crate::rendezvous::free_port()
        .map_err(|e| spawn_err(format!("could not start: cannot find a free port: {e}")))?;
    // like torch.multiprocessing.spawn, children's output reaches the terminal by default
    let verbose = std::env::var(SPAWN_VERBOSE_ENV).map_or(true, |v| v != "0");
    let n = opts.nprocs;
    // the flight-recorder folder of this job: a fresh one unless the user (or an outer spawn)
    // chose one; a failed job's dumps are read into its error, then the folder goes
    let fr_dir = match std::env::var_os(crate::recorder::FR_DIR_ENV) {
        Some(_) => None,
        None => Some(
            std::env::temp_dir().join(format!("tensorplay-fr-spawn-{}-{port}", std::process::id())),
        ),
    };

    let mut procs: Vec<Running> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut full_path: Vec<String> = path.iter().map(|r| r.to_string()).collect();
        full_path.push(rank.to_string());
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
            .env(SPAWN_RANK_ENV, rank.to_string())
            .env(SPAWN_PATH_ENV, full_path.join(","))
            .env(
                SPAWN_CALLS_ENV,
                calls
                    .iter()
                    .map(|c| c.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
            )
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .envs(
                fr_dir
                    .iter()
                    .map(|d| (crate::recorder::FR_DIR_ENV, d.as_os_str())),
            )
            .envs(opts.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut procs);
                return Err(Error::Spawn {
                    rank,
                    reason: format!("could not be started ({}): {e}", exe.display()),
                    output: String::new(),
                });
            }
        };
        let output = Arc::new(Mutex::new(Captured::default()));
        let readers_done = Arc::new(AtomicUsize::new(0));
        let mut readers = Vec::new();
        let out: Option<Box<dyn Read + Send>> = child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>);
        let err: Option<Box<dyn Read + Send>> = child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>);
        for (pipe, is_stdout) in [(out, true), (err, false)]
            .into_iter()
            .filter_map(|(p, o)| p.map(|p| (p, o)))
        {
            let output = Arc::clone(&output);
            let done = Arc::clone(&readers_done);
            readers.push(std::thread::spawn(move || {
                read_pipe(pipe, &output, verbose.then_some(rank), is_stdout);
                done.fetch_add(1, Ordering::SeqCst);
            }));
        }
        procs.push(Running {
            child,
            output,
            readers,
            readers_done,
            status: None,
            wait_error: None,
        });
    }

    let start = Instant::now();
    // every rank that ended on its own, with when it was seen ending
    let mut exits: Vec<Exit> = Vec::new();
    // after the first failure the others get a moment to end on their own (and to write their
    // flight recorder when asked) before they are killed
    let mut grace: Option<Instant> = None;
    // the overall timeout, when one was set and it passed
    let timed_out: Option<Duration> = loop {
        let mut all_done = true;
        let mut failed = false;
        for (rank, p) in procs.iter_mut().enumerate() {
            if p.status.is_some() {
                continue;
            }
            match p.child.try_wait() {
                Ok(Some(st)) => {
                    p.status = Some(st);
                    failed |= !st.success();
                    exits.push(Exit {
                        rank,
                        at: start.elapsed(),
                        how: ended(st),
                        message: String::new(),
                        stopped: false,
                    });
                }
                Ok(None) => all_done = false,
                Err(e) => {
                    p.wait_error = Some(format!("could not be waited for: {e}"));
                    failed = true;
                    exits.push(Exit {
                        rank,
                        at: start.elapsed(),
                        how: Ended::Code(-1),
                        message: String::new(),
                        stopped: false,
                    });
                }
            }
        }
        if failed && grace.is_none() {
            grace = Some(Instant::now() + FAIL_GRACE);
        }
        if all_done || grace.is_some_and(|g| Instant::now() >= g) {
            break None;
        }
        if let Some(limit) = opts.timeout
            && start.elapsed() >= limit
        {
            break Some(limit);
        }
        std::thread::sleep(Duration::from_millis(5));
    };

    let stopped: Vec<usize> = (0..n).filter(|&r| procs[r].status.is_none()).collect();
    kill_all(&mut procs);
    // the dumps of this job: in spawn's own folder (removed after reading) or in the one the
    // user chose (kept)
    let diagnosis = {
        let dir = fr_dir.clone().unwrap_or_else(crate::recorder::dump_dir);
        let text = crate::recorder::read_dumps(&dir)
            .ok()
            .map(|(dumps, _)| crate::recorder::diagnose(&dumps).to_string());
        if let Some(d) = &fr_dir {
            let _ = std::fs::remove_dir_all(d);
        }
        text
    };
    // a rank that failed during the grace period is reported, not the job's timeout
    if let Some(limit) = timed_out
        && !exits.iter().any(|e| !e.how.success())
    {
        let rank = stopped.first().copied().unwrap_or(0);
        let (output, _) = collect_output(&mut procs[rank]);
        return Err(Error::Spawn {
            rank,
            reason: format!(
                "timed out after {:.1}s, the timeout set in SpawnOptions (still running; killed{})",
                limit.as_secs_f64(),
                if stopped.len() > 1 {
                    format!("; ranks {stopped:?} were all still running")
                } else {
                    String::new()
                }
            ),
            output,
        });
    }
    // the failure messages of the ranks that failed, then the verdict
    let mut outputs: Vec<Option<(String, Option<String>)>> = vec![None; n];
    for e in exits.iter_mut().filter(|e| !e.how.success()) {
        let (output, marker) = collect_output(&mut procs[e.rank]);
        e.message = marker.clone().unwrap_or_else(|| last_lines(&output, 5));
        outputs[e.rank] = Some((output, marker));
    }
    let Some(verdict) = blame::root_cause(&exits) else {
        return Ok(());
    };
    let implicated = blame::implicated(&exits, &verdict, &stopped);
    // "rank 1 failed: rank 1: ..." says the rank once
    let own_words = |r: usize, m: &str| -> String {
        m.strip_prefix(&format!("rank {r}: "))
            .unwrap_or(m)
            .to_string()
    };
    let failed_line = |r: usize| -> String {
        let why = exits
            .iter()
            .find(|e| e.rank == r)
            .map(|e| first_line(&own_words(r, &e.message)))
            .unwrap_or_default();
        format!("rank {r} ({why})")
    };
    let (rank, mut reason, output, then) = match &implicated {
        Some(imp) => {
            let (output, _) = collect_output(&mut procs[imp.rank]);
            let r = imp.named_by;
            let said = exits
                .iter()
                .find(|e| e.rank == r)
                .map(|e| first_line(&own_words(r, &e.message)))
                .unwrap_or_default();
            let what = match imp.why {
                blame::Why::StillRunning => format!(
                    "was still running when rank {r} failed waiting for it (stuck, or it skipped a collective the others called)"
                ),
                blame::Why::ExitedEarly => format!(
                    "exited with code 0 while rank {r} still expected it in a collective (did it skip or return early?)"
                ),
            };
            let mut then = vec![verdict.root];
            then.extend(&verdict.consequences);
            (imp.rank, format!("{what}; rank {r}: {said}"), output, then)
        }
        None => {
            let rank = verdict.root;
            let (output, marker) = outputs[rank].take().unwrap_or_default();
            let status = procs[rank]
                .wait_error
                .clone()
                .or_else(|| procs[rank].status.map(describe_status))
                .unwrap_or_else(|| "failed".into());
            let reason = match marker {
                Some(msg) => format!("failed: {} ({status})", own_words(rank, &msg)),
                None => status,
            };
            (rank, reason, output, verdict.consequences.clone())
        }
    };
    if !verdict.own_failures.is_empty() {
        let own: Vec<String> = verdict
            .own_failures
            .iter()
            .map(|&r| failed_line(r))
            .collect();
        reason.push_str(&format!(
            "\n{}: {}",
            blame::own_failures_label(own.len()),
            own.join("; ")
        ));
    }
    if !then.is_empty() {
        let then: Vec<String> = then.iter().map(|&r| failed_line(r)).collect();
        reason.push_str(&format!("\nthen, as a consequence: {}", then.join("; ")));
    }
    if let Some(d) = &fr_dir {
        // spawn's own folder is gone by now: its diagnosis follows instead
        reason = reason.replace(
            &format!("(run `tensorplay-fr {}` for a diagnosis)", d.display()),
            "(read by spawn, diagnosis below; set TENSORPLAY_FR_DIR to keep the dumps)",
        );
    }
    if !stopped.is_empty() {
        reason.push_str(&format!("\nstopped by spawn: ranks {stopped:?}"));
    }
    if let Some(d) = diagnosis {
        reason.push_str(&format!("\nflight recorder:\n{}", d.trim_end()));
    }
    Err(Error::Spawn {
        rank,
        reason,
        output,
    })
}

/// How `st` ended.
fn ended(st: ExitStatus) -> Ended {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = st.signal() {
            return Ended::Signal(sig);
        }
    }
    Ended::Code(st.code().unwrap_or(-1))
}

/// The last `n` non-empty lines of `text`.
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The first line of `text`, at most 200 characters.
fn first_line(text: &str) -> String {
    let l = text.lines().next().unwrap_or("").trim();
    match l.char_indices().nth(200) {
        Some((i, _)) => format!("{}...", &l[..i]),
        None => l.to_string(),
    }
}

/// Keeps a child's output and, when `echo` is set, forwards it with a `[rank N] ` prefix: the
/// child's stdout to this process's stdout, its stderr to stderr. The child's failure line
/// (after [`FAIL_MARKER`]) is kept apart as its failure message, not in the output (the
/// error's reason quotes it), and forwarded as `[rank N] failed: <message>`.
///
/// Only whole lines are appended to the shared `output` (a last line without a newline when
/// the pipe closes gets one), so a line the child wrote to stderr is never split by bytes it wrote to
/// stdout at the same moment (libtest's progress output in a child running a test, say): the
/// parent finds the failure marker line intact.
fn read_pipe(
    mut pipe: Box<dyn Read + Send>,
    output: &Mutex<Captured>,
    echo: Option<usize>,
    is_stdout: bool,
) {
    let marker = FAIL_MARKER.as_bytes();
    let emit = |line: &[u8]| {
        // the failure line: kept apart (the reason quotes it) and forwarded as "failed: ...";
        // what stood before the marker on its line is ordinary output
        let found = if is_stdout {
            None
        } else {
            line.windows(marker.len()).position(|w| w == marker)
        };
        let (line, failure) = match found {
            Some(at) => {
                let msg = &line[at + marker.len()..];
                let msg = &msg[..msg.len().min(MAX_MARKER)];
                let msg = String::from_utf8_lossy(msg).trim_end().to_string();
                (&line[..at], Some(msg))
            }
            None => (line, None),
        };
        let line = if line.iter().all(u8::is_ascii_whitespace) && failure.is_some() {
            &line[..0]
        } else {
            line
        };
        {
            let mut out = output.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(msg) = &failure {
                out.marker = Some(msg.clone());
            }
            if !line.is_empty() {
                out.tail.extend_from_slice(line);
                if !line.ends_with(b"\n") {
                    out.tail.push(b'\n');
                }
            }
            if out.tail.len() > 2 * MAX_OUTPUT {
                let cut = out.tail.len() - MAX_OUTPUT;
                out.tail.drain(..cut);
                out.dropped = true;
            }
        }
        if let Some(rank) = echo {
            let mut text = String::new();
            if !line.is_empty() {
                text = format!("[rank {rank}] {}", String::from_utf8_lossy(line));
                if !text.ends_with('\n') {
                    text.push('\n');
                }
            }
            if let Some(msg) = &failure {
                text.push_str(&format!("[rank {rank}] failed: {msg}\n"));
            }
            // one write per line, so lines of different ranks do not interleave either
            if is_stdout {
                let _ = std::io::stdout().lock().write_all(text.as_bytes());
            } else {
                let _ = std::io::stderr().lock().write_all(text.as_bytes());
            }
        }
    };
    let mut buf = [0u8; 8192];
    let mut line = Vec::new();
    loop {
        let n = match pipe.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        for &b in &buf[..n] {
            line.push(b);
            if b == b'\n' {
                emit(&line);
                line.clear();
            }
        }
        // a very long line without a newline is kept in pieces rather than held back forever
        if line.len() >= MAX_OUTPUT {
            emit(&line);
            line.clear();
        }
    }
    if !line.is_empty() {
        emit(&line);
    }
}

/// Kills the children still running and reaps them all.
fn kill_all(procs: &mut [Running]) {
    for p in procs.iter_mut() {
        if p.status.is_none() {
            let _ = p.child.kill();
        }
    }
    for p in procs.iter_mut() {
        if p.status.is_none() {
            p.status = p.child.wait().ok();
        }
    }
}

/// Waits (up to 2 s: a grandchild may still hold the pipes) for the readers, then returns the
/// last [`MAX_OUTPUT`] bytes of the output and the child's last failure message.
fn collect_output(p: &mut Running) -> (String, Option<String>) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while p.readers_done.load(Ordering::SeqCst) < p.readers.len() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    if p.readers_done.load(Ordering::SeqCst) == p.readers.len() {
        for h in p.readers.drain(..) {
            let _ = h.join();
        }
    }
    let out = p.output.lock().unwrap_or_else(|e| e.into_inner());
    let start = out.tail.len().saturating_sub(MAX_OUTPUT);
    let mut s = String::from_utf8_lossy(&out.tail[start..]).into_owned();
    if start > 0 || out.dropped {
        s.insert_str(0, "[... output truncated ...]\n");
    }
    (s, out.marker.clone())
}

fn describe_status(st: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = st.signal() {
            return format!("was killed by signal {sig} ({})", signal_name(sig));
        }
    }
    match st.code() {
        Some(c) => format!("exited with code {c}"),
        None => format!("exited abnormally ({st})"),
    }
}

/// The name of a Linux signal number ("unknown signal" elsewhere: numbers differ).
#[cfg(unix)]
fn signal_name(sig: i32) -> &'static str {
    if !cfg!(target_os = "linux") {
        return "unknown signal";
    }
    match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        5 => "SIGTRAP",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        _ => "unknown signal",
    }
}
