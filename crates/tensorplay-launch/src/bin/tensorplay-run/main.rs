//! `tensorplay-run`: starts the processes of a distributed job on this node, as `torchrun` does.
//!
//! ```text
//! tensorplay-run --nproc-per-node 2 target/release/examples/wine_distributed
//! tensorplay-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \
//!     --nproc-per-node 4 ./train -- --epochs 10
//! tensorplay-run --nnodes 2 --node-rank 1 --rdzv-endpoint 10.0.0.1:29500 --nproc-per-node 4 ./train
//! tensorplay-run --standalone --nproc_per_node=4 ./train      # torchrun's spellings work too
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
//! The files: `args.rs` the command line, `group.rs` runs and watches one round of the local
//! children, `rounds.rs` the rounds of a job, `elastic/` the launchers' rendezvous, `node.rs`
//! this node's place.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

mod args;
mod elastic;
mod group;
mod node;
mod rounds;

use args::{Args, seconds};
use clap::Parser;
use node::Nodes;

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
    if args.standalone && !matches!(nodes, None | Some(Nodes::Fixed(1))) {
        return Err(format!(
            "--standalone runs a single-node job: drop --nnodes {} (or give --nnodes 1)",
            args.nnodes.as_deref().unwrap_or_default()
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
    let node = if args.standalone {
        // torchrun's --standalone: one node on this host, a free port; a scheduler's
        // variables are not read (clap refused the flags that would place the node)
        let one = node::Flags {
            nnodes: Some(1),
            node_rank: Some(0),
            ..flags
        };
        node::resolve(&one, &|_| None)?
    } else {
        node::resolve(&flags, &|v| std::env::var(v).ok())?
    };
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
