//! [`save`]: every rank offers the pieces it holds, the ranks agree on one plan (each piece
//! written once), each writes its file, and rank 0 commits the metadata once every file is
//! durable.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tensorplay_collectives::{self as dist, ProcessGroup, ReduceOp};
use tensorplay_core::serialize::dtype_name;
use tensorplay_core::{DType, Error, Result, Storage, Tensor, no_grad};

use super::format::{FileEntry, FileLayout, file_name, layout};
use super::metadata::{FORMAT, Metadata, StoredChunk, TensorStorageMetadata, VERSION};
use super::planner::{LocalChunk, SavePlan, WriteOffer, plan_writes};
use super::state::{StateDict, StateValue, is_partial};
use super::storage::{FileSystemWriter, StorageWriter};
use super::sync::{Ranks, failed_ranks};

/// What each rank tells the others before a save.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Offers {
    /// This rank's problem with its input or its storage, if any.
    problem: Option<String>,
    /// The state's names with their kind (tensor, split tensor, `Partial` tensor, value,
    /// per-rank value): every rank must pass the same.
    keys: Vec<(String, u8)>,
    /// The pieces this rank holds.
    offers: Vec<WriteOffer>,
    /// Rank 0's: the save's id.
    save_id: String,
    /// Rank 0's: the shared values, as JSON text (the ranks' exchange is not self-describing).
    values: BTreeMap<String, String>,
    /// This rank's own values, as JSON text.
    rank_values: BTreeMap<String, String>,
}

/// An entry's kind, which every rank must agree on (a `Partial` tensor's sum is collective).
fn kind(v: &StateValue) -> u8 {
    match v {
        StateValue::Tensor { placement, .. } if is_partial(placement) => 2,
        StateValue::Tensor { .. } => 1,
        StateValue::Value(_) => 3,
        StateValue::RankValue(_) => 4,
    }
}

/// The JSON value a rank sent as text (it came from `Value::to_string`, so it parses).
fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or(serde_json::Value::Null)
}

/// A fresh id for a save: the time and the process, so that no two saves share file names.
fn new_save_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{nanos:x}-{:x}", std::process::id())
}

/// The piece `lc` of `local` as a tensor of the piece's shape (a view).
pub(crate) fn piece_of(local: &Tensor, lc: &LocalChunk) -> Result<Tensor> {
    if lc.chunk.sizes.is_empty() {
        // a 0-d tensor (a fully sharded 0-d parameter's shard is [1])
        return if local.shape().is_empty() {
            Ok(local.clone())
        } else {
            local.reshape(&[] as &[usize])
        };
    }
    let mut v = local.clone();
    for (d, (&at, &n)) in lc.local_offsets.iter().zip(&lc.chunk.sizes).enumerate() {
        if at != 0 || n != v.shape()[d] {
            v = v.narrow(d as isize, at, n)?;
        }
    }
    Ok(v)
}

/// The check every tensor entry passes before anything is planned.
pub(crate) fn check_entry(
    op: &'static str,
    key: &str,
    local: &Tensor,
    p: &super::state_dict::TensorPlacement,
) -> Result<()> {
    if local.shape() != p.local_shape.as_slice() || local.dtype() != p.dtype {
        return Err(Error::InvalidArgument {
            op,
            arg: "state_dict",
            expected: format!(
                "entry {key:?}: a {:?} tensor of shape {:?} (its placement's local shape)",
                p.dtype, p.local_shape
            ),
            got: format!("{:?} of shape {:?}", local.dtype(), local.shape()),
        });
    }
    Ok(())
}

/// This rank's offers and the tensors that hold them (host, contiguous), in state order.
/// `Partial` tensors are summed over their group first (collective, in name order).
fn pieces(state: &StateDict) -> Result<(Vec<WriteOffer>, Vec<Tensor>)> {
    let _g = no_grad();
    let mut offers = Vec::new();
    let mut data = Vec::new();
    for (key, v) in state {
        let StateValue::Tensor { local, placement } = v else {
            continue;
        };
        let mut offer = |lc: &LocalChunk, t: Tensor| -> Result<()> {
            offers.push(WriteOffer {
                fqn: key.clone(),
                dtype: dtype_name(placement.dtype).to_string(),
                size: placement.global_shape.clone(),
                offsets: lc.chunk.offsets.clone(),
                sizes: lc.chunk.sizes.clone(),
            });
            data.push(t.cpu()?.contiguous()?);
            Ok(())
        };
        if let Some((group, _)) = placement.partial_over() {
            // every rank of the sum offers the same pieces of it: one of them writes each
            let sum = local.detach().contiguous()?.deep_clone()?;
            dist::all_reduce(&sum, ReduceOp::Sum, Some(group))?;
            for lc in placement.held_chunks() {
                offer(&lc, piece_of(&sum, &lc)?)?;
            }
        } else {
            for lc in placement.local_chunks() {
                offer(&lc, piece_of(local, &lc)?)?;
            }
        }
    }
    Ok((offers, data))
}

