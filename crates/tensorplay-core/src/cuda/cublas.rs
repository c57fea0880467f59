//! cuBLAS, for matrix products (loaded at run time; CUDA 13 or 12). TF32 stays off: cuBLAS's
//! default math mode computes float32 products in float32. bfloat16 and float16 products go
//! through `cublasGemmStridedBatchedEx` with 16-bit operands and result and float32 compute
//! (`CUBLAS_COMPUTE_32F`), reduced-precision split-K reductions disallowed, so a product
//! accumulates in float32 and rounds once, as the CPU's.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use libloading::Library;

use super::library::{Wanted, load, symbol};
use super::plan::Gemm;
use crate::{DType, Error, Result};

/// Where cuBLAS comes from.
pub(crate) const CUBLAS: Wanted = Wanted {
    what: "cuBLAS",
    env: "TENSORPLAY_CUBLAS",
    files: &["libcublas.so.13", "libcublas.so.12", "libcublas.so"],
    install: "install CUDA 13 or 12's cuBLAS (the toolkit's libcublas package, or \
              `pip install nvidia-cublas-cu12`)",
};

/// A cuBLAS handle.
pub(crate) type Handle = *mut c_void;

type GemmFn<T> = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const T,
    *const T,
    c_int,
    i64,
    *const T,
    c_int,
    i64,
    *const T,
    *mut T,
    c_int,
    i64,
    c_int,
) -> c_int;

/// `cublasGemmStridedBatchedEx`: as [`GemmFn`] with each matrix's `cudaDataType` after its
/// pointer, then the compute type and the algorithm.
type GemmExFn = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    c_int,
    c_int,
    i64,
    *const c_void,
    c_int,
    c_int,
    i64,
    *const c_void,
    *mut c_void,
    c_int,
    c_int,
    i64,
    c_int,
    c_int,
    c_int,
) -> c_int;

/// `cudaDataType` values (library_types.h).
const CUDA_R_16F: c_int = 2;
const CUDA_R_16BF: c_int = 14;
/// `CUBLAS_COMPUTE_32F`.
const COMPUTE_32F: c_int = 68;
/// `CUBLAS_GEMM_DEFAULT`.
const GEMM_DEFAULT: c_int = -1;
/// `CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION`: no TF32, and
/// 16-bit products' split-K partial sums kept in float32.
const MATH_MODE: c_int = 16;

/// The loaded library and the functions used.
pub(crate) struct Cublas {
    _lib: Library,
    create: unsafe extern "C" fn(*mut Handle) -> c_int,
    set_stream: unsafe extern "C" fn(Handle, *mut c_void) -> c_int,
    sgemm: GemmFn<f32>,
    dgemm: GemmFn<f64>,
    gemm_ex: GemmExFn,
    set_math_mode: unsafe extern "C" fn(Handle, c_int) -> c_int,
}

// SAFETY: the function pointers are plain C functions into a library that stays loaded; cuBLAS
// allows a handle to be used from several threads (its documentation), and each call binds the
// handle's context first (runtime.rs).
unsafe impl Send for Cublas {}
// SAFETY: as above.
unsafe impl Sync for Cublas {}

