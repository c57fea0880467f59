//! Where PyTorch's anchor scripts and interpreter are: the flags every bench command (and
//! `gpu-check`'s bundle) shares.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The default anchors' folder, relative to the directory `cargo xtask` runs in (the checkout
/// sits next to the shared folder).
pub(crate) const DEFAULT_ANCHORS: &str = "../shared/anchors";

/// The anchors' folder and PyTorch's interpreter (clap flags, flattened into each bench).
#[derive(clap::Args)]
pub(crate) struct Anchor {
    /// Folder holding the PyTorch anchor scripts (`torch_core_step.py`, `setup.sh`, ...).
    #[arg(long, env = "TENSORPLAY_ANCHORS", default_value = DEFAULT_ANCHORS)]
    pub(crate) anchors: PathBuf,
    /// Python interpreter with PyTorch installed. Without it: `ANCHOR_PYTHON`, then
    /// `$ANCHOR_VENV/bin/python`, then the interpreter that `bash <anchors>/setup.sh` prints
    /// (it installs PyTorch once into a virtual environment and is idempotent).
    #[arg(long, env = "ANCHOR_PYTHON")]
    pub(crate) python: Option<PathBuf>,
}

/// Whether PyTorch's side ran, for the summary table's pytorch columns.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Pytorch {
    /// It ran (in at least one round).
    Ran,
    /// It could not run: no interpreter with PyTorch, or no anchor script (the reason).
    Missing(String),
    /// It was started but failed in every round (the last error line).
    Failed(String),
}

impl Anchor {
    /// The PyTorch interpreter: `--python`, `ANCHOR_PYTHON`, `$ANCHOR_VENV/bin/python`, then
    /// what `bash <anchors>/setup.sh` prints on its last line; `Err` says why there is none.
    pub(crate) fn python(&self) -> Result<PathBuf, String> {
        let found = if let Some(p) = &self.python {
            p.clone()
        } else if let Some(v) = std::env::var_os("ANCHOR_VENV") {
            PathBuf::from(v).join("bin/python")
        } else {
            self.setup_python()?
        };
        if found.exists() {
            Ok(found)
        } else {
            Err(format!("no PyTorch interpreter at {}", found.display()))
        }
    }

    /// The interpreter that `bash <anchors>/setup.sh` prints (installing PyTorch once).
    fn setup_python(&self) -> Result<PathBuf, String> {
        let setup = self.anchors.join("setup.sh");
        if !setup.exists() {
            return Err(format!(
                "{} not found (give the anchors' folder with --anchors DIR or \
                 TENSORPLAY_ANCHORS, or an interpreter with --python)",
                setup.display()
            ));
        }
        eprintln!(
            "finding PyTorch with `bash {}` (installs it once)...",
            setup.display()
        );
        match Command::new("bash").arg(&setup).output() {
            Ok(out) if out.status.success() => {
                let text = String::from_utf8_lossy(&out.stdout);
                text.lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .map(|l| PathBuf::from(l.trim()))
                    .ok_or_else(|| format!("{} printed no interpreter", setup.display()))
            }
            Ok(out) => Err(format!(
                "{} failed ({}): {}",
                setup.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => Err(format!("could not run {}: {e}", setup.display())),
        }
    }

    /// The interpreter and the anchor script `name` (in the anchors' folder) when both exist;
    /// otherwise prints a note and returns why PyTorch's side will not run.
    pub(crate) fn script(&self, name: &str) -> Result<(PathBuf, PathBuf), String> {
        torch_with(self.python(), &self.anchors.join(name))
    }
}

/// `python` with `script` when both exist, or why not (also printed as a note).
pub(crate) fn torch_with(
    python: Result<PathBuf, String>,
    script: &Path,
) -> Result<(PathBuf, PathBuf), String> {
    let r = python.and_then(|p| {
        if script.exists() {
            Ok((p, script.to_path_buf()))
        } else {
            Err(format!("anchor script {} not found", script.display()))
        }
    });
    if let Err(why) = &r {
        eprintln!("note: PyTorch will not run: {why}. Reporting tensorplay only.");
    }
    r
}
