//! Ready-made models built from tensorplay's layers (`tp::nn`) and its differentiable
//! collectives (`tp::distributed::nn::functional`); the facade `tensorplay` re-exports this
//! crate as `tp::models` with its feature `models`.
//!
//! - [`gpt`]: a decoder-only transformer in GPT-2's shape ([`Gpt`]), with Megatron-style tensor
//!   parallelism ([`Gpt::tensor_parallel`]); the second main job, `gpt_distributed`, trains
//!   one on Shakespeare in one process, tensor-parallel and data-parallel.
//! - [`gpt_stage`]: the GPT split by layers into pipeline stages ([`Gpt::pipeline_stage`]).

pub mod gpt;
pub mod gpt_stage;

pub use gpt::{Block, Gpt, GptConfig};
pub use gpt_stage::GptStage;

/// The training text of the second main job: 1,115,394 bytes of ASCII from Shakespeare's plays
/// (`data/tinyshakespeare.txt`; source and licence in `data/README.md`). A `const`, so only the
/// programs that name it carry it.
pub const TINY_SHAKESPEARE: &str = include_str!("../data/tinyshakespeare.txt");
