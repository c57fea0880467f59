//! [`autocast`]: regions where the operations that gain from low precision run in bfloat16 or
//! float16 and the ones that need range or accumulation run in float32, over float32
//! weights (PyTorch's `torch.autocast`).
//!
//! The policy, per operation (PyTorch's, for the operations tensorplay has):
//! - **low precision** (floating inputs other than float64 are cast to the autocast dtype):
//!   `matmul`, `mm`, `linear`, `scaled_dot_product_attention`;
//! - **float32** (16-bit inputs are cast to float32): `softmax`, `log_softmax`, `layer_norm`,
//!   `exp`, `log`, `pow`, `sum`, `mean`, and the losses (`cross_entropy`, `mse_loss`);
//! - everything else runs in its inputs' dtype, and elementwise operations with mixed inputs
//!   promote to the widest (type promotion, as outside autocast).
//!
//! The state is per thread, like PyTorch's. Backward runs with autocast off: each gradient
//! takes its forward's dtype (the casts' backward casts gradients back to float32 for the
//! weights). A leaf that requires grad (a weight) is cast once per outermost region and the
//! cast reused by every operation in it (PyTorch's cast cache), so its gradient flows through
//! one cast.

use std::cell::RefCell;
use std::collections::HashMap;

use crate::{DType, Device, Error, IntoDevice, Result, Tensor, TensorId};

/// The device kinds autocast keeps a state for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Cpu,
    Cuda,
}

impl Kind {
    fn of(device: Device) -> Option<Kind> {
        match device {
            Device::Cpu => Some(Kind::Cpu),
            Device::Cuda(_) => Some(Kind::Cuda),
            Device::Meta => None,
        }
    }
    /// PyTorch's default low dtype: bfloat16 on the CPU, float16 on CUDA.
    fn default_dtype(self) -> DType {
        match self {
            Kind::Cpu => DType::BF16,
            Kind::Cuda => DType::F16,
        }
    }
}

/// One device kind's state: whether autocast is on, its dtype, and whether the cast cache is
/// used.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Region {
    enabled: bool,
    dtype: DType,
    cache: bool,
}

/// What one guard changed: its kind, the region it replaced, and whether it enabled autocast.
struct Frame {
    kind: Kind,
    previous: Option<Region>,
    enabled: bool,
}

#[derive(Default)]
struct State {
    /// The current region of each kind (absent: off, default dtype).
    regions: HashMap<Kind, Region>,
    /// The live guards' changes, oldest first; a guard is its index here.
    frames: Vec<Frame>,
    /// Casts of leaves that require grad, by (leaf, dtype), with the leaf's version when cast
    /// (an in-place change of the leaf makes the entry stale).
    cache: HashMap<(TensorId, DType), (u64, Tensor)>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

/// How [`autocast_with`] sets a region (PyTorch's `torch.autocast` arguments).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AutocastOptions {
    /// The low dtype (`bfloat16` or `float16`); `None`: bfloat16 on the CPU, float16 on CUDA.
    pub dtype: Option<DType>,
    /// Whether autocast is on in the region (`false` turns it off inside an outer region).
    pub enabled: bool,
    /// Whether weights are cast once per region and reused (the cast cache).
    pub cache_enabled: bool,
}

impl Default for AutocastOptions {
    fn default() -> Self {
        AutocastOptions {
            dtype: None,
            enabled: true,
            cache_enabled: true,
        }
    }
}

/// Restores the autocast state as it was before the guard when dropped; the cast cache is
/// emptied when no enabling guard of the thread is left. Dropping a guard also ends the
/// regions opened after it that still live (their guards then change nothing when they drop),
/// so guards dropped out of order cannot leave autocast on. Not `Send`: the state is the
/// thread's.
#[must_use = "autocast lasts while the guard lives"]
pub struct AutocastGuard {
    /// The guard's index in the thread's frames.
    depth: usize,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            while s.frames.len() > self.depth {
                let Some(f) = s.frames.pop() else { break };
                match f.previous {
                    Some(r) => s.regions.insert(f.kind, r),
                    None => s.regions.remove(&f.kind),
                };
            }
            if !s.frames.iter().any(|f| f.enabled) {
                s.cache.clear();
            }
        });
    }
}

