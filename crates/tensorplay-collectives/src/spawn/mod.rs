//! `spawn`: run a function in `nprocs` processes (`torch.multiprocessing.spawn`).
//!
//! # How it works
//!
//! Rust cannot fork a closure into a fresh process safely, so [`spawn`] re-executes the current
//! executable ([`std::env::current_exe`]) `nprocs` times with these environment variables:
//! `TENSORPLAY_SPAWN_RANK=<r>`, `RANK=<r>`, `LOCAL_RANK=<r>`, `WORLD_SIZE=<n>`,
//! `LOCAL_WORLD_SIZE=<n>`, `MASTER_ADDR=127.0.0.1` and `MASTER_PORT=<a free port>`, plus
//! [`SpawnOptions::env`].
//!
//! * In the **parent** (no `TENSORPLAY_SPAWN_RANK`), `spawn` starts the children, forwards
//!   their output line by line prefixed with `[rank N] ` (set `TENSORPLAY_SPAWN_VERBOSE=0` to
//!   silence it) while keeping it for failure reports, and returns when all exited
//!   successfully, or as soon as one fails (non-zero exit, signal, or the overall timeout when
//!   [`SpawnOptions::timeout`] sets one: by default there is none, as in PyTorch): it then
//!   kills the others and returns [`Error::Spawn`] for the first failing rank with its output.
//! * In a **child**, the program runs again from the start and reaches the same `spawn` call;
//!   that call sees `TENSORPLAY_SPAWN_RANK`, runs `f(rank)` and exits the process at once:
//!   code 0 on `Ok`, 1 on `Err`, 101 on panic. Nothing after the `spawn` call runs in a child.
//!   Code before it runs in every child too, so keep it cheap and deterministic.
//!
//! **A failing rank is reported once.** A child's error, or the panic of the thread running
//! `f` (its location and message, then the backtrace when `RUST_BACKTRACE` asks for one), is
//! sent to the parent on one marked line instead of being printed by the panic hook; the
//! parent forwards it as `[rank N] failed: <message>` and quotes it in [`Error::Spawn`]'s
//! reason, and leaves it out of the error's `output` (the rest of what the rank printed), so
//! the message appears once live and once in the error. Panics of other threads go to the
//! panic hook as usual.
//!
//! When called from a libtest test (the current thread is named after the test, not `main`),
//! the children re-run only that test (`<name> --exact --include-ignored --nocapture
//! --test-threads=1 -q`, so an ignored test run with `--ignored` runs in them too);
//! otherwise they get the parent's arguments, so binaries and examples that call `spawn` from
//! `main` work the same way.
//!
//! **Under `tensorplay-run`.** A process started by the launcher (`TENSORPLAY_RUN=1`) already
//! is one rank of a job, so `spawn(n, f)` there joins that job instead of starting a second
//! one: when `n` equals the launcher's `WORLD_SIZE`, it runs `f(RANK)` in this process and exits
//! it as a spawned child does (the launcher's environment, `MASTER_ADDR`/`MASTER_PORT`
//! included, is kept: [`SpawnOptions::env`] and `timeout` do not apply, the launcher's own
//! options do, and [`is_spawned_child`] is false); any other `n` is an
//! [`Error::InvalidArgument`] naming both numbers. A `spawn` inside `f` starts grandchildren
//! as in any child.
//!
//! **Several calls.** A program may call `spawn` more than once, one call after another, as
//! with `mp.spawn`: the children of its `k`-th call ([`SPAWN_CALLS_ENV`]) return `Ok(())` at
//! once from the calls before it (the parent has run those) and run `f` at their own, so code
//! between the calls runs in those children too, as code before the first call does.
//!
//! **Nesting.** `f` may itself call `spawn` (at most once per run of `f`): the grandchildren
//! carry the whole rank path in `TENSORPLAY_SPAWN_PATH` (for example `1,0`), re-run the outer
//! `f` with their parent's rank up to the inner call, and run the inner `f` there. Each
//! `spawn` call thus knows whether it is the parent or the child of its own level, and
//! spawning never recurses without bound.
//!
//! Unix only (children killed by a signal are reported by signal number and name); on other
//! platforms it compiles and reports exit codes only.

pub mod blame;
mod parent;

use std::backtrace::{Backtrace, BacktraceStatus};
use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, Once};
use std::thread::ThreadId;
use std::time::Duration;

use crate::{Error, Result};

use self::parent::run_parent;

