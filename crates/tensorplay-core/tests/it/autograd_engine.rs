//! The autograd engine: accumulation, shared sub-graphs, retain_graph, create_graph, hooks,
//! in-place detection, custom functions, grad(), and the lower-level entry point.

use tensorplay_core::autograd::{
    self, Context, ExecuteOptions, Function, GradOptions, GradcheckOptions, LeafSink, apply,
    gradcheck, gradgradcheck, run_backward,
};
use tensorplay_core::{self as tp, DType, Error, Tensor};

fn t64(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).unwrap().requires_grad_(true)
}

#[test]
fn accumulates_over_two_backwards_and_shared_subgraph() -> tp::Result<()> {
    let x = t64(&[1.0, 2.0, 3.0], &[3]);
    let y = x.mul(&x)?; // shared by both uses below
    let z = y.add(&y.mul_scalar(3.0)?)?.sum()?; // 4 x^2
    z.backward()?;
    assert_eq!(x.grad().unwrap().to_vec::<f64>()?, vec![8.0, 16.0, 24.0]);
    let w = x.sum()?;
    w.backward()?;
    assert_eq!(x.grad().unwrap().to_vec::<f64>()?, vec![9.0, 17.0, 25.0]);
    Ok(())
}

#[test]
fn second_backward_without_retain_graph_fails() -> tp::Result<()> {
    let x = t64(&[1.0, 2.0], &[2]);
    let y = x.exp()?.sum()?;
    y.backward_with(None, true, false)?;
    y.backward()?; // retained once, so this works and frees
    let err = y.backward().unwrap_err();
    assert!(matches!(err, Error::Autograd(_)), "{err:?}");
    assert!(err.to_string().contains("second time"), "{err}");
    let g = x.grad().unwrap().to_vec::<f64>()?;
    assert!((g[0] - 2.0 * 1f64.exp()).abs() < 1e-12);
    Ok(())
}

#[test]
fn non_scalar_backward_needs_gradient() -> tp::Result<()> {
    let x = t64(&[1.0, 2.0], &[2]);
    let y = x.mul_scalar(2.0)?;
    assert!(matches!(y.backward(), Err(Error::Autograd(_))));
    y.backward_with(
        Some(&Tensor::from_slice(&[1.0f64, 10.0], &[2])?),
        false,
        false,
    )?;
    assert_eq!(x.grad().unwrap().to_vec::<f64>()?, vec![2.0, 20.0]);
    // wrong shape of the explicit gradient
    let y = x.mul_scalar(2.0)?;
    assert!(
        y.backward_with(Some(&Tensor::from_slice(&[1.0f64], &[1])?), false, false)
            .is_err()
    );
    Ok(())
}

#[test]
fn inplace_modification_of_saved_tensor_is_an_error() -> tp::Result<()> {
    let x = t64(&[1.0, 2.0], &[2]);
    let y = x.exp()?; // saves its output
    let z = y.mul_scalar(1.0)?.sum()?;
    {
        let _g = tp::no_grad();
        y.add_scalar_(1.0)?;
    }
    let l = y.sum()?.add(&z)?;
    let err = l.backward().unwrap_err();
    assert!(matches!(err, Error::Autograd(_)), "{err:?}");
    assert!(
        err.to_string()
            .contains("modified by an in-place operation"),
        "{err}"
    );
    Ok(())
}

#[test]
fn inplace_on_leaf_requiring_grad_is_refused() {
    let x = t64(&[1.0], &[1]);
    assert!(x.add_scalar_(1.0).is_err());
    let _g = tp::no_grad();
    assert!(x.add_scalar_(1.0).is_ok());
}

#[test]
fn no_grad_and_detach_cut_the_graph() -> tp::Result<()> {
    let x = t64(&[1.0], &[1]);
    let y = {
        let _g = tp::no_grad();
        x.mul_scalar(2.0)?
    };
    assert!(!y.requires_grad());
    let d = x.mul_scalar(2.0)?.detach();
    assert!(!d.requires_grad() && d.is_leaf());
    Ok(())
}

