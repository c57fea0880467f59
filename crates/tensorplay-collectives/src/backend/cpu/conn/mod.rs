//! Peer connections of the CPU backend: the full TCP mesh, message framing, the per-peer
//! writer threads and the batch of in-flight sends.
//!
//! Every message is a 40-byte header followed by its payload. The header carries the kind of
//! call (collective or point-to-point), the collective's sequence number (or the p2p tag), the
//! call's signature (dtype, reduce op, element count, root) and the payload length; the
//! receiver checks all of them, so ranks that call different collectives, or the same one with
//! different arguments, get [`Error::Mismatch`](crate::Error::Mismatch) instead of garbage.
//!
//! # Layout
//!
//! - `header`: the message header ([`Header`], [`Kind`]) and its encoding;
//! - `frame`: reading and writing framed messages on a socket, and mapping I/O errors;
//! - `peer`: one peer connection ([`Peer`]) and its writer thread;
//! - `batch`: the sends in flight during one step ([`Batch`], [`with_batch`]);
//! - `mesh`: connecting the full mesh with a handshake ([`connect_mesh`]).

mod batch;
mod frame;
mod header;
mod mesh;
mod peer;

pub(super) use self::batch::{Batch, with_batch};
pub(super) use self::frame::io_err;
pub(super) use self::header::{HDR, Header, Kind, NO_REDOP};
pub(super) use self::mesh::connect_mesh;
pub(super) use self::peer::{Peer, peer_of};
