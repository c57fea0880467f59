// tensorplay's CUDA kernels: one file of CUDA C, compiled at run time by NVRTC for the device
// it runs on (no CUDA toolkit at build time), assembled by ptxas for sm_80 and sm_90 in CI, and
// compiled by the host C++ compiler with `emulate.h` for the kernel tests that run without a GPU.
//
// Conventions, shared with `src/cuda/plan.rs` (which builds every launch):
// - Every kernel takes one parameter struct by value; pointers are device addresses (u64).
// - A strided operand is a `Strided`: up to TP_MAX_DIMS dims, element strides (0 when broadcast)
//   and an element offset. Outputs are contiguous, row-major.
// - Launches are one-dimensional with grid-stride loops, and threads never talk to each other
//   (no shared memory, no barriers): reductions run in two launches over partial results. The
//   only inter-thread operations are the atomic adds of scatter_add.
// - Integer arithmetic wraps, as the CPU's does; float to int casts saturate, NaN gives 0.

#ifdef TP_EMULATE
#include "emulate.h"
#else
#define TP_KERNEL(name, P) extern "C" __global__ void name(const P p)
#endif

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

#define TP_MAX_DIMS 8

struct Strided {
    i64 ndim;
    i64 offset;
    i64 shape[TP_MAX_DIMS];
    i64 strides[TP_MAX_DIMS];
};

// element offset of the `i`-th element (row-major order) of a strided view
__device__ inline i64 tp_at(const Strided& l, i64 i) {
    i64 off = l.offset;
    for (i64 d = l.ndim - 1; d >= 0; --d) {
        i64 s = l.shape[d];
        off += (i % s) * l.strides[d];
        i /= s;
    }
    return off;
}

#define TP_LOOP(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

// ---------------------------------------------------------------------------------------------
// scalar helpers, overloaded per element type

__device__ inline float tp_exp(float x) { return expf(x); }
__device__ inline double tp_exp(double x) { return exp(x); }
__device__ inline float tp_log(float x) { return logf(x); }
__device__ inline double tp_log(double x) { return log(x); }
__device__ inline float tp_sqrt(float x) { return sqrtf(x); }
__device__ inline double tp_sqrt(double x) { return sqrt(x); }
__device__ inline float tp_abs(float x) { return fabsf(x); }
__device__ inline double tp_abs(double x) { return fabs(x); }
__device__ inline float tp_tanh(float x) { return tanhf(x); }
__device__ inline double tp_tanh(double x) { return tanh(x); }
__device__ inline float tp_erf(float x) { return erff(x); }
__device__ inline double tp_erf(double x) { return erf(x); }
__device__ inline float tp_pow(float x, float y) { return powf(x, y); }
__device__ inline double tp_pow(double x, double y) { return pow(x, y); }
__device__ inline i64 tp_pow(i64 x, i64 y) { return (i64)pow((double)x, (double)y); }

// wrapping integer arithmetic (two's complement through unsigned), plain IEEE for floats
__device__ inline float tp_add(float a, float b) { return a + b; }
__device__ inline double tp_add(double a, double b) { return a + b; }
__device__ inline i64 tp_add(i64 a, i64 b) { return (i64)((u64)a + (u64)b); }
__device__ inline float tp_sub(float a, float b) { return a - b; }
__device__ inline double tp_sub(double a, double b) { return a - b; }
__device__ inline i64 tp_sub(i64 a, i64 b) { return (i64)((u64)a - (u64)b); }
__device__ inline float tp_mul(float a, float b) { return a * b; }
__device__ inline double tp_mul(double a, double b) { return a * b; }
__device__ inline i64 tp_mul(i64 a, i64 b) { return (i64)((u64)a * (u64)b); }

// conversions through double, as the CPU's `from_f64(to_f64(v))`
__device__ inline double tp_to_f64(float v) { return (double)v; }
__device__ inline double tp_to_f64(double v) { return v; }
__device__ inline double tp_to_f64(i64 v) { return (double)v; }
__device__ inline double tp_to_f64(bool v) { return v ? 1.0 : 0.0; }
template <typename T> __device__ inline T tp_from_f64(double v);
template <> __device__ inline float tp_from_f64<float>(double v) { return (float)v; }
template <> __device__ inline double tp_from_f64<double>(double v) { return v; }
template <> __device__ inline bool tp_from_f64<bool>(double v) { return v != 0.0; }
template <> __device__ inline i64 tp_from_f64<i64>(double v) {
    if (v != v) return 0;
    if (v >= 9223372036854775807.0) return 9223372036854775807LL;
    if (v <= -9223372036854775808.0) return (-9223372036854775807LL - 1);
    return (i64)v;
}

