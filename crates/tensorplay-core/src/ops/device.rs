//! Moving tensors between devices (`Tensor::to`).

use crate::autograd::{Context, Function, apply};
use crate::cuda::CudaStorage;
use crate::storage::Storage;
use crate::{Device, IntoDevice, Result, Tensor};

struct ToDevice {
    from: Device,
    to: Device,
}

impl Function for ToDevice {
    fn name(&self) -> &str {
        "ToCopyBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let x = inputs[0];
        // a contiguous host copy first
        let host = if x.device().is_cuda() {
            x.contiguous_storage_copy()?
        } else {
            x.contiguous()?
        };
        let storage = {
            let guard = host.0.storage.read();
            let Storage::Cpu(cpu) = &*guard else {
                return Err(crate::Error::NotSupported {
                    op: "to",
                    detail: "from a non-host staging copy".into(),
                });
            };
            let range = host
                .layout()
                .contiguous_range()
                .unwrap_or_else(|| 0..host.numel());
            let cpu = slice_cpu(cpu, range);
            match self.to {
                Device::Cpu => Storage::Cpu(cpu),
                Device::Cuda(i) => Storage::Cuda(CudaStorage::from_cpu(&cpu, i)?),
                Device::Meta => Storage::Meta(crate::storage::MetaStorage {
                    dtype: cpu.dtype(),
                    len: cpu.len(),
                }),
            }
        };
        Ok(vec![Tensor::from_storage(storage, x.shape())])
    }
    fn backward(&self, _ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g[0].to_device(self.from)?)])
    }
}

fn slice_cpu(c: &crate::CpuStorage, r: std::ops::Range<usize>) -> crate::CpuStorage {
    use crate::CpuStorage as C;
    match c {
        C::F32(v) => C::F32(v[r].to_vec()),
        C::F64(v) => C::F64(v[r].to_vec()),
        C::I64(v) => C::I64(v[r].to_vec()),
        C::Bool(v) => C::Bool(v[r].to_vec()),
        C::BF16(v) => C::BF16(v[r].to_vec()),
        C::F16(v) => C::F16(v[r].to_vec()),
    }
}

impl Tensor {
    /// Copies a CUDA tensor's elements to a contiguous host tensor.
    fn contiguous_storage_copy(&self) -> Result<Tensor> {
        let guard = self.0.storage.read();
        let Storage::Cuda(c) = &*guard else {
            drop(guard);
            return self.contiguous();
        };
        let cpu = c.to_cpu()?;
        drop(guard);
        let flat = Tensor::from_storage(Storage::Cpu(cpu), &[self.0.storage.read_len()]);
        flat.view_with_layout(self.layout().clone()).contiguous()
    }

    /// Moves to `device` (`tensor.to("cuda:0")`): a copy when the device differs, the same
    /// handle otherwise. Differentiable: the gradient moves back. Accepts a [`Device`] or a
    /// string such as `"cpu"`, `"cuda"`, `"cuda:1"`.
    ///
    /// To `"meta"`, the result is a tensor of the same shape and dtype without elements and
    /// without history.
    ///
    /// Errors: [`crate::Error::InvalidDevice`] for a bad string,
    /// [`crate::Error::CudaUnavailable`] when CUDA is asked for but there is no driver or no
    /// such device, [`crate::Error::MetaTensor`] from the meta device (there are no values
    /// to move: see [`Tensor::empty_like_on`]).
    pub fn to(&self, device: impl IntoDevice) -> Result<Tensor> {
        self.to_device(device.into_device()?)
    }

    /// [`Tensor::to`] with a [`Device`].
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        if self.device().is_meta() {
            return Err(crate::Error::MetaTensor { op: "to" });
        }
        if device.is_meta() {
            // no values to copy, so no history either (PyTorch's `.to("meta")` keeps none
            // that could ever run)
            return Tensor::empty(self.shape(), (self.dtype(), Device::Meta));
        }
        Ok(apply(
            ToDevice {
                from: self.device(),
                to: device,
            },
            &[self],
        )?
        .remove(0))
    }

    /// Moves to the CPU.
    pub fn cpu(&self) -> Result<Tensor> {
        self.to_device(Device::Cpu)
    }

    /// Moves to CUDA device `ordinal`.
    pub fn cuda(&self, ordinal: usize) -> Result<Tensor> {
        self.to_device(Device::Cuda(ordinal))
    }
}
