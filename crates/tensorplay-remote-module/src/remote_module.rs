//! [`RemoteModule`]: a module built on another worker and called through RPC
//! (`torch.distributed.nn.api.remote_module.RemoteModule`).
//!
//! Rust cannot ship a class, so a module type that can be built remotely implements
//! [`RemoteConstructible`] (its constructor arguments, a serializable type, and a stable name)
//! and every worker registers it with [`register_module`](crate::register_module); workers built from the same code know
//! the same types. The core's `Linear`, `Embedding` and `Sequential` (of core layers, described
//! by [`LayerSpec`]s) are constructible out of the box.
//!
//! The owner keeps the module in an [`RRef`] to a [`Hosted`] value; the handle calls its
//! methods through the RRef's proxies, so a forward inside a distributed autograd context
//! records send/recv functions and `dist_autograd::backward` reaches the remote parameters.
//!
//! Differences from PyTorch, on purpose (see `docs/decisions.md`): creation errors (an unknown
//! type, a failing constructor, a missing device, a missing interface) are returned by the
//! constructor; `train(mode)` honours `mode`; `Debug` prints the owner and device; a local
//! model holding a RemoteModule lists its local parameters (the RemoteModule contributes none).

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use tensorplay_core::nn::{ForwardHook, ForwardPreHook, Module, ModuleCore, RemovableHandle};
use tensorplay_core::{Device, Error, Result, Tensor};
use tensorplay_rpc::{self as rpc, Decoder, Encoder, RRef, RpcFuture, Wire};

use crate::constructible::{Interface, RemoteConstructible};
use crate::hosted::Hosted;
use crate::registry::{InterfaceCheck, create_fn, method_name};
use crate::remote_device::RemoteDevice;

// ---------------------------------------------------------------------------------------------
// the handle

/// A module that lives on another worker (or this one), called through RPC (`RemoteModule`).
///
/// ```no_run
/// use tensorplay as tp;
/// use tp::nn::Linear;
/// use tp::{Tensor, ones};
/// use tp::distributed::nn::{LinearArgs, RemoteModule, register_module};
///
/// # fn demo() -> tp::Result<()> {
/// register_module::<Linear>(); // on every worker, before init_rpc
/// // ... init_rpc ...
/// let fc = RemoteModule::<Linear>::new("worker1/cpu", LinearArgs { in_features: 16, out_features: 8, bias: true })?;
/// let y = fc.forward(&ones(&[4, 16])?)?; // runs on worker1
/// let params = fc.remote_parameters(true)?; // for a DistributedOptimizer
/// # Ok(()) }
/// ```
#[derive(Module)]
pub struct RemoteModule<M: RemoteConstructible> {
    #[module(skip)]
    rref: RRef<Hosted<M>>,
    #[module(skip)]
    remote_device: RemoteDevice,
    owner_name: String,
    interface: Option<String>,
    core: ModuleCore,
    _m: PhantomData<fn() -> M>,
}

/// Another handle to the same remote module (the module is not copied): like passing an
/// [`RRef`], the owner keeps the module alive while any handle exists. A clone can be moved
/// into an RPC's arguments while this one stays usable; [`RemoteModule::from_module_rref`] makes
/// a handle from the module's RRef ([`RemoteModule::get_module_rref`]) instead.
impl<M: RemoteConstructible> Clone for RemoteModule<M> {
    fn clone(&self) -> Self {
        let mut core = ModuleCore::new();
        core.set_training(self.core.training());
        RemoteModule {
            rref: self.rref.clone(),
            remote_device: self.remote_device.clone(),
            owner_name: self.owner_name.clone(),
            interface: self.interface.clone(),
            core,
            _m: PhantomData,
        }
    }
}

impl<M: RemoteConstructible> fmt::Debug for RemoteModule<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteModule")
            .field("type", &M::TYPE_NAME)
            .field("owner", &self.owner_name)
            .field("device", &self.remote_device.device)
            .field("interface", &self.interface)
            .finish()
    }
}

/// An RPC error as the stack's error, with an unknown creation function explained.
pub(crate) fn creation_error<M: RemoteConstructible>(e: rpc::Error, worker: &str) -> Error {
    match &e {
        // the owner knows neither the type's constructor nor its methods
        rpc::Error::Remote { kind, .. } if kind == "UnknownFunction" || kind == "UnknownMethod" => {
            Error::InvalidArgument {
                op: "RemoteModule::new",
                arg: "module type",
                expected: format!(
                    "a module type registered on worker {worker} (call register_module::<{}>() there)",
                    M::TYPE_NAME
                ),
                got: format!("{}, which worker {worker} does not know", M::TYPE_NAME),
            }
        }
        _ => e.into(),
    }
}

