//! A view of a store under a key prefix (`PrefixStore`).

use std::sync::Arc;
use std::time::Duration;

use super::Store;
use crate::Result;

/// Prepends `"<prefix>/"` to every key of an underlying store, so that several users (process
/// groups, RPC) share one store without clashing.
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PrefixStore({:?})", self.prefix)
    }
}

impl PrefixStore {
    /// Wraps `inner` under `prefix`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> PrefixStore {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    fn k(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }

    /// The underlying store.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.k(key), value)
    }
    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.inner.get(&self.k(key))
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.k(key), delta)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.k(key), expected, desired)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let owned: Vec<String> = keys.iter().map(|k| self.k(k)).collect();
        let refs: Vec<&str> = owned.iter().map(|s| s.as_str()).collect();
        self.inner.wait(&refs, timeout)
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        let owned: Vec<String> = keys.iter().map(|k| self.k(k)).collect();
        let refs: Vec<&str> = owned.iter().map(|s| s.as_str()).collect();
        self.inner.check(&refs)
    }
    fn delete_key(&self, key: &str) -> Result<bool> {
        self.inner.delete_key(&self.k(key))
    }
    /// Counts the keys of the whole underlying store (as PyTorch's PrefixStore does).
    fn num_keys(&self) -> Result<usize> {
        self.inner.num_keys()
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }
    fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.inner.local_ip()
    }
}
