//! Automatic mixed precision: autocast and the gradient scaler (`torch.amp`).

mod autocast;

pub use autocast::{
    AutocastGuard, AutocastOptions, autocast, autocast_with, get_autocast_dtype,
    is_autocast_enabled,
};
pub(crate) use autocast::{
    Regions, current_regions, disabled_for_backward, enter_regions, to_fp32, to_lower,
};
pub mod grad_scaler;
pub use grad_scaler::{FoundInfSync, GradScaler, GradScalerOptions, GradScalerState};