// a dtype conversion: through double as the CPU's, except where that would lose what the CPU
// keeps: a copy to the same type, and int64 to bool
template <typename D, typename S> struct tp_cast_t {
    __device__ static inline D go(S v) { return tp_from_f64<D>(tp_to_f64(v)); }
};
template <typename T> struct tp_cast_t<T, T> {
    __device__ static inline T go(T v) { return v; }
};
template <> struct tp_cast_t<bool, i64> {
    __device__ static inline bool go(i64 v) { return v != 0; }
};
template <typename D, typename S> __device__ inline D tp_cast(S v) { return tp_cast_t<D, S>::go(v); }

// ---------------------------------------------------------------------------------------------
// 16-bit floats: two-byte storage types with bit-exact conversions written here (no cuda_bf16.h
// or cuda_fp16.h: the same code runs on every NVRTC and in the host emulation, so the emulator's
// tests check the very conversions the GPU runs). Loads widen to float32 exactly; stores round
// float32 to nearest even, infinities kept, NaN kept and quieted (as the `half` crate). Every
// operation on them computes in float32 and rounds once, as the CPU does.

struct tp_bf16 { unsigned short bits; };
struct tp_f16 { unsigned short bits; };

__device__ inline float tp_up(tp_bf16 v) { return __uint_as_float((u32)v.bits << 16); }
__device__ inline float tp_up(tp_f16 v) {
    u32 sign = (u32)(v.bits & 0x8000u) << 16, e = (v.bits >> 10) & 0x1fu, m = v.bits & 0x3ffu;
    if (e == 0x1f) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        float f = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
        return sign ? -f : f;
    }
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}
__device__ inline float tp_up(float v) { return v; }
__device__ inline double tp_up(double v) { return v; }
__device__ inline i64 tp_up(i64 v) { return v; }
__device__ inline bool tp_up(bool v) { return v; }

__device__ inline tp_bf16 tp_bf16_from(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return tp_bf16{(unsigned short)((x >> 16) | 0x40u)};
    return tp_bf16{(unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16)};
}
__device__ inline tp_f16 tp_f16_from(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {  // infinity, NaN (quieted, top mantissa bits kept)
        u32 nan = ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u;
        return tp_f16{(unsigned short)(sign | 0x7c00u | nan)};
    }
    if (ax >= 0x477ff000u) return tp_f16{(unsigned short)(sign | 0x7c00u)};  // >= 65520
    if (ax < 0x38800000u) {  // below 2^-14: a subnormal result, m * 2^-24
        if (ax < 0x33000000u) return tp_f16{(unsigned short)sign};  // <= 2^-25: zero
        u32 mant = (ax & 0x7fffffu) | 0x800000u, shift = 126u - (ax >> 23);
        u32 q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) ++q;
        return tp_f16{(unsigned short)(sign | q)};
    }
    u32 r = ax - 0x38000000u;  // exponent rebiased from 127 to 15
    r += 0xfffu + ((r >> 13) & 1u);
    return tp_f16{(unsigned short)(sign | (r >> 13))};
}

// a computed value (float32 for the 16-bit types) stored as type D: 16-bit types round once,
// the others are already of their type
template <typename D> struct tp_down_t {
    template <typename T> __device__ static inline D go(T v) { return (D)v; }
};
template <> struct tp_down_t<tp_bf16> {
    __device__ static inline tp_bf16 go(float v) { return tp_bf16_from(v); }
};
template <> struct tp_down_t<tp_f16> {
    __device__ static inline tp_f16 go(float v) { return tp_f16_from(v); }
};
template <typename D, typename T> __device__ inline D tp_down(T v) { return tp_down_t<D>::go(v); }

// float64 to float32 rounding to odd: rounding that to a narrower format then gives the float64
// value correctly rounded once (float32 has more than twice the 16-bit types' precision bits)
__device__ inline float tp_f64_to_f32_odd(double d) {
    float f = (float)d;
    if (d != d || (double)f == d) return f;
    u32 b = __float_as_uint(f);
    if (tp_abs((double)f) > tp_abs(d)) b -= 1u;  // one step toward zero: the truncation
    return __uint_as_float(b | 1u);
}

