//! [`Hosted`]: the value a RemoteModule's owner keeps in its RRef (the module behind a lock,
//! with its device), and how it travels.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use tensorplay_core::{Device, Result, Tensor};
use tensorplay_rpc::{self as rpc, Decoder, Encoder, Wire};

use crate::constructible::RemoteConstructible;

/// The owner's copy of a remote module: the module (behind a lock), its constructor arguments
/// and its device.
///
/// `get_module_rref().to_here(None)` returns a `Hosted<M>`, not the module: on another worker,
/// a new one holding an equal module on the CPU (the owner sends the arguments, the training
/// flag and the state dict, and the receiver rebuilds the module from them); on the owner, the
/// owner's own (a handle sharing the live module). [`read`](Hosted::read) and
/// [`write`](Hosted::write) lock the module in place; [`into_inner`](Hosted::into_inner) gives
/// the module itself:
///
/// ```no_run
/// use tensorplay as tp;
/// use tp::distributed::nn::{LinearArgs, RemoteModule};
/// use tp::nn::Module;
///
/// # fn main() -> tp::Result<()> {
/// let remote = RemoteModule::<tp::nn::Linear>::new(
///     "worker1/cpu",
///     LinearArgs { in_features: 4, out_features: 2, bias: true },
/// )?;
/// let copy: tp::nn::Linear = remote.get_module_rref().to_here(None)?.into_inner()?;
/// assert_eq!(copy.forward(&tp::ones(&[1, 4])?)?.shape(), &[1, 2]); // runs here, on the copy
/// # Ok(()) }
/// ```
pub struct Hosted<M: RemoteConstructible> {
    inner: Arc<HostedInner<M>>,
}

pub(crate) struct HostedInner<M: RemoteConstructible> {
    args: M::Args,
    device: Device,
    module: RwLock<M>,
}

impl<M: RemoteConstructible> Clone for Hosted<M> {
    fn clone(&self) -> Self {
        Hosted {
            inner: self.inner.clone(),
        }
    }
}

impl<M: RemoteConstructible> fmt::Debug for Hosted<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hosted")
            .field("type", &M::TYPE_NAME)
            .field("device", &self.inner.device)
            .finish()
    }
}

impl<M: RemoteConstructible> Hosted<M> {
    pub(crate) fn new(args: M::Args, device: Device, module: M) -> Hosted<M> {
        Hosted {
            inner: Arc::new(HostedInner {
                args,
                device,
                module: RwLock::new(module),
            }),
        }
    }
    /// Read access to the module.
    pub fn read(&self) -> RwLockReadGuard<'_, M> {
        self.inner.module.read().unwrap_or_else(|e| e.into_inner())
    }
    /// Write access to the module.
    pub fn write(&self) -> RwLockWriteGuard<'_, M> {
        self.inner.module.write().unwrap_or_else(|e| e.into_inner())
    }
    /// The device the module lives on.
    pub fn device(&self) -> Device {
        self.inner.device
    }
    /// The constructor arguments it was built from.
    pub fn args(&self) -> &M::Args {
        &self.inner.args
    }

    /// The module itself. When this is its only handle (the copy that
    /// `get_module_rref().to_here()` fetched from another worker, not cloned since), the
    /// module is taken out as it is, on its device; otherwise (the owner's own value, or a
    /// clone) a new module is built from the same constructor arguments, state dict and
    /// training flag, on the CPU, as sending it would, and the shared one is left alone.
    ///
    /// # Errors
    /// Only when rebuilding: `M::construct`'s error, or the module's `state_dict` /
    /// `load_state_dict` error.
    pub fn into_inner(self) -> Result<M> {
        match Arc::try_unwrap(self.inner) {
            Ok(inner) => Ok(inner.module.into_inner().unwrap_or_else(|e| e.into_inner())),
            Err(shared) => {
                let hosted = Hosted { inner: shared };
                let m = hosted.read();
                let state = m.state_dict()?;
                let entries = state
                    .into_iter()
                    .map(|(k, v)| Ok((k, v.to_device(Device::Cpu)?.detach().deep_clone()?)))
                    .collect::<Result<Vec<_>>>()?;
                rebuild(&hosted.inner.args, entries, m.is_training())
            }
        }
    }
}

/// A module built from `args` with the state `entries` and the training flag `training` (what
/// a receiver of a [`Hosted`] holds).
pub(crate) fn rebuild<M: RemoteConstructible>(
    args: &M::Args,
    entries: Vec<(String, Tensor)>,
    training: bool,
) -> Result<M> {
    let mut m = M::construct(args)?;
    let state: BTreeMap<String, Tensor> = entries.into_iter().collect();
    {
        let _g = tensorplay_core::no_grad();
        m.load_state_dict(&state, true)?;
    }
    m.train(training)?;
    Ok(m)
}

impl<M: RemoteConstructible> Wire for Hosted<M> {
    fn encode(&self, e: &mut Encoder) -> rpc::Result<()> {
        let m = self.read();
        let state = m.state_dict()?;
        self.inner.args.encode(e)?;
        self.inner.device.to_string().encode(e)?;
        m.is_training().encode(e)?;
        let entries: Vec<(String, Tensor)> = state
            .into_iter()
            .map(|(k, v)| Ok((k, v.to_device(Device::Cpu)?.detach())))
            .collect::<Result<_>>()?;
        entries.encode(e)
    }

    fn decode(d: &mut Decoder) -> rpc::Result<Self> {
        let args = M::Args::decode(d)?;
        let device: String = Wire::decode(d)?;
        let training = bool::decode(d)?;
        let entries: Vec<(String, Tensor)> = Wire::decode(d)?;
        let m = rebuild::<M>(&args, entries, training)?;
        // the copy lives where it arrived: on the CPU
        let _ = device;
        Ok(Hosted::new(args, Device::Cpu, m))
    }
}
