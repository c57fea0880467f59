//! Where a [`RemoteModule`](crate::RemoteModule) lives: `"<worker>/<device>"`,
//! `"rank:<N>/<device>"`, or a worker alone (device `cpu`), following PyTorch's
//! `_remote_device` grammar (see `docs/decisions.md` for the one difference: an input that is
//! only a device is refused, since a remote module needs a worker).

use std::fmt;
use std::str::FromStr;

use tensorplay_core::{Device, Error, Result};
use tensorplay_rpc::To;

/// The forms a remote device string may take, quoted in errors.
pub const REMOTE_DEVICE_FORMS: &str =
    "'<workername>/<device>', 'rank:<rank>/<device>', '<workername>' or 'rank:<rank>'";

/// The worker part of a remote device.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum WorkerRef {
    /// A worker name (as given to `init_rpc`).
    Name(String),
    /// A worker rank (`rank:N`).
    Rank(usize),
}

impl WorkerRef {
    /// The RPC destination.
    pub fn to(&self) -> To {
        match self {
            WorkerRef::Name(n) => To::Name(n.clone()),
            WorkerRef::Rank(r) => To::Rank(*r),
        }
    }
}

/// A parsed remote device: a worker and a device on it.
///
/// ```
/// use tensorplay as tp;
/// use tp::Device;
/// use tp::distributed::nn::{RemoteDevice, WorkerRef};
///
/// let d: RemoteDevice = "rank:1/cuda:0".parse()?;
/// assert_eq!(d.worker, WorkerRef::Rank(1));
/// assert_eq!(d.device, Device::Cuda(0));
/// assert_eq!(d.to_string(), "rank:1/cuda:0");
/// assert!("worker1/cpu2".parse::<RemoteDevice>().is_err());
/// # Ok::<(), tp::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RemoteDevice {
    /// The worker that holds the module.
    pub worker: WorkerRef,
    /// The device of that worker the module lives on.
    pub device: Device,
}

impl RemoteDevice {
    /// Parses a remote device string.
    ///
    /// # Errors
    /// [`Error::InvalidDevice`] naming the device part when it is not `cpu`, `cuda` or
    /// `cuda:N` (including an empty one); [`Error::InvalidArgument`] quoting the input and
    /// [`REMOTE_DEVICE_FORMS`] when the string has more than one `/`, an empty worker part, a
    /// worker part with `:` that is not `rank:<digits>`, or is only a device.
    pub fn parse(s: &str) -> Result<RemoteDevice> {
        let bad = || Error::InvalidArgument {
            op: "remote_device",
            arg: "remote_device",
            expected: REMOTE_DEVICE_FORMS.into(),
            got: format!("{s:?}"),
        };
        let parts: Vec<&str> = s.split('/').collect();
        let (worker, device) = match parts.as_slice() {
            [w] => {
                // a bare device names no worker
                if Device::parse(w).is_ok() {
                    return Err(bad());
                }
                (*w, Device::Cpu)
            }
            [w, d] => {
                if w.is_empty() {
                    return Err(bad());
                }
                let dev = Device::parse(d).map_err(|_| Error::InvalidDevice {
                    input: (*d).to_string(),
                })?;
                // `Device::parse` trims; the device part must be exact
                if d.trim() != *d {
                    return Err(Error::InvalidDevice {
                        input: (*d).to_string(),
                    });
                }
                (*w, dev)
            }
            _ => return Err(bad()),
        };
        if worker.is_empty() {
            return Err(bad());
        }
        let worker = if worker.contains(':') {
            let rank = worker
                .strip_prefix("rank:")
                .filter(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|r| r.parse::<usize>().ok())
                .ok_or_else(bad)?;
            WorkerRef::Rank(rank)
        } else {
            WorkerRef::Name(worker.to_string())
        };
        Ok(RemoteDevice { worker, device })
    }
}

impl FromStr for RemoteDevice {
    type Err = Error;
    fn from_str(s: &str) -> Result<RemoteDevice> {
        RemoteDevice::parse(s)
    }
}

impl fmt::Display for RemoteDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.worker {
            WorkerRef::Name(n) => write!(f, "{n}/{}", self.device),
            WorkerRef::Rank(r) => write!(f, "rank:{r}/{}", self.device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str, worker: WorkerRef, device: Device) {
        assert_eq!(
            RemoteDevice::parse(s).unwrap_or_else(|e| panic!("{s}: {e}")),
            RemoteDevice { worker, device },
            "{s}"
        );
    }

    fn name(n: &str) -> WorkerRef {
        WorkerRef::Name(n.into())
    }

    #[test]
    fn accepted_forms() {
        ok("worker1", name("worker1"), Device::Cpu);
        ok("worker1/cpu", name("worker1"), Device::Cpu);
        ok("worker1/cuda:0", name("worker1"), Device::Cuda(0));
        ok("rank:1", WorkerRef::Rank(1), Device::Cpu);
        ok("rank:1/cuda:0", WorkerRef::Rank(1), Device::Cuda(0));
        // parses; the owner reports that it has no such device
        ok("worker1/cuda:100", name("worker1"), Device::Cuda(100));
    }

    #[test]
    fn bad_device_parts_name_the_device() {
        for (s, part) in [
            ("worker1/foo", "foo"),
            ("worker1/cpu2", "cpu2"),
            ("worker1/", ""),
        ] {
            match RemoteDevice::parse(s) {
                Err(Error::InvalidDevice { input }) => assert_eq!(input, part, "{s}"),
                other => panic!("{s}: {other:?}"),
            }
        }
    }

    #[test]
    fn bad_forms_quote_the_input_and_the_forms() {
        for s in [
            "worker1/cuda:0/cuda:1",
            "/",
            "/cuda:0",
            "rank:x/cpu",
            "a:b:c/cpu",
            "trainer:0/cpu",
            "cpu",
            "",
        ] {
            let e = RemoteDevice::parse(s).expect_err(s);
            let text = e.to_string();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{s}: {e:?}");
            assert!(text.contains(&format!("{s:?}")), "{s}: {text}");
            assert!(text.contains("rank:<rank>/<device>"), "{s}: {text}");
        }
    }

    #[test]
    fn display_round_trips() {
        for s in ["worker1/cpu", "rank:3/cuda:2"] {
            assert_eq!(
                RemoteDevice::parse(s)
                    .map(|d| d.to_string())
                    .ok()
                    .as_deref(),
                Some(s)
            );
        }
    }
}
