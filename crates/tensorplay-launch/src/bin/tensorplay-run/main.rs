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
//!
//! With `--max-restarts N` a failed local group is started again (a new round, a new
//! `MASTER_PORT`, `TENSORPLAY_RESTART_COUNT` one higher) up to N times; with several nodes the
//! launchers restart together through their own rendezvous, which also runs elastic jobs
//! (`--nnodes MIN:MAX`). See `docs/restarts.md`.
//!
//! The files: `group.rs` runs and watches one round of the local children, `rounds.rs` the
//! rounds of a job, `elastic.rs` the launchers' rendezvous, `node.rs` this node's place.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

mod elastic;
mod group;
mod node;
mod rounds;

use clap::Parser;
use node::Nodes;

/// Starts the processes of a distributed tensorplay job on this node (like `torchrun`).
#[derive(Parser, Debug)]
#[command(
    name = "tensorplay-run",
    version,
    about = "Start N processes of a program with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, \
             MASTER_ADDR and MASTER_PORT set (the env:// rendezvous), like torchrun. Exits 1 when \
             a rank fails, naming it; with --max-restarts, starts them again first."
)]
struct Args {
    /// Processes to start on this node (one per GPU, typically).
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// Nodes in the job: N, or MIN:MAX for an elastic job (rounds of MIN to MAX nodes, node
    /// ranks given by the launchers' rendezvous). Default: `SLURM_NNODES` or
    /// `OMPI_COMM_WORLD_SIZE` under `srun` or `mpirun` with one launcher per node, else 1.
    #[arg(long)]
    nnodes: Option<String>,
    /// This node's index in 0..nnodes (default: `SLURM_NODEID` or `OMPI_COMM_WORLD_RANK`,
    /// else 0). Refused with an elastic --nnodes MIN:MAX.
    #[arg(long)]
    node_rank: Option<usize>,
    /// Address of the node that runs rank 0 (it hosts the store). Default: `127.0.0.1`; under
    /// Slurm `MASTER_ADDR` or the first host of `SLURM_JOB_NODELIST`; under Open MPI
    /// `MASTER_ADDR`. With several nodes and restarts, or elastic: where the launchers'
    /// rendezvous store is (the children get another port, and node rank 0's address).
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
    /// Seconds between SIGTERM and SIGKILL when the children are stopped.
    #[arg(long, default_value_t = 5)]
    kill_grace: u64,
    /// How many times the local group is started again after a rank failed (a new round for
    /// every node of the job). Interrupts never restart; an elastic membership change does
    /// not count.
    #[arg(long, default_value_t = 0)]
    max_restarts: usize,
    /// Seconds a round of the launchers' rendezvous waits for at least MIN nodes (and a
    /// launcher waits for a round with room) before the job fails.
    #[arg(long, default_value_t = 60.0)]
    rdzv_timeout: f64,
    /// Seconds an elastic round waits for more nodes once MIN have joined (it closes at once
    /// when MAX have).
    #[arg(long, default_value_t = 3.0)]
    rdzv_last_call: f64,
    /// The program to run, then its arguments (after `--` if they start with `-`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

/// `v` seconds of `flag` (a finite number, above 0 unless `zero_ok`).
fn seconds(flag: &str, v: f64, zero_ok: bool) -> Result<Duration, String> {
    let ok = v > 0.0 || (zero_ok && v == 0.0);
    let expected = if zero_ok { "0 or more" } else { "more than 0" };
    if !ok {
        return Err(format!("{flag} {v}: expected {expected} seconds"));
    }
    // a day at most: infinite or astronomically long waits are typing errors, and would
    // overflow the deadlines computed from them
    const MAX_SECS: f64 = 86_400.0;
    if v > MAX_SECS {
        return Err(format!(
            "{flag} {v}: expected at most {MAX_SECS} seconds (a day)"
        ));
    }
    Duration::try_from_secs_f64(v).map_err(|_| format!("{flag} {v}: expected {expected} seconds"))
}

fn run(args: Args) -> Result<(), String> {
    let nodes = args.nnodes.as_deref().map(node::parse_nnodes).transpose()?;
    let elastic = match nodes {
        Some(Nodes::Elastic { min, max }) => Some((min, max)),
        _ => None,
    };
    if elastic.is_some() && args.node_rank.is_some() {
        return Err(
            "--node-rank is not used with an elastic --nnodes MIN:MAX: the launchers' rendezvous numbers the nodes of each round (drop --node-rank)"
                .into(),
        );
    }
    let timeout = seconds("--rdzv-timeout", args.rdzv_timeout, false)?;
    let last_call = seconds("--rdzv-last-call", args.rdzv_last_call, true)?;
    // (only an elastic round of MIN < MAX nodes waits for a last call)
    if elastic.is_some_and(|(min, max)| min < max) && last_call >= timeout {
        return Err(format!(
            "--rdzv-last-call {} must be shorter than --rdzv-timeout {}: a round waits for the last \
             call within the timeout",
            args.rdzv_last_call, args.rdzv_timeout
        ));
    }
    let flags = node::Flags {
        nnodes: match nodes {
            Some(Nodes::Fixed(n)) => Some(n),
            Some(Nodes::Elastic { max, .. }) => Some(max),
            None => None,
        },
        // elastic: the rendezvous numbers the nodes (a scheduler's node rank is not used)
        node_rank: if elastic.is_some() {
            Some(0)
        } else {
            args.node_rank
        },
        master_addr: args.master_addr.clone(),
        master_port: args.master_port,
        rdzv_endpoint: args.rdzv_endpoint.clone(),
    };
    let node = node::resolve(&flags, &|v| std::env::var(v).ok())?;
    if args.nproc_per_node == 0 || node.nnodes == 0 {
        return Err("--nproc-per-node and --nnodes must be at least 1".into());
    }
    // the launchers meet in their own rendezvous when they must restart together, or when
    // the job is elastic; else (no restarts, or one node) the children use the master directly
    let launchers = match elastic {
        Some((_, max)) => max > 1,
        None => node.nnodes > 1 && args.max_restarts > 0,
    };
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
        match elastic {
            Some((min, max)) => eprintln!(
                "tensorplay-run: under {s}: an elastic node ({min} to {max} nodes), rendezvous {}:{port}",
                node.master_addr
            ),
            None => eprintln!(
                "tensorplay-run: under {s}: node {} of {}, master {}:{port}",
                node.node_rank, node.nnodes, node.master_addr
            ),
        }
    }
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
            .map_err(|e| format!("installing the SIGINT/SIGTERM/SIGHUP handler: {e}"))?;
    }
    let job = rounds::Job {
        command: &args.command,
        nproc: args.nproc_per_node,
        kill_grace: Duration::from_secs(args.kill_grace),
        max_restarts: args.max_restarts,
        interrupted: &interrupted,
    };
    if !launchers {
        return rounds::local(&job, node.nnodes, node.node_rank, &node.master_addr, port);
    }
    let (min, max) = elastic.unwrap_or((node.nnodes, node.nnodes));
    let cfg = elastic::Config {
        min,
        max,
        elastic: elastic.is_some(),
        fixed_rank: elastic.is_none().then_some(node.node_rank),
        last_call,
        timeout,
        max_restarts: args.max_restarts,
        shape: format!(
            "--nnodes {} --nproc-per-node {} --max-restarts {}",
            if elastic.is_some() {
                format!("{min}:{max}")
            } else {
                min.to_string()
            },
            args.nproc_per_node,
            args.max_restarts
        ),
    };
    let l = elastic::Launchers::connect(&node.master_addr, port, cfg)?;
    rounds::with_launchers(&job, l)
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
