//! Parameter groups (`optimizer.param_groups`): the hyperparameters that apply to a range of
//! an optimizer's parameters, changed while training by users and learning-rate schedulers.

use std::ops::Range;

use super::{check_lr, check_nonneg};
use crate::{Error, Result};

/// One parameter group of an optimizer (`optimizer.param_groups[i]`): the parameters it covers
/// (a range of [`Optimizer::params`](super::Optimizer::params)) and the hyperparameters that
/// may change between steps. Fields an optimizer does not use are `None` (`momentum` is SGD's,
/// `betas` Adam's and AdamW's); the others (SGD's dampening and Nesterov flag, Adam's `eps` and
/// `amsgrad`) are fixed at construction.
///
/// Values are checked at the next `step`, which fails naming the group before any parameter
/// changes: `lr`, `weight_decay` and `momentum` finite and `>= 0`, betas in `[0, 1)`.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroup {
    /// Learning rate.
    pub lr: f64,
    /// Weight decay (L2 for SGD and Adam, decoupled for AdamW).
    pub weight_decay: f64,
    /// SGD's momentum factor.
    pub momentum: Option<f64>,
    /// Adam's and AdamW's `(beta1, beta2)`.
    pub betas: Option<(f64, f64)>,
    pub(crate) params: Range<usize>,
}

impl ParamGroup {
    pub(crate) fn new(
        lr: f64,
        weight_decay: f64,
        momentum: Option<f64>,
        betas: Option<(f64, f64)>,
        params: Range<usize>,
    ) -> ParamGroup {
        ParamGroup {
            lr,
            weight_decay,
            momentum,
            betas,
            params,
        }
    }

    /// The indices of this group's parameters in the optimizer's
    /// [`params`](super::Optimizer::params).
    pub fn params(&self) -> Range<usize> {
        self.params.clone()
    }

    /// Checks the values a user or a scheduler may have set; errors name `op` and group `i`.
    pub(crate) fn check(&self, op: &'static str, i: usize) -> Result<()> {
        let named = |e: Error| in_group(e, i);
        check_lr(op, self.lr).map_err(named)?;
        check_nonneg(op, "weight_decay", self.weight_decay).map_err(named)?;
        if let Some(m) = self.momentum {
            check_nonneg(op, "momentum", m).map_err(named)?;
        }
        if let Some((b1, b2)) = self.betas {
            for (k, b) in [b1, b2].into_iter().enumerate() {
                if !(0.0..1.0).contains(&b) {
                    return Err(Error::invalid(
                        op,
                        "betas",
                        "betas in [0, 1)",
                        format!("beta{} = {b} in param_groups[{i}]", k + 1),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// `e` (an invalid hyperparameter) naming group `i`.
pub(crate) fn in_group(e: Error, i: usize) -> Error {
    match e {
        Error::InvalidArgument {
            op,
            arg,
            expected,
            got,
        } => Error::InvalidArgument {
            op,
            arg,
            expected,
            got: format!("{got} in param_groups[{i}]"),
        },
        other => other,
    }
}

/// Checks every group before a step.
pub(crate) fn check_groups(op: &'static str, groups: &[ParamGroup]) -> Result<()> {
    groups
        .iter()
        .enumerate()
        .try_for_each(|(i, g)| g.check(op, i))
}

/// Sets every group's learning rate (`set_lr`).
pub(crate) fn set_all_lr(op: &'static str, groups: &mut [ParamGroup], lr: f64) -> Result<()> {
    check_lr(op, lr)?;
    groups.iter_mut().for_each(|g| g.lr = lr);
    Ok(())
}

/// The ranges of consecutive groups of `sizes` parameters.
pub(crate) fn ranges(sizes: impl IntoIterator<Item = usize>) -> Vec<Range<usize>> {
    let mut start = 0;
    sizes
        .into_iter()
        .map(|n| {
            let r = start..start + n;
            start += n;
            r
        })
        .collect()
}
