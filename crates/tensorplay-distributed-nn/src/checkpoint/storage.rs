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
    /// `metadata` atomically and durably, replacing the previous checkpoint's.
    ///
    /// # Errors
    /// [`Error::Checkpoint`](tensorplay_core::Error::Checkpoint) naming the metadata file; the
    /// previous checkpoint is then still the committed one.
    fn commit(&mut self, metadata: &Metadata) -> Result<()>;
    /// After a commit: removes the rank files of earlier or failed saves, those not in `keep`.
    /// Best effort.
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
}

impl FileSystemWriter {
    /// A writer into the folder `dir` (created when absent).
    pub fn new(dir: impl AsRef<Path>) -> FileSystemWriter {
        FileSystemWriter {
            dir: dir.as_ref().to_path_buf(),
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
        write_atomically(self.dir.join(METADATA_FILE), metadata.to_json().as_bytes())
    }

    fn remove_stale(&mut self, keep: &BTreeSet<String>) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if is_shard_file(&name) && !keep.contains(&name) {
                let _ = fs::remove_file(e.path());
            }
        }
    }
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
