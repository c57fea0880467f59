//! `tensorplay-run`: starts the processes of a distributed job on this node, as `torchrun` does.
//!
//! ```text
//! tensorplay-run --nproc-per-node 2 target/release/examples/wine_distributed
//! tensorplay-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \
//!     --nproc-per-node 4 ./train -- --epochs 10
//! tensorplay-run --nnodes 2 --node-rank 1 --rdzv-endpoint 10.0.0.1:29500 --nproc-per-node 4 ./train
//! srun --ntasks-per-node=1 tensorplay-run --nproc-per-node 4 ./train   # Slurm places the node
//! ```
//!
//! Under `srun` or `mpirun` (one launcher per node) the number of nodes, this node's rank and
//! the master come from the scheduler's variables when the flags are absent (see `node.rs`).
//!
//! Each child gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` (the `env://` rendezvous of process groups and RPC) and
//! `TENSORPLAY_RUN=1`. Every line a child prints is prefixed with `[rank N] `. Ctrl-C, SIGTERM
//! and SIGHUP (a scheduler, `timeout`, `docker stop`, a closed terminal) are forwarded to the
//! children as SIGINT, and the launcher waits for them. When a child fails
//! (non-zero exit or a signal), the others get 3 s to end on their own (to compare failure reports
//! and write their flight recorders), are then sent SIGTERM (then SIGKILL after `--kill-grace` seconds), and
//! the launcher exits non-zero, naming the rank that failed first (not a survivor that reported
//! it), its last lines, the consequences, and the flight recorder's diagnosis.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod node;

use clap::Parser;
use tensorplay::distributed::recorder;
use tensorplay::distributed::spawn::blame::{self, Ended, Exit};

