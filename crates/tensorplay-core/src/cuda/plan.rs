//! Launch plans: which kernel of `kernels/tensorplay.cu` runs, with which parameter struct and
//! how many threads, for each operation on device memory. Pure: no driver, no memory, so the
//! same plans run on a GPU (`real.rs`) and in the host emulation of the kernels that tests
//! use without one (`emulator.rs`). The `#[repr(C)]` structs mirror the kernels' structs field
//! for field.

use crate::backend::{BinaryCode, CmpCode, ReduceCode, UnaryCode};
use crate::{DType, Error, Layout, Result};

mod gemm;
pub(crate) use gemm::{Gemm, gemm};

/// The most dims a strided operand can have after merging (the kernels' `TP_MAX_DIMS`).
pub(crate) const MAX_DIMS: usize = 8;
/// Threads per block of every launch.
pub(crate) const BLOCK: u32 = 256;
/// The most blocks of one launch (the grid-stride loops cover the rest).
const MAX_GRID: usize = 1 << 16;

/// A strided operand (the kernels' `Strided`): element strides, 0 when broadcast.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Strided {
    ndim: i64,
    offset: i64,
    shape: [i64; MAX_DIMS],
    strides: [i64; MAX_DIMS],
}

impl Strided {
    /// `l` with its mergeable dims merged (fewer dims, less index arithmetic per element).
    ///
    /// # Errors
    /// `NotSupported` naming `op` when more than [`MAX_DIMS`] dims remain.
    pub(crate) fn new(l: &Layout, op: &'static str) -> Result<Strided> {
        let mut dims: Vec<(usize, usize)> = Vec::with_capacity(l.shape.len());
        for (&n, &s) in l.shape.iter().zip(&l.strides) {
            if n == 1 {
                continue;
            }
            match dims.last_mut() {
                Some((pn, ps)) if *ps == s * n => {
                    *pn *= n;
                    *ps = s;
                }
                _ => dims.push((n, s)),
            }
        }
        if dims.len() > MAX_DIMS {
            return Err(Error::NotSupported {
                op,
                detail: format!(
                    "on CUDA tensors with more than {MAX_DIMS} non-mergeable dims (shape {:?}, \
                     strides {:?}); call .contiguous() first (it copies such views through \
                     the host)",
                    l.shape, l.strides
                ),
            });
        }
        let mut out = Strided {
            ndim: dims.len() as i64,
            offset: l.offset as i64,
            ..Strided::default()
        };
        for (d, (n, s)) in dims.into_iter().enumerate() {
            out.shape[d] = n as i64;
            out.strides[d] = s as i64;
        }
        Ok(out)
    }

    /// A contiguous operand of `n` elements.
    pub(crate) fn flat(n: usize) -> Strided {
        let mut out = Strided {
            ndim: 1,
            ..Strided::default()
        };
        out.shape[0] = n.max(1) as i64;
        out.strides[0] = 1;
        out
    }
}

/// The kernels' parameter structs, one per kernel family.
#[allow(missing_docs)]
pub(crate) mod params {
    use super::Strided;

    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Unary {
        pub out: u64,
        pub x: u64,
        pub lx: Strided,
        pub n: i64,
        pub op: i64,
        pub scalar: f64,
    }
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Binary {
        pub out: u64,
        pub a: u64,
        pub b: u64,
        pub la: Strided,
        pub lb: Strided,
        pub n: i64,
        pub op: i64,
    }
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Cmp {
        pub out: u64,
        pub a: u64,
        pub b: u64,
        pub la: Strided,
        pub lb: Strided,
        pub n: i64,
        pub op: i64,
        pub scalar: f64,
    }
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Where {
        pub out: u64,
        pub cond: u64,
        pub a: u64,
        pub b: u64,
        pub lc: Strided,
        pub la: Strided,
        pub lb: Strided,
        pub n: i64,
    }
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Copy {
        pub out: u64,
        pub x: u64,
        pub lo: Strided,
        pub lx: Strided,
        pub n: i64,
    }
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Reduce {
        pub out: u64,
        pub idx_out: u64,
        pub x: u64,
        pub idx_in: u64,
        pub lo: Strided,
        pub lk: Strided,
        pub m: i64,
        pub k: i64,
        pub parts: i64,
        pub chunk: i64,
        pub op: i64,
    }
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Index {
        pub out: u64,
        pub x: u64,
        pub idx: u64,
        pub outer: i64,
        pub size: i64,
        pub count: i64,
        pub inner: i64,
    }
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct CrossEntropy {
        pub loss: u64,
        pub probs: u64,
        pub x: u64,
        pub target: u64,
        pub rows: i64,
        pub classes: i64,
    }
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Dropout {
        pub mask: u64,
        pub n: i64,
        pub seed: u64,
        pub offset: u64,
        pub p: f64,
    }
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Sgd {
        pub param: u64,
        pub grad: u64,
        pub momentum_buf: u64,
        pub n: i64,
        pub first: i64,
        pub nesterov: i64,
        pub lr: f64,
        pub momentum: f64,
        pub dampening: f64,
        pub weight_decay: f64,
    }
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Adam {
        pub param: u64,
        pub grad: u64,
        pub exp_avg: u64,
        pub exp_avg_sq: u64,
        pub max_exp_avg_sq: u64,
        pub n: i64,
        pub decoupled: i64,
        pub beta1: f64,
        pub beta2: f64,
        pub eps: f64,
        pub weight_decay: f64,
        pub decay: f64,
        pub step_size: f64,
        pub bias_c2_sqrt: f64,
    }
}

