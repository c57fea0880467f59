//! Benchmark of a core training step (placeholder).
fn main() {}