/// Starts the processes of a distributed tensorplay job on this node (like `torchrun`).
#[derive(Parser, Debug)]
#[command(
    name = "tensorplay-run",
    version,
    about = "Start N processes of a program with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, \
             MASTER_ADDR and MASTER_PORT set (the env:// rendezvous), like torchrun. Exits 1 when \
             a rank fails, naming it."
)]
struct Args {
    /// Processes to start on this node (one per GPU, typically).
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// Nodes in the job (default: `SLURM_NNODES` or `OMPI_COMM_WORLD_SIZE` under `srun` or
    /// `mpirun` with one launcher per node, else 1).
    #[arg(long)]
    nnodes: Option<usize>,
    /// This node's index in 0..nnodes (default: `SLURM_NODEID` or `OMPI_COMM_WORLD_RANK`,
    /// else 0).
    #[arg(long)]
    node_rank: Option<usize>,
    /// Address of the node that runs rank 0 (it hosts the store). Default: `127.0.0.1`; under
    /// Slurm `MASTER_ADDR` or the first host of `SLURM_JOB_NODELIST`; under Open MPI
    /// `MASTER_ADDR`.
    #[arg(long)]
    master_addr: Option<String>,
    /// Port of the store on the master node. Default: a free port (one node only); under
    /// Slurm `MASTER_PORT` or 20000 + `SLURM_JOB_ID` % 20000; under Open MPI `MASTER_PORT` or
    /// 29500.
    #[arg(long)]
    master_port: Option<u16>,
    /// The master's `HOST[:PORT]` in one flag, as torchrun spells it (port 29400 when absent;
    /// IPv6 in brackets). Instead of --master-addr and --master-port.
    #[arg(long)]
    rdzv_endpoint: Option<String>,
    /// Seconds between SIGTERM and SIGKILL when the other children are stopped.
    #[arg(long, default_value_t = 5)]
    kill_grace: u64,
    /// The program to run, then its arguments (after `--` if they start with `-`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

/// Copies `from` to stdout or stderr line by line, each line prefixed with `[rank N] `; the
/// channel hears when the stream ended.
/// The longest piece of a child's line forwarded at once (64 KiB).
const MAX_LINE: u64 = 64 * 1024;

/// How long the other ranks may take to end on their own after the first failure, before the
/// launcher stops them.
const FAIL_GRACE: Duration = Duration::from_secs(3);

/// How many of a child's last lines are kept for the failure report.
const KEEP_LINES: usize = 8;

/// A child's last lines (both streams), for the failure report.
type Tail = Arc<Mutex<VecDeque<String>>>;

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

fn signal(child: &Child, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) on a child we started and have not reaped yet.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let flags = node::Flags {
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr.clone(),
        master_port: args.master_port,
        rdzv_endpoint: args.rdzv_endpoint.clone(),
    };
    let node = node::resolve(&flags, &|v| std::env::var(v).ok())?;
    if args.nproc_per_node == 0 || node.nnodes == 0 {
        return Err("--nproc-per-node and --nnodes must be at least 1".into());
    }
    let port = match node.master_port {
        Some(p) => p,
        // below the ephemeral range, so no connection takes it before rank 0 binds it
        None if node.nnodes == 1 => tensorplay_collectives::rendezvous::free_port()
            .map_err(|e| format!("finding a free port on {}: {e}", node.master_addr))?,
        None => {
            return Err(
                "--master-port (or --rdzv-endpoint HOST:PORT) is required with several nodes"
                    .into(),
            );
        }
    };
    if let Some(n) = &node.note {
        eprintln!("tensorplay-run: {n}");
    }
    if let Some(s) = &node.scheduler {
        eprintln!(
            "tensorplay-run: under {s}: node {} of {}, master {}:{port}",
            node.node_rank, node.nnodes, node.master_addr
        );
    }
    let world = node.nnodes * args.nproc_per_node;
    // where the ranks write their flight recorders (the default folder is this job's: a stale
    // one from an earlier job on the same port goes)
    let fr_dir = match std::env::var_os(recorder::FR_DIR_ENV) {
        Some(d) => std::path::PathBuf::from(d),
        None => {
            let d = recorder::job_dump_dir(&node.master_addr, &port.to_string());
            let _ = std::fs::remove_dir_all(&d);
            d
        }
    };
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
            .map_err(|e| format!("installing the SIGINT/SIGTERM/SIGHUP handler: {e}"))?;
    }
    let mut children: Vec<(usize, Child)> = Vec::new();
    let tails: Vec<Tail> = (0..args.nproc_per_node).map(|_| Tail::default()).collect();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let mut streams = 0usize;
    for (local, tail) in tails.iter().enumerate() {
        let rank = node.node_rank * args.nproc_per_node + local;
        let mut cmd = Command::new(&args.command[0]);
        cmd.args(&args.command[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("GROUP_RANK", node.node_rank.to_string())
            .env("MASTER_ADDR", &node.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("TENSORPLAY_RUN", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for (_, c) in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!(
                    "could not start rank {rank} ({:?}): {e}",
                    args.command[0]
                ));
            }
        };
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
    let mut exits: Vec<Exit> = Vec::new();
    let mut forwarded = false;
    let mut first_failure: Option<Instant> = None;
    let mut stop_sent: Option<Instant> = None;
    let mut running: Vec<(usize, Child)> = children;
    while !running.is_empty() {
        if interrupted.load(Ordering::SeqCst) && !forwarded {
            forwarded = true;
            for (_, c) in &running {
                signal(c, libc::SIGINT);
            }
            interrupt = Some(
                "interrupted (SIGINT, SIGTERM or SIGHUP; forwarded to every rank as SIGINT)".into(),
            );
            // SIGINT is the stop signal here: SIGKILL follows after the grace period
            stop_sent = Some(Instant::now());
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
        // the others get a moment to end on their own (and to write their flight recorders)
        // before they are told to stop
        let stop_now = first_failure.is_some_and(|t| t.elapsed() >= FAIL_GRACE);
        if stop_now && !running.is_empty() {
            match stop_sent {
                None => {
                    for (_, c) in &running {
                        signal(c, libc::SIGTERM);
                    }
                    stop_sent = Some(Instant::now());
                }
                Some(t) if t.elapsed() > Duration::from_secs(args.kill_grace) => {
                    for (_, c) in &mut running {
                        let _ = c.kill();
                    }
                }
                Some(_) => {}
            }
        }
        std::thread::sleep(Duration::from_millis(5));
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
    let base = node.node_rank * args.nproc_per_node;
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
        return Err(i);
    }
    let Some(v) = blame::root_cause(&exits) else {
        if std::env::var_os(recorder::FR_DIR_ENV).is_none() {
            // a job that succeeded leaves no folder behind
            let _ = std::fs::remove_dir_all(&fr_dir);
        }
        return Ok(());
    };
    let stopped: Vec<usize> = exits.iter().filter(|e| e.stopped).map(|e| e.rank).collect();
    let mut msg = match blame::implicated(&exits, &v, &stopped) {
        Some(imp) => implicated_report(&imp, &v, &exits),
        None => report(&v, &exits),
    };
    if let Ok((dumps, _)) = recorder::read_dumps(&fr_dir) {
        msg.push_str(&format!(
            "\nflight recorder ({}; `tensorplay-fr {}` prints this again):\n{}",
            fr_dir.display(),
            fr_dir.display(),
            recorder::diagnose(&dumps).to_string().trim_end()
        ));
    }
    Err(msg)
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

/// The failure report: the root cause with its last lines, then the consequences.
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
    let own: Vec<String> = v
        .consequences
        .iter()
        .filter_map(|&r| find(r))
        .filter(|e| !e.stopped)
        .map(|e| {
            let last = e.message.lines().last().unwrap_or("").trim();
            format!("rank {} {} ({last})", e.rank, how(e))
        })
        .collect();
    if !own.is_empty() {
        out.push_str(&format!("\nthen, as a consequence: {}", own.join("; ")));
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

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tensorplay-run: {e}");
            ExitCode::FAILURE
        }
    }
}
