//! [`consolidate`]: a distributed checkpoint as one ordinary safetensors file of whole
//! tensors (PyTorch's `dcp_to_torch_save`, in safetensors), streamed one tensor at a time.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::Path;

use tensorplay_core::serialize::{CHECKSUM_KEY, Checksum};
use tensorplay_core::{Error, Result};

use super::load::checksum_mismatch;
use super::metadata::{StoredChunk, TensorStorageMetadata, bad};
use super::storage::{FileSystemReader, StorageReader};

/// The bytes of saved piece `c` of tensor `key`, checked against its checksum.
fn piece_bytes(reader: &mut FileSystemReader, key: &str, c: &StoredChunk) -> Result<Vec<u8>> {
    let len = (c.byte_range[1] - c.byte_range[0]) as usize;
    let mut buf = vec![0u8; len];
    reader.read_into(&c.file, c.byte_range[0], &mut buf)?;
    let crc = format!("{:08x}", crc32fast::hash(&buf));
    if crc != c.crc32 {
        return Err(checksum_mismatch(&reader.location(), key, c, &crc));
    }
    Ok(buf)
}

/// Copies the row-major bytes `piece` of box `c` (elements of `es` bytes) into `whole`, the
/// row-major bytes of a tensor of `shape`.
fn place(whole: &mut [u8], shape: &[usize], c: &StoredChunk, piece: &[u8], es: usize) {
    let nd = shape.len();
    if nd == 0 {
        whole.copy_from_slice(piece);
        return;
    }
    // the trailing dimensions the piece spans whole are one run of bytes
    let mut k = nd - 1;
    while k > 0 && c.sizes[k] == shape[k] && c.offsets[k] == 0 {
        k -= 1;
    }
    let run: usize = c.sizes[k..].iter().product::<usize>() * es;
    if run == 0 {
        return;
    }
    // strides of the whole, in bytes
    let mut stride = vec![es; nd];
    for d in (0..nd - 1).rev() {
        stride[d] = stride[d + 1] * shape[d + 1];
    }
    let outer: Vec<usize> = c.sizes[..k].to_vec();
    let mut index = vec![0usize; k];
    for (i, src) in piece.chunks_exact(run).enumerate() {
        if i > 0 {
            // the next index over the outer dimensions, last fastest
            for d in (0..k).rev() {
                index[d] += 1;
                if index[d] < outer[d] {
                    break;
                }
                index[d] = 0;
            }
        }
        let at: usize = (0..k)
            .map(|d| (c.offsets[d] + index[d]) * stride[d])
            .sum::<usize>()
            + c.offsets[k] * stride[k];
        whole[at..at + run].copy_from_slice(src);
    }
}

/// The header of the consolidated file: JSON padded with spaces to a multiple of 8 bytes, and
/// where in it the checksum's 8 placeholder digits lie.
fn header(tensors: &BTreeMap<String, TensorStorageMetadata>) -> Result<(Vec<u8>, usize)> {
    let placeholder = "00000000";
    let mut map = serde_json::Map::new();
    map.insert(
        "__metadata__".into(),
        serde_json::json!({ "format": "pt", CHECKSUM_KEY: placeholder }),
    );
    let mut at = 0u64;
    let too_big = || Error::Checkpoint {
        path: String::new(),
        problem: "its tensors hold more bytes than a file can".into(),
    };
    for (name, t) in tensors {
        let n = t
            .chunks
            .iter()
            .try_fold(0u64, |a, c| {
                a.checked_add(c.byte_range[1] - c.byte_range[0])
            })
            .ok_or_else(too_big)?;
        let end = at.checked_add(n).ok_or_else(too_big)?;
        map.insert(
            name.clone(),
            serde_json::json!({ "dtype": t.dtype, "shape": t.size, "data_offsets": [at, end] }),
        );
        at = end;
    }
    let mut text = serde_json::Value::Object(map).to_string().into_bytes();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let key = format!("\"{CHECKSUM_KEY}\":\"{placeholder}\"");
    let pos = text
        .windows(key.len())
        .position(|w| w == key.as_bytes())
        .map(|p| p + key.len() - 1 - placeholder.len())
        .ok_or_else(|| Error::Checkpoint {
            path: String::new(),
            problem: "the consolidated header lost its checksum field".into(),
        })?;
    Ok((text, pos))
}