/// One kernel launch: the kernel's name, its parameters and the threads it needs.
#[derive(Debug, Clone)]
pub(crate) struct Launch {
    pub(crate) kernel: String,
    pub(crate) params: Params,
    /// Threads wanted (one per element or output); the grid is capped, loops cover the rest.
    pub(crate) threads: usize,
}

impl Launch {
    /// Blocks of [`BLOCK`] threads.
    pub(crate) fn grid(&self) -> u32 {
        self.threads.div_ceil(BLOCK as usize).clamp(1, MAX_GRID) as u32
    }
}

/// The parameter struct of a launch.
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub(crate) enum Params {
    Unary(params::Unary),
    Binary(params::Binary),
    Cmp(params::Cmp),
    Where(params::Where),
    Copy(params::Copy),
    Reduce(params::Reduce),
    Index(params::Index),
    CrossEntropy(params::CrossEntropy),
    Dropout(params::Dropout),
    Sgd(params::Sgd),
    Adam(params::Adam),
}

impl Params {
    /// The struct's bytes, as the kernel receives them (the host emulation's input).
    #[cfg_attr(not(all(test, feature = "cuda-emulator")), allow(dead_code))]
    pub(crate) fn bytes(&self) -> &[u8] {
        fn raw<T>(v: &T) -> &[u8] {
            // SAFETY: every params struct is #[repr(C)] plain data (integers and floats, with
            // no padding-dependent meaning); reading its bytes is what the driver does too.
            unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }
        }
        match self {
            Params::Unary(p) => raw(p),
            Params::Binary(p) => raw(p),
            Params::Cmp(p) => raw(p),
            Params::Where(p) => raw(p),
            Params::Copy(p) => raw(p),
            Params::Reduce(p) => raw(p),
            Params::Index(p) => raw(p),
            Params::CrossEntropy(p) => raw(p),
            Params::Dropout(p) => raw(p),
            Params::Sgd(p) => raw(p),
            Params::Adam(p) => raw(p),
        }
    }
}

/// The kernels' dtype suffix.
pub(crate) fn suffix(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::I64 => "i64",
        DType::Bool => "bool",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
    }
}

/// `out[i] = op(x[i])` over `x`'s view (`out` contiguous, `n` elements).
pub(crate) fn unary(
    dt: DType,
    out: u64,
    x: u64,
    lx: &Layout,
    op: UnaryCode,
    scalar: f64,
    name: &'static str,
) -> Result<Launch> {
    let n = lx.numel();
    Ok(Launch {
        kernel: format!("tp_unary_{}", suffix(dt)),
        params: Params::Unary(params::Unary {
            out,
            x,
            lx: Strided::new(lx, name)?,
            n: n as i64,
            op: op as i64,
            scalar,
        }),
        threads: n,
    })
}

/// `out[i] = op(a[i], b[i])`, `la` and `lb` already broadcast to the output's shape.
pub(crate) fn binary(
    dt: DType,
    out: u64,
    (a, la): (u64, &Layout),
    (b, lb): (u64, &Layout),
    op: BinaryCode,
    name: &'static str,
) -> Result<Launch> {
    let n = la.numel();
    Ok(Launch {
        kernel: format!("tp_binary_{}", suffix(dt)),
        params: Params::Binary(params::Binary {
            out,
            a,
            b,
            la: Strided::new(la, name)?,
            lb: Strided::new(lb, name)?,
            n: n as i64,
            op: op as i64,
        }),
        threads: n,
    })
}

