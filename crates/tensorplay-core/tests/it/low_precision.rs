//! bfloat16 and float16: casts over every bit pattern against the `half` crate, and every op
//! with its gradient against the float32 op on the same inputs (which are exact in both),
//! rounded once.
//!
//! Tolerances, in units of the 16-bit type's epsilon (`eps`: 2^-7 for bfloat16, 2^-10 for
//! float16) times the largest magnitude of the expected values:
//! - `Exact`: ops whose 16-bit kernel is the float32 kernel with a load before and one
//!   rounding after (elementwise math, views, copies, indexing, comparisons): the forward
//!   must equal the float32 result rounded, bit for bit. Their gradients are computed by
//!   16-bit ops in turn (a chain of roundings), so they get `GRAD` eps.
//! - `Accumulating`: ops that sum (reductions, matmul, normalisation, losses, attention):
//!   float32 accumulation in another order than the float32 op's may move the result by one
//!   16-bit step: `ACC` eps forward, `GRAD` eps for the gradients.

use tensorplay_core::{self as tp, DType, Tensor, bf16, f16};
use tensorplay_testkit::{Tol, check_close};

/// Forward tolerance of accumulating ops, in eps of the largest expected magnitude.
const ACC: f64 = 2.0;
/// Gradient tolerance, in eps of the largest expected magnitude.
const GRAD: f64 = 8.0;

// ---------------------------------------------------------------------------------------------
// casts

/// Every bit pattern of `dtype` as a tensor, with the `half` crate's float32 and float64 values.
fn every_pattern(dtype: DType) -> (Tensor, Vec<f32>, Vec<f64>) {
    let bits = 0..=u16::MAX;
    match dtype {
        DType::BF16 => {
            let v: Vec<bf16> = bits.map(bf16::from_bits).collect();
            let (a, b) = (
                v.iter().map(|x| x.to_f32()).collect(),
                v.iter().map(|x| x.to_f64()).collect(),
            );
            (Tensor::from_vec(v, &[1 << 16]).unwrap(), a, b)
        }
        DType::F16 => {
            let v: Vec<f16> = bits.map(f16::from_bits).collect();
            let (a, b) = (
                v.iter().map(|x| x.to_f32()).collect(),
                v.iter().map(|x| x.to_f64()).collect(),
            );
            (Tensor::from_vec(v, &[1 << 16]).unwrap(), a, b)
        }
        other => panic!("not a 16-bit dtype: {other}"),
    }
}

