//! Procedural macros of tensorplay.
//!
//! - [`macro@Module`] (`#[derive(Module)]`) writes a module's traversal (its `ModuleCore`,
//!   parameters, buffers and children) from its fields. Use it through
//!   `tensorplay::nn::Module`.
//! - [`macro@interface`] turns a trait into the method set of a `RemoteModule`
//!   (`_module_interface_cls` in PyTorch). Use it through `tensorplay::distributed::nn::interface`.

use proc_macro::TokenStream;
use syn::{DeriveInput, ItemTrait, parse_macro_input};

mod interface;
mod module;

/// Defines the exact set of remote methods of a `RemoteModule` from a trait.
///
/// Every method takes `&self` or `&mut self` (run under a read or write lock of the module on
/// its owner), any number of arguments whose types implement `Wire`, and returns
/// `Result<R>` (the stack's `Result`) with `R: Wire`. For a trait `Scorer` the macro keeps the
/// trait as written and adds:
/// - `ScorerRemote`, implemented for `RemoteModule<M>` when `M: Scorer`: each method in a
///   blocking form (same name) and an `_async` form returning an `RpcFuture`;
/// - `ScorerInterface`, the marker to pass to `RemoteModule::new_with_interface::<ScorerInterface>`
///   and `register_interface::<ScorerInterface, M>()`; the owner checks at creation that it
///   registered `M` with the same interface and method signatures.
///
/// The generated code names the runtime through `::tensorplay::distributed::nn`; code that
/// depends on `tensorplay-distributed-nn` directly writes
/// `#[interface(crate = "tensorplay_remote_module")]`.
#[proc_macro_attribute]
pub fn interface(attr: TokenStream, item: TokenStream) -> TokenStream {
    let trait_item = parse_macro_input!(item as ItemTrait);
    match interface::expand(attr.into(), trait_item) {
        Ok(t) => t.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// Writes a module's traversal from its fields (`#[derive(Module)]`): it implements
/// `nn::ModuleFields` (the `ModuleCore`, the parameters, buffers and children with their names),
/// and the struct's `impl Module` writes only `forward`.
///
/// Each named field is, in field order:
/// - the **core**: the one field of type `ModuleCore` (required);
/// - a **parameter**: a `Tensor`, or an `Option<Tensor>` listed when `Some`
///   (`#[module(param)]` says so explicitly);
/// - a **buffer**: a `Tensor` or `Option<Tensor>` marked `#[module(buffer)]`;
/// - **plain data**, not listed: numbers, `bool`, `char`, `String`, `PhantomData`, and
///   `Option`s, `Vec`s, `Box`es, arrays, tuples and references of them;
/// - **skipped**: any field marked `#[module(skip)]` (a process group, a cache, an enum of
///   options, a `Tensor` that is neither a parameter nor a buffer);
/// - a **child module**: any other named type, or an `Option` of one listed when `Some`; an
///   `nn::ModuleList` is a child like any other. Its type must implement `Module` (the compiler
///   says so at the field otherwise).
///
/// The field's name is the attribute name: a field `c_fc` holding a `Linear` gives the
/// parameters `c_fc.weight` and `c_fc.bias`, as PyTorch names them. Errors (compile errors at
/// the field): tuple structs, enums, no or two `ModuleCore` fields, a `Vec` of modules (use
/// `ModuleList`), `#[module(buffer)]` on a non-tensor, unknown options.
///
/// The generated code names `::tensorplay_core` when the crate depends on `tensorplay-core`,
/// else `::tensorplay`; `#[module(crate = "path")]` on the struct names another root.
#[proc_macro_derive(Module, attributes(module))]
pub fn derive_module(item: TokenStream) -> TokenStream {
    let input = parse_macro_input!(item as DeriveInput);
    match module::expand(&input) {
        Ok(t) => t.into(),
        Err(e) => e.to_compile_error().into(),
    }
}
