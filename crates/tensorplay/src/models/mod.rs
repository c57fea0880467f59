//! Ready-made models built from the layers of [`crate::nn`] and the differentiable collectives
//! of [`crate::distributed::nn::functional`].
//!
//! - [`gpt`]: a decoder-only transformer in GPT-2's shape ([`Gpt`]), with Megatron-style tensor
//!   parallelism ([`Gpt::tensor_parallel`]); the second main job, `gpt_distributed`, trains
//!   one on Shakespeare in one process, tensor-parallel and data-parallel.

pub mod gpt;

pub use gpt::{Block, Gpt, GptConfig};
