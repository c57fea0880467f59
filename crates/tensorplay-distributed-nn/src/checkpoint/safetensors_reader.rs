//! [`SafetensorsReader`]: one ordinary safetensors file of whole tensors (a consolidated
//! checkpoint, a file `tp::save` or PyTorch's `safetensors` wrote) read as a checkpoint, so
//! that it loads straight into a sharded model: each rank reads the rows its pieces need.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use tensorplay_collectives::ProcessGroup;
use tensorplay_core::Result;

use super::load::load_with;
use super::metadata::{FORMAT, Metadata, StoredChunk, TensorStorageMetadata, VERSION, bad};
use super::state::StateDict;
use super::storage::StorageReader;

/// The largest header read (safetensors' own bound is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// A safetensors file read as a checkpoint of one piece per tensor (PyTorch's
/// `HuggingFaceStorageReader`, for one file). Its pieces carry no checksums: a load reads only
/// the rows each rank needs. The file's string metadata is not read, and tensors of dtypes
/// tensorplay lacks (`I32`, `U8`, ...) are left out (a load that asks for one is told the file
/// has no such tensor).
#[derive(Debug)]
pub struct SafetensorsReader {
    path: PathBuf,
    file: Option<File>,
}

impl SafetensorsReader {
    /// A reader of the safetensors file `path`.
    pub fn new(path: impl AsRef<Path>) -> SafetensorsReader {
        SafetensorsReader {
            path: path.as_ref().to_path_buf(),
            file: None,
        }
    }

    fn open(&mut self) -> Result<&File> {
        if self.file.is_none() {
            let f = File::open(&self.path)
                .map_err(|e| bad(&self.path, format!("could not open it: {e}")))?;
            self.file = Some(f);
        }
        self.file
            .as_ref()
            .ok_or_else(|| bad(&self.path, "could not open it"))
    }

    fn name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

impl StorageReader for SafetensorsReader {
    fn location(&self) -> String {
        self.path
            .parent()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    }

    fn read_metadata(&mut self) -> Result<Metadata> {
        let path = self.path.clone();
        let name = self.name();
        let f = self.open()?;
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let mut n = [0u8; 8];
        f.read_exact_at(&mut n, 0)
            .map_err(|_| bad(&path, format!("not a safetensors file: {len} bytes")))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || 8 + n > len {
            return Err(bad(
                &path,
                format!("not a safetensors file: a header of {n} bytes in a file of {len}"),
            ));
        }
        let mut text = vec![0u8; n as usize];
        f.read_exact_at(&mut text, 8)
            .map_err(|e| bad(&path, format!("could not read it: {e}")))?;
        let header: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&text)
            .map_err(|e| bad(&path, format!("not a safetensors header: {e}")))?;
        let data = 8 + n;
        let mut tensors = BTreeMap::new();
        for (key, v) in header {
            if key == "__metadata__" {
                continue;
            }
            let entry = (|| {
                let dtype = v["dtype"].as_str()?.to_string();
                let size: Vec<usize> = v["shape"]
                    .as_array()?
                    .iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect::<Option<_>>()?;
                let o = v["data_offsets"].as_array()?;
                let (a, b) = (o.first()?.as_u64()?, o.get(1)?.as_u64()?);
                Some((dtype, size, a.checked_add(data)?, b.checked_add(data)?))
            })();
            let Some((dtype, size, start, end)) = entry else {
                return Err(bad(
                    &path,
                    format!("tensor {key:?}: not a safetensors entry (dtype, shape, data_offsets)"),
                ));
            };
            if tensorplay_core::serialize::dtype_from_name(&dtype).is_none() {
                // a dtype tensorplay lacks (I32, U8, ...): loadable only if not asked for
                continue;
            }
            if end > len {
                return Err(bad(
                    &path,
                    format!("truncated: tensor {key:?} ends at byte {end}, the file has {len}"),
                ));
            }
            let chunk = StoredChunk {
                offsets: vec![0; size.len()],
                sizes: size.clone(),
                file: name.clone(),
                byte_range: [start, end],
                // not checked (see `checksummed`): 8 digits for the metadata's own checks
                crc32: "00000000".into(),
            };
            tensors.insert(
                key,
                TensorStorageMetadata {
                    dtype,
                    size,
                    chunks: vec![chunk],
                },
            );
        }
        let md = Metadata {
            format: FORMAT.into(),
            version: VERSION,
            save_id: format!("safetensors:{}", path.display()),
            world_size: 1,
            tensors,
            values: BTreeMap::new(),
            rank_values: BTreeMap::new(),
        };
        md.validate(&path)?;
        Ok(md)
    }

    fn metadata_path(&self) -> String {
        self.path.display().to_string()
    }

    fn read_into(&mut self, file: &str, start: u64, buf: &mut [u8]) -> Result<()> {
        let path = self.path.clone();
        if file != self.name() {
            return Err(bad(&path, format!("asked for another file, {file:?}")));
        }
        let f = self.open()?;
        f.read_exact_at(buf, start).map_err(|e| {
            bad(
                &path,
                format!(
                    "could not read bytes {start}..{}: {e}",
                    start + buf.len() as u64
                ),
            )
        })
    }

    fn checksummed(&self) -> bool {
        false
    }
}

/// Loads the whole tensors of the safetensors file `file` into `state`, in place: a
/// [`load`](super::load) from a [`SafetensorsReader`] (collective over `group` as `load` is;
/// each rank reads the rows its local pieces need, so a consolidated checkpoint, or a file of
/// whole weights, goes straight into a sharded model). Every tensor entry of `state` must be in
/// the file with the same whole shape and dtype; `state`'s values cannot be (the file holds
/// tensors only).
///
/// # Errors
/// As [`load`](super::load), on every rank with nothing changed: the file is missing, not a
/// safetensors file, truncated, or lacks a tensor of `state`, or holds it with another shape
/// or dtype.
pub fn load_safetensors(
    state: &mut StateDict,
    file: impl AsRef<Path>,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    load_with(state, &mut SafetensorsReader::new(file), group)
}