#[test]
fn hooks_see_and_replace_gradients() -> tp::Result<()> {
    let x = t64(&[1.0, 2.0], &[2]);
    let y = x.mul_scalar(3.0)?;
    y.register_hook(|g| Ok(Some(g.mul_scalar(10.0)?)))?;
    x.register_hook(|g| {
        assert_eq!(g.to_vec::<f64>()?, vec![30.0, 30.0]);
        Ok(None)
    })?;
    y.retain_grad()?;
    y.sum()?.backward()?;
    assert_eq!(x.grad().unwrap().to_vec::<f64>()?, vec![30.0, 30.0]);
    assert_eq!(y.grad().unwrap().to_vec::<f64>()?, vec![10.0, 10.0]);
    Ok(())
}

#[test]
fn grad_function_does_not_touch_dot_grad_and_double_backward_works() -> tp::Result<()> {
    let x = t64(&[0.5, -1.5], &[2]);
    let y = x.pow_scalar(3.0)?.sum()?;
    let g = autograd::grad(
        &[y],
        std::slice::from_ref(&x),
        &[],
        GradOptions {
            create_graph: true,
            ..Default::default()
        },
    )?;
    let g = g[0].clone().unwrap();
    assert_eq!(g.to_vec::<f64>()?, vec![0.75, 6.75]); // 3x^2
    assert!(x.grad().is_none());
    let gg = autograd::grad(
        &[g.sum()?],
        std::slice::from_ref(&x),
        &[],
        GradOptions::default(),
    )?;
    assert_eq!(gg[0].as_ref().unwrap().to_vec::<f64>()?, vec![3.0, -9.0]); // 6x
    Ok(())
}

#[test]
fn unused_input_is_an_error_unless_allowed() -> tp::Result<()> {
    let x = t64(&[1.0], &[1]);
    let u = t64(&[1.0], &[1]);
    let y = x.mul_scalar(2.0)?.sum()?;
    assert!(
        autograd::grad(
            std::slice::from_ref(&y),
            std::slice::from_ref(&u),
            &[],
            GradOptions {
                retain_graph: Some(true),
                ..Default::default()
            }
        )
        .is_err()
    );
    let r = autograd::grad(
        &[y],
        &[x, u],
        &[],
        GradOptions {
            allow_unused: true,
            ..Default::default()
        },
    )?;
    assert!(r[0].is_some() && r[1].is_none());
    Ok(())
}

/// Two outputs, one of them unused by the loss: the engine must hand zeros to backward.
struct SplitTwo;
impl Function for SplitTwo {
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> tp::Result<Vec<Tensor>> {
        Ok(vec![inputs[0].mul_scalar(2.0)?, inputs[0].mul_scalar(3.0)?])
    }
    fn backward(&self, _ctx: &Context, g: &[Tensor]) -> tp::Result<Vec<Option<Tensor>>> {
        assert_eq!(g.len(), 2);
        Ok(vec![Some(
            g[0].mul_scalar(2.0)?.add(&g[1].mul_scalar(3.0)?)?,
        )])
    }
}

#[test]
fn custom_function_with_unused_output() -> tp::Result<()> {
    let x = t64(&[1.0, 1.0], &[2]);
    let outs = apply(SplitTwo, &[&x])?;
    assert_eq!(outs[0].grad_fn().unwrap().name(), "SplitTwo");
    outs[1].sum()?.backward()?;
    assert_eq!(x.grad().unwrap().to_vec::<f64>()?, vec![3.0, 3.0]);
    Ok(())
}

/// A function returning a gradient of the wrong shape is reported, not silently used.
struct BadGrad;
impl Function for BadGrad {
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> tp::Result<Vec<Tensor>> {
        Ok(vec![inputs[0].mul_scalar(1.0)?])
    }
    fn backward(&self, _ctx: &Context, _g: &[Tensor]) -> tp::Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(tp::zeros(&[7])?.to_dtype(DType::F64)?)])
    }
}

