//! The metadata file that commits a distributed checkpoint: per tensor, its global shape,
//! dtype and the chunks written (offsets, sizes, file, byte range, checksum); the
//! checkpoint's non-tensor values; and the checks a load makes before trusting it.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tensorplay_core::serialize::dtype_from_name;
use tensorplay_core::{DType, Error, Result};

use super::planner::{intersect, overlaps};
use super::state_dict::ChunkStorageMetadata;

/// The name of the metadata file in a checkpoint's folder. Rank 0 writes it last, atomically:
/// it is the commit point, and the only file a load starts from.
pub const METADATA_FILE: &str = "metadata.json";

/// The `format` every tensorplay checkpoint's metadata names.
pub const FORMAT: &str = "tensorplay.dcp";

/// The newest version of the format this build writes and reads.
pub const VERSION: u64 = 1;

/// A committed checkpoint's table of contents (PyTorch's `Metadata`), written as JSON to
/// [`METADATA_FILE`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    /// Always [`FORMAT`]: a file of another program is refused.
    pub format: String,
    /// The format's version ([`VERSION`]).
    pub version: u64,
    /// A name unique to this save; its files' names begin with it, so a new save never
    /// overwrites the files of the committed one.
    pub save_id: String,
    /// The number of ranks that saved it.
    pub world_size: usize,
    /// Per fully qualified tensor name, where its pieces are.
    pub tensors: BTreeMap<String, TensorStorageMetadata>,
    /// Values every rank shares (a step count, a data position, a scheduler's state), as JSON.
    #[serde(default)]
    pub values: BTreeMap<String, serde_json::Value>,
    /// Values each rank has its own of (its random state): entry `r` is rank `r`'s.
    #[serde(default)]
    pub rank_values: BTreeMap<String, Vec<serde_json::Value>>,
}

/// One tensor of a checkpoint (PyTorch's `TensorStorageMetadata`): the whole tensor's shape
/// and dtype and the chunks that together hold each of its elements exactly once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorStorageMetadata {
    /// The dtype's safetensors name (`"F32"`, `"BF16"`, ...).
    pub dtype: String,
    /// The whole tensor's shape.
    pub size: Vec<usize>,
    /// The pieces written, each once.
    pub chunks: Vec<StoredChunk>,
}

/// One piece of a tensor on disk: its place in the whole and the bytes that hold it (row-major,
/// little-endian: one tensor of a safetensors file).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredChunk {
    /// Where the piece starts in the whole tensor, per dimension.
    pub offsets: Vec<usize>,
    /// The piece's extent, per dimension.
    pub sizes: Vec<usize>,
    /// The file (a name in the checkpoint's folder).
    pub file: String,
    /// Its bytes: `[start, end)` counted from the start of the file.
    pub byte_range: [u64; 2],
    /// CRC-32 of those bytes, 8 hex digits.
    pub crc32: String,
}

impl StoredChunk {
    /// The piece's place in the whole.
    pub fn chunk(&self) -> ChunkStorageMetadata {
        ChunkStorageMetadata {
            offsets: self.offsets.clone(),
            sizes: self.sizes.clone(),
        }
    }
}

impl TensorStorageMetadata {
    /// The dtype ([`Metadata::validate`] has checked that the name is one).
    pub fn dtype(&self) -> Option<DType> {
        dtype_from_name(&self.dtype)
    }
}

/// A [`Error::Checkpoint`] about `path`.
pub(crate) fn bad(path: &Path, problem: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.display().to_string(),
        problem: problem.into(),
    }
}