/// Writes the checkpoint in the folder `checkpoint_dir` as one safetensors file `file` of
/// whole tensors, by name (`torch.distributed.checkpoint.format_utils.dcp_to_torch_save`, as
/// safetensors): readable by [`tensorplay_core::load`] (its header carries tensorplay's
/// checksum) and by PyTorch's `safetensors.torch.load_file` (`format: pt`). Not collective:
/// one process runs it, any time after the save.
///
/// Streamed: one whole tensor is held at a time (the largest tensor's bytes, not the model's);
/// each piece is read once and checked against its checksum. The file is written to a
/// temporary beside it, flushed to disk and renamed, so `file` is whole or absent. The
/// checkpoint's JSON values (a step, a data position) are not in the file: it holds tensors.
///
/// # Errors
/// [`Error::Checkpoint`] naming the file at fault: no committed checkpoint or metadata that
/// is not one, a missing, truncated or corrupt piece, `file` not writable.
pub fn consolidate(checkpoint_dir: impl AsRef<Path>, file: impl AsRef<Path>) -> Result<()> {
    let file = file.as_ref();
    let mut reader = FileSystemReader::new(checkpoint_dir);
    let md = reader.read_metadata()?;
    let (head, sum_at) = header(&md.tensors).map_err(|e| match e {
        Error::Checkpoint { problem, .. } => bad(file, problem),
        other => other,
    })?;
    // every piece inside its file before anything is allocated (a hand-edited metadata file
    // may claim any size)
    for (name, t) in &md.tensors {
        for c in &t.chunks {
            let path = Path::new(&reader.location()).join(&c.file);
            let len = std::fs::metadata(&path)
                .map_err(|e| bad(&path, format!("could not read it: {e}")))?
                .len();
            if c.byte_range[1] > len {
                return Err(bad(
                    &path,
                    format!(
                        "truncated: tensor {name:?}'s piece ends at byte {}, the file has {len}",
                        c.byte_range[1]
                    ),
                ));
            }
        }
    }
    let tmp = file.with_extension(format!("consolidating-{}", std::process::id()));
    // the temporary goes whatever happens, a panic included
    let mut guard = RemoveOnDrop(Some(tmp.clone()));
    let result = (|| -> Result<()> {
        let io = |e: std::io::Error| bad(&tmp, format!("could not write it: {e}"));
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(io)?;
        let mut w = BufWriter::new(f);
        w.write_all(&(head.len() as u64).to_le_bytes())
            .map_err(io)?;
        w.write_all(&head).map_err(io)?;
        let mut sums = BTreeMap::new();
        sums.insert("format".to_string(), "pt".to_string());
        let mut sum = Checksum::new(&sums);
        for (name, t) in &md.tensors {
            let dtype = t
                .dtype()
                .ok_or_else(|| bad(file, format!("dtype {:?}", t.dtype)))?;
            let es = dtype.size_in_bytes();
            let len = t
                .size
                .iter()
                .try_fold(es, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad(file, format!("tensor {name:?} is too large")))?;
            let mut whole = Vec::new();
            whole
                .try_reserve_exact(len)
                .map_err(|e| bad(file, format!("tensor {name:?} ({len} bytes): {e}")))?;
            whole.resize(len, 0u8);
            for c in &t.chunks {
                let piece = piece_bytes(&mut reader, name, c)?;
                place(&mut whole, &t.size, c, &piece, es);
            }
            sum.tensor(name, dtype, &t.size, whole.len());
            sum.bytes(&whole);
            w.write_all(&whole).map_err(io)?;
        }
        let mut f: File = w.into_inner().map_err(|e| io(e.into_error()))?;
        f.seek(SeekFrom::Start(8 + sum_at as u64)).map_err(io)?;
        f.write_all(sum.finish().as_bytes()).map_err(io)?;
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, file).map_err(|e| bad(file, format!("could not write it: {e}")))?;
        if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
            // the rename durable too
            let _ = File::open(dir).and_then(|d| d.sync_all());
        }
        Ok(())
    })();
    if result.is_ok() {
        // renamed: nothing left to remove
        guard.0 = None;
    }
    result
}

/// Removes a file when dropped (a temporary left by a failure or a panic).
struct RemoveOnDrop(Option<std::path::PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `place` puts every box of a split of a 3 x 4 x 2 tensor where it belongs.
    #[test]
    fn pieces_land_in_their_boxes() {
        let shape = [3usize, 4, 2];
        let whole_ref: Vec<u8> = (0..24).collect();
        let at = |i: usize, j: usize, k: usize| whole_ref[(i * 4 + j) * 2 + k];
        let boxes: [(&str, [usize; 3], [usize; 3]); 4] = [
            ("rows 0-1, columns 0-2", [0, 0, 0], [2, 3, 2]),
            ("rows 0-1, column 3", [0, 3, 0], [2, 1, 2]),
            ("row 2, every column, k 0", [2, 0, 0], [1, 4, 1]),
            ("row 2, every column, k 1", [2, 0, 1], [1, 4, 1]),
        ];
        let mut whole = vec![255u8; 24];
        for (name, offsets, sizes) in boxes {
            let mut piece = Vec::new();
            for i in 0..sizes[0] {
                for j in 0..sizes[1] {
                    for k in 0..sizes[2] {
                        piece.push(at(offsets[0] + i, offsets[1] + j, offsets[2] + k));
                    }
                }
            }
            let c = StoredChunk {
                offsets: offsets.to_vec(),
                sizes: sizes.to_vec(),
                file: "f".into(),
                byte_range: [0, piece.len() as u64],
                crc32: String::new(),
            };
            place(&mut whole, &shape, &c, &piece, 1);
            assert!(
                whole
                    .iter()
                    .zip(&whole_ref)
                    .all(|(a, b)| a == b || *a == 255),
                "{name}: {whole:?}"
            );
        }
        assert_eq!(whole, whole_ref);
    }
}
