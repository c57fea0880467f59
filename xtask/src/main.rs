//! `cargo xtask <command>`: project automation. This file is the command line only; each
//! command lives in its own module:
//!
//! | command | module |
//! |---|---|
//! | `test-multigpu` | `test_multigpu.rs`: multi-rank scenarios and GPU tests, discovered from the test binaries |
//! | `test-multihost` | `multihost/`: simulated hosts in network namespaces (needs root) |
//! | `test-mpi` | `test_mpi.rs`: the `"mpi"` backend under `mpirun` (installs Open MPI when missing; needs root) |
//! | `test-resume` | `resume.rs`: the main job killed and restarted by `tensorplay-run`; `resume_gpt.rs`: the GPT resumed at other world sizes |
//! | `bench-core` | `bench/core.rs`: MLP step, matmul and GPT step beside PyTorch |
//! | `bench-ddp` | `bench/ddp.rs`: a DDP training step beside PyTorch DDP over gloo |
//! | `bench-fsdp` | `bench/fsdp.rs`: a fully sharded GPT training step beside PyTorch FSDP2 over gloo |
//! | `bench-checkpoint` | `bench/checkpoint.rs`: distributed checkpoints of the fully sharded GPT beside PyTorch's DCP |
//! | `bench-rpc` | `bench/rpc.rs`: RPC latency, rate and echo beside TensorPipe |
//! | `bench-collectives` | `bench/collectives.rs`: collective bandwidth beside gloo |
//! | `conformance` | `conformance.rs`: a conformance vectors file |
//! | `check-kernels` | `check_kernels.rs`: the CUDA kernels without a GPU |
//! | `check-docs` | `check_docs.rs`: the rendered facade docs |
//! | `gpu-check` | `gpu_check.rs`: the GPU check bundle |
//!
//! The benchmarks share `bench/` (the CPU line, the anchors' folder, the output parsers and
//! the summary table); `packages.rs` names the package of each binary the commands build.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod check_docs;
mod check_kernels;
mod conformance;
mod gpu_check;
mod multihost;
mod packages;
mod process;
mod resume;
mod resume_gpt;
mod test_mpi;
mod test_multigpu;

#[derive(Parser)]
#[command(name = "xtask", about = "tensorplay project automation")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Multi-rank test scenarios and the GPU tests, discovered from the test binaries (the
    /// tests of `multiprocess` targets; the tests ignored as "needs GPUs", run once per GPU
    /// count), then the differentiable collectives' suites; ends with `N passed, M failed, K
    /// not run (no GPU)`. Fails without GPUs unless `--cpu-only`.
    TestMultigpu(test_multigpu::Args),
    /// Multi-host scenarios: K simulated hosts on this machine (network, mount and UTS
    /// namespaces, veth pairs to a bridge, private addresses inside the namespaces only), the
    /// project's multi-process tests and the main job started by `tensorplay-run --nnodes K` on
    /// each; ends with `N passed, M failed`. Needs root.
    TestMultihost {
        /// Only the scenarios whose name contains this.
        #[arg(long)]
        filter: Option<String>,
    },
    /// The main job killed and restarted: `tensorplay-run --max-restarts 2` runs
    /// `wine_distributed` with checkpoints while a rank SIGKILLs itself once, in each run in
    /// turn; the result lines must equal an uninterrupted job's.
    TestResume,
    /// The `"mpi"` backend: installs Debian's Open MPI when missing (needs root), builds
    /// `tensorplay-mpi` with its `mpi` feature, runs its tests as a singleton and under
    /// `mpirun -np 2`, `3` and `4`, then a rank past the timeout (exit code 124 and the
    /// watchdog's report) and a killed rank (the job ends); ends with `N passed, M failed`.
    TestMpi,
    /// Collective bandwidth (2 ranks, 4 KiB to 64 MiB) next to PyTorch gloo's.
    BenchCollectives(bench::collectives::Args),
    /// DistributedDataParallel training step (MLP 784-hidden-hidden-hidden-10, batch 32 per
    /// rank) next to PyTorch DDP over gloo: local step, DDP step, overhead and their ratios.
    BenchDdp(bench::ddp::Args),
    /// Fully sharded GPT training step (8 blocks of width 256, batch 8 per rank) next to
    /// PyTorch's FSDP2 over gloo: step time, state bytes per rank, and against our own DDP.
    BenchFsdp(bench::fsdp::Args),
    /// Distributed checkpoints of the fully sharded GPT (8 blocks of width 768) with its AdamW
    /// state next to PyTorch's DCP over gloo: save and load throughput, async save's blocking.
    BenchCheckpoint(bench::checkpoint::Args),
    /// Pipelined GPT training step (8 blocks of width 256, 2 stages, batch 16 in 4
    /// micro-batches) next to PyTorch's pipelining over gloo: GPipe and 1F1B steps, the
    /// measured bubble against the schedule's theory, interleaved and zero bubble against 1F1B.
    BenchPp(bench::pp::Args),
    /// Runs a conformance vectors file against the differentiable collectives (one world of
    /// processes per world size in the file); ends with `N passed, M failed`.
    Conformance(conformance::Args),
    /// Core benchmark side by side with PyTorch (MLP training step, f32 matmul GFLOP/s, the
    /// GPT training step).
    BenchCore(bench::core::Args),
    /// RPC latency, calls/s and tensor echo throughput (2 workers on 127.0.0.1) next to
    /// PyTorch's TensorPipe.
    BenchRpc(bench::rpc::Args),
    /// The CUDA kernels without a GPU: their host emulation against the CPU's operations, then
    /// NVRTC and ptxas of CUDA 12.9 and 13.5 (NVIDIA's PyPI wheels, fetched once into
    /// `target/nvidia-wheels`) compile and assemble every kernel for sm_80 and sm_90 (12.9), sm_90 and sm_100 (13.5).
    CheckKernels,
    /// Checks the rendered facade docs (`target/doc/tensorplay/`, from `cargo doc --workspace
    /// --no-deps`): no example names an internal crate, no prose shows a broken
    /// `[tensorplay_...` link.
    CheckDocs,
    /// The GPU check: builds `tensorplay-gpu-check` and a `run.sh` into `--bundle DIR` (under
    /// 64 MiB, no toolchain needed where it runs), or builds and runs it here. Without a GPU it
    /// says so and fails; it never reports checks that did not run as passed.
    GpuCheck(gpu_check::Args),
}

fn main() -> ExitCode {
    let r = match Cli::parse().command {
        Cmd::TestMultigpu(a) => test_multigpu::run(&a),
        Cmd::TestMultihost { filter } => multihost::test_multihost(filter.as_deref()),
        Cmd::TestResume => resume::test_resume(),
        Cmd::TestMpi => test_mpi::test_mpi(),
        Cmd::BenchCollectives(a) => bench::collectives::run(&a),
        Cmd::BenchDdp(a) => bench::ddp::run(&a),
        Cmd::BenchFsdp(a) => bench::fsdp::run(&a),
        Cmd::BenchCheckpoint(a) => bench::checkpoint::run(&a),
        Cmd::BenchPp(a) => bench::pp::run(&a),
        Cmd::Conformance(a) => conformance::run(&a),
        Cmd::BenchCore(a) => bench::core::run(&a),
        Cmd::BenchRpc(a) => bench::rpc::run(&a),
        Cmd::CheckDocs => check_docs::check_docs(),
        Cmd::CheckKernels => check_kernels::run(),
        Cmd::GpuCheck(a) => gpu_check::run(&a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
