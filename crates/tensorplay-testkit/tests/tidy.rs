//! Tidy checks of the whole workspace, run by `cargo test`: the code map in
//! `docs/ARCHITECTURE.md` is true, files stay small, programs parse arguments with clap,
//! examples share code through a library, and the data-parallel layers stay off RPC.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's root (this crate is `crates/tensorplay-testkit`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("the repository root")
        .to_path_buf()
}

/// The workspace's crates: (name, folder), from `crates/*/Cargo.toml` and `xtask`.
fn crates() -> Vec<(String, PathBuf)> {
    let mut v: Vec<(String, PathBuf)> = std::fs::read_dir(root().join("crates"))
        .expect("crates/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), p))
        .collect();
    v.push(("xtask".into(), root().join("xtask")));
    v.sort();
    v
}

/// The file modules a crate root declares (`mod x;`, `pub mod x;`), from `src/lib.rs`,
/// `src/main.rs` and each `src/bin/NAME/main.rs` (as `bin/NAME/x`); inline modules
/// (`mod x { .. }`) are part of their root file's row.
fn top_level_modules(krate: &Path) -> BTreeSet<String> {
    let mut mods = BTreeSet::new();
    let mut roots = vec![
        (String::new(), krate.join("src/lib.rs")),
        (String::new(), krate.join("src/main.rs")),
    ];
    if let Ok(rd) = std::fs::read_dir(krate.join("src/bin")) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            roots.push((format!("bin/{name}/"), e.path().join("main.rs")));
        }
    }
    for (prefix, root_file) in roots {
        let Ok(text) = std::fs::read_to_string(&root_file) else {
            continue;
        };
        for line in text.lines() {
            let l = line.trim_start();
            if line.starts_with(' ') || l.starts_with("//") {
                continue; // nested modules belong to their parent's row
            }
            let l = l
                .strip_prefix("pub(crate) ")
                .or_else(|| l.strip_prefix("pub "))
                .unwrap_or(l);
            if let Some(rest) = l.strip_prefix("mod ") {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let file_module = rest.trim_end().ends_with(';');
                if file_module && !name.is_empty() && name != "tests" {
                    mods.insert(format!("{prefix}{name}"));
                }
            }
        }
    }
    mods
}

/// The code map's sections: crate name -> the backticked tokens of its section.
fn map_sections(text: &str) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("## `") {
            let name = h.split('`').next().unwrap_or_default().to_string();
            out.push((name, Vec::new()));
            continue;
        }
        if line.starts_with("## ") {
            out.push((String::new(), Vec::new()));
            continue;
        }
        if let Some((_, toks)) = out.last_mut() {
            toks.extend(line.split('`').skip(1).step_by(2).map(str::to_string));
        }
    }
    out
}

/// Whether a backticked token names a file or folder (and so must exist).
fn is_path(tok: &str) -> bool {
    !tok.contains(' ')
        && !tok.contains("::")
        && !tok.contains("://")
        && !tok.starts_with('-')
        && (tok.ends_with('/')
            || [
                ".rs", ".cu", ".h", ".cpp", ".md", ".json", ".txt", ".py", ".toml", ".sh",
            ]
            .iter()
            .any(|x| tok.ends_with(x)))
}

