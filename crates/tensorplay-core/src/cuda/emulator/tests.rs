//! Every kernel family through its launch plan, on the host, against the CPU's operations.
//! Shapes, strides and values come from a fixed seed; each case names itself when it fails.
//! Tolerances (relative, with an absolute floor of the same size): float64 1e-12, float32
//! 2e-6 (the C library's and Rust's transcendental functions may differ by an ulp).

use super::run;
use crate::backend::{BinaryCode, CmpCode, ReduceCode, UnaryCode};
use crate::cuda::plan::{self, ReduceShape};
use crate::random::Generator;
use crate::storage::{CpuStorage, Storage, StorageElement};
use crate::{DType, Layout, Tensor};

/// The host address of `t`'s storage and its layout.
fn host(t: &Tensor) -> (u64, Layout) {
    t.with_storage(|s, l| {
        let Storage::Cpu(c) = s else {
            panic!("host tensors only")
        };
        let p = match c {
            CpuStorage::F32(v) => v.as_ptr() as u64,
            CpuStorage::F64(v) => v.as_ptr() as u64,
            CpuStorage::I64(v) => v.as_ptr() as u64,
            CpuStorage::Bool(v) => v.as_ptr() as u64,
            CpuStorage::BF16(v) => v.as_ptr() as u64,
            CpuStorage::F16(v) => v.as_ptr() as u64,
        };
        (p, l.clone())
    })
}

/// A contiguous output buffer of `n` elements of `dt` as a tensor of `shape`.
fn output(dt: DType, shape: &[usize]) -> Tensor {
    Tensor::zeros(shape, dt).expect("zeros")
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.to_vec::<f64>())
        .expect("values")
}

fn close(case: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.shape(), want.shape(), "{case}: shape");
    let (g, w) = (values(got), values(want));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let ok = (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= tol * b.abs().max(1.0);
        assert!(ok, "{case}: element {i}: kernel {a}, cpu {b}");
    }
}

/// The relative tolerance of computed (not copied) values: float64 1e-12, float32 2e-6, and
/// for the 16-bit types one unit in the last place (bfloat16 2^-7, float16 2^-10): they compute
/// in float32 and round once, and a float32 result an ulp apart from the CPU's (another libm)
/// may round to the neighbouring 16-bit value.
fn tol(dt: DType) -> f64 {
    match dt {
        DType::F32 => 2e-6,
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
        _ => 1e-12,
    }
}

/// A view of `shape` over fresh random values: contiguous, transposed, narrowed or expanded
/// (`kind` 0..4), so the kernels see non-unit and zero strides and offsets.
fn view(g: &mut Generator, shape: &[usize], dt: DType, kind: usize) -> Tensor {
    let make = |g: &mut Generator, s: &[usize]| {
        let n: usize = s.iter().product();
        let v: Vec<f64> = (0..n).map(|_| g.normal() * 2.0).collect();
        Tensor::from_vec(v, s)
            .and_then(|t| t.to_dtype(dt))
            .expect("tensor")
    };
    let nd = shape.len();
    match kind % 4 {
        1 if nd >= 2 => {
            let mut s = shape.to_vec();
            s.swap(nd - 2, nd - 1);
            make(g, &s).transpose(-2, -1).expect("transpose")
        }
        2 if nd >= 1 => {
            let mut s = shape.to_vec();
            s[0] += 2;
            make(g, &s).narrow(0, 1, shape[0]).expect("narrow")
        }
        3 if nd >= 1 => {
            let mut s = shape.to_vec();
            s[nd - 1] = 1;
            make(g, &s).expand(shape).expect("expand")
        }
        _ => make(g, shape),
    }
}

fn shapes(g: &mut Generator, count: usize) -> Vec<Vec<usize>> {
    (0..count)
        .map(|_| {
            let nd = 1 + g.int_range(0, 4) as usize;
            (0..nd).map(|_| 1 + g.int_range(0, 5) as usize).collect()
        })
        .collect()
}

#[test]
fn every_planned_kernel_exists() {
    let names = super::kernel_names();
    let mut want = vec!["tp_dropout_mask".to_string()];
    let all = ["f32", "f64", "i64", "bool", "bf16", "f16"];
    for s in all {
        want.push(format!("tp_unary_{s}"));
        want.push(format!("tp_cmp_{s}"));
        want.push(format!("tp_where_{s}"));
        want.push(format!("tp_index_select_{s}"));
        want.push(format!("tp_gather_{s}"));
        for d in all {
            want.push(format!("tp_copy_{s}_{d}"));
        }
    }
    for s in ["f32", "f64", "i64", "bf16", "f16"] {
        want.push(format!("tp_binary_{s}"));
        want.push(format!("tp_reduce_{s}"));
        want.push(format!("tp_scatter_add_{s}"));
    }
    for s in ["f32", "f64", "bf16", "f16"] {
        want.push(format!("tp_cross_entropy_{s}"));
    }
    // 16-bit reductions keep float32 partials between their two launches; the optimizers
    // refuse 16-bit parameters (float32 masters), so they have no 16-bit kernels
    for s in ["bf16", "f16"] {
        want.push(format!("tp_reduce_{s}_part"));
        want.push(format!("tp_reduce_{s}_final"));
    }
    for s in ["f32", "f64"] {
        want.push(format!("tp_sgd_{s}"));
        want.push(format!("tp_adam_{s}"));
    }
    for w in &want {
        assert!(names.contains(w), "{w} is missing from tensorplay.cu");
    }
    assert_eq!(names.len(), want.len(), "kernels no plan names: {names:?}");
}

