//! The program's command line (clap): `--steps`, `--seed`, `--sample`, `--plot`,
//! `--single-process`, `--threads`, `--dtype`, and one layout's run with checkpoints
//! (`--layout`, `--world`, `--checkpoint-dir`, `--checkpoint-every`, `--losses-out`), each
//! checked before any training starts.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Parser;
use clap::builder::TypedValueParser;
use tensorplay::DType;
use tensorplay_examples::gpt_checks::COMPARE_STEPS;
use tensorplay_examples::plot;

use crate::MAX_STEPS;

/// Trains a character-level GPT four times (three distributed runs and one process) from the same weights and batches.
#[derive(Parser, Debug)]
#[command(
    name = "gpt_distributed",
    about = "Trains a character-level GPT (4 layers, width 128, 4 heads, context 64) on \
             Shakespeare four times from the same weights and batches: tensor-parallel, \
             data-parallel and fully sharded on 2 ranks, then in one process. Prints each run's validation \
             loss (the single-process reference first) and, for the distributed runs, the largest difference from the \
             single-process losses over the first 100 steps (exit 1 if one reaches 1e-4, or 2e-2 \
             with --dtype bf16); then \
             the learning check and the memory check of the single-process run (from 600 steps \
             on; exit 1 if it did not learn or its resident memory grew by more than 10%), the \
             tensor memory, a sample of generated text and a timing table.",
    after_help = "Started by hand it starts its second rank itself; under tensorplay-run (or \
                  torchrun's, Slurm's or Open MPI's variables) it takes RANK and WORLD_SIZE=2 \
                  from the environment."
)]
pub(crate) struct Opts {
    /// Optimizer steps per run, 100 to 1000000; the warm-up is always 100 steps.
    #[arg(long, value_name = "N", default_value_t = 600, value_parser = parse_steps)]
    pub(crate) steps: usize,
    /// Seed of the initial weights, the batches and the sampling.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) seed: u64,
    /// Characters of generated text, 0 for none (at most 100000).
    #[arg(long, value_name = "CHARS", default_value_t = 300, value_parser = parse_sample)]
    pub(crate) sample: usize,
    /// Draw the loss curves into this SVG file.
    #[arg(long, value_name = "PATH.svg", value_parser = parse_plot, conflicts_with = "single_process")]
    pub(crate) plot: Option<PathBuf>,
    /// Train only the single-process run: no ranks started, nothing compared (the learning and
    /// memory checks still run; the benchmark `gpt_train_2_threads` times this).
    #[arg(long)]
    pub(crate) single_process: bool,
    /// Intra-op threads of the single-process run, 1 to 1024 (default: the cores of the
    /// process's affinity, `tp::set_num_threads`' rule); the distributed runs use one per rank.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub(crate) threads: Option<u16>,
    /// The compute dtype: float32, or bf16 (every run under autocast bfloat16 over float32
    /// master weights, the fully-sharded run with MixedPrecisionPolicy param bfloat16, reduce
    /// float32; the distributed runs' losses must then stay within 2e-2 of the single-process
    /// bfloat16 run's).
    #[arg(long, value_name = "DTYPE", default_value = "float32", value_parser = parse_dtype)]
    pub(crate) dtype: DType,
    /// Train only this layout (data-parallel, fully-sharded or tensor-parallel), at `--world`
    /// ranks, without the single-process reference or the comparisons; prints
    /// `<layout> at <N> ranks: validation loss V`.
    #[arg(long, value_name = "LAYOUT", value_parser = parse_layout, conflicts_with_all = ["single_process", "plot"])]
    pub(crate) layout: Option<Layout>,
    /// The ranks of `--layout`'s run, 1 to 16 (default: a launcher's WORLD_SIZE, else 2); it
    /// must divide the batch's 16 rows (tensor-parallel: the 4 heads).
    #[arg(long, value_name = "N", requires = "layout", value_parser = clap::value_parser!(u16).range(1..=16).map(usize::from))]
    pub(crate) world: Option<usize>,
    /// Save a checkpoint of `--layout`'s run into this folder every `--checkpoint-every`
    /// steps, and continue from the one it holds, if any (at any world size and layout).
    #[arg(long, value_name = "DIR", requires = "layout")]
    pub(crate) checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints, at least 1.
    #[arg(long, value_name = "K", default_value_t = 50, requires = "checkpoint_dir", value_parser = clap::value_parser!(u32).range(1..).map(|k| k as usize))]
    pub(crate) checkpoint_every: usize,
    /// Write `--layout`'s run's losses to this file as JSON: `{"layout", "world", "losses"
    /// (every step's), "val_loss"}`.
    #[arg(long, value_name = "PATH.json", requires = "layout")]
    pub(crate) losses_out: Option<PathBuf>,
}

/// A layout `--layout` runs alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    DataParallel,
    FullySharded,
    TensorParallel,
}

