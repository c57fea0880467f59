//! One CUDA device's kernels: compiled by NVRTC for the device's compute capability on first
//! use, loaded into its context, and launched from the plans of `plan.rs` on the device's
//! stream; and its cuBLAS handle.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::cublas::{Cublas, Handle};
use super::kernel_cache;
use super::nvrtc::{KERNELS, Nvrtc};
use super::plan::{BLOCK, Gemm, Launch, Params, params};
use crate::{DType, Error, Result};

// SAFETY (all eleven): the structs are #[repr(C)] plain data (integers, floats and device
// addresses) whose layout matches the kernels' structs field for field (checked against the
// host compilation of the same structs by the emulator's tests).
unsafe impl DeviceRepr for params::Unary {}
unsafe impl DeviceRepr for params::Binary {}
unsafe impl DeviceRepr for params::Cmp {}
unsafe impl DeviceRepr for params::Where {}
unsafe impl DeviceRepr for params::Copy {}
unsafe impl DeviceRepr for params::Reduce {}
unsafe impl DeviceRepr for params::Index {}
unsafe impl DeviceRepr for params::CrossEntropy {}
unsafe impl DeviceRepr for params::Dropout {}
unsafe impl DeviceRepr for params::Sgd {}
unsafe impl DeviceRepr for params::Adam {}

/// A device's loaded kernels, stream and cuBLAS handle.
pub(crate) struct Runtime {
    pub(crate) stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    cublas: Mutex<Option<usize>>,
    /// The architecture the kernels were compiled for, e.g. `compute_90`.
    pub(crate) arch: String,
}

fn driver(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda {
        op,
        message: format!("{e:?}"),
    }
}

impl Runtime {
    fn new(ctx: &Arc<CudaContext>) -> Result<Runtime> {
        let driver_cuda = driver_version();
        let nvrtc = Nvrtc::get_for(driver_cuda.map(|v| v.0))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("compute capability"))?;
        let device = (major.max(0) as u32, minor.max(0) as u32);
        let cache = kernel_cache::folder();
        // machine code for the device itself (no JIT: any minor version of the driver's CUDA
        // loads it); when this NVRTC does not know the device, PTX of an earlier architecture,
        // which the driver's JIT compiles
        let mut tries: Vec<((u32, u32), bool)> = vec![(device, true)];
        tries.extend(
            [(9, 0), (8, 0)]
                .into_iter()
                .filter(|&a| a < device)
                .map(|a| (a, false)),
        );
        let mut first_error = None;
        for (arch, cubin) in tries {
            let name = kernel_cache::file_name(KERNELS, arch, nvrtc.version(), cubin);
            let compile = || {
                if cubin {
                    nvrtc.compile_cubin(KERNELS, "tensorplay.cu", arch)
                } else {
                    nvrtc
                        .compile(KERNELS, "tensorplay.cu", arch)
                        .map(String::into_bytes)
                }
            };
            let image = |code: Vec<u8>| {
                if cubin {
                    Ptx::from_binary(code)
                } else {
                    Ptx::from_src(String::from_utf8_lossy(&code).into_owned())
                }
            };
            let code = match kernel_cache::load_or_compile(cache.as_deref(), &name, compile) {
                Ok(c) => c,
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            let (nv_major, nv_minor) = nvrtc.version();
            let unloadable = |e: cudarc::driver::DriverError| Error::CudaUnavailable {
                reason: format!(
                    "the kernels compiled by {} (NVRTC {nv_major}.{nv_minor}) for {} could not \
                     be loaded by the driver (CUDA {}): {e:?}; install the NVRTC of the driver's \
                     CUDA version (TENSORPLAY_NVRTC names a file) or update the driver",
                    nvrtc.file,
                    arch_name(arch, cubin),
                    driver_cuda.map_or_else(|| "?".into(), |(a, b)| format!("{a}.{b}")),
                ),
            };
            let module = match ctx.load_module(image(code)) {
                Ok(m) => m,
                // a cached file the driver refuses (damaged, or from elsewhere) is compiled anew
                Err(_) if cache.is_some() => {
                    kernel_cache::forget(cache.as_deref(), &name);
                    ctx.load_module(image(compile()?)).map_err(unloadable)?
                }
                Err(e) => return Err(unloadable(e)),
            };
            return Ok(Runtime {
                stream: ctx.default_stream(),
                module,
                functions: Mutex::default(),
                cublas: Mutex::default(),
                arch: arch_name(arch, cubin),
            });
        }
        Err(first_error.unwrap_or_else(|| Error::CudaUnavailable {
            reason: format!("no kernels for a device of compute capability {major}.{minor}"),
        }))
    }

