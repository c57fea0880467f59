//! `tensorplay-core`: tensors, CPU and CUDA storage, reverse-mode autograd, `nn` layers and
//! optimizers, with PyTorch's semantics and names.
//!
//! ```
//! use tensorplay_core as tp;
//!
//! tp::manual_seed(0);
//! let w = tp::randn(&[3, 2])?.requires_grad_(true);
//! let x = tp::ones(&[4, 3])?;
//! let loss = x.matmul(&w)?.relu()?.sum()?;
//! loss.backward()?;
//! assert_eq!(w.grad().unwrap().shape(), &[3, 2]);
//! # Ok::<(), tp::Error>(())
//! ```
//!
//! Layout of the crate: [`Tensor`] is a shared handle over a [`Storage`] (CPU vectors or CUDA
//! buffers) with a [`Layout`] (shape, strides, offset); operations live in `ops/` and are
//! methods of `Tensor`; [`autograd`] holds the engine and the public [`autograd::Function`]
//! trait that every differentiable op (and every distributed collective of the higher crates)
//! is written with.

// `#[derive(Module)]` names this crate `::tensorplay_core`, inside it too
extern crate self as tensorplay_core;

pub mod amp;
pub mod autograd;
mod backend;
pub mod bytes;
pub mod cuda;
mod device;
mod dtype;
mod error;
mod finfo;
mod kernels;
mod layout;
/// Host memory statistics and the caching allocator's controls (PyTorch's
/// `torch.cuda.memory_allocated` family, for the CPU): see `storage/pool.rs` for the rules.
pub mod memory {
    pub use crate::storage::huge_pages::advise_huge_pages;
    pub use crate::storage::pool::{
        allocated_bytes, cache_limit_bytes, empty_cache, peak_allocated_bytes, reserved_bytes,
        reset_peak,
    };

    /// The whole process's resident memory in bytes (`VmRSS` of `/proc/self/status`, what
    /// `top` shows), as opposed to the tensor bytes above; `None` where the system has no such
    /// file (outside Linux).
    pub fn process_resident_bytes() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        // "VmRSS:     123456 kB"
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn resident_memory_is_read_on_linux() {
            if cfg!(target_os = "linux") {
                let b = super::process_resident_bytes().expect("/proc/self/status VmRSS");
                // a test process holds at least its own code: more than 1 MiB, less than 1 TiB
                assert!((1 << 20..1 << 40).contains(&b), "{b}");
            }
        }
    }
}
pub mod nn;
mod ops;
pub mod optim;
pub mod random;
pub mod serialize;
mod storage;
mod tensor;
pub mod utils;

pub use amp::{autocast, get_autocast_dtype, is_autocast_enabled};
pub use autograd::{no_grad, set_grad_enabled};
pub use device::{Device, IntoDevice, get_default_device, set_default_device, with_default_device};
pub use dtype::{DType, Element, FloatElement};
pub use error::{Error, Result, fmt_error_chain};
pub use finfo::{FInfo, finfo};
/// The 16-bit float element types of [`DType::BF16`] and [`DType::F16`] (the `half` crate's).
pub use half::{bf16, f16};
pub use kernels::half_convert;
pub use kernels::{
    CpuCapability, cpu_capability, get_num_threads, set_cpu_capability, set_num_threads,
    with_cpu_capability,
};
pub use layout::{Layout, broadcast_shapes, contiguous_strides, normalize_dim};
pub use ops::creation::{TensorOptions, arange, full, ones, rand, randint, randn, zeros};
pub use ops::shape::{cat, stack};
pub use ops::view::ShapeArg;
pub use random::{get_rng_state, manual_seed, set_rng_state};
pub use serialize::{load, save};
pub use storage::{BufElement, CpuStorage, HostBuf, HostBufMut, Storage, StorageElement};
pub use tensor::{Tensor, TensorId};
