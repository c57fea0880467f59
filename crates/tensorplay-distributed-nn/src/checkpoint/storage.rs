//! Where a distributed checkpoint's bytes go (PyTorch's `StorageWriter` / `StorageReader`):
//! the planner decides what to write and read; a storage moves the bytes. The file-system
//! storage is here; another store (an object store, a remote file system) implements the two
//! traits without touching the planner.

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use tensorplay_core::Result;
use tensorplay_core::serialize::write_atomically;

use super::format::is_shard_file;
use super::metadata::{METADATA_FILE, Metadata, bad};

/// Writes the files of a checkpoint. One writer per rank; rank 0's also commits.
pub trait StorageWriter: Send {
    /// Where the checkpoint goes, as errors name it (a folder).
    fn location(&self) -> String;
    /// Prepares for a save (creates the folder). Called on every rank before any file.
    ///
    /// # Errors
    /// [`Error::Checkpoint`](tensorplay_core::Error::Checkpoint) when the storage cannot be
    /// written.
    fn set_up(&mut self) -> Result<()>;
    /// Writes the file `name` whole: `fill` writes its bytes in order into the sink; the file
    /// is durable (flushed to disk) when this returns `Ok`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`](tensorplay_core::Error::Checkpoint) naming the file; `fill`'s
    /// errors.
    fn write_file(
        &mut self,
        name: &str,
        fill: &mut dyn FnMut(&mut dyn Write) -> Result<()>,
    ) -> Result<()>;
    /// Commits the checkpoint (rank 0 only, after every rank's files are durable): writes
    /// `metadata` atomically and durably, replacing the previous checkpoint's. The file-system
    /// writer refuses (an error, nothing committed) when a newer save was committed into the
    /// folder meanwhile or one of this save's files is gone, under a lock on the folder, so two
    /// jobs saving into one folder never leave it without a loadable checkpoint.
    ///
    /// # Errors
    /// [`Error::Checkpoint`](tensorplay_core::Error::Checkpoint) naming the metadata file; the
    /// previous checkpoint is then still the committed one.
    fn commit(&mut self, metadata: &Metadata) -> Result<()>;
    /// After a commit: removes the rank files of saves that began before the committed one,
    /// those not in `keep` (a newer save's files, perhaps another job's still being written,
    /// stay). Best effort.
    fn remove_stale(&mut self, keep: &BTreeSet<String>);
}

/// Reads the files of a committed checkpoint.
pub trait StorageReader: Send {
    /// Where the checkpoint is, as errors name it.
    fn location(&self) -> String;
    /// The committed checkpoint's metadata, checked
    /// ([`Metadata::validate`]).
    ///
    /// # Errors
    /// [`Error::Checkpoint`](tensorplay_core::Error::Checkpoint): no committed checkpoint, or
    /// metadata that is truncated, corrupt or another program's.
    fn read_metadata(&mut self) -> Result<Metadata>;

    /// Where the metadata is, as errors about it name it (default: [`METADATA_FILE`] in
    /// [`location`](Self::location)).
    fn metadata_path(&self) -> String {
        format!("{}/{METADATA_FILE}", self.location())
    }
    /// Fills `buf` with the bytes of `file` from byte `start` on.
    ///
    /// # Errors
    /// [`Error::Checkpoint`](tensorplay_core::Error::Checkpoint) naming the file: missing,
    /// unreadable, or shorter than `start + buf.len()` (truncated).
    fn read_into(&mut self, file: &str, start: u64, buf: &mut [u8]) -> Result<()>;

    /// Whether the metadata's pieces carry checksums a load checks (each piece it needs is then
    /// read whole once, to check it, before its rows are read into the tensors). A storage
    /// without them (one safetensors file: [`SafetensorsReader`]) is read only in the rows each
    /// rank needs. Default: true.
    ///
    /// [`SafetensorsReader`]: super::SafetensorsReader
    fn checksummed(&self) -> bool {
        true
    }
}

/// The file-system storage: a checkpoint is a folder holding one safetensors file per writing
/// rank and [`METADATA_FILE`]. Ranks on several hosts need a folder they all see.
#[derive(Debug, Clone)]
pub struct FileSystemWriter {
    dir: PathBuf,
    /// The save this writer committed last (what a clean-up compares files with).
    committed: Option<String>,
}