/// Turns autocast on for `device`'s kind (`"cpu"` or `"cuda"`; the index of a CUDA device is
/// ignored, as PyTorch's device type is) with `dtype`, until the guard drops
/// (`with torch.autocast(device, dtype)`). Regions nest; the inner one wins while it lives.
///
/// Where CUDA is not available, a CUDA region is disabled with a warning on standard error
/// (once per process), as PyTorch does, so that a script written for a GPU still runs.
///
/// # Errors
/// An unparsable device, the meta device, or a `dtype` other than bfloat16 or float16.
///
/// ```
/// use tensorplay::{self as tp, DType};
/// let x = tp::randn(&[4, 8])?;
/// let w = tp::randn(&[8, 3])?;
/// {
///     let _ac = tp::autocast("cpu", DType::BF16)?;
///     assert_eq!(x.matmul(&w)?.dtype(), DType::BF16); // matmul runs in bfloat16
///     assert_eq!(x.softmax(-1)?.dtype(), DType::F32); // softmax in float32
/// }
/// assert_eq!(x.matmul(&w)?.dtype(), DType::F32);
/// # Ok::<(), tp::Error>(())
/// ```
pub fn autocast(device: impl IntoDevice, dtype: DType) -> Result<AutocastGuard> {
    autocast_with(
        device,
        AutocastOptions {
            dtype: Some(dtype),
            ..Default::default()
        },
    )
}

/// [`autocast`] with every option: `enabled: false` turns autocast off in a region inside
/// an outer one; `dtype: None` takes the device's default (bfloat16 on the CPU, float16 on
/// CUDA).
///
/// # Errors
/// As [`autocast`].
pub fn autocast_with(device: impl IntoDevice, options: AutocastOptions) -> Result<AutocastGuard> {
    let device = device.into_device()?;
    let kind = Kind::of(device).ok_or_else(|| {
        Error::invalid(
            "autocast",
            "device",
            "a CPU or CUDA device",
            format!("{device}"),
        )
    })?;
    let dtype = options.dtype.unwrap_or_else(|| kind.default_dtype());
    let mut enabled = options.enabled;
    if enabled && kind == Kind::Cuda && !crate::cuda::is_available() {
        // PyTorch warns and disables, so that a script written for a GPU still runs
        crate::kernels::warn_once(
            "autocast-cuda",
            "autocast(\"cuda\") was asked for but CUDA is not available: the region is disabled",
        );
        enabled = false;
    }
    if !dtype.is_half() {
        return Err(Error::UnsupportedDType {
            op: "autocast",
            dtype,
            expected: "bfloat16 or float16",
        });
    }
    let region = Region {
        enabled,
        dtype,
        cache: options.cache_enabled,
    };
    Ok(STATE.with(|s| {
        let mut s = s.borrow_mut();
        let previous = s.regions.insert(kind, region);
        s.frames.push(Frame {
            kind,
            previous,
            enabled,
        });
        AutocastGuard {
            depth: s.frames.len() - 1,
            _not_send: std::marker::PhantomData,
        }
    }))
}

/// Whether autocast is on for `device`'s kind on this thread (`torch.is_autocast_enabled`).
/// False for the meta device and for an unparsable device.
pub fn is_autocast_enabled(device: impl IntoDevice) -> bool {
    region(device).is_some_and(|(_, r)| r.enabled)
}

/// The dtype autocast uses for `device`'s kind (`torch.get_autocast_dtype`): the current
/// region's, else the default (bfloat16 on the CPU, float16 on CUDA).
///
/// # Errors
/// An unparsable device or the meta device.
pub fn get_autocast_dtype(device: impl IntoDevice) -> Result<DType> {
    let device = device.into_device()?;
    let kind = Kind::of(device).ok_or_else(|| {
        Error::invalid(
            "get_autocast_dtype",
            "device",
            "a CPU or CUDA device",
            format!("{device}"),
        )
    })?;
    Ok(STATE.with(|s| {
        s.borrow()
            .regions
            .get(&kind)
            .map_or_else(|| kind.default_dtype(), |r| r.dtype)
    }))
}

fn region(device: impl IntoDevice) -> Option<(Kind, Region)> {
    let kind = Kind::of(device.into_device().ok()?)?;
    STATE.with(|s| s.borrow().regions.get(&kind).map(|r| (kind, *r)))
}

