//! The launcher's command line: its flags (with torchrun's spellings as aliases), then the
//! program and the program's own arguments, passed on untouched.
//!
//! A flag before the program that the launcher does not know is refused by clap with a hint
//! naming the closest flag (never taken for the program); everything from the program on is
//! the program's, flags included (`tensorplay-run ./train --epochs 10`), and a `--` before the
//! program ends the launcher's flags (`tensorplay-run -- ./train`).

use std::time::Duration;

use clap::Parser;

/// Starts the processes of a distributed tensorplay job on this node (like `torchrun`).
#[derive(Parser, Debug)]
#[command(
    name = "tensorplay-run",
    version,
    about = "Start N processes of a program with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, \
             MASTER_ADDR and MASTER_PORT set (the env:// rendezvous), like torchrun. Exits 1 when \
             a rank fails, naming it; with --max-restarts, starts them again first.",
    after_help = "torchrun's spellings are accepted too: --nproc_per_node, --nnodes, \
                  --node_rank, --master_addr, --master_port, --rdzv_endpoint, --max_restarts, \
                  --standalone. Everything after PROGRAM is the program's, flags included."
)]
pub(crate) struct Args {
    /// Processes to start on this node (one per GPU, typically).
    #[arg(
        long,
        visible_alias = "nproc_per_node",
        value_name = "N",
        default_value_t = 1
    )]
    pub(crate) nproc_per_node: usize,
    /// Nodes in the job: N, or MIN:MAX for an elastic job (rounds of MIN to MAX nodes, node
    /// ranks given by the launchers' rendezvous). Default: `SLURM_NNODES` or
    /// `OMPI_COMM_WORLD_SIZE` under `srun` or `mpirun` with one launcher per node, else 1.
    #[arg(long, value_name = "N|MIN:MAX")]
    pub(crate) nnodes: Option<String>,
    /// This node's index in 0..nnodes (default: `SLURM_NODEID` or `OMPI_COMM_WORLD_RANK`,
    /// else 0). Refused with an elastic --nnodes MIN:MAX.
    #[arg(long, visible_alias = "node_rank", value_name = "RANK")]
    pub(crate) node_rank: Option<usize>,
    /// Address of the node that runs rank 0 (it hosts the store). Default: `127.0.0.1`; under
    /// Slurm `MASTER_ADDR` or the first host of `SLURM_JOB_NODELIST`; under Open MPI
    /// `MASTER_ADDR`. With several nodes and restarts, or elastic: where the launchers'
    /// rendezvous store is (the children get another port, and node rank 0's address).
    #[arg(long, visible_alias = "master_addr", value_name = "HOST")]
    pub(crate) master_addr: Option<String>,
    /// Port of the store on the master node. Default: a free port (one node only); under
    /// Slurm `MASTER_PORT` or 20000 + `SLURM_JOB_ID` % 20000; under Open MPI `MASTER_PORT` or
    /// 29500. 1 to 65535 (0 would leave the ranks no port to find the store at).
    #[arg(
        long,
        visible_alias = "master_port",
        value_name = "PORT",
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    pub(crate) master_port: Option<u16>,
    /// The master's `HOST[:PORT]` in one flag, as torchrun spells it (port 29400 when absent;
    /// IPv6 in brackets). Instead of --master-addr and --master-port.
    #[arg(long, visible_alias = "rdzv_endpoint", value_name = "HOST[:PORT]")]
    pub(crate) rdzv_endpoint: Option<String>,
    /// A single-node job on a free local port, as torchrun's --standalone: one node, master
    /// 127.0.0.1, and a scheduler's variables (Slurm, Open MPI) are not read.
    #[arg(long, conflicts_with_all = ["node_rank", "master_addr", "master_port", "rdzv_endpoint"])]
    pub(crate) standalone: bool,
    /// Seconds between SIGTERM and SIGKILL when the children are stopped.
    #[arg(long, value_name = "SECONDS", default_value_t = 5)]
    pub(crate) kill_grace: u64,
    /// How many times the local group is started again after a rank failed (a new round for
    /// every node of the job). Interrupts never restart; an elastic membership change does
    /// not count.
    #[arg(
        long,
        visible_alias = "max_restarts",
        value_name = "N",
        default_value_t = 0
    )]
    pub(crate) max_restarts: usize,
    /// Seconds a round of the launchers' rendezvous waits for at least MIN nodes (and a
    /// launcher waits for a round with room) before the job fails.
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0)]
    pub(crate) rdzv_timeout: f64,
    /// Seconds an elastic round waits for more nodes once MIN have joined (it closes at once
    /// when MAX have).
    #[arg(long, value_name = "SECONDS", default_value_t = 3.0)]
    pub(crate) rdzv_last_call: f64,
    /// The program to run, then its arguments: everything after the program is passed to it
    /// untouched, flags included.
    #[arg(
        required = true,
        trailing_var_arg = true,
        value_name = "PROGRAM [ARGS]"
    )]
    pub(crate) command: Vec<String>,
}

