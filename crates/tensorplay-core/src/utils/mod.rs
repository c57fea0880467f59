//! Utilities outside the tensor library proper (`torch.utils`).

pub mod checkpoint;
pub mod data;
