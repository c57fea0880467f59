//! Point-to-point lanes: one worker thread per (peer, direction) of a group, started at the
//! first non-blocking send or receive to that peer and kept until the group is dropped. Each
//! lane runs its operations in the order they were posted, so messages to one peer leave in
//! posting order and receives from one peer match them in order (MPI's non-overtaking rule),
//! while sends and receives to different peers, or both ways with one peer, run at once.

use std::collections::HashMap;
use std::sync::Mutex;

use crossbeam::channel::{Sender, unbounded};

use crate::{Error, Result};

type Job = Box<dyn FnOnce() + Send>;

/// The lanes of one group on this rank.
#[derive(Default)]
pub(crate) struct Lanes {
    lanes: Mutex<HashMap<(usize, bool), Sender<Job>>>,
}

impl Lanes {
    /// Queues `job` on the lane that sends to (`sending`) or receives from group rank `peer`,
    /// starting the lane's thread the first time.
    ///
    /// # Errors
    /// The thread could not be started.
    pub(crate) fn post(&self, peer: usize, sending: bool, job: Job) -> Result<()> {
        let mut lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
        let tx = match lanes.get(&(peer, sending)) {
            Some(tx) => tx.clone(),
            None => {
                let (tx, rx) = unbounded::<Job>();
                let dir = if sending { "send" } else { "recv" };
                std::thread::Builder::new()
                    .name(format!("tensorplay-p2p-{dir}-{peer}"))
                    // ends when the group (the lane's only sender) is dropped
                    .spawn(move || {
                        while let Ok(job) = rx.recv() {
                            job();
                        }
                    })
                    .map_err(|e| Error::Io(format!("could not start a {dir} lane thread: {e}")))?;
                lanes.insert((peer, sending), tx.clone());
                tx
            }
        };
        drop(lanes);
        tx.send(job)
            .map_err(|_| Error::Io("a point-to-point lane has stopped".into()))
    }
}
