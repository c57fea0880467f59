//! Creation functions: zeros, ones, full, arange, rand, randn, randint.

use crate::layout::checked_numel;
use crate::random::default_generator;
use crate::storage::{CpuStorage, MetaStorage, Storage, try_vec};
use crate::{DType, Device, Error, Result, Tensor};

/// Dtype and device of a new tensor (`dtype=`, `device=` keyword arguments).
///
/// Converts from a [`DType`], a [`Device`], or a `(DType, Device)` pair; the default is
/// float32 on this thread's default device ([`crate::get_default_device`], the CPU unless
/// changed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorOptions {
    /// Element type.
    pub dtype: DType,
    /// Device.
    pub device: Device,
}

impl Default for TensorOptions {
    fn default() -> Self {
        TensorOptions {
            dtype: DType::F32,
            device: crate::get_default_device(),
        }
    }
}
impl From<DType> for TensorOptions {
    fn from(dtype: DType) -> Self {
        TensorOptions {
            dtype,
            ..Default::default()
        }
    }
}
impl From<Device> for TensorOptions {
    fn from(device: Device) -> Self {
        TensorOptions {
            device,
            ..Default::default()
        }
    }
}
impl From<(DType, Device)> for TensorOptions {
    fn from((dtype, device): (DType, Device)) -> Self {
        TensorOptions { dtype, device }
    }
}

/// A tensor of `shape` on the meta device: no memory, no values.
pub(crate) fn meta(op: &'static str, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let len = checked_numel(shape, op)?;
    Ok(Tensor::from_storage(
        Storage::Meta(MetaStorage { dtype, len }),
        shape,
    ))
}

fn place(t: Tensor, device: Device) -> Result<Tensor> {
    if device == Device::Cpu {
        Ok(t)
    } else {
        t.to_device(device)
    }
}

/// Errors when `value` cannot be stored in `dtype` without loss of meaning: NaN, infinite or
/// out-of-range values for int64 (PyTorch refuses these too).
pub(crate) fn check_fill_value(op: &'static str, value: f64, dtype: DType) -> Result<()> {
    // i64::MIN is exactly -2^63, and -(i64::MIN as f64) is 2^63: every f64 in between converts
    // without saturating
    if dtype == DType::I64 && !(value >= i64::MIN as f64 && value < -(i64::MIN as f64)) {
        return Err(Error::invalid(
            op,
            "value",
            "a finite value in the range of int64",
            value,
        ));
    }
    Ok(())
}

/// A CPU tensor of `shape` filled with `value`, then placed on the device; shape overflow and
/// allocation failure are errors naming `op`.
fn filled(op: &'static str, shape: &[usize], value: f64, o: TensorOptions) -> Result<Tensor> {
    check_fill_value(op, value, o.dtype)?;
    if o.device.is_meta() {
        return meta(op, shape, o.dtype);
    }
    let n = checked_numel(shape, op)?;
    let s = match o.dtype {
        DType::F32 => CpuStorage::F32(try_vec(n, value as f32, op, "shape")?),
        DType::F64 => CpuStorage::F64(try_vec(n, value, op, "shape")?),
        DType::I64 => CpuStorage::I64(try_vec(n, value as i64, op, "shape")?),
        DType::Bool => CpuStorage::Bool(try_vec(n, value != 0.0, op, "shape")?),
        DType::BF16 => CpuStorage::BF16(try_vec(
            n,
            <half::bf16 as crate::Element>::from_f64(value),
            op,
            "shape",
        )?),
        DType::F16 => CpuStorage::F16(try_vec(
            n,
            <half::f16 as crate::Element>::from_f64(value),
            op,
            "shape",
        )?),
    };
    place(Tensor::from_cpu(s, shape), o.device)
}