impl FileSystemWriter {
    /// A writer into the folder `dir` (created when absent).
    pub fn new(dir: impl AsRef<Path>) -> FileSystemWriter {
        FileSystemWriter {
            dir: dir.as_ref().to_path_buf(),
            committed: None,
        }
    }
}

/// Flushes the folder's entries (new names) to disk; best effort where a folder cannot be
/// opened for that.
fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

impl StorageWriter for FileSystemWriter {
    fn location(&self) -> String {
        self.dir.display().to_string()
    }

    fn set_up(&mut self) -> Result<()> {
        fs::create_dir_all(&self.dir)
            .map_err(|e| bad(&self.dir, format!("could not create the folder: {e}")))
    }

    fn write_file(
        &mut self,
        name: &str,
        fill: &mut dyn FnMut(&mut dyn Write) -> Result<()>,
    ) -> Result<()> {
        let path = self.dir.join(name);
        let io = |e: std::io::Error| bad(&path, format!("could not write it: {e}"));
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(io)?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        let written = fill(&mut w).and_then(|()| {
            let f = w.into_inner().map_err(|e| io(e.into_error()))?;
            f.sync_all().map_err(io)
        });
        if written.is_err() {
            let _ = fs::remove_file(&path);
        }
        written?;
        sync_dir(&self.dir);
        Ok(())
    }

    fn commit(&mut self, metadata: &Metadata) -> Result<()> {
        let md_path = self.dir.join(METADATA_FILE);
        let _lock = FolderLock::take(&self.dir)?;
        // another job's save into this folder: the newer save wins, and an older one whose
        // files the newer one's clean-up removed is not committed over it
        if let Some(current) = fs::read(&md_path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Metadata>(&b).ok())
            && save_order(&current.save_id) > save_order(&metadata.save_id)
        {
            return Err(bad(
                &md_path,
                format!(
                    "a newer save ({}) was committed into this folder while this one ({}) was \
                     written (two jobs saving into one folder?): this save is not committed",
                    current.save_id, metadata.save_id
                ),
            ));
        }
        for name in metadata
            .tensors
            .values()
            .flat_map(|t| t.chunks.iter().map(|c| &c.file))
        {
            if !self.dir.join(name).is_file() {
                return Err(bad(
                    &self.dir.join(name),
                    "this save's file was removed before its commit (another save into this \
                     folder cleaned it up?): this save is not committed",
                ));
            }
        }
        write_atomically(&md_path, metadata.to_json().as_bytes())?;
        self.committed = Some(metadata.save_id.clone());
        Ok(())
    }

