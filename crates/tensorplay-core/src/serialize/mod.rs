//! Checkpoints on disk: named tensors (a module's `state_dict`, an optimizer's state) in the
//! [safetensors](https://huggingface.co/docs/safetensors) format, which PyTorch
//! (`safetensors.torch.load_file`), candle and JAX read.
//!
//! ```
//! use tensorplay::{self as tp, nn::{Linear, Module}};
//! let dir = std::env::temp_dir().join(format!("tp-doc-save-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("model.safetensors");
//!
//! let model = Linear::new(3, 2, true)?;
//! tp::save(&model.state_dict()?, &path)?;
//! let mut copy = Linear::new(3, 2, true)?;
//! copy.load_state_dict(&tp::load(&path)?, true)?;
//! assert_eq!(copy.weight.to_vec::<f32>()?, model.weight.to_vec::<f32>()?);
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok::<(), tp::Error>(())
//! ```
//!
//! The file: an 8-byte little-endian header length, a JSON header listing each tensor's dtype
//! (`F32`, `F64`, `I64`, `BOOL`), shape and byte range, then the bytes, row-major and
//! little-endian. The header's `__metadata__` holds strings: tensorplay writes
//! `tensorplay.crc32`, a checksum of the data that a load verifies (files from other programs
//! have none and load unchecked), and optimizer states add their kind and parameter groups.
//!
//! Saves are atomic: the file is written beside the target under a temporary name, flushed to
//! disk (`fsync`), renamed over the target, and the folder is flushed. A process killed while
//! saving leaves the previous file whole (and possibly a `.name.tmp-*` file, which no load
//! reads). A truncated, corrupt or foreign file is refused with [`Error::Checkpoint`](crate::Error::Checkpoint)
//! naming it and what is wrong.

mod atomic;
mod safetensors;

pub(crate) use atomic::problem;
pub use safetensors::{
    CHECKSUM_KEY, Checksum, dtype_from_name, dtype_name, load, load_with_metadata, save,
    save_with_metadata,
};

/// Writes `bytes` to `path` atomically (temporary file, `fsync`, rename, `fsync` of the
/// folder), for the small metadata files that sit beside checkpoints (a sharded checkpoint's
/// `.json`).
///
/// Errors: [`Error::Checkpoint`](crate::Error::Checkpoint) naming the file when it cannot be
/// written.
pub fn write_atomically(path: impl AsRef<std::path::Path>, bytes: &[u8]) -> crate::Result<()> {
    atomic::write_atomically(path.as_ref(), bytes)
}
