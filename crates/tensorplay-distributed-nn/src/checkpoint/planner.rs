//! The planning of a distributed checkpoint, as pure functions: which rank writes which piece
//! of each tensor (the global save plan: replicated pieces written once, spread over the ranks
//! that hold them), and which saved pieces each piece a rank loads is cut from (the read plan:
//! box intersections, which is what makes a checkpoint saved by N ranks load on M).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tensorplay_core::serialize::dtype_from_name;

use super::state_dict::ChunkStorageMetadata;

/// One piece of a tensor that a rank holds: its place in the whole tensor and where it lies in
/// the rank's local tensor (the piece is `local[local_offsets[0]..][..sizes[0]], ...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalChunk {
    /// The piece in the whole tensor's coordinates.
    pub chunk: ChunkStorageMetadata,
    /// Where the piece starts in the local tensor, per dimension.
    pub local_offsets: Vec<usize>,
}

/// The common part of two pieces of one tensor; `None` when they share no element. Two pieces
/// of a 0-d tensor are both the whole.
pub fn intersect(
    a: &ChunkStorageMetadata,
    b: &ChunkStorageMetadata,
) -> Option<ChunkStorageMetadata> {
    if a.offsets.len() != b.offsets.len() {
        return None;
    }
    let mut offsets = Vec::with_capacity(a.offsets.len());
    let mut sizes = Vec::with_capacity(a.offsets.len());
    for d in 0..a.offsets.len() {
        let start = a.offsets[d].max(b.offsets[d]);
        let end = (a.offsets[d] + a.sizes[d]).min(b.offsets[d] + b.sizes[d]);
        if end <= start {
            return None;
        }
        offsets.push(start);
        sizes.push(end - start);
    }
    Some(ChunkStorageMetadata { offsets, sizes })
}

/// Whether two pieces of one tensor share an element.
pub fn overlaps(a: &ChunkStorageMetadata, b: &ChunkStorageMetadata) -> bool {
    intersect(a, b).is_some()
}

/// A piece of a tensor a rank holds and could write, as the ranks tell each other before a
/// save.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteOffer {
    /// The tensor's fully qualified name.
    pub fqn: String,
    /// Its dtype's safetensors name.
    pub dtype: String,
    /// The whole tensor's shape.
    pub size: Vec<usize>,
    /// The piece's offsets in the whole.
    pub offsets: Vec<usize>,
    /// The piece's sizes.
    pub sizes: Vec<usize>,
}

impl WriteOffer {
    /// Elements in the piece.
    pub fn numel(&self) -> usize {
        self.sizes.iter().product()
    }
    /// Bytes of the piece.
    pub fn bytes(&self) -> usize {
        self.numel() * dtype_from_name(&self.dtype).map_or(1, |d| d.size_in_bytes())
    }
    /// The piece's place in the whole.
    pub fn chunk(&self) -> ChunkStorageMetadata {
        ChunkStorageMetadata {
            offsets: self.offsets.clone(),
            sizes: self.sizes.clone(),
        }
    }
}

/// What the global save plan decides: per rank, the indices of its offers it writes (in
/// offer order), and per tensor its dtype and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavePlan {
    /// `writes[r]`: the offers of rank `r` that rank `r` writes.
    pub writes: Vec<Vec<usize>>,
    /// Per tensor name: (dtype name, whole shape).
    pub tensors: BTreeMap<String, (String, Vec<usize>)>,
}

