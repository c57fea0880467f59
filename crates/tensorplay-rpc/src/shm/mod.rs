//! The shared-memory path for large tensors between workers on one host.
//!
//! QUIC on loopback moves a few hundred MB/s (encryption and per-packet work, all on the CPU);
//! between processes of one host a tensor can instead be copied through shared memory at
//! memory speed. The path is chosen automatically per tensor: the sender uses it when the
//! tensor has at least [`min_bytes`] bytes and the receiver has confirmed, at `init_rpc`, that
//! it can read the sender's shared-memory directory. QUIC stays the path for everything else
//! (and between hosts): the frame still travels over the QUIC stream, with the tensor's bytes
//! replaced by a reference to a segment.
//!
//! # Design
//!
//! - **One directory per worker** (`/dev/shm/tensorplay-rpc-<pidns>-<pid>-<random>`, mode
//!   0700), created at `init_rpc` and removed at shutdown (and by a later `init_rpc` on this
//!   host if its process died: `tensorplay_collectives::shm_host::sweep`, shared with the
//!   `"cpu"` backend's shared-memory transport). It holds a `host` file with a random token.
//! - **Same host, confirmed**: each worker publishes `<dir>\n<token>` through the job's store;
//!   a peer that can open `<dir>/host` (a directory directly under `/dev/shm`, with our prefix,
//!   owned by our user, not a symlink) and read the same token shares this host's
//!   `/dev/shm` and may read the worker's segments. Each worker then publishes which peers it
//!   confirmed, and a sender uses the path only towards peers that confirmed it.
//! - **Segments**: files in the sender's directory, memory-mapped by the sender once and
//!   reused, so a transfer is one `memcpy` into pages that are already resident. A segment is
//!   named `<segment>.free` while free and `<segment>.<transfer>` while a transfer owns it;
//!   the sender claims a free one by renaming it (atomic), copies the tensor in, and sends
//!   `(segment, transfer)` in the frame. The receiver opens `<segment>.<transfer>`, copies
//!   from its read-only mapping of the segment (kept between transfers, see
//!   [`peer_mapping`]) into the new tensor's storage (allocated on one long-lived thread, see
//!   [`alloc_on_stable_thread`]), and gives the segment back by renaming it to
//!   `<segment>.free`. Transfer numbers are never reused, so a late or duplicate release can
//!   only ever touch its own transfer. A sender that fails before its frame was sent releases
//!   its claims itself; a receiver that fails after reading a header releases the segments it
//!   names.
//! - **Never trust names from the network**: a frame carries two numbers; the receiver builds
//!   the file name itself, inside the directory that the peer published and that was checked
//!   at `init_rpc`. Sizes are checked against the file before mapping.
//! - **Memory**: segments stay allocated while free (that is what makes them fast), up to a
//!   budget per worker ([`budget`], 1 GiB by default); over it, free segments are deleted and,
//!   failing that, the tensor travels over QUIC. A receiver keeps at most 32 peer segments
//!   mapped. A same-user process that truncates a segment while a receiver copies from it
//!   would crash that receiver (SIGBUS); workers never truncate segments, and other users
//!   cannot reach them (0700 directories).
//!
//! Settings (environment): `TENSORPLAY_RPC_SHM=0` turns the path off;
//! `TENSORPLAY_RPC_SHM_MIN_BYTES` (default 64 KiB) and `TENSORPLAY_RPC_SHM_BUDGET_MB`
//! (default 1024) tune it.
//!
//! Files: `alloc` (receive buffers), `sender` (the directory, its segments and claims),
//! `receiver` (reading a peer's segment); this module holds the settings, the names and the
//! confirmation of peers.

mod alloc;
mod receiver;
mod sender;

pub(crate) use alloc::oom;
pub(crate) use receiver::{forget_peer_mappings, read_tensor};
pub(crate) use sender::{Claim, ShmDir, release};

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use tensorplay_collectives::shm_host::{self, euid};

use crate::{Error, Result};

/// Where the directories live.
pub(crate) const ROOT: &str = "/dev/shm";
/// The prefix of every worker's directory.
pub(super) const PREFIX: &str = "tensorplay-rpc-";
/// The token file inside a directory.
pub(super) const HOST_FILE: &str = "host";
/// The smallest segment (capacities are powers of two from here).
pub(super) const MIN_SEGMENT: usize = 64 << 10;

/// Whether the path is enabled (`TENSORPLAY_RPC_SHM`, default on).
pub(crate) fn enabled() -> bool {
    std::env::var("TENSORPLAY_RPC_SHM").map_or(true, |v| !matches!(v.trim(), "0" | "false" | "off"))
}

/// The smallest tensor, in bytes, sent through shared memory.
pub(crate) fn min_bytes() -> usize {
    std::env::var("TENSORPLAY_RPC_SHM_MIN_BYTES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(64 << 10)
}

/// The most bytes of segments one worker keeps.
pub(crate) fn budget() -> usize {
    std::env::var("TENSORPLAY_RPC_SHM_BUDGET_MB")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map_or(1 << 30, |mb| mb.saturating_mul(1 << 20))
}

pub(super) fn shm_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Transport(format!("shared memory: {what}: {e}"))
}

/// Random hex for directory names and tokens.
pub(super) fn random_hex(n: usize) -> Result<String> {
    shm_host::random_hex(n).map_err(|e| shm_err("random bytes", e))
}

pub(super) fn free_name(seg: u64) -> String {
    format!("{seg:016x}.free")
}

pub(super) fn busy_name(seg: u64, xfer: u64) -> String {
    format!("{seg:016x}.{xfer:016x}")
}

/// The directory a peer published, when this process can read it: a directory directly under
/// `root` with our prefix and safe characters, owned by our user, not a symlink, whose `host`
/// file holds the published token.
pub(crate) fn confirm_peer(root: &Path, advert: &[u8]) -> Option<PathBuf> {
    let s = std::str::from_utf8(advert).ok()?;
    let (path, token) = s.split_once('\n')?;
    let path = Path::new(path);
    if !shm_host::check_name(root, path, PREFIX) || token.is_empty() {
        return None;
    }
    let meta = std::fs::symlink_metadata(path).ok()?;
    if !meta.is_dir() || meta.uid() != euid() {
        return None;
    }
    let mut got = String::new();
    shm_host::open_owned(&path.join(HOST_FILE), false)?
        .take(256)
        .read_to_string(&mut got)
        .ok()?;
    (got == token).then(|| path.to_path_buf())
}

#[cfg(test)]
mod tests;
