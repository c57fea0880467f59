//! Key-value stores for rendezvous (`torch.distributed.Store`): a TCP store, a prefix store and
//! an in-memory store.
//!
//! Keys are strings, values are bytes. Every blocking call takes or has a timeout and returns
//! [`Error::Timeout`](crate::Error::Timeout) naming the keys it waited for.

mod memory;
mod prefix;
pub(crate) mod tcp;

use std::time::Duration;

pub use memory::MemoryStore;
pub use prefix::PrefixStore;
pub use tcp::{MAX_KEY_LEN, MAX_VALUE_LEN, TcpStore, TcpStoreServer};

use crate::Result;

/// The default timeout of store operations (PyTorch's default: 300 s; ours is shorter because a
/// stuck rendezvous is almost always a dead peer).
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(60);

/// A shared key-value store used by ranks to find each other (`c10d::Store`).
///
/// Implementations are thread-safe; `get` and `wait` block until the keys exist or the timeout
/// expires.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any previous value, and wakes waiters.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// The value of `key`, waiting up to the store's timeout for it to be set.
    fn get(&self, key: &str) -> Result<Vec<u8>>;
    /// Adds `delta` to the integer stored at `key` (0 when absent) and returns the new value.
    /// The value is stored as decimal ASCII, as PyTorch does.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Sets `key` to `desired` if its current value is `expected` (absent counts as empty);
    /// returns the value after the operation.
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;
    /// Waits until every key exists, up to `timeout`.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;
    /// Whether `key` exists, without waiting.
    fn check(&self, keys: &[&str]) -> Result<bool>;
    /// Deletes `key`; returns whether it existed.
    fn delete_key(&self, key: &str) -> Result<bool>;
    /// Number of keys in the store.
    fn num_keys(&self) -> Result<usize>;
    /// The timeout of `get` (and the default of `wait`).
    fn timeout(&self) -> Duration;
    /// Changes the timeout of `get`.
    fn set_timeout(&self, timeout: Duration);
    /// This host's address on the network that reaches the store's server, which is where the
    /// other ranks can reach this process too (loopback when the server is on loopback);
    /// `None` when unknown (an in-memory store). The cpu backend listens there.
    fn local_ip(&self) -> Option<std::net::IpAddr> {
        None
    }
}

/// This host's address on the way to `to`: `to` itself when it is loopback, else the source
/// address the kernel picks for a datagram to it (no packet is sent); `None` when there is no
/// route.
pub fn ip_toward(to: std::net::SocketAddr) -> Option<std::net::IpAddr> {
    if to.ip().is_loopback() {
        return Some(to.ip());
    }
    let any: std::net::IpAddr = if to.is_ipv4() {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    };
    let s = std::net::UdpSocket::bind((any, 0)).ok()?;
    s.connect(to).ok()?;
    s.local_addr().ok().map(|a| a.ip())
}
