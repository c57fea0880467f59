//! The CUDA implementation of the backend contract ([`DeviceStorage`]): every operation is a
//! plan from `plan.rs` launched on the device's stream, or a cuBLAS GEMM.

use std::sync::Arc;

use cudarc::driver::DevicePtr;

use super::plan::{self, ReduceShape};
use super::real::{CudaData, CudaStorage};
use super::runtime::{Runtime, runtime};
use crate::backend::{
    AdamStep, BinaryCode, CmpCode, DeviceStorage, IndexKind, ReduceCode, SgdStep, UnaryCode,
};
use crate::{DType, Error, Layout, Result};

impl CudaStorage {
    /// The device address of the first element.
    pub(crate) fn ptr(&self) -> u64 {
        let s = self.stream();
        match self.data() {
            CudaData::F32(d) => d.device_ptr(s).0,
            CudaData::F64(d) => d.device_ptr(s).0,
            CudaData::I64(d) => d.device_ptr(s).0,
            CudaData::Bool(d) => d.device_ptr(s).0,
            CudaData::BF16(d) => d.device_ptr(s).0,
            CudaData::F16(d) => d.device_ptr(s).0,
        }
    }

    fn rt(&self) -> Result<Arc<Runtime>> {
        runtime(&super::real::context(self.ordinal())?, self.ordinal())
    }

    /// Uninitialised storage of `n` elements of `dtype` on this device, for kernels that
    /// write all of it.
    fn alloc(&self, dtype: DType, n: usize) -> Result<CudaStorage> {
        CudaStorage::uninit(dtype, n, self.ordinal())
    }

    fn same_device(&self, other: &CudaStorage, op: &'static str) -> Result<()> {
        if self.ordinal() != other.ordinal() {
            return Err(Error::DeviceMismatch {
                op,
                lhs: self.device(),
                rhs: other.device(),
            });
        }
        Ok(())
    }

    /// [`DeviceStorage::copy_as`] by way of host memory (for views the kernels cannot index).
    fn copy_through_host(&self, l: &Layout, to: DType) -> Result<CudaStorage> {
        let host = crate::Tensor::from_storage(crate::Storage::Cpu(self.to_cpu()?), &[self.len()]);
        let v = host
            .view_with_layout(l.clone())
            .to_dtype(to)?
            .deep_clone()?;
        v.with_storage(|s, _| match s {
            crate::Storage::Cpu(c) => CudaStorage::from_cpu(c, self.ordinal()),
            crate::Storage::Cuda(c) => c.copy_as(&Layout::contiguous(&[c.len()]), to),
            crate::Storage::Meta(_) => Err(Error::MetaTensor { op: "copy_as" }),
        })
    }

    /// Refuses all but the float dtypes (with `half`, the 16-bit ones too).
    fn need_float(&self, op: &'static str, half: bool) -> Result<()> {
        match self.dtype() {
            DType::F32 | DType::F64 => Ok(()),
            DType::BF16 | DType::F16 if half => Ok(()),
            d @ (DType::I64 | DType::Bool | DType::BF16 | DType::F16) => {
                Err(Error::UnsupportedDType {
                    op,
                    dtype: d,
                    expected: if half {
                        "float32, float64, bfloat16 or float16"
                    } else {
                        "float32 or float64 (optimizers keep float32 masters of 16-bit \
                         parameters)"
                    },
                })
            }
        }
    }
}

impl DeviceStorage for CudaStorage {
    fn unary(&self, l: &Layout, op: UnaryCode, scalar: f64) -> Result<Self> {
        let rt = self.rt()?;
        let out = self.alloc(self.dtype(), l.numel())?;
        rt.launch(&plan::unary(
            self.dtype(),
            out.ptr(),
            self.ptr(),
            l,
            op,
            scalar,
            "unary",
        )?)?;
        Ok(out)
    }

    fn binary(&self, l: &Layout, rhs: &Self, rl: &Layout, op: BinaryCode) -> Result<Self> {
        self.same_device(rhs, "binary")?;
        let rt = self.rt()?;
        let out = self.alloc(self.dtype(), l.numel())?;
        rt.launch(&plan::binary(
            self.dtype(),
            out.ptr(),
            (self.ptr(), l),
            (rhs.ptr(), rl),
            op,
            "binary",
        )?)?;
        Ok(out)
    }

    fn compare(
        &self,
        l: &Layout,
        rhs: Option<(&Self, &Layout)>,
        op: CmpCode,
        scalar: f64,
    ) -> Result<Self> {
        let rt = self.rt()?;
        let out = self.alloc(DType::Bool, l.numel())?;
        let b = match rhs {
            Some((r, rl)) => {
                self.same_device(r, "compare")?;
                Some((r.ptr(), rl))
            }
            None => None,
        };
        rt.launch(&plan::compare(
            self.dtype(),
            out.ptr(),
            (self.ptr(), l),
            b,
            op,
            scalar,
            "compare",
        )?)?;
        Ok(out)
    }

