//! Utilities outside the tensor library proper (`torch.utils`).

pub mod data;
