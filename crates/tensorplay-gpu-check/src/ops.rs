//! Every core operation on `cuda:0` against the CPU: forward values and the gradient of a
//! weighted sum through the autograd engine, on generated shapes and views (contiguous,
//! transposed, narrowed, expanded), float32 and float64, with a fixed seed and a bounded count.
//!
//! Tolerances (relative, with an absolute floor of the same size), per family: elementwise
//! float32 1e-5 / float64 1e-12; reductions, products and softmax (another summation order)
//! float32 1e-4 / float64 1e-10; comparisons, casts, copies and indexing exact.

use tensorplay as tp;
use tp::{DType, Device, Tensor};

use super::{Res, e};

const GPU: Device = Device::Cuda(0);

/// A small deterministic generator (the checks must not depend on the library's RNG).
pub(crate) struct Gen(u64);
impl Gen {
    pub(crate) fn new(seed: u64) -> Gen {
        Gen(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Roughly normal values in [-3, 3].
    pub(crate) fn normal(&mut self) -> f64 {
        (0..6)
            .map(|_| (self.next() >> 11) as f64 / (1u64 << 53) as f64)
            .sum::<f64>()
            - 3.0
    }
    pub(crate) fn values(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.normal()).collect()
    }
}

/// Compares two tensors elementwise (NaNs equal), naming the case and the first difference.
pub(crate) fn close(case: &str, got: &Tensor, want: &Tensor, tol: f64) -> Res {
    if got.shape() != want.shape() {
        return Err(format!(
            "{case}: shape {:?}, the CPU's {:?}",
            got.shape(),
            want.shape()
        ));
    }
    if got.dtype() != want.dtype() {
        return Err(format!(
            "{case}: dtype {}, the CPU's {}",
            got.dtype(),
            want.dtype()
        ));
    }
    let g = got.cpu().and_then(|t| t.to_vec_f64()).map_err(e)?;
    let w = want.to_vec_f64().map_err(e)?;
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let ok = (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= tol * b.abs().max(1.0);
        if !ok {
            return Err(format!(
                "{case}: element {i}: cuda {a}, cpu {b} (tolerance {tol:e})"
            ));
        }
    }
    Ok(())
}

/// Makes a view of a base tensor.
type ViewFn = Box<dyn Fn(&Tensor) -> tp::Result<Tensor>>;

/// The same view of a base tensor on the CPU and on the GPU (`kind` 0..4: contiguous,
/// transposed, narrowed, expanded), so the GPU sees the same strides and offsets.
fn views(g: &mut Gen, shape: &[usize], dt: DType, kind: usize) -> Result<(Tensor, Tensor), String> {
    let nd = shape.len();
    let (base_shape, make): (Vec<usize>, ViewFn) = match kind % 4 {
        1 if nd >= 2 => {
            let mut s = shape.to_vec();
            s.swap(nd - 2, nd - 1);
            (s, Box::new(|t: &Tensor| t.transpose(-2, -1)))
        }
        2 if nd >= 1 => {
            let mut s = shape.to_vec();
            s[0] += 2;
            let n = shape[0];
            (s, Box::new(move |t: &Tensor| t.narrow(0, 1, n)))
        }
        3 if nd >= 1 => {
            let mut s = shape.to_vec();
            s[nd - 1] = 1;
            let full = shape.to_vec();
            (s, Box::new(move |t: &Tensor| t.expand(&full)))
        }
        _ => (shape.to_vec(), Box::new(|t: &Tensor| Ok(t.clone()))),
    };
    let n: usize = base_shape.iter().product();
    let base = Tensor::from_vec(g.values(n), &base_shape)
        .and_then(|t| t.to_dtype(dt))
        .map_err(e)?;
    let cpu = make(&base).map_err(e)?;
    let gpu = make(&base.to_device(GPU).map_err(e)?).map_err(e)?;
    Ok((cpu, gpu))
}

fn shapes(g: &mut Gen, count: usize) -> Vec<Vec<usize>> {
    (0..count)
        .map(|_| {
            let nd = 1 + g.below(4);
            (0..nd).map(|_| 1 + g.below(6)).collect()
        })
        .collect()
}

type Op = fn(&[Tensor]) -> tp::Result<Tensor>;

/// One differentiable case: `f` on the CPU and GPU inputs; the forward values and the
/// gradients of `sum(f(x) * w)` (w fixed, generated) must agree.
fn check_case(name: &str, inputs: &[(Tensor, Tensor)], f: Op, tol: f64, grads: bool) -> Res {
    let prep = |t: &Tensor| -> tp::Result<Tensor> {
        if grads && t.dtype().is_float() {
            Ok(t.detach().requires_grad_(true))
        } else {
            Ok(t.clone())
        }
    };
    let cpu: Vec<Tensor> = inputs
        .iter()
        .map(|(c, _)| prep(c))
        .collect::<tp::Result<_>>()
        .map_err(e)?;
    let gpu: Vec<Tensor> = inputs
        .iter()
        .map(|(_, g)| prep(g))
        .collect::<tp::Result<_>>()
        .map_err(e)?;
    let yc = f(&cpu).map_err(|x| format!("{name} on the CPU: {x}"))?;
    let yg = f(&gpu).map_err(|x| format!("{name} on cuda:0: {x}"))?;
    if yg.device() != GPU {
        return Err(format!(
            "{name}: the result is on {}, not cuda:0",
            yg.device()
        ));
    }
    close(&format!("{name} forward"), &yg, &yc, tol)?;
    if !grads || !yc.dtype().is_float() || !yc.requires_grad() {
        return Ok(());
    }
    let mut g = Gen::new(yc.numel() as u64);
    let w = Tensor::from_vec(g.values(yc.numel()), yc.shape())
        .and_then(|t| t.to_dtype(yc.dtype()))
        .map_err(e)?;
    yc.mul(&w)
        .and_then(|t| t.sum())
        .and_then(|t| t.backward())
        .map_err(e)?;
    yg.mul(&w.to_device(GPU).map_err(e)?)
        .and_then(|t| t.sum())
        .and_then(|t| t.backward())
        .map_err(|x| format!("{name} backward on cuda:0: {x}"))?;
    for (i, (c, gp)) in cpu.iter().zip(&gpu).enumerate() {
        if let (Some(a), Some(b)) = (gp.grad(), c.grad()) {
            close(&format!("{name} gradient of input {i}"), &a, &b, tol * 10.0)?;
        }
    }
    Ok(())
}

fn tols(dt: DType) -> (f64, f64) {
    if dt == DType::F32 {
        (1e-5, 1e-4)
    } else {
        (1e-12, 1e-10)
    }
}

/// Elementwise unary and binary operations (with broadcasting), comparisons, `where`.
pub(crate) fn elementwise() -> Res {
    let mut g = Gen::new(1);
    let unary: [(&str, Op); 16] = [
        ("neg", |x| x[0].neg()),
        ("exp", |x| x[0].exp()),
        ("log", |x| x[0].abs()?.add_scalar(0.5)?.log()),
        ("sqrt", |x| x[0].abs()?.add_scalar(0.5)?.sqrt()),
        ("abs", |x| x[0].abs()),
        ("relu", |x| x[0].relu()),
        ("sigmoid", |x| x[0].sigmoid()),
        ("tanh", |x| x[0].tanh()),
        ("gelu", |x| x[0].gelu()),
        ("erf", |x| x[0].erf()),
        ("add_scalar", |x| x[0].add_scalar(1.25)),
        ("mul_scalar", |x| x[0].mul_scalar(-3.0)),
        ("div_scalar", |x| x[0].div_scalar(7.0)),
        ("pow_scalar 3", |x| x[0].pow_scalar(3.0)),
        ("pow_scalar 2", |x| x[0].pow_scalar(2.0)),
        ("sign", |x| x[0].sign()),
    ];
    let binary: [(&str, Op); 9] = [
        ("add", |x| x[0].add(&x[1])),
        ("sub", |x| x[0].sub(&x[1])),
        ("mul", |x| x[0].mul(&x[1])),
        ("div", |x| x[0].div(&x[1].abs()?.add_scalar(0.5)?)),
        ("pow", |x| x[0].abs()?.add_scalar(0.5)?.pow(&x[1])),
        ("maximum", |x| x[0].maximum(&x[1])),
        ("minimum", |x| x[0].minimum(&x[1])),
        ("where", |x| x[0].where_(&x[0].gt(&x[1])?, &x[1])),
        ("lt as float", |x| x[0].lt(&x[1])?.to_dtype(x[0].dtype())),
    ];
    for (si, shape) in shapes(&mut g, 6).iter().enumerate() {
        for dt in [DType::F32, DType::F64] {
            let (t, _) = tols(dt);
            let x = views(&mut g, shape, dt, si)?;
            for (name, f) in unary {
                check_case(
                    &format!("{name} {dt} {shape:?} view {si}"),
                    std::slice::from_ref(&x),
                    f,
                    t,
                    true,
                )?;
            }
            let mut bshape = shape.clone();
            bshape[0] = 1;
            let y = views(&mut g, &bshape, dt, si + 1)?;
            for (name, f) in binary {
                check_case(
                    &format!("{name} {dt} {shape:?} with {bshape:?}"),
                    &[x.clone(), y.clone()],
                    f,
                    t,
                    true,
                )?;
            }
        }
        // int64 arithmetic wraps, comparisons, casts of every pair
        let xi = views(&mut g, shape, DType::I64, si)?;
        for (name, f) in [
            ("add", binary[0].1),
            ("mul", binary[2].1),
            ("maximum", binary[5].1),
        ] {
            check_case(
                &format!("{name} int64 {shape:?}"),
                &[xi.clone(), xi.clone()],
                f,
                0.0,
                false,
            )?;
        }
        for from in [DType::F32, DType::F64, DType::I64, DType::Bool] {
            let x = views(&mut g, shape, from, si)?;
            for to in [DType::F32, DType::F64, DType::I64, DType::Bool] {
                let c = x.0.to_dtype(to).map_err(e)?;
                let gg = x.1.to_dtype(to).map_err(e)?;
                close(&format!("{from} to {to} {shape:?} view {si}"), &gg, &c, 0.0)?;
            }
            let cmps: [(&str, Op); 2] = [
                ("eq", |x| x[0].eq(&x[0].neg()?)),
                ("ge_scalar", |x| x[0].ge_scalar(0.0)),
            ];
            for (name, f) in cmps {
                if from != DType::Bool {
                    check_case(
                        &format!("{name} {from} {shape:?}"),
                        std::slice::from_ref(&x),
                        f,
                        0.0,
                        false,
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// Reductions, products, shape operations, indexing, softmax and the losses.
pub(crate) fn reductions_and_products() -> Res {
    let mut g = Gen::new(2);
    let ops: [(&str, Op); 12] = [
        ("sum", |x| x[0].sum()),
        ("sum_dims 0", |x| x[0].sum_dims(&[0], false)),
        ("mean_dims -1 keepdim", |x| x[0].mean_dims(&[-1], true)),
        ("max", |x| x[0].max()),
        ("min", |x| x[0].min()),
        ("max_dim -1", |x| Ok(x[0].max_dim(-1, false)?.0)),
        ("min_dim 0 keepdim", |x| Ok(x[0].min_dim(0, true)?.0)),
        ("argmax -1", |x| x[0].argmax(Some(-1), false)),
        ("softmax -1", |x| x[0].softmax(-1)),
        ("log_softmax 0", |x| x[0].log_softmax(0)),
        ("contiguous", |x| x[0].contiguous()),
        ("cat", |x| {
            Tensor::cat(&[x[0].clone(), x[0].mul_scalar(2.0)?], 0)
        }),
    ];
    for (si, shape) in shapes(&mut g, 8).iter().enumerate() {
        for dt in [DType::F32, DType::F64] {
            let (_, t) = tols(dt);
            let x = views(&mut g, shape, dt, si)?;
            for (name, f) in ops {
                check_case(
                    &format!("{name} {dt} {shape:?} view {si}"),
                    std::slice::from_ref(&x),
                    f,
                    t,
                    true,
                )?;
            }
        }
    }
    // a long reduction (two launches on the GPU)
    let x = views(&mut g, &[3, 20000], DType::F64, 0)?;
    check_case(
        "sum_dims long",
        std::slice::from_ref(&x),
        |x| x[0].sum_dims(&[1], false),
        1e-10,
        true,
    )?;
    check_case(
        "max_dim long",
        std::slice::from_ref(&x),
        |x| Ok(x[0].max_dim(1, false)?.0),
        0.0,
        true,
    )?;
    // matrix products: plain, transposed, batched, broadcast
    for (i, (sa, sb)) in [
        (vec![5, 7], vec![7, 3]),
        (vec![4, 5, 7], vec![4, 7, 3]),
        (vec![4, 5, 7], vec![7, 3]),
        (vec![2, 1, 5, 7], vec![3, 7, 6]),
        (vec![64, 300], vec![300, 129]),
    ]
    .into_iter()
    .enumerate()
    {
        for dt in [DType::F32, DType::F64] {
            let (_, t) = tols(dt);
            for kind in [0, 1] {
                let a = views(&mut g, &sa, dt, kind)?;
                let b = views(&mut g, &sb, dt, kind + i)?;
                check_case(
                    &format!("matmul {dt} {sa:?} @ {sb:?} view {kind}"),
                    &[a, b],
                    |x| x[0].matmul(&x[1]),
                    t,
                    true,
                )?;
            }
        }
    }
    // indexing, embedding and cross-entropy
    for dt in [DType::F32, DType::F64] {
        let (_, t) = tols(dt);
        let x = views(&mut g, &[6, 5, 4], dt, 0)?;
        check_case(
            &format!("index_select {dt}"),
            std::slice::from_ref(&x),
            |x| {
                x[0].index_select(
                    1,
                    &Tensor::from_vec(vec![4i64, 0, 0, 2], &[4])?.to_device(x[0].device())?,
                )
            },
            0.0,
            true,
        )?;
        check_case(
            &format!("gather {dt}"),
            std::slice::from_ref(&x),
            |x| {
                let idx: Vec<i64> = (0..6 * 2 * 4).map(|i| (i * 7 % 5) as i64).collect();
                x[0].gather(
                    1,
                    &Tensor::from_vec(idx, &[6, 2, 4])?.to_device(x[0].device())?,
                )
            },
            0.0,
            true,
        )?;
        check_case(
            &format!("embedding {dt}"),
            std::slice::from_ref(&x),
            |x| {
                let table = x[0].reshape(&[30usize, 4][..])?;
                let idx = Tensor::from_vec(vec![3i64, 29, 3, 0, 7, 7], &[2, 3])?
                    .to_device(x[0].device())?;
                tp::nn::functional::embedding(&idx, &table)
            },
            t,
            true,
        )?;
        let logits = views(&mut g, &[16, 7], dt, 1)?;
        check_case(
            &format!("cross_entropy {dt}"),
            std::slice::from_ref(&logits),
            |x| {
                let target: Vec<i64> = (0..16).map(|i| (i * 3 % 7) as i64).collect();
                tp::nn::functional::cross_entropy(
                    &x[0],
                    &Tensor::from_vec(target, &[16])?.to_device(x[0].device())?,
                )
            },
            t,
            true,
        )?;
        check_case(
            &format!("mse_loss {dt}"),
            std::slice::from_ref(&logits),
            |x| tp::nn::functional::mse_loss(&x[0], &x[0].mul_scalar(0.5)?.detach()),
            t,
            true,
        )?;
    }
    Ok(())
}

/// In-place writes, dropout's reproducibility and rate.
pub(crate) fn inplace_and_dropout() -> Res {
    let mut g = Gen::new(3);
    let (c, gp) = views(&mut g, &[5, 6], DType::F32, 0)?;
    let (src_c, src_g) = views(&mut g, &[6, 5], DType::F32, 1)?;
    let (dc, dg) = (c.t().map_err(e)?, gp.t().map_err(e)?);
    dc.copy_(&src_c).map_err(e)?;
    dg.copy_(&src_g).map_err(e)?;
    close("copy_ into a transposed view", &gp, &c, 0.0)?;
    gp.fill_(2.5).map_err(e)?;
    c.fill_(2.5).map_err(e)?;
    close("fill_", &gp, &c, 0.0)?;
    let x = Tensor::ones(&[200_000], (DType::F32, GPU)).map_err(e)?;
    tp::manual_seed(7);
    let a = tp::nn::functional::dropout(&x, 0.3, true).map_err(e)?;
    tp::manual_seed(7);
    let b = tp::nn::functional::dropout(&x, 0.3, true).map_err(e)?;
    close("dropout with the same seed", &a, &b.cpu().map_err(e)?, 0.0)?;
    let kept = a
        .ne_scalar(0.0)
        .and_then(|m| m.to_dtype(DType::F64))
        .and_then(|m| m.mean())
        .and_then(|m| m.item_f64())
        .map_err(e)?;
    if (kept - 0.7).abs() > 0.01 {
        return Err(format!("dropout p=0.3 kept {kept:.4} of the elements"));
    }
    let scaled = a.max().and_then(|m| m.item_f64()).map_err(e)?;
    if (scaled - 1.0 / 0.7).abs() > 1e-6 {
        return Err(format!(
            "dropout scales kept elements to {scaled}, not 1/0.7"
        ));
    }
    Ok(())
}