/// Environment variable holding a child's rank (set by [`spawn`]; its presence marks a child).
pub const SPAWN_RANK_ENV: &str = "TENSORPLAY_SPAWN_RANK";
/// Environment variable holding the comma-separated rank path of nested spawns.
pub const SPAWN_PATH_ENV: &str = "TENSORPLAY_SPAWN_PATH";
/// Environment variable holding, for each level of the rank path, which `spawn` call of its
/// process at that level started the child (0 for the first): a program may call `spawn`
/// several times, and a child re-running it skips the calls before its own. A program that
/// routes its children to their call itself (by a variable of its own, calling `spawn` first
/// thing in the child) sets this to `0` in [`SpawnOptions::env`], which overrides it.
pub const SPAWN_CALLS_ENV: &str = "TENSORPLAY_SPAWN_CALLS";
/// The children's output is forwarded live to this process's stdout/stderr, each line
/// prefixed with `[rank N] ` (and also kept for failure reports); set this variable to `0` to
/// only keep it.
pub const SPAWN_VERBOSE_ENV: &str = "TENSORPLAY_SPAWN_VERBOSE";
/// The overall timeout [`spawn`] used to apply by default (600 seconds). [`spawn`] has no
/// overall timeout by default now ([`SpawnOptions::new`] sets `timeout: None`), as
/// `torch.multiprocessing.spawn`; set `SpawnOptions { timeout: Some(..) }` to bound a job.
#[deprecated(
    note = "spawn has no overall timeout by default (as torch.multiprocessing.spawn): a healthy \
            job runs as long as it needs, and the collectives' own timeouts (300 s by default) \
            catch a stuck rank; set SpawnOptions { timeout: Some(..) } to bound a job"
)]
pub const DEFAULT_SPAWN_TIMEOUT: Duration = Duration::from_secs(600);

/// How much of a failing child's output [`Error::Spawn`] keeps (the last 64 KiB).
const MAX_OUTPUT: usize = 64 * 1024;
/// Marker line a failing child prints, so the parent can quote the error in the reason.
const FAIL_MARKER: &str = "tensorplay-spawn-error: ";

/// The error type of a spawned function: any error, so `?` works on this crate's
/// [`Error`], the core's error (`tensorplay::Error`), I/O errors, and string messages (`"msg".into()`).
pub type SpawnError = Box<dyn std::error::Error + Send + Sync>;

/// Options of [`spawn_with`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpawnOptions {
    /// Number of processes (ranks `0..nprocs`); must be at least 1.
    pub nprocs: usize,
    /// Overall timeout: when the children have not all exited after this long, the remaining
    /// ones are killed and the first of them is reported. `None` (the default): no limit, as
    /// in `torch.multiprocessing.spawn`; a rank stuck in a collective still fails at the
    /// collective's timeout (the group's, 300 s by default), which ends the job.
    pub timeout: Option<Duration>,
    /// Extra environment variables for the children (applied after the standard ones, so
    /// they can override them).
    pub env: Vec<(String, String)>,
}

impl SpawnOptions {
    /// `nprocs` processes, no overall timeout (`timeout: None`, as `torch.multiprocessing.spawn`)
    /// and no extra environment.
    pub fn new(nprocs: usize) -> SpawnOptions {
        SpawnOptions {
            nprocs,
            timeout: None,
            env: Vec::new(),
        }
    }
}

/// Number of `f`s of enclosing `spawn` calls currently running in this (child) process.
static LEVEL: AtomicUsize = AtomicUsize::new(0);
thread_local! {
    /// How many `spawn` calls this thread has made at each level so far. Per thread, not per
    /// process: a child re-runs the calling code on one thread (libtest runs each test on a
    /// thread of its own, and a child re-runs only that test).
    static CALLS: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The index of this `spawn` call among this thread's calls at `level` (0 for the first).
fn next_call(level: usize) -> usize {
    CALLS.with_borrow_mut(|calls| {
        if calls.len() <= level {
            calls.resize(level + 1, 0);
        }
        calls[level] += 1;
        calls[level] - 1
    })
}

/// The thread running `f` in this child: its panics are reported by `spawn`, not by the hook.
static F_THREAD: Mutex<Option<ThreadId>> = Mutex::new(None);
/// The last panic of [`F_THREAD`]: "panicked at FILE:LINE:COL: message" and the backtrace,
/// when `RUST_BACKTRACE` asked for one.
static PANIC_REPORT: Mutex<Option<(String, Option<String>)>> = Mutex::new(None);
/// Installs [`report_panics_of_f`] once per process.
static PANIC_HOOK: Once = Once::new();

/// Wraps the panic hook: a panic of the thread running `f` is recorded in [`PANIC_REPORT`]
/// (the child then sends it to the parent on its failure line) instead of printed, so that
/// the user sees the message once; panics of other threads go to the previous hook.
fn report_panics_of_f() {
    PANIC_HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let this = std::thread::current().id();
            let of_f = *F_THREAD.lock().unwrap_or_else(|e| e.into_inner()) == Some(this);
            if !of_f {
                return previous(info);
            }
            let at = info
                .location()
                .map(|l| format!(" at {}:{}:{}", l.file(), l.line(), l.column()))
                .unwrap_or_default();
            let msg = panic_message(info.payload());
            let trace = Backtrace::capture();
            let trace = (trace.status() == BacktraceStatus::Captured).then(|| trace.to_string());
            *PANIC_REPORT.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((format!("panicked{at}: {msg}"), trace));
        }));
    });
}

