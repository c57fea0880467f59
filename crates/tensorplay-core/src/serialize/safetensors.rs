//! Named tensors to and from a safetensors file, with a checksum of the data in the header.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};

use super::atomic::{problem, write_atomically};
use crate::{DType, Result, Tensor};

/// The header key of the CRC-32 of every tensor's name, dtype, shape and bytes (in name
/// order), as 8 hex digits. Written by every save; checked by a load when present (files
/// written by other programs have none).
pub const CHECKSUM_KEY: &str = "tensorplay.crc32";

fn to_safetensors(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::I64 => Dtype::I64,
        DType::Bool => Dtype::BOOL,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

fn from_safetensors(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::F64 => Some(DType::F64),
        Dtype::I64 => Some(DType::I64),
        Dtype::BOOL => Some(DType::Bool),
        Dtype::BF16 => Some(DType::BF16),
        Dtype::F16 => Some(DType::F16),
        _ => None,
    }
}

/// The safetensors name of `d`: `"F32"`, `"F64"`, `"I64"`, `"BOOL"`, `"BF16"`, `"F16"` (what
/// a file's header and a distributed checkpoint's metadata write).
pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "F32",
        DType::F64 => "F64",
        DType::I64 => "I64",
        DType::Bool => "BOOL",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
    }
}

/// The dtype whose safetensors name is `name` ([`dtype_name`]'s inverse); `None` for a name
/// tensorplay has no dtype for.
pub fn dtype_from_name(name: &str) -> Option<DType> {
    DType::ALL.into_iter().find(|&d| dtype_name(d) == name)
}

/// The tensor's elements as little-endian bytes, row-major (CUDA tensors copied to the host).
fn bytes_of(t: &Tensor) -> Result<Vec<u8>> {
    Ok(match t.dtype() {
        DType::F32 => t
            .to_vec::<f32>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F64 => t
            .to_vec::<f64>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::I64 => t
            .to_vec::<i64>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::Bool => t.to_vec::<bool>()?.iter().map(|&v| u8::from(v)).collect(),
        DType::BF16 => t
            .to_vec::<half::bf16>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => t
            .to_vec::<half::f16>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    })
}

/// A CPU tensor of `shape` from little-endian `bytes` of `dtype` (whose length the format
/// has checked); `None` when a bool byte is neither 0 nor 1.
fn tensor_of(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Option<Tensor>> {
    fn le<const N: usize, T>(b: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
        b.chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                f(a)
            })
            .collect()
    }
    Ok(Some(match dtype {
        DType::F32 => Tensor::from_vec(le(bytes, f32::from_le_bytes), shape)?,
        DType::F64 => Tensor::from_vec(le(bytes, f64::from_le_bytes), shape)?,
        DType::I64 => Tensor::from_vec(le(bytes, i64::from_le_bytes), shape)?,
        DType::BF16 => Tensor::from_vec(le(bytes, half::bf16::from_le_bytes), shape)?,
        DType::F16 => Tensor::from_vec(le(bytes, half::f16::from_le_bytes), shape)?,
        DType::Bool => {
            if bytes.iter().any(|&b| b > 1) {
                return Ok(None);
            }
            Tensor::from_vec(bytes.iter().map(|&b| b == 1).collect::<Vec<bool>>(), shape)?
        }
    }))
}

/// The checksum of `(name, dtype, shape, bytes)` entries, in name order, and of the header's
/// string metadata (every key but [`CHECKSUM_KEY`], in key order): a flipped bit anywhere in
/// the values or the metadata (an optimizer's learning rate, a run's progress) is caught.
fn checksum<'a>(
    entries: impl Iterator<Item = (&'a str, Dtype, &'a [usize], &'a [u8])>,
    metadata: &BTreeMap<String, String>,
) -> String {
    let mut h = Checksum::new(metadata);
    for (name, dtype, shape, bytes) in entries {
        h.tensor_st(name, dtype, shape, bytes.len());
        h.bytes(bytes);
    }
    h.finish()
}

/// The checksum a save writes under [`CHECKSUM_KEY`], computed piece by piece, for a writer
/// that streams a file's tensors instead of holding them (a checkpoint's consolidation): feed
/// it the header's metadata (without [`CHECKSUM_KEY`]), then, in name order, each tensor's
/// [`tensor`](Checksum::tensor) entry followed by its data [`bytes`](Checksum::bytes) (in any
/// number of calls, row-major, little-endian).
#[derive(Debug, Clone)]
pub struct Checksum(crc32fast::Hasher);

