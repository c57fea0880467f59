//! Replicated and sharded checkpoint files: [`save_replicated`], [`save_sharded`],
//! [`load_sharded`] (see the [module docs](super)).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tensorplay_collectives::{self as dist, ProcessGroup, ReduceOp};
use tensorplay_core::serialize::{load_with_metadata, save_with_metadata, write_atomically};
use tensorplay_core::{Error, Result, Tensor};

/// Every rank's flag (1 ok, 0 failed) of the group, known to every rank.
pub(crate) fn flags(ok: bool, group: Option<&ProcessGroup>) -> Result<Vec<bool>> {
    let (rank, world) = (dist::get_rank(group)?, dist::get_world_size(group)?);
    let mut v = vec![0i64; world];
    v[rank] = i64::from(ok);
    let t = Tensor::from_vec(v, &[world])?;
    dist::all_reduce(&t, ReduceOp::Sum, group)?;
    Ok(t.to_vec::<i64>()?.into_iter().map(|f| f == 1).collect())
}

/// `Ok` when every rank succeeded, else the error: this rank's own, or one naming the ranks
/// that failed.
pub(crate) fn agree(mine: Result<()>, what: &str, group: Option<&ProcessGroup>) -> Result<()> {
    let all = flags(mine.is_ok(), group)?;
    mine?;
    let failed: Vec<usize> = (0..all.len()).filter(|&r| !all[r]).collect();
    if failed.is_empty() {
        return Ok(());
    }
    Err(Error::Checkpoint {
        path: what.to_string(),
        problem: format!("rank(s) {failed:?} failed (their errors name the file and the cause)"),
    })
}

/// Writes `tensors` and `metadata` to `path` on rank 0 of `group` (the default group when
/// `None`); the other ranks wait for it. Collective. Rank 0's values are the ones written:
/// with DDP every rank holds the same, as the model's `state_dict` and an optimizer's state.
///
/// Errors: [`Error::Checkpoint`] on every rank when rank 0 could not write the file (rank 0's
/// error names the cause); the group's errors.
pub fn save_replicated(
    tensors: &BTreeMap<String, Tensor>,
    metadata: &BTreeMap<String, String>,
    path: impl AsRef<Path>,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let path = path.as_ref();
    let mine = if dist::get_rank(group)? == 0 {
        save_with_metadata(tensors, metadata, path)
    } else {
        Ok(())
    };
    agree(mine, &path.display().to_string(), group)
}

/// The `.json` of a sharded checkpoint.
fn index_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.json"))
}

fn shard_name(name: &str, step: u64, rank: usize) -> String {
    format!("{name}.step{step}.rank{rank}.safetensors")
}

/// Writes this rank's shard of the sharded checkpoint `name` at `step` in `dir` (created when
/// absent), then (rank 0)
/// the `.json` that commits it, then removes this rank's shards of earlier saves. Collective
/// over `group` (the default group when `None`). `tensors` and `metadata` are this rank's own
/// (its parameters' shards, its optimizer's state).
///
/// Errors: [`Error::Checkpoint`] on every rank when any rank could not write its shard or rank
/// 0 the `.json` (the failing rank's error names the file and cause; the others name the
/// ranks); the group's errors. After an error the previous checkpoint is still whole.
pub fn save_sharded(
    dir: impl AsRef<Path>,
    name: &str,
    step: u64,
    tensors: &BTreeMap<String, Tensor>,
    metadata: &BTreeMap<String, String>,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let dir = dir.as_ref();
    let (rank, world) = (dist::get_rank(group)?, dist::get_world_size(group)?);
    // the folder is created when absent, as PyTorch's `dcp.save` does
    let mine = std::fs::create_dir_all(dir)
        .map_err(|e| Error::Checkpoint {
            path: dir.display().to_string(),
            problem: format!("could not create the folder: {e}"),
        })
        .and_then(|()| {
            save_with_metadata(tensors, metadata, dir.join(shard_name(name, step, rank)))
        });
    agree(
        mine,
        &dir.join(shard_name(name, step, rank)).display().to_string(),
        group,
    )?;
    let index = index_path(dir, name);
    let committed = if rank == 0 {
        let shards: Vec<String> = (0..world).map(|r| shard_name(name, step, r)).collect();
        let json = serde_json::json!({
            "format": "tensorplay.sharded",
            "name": name,
            "step": step,
            "world_size": world,
            "shards": shards,
        });
        write_atomically(&index, json.to_string().as_bytes())
    } else {
        Ok(())
    };
    agree(committed, &index.display().to_string(), group)?;
    // this rank's older shards are no longer named by any .json
    let keep = shard_name(name, step, rank);
    let suffix = format!(".rank{rank}.safetensors");
    let prefix = format!("{name}.step");
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let f = e.file_name().to_string_lossy().into_owned();
            if f != keep
                && f.strip_prefix(&prefix)
                    .and_then(|r| r.strip_suffix(&suffix))
                    .is_some_and(|s| s.parse::<u64>().is_ok())
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(())
}

