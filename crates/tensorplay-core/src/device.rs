//! Devices: where a tensor's storage lives.

use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

/// Where a tensor's storage lives, as `torch.device`.
///
/// Parsed from `"cpu"`, `"cuda"` (device 0) or `"cuda:N"`:
///
/// ```
/// use tensorplay as tp;
/// use tp::Device;
/// assert_eq!("cuda:1".parse::<Device>()?, Device::Cuda(1));
/// assert_eq!(Device::parse("cpu")?, Device::Cpu);
/// assert!(Device::parse("tpu").is_err());
/// # Ok::<(), tp::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory.
    #[default]
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl Device {
    /// Parses a device string; [`Error::InvalidDevice`] when it is not `cpu`, `cuda` or `cuda:N`.
    pub fn parse(s: &str) -> Result<Device> {
        s.parse()
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl FromStr for Device {
    type Err = Error;
    fn from_str(s: &str) -> Result<Device> {
        let bad = || Error::InvalidDevice {
            input: s.to_string(),
        };
        let t = s.trim();
        match t {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => {
                let rest = t.strip_prefix("cuda:").ok_or_else(bad)?;
                if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                rest.parse::<usize>().map(Device::Cuda).map_err(|_| bad())
            }
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Anything that names a device: a [`Device`], `&str` or `String`.
pub trait IntoDevice {
    /// Converts into a [`Device`]; errors on an unparsable string.
    fn into_device(self) -> Result<Device>;
}
impl IntoDevice for Device {
    fn into_device(self) -> Result<Device> {
        Ok(self)
    }
}
impl IntoDevice for &str {
    fn into_device(self) -> Result<Device> {
        self.parse()
    }
}
impl IntoDevice for &String {
    fn into_device(self) -> Result<Device> {
        self.parse()
    }
}
impl IntoDevice for String {
    fn into_device(self) -> Result<Device> {
        self.parse()
    }
}
