//! `tensorplay-run`: starts the processes of a distributed job on this node, as `torchrun` does.
//!
//! ```text
//! tensorplay-run --nproc-per-node 2 target/release/examples/wine_distributed
//! tensorplay-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \
//!     --nproc-per-node 4 ./train -- --epochs 10
//! ```
//!
//! Each child gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` (the `env://` rendezvous of process groups and RPC) and
//! `TENSORPLAY_RUN=1`. Every line a child prints is prefixed with `[rank N] `. Ctrl-C, SIGTERM
//! and SIGHUP (a scheduler, `timeout`, `docker stop`, a closed terminal) are forwarded to the
//! children as SIGINT, and the launcher waits for them. When a child fails
//! (non-zero exit or a signal), the others are sent SIGTERM (then SIGKILL after
//! `--kill-grace` seconds) and the launcher exits non-zero, naming the rank and the reason.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;

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
    /// Nodes in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index in 0..nnodes.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of the node that runs rank 0 (it hosts the store).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the store on the master node; by default a free port (one node only).
    #[arg(long)]
    master_port: Option<u16>,
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

fn forward(
    rank: usize,
    from: impl Read + Send + 'static,
    to_stderr: bool,
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

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => format!("was killed by signal {s}"),
        _ => "ended".into(),
    }
}

fn run(args: Args) -> Result<(), String> {
    if args.nproc_per_node == 0 || args.nnodes == 0 {
        return Err("--nproc-per-node and --nnodes must be at least 1".into());
    }
    if args.node_rank >= args.nnodes {
        return Err(format!(
            "--node-rank {} is outside 0..{} (--nnodes)",
            args.node_rank, args.nnodes
        ));
    }
    let port = match args.master_port {
        Some(p) => p,
        None if args.nnodes == 1 => TcpListener::bind((args.master_addr.as_str(), 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| format!("finding a free port on {}: {e}", args.master_addr))?,
        None => return Err("--master-port is required with several nodes".into()),
    };
    let world = args.nnodes * args.nproc_per_node;
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
            .map_err(|e| format!("installing the SIGINT/SIGTERM/SIGHUP handler: {e}"))?;
    }
    let mut children: Vec<(usize, Child)> = Vec::new();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let mut streams = 0usize;
    for local in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local;
        let mut cmd = Command::new(&args.command[0]);
        cmd.args(&args.command[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("MASTER_ADDR", &args.master_addr)
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
            forward(rank, o, false, done_tx.clone());
            streams += 1;
        }
        if let Some(e) = child.stderr.take() {
            forward(rank, e, true, done_tx.clone());
            streams += 1;
        }
        children.push((rank, child));
    }
    let mut failure: Option<String> = None;
    let mut forwarded = false;
    let mut stop_sent: Option<Instant> = None;
    let mut running: Vec<(usize, Child)> = children;
    while !running.is_empty() {
        if interrupted.load(Ordering::SeqCst) && !forwarded {
            forwarded = true;
            for (_, c) in &running {
                signal(c, libc::SIGINT);
            }
            failure.get_or_insert_with(|| {
                "interrupted (SIGINT, SIGTERM or SIGHUP; forwarded to every rank as SIGINT)".into()
            });
            // SIGINT is the stop signal here: SIGKILL follows after the grace period
            stop_sent = Some(Instant::now());
        }
        let mut still = Vec::with_capacity(running.len());
        for (rank, mut c) in running {
            match c.try_wait() {
                Ok(Some(status)) if status.success() => {}
                Ok(Some(status)) => {
                    if failure.is_none() {
                        failure = Some(format!("rank {rank} {}", describe(status)));
                    }
                }
                Ok(None) => still.push((rank, c)),
                Err(e) => {
                    failure.get_or_insert_with(|| format!("waiting for rank {rank}: {e}"));
                }
            }
        }
        running = still;
        if failure.is_some() && !running.is_empty() {
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
        std::thread::sleep(Duration::from_millis(20));
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
    match failure {
        Some(f) => Err(f),
        None => Ok(()),
    }
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