#[test]
fn architecture_map_is_true() {
    let root = root();
    let text = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).expect("the map");
    let sections = map_sections(&text);
    let mut problems = Vec::new();
    for (name, dir) in crates() {
        let Some((_, toks)) = sections.iter().find(|(n, _)| *n == name) else {
            problems.push(format!("crate {name}: no section \"## `{name}`\""));
            continue;
        };
        let section_text: String = text
            .split("\n## ")
            .find(|s| s.starts_with(&format!("`{name}`")))
            .unwrap_or_default()
            .to_string();
        for line in ["**Invariant**", "**Boundary**"] {
            if !section_text.contains(line) {
                problems.push(format!("crate {name}: its section has no {line} line"));
            }
        }
        let paths: Vec<&String> = toks.iter().filter(|t| is_path(t)).collect();
        for m in top_level_modules(&dir) {
            let covered = paths.iter().any(|p| {
                let p = p.trim_start_matches("src/");
                p == format!("{m}.rs") || p.starts_with(&format!("{m}/"))
            });
            if !covered {
                problems.push(format!(
                    "crate {name}: top-level module `{m}` has no row (name `{m}.rs` or `{m}/`)"
                ));
            }
        }
    }
    // every path named anywhere in the map exists: in its crate (src/ or the crate's folder)
    // or from the repository's root
    for (name, toks) in &sections {
        let dir = root.join("crates").join(name);
        let dir = if name == "xtask" {
            root.join("xtask")
        } else {
            dir
        };
        for t in toks.iter().filter(|t| is_path(t)) {
            let t = t.as_str();
            let found = [dir.join("src").join(t), dir.join(t), root.join(t)]
                .iter()
                .any(|p| p.exists());
            if !found {
                let at = if name.is_empty() {
                    "the map"
                } else {
                    name.as_str()
                };
                problems.push(format!("{at}: `{t}` does not exist"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "docs/ARCHITECTURE.md is out of date:\n{}",
        problems.join("\n")
    );
}

/// Every file under `dir` (recursively) whose name ends with one of `exts`, skipping `target`
/// and hidden folders.
fn files(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                if name != "target" && !name.starts_with('.') {
                    stack.push(p);
                }
            } else if exts.iter().any(|x| name.ends_with(x)) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Longest a source file may be; test files (`tests/` folders, `tests.rs`) and CUDA kernels
/// excepted.
const MAX_LINES: usize = 700;

#[test]
fn no_source_file_over_700_lines() {
    let root = root();
    let mut long = Vec::new();
    for (_, dir) in crates() {
        for f in files(&dir, &[".rs"]) {
            let rel = f
                .strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            if rel.contains("/tests/") || rel.ends_with("/tests.rs") {
                continue;
            }
            let n = std::fs::read_to_string(&f).unwrap().lines().count();
            if n > MAX_LINES {
                long.push(format!("{rel}: {n} lines"));
            }
        }
    }
    assert!(
        long.is_empty(),
        "source files over {MAX_LINES} lines (split them by concept):\n{}",
        long.join("\n")
    );
}

#[test]
fn programs_parse_arguments_with_clap_and_examples_share_code_through_a_library() {
    let root = root();
    let mut bad = Vec::new();
    for (_, dir) in crates() {
        for f in files(&dir, &[".rs"]) {
            let rel = f
                .strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let text = std::fs::read_to_string(&f).unwrap();
            let program = rel.contains("/examples/")
                || rel.contains("/src/bin/")
                || rel.contains("/benches/")
                || rel.ends_with("src/main.rs");
            // the arguments reach clap (`parse_from(std::env::args())` is fine); a program
            // that walks them itself does not name clap
            let reads_args = text.contains("std::env::args");
            let to_clap = ["clap", "parse_from", "try_parse"]
                .iter()
                .any(|k| text.contains(k));
            if program && reads_args && !to_clap {
                bad.push(format!(
                    "{rel}: reads std::env::args by hand (use a clap Parser)"
                ));
            }
            if rel.contains("/examples/") && text.contains("#[path") {
                bad.push(format!("{rel}: #[path] (shared code goes in a library)"));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn data_parallel_layers_do_not_depend_on_rpc() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(root())
        .args([
            "tree",
            "--offline",
            "-p",
            "tensorplay-distributed-nn",
            "--prefix",
            "none",
        ])
        .output()
        .expect("runs cargo tree");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("tensorplay-collectives"),
        "cargo tree failed: {}{}",
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    let rpc: Vec<&str> = text
        .lines()
        .filter(|l| {
            ["quinn", "rustls", "tokio", "tensorplay-rpc"]
                .iter()
                .any(|k| l.starts_with(k))
        })
        .collect();
    assert!(
        rpc.is_empty(),
        "tensorplay-distributed-nn depends on the RPC transport: {rpc:?}"
    );
}

/// Modules get their traversal from `#[derive(Module)]`: the only hand-written `core` /
/// `named_children` are the trait's own (`nn/fields.rs`: its declaration and `Box`'s
/// forwarding), the dynamic containers (`Sequential` in `nn/layers.rs`, `ModuleList` in
/// `nn/container.rs`), the transparent `CheckpointWrapper` (which forwards everything to the
/// module it wraps, as `Box` does) and the derive's template.
#[test]
fn modules_use_the_derive() {
    let root = root();
    let allowed = [
        "crates/tensorplay-core/src/nn/fields.rs",
        "crates/tensorplay-core/src/nn/layers.rs",
        "crates/tensorplay-core/src/nn/container.rs",
        "crates/tensorplay-core/src/utils/checkpoint/wrapper.rs",
        "crates/tensorplay-macros/src/module.rs",
    ];
    let mut bad = Vec::new();
    for (_, dir) in crates() {
        for f in files(&dir, &[".rs"]) {
            let rel = f
                .strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            if allowed.contains(&rel.as_str()) {
                continue;
            }
            let text = std::fs::read_to_string(&f).unwrap();
            for (i, line) in text.lines().enumerate() {
                let l = line.trim_start();
                if l.starts_with("fn named_children") || l.starts_with("fn core(&self)") {
                    bad.push(format!("{rel}:{}: {l}", i + 1));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "hand-written module traversal (use #[derive(Module)]):\n{}",
        bad.join("\n")
    );
}