/// Runs `f(rank)` in `nprocs` processes, like `torch.multiprocessing.spawn`: the current program
/// is re-executed once per rank with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
/// `MASTER_ADDR=127.0.0.1` and a free `MASTER_PORT` set, and reaches this call again; code
/// before it runs in every child, nothing after it does (a child exits when `f` returns). Each
/// child's output is forwarded prefixed with `[rank N] `. Under `tensorplay-run`, the process
/// joins the launcher's job instead (`nprocs` must equal its `WORLD_SIZE`). There is no
/// overall timeout, as in `torch.multiprocessing.spawn`: the job runs until every rank has
/// exited or one has failed (a rank stuck in a collective fails at the collective's timeout);
/// [`spawn_with`] with `SpawnOptions { timeout: Some(..) }` sets one.
///
/// # Errors
/// [`Error::InvalidArgument`] when `nprocs` is 0; [`Error::Spawn`] naming the first rank that
/// failed (exit code, signal, or the timeout [`spawn_with`] was given) with its captured output,
/// or rank 0 with the reason when the processes could not be started. Ranks that failed later
/// are listed in the reason: as a consequence when their message says they lost or waited for
/// another rank, as failed on their own otherwise (see [`blame`]).
pub fn spawn<F>(nprocs: usize, f: F) -> Result<()>
where
    F: Fn(usize) -> std::result::Result<(), SpawnError>,
{
    spawn_with(SpawnOptions::new(nprocs), f)
}

/// [`spawn`] with options: an overall timeout (none by default) and extra environment
/// variables.
///
/// # Errors
/// As [`spawn`]; when `opts.timeout` is `Some(t)` and the ranks have not all exited after
/// `t`, [`Error::Spawn`] names the first rank still running and says it timed out.
pub fn spawn_with<F>(opts: SpawnOptions, f: F) -> Result<()>
where
    F: Fn(usize) -> std::result::Result<(), SpawnError>,
{
    if opts.nprocs == 0 {
        return Err(Error::invalid("spawn", -1, "nprocs", "at least 1", 0));
    }
    let level = LEVEL.load(Ordering::SeqCst);
    let call = next_call(level);
    let mut path = rank_path()?;
    // which call at each level started this process (empty outside spawn's children)
    let mut calls = parse_ranks(
        SPAWN_CALLS_ENV,
        &std::env::var(SPAWN_CALLS_ENV).unwrap_or_default(),
    )?;
    if path.len() > level {
        if call < calls.get(level).copied().unwrap_or(0) {
            // an earlier spawn call of the program: the parent has run it already, this child
            // belongs to a later one (code between the calls runs here as in the parent)
            return Ok(());
        }
        return run_child(&opts, &path, level, f);
    }
    // the children of this call: the calls that led to this process, then this one
    calls.resize(level, 0);
    calls.push(call);
    if path.is_empty()
        && let Some((rank, world)) = launcher_rank()?
    {
        // started by tensorplay-run: this process already is one rank of the job, the first
        // level of the rank path (a spawn inside `f` then starts grandchildren as usual)
        path = vec![rank];
        if level > 0 {
            return run_parent(&opts, &path, &calls);
        }
        if opts.nprocs != world {
            return Err(Error::invalid(
                "spawn",
                rank as i64,
                "nprocs",
                format!(
                    "{world}, the WORLD_SIZE of the job tensorplay-run started (under the \
                     launcher each process is one rank and spawn runs f(RANK) in it; run the \
                     program without tensorplay-run to let spawn start the processes)"
                ),
                opts.nprocs,
            ));
        }
        return run_child(&opts, &[rank], 0, f);
    }
    run_parent(&opts, &path, &calls)
}

