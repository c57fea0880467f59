//! The layers a transformer needs: tanh-GELU, LayerNorm, masked_fill, triu/tril, scaled
//! dot-product attention, MultiheadAttention, ModuleList, tied weights and the warm-up + cosine
//! schedule. Values against hand-written float64 loops, gradients against finite differences
//! (float64), and the errors of bad arguments.

use tensorplay_core::autograd::{GradcheckOptions, gradcheck};
use tensorplay_core::nn::{self, Module, functional as F};
use tensorplay_core::optim::lr_scheduler::{LrScheduler, WarmupCosineLR};
use tensorplay_core::optim::{AdamW, AdamWOptions, Optimizer};
use tensorplay_core::{self as tp, DType, Error, Tensor};

/// Distinct values in about (-2.9, 2.9), offset by `k`.
fn vals(n: usize, k: usize) -> Vec<f64> {
    (0..n)
        .map(|i| ((i * 7 + k * 5) % 29) as f64 / 5.0 - 2.9 + 0.01 * i as f64)
        .collect()
}

fn leaf(shape: &[usize], k: usize) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(vals(n, k), shape)
        .unwrap()
        .requires_grad_(true)
}

fn check(name: &str, f: impl Fn(&[Tensor]) -> tp::Result<Vec<Tensor>>, inputs: &[Tensor]) {
    if let Err(e) = gradcheck(f, inputs, GradcheckOptions::default()) {
        panic!("gradcheck of {name} failed: {e}");
    }
}

fn close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    tensorplay_testkit::assert_close(what, got, want, tensorplay_testkit::Tol::scaled(tol));
}

