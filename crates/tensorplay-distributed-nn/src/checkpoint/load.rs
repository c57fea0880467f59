//! [`load`]: every rank reads the metadata, intersects the pieces it needs with the pieces on
//! disk and checks those pieces' bytes (streamed through a small buffer, against their
//! checksums); only when every rank has found everything does any rank read the bytes again,
//! straight into its tensors (through the files it already holds open).

use std::collections::BTreeMap;
use std::path::Path;

use tensorplay_collectives::ProcessGroup;
use tensorplay_core::bytes::bools_from_bytes;
use tensorplay_core::serialize::dtype_name;
use tensorplay_core::{DType, Device, Error, Result, Storage, Tensor, no_grad};

use super::metadata::{Metadata, StoredChunk};
use super::planner::{LocalChunk, plan_reads};
use super::save::{check_entry, piece_of};
use super::state::{StateDict, StateValue};
use super::storage::{FileSystemReader, StorageReader};
use super::sync::{Ranks, failed_ranks};

/// One box to read once every rank has checked its pieces.
struct Copy {
    key: String,
    dest: LocalChunk,
    /// The saved piece the box is in (checked).
    source: StoredChunk,
    dtype: DType,
    offsets: Vec<usize>,
    sizes: Vec<usize>,
}

/// Everything this rank will write, its pieces checked.
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

/// The error of saved piece `c` of tensor `key` (in the checkpoint at `location`) whose bytes
/// hash to `crc`, not the metadata's checksum.
pub(crate) fn checksum_mismatch(location: &str, key: &str, c: &StoredChunk, crc: &str) -> Error {
    Error::Checkpoint {
        path: format!("{location}/{}", c.file),
        problem: format!(
            "tensor {key:?}: the piece at offsets {:?} (bytes {}..{}) fails its checksum (CRC-32 \
             {crc}, the metadata says {}): the file is corrupt or from another save",
            c.offsets, c.byte_range[0], c.byte_range[1], c.crc32
        ),
    }
}

/// Streams the saved piece `c` of tensor `key` (of `dtype`) through a small buffer and checks
/// its checksum (and that a bool piece's bytes are 0 or 1).
fn check_piece(
    reader: &mut dyn StorageReader,
    key: &str,
    c: &StoredChunk,
    dtype: DType,
) -> Result<()> {
    const BLOCK: u64 = 4 << 20;
    let mut buf = vec![0u8; BLOCK.min(c.byte_range[1] - c.byte_range[0]) as usize];
    let mut h = crc32fast::Hasher::new();
    let mut at = c.byte_range[0];
    while at < c.byte_range[1] {
        let n = BLOCK.min(c.byte_range[1] - at) as usize;
        reader
            .read_into(&c.file, at, &mut buf[..n])
            .map_err(|e| about(key, e))?;
        h.update(&buf[..n]);
        if dtype == DType::Bool && buf[..n].iter().any(|&b| b > 1) {
            return Err(Error::Checkpoint {
                path: format!("{}/{}", reader.location(), c.file),
                problem: format!("tensor {key:?}: a boolean byte is neither 0 nor 1"),
            });
        }
        at += n as u64;
    }
    let crc = format!("{:08x}", h.finalize());
    if reader.checksummed() && crc != c.crc32 {
        return Err(checksum_mismatch(&reader.location(), key, c, &crc));
    }
    Ok(())
}

/// Reads the saved piece `c` of tensor `key` (of `dtype`; checked before) as a tensor.
fn read_piece(
    reader: &mut dyn StorageReader,
    key: &str,
    c: &StoredChunk,
    dtype: DType,
) -> Result<Tensor> {
    let where_ = format!("{}/{}", reader.location(), c.file);
    let n: usize = c.sizes.iter().product();
    if dtype == DType::Bool {
        let mut buf = vec![0u8; n];
        reader
            .read_into(&c.file, c.byte_range[0], &mut buf)
            .map_err(|e| about(key, e))?;
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
            .map_err(|e| about(key, e))
    })?;
    Ok(t)
}