    fn select(
        &self,
        l: &Layout,
        (a, la): (&Self, &Layout),
        (b, lb): (&Self, &Layout),
    ) -> Result<Self> {
        self.same_device(a, "where")?;
        self.same_device(b, "where")?;
        let rt = self.rt()?;
        let out = self.alloc(a.dtype(), la.numel())?;
        rt.launch(&plan::select(
            a.dtype(),
            out.ptr(),
            (self.ptr(), l),
            (a.ptr(), la),
            (b.ptr(), lb),
        )?)?;
        Ok(out)
    }

    fn copy_as(&self, l: &Layout, to: DType) -> Result<Self> {
        let rt = self.rt()?;
        let n = l.numel();
        let out = self.alloc(to, n)?;
        let lo = Layout::contiguous(l.shape());
        match plan::copy((self.dtype(), self.ptr(), l), (to, out.ptr(), &lo), "copy") {
            Ok(launch) => rt.launch(&launch)?,
            // a view of more dims than the kernels take goes through the host
            Err(Error::NotSupported { .. }) => return self.copy_through_host(l, to),
            Err(e) => return Err(e),
        }
        Ok(out)
    }

    fn write(&mut self, l: &Layout, src: &Self, sl: &Layout) -> Result<()> {
        self.same_device(src, "copy_")?;
        let rt = self.rt()?;
        rt.launch(&plan::copy(
            (src.dtype(), src.ptr(), sl),
            (self.dtype(), self.ptr(), l),
            "copy_",
        )?)
    }

