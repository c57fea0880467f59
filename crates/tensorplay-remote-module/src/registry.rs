//! The per-worker registry of module types and their interfaces: what [`register_module`]
//! and [`register_interface`] record, and the remote functions that build a module.

use std::collections::HashMap;
use std::sync::{LazyLock, RwLock};

use tensorplay_core::{Device, Error, Result, Tensor};
use tensorplay_rpc::{self as rpc, RRef};

use crate::constructible::{Interface, RemoteConstructible};
use crate::hosted::Hosted;

// ---------------------------------------------------------------------------------------------
// the per-worker registry of module types and their interfaces

/// Interfaces registered per type name: interface name -> its methods.
/// Interface name -> its methods, per module type name.
pub(crate) type TypeTable = HashMap<&'static str, HashMap<&'static str, Vec<(String, String)>>>;

pub(crate) static TYPES: LazyLock<RwLock<TypeTable>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));

pub(crate) fn create_fn<M: RemoteConstructible>() -> String {
    format!("tensorplay::remote_module::create::{}", M::TYPE_NAME)
}

/// The registered name of method `method` of `M`'s hosted value.
#[doc(hidden)]
pub fn method_name<M: RemoteConstructible>(method: &str) -> String {
    format!("tensorplay::remote_module::{}::{method}", M::TYPE_NAME)
}

/// What a creation request checks on the owner: an interface's name and methods.
pub(crate) type InterfaceCheck = Option<(String, Vec<(String, String)>)>;

/// Whether this worker has `device`.
pub(crate) fn check_device(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Meta => Err(Error::InvalidArgument {
            op: "RemoteModule::new",
            arg: "remote_device",
            expected: "a device with memory (cpu or cuda:N) to host the module on".into(),
            got: "meta".into(),
        }),
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
/// ([`RemoteModule::new`](crate::RemoteModule::new)). Call it on every worker, before `init_rpc` (or at least before a
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
/// `RemoteModule<M>` handles created with [`RemoteModule::new_with_interface`](crate::RemoteModule::new_with_interface), and creations
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