/// `out[i] = a[i] op b[i]` (bool out); `b = None` compares with `scalar`.
pub(crate) fn compare(
    dt: DType,
    out: u64,
    (a, la): (u64, &Layout),
    b: Option<(u64, &Layout)>,
    op: CmpCode,
    scalar: f64,
    name: &'static str,
) -> Result<Launch> {
    let n = la.numel();
    let (b, lb) = match b {
        Some((p, l)) => (p, Strided::new(l, name)?),
        None => (0, Strided::flat(1)),
    };
    Ok(Launch {
        kernel: format!("tp_cmp_{}", suffix(dt)),
        params: Params::Cmp(params::Cmp {
            out,
            a,
            b,
            la: Strided::new(la, name)?,
            lb,
            n: n as i64,
            op: op as i64,
            scalar,
        }),
        threads: n,
    })
}

/// `out[i] = cond[i] ? a[i] : b[i]`, all broadcast to the output's shape.
pub(crate) fn select(
    dt: DType,
    out: u64,
    (c, lc): (u64, &Layout),
    (a, la): (u64, &Layout),
    (b, lb): (u64, &Layout),
) -> Result<Launch> {
    let n = la.numel();
    Ok(Launch {
        kernel: format!("tp_where_{}", suffix(dt)),
        params: Params::Where(params::Where {
            out,
            cond: c,
            a,
            b,
            lc: Strided::new(lc, "where")?,
            la: Strided::new(la, "where")?,
            lb: Strided::new(lb, "where")?,
            n: n as i64,
        }),
        threads: n,
    })
}

/// `out` (the view `lo`) `<- x` (the view `lx`, same shape), converting `from` to `to`.
pub(crate) fn copy(
    (from, x, lx): (DType, u64, &Layout),
    (to, out, lo): (DType, u64, &Layout),
    name: &'static str,
) -> Result<Launch> {
    let n = lx.numel();
    Ok(Launch {
        kernel: format!("tp_copy_{}_{}", suffix(from), suffix(to)),
        params: Params::Copy(params::Copy {
            out,
            x,
            lo: Strided::new(lo, name)?,
            lx: Strided::new(lx, name)?,
            n: n as i64,
        }),
        threads: n,
    })
}

/// The shape of a reduction: `m` outputs of `k` elements each.
#[derive(Debug, Clone)]
pub(crate) struct ReduceShape {
    /// The kept dims (shape and the view's strides), offset 0.
    pub(crate) kept: Layout,
    /// The reduced dims (shape and the view's strides), with the view's offset.
    pub(crate) reduced: Layout,
}

impl ReduceShape {
    /// Splits `l` into kept and reduced dims (`dims` sorted, distinct).
    pub(crate) fn new(l: &Layout, dims: &[usize]) -> ReduceShape {
        let pick = |keep: bool| {
            let (shape, strides): (Vec<usize>, Vec<usize>) = (0..l.shape.len())
                .filter(|d| dims.contains(d) != keep)
                .map(|d| (l.shape[d], l.strides[d]))
                .unzip();
            (shape, strides)
        };
        let (ks, kst) = pick(true);
        let (rs, rst) = pick(false);
        ReduceShape {
            kept: Layout {
                shape: ks,
                strides: kst,
                offset: 0,
            },
            reduced: Layout {
                shape: rs,
                strides: rst,
                offset: l.offset,
            },
        }
    }
    pub(crate) fn m(&self) -> usize {
        self.kept.numel()
    }
    pub(crate) fn k(&self) -> usize {
        self.reduced.numel()
    }
}

/// How a reduction of `m` outputs over `k` elements splits: `parts` chunks of `chunk` each
/// per output (1 part: a single launch).
pub(crate) fn reduce_split(m: usize, k: usize) -> (usize, usize) {
    if k <= 1024 || m >= 1 << 15 {
        return (1, k.max(1));
    }
    let parts = k.div_ceil(256).min(((1usize << 16) / m.max(1)).max(1));
    let chunk = k.div_ceil(parts);
    (k.div_ceil(chunk), chunk)
}

/// The dtype of a split reduction's partial results: float32 for the 16-bit types (their sums
/// accumulate in float32 and round once), the input's own otherwise.
pub(crate) fn reduce_scratch(dt: DType) -> DType {
    if dt.is_half() { DType::F32 } else { dt }
}

