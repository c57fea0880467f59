//! `checkpoint::consolidate` and `checkpoint::load_safetensors`: checkpoints saved fully
//! sharded and 2-D become one safetensors file whose tensors are the saved whole ones, bit for
//! bit (read by `tp::load`, and by PyTorch's safetensors when `ANCHOR_PYTHON` names a Python
//! with torch and safetensors); such a file, and one `tp::save` wrote, loads straight into
//! every layout at several world sizes; files that do not fit are refused on every rank.

use std::collections::BTreeMap;
use std::path::Path;

use tensorplay_core::nn::Module;
use tensorplay_core::{self as tp, Tensor};
use tensorplay_distributed_nn::checkpoint::state_dict::get_model_state_dict;
use tensorplay_distributed_nn::checkpoint::{self as dcp, model_state};
use tensorplay_testkit::{SharedDir, le_bytes};

use super::dcp::{Layout, SAVED, TestResult, at, build, save_as};
use super::state_dict::{full, pair_from, same};

/// The saved model's whole tensors under `prefix` (as a checkpoint of `model_state(m,
/// prefix)` names them).
fn saved_whole(prefix: &str) -> tp::Result<BTreeMap<String, Tensor>> {
    Ok(pair_from(SAVED)?
        .state_dict()?
        .into_iter()
        .map(|(k, v)| {
            let k = if prefix.is_empty() {
                k
            } else {
                format!("{prefix}.{k}")
            };
            (k, v)
        })
        .collect())
}

/// Loads `file` into a model of another seed laid out as `layout`, under `prefix`; checks the
/// whole tensors.
fn load_file_as(layout: Layout, file: &Path, prefix: &str, rank: usize) -> TestResult {
    let m = build(layout, 99)?;
    let mut sd = model_state(&*m, prefix)?;
    dcp::load_safetensors(&mut sd, file, None)?;
    same(
        &format!("{layout:?} rank {rank}"),
        &get_model_state_dict(&*m, full())?,
        &pair_from(SAVED)?.state_dict()?,
    )?;
    Ok(())
}

#[test]
fn consolidated_files_hold_the_whole_tensors_and_load_into_every_layout() {
    let root = SharedDir::new("dcp-consolidate");
    for (saved, n) in [(Layout::Fsdp, 3), (Layout::TwoD, 4)] {
        let name = format!("{saved:?}-{n}");
        let dir = root.dir().join(&name);
        let file = root.dir().join(format!("{name}.safetensors"));
        at(saved, n, &root, |rank| save_as(saved, &dir, rank))
            .unwrap_or_else(|e| panic!("save {name}: {e}"));
        // the test process consolidates and reads the file (the ranks of later worlds re-run
        // the test from its start: they find the file there)
        if !tensorplay_collectives::spawn::is_spawned_child() {
            dcp::consolidate(&dir, &file).unwrap_or_else(|e| panic!("{name}: {e}"));
            let got = tp::load(&file).unwrap_or_else(|e| panic!("{name}: tp::load: {e}"));
            same(&name, &got, &saved_whole("model").unwrap()).unwrap_or_else(|e| panic!("{e}"));
        }
        for (layout, m) in [
            (Layout::Alone, 1),
            (Layout::Fsdp, 2),
            (Layout::Fsdp, 4),
            (Layout::Tp, 2),
            (Layout::TwoD, 4),
        ] {
            at(layout, m, &root, |rank| {
                load_file_as(layout, &file, "model", rank)
            })
            .unwrap_or_else(|e| panic!("{name} -> {layout:?} at {m}: {e}"));
        }
    }
}

#[test]
fn a_file_of_whole_weights_loads_into_sharded_models() {
    let root = SharedDir::new("dcp-whole-file");
    let file = root.dir().join("weights.safetensors");
    if !tensorplay_collectives::spawn::is_spawned_child() {
        let _g = tensorplay_testkit::generator_lock();
        tp::save(&saved_whole("").unwrap(), &file).unwrap();
    }
    for (layout, m) in [(Layout::Fsdp, 3), (Layout::TwoD, 2), (Layout::Ddp, 2)] {
        at(layout, m, &root, |rank| {
            load_file_as(layout, &file, "", rank)
        })
        .unwrap_or_else(|e| panic!("{layout:?} at {m}: {e}"));
    }
}