impl Cublas {
    /// The shared instance, loaded once.
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] naming the files tried and what to install.
    pub(crate) fn get() -> Result<&'static Cublas> {
        static C: OnceLock<std::result::Result<Cublas, String>> = OnceLock::new();
        C.get_or_init(|| Cublas::load().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|r| Error::CudaUnavailable {
                reason: r.trim_start_matches("CUDA unavailable: ").to_string(),
            })
    }

    fn load() -> Result<Cublas> {
        let (lib, _) = load(&CUBLAS)?;
        let w = CUBLAS.what;
        // SAFETY: the types are cuBLAS's C signatures (cublas_api.h, CUDA 12 and 13 alike).
        unsafe {
            Ok(Cublas {
                create: symbol(&lib, w, b"cublasCreate_v2\0")?,
                set_stream: symbol(&lib, w, b"cublasSetStream_v2\0")?,
                sgemm: symbol(&lib, w, b"cublasSgemmStridedBatched\0")?,
                dgemm: symbol(&lib, w, b"cublasDgemmStridedBatched\0")?,
                gemm_ex: symbol(&lib, w, b"cublasGemmStridedBatchedEx\0")?,
                set_math_mode: symbol(&lib, w, b"cublasSetMathMode\0")?,
                _lib: lib,
            })
        }
    }

    /// A handle whose work goes on `stream` (a `CUstream`).
    pub(crate) fn handle(&self, stream: *mut c_void) -> Result<Handle> {
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: an out-pointer; the stream belongs to the current context.
        let rc = unsafe { (self.create)(&mut h) };
        if rc != 0 {
            return Err(cublas_error("cublasCreate", rc));
        }
        // SAFETY: a live handle and stream.
        let rc = unsafe { (self.set_stream)(h, stream) };
        if rc != 0 {
            return Err(cublas_error("cublasSetStream", rc));
        }
        // SAFETY: a live handle.
        let rc = unsafe { (self.set_math_mode)(h, MATH_MODE) };
        if rc != 0 {
            return Err(cublas_error("cublasSetMathMode", rc));
        }
        Ok(h)
    }

    /// Runs `g` on device pointers `a`, `b` (cuBLAS's operands, offsets not yet applied) into
    /// `c`, all of dtype `dt` (float32, float64, bfloat16 or float16; the 16-bit ones computed
    /// in float32).
    ///
    /// # Safety
    /// The pointers must be device memory of the handle's context, large enough for `g`.
    pub(crate) unsafe fn gemm(
        &self,
        h: Handle,
        g: &Gemm,
        dt: DType,
        a: u64,
        b: u64,
        c: u64,
    ) -> Result<()> {
        let rc = match dt {
            // SAFETY: per this function's contract; dgemm takes float64 operands.
            DType::F64 => unsafe { run(self.dgemm, h, g, (1.0, 0.0), a, b, c) },
            // SAFETY: per this function's contract; sgemm takes float32 operands.
            DType::F32 => unsafe { run(self.sgemm, h, g, (1.0, 0.0), a, b, c) },
            // SAFETY: per this function's contract; the operands are 16-bit of `ty`.
            DType::BF16 => unsafe { self.run_ex(h, g, CUDA_R_16BF, (a, b, c)) },
            // SAFETY: as above.
            DType::F16 => unsafe { self.run_ex(h, g, CUDA_R_16F, (a, b, c)) },
            d @ (DType::I64 | DType::Bool) => {
                return Err(Error::UnsupportedDType {
                    op: "matmul",
                    dtype: d,
                    expected: "float32, float64, bfloat16 or float16 on CUDA",
                });
            }
        };
        if rc != 0 {
            return Err(cublas_error("cublas<t>gemmStridedBatched", rc));
        }
        Ok(())
    }
}

impl Cublas {
    /// One strided-batched GEMM of 16-bit (`ty`) operands and result with float32 compute.
    ///
    /// # Safety
    /// As [`Cublas::gemm`].
    unsafe fn run_ex(&self, h: Handle, g: &Gemm, ty: c_int, (a, b, c): (u64, u64, u64)) -> c_int {
        // two-byte elements; alpha and beta are float32 (the compute type's)
        let (a, b) = (a + 2 * g.a_offset as u64, b + 2 * g.b_offset as u64);
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the caller's contract; alpha and beta live across the call (host pointer mode).
        unsafe {
            (self.gemm_ex)(
                h,
                c_int::from(g.transa),
                c_int::from(g.transb),
                g.m,
                g.n,
                g.k,
                (&alpha as *const f32).cast(),
                a as *const c_void,
                ty,
                g.lda,
                g.stride_a,
                b as *const c_void,
                ty,
                g.ldb,
                g.stride_b,
                (&beta as *const f32).cast(),
                c as *mut c_void,
                ty,
                g.ldc,
                g.stride_c,
                g.batch,
                COMPUTE_32F,
                GEMM_DEFAULT,
            )
        }
    }
}

/// One strided-batched GEMM through `f` with `(alpha, beta)`, offsets applied to `a` and `b`.
///
/// # Safety
/// As [`Cublas::gemm`].
unsafe fn run<T>(
    f: GemmFn<T>,
    h: Handle,
    g: &Gemm,
    (alpha, beta): (T, T),
    a: u64,
    b: u64,
    c: u64,
) -> c_int {
    let (a, b) = (
        (a as *const T).wrapping_add(g.a_offset),
        (b as *const T).wrapping_add(g.b_offset),
    );
    // SAFETY: the caller's contract; alpha and beta live across the call (host pointer mode).
    unsafe {
        f(
            h,
            c_int::from(g.transa),
            c_int::from(g.transb),
            g.m,
            g.n,
            g.k,
            &alpha,
            a,
            g.lda,
            g.stride_a,
            b,
            g.ldb,
            g.stride_b,
            &beta,
            c as *mut T,
            g.ldc,
            g.stride_c,
            g.batch,
        )
    }
}

fn cublas_error(call: &str, rc: c_int) -> Error {
    Error::Cuda {
        op: "matmul",
        message: format!("{call} failed with cuBLAS status {rc}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::library::load_from;

    #[test]
    fn a_missing_cublas_is_named_with_what_to_install() {
        let e = load_from(
            &CUBLAS,
            &["/nonexistent/libcublas.so.12".to_string()],
            false,
        )
        .expect_err("no such file")
        .to_string();
        assert!(
            e.contains("cuBLAS") && e.contains("/nonexistent/libcublas.so.12"),
            "{e}"
        );
        assert!(
            e.contains("nvidia-cublas-cu12") && e.contains("TENSORPLAY_CUBLAS"),
            "{e}"
        );
    }
}