__device__ inline double tp_to_f64(tp_bf16 v) { return (double)tp_up(v); }
__device__ inline double tp_to_f64(tp_f16 v) { return (double)tp_up(v); }
template <> __device__ inline tp_bf16 tp_from_f64<tp_bf16>(double v) {
    return tp_bf16_from(tp_f64_to_f32_odd(v));
}
template <> __device__ inline tp_f16 tp_from_f64<tp_f16>(double v) {
    return tp_f16_from(tp_f64_to_f32_odd(v));
}
template <> struct tp_cast_t<float, tp_bf16> {
    __device__ static inline float go(tp_bf16 v) { return tp_up(v); }
};
template <> struct tp_cast_t<float, tp_f16> {
    __device__ static inline float go(tp_f16 v) { return tp_up(v); }
};
template <> struct tp_cast_t<tp_bf16, float> {
    __device__ static inline tp_bf16 go(float v) { return tp_bf16_from(v); }
};
template <> struct tp_cast_t<tp_f16, float> {
    __device__ static inline tp_f16 go(float v) { return tp_f16_from(v); }
};

// ---------------------------------------------------------------------------------------------
// elementwise

enum UnaryOp {
    U_NEG = 0, U_EXP = 1, U_LOG = 2, U_SQRT = 3, U_ABS = 4, U_RELU = 5, U_SIGMOID = 6,
    U_TANH = 7, U_GELU = 8, U_ERF = 9, U_ADD_SCALAR = 10, U_MUL_SCALAR = 11,
    U_DIV_SCALAR = 12, U_POW_SCALAR = 13, U_SIGN = 14, U_NOT = 15, U_SQUARE = 16,
};

struct UnaryParams {
    u64 out;
    u64 x;
    Strided lx;
    i64 n;
    i64 op;
    double scalar;
};

template <typename T> __device__ inline T tp_unary_float(i64 op, T v, double s) {
    const T zero = (T)0, one = (T)1;
    switch (op) {
    case U_NEG: return -v;
    case U_EXP: return tp_exp(v);
    case U_LOG: return tp_log(v);
    case U_SQRT: return tp_sqrt(v);
    case U_ABS: return tp_abs(v);
    case U_RELU: return (v > zero || v != v) ? v : zero;
    case U_SIGMOID: return one / (one + tp_exp(-v));
    case U_TANH: return tp_tanh(v);
    case U_GELU: return v * (T)0.5 * (one + tp_erf(v * (T)0.70710678118654752440));
    case U_ERF: return tp_erf(v);
    case U_ADD_SCALAR: return v + (T)s;
    case U_MUL_SCALAR: return v * (T)s;
    case U_DIV_SCALAR: return v / (T)s;
    case U_POW_SCALAR: return tp_pow(v, (T)s);
    case U_SIGN: return v > zero ? one : (v < zero ? -one : v);
    case U_SQUARE: return v * v;
    default: return v;
    }
}

__device__ inline i64 tp_unary_int(i64 op, i64 v, double s) {
    switch (op) {
    case U_NEG: return (i64)(0ULL - (u64)v);
    case U_ABS: return v < 0 ? (i64)(0ULL - (u64)v) : v;
    case U_ADD_SCALAR: return tp_add(v, tp_from_f64<i64>(s));
    case U_MUL_SCALAR: return tp_mul(v, tp_from_f64<i64>(s));
    case U_RELU: return v > 0 ? v : 0;
    case U_SIGN: return v > 0 ? 1 : (v < 0 ? -1 : 0);
    case U_SQUARE: return tp_mul(v, v);
    default: return v;
    }
}

TP_KERNEL(tp_unary_f32, UnaryParams) {
    const float* x = (const float*)p.x;
    float* out = (float*)p.out;
    TP_LOOP(i, p.n) { out[i] = tp_unary_float<float>(p.op, x[tp_at(p.lx, i)], p.scalar); }
}
TP_KERNEL(tp_unary_f64, UnaryParams) {
    const double* x = (const double*)p.x;
    double* out = (double*)p.out;
    TP_LOOP(i, p.n) { out[i] = tp_unary_float<double>(p.op, x[tp_at(p.lx, i)], p.scalar); }
}
#define TP_UNARY_HALF(name, H)                                                           \
    TP_KERNEL(name, UnaryParams) {                                                       \
        const H* x = (const H*)p.x;                                                      \
        H* out = (H*)p.out;                                                              \
        TP_LOOP(i, p.n) {                                                                \
            out[i] = tp_down<H>(tp_unary_float<float>(p.op, tp_up(x[tp_at(p.lx, i)]), p.scalar)); \
        }                                                                                \
    }
TP_UNARY_HALF(tp_unary_bf16, tp_bf16)
TP_UNARY_HALF(tp_unary_f16, tp_f16)
TP_KERNEL(tp_unary_i64, UnaryParams) {
    const i64* x = (const i64*)p.x;
    i64* out = (i64*)p.out;
    TP_LOOP(i, p.n) { out[i] = tp_unary_int(p.op, x[tp_at(p.lx, i)], p.scalar); }
}
TP_KERNEL(tp_unary_bool, UnaryParams) {
    const bool* x = (const bool*)p.x;
    bool* out = (bool*)p.out;
    TP_LOOP(i, p.n) {
        bool v = x[tp_at(p.lx, i)];
        out[i] = p.op == U_NOT ? !v : v;
    }
}