/// `Some((RANK, WORLD_SIZE))` in a process started by `tensorplay-run` (`TENSORPLAY_RUN=1`)
/// and not by `spawn`.
fn launcher_rank() -> Result<Option<(usize, usize)>> {
    if std::env::var_os("TENSORPLAY_RUN").is_none_or(|v| v != "1") {
        return Ok(None);
    }
    let var = |name: &str| -> Result<usize> {
        let v = std::env::var(name).unwrap_or_default();
        v.trim().parse::<usize>().map_err(|_| {
            Error::invalid(
                "spawn",
                -1,
                name,
                "a whole number set by tensorplay-run",
                format!("{v:?}"),
            )
        })
    };
    let (rank, world) = (var("RANK")?, var("WORLD_SIZE")?);
    if rank >= world {
        return Err(Error::invalid(
            "spawn",
            rank as i64,
            "RANK",
            format!("< WORLD_SIZE {world}"),
            rank,
        ));
    }
    Ok(Some((rank, world)))
}

/// The comma-separated whole numbers of environment variable `var` (empty when `s` is).
fn parse_ranks(var: &str, s: &str) -> Result<Vec<usize>> {
    if s.is_empty() {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(|p| p.trim().parse::<usize>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| {
            Error::invalid(
                "spawn",
                -1,
                var,
                "comma-separated whole numbers",
                format!("{s:?}"),
            )
        })
}

/// The rank path from the environment (empty in a process not started by `spawn`).
fn rank_path() -> Result<Vec<usize>> {
    if let Ok(p) = std::env::var(SPAWN_PATH_ENV) {
        return parse_ranks(SPAWN_PATH_ENV, &p);
    }
    match std::env::var(SPAWN_RANK_ENV) {
        Ok(r) => parse_ranks(SPAWN_RANK_ENV, &r),
        Err(_) => Ok(Vec::new()),
    }
}

/// In a child: runs `f` with this level's rank; at the innermost level, exits the process.
fn run_child<F>(opts: &SpawnOptions, path: &[usize], level: usize, f: F) -> Result<()>
where
    F: Fn(usize) -> std::result::Result<(), SpawnError>,
{
    let rank = path[level];
    let innermost = level + 1 == path.len();
    if rank >= opts.nprocs {
        eprintln!(
            "{FAIL_MARKER}rank {rank} from {SPAWN_PATH_ENV} is out of range for nprocs {}",
            opts.nprocs
        );
        exit_now(1);
    }
    LEVEL.store(level + 1, Ordering::SeqCst);
    report_panics_of_f();
    *F_THREAD.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::thread::current().id());
    let outcome = catch_unwind(AssertUnwindSafe(|| f(rank)));
    LEVEL.store(level, Ordering::SeqCst);
    if !innermost {
        // The nested spawn inside `f` should have run the inner function and exited.
        eprintln!(
            "{FAIL_MARKER}rank {rank}: the nested spawn call was not reached again in the child \
             (spawn must be called deterministically)"
        );
        exit_now(1);
    }
    match outcome {
        Ok(Ok(())) => exit_now(0),
        Ok(Err(e)) => {
            fail_line(&e.to_string());
            exit_now(1)
        }
        Err(payload) => {
            let report = PANIC_REPORT
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            let (msg, trace) =
                report.unwrap_or_else(|| (format!("panicked: {}", panic_message(&*payload)), None));
            fail_line(&msg);
            // what the panic hook would have added, as ordinary output
            match trace {
                Some(t) => eprintln!("stack backtrace:\n{}", t.trim_end()),
                None => eprintln!(
                    "note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace"
                ),
            }
            exit_now(101)
        }
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}

/// Writes the failure marker and the message to stderr in one call; the parent quotes the
/// marker line (the message's first line) in its reason and forwards it as
/// `[rank N] failed: <message>`; later lines of a message of several are ordinary output.
fn fail_line(msg: &str) {
    let line = format!("{FAIL_MARKER}{}\n", msg.trim_end());
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(line.as_bytes());
    let _ = err.flush();
}

fn exit_now(code: i32) -> ! {
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    std::process::exit(code)
}

/// Whether this process is a child started by `spawn` (`TENSORPLAY_SPAWN_RANK` is set): code
/// outside the spawned functions runs in the children too (before the first `spawn` call and
/// between calls), so parent-only work (checking results, printing a summary) goes behind
/// `if !is_spawned_child()`.
pub fn is_spawned_child() -> bool {
    std::env::var_os(SPAWN_RANK_ENV).is_some()
}