#[test]
fn wrong_gradient_shape_is_an_error() -> tp::Result<()> {
    let x = t64(&[1.0, 1.0], &[2]);
    let y = apply(BadGrad, &[&x])?.remove(0);
    let err = y.sum()?.backward().unwrap_err();
    assert!(matches!(err, Error::Autograd(_)), "{err:?}");
    assert!(err.to_string().contains("invalid gradient"), "{err}");
    Ok(())
}

#[test]
fn lower_level_entry_collects_leaf_grads_without_touching_dot_grad() -> tp::Result<()> {
    let a = t64(&[1.0, 2.0], &[2]);
    let b = t64(&[3.0, 4.0], &[2]);
    let y = a.mul(&b)?;
    let edge = y.gradient_edge().unwrap();
    let seed = Tensor::from_slice(&[1.0f64, 1.0], &[2])?;
    let res = run_backward(
        &[(edge.clone(), seed.clone())],
        &[],
        ExecuteOptions {
            retain_graph: true,
            create_graph: false,
            leaf_sink: LeafSink::Collect,
        },
    )?;
    assert!(a.grad().is_none() && b.grad().is_none());
    let mut got: Vec<(u64, Vec<f64>)> = res
        .leaf_grads
        .iter()
        .map(|(l, g)| (l.id().as_u64(), g.to_vec::<f64>().unwrap()))
        .collect();
    got.sort_by_key(|p| p.0);
    assert_eq!(
        got,
        vec![
            (a.id().as_u64(), vec![3.0, 4.0]),
            (b.id().as_u64(), vec![1.0, 2.0])
        ]
    );
    // the same root twice: gradients add up within one pass
    let res = run_backward(
        &[(edge.clone(), seed.clone()), (edge, seed)],
        &[],
        ExecuteOptions {
            leaf_sink: LeafSink::Collect,
            ..Default::default()
        },
    )?;
    let ga = res
        .leaf_grads
        .iter()
        .find(|(l, _)| l.id() == a.id())
        .unwrap();
    assert_eq!(ga.1.to_vec::<f64>()?, vec![6.0, 8.0]);
    Ok(())
}

#[test]
fn backward_from_several_threads() -> tp::Result<()> {
    let w = t64(&[1.0, 2.0, 3.0], &[3]);
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let w = w.clone();
            std::thread::spawn(move || -> tp::Result<()> {
                let y = w.mul_scalar(i as f64)?.sum()?;
                y.backward()
            })
        })
        .collect();
    for h in handles {
        h.join().expect("thread")?;
    }
    assert_eq!(w.grad().unwrap().to_vec::<f64>()?, vec![6.0, 6.0, 6.0]);
    Ok(())
}