    /// Runs `l` on the device's stream (asynchronously: errors of the kernel itself surface
    /// at the next synchronisation).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the kernel is missing or the launch is refused.
    pub(crate) fn launch(&self, l: &Launch) -> Result<()> {
        if l.threads == 0 {
            return Ok(());
        }
        let f = {
            let mut fs = self.functions.lock().unwrap_or_else(|e| e.into_inner());
            match fs.get(&l.kernel) {
                Some(f) => f.clone(),
                None => {
                    let f = self
                        .module
                        .load_function(&l.kernel)
                        .map_err(driver("loading a kernel"))?;
                    fs.insert(l.kernel.clone(), f.clone());
                    f
                }
            }
        };
        let cfg = LaunchConfig {
            grid_dim: (l.grid(), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&f);
        match &l.params {
            Params::Unary(p) => b.arg(p),
            Params::Binary(p) => b.arg(p),
            Params::Cmp(p) => b.arg(p),
            Params::Where(p) => b.arg(p),
            Params::Copy(p) => b.arg(p),
            Params::Reduce(p) => b.arg(p),
            Params::Index(p) => b.arg(p),
            Params::CrossEntropy(p) => b.arg(p),
            Params::Dropout(p) => b.arg(p),
            Params::Sgd(p) => b.arg(p),
            Params::Adam(p) => b.arg(p),
        };
        // SAFETY: the plans size every pointer's buffer for the launch's element counts (the
        // contract of plan.rs, exercised by the emulator's tests), and the parameter struct
        // matches the kernel's signature (the kernel's name is derived from the same plan).
        unsafe { b.launch(cfg) }.map_err(driver("kernel launch"))?;
        Ok(())
    }

    /// Runs the GEMM `g` (see [`Gemm`]) on device pointers.
    ///
    /// # Safety
    /// The pointers must be this device's memory, large enough for `g`.
    pub(crate) unsafe fn gemm(&self, g: &Gemm, dt: DType, a: u64, b: u64, c: u64) -> Result<()> {
        let cublas = Cublas::get()?;
        // cuBLAS works in the calling thread's current context (also when making its handle)
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        let h = {
            let mut slot = self.cublas.lock().unwrap_or_else(|e| e.into_inner());
            match *slot {
                Some(h) => h as Handle,
                None => {
                    let h = cublas.handle(self.stream.cu_stream().cast())?;
                    *slot = Some(h as usize);
                    h
                }
            }
        };
        // SAFETY: per this function's contract; the handle runs on this device's stream.
        unsafe { cublas.gemm(h, g, dt, a, b, c) }
    }
}

/// `sm_90` (machine code) or `compute_90` (PTX).
fn arch_name((major, minor): (u32, u32), cubin: bool) -> String {
    format!("{}_{major}{minor}", if cubin { "sm" } else { "compute" })
}

/// The CUDA version the driver supports, as (major, minor), e.g. (13, 0) for driver 580.
pub(crate) fn driver_version() -> Option<(i32, i32)> {
    let mut v = 0;
    // SAFETY: an out-pointer to a live int; the driver library is loaded (a context exists).
    let rc = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    (rc == cudarc::driver::sys::CUresult::CUDA_SUCCESS && v > 0)
        .then_some((v / 1000, v % 1000 / 10))
}

/// The runtime of device `ordinal`, made on first use (compiling the kernels: about a second).
///
/// # Errors
/// [`Error::CudaUnavailable`] when NVRTC is missing (naming what to install), or the kernels'
/// compile or load errors.
pub(crate) fn runtime(ctx: &Arc<CudaContext>, ordinal: usize) -> Result<Arc<Runtime>> {
    static RT: OnceLock<Mutex<HashMap<usize, Arc<Runtime>>>> = OnceLock::new();
    let mut map = RT
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(r) = map.get(&ordinal) {
        return Ok(r.clone());
    }
    let r = Arc::new(Runtime::new(ctx)?);
    map.insert(ordinal, r.clone());
    Ok(r)
}