/// The bytes of a host tensor that is contiguous (as [`pieces`] makes them), in the order a
/// safetensors file stores them (little-endian on the little-endian machines tensorplay
/// builds for).
fn with_bytes<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    t.with_storage(|s, l| {
        let es = t.dtype().size_in_bytes();
        match (s, l.contiguous_range()) {
            (Storage::Cpu(c), Some(r)) => Ok(f(&c.as_bytes()[r.start * es..r.end * es])),
            _ => Err(Error::NotSupported {
                op: "checkpoint::save",
                detail: "on a piece that is not a contiguous host tensor".into(),
            }),
        }
    })
}

/// The layout of rank `r`'s file under `plan`.
fn file_layout(plan: &SavePlan, all: &[Offers], r: usize) -> (Vec<FileEntry>, FileLayout) {
    let entries = plan.writes[r]
        .iter()
        .map(|&i| {
            let o = &all[r].offers[i];
            let dtype = tensorplay_core::serialize::dtype_from_name(&o.dtype).unwrap_or(DType::F32);
            FileEntry {
                fqn: o.fqn.clone(),
                dtype,
                size: o.size.clone(),
                offsets: o.offsets.clone(),
                sizes: o.sizes.clone(),
            }
        })
        .collect::<Vec<_>>();
    let l = layout(&entries);
    (entries, l)
}