enum BinaryOp { B_ADD = 0, B_SUB = 1, B_MUL = 2, B_DIV = 3, B_POW = 4, B_MAX = 5, B_MIN = 6,
                B_RELU_BACKWARD = 7 };

struct BinaryParams {
    u64 out;
    u64 a;
    u64 b;
    Strided la;
    Strided lb;
    i64 n;
    i64 op;
};

template <typename T> __device__ inline T tp_binary(i64 op, T x, T y) {
    switch (op) {
    case B_ADD: return tp_add(x, y);
    case B_SUB: return tp_sub(x, y);
    case B_MUL: return tp_mul(x, y);
    case B_DIV: return x / y;
    case B_POW: return tp_pow(x, y);
    case B_MAX: return (x >= y || x != x) ? x : y;
    case B_MIN: return (x <= y || x != x) ? x : y;
    case B_RELU_BACKWARD: return y > (T)0 ? x : (T)0;
    default: return x;
    }
}

#define TP_BINARY(name, T)                                                           \
    TP_KERNEL(name, BinaryParams) {                                                  \
        const T* a = (const T*)p.a;                                                  \
        const T* b = (const T*)p.b;                                                  \
        T* out = (T*)p.out;                                                          \
        TP_LOOP(i, p.n) { out[i] = tp_binary<T>(p.op, a[tp_at(p.la, i)], b[tp_at(p.lb, i)]); } \
    }
TP_BINARY(tp_binary_f32, float)
TP_BINARY(tp_binary_f64, double)
TP_BINARY(tp_binary_i64, i64)
#define TP_BINARY_HALF(name, H)                                                      \
    TP_KERNEL(name, BinaryParams) {                                                  \
        const H* a = (const H*)p.a;                                                  \
        const H* b = (const H*)p.b;                                                  \
        H* out = (H*)p.out;                                                          \
        TP_LOOP(i, p.n) {                                                            \
            out[i] = tp_down<H>(tp_binary<float>(p.op, tp_up(a[tp_at(p.la, i)]),     \
                                                 tp_up(b[tp_at(p.lb, i)])));         \
        }                                                                            \
    }
TP_BINARY_HALF(tp_binary_bf16, tp_bf16)
TP_BINARY_HALF(tp_binary_f16, tp_f16)

enum CmpOp { C_EQ = 0, C_NE = 1, C_LT = 2, C_LE = 3, C_GT = 4, C_GE = 5 };

// a comparison of two strided operands (b != 0), in their own type, or of `a` with a scalar
// (b == 0), compared as doubles: as the CPU does
struct CmpParams {
    u64 out;
    u64 a;
    u64 b;
    Strided la;
    Strided lb;
    i64 n;
    i64 op;
    double scalar;
};

template <typename T> __device__ inline bool tp_cmp(i64 op, T x, T y) {
    switch (op) {
    case C_EQ: return x == y;
    case C_NE: return x != y;
    case C_LT: return x < y;
    case C_LE: return x <= y;
    case C_GT: return x > y;
    default: return x >= y;
    }
}

#define TP_CMP(name, T)                                                                  \
    TP_KERNEL(name, CmpParams) {                                                         \
        const T* a = (const T*)p.a;                                                      \
        const T* b = (const T*)p.b;                                                      \
        bool* out = (bool*)p.out;                                                        \
        TP_LOOP(i, p.n) {                                                                \
            T x = a[tp_at(p.la, i)];                                                     \
            out[i] = p.b ? tp_cmp(p.op, tp_up(x), tp_up(b[tp_at(p.lb, i)]))              \
                         : tp_cmp<double>(p.op, tp_to_f64(x), p.scalar);                 \
        }                                                                                \
    }
TP_CMP(tp_cmp_f32, float)
TP_CMP(tp_cmp_f64, double)
TP_CMP(tp_cmp_i64, i64)
TP_CMP(tp_cmp_bool, bool)
TP_CMP(tp_cmp_bf16, tp_bf16)
TP_CMP(tp_cmp_f16, tp_f16)

// out[i] = cond[i] ? a[i] : b[i], all three strided (broadcast) to the output's shape
struct WhereParams {
    u64 out;
    u64 cond;
    u64 a;
    u64 b;
    Strided lc;
    Strided la;
    Strided lb;
    i64 n;
};

