//! [`load`]: every rank reads the metadata, intersects the pieces it needs with the pieces on
//! disk, reads and checks those bytes, and only when every rank has everything does any rank
//! write into its tensors.

use std::collections::BTreeMap;
use std::path::Path;

use tensorplay_collectives::ProcessGroup;
use tensorplay_core::bytes::bools_from_bytes;
use tensorplay_core::serialize::dtype_name;
use tensorplay_core::{DType, Device, Error, Result, Storage, Tensor, no_grad};

use super::metadata::{METADATA_FILE, Metadata, StoredChunk};
use super::planner::{LocalChunk, plan_reads};
use super::save::{check_entry, piece_of};
use super::state::{StateDict, StateValue};
use super::storage::{FileSystemReader, StorageReader};
use super::sync::{Ranks, failed_ranks};

/// One box to copy once every rank has read its bytes.
struct Copy {
    key: String,
    dest: LocalChunk,
    /// The saved piece, read and checked.
    source: Tensor,
    source_offsets: Vec<usize>,
    offsets: Vec<usize>,
    sizes: Vec<usize>,
}

/// Everything this rank will write, read and checked.
struct Staged {
    save_id: String,
    copies: Vec<Copy>,
    /// `Partial` tensors this rank holds zeros of.
    zeroed: Vec<String>,
    values: BTreeMap<String, serde_json::Value>,
}

/// `e` with `tensor {key}: ` before its problem.
fn about(key: &str, e: Error) -> Error {
    match e {
        Error::Checkpoint { path, problem } => Error::Checkpoint {
            path,
            problem: format!("tensor {key:?}: {problem}"),
        },
        other => other,
    }
}

/// Reads the saved piece `c` of tensor `key` (of `dtype`) and checks its checksum (when the
/// storage has them).
fn read_piece(
    reader: &mut dyn StorageReader,
    key: &str,
    c: &StoredChunk,
    dtype: DType,
) -> Result<Tensor> {
    let verify = reader.checksummed();
    let where_ = format!("{}/{}", reader.location(), c.file);
    let check = |b: &[u8]| -> Result<()> {
        if !verify {
            return Ok(());
        }
        let crc = format!("{:08x}", crc32fast::hash(b));
        if crc != c.crc32 {
            return Err(Error::Checkpoint {
                path: where_.clone(),
                problem: format!(
                    "tensor {key:?}: the piece at offsets {:?} (bytes {}..{}) fails its checksum \
                     (CRC-32 {crc}, the metadata says {}): the file is corrupt or from another save",
                    c.offsets, c.byte_range[0], c.byte_range[1], c.crc32
                ),
            });
        }
        Ok(())
    };
    let n: usize = c.sizes.iter().product();
    if dtype == DType::Bool {
        let mut buf = vec![0u8; n];
        reader
            .read_into(&c.file, c.byte_range[0], &mut buf)
            .map_err(|e| about(key, e))?;
        check(&buf)?;
        let bools = bools_from_bytes(&buf).ok_or_else(|| Error::Checkpoint {
            path: where_.clone(),
            problem: format!("tensor {key:?}: a boolean byte is neither 0 nor 1"),
        })?;
        return Tensor::from_vec(bools.to_vec(), &c.sizes);
    }
    let t = Tensor::empty(&c.sizes, (dtype, Device::Cpu))?;
    let es = dtype.size_in_bytes();
    t.with_storage_mut(|s, l| -> Result<()> {
        let (Storage::Cpu(cpu), Some(r)) = (s, l.contiguous_range()) else {
            return Err(Error::NotSupported {
                op: "checkpoint::load",
                detail: "without a contiguous host buffer to read into".into(),
            });
        };
        let Some(mut buf) = cpu.as_buf_mut() else {
            return Err(Error::NotSupported {
                op: "checkpoint::load",
                detail: format!("for dtype {dtype:?}"),
            });
        };
        let bytes = &mut buf.as_bytes_mut()[r.start * es..r.end * es];
        reader
            .read_into(&c.file, c.byte_range[0], bytes)
            .map_err(|e| about(key, e))?;
        check(bytes)
    })?;
    Ok(t)
}

