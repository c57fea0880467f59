//! Checkpoints of a process group's training (`torch.distributed.checkpoint`).
//!
//! - **Resharding checkpoints** ([`save`], [`load`], [`async_save`], PyTorch's DCP): each rank
//!   writes the pieces it holds (each piece once), rank 0 commits a [`Metadata`] file saying
//!   where every piece of every tensor lies, and a load at any world size, into any layout,
//!   reads the byte ranges its own pieces need ([`planner`]: box intersections). What to save
//!   is a [`StateDict`] (tensors with placements, shared and per-rank JSON values), or
//!   [`Stateful`] objects ([`AppState`]: a model and its optimizer; [`RandomState`]) through
//!   [`save_state`] / [`load_state`]. Storage is behind [`StorageWriter`] / [`StorageReader`]
//!   ([`FileSystemWriter`] / [`FileSystemReader`]). [`consolidate`] writes a checkpoint as one
//!   safetensors file of whole tensors; [`load_safetensors`] loads such a file (or any of whole
//!   tensors) into a sharded model. The guide: `docs/checkpoints.md`.
//! - **Replicated** (DDP, or any parameters equal on every rank): [`save_replicated`] writes
//!   the file on rank 0 only; every rank then loads it with [`tensorplay_core::load`].
//! - **Sharded at a fixed world size** (the older format): [`save_sharded`] writes
//!   `<name>.step<S>.rank<r>.safetensors` on every rank, then rank 0 writes `<name>.json`
//!   naming the step, the world size and the shards; [`load_sharded`] restores every rank's
//!   shard at the same world size (another world size is refused: use [`save`] / [`load`]).
//!
//! Every call is collective over the group (every rank calls it, in the same order), and every
//! rank returns the same outcome: when one rank cannot write or read, all of them fail, naming
//! it. Ranks on several hosts need a folder all of them see (a shared file system), as with
//! PyTorch's distributed checkpoints.
//!
//! [`state_dict`] makes what these functions write: a model's and an optimizer's state keyed
//! by fully qualified parameter names, the same for plain, DDP, tensor-parallel and fully
//! sharded models (`torch.distributed.checkpoint.state_dict`), local shards with their
//! [`TensorPlacement`](state_dict::TensorPlacement) or whole tensors.

mod async_save;
mod consolidate;
mod format;
mod load;
mod metadata;
pub mod planner;
mod safetensors_reader;
mod save;
mod sharded;
mod state;
pub mod state_dict;
mod stateful;
mod storage;
mod sync;

pub use async_save::{AsyncSaveHandle, async_save, async_save_with};
pub use consolidate::consolidate;
pub use format::SHARDING_KEY;
pub use load::{load, load_with};
pub use safetensors_reader::{SafetensorsReader, load_safetensors};
pub use save::{save, save_with};
pub use state::{StateDict, StateValue, model_state, strip_prefix};
pub use stateful::{AppState, RandomState, Stateful, load_state, save_state};
pub use storage::{FileSystemReader, FileSystemWriter, StorageReader, StorageWriter};

pub use metadata::{FORMAT, METADATA_FILE, Metadata, StoredChunk, TensorStorageMetadata, VERSION};

pub use sharded::{Shard, load_sharded, save_replicated, save_sharded, sharded_exists};