impl Tensor {
    /// A tensor of `shape` filled with `value` (converted to the dtype). Errors when the shape
    /// has more elements than fit in memory, or when `value` is NaN, infinite or out of range
    /// for an int64 tensor.
    pub fn full(shape: &[usize], value: f64, options: impl Into<TensorOptions>) -> Result<Tensor> {
        filled("full", shape, value, options.into())
    }
    /// Zeros of `shape`; errors when the shape has more elements than fit in memory.
    pub fn zeros(shape: &[usize], options: impl Into<TensorOptions>) -> Result<Tensor> {
        filled("zeros", shape, 0.0, options.into())
    }
    /// A tensor of `shape` whose values the caller will overwrite (`torch.empty`): zeros on
    /// the host (PyTorch leaves them unspecified; zeroing costs little next to the page faults
    /// of fresh memory), no memory at all on the meta device. Errors as [`Tensor::zeros`].
    pub fn empty(shape: &[usize], options: impl Into<TensorOptions>) -> Result<Tensor> {
        filled("empty", shape, 0.0, options.into())
    }
    /// [`Tensor::empty`] with this tensor's shape and dtype on `device`
    /// (`torch.empty_like(t, device=device)`): how a tensor built on the meta device gets
    /// memory.
    ///
    /// ```
    /// use tensorplay::{self as tp, DType, Device, Tensor};
    ///
    /// let m = Tensor::zeros(&[2, 3], (DType::F64, Device::Meta))?;
    /// assert!(matches!(m.sum(), Err(tp::Error::MetaTensor { .. })));
    /// let t = m.empty_like_on(Device::Cpu)?;
    /// assert_eq!((t.shape(), t.dtype()), ([2, 3].as_slice(), DType::F64));
    /// # Ok::<(), tp::Error>(())
    /// ```
    pub fn empty_like_on(&self, device: Device) -> Result<Tensor> {
        Tensor::empty(self.shape(), (self.dtype(), device))
    }
    /// Ones of `shape`.
    pub fn ones(shape: &[usize], options: impl Into<TensorOptions>) -> Result<Tensor> {
        Tensor::full(shape, 1.0, options)
    }
    /// Zeros with this tensor's shape, dtype and device.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.shape(), (self.dtype(), self.device()))
    }
    /// Ones with this tensor's shape, dtype and device.
    pub fn ones_like(&self) -> Result<Tensor> {
        Tensor::ones(self.shape(), (self.dtype(), self.device()))
    }
    /// `value` with this tensor's shape, dtype and device.
    pub fn full_like(&self, value: f64) -> Result<Tensor> {
        Tensor::full(self.shape(), value, (self.dtype(), self.device()))
    }

    /// `[start, start + step, ...)` up to `end` exclusive (`torch.arange`); errors when
    /// `start` or `end` is not finite, `step` is 0, not finite or has the wrong sign, or the
    /// range has more elements than fit in memory.
    pub fn arange(
        start: f64,
        end: f64,
        step: f64,
        options: impl Into<TensorOptions>,
    ) -> Result<Tensor> {
        let o = options.into();
        for (arg, v) in [("start", start), ("end", end)] {
            if !v.is_finite() {
                return Err(Error::invalid("arange", arg, "a finite number", v));
            }
        }
        if step == 0.0 || !step.is_finite() || (end - start) * step < 0.0 {
            return Err(Error::invalid(
                "arange",
                "step",
                "a non-zero finite step pointing from start to end",
                format!("start={start}, end={end}, step={step}"),
            ));
        }
        let count = ((end - start) / step).ceil().max(0.0);
        // beyond 2^53 elements consecutive values are no longer distinct f64s
        if count.is_nan() || count >= 9_007_199_254_740_992.0 {
            return Err(Error::invalid(
                "arange",
                "end",
                "a range of fewer than 2^53 elements",
                format!("start={start}, end={end}, step={step}"),
            ));
        }
        let n = count as usize;
        if o.device.is_meta() {
            return meta("arange", &[n], o.dtype);
        }
        let mut v = try_vec(n, 0.0f64, "arange", "end")?;
        for (i, x) in v.iter_mut().enumerate() {
            *x = start + i as f64 * step;
        }
        Tensor::from_vec(v, &[n])?
            .to_dtype(o.dtype)?
            .to_device(o.device)
    }

    /// Uniform samples in `[0, 1)` from the default generator (`torch.rand`); on the meta
    /// device, no samples (the generator does not move).
    pub fn rand(shape: &[usize], options: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = options.into();
        if o.device.is_meta() {
            float_only("rand", o.dtype)?;
            return meta("rand", shape, o.dtype);
        }
        let n = checked_numel(shape, "rand")?;
        let mut v = try_vec(n, 0.0f64, "rand", "shape")?;
        {
            let mut g = default_generator();
            v.iter_mut().for_each(|x| *x = g.uniform());
        }
        float_from_f64("rand", v, shape, o)
    }
    /// Standard normal samples from the default generator (`torch.randn`); on the meta
    /// device, no samples (the generator does not move).
    pub fn randn(shape: &[usize], options: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = options.into();
        if o.device.is_meta() {
            float_only("randn", o.dtype)?;
            return meta("randn", shape, o.dtype);
        }
        let n = checked_numel(shape, "randn")?;
        let mut v = try_vec(n, 0.0f64, "randn", "shape")?;
        {
            let mut g = default_generator();
            v.iter_mut().for_each(|x| *x = g.normal());
        }
        float_from_f64("randn", v, shape, o)
    }
    /// Uniform integers in `[low, high)` as int64 (`torch.randint`); errors when `high <= low`.
    pub fn randint(low: i64, high: i64, shape: &[usize], device: Device) -> Result<Tensor> {
        if high <= low {
            return Err(Error::invalid(
                "randint",
                "high",
                format!("> low ({low})"),
                high,
            ));
        }
        if device.is_meta() {
            return meta("randint", shape, DType::I64);
        }
        let n = checked_numel(shape, "randint")?;
        let mut v = try_vec(n, 0i64, "randint", "shape")?;
        {
            let mut g = default_generator();
            v.iter_mut().for_each(|x| *x = g.int_range(low, high));
        }
        place(Tensor::from_vec(v, shape)?, device)
    }
}

