//! Creation functions: zeros, ones, full, arange, rand, randn, randint.

use crate::random::default_generator;
use crate::storage::CpuStorage;
use crate::{DType, Device, Error, Result, Tensor};

/// Dtype and device of a new tensor (`dtype=`, `device=` keyword arguments).
///
/// Converts from a [`DType`], a [`Device`], or a `(DType, Device)` pair; the default is
/// float32 on the CPU.
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
            device: Device::Cpu,
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

fn place(t: Tensor, device: Device) -> Result<Tensor> {
    if device == Device::Cpu {
        Ok(t)
    } else {
        t.to_device(device)
    }
}

impl Tensor {
    /// A tensor of `shape` filled with `value` (converted to the dtype).
    pub fn full(shape: &[usize], value: f64, options: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = options.into();
        let n = shape.iter().product();
        let s = match o.dtype {
            DType::F32 => CpuStorage::F32(vec![value as f32; n]),
            DType::F64 => CpuStorage::F64(vec![value; n]),
            DType::I64 => CpuStorage::I64(vec![value as i64; n]),
            DType::Bool => CpuStorage::Bool(vec![value != 0.0; n]),
        };
        place(Tensor::from_cpu(s, shape), o.device)
    }
    /// Zeros of `shape`.
    pub fn zeros(shape: &[usize], options: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = options.into();
        let n = shape.iter().product();
        place(
            Tensor::from_cpu(CpuStorage::zeros(o.dtype, n), shape),
            o.device,
        )
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
    /// `step` is 0 or has the wrong sign.
    pub fn arange(
        start: f64,
        end: f64,
        step: f64,
        options: impl Into<TensorOptions>,
    ) -> Result<Tensor> {
        let o = options.into();
        if step == 0.0 || !step.is_finite() || (end - start) * step < 0.0 {
            return Err(Error::invalid(
                "arange",
                "step",
                "a non-zero finite step pointing from start to end",
                format!("start={start}, end={end}, step={step}"),
            ));
        }
        let n = ((end - start) / step).ceil().max(0.0) as usize;
        let v: Vec<f64> = (0..n).map(|i| start + i as f64 * step).collect();
        Tensor::from_vec(v, &[n])?
            .to_dtype(o.dtype)?
            .to_device(o.device)
    }

    /// Uniform samples in `[0, 1)` from the default generator (`torch.rand`).
    pub fn rand(shape: &[usize], options: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = options.into();
        let n: usize = shape.iter().product();
        let v: Vec<f64> = {
            let mut g = default_generator();
            (0..n).map(|_| g.uniform()).collect()
        };
        float_from_f64("rand", v, shape, o)
    }
    /// Standard normal samples from the default generator (`torch.randn`).
    pub fn randn(shape: &[usize], options: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = options.into();
        let n: usize = shape.iter().product();
        let v: Vec<f64> = {
            let mut g = default_generator();
            (0..n).map(|_| g.normal()).collect()
        };
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
        let n: usize = shape.iter().product();
        let v: Vec<i64> = {
            let mut g = default_generator();
            (0..n).map(|_| g.int_range(low, high)).collect()
        };
        place(Tensor::from_vec(v, shape)?, device)
    }
}

fn float_from_f64(
    op: &'static str,
    v: Vec<f64>,
    shape: &[usize],
    o: TensorOptions,
) -> Result<Tensor> {
    let t = match o.dtype {
        DType::F64 => Tensor::from_vec(v, shape)?,
        DType::F32 => Tensor::from_vec(v.into_iter().map(|x| x as f32).collect(), shape)?,
        d => {
            return Err(Error::UnsupportedDType {
                op,
                dtype: d,
                expected: "float32 or float64",
            });
        }
    };
    place(t, o.device)
}

/// Float32 zeros of `shape` on the CPU (`torch.zeros`).
pub fn zeros(shape: &[usize]) -> Result<Tensor> {
    Tensor::zeros(shape, DType::F32)
}
/// Float32 ones of `shape` on the CPU (`torch.ones`).
pub fn ones(shape: &[usize]) -> Result<Tensor> {
    Tensor::ones(shape, DType::F32)
}
/// Float32 `value` of `shape` on the CPU (`torch.full`).
pub fn full(shape: &[usize], value: f64) -> Result<Tensor> {
    Tensor::full(shape, value, DType::F32)
}
/// Float32 `[start, end)` with `step` on the CPU (`torch.arange`).
pub fn arange(start: f64, end: f64, step: f64) -> Result<Tensor> {
    Tensor::arange(start, end, step, DType::F32)
}
/// Float32 uniform samples in `[0, 1)` on the CPU (`torch.rand`).
pub fn rand(shape: &[usize]) -> Result<Tensor> {
    Tensor::rand(shape, DType::F32)
}
/// Float32 standard normal samples on the CPU (`torch.randn`).
pub fn randn(shape: &[usize]) -> Result<Tensor> {
    Tensor::randn(shape, DType::F32)
}
/// Int64 uniform integers in `[low, high)` on the CPU (`torch.randint`).
pub fn randint(low: i64, high: i64, shape: &[usize]) -> Result<Tensor> {
    Tensor::randint(low, high, shape, Device::Cpu)
}
