//! An in-process store for single-process tests and threads (`HashStore`).

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{DEFAULT_STORE_TIMEOUT, Store};
use crate::{Error, Result};

/// A thread-safe in-memory [`Store`] (PyTorch's `HashStore`).
#[derive(Debug)]
pub struct MemoryStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    timeout: Mutex<Duration>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// An empty store with the default timeout.
    pub fn new() -> MemoryStore {
        MemoryStore {
            map: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            timeout: Mutex::new(DEFAULT_STORE_TIMEOUT),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Parses the decimal counter stored by `add`.
pub(crate) fn parse_counter(key: &str, v: &[u8]) -> Result<i64> {
    if v.is_empty() {
        return Ok(0);
    }
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .ok_or_else(|| Error::Store(format!("add: the value of key {key:?} is not an integer")))
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.wait(&[key], self.timeout())?;
        self.lock()
            .get(key)
            .cloned()
            .ok_or_else(|| Error::Store(format!("key {key:?} vanished while waiting")))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut m = self.lock();
        let cur = parse_counter(key, m.get(key).map(|v| v.as_slice()).unwrap_or(b""))?;
        let new = cur.checked_add(delta).ok_or_else(|| {
            Error::Store(format!(
                "add: {cur} + {delta} overflows i64 for key {key:?}"
            ))
        })?;
        m.insert(key.to_string(), new.to_string().into_bytes());
        drop(m);
        self.changed.notify_all();
        Ok(new)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let mut m = self.lock();
        let cur = m.get(key).cloned();
        let matches = match &cur {
            None => expected.is_empty(),
            Some(v) => v.as_slice() == expected,
        };
        if matches {
            m.insert(key.to_string(), desired.to_vec());
            drop(m);
            self.changed.notify_all();
            Ok(desired.to_vec())
        } else {
            Ok(cur.unwrap_or_default())
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut m = self.lock();
        loop {
            let missing: Vec<&str> = keys
                .iter()
                .copied()
                .filter(|k| !m.contains_key(*k))
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    op: "store wait".into(),
                    rank: -1,
                    timeout,
                    detail: format!("keys {missing:?} were never set").into(),
                });
            }
            m = self
                .changed
                .wait_timeout(m, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let m = self.lock();
        Ok(keys.iter().all(|k| m.contains_key(*k)))
    }

    fn delete_key(&self, key: &str) -> Result<bool> {
        Ok(self.lock().remove(key).is_some())
    }

    fn num_keys(&self) -> Result<usize> {
        Ok(self.lock().len())
    }

    fn timeout(&self) -> Duration {
        *self.timeout.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_timeout(&self, timeout: Duration) {
        *self.timeout.lock().unwrap_or_else(|e| e.into_inner()) = timeout;
    }
}