/// `v` seconds of `flag` (a finite number, above 0 unless `zero_ok`).
pub(crate) fn seconds(flag: &str, v: f64, zero_ok: bool) -> Result<Duration, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A command line and what it parses to: `Ok(the flags' values (nproc, nnodes, node
    /// rank, master, max restarts, standalone), the program's words)`, or the words of
    /// clap's refusal.
    struct Case {
        argv: &'static [&'static str],
        want: Result<(Parsed, &'static [&'static str]), &'static str>,
    }

    type Parsed = (
        usize,
        Option<&'static str>,
        Option<usize>,
        Master,
        usize,
        bool,
    );
    type Master = (Option<&'static str>, Option<u16>, Option<&'static str>);

    fn check(case: &Case) {
        let got = Args::try_parse_from(
            std::iter::once("tensorplay-run").chain(case.argv.iter().copied()),
        );
        match (&got, &case.want) {
            (Ok(a), Ok((flags, command))) => {
                let master = (
                    a.master_addr.as_deref(),
                    a.master_port,
                    a.rdzv_endpoint.as_deref(),
                );
                let parsed = (
                    a.nproc_per_node,
                    a.nnodes.as_deref(),
                    a.node_rank,
                    master,
                    a.max_restarts,
                    a.standalone,
                );
                assert_eq!(
                    (&parsed, &a.command[..]),
                    (
                        flags,
                        &command.iter().map(|s| s.to_string()).collect::<Vec<_>>()[..]
                    ),
                    "{:?}",
                    case.argv
                );
            }
            (Err(e), Err(says)) => {
                let e = e.to_string();
                assert!(e.contains(says), "{:?}: {e}", case.argv);
            }
            _ => panic!("{:?}: got {got:?}", case.argv),
        }
    }

    const NONE: Master = (None, None, None);

    #[test]
    fn flags_aliases_and_the_program() {
        let cases = [
            // today's spellings
            Case {
                argv: &[
                    "--nproc-per-node",
                    "2",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    "1",
                    "--master-addr",
                    "10.0.0.1",
                    "--master-port",
                    "29500",
                    "--max-restarts",
                    "3",
                    "./train",
                    "--epochs",
                    "10",
                ],
                want: Ok((
                    (
                        2,
                        Some("2"),
                        Some(1),
                        (Some("10.0.0.1"), Some(29500), None),
                        3,
                        false,
                    ),
                    &["./train", "--epochs", "10"],
                )),
            },
            // torchrun's spellings
            Case {
                argv: &[
                    "--nproc_per_node",
                    "2",
                    "--nnodes",
                    "2",
                    "--node_rank",
                    "1",
                    "--master_addr",
                    "10.0.0.1",
                    "--master_port",
                    "29500",
                    "--max_restarts",
                    "3",
                    "./train",
                ],
                want: Ok((
                    (
                        2,
                        Some("2"),
                        Some(1),
                        (Some("10.0.0.1"), Some(29500), None),
                        3,
                        false,
                    ),
                    &["./train"],
                )),
            },
            Case {
                argv: &[
                    "--nproc_per_node=4",
                    "--nnodes=1:2",
                    "--rdzv_endpoint=h:29400",
                    "train.sh",
                ],
                want: Ok((
                    (
                        4,
                        Some("1:2"),
                        None,
                        (None, None, Some("h:29400")),
                        0,
                        false,
                    ),
                    &["train.sh"],
                )),
            },
            Case {
                argv: &[
                    "--standalone",
                    "--nnodes=1",
                    "--nproc_per_node=2",
                    "./train",
                ],
                want: Ok(((2, Some("1"), None, NONE, 0, true), &["./train"])),
            },
            // everything after the program is the program's, the launcher's flags included
            Case {
                argv: &["./train", "--nproc-per-node", "3", "--bogus", "-x"],
                want: Ok((
                    (1, None, None, NONE, 0, false),
                    &["./train", "--nproc-per-node", "3", "--bogus", "-x"],
                )),
            },
            Case {
                argv: &["./train", "--", "--steps", "100"],
                want: Ok((
                    (1, None, None, NONE, 0, false),
                    &["./train", "--", "--steps", "100"],
                )),
            },
            // `--` ends the launcher's flags
            Case {
                argv: &["--nproc-per-node", "2", "--", "./train", "--steps"],
                want: Ok(((2, None, None, NONE, 0, false), &["./train", "--steps"])),
            },
            // an unknown flag before the program is refused, with the closest flag
            Case {
                argv: &["--nproc-per-nod", "2", "./train"],
                want: Err(
                    "unexpected argument '--nproc-per-nod' found\n\n  tip: a similar argument exists: '--nproc-per-node'",
                ),
            },
            Case {
                argv: &["--master-adr", "h", "./train"],
                want: Err("a similar argument exists: '--master-addr'"),
            },
            Case {
                argv: &["--bogus", "./train"],
                want: Err("unexpected argument '--bogus' found"),
            },
            // clap's messages for bad values and missing pieces
            Case {
                argv: &["--nproc-per-node", "two", "./train"],
                want: Err("invalid value 'two' for '--nproc-per-node <N>'"),
            },
            Case {
                argv: &["--master-port", "70000", "./train"],
                want: Err("invalid value '70000' for '--master-port <PORT>'"),
            },
            Case {
                argv: &["--master_port", "0", "./train"],
                want: Err("invalid value '0' for '--master-port <PORT>'"),
            },
            Case {
                argv: &["--nproc-per-node", "2"],
                want: Err("the following required arguments were not provided"),
            },
            Case {
                argv: &["--standalone", "--master-port", "29500", "./train"],
                want: Err("'--standalone' cannot be used with '--master-port <PORT>'"),
            },
        ];
        for case in &cases {
            check(case);
        }
    }
}