impl<M: RemoteConstructible> RemoteModule<M> {
    /// Builds `M` from `args` on the worker and device of `remote_device` (see
    /// [`RemoteDevice`]) and returns a handle once it exists.
    ///
    /// # Errors
    /// The parse errors of [`RemoteDevice::parse`]; an unknown worker; the owner's errors:
    /// `M` not registered there, the constructor's error, a device it does not have.
    pub fn new(remote_device: &str, args: M::Args) -> Result<RemoteModule<M>> {
        Self::create(remote_device, args, None)
    }

    /// As [`RemoteModule::new`], with the method set of interface `I` (`_module_interface_cls`):
    /// the owner checks that it registered `M` with `I` ([`register_interface`](crate::register_interface)) and with the
    /// same method signatures, and the handle gets `I`'s methods (the `<Trait>Remote` trait the
    /// macro generates).
    ///
    /// # Errors
    /// As [`RemoteModule::new`], and the owner's refusal when `M` does not implement `I` there.
    pub fn new_with_interface<I: Interface<M>>(
        remote_device: &str,
        args: M::Args,
    ) -> Result<RemoteModule<M>> {
        Self::create(remote_device, args, Some((I::NAME, I::methods())))
    }

    fn create(
        remote_device: &str,
        args: M::Args,
        iface: Option<(&'static str, Vec<(String, String)>)>,
    ) -> Result<RemoteModule<M>> {
        let rd = RemoteDevice::parse(remote_device)?;
        let owner = rpc::get_worker_info(rd.worker.to())?;
        let check: InterfaceCheck = iface.as_ref().map(|(n, m)| (n.to_string(), m.clone()));
        let rref: RRef<Hosted<M>> = rpc::remote(
            owner.id,
            &create_fn::<M>(),
            (args, rd.device.to_string(), check),
            None,
        )?;
        // wait for the creation: its errors are the constructor's
        let training: bool = rref
            .rpc_sync(&method_name::<M>("is_training"), (), None)
            .map_err(|e| creation_error::<M>(e, &owner.name))?;
        let mut core = ModuleCore::new();
        core.set_training(training);
        Ok(RemoteModule {
            rref,
            remote_device: rd,
            owner_name: owner.name,
            interface: iface.map(|(n, _)| n.to_string()),
            core,
            _m: PhantomData,
        })
    }

    /// A handle to a module already held in `module_rref` (`init_from_module_rref`), for
    /// example one received from another worker; `remote_device` must name the RRef's owner
    /// and the module's device.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the owner or device differ; RPC errors.
    pub fn from_module_rref(
        remote_device: &str,
        module_rref: RRef<Hosted<M>>,
    ) -> Result<RemoteModule<M>> {
        let rd = RemoteDevice::parse(remote_device)?;
        let owner = module_rref.owner();
        let named = rpc::get_worker_info(rd.worker.to())?;
        let device: String = module_rref.rpc_sync(&method_name::<M>("device"), (), None)?;
        if named.id != owner.id || device != rd.device.to_string() {
            return Err(Error::InvalidArgument {
                op: "RemoteModule::from_module_rref",
                arg: "remote_device",
                expected: format!("{}/{device}, where the module lives", owner.name),
                got: remote_device.to_string(),
            });
        }
        let training: bool = module_rref.rpc_sync(&method_name::<M>("is_training"), (), None)?;
        let mut core = ModuleCore::new();
        core.set_training(training);
        Ok(RemoteModule {
            rref: module_rref,
            remote_device: rd,
            owner_name: owner.name,
            interface: None,
            core,
            _m: PhantomData,
        })
    }

    /// Runs the module's forward on the owner (`forward`): the input moves to the module's
    /// device there and the result comes back to this worker. Inside a distributed autograd
    /// context the call is recorded, so the backward pass reaches the remote parameters.
    ///
    /// # Errors
    /// The forward's error on the owner ([`rpc::Error::Remote`] inside
    /// [`Error::External`]), RPC errors.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        self.forward_many(std::slice::from_ref(input))
    }

