//! The traits of a module type that can be built on another worker ([`RemoteConstructible`])
//! and of the method sets of `#[interface]` traits ([`Interface`]).

use tensorplay_core::nn::Module;
use tensorplay_core::{Error, Result, Tensor};
use tensorplay_rpc::Wire;

/// A module type that a remote worker can build from serializable constructor arguments.
///
/// ```
/// use tensorplay as tp;
/// use tp::nn::{Linear, Module, ModuleCore};
/// use tp::{Result, Tensor};
/// use tp::distributed::nn::RemoteConstructible;
///
/// /// y = x * w, with w set from the arguments.
/// #[derive(Module)]
/// struct Scale { w: Tensor, core: ModuleCore }
///
/// impl Module for Scale {
///     fn forward(&self, x: &Tensor) -> Result<Tensor> { x.mul(&self.w) }
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
    /// Whatever the constructor refuses; returned by [`RemoteModule::new`](crate::RemoteModule::new).
    fn construct(args: &Self::Args) -> Result<Self>;
    /// The forward of several inputs ([`RemoteModule::forward_many`](crate::RemoteModule::forward_many)); the default accepts
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
