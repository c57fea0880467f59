//! The receiver's side: reading a tensor from a peer's segment through a kept mapping, then
//! giving the segment back.

use std::fs::{File, OpenOptions};
use std::mem::MaybeUninit;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tensorplay_collectives::shm_host::{MapMode, Mmap, euid};
use tensorplay_core::{DType, Tensor};

use super::alloc::new_vec_with;
use super::sender::release;
use super::{busy_name, shm_err};
use crate::{Error, Result};

/// Reads a tensor of `n` elements of `dtype` from the peer's segment, then gives the segment
/// back (whether or not the read succeeded).
pub(crate) fn read_tensor(
    dir: &Path,
    seg: u64,
    xfer: u64,
    dtype: DType,
    n: usize,
    shape: &[usize],
) -> Result<Tensor> {
    let r = read_inner(dir, seg, xfer, dtype, n, shape);
    release(dir, seg, xfer);
    r
}

fn read_inner(
    dir: &Path,
    seg: u64,
    xfer: u64,
    dtype: DType,
    n: usize,
    shape: &[usize],
) -> Result<Tensor> {
    let bytes = n
        .checked_mul(dtype.size_in_bytes())
        .ok_or_else(|| Error::Serialization("tensor size overflows".into()))?;
    let path = dir.join(busy_name(seg, xfer));
    // O_NONBLOCK: a FIFO planted under the name cannot block us (regular files ignore it)
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path)
        .map_err(|e| shm_err(&format!("opening the peer's segment {}", path.display()), e))?;
    let meta = file.metadata().map_err(|e| shm_err("segment", e))?;
    // the sender wrote the bytes, so the file holds real pages for them (a sparse file that
    // only claims a size cannot make us allocate memory the peer never committed)
    if !meta.is_file()
        || meta.len() < bytes as u64
        || meta.blocks().saturating_mul(512) < bytes as u64
        || meta.uid() != euid()
    {
        return Err(Error::Serialization(format!(
            "the peer's shared-memory segment {} cannot hold the {bytes} bytes its message describes",
            path.display()
        )));
    }
    if bytes == 0 {
        return tensor_of(dtype, shape, |_| Ok(()), n);
    }
    let map =
        peer_mapping(dir, seg, &file, &meta, bytes).map_err(|e| shm_err("mapping a segment", e))?;
    drop(file);
    tensor_of(
        dtype,
        shape,
        |dst| {
            // SAFETY: the mapping is at least `bytes` long (the file was checked to be at
            // least that long; the owner never shrinks a segment), `dst` is `bytes` long, and
            // the two cannot overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(map.as_ptr(), dst.as_mut_ptr().cast::<u8>(), bytes);
            }
            Ok(())
        },
        n,
    )
}

/// A peer's segment as this worker mapped it.
struct PeerMap {
    dev: u64,
    ino: u64,
    map: Arc<Mmap>,
    used: u64,
}

/// At most this many peer segments stay mapped.
const MAX_PEER_MAPS: usize = 32;

type PeerMaps = std::collections::HashMap<(PathBuf, u64), PeerMap>;

static PEER_MAPS: std::sync::LazyLock<Mutex<(PeerMaps, u64)>> =
    std::sync::LazyLock::new(|| Mutex::new((PeerMaps::new(), 0)));

/// A read-only mapping of at least the first `bytes` bytes of a peer's segment, kept between
/// transfers: mapping (populating the page tables) and unmapping a segment per transfer was
/// about 12% of a 16 MiB echo. A segment keeps its file (inode and size) for its life and
/// segment numbers are never reused, so a kept mapping sees the data of every later transfer
/// through the same segment; the inode is compared anyway. The least recently used mapping
/// goes when more than [`MAX_PEER_MAPS`] are kept, and all go at shutdown.
fn peer_mapping(
    dir: &Path,
    seg: u64,
    file: &File,
    meta: &std::fs::Metadata,
    bytes: usize,
) -> std::io::Result<Arc<Mmap>> {
    let mut g = PEER_MAPS.lock().unwrap_or_else(|e| e.into_inner());
    let (maps, tick) = &mut *g;
    *tick += 1;
    let key = (dir.to_path_buf(), seg);
    if let Some(m) = maps.get_mut(&key)
        && m.dev == meta.dev()
        && m.ino == meta.ino()
        && m.map.len() >= bytes
    {
        m.used = *tick;
        return Ok(m.map.clone());
    }
    let map = Arc::new(Mmap::map(file, bytes, MapMode::ReadPopulate)?);
    if maps.len() >= MAX_PEER_MAPS
        && !maps.contains_key(&key)
        && let Some(oldest) = maps
            .iter()
            .min_by_key(|(_, m)| m.used)
            .map(|(k, _)| k.clone())
    {
        maps.remove(&oldest);
    }
    maps.insert(
        key,
        PeerMap {
            dev: meta.dev(),
            ino: meta.ino(),
            map: map.clone(),
            used: *tick,
        },
    );
    Ok(map)
}

/// Unmaps every peer segment kept by [`peer_mapping`] (at shutdown).
pub(crate) fn forget_peer_mappings() {
    PEER_MAPS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .0
        .clear();
}

/// A new tensor whose `n` elements' bytes `fill` writes.
fn tensor_of(
    dtype: DType,
    shape: &[usize],
    fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> Result<()>,
    n: usize,
) -> Result<Tensor> {
    Ok(match dtype {
        DType::F32 => Tensor::from_vec(new_vec_with::<f32>(n, fill)?, shape)?,
        DType::F64 => Tensor::from_vec(new_vec_with::<f64>(n, fill)?, shape)?,
        DType::I64 => Tensor::from_vec(new_vec_with::<i64>(n, fill)?, shape)?,
        DType::BF16 => Tensor::from_vec(new_vec_with::<tensorplay_core::bf16>(n, fill)?, shape)?,
        DType::F16 => Tensor::from_vec(new_vec_with::<tensorplay_core::f16>(n, fill)?, shape)?,
        DType::Bool => {
            let v = new_vec_with::<u8>(n, fill)?;
            if v.iter().any(|&b| b > 1) {
                return Err(Error::Serialization(
                    "a bool tensor with bytes other than 0 and 1".into(),
                ));
            }
            Tensor::from_vec(v.into_iter().map(|b| b == 1).collect::<Vec<bool>>(), shape)?
        }
    })
}
