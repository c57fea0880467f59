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
mod container;
pub mod functional;
mod layers;
mod loss;
mod module;
mod normalization;
pub mod utils;

pub use attention::MultiheadAttention;
pub use container::ModuleList;
pub use layers::{Dropout, Embedding, GELU, Linear, ReLU, Sequential, Sigmoid, Tanh};
pub use loss::{CrossEntropyLoss, MSELoss};
pub use module::{ForwardHook, ForwardPreHook, Module, ModuleCore};
pub use normalization::LayerNorm;
