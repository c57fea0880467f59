//! Mixed precision of a fully sharded module (`MixedPrecisionPolicy`): the dtypes its
//! parameters are gathered and computed in, its gradients reduced in, and its output given in,
//! while the shards stay the master copy in their own dtype.

use tensorplay_core::{DType, Result, Tensor};

/// The dtypes one `fully_shard` group computes and communicates in
/// (`torch.distributed.fsdp.MixedPrecisionPolicy`). The default changes nothing: parameters
/// are gathered, and gradients reduced, in the parameters' own dtype.
///
/// The shards (what `parameters()` lists and the optimizer steps) keep the dtype the model was
/// built in: they are the master weights. With `param_dtype` set, each shard is cast once per
/// gather to `param_dtype` *before* the all-gather (so the collective moves `param_dtype`
/// bytes) and the module computes with `param_dtype` tensors; the gradients, of
/// `param_dtype`, are cast to `reduce_dtype` for the reduce-scatter (the sum and the division
/// by the world happen there), and the averaged rows are cast to the shard's dtype into its
/// `.grad`.
///
/// Today's CPU dtypes make float64 masters with float32 compute the testable pair; bfloat16
/// and float16 join with the low-precision work.
///
/// ```
/// use tensorplay::{self as tp, DType};
/// use tp::distributed::fsdp::{FsdpOptions, MixedPrecisionPolicy};
///
/// let opts = FsdpOptions {
///     mp_policy: MixedPrecisionPolicy {
///         param_dtype: Some(DType::F32),  // gather and compute in float32
///         reduce_dtype: Some(DType::F64), // sum the gradients in float64
///         ..Default::default()
///     },
///     ..Default::default()
/// };
/// assert!(opts.mp_policy.cast_forward_inputs);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixedPrecisionPolicy {
    /// The dtype of the gathered (unsharded) parameters, which the module computes with;
    /// `None`: the parameters' own dtype. A floating dtype.
    pub param_dtype: Option<DType>,
    /// The dtype the gradients are reduce-scattered in; `None`: `param_dtype` (or the
    /// parameters' own dtype). A floating dtype.
    pub reduce_dtype: Option<DType>,
    /// The dtype the module's floating output is cast to after its forward; `None`: left as
    /// computed. A floating dtype. Set it on the root's call: an inner block's output cast
    /// back would reach the root's own layers (which compute in `param_dtype`) in the wrong
    /// dtype, since only a fully sharded module's own input is cast.
    pub output_dtype: Option<DType>,
    /// Cast the module's floating input to `param_dtype` before its forward (default true;
    /// nothing when `param_dtype` is `None`). Integer inputs (token ids) are never cast.
    pub cast_forward_inputs: bool,
}

impl Default for MixedPrecisionPolicy {
    fn default() -> Self {
        MixedPrecisionPolicy {
            param_dtype: None,
            reduce_dtype: None,
            output_dtype: None,
            cast_forward_inputs: true,
        }
    }
}

impl MixedPrecisionPolicy {
    /// The first field holding a dtype that is not floating point: `(field, dtype)`.
    pub(crate) fn non_float(&self) -> Option<(&'static str, DType)> {
        [
            ("mp_policy.param_dtype", self.param_dtype),
            ("mp_policy.reduce_dtype", self.reduce_dtype),
            ("mp_policy.output_dtype", self.output_dtype),
        ]
        .into_iter()
        .find_map(|(f, d)| d.filter(|d| !d.is_float()).map(|d| (f, d)))
    }

    /// `input` as the module's forward takes it: cast to `param_dtype` when asked for and
    /// floating (`None`: unchanged).
    pub(crate) fn cast_input(&self, input: &Tensor) -> Result<Option<Tensor>> {
        match self.param_dtype {
            Some(d) if self.cast_forward_inputs && cast_wanted(input, d) => {
                Ok(Some(input.to_dtype(d)?))
            }
            _ => Ok(None),
        }
    }

    /// The module's `output` as its caller gets it: cast to `output_dtype` when set and
    /// floating (`None`: unchanged).
    pub(crate) fn cast_output(&self, output: &Tensor) -> Result<Option<Tensor>> {
        match self.output_dtype {
            Some(d) if cast_wanted(output, d) => Ok(Some(output.to_dtype(d)?)),
            _ => Ok(None),
        }
    }
}

fn cast_wanted(t: &Tensor, to: DType) -> bool {
    t.dtype().is_float() && t.dtype() != to
}