#define TP_WHERE(name, T)                                                                    \
    TP_KERNEL(name, WhereParams) {                                                           \
        const bool* c = (const bool*)p.cond;                                                 \
        const T* a = (const T*)p.a;                                                          \
        const T* b = (const T*)p.b;                                                          \
        T* out = (T*)p.out;                                                                  \
        TP_LOOP(i, p.n) { out[i] = c[tp_at(p.lc, i)] ? a[tp_at(p.la, i)] : b[tp_at(p.lb, i)]; } \
    }
TP_WHERE(tp_where_f32, float)
TP_WHERE(tp_where_f64, double)
TP_WHERE(tp_where_i64, i64)
TP_WHERE(tp_where_bool, bool)
TP_WHERE(tp_where_bf16, tp_bf16)
TP_WHERE(tp_where_f16, tp_f16)

// out (strided, the destination view) <- x (strided, broadcast to out's shape), converting the
// element type; a contiguous `lo` makes this a gather into a new tensor (copies, casts), a
// strided one an in-place assignment into a view
struct CopyParams {
    u64 out;
    u64 x;
    Strided lo;
    Strided lx;
    i64 n;
};

#define TP_COPY(name, S, D)                                                                   \
    TP_KERNEL(name, CopyParams) {                                                             \
        const S* x = (const S*)p.x;                                                           \
        D* out = (D*)p.out;                                                                   \
        TP_LOOP(i, p.n) { out[tp_at(p.lo, i)] = tp_cast<D, S>(x[tp_at(p.lx, i)]); } \
    }