#[test]
fn unary_kernels_match_the_cpu() {
    let mut g = Generator::new(21);
    type Cpu = fn(&Tensor) -> crate::Result<Tensor>;
    let cases: Vec<(UnaryCode, f64, Cpu, &str)> = vec![
        (UnaryCode::Neg, 0.0, |t| t.neg(), "neg"),
        (UnaryCode::Exp, 0.0, |t| t.exp(), "exp"),
        (UnaryCode::Log, 0.0, |t| t.log(), "log"),
        (UnaryCode::Sqrt, 0.0, |t| t.sqrt(), "sqrt"),
        (UnaryCode::Abs, 0.0, |t| t.abs(), "abs"),
        (UnaryCode::Relu, 0.0, |t| t.relu(), "relu"),
        (UnaryCode::Sigmoid, 0.0, |t| t.sigmoid(), "sigmoid"),
        (UnaryCode::Tanh, 0.0, |t| t.tanh(), "tanh"),
        (UnaryCode::Gelu, 0.0, |t| t.gelu(), "gelu"),
        (UnaryCode::Erf, 0.0, |t| t.erf(), "erf"),
        (
            UnaryCode::AddScalar,
            2.0,
            |t| t.add_scalar(2.0),
            "add_scalar",
        ),
        (
            UnaryCode::MulScalar,
            -3.0,
            |t| t.mul_scalar(-3.0),
            "mul_scalar",
        ),
        (
            UnaryCode::DivScalar,
            7.0,
            |t| t.div_scalar(7.0),
            "div_scalar",
        ),
        (
            UnaryCode::PowScalar,
            3.0,
            |t| t.pow_scalar(3.0),
            "pow_scalar",
        ),
        (UnaryCode::Sign, 0.0, |t| t.sign(), "sign"),
    ];
    for (si, shape) in shapes(&mut g, 12).iter().enumerate() {
        for dt in [DType::F32, DType::F64, DType::I64, DType::BF16, DType::F16] {
            let x = view(&mut g, shape, dt, si);
            for (code, scalar, cpu, name) in &cases {
                let int_ok = matches!(
                    code,
                    UnaryCode::Neg
                        | UnaryCode::Abs
                        | UnaryCode::Relu
                        | UnaryCode::Sign
                        | UnaryCode::AddScalar
                        | UnaryCode::MulScalar
                );
                if dt == DType::I64 && !int_ok {
                    continue;
                }
                let want = cpu(&x).expect("cpu");
                let out = output(dt, shape);
                let (o, _) = host(&out);
                let (xp, lx) = host(&x);
                run(&plan::unary(dt, o, xp, &lx, *code, *scalar, name).expect("plan"));
                close(
                    &format!("{name} {dt:?} {shape:?} view {si}"),
                    &out,
                    &want,
                    tol(dt),
                );
            }
        }
    }
}

