//! Methods of RRef values (`register_method`): run on the owner with the value.

use std::any::Any;
use std::sync::{Arc, LazyLock, RwLock};

use tensorplay_core::Tensor;

use super::*;
use crate::wire::{Encoder, Wire, decode_args, encode_value};
use crate::{Error, Result};

pub(super) type MethodHandler = Arc<
    dyn Fn(&(dyn Any + Send + Sync), &[u8], Vec<Tensor>, usize) -> Result<Encoder> + Send + Sync,
>;

/// By method name, then by the value type it was registered for: its signature and handler.
type Methods = HashMap<String, HashMap<&'static str, (String, MethodHandler)>>;

pub(super) static METHODS: LazyLock<RwLock<Methods>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));

pub(super) fn method_signature<T, A, R>() -> String {
    format!(
        "{}::({}) -> {}",
        std::any::type_name::<T>(),
        std::any::type_name::<A>(),
        std::any::type_name::<R>()
    )
}

/// Registers `f` as the method `name` of RRef values of type `T`: `rref.rpc_sync(name, args,
/// timeout)` runs it on the owner with the value (the proxies of PyTorch's RRefs, which call
/// a Python method by name). Values of different types may each have a method of the same
/// name; registering the same name for the same type again replaces it.
///
/// ```
/// use tensorplay as tp;
/// use tp::Tensor;
/// use tp::distributed::rpc;
///
/// rpc::register_method("numel", |t: &Tensor, (): ()| Ok(t.numel()));
/// ```
pub fn register_method<T, A, R, F>(name: &str, f: F)
where
    T: Send + Sync + 'static,
    A: Wire,
    R: Wire,
    F: Fn(&T, A) -> tensorplay_core::Result<R> + Send + Sync + 'static,
{
    let mname = name.to_string();
    let h: MethodHandler = Arc::new(move |v, payload, tensors, caller| {
        let v = v.downcast_ref::<T>().ok_or_else(|| Error::Remote {
            worker: String::new(),
            kind: "Signature".into(),
            message: format!("the RRef's value is not a {}", std::any::type_name::<T>()),
        })?;
        let args: A = decode_args(
            payload,
            tensors,
            caller,
            &format!("arguments of method {mname}"),
        )?;
        let r = f(v, args)?;
        encode_value(&r, caller)
    });
    METHODS
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .entry(name.to_string())
        .or_default()
        .insert(
            std::any::type_name::<T>(),
            (method_signature::<T, A, R>(), h),
        );
}
