//! Who takes part and how: worker identities ([`WorkerInfo`]), call targets ([`To`]) and the
//! options of [`init_rpc`] ([`RpcBackendOptions`], device maps included).

use std::collections::HashMap;
use std::time::Duration;

use tensorplay_core::Device;

#[cfg(doc)]
use super::init_rpc;
use crate::{Error, Result};

/// A worker of the RPC group (`torch.distributed.rpc.WorkerInfo`): its unique name and its id
/// (its rank, `0..world_size`). Equal by value; travels in RPCs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerInfo {
    /// The worker's name.
    pub name: String,
    /// The worker's id (rank).
    pub id: usize,
}

impl std::fmt::Display for WorkerInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WorkerInfo(id={}, name={})", self.id, self.name)
    }
}

/// Where a call goes: a worker's name, its rank, or its [`WorkerInfo`].
#[derive(Debug, Clone)]
pub enum To {
    /// By name.
    Name(String),
    /// By rank (worker id).
    Rank(usize),
}

impl From<&str> for To {
    fn from(s: &str) -> To {
        To::Name(s.to_string())
    }
}
impl From<String> for To {
    fn from(s: String) -> To {
        To::Name(s)
    }
}
impl From<&String> for To {
    fn from(s: &String) -> To {
        To::Name(s.clone())
    }
}
impl From<usize> for To {
    fn from(r: usize) -> To {
        To::Rank(r)
    }
}
impl From<&WorkerInfo> for To {
    fn from(w: &WorkerInfo) -> To {
        To::Rank(w.id)
    }
}
impl From<WorkerInfo> for To {
    fn from(w: WorkerInfo) -> To {
        To::Rank(w.id)
    }
}

/// Options of [`init_rpc`](crate::init_rpc) (`TensorPipeRpcBackendOptions`).
#[derive(Debug, Clone)]
pub struct RpcBackendOptions {
    /// Default timeout of every call, `to_here` and the shutdown barrier (default 60 s);
    /// `Duration::ZERO` means no timeout.
    pub rpc_timeout: Duration,
    /// Threads of the transport's runtime (default 1: each extra thread adds hand-offs
    /// between threads to every call, which cost more latency than they win on small
    /// machines). A running user function hands its thread's transport work to another
    /// thread first, so this never limits nesting or concurrency. At most 1024; 0 means 1.
    pub num_worker_threads: usize,
    /// `"env://"` (default: `MASTER_ADDR`, `MASTER_PORT`) or `"tcp://host:port"`.
    pub init_method: String,
    /// By callee worker name: where a tensor on each of this worker's devices lands on that
    /// worker (`TensorPipeRpcBackendOptions.device_maps`; set with
    /// [`RpcBackendOptions::set_device_map`](crate::RpcBackendOptions::set_device_map)).
    /// Checked by [`init_rpc`](crate::init_rpc): every name must be another worker of the job,
    /// and no two devices may map to the same target. Tensors
    /// between workers are host tensors today, which a map leaves on the CPU, as in PyTorch.
    pub device_maps: HashMap<String, HashMap<Device, Device>>,
}

impl Default for RpcBackendOptions {
    fn default() -> Self {
        RpcBackendOptions {
            rpc_timeout: Duration::from_secs(60),
            num_worker_threads: 1,
            init_method: "env://".into(),
            device_maps: HashMap::new(),
        }
    }
}

impl RpcBackendOptions {
    /// Adds `map` (this worker's device -> `to`'s device) to the device map towards worker
    /// `to` (`set_device_map`); entries for the same source device are replaced.
    ///
    /// ```
    /// use std::collections::HashMap;
    /// use tensorplay as tp;
    /// use tp::Device;
    /// let mut o = tp::distributed::rpc::RpcBackendOptions::default();
    /// o.set_device_map("worker1", HashMap::from([(Device::Cuda(0), Device::Cuda(1))]));
    /// assert_eq!(o.device_maps["worker1"][&Device::Cuda(0)], Device::Cuda(1));
    /// ```
    pub fn set_device_map(&mut self, to: &str, map: HashMap<Device, Device>) -> &mut Self {
        self.device_maps
            .entry(to.to_string())
            .or_default()
            .extend(map);
        self
    }
}

/// Checks `maps` against the job's workers (see [`RpcBackendOptions::device_maps`]).
pub(super) fn check_device_maps(
    maps: &HashMap<String, HashMap<Device, Device>>,
    me: &str,
    workers: &[WorkerInfo],
) -> Result<()> {
    for (to, map) in maps {
        if to == me || !workers.iter().any(|w| w.name == *to) {
            return Err(Error::invalid(
                "init_rpc",
                "device_maps",
                "names of the other workers of the job",
                format!("a map for {to:?}, which is not another worker"),
            ));
        }
        let mut targets: Vec<Device> = map.values().copied().collect();
        targets.sort_by_key(|d| format!("{d}"));
        if let Some(w) = targets.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::invalid(
                "init_rpc",
                "device_maps",
                "a one-to-one map of devices",
                format!("two devices mapped to {} on {to:?}", w[0]),
            ));
        }
    }
    Ok(())
}