fn invalid_arg(e: Error) -> &'static str {
    match e {
        Error::InvalidArgument { arg, .. } => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// tanh-GELU

fn gelu_tanh_ref(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}

#[test]
fn gelu_tanh_values_gradients_and_module() -> tp::Result<()> {
    let x = leaf(&[3, 5], 0);
    let want: Vec<f64> = vals(15, 0).into_iter().map(gelu_tanh_ref).collect();
    close("gelu_tanh f64", &x.gelu_tanh()?.to_vec()?, &want, 1e-15);
    // float32 within float32's precision, and a transposed view read in logical order
    let x32 = x.detach().to_dtype(DType::F32)?.t()?;
    let got: Vec<f64> = x32.gelu_tanh()?.to_vec_f64()?;
    let want_t = x.detach().t()?.contiguous()?.to_vec::<f64>()?;
    let want_t: Vec<f64> = want_t.into_iter().map(gelu_tanh_ref).collect();
    close("gelu_tanh f32 transposed", &got, &want_t, 1e-6);
    check(
        "gelu_tanh",
        |xs| Ok(vec![xs[0].gelu_tanh()?]),
        std::slice::from_ref(&x),
    );
    // the module and the functional form
    let m = nn::GELU::tanh().call(&x)?.to_vec::<f64>()?;
    close("GELU::tanh", &m, &want, 1e-15);
    let e = F::gelu(&x, F::Approximate::None)?.to_vec::<f64>()?;
    close("F::gelu exact", &e, &x.gelu()?.to_vec::<f64>()?, 0.0);
    // the approximation stays within 5e-4 of the exact GELU
    for (a, b) in m.iter().zip(&e) {
        assert!((a - b).abs() < 5e-4, "{a} vs {b}");
    }
    assert!(matches!(
        Tensor::from_vec(vec![1i64], &[1])?.gelu_tanh(),
        Err(Error::UnsupportedDType { .. })
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// LayerNorm

/// `(x - mean) / sqrt(var + eps) * w + b` over rows of `n`, in plain float64.
fn layer_norm_ref(x: &[f64], n: usize, w: &[f64], b: &[f64], eps: f64) -> Vec<f64> {
    let mut out = Vec::new();
    for row in x.chunks(n) {
        let mean = row.iter().sum::<f64>() / n as f64;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
        for (i, v) in row.iter().enumerate() {
            out.push((v - mean) / (var + eps).sqrt() * w[i] + b[i]);
        }
    }
    out
}

#[test]
fn layer_norm_values_and_gradients() -> tp::Result<()> {
    let x = leaf(&[2, 3, 4], 1);
    let w = leaf(&[4], 2);
    let b = leaf(&[4], 3);
    let y = F::layer_norm(&x, &[4], Some(&w), Some(&b), 1e-5)?;
    let want = layer_norm_ref(&vals(24, 1), 4, &vals(4, 2), &vals(4, 3), 1e-5);
    close("layer_norm", &y.to_vec()?, &want, 1e-12);
    check(
        "layer_norm affine",
        |t| {
            Ok(vec![F::layer_norm(
                &t[0],
                &[4],
                Some(&t[1]),
                Some(&t[2]),
                1e-5,
            )?])
        },
        &[x.clone(), w.clone(), b.clone()],
    );
    check(
        "layer_norm over two trailing dims",
        |t| {
            Ok(vec![F::layer_norm(
                &t[0],
                &[3, 4],
                Some(&t[1]),
                None,
                1e-3,
            )?])
        },
        &[x.clone(), leaf(&[3, 4], 4)],
    );
    check(
        "layer_norm without affine, transposed input",
        |t| {
            Ok(vec![F::layer_norm(
                &t[0].transpose(0, 2)?,
                &[2],
                None,
                None,
                0.0,
            )?])
        },
        std::slice::from_ref(&x),
    );
    // float32 agrees with float64
    let y32 = F::layer_norm(
        &x.detach().to_dtype(DType::F32)?,
        &[4],
        Some(&w.detach().to_dtype(DType::F32)?),
        Some(&b.detach().to_dtype(DType::F32)?),
        1e-5,
    )?;
    close("layer_norm f32", &y32.to_vec_f64()?, &want, 1e-5);

    // the module: ones and zeros, PyTorch's names, the same values as the functional form
    let ln = nn::LayerNorm::with_dtype(&[4], 1e-5, DType::F64)?;
    let names: Vec<String> = ln.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["weight", "bias"]);
    let plain = layer_norm_ref(&vals(24, 1), 4, &[1.0; 4], &[0.0; 4], 1e-5);
    close("LayerNorm module", &ln.call(&x)?.to_vec()?, &plain, 1e-12);

    // errors name the argument
    assert_eq!(
        invalid_arg(F::layer_norm(&x, &[3], None, None, 1e-5).unwrap_err()),
        "normalized_shape"
    );
    assert_eq!(
        invalid_arg(F::layer_norm(&x, &[], None, None, 1e-5).unwrap_err()),
        "normalized_shape"
    );
    assert_eq!(
        invalid_arg(F::layer_norm(&x, &[4], None, None, -1.0).unwrap_err()),
        "eps"
    );
    assert!(matches!(
        F::layer_norm(&x, &[4], Some(&leaf(&[3], 0)), None, 1e-5),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        F::layer_norm(
            &x,
            &[4],
            Some(&w.detach().to_dtype(DType::F32)?),
            None,
            1e-5
        ),
        Err(Error::DTypeMismatch { .. })
    ));
    assert!(matches!(
        F::layer_norm(
            &Tensor::from_vec(vec![1i64, 2], &[2])?,
            &[2],
            None,
            None,
            1e-5
        ),
        Err(Error::UnsupportedDType { .. })
    ));
    assert_eq!(
        invalid_arg(nn::LayerNorm::new(&[], 1e-5).unwrap_err()),
        "normalized_shape"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// masked_fill, triu, tril

#[test]
fn masked_fill_triu_tril_values_and_gradients() -> tp::Result<()> {
    let x = leaf(&[2, 3, 4], 5);
    // a [3, 4] mask broadcast over the batch
    let m: Vec<bool> = (0..12).map(|i| i % 3 == 1).collect();
    let mask = Tensor::from_vec(m.clone(), &[3, 4])?;
    let y = x.masked_fill(&mask, -7.5)?.to_vec::<f64>()?;
    let xv = vals(24, 5);
    for (i, v) in y.iter().enumerate() {
        let want = if m[i % 12] { -7.5 } else { xv[i] };
        assert_eq!(*v, want, "masked_fill element {i}");
    }
    check(
        "masked_fill",
        |t| Ok(vec![t[0].masked_fill(&mask, f64::NEG_INFINITY)?.exp()?]),
        std::slice::from_ref(&x),
    );
    assert!(matches!(
        x.masked_fill(&x.detach(), 0.0),
        Err(Error::UnsupportedDType { .. })
    ));
    // a mask larger than the input does not broadcast to it
    let big = Tensor::from_vec(vec![true; 48], &[2, 2, 3, 4])?;
    assert!(x.masked_fill(&big, 0.0).is_err());

    let a = leaf(&[2, 3, 4], 6);
    let av = vals(24, 6);
    for diag in [-1i64, 0, 1, 3] {
        let up = a.triu(diag)?.to_vec::<f64>()?;
        let low = a.tril(diag)?.to_vec::<f64>()?;
        for (idx, v) in av.iter().enumerate() {
            let (i, j) = ((idx % 12) / 4, idx % 4);
            let d = j as i64 - i as i64;
            assert_eq!(
                up[idx],
                if d >= diag { *v } else { 0.0 },
                "triu({diag}) at {idx}"
            );
            assert_eq!(
                low[idx],
                if d <= diag { *v } else { 0.0 },
                "tril({diag}) at {idx}"
            );
        }
    }
    check(
        "triu",
        |t| Ok(vec![t[0].triu(1)?]),
        std::slice::from_ref(&a),
    );
    check(
        "tril",
        |t| Ok(vec![t[0].tril(-1)?]),
        std::slice::from_ref(&a),
    );
    let ints = Tensor::from_vec(vec![1i64, 2, 3, 4], &[2, 2])?;
    assert_eq!(ints.tril(0)?.to_vec::<i64>()?, [1, 0, 3, 4]);
    assert_eq!(invalid_arg(leaf(&[3], 0).triu(0).unwrap_err()), "input");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// attention

/// Naive attention of one `[L, E]` query block over `[S, E]` keys and `[S, Ev]` values.
fn attention_ref(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    l: usize,
    s: usize,
    e: usize,
    causal: bool,
) -> Vec<f64> {
    let ev = v.len() / s;
    let mut out = vec![0.0; l * ev];
    for i in 0..l {
        let scores: Vec<f64> = (0..s)
            .map(|j| {
                if causal && j > i {
                    f64::NEG_INFINITY
                } else {
                    (0..e).map(|c| q[i * e + c] * k[j * e + c]).sum::<f64>() / (e as f64).sqrt()
                }
            })
            .collect();
        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = w.iter().sum();
        for j in 0..s {
            for c in 0..ev {
                out[i * ev + c] += w[j] / z * v[j * ev + c];
            }
        }
    }
    out
}

#[test]
fn scaled_dot_product_attention_values_and_gradients() -> tp::Result<()> {
    let (b, h, l, e) = (2, 2, 4, 3);
    let q = leaf(&[b, h, l, e], 7);
    let k = leaf(&[b, h, l, e], 8);
    let v = leaf(&[b, h, l, e], 9);
    for causal in [false, true] {
        let y = F::scaled_dot_product_attention(&q, &k, &v, None, 0.0, causal, None)?;
        assert_eq!(y.shape(), [b, h, l, e]);
        let y = y.to_vec::<f64>()?;
        let (qv, kv, vv) = (vals(48, 7), vals(48, 8), vals(48, 9));
        for blk in 0..b * h {
            let r = blk * l * e..(blk + 1) * l * e;
            let want = attention_ref(
                &qv[r.clone()],
                &kv[r.clone()],
                &vv[r.clone()],
                l,
                l,
                e,
                causal,
            );
            close(
                &format!("sdpa causal={causal} block {blk}"),
                &y[r],
                &want,
                1e-12,
            );
        }
        check(
            &format!("sdpa causal={causal}"),
            |t| {
                Ok(vec![F::scaled_dot_product_attention(
                    &t[0], &t[1], &t[2], None, 0.0, causal, None,
                )?])
            },
            &[q.clone(), k.clone(), v.clone()],
        );
    }
    // a bool mask (true = attend) equals the float mask of 0 / -inf, and is_causal equals the
    // lower-triangular bool mask
    let tri = Tensor::ones(&[l, l], DType::F64)?
        .tril(0)?
        .to_dtype(DType::Bool)?;
    let float_mask =
        Tensor::zeros(&[l, l], DType::F64)?.masked_fill(&tri.logical_not()?, f64::NEG_INFINITY)?;
    let by_bool = F::scaled_dot_product_attention(&q, &k, &v, Some(&tri), 0.0, false, None)?;
    let by_float =
        F::scaled_dot_product_attention(&q, &k, &v, Some(&float_mask), 0.0, false, None)?;
    let causal = F::scaled_dot_product_attention(&q, &k, &v, None, 0.0, true, None)?;
    close(
        "bool mask vs float mask",
        &by_bool.to_vec()?,
        &by_float.to_vec()?,
        1e-15,
    );
    close(
        "bool mask vs is_causal",
        &by_bool.to_vec()?,
        &causal.to_vec()?,
        1e-15,
    );
    // a key length different from the query's, and an explicit scale
    let k5 = leaf(&[b, h, 5, e], 10);
    let v5 = leaf(&[b, h, 5, 2], 11);
    let y = F::scaled_dot_product_attention(&q, &k5, &v5, None, 0.0, false, Some(0.5))?;
    assert_eq!(y.shape(), [b, h, l, 2]);
    check(
        "sdpa with S != L and a scale",
        |t| {
            Ok(vec![F::scaled_dot_product_attention(
                &t[0],
                &t[1],
                &t[2],
                None,
                0.0,
                false,
                Some(0.5),
            )?])
        },
        &[q.clone(), k5.clone(), v5.clone()],
    );
    // errors
    assert_eq!(
        invalid_arg(
            F::scaled_dot_product_attention(&q, &k, &v, Some(&tri), 0.0, true, None).unwrap_err()
        ),
        "attn_mask"
    );
    assert_eq!(
        invalid_arg(
            F::scaled_dot_product_attention(
                &q,
                &leaf(&[b, h, l, 2], 0),
                &v,
                None,
                0.0,
                false,
                None
            )
            .unwrap_err()
        ),
        "key"
    );
    assert_eq!(
        invalid_arg(
            F::scaled_dot_product_attention(&q, &k, &v5, None, 0.0, false, None).unwrap_err()
        ),
        "value"
    );
    assert_eq!(
        invalid_arg(
            F::scaled_dot_product_attention(&q, &k, &v, None, 1.5, false, None).unwrap_err()
        ),
        "dropout_p"
    );
    // an integer mask is neither a bool nor an additive mask; inputs of mixed dtypes
    for dtype in [DType::I64, DType::F32] {
        let mask = Tensor::zeros(&[l, l], dtype)?;
        let e = F::scaled_dot_product_attention(&q, &k, &v, Some(&mask), 0.0, false, None)
            .expect_err(&format!("a {dtype} mask for a float64 query"));
        assert_eq!(invalid_arg(e), "attn_mask", "{dtype} mask");
    }
    for (name, k32, v32) in [
        ("key", k.to_dtype(DType::F32)?, v.clone()),
        ("value", k.clone(), v.to_dtype(DType::F32)?),
    ] {
        assert_eq!(
            invalid_arg(
                F::scaled_dot_product_attention(&q, &k32, &v32, None, 0.0, false, None)
                    .unwrap_err()
            ),
            name
        );
    }
    assert!(
        F::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            Some(&Tensor::ones(&[3, 3], DType::Bool)?),
            0.0,
            false,
            None
        )
        .is_err()
    );
    Ok(())
}

#[test]
fn multihead_attention_matches_its_definition() -> tp::Result<()> {
    tp::manual_seed(3);
    let (bsz, t, e, heads) = (2, 5, 8, 2);
    let mut mha = nn::MultiheadAttention::new(e, heads, 0.0, true)?.causal(true);
    let names: Vec<String> = mha.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "in_proj_weight",
            "in_proj_bias",
            "out_proj.weight",
            "out_proj.bias"
        ]
    );
    // Xavier-uniform bound sqrt(6 / (E + 3E)), zero biases
    let bound = (6.0f64 / (4 * e) as f64).sqrt();
    assert!(
        mha.in_proj_weight
            .to_vec_f64()?
            .iter()
            .all(|w| w.abs() <= bound)
    );
    assert!(
        mha.in_proj_bias
            .as_ref()
            .unwrap()
            .to_vec_f64()?
            .iter()
            .all(|b| *b == 0.0)
    );
    // float64 parameters with non-zero biases, then the definition written out
    mha.in_proj_weight = leaf(&[3 * e, e], 12)
        .mul_scalar(0.2)?
        .detach()
        .requires_grad_(true);
    mha.in_proj_bias = Some(
        leaf(&[3 * e], 13)
            .mul_scalar(0.1)?
            .detach()
            .requires_grad_(true),
    );
    mha.out_proj = nn::Linear::from_weights(
        leaf(&[e, e], 14)
            .mul_scalar(0.2)?
            .detach()
            .requires_grad_(true),
        Some(leaf(&[e], 15)),
    )?;
    let x = leaf(&[bsz, t, e], 16);
    let y = mha.call(&x)?;
    let w = &mha.in_proj_weight;
    let bias = mha.in_proj_bias.clone().unwrap();
    let proj = |i: usize| -> tp::Result<Tensor> {
        F::linear(
            &x,
            &w.narrow(0, i * e, e)?,
            Some(&bias.narrow(0, i * e, e)?),
        )?
        .reshape(&[bsz, t, heads, e / heads])?
        .permute(&[0, 2, 1, 3])
    };
    let att =
        F::scaled_dot_product_attention(&proj(0)?, &proj(1)?, &proj(2)?, None, 0.0, true, None)?;
    let want = mha
        .out_proj
        .call(&att.permute(&[0, 2, 1, 3])?.reshape(&[bsz, t, e])?)?;
    close("MultiheadAttention", &y.to_vec()?, &want.to_vec()?, 1e-13);
    // gradients of the input and every parameter
    let (wi, bi) = (mha.in_proj_weight.clone(), bias.clone());
    let (wo, bo) = (
        mha.out_proj.weight.clone(),
        mha.out_proj.bias.clone().unwrap(),
    );
    check(
        "MultiheadAttention",
        |p| {
            let mut m = nn::MultiheadAttention::new(e, heads, 0.0, true)?.causal(true);
            m.in_proj_weight = p[1].clone();
            m.in_proj_bias = Some(p[2].clone());
            m.out_proj = nn::Linear::from_weights(p[3].clone(), Some(p[4].clone()))?;
            Ok(vec![m.call(&p[0])?])
        },
        &[x.clone(), wi, bi, wo, bo],
    );
    // bool masks as in PyTorch: MultiheadAttention masks where true (triu(1) is causal),
    // scaled_dot_product_attention attends where true (tril is causal); a float mask adds
    let ones = Tensor::ones(&[t, t], DType::Bool)?;
    let blocked = ones.triu(1)?;
    let bias = Tensor::zeros(&[t, t], DType::F64)?.masked_fill(&blocked, f64::NEG_INFINITY)?;
    for (what, got) in [
        (
            "MHA bool mask",
            mha.attend(&x, &x, &x, Some(&blocked), false)?,
        ),
        (
            "MHA float mask",
            mha.attend(&x, &x, &x, Some(&bias), false)?,
        ),
        ("MHA is_causal", mha.attend(&x, &x, &x, None, true)?),
    ] {
        close(what, &got.to_vec()?, &want.to_vec()?, 1e-13);
    }
    let (q, k, v) = (
        leaf(&[bsz, 2, t, 3], 21),
        leaf(&[bsz, 2, t, 3], 22),
        leaf(&[bsz, 2, t, 3], 23),
    );
    let causal = F::scaled_dot_product_attention(&q, &k, &v, None, 0.0, true, None)?;
    let by_mask =
        F::scaled_dot_product_attention(&q, &k, &v, Some(&ones.tril(0)?), 0.0, false, None)?;
    close(
        "sdpa bool mask",
        &by_mask.to_vec()?,
        &causal.to_vec()?,
        1e-13,
    );
    // separate query and key/value lengths, and bad inputs
    let kv = leaf(&[bsz, 3, e], 17);
    assert_eq!(mha.attend(&x, &kv, &kv, None, false)?.shape(), [bsz, t, e]);
    assert_eq!(
        invalid_arg(
            mha.attend(&x, &leaf(&[bsz, 3, 4], 0), &kv, None, false)
                .unwrap_err()
        ),
        "key"
    );
    let int_mask = Tensor::ones(&[t, t], DType::I64)?;
    assert_eq!(
        invalid_arg(mha.attend(&x, &x, &x, Some(&int_mask), false).unwrap_err()),
        "attn_mask"
    );
    assert_eq!(
        invalid_arg(nn::MultiheadAttention::new(8, 3, 0.0, true).unwrap_err()),
        "num_heads"
    );
    assert_eq!(
        invalid_arg(nn::MultiheadAttention::new(8, 2, 2.0, true).unwrap_err()),
        "dropout"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// ModuleList, tied weights

#[test]
fn module_list_registers_children_and_refuses_forward() -> tp::Result<()> {
    let mut list: nn::ModuleList<nn::Linear> = nn::ModuleList::new();
    for _ in 0..3 {
        list.push(nn::Linear::new(2, 2, true)?);
    }
    let names: Vec<String> = list
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        names,
        [
            "0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"
        ]
    );
    assert_eq!(list[1].out_features(), 2);
    assert!(list.get(3).is_none());
    list.eval()?;
    assert!(list.iter().all(|l| !l.is_training()));
    assert!(matches!(
        list.forward(&tp::randn(&[1, 2])?),
        Err(Error::NotSupported {
            op: "ModuleList::forward",
            ..
        })
    ));
    // mixed types, boxed
    let mut mixed = nn::ModuleList::<Box<dyn Module>>::new();
    mixed.push(Box::new(nn::Linear::new(2, 3, false)?));
    mixed.push(Box::new(nn::GELU::tanh()));
    let mut x = tp::randn(&[4, 2])?;
    for m in &mixed {
        x = m.call(&x)?;
    }
    assert_eq!(x.shape(), [4, 3]);
    assert_eq!(mixed.state_dict()?.len(), 1);
    Ok(())
}

/// A toy language model whose output head is the embedding table (tied).
#[derive(Module)]
struct Tied {
    emb: nn::Embedding,
    head: nn::Linear,
    core: nn::ModuleCore,
}

impl Module for Tied {
    fn forward(&self, idx: &Tensor) -> tp::Result<Tensor> {
        self.head.call(&self.emb.call(idx)?.tanh()?)
    }
}

#[test]
fn tied_weights_are_one_parameter_with_both_gradients() -> tp::Result<()> {
    let table = leaf(&[5, 3], 18)
        .mul_scalar(0.3)?
        .detach()
        .requires_grad_(true);
    let model = Tied {
        emb: nn::Embedding::from_weights(table.clone())?,
        head: nn::Linear::from_weights(table.clone(), None)?,
        core: nn::ModuleCore::new(),
    };
    let named = model.named_parameters();
    assert_eq!(named.len(), 1, "a tied weight is listed once");
    assert_eq!(named[0].0, "emb.weight");
    let idx = Tensor::from_vec(vec![0i64, 3, 3, 1], &[4])?;
    // the gradient is the sum over both uses: compared with finite differences
    check(
        "tied embedding and head",
        |p| {
            let m = Tied {
                emb: nn::Embedding::from_weights(p[0].clone())?,
                head: nn::Linear::from_weights(p[0].clone(), None)?,
                core: nn::ModuleCore::new(),
            };
            Ok(vec![m.call(&idx)?])
        },
        std::slice::from_ref(&table),
    );
    // an optimizer over parameters() steps the shared tensor once
    let mut opt = AdamW::new(model.parameters(), AdamWOptions::default())?;
    model.call(&idx)?.sum()?.backward()?;
    let before = table.to_vec::<f64>()?;
    opt.step()?;
    let after = table.to_vec::<f64>()?;
    // AdamW's first step moves each element by lr (sign of the gradient) plus the decay
    for (a, b) in after.iter().zip(&before) {
        assert!(
            (a - b).abs() <= 1e-3 * 1.01 + 1e-2 * 1e-3 * b.abs(),
            "{a} vs {b}"
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// the warm-up + cosine schedule

#[test]
fn warmup_cosine_schedule_values() -> tp::Result<()> {
    let w = Tensor::from_vec(vec![1.0f64], &[1])?.requires_grad_(true);
    let mut opt = AdamW::new(
        vec![w],
        AdamWOptions {
            lr: 0.01,
            ..Default::default()
        },
    )?;
    let (warm, total, min) = (4usize, 12usize, 0.1);
    let mut sched = WarmupCosineLR::new(&mut opt, warm, total, min)?;
    for e in 0..20usize {
        let want = if e < warm {
            0.01 * (e + 1) as f64 / warm as f64
        } else {
            let p = ((e - warm) as f64 / (total - warm) as f64).min(1.0);
            0.01 * (min + (1.0 - min) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos()))
        };
        assert!(
            (opt.lr() - want).abs() < 1e-15,
            "step {e}: {} vs {want}",
            opt.lr()
        );
        assert!(
            (sched.closed_form_lr(e)[0] - want).abs() < 1e-15,
            "closed form at {e}"
        );
        assert_eq!(sched.last_epoch(), e);
        sched.step(&mut opt)?;
    }
    assert_eq!(
        invalid_arg(WarmupCosineLR::new(&mut opt, 5, 5, 0.0).unwrap_err()),
        "total"
    );
    assert_eq!(
        invalid_arg(WarmupCosineLR::new(&mut opt, 0, 5, 1.5).unwrap_err()),
        "min_factor"
    );
    // no warm-up: the first step is at the base rate
    let w = Tensor::from_vec(vec![1.0f64], &[1])?.requires_grad_(true);
    let mut opt = AdamW::new(
        vec![w],
        AdamWOptions {
            lr: 0.5,
            ..Default::default()
        },
    )?;
    WarmupCosineLR::new(&mut opt, 0, 10, 0.0)?;
    assert_eq!(opt.lr(), 0.5);
    Ok(())
}
