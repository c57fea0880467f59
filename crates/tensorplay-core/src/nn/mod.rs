//! Neural-network building blocks (`torch.nn`): the [`Module`] trait, layers, losses and
//! [`functional`] forms of them.
//!
//! ```
//! use tensorplay::{self as tp, nn::{self, Module}};
//!
//! tp::manual_seed(0);
//! let model = nn::Sequential::new()
//!     .add(nn::Linear::new(4, 8, true)?)
//!     .add(nn::ReLU::new())
//!     .add(nn::Linear::new(8, 3, true)?);
//! let x = tp::randn(&[5, 4])?;
//! let target = tp::Tensor::from_vec(vec![0i64, 2, 1, 0, 1], &[5])?;
//! let loss = nn::CrossEntropyLoss::new().forward(&model.call(&x)?, &target)?;
//! loss.backward()?;
//! let names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
//! assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]);
//! # Ok::<(), tp::Error>(())
//! ```

mod attention;
mod boxed;
mod container;
mod fields;
pub mod functional;
mod hooks;
pub mod init;
mod layers;
mod loss;
mod module;
mod normalization;
pub mod utils;

pub use attention::MultiheadAttention;
pub use container::ModuleList;
pub use fields::{AsModule, ModuleFields};
pub use hooks::{AttachedState, ForwardHook, ForwardPreHook, ModuleCore, RemovableHandle};
pub use layers::{Dropout, Embedding, GELU, Linear, ReLU, Sequential, Sigmoid, Tanh};
pub use loss::{CrossEntropyLoss, MSELoss};
pub use module::Module;
pub use normalization::LayerNorm;
/// `#[derive(Module)]`: writes [`ModuleFields`] (the core, parameters, buffers and children)
/// from a struct's fields; see [`trait@Module`] for an example.
pub use tensorplay_macros::Module;