/// Reads and checks everything this rank needs, writing nothing.
fn stage(state: &StateDict, reader: &mut dyn StorageReader, rank: usize) -> Result<Staged> {
    let md: Metadata = reader.read_metadata()?;
    let md_path = format!("{}/{METADATA_FILE}", reader.location());
    let missing = |key: &str, what: &str| Error::Checkpoint {
        path: md_path.clone(),
        problem: format!(
            "no {what} {key:?} in the checkpoint (it holds {} tensors and {} values{})",
            md.tensors.len(),
            md.values.len() + md.rank_values.len(),
            md.tensors
                .keys()
                .next()
                .map(|k| format!(", such as {k:?}"))
                .unwrap_or_default()
        ),
    };
    let mut staged = Staged {
        save_id: md.save_id.clone(),
        copies: Vec::new(),
        zeroed: Vec::new(),
        values: BTreeMap::new(),
    };
    for (key, v) in state {
        let (local, placement) = match v {
            StateValue::Tensor { local, placement } => (local, placement),
            StateValue::Value(_) => {
                let v = md.values.get(key).ok_or_else(|| missing(key, "value"))?;
                staged.values.insert(key.clone(), v.clone());
                continue;
            }
            StateValue::RankValue(_) => {
                let all = md
                    .rank_values
                    .get(key)
                    .ok_or_else(|| missing(key, "value"))?;
                if let Some(v) = all.get(rank).or_else(|| all.get(rank % all.len().max(1))) {
                    staged.values.insert(key.clone(), v.clone());
                }
                continue;
            }
        };
        // the same checks as a save's
        check_entry("checkpoint::load", key, local, placement)?;
        let saved = md.tensors.get(key).ok_or_else(|| missing(key, "tensor"))?;
        let want = dtype_name(placement.dtype);
        if saved.dtype != want || saved.size != placement.global_shape {
            return Err(Error::Checkpoint {
                path: md_path.clone(),
                problem: format!(
                    "tensor {key:?} is saved as {} of shape {:?}; the model's is {want} of shape \
                     {:?}",
                    saved.dtype, saved.size, placement.global_shape
                ),
            });
        }
        if placement.partial_over().is_some_and(|(_, rank)| rank != 0) {
            staged.zeroed.push(key.clone());
        }
        let dest = placement.local_chunks();
        let pieces: Vec<_> = saved.chunks.iter().map(StoredChunk::chunk).collect();
        let mut read: BTreeMap<usize, Tensor> = BTreeMap::new();
        for item in plan_reads(&dest, &pieces) {
            let whole = &saved.chunks[item.saved];
            if !reader.checksummed() {
                // no checksum to check over the whole piece: read just the rows needed
                let rows = rows_of(whole, &item.offsets, &item.sizes, placement.dtype);
                let source = read_piece(reader, key, &rows, placement.dtype)?;
                staged.copies.push(Copy {
                    key: key.clone(),
                    dest: dest[item.dest].clone(),
                    source,
                    source_offsets: rows.offsets,
                    offsets: item.offsets,
                    sizes: item.sizes,
                });
                continue;
            }
            let source = match read.entry(item.saved) {
                std::collections::btree_map::Entry::Occupied(e) => e.get().clone(),
                std::collections::btree_map::Entry::Vacant(e) => e
                    .insert(read_piece(reader, key, whole, placement.dtype)?)
                    .clone(),
            };
            staged.copies.push(Copy {
                key: key.clone(),
                dest: dest[item.dest].clone(),
                source,
                source_offsets: pieces[item.saved].offsets.clone(),
                offsets: item.offsets,
                sizes: item.sizes,
            });
        }
    }
    Ok(staged)
}

/// The rows of saved piece `c` that the box `offsets`/`sizes` (inside it) covers along
/// dimension 0, as a piece of its own: row-major, they are one run of its bytes.
fn rows_of(c: &StoredChunk, offsets: &[usize], sizes: &[usize], dtype: DType) -> StoredChunk {
    if c.sizes.is_empty() {
        return c.clone();
    }
    let row_bytes = (c.sizes[1..].iter().product::<usize>() * dtype.size_in_bytes()) as u64;
    let skip = (offsets[0] - c.offsets[0]) as u64;
    let start = c.byte_range[0] + skip * row_bytes;
    let mut rows = c.clone();
    rows.offsets[0] = offsets[0];
    rows.sizes[0] = sizes[0];
    rows.byte_range = [start, start + sizes[0] as u64 * row_bytes];
    rows
}