/// Reads and checks everything this rank needs, writing nothing.
fn stage(state: &StateDict, reader: &mut dyn StorageReader, rank: usize) -> Result<Staged> {
    let md: Metadata = reader.read_metadata()?;
    let md_path = reader.metadata_path();
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
        let mut checked = std::collections::BTreeSet::new();
        for item in plan_reads(&dest, &pieces) {
            let whole = &saved.chunks[item.saved];
            // a bool piece's bytes are checked even without a checksum: a bad byte found while
            // writing would leave the load partial
            let check = reader.checksummed() || placement.dtype == DType::Bool;
            if check && checked.insert(item.saved) {
                check_piece(reader, key, whole, placement.dtype)?;
            }
            staged.copies.push(Copy {
                key: key.clone(),
                dest: dest[item.dest].clone(),
                source: whole.clone(),
                dtype: placement.dtype,
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

/// Whether the box `offsets`/`sizes` of saved piece `c` is one run of its bytes: it spans the
/// piece's whole extent in every dimension after the first.
fn box_is_rows(c: &StoredChunk, offsets: &[usize], sizes: &[usize]) -> bool {
    (1..c.sizes.len()).all(|d| offsets[d] == c.offsets[d] && sizes[d] == c.sizes[d])
}

/// Reads copy `c`'s box straight into `dst` (a contiguous host tensor of the box's shape), when
/// the box is one run of the file's bytes; `Ok(false)` when it cannot (another device, bools,
/// a box that cuts the piece's rows).
fn read_in_place(reader: &mut dyn StorageReader, c: &Copy, dst: &Tensor) -> Result<bool> {
    if c.dtype == DType::Bool || !box_is_rows(&c.source, &c.offsets, &c.sizes) {
        return Ok(false);
    }
    let rows = rows_of(&c.source, &c.offsets, &c.sizes, c.dtype);
    let es = c.dtype.size_in_bytes();
    dst.with_storage_mut(|s, l| -> Result<bool> {
        let (Storage::Cpu(cpu), Some(r)) = (s, l.contiguous_range()) else {
            return Ok(false);
        };
        let Some(mut buf) = cpu.as_buf_mut() else {
            return Ok(false);
        };
        let bytes = &mut buf.as_bytes_mut()[r.start * es..r.end * es];
        if bytes.len() as u64 != rows.byte_range[1] - rows.byte_range[0] {
            return Ok(false);
        }
        reader
            .read_into(&rows.file, rows.byte_range[0], bytes)
            .map_err(|e| about(&c.key, e))?;
        Ok(true)
    })
}

/// Writes what [`stage`] planned into the state's tensors and values, reading each box from
/// `reader`: into the tensor itself where the box is one run of bytes of both, else through a
/// piece of the rows it covers.
fn apply(state: &mut StateDict, staged: Staged, reader: &mut dyn StorageReader) -> Result<()> {
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
        if read_in_place(reader, c, &dst)? {
            continue;
        }
        let rows = rows_of(&c.source, &c.offsets, &c.sizes, c.dtype);
        let source = read_piece(reader, &c.key, &rows, c.dtype)?;
        let src = boxed(&source, &rows.offsets, &c.offsets, &c.sizes)?;
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
/// All or nothing: every rank first checks everything it needs (the metadata, shapes and
/// dtypes, each piece's bytes against its checksum, streamed through a small buffer); only when
/// every rank has succeeded does any rank read the bytes again, straight into its tensors where
/// a box is one run of bytes of both (no staging copy of the state). The files stay open
/// between the check and the read, so a save that commits meanwhile and removes them changes
/// nothing; only a file rewritten in place by another program between the two could make the
/// second read fail, leaving that rank's load partial (reported).
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
    apply(state, staged, reader)
}