impl Checksum {
    /// A checksum starting with the header's string `metadata`.
    pub fn new(metadata: &BTreeMap<String, String>) -> Checksum {
        let mut h = crc32fast::Hasher::new();
        for (k, v) in metadata {
            for part in [k, v] {
                h.update(&(part.len() as u64).to_le_bytes());
                h.update(part.as_bytes());
            }
        }
        Checksum(h)
    }

    /// Starts tensor `name` of `dtype` and `shape`, whose data is `nbytes` bytes.
    pub fn tensor(&mut self, name: &str, dtype: DType, shape: &[usize], nbytes: usize) {
        self.tensor_st(name, to_safetensors(dtype), shape, nbytes);
    }

    fn tensor_st(&mut self, name: &str, dtype: Dtype, shape: &[usize], nbytes: usize) {
        let h = &mut self.0;
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(format!("{dtype:?}").as_bytes());
        h.update(&(shape.len() as u64).to_le_bytes());
        for &d in shape {
            h.update(&(d as u64).to_le_bytes());
        }
        h.update(&(nbytes as u64).to_le_bytes());
    }

    /// The next bytes of the current tensor's data.
    pub fn bytes(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The checksum, 8 hex digits.
    pub fn finish(self) -> String {
        format!("{:08x}", self.0.finalize())
    }
}

/// Writes `tensors` to the safetensors file `path` (`safetensors.torch.save_file`), replacing
/// it atomically: a crash mid-save leaves the previous file whole (see the
/// [module](super) docs). Every dtype is stored as itself (`F32`, `F64`, `I64`, `BOOL`), in
/// row-major order, little-endian; CUDA tensors are copied to the host, views are written as
/// their elements. The header holds a checksum of the data ([`CHECKSUM_KEY`]).
///
/// Errors: [`Error::Checkpoint`](crate::Error::Checkpoint) naming the file when it cannot be
/// written (missing folder, permissions, a full disk).
pub fn save(tensors: &BTreeMap<String, Tensor>, path: impl AsRef<Path>) -> Result<()> {
    save_with_metadata(tensors, &BTreeMap::new(), path)
}

/// [`save`] with string `metadata` in the file's header (`__metadata__`, the format's place
/// for non-tensor data such as step counts or hyperparameters).
///
/// Errors: as [`save`]; [`Error::InvalidArgument`](crate::Error::InvalidArgument) when
/// `metadata` uses the key [`CHECKSUM_KEY`].
pub fn save_with_metadata(
    tensors: &BTreeMap<String, Tensor>,
    metadata: &BTreeMap<String, String>,
    path: impl AsRef<Path>,
) -> Result<()> {
    let path = path.as_ref();
    if metadata.contains_key(CHECKSUM_KEY) {
        return Err(crate::Error::invalid(
            "save_with_metadata",
            "metadata",
            format!("no key `{CHECKSUM_KEY}` (the checksum this module writes)"),
            CHECKSUM_KEY,
        ));
    }
    let mut data: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        data.push((
            name,
            to_safetensors(t.dtype()),
            t.shape().to_vec(),
            bytes_of(t)?,
        ));
    }
    let sum = checksum(
        data.iter()
            .map(|(n, d, s, b)| (*n, *d, s.as_slice(), b.as_slice())),
        metadata,
    );
    let mut header: HashMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    header.insert(CHECKSUM_KEY.to_string(), sum);
    let mut views = Vec::with_capacity(data.len());
    for (name, dtype, shape, bytes) in &data {
        let v = TensorView::new(*dtype, shape.clone(), bytes)
            .map_err(|e| problem(path, format!("tensor `{name}`: {e}")))?;
        views.push((*name, v));
    }
    let bytes = safetensors::serialize(views, Some(header))
        .map_err(|e| problem(path, format!("could not encode it: {e}")))?;
    write_atomically(path, &bytes)
}

/// Reads every tensor of the safetensors file `path` (`safetensors.torch.load_file`), onto the
/// CPU; the counterpart of [`save`], bit-exact.
///
/// Errors: [`Error::Checkpoint`](crate::Error::Checkpoint) naming the file and what is wrong:
/// it cannot be read; it is too short or its header is not a safetensors header (another
/// format); it is truncated or its offsets do not cover the data; its checksum does not match
/// (corrupt); a tensor has a dtype tensorplay lacks (such as `I32` or `F8_E4M3`, named).
pub fn load(path: impl AsRef<Path>) -> Result<BTreeMap<String, Tensor>> {
    Ok(load_with_metadata(path)?.0)
}