impl Metadata {
    /// The metadata in `bytes` (the content of `path`, named by errors), checked with
    /// [`validate`](Metadata::validate).
    ///
    /// Errors: [`Error::Checkpoint`] naming `path`: not JSON (a truncated or corrupt file),
    /// not a tensorplay checkpoint's metadata, or any problem `validate` finds.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Metadata> {
        let v: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|e| bad(path, format!("not JSON (truncated or corrupt?): {e}")))?;
        if v.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(bad(
                path,
                format!(
                    "not the metadata of a tensorplay checkpoint (no \"format\": \"{FORMAT}\"; \
                     written by another program?)"
                ),
            ));
        }
        let m: Metadata = serde_json::from_value(v).map_err(|e| {
            bad(
                path,
                format!("metadata does not have the expected fields: {e}"),
            )
        })?;
        m.validate(path)?;
        Ok(m)
    }

    /// The JSON text written to [`METADATA_FILE`].
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Checks that the metadata describes a loadable checkpoint: the format and version, every
    /// dtype known, every chunk inside its tensor with a byte range of its size, file names
    /// that are plain names in the folder, per-rank values for every rank, and each tensor's
    /// chunks holding every element exactly once (no overlaps, no holes).
    ///
    /// Errors: [`Error::Checkpoint`] naming `path` and the tensor at fault.
    pub fn validate(&self, path: &Path) -> Result<()> {
        if self.format != FORMAT {
            return Err(bad(
                path,
                format!("format {:?}, expected {FORMAT:?}", self.format),
            ));
        }
        if self.version > VERSION {
            return Err(bad(
                path,
                format!(
                    "format version {} is newer than this build reads ({VERSION})",
                    self.version
                ),
            ));
        }
        for (name, t) in &self.tensors {
            validate_tensor(t).map_err(|p| bad(path, format!("tensor {name:?}: {p}")))?;
        }
        for (name, v) in &self.rank_values {
            if v.len() != self.world_size {
                return Err(bad(
                    path,
                    format!(
                        "value {name:?} has {} per-rank entries for a world of {}",
                        v.len(),
                        self.world_size
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Whether `name` is a plain file name (no folder, not `.` or `..`).
pub(crate) fn plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0'])
}

/// The problem with one tensor's entry, if any.
fn validate_tensor(t: &TensorStorageMetadata) -> std::result::Result<(), String> {
    let dtype = t
        .dtype()
        .ok_or_else(|| format!("dtype {:?} is not one tensorplay has", t.dtype))?;
    let too_big = || {
        format!(
            "its shape {:?} has more elements than a machine can address",
            t.size
        )
    };
    let total: u128 = t
        .size
        .iter()
        .try_fold(1u128, |a, &d| a.checked_mul(d as u128))
        .filter(|&n| n <= usize::MAX as u128)
        .ok_or_else(too_big)?;
    let mut covered: u128 = 0;
    for (i, c) in t.chunks.iter().enumerate() {
        if c.offsets.len() != t.size.len() || c.sizes.len() != t.size.len() {
            return Err(format!(
                "chunk {i} has {} offsets and {} sizes for a {}-d tensor",
                c.offsets.len(),
                c.sizes.len(),
                t.size.len()
            ));
        }
        for d in 0..t.size.len() {
            if c.offsets[d]
                .checked_add(c.sizes[d])
                .is_none_or(|e| e > t.size[d])
            {
                return Err(format!(
                    "chunk {i} (offsets {:?}, sizes {:?}) reaches past the shape {:?}",
                    c.offsets, c.sizes, t.size
                ));
            }
        }
        // inside the shape (checked above), so at most `total`
        let numel: u128 = c.sizes.iter().map(|&d| d as u128).product();
        let [start, end] = c.byte_range;
        let want = numel * dtype.size_in_bytes() as u128;
        if end < start || u128::from(end - start) != want {
            return Err(format!(
                "chunk {i}'s byte range {start}..{end} is not the {want} bytes of its {numel} \
                 elements"
            ));
        }
        if !plain_file_name(&c.file) {
            return Err(format!(
                "chunk {i}'s file {:?} is not a file name in the checkpoint's folder",
                c.file
            ));
        }
        if c.crc32.len() != 8 || u32::from_str_radix(&c.crc32, 16).is_err() {
            return Err(format!(
                "chunk {i}'s checksum {:?} is not 8 hex digits",
                c.crc32
            ));
        }
        covered = covered.saturating_add(numel);
    }
    let chunks: Vec<ChunkStorageMetadata> = t.chunks.iter().map(StoredChunk::chunk).collect();
    for (i, a) in chunks.iter().enumerate() {
        for (j, b) in chunks.iter().enumerate().skip(i + 1) {
            if overlaps(a, b) {
                let both = intersect(a, b).map(|c| c.offsets).unwrap_or_default();
                return Err(format!(
                    "chunks {i} and {j} overlap (both hold the element at {both:?})"
                ));
            }
        }
    }
    if covered != total {
        return Err(format!(
            "its chunks hold {covered} of its {total} elements (a hole: a piece is missing)"
        ));
    }
    Ok(())
}
