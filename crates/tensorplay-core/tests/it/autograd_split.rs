//! Split backward (`autograd::backward_input` + `WeightGrads::run`, zero-bubble pipelines):
//! the input gradients equal `backward`'s and no `.grad` moves in the input half; after the
//! weight half every `.grad` equals one `backward`'s, bit for bit; post-accumulate hooks run
//! in the weight half.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tensorplay_core::autograd::{self, backward_input};
use tensorplay_core::nn::functional::{
    Approximate, embedding, gelu, layer_norm, linear, scaled_dot_product_attention,
};
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_testkit::element_bits;

/// A piece of a model: parameters (leaves) and a forward from an input to outputs.
struct Case {
    name: &'static str,
    /// Parameter shapes.
    params: &'static [&'static [usize]],
    /// The input: a float `[4, 6]` that requires grad, or token ids `[2, 3]`.
    tokens: bool,
    forward: fn(&[Tensor], &Tensor) -> tp::Result<Vec<Tensor>>,
}

fn mlp(p: &[Tensor], x: &Tensor) -> tp::Result<Vec<Tensor>> {
    let h = gelu(&linear(x, &p[0], Some(&p[1]))?, Approximate::Tanh)?;
    let h = layer_norm(&h, &[8], Some(&p[2]), Some(&p[3]), 1e-5)?;
    Ok(vec![linear(&h, &p[4], None)?])
}

fn two_outputs(p: &[Tensor], x: &Tensor) -> tp::Result<Vec<Tensor>> {
    // the second output is computed from the first
    let y1 = linear(x, &p[0], Some(&p[1]))?;
    let y2 = linear(&y1.relu()?, &p[2], None)?.mul_scalar(2.0)?;
    Ok(vec![y1, y2])
}

fn tied_tokens(p: &[Tensor], idx: &Tensor) -> tp::Result<Vec<Tensor>> {
    // an embedding whose weight is also the head (the GPT's tie), and attention
    let x = embedding(idx, &p[0])?; // [2, 3, 6]
    let q = linear(&x, &p[1], None)?.reshape(&[2, 1, 3, 6])?;
    let a = scaled_dot_product_attention(&q, &q, &q, None, 0.0, true, None)?.reshape(&[2, 3, 6])?;
    Ok(vec![linear(&x.add(&a)?, &p[0], None)?])
}

fn weight_used_twice(p: &[Tensor], x: &Tensor) -> tp::Result<Vec<Tensor>> {
    let h = linear(x, &p[0], None)?.tanh()?;
    Ok(vec![linear(&h, &p[0], None)?.add(&x.mul_scalar(0.5)?)?])
}

const CASES: &[Case] = &[
    Case {
        name: "linear, gelu, layer norm, head",
        params: &[&[8, 6], &[8], &[8], &[8], &[5, 8]],
        tokens: false,
        forward: mlp,
    },
    Case {
        name: "two outputs, one from the other",
        params: &[&[7, 6], &[7], &[3, 7]],
        tokens: false,
        forward: two_outputs,
    },
    Case {
        name: "token ids in (no input gradient), tied head, attention",
        params: &[&[9, 6], &[6, 6]],
        tokens: true,
        forward: tied_tokens,
    },
    Case {
        name: "one weight used twice, input on a side branch",
        params: &[&[6, 6]],
        tokens: false,
        forward: weight_used_twice,
    },
];

fn leaves(values: &[Tensor]) -> tp::Result<Vec<Tensor>> {
    values
        .iter()
        .map(|v| Ok(v.deep_clone()?.requires_grad_(true)))
        .collect()
}

fn bits(t: &Option<Tensor>) -> Option<Vec<u64>> {
    t.as_ref().map(|t| element_bits(t).unwrap())
}