/// A piece's bytes: a host tensor's (a synchronous save) or a staged copy (an async one).
pub(crate) enum Bytes<'a> {
    Tensor(&'a Tensor),
    Host(&'a [u8]),
}

/// Writes a rank's file (`l`'s header, then the pieces in order); returns each piece's
/// CRC-32 as 8 hex digits.
pub(crate) fn write_file(
    writer: &mut dyn StorageWriter,
    name: &str,
    l: &FileLayout,
    data: &[Bytes<'_>],
) -> Result<Vec<String>> {
    let mut crcs = Vec::with_capacity(data.len());
    writer.write_file(name, &mut |w: &mut dyn Write| {
        let io = |e: std::io::Error| Error::Checkpoint {
            path: name.to_string(),
            problem: format!("could not write it: {e}"),
        };
        w.write_all(&l.header).map_err(io)?;
        for piece in data {
            let mut put = |b: &[u8]| w.write_all(b).map(|()| crc32fast::hash(b));
            let crc = match piece {
                Bytes::Tensor(t) => with_bytes(t, put)?,
                Bytes::Host(b) => put(b),
            }
            .map_err(io)?;
            crcs.push(format!("{crc:08x}"));
        }
        Ok(())
    })?;
    Ok(crcs)
}

/// A host copy of a contiguous host tensor's bytes (what an async save writes from).
pub(crate) fn staged(t: &Tensor) -> Result<Vec<u8>> {
    with_bytes(t, <[u8]>::to_vec)
}

/// Saves `state` as a checkpoint in the folder `checkpoint_dir` (`torch.distributed.checkpoint.save`):
/// collective over `group` (the default group when `None` and one is initialised; a single
/// process otherwise: PyTorch's `no_dist`). Every rank passes the same names.
///
/// Each tensor's pieces are written once, by one of the ranks that hold them (a replicated
/// tensor by one rank, the ranks taking turns; a shard by its owner; a `Partial` tensor summed
/// first), into one safetensors file per writing rank; rank 0 then writes the metadata
/// ([`Metadata`]: per tensor its shape, dtype and pieces), which commits the checkpoint.
/// Files and metadata are flushed to disk (`fsync`) before the metadata's rename. A save
/// replaces the folder's previous checkpoint only at its commit: a job killed while saving
/// leaves the previous checkpoint loadable. The files of earlier saves are removed after the
/// commit. Returns the committed metadata.
///
/// # Errors
/// On every rank, with nothing committed: [`Error::InvalidArgument`] when the ranks pass
/// different names, or a tensor does not match its placement; [`Error::Checkpoint`] when the
/// ranks' pieces of a tensor disagree (shape, dtype, overlaps, elements no rank holds) or a
/// rank could not write (the failing rank's error names the file and cause, the others name
/// the ranks); the group's errors.
pub fn save(
    state: &StateDict,
    checkpoint_dir: impl AsRef<Path>,
    group: Option<&ProcessGroup>,
) -> Result<Metadata> {
    save_with(state, &mut FileSystemWriter::new(checkpoint_dir), group)
}

/// [`save`] through any [`StorageWriter`].
///
/// # Errors
/// As [`save`].
pub fn save_with(
    state: &StateDict,
    writer: &mut dyn StorageWriter,
    group: Option<&ProcessGroup>,
) -> Result<Metadata> {
    let p = prepare(state, writer, group)?;
    let mine: Vec<Bytes<'_>> = p.mine().map(Bytes::Tensor).collect();
    let written = if mine.is_empty() {
        Ok(Vec::new())
    } else {
        write_file(writer, &p.file_name(), &p.layout(p.ranks.rank), &mine)
    };
    let reports: Vec<(Option<String>, Vec<String>)> = p.ranks.gather(&(
        written.as_ref().err().map(ToString::to_string),
        written.as_ref().cloned().unwrap_or_default(),
    ))?;
    written?;
    if let Some(bad) = failed_ranks(reports.iter().map(|(p, _)| p.as_deref())) {
        return Err(Error::Checkpoint {
            path: writer.location(),
            problem: bad,
        });
    }
    let crcs: Vec<Vec<String>> = reports.into_iter().map(|(_, c)| c).collect();
    let metadata = p.metadata(&crcs);
    // every rank checks what rank 0 is about to commit (the same metadata everywhere)
    let committed = metadata
        .validate(Path::new(&writer.location()))
        .and_then(|()| {
            if p.ranks.rank == 0 {
                writer.commit(&metadata)
            } else {
                Ok(())
            }
        });
    p.ranks.agree(committed, &writer.location())?;
    writer.remove_stale(&files_of(&metadata));
    Ok(metadata)
}

/// The files a committed checkpoint names (what a clean-up keeps).
pub(crate) fn files_of(metadata: &Metadata) -> BTreeSet<String> {
    metadata
        .tensors
        .values()
        .flat_map(|t| t.chunks.iter().map(|c| c.file.clone()))
        .collect()
}

/// The folders this process is saving into now.
static IN_FLIGHT: std::sync::Mutex<BTreeSet<String>> = std::sync::Mutex::new(BTreeSet::new());

/// This process's claim on a folder for one save (an async save holds it until its background
/// writer ends): a second save into the folder meanwhile is refused, since each save's
/// clean-up removes the files the other's metadata names.
pub(crate) struct FolderClaim(String);

impl FolderClaim {
    fn take(location: String) -> Result<FolderClaim> {
        // one folder however it is spelled (`dir`, `dir/.`, a link to it)
        let location = std::fs::canonicalize(&location)
            .unwrap_or_else(|_| Path::new(&location).components().collect())
            .display()
            .to_string();
        let mut all = IN_FLIGHT
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !all.insert(location.clone()) {
            return Err(Error::Checkpoint {
                path: location,
                problem: "another save into this folder is still in flight in this process (an \
                          async save: wait on its handle before the next save)"
                    .into(),
            });
        }
        Ok(FolderClaim(location))
    }
}

impl Drop for FolderClaim {
    fn drop(&mut self) {
        IN_FLIGHT
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.0);
    }
}

/// What every rank knows once the ranks agreed on a save's plan.
pub(crate) struct Prepared {
    _claim: Option<FolderClaim>,
    pub(crate) ranks: Ranks,
    plan: SavePlan,
    all: Vec<Offers>,
    pub(crate) save_id: String,
    /// This rank's offered pieces (host, contiguous), in offer order.
    data: Vec<Tensor>,
}

impl Prepared {
    /// The pieces this rank writes, in its file's order.
    pub(crate) fn mine(&self) -> impl Iterator<Item = &Tensor> {
        self.plan.writes[self.ranks.rank]
            .iter()
            .filter_map(|&i| self.data.get(i))
    }

    /// Lets go of the pieces (an async save has copied them); [`mine`](Self::mine) is then
    /// empty.
    pub(crate) fn release_pieces(&mut self) {
        self.data.clear();
    }

    /// This rank's file name.
    pub(crate) fn file_name(&self) -> String {
        file_name(&self.save_id, self.ranks.rank)
    }

    /// Rank `r`'s file layout.
    pub(crate) fn layout(&self, r: usize) -> FileLayout {
        file_layout(&self.plan, &self.all, r).1
    }

    /// The metadata once every rank reported its pieces' checksums (`crcs[r]`: rank `r`'s, in
    /// its file's order); the same on every rank.
    pub(crate) fn metadata(&self, crcs: &[Vec<String>]) -> Metadata {
        let mut tensors: BTreeMap<String, TensorStorageMetadata> = self
            .plan
            .tensors
            .iter()
            .map(|(k, (dtype, size))| {
                (
                    k.clone(),
                    TensorStorageMetadata {
                        dtype: dtype.clone(),
                        size: size.clone(),
                        chunks: Vec::new(),
                    },
                )
            })
            .collect();
        for (r, crcs) in crcs.iter().enumerate() {
            let (entries, l) = file_layout(&self.plan, &self.all, r);
            for ((e, range), crc) in entries.iter().zip(&l.ranges).zip(crcs) {
                if let Some(t) = tensors.get_mut(&e.fqn) {
                    t.chunks.push(StoredChunk {
                        offsets: e.offsets.clone(),
                        sizes: e.sizes.clone(),
                        file: file_name(&self.save_id, r),
                        byte_range: *range,
                        crc32: crc.clone(),
                    });
                }
            }
        }
        let mut rank_values: BTreeMap<String, Vec<serde_json::Value>> = BTreeMap::new();
        for o in &self.all {
            for (k, v) in &o.rank_values {
                rank_values.entry(k.clone()).or_default().push(json(v));
            }
        }
        Metadata {
            format: FORMAT.into(),
            version: VERSION,
            save_id: self.save_id.clone(),
            world_size: self.ranks.world,
            tensors,
            values: self.all[0]
                .values
                .iter()
                .map(|(k, v)| (k.clone(), json(v)))
                .collect(),
            rank_values,
        }
    }
}

/// The collective first half of a save: checks, the ranks' offers, the plan, and this rank's
/// pieces on the host.
pub(crate) fn prepare(
    state: &StateDict,
    writer: &mut dyn StorageWriter,
    group: Option<&ProcessGroup>,
) -> Result<Prepared> {
    let ranks = Ranks::of(group)?;
    let (rank, world) = (ranks.rank, ranks.world);
    let mut values = BTreeMap::new();
    let mut rank_values = BTreeMap::new();
    let mut checked = Ok(());
    for (k, v) in state {
        match v {
            StateValue::Value(v) => {
                values.insert(k.clone(), v.to_string());
            }
            StateValue::RankValue(v) => {
                rank_values.insert(k.clone(), v.to_string());
            }
            StateValue::Tensor { local, placement } => {
                // checked before any collective, so that a bad entry cannot desynchronise them
                if checked.is_ok() {
                    checked = check_entry("checkpoint::save", k, local, placement);
                }
            }
        }
    }
    let mut claim = None;
    let checked = checked
        .and_then(|()| {
            claim = Some(FolderClaim::take(writer.location())?);
            Ok(())
        })
        .and_then(|()| writer.set_up());
    let mine = Offers {
        problem: checked.as_ref().err().map(ToString::to_string),
        keys: state.iter().map(|(k, v)| (k.clone(), kind(v))).collect(),
        offers: Vec::new(),
        save_id: if rank == 0 {
            new_save_id()
        } else {
            String::new()
        },
        values,
        rank_values,
    };
    // first round: names and problems (the partial sums below are collective in name order)
    let first = ranks.gather(&mine)?;
    checked?;
    if let Some(bad) = failed_ranks(first.iter().map(|o| o.problem.as_deref())) {
        return Err(Error::Checkpoint {
            path: writer.location(),
            problem: bad,
        });
    }
    if let Some(r) = (1..world).find(|&r| first[r].keys != first[0].keys) {
        type Names<'a> = BTreeSet<&'a (String, u8)>;
        let (a, b): (Names<'_>, Names<'_>) = (
            first[0].keys.iter().collect(),
            first[r].keys.iter().collect(),
        );
        let only0: Vec<_> = a.difference(&b).take(3).collect();
        let only_r: Vec<_> = b.difference(&a).take(3).collect();
        return Err(Error::InvalidArgument {
            op: "checkpoint::save",
            arg: "state_dict",
            expected: "the same names, of the same kinds (1 tensor, 2 Partial tensor, 3 value, \
                       4 per-rank value), on every rank"
                .into(),
            got: format!(
                "rank {rank} sees rank 0 and rank {r} differ: only rank 0 has {only0:?}, only \
                 rank {r} has {only_r:?}"
            ),
        });
    }
    let pieces = pieces(state);
    let offers = pieces.as_ref().map(|(o, _)| o.clone()).unwrap_or_default();
    let reported: Vec<(Option<String>, Vec<WriteOffer>)> =
        ranks.gather(&(pieces.as_ref().err().map(ToString::to_string), offers))?;
    let (_, data) = pieces?;
    if let Some(bad) = failed_ranks(reported.iter().map(|(p, _)| p.as_deref())) {
        return Err(Error::Checkpoint {
            path: writer.location(),
            problem: bad,
        });
    }
    let all_offers: Vec<Vec<WriteOffer>> = reported.into_iter().map(|(_, o)| o).collect();
    let plan = plan_writes(&all_offers).map_err(|p| Error::Checkpoint {
        path: writer.location(),
        problem: p,
    })?;
    let all: Vec<Offers> = first
        .into_iter()
        .zip(all_offers)
        .map(|(mut f, o)| {
            f.offers = o;
            f
        })
        .collect();
    let save_id = all[0].save_id.clone();
    Ok(Prepared {
        _claim: claim,
        ranks,
        plan,
        all,
        save_id,
        data,
    })
}