#[test]
fn binary_compare_and_where_kernels_match_the_cpu_with_broadcasting() {
    let mut g = Generator::new(22);
    type Cpu = fn(&Tensor, &Tensor) -> crate::Result<Tensor>;
    let ops: Vec<(BinaryCode, Cpu, &str)> = vec![
        (BinaryCode::Add, |a, b| a.add(b), "add"),
        (BinaryCode::Sub, |a, b| a.sub(b), "sub"),
        (BinaryCode::Mul, |a, b| a.mul(b), "mul"),
        (BinaryCode::Div, |a, b| a.div(b), "div"),
        (BinaryCode::Pow, |a, b| a.abs()?.pow(b), "pow"),
        (BinaryCode::Max, |a, b| a.maximum(b), "maximum"),
        (BinaryCode::Min, |a, b| a.minimum(b), "minimum"),
    ];
    let cmps: Vec<(CmpCode, Cpu, &str)> = vec![
        (CmpCode::Eq, |a, b| a.eq(b), "eq"),
        (CmpCode::Ne, |a, b| a.ne(b), "ne"),
        (CmpCode::Lt, |a, b| a.lt(b), "lt"),
        (CmpCode::Le, |a, b| a.le(b), "le"),
        (CmpCode::Gt, |a, b| a.gt(b), "gt"),
        (CmpCode::Ge, |a, b| a.ge(b), "ge"),
    ];
    for (si, shape) in shapes(&mut g, 12).iter().enumerate() {
        // b broadcasts along its first dim
        let mut bshape = shape.clone();
        bshape[0] = 1;
        for dt in [DType::F32, DType::F64, DType::I64, DType::BF16, DType::F16] {
            let a = view(&mut g, shape, dt, si);
            let b = view(&mut g, &bshape, dt, si + 1);
            let (ap, la) = host(&a);
            let (bp, lb0) = host(&b);
            let lb = lb0.broadcast_to(shape, "test").expect("broadcast");
            for (code, cpu, name) in &ops {
                if dt == DType::I64 && matches!(code, BinaryCode::Div | BinaryCode::Pow) {
                    continue;
                }
                let a2 = if *code == BinaryCode::Pow {
                    a.abs().expect("abs")
                } else {
                    a.clone()
                };
                let (ap2, la2) = host(&a2);
                let want = cpu(&a, &b).expect("cpu");
                let out = output(dt, shape);
                let (o, _) = host(&out);
                run(&plan::binary(dt, o, (ap2, &la2), (bp, &lb), *code, name).expect("plan"));
                close(
                    &format!("{name} {dt:?} {shape:?} view {si}"),
                    &out,
                    &want,
                    tol(dt),
                );
            }
            for (code, cpu, name) in &cmps {
                let want = cpu(&a, &b).expect("cpu");
                let out = output(DType::Bool, shape);
                let (o, _) = host(&out);
                run(
                    &plan::compare(dt, o, (ap, &la), Some((bp, &lb)), *code, 0.0, name)
                        .expect("plan"),
                );
                close(&format!("{name} {dt:?} {shape:?}"), &out, &want, 0.0);
            }
            let want = a.gt_scalar(0.25).expect("cpu");
            let out = output(DType::Bool, shape);
            let (o, _) = host(&out);
            run(
                &plan::compare(dt, o, (ap, &la), None, CmpCode::Gt, 0.25, "gt_scalar")
                    .expect("plan"),
            );
            close(&format!("gt_scalar {dt:?} {shape:?}"), &out, &want, 0.0);
            // where(a > 0, a, b)
            let cond = a.gt_scalar(0.0).expect("cond");
            let (cp, lc) = host(&cond);
            let want = a.where_(&cond, &b).expect("cpu");
            let out = output(dt, shape);
            let (o, _) = host(&out);
            run(&plan::select(dt, o, (cp, &lc), (ap, &la), (bp, &lb)).expect("plan"));
            close(&format!("where {dt:?} {shape:?}"), &out, &want, 0.0);
        }
    }
}

#[test]
fn copies_cast_every_dtype_pair_and_write_strided_views() {
    let mut g = Generator::new(23);
    let all = DType::ALL;
    for (si, shape) in shapes(&mut g, 10).iter().enumerate() {
        for from in all {
            let x = view(&mut g, shape, from, si);
            let (xp, lx) = host(&x);
            for to in all {
                let want = x.to_dtype(to).expect("cpu");
                let out = output(to, shape);
                let (o, lo) = host(&out);
                run(&plan::copy((from, xp, &lx), (to, o, &lo), "to_dtype").expect("plan"));
                close(
                    &format!("{from:?} -> {to:?} {shape:?} view {si}"),
                    &out,
                    &want,
                    0.0,
                );
            }
        }
        // into a transposed destination view
        if shape.len() >= 2 {
            let x = view(&mut g, shape, DType::F64, 0);
            let mut t = shape.clone();
            let nd = t.len();
            t.swap(nd - 2, nd - 1);
            let dst_base = output(DType::F64, &t);
            let dst = dst_base.transpose(-2, -1).expect("transpose");
            let (o, lo) = host(&dst);
            let (xp, lx) = host(&x);
            run(&plan::copy((DType::F64, xp, &lx), (DType::F64, o, &lo), "copy_").expect("plan"));
            close(
                &format!("strided write {shape:?}"),
                &dst.contiguous().expect("c"),
                &x,
                0.0,
            );
        }
    }
}

