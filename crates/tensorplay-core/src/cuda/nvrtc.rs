//! NVRTC, the CUDA runtime compiler: compiles `kernels/tensorplay.cu` to PTX for the device at
//! hand (loaded at run time; CUDA 13 or 12).

use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::OnceLock;

use libloading::Library;

use super::library::{Wanted, load_preferring, symbol};
use crate::{Error, Result};

/// The kernels' source.
pub const KERNELS: &str = include_str!("kernels/tensorplay.cu");

/// Where NVRTC comes from.
pub(crate) const NVRTC: Wanted = Wanted {
    what: "NVRTC (the CUDA runtime compiler)",
    env: "TENSORPLAY_NVRTC",
    files: &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
    install: "install CUDA 13 or 12's runtime compiler (the toolkit's cuda-nvrtc package, or \
              `pip install nvidia-cuda-nvrtc-cu12`)",
};

type Program = *mut c_void;

/// The loaded library and the functions used.
pub(crate) struct Nvrtc {
    _lib: Library,
    /// The file loaded.
    pub(crate) file: String,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    log: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    ptx_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    ptx: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut Program) -> c_int,
}

// SAFETY: NVRTC's functions are thread-safe for distinct programs (NVIDIA's documentation);
// each compile creates and destroys its own program.
unsafe impl Send for Nvrtc {}
// SAFETY: as above.
unsafe impl Sync for Nvrtc {}

impl Nvrtc {
    /// Loads NVRTC (see [`NVRTC`]).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] naming the files tried and what to install.
    pub(crate) fn load(driver_major: Option<i32>) -> Result<Nvrtc> {
        // an NVRTC newer than the driver makes code the driver cannot load: with a CUDA 12
        // driver, CUDA 12's NVRTC only
        let files: Vec<&str> = NVRTC
            .files
            .iter()
            .copied()
            .filter(|f| match (driver_major, f.rsplit_once(".so.")) {
                (Some(d), Some((_, major))) => major.parse::<i32>().is_ok_and(|m| m <= d),
                _ => true,
            })
            .collect();
        let (lib, file) = load_preferring(&NVRTC, &files)?;
        Nvrtc::from_library(lib, file)
    }

    fn from_library(lib: Library, file: String) -> Result<Nvrtc> {
        let w = NVRTC.what;
        // SAFETY: the types are NVRTC's C signatures (nvrtc.h, CUDA 12 and 13 alike).
        unsafe {
            Ok(Nvrtc {
                version: symbol(&lib, w, b"nvrtcVersion\0")?,
                create: symbol(&lib, w, b"nvrtcCreateProgram\0")?,
                compile: symbol(&lib, w, b"nvrtcCompileProgram\0")?,
                log_size: symbol(&lib, w, b"nvrtcGetProgramLogSize\0")?,
                log: symbol(&lib, w, b"nvrtcGetProgramLog\0")?,
                ptx_size: symbol(&lib, w, b"nvrtcGetPTXSize\0")?,
                ptx: symbol(&lib, w, b"nvrtcGetPTX\0")?,
                cubin_size: symbol(&lib, w, b"nvrtcGetCUBINSize\0")?,
                cubin: symbol(&lib, w, b"nvrtcGetCUBIN\0")?,
                destroy: symbol(&lib, w, b"nvrtcDestroyProgram\0")?,
                _lib: lib,
                file,
            })
        }
    }