/// The global save plan from every rank's offers (`offers[r]`: rank `r`'s), the same on every
/// rank that computes it: each distinct piece (same tensor, offsets and sizes) is written once,
/// by the rank holding it that has the fewest bytes to write so far (ties: the lowest rank),
/// so replicated tensors spread over the ranks; empty pieces are not written.
///
/// Errors (a message naming the tensor and ranks): ranks that disagree on a tensor's dtype or
/// shape; pieces of one tensor that overlap without being equal; elements no rank holds.
pub fn plan_writes(offers: &[Vec<WriteOffer>]) -> Result<SavePlan, String> {
    let mut tensors: BTreeMap<String, (String, Vec<usize>, usize)> = BTreeMap::new();
    // (fqn, offsets, sizes) -> holders (rank, index)
    type Key<'a> = (&'a str, &'a [usize], &'a [usize]);
    let mut holders: BTreeMap<Key<'_>, Vec<(usize, usize)>> = BTreeMap::new();
    for (r, list) in offers.iter().enumerate() {
        for (i, o) in list.iter().enumerate() {
            match tensors.get(&o.fqn) {
                Some((dtype, size, first)) if (dtype, size) != (&o.dtype, &o.size) => {
                    return Err(format!(
                        "tensor {:?}: rank {first} holds it as {dtype} of shape {size:?}, rank \
                         {r} as {} of shape {:?}",
                        o.fqn, o.dtype, o.size
                    ));
                }
                Some(_) => {}
                None => {
                    tensors.insert(o.fqn.clone(), (o.dtype.clone(), o.size.clone(), r));
                }
            }
            if o.offsets.len() != o.size.len() || o.sizes.len() != o.size.len() {
                return Err(format!(
                    "tensor {:?}: rank {r}'s piece has {} offsets and {} sizes for shape {:?}",
                    o.fqn,
                    o.offsets.len(),
                    o.sizes.len(),
                    o.size
                ));
            }
            if (0..o.size.len()).any(|d| o.offsets[d] + o.sizes[d] > o.size[d]) {
                return Err(format!(
                    "tensor {:?}: rank {r}'s piece (offsets {:?}, sizes {:?}) reaches past \
                     its shape {:?}",
                    o.fqn, o.offsets, o.sizes, o.size
                ));
            }
            if o.numel() == 0 {
                continue;
            }
            holders
                .entry((o.fqn.as_str(), o.offsets.as_slice(), o.sizes.as_slice()))
                .or_default()
                .push((r, i));
        }
    }
    // every element held exactly once by the distinct pieces
    let mut by_tensor: BTreeMap<&str, Vec<(ChunkStorageMetadata, usize)>> = BTreeMap::new();
    for ((fqn, offsets, sizes), who) in &holders {
        let c = ChunkStorageMetadata {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
        };
        by_tensor.entry(fqn).or_default().push((c, who[0].0));
    }
    for (fqn, (_, size, _)) in &tensors {
        let pieces = by_tensor.get(fqn.as_str()).map_or(&[][..], Vec::as_slice);
        for (i, (a, ra)) in pieces.iter().enumerate() {
            for (b, rb) in &pieces[i + 1..] {
                if overlaps(a, b) {
                    return Err(format!(
                        "tensor {fqn:?}: rank {ra}'s piece (offsets {:?}, sizes {:?}) and rank \
                         {rb}'s (offsets {:?}, sizes {:?}) overlap without being the same piece",
                        a.offsets, a.sizes, b.offsets, b.sizes
                    ));
                }
            }
        }
        let held: usize = pieces.iter().map(|(c, _)| c.numel()).sum();
        let total: usize = size.iter().product();
        if held != total {
            return Err(format!(
                "tensor {fqn:?} of shape {size:?}: the ranks hold {held} of its {total} elements \
                 (a piece is missing)"
            ));
        }
    }
    let mut writes = vec![Vec::new(); offers.len()];
    let mut load = vec![0usize; offers.len()];
    for who in holders.values() {
        let Some(&(r, i)) = who.iter().min_by_key(|(r, _)| (load[*r], *r)) else {
            continue; // a piece enters the table with its first holder: never empty
        };
        load[r] += offers[r][i].bytes();
        writes[r].push(i);
    }
    for w in &mut writes {
        w.sort_unstable();
    }
    Ok(SavePlan {
        writes,
        tensors: tensors
            .into_iter()
            .map(|(k, (dtype, size, _))| (k, (dtype, size)))
            .collect(),
    })
}

/// One copy of a load: the box `offsets`/`sizes` (whole-tensor coordinates) from saved piece
/// `saved` into the local piece `dest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadItem {
    /// Index of the saved piece.
    pub saved: usize,
    /// Index of the local piece.
    pub dest: usize,
    /// Where the box starts in the whole tensor.
    pub offsets: Vec<usize>,
    /// The box's extent.
    pub sizes: Vec<usize>,
}

/// The copies that fill the local pieces `dest` from the saved pieces `saved` (which hold
/// every element once: [`Metadata::validate`](super::Metadata::validate) checked): one per
/// overlapping pair, so each local element is written exactly once.
pub fn plan_reads(dest: &[LocalChunk], saved: &[ChunkStorageMetadata]) -> Vec<ReadItem> {
    let mut out = Vec::new();
    for (d, l) in dest.iter().enumerate() {
        for (s, c) in saved.iter().enumerate() {
            if let Some(b) = intersect(&l.chunk, c) {
                out.push(ReadItem {
                    saved: s,
                    dest: d,
                    offsets: b.offsets,
                    sizes: b.sizes,
                });
            }
        }
    }
    out
}

/// The pieces of a 2-D split: `outer` are this rank's pieces of the whole tensor as the first
/// split left them (tensor parallelism: global chunks and where each lies in the rank's
/// first-level local tensor); the second split (fully sharded) then keeps rows `rows` of that
/// local tensor. Returns the kept pieces in the whole tensor's coordinates, each with where it
/// lies in the final local tensor (whose row 0 is row `rows.start` of the first-level one).
/// 0-d pieces (never split by the first level) are kept whole by the rank holding row 0.
pub fn compose_rows(outer: &[LocalChunk], rows: std::ops::Range<usize>) -> Vec<LocalChunk> {
    let mut out = Vec::new();
    for c in outer {
        if c.chunk.sizes.is_empty() {
            if rows.start == 0 && !rows.is_empty() {
                out.push(c.clone());
            }
            continue;
        }
        let (at, n) = (c.local_offsets[0], c.chunk.sizes[0]);
        let lo = at.max(rows.start);
        let hi = (at + n).min(rows.end);
        if lo >= hi {
            continue;
        }
        let mut chunk = c.chunk.clone();
        chunk.offsets[0] += lo - at;
        chunk.sizes[0] = hi - lo;
        let mut local_offsets = c.local_offsets.clone();
        local_offsets[0] = lo - rows.start;
        out.push(LocalChunk {
            chunk,
            local_offsets,
        });
    }
    out
}

#[cfg(test)]
mod tests;
