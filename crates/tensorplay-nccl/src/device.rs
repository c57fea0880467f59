//! Device buffers as NCCL takes them: the pointer, count and NCCL dtype of a contiguous CUDA
//! tensor, the NCCL op for a reduction, and which GPU a rank uses.

use cudarc::driver::{CudaStream, DevicePtr};
use tensorplay_collectives::{Error, ReduceOp, Result};
use tensorplay_core::cuda::CudaData;
use tensorplay_core::{DType, Storage, Tensor};

use crate::ffi::{dtype, redop};

/// The device memory of one contiguous CUDA tensor, as NCCL takes it.
#[derive(Clone, Copy)]
pub(crate) struct Dev {
    pub(crate) ptr: u64,
    pub(crate) count: usize,
    pub(crate) dtype: i32,
    pub(crate) bytes: usize,
}

impl Dev {
    /// Consecutive blocks of `counts` elements (the per-rank parts of an all-to-all).
    pub(crate) fn blocks(&self, counts: &[usize]) -> Vec<Dev> {
        let size = self.bytes.checked_div(self.count).unwrap_or(0);
        let mut off = 0;
        counts
            .iter()
            .map(|&n| {
                let b = Dev {
                    ptr: self.ptr + (off * size) as u64,
                    count: n,
                    dtype: self.dtype,
                    bytes: n * size,
                };
                off += n;
                b
            })
            .collect()
    }

    pub(crate) fn buf(&self) -> *const std::ffi::c_void {
        self.ptr as *const std::ffi::c_void
    }
    pub(crate) fn buf_mut(&self) -> *mut std::ffi::c_void {
        self.ptr as *mut std::ffi::c_void
    }
}

pub(crate) fn bad(detail: impl Into<String>) -> Error {
    Error::Backend {
        backend: "nccl".into(),
        detail: tensorplay_collectives::Detail::from(detail.into()),
    }
}

/// The device pointer of `t` (contiguous, on this GPU), after the work that produced it.
pub(crate) fn dev(t: &Tensor, stream: &CudaStream) -> Result<Dev> {
    let r = if t.numel() == 0 {
        0..0
    } else {
        t.layout()
            .contiguous_range()
            .ok_or_else(|| bad("a strided tensor reached the backend"))?
    };
    t.with_storage(|st, _| {
        let Storage::Cuda(c) = st else {
            return Err(bad(format!(
                "expected a CUDA tensor, got one on {}",
                t.device()
            )));
        };
        // the data's producer runs on the tensor's own stream: wait for it
        c.stream()
            .synchronize()
            .map_err(|e| bad(format!("synchronizing the tensor's stream failed: {e:?}")))?;
        // the guards cudarc returns record the access on `stream` when dropped; every call
        // waits for its work before returning, so dropping them here orders nothing wrongly
        let (base, size, dt) = match c.data() {
            CudaData::F32(s) => (s.device_ptr(stream).0, 4, nccl_dtype(DType::F32)),
            CudaData::F64(s) => (s.device_ptr(stream).0, 8, nccl_dtype(DType::F64)),
            CudaData::I64(s) => (s.device_ptr(stream).0, 8, nccl_dtype(DType::I64)),
            CudaData::Bool(s) => (s.device_ptr(stream).0, 1, nccl_dtype(DType::Bool)),
            CudaData::BF16(s) => (s.device_ptr(stream).0, 2, nccl_dtype(DType::BF16)),
            CudaData::F16(s) => (s.device_ptr(stream).0, 2, nccl_dtype(DType::F16)),
        };
        Ok(Dev {
            ptr: base + (r.start * size) as u64,
            count: r.len(),
            dtype: dt,
            bytes: r.len() * size,
        })
    })
}

/// The NCCL element type of `dt` (bool as uint8). NCCL reduces bfloat16 and float16 in
/// their own type (each step of its ring or tree rounds), unlike the cpu backend, which
/// sums 16-bit inputs in float32 and rounds once (docs/collectives.md).
pub(crate) fn nccl_dtype(dt: DType) -> i32 {
    match dt {
        DType::F32 => dtype::FLOAT32,
        DType::F64 => dtype::FLOAT64,
        DType::I64 => dtype::INT64,
        DType::Bool => dtype::UINT8,
        DType::BF16 => dtype::BFLOAT16,
        DType::F16 => dtype::FLOAT16,
    }
}

/// The NCCL op for `op` on `dt` (bool reduces as uint8: Sum is Max, Product is Min, as in
/// PyTorch).
pub(crate) fn nccl_op(op: ReduceOp, dt: DType) -> Result<i32> {
    Ok(match (op, dt) {
        (ReduceOp::Sum, DType::Bool) | (ReduceOp::Max, _) => redop::MAX,
        (ReduceOp::Product, DType::Bool) | (ReduceOp::Min, _) => redop::MIN,
        (ReduceOp::Sum, _) => redop::SUM,
        (ReduceOp::Product, _) => redop::PROD,
        (ReduceOp::Avg, _) => redop::AVG,
        (other, _) => return Err(bad(format!("{other:?} is not an NCCL reduction"))),
    })
}

/// The GPU a rank uses, or why it cannot have one: NCCL needs one GPU per process.
pub fn device_for(rank: usize, local_rank: usize, gpus: usize) -> Result<usize> {
    if local_rank >= gpus {
        return Err(bad(format!(
            "NCCL needs one GPU per process: rank {rank} (local rank {local_rank}) wants \
             cuda:{local_rank}, but this machine has {gpus} GPU(s); run at most {gpus} \
             process(es) per machine, or use the \"cpu\" backend"
        )));
    }
    Ok(local_rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_has_its_nccl_type() {
        // (dtype, ncclDataType_t value from nccl.h)
        let cases = [
            (DType::F32, 7),
            (DType::F64, 8),
            (DType::I64, 4),
            (DType::Bool, 1),
            (DType::BF16, 9),
            (DType::F16, 6),
        ];
        assert_eq!(cases.len(), DType::ALL.len(), "a case per dtype");
        for (dt, want) in cases {
            assert_eq!(nccl_dtype(dt), want, "{dt}");
        }
    }
}