    /// The shared instance, loaded once: for a driver of CUDA major version `driver_major`
    /// when given (the first caller decides), else whichever of CUDA 13 and 12 is installed.
    pub(crate) fn get_for(driver_major: Option<i32>) -> Result<&'static Nvrtc> {
        static N: OnceLock<std::result::Result<Nvrtc, String>> = OnceLock::new();
        N.get_or_init(|| Nvrtc::load(driver_major).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|r| Error::CudaUnavailable {
                reason: r.trim_start_matches("CUDA unavailable: ").to_string(),
            })
    }

    /// NVRTC's (major, minor) version.
    pub(crate) fn version(&self) -> (i32, i32) {
        let (mut a, mut b) = (0, 0);
        // SAFETY: two out-pointers to live ints.
        unsafe { (self.version)(&mut a, &mut b) };
        (a, b)
    }

    /// Compiles `source` (named `name` in messages) to PTX for compute capability
    /// `major.minor`, without fused multiply-adds (so results match the CPU's arithmetic).
    ///
    /// # Errors
    /// [`Error::Cuda`] with NVRTC's log when the source does not compile.
    pub(crate) fn compile(&self, source: &str, name: &str, arch: (u32, u32)) -> Result<String> {
        let ptx = self.compile_to(source, name, arch, false)?;
        Ok(String::from_utf8_lossy(&ptx)
            .trim_end_matches('\0')
            .to_string())
    }

    /// Like [`Nvrtc::compile`], to machine code (a cubin) for `sm_XY`: the driver loads it
    /// without its PTX JIT, so an NVRTC of any minor version of the driver's CUDA works.
    pub(crate) fn compile_cubin(
        &self,
        source: &str,
        name: &str,
        arch: (u32, u32),
    ) -> Result<Vec<u8>> {
        self.compile_to(source, name, arch, true)
    }

    fn compile_to(
        &self,
        source: &str,
        name: &str,
        (major, minor): (u32, u32),
        cubin: bool,
    ) -> Result<Vec<u8>> {
        let target = if cubin { "sm" } else { "compute" };
        let fail = |what: &str, rc: c_int| Error::Cuda {
            op: "nvrtc",
            message: format!("{what} failed with NVRTC error {rc}"),
        };
        let src = CString::new(source).map_err(|_| fail("a source with a NUL byte", -1))?;
        let cname = CString::new(name).map_err(|_| fail("a name with a NUL byte", -1))?;
        let opts: Vec<CString> = [
            format!("--gpu-architecture={target}_{major}{minor}"),
            "--fmad=false".into(),
            "-default-device".into(),
        ]
        .into_iter()
        .map(|o| CString::new(o).expect("options have no NUL"))
        .collect();
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: the strings live across the calls; `prog` is created, used and destroyed
        // here only; the buffers handed to the getters have the sizes NVRTC reported.
        unsafe {
            let rc = (self.create)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if rc != 0 {
                return Err(fail("nvrtcCreateProgram", rc));
            }
            let rc = (self.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
            let mut n = 0usize;
            let mut log = Vec::new();
            if (self.log_size)(prog, &mut n) == 0 {
                log = vec![0u8; n.max(1)];
                if (self.log)(prog, log.as_mut_ptr().cast()) != 0 {
                    log.clear();
                }
            }
            let log = String::from_utf8_lossy(&log)
                .trim_end_matches('\0')
                .trim()
                .to_string();
            if rc != 0 {
                (self.destroy)(&mut prog);
                return Err(Error::Cuda {
                    op: "nvrtc",
                    message: format!(
                        "{name} does not compile for {target}_{major}{minor} (NVRTC error {rc}):\n{log}"
                    ),
                });
            }
            let (size, get) = if cubin {
                (self.cubin_size, self.cubin)
            } else {
                (self.ptx_size, self.ptx)
            };
            n = 0;
            let rc = size(prog, &mut n);
            let mut out = vec![0u8; n.max(1)];
            let rc = if rc == 0 {
                get(prog, out.as_mut_ptr().cast())
            } else {
                rc
            };
            (self.destroy)(&mut prog);
            if rc != 0 {
                return Err(fail(
                    if cubin {
                        "nvrtcGetCUBIN"
                    } else {
                        "nvrtcGetPTX"
                    },
                    rc,
                ));
            }
            out.truncate(n);
            Ok(out)
        }
    }
}

/// Compiles tensorplay's kernels to PTX for compute capability `major.minor` with the NVRTC
/// found at run time (`TENSORPLAY_NVRTC` names its file; else `libnvrtc.so.13`, `.so.12`).
/// What the CUDA device path does once per device; public so that CI can check the kernels
/// compile on machines without a GPU.
///
/// Returns the PTX text and the NVRTC file that compiled it.
///
/// # Errors
/// [`Error::CudaUnavailable`] when NVRTC cannot be loaded; [`Error::Cuda`] with the compiler's
/// log when a kernel does not compile.
pub fn compile_kernels(compute_capability: (u32, u32)) -> Result<(String, String)> {
    let n = Nvrtc::get_for(None)?;
    Ok((
        n.compile(KERNELS, "tensorplay.cu", compute_capability)?,
        n.file.clone(),
    ))
}

/// Like [`compile_kernels`], to machine code (an ELF cubin) for `sm_XY`: what the CUDA
/// device path loads when NVRTC knows the device's architecture.
///
/// # Errors
/// As [`compile_kernels`].
pub fn compile_kernels_binary(compute_capability: (u32, u32)) -> Result<(Vec<u8>, String)> {
    let n = Nvrtc::get_for(None)?;
    Ok((
        n.compile_cubin(KERNELS, "tensorplay.cu", compute_capability)?,
        n.file.clone(),
    ))
}

/// NVRTC's version as (major, minor).
///
/// # Errors
/// [`Error::CudaUnavailable`] when NVRTC cannot be loaded.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    Ok(Nvrtc::get_for(None)?.version())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::library::load_from;

    #[test]
    fn a_missing_nvrtc_is_named_with_what_to_install() {
        let e = load_from(&NVRTC, &["/nonexistent/libnvrtc.so.13".to_string()], false)
            .expect_err("no such file")
            .to_string();
        assert!(e.contains("NVRTC"), "{e}");
        assert!(e.contains("/nonexistent/libnvrtc.so.13"), "{e}");
        assert!(e.contains("nvidia-cuda-nvrtc-cu12"), "{e}");
        assert!(e.contains("TENSORPLAY_NVRTC"), "{e}");
    }
}
