//! `tensorplay`: a PyTorch-style deep-learning stack in Rust, built for distributed training.
//!
//! This facade re-exports the layers under PyTorch's module paths; depend on it and write
//! `use tensorplay as tp;`:
//!
//! | PyTorch | tensorplay |
//! |---|---|
//! | `torch.Tensor`, `torch.randn`, `torch.zeros`, ... | [`Tensor`], [`randn`], [`zeros`], ... |
//! | `torch.autograd` | [`autograd`] |
//! | `torch.nn` | [`nn`] |
//! | `torch.optim` | [`optim`] |
//!
//! ```
//! use tensorplay as tp;
//! let x = tp::randn(&[4, 3])?.requires_grad_(true);
//! let y = x.tanh()?.sum()?;
//! y.backward()?;
//! assert_eq!(x.grad().unwrap().shape(), &[4, 3]);
//! # Ok::<(), tp::Error>(())
//! ```
//!
//! Every layer's error converts into the one [`Error`] of this crate, so `?` works across
//! layers in a function returning [`Result`].

pub use tensorplay_core::{
    CpuStorage, DType, Device, IntoDevice, Layout, Storage, Tensor, TensorId, TensorOptions,
    arange, autograd, cuda, full, get_num_threads, manual_seed, no_grad, ones, rand, randint,
    randn, random, set_grad_enabled, set_num_threads, zeros,
};
pub use tensorplay_core::{nn, optim};

/// The error of every tensorplay layer.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// From the tensor/autograd core.
    #[error(transparent)]
    Core(#[from] tensorplay_core::Error),
}

/// `Result` with the facade's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
