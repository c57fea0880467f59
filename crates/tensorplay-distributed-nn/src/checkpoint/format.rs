//! A rank's file in a distributed checkpoint: an ordinary safetensors file whose tensors are
//! the pieces the rank writes, back to back, with the header's `__metadata__` saying where
//! each piece lies in its whole tensor (as DCP's Hugging Face writer records its sharding).
//! The layout is computed before any byte is written, so every byte range is known from the
//! plan alone.

use std::collections::BTreeMap;

use tensorplay_core::DType;
use tensorplay_core::serialize::dtype_name;

/// The header key whose value (JSON) maps each tensor of the file to its piece:
/// `{"<name>": {"fqn": .., "offsets": [..], "size": [..]}}`.
pub const SHARDING_KEY: &str = "tensorplay.sharding";

/// The name of rank `rank`'s file of the save `save_id`.
pub(crate) fn file_name(save_id: &str, rank: usize) -> String {
    format!("shard-{save_id}-rank{rank}.safetensors")
}

/// Whether `name` is a rank's file of some save (what a clean-up may remove when the committed
/// metadata does not name it).
pub(crate) fn is_shard_file(name: &str) -> bool {
    name.starts_with("shard-") && name.ends_with(".safetensors") && name.contains("-rank")
}

/// One piece in a rank's file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileEntry {
    /// The fully qualified name of its tensor.
    pub(crate) fqn: String,
    /// The tensor's dtype.
    pub(crate) dtype: DType,
    /// The whole tensor's shape.
    pub(crate) size: Vec<usize>,
    /// The piece's offsets in the whole.
    pub(crate) offsets: Vec<usize>,
    /// The piece's sizes (its shape in the file).
    pub(crate) sizes: Vec<usize>,
}

impl FileEntry {
    fn bytes(&self) -> u64 {
        (self.sizes.iter().product::<usize>() * self.dtype.size_in_bytes()) as u64
    }
}

/// Where everything of a rank's file goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileLayout {
    /// The file's first bytes: the 8-byte little-endian header length, then the JSON header
    /// padded with spaces so that the data starts at a multiple of 8.
    pub(crate) header: Vec<u8>,
    /// Each entry's bytes, `[start, end)` from the start of the file, in entry order.
    pub(crate) ranges: Vec<[u64; 2]>,
}

/// The tensor names of `entries` in the file: the tensor's name when the file holds one piece
/// of it, `<name>#<k>` for its k-th piece otherwise.
fn names(entries: &[FileEntry]) -> Vec<String> {
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for e in entries {
        *count.entry(&e.fqn).or_default() += 1;
    }
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    entries
        .iter()
        .map(|e| {
            if count[e.fqn.as_str()] == 1 {
                e.fqn.clone()
            } else {
                let k = seen.entry(&e.fqn).or_default();
                *k += 1;
                format!("{}#{}", e.fqn, *k - 1)
            }
        })
        .collect()
}

/// The layout of a file holding `entries` in order.
pub(crate) fn layout(entries: &[FileEntry]) -> FileLayout {
    let names = names(entries);
    let mut header = serde_json::Map::new();
    let mut sharding = serde_json::Map::new();
    let mut at = 0u64;
    let mut data = Vec::with_capacity(entries.len());
    for (e, name) in entries.iter().zip(&names) {
        let end = at + e.bytes();
        header.insert(
            name.clone(),
            serde_json::json!({
                "dtype": dtype_name(e.dtype),
                "shape": e.sizes,
                "data_offsets": [at, end],
            }),
        );
        sharding.insert(
            name.clone(),
            serde_json::json!({"fqn": e.fqn, "offsets": e.offsets, "size": e.size}),
        );
        data.push([at, end]);
        at = end;
    }
    header.insert(
        "__metadata__".into(),
        serde_json::json!({
            "format": "pt",
            SHARDING_KEY: serde_json::Value::Object(sharding).to_string(),
        }),
    );
    let mut json = serde_json::Value::Object(header).to_string().into_bytes();
    while !(8 + json.len()).is_multiple_of(8) {
        json.push(b' ');
    }
    let start = 8 + json.len() as u64;
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    FileLayout {
        header: bytes,
        ranges: data
            .into_iter()
            .map(|[a, b]| [start + a, start + b])
            .collect(),
    }
}
