//! Automatic mixed precision: autocast and the gradient scaler (`torch.amp`).

pub mod grad_scaler;
pub use grad_scaler::{FoundInfSync, GradScaler, GradScalerOptions, GradScalerState};