    /// [`RemoteModule::forward`] returning a future (`forward_async`).
    ///
    /// # Errors
    /// RPC errors when the call cannot be sent; the forward's errors come from the future.
    pub fn forward_async(&self, input: &Tensor) -> Result<RpcFuture<Tensor>> {
        self.forward_many_async(std::slice::from_ref(input))
    }

    /// The forward of several inputs ([`RemoteConstructible::forward_many`] on the owner).
    ///
    /// # Errors
    /// As [`RemoteModule::forward`].
    pub fn forward_many(&self, inputs: &[Tensor]) -> Result<Tensor> {
        Ok(self.forward_many_async(inputs)?.wait()?)
    }

    /// [`RemoteModule::forward_many`] returning a future.
    ///
    /// # Errors
    /// As [`RemoteModule::forward_async`].
    pub fn forward_many_async(&self, inputs: &[Tensor]) -> Result<RpcFuture<Tensor>> {
        Ok(self
            .rref
            .rpc_async(&method_name::<M>("forward"), inputs.to_vec(), None)?)
    }

    /// RRefs to the module's parameters on the owner (`remote_parameters`), all of them or
    /// (`recurse == false`) the module's own; pass them to a `DistributedOptimizer`.
    ///
    /// # Errors
    /// RPC errors.
    pub fn remote_parameters(&self, recurse: bool) -> Result<Vec<RRef<Tensor>>> {
        Ok(self
            .rref
            .rpc_sync(&method_name::<M>("parameters"), recurse, None)?)
    }

    /// Asks the owner to save the module's `state_dict` (parameters and buffers) to the
    /// safetensors file `path` on its own file system ([`tensorplay_core::save`]: atomic).
    ///
    /// # Errors
    /// The owner's [`Error::Checkpoint`](tensorplay_core::Error::Checkpoint) naming the file
    /// (a folder it cannot write), or the RPC's error.
    pub fn save_on_owner(&self, path: &str) -> Result<()> {
        Ok(self
            .rref
            .rpc_sync(&method_name::<M>("save"), path.to_string(), None)?)
    }

    /// Asks the owner to load the module's parameters and buffers from the safetensors file
    /// `path` on its own file system (written by [`save_on_owner`](Self::save_on_owner)), in
    /// place (`load_state_dict(strict=true)`): RRefs to the parameters, and optimizers over
    /// them, see the loaded values.
    ///
    /// # Errors
    /// The owner's [`Error::Checkpoint`](tensorplay_core::Error::Checkpoint) (a missing,
    /// truncated or corrupt file, named), its `load_state_dict` error (missing or unexpected
    /// keys, other shapes), or the RPC's error.
    pub fn load_on_owner(&self, path: &str) -> Result<()> {
        Ok(self
            .rref
            .rpc_sync(&method_name::<M>("load"), path.to_string(), None)?)
    }

    /// The RRef holding the module on its owner (`get_module_rref`). `to_here(None)` on it
    /// returns a [`Hosted<M>`]: on another worker a copy holding an equal module on the CPU,
    /// on the owner the owner's own; [`Hosted::into_inner`] gives the module itself.
    pub fn get_module_rref(&self) -> RRef<Hosted<M>> {
        self.rref.clone()
    }

    /// The parsed remote device.
    pub fn remote_device(&self) -> &RemoteDevice {
        &self.remote_device
    }

    /// The name of the worker that holds the module.
    pub fn owner_name(&self) -> &str {
        &self.owner_name
    }

    /// The training flag of the remote module, asked of its owner.
    ///
    /// # Errors
    /// RPC errors.
    pub fn is_training_remote(&self) -> Result<bool> {
        Ok(self
            .rref
            .rpc_sync(&method_name::<M>("is_training"), (), None)?)
    }

    /// Calls method `method` of interface `I` on the owner (used by the `#[interface]`
    /// macro's generated methods).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the handle was not created with `I`; the method's and
    /// RPC errors.
    #[doc(hidden)]
    pub fn __interface_call_async<I: Interface<M>, A: Wire, R: Wire>(
        &self,
        method: &str,
        args: A,
    ) -> Result<RpcFuture<R>> {
        if self.interface.as_deref() != Some(I::NAME) {
            return Err(Error::InvalidArgument {
                op: "RemoteModule interface call",
                arg: "interface",
                expected: format!(
                    "a handle created with RemoteModule::new_with_interface::<{}>",
                    I::NAME
                ),
                got: format!("a handle with interface {:?}", self.interface),
            });
        }
        Ok(self
            .rref
            .rpc_async(&interface_method_name::<M>(I::NAME, method), args, None)?)
    }
}

