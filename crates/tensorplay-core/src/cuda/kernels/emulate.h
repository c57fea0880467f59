// Host emulation of the CUDA C used by tensorplay.cu, for the kernel tests that run without a
// GPU (`cargo test -p tensorplay-core --features cuda-emulator`). The kernels never let threads
// talk to each other, so running every thread of every block one after the other computes what
// the GPU computes; atomics become plain read-modify-writes.
#pragma once
#include <math.h>
#include <string.h>

// CUDA's bit casts between float and its 32-bit pattern
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, sizeof u); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, sizeof f); return f; }

struct tp_dim3 {
    unsigned x, y, z;
};
extern thread_local tp_dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __device__
#define __global__

inline float atomicAdd(float* a, float v) { float o = *a; *a = o + v; return o; }
inline double atomicAdd(double* a, double v) { double o = *a; *a = o + v; return o; }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
    unsigned long long o = *a; *a = o + v; return o;
}

typedef void (*tp_emu_entry)(const void*);
struct tp_emu_register {
    tp_emu_register(const char* name, tp_emu_entry entry);
};

// a kernel: its body, an entry point taking the parameter struct's address, and its
// registration under its CUDA name
#define TP_KERNEL(name, P)                                                        \
    static void name##_body(const P& p);                                          \
    static void name##_entry(const void* raw) { name##_body(*(const P*)raw); }   \
    static tp_emu_register name##_registered(#name, name##_entry);               \
    static void name##_body(const P& p)