fn float_only(op: &'static str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 => Ok(()),
        d @ (DType::I64 | DType::Bool) => Err(Error::UnsupportedDType {
            op,
            dtype: d,
            expected: "a floating dtype (float32, float64, bfloat16 or float16)",
        }),
    }
}

fn float_from_f64(
    op: &'static str,
    v: Vec<f64>,
    shape: &[usize],
    o: TensorOptions,
) -> Result<Tensor> {
    float_only(op, o.dtype)?;
    let t = match o.dtype {
        DType::F32 => Tensor::from_vec(v.into_iter().map(|x| x as f32).collect(), shape)?,
        // float64, and the 16-bit types rounded once from float64
        d => Tensor::from_vec(v, shape)?.to_dtype(d)?,
    };
    place(t, o.device)
}

/// Float32 zeros of `shape` on the default device (`torch.zeros`).
pub fn zeros(shape: &[usize]) -> Result<Tensor> {
    Tensor::zeros(shape, DType::F32)
}
/// Float32 ones of `shape` on the default device (`torch.ones`).
pub fn ones(shape: &[usize]) -> Result<Tensor> {
    Tensor::ones(shape, DType::F32)
}
/// Float32 `value` of `shape` on the default device (`torch.full`).
pub fn full(shape: &[usize], value: f64) -> Result<Tensor> {
    Tensor::full(shape, value, DType::F32)
}
/// Float32 `[start, end)` with `step` on the default device (`torch.arange`).
pub fn arange(start: f64, end: f64, step: f64) -> Result<Tensor> {
    Tensor::arange(start, end, step, DType::F32)
}
/// Float32 uniform samples in `[0, 1)` on the default device (`torch.rand`).
pub fn rand(shape: &[usize]) -> Result<Tensor> {
    Tensor::rand(shape, DType::F32)
}
/// Float32 standard normal samples on the default device (`torch.randn`).
pub fn randn(shape: &[usize]) -> Result<Tensor> {
    Tensor::randn(shape, DType::F32)
}
/// Int64 uniform integers in `[low, high)` on the default device (`torch.randint`).
pub fn randint(low: i64, high: i64, shape: &[usize]) -> Result<Tensor> {
    Tensor::randint(low, high, shape, Device::Cpu)
}