#[test]
fn gradcheck_catches_a_wrong_backward() -> tp::Result<()> {
    struct WrongSquare;
    impl Function for WrongSquare {
        fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> tp::Result<Vec<Tensor>> {
            ctx.save_for_backward(&[inputs[0]]);
            Ok(vec![inputs[0].mul(inputs[0])?])
        }
        fn backward(&self, ctx: &Context, g: &[Tensor]) -> tp::Result<Vec<Option<Tensor>>> {
            let x = &ctx.saved_tensors()?[0];
            Ok(vec![Some(g[0].mul(x)?)]) // missing factor 2
        }
    }
    let x = t64(&[0.3, 0.7], &[2]);
    let r = gradcheck(
        |xs| apply(WrongSquare, &[&xs[0]]),
        std::slice::from_ref(&x),
        GradcheckOptions::default(),
    );
    assert!(r.is_err());
    gradcheck(
        |xs| Ok(vec![xs[0].mul(&xs[0])?]),
        std::slice::from_ref(&x),
        GradcheckOptions::default(),
    )?;
    gradgradcheck(
        |xs| Ok(vec![xs[0].mul(&xs[0])?.tanh()?]),
        &[x],
        GradcheckOptions::default(),
    )?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// end-of-backward callbacks and post-accumulate-grad hooks

/// A callback queued from a hook runs after every node of the pass, once, and sees the final
/// `.grad` of every leaf; callbacks it queues run too, in order.
#[test]
fn queued_callbacks_run_after_the_whole_pass() {
    use std::sync::{Arc, Mutex};
    let a = Tensor::from_vec(vec![1.0f64, 2.0], &[2])
        .unwrap()
        .requires_grad_(true);
    let b = Tensor::from_vec(vec![3.0f64, 4.0], &[2])
        .unwrap()
        .requires_grad_(true);
    let log: Arc<Mutex<Vec<String>>> = Arc::default();
    let (l, a2, b2) = (log.clone(), a.clone(), b.clone());
    // the hook on `a` runs first (a is used last in forward); b has no grad yet then
    a.register_post_accumulate_grad_hook(move |_| {
        let (l2, a3, b3) = (l.clone(), a2.clone(), b2.clone());
        l.lock()
            .unwrap()
            .push(format!("hook a, b has grad: {}", b2.grad().is_some()));
        autograd::queue_callback(move || {
            let ga = a3.grad().unwrap().to_vec::<f64>()?;
            let gb = b3.grad().unwrap().to_vec::<f64>()?;
            l2.lock().unwrap().push(format!("callback {ga:?} {gb:?}"));
            let l3 = l2.clone();
            autograd::queue_callback(move || {
                l3.lock().unwrap().push("nested".into());
                Ok(())
            })
        })
    })
    .unwrap();
    // b is used through a long chain, a directly: a's accumulator is ready first
    let y = b
        .mul_scalar(2.0)
        .unwrap()
        .exp()
        .unwrap()
        .log()
        .unwrap()
        .add(&a)
        .unwrap()
        .sum()
        .unwrap();
    y.backward().unwrap();
    let got = log.lock().unwrap().clone();
    assert_eq!(
        got,
        vec![
            "hook a, b has grad: false".to_string(),
            "callback [1.0, 1.0] [2.0, 2.0]".to_string(),
            "nested".to_string()
        ]
    );
    // outside a pass it is an error, not a silent no-op
    assert!(matches!(
        autograd::queue_callback(|| Ok(())),
        Err(Error::Autograd(_))
    ));
}

/// A callback's error fails the backward call; the hooks see the accumulated sum; removed
/// hooks stop running; leaves that do not require grad refuse hooks.
#[test]
fn post_accumulate_hooks_see_the_sum_and_can_be_removed() {
    use std::sync::{Arc, Mutex};
    let w = Tensor::from_vec(vec![1.0f64, 2.0], &[2])
        .unwrap()
        .requires_grad_(true);
    let seen: Arc<Mutex<Vec<Vec<f64>>>> = Arc::default();
    let s = seen.clone();
    let h = w
        .register_post_accumulate_grad_hook(move |t| {
            s.lock().unwrap().push(t.grad().unwrap().to_vec::<f64>()?);
            Ok(())
        })
        .unwrap();
    w.mul_scalar(3.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    w.mul_scalar(1.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![vec![3.0, 3.0], vec![4.0, 4.0]]);
    h.remove();
    w.sum().unwrap().backward().unwrap();
    assert_eq!(seen.lock().unwrap().len(), 2, "a removed hook ran");
    // autograd::grad does not accumulate, so it does not run them
    let w2 = w.clone();
    w2.register_post_accumulate_grad_hook(|_| {
        autograd::queue_callback(|| Err(Error::Autograd("from the callback".into())))
    })
    .unwrap();
    let _ = autograd::grad(
        &[w.sum().unwrap()],
        std::slice::from_ref(&w),
        &[],
        Default::default(),
    )
    .unwrap();
    let err = w.sum().unwrap().backward().unwrap_err();
    assert!(err.to_string().contains("from the callback"), "{err}");
    let plain = Tensor::from_vec(vec![1.0f64], &[1]).unwrap();
    assert!(
        plain
            .register_post_accumulate_grad_hook(|_| Ok(()))
            .is_err()
    );
    let nonleaf = w.mul_scalar(2.0).unwrap();
    assert!(
        nonleaf
            .register_post_accumulate_grad_hook(|_| Ok(()))
            .is_err()
    );
}

/// `linear`'s weight gradient comes out contiguous (its matmul sees `weight.t()`), with the
/// same values as the general formula.
#[test]
fn the_weight_gradient_of_a_transposed_operand_is_contiguous() -> tp::Result<()> {
    let w = t64(&[1.0, -2.0, 0.5, 3.0, 1.5, -1.0], &[2, 3]);
    let x = Tensor::from_slice(&[0.3f64, -0.7, 1.1, 2.0, 0.1, -0.4], &[2, 3])?;
    x.matmul(&w.t()?)?.mul_scalar(2.0)?.sum()?.backward()?;
    let g = w.grad().unwrap();
    assert!(g.is_contiguous(), "strides {:?}", g.strides());
    // d/dW sum(2 x W^T) = 2 * sum over rows of x, for every output row
    let col: Vec<f64> = (0..3)
        .map(|j| 2.0 * (x.to_vec::<f64>().unwrap()[j] + x.to_vec::<f64>().unwrap()[3 + j]))
        .collect();
    let want: Vec<f64> = col.iter().chain(col.iter()).copied().collect();
    for (a, b) in g.to_vec::<f64>()?.iter().zip(&want) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }
    Ok(())
}

/// Leaves whose gradients become ready together are accumulated (and their post-accumulate
/// hooks run) in one fixed order, whatever addresses their nodes got: data parallelism starts
/// its buckets from these hooks, and ranks that start them in different orders disagree.
#[test]
fn leaves_ready_together_accumulate_in_a_fixed_order() {
    use std::sync::{Arc, Mutex};
    type Build = fn(&[Tensor]) -> tp::Result<Tensor>;
    // (case, leaf lengths, the loss); a leaf of length 4 is [2, 2], of length 2 is [2]
    let cases: [(&str, &[usize], Build); 3] = [
        ("linear with bias", &[4, 4, 2], |l| {
            tp::nn::functional::linear(&l[0], &l[1], Some(&l[2]))?.sum()
        }),
        ("mul of two leaves", &[4, 4], |l| l[0].mul(&l[1])?.sum()),
        ("sum of three leaves", &[4, 4, 4], |l| {
            l[0].add(&l[1])?.add(&l[2])?.sum()
        }),
    ];
    let check = |name: &str, lens: &[usize], build: Build| -> Result<(), String> {
        let mut first: Option<Vec<usize>> = None;
        let mut keep = vec![];
        for rep in 0..24 {
            // allocations between the repetitions move the next graph's nodes around
            keep.push(vec![0u8; 64 * (rep % 5 + 1)]);
            let leaves: Vec<Tensor> = lens
                .iter()
                .map(|&n| {
                    let shape: &[usize] = if n == 4 { &[2, 2] } else { &[2] };
                    t64(&[0.5, -1.0, 2.0, 0.25][..n], shape)
                })
                .collect();
            let order: Arc<Mutex<Vec<usize>>> = Arc::default();
            for (i, l) in leaves.iter().enumerate() {
                let o = order.clone();
                l.register_post_accumulate_grad_hook(move |_| {
                    o.lock().unwrap().push(i);
                    Ok(())
                })
                .map_err(|e| format!("{name}: {e}"))?;
            }
            build(&leaves)
                .and_then(|y| y.backward())
                .map_err(|e| format!("{name}: {e}"))?;
            let got = order.lock().unwrap().clone();
            match &first {
                None => first = Some(got),
                Some(f) if *f != got => {
                    return Err(format!(
                        "{name}: repetition {rep} ran {got:?}, the first {f:?}"
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(())
    };
    for (name, lens, build) in cases {
        check(name, lens, build).unwrap();
    }
}