impl Layout {
    /// The run's name, as the job prints it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Layout::DataParallel => "data-parallel",
            Layout::FullySharded => "fully-sharded",
            Layout::TensorParallel => "tensor-parallel",
        }
    }
}

/// `--layout`: data-parallel, fully-sharded or tensor-parallel.
fn parse_layout(v: &str) -> Result<Layout, String> {
    [
        Layout::DataParallel,
        Layout::FullySharded,
        Layout::TensorParallel,
    ]
    .into_iter()
    .find(|l| l.name() == v)
    .ok_or_else(|| "expected data-parallel, fully-sharded or tensor-parallel".to_string())
}

impl Opts {
    /// Parses `argv` (the program's name first). A `--` is skipped: it ends a launcher's own
    /// options (`tensorplay-run ... gpt_distributed -- --steps 100` passes it on), and this
    /// program takes no positional arguments it could announce.
    pub(crate) fn try_parse_args<I, T>(argv: I) -> Result<Opts, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString>,
    {
        Opts::try_parse_from(argv.into_iter().map(Into::into).filter(|a| a != "--"))
    }
}

/// `--steps`: a whole number from the compared steps to `MAX_STEPS`.
fn parse_steps(v: &str) -> Result<usize, String> {
    let steps: usize = v.parse().map_err(|e| format!("bad --steps {v:?}: {e}"))?;
    if !(COMPARE_STEPS..=MAX_STEPS).contains(&steps) {
        return Err(format!(
            "expected {COMPARE_STEPS} (the compared steps) to {MAX_STEPS}"
        ));
    }
    Ok(steps)
}

/// `--dtype`: float32 (or f32) or bf16 (or bfloat16).
fn parse_dtype(v: &str) -> Result<DType, String> {
    match v {
        "float32" | "f32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        _ => Err("expected float32 or bf16".to_string()),
    }
}

/// `--sample`: at most 100000 characters.
fn parse_sample(v: &str) -> Result<usize, String> {
    let chars: usize = v.parse().map_err(|e| format!("bad --sample {v:?}: {e}"))?;
    if chars > 100_000 {
        return Err(format!(
            "--sample must be at most 100000 characters, got {v}"
        ));
    }
    Ok(chars)
}

