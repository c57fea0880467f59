//! The values this worker owns: the shell's slot for each entry of the owner table, filled
//! once the value (or its creation's error) is known; fetches wait on it.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::{GloballyUniqueId, RRefContext};
use crate::wire::{Encoder, Wire, encode_value};
use crate::{Error, Result};

/// A value stored on its owner: type-erased, with the function that encodes it for a fetch.
#[derive(Clone)]
pub(crate) struct Stored {
    pub(super) value: Arc<dyn Any + Send + Sync>,
    pub(super) encode: EncodeFn,
}

/// Encodes a stored value for a worker.
type EncodeFn = Arc<dyn Fn(&(dyn Any + Send + Sync), usize) -> Result<Encoder> + Send + Sync>;

impl Stored {
    pub(crate) fn new<T: Wire + Clone + Sync>(v: T) -> Stored {
        Stored {
            value: Arc::new(v),
            encode: Arc::new(|v: &(dyn Any + Send + Sync), dest| {
                let v = v
                    .downcast_ref::<T>()
                    .ok_or_else(|| Error::Serialization("RRef value of another type".into()))?;
                encode_value(v, dest)
            }),
        }
    }
}

/// The shell's slot for one owned value: the value, or the creation's error, once known;
/// fetches wait on it.
pub(crate) type Slot = watch::Sender<Option<std::result::Result<Stored, Error>>>;

impl RRefContext {
    pub(super) fn set_value(&self, id: GloballyUniqueId, v: std::result::Result<Stored, Error>) {
        // an earlier value is dropped after unlocking (it may hold RRefs owned here)
        let old = self.table().slot(id).send_replace(Some(v));
        drop(old);
    }

    /// Waits for the value of `id` (its creation may not have arrived yet).
    pub(super) async fn value(
        &self,
        id: GloballyUniqueId,
        timeout: Option<Duration>,
    ) -> Result<Stored> {
        let mut rx = self.table().slot(id).subscribe();
        let wait = async {
            loop {
                if let Some(v) = rx.borrow_and_update().clone() {
                    return v;
                }
                if rx.changed().await.is_err() {
                    return Err(Error::Remote {
                        worker: String::new(),
                        kind: "RRef".into(),
                        message: format!("RRef {id} was deleted"),
                    });
                }
            }
        };
        let r = match timeout {
            Some(t) => tokio::time::timeout(t, wait).await.unwrap_or_else(|_| {
                Err(Error::Timeout {
                    op: format!("waiting for the value of RRef {id} on its owner"),
                    worker: String::new(),
                    timeout: t,
                })
            }),
            None => wait.await,
        };
        // an entry made by this wait alone (an RRef deleted or never created) is not kept
        let released = self.table().release_if_unused(id);
        drop(released);
        r
    }
}
