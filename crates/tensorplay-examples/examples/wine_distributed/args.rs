//! The command line (clap): `--seed`, `--epochs`, `--plot`, `--checkpoint-dir`,
//! `--checkpoint-every`, each also as `--flag=value`; a bare `--` (the end of a launcher's own
//! options, `tensorplay-run ... wine_distributed -- ...`) is skipped wherever it stands.

use std::path::PathBuf;

use clap::Parser;
use tensorplay as tp;
use tensorplay_examples::plot;
use tensorplay_examples::resume::Checkpoints;

use crate::MAX_EPOCHS;

/// Steps between checkpoints when `--checkpoint-dir` is given without `--checkpoint-every`.
const DEFAULT_CHECKPOINT_EVERY: usize = 100;

/// The red-wine MLP trained three ways across two workers (tensor-parallel, parameter-server,
/// data-parallel), each checked against one process.
#[derive(Parser, Debug)]
#[command(name = "wine_distributed")]
pub(crate) struct Args {
    /// The seed of the initial weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Epochs of every run.
    #[arg(long, default_value_t = 200, value_parser = epochs)]
    epochs: usize,
    /// Draw the loss curves into this SVG file (checked before the training).
    #[arg(long, value_name = "PATH.svg", value_parser = plot_path)]
    plot: Option<PathBuf>,
    /// Write checkpoints to (and resume from) this folder.
    #[arg(long, value_name = "DIR", value_parser = folder)]
    checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints (default 100).
    #[arg(long, value_name = "STEPS", requires = "checkpoint_dir", value_parser = steps)]
    checkpoint_every: Option<usize>,
}

fn epochs(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    if n == 0 || n > MAX_EPOCHS {
        return Err(format!("must be from 1 to {MAX_EPOCHS}"));
    }
    Ok(n)
}

fn steps(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    if n == 0 {
        return Err("must be at least 1 (steps)".into());
    }
    Ok(n)
}

fn plot_path(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    plot::check_path(&p)?;
    Ok(p)
}

fn folder(s: &str) -> Result<PathBuf, String> {
    if s.is_empty() {
        return Err("needs a folder".into());
    }
    Ok(PathBuf::from(s))
}

/// The options of a run, checked.
pub(crate) struct Opts {
    pub(crate) seed: u64,
    pub(crate) epochs: usize,
    pub(crate) plot: Option<PathBuf>,
    pub(crate) checkpoint: Option<Checkpoints>,
}

/// Parses `args` (the program's name first), skipping bare `--`: clap's error on bad input.
pub(crate) fn parse_from<I: IntoIterator<Item = String>>(args: I) -> Result<Args, clap::Error> {
    let mut args = args.into_iter();
    let program = args.next();
    Args::try_parse_from(program.into_iter().chain(args.filter(|a| a != "--")))
}

/// Reads the command line: `--help` prints the generated help and exits 0, bad input exits 2
/// with clap's message; then the checkpoint folder is made (or checked to hold this
/// configuration's checkpoints).
pub(crate) fn parse() -> Result<Opts, String> {
    let a = parse_from(std::env::args()).unwrap_or_else(|e| e.exit());
    let o = Opts {
        seed: a.seed,
        epochs: a.epochs,
        plot: a.plot,
        checkpoint: a.checkpoint_dir.map(|dir| Checkpoints {
            dir,
            every: a.checkpoint_every.unwrap_or(DEFAULT_CHECKPOINT_EVERY),
        }),
    };
    if let Some(c) = &o.checkpoint {
        std::fs::create_dir_all(&c.dir).map_err(|e| {
            format!(
                "--checkpoint-dir {}: cannot create it: {e}",
                c.dir.display()
            )
        })?;
        // a folder holds the checkpoints of one configuration
        let config = format!("--seed {} --epochs {}", o.seed, o.epochs);
        let f = c.dir.join("config.txt");
        match std::fs::read_to_string(&f) {
            Ok(saved) if saved.trim() != config => {
                return Err(format!(
                    "--checkpoint-dir {} holds the checkpoints of `{}`, not `{config}`: use another folder",
                    c.dir.display(),
                    saved.trim()
                ));
            }
            Ok(_) => {}
            Err(_) => {
                tp::serialize::write_atomically(&f, config.as_bytes()).map_err(|e| e.to_string())?
            }
        }
    }
    Ok(o)
}