/// The launches of a reduction into `out` (`m` values) and, for arg ops, `idx_out` (`m` int64
/// indices into the reduced dims' row-major order). `scratch` holds `m * parts` values and, for
/// arg ops, as many indices (the first launch's partial results; unused when `parts` is 1).
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce(
    dt: DType,
    x: u64,
    shape: &ReduceShape,
    op: ReduceCode,
    (out, idx_out): (u64, u64),
    (scratch, scratch_idx): (u64, u64),
    (parts, chunk): (usize, usize),
    name: &'static str,
) -> Result<Vec<Launch>> {
    let (m, k) = (shape.m(), shape.k());
    // no empty chunk: its neutral value would take part in the second launch
    let chunk = chunk.max(1);
    let parts = parts.min(k.div_ceil(chunk)).max(1);
    let kernel = format!("tp_reduce_{}", suffix(dt));
    // a 16-bit reduction keeps float32 partials (see `reduce_scratch`), one kernel each side
    let (first_kernel, second_kernel) = if dt.is_half() {
        (format!("{kernel}_part"), format!("{kernel}_final"))
    } else {
        (kernel.clone(), kernel.clone())
    };
    let lo = Strided::new(&shape.kept, name)?;
    let lk = Strided::new(&shape.reduced, name)?;
    if parts <= 1 {
        return Ok(vec![Launch {
            kernel,
            params: Params::Reduce(params::Reduce {
                out,
                idx_out,
                x,
                idx_in: 0,
                lo,
                lk,
                m: m as i64,
                k: k as i64,
                parts: 1,
                chunk: k as i64,
                op: op as i64,
            }),
            threads: m,
        }]);
    }
    let first = Launch {
        kernel: first_kernel,
        params: Params::Reduce(params::Reduce {
            out: scratch,
            idx_out: scratch_idx,
            x,
            idx_in: 0,
            lo,
            lk,
            m: m as i64,
            k: k as i64,
            parts: parts as i64,
            chunk: chunk as i64,
            op: op as i64,
        }),
        threads: m * parts,
    };
    let rows = Layout {
        shape: vec![m],
        strides: vec![parts],
        offset: 0,
    };
    let second = Launch {
        kernel: second_kernel,
        params: Params::Reduce(params::Reduce {
            out,
            idx_out,
            x: scratch,
            idx_in: scratch_idx,
            lo: Strided::new(&rows, name)?,
            lk: Strided::flat(parts),
            m: m as i64,
            k: parts as i64,
            parts: 1,
            chunk: parts as i64,
            op: op as i64,
        }),
        threads: m,
    };
    Ok(vec![first, second])
}

/// The index kernels (`index_select`, `gather`, `scatter_add`) over contiguous operands seen
/// as `[outer, size, inner]` around the indexed dim, with `count` indices along it.
pub(crate) fn index(
    kind: &str,
    dt: DType,
    (out, x, idx): (u64, u64, u64),
    (outer, size, count, inner): (usize, usize, usize, usize),
) -> Launch {
    Launch {
        kernel: format!("tp_{kind}_{}", suffix(dt)),
        params: Params::Index(params::Index {
            out,
            x,
            idx,
            outer: outer as i64,
            size: size as i64,
            count: count as i64,
            inner: inner as i64,
        }),
        threads: outer * count * inner,
    }
}

/// Row-wise cross-entropy of contiguous logits `[rows, classes]` with int64 targets.
pub(crate) fn cross_entropy(
    dt: DType,
    (loss, probs, x, target): (u64, u64, u64, u64),
    rows: usize,
    classes: usize,
) -> Launch {
    Launch {
        kernel: format!("tp_cross_entropy_{}", suffix(dt)),
        params: Params::CrossEntropy(params::CrossEntropy {
            loss,
            probs,
            x,
            target,
            rows: rows as i64,
            classes: classes as i64,
        }),
        threads: rows,
    }
}

/// A dropout keep-mask of `n` bools from Philox-4x32-10 at (`seed`, `offset`).
pub(crate) fn dropout_mask(mask: u64, n: usize, seed: u64, offset: u64, p: f64) -> Launch {
    Launch {
        kernel: "tp_dropout_mask".into(),
        params: Params::Dropout(params::Dropout {
            mask,
            n: n as i64,
            seed,
            offset,
            p,
        }),
        threads: n,
    }
}

/// One fused SGD update of a contiguous parameter.
pub(crate) fn sgd(dt: DType, p: params::Sgd) -> Launch {
    Launch {
        kernel: format!("tp_sgd_{}", suffix(dt)),
        threads: p.n as usize,
        params: Params::Sgd(p),
    }
}

/// One fused Adam/AdamW update of a contiguous parameter.
pub(crate) fn adam(dt: DType, p: params::Adam) -> Launch {
    Launch {
        kernel: format!("tp_adam_{}", suffix(dt)),
        threads: p.n as usize,
        params: Params::Adam(p),
    }
}