/// `t` (a piece starting at `origin` in the whole) narrowed to the box `offsets`/`sizes`.
fn boxed(t: &Tensor, origin: &[usize], offsets: &[usize], sizes: &[usize]) -> Result<Tensor> {
    let mut v = t.clone();
    for d in 0..sizes.len() {
        let at = offsets[d] - origin[d];
        if at != 0 || sizes[d] != v.shape()[d] {
            v = v.narrow(d as isize, at, sizes[d])?;
        }
    }
    Ok(v)
}

/// Writes what [`stage`] read into the state's tensors and values.
fn apply(state: &mut StateDict, staged: Staged) -> Result<()> {
    let _g = no_grad();
    for key in &staged.zeroed {
        if let Some(StateValue::Tensor { local, .. }) = state.get(key) {
            local.zero_()?;
        }
    }
    for c in &staged.copies {
        let Some(StateValue::Tensor { local, .. }) = state.get(&c.key) else {
            continue;
        };
        let dst = boxed(
            &piece_of(local, &c.dest)?,
            &c.dest.chunk.offsets,
            &c.offsets,
            &c.sizes,
        )?;
        let src = boxed(&c.source, &c.source_offsets, &c.offsets, &c.sizes)?;
        dst.copy_(&src)?;
    }
    for (key, v) in staged.values {
        if let Some(slot) = state.get_mut(&key) {
            *slot = if matches!(slot, StateValue::RankValue(_)) {
                StateValue::RankValue(v)
            } else {
                StateValue::Value(v)
            };
        }
    }
    Ok(())
}

/// Loads the checkpoint in the folder `checkpoint_dir` into `state`, in place
/// (`torch.distributed.checkpoint.load`): collective over `group` (the default group when
/// `None` and one is initialised; a single process otherwise).
///
/// `state` says what to load and where: each tensor entry's local tensor is filled with its
/// pieces of the saved whole, whatever the layout and world size that saved it (each rank
/// reads only the saved pieces that overlap its own); each value is replaced by the saved
/// one. Names the checkpoint has but `state` does not are not read.
///
/// All or nothing: every rank first reads and checks everything it needs (the metadata, each
/// piece's bytes and checksum, shapes and dtypes); only when every rank has succeeded does any
/// rank write into its tensors.
///
/// # Errors
/// On every rank, with nothing changed anywhere: [`Error::Checkpoint`] naming the file and the
/// tensor (no committed checkpoint, metadata that is corrupt or another program's, pieces
/// that overlap or leave holes, a missing, truncated or corrupt file, a name the checkpoint
/// lacks, a shape or dtype that differs from the saved one); [`Error::InvalidArgument`] when
/// a tensor does not match its placement; on the ranks that succeeded, an error naming the
/// ranks that failed and the first one's reason; the group's errors.
pub fn load(
    state: &mut StateDict,
    checkpoint_dir: impl AsRef<Path>,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    load_with(state, &mut FileSystemReader::new(checkpoint_dir), group)
}

/// [`load`] through any [`StorageReader`].
///
/// # Errors
/// As [`load`].
pub fn load_with(
    state: &mut StateDict,
    reader: &mut dyn StorageReader,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    load_after(state, reader, group, Ok(()))
}

/// [`load_with`] after this rank's own preparation, whose failure `prior` the ranks learn of
/// in the load's one exchange (so that no rank waits in it alone).
pub(crate) fn load_after(
    state: &mut StateDict,
    reader: &mut dyn StorageReader,
    group: Option<&ProcessGroup>,
    prior: Result<()>,
) -> Result<()> {
    let ranks = Ranks::of(group)?;
    let staged = prior.and_then(|()| stage(state, reader, ranks.rank));
    let report = (
        staged.as_ref().err().map(ToString::to_string),
        staged
            .as_ref()
            .map(|s| s.save_id.clone())
            .unwrap_or_default(),
    );
    let all: Vec<(Option<String>, String)> = ranks.gather(&report)?;
    let staged = staged?;
    if let Some(problem) = failed_ranks(all.iter().map(|(p, _)| p.as_deref())) {
        return Err(Error::Checkpoint {
            path: reader.location(),
            problem,
        });
    }
    if let Some((r, (_, id))) = all
        .iter()
        .enumerate()
        .find(|(_, (_, id))| *id != staged.save_id)
    {
        return Err(Error::Checkpoint {
            path: reader.location(),
            problem: format!(
                "rank {} read save {:?}, rank {r} read save {id:?}: a save committed while \
                 loading; nothing was changed",
                ranks.rank, staged.save_id
            ),
        });
    }
    apply(state, staged)
}