fn reduce_case(
    x: &Tensor,
    dims: &[usize],
    code: ReduceCode,
    split: Option<(usize, usize)>,
) -> (Tensor, Tensor) {
    let dt = x.dtype();
    let (xp, lx) = host(x);
    let shape = ReduceShape::new(&lx, dims);
    let (m, k) = (shape.m(), shape.k());
    let (parts, chunk) = split.unwrap_or_else(|| plan::reduce_split(m, k));
    let out = output(dt, &[m]);
    let idx = output(DType::I64, &[m]);
    let scratch = output(plan::reduce_scratch(dt), &[m * parts]);
    let scratch_idx = output(DType::I64, &[m * parts]);
    let idx_p = if code == ReduceCode::Sum {
        0
    } else {
        host(&idx).0
    };
    let sidx_p = if code == ReduceCode::Sum {
        0
    } else {
        host(&scratch_idx).0
    };
    for l in plan::reduce(
        dt,
        xp,
        &shape,
        code,
        (host(&out).0, idx_p),
        (host(&scratch).0, sidx_p),
        (parts, chunk),
        "reduce",
    )
    .expect("plan")
    {
        run(&l);
    }
    (out, idx)
}

#[test]
fn reductions_match_the_cpu_in_one_and_two_launches() {
    let mut g = Generator::new(24);
    for (si, shape) in shapes(&mut g, 12).iter().enumerate() {
        for dt in [DType::F32, DType::F64, DType::I64, DType::BF16, DType::F16] {
            let x = view(&mut g, shape, dt, si);
            let nd = shape.len();
            let d = si % nd;
            let kept: Vec<usize> = shape
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != d)
                .map(|(_, &s)| s)
                .collect();
            for split in [None, Some((2, shape[d].div_ceil(2)))] {
                let case = format!("{dt:?} {shape:?} dim {d} split {split:?}");
                let (s, _) = reduce_case(&x, &[d], ReduceCode::Sum, split);
                let want = x.sum_dims(&[d as isize], false).expect("sum");
                close(
                    &format!("sum {case}"),
                    &s.reshape(&kept[..]).expect("r"),
                    &want,
                    tol(dt) * 8.0,
                );
                for (code, is_max) in [(ReduceCode::Max, true), (ReduceCode::Min, false)] {
                    let (v, i) = reduce_case(&x, &[d], code, split);
                    let (wv, wi) = if is_max {
                        x.max_dim(d as isize, false)
                    } else {
                        x.min_dim(d as isize, false)
                    }
                    .expect("cpu");
                    close(
                        &format!("{code:?} {case}"),
                        &v.reshape(&kept[..]).expect("r"),
                        &wv,
                        0.0,
                    );
                    close(
                        &format!("arg{code:?} {case}"),
                        &i.reshape(&kept[..]).expect("r"),
                        &wi,
                        0.0,
                    );
                }
            }
            let all: Vec<usize> = (0..nd).collect();
            let (s, _) = reduce_case(&x, &all, ReduceCode::Sum, None);
            close(
                &format!("sum all {dt:?} {shape:?}"),
                &s.reshape(&[] as &[usize]).expect("r"),
                &x.sum().expect("sum"),
                tol(dt) * 8.0,
            );
        }
    }
    // a long reduction takes the two-launch path by itself
    let x = view(&mut g, &[3, 5000], DType::F64, 0);
    assert!(plan::reduce_split(3, 5000).0 > 1);
    let (v, i) = reduce_case(&x, &[1], ReduceCode::Max, None);
    let (wv, wi) = x.max_dim(1, false).expect("cpu");
    close("long max", &v, &wv, 0.0);
    close("long argmax", &i, &wi, 0.0);
    let (s, _) = reduce_case(&x, &[1], ReduceCode::Sum, None);
    close(
        "long sum",
        &s,
        &x.sum_dims(&[1], false).expect("sum"),
        1e-12,
    );
    // NaN wins, the first extreme wins ties
    let x = Tensor::from_vec(vec![1.0f64, 3.0, 3.0, f64::NAN, 2.0, f64::NAN], &[1, 6]).expect("t");
    let (v, i) = reduce_case(&x, &[1], ReduceCode::Max, Some((3, 2)));
    assert!(values(&v)[0].is_nan());
    assert_eq!(i.to_vec::<i64>().expect("i"), vec![3]);
}

