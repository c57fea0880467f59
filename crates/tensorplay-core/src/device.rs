//! Devices: where a tensor's storage lives.

use std::cell::Cell;
use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

/// Where a tensor's storage lives, as `torch.device`.
///
/// Parsed from `"cpu"`, `"cuda"` (device 0), `"cuda:N"` or `"meta"`:
///
/// ```
/// use tensorplay as tp;
/// use tp::Device;
/// assert_eq!("cuda:1".parse::<Device>()?, Device::Cuda(1));
/// assert_eq!(Device::parse("cpu")?, Device::Cpu);
/// assert_eq!(Device::parse("meta")?, Device::Meta);
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
    /// No memory at all: tensors with a shape and a dtype but no elements (`torch.device("meta")`),
    /// for building a model too large for one rank and allocating only its shards later
    /// ([`crate::nn::Module::to_empty`]). Views work on them; operations that read or write
    /// elements fail with [`Error::MetaTensor`].
    Meta,
}

impl Device {
    /// Parses a device string; [`Error::InvalidDevice`] when it is not `cpu`, `cuda`, `cuda:N`
    /// or `meta`.
    pub fn parse(s: &str) -> Result<Device> {
        s.parse()
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// Whether this is the meta device.
    pub fn is_meta(self) -> bool {
        self == Device::Meta
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
            "meta" => Ok(Device::Meta),
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
            Device::Meta => f.write_str("meta"),
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

thread_local! {
    static DEFAULT_DEVICE: Cell<Device> = const { Cell::new(Device::Cpu) };
}

/// Sets the device that creation functions use when given only a dtype (or nothing):
/// `zeros`, `ones`, `full`, `rand`, `randn`, `arange`, [`crate::Tensor::empty`] and the layers'
/// constructors (`torch.set_default_device`). Per thread; the CPU at start. Tensors made from
/// data (`from_vec`, `scalar`) stay on the CPU.
pub fn set_default_device(device: Device) {
    DEFAULT_DEVICE.with(|d| d.set(device));
}

/// The device creation functions use by default on this thread (`torch.get_default_device`).
pub fn get_default_device() -> Device {
    DEFAULT_DEVICE.with(Cell::get)
}

/// Runs `f` with `device` as this thread's default device, then puts the previous one back
/// (also when `f` panics): PyTorch's `with torch.device("meta"):`. Building a model on the meta
/// device allocates nothing:
///
/// ```
/// use tensorplay::{self as tp, nn::{self, Module}, Device};
///
/// let layer = tp::with_default_device(Device::Meta, || nn::Linear::new(1 << 14, 1 << 14, true))?;
/// assert_eq!(layer.weight.device(), Device::Meta);
/// assert_eq!(layer.weight.shape(), [1 << 14, 1 << 14]);
/// assert_eq!(tp::get_default_device(), Device::Cpu);
/// # Ok::<(), tp::Error>(())
/// ```
pub fn with_default_device<R>(device: Device, f: impl FnOnce() -> R) -> R {
    struct Restore(Device);
    impl Drop for Restore {
        fn drop(&mut self) {
            set_default_device(self.0);
        }
    }
    let _restore = Restore(get_default_device());
    set_default_device(device);
    f()
}
