//! The CUDA kernels run on the host (feature `cuda-emulator`, tests only): `kernels/emulate.cpp`
//! compiles `tensorplay.cu` with a C++ compiler, and [`run`] executes a [`Launch`] from
//! `plan.rs` on host memory. The tests below compare every kernel family, through the same
//! plans the GPU path uses, with the CPU's operations on generated shapes and strides.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};

use super::plan::{BLOCK, Launch};

unsafe extern "C" {
    fn tp_emu_launch(
        name: *const c_char,
        params: *const c_void,
        grid: c_uint,
        block: c_uint,
    ) -> c_int;
    fn tp_emu_kernel_count() -> c_int;
    fn tp_emu_kernel_name(i: c_int) -> *const c_char;
}

/// Runs `l` on the host. The pointers in its parameters must be host addresses of live buffers
/// large enough for the launch (the plans' contract).
///
/// # Panics
/// When the kernel does not exist (a plan naming a kernel the .cu file lacks).
pub(crate) fn run(l: &Launch) {
    let name = CString::new(l.kernel.as_str()).expect("kernel names have no NUL");
    // SAFETY: `params` is the #[repr(C)] struct the kernel reads; the caller guarantees the
    // pointers inside it; the emulation runs synchronously on this thread.
    let rc = unsafe {
        tp_emu_launch(
            name.as_ptr(),
            l.params.bytes().as_ptr().cast(),
            l.grid(),
            BLOCK,
        )
    };
    assert_eq!(rc, 0, "no kernel named {}", l.kernel);
}

/// The names of every kernel in tensorplay.cu.
pub(crate) fn kernel_names() -> Vec<String> {
    // SAFETY: the registry is filled by static constructors before main and never changes;
    // the names are static C strings.
    unsafe {
        (0..tp_emu_kernel_count())
            .map(|i| {
                CStr::from_ptr(tp_emu_kernel_name(i))
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