fn check(case: &Case) -> Result<(), String> {
    let e = |e: tp::Error| format!("{}: {e}", case.name);
    tp::manual_seed(7);
    let values: Vec<Tensor> = case
        .params
        .iter()
        .map(|s| Tensor::randn(s, DType::F64))
        .collect::<tp::Result<_>>()
        .map_err(e)?;
    let input = if case.tokens {
        Tensor::from_vec(vec![1i64, 8, 3, 3, 0, 5], &[2, 3]).map_err(e)?
    } else {
        Tensor::randn(&[4, 6], DType::F64).map_err(e)?
    };
    // the reference: one backward
    let (p_ref, p_split) = (leaves(&values).map_err(e)?, leaves(&values).map_err(e)?);
    let x_ref = input.deep_clone().map_err(e)?.requires_grad_(!case.tokens);
    let outs = (case.forward)(&p_ref, &x_ref).map_err(e)?;
    let grads: Vec<Option<Tensor>> = outs
        .iter()
        .map(|o| Tensor::randn(o.shape(), DType::F64).map(Some))
        .collect::<tp::Result<_>>()
        .map_err(e)?;
    autograd::backward(&outs, &grads, false, false).map_err(e)?;
    // the split
    let x = input.deep_clone().map_err(e)?.requires_grad_(!case.tokens);
    let hooks = Arc::new(AtomicUsize::new(0));
    for p in &p_split {
        let h = hooks.clone();
        p.register_post_accumulate_grad_hook(move |_| {
            h.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
        .map_err(e)?;
    }
    let outs = (case.forward)(&p_split, &x).map_err(e)?;
    let inputs = if case.tokens { vec![] } else { vec![x.clone()] };
    let (dx, weights) = backward_input(&outs, &grads, &inputs).map_err(e)?;
    if !case.tokens && bits(&dx[0]) != bits(&x_ref.grad()) {
        return Err(format!(
            "{}: the input gradient differs from backward's",
            case.name
        ));
    }
    for (i, p) in p_split.iter().enumerate() {
        if p.grad().is_some() {
            return Err(format!(
                "{}: parameter {i} has a .grad after the input half",
                case.name
            ));
        }
    }
    if hooks.load(Ordering::Relaxed) != 0 || weights.is_empty() {
        return Err(format!(
            "{}: hooks ran in the input half, or no weight half",
            case.name
        ));
    }
    weights.run().map_err(e)?;
    for (i, (p, r)) in p_split.iter().zip(&p_ref).enumerate() {
        if bits(&p.grad()) != bits(&r.grad()) || p.grad().is_none() {
            return Err(format!(
                "{}: parameter {i}'s .grad differs from backward's",
                case.name
            ));
        }
    }
    if x.grad().is_some() {
        return Err(format!(
            "{}: the input got a .grad (backward_input returns it)",
            case.name
        ));
    }
    let ran = hooks.load(Ordering::Relaxed);
    if ran != p_split.len() {
        return Err(format!(
            "{}: {ran} post-accumulate hooks ran, want {}",
            case.name,
            p_split.len()
        ));
    }
    Ok(())
}

#[test]
fn split_backward_equals_backward_bit_for_bit() {
    let _g = tensorplay_testkit::generator_lock();
    let failures: Vec<String> = CASES.iter().filter_map(|c| check(c).err()).collect();
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn split_backward_refuses_inputs_without_grad_and_frees_the_graph() -> tp::Result<()> {
    let w = Tensor::randn(&[3, 3], DType::F64)?.requires_grad_(true);
    let x = Tensor::randn(&[2, 3], DType::F64)?;
    let y = linear(&x, &w, None)?;
    let err = backward_input(
        std::slice::from_ref(&y),
        &[Some(Tensor::ones(&[2, 3], DType::F64)?)],
        &[x],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("input 0 of backward_input does not require grad"),
        "{err}"
    );
    // the weight half runs once; a second backward through the freed graph is an error
    let x = Tensor::randn(&[2, 3], DType::F64)?.requires_grad_(true);
    let y = linear(&x, &w, None)?.sum()?;
    let (_, weights) = backward_input(std::slice::from_ref(&y), &[None], &[x])?;
    weights.run()?;
    assert!(w.grad().is_some());
    let err = y.backward().unwrap_err().to_string();
    assert!(err.contains("second time"), "{err}");
    Ok(())
}

/// `x * w`, recording what each backward call was asked to compute.
struct Probe(Arc<std::sync::Mutex<Vec<(bool, bool)>>>);

impl autograd::Function for Probe {
    fn forward(&self, ctx: &mut autograd::Context, inputs: &[&Tensor]) -> tp::Result<Vec<Tensor>> {
        ctx.save_for_backward(&[inputs[0], inputs[1]]);
        Ok(vec![inputs[0].mul(inputs[1])?])
    }
    fn backward(&self, ctx: &autograd::Context, g: &[Tensor]) -> tp::Result<Vec<Option<Tensor>>> {
        let s = ctx.saved_tensors()?;
        let (dx, dw) = (ctx.needs_input_grad(0), ctx.needs_input_grad(1));
        self.0.lock().unwrap().push((dx, dw));
        Ok(vec![
            dx.then(|| g[0].mul(&s[1])).transpose()?,
            dw.then(|| g[0].mul(&s[0])).transpose()?,
        ])
    }
}

#[test]
fn the_input_half_does_not_compute_weight_gradients() -> tp::Result<()> {
    let calls = Arc::new(std::sync::Mutex::new(vec![]));
    let x = Tensor::from_vec(vec![1.0f64, 2.0], &[2])?.requires_grad_(true);
    let w = Tensor::from_vec(vec![3.0f64, 4.0], &[2])?.requires_grad_(true);
    let y = autograd::apply(Probe(calls.clone()), &[&x, &w])?.remove(0);
    let (dx, weights) = backward_input(&[y], &[Some(Tensor::ones(&[2], DType::F64)?)], &[x])?;
    assert_eq!(dx[0].as_ref().unwrap().to_vec::<f64>()?, vec![3.0, 4.0]);
    assert_eq!(
        *calls.lock().unwrap(),
        vec![(true, false)],
        "the input half"
    );
    weights.run()?;
    assert_eq!(
        *calls.lock().unwrap(),
        vec![(true, false), (false, true)],
        "then the weight half"
    );
    assert_eq!(w.grad().unwrap().to_vec::<f64>()?, vec![1.0, 2.0]);
    Ok(())
}