/// A file that does not fit the model: what every rank's error must say.
type Misfit = (&'static str, fn(&Path) -> TestResult, &'static str);

#[test]
fn files_that_do_not_fit_are_refused_on_every_rank() {
    let root = SharedDir::new("dcp-file-misfits");
    let misfits: [Misfit; 4] = [
        (
            "a tensor the model has is missing",
            |p| {
                let mut w = saved_whole("")?;
                w.remove("2.bias");
                Ok(tp::save(&w, p)?)
            },
            "no tensor \"2.bias\"",
        ),
        (
            "a tensor of another shape",
            |p| {
                let mut w = saved_whole("")?;
                w.insert("0.weight".into(), Tensor::zeros(&[6, 5], tp::DType::F64)?);
                Ok(tp::save(&w, p)?)
            },
            "of shape [6, 5]",
        ),
        (
            "a truncated file",
            |p| {
                tp::save(&saved_whole("")?, p)?;
                let len = std::fs::metadata(p)?.len();
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)?
                    .set_len(len - 16)?;
                Ok(())
            },
            "truncated",
        ),
        (
            "not a safetensors file",
            |p| Ok(std::fs::write(p, b"{\"format\": \"tensorplay.dcp\"}")?),
            "not a safetensors",
        ),
    ];
    for (i, (name, make, needle)) in misfits.into_iter().enumerate() {
        let file = root.dir().join(format!("misfit-{i}.safetensors"));
        if !tensorplay_collectives::spawn::is_spawned_child() {
            make(&file).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        at(Layout::Fsdp, 2, &root, |rank| {
            let m = build(Layout::Fsdp, 99)?;
            let before = get_model_state_dict(&*m, full())?;
            let mut sd = model_state(&*m, "")?;
            match dcp::load_safetensors(&mut sd, &file, None) {
                Ok(()) => return Err(format!("rank {rank} loaded it").into()),
                Err(e) if e.to_string().contains(needle) => {}
                Err(e) => return Err(format!("rank {rank}'s error: {e}").into()),
            }
            same(
                &format!("rank {rank} after the refusal"),
                &get_model_state_dict(&*m, full())?,
                &before,
            )?;
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// PyTorch's safetensors reads a consolidated file: the same names, dtypes, shapes and bytes.
/// Needs a Python with torch and safetensors: `ANCHOR_PYTHON=/path/to/python cargo test -p
/// tensorplay-distributed-nn --test it dcp_consolidate -- --ignored` (the anchors' venv:
/// `bash ../shared/anchors/setup.sh`, then `pip install safetensors` into it).
#[test]
#[ignore = "needs PyTorch with safetensors: set ANCHOR_PYTHON and run with --ignored"]
fn pytorch_reads_consolidated_files() {
    let python =
        std::env::var("ANCHOR_PYTHON").expect("ANCHOR_PYTHON: a Python with torch and safetensors");
    let root = SharedDir::new("dcp-consolidate-torch");
    let dir = root.dir().join("ckpt");
    let file = root.dir().join("model.safetensors");
    at(Layout::Fsdp, 2, &root, |rank| {
        save_as(Layout::Fsdp, &dir, rank)
    })
    .unwrap_or_else(|e| panic!("save: {e}"));
    if tensorplay_collectives::spawn::is_spawned_child() {
        return;
    }
    dcp::consolidate(&dir, &file).unwrap();
    let script = r#"
import sys, zlib, torch
from safetensors.torch import load_file
for name, t in sorted(load_file(sys.argv[1]).items()):
    b = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b''
    print(name, str(t.dtype).replace('torch.', ''), list(t.shape), '%08x' % zlib.crc32(b))
"#;
    let out = std::process::Command::new(python)
        .args(["-c", script])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = String::from_utf8(out.stdout).unwrap();
    let want: Vec<String> = saved_whole("model")
        .unwrap()
        .iter()
        .map(|(k, t)| {
            let crc = crc32fast::hash(&le_bytes(t).unwrap());
            format!("{k} float64 {:?} {crc:08x}", t.shape())
        })
        .collect();
    assert_eq!(got.lines().collect::<Vec<_>>(), want, "{got}");
}