#define TP_COPY_FROM(S, sname)                \
    TP_COPY(tp_copy_##sname##_f32, S, float)  \
    TP_COPY(tp_copy_##sname##_f64, S, double) \
    TP_COPY(tp_copy_##sname##_i64, S, i64)    \
    TP_COPY(tp_copy_##sname##_bool, S, bool)  \
    TP_COPY(tp_copy_##sname##_bf16, S, tp_bf16) \
    TP_COPY(tp_copy_##sname##_f16, S, tp_f16)
TP_COPY_FROM(float, f32)
TP_COPY_FROM(double, f64)
TP_COPY_FROM(i64, i64)
TP_COPY_FROM(bool, bool)
TP_COPY_FROM(tp_bf16, bf16)
TP_COPY_FROM(tp_f16, f16)

// ---------------------------------------------------------------------------------------------
// reductions
//
// `m` outputs, each over `k` elements. Output j's elements are x[tp_at(lo, j) - lo.offset +
// tp_at(lk, r)] for r in 0..k (lo: the kept dims, lk: the reduced dims; both carry the view's
// strides, the view's offset sits in lk). Thread t reduces the chunk c = t % parts of output
// j = t / parts: r in [c * chunk, min(k, (c + 1) * chunk)), writing partial t (and, for arg
// ops, the index of its winner in `idx_out`). A first launch with parts > 1 is followed by a
// second over the contiguous [m, parts] partials (lo contiguous, idx_in = the first's indices).

enum ReduceOp { R_SUM = 0, R_MAX = 1, R_MIN = 2 };

struct ReduceParams {
    u64 out;
    u64 idx_out;  // i64 winners' indices, or 0
    u64 x;
    u64 idx_in;   // i64 indices of x's elements (a second launch), or 0: r itself
    Strided lo;
    Strided lk;
    i64 m;
    i64 k;
    i64 parts;
    i64 chunk;
    i64 op;
};

// T: the type computed in; S: x's element type; D: out's (a 16-bit type computes in float32,
// its partial sums stay float32 between the launches and the result rounds once)
template <typename T, typename S, typename D> __device__ inline void tp_reduce(const ReduceParams& p) {
    const S* x = (const S*)p.x;
    D* out = (D*)p.out;
    i64* idx_out = (i64*)p.idx_out;
    const i64* idx_in = (const i64*)p.idx_in;
    TP_LOOP(t, p.m * p.parts) {
        i64 j = t / p.parts, c = t % p.parts;
        i64 base = tp_at(p.lo, j) - p.lo.offset;
        i64 r0 = c * p.chunk, r1 = r0 + p.chunk < p.k ? r0 + p.chunk : p.k;
        T best = (T)0;
        i64 best_i = 0;
        bool have = false;
        for (i64 r = r0; r < r1; ++r) {
            T v = tp_up(x[base + tp_at(p.lk, r)]);
            i64 vi = idx_in ? idx_in[j * p.k + r] : r;
            if (p.op == R_SUM) {
                best = have ? tp_add(best, v) : v;
                have = true;
                continue;
            }
            bool replace;
            if (!have) replace = true;
            else if (best != best) replace = false;  // the first NaN wins
            else replace = (v != v) || (p.op == R_MAX ? v > best : v < best);
            if (replace) { best = v; best_i = vi; }
            have = true;
        }
        out[t] = tp_down<D>(best);
        if (idx_out) idx_out[t] = best_i;
    }
}
TP_KERNEL(tp_reduce_f32, ReduceParams) { tp_reduce<float, float, float>(p); }
TP_KERNEL(tp_reduce_f64, ReduceParams) { tp_reduce<double, double, double>(p); }
TP_KERNEL(tp_reduce_i64, ReduceParams) { tp_reduce<i64, i64, i64>(p); }
// a 16-bit reduction: in one launch, or a first into float32 partials and a second from them
TP_KERNEL(tp_reduce_bf16, ReduceParams) { tp_reduce<float, tp_bf16, tp_bf16>(p); }
TP_KERNEL(tp_reduce_bf16_part, ReduceParams) { tp_reduce<float, tp_bf16, float>(p); }
TP_KERNEL(tp_reduce_bf16_final, ReduceParams) { tp_reduce<float, float, tp_bf16>(p); }
TP_KERNEL(tp_reduce_f16, ReduceParams) { tp_reduce<float, tp_f16, tp_f16>(p); }
TP_KERNEL(tp_reduce_f16_part, ReduceParams) { tp_reduce<float, tp_f16, float>(p); }
TP_KERNEL(tp_reduce_f16_final, ReduceParams) { tp_reduce<float, float, tp_f16>(p); }

// ---------------------------------------------------------------------------------------------
// indexing
//
// All three see x as [outer, size, inner] around dimension `dim` (contiguous operands: the plan
// copies strided ones first). index_select: out[o, j, i] = x[o, idx[j], i] with out's middle
// size `count`. gather: out[o, j, i] = x[o, idx[o, j, i], i]. scatter_add: out[o, idx[o, j, i],
// i] += src[o, j, i] (atomically: the order of float additions is not fixed).

struct IndexParams {
    u64 out;
    u64 x;
    u64 idx;
    i64 outer;
    i64 size;   // x's (index_select, gather) or out's (scatter_add) size along dim
    i64 count;  // the index's size along dim
    i64 inner;
};

#define TP_INDEX_SELECT(name, T)                                       \
    TP_KERNEL(name, IndexParams) {                                     \
        const T* x = (const T*)p.x;                                    \
        const i64* idx = (const i64*)p.idx;                            \
        T* out = (T*)p.out;                                            \
        TP_LOOP(t, p.outer * p.count * p.inner) {                      \
            i64 i = t % p.inner, j = (t / p.inner) % p.count;          \
            i64 o = t / (p.inner * p.count);                           \
            out[t] = x[(o * p.size + idx[j]) * p.inner + i];           \
        }                                                              \
    }
#define TP_GATHER(name, T)                                             \
    TP_KERNEL(name, IndexParams) {                                     \
        const T* x = (const T*)p.x;                                    \
        const i64* idx = (const i64*)p.idx;                            \
        T* out = (T*)p.out;                                            \
        TP_LOOP(t, p.outer * p.count * p.inner) {                      \
            i64 i = t % p.inner, o = t / (p.inner * p.count);          \
            out[t] = x[(o * p.size + idx[t]) * p.inner + i];           \
        }                                                              \
    }
TP_INDEX_SELECT(tp_index_select_f32, float)
TP_INDEX_SELECT(tp_index_select_f64, double)
TP_INDEX_SELECT(tp_index_select_i64, i64)
TP_INDEX_SELECT(tp_index_select_bool, bool)
TP_GATHER(tp_gather_f32, float)
TP_GATHER(tp_gather_f64, double)
TP_GATHER(tp_gather_i64, i64)
TP_GATHER(tp_gather_bool, bool)
TP_INDEX_SELECT(tp_index_select_bf16, tp_bf16)
TP_INDEX_SELECT(tp_index_select_f16, tp_f16)
TP_GATHER(tp_gather_bf16, tp_bf16)
TP_GATHER(tp_gather_f16, tp_f16)

__device__ inline void tp_atomic_add(float* a, float v) { atomicAdd(a, v); }
__device__ inline void tp_atomic_add(double* a, double v) { atomicAdd(a, v); }
__device__ inline void tp_atomic_add(i64* a, i64 v) { atomicAdd((u64*)a, (u64)v); }
// a 16-bit add, in float32 rounded once, by compare-and-swap of the aligned 32-bit word holding
// the element (any architecture); the host emulation runs one thread at a time and adds in place
template <typename H> __device__ inline void tp_atomic_add_half(H* a, H v) {
#ifdef TP_EMULATE
    *a = tp_down<H>(tp_up(*a) + tp_up(v));
#else
    u32* word = (u32*)((u64)a & ~3ULL);
    u32 shift = ((u64)a & 2ULL) ? 16u : 0u;
    u32 old = *word, assumed;
    do {
        assumed = old;
        H cur = H{(unsigned short)(assumed >> shift)};
        H sum = tp_down<H>(tp_up(cur) + tp_up(v));
        u32 next = (assumed & ~(0xffffu << shift)) | ((u32)sum.bits << shift);
        old = atomicCAS(word, assumed, next);
    } while (assumed != old);
#endif
}
__device__ inline void tp_atomic_add(tp_bf16* a, tp_bf16 v) { tp_atomic_add_half(a, v); }
__device__ inline void tp_atomic_add(tp_f16* a, tp_f16 v) { tp_atomic_add_half(a, v); }

#define TP_SCATTER_ADD(name, T)                                        \
    TP_KERNEL(name, IndexParams) {                                     \
        const T* src = (const T*)p.x;                                  \
        const i64* idx = (const i64*)p.idx;                            \
        T* out = (T*)p.out;                                            \
        TP_LOOP(t, p.outer * p.count * p.inner) {                      \
            i64 i = t % p.inner, o = t / (p.inner * p.count);          \
            tp_atomic_add(&out[(o * p.size + idx[t]) * p.inner + i], src[t]); \
        }                                                              \
    }
TP_SCATTER_ADD(tp_scatter_add_f32, float)
TP_SCATTER_ADD(tp_scatter_add_f64, double)
TP_SCATTER_ADD(tp_scatter_add_i64, i64)
TP_SCATTER_ADD(tp_scatter_add_bf16, tp_bf16)
TP_SCATTER_ADD(tp_scatter_add_f16, tp_f16)

// ---------------------------------------------------------------------------------------------
// cross-entropy over contiguous logits [rows, classes], per row as the CPU computes it: the
// shift is the row's max ignoring NaN (0 when not finite), probs = exp(x - shift) * (1 / sum),
// loss = (shift + log(sum)) - x[target]

struct CrossEntropyParams {
    u64 loss;   // [rows]
    u64 probs;  // [rows, classes]
    u64 x;
    u64 target; // i64 [rows]
    i64 rows;
    i64 classes;
};

// T: the type computed in (float32 for the 16-bit types), S: the logits' and outputs' type
template <typename T, typename S> __device__ inline void tp_cross_entropy(const CrossEntropyParams& p) {
    const S* x = (const S*)p.x;
    const i64* target = (const i64*)p.target;
    S* loss = (S*)p.loss;
    S* probs = (S*)p.probs;
    TP_LOOP(r, p.rows) {
        const S* row = x + r * p.classes;
        S* pr = probs + r * p.classes;
        T mx = -(T)1 / (T)0;
        for (i64 c = 0; c < p.classes; ++c) {
            T v = tp_up(row[c]);
            mx = v > mx ? v : mx;
        }
        T shift = (mx - mx == (T)0) ? mx : (T)0;
        T sum = (T)0;
        for (i64 c = 0; c < p.classes; ++c) sum = sum + tp_exp(tp_up(row[c]) - shift);
        T inv = (T)1 / sum;
        // the exponentials again (the same values): a 16-bit probs buffer cannot hold them exactly
        for (i64 c = 0; c < p.classes; ++c) pr[c] = tp_down<S>(tp_exp(tp_up(row[c]) - shift) * inv);
        loss[r] = tp_down<S>((shift + tp_log(sum)) - tp_up(row[target[r]]));
    }
}
TP_KERNEL(tp_cross_entropy_f32, CrossEntropyParams) { tp_cross_entropy<float, float>(p); }
TP_KERNEL(tp_cross_entropy_f64, CrossEntropyParams) { tp_cross_entropy<double, double>(p); }
TP_KERNEL(tp_cross_entropy_bf16, CrossEntropyParams) { tp_cross_entropy<float, tp_bf16>(p); }
TP_KERNEL(tp_cross_entropy_f16, CrossEntropyParams) { tp_cross_entropy<float, tp_f16>(p); }

// ---------------------------------------------------------------------------------------------
// dropout: Philox-4x32-10 (Salmon et al. 2011) keyed by (seed), counter (offset + i / 4): the
// same seed and offset give the same mask on every device of every generation. mask[i] =
// uniform(i) >= p (kept), as a bool.

struct DropoutParams {
    u64 mask;
    i64 n;
    u64 seed;
    u64 offset;
    double p;
};

__device__ inline u32 tp_mulhi(u32 a, u32 b) { return (u32)(((u64)a * (u64)b) >> 32); }

__device__ inline void tp_philox(u32 key0, u32 key1, u32 ctr[4]) {
    for (int round = 0; round < 10; ++round) {
        u32 hi0 = tp_mulhi(0xD2511F53u, ctr[0]), lo0 = 0xD2511F53u * ctr[0];
        u32 hi1 = tp_mulhi(0xCD9E8D57u, ctr[2]), lo1 = 0xCD9E8D57u * ctr[2];
        u32 c0 = hi1 ^ ctr[1] ^ key0, c1 = lo1, c2 = hi0 ^ ctr[3] ^ key1, c3 = lo0;
        ctr[0] = c0; ctr[1] = c1; ctr[2] = c2; ctr[3] = c3;
        key0 += 0x9E3779B9u;
        key1 += 0xBB67AE85u;
    }
}

TP_KERNEL(tp_dropout_mask, DropoutParams) {
    bool* mask = (bool*)p.mask;
    TP_LOOP(i, p.n) {
        u64 c = p.offset + (u64)(i / 4);
        u32 ctr[4] = {(u32)c, (u32)(c >> 32), 0u, 0u};
        tp_philox((u32)p.seed, (u32)(p.seed >> 32), ctr);
        double u = (double)ctr[i % 4] * (1.0 / 4294967296.0);
        mask[i] = u >= p.p;
    }
}

// ---------------------------------------------------------------------------------------------
// optimizer updates, fused: one launch per parameter over contiguous param, grad and state, with
// the CPU's arithmetic in the CPU's order (so f64 results are bit-identical)

struct SgdParams {
    u64 param;
    u64 grad;
    u64 momentum_buf;  // 0 without momentum
    i64 n;
    i64 first;         // 1 on the first step with momentum: the buffer starts as the gradient
    i64 nesterov;
    double lr;
    double momentum;
    double dampening;
    double weight_decay;
};

template <typename T> __device__ inline void tp_sgd(const SgdParams& p) {
    T* w = (T*)p.param;
    const T* gr = (const T*)p.grad;
    T* buf = (T*)p.momentum_buf;
    const T lr = (T)p.lr, wd = (T)p.weight_decay, mom = (T)p.momentum;
    const T one_minus_damp = (T)1 - (T)p.dampening;
    TP_LOOP(i, p.n) {
        T d = p.weight_decay != 0.0 ? gr[i] + wd * w[i] : gr[i];
        if (buf) {
            T b = p.first ? d : mom * buf[i] + one_minus_damp * d;
            buf[i] = b;
            d = p.nesterov ? d + mom * b : b;
        }
        w[i] = w[i] - lr * d;
    }
}
TP_KERNEL(tp_sgd_f32, SgdParams) { tp_sgd<float>(p); }
TP_KERNEL(tp_sgd_f64, SgdParams) { tp_sgd<double>(p); }

struct AdamParams {
    u64 param;
    u64 grad;
    u64 exp_avg;
    u64 exp_avg_sq;
    u64 max_exp_avg_sq;  // 0 without AMSGrad
    i64 n;
    i64 decoupled;       // AdamW's decoupled weight decay
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
    double decay;        // 1 - lr * weight_decay
    double step_size;    // lr / (1 - beta1^step)
    double bias_c2_sqrt; // sqrt(1 - beta2^step)
};

template <typename T> __device__ inline void tp_adam(const AdamParams& p) {
    T* w = (T*)p.param;
    const T* gr = (const T*)p.grad;
    T* m = (T*)p.exp_avg;
    T* v = (T*)p.exp_avg_sq;
    T* vmax = (T*)p.max_exp_avg_sq;
    const T b1 = (T)p.beta1, b2 = (T)p.beta2, one_b1 = (T)(1.0 - p.beta1),
            one_b2 = (T)(1.0 - p.beta2), eps = (T)p.eps, wd = (T)p.weight_decay,
            decay = (T)p.decay, step_size = (T)p.step_size, bc2 = (T)p.bias_c2_sqrt;
    TP_LOOP(i, p.n) {
        T g = gr[i];
        T x = w[i];
        if (p.weight_decay != 0.0) {
            if (p.decoupled) x = x * decay;
            else g = g + wd * x;
        }
        T mj = b1 * m[i] + one_b1 * g;
        T vj = b2 * v[i] + one_b2 * g * g;
        m[i] = mj;
        v[i] = vj;
        T vd = vj;
        if (vmax) {
            vd = vmax[i] > vj ? vmax[i] : vj;
            vmax[i] = vd;
        }
        T denom = tp_sqrt(vd) / bc2 + eps;
        w[i] = x - step_size * (mj / denom);
    }
}
TP_KERNEL(tp_adam_f32, AdamParams) { tp_adam<float>(p); }
TP_KERNEL(tp_adam_f64, AdamParams) { tp_adam<double>(p); }
