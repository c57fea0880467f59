//! [`RemoteModule`]: a module built on another worker and called through RPC
//! (`torch.distributed.nn.api.remote_module.RemoteModule`).
//!
//! Rust cannot ship a class, so a module type that can be built remotely implements
//! [`RemoteConstructible`] (its constructor arguments, a serializable type, and a stable name)
//! and every worker registers it with [`register_module`]; workers built from the same code know
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

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, LazyLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use tensorplay_core::nn::{
    Dropout, Embedding, ForwardHook, GELU, Linear, Module, ModuleCore, ReLU, Sequential, Sigmoid,
    Tanh,
};
use tensorplay_core::{Device, Error, Result, Tensor};
use tensorplay_rpc::{self as rpc, Decoder, Encoder, RRef, RpcFuture, Wire};

use crate::remote_device::RemoteDevice;

/// A module type that a remote worker can build from serializable constructor arguments.
///
/// ```
/// use tensorplay as tp;
/// use tp::nn::{Linear, Module, ModuleCore};
/// use tp::{Result, Tensor};
/// use tp::distributed::nn::RemoteConstructible;
///
/// /// y = x * w, with w set from the arguments.
/// struct Scale { w: Tensor, core: ModuleCore }
///
/// impl Module for Scale {
///     fn forward(&self, x: &Tensor) -> Result<Tensor> { x.mul(&self.w) }
///     fn core(&self) -> &ModuleCore { &self.core }
///     fn core_mut(&mut self) -> &mut ModuleCore { &mut self.core }
///     fn local_parameters(&self) -> Vec<(String, Tensor)> { vec![("w".into(), self.w.clone())] }
///     fn local_parameters_mut(&mut self) -> Vec<(String, &mut Tensor)> { vec![("w".into(), &mut self.w)] }
/// }
///
/// impl RemoteConstructible for Scale {
///     type Args = Vec<f64>;
///     const TYPE_NAME: &'static str = "example::Scale";
///     fn construct(args: &Vec<f64>) -> Result<Scale> {
///         let w = Tensor::from_vec(args.clone(), &[args.len()])?.requires_grad_(true);
///         Ok(Scale { w, core: ModuleCore::new() })
///     }
/// }
/// // on every worker, before init_rpc:
/// tp::distributed::nn::register_module::<Scale>();
/// ```
pub trait RemoteConstructible: Module + Sized + 'static {
    /// The constructor's arguments, sent to the owner.
    type Args: Wire + Clone + Send + Sync;
    /// The name the type is registered under on every worker (unique in the job).
    const TYPE_NAME: &'static str;
    /// Builds the module (on CPU; it is moved to its device afterwards).
    ///
    /// # Errors
    /// Whatever the constructor refuses; returned by [`RemoteModule::new`].
    fn construct(args: &Self::Args) -> Result<Self>;
    /// The forward of several inputs ([`RemoteModule::forward_many`]); the default accepts
    /// exactly one and calls [`Module::call`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another number of inputs; the forward's errors.
    fn forward_many(&self, inputs: &[Tensor]) -> Result<Tensor> {
        match inputs {
            [x] => self.call(x),
            _ => Err(Error::InvalidArgument {
                op: "RemoteModule::forward_many",
                arg: "inputs",
                expected: format!("one input for {}", Self::TYPE_NAME),
                got: format!("{} inputs", inputs.len()),
            }),
        }
    }
}

/// A set of remote methods defined by `#[interface]` on a trait (`_module_interface_cls`).
/// Implemented by the macro for each module type that implements the trait; not by hand.
pub trait Interface<M: RemoteConstructible>: 'static {
    /// The trait's name.
    const NAME: &'static str;
    /// Each method's name and argument/result types, compared between the caller's and the
    /// owner's binaries when a module is created.
    fn methods() -> Vec<(String, String)>;
    /// Registers the methods for `M` on this worker.
    fn register_methods();
}

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