/// Other regions until dropped, then the regions as they were: autocast off for backward
/// ([`disabled_for_backward`]), or a checkpointed forward's regions while it is recomputed
/// ([`enter_regions`]).
pub(crate) struct NoAutocast {
    saved: HashMap<Kind, Region>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for NoAutocast {
    fn drop(&mut self) {
        let saved = std::mem::take(&mut self.saved);
        STATE.with(|s| s.borrow_mut().regions = saved);
    }
}

/// Turns autocast off on every device kind until the guard drops, and empties the cast cache:
/// the next forward casts afresh (a second micro-batch's backward must not run through the
/// first's consumed cast, and the optimizer's step after backward changes the weights).
pub(crate) fn disabled_for_backward() -> NoAutocast {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.cache.clear();
        let off = s
            .regions
            .iter()
            .map(|(&k, &r)| {
                (
                    k,
                    Region {
                        enabled: false,
                        ..r
                    },
                )
            })
            .collect();
        NoAutocast {
            saved: std::mem::replace(&mut s.regions, off),
            _not_send: std::marker::PhantomData,
        }
    })
}

/// The cast of `t` to `dtype`, through the cache when `t` is a leaf that requires grad, the
/// region caches and gradients are recorded (a cast made under `no_grad` has no graph and
/// must not serve a later forward that needs one). An entry made before an in-place change
/// of `t` (its version moved) is replaced.
fn cast(t: &Tensor, dtype: DType, cache: bool) -> Result<Tensor> {
    if !(cache && t.is_leaf() && t.requires_grad() && crate::autograd::is_grad_enabled()) {
        return t.to_dtype(dtype);
    }
    let key = (t.id(), dtype);
    let version = t.version();
    let hit = STATE.with(|s| {
        s.borrow()
            .cache
            .get(&key)
            .filter(|(v, _)| *v == version)
            .map(|(_, c)| c.clone())
    });
    if let Some(c) = hit {
        return Ok(c);
    }
    let c = t.to_dtype(dtype)?;
    STATE.with(|s| s.borrow_mut().cache.insert(key, (version, c.clone())));
    Ok(c)
}

/// This thread's autocast regions, as a forward that will be recomputed saw them.
#[derive(Clone, Default)]
pub(crate) struct Regions(HashMap<Kind, Region>);

/// This thread's current autocast regions.
pub(crate) fn current_regions() -> Regions {
    STATE.with(|s| Regions(s.borrow().regions.clone()))
}

/// Sets this thread's regions to `saved` until the guard drops (a checkpoint's recompute, in
/// backward, under its forward's autocast state). Without the cast cache: the recompute runs
/// where no guard of the user's would empty it.
pub(crate) fn enter_regions(saved: &Regions) -> NoAutocast {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let set = saved
            .0
            .iter()
            .map(|(&k, &r)| (k, Region { cache: false, ..r }))
            .collect();
        NoAutocast {
            saved: std::mem::replace(&mut s.regions, set),
            _not_send: std::marker::PhantomData,
        }
    })
}