#[test]
fn index_kernels_match_the_cpu() {
    let mut g = Generator::new(25);
    for dt in [DType::F32, DType::F64, DType::I64, DType::BF16, DType::F16] {
        let x = view(&mut g, &[4, 6, 3], dt, 0);
        for d in 0..3 {
            let size = x.shape()[d];
            let (outer, inner): (usize, usize) = (
                x.shape()[..d].iter().product(),
                x.shape()[d + 1..].iter().product(),
            );
            let idx: Vec<i64> = (0..5).map(|_| g.int_range(0, size as i64)).collect();
            let it = Tensor::from_vec(idx.clone(), &[5]).expect("idx");
            let want = x.index_select(d as isize, &it).expect("cpu");
            let out = output(dt, want.shape());
            run(&plan::index(
                "index_select",
                dt,
                (host(&out).0, host(&x).0, host(&it).0),
                (outer, size, 5, inner),
            ));
            close(&format!("index_select {dt:?} dim {d}"), &out, &want, 0.0);
            // gather/scatter_add with an index of x's shape but 2 along d
            let mut ishape = x.shape().to_vec();
            ishape[d] = 2;
            let n: usize = ishape.iter().product();
            let gi: Vec<i64> = (0..n).map(|_| g.int_range(0, size as i64)).collect();
            let gt = Tensor::from_vec(gi, &ishape).expect("gather index");
            let want = x.gather(d as isize, &gt).expect("cpu");
            let out = output(dt, &ishape);
            run(&plan::index(
                "gather",
                dt,
                (host(&out).0, host(&x).0, host(&gt).0),
                (outer, size, 2, inner),
            ));
            close(&format!("gather {dt:?} dim {d}"), &out, &want, 0.0);
            let src = view(&mut g, &ishape, dt, 0);
            let want = x.scatter_add(d as isize, &gt, &src).expect("cpu");
            let out = x.contiguous().expect("c").deep_clone().expect("clone");
            run(&plan::index(
                "scatter_add",
                dt,
                (host(&out).0, host(&src).0, host(&gt).0),
                (outer, size, 2, inner),
            ));
            close(&format!("scatter_add {dt:?} dim {d}"), &out, &want, tol(dt));
        }
    }
}

#[test]
fn cross_entropy_matches_the_cpu() {
    let mut g = Generator::new(26);
    for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        let x = view(&mut g, &[7, 5], dt, 0);
        let t: Vec<i64> = (0..7).map(|_| g.int_range(0, 5)).collect();
        let target = Tensor::from_vec(t, &[7]).expect("target");
        let want = crate::nn::functional::cross_entropy(&x, &target).expect("cpu");
        let loss = output(dt, &[7]);
        let probs = output(dt, &[7, 5]);
        run(&plan::cross_entropy(
            dt,
            (host(&loss).0, host(&probs).0, host(&x).0, host(&target).0),
            7,
            5,
        ));
        close(
            &format!("cross_entropy {dt:?}"),
            &loss.mean().expect("mean"),
            &want,
            tol(dt) * 4.0,
        );
        close(
            &format!("softmax {dt:?}"),
            &probs,
            &x.softmax(1).expect("softmax"),
            tol(dt) * 4.0,
        );
    }
}

#[test]
fn dropout_masks_follow_philox_known_answers_and_the_rate() {
    // Philox-4x32-10 with key 0 and counter 0 gives 6627e8d5 e169c58d bc57ac4c 9b00dbd8
    // (Random123's known-answer vectors): uniforms .399 .880 .735 .605
    let mask = |n: usize, seed: u64, offset: u64, p: f64| {
        let m = output(DType::Bool, &[n]);
        run(&plan::dropout_mask(host(&m).0, n, seed, offset, p));
        m.to_vec::<bool>().expect("mask")
    };
    assert_eq!(mask(4, 0, 0, 0.5), vec![false, true, true, true]);
    assert_eq!(mask(4, 0, 0, 0.7), vec![false, true, true, false]);
    assert_eq!(mask(4, 0, 0, 0.8), vec![false, true, false, false]);
    let a = mask(40000, 7, 3, 0.3);
    assert_eq!(a, mask(40000, 7, 3, 0.3), "same seed and offset, same mask");
    assert_ne!(a, mask(40000, 8, 3, 0.3), "another seed, another mask");
    let kept = a.iter().filter(|&&k| k).count() as f64 / 40000.0;
    assert!((kept - 0.7).abs() < 0.01, "kept fraction {kept}");
}

/// What `cublas<t>gemmStridedBatched` computes (column-major, alpha 1, beta 0), on the host.
fn host_gemm<T: StorageElement + num_traits::Float>(g: &plan::Gemm, a: &[T], b: &[T], c: &mut [T]) {
    for bi in 0..g.batch as usize {
        for j in 0..g.n as usize {
            for i in 0..g.m as usize {
                let mut acc = T::zero();
                for p in 0..g.k as usize {
                    let av = if g.transa {
                        a[g.a_offset + bi * g.stride_a as usize + i * g.lda as usize + p]
                    } else {
                        a[g.a_offset + bi * g.stride_a as usize + p * g.lda as usize + i]
                    };
                    let bv = if g.transb {
                        b[g.b_offset + bi * g.stride_b as usize + p * g.ldb as usize + j]
                    } else {
                        b[g.b_offset + bi * g.stride_b as usize + j * g.ldb as usize + p]
                    };
                    acc = acc + av * bv;
                }
                c[bi * g.stride_c as usize + j * g.ldc as usize + i] = acc;
            }
        }
    }
}