/// The registered name of method `method` of interface `iface` for `M`.
#[doc(hidden)]
pub fn interface_method_name<M: RemoteConstructible>(iface: &str, method: &str) -> String {
    format!(
        "tensorplay::remote_module::{}::{iface}::{method}",
        M::TYPE_NAME
    )
}

pub(crate) fn unsupported(method: &'static str, hint: &str) -> Error {
    Error::NotSupported {
        op: method,
        detail: format!("here: RemoteModule holds no local state; {hint}"),
    }
}

impl<M: RemoteConstructible> Module for RemoteModule<M> {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        RemoteModule::forward(self, input)
    }
    fn state_dict(&self) -> Result<BTreeMap<String, Tensor>> {
        Err(unsupported(
            "state_dict",
            "use get_module_rref().to_here(None)?.into_inner() for a copy of the remote module",
        ))
    }
    fn load_state_dict(&mut self, _: &BTreeMap<String, Tensor>, _: bool) -> Result<()> {
        Err(unsupported(
            "load_state_dict",
            "load the state on the owner, through a method of an #[interface]",
        ))
    }
    /// Sets the training flag of the remote module (and this handle's copy of it); unlike
    /// PyTorch, `mode` is honoured.
    fn train(&mut self, mode: bool) -> Result<()> {
        let now: bool = self.rref.rpc_sync(&method_name::<M>("train"), mode, None)?;
        self.core.set_training(now);
        Ok(())
    }
    fn zero_grad(&self) -> Result<()> {
        Err(unsupported(
            "zero_grad",
            "gradients of remote parameters live in distributed autograd contexts; no zeroing is needed",
        ))
    }
    fn requires_grad_(&mut self, _: bool) -> Result<()> {
        Err(unsupported(
            "requires_grad_",
            "change it on the owner, through a method of an #[interface]",
        ))
    }
    fn to_device(&mut self, _: Device) -> Result<()> {
        Err(unsupported(
            "to",
            "choose the device when creating it (\"worker/cuda:0\")",
        ))
    }
    fn to_empty(&mut self, _: Device) -> Result<()> {
        Err(unsupported(
            "to_empty",
            "the module is built on its owner, with memory",
        ))
    }
    fn reset_parameters(&mut self) -> Result<()> {
        Err(unsupported(
            "reset_parameters",
            "change it on the owner, through a method of an #[interface]",
        ))
    }
    fn cpu(&mut self) -> Result<()> {
        Err(unsupported(
            "cpu",
            "choose the device when creating it (\"worker/cpu\")",
        ))
    }
    fn cuda(&mut self, _: usize) -> Result<()> {
        Err(unsupported(
            "cuda",
            "choose the device when creating it (\"worker/cuda:0\")",
        ))
    }
    fn register_forward_hook(&mut self, _: ForwardHook) -> Result<RemovableHandle> {
        Err(unsupported(
            "register_forward_hook",
            "register hooks on the owner's module, through a method of an #[interface]",
        ))
    }
    fn register_forward_pre_hook(&mut self, _: ForwardPreHook) -> Result<RemovableHandle> {
        Err(unsupported(
            "register_forward_pre_hook",
            "register hooks on the owner's module, through a method of an #[interface]",
        ))
    }
}

impl<M: RemoteConstructible> Wire for RemoteModule<M> {
    fn encode(&self, e: &mut Encoder) -> rpc::Result<()> {
        self.rref.encode(e)?;
        self.remote_device.to_string().encode(e)?;
        self.owner_name.encode(e)?;
        self.interface.encode(e)?;
        self.core.training().encode(e)
    }
    fn decode(d: &mut Decoder) -> rpc::Result<Self> {
        let rref = RRef::<Hosted<M>>::decode(d)?;
        let rd: String = Wire::decode(d)?;
        let owner_name: String = Wire::decode(d)?;
        let interface: Option<String> = Wire::decode(d)?;
        let training = bool::decode(d)?;
        let remote_device = RemoteDevice::parse(&rd)?;
        let mut core = ModuleCore::new();
        core.set_training(training);
        Ok(RemoteModule {
            rref,
            remote_device,
            owner_name,
            interface,
            core,
            _m: PhantomData,
        })
    }
}