/// `--plot`: a file name ending in `.svg` (checked before hours of training, not after).
fn parse_plot(v: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(v);
    plot::check_path(&p)?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// steps, seed, sample, plot, single_process, threads, dtype
    type Want = (
        usize,
        u64,
        usize,
        Option<&'static str>,
        bool,
        Option<u16>,
        DType,
    );

    /// One command line: the values it gives, or the words its refusal says.
    struct Case {
        args: &'static [&'static str],
        want: Result<Want, &'static str>,
    }

    fn check(case: &Case) {
        let argv = std::iter::once("gpt_distributed").chain(case.args.iter().copied());
        let got = Opts::try_parse_args(argv);
        match (&got, &case.want) {
            (Ok(o), Ok((steps, seed, sample, plot, single, threads, dtype))) => assert_eq!(
                (
                    o.steps,
                    o.seed,
                    o.sample,
                    o.plot.as_deref(),
                    o.single_process,
                    o.threads,
                    o.dtype
                ),
                (
                    *steps,
                    *seed,
                    *sample,
                    plot.map(std::path::Path::new),
                    *single,
                    *threads,
                    *dtype
                ),
                "{:?}",
                case.args
            ),
            (Err(e), Err(says)) => {
                let e = e.to_string();
                assert!(e.contains(says), "{:?}: {e}", case.args);
            }
            _ => panic!("{:?}: got {got:?}", case.args),
        }
    }

    /// One command line of the one-layout run: `(layout, world, checkpoint dir, every,
    /// losses file)`, or the words its refusal says.
    type LayoutWant = (
        Option<Layout>,
        Option<usize>,
        Option<&'static str>,
        usize,
        Option<&'static str>,
    );

    fn check_layout(args: &[&str], want: Result<LayoutWant, &str>) {
        let argv = std::iter::once("gpt_distributed").chain(args.iter().copied());
        match (Opts::try_parse_args(argv), want) {
            (Ok(o), Ok((layout, world, dir, every, losses))) => assert_eq!(
                (
                    o.layout,
                    o.world,
                    o.checkpoint_dir.as_deref(),
                    o.checkpoint_every,
                    o.losses_out.as_deref()
                ),
                (
                    layout,
                    world,
                    dir.map(std::path::Path::new),
                    every,
                    losses.map(std::path::Path::new)
                ),
                "{args:?}"
            ),
            (Err(e), Err(says)) => {
                let e = e.to_string();
                assert!(e.contains(says), "{args:?}: {e}");
            }
            (got, _) => panic!("{args:?}: got {got:?}"),
        }
    }

    #[test]
    fn one_layout_arguments_are_checked_up_front() {
        let fs = Some(Layout::FullySharded);
        let cases: [(&[&str], Result<LayoutWant, &str>); 12] = [
            (&[], Ok((None, None, None, 50, None))),
            (
                &["--layout", "fully-sharded"],
                Ok((fs, None, None, 50, None)),
            ),
            (
                &[
                    "--layout=data-parallel",
                    "--world",
                    "4",
                    "--checkpoint-dir",
                    "c",
                ],
                Ok((Some(Layout::DataParallel), Some(4), Some("c"), 50, None)),
            ),
            (
                &[
                    "--layout",
                    "tensor-parallel",
                    "--checkpoint-dir",
                    "c",
                    "--checkpoint-every",
                    "7",
                    "--losses-out",
                    "l.json",
                ],
                Ok((
                    Some(Layout::TensorParallel),
                    None,
                    Some("c"),
                    7,
                    Some("l.json"),
                )),
            ),
            (
                &["--layout", "pipeline"],
                Err("expected data-parallel, fully-sharded or tensor-parallel"),
            ),
            (&["--world", "2"], Err("--layout <LAYOUT>")),
            (&["--checkpoint-dir", "c"], Err("--layout <LAYOUT>")),
            (
                &["--layout", "fully-sharded", "--checkpoint-every", "5"],
                Err("--checkpoint-dir <DIR>"),
            ),
            (
                &["--layout", "fully-sharded", "--world", "0"],
                Err("0 is not in 1..=16"),
            ),
            (
                &["--layout", "fully-sharded", "--world", "17"],
                Err("17 is not in 1..=16"),
            ),
            (
                &[
                    "--layout",
                    "fully-sharded",
                    "--checkpoint-dir",
                    "c",
                    "--checkpoint-every",
                    "0",
                ],
                Err("0 is not in 1.."),
            ),
            (
                &["--layout", "fully-sharded", "--single-process"],
                Err("cannot be used with"),
            ),
        ];
        for (args, want) in cases {
            check_layout(args, want);
        }
    }

    #[test]
    fn arguments_are_checked_up_front() {
        let cases = [
            Case {
                args: &[],
                want: Ok((600, 0, 300, None, false, None, DType::F32)),
            },
            Case {
                args: &["--steps", "200", "--seed=3", "--sample", "0"],
                want: Ok((200, 3, 0, None, false, None, DType::F32)),
            },
            Case {
                args: &["--steps=100", "--sample", "200", "--plot", "loss.svg"],
                want: Ok((100, 0, 200, Some("loss.svg"), false, None, DType::F32)),
            },
            Case {
                args: &["--", "--steps", "100", "--seed", "7"],
                want: Ok((100, 7, 300, None, false, None, DType::F32)),
            },
            Case {
                args: &["--steps", "1000000"],
                want: Ok((1_000_000, 0, 300, None, false, None, DType::F32)),
            },
            Case {
                args: &["--steps", "99"],
                want: Err("expected 100 (the compared steps)"),
            },
            Case {
                args: &["--steps", "1000001"],
                want: Err(
                    "invalid value '1000001' for '--steps <N>': expected 100 (the compared steps) to 1000000",
                ),
            },
            Case {
                args: &["--steps", "x"],
                want: Err("bad --steps"),
            },
            Case {
                args: &["--seed"],
                want: Err("a value is required for '--seed <N>'"),
            },
            Case {
                args: &["--seed", "-1"],
                want: Err("unexpected argument '-1' found"),
            },
            Case {
                args: &["--seed", "x"],
                want: Err("invalid value 'x' for '--seed <N>'"),
            },
            Case {
                args: &["--sample", "100001"],
                want: Err("at most 100000"),
            },
            Case {
                args: &["--plot", ""],
                want: Err("file name"),
            },
            Case {
                args: &["--plot", "loss.png"],
                want: Err("ending in .svg"),
            },
            Case {
                args: &["--single-process", "--threads", "2", "--steps", "200"],
                want: Ok((200, 0, 300, None, true, Some(2), DType::F32)),
            },
            Case {
                args: &["--threads", "0"],
                want: Err("0 is not in 1..=1024"),
            },
            Case {
                args: &["--single-process", "--plot", "loss.svg"],
                want: Err("cannot be used with"),
            },
            Case {
                args: &["--dtype", "bf16", "--steps", "100"],
                want: Ok((100, 0, 300, None, false, None, DType::BF16)),
            },
            Case {
                args: &["--dtype=bfloat16", "--single-process"],
                want: Ok((600, 0, 300, None, true, None, DType::BF16)),
            },
            Case {
                args: &["--dtype", "float16"],
                want: Err("expected float32 or bf16"),
            },
            Case {
                args: &["--bogus"],
                want: Err("unexpected argument '--bogus'"),
            },
            Case {
                args: &["--step", "200"],
                want: Err("a similar argument exists: '--steps'"),
            },
        ];
        for case in &cases {
            check(case);
        }
    }
}