/// [`load`], also returning the header's string metadata (without [`CHECKSUM_KEY`]).
///
/// Errors: as [`load`].
pub fn load_with_metadata(
    path: impl AsRef<Path>,
) -> Result<(BTreeMap<String, Tensor>, BTreeMap<String, String>)> {
    let path = path.as_ref();
    // a FIFO or a device would block or never end: checkpoints are regular files
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => {
            return Err(problem(
                path,
                "not a regular file (a folder, a pipe or a device)",
            ));
        }
        Err(e) => return Err(problem(path, format!("could not read it: {e}"))),
        Ok(_) => {}
    }
    let buf = std::fs::read(path).map_err(|e| problem(path, format!("could not read it: {e}")))?;
    let st = SafeTensors::deserialize(&buf).map_err(|e| problem(path, explain(&buf, e)))?;
    let (_, header) =
        SafeTensors::read_metadata(&buf).map_err(|e| problem(path, explain(&buf, e)))?;
    let mut metadata: BTreeMap<String, String> = header
        .metadata()
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let expected_sum = metadata.remove(CHECKSUM_KEY);
    // a flipped bit in the checksum's own key would turn the check off: refuse a key one bit
    // away from it
    if expected_sum.is_none()
        && let Some(k) = metadata.keys().find(|k| one_bit_apart(k, CHECKSUM_KEY))
    {
        return Err(problem(
            path,
            format!("corrupt header: the key `{k}` is one bit away from `{CHECKSUM_KEY}`"),
        ));
    }
    let mut views: Vec<(String, TensorView<'_>)> = st.tensors();
    views.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(want) = expected_sum {
        let got = checksum(
            views
                .iter()
                .map(|(n, v)| (n.as_str(), v.dtype(), v.shape(), v.data())),
            &metadata,
        );
        if got != want {
            return Err(problem(
                path,
                format!(
                    "corrupt: the checksum of its tensors and metadata is {got}, the header says {want}"
                ),
            ));
        }
    }
    let mut out = BTreeMap::new();
    for (name, v) in views {
        let dtype = from_safetensors(v.dtype()).ok_or_else(|| {
            problem(
                path,
                format!(
                    "tensor `{name}` has dtype {:?}; tensorplay reads F32, F64, BF16, F16, I64 and BOOL",
                    v.dtype()
                ),
            )
        })?;
        let t = tensor_of(dtype, v.shape(), v.data())
            .map_err(|e| problem(path, format!("tensor `{name}`: {e}")))?
            .ok_or_else(|| {
                problem(
                    path,
                    format!("corrupt: bool tensor `{name}` holds a byte other than 0 or 1"),
                )
            })?;
        out.insert(name, t);
    }
    Ok((out, metadata))
}

/// Whether `a` and `b` differ in exactly one bit.
fn one_bit_apart(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .map(|(x, y)| (x ^ y).count_ones())
            .sum::<u32>()
            == 1
}

/// What a format error means for a user holding `buf`.
fn explain(buf: &[u8], e: safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    let len = buf.len();
    match e {
        E::HeaderTooSmall => format!(
            "not a safetensors file: {len} bytes, shorter than the 8-byte header length it starts with (truncated?)"
        ),
        E::HeaderTooLarge | E::InvalidHeaderStart | E::InvalidHeader(_) => format!(
            "not a safetensors file (its first bytes are not a header length followed by a JSON header{}): {e}",
            foreign_hint(buf)
        ),
        E::InvalidHeaderLength => {
            format!("truncated: {len} bytes, shorter than its header says ({e})")
        }
        E::InvalidHeaderDeserialization(_) => format!(
            "not a safetensors file, or a corrupt header{}: {e}",
            foreign_hint(buf)
        ),
        E::MetadataIncompleteBuffer => format!(
            "truncated or padded: its {len} bytes do not match the tensors its header lists"
        ),
        other => format!("corrupt header: {other}"),
    }
}

/// A hint when `buf` looks like a format people confuse with safetensors.
fn foreign_hint(buf: &[u8]) -> &'static str {
    if buf.starts_with(b"PK\x03\x04") {
        "; it looks like a zip archive, as `torch.save` writes: save with safetensors instead"
    } else if buf.first() == Some(&0x80) {
        "; it looks like a Python pickle"
    } else {
        ""
    }
}