#[test]
fn gemm_plans_read_transposed_broadcast_and_offset_operands() {
    let mut g = Generator::new(27);
    for case in 0..16 {
        let (batch, m, k, n) = (
            1 + case % 3,
            1 + g.int_range(0, 6) as usize,
            1 + g.int_range(0, 6) as usize,
            1 + g.int_range(0, 6) as usize,
        );
        let a = view(&mut g, &[batch, m, k], DType::F64, case);
        let b = if case % 4 == 3 {
            view(&mut g, &[1, k, n], DType::F64, case / 4)
                .expand(&[batch, k, n])
                .expect("expand")
        } else {
            view(&mut g, &[batch, k, n], DType::F64, case / 4)
        };
        let want = a.matmul(&b).expect("cpu");
        let Some(plan) = plan::gemm(a.layout(), b.layout(), batch) else {
            // only views with neither rows nor columns contiguous need a copy
            assert!(
                !a.layout().is_contiguous() || !b.layout().is_contiguous(),
                "case {case}: a contiguous pair was refused"
            );
            continue;
        };
        let mut c = vec![0.0f64; batch * m * n];
        let av = a.with_cpu_data(|s: &[f64], _| s.to_vec()).expect("a");
        let bv = b.with_cpu_data(|s: &[f64], _| s.to_vec()).expect("b");
        host_gemm(&plan, &bv, &av, &mut c);
        let got = Tensor::from_vec(c, &[batch, m, n]).expect("c");
        close(
            &format!("gemm case {case} {:?} {:?}", a.layout(), b.layout()),
            &got,
            &want,
            1e-12,
        );
    }
}

