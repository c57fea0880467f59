//! bfloat16 and float16 on `cuda:0` against the CPU: copies and casts to and from every dtype
//! (bit-exact), elementwise ops, sums, softmax, cross-entropy and matrix products (cuBLAS's
//! `GemmEx` with float32 compute). On a device older than compute capability 8.0 a bfloat16
//! tensor must be refused naming the capability (and its checks are skipped).
//!
//! Tolerances (relative, with an absolute floor of the same size): one 16-bit unit in the last
//! place for elementwise ops (bfloat16 2^-7, float16 2^-10: the same float32 value rounded once,
//! but the device's transcendental functions may differ from the CPU's by a float32 ulp); four
//! for sums, softmax, cross-entropy and products (another summation order in float32, then one
//! rounding).

use tensorplay as tp;
use tp::{DType, Tensor};

use super::ops::{Gen, close};
use super::{Res, e};

/// Every check of both 16-bit types.
pub(crate) fn sixteen_bit() -> Res {
    let mut g = Gen::new(39);
    for dt in [DType::BF16, DType::F16] {
        let ulp = if dt == DType::BF16 {
            1.0 / 128.0
        } else {
            1.0 / 1024.0
        };
        let make = |g: &mut Gen, shape: &[usize]| {
            let n = shape.iter().product();
            Tensor::from_vec(g.values(n), shape)
                .and_then(|t| t.to_dtype(dt))
                .map_err(e)
        };
        let x = make(&mut g, &[4099])?;
        let gx = match x.to("cuda:0") {
            Ok(t) => t,
            Err(err) if dt == DType::BF16 && err.to_string().contains("compute capability") => {
                if !err.to_string().contains("needs compute capability 8.0") {
                    return Err(format!("the refusal of bfloat16 does not say why: {err}"));
                }
                println!("        bfloat16 refused as it must be here: {err}");
                continue;
            }
            Err(err) => return Err(format!("{dt} to cuda:0: {err}")),
        };
        close(&format!("{dt} to cuda:0 and back"), &gx, &x, 0.0)?;
        for to in DType::ALL {
            let want = x.to_dtype(to).map_err(e)?;
            let got = gx.to_dtype(to).map_err(e)?;
            close(&format!("{dt} -> {to} on cuda"), &got, &want, 0.0)?;
            let back = want.to_dtype(dt).map_err(e)?;
            let got = got.to_dtype(dt).map_err(e)?;
            close(&format!("{to} -> {dt} on cuda"), &got, &back, 0.0)?;
        }
        let y = make(&mut g, &[4099])?;
        let gy = y.to("cuda:0").map_err(e)?;
        type Op = fn(&Tensor, &Tensor) -> tp::Result<Tensor>;
        let ops: [(&str, Op, f64); 8] = [
            ("add", |a, b| a.add(b), 0.0),
            ("mul", |a, b| a.mul(b), 0.0),
            ("div", |a, b| a.div(b), 0.0),
            ("exp", |a, _| a.exp(), ulp),
            ("tanh", |a, _| a.tanh(), ulp),
            ("gelu", |a, _| a.gelu(), ulp),
            ("sum", |a, _| a.sum(), 4.0 * ulp),
            ("gt", |a, b| a.gt(b), 0.0),
        ];
        for (name, f, tol) in ops {
            let want = f(&x, &y).map_err(e)?;
            close(
                &format!("{name} {dt}"),
                &f(&gx, &gy).map_err(e)?,
                &want,
                tol,
            )?;
        }
        let logits = make(&mut g, &[33, 129])?;
        let gl = logits.to("cuda:0").map_err(e)?;
        let want = logits.softmax(-1).map_err(e)?;
        close(
            &format!("softmax {dt}"),
            &gl.softmax(-1).map_err(e)?,
            &want,
            4.0 * ulp,
        )?;
        let target: Vec<i64> = (0..33).map(|_| g.below(129) as i64).collect();
        let t = Tensor::from_vec(target, &[33]).map_err(e)?;
        let gt = t.to("cuda:0").map_err(e)?;
        let ce = |l: &Tensor, t: &Tensor| tp::nn::functional::cross_entropy(l, t).map_err(e);
        close(
            &format!("cross_entropy {dt}"),
            &ce(&gl, &gt)?,
            &ce(&logits, &t)?,
            4.0 * ulp,
        )?;
        for (sa, sb) in [
            (vec![64, 96], vec![96, 80]),
            (vec![3, 17, 33], vec![3, 33, 9]),
        ] {
            let (a, b) = (make(&mut g, &sa)?, make(&mut g, &sb)?);
            let want = a.matmul(&b).map_err(e)?;
            let got = a
                .to("cuda:0")
                .and_then(|ga| ga.matmul(&b.to("cuda:0")?))
                .map_err(e)?;
            close(
                &format!("matmul {dt} {sa:?} @ {sb:?}"),
                &got,
                &want,
                4.0 * ulp,
            )?;
        }
    }
    Ok(())
}
