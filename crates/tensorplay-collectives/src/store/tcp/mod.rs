//! The TCP store (`TCPStore`): a server thread that holds the key-value map, and clients that
//! talk to it over one TCP connection each.
//!
//! # Protocol
//!
//! Little-endian and length-prefixed. A request is a `u8` opcode followed by its fields; a
//! string or byte field is a `u32` length and the bytes (keys at most [`MAX_KEY_LEN`] bytes,
//! values at most [`MAX_VALUE_LEN`] bytes), a timeout is a `u64` in milliseconds. A response
//! is a `u8` status — `0` ok (followed by the operation's result), `1` timeout (followed by
//! the list of missing keys), `2` error (followed by a message) — so blocking requests (`get`,
//! `wait`) block on the server, which answers "timeout" itself when the client's timeout
//! passes; the client never polls.
//!
//! # Layout
//!
//! - `wire`: the protocol's opcodes, status codes, limits and encoding helpers;
//! - `server`: [`TcpStoreServer`], which holds the map and serves one thread per connection;
//! - `client`: [`TcpStore`], the client side, implementing [`Store`](super::Store).

mod client;
mod server;
mod wire;

pub use self::client::TcpStore;
pub(crate) use self::client::resolve;
pub use self::server::TcpStoreServer;
pub use self::wire::{MAX_KEY_LEN, MAX_VALUE_LEN};