/// Three steps of each fused optimizer kernel against the CPU's optimizer, float64: the
/// kernels do the CPU's arithmetic in its order, so the results are bit-identical.
#[test]
fn optimizer_kernels_match_the_cpu_bit_for_bit() {
    use crate::optim::{Adam, AdamOptions, AdamW, AdamWOptions, Optimizer, SGD, SgdOptions};
    let mut g = Generator::new(28);
    let n = 37;
    let vals = |g: &mut Generator| (0..n).map(|_| g.normal()).collect::<Vec<f64>>();
    let w0 = vals(&mut g);
    let grads: Vec<Vec<f64>> = (0..3).map(|_| vals(&mut g)).collect();
    let ptr = |v: &mut Vec<f64>| v.as_mut_ptr() as u64;
    let cpu_run = |mut opt: Box<dyn Optimizer>, w: &Tensor| -> Vec<f64> {
        for gr in &grads {
            opt.step_with_grads(&[Some(Tensor::from_vec(gr.clone(), &[n]).expect("g"))])
                .expect("step");
        }
        w.to_vec::<f64>().expect("w")
    };
    // SGD with momentum, Nesterov and weight decay
    let (lr, mom, wd) = (0.1, 0.9, 0.01);
    let w = Tensor::from_vec(w0.clone(), &[n])
        .expect("w")
        .requires_grad_(true);
    let o = SgdOptions {
        lr,
        momentum: mom,
        nesterov: true,
        weight_decay: wd,
        ..Default::default()
    };
    let want = cpu_run(Box::new(SGD::new(vec![w.clone()], o).expect("sgd")), &w);
    let (mut p, mut buf) = (w0.clone(), vec![0.0; n]);
    for (i, gr) in grads.iter().enumerate() {
        let mut gr = gr.clone();
        run(&plan::sgd(
            DType::F64,
            plan::params::Sgd {
                param: ptr(&mut p),
                grad: ptr(&mut gr),
                momentum_buf: ptr(&mut buf),
                n: n as i64,
                first: i64::from(i == 0),
                nesterov: 1,
                lr,
                momentum: mom,
                dampening: 0.0,
                weight_decay: wd,
            },
        ));
    }
    assert_eq!(p, want, "SGD");
    // Adam (weight decay, AMSGrad) and AdamW
    for decoupled in [false, true] {
        let (lr, (b1, b2), eps, wd) = (0.01, (0.9, 0.999), 1e-8, 0.05);
        let w = Tensor::from_vec(w0.clone(), &[n])
            .expect("w")
            .requires_grad_(true);
        let opt: Box<dyn Optimizer> = if decoupled {
            Box::new(
                AdamW::new(
                    vec![w.clone()],
                    AdamWOptions {
                        lr,
                        betas: (b1, b2),
                        eps,
                        weight_decay: wd,
                        amsgrad: true,
                    },
                )
                .expect("adamw"),
            )
        } else {
            Box::new(
                Adam::new(
                    vec![w.clone()],
                    AdamOptions {
                        lr,
                        betas: (b1, b2),
                        eps,
                        weight_decay: wd,
                        amsgrad: true,
                    },
                )
                .expect("adam"),
            )
        };
        let want = cpu_run(opt, &w);
        let (mut p, mut m, mut v, mut vmax) =
            (w0.clone(), vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        for (i, gr) in grads.iter().enumerate() {
            let step = i as i32 + 1;
            let (bc1, bc2) = (1.0 - b1.powi(step), 1.0 - b2.powi(step));
            let mut gr = gr.clone();
            run(&plan::adam(
                DType::F64,
                plan::params::Adam {
                    param: ptr(&mut p),
                    grad: ptr(&mut gr),
                    exp_avg: ptr(&mut m),
                    exp_avg_sq: ptr(&mut v),
                    max_exp_avg_sq: ptr(&mut vmax),
                    n: n as i64,
                    decoupled: i64::from(decoupled),
                    beta1: b1,
                    beta2: b2,
                    eps,
                    weight_decay: wd,
                    decay: 1.0 - lr * wd,
                    step_size: lr / bc1,
                    bias_c2_sqrt: bc2.sqrt(),
                },
            ));
        }
        assert_eq!(p, want, "Adam decoupled={decoupled}");
    }
}

/// int64 values beyond 2^53 survive copies and compare exactly (they once went through
/// float64, as the CPU's scalar comparisons do but its copies and tensor comparisons do not).
#[test]
fn int64_copies_and_comparisons_are_exact_beyond_2_pow_53() {
    let big = (1i64 << 53) + 1;
    let a = Tensor::from_vec(vec![big, i64::MIN + 1, i64::MAX - 1, -big, 5], &[5]).expect("a");
    let b = Tensor::from_vec(vec![big - 1, i64::MIN + 1, i64::MAX, -big + 1, 5], &[5]).expect("b");
    let (ap, la) = host(&a);
    let (bp, lb) = host(&b);
    for to in [DType::I64, DType::Bool] {
        let out = output(to, &[5]);
        let (o, lo) = host(&out);
        run(&plan::copy((DType::I64, ap, &la), (to, o, &lo), "copy").expect("plan"));
        match to {
            DType::I64 => assert_eq!(
                out.to_vec::<i64>().expect("v"),
                a.to_vec::<i64>().expect("v")
            ),
            _ => assert_eq!(
                out.to_vec::<bool>().expect("v"),
                a.to_dtype(to).and_then(|t| t.to_vec::<bool>()).expect("v")
            ),
        }
    }
    for (code, want) in [
        (CmpCode::Eq, a.eq(&b)),
        (CmpCode::Lt, a.lt(&b)),
        (CmpCode::Ge, a.ge(&b)),
    ] {
        let out = output(DType::Bool, &[5]);
        run(&plan::compare(
            DType::I64,
            host(&out).0,
            (ap, &la),
            Some((bp, &lb)),
            code,
            0.0,
            "cmp",
        )
        .expect("plan"));
        assert_eq!(
            out.to_vec::<bool>().expect("v"),
            want.and_then(|t| t.to_vec::<bool>()).expect("cpu"),
            "{code:?}"
        );
    }
}

/// Whether `k` (16-bit pattern, `value` its meaning) is `d` rounded to nearest even: no
/// neighbour is nearer, a tie goes to the even pattern, and infinity only beyond the largest
/// finite value plus half a step (`overflow`).
fn nearest_even(d: f64, k: u16, value: fn(u16) -> f64, overflow: f64) -> bool {
    let kv = value(k);
    if d.is_nan() || kv.is_nan() {
        return d.is_nan() && kv.is_nan();
    }
    if kv.is_infinite() {
        return d.abs() >= overflow && d.signum() == kv.signum();
    }
    [k.wrapping_add(1), k.wrapping_sub(1)]
        .into_iter()
        .all(|nb| {
            let n = value(nb);
            let (dk, dn) = ((d - kv).abs(), (d - n).abs());
            n.is_nan() || n.is_infinite() || dk < dn || (dk == dn && k & 1 == 0)
        })
}

/// Every bfloat16 and float16 bit pattern through the kernels' conversions to float32 and
/// float64 and back, and float32 values (random bit patterns, and the rounding boundaries:
/// ties, overflow to infinity, subnormals) to each 16-bit type, against the `half` crate bit for
/// bit (NaN: any NaN); float64 values to each 16-bit type rounded to nearest even (checked
/// against the neighbours: `half`'s `from_f64` drops the low 32 bits of the float64 first, so
/// it is off by one step where only those bits break a tie).
#[test]
fn casts_to_and_from_16_bits_match_the_half_crate_bit_for_bit() {
    use crate::{bf16, f16};
    let cast = |x: &Tensor, to: DType| {
        let (xp, lx) = host(x);
        let out = output(to, x.shape());
        let (o, lo) = host(&out);
        run(&plan::copy((x.dtype(), xp, &lx), (to, o, &lo), "to_dtype").expect("plan"));
        out
    };
    let same = |case: &str, got: &Tensor, want: &Tensor| {
        let (g, w) = (values(got), values(want));
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            let ok = (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits();
            assert!(ok, "{case}: element {i}: kernel {a:e}, half {b:e}");
        }
    };
    let bits: Vec<u16> = (0..=u16::MAX).collect();
    let bfs = Tensor::from_vec(bits.iter().map(|&b| bf16::from_bits(b)).collect(), &[65536]);
    let fs = Tensor::from_vec(bits.iter().map(|&b| f16::from_bits(b)).collect(), &[65536]);
    for (name, x) in [
        ("bfloat16", bfs.expect("bf16")),
        ("float16", fs.expect("f16")),
    ] {
        for to in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let want = x.to_dtype(to).expect("cpu");
            same(&format!("all {name} -> {to:?}"), &cast(&x, to), &want);
        }
    }
    let mut g = Generator::new(29);
    let mut f32s: Vec<f32> = (0..200_000)
        .map(|_| f32::from_bits(g.int_range(0, i64::from(u32::MAX)) as u32))
        .collect();
    // bfloat16 ties (even and odd) and float16's: overflow, the subnormal range, ties there
    f32s.extend([
        65504.0, 65519.99, 65520.0, 65536.0, 1e-8, 2.98e-8, 5.96e-8, 6.1e-5,
    ]);
    f32s.extend([
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::MAX,
    ]);
    f32s.extend([
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MIN_POSITIVE,
        -0.0,
        2f32.powi(-25),
    ]);
    f32s.extend((0..1 << 13).map(|i| f32::from_bits(0x3300_0000 + (i << 11))));
    let n = f32s.len();
    let f64s: Vec<f64> = (0..n)
        .map(|i| f64::from(f32s[i]) * (1.0 + g.normal() * 1e-6))
        .chain([
            1.0 + 2f64.powi(-8),
            1.0 + 2f64.powi(-8) + 2f64.powi(-40),
            1e300,
            -1e-300,
        ])
        .collect();
    let m = f64s.len();
    let x = Tensor::from_vec(f32s, &[n]).expect("f32");
    for to in [DType::BF16, DType::F16] {
        let want = x.to_dtype(to).expect("cpu");
        same(&format!("F32 -> {to:?}"), &cast(&x, to), &want);
    }
    let x = Tensor::from_vec(f64s.clone(), &[m]).expect("f64");
    let bf = cast(&x, DType::BF16).to_vec::<bf16>().expect("bf16");
    let hf = cast(&x, DType::F16).to_vec::<f16>().expect("f16");
    let bf_value = |b: u16| bf16::from_bits(b).to_f64();
    let f_value = |b: u16| f16::from_bits(b).to_f64();
    // halfway between the largest finite value and the next power of two
    let (bf_over, f_over) = (
        (bf16::MAX.to_f64() + 2f64.powi(128)) / 2.0,
        (f16::MAX.to_f64() + 65536.0) / 2.0,
    );
    for (i, &d) in f64s.iter().enumerate() {
        let (b, h) = (bf[i].to_bits(), hf[i].to_bits());
        assert!(
            nearest_even(d, b, bf_value, bf_over),
            "{d:e} -> bfloat16 {b:#06x}"
        );
        assert!(
            nearest_even(d, h, f_value, f_over),
            "{d:e} -> float16 {h:#06x}"
        );
    }
}

