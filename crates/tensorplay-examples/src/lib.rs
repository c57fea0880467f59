//! The code tensorplay's example programs share (unpublished): how a main job's processes join
//! their job ([`launch`]), the loss plots ([`plot`]), `wine_distributed`'s checkpoints
//! ([`resume`]) and data ([`wine`]), and `gpt_distributed`'s batches ([`gpt_batches`]) and
//! checks ([`gpt_checks`]).
//!
//! The programs are this crate's examples: `cargo run --release --example wine_distributed`
//! (or `gpt_distributed`, `wine_quality`) from the workspace root.

pub mod gpt_batches;
pub mod gpt_checks;
pub mod launch;
pub mod plot;
pub mod resume;
pub mod wine;