/// What [`load_sharded`] returns: the step saved, and this rank's tensors and metadata.
#[derive(Debug, Clone)]
pub struct Shard {
    /// The `step` given to [`save_sharded`].
    pub step: u64,
    /// This rank's tensors.
    pub tensors: BTreeMap<String, Tensor>,
    /// This rank's metadata.
    pub metadata: BTreeMap<String, String>,
}

/// Whether `dir` holds a committed sharded checkpoint `name` (its `.json`). Not collective.
pub fn sharded_exists(dir: impl AsRef<Path>, name: &str) -> bool {
    index_path(dir.as_ref(), name).is_file()
}

fn read_index(index: &Path, world: usize, rank: usize) -> Result<(u64, PathBuf)> {
    let bad = |what: String| Error::Checkpoint {
        path: index.display().to_string(),
        problem: what,
    };
    let text =
        std::fs::read_to_string(index).map_err(|e| bad(format!("could not read it: {e}")))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON (corrupt?): {e}")))?;
    if v.get("format").and_then(|f| f.as_str()) != Some("tensorplay.sharded") {
        return Err(bad(
            "not the index of a sharded checkpoint (no \"format\": \"tensorplay.sharded\")".into(),
        ));
    }
    let step = v
        .get("step")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| bad("no \"step\"".into()))?;
    let saved_world = v
        .get("world_size")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| bad("no \"world_size\"".into()))?;
    if saved_world != world as u64 {
        return Err(bad(format!(
            "written by {saved_world} ranks, loaded by {world}: resharding to another world size is not supported"
        )));
    }
    let shard = v
        .get("shards")
        .and_then(|s| s.as_array())
        .and_then(|s| s.get(rank))
        .and_then(|s| s.as_str())
        .ok_or_else(|| bad(format!("no shard for rank {rank}")))?;
    if shard.contains('/') || shard.contains('\\') {
        return Err(bad(format!(
            "shard name {shard:?} is not a file name in its folder"
        )));
    }
    let dir = index.parent().unwrap_or_else(|| Path::new("."));
    Ok((step, dir.join(shard)))
}

/// Loads this rank's shard of the sharded checkpoint `name` in `dir`, written by
/// [`save_sharded`] at the same world size. Collective over `group`.
///
/// Errors: [`Error::Checkpoint`] on every rank when any rank could not read its shard (the
/// failing rank names the file and problem: missing, truncated, corrupt) or the `.json` is
/// missing, corrupt, or of another world size (resharding is not supported).
pub fn load_sharded(
    dir: impl AsRef<Path>,
    name: &str,
    group: Option<&ProcessGroup>,
) -> Result<Shard> {
    let dir = dir.as_ref();
    let (rank, world) = (dist::get_rank(group)?, dist::get_world_size(group)?);
    let index = index_path(dir, name);
    let mine = read_index(&index, world, rank).and_then(|(step, path)| {
        let (tensors, metadata) = load_with_metadata(&path)?;
        Ok(Shard {
            step,
            tensors,
            metadata,
        })
    });
    let all = flags(mine.is_ok(), group)?;
    let shard = mine?;
    let failed: Vec<usize> = (0..all.len()).filter(|&r| !all[r]).collect();
    if !failed.is_empty() {
        return Err(Error::Checkpoint {
            path: index.display().to_string(),
            problem: format!(
                "rank(s) {failed:?} could not load their shards (their errors name the cause)"
            ),
        });
    }
    Ok(shard)
}