    fn remove_stale(&mut self, keep: &BTreeSet<String>) {
        let Some(committed) = self.committed.as_deref().and_then(save_order) else {
            return;
        };
        let Ok(_lock) = FolderLock::take(&self.dir) else {
            return;
        };
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // only older saves' files: a newer save's, still being written, stay
            let older = save_id_of(&name)
                .and_then(save_order)
                .is_some_and(|o| o < committed);
            if is_shard_file(&name) && !keep.contains(&name) && older {
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

/// An exclusive lock on a checkpoint folder's commit (a lock file in it, `flock`): one commit
/// and clean-up at a time, across processes.
struct FolderLock(File);

impl FolderLock {
    fn take(dir: &Path) -> Result<FolderLock> {
        let path = dir.join(".commit.lock");
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| bad(&path, format!("could not open the folder's lock: {e}")))?;
        f.lock()
            .map_err(|e| bad(&path, format!("could not lock the folder: {e}")))?;
        Ok(FolderLock(f))
    }
}

impl Drop for FolderLock {
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

/// The save id in a rank file's name (`shard-<id>-rank<r>.safetensors`).
fn save_id_of(name: &str) -> Option<&str> {
    let rest = name.strip_prefix("shard-")?;
    Some(&rest[..rest.rfind("-rank")?])
}

/// When a save began, from its id (`<nanoseconds, hex>-<process, hex>`): saves compare by it.
fn save_order(id: &str) -> Option<u128> {
    u128::from_str_radix(id.split('-').next()?, 16).ok()
}

/// Reads a checkpoint folder written by [`FileSystemWriter`] (positioned reads: a rank reads
/// only the byte ranges it needs).
#[derive(Debug)]
pub struct FileSystemReader {
    dir: PathBuf,
    open: HashMap<String, File>,
}

impl FileSystemReader {
    /// A reader of the folder `dir`.
    pub fn new(dir: impl AsRef<Path>) -> FileSystemReader {
        FileSystemReader {
            dir: dir.as_ref().to_path_buf(),
            open: HashMap::new(),
        }
    }
}

impl StorageReader for FileSystemReader {
    fn location(&self) -> String {
        self.dir.display().to_string()
    }

    fn read_metadata(&mut self) -> Result<Metadata> {
        let path = self.dir.join(METADATA_FILE);
        let bytes = fs::read(&path).map_err(|e| {
            let why = if e.kind() == std::io::ErrorKind::NotFound {
                "no committed checkpoint here (no metadata file)".to_string()
            } else {
                format!("could not read it: {e}")
            };
            bad(&path, why)
        })?;
        Metadata::parse(&bytes, &path)
    }

    fn read_into(&mut self, file: &str, start: u64, buf: &mut [u8]) -> Result<()> {
        let path = self.dir.join(file);
        if !self.open.contains_key(file) {
            let f = File::open(&path).map_err(|e| bad(&path, format!("could not open it: {e}")))?;
            self.open.insert(file.to_string(), f);
        }
        let f = &self.open[file];
        f.read_exact_at(buf, start).map_err(|e| {
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                bad(
                    &path,
                    format!(
                        "truncated: bytes {start}..{} are needed, the file has {len}",
                        start + buf.len() as u64
                    ),
                )
            } else {
                bad(&path, format!("could not read it: {e}"))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::checkpoint::metadata::{FORMAT, StoredChunk, TensorStorageMetadata, VERSION};

    /// A save's metadata naming its one rank file (written by [`write`]).
    fn save(id: &str) -> Metadata {
        let chunk = StoredChunk {
            offsets: vec![0],
            sizes: vec![1],
            file: format!("shard-{id}-rank0.safetensors"),
            byte_range: [0, 4],
            crc32: "00000000".into(),
        };
        Metadata {
            format: FORMAT.into(),
            version: VERSION,
            save_id: id.into(),
            world_size: 1,
            tensors: BTreeMap::from([(
                "t".to_string(),
                TensorStorageMetadata {
                    dtype: "F32".into(),
                    size: vec![1],
                    chunks: vec![chunk],
                },
            )]),
            values: BTreeMap::new(),
            rank_values: BTreeMap::new(),
        }
    }

    fn write(w: &mut FileSystemWriter, md: &Metadata) {
        let name = &md.tensors["t"].chunks[0].file;
        w.write_file(name, &mut |out| {
            out.write_all(&[0; 4])
                .map_err(|e| bad(Path::new(name), e.to_string()))
        })
        .unwrap();
    }

    /// Two jobs saving into one folder: the older save's commit after the newer one's is
    /// refused, the newer one's clean-up leaves a still newer save's file alone, and the folder
    /// keeps a checkpoint whose files are all there.
    #[test]
    fn two_jobs_in_one_folder_never_leave_it_without_a_checkpoint() {
        let dir = std::env::temp_dir().join(format!("tp-two-jobs-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let (older, newer, newest) = (save("a0-1"), save("b0-2"), save("c0-3"));
        let mut w1 = FileSystemWriter::new(&dir);
        let mut w2 = FileSystemWriter::new(&dir);
        let mut w3 = FileSystemWriter::new(&dir);
        w1.set_up().unwrap();
        write(&mut w1, &older);
        write(&mut w2, &newer);
        write(&mut w3, &newest);
        w2.commit(&newer).unwrap();
        w2.remove_stale(&crate::checkpoint::save::files_of(&newer));
        let e = w1.commit(&older).unwrap_err().to_string();
        assert!(e.contains("a newer save (b0-2)"), "{e}");
        let committed = FileSystemReader::new(&dir).read_metadata().unwrap();
        assert_eq!(committed.save_id, "b0-2");
        for (md, kept) in [(&older, false), (&newer, true), (&newest, true)] {
            let f = dir.join(&md.tensors["t"].chunks[0].file);
            assert_eq!(f.is_file(), kept, "{}", f.display());
        }
        let _ = fs::remove_dir_all(&dir);
    }
}