/// The inputs of a low-precision operation as it runs under autocast: floating inputs other
/// than float64 cast to the region's dtype. `None` when autocast is off for the first
/// input's device or nothing needs a cast.
pub(crate) fn to_lower(inputs: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
    let Some((_, r)) = inputs.first().and_then(|t| region(t.device())) else {
        return Ok(None);
    };
    let eligible = |t: &Tensor| t.dtype().is_float() && t.dtype() != DType::F64;
    if !r.enabled || !inputs.iter().any(|t| eligible(t) && t.dtype() != r.dtype) {
        return Ok(None);
    }
    inputs
        .iter()
        .map(|t| {
            if eligible(t) && t.dtype() != r.dtype {
                cast(t, r.dtype, r.cache)
            } else {
                Ok((*t).clone())
            }
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// The inputs of a float32 operation as it runs under autocast: 16-bit inputs cast to
/// float32. `None` when autocast is off for the first input's device or no input is 16-bit.
pub(crate) fn to_fp32(inputs: &[&Tensor]) -> Result<Option<Vec<Tensor>>> {
    let Some((_, r)) = inputs.first().and_then(|t| region(t.device())) else {
        return Ok(None);
    };
    if !r.enabled || !inputs.iter().any(|t| t.dtype().is_half()) {
        return Ok(None);
    }
    inputs
        .iter()
        .map(|t| {
            if t.dtype().is_half() {
                cast(t, DType::F32, r.cache)
            } else {
                Ok((*t).clone())
            }
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The id of the cast `to_lower` gives `t` (inside a region).
    fn cast_id(t: &Tensor) -> TensorId {
        to_lower(&[t]).unwrap().expect("a float32 input is cast")[0].id()
    }

    #[test]
    fn the_cast_cache_keeps_one_cast_of_a_weight_per_region() {
        let w = Tensor::from_vec(vec![1.0f32, 2.0], &[2])
            .unwrap()
            .requires_grad_(true);
        let x = Tensor::from_vec(vec![3.0f32, 4.0], &[2]).unwrap();
        let first = {
            let _ac = autocast("cpu", DType::BF16).unwrap();
            let a = cast_id(&w);
            assert_eq!(cast_id(&w), a, "a weight: cast once, reused");
            assert_ne!(cast_id(&x), cast_id(&x), "no grad: cast at each use");
            {
                let _inner = autocast("cpu", DType::F16).unwrap();
                assert_ne!(cast_id(&w), a, "another dtype, another cast");
            }
            assert_eq!(cast_id(&w), a, "the outer region's cast again");
            a
        };
        let _ac = autocast("cpu", DType::BF16).unwrap();
        assert_ne!(cast_id(&w), first, "a new region: the cache was emptied");
        let _nc = autocast_with(
            "cpu",
            AutocastOptions {
                dtype: Some(DType::BF16),
                cache_enabled: false,
                ..Default::default()
            },
        )
        .unwrap();
        assert_ne!(cast_id(&w), cast_id(&w), "cache_enabled: false");
    }

    #[test]
    fn guards_dropped_out_of_order_leave_autocast_off() {
        let outer = autocast("cpu", DType::BF16).unwrap();
        let inner = autocast("cpu", DType::F16).unwrap();
        drop(outer);
        assert!(
            !is_autocast_enabled("cpu"),
            "the outer guard ends both regions"
        );
        drop(inner);
        assert!(
            !is_autocast_enabled("cpu"),
            "the inner guard, dropped last, changes nothing"
        );
        assert_eq!(get_autocast_dtype("cpu").unwrap(), DType::BF16);
        STATE.with(|s| assert!(s.borrow().cache.is_empty() && s.borrow().frames.is_empty()));
    }

    /// `w`'s gradient after `y = sum(x @ w)` run under autocast, with the steps `before`
    /// taken in the same region first.
    fn grad_after(before: impl Fn(&Tensor, &Tensor)) -> Vec<f64> {
        let w = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])
            .unwrap()
            .requires_grad_(true);
        let x = Tensor::from_vec(vec![1.0f32, 0.5, -1.0, 2.0], &[2, 2]).unwrap();
        let _ac = autocast("cpu", DType::BF16).unwrap();
        before(&x, &w);
        w.set_grad(None);
        x.matmul(&w).unwrap().sum().unwrap().backward().unwrap();
        w.grad().expect("w has a gradient").to_vec_f64().unwrap()
    }

    #[test]
    fn cached_casts_serve_every_forward_of_a_region() {
        // d sum(x @ w) / dw = column sums of x, on each row of w: [0, 2.5] twice
        let want = vec![0.0, 0.0, 2.5, 2.5];
        type Before = fn(&Tensor, &Tensor);
        let cases: [(&str, Before); 3] = [
            ("nothing before", |_, _| {}),
            ("a forward under no_grad first", |x, w| {
                let _ng = crate::autograd::no_grad();
                x.matmul(w).unwrap();
            }),
            ("a first micro-batch's backward", |x, w| {
                x.matmul(w).unwrap().sum().unwrap().backward().unwrap();
            }),
        ];
        for (case, before) in cases {
            assert_eq!(grad_after(before), want, "{case}");
        }
        // the values, not only the gradient: a weight changed in place is cast again
        let w = Tensor::from_vec(vec![1.0f32, 2.0], &[2, 1])
            .unwrap()
            .requires_grad_(true);
        let x = Tensor::from_vec(vec![1.0f32, 1.0], &[1, 2]).unwrap();
        let _ac = autocast("cpu", DType::BF16).unwrap();
        assert_eq!(x.matmul(&w).unwrap().to_vec_f64().unwrap(), vec![3.0]);
        {
            let _ng = crate::autograd::no_grad();
            w.mul_scalar_(2.0).unwrap();
        }
        assert_eq!(
            x.matmul(&w).unwrap().to_vec_f64().unwrap(),
            vec![6.0],
            "after w *= 2 in the region"
        );
    }
}