struct HostedInner<M: RemoteConstructible> {
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
    fn new(args: M::Args, device: Device, module: M) -> Hosted<M> {
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
fn rebuild<M: RemoteConstructible>(
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

// ---------------------------------------------------------------------------------------------
// the per-worker registry of module types and their interfaces

/// Interfaces registered per type name: interface name -> its methods.
/// Interface name -> its methods, per module type name.
type TypeTable = HashMap<&'static str, HashMap<&'static str, Vec<(String, String)>>>;

static TYPES: LazyLock<RwLock<TypeTable>> = LazyLock::new(|| RwLock::new(HashMap::new()));

fn create_fn<M: RemoteConstructible>() -> String {
    format!("tensorplay::remote_module::create::{}", M::TYPE_NAME)
}

/// The registered name of method `method` of `M`'s hosted value.
#[doc(hidden)]
pub fn method_name<M: RemoteConstructible>(method: &str) -> String {
    format!("tensorplay::remote_module::{}::{method}", M::TYPE_NAME)
}

/// What a creation request checks on the owner: an interface's name and methods.
type InterfaceCheck = Option<(String, Vec<(String, String)>)>;

/// Whether this worker has `device`.
fn check_device(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(i) => {
            let n = tensorplay_core::cuda::device_count();
            if i < n {
                Ok(())
            } else {
                Err(Error::InvalidArgument {
                    op: "RemoteModule::new",
                    arg: "remote_device",
                    expected: format!("a device of this worker (it has {n} CUDA devices)"),
                    got: format!("cuda:{i}: no such device"),
                })
            }
        }
    }
}

/// Registers module type `M` on this worker, so that other workers can build it here
/// ([`RemoteModule::new`]). Call it on every worker, before `init_rpc` (or at least before a
/// peer creates one). Registering again is harmless.
pub fn register_module<M: RemoteConstructible>() {
    TYPES
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .entry(M::TYPE_NAME)
        .or_default();
    rpc::register(
        &create_fn::<M>(),
        |(args, device, iface): (M::Args, String, InterfaceCheck)| -> Result<Hosted<M>> {
            let device = Device::parse(&device)?;
            check_device(device)?;
            if let Some((name, methods)) = iface {
                let types = TYPES.read().unwrap_or_else(|e| e.into_inner());
                let have = types.get(M::TYPE_NAME).and_then(|t| t.get(name.as_str()));
                match have {
                    Some(m) if *m == methods => {}
                    Some(m) => {
                        return Err(Error::InvalidArgument {
                            op: "RemoteModule::new",
                            arg: "interface",
                            expected: format!("the methods {methods:?} of interface {name}"),
                            got: format!("{} implements it here as {m:?}", M::TYPE_NAME),
                        });
                    }
                    None => {
                        return Err(Error::InvalidArgument {
                            op: "RemoteModule::new",
                            arg: "interface",
                            expected: format!(
                                "a module type that implements interface {name} on this worker"
                            ),
                            got: format!(
                                "{}, registered here without it (register_interface::<{name}, _>() was not called for it)",
                                M::TYPE_NAME
                            ),
                        });
                    }
                }
            }
            let mut m = M::construct(&args)?;
            if device != Device::Cpu {
                m.to(device)?;
            }
            Ok(Hosted::new(args, device, m))
        },
    );
    rpc::register_method(
        &method_name::<M>("forward"),
        |h: &Hosted<M>, inputs: Vec<Tensor>| {
            let dev = h.device();
            let inputs = inputs
                .iter()
                .map(|x| x.to_device(dev))
                .collect::<Result<Vec<_>>>()?;
            let y = h.read().forward_many(&inputs)?;
            y.to_device(Device::Cpu)
        },
    );
    rpc::register_method(&method_name::<M>("save"), |h: &Hosted<M>, path: String| {
        tensorplay_core::save(&h.read().state_dict()?, &path)
    });
    rpc::register_method(&method_name::<M>("load"), |h: &Hosted<M>, path: String| {
        let state = tensorplay_core::load(&path)?;
        h.write().load_state_dict(&state, true)
    });
    rpc::register_method(&method_name::<M>("train"), |h: &Hosted<M>, mode: bool| {
        h.write().train(mode)?;
        Ok(h.read().is_training())
    });
    rpc::register_method(&method_name::<M>("is_training"), |h: &Hosted<M>, (): ()| {
        Ok(h.read().is_training())
    });
    rpc::register_method(&method_name::<M>("device"), |h: &Hosted<M>, (): ()| {
        Ok(h.device().to_string())
    });
    rpc::register_method(
        &method_name::<M>("parameters"),
        |h: &Hosted<M>, recurse: bool| {
            let m = h.read();
            let ps: Vec<Tensor> = if recurse {
                m.parameters()
            } else {
                m.local_parameters().into_iter().map(|(_, p)| p).collect()
            };
            ps.into_iter()
                .map(|p| RRef::new(p).map_err(Error::from))
                .collect::<Result<Vec<_>>>()
        },
    );
}

/// Registers interface `I` for module type `M` on this worker: its methods become callable on
/// `RemoteModule<M>` handles created with [`RemoteModule::new_with_interface`], and creations
/// that ask for `I` pass the owner's check. Call it on every worker, like [`register_module`].
pub fn register_interface<I: Interface<M>, M: RemoteConstructible>() {
    register_module::<M>();
    I::register_methods();
    TYPES
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .entry(M::TYPE_NAME)
        .or_default()
        .insert(I::NAME, I::methods());
}

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
pub struct RemoteModule<M: RemoteConstructible> {
    rref: RRef<Hosted<M>>,
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
fn creation_error<M: RemoteConstructible>(e: rpc::Error, worker: &str) -> Error {
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
    /// the owner checks that it registered `M` with `I` ([`register_interface`]) and with the
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

fn unsupported(method: &'static str, hint: &str) -> Error {
    Error::NotSupported {
        op: method,
        detail: format!("here: RemoteModule holds no local state; {hint}"),
    }
}

impl<M: RemoteConstructible> Module for RemoteModule<M> {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        RemoteModule::forward(self, input)
    }
    fn core(&self) -> &ModuleCore {
        &self.core
    }
    fn core_mut(&mut self) -> &mut ModuleCore {
        &mut self.core
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
    fn register_forward_hook(&mut self, _: ForwardHook) -> Result<()> {
        Err(unsupported(
            "register_forward_hook",
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

// ---------------------------------------------------------------------------------------------
// the core's layers

/// The constructor arguments of [`Linear`] (`nn.Linear(in_features, out_features, bias)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearArgs {
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
    /// Whether the layer has a bias.
    pub bias: bool,
}

impl Wire for LinearArgs {
    fn encode(&self, e: &mut Encoder) -> rpc::Result<()> {
        (self.in_features, self.out_features, self.bias).encode(e)
    }
    fn decode(d: &mut Decoder) -> rpc::Result<Self> {
        let (in_features, out_features, bias) = Wire::decode(d)?;
        Ok(LinearArgs {
            in_features,
            out_features,
            bias,
        })
    }
}

impl RemoteConstructible for Linear {
    type Args = LinearArgs;
    const TYPE_NAME: &'static str = "tensorplay::nn::Linear";
    fn construct(a: &LinearArgs) -> Result<Linear> {
        Linear::new(a.in_features, a.out_features, a.bias)
    }
}

impl RemoteConstructible for Embedding {
    /// `(num_embeddings, embedding_dim)`.
    type Args = (usize, usize);
    const TYPE_NAME: &'static str = "tensorplay::nn::Embedding";
    fn construct(&(n, d): &(usize, usize)) -> Result<Embedding> {
        Embedding::new(n, d)
    }
}

/// One layer of a remotely built [`Sequential`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LayerSpec {
    /// `Linear(in, out, bias)`.
    Linear(LinearArgs),
    /// `ReLU`.
    ReLU,
    /// `Tanh`.
    Tanh,
    /// `Embedding(num, dim)`.
    Embedding(usize, usize),
    /// `Sigmoid`.
    Sigmoid,
    /// `GELU` (the exact, erf form).
    GELU,
    /// `Dropout(p)`: zeroes each element with probability `p` in training mode, scaling the
    /// rest by `1 / (1 - p)`; `p` in `[0, 1)`, checked on the owner.
    Dropout(f64),
}

impl Wire for LayerSpec {
    fn encode(&self, e: &mut Encoder) -> rpc::Result<()> {
        match *self {
            LayerSpec::Linear(a) => {
                0u8.encode(e)?;
                a.encode(e)
            }
            LayerSpec::ReLU => 1u8.encode(e),
            LayerSpec::Tanh => 2u8.encode(e),
            LayerSpec::Embedding(n, d) => {
                3u8.encode(e)?;
                (n, d).encode(e)
            }
            LayerSpec::Sigmoid => 4u8.encode(e),
            LayerSpec::GELU => 5u8.encode(e),
            LayerSpec::Dropout(p) => {
                6u8.encode(e)?;
                p.encode(e)
            }
        }
    }
    fn decode(d: &mut Decoder) -> rpc::Result<Self> {
        Ok(match u8::decode(d)? {
            0 => LayerSpec::Linear(LinearArgs::decode(d)?),
            1 => LayerSpec::ReLU,
            2 => LayerSpec::Tanh,
            3 => {
                let (n, dim) = Wire::decode(d)?;
                LayerSpec::Embedding(n, dim)
            }
            4 => LayerSpec::Sigmoid,
            5 => LayerSpec::GELU,
            6 => LayerSpec::Dropout(f64::decode(d)?),
            k => {
                return Err(rpc::Error::Serialization(format!(
                    "unknown layer kind {k} (expected 0 Linear, 1 ReLU, 2 Tanh, 3 Embedding, 4 Sigmoid, 5 GELU, 6 Dropout)"
                )));
            }
        })
    }
}

impl RemoteConstructible for Sequential {
    /// The layers, in order.
    type Args = Vec<LayerSpec>;
    const TYPE_NAME: &'static str = "tensorplay::nn::Sequential";
    fn construct(layers: &Vec<LayerSpec>) -> Result<Sequential> {
        let mut s = Sequential::new();
        for l in layers {
            s.push(match *l {
                LayerSpec::Linear(a) => Box::new(Linear::construct(&a)?),
                LayerSpec::ReLU => Box::new(ReLU::new()),
                LayerSpec::Tanh => Box::new(Tanh::new()),
                LayerSpec::Embedding(n, d) => Box::new(Embedding::new(n, d)?),
                LayerSpec::Sigmoid => Box::new(Sigmoid::new()),
                LayerSpec::GELU => Box::new(GELU::new()),
                LayerSpec::Dropout(p) => Box::new(Dropout::new(p)?),
            });
        }
        Ok(s)
    }
}