    fn reduce(
        &self,
        l: &Layout,
        dims: &[usize],
        op: ReduceCode,
        with_index: bool,
    ) -> Result<(Self, Option<Self>)> {
        let rt = self.rt()?;
        let dt = self.dtype();
        let shape = ReduceShape::new(l, dims);
        let (m, k) = (shape.m(), shape.k());
        let split = plan::reduce_split(m, k);
        let with_index = with_index && op != ReduceCode::Sum;
        let out = self.alloc(dt, m)?;
        let idx = if with_index {
            Some(self.alloc(DType::I64, m)?)
        } else {
            None
        };
        let (scratch, scratch_idx) = if split.0 > 1 {
            let s = self.alloc(plan::reduce_scratch(dt), m * split.0)?;
            let si = if with_index {
                Some(self.alloc(DType::I64, m * split.0)?)
            } else {
                None
            };
            (Some(s), si)
        } else {
            (None, None)
        };
        let p = |s: &Option<CudaStorage>| s.as_ref().map_or(0, CudaStorage::ptr);
        for launch in plan::reduce(
            dt,
            self.ptr(),
            &shape,
            op,
            (out.ptr(), p(&idx)),
            (p(&scratch), p(&scratch_idx)),
            split,
            "reduce",
        )? {
            rt.launch(&launch)?;
        }
        // the scratch buffers are freed on the stream, after the launches that use them
        drop((scratch, scratch_idx));
        Ok((out, idx))
    }

    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, batch: usize) -> Result<Self> {
        self.same_device(rhs, "matmul")?;
        self.need_float("matmul", true)?;
        let rt = self.rt()?;
        let (m, n) = (l.shape()[1], rl.shape()[2]);
        // operands cuBLAS cannot read in place are copied contiguous first
        let (a_copy, b_copy);
        let (mut a, mut la, mut b, mut lb) = (self, l.clone(), rhs, rl.clone());
        let g = match plan::gemm(&la, &lb, batch) {
            Some(g) => g,
            None => {
                a_copy = self.copy_as(l, self.dtype())?;
                b_copy = rhs.copy_as(rl, rhs.dtype())?;
                (a, la, b, lb) = (
                    &a_copy,
                    Layout::contiguous(l.shape()),
                    &b_copy,
                    Layout::contiguous(rl.shape()),
                );
                plan::gemm(&la, &lb, batch).ok_or_else(|| Error::NotSupported {
                    op: "matmul",
                    detail: format!(
                        "on CUDA with sizes beyond cuBLAS's 32-bit ints ({:?} @ {:?})",
                        la.shape(),
                        lb.shape()
                    ),
                })?
            }
        };
        if g.k == 0 || batch * m * n == 0 {
            // an empty inner dimension gives zeros
            return CudaStorage::zeros(self.dtype(), batch * m * n, self.ordinal());
        }
        let out = self.alloc(self.dtype(), batch * m * n)?;
        // SAFETY: the plan's offsets, leading dimensions and strides stay inside the operands'
        // views (checked by the emulator's gemm tests); `out` holds batch * m * n elements.
        unsafe { rt.gemm(&g, self.dtype(), b.ptr(), a.ptr(), out.ptr()) }?;
        Ok(out)
    }

    fn index(
        &self,
        kind: IndexKind,
        idx: &Self,
        dims: (usize, usize, usize, usize),
    ) -> Result<Self> {
        self.same_device(idx, "index")?;
        let rt = self.rt()?;
        let (outer, _, count, inner) = dims;
        let out = self.alloc(self.dtype(), outer * count * inner)?;
        let name = match kind {
            IndexKind::Select => "index_select",
            IndexKind::Gather => "gather",
        };
        rt.launch(&plan::index(
            name,
            self.dtype(),
            (out.ptr(), self.ptr(), idx.ptr()),
            dims,
        ))?;
        Ok(out)
    }

    fn scatter_add(
        &mut self,
        idx: &Self,
        src: &Self,
        dims: (usize, usize, usize, usize),
    ) -> Result<()> {
        self.same_device(idx, "scatter_add")?;
        self.same_device(src, "scatter_add")?;
        if self.dtype() == DType::Bool {
            return Err(Error::UnsupportedDType {
                op: "scatter_add",
                dtype: DType::Bool,
                expected: "float32, float64 or int64",
            });
        }
        let rt = self.rt()?;
        rt.launch(&plan::index(
            "scatter_add",
            self.dtype(),
            (self.ptr(), src.ptr(), idx.ptr()),
            dims,
        ))
    }

    fn cross_entropy(&self, target: &Self, rows: usize, classes: usize) -> Result<(Self, Self)> {
        self.same_device(target, "cross_entropy")?;
        self.need_float("cross_entropy", true)?;
        let rt = self.rt()?;
        let loss = self.alloc(self.dtype(), rows)?;
        let probs = self.alloc(self.dtype(), rows * classes)?;
        rt.launch(&plan::cross_entropy(
            self.dtype(),
            (loss.ptr(), probs.ptr(), self.ptr(), target.ptr()),
            rows,
            classes,
        ))?;
        Ok((loss, probs))
    }

    fn dropout_mask(&self, n: usize, seed: u64, offset: u64, p: f64) -> Result<Self> {
        let rt = self.rt()?;
        let mask = self.alloc(DType::Bool, n)?;
        rt.launch(&plan::dropout_mask(mask.ptr(), n, seed, offset, p))?;
        Ok(mask)
    }

    fn sgd_step(
        &mut self,
        n: usize,
        grad: &Self,
        buf: Option<&mut Self>,
        h: &SgdStep,
    ) -> Result<()> {
        self.same_device(grad, "SGD.step")?;
        self.need_float("SGD.step", false)?;
        let rt = self.rt()?;
        let p = plan::params::Sgd {
            param: self.ptr(),
            grad: grad.ptr(),
            momentum_buf: buf.map_or(0, |b| b.ptr()),
            n: n as i64,
            first: i64::from(h.first),
            nesterov: i64::from(h.nesterov),
            lr: h.lr,
            momentum: h.momentum,
            dampening: h.dampening,
            weight_decay: h.weight_decay,
        };
        rt.launch(&plan::sgd(self.dtype(), p))
    }

    fn adam_step(
        &mut self,
        n: usize,
        grad: &Self,
        m: &mut Self,
        v: &mut Self,
        vmax: Option<&mut Self>,
        h: &AdamStep,
    ) -> Result<()> {
        self.same_device(grad, "Adam.step")?;
        self.need_float("Adam.step", false)?;
        let rt = self.rt()?;
        let p = plan::params::Adam {
            param: self.ptr(),
            grad: grad.ptr(),
            exp_avg: m.ptr(),
            exp_avg_sq: v.ptr(),
            max_exp_avg_sq: vmax.map_or(0, |b| b.ptr()),
            n: n as i64,
            decoupled: i64::from(h.decoupled),
            beta1: h.beta1,
            beta2: h.beta2,
            eps: h.eps,
            weight_decay: h.weight_decay,
            decay: h.decay,
            step_size: h.step_size,
            bias_c2_sqrt: h.bias_c2_sqrt,
        };
        rt.launch(&plan::adam(self.dtype(), p))
    }

    fn zeros_like_device(&self, dtype: DType, n: usize) -> Result<Self> {
        CudaStorage::zeros(dtype, n, self.ordinal())
    }

    fn upload(&self, data: &crate::CpuStorage) -> Result<Self> {
        CudaStorage::from_cpu(data, self.ordinal())
    }
}