/// A split 16-bit sum keeps float32 partials and rounds once: a first chunk of `big` and 255
/// ones (a tie in the 16-bit type, which rounds up) and a second of minus that rounded value
/// sum to -1, where 16-bit partials would give 0.
#[test]
fn split_16_bit_sums_keep_float32_partials() {
    for (dt, big, rounded) in [(DType::BF16, 256.0, 512.0), (DType::F16, 2048.0, 2304.0)] {
        let mut v = vec![0.0f64; 512];
        v[0] = big;
        v[1..256].fill(1.0);
        v[256] = -rounded;
        let x = Tensor::from_vec(v, &[1, 512])
            .and_then(|t| t.to_dtype(dt))
            .expect("x");
        let (s, _) = reduce_case(&x, &[1], ReduceCode::Sum, Some((2, 256)));
        assert_eq!(values(&s), vec![-1.0], "{dt:?}: split sum");
        let want = x.sum_dims(&[1], false).expect("cpu");
        close(&format!("split sum {dt:?}"), &s, &want, 0.0);
    }
}

/// The bfloat16 rule: a device older than compute capability 8.0 is refused naming both.
#[cfg(feature = "cuda")]
#[test]
fn bfloat16_needs_compute_capability_8() {
    let e = crate::cuda::real::bf16_capability(0, (7, 5))
        .expect_err("sm_75")
        .to_string();
    assert!(
        e.contains("bfloat16 needs compute capability 8.0 or newer; device 0 has 7.5"),
        "{e}"
    );
    assert!(crate::cuda::real::bf16_capability(1, (8, 0)).is_ok());
    assert!(crate::cuda::real::bf16_capability(1, (9, 0)).is_ok());
}