/// Whether two values are the same: equal bits, or both NaN (a NaN's payload may be quieted).
fn same_f64(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn casts_of_every_bit_pattern_match_the_half_crate() {
    for dtype in [DType::BF16, DType::F16] {
        let (t, want32, want64) = every_pattern(dtype);
        let got32 = t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
        let got64 = t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
        let orig = tensorplay_testkit::element_bits(&t).unwrap();
        for i in 0..1usize << 16 {
            assert!(
                same_f64(got32[i].into(), want32[i].into()),
                "{dtype} {i:#06x} to float32: {} vs {}",
                got32[i],
                want32[i]
            );
            assert!(same_f64(got64[i], want64[i]), "{dtype} {i:#06x} to float64");
        }
        // back from float32 and float64: every pattern returns (NaN stays NaN)
        for from in [DType::F32, DType::F64] {
            let back = t.to_dtype(from).unwrap().to_dtype(dtype).unwrap();
            let back_bits = tensorplay_testkit::element_bits(&back).unwrap();
            let back_vals = back.to_vec_f64().unwrap();
            for i in 0..1usize << 16 {
                assert!(
                    back_bits[i] == orig[i] || (back_vals[i].is_nan() && want64[i].is_nan()),
                    "{dtype} {i:#06x} through {from}: {:#06x}",
                    back_bits[i]
                );
            }
        }
    }
}

/// Float32 values that exercise rounding: a sweep over the bit patterns (every 4099th, both
/// signs, subnormals to infinities and NaNs), every bfloat16 tie (low half exactly 0x8000),
/// and values just above and below ties.
fn rounding_inputs() -> Vec<f32> {
    let mut v: Vec<f32> = (0..=u32::MAX).step_by(4099).map(f32::from_bits).collect();
    for hi in 0..=u16::MAX as u32 {
        for lo in [0x7fff, 0x8000, 0x8001] {
            v.push(f32::from_bits(hi << 16 | lo));
        }
    }
    // float16 ties: 13 dropped bits of which the top one set, around every float16 exponent
    for e in 100u32..145 {
        for m in [0u32, 1, 0x3ff, 0x155] {
            let base = e << 23 | m << 13;
            v.extend([base | 0x1000, base | 0xfff, base | 0x1001].map(f32::from_bits));
        }
    }
    v
}

/// `v` rounded to nearest even in `dtype`, found without any float64-to-16-bit conversion
/// (the `half` crate's `from_f64` rounds through float32 and can round twice): among the
/// neighbours of a nearby candidate, the one nearest `v` (the differences are exact: the
/// values are within a factor of two), a tie to the even bit pattern; infinity counts as
/// the next power of two after the largest finite value.
fn nearest_even(v: f64, dtype: DType) -> u64 {
    let (value, candidate): (fn(u16) -> f64, u16) = match dtype {
        DType::BF16 => (
            |b| bf16::from_bits(b).to_f64(),
            bf16::from_f32(v as f32).to_bits(),
        ),
        DType::F16 => (
            |b| f16::from_bits(b).to_f64(),
            f16::from_f32(v as f32).to_bits(),
        ),
        other => panic!("not a 16-bit dtype: {other}"),
    };
    if !v.is_finite() {
        return u64::from(candidate);
    }
    let top = 2.0 * tp::finfo(dtype).unwrap().max / (2.0 - tp::finfo(dtype).unwrap().eps);
    let exponent_mask = if dtype == DType::BF16 { 0x7f80 } else { 0x7c00 };
    let at = |b: u16| {
        let x = value(b);
        if x.is_infinite() { top.copysign(x) } else { x }
    };
    let mut best = candidate;
    for b in [candidate.wrapping_sub(1), candidate.wrapping_add(1)] {
        let nan = b & exponent_mask == exponent_mask && b & !(exponent_mask | 0x8000) != 0;
        if nan || (b ^ candidate) & 0x8000 != 0 {
            continue;
        }
        let (d, db) = ((v - at(b)).abs(), (v - at(best)).abs());
        if d < db || (d == db && b & 1 == 0) {
            best = b;
        }
    }
    u64::from(best)
}

#[test]
fn casts_to_16_bits_round_to_nearest_even() {
    let x = rounding_inputs();
    let n = x.len();
    let t32 = Tensor::from_vec(x.clone(), &[n]).unwrap();
    let t64 = t32.to_dtype(DType::F64).unwrap();
    // float64 inputs between float32 values: the cast must round once from float64
    let x64: Vec<f64> = x
        .iter()
        .map(|&v| f64::from(v) * (1.0 + 2f64.powi(-30)))
        .collect();
    let t64b = Tensor::from_vec(x64.clone(), &[n]).unwrap();
    type Case = (&'static str, DType, Tensor, Vec<u64>);
    let cases: Vec<Case> = vec![
        (
            "float32 to bfloat16",
            DType::BF16,
            t32.clone(),
            x.iter()
                .map(|&v| u64::from(bf16::from_f32(v).to_bits()))
                .collect(),
        ),
        (
            "float32 to float16",
            DType::F16,
            t32,
            x.iter()
                .map(|&v| u64::from(f16::from_f32(v).to_bits()))
                .collect(),
        ),
        (
            "float64 to bfloat16",
            DType::BF16,
            t64.clone(),
            x.iter()
                .map(|&v| u64::from(bf16::from_f32(v).to_bits()))
                .collect(),
        ),
        (
            "float64 to float16",
            DType::F16,
            t64,
            x.iter()
                .map(|&v| u64::from(f16::from_f32(v).to_bits()))
                .collect(),
        ),
        (
            "float64 between floats to bfloat16",
            DType::BF16,
            t64b.clone(),
            x64.iter().map(|&v| nearest_even(v, DType::BF16)).collect(),
        ),
        (
            "float64 between floats to float16",
            DType::F16,
            t64b,
            x64.iter().map(|&v| nearest_even(v, DType::F16)).collect(),
        ),
    ];
    for (name, dtype, t, want) in cases {
        let got = t.to_dtype(dtype).unwrap();
        let vals = got.to_vec_f64().unwrap();
        let bits = tensorplay_testkit::element_bits(&got).unwrap();
        for i in 0..n {
            assert!(
                bits[i] == want[i] || (vals[i].is_nan() && x[i].is_nan()),
                "{name}: {:e} ({:#010x}) gave {:#06x}, want {:#06x}",
                x[i],
                x[i].to_bits(),
                bits[i],
                want[i]
            );
        }
    }
}

#[test]
fn creation_printing_and_indexing_in_16_bits() {
    for dtype in [DType::BF16, DType::F16] {
        let t = Tensor::full(&[2, 3], 1.5, dtype).unwrap();
        assert_eq!(t.dtype(), dtype);
        assert_eq!(t.to_vec_f64().unwrap(), vec![1.5; 6], "{dtype}: full");
        let z = Tensor::zeros(&[4], dtype).unwrap();
        assert_eq!(z.to_vec_f64().unwrap(), vec![0.0; 4], "{dtype}: zeros");
        let r = Tensor::arange(0.0, 6.0, 1.0, dtype)
            .unwrap()
            .reshape(&[2, 3])
            .unwrap();
        assert_eq!(
            r.select(1, 2).unwrap().to_vec_f64().unwrap(),
            vec![2.0, 5.0],
            "{dtype}: select"
        );
        assert!(r.item_f64().is_err(), "{dtype}: item of 6 elements");
        assert_eq!(
            r.narrow(1, 1, 1)
                .unwrap()
                .sum()
                .unwrap()
                .item_f64()
                .unwrap(),
            5.0,
            "{dtype}: narrow + sum"
        );
        let shown = format!("{r:?}");
        assert!(
            shown.contains(&dtype.to_string()),
            "{dtype}: printed as {shown}"
        );
        let f = tp::finfo(dtype).unwrap();
        assert_eq!(f.bits, 16, "{dtype}: finfo bits");
        // random creation: the asked dtype (randn once gave float32 for a 16-bit dtype), and
        // the float64 draws of the same seed rounded once
        type Draw = fn(&[usize], DType) -> tp::Result<Tensor>;
        let draws: [(&str, Draw); 2] = [
            ("randn", |s, d| Tensor::randn(s, d)),
            ("rand", |s, d| Tensor::rand(s, d)),
        ];
        for (name, draw) in draws {
            tp::manual_seed(5);
            let want = draw(&[64], DType::F64).unwrap().to_dtype(dtype).unwrap();
            tp::manual_seed(5);
            let got = draw(&[64], dtype).unwrap();
            assert_eq!(got.dtype(), dtype, "{dtype}: {name}'s dtype");
            assert_eq!(
                got.to_vec_f64().unwrap(),
                want.to_vec_f64().unwrap(),
                "{dtype}: {name}'s values"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// ops and gradients

/// How an op's 16-bit result relates to its float32 result (see the module's docs).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Family {
    Exact,
    Accumulating,
}

/// The inputs of a case: float leaves of these shapes (distinct values in about [-2, 2], or
/// positive with `Pos`), and integer or boolean tensors that stay as they are.
#[derive(Clone)]
enum Input {
    Float(&'static [usize]),
    Pos(&'static [usize]),
    Fixed(fn() -> Tensor),
}

type F = fn(&[Tensor]) -> tp::Result<Tensor>;

/// One op: its inputs, the op, and its family.
struct Case {
    name: &'static str,
    inputs: Vec<Input>,
    f: F,
    family: Family,
}

/// `n` distinct values in about [-2, 2] (offset by `k`), exact in both 16-bit types.
fn vals(n: usize, k: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 + k * 11) % 101) as f32 / 25.0 - 2.0)
        .collect()
}

fn leaves(c: &Case, dtype: DType) -> Vec<Tensor> {
    c.inputs
        .iter()
        .enumerate()
        .map(|(k, i)| match i {
            Input::Float(s) | Input::Pos(s) => {
                let n = s.iter().product();
                let mut v = vals(n, k);
                if matches!(i, Input::Pos(_)) {
                    v.iter_mut().for_each(|x| *x += 2.5);
                }
                let t = Tensor::from_vec(v, s).unwrap().to_dtype(dtype).unwrap();
                t.requires_grad_(true)
            }
            Input::Fixed(f) => f(),
        })
        .collect()
}

fn eps(dtype: DType) -> f64 {
    tp::finfo(dtype).unwrap().eps
}

/// `got` against `want` rounded to `dtype`, within `ulps` eps of the largest expected
/// magnitude (0: bit for bit after rounding).
fn compare(what: &str, got: &Tensor, want: &Tensor, dtype: DType, ulps: f64) -> Result<(), String> {
    if got.dtype() != want.dtype() && want.dtype() == DType::F32 && got.dtype() != dtype {
        return Err(format!("{what}: dtype {}, want {dtype}", got.dtype()));
    }
    let rounded = if want.dtype() == DType::F32 {
        want.to_dtype(dtype)
    } else {
        Ok(want.clone())
    };
    let want = rounded
        .and_then(|t| t.to_vec_f64())
        .map_err(|e| e.to_string())?;
    let got = got.to_vec_f64().map_err(|e| e.to_string())?;
    let scale = want
        .iter()
        .fold(0f64, |m, v| if v.is_finite() { m.max(v.abs()) } else { m });
    let tol = Tol {
        abs: ulps * eps(dtype) * scale,
        rel: 0.0,
    };
    check_close(what, &got, &want, tol)
}

fn check(c: &Case) -> Result<(), String> {
    for dtype in [DType::BF16, DType::F16] {
        let x16 = leaves(c, dtype);
        let x32: Vec<Tensor> = x16
            .iter()
            .map(|t| {
                if t.dtype() == dtype {
                    t.detach()
                        .to_dtype(DType::F32)
                        .unwrap()
                        .requires_grad_(true)
                } else {
                    t.clone()
                }
            })
            .collect();
        let name = format!("{} in {dtype}", c.name);
        let y16 = (c.f)(&x16).map_err(|e| format!("{name}: {e}"))?;
        let y32 = (c.f)(&x32).map_err(|e| format!("{name} (float32): {e}"))?;
        if y32.dtype() == DType::F32 && y16.dtype() != dtype {
            return Err(format!(
                "{name}: output dtype {}, want {dtype}",
                y16.dtype()
            ));
        }
        let ulps = match c.family {
            Family::Exact => 0.0,
            Family::Accumulating => ACC,
        };
        compare(&format!("{name}: forward"), &y16, &y32, dtype, ulps)?;
        if !y16.requires_grad() {
            continue;
        }
        // a weighted sum, so that every output element's gradient differs
        let w = Tensor::from_vec(vals(y16.numel(), 7), y16.shape())
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let w32 = w.to_dtype(DType::F32).unwrap();
        y16.mul(&w)
            .unwrap()
            .sum()
            .unwrap()
            .backward()
            .map_err(|e| format!("{name}: backward: {e}"))?;
        y32.mul(&w32)
            .unwrap()
            .sum()
            .unwrap()
            .backward()
            .map_err(|e| format!("{name}: backward (float32): {e}"))?;
        for (i, (a, b)) in x16.iter().zip(&x32).enumerate() {
            let (Some(ga), Some(gb)) = (a.grad(), b.grad()) else {
                if a.grad().is_some() != b.grad().is_some() {
                    return Err(format!(
                        "{name}: input {i} has a gradient in one precision only"
                    ));
                }
                continue;
            };
            if ga.dtype() != dtype {
                return Err(format!(
                    "{name}: input {i}'s gradient is {}, want {dtype}",
                    ga.dtype()
                ));
            }
            compare(
                &format!("{name}: gradient of input {i}"),
                &ga,
                &gb,
                dtype,
                GRAD,
            )?;
        }
    }
    Ok(())
}

fn mask() -> Tensor {
    Tensor::from_vec(vec![true, false, true, true, false, false], &[2, 3]).unwrap()
}
fn index() -> Tensor {
    Tensor::from_vec(vec![2i64, 0, 2, 1], &[4]).unwrap()
}
fn targets() -> Tensor {
    Tensor::from_vec(vec![1i64, 0, 4, 2], &[4]).unwrap()
}
fn tokens() -> Tensor {
    Tensor::from_vec(vec![3i64, 1, 3, 0, 5, 1], &[2, 3]).unwrap()
}

fn cases() -> Vec<Case> {
    use Family::*;
    use Input::*;
    let c = |name, inputs, f: F, family| Case {
        name,
        inputs,
        f,
        family,
    };
    vec![
        c(
            "add",
            vec![Float(&[2, 3]), Float(&[3])],
            |x| x[0].add(&x[1]),
            Exact,
        ),
        c(
            "sub",
            vec![Float(&[2, 3]), Float(&[2, 3])],
            |x| x[0].sub(&x[1]),
            Exact,
        ),
        c(
            "mul",
            vec![Float(&[2, 3]), Float(&[2, 1])],
            |x| x[0].mul(&x[1]),
            Exact,
        ),
        c(
            "div",
            vec![Float(&[2, 3]), Pos(&[2, 3])],
            |x| x[0].div(&x[1]),
            Exact,
        ),
        c(
            "pow",
            vec![Pos(&[2, 3]), Float(&[2, 3])],
            |x| x[0].pow(&x[1]),
            Exact,
        ),
        c(
            "maximum",
            vec![Float(&[2, 3]), Float(&[2, 3])],
            |x| x[0].maximum(&x[1]),
            Exact,
        ),
        c(
            "minimum",
            vec![Float(&[2, 3]), Float(&[2, 3])],
            |x| x[0].minimum(&x[1]),
            Exact,
        ),
        c(
            "add_scalar",
            vec![Float(&[5])],
            |x| x[0].add_scalar(0.1),
            Exact,
        ),
        c(
            "mul_scalar",
            vec![Float(&[5])],
            |x| x[0].mul_scalar(0.3),
            Exact,
        ),
        c(
            "div_scalar",
            vec![Float(&[5])],
            |x| x[0].div_scalar(3.0),
            Exact,
        ),
        c(
            "pow_scalar",
            vec![Pos(&[5])],
            |x| x[0].pow_scalar(1.5),
            Exact,
        ),
        c("neg", vec![Float(&[5])], |x| x[0].neg(), Exact),
        c("abs", vec![Float(&[5])], |x| x[0].abs(), Exact),
        c("sqrt", vec![Pos(&[5])], |x| x[0].sqrt(), Exact),
        c("exp", vec![Float(&[7])], |x| x[0].exp(), Exact),
        c("log", vec![Pos(&[7])], |x| x[0].log(), Exact),
        c("relu", vec![Float(&[7])], |x| x[0].relu(), Exact),
        c("sigmoid", vec![Float(&[7])], |x| x[0].sigmoid(), Exact),
        c("tanh", vec![Float(&[7])], |x| x[0].tanh(), Exact),
        c("gelu", vec![Float(&[7])], |x| x[0].gelu(), Exact),
        c("gelu_tanh", vec![Float(&[7])], |x| x[0].gelu_tanh(), Exact),
        c("erf", vec![Float(&[7])], |x| x[0].erf(), Exact),
        c("sign", vec![Float(&[7])], |x| x[0].sign(), Exact),
        c(
            "transpose + contiguous",
            vec![Float(&[3, 4])],
            |x| x[0].t()?.contiguous(),
            Exact,
        ),
        c(
            "reshape + permute",
            vec![Float(&[2, 3, 4])],
            |x| x[0].permute(&[2, 0, 1])?.reshape(&[4, 6]),
            Exact,
        ),
        c(
            "narrow",
            vec![Float(&[4, 3])],
            |x| x[0].narrow(0, 1, 2),
            Exact,
        ),
        c(
            "cat",
            vec![Float(&[2, 3]), Float(&[1, 3])],
            |x| tp::cat(&[x[0].clone(), x[1].clone()], 0),
            Exact,
        ),
        c(
            "stack",
            vec![Float(&[2, 3]), Float(&[2, 3])],
            |x| tp::stack(&[x[0].clone(), x[1].clone()], 1),
            Exact,
        ),
        c(
            "index_select",
            vec![Float(&[3, 4]), Fixed(index)],
            |x| x[0].index_select(0, &x[1]),
            Exact,
        ),
        c(
            "gather",
            vec![
                Float(&[2, 3]),
                Fixed(|| Tensor::from_vec(vec![2i64, 0, 1, 1], &[2, 2]).unwrap()),
            ],
            |x| x[0].gather(1, &x[1]),
            Exact,
        ),
        c(
            "where",
            vec![Float(&[2, 3]), Float(&[2, 3]), Fixed(mask)],
            |x| x[0].where_(&x[2], &x[1]),
            Exact,
        ),
        c(
            "masked_fill",
            vec![Float(&[2, 3]), Fixed(mask)],
            |x| x[0].masked_fill(&x[1], -1.5),
            Exact,
        ),
        c("tril", vec![Float(&[3, 3])], |x| x[0].tril(0), Exact),
        c("max", vec![Float(&[2, 3])], |x| x[0].max(), Exact),
        c(
            "max_dim",
            vec![Float(&[2, 3])],
            |x| Ok(x[0].max_dim(1, false)?.0),
            Exact,
        ),
        c(
            "min_dim",
            vec![Float(&[2, 3])],
            |x| Ok(x[0].min_dim(0, true)?.0),
            Exact,
        ),
        c(
            "argmax",
            vec![Float(&[2, 3])],
            |x| x[0].argmax(Some(1), false),
            Exact,
        ),
        c(
            "lt",
            vec![Float(&[2, 3]), Float(&[2, 3])],
            |x| x[0].lt(&x[1]),
            Exact,
        ),
        c("sum", vec![Float(&[4, 5])], |x| x[0].sum(), Accumulating),
        c(
            "sum over rows",
            vec![Float(&[4, 5])],
            |x| x[0].sum_dims(&[1], false),
            Accumulating,
        ),
        c(
            "sum over columns",
            vec![Float(&[4, 5])],
            |x| x[0].sum_dims(&[0], false),
            Accumulating,
        ),
        c(
            "sum over the middle",
            vec![Float(&[2, 5, 3])],
            |x| x[0].sum_dims(&[1], true),
            Accumulating,
        ),
        c("mean", vec![Float(&[4, 5])], |x| x[0].mean(), Accumulating),
        c(
            "mean_dims",
            vec![Float(&[4, 5])],
            |x| x[0].mean_dims(&[0], false),
            Accumulating,
        ),
        c(
            "softmax",
            vec![Float(&[3, 5])],
            |x| x[0].softmax(-1),
            Accumulating,
        ),
        c(
            "log_softmax",
            vec![Float(&[3, 5])],
            |x| x[0].log_softmax(-1),
            Accumulating,
        ),
        c(
            "matmul",
            vec![Float(&[3, 4]), Float(&[4, 5])],
            |x| x[0].matmul(&x[1]),
            Accumulating,
        ),
        c(
            "batched matmul",
            vec![Float(&[2, 3, 4]), Float(&[4, 2])],
            |x| x[0].matmul(&x[1]),
            Accumulating,
        ),
        c(
            "linear",
            vec![Float(&[3, 4]), Float(&[5, 4]), Float(&[5])],
            |x| tp::nn::functional::linear(&x[0], &x[1], Some(&x[2])),
            Accumulating,
        ),
        c(
            "layer_norm",
            vec![Float(&[3, 6]), Pos(&[6]), Float(&[6])],
            |x| tp::nn::functional::layer_norm(&x[0], &[6], Some(&x[1]), Some(&x[2]), 1e-5),
            Accumulating,
        ),
        c(
            "cross_entropy",
            vec![Float(&[4, 5]), Fixed(targets)],
            |x| tp::nn::functional::cross_entropy(&x[0], &x[1]),
            Accumulating,
        ),
        c(
            "mse_loss",
            vec![Float(&[4, 5]), Float(&[4, 5])],
            |x| tp::nn::functional::mse_loss(&x[0], &x[1]),
            Accumulating,
        ),
        c(
            "embedding",
            vec![Float(&[6, 4]), Fixed(tokens)],
            |x| tp::nn::functional::embedding(&x[1], &x[0]),
            Accumulating,
        ),
        c(
            "scaled_dot_product_attention",
            vec![
                Float(&[1, 2, 4, 8]),
                Float(&[1, 2, 4, 8]),
                Float(&[1, 2, 4, 8]),
            ],
            |x| {
                tp::nn::functional::scaled_dot_product_attention(
                    &x[0], &x[1], &x[2], None, 0.0, true, None,
                )
            },
            Accumulating,
        ),
    ]
}

#[test]
fn every_op_and_gradient_in_16_bits_matches_float32_rounded() {
    let failures: Vec<String> = cases().iter().filter_map(|c| check(c).err()).collect();
    assert!(
        failures.is_empty(),
        "{} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Means and losses whose float32 result fits the 16-bit type while an intermediate (the sum,
/// a square) would not: computed in float32 and rounded once, never infinite. The expected
/// values are the exact results rounded to the dtype.
#[test]
fn means_and_losses_in_16_bits_do_not_overflow_their_intermediates() {
    type Op = fn(DType) -> tp::Result<Tensor>;
    /// float16: near its largest value, so the sum of two is not a float16 (it is a float32).
    /// bfloat16 has float32's range: two values near its largest would overflow the float32
    /// sum too (as in PyTorch), so it takes a value whose sum fits.
    fn big(d: DType) -> f64 {
        if d == DType::BF16 { 1e38 } else { 6e4 }
    }
    type Want = fn(DType) -> Vec<f64>;
    let cases: [(&str, Op, Want); 5] = [
        (
            "mean of 40000 twos (sum 80000)",
            |d| Tensor::full(&[40000], 2.0, d)?.mean(),
            |_| vec![2.0],
        ),
        (
            "mean_dims over rows of 40000 twos",
            |d| Tensor::full(&[2, 40000], 2.0, d)?.mean_dims(&[1], false),
            |_| vec![2.0, 2.0],
        ),
        (
            "mse_loss of [300, 0] against zeros (300^2 = 90000)",
            |d| {
                let x = Tensor::from_vec(vec![300.0f32, 0.0], &[2])?.to_dtype(d)?;
                tp::nn::functional::mse_loss(&x, &Tensor::zeros(&[2], d)?)
            },
            |_| vec![45000.0],
        ),
        (
            "mse_loss of 40000 differences of 2",
            |d| {
                tp::nn::functional::mse_loss(
                    &Tensor::full(&[40000], 2.0, d)?,
                    &Tensor::zeros(&[40000], d)?,
                )
            },
            |_| vec![4.0],
        ),
        (
            "mean of two values near the largest",
            |d| Tensor::full(&[2], big(d), d)?.mean(),
            |d| vec![big(d)],
        ),
    ];
    for dtype in [DType::BF16, DType::F16] {
        for (name, op, want) in &cases {
            let got = op(dtype).unwrap_or_else(|e| panic!("{dtype}, {name}: {e}"));
            assert_eq!(got.dtype(), dtype, "{dtype}, {name}");
            let want = want(dtype);
            let rounded = Tensor::from_vec(want.clone(), &[want.len()])
                .and_then(|t| t.to_dtype(dtype))
                .and_then(|t| t.to_vec_f64())
                .unwrap();
            assert_eq!(got.to_vec_f64().unwrap(), rounded, "{dtype}, {name}");
        }
    }
}

/// The optimizers refuse 16-bit parameters when built (float32 masters are the rule), naming
/// the optimizer and the parameter, so no step can update some parameters and fail on others.
#[test]
fn optimizers_refuse_16_bit_parameters_when_built() {
    use tp::optim::{Adam, AdamW, SGD};
    type Build = fn(Vec<Tensor>) -> tp::Result<()>;
    let builds: [(&str, Build); 3] = [
        ("SGD", |p| SGD::new(p, Default::default()).map(drop)),
        ("Adam", |p| Adam::new(p, Default::default()).map(drop)),
        ("AdamW", |p| AdamW::new(p, Default::default()).map(drop)),
    ];
    for dtype in [DType::BF16, DType::F16] {
        for (name, build) in &builds {
            let params = vec![
                Tensor::ones(&[2], DType::F32).unwrap().requires_grad_(true),
                Tensor::ones(&[2], dtype).unwrap().requires_grad_(true),
            ];
            let e = build(params)
                .err()
                .unwrap_or_else(|| panic!("{name} accepted a {dtype} parameter"))
                .to_string();
            for part in [
                *name,
                "float32 or float64",
                &format!("parameter 1 of dtype {dtype}"),
            ] {
                assert!(e.contains(part), "{name}, {dtype}: {e}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// tiny magnitudes in matrix products

/// One 16-bit product whose elements or partial products are tiny: `a` (`1 x k`, every
/// element `2^ea`) times `b` (`k x n`, every element `2^eb`), in `dtype`.
struct TinyCase {
    name: &'static str,
    dtype: DType,
    k: usize,
    n: usize,
    ea: i32,
    eb: i32,
}

/// The 16-bit product equals the float32 product of the same (exact) values rounded once: on
/// a processor whose bfloat16 kernel flushes subnormals (`VDPBF16PS`), operands this small
/// take the exact path.
fn check_tiny(c: &TinyCase) {
    let (name, dtype) = (c.name, c.dtype);
    let run = |dt: DType| -> Vec<f32> {
        let a = Tensor::full(&[1, c.k], 2f64.powi(c.ea), DType::F32).and_then(|t| t.to_dtype(dt));
        let b = Tensor::full(&[c.k, c.n], 2f64.powi(c.eb), DType::F32).and_then(|t| t.to_dtype(dt));
        let y = a.and_then(|a| b.and_then(|b| a.matmul(&b)));
        y.and_then(|y| y.to_dtype(DType::F32))
            .and_then(|y| y.to_vec::<f32>())
            .unwrap_or_else(|e| panic!("{name} ({dtype}): {e}"))
    };
    let want: Vec<f32> = Tensor::from_vec(run(DType::F32), &[c.n])
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.to_vec::<f32>())
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let got = run(dtype);
    assert!(
        want[0] != 0.0,
        "{name} ({dtype}): the case must not round to zero"
    );
    assert_eq!(got, want, "{name} ({dtype})");
}

#[test]
fn tiny_products_are_not_flushed_to_zero() {
    let case = |name, dtype, k, n, ea, eb| TinyCase {
        name,
        dtype,
        k,
        n,
        ea,
        eb,
    };
    let (bf, h) = (DType::BF16, DType::F16);
    let cases = [
        case(
            "products below float32's normals, sum above",
            bf,
            64,
            1,
            -70,
            -60,
        ),
        case("a bfloat16 subnormal input", bf, 1, 1, -130, 40),
        case("a subnormal result", bf, 1, 1, -64, -64),
        case("a tile-sized product", bf, 64, 64, -70, -60),
        // float16's range: subnormals below 2^-14
        case("float16 subnormal input", h, 8, 40, -20, 3),
        case("float16 subnormal result", h, 2, 33, -9, -9),
    ];
    for c in &cases {
        check_tiny(c);
    }
}
