//! With the `cuda-emulator` feature, compiles the CUDA kernels for the host (see
//! `src/cuda/kernels/emulate.h`); otherwise does nothing.

fn main() {
    println!("cargo::rerun-if-changed=src/cuda/kernels");
    #[cfg(feature = "cuda-emulator")]
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("src/cuda/kernels/emulate.cpp")
        .define("TP_EMULATE", "1")
        .warnings(true)
        .compile("tensorplay_cuda_emulator");
}
