//! The function registry: functions registered by name ([`register`]), with the signature
//! checked between caller and callee, and their lookup when a call arrives.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, RwLock};

use tensorplay_core::Tensor;

#[cfg(doc)]
use super::{rpc_async, rpc_sync};
use crate::wire::{Encoder, Wire, decode_args, encode_value};
use crate::{Error, Result};

/// What a call's handler gets besides its arguments.
pub(crate) struct CallCtx {
    /// The caller.
    pub(crate) caller: usize,
}

type Handler = Arc<dyn Fn(&CallCtx, &[u8], Vec<Tensor>) -> Result<Encoder> + Send + Sync>;

type RemoteHandler =
    Arc<dyn Fn(&CallCtx, &[u8], Vec<Tensor>) -> Result<crate::rref::Stored> + Send + Sync>;

pub(crate) struct Registered {
    pub(crate) sig: String,
    pub(crate) handler: Handler,
    /// The same function keeping its result as an RRef's value.
    pub(crate) remote: RemoteHandler,
}

pub(crate) static REGISTRY: LazyLock<RwLock<HashMap<String, Arc<Registered>>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));

/// The signature string checked between caller and callee.
pub(crate) fn signature<A, R>() -> String {
    format!(
        "({}) -> {}",
        std::any::type_name::<A>(),
        std::any::type_name::<R>()
    )
}

/// Registers `f` as the remote function `name`: any worker of the job may call it with
/// [`rpc_sync`](crate::rpc_sync), [`rpc_async`](crate::rpc_async) or
/// [`remote`](crate::remote). Workers built from the same code register the same functions
/// (call `register` before `init_rpc`, or at least before a peer calls). `A` is the argument
/// (a tuple for several), `R` the result; a caller using other types gets an error naming both
/// signatures. Registering a name again replaces it.
///
/// ```
/// use tensorplay as tp;
/// use tp::Tensor;
/// use tp::distributed::rpc;
///
/// rpc::register("add", |(a, b): (Tensor, Tensor)| a.add(&b));
/// ```
pub fn register<A, R, F>(name: &str, f: F)
where
    A: Wire,
    R: Wire + Clone + Sync,
    F: Fn(A) -> tensorplay_core::Result<R> + Send + Sync + 'static,
{
    let f = Arc::new(f);
    let (fname, f2, fname2) = (name.to_string(), f.clone(), name.to_string());
    let handler: Handler = Arc::new(move |ctx: &CallCtx, payload: &[u8], tensors| {
        let args: A = decode_args(
            payload,
            tensors,
            ctx.caller,
            &format!("arguments of {fname}"),
        )?;
        let r = f(args)?;
        encode_value(&r, ctx.caller)
    });
    let remote: RemoteHandler = Arc::new(move |ctx: &CallCtx, payload: &[u8], tensors| {
        let args: A = decode_args(
            payload,
            tensors,
            ctx.caller,
            &format!("arguments of {fname2}"),
        )?;
        Ok(crate::rref::Stored::new(f2(args)?))
    });
    REGISTRY.write().unwrap_or_else(|e| e.into_inner()).insert(
        name.to_string(),
        Arc::new(Registered {
            sig: signature::<A, R>(),
            handler,
            remote,
        }),
    );
}

/// Looks up a registered function and checks the caller's signature.
pub(crate) fn lookup(func: &str, sig: &str) -> Result<Arc<Registered>> {
    let reg = REGISTRY
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(func)
        .cloned()
        .ok_or_else(|| Error::Remote {
            worker: String::new(),
            kind: "UnknownFunction".into(),
            message: format!(
                "no function named {func:?} is registered on this worker (register it with tensorplay::distributed::rpc::register on every worker)"
            ),
        })?;
    if reg.sig != sig {
        return Err(Error::Remote {
            worker: String::new(),
            kind: "Signature".into(),
            message: format!(
                "function {func:?} is registered as {} but was called as {sig}",
                reg.sig
            ),
        });
    }
    Ok(reg)
}
