//! Misuse of deferred initialisation (the meta device): hostile uses of meta tensors,
//! `to_empty`, `reset_parameters`, `nn::init` and the thread's default device, each a clear
//! error or a right answer, never a panic. Each probe is a table of cases run by one `check`
//! that names the failing case.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};

use tensorplay_testkit::generator_lock;

use tensorplay::{
    self as tp, DType, Device, Error, Tensor,
    nn::{self, Module, init},
    optim::{Adam, AdamOptions, Optimizer, SGD, SgdOptions},
};

type Probe = Box<dyn Fn() -> tp::Result<Tensor>>;

fn meta(shape: &[usize]) -> Tensor {
    Tensor::zeros(shape, (DType::F32, Device::Meta)).unwrap()
}

/// Runs each case; a panic, or an `Ok` that is not a meta tensor of the expected shape when the
/// case allows one, or an error other than `MetaTensor` (or a shape error) is a failure.
fn check_ops(cases: Vec<(&str, Probe, Option<Vec<usize>>)>) {
    let mut bad = Vec::new();
    for (name, f, ok_shape) in cases {
        match catch_unwind(AssertUnwindSafe(&f)) {
            Err(p) => bad.push(format!(
                "{name}: PANIC {}",
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            )),
            // MetaTensor, or a device mismatch / shape error as any other tensors get
            Ok(Err(_)) => {}
            Ok(Ok(t)) => match &ok_shape {
                Some(s) if t.device().is_meta() && t.shape() == s.as_slice() => {}
                _ => bad.push(format!(
                    "{name}: Ok({:?} on {}), expected an error or meta {ok_shape:?}",
                    t.shape(),
                    t.device()
                )),
            },
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Every element-touching operation on a meta tensor errors with `MetaTensor`; views and
/// shape-only operations give meta tensors; nothing panics.
#[test]
fn operations_on_meta_tensors_error_or_stay_meta() {
    let cpu = || Tensor::ones(&[2, 3], DType::F32).unwrap();
    let cases: Vec<(&str, Probe, Option<Vec<usize>>)> = vec![
        ("sum", Box::new(|| meta(&[2, 3]).sum()), None),
        (
            "matmul",
            Box::new(|| meta(&[2, 3]).matmul(&meta(&[3, 4]))),
            Some(vec![2, 4]),
        ),
        (
            "matmul meta @ cpu",
            Box::new(move || meta(&[2, 3]).matmul(&cpu().t()?)),
            Some(vec![2, 2]),
        ),
        (
            "add meta + cpu",
            Box::new(move || meta(&[2, 3]).add(&cpu())),
            Some(vec![2, 3]),
        ),
        (
            "add cpu + meta",
            Box::new(move || cpu().add(&meta(&[2, 3]))),
            Some(vec![2, 3]),
        ),
        (
            "cat meta",
            Box::new(|| tp::cat(&[meta(&[2, 3]), meta(&[1, 3])], 0)),
            Some(vec![3, 3]),
        ),
        (
            "cat meta, cpu",
            Box::new(move || tp::cat(&[meta(&[2, 3]), cpu()], 0)),
            Some(vec![4, 3]),
        ),
        (
            "stack meta",
            Box::new(|| tp::stack(&[meta(&[2]), meta(&[2])], 0)),
            Some(vec![2, 2]),
        ),
        (
            "item",
            Box::new(|| meta(&[1]).item::<f32>().map(|_| meta(&[0]))),
            None,
        ),
        (
            "to_vec",
            Box::new(|| meta(&[2]).to_vec::<f32>().map(|_| meta(&[0]))),
            None,
        ),
        (
            "index_select",
            Box::new(|| meta(&[4, 3]).index_select(0, &Tensor::from_vec(vec![0i64, 2], &[2])?)),
            Some(vec![2, 3]),
        ),
        (
            "select",
            Box::new(|| meta(&[4, 3]).select(0, 1)),
            Some(vec![3]),
        ),
        (
            "select out of range",
            Box::new(|| meta(&[4, 3]).select(0, 9)),
            None,
        ),
        (
            "narrow + contiguous",
            Box::new(|| meta(&[4, 3]).narrow(1, 1, 2)?.contiguous()),
            Some(vec![4, 2]),
        ),
        (
            "transpose + contiguous",
            Box::new(|| meta(&[4, 3]).transpose(0, 1)?.contiguous()),
            Some(vec![3, 4]),
        ),
        (
            "transpose + reshape",
            Box::new(|| meta(&[4, 3]).t()?.reshape(&[12])),
            Some(vec![12]),
        ),
        (
            "to_dtype int64 then reshape",
            Box::new(|| meta(&[4, 3]).to_dtype(DType::I64)?.reshape(&[2, 6])),
            Some(vec![2, 6]),
        ),
        (
            "to_dtype bool then float",
            Box::new(|| meta(&[4, 3]).to_dtype(DType::Bool)?.to_dtype(DType::F64)),
            Some(vec![4, 3]),
        ),
        (
            "deep_clone",
            Box::new(|| meta(&[4, 3]).deep_clone()),
            Some(vec![4, 3]),
        ),
        ("tanh", Box::new(|| meta(&[4, 3]).tanh()), Some(vec![4, 3])),
        (
            "backward through a meta tensor",
            Box::new(|| {
                let w = meta(&[3]).requires_grad_(true);
                w.tanh()?.sum()?.backward()?;
                Ok(w.grad().unwrap_or_else(|| meta(&[99])))
            }),
            None,
        ),
        (
            "embedding with meta weight",
            Box::new(|| {
                nn::functional::embedding(&Tensor::from_vec(vec![0i64, 1], &[2])?, &meta(&[4, 3]))
            }),
            Some(vec![2, 3]),
        ),
        (
            "mse_loss",
            Box::new(move || nn::functional::mse_loss(&meta(&[2, 3]), &cpu())),
            Some(vec![]),
        ),
        (
            "copy_ into meta",
            Box::new(move || {
                let m = meta(&[2, 3]);
                m.copy_(&cpu())?;
                Ok(m)
            }),
            None,
        ),
        (
            "copy_ from meta into cpu",
            Box::new(move || {
                let c = cpu();
                c.copy_(&meta(&[2, 3]))?;
                Ok(c)
            }),
            None,
        ),
        (
            "save a meta tensor",
            Box::new(|| {
                let mut d = BTreeMap::new();
                d.insert("w".to_string(), meta(&[2]));
                let p =
                    std::env::temp_dir().join(format!("breaker-meta-{}.st", std::process::id()));
                tp::save(&d, &p)?;
                Ok(meta(&[99]))
            }),
            None,
        ),
        (
            "clip_grad_norm_ with a meta grad",
            Box::new(|| {
                let w = meta(&[3]).requires_grad_(true);
                w.set_grad(Some(meta(&[3])));
                nn::utils::clip_grad_norm_(&[w], 1.0, 2.0, false)?;
                Ok(meta(&[99]))
            }),
            None,
        ),
        (
            "SGD step on a meta parameter with a meta grad",
            Box::new(|| {
                let w = meta(&[3]).requires_grad_(true);
                w.set_grad(Some(meta(&[3])));
                let mut o = SGD::new(
                    vec![w],
                    SgdOptions {
                        lr: 0.1,
                        momentum: 0.9,
                        ..Default::default()
                    },
                )?;
                o.step()?;
                Ok(meta(&[99]))
            }),
            None,
        ),
        (
            "Adam step on a cpu parameter with a meta grad",
            Box::new(|| {
                let w = Tensor::ones(&[3], DType::F32)?.requires_grad_(true);
                w.set_grad(Some(meta(&[3])));
                let mut o = Adam::new(vec![w], AdamOptions::default())?;
                o.step()?;
                Ok(meta(&[99]))
            }),
            None,
        ),
    ];
    check_ops(cases);
    // printing never panics and says "meta"
    let m = meta(&[2, 2]).requires_grad_(true);
    let s = format!("{m:?}");
    assert!(s.contains("meta") && !s.contains("data"), "{s}");
}

fn linear_on_meta(i: usize, o: usize) -> nn::Linear {
    tp::with_default_device(Device::Meta, || nn::Linear::new(i, o, true)).unwrap()
}

/// A module on the meta device: its state dict cannot be saved, nothing loads into it, it does
/// not run; a module partly on the meta device is not half loaded.
#[test]
fn modules_on_meta_refuse_values_cleanly() {
    type Case = (&'static str, fn() -> tp::Result<()>);
    let cases: [Case; 5] = [
        ("forward", || {
            linear_on_meta(3, 2).forward(&Tensor::ones(&[1, 3], DType::F32)?)?;
            Ok(())
        }),
        ("save state_dict", || {
            let p = std::env::temp_dir().join(format!("breaker-sd-{}.st", std::process::id()));
            tp::save(&linear_on_meta(3, 2).state_dict()?, &p)
        }),
        ("load_state_dict into meta", || {
            let src = nn::Linear::new(3, 2, true)?.state_dict()?;
            linear_on_meta(3, 2).load_state_dict(&src, true)
        }),
        (
            "DDP-free optimizer built on meta, step after to_empty",
            || {
                // an optimizer made before to_empty must see the materialised parameters
                let mut l = linear_on_meta(3, 2);
                let mut o = Adam::new(l.parameters(), AdamOptions::default())?;
                l.to_empty(Device::Cpu)?;
                l.reset_parameters()?;
                let before = l.weight.to_vec::<f32>()?;
                l.forward(&Tensor::ones(&[1, 3], DType::F32)?)?
                    .sum()?
                    .backward()?;
                o.step()?;
                if l.weight.to_vec::<f32>()? == before {
                    return Err(Error::Autograd("the step did not move the weight".into()));
                }
                // report success as a MetaTensor-free Ok: mapped to an error below to distinguish
                Err(Error::Autograd("OK".into()))
            },
        ),
        (
            "SGD built on meta with momentum, step after to_empty",
            || {
                let mut l = linear_on_meta(3, 2);
                let mut o = SGD::new(
                    l.parameters(),
                    SgdOptions {
                        lr: 0.1,
                        momentum: 0.9,
                        ..Default::default()
                    },
                )?;
                l.to_empty(Device::Cpu)?;
                l.reset_parameters()?;
                l.forward(&Tensor::ones(&[1, 3], DType::F32)?)?
                    .sum()?
                    .backward()?;
                o.step()?;
                Err(Error::Autograd("OK".into()))
            },
        ),
    ];
    let mut bad = Vec::new();
    for (name, f) in cases {
        match catch_unwind(f) {
            Err(_) => bad.push(format!("{name}: PANIC")),
            Ok(Err(Error::MetaTensor { .. })) if !name.contains("after to_empty") => {}
            // a meta weight against a CPU input: the device mismatch error, as PyTorch
            Ok(Err(Error::DeviceMismatch { .. })) if name == "forward" => {}
            Ok(Err(Error::Autograd(s))) if s == "OK" && name.contains("after to_empty") => {}
            Ok(r) => bad.push(format!("{name}: {r:?}")),
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// `load_state_dict` documents "Nothing is copied when it errors": a module with one real and
/// one meta parameter must keep its real parameter when loading fails on the meta one.
#[test]
fn load_state_dict_into_a_partly_meta_module_copies_nothing() {
    let mut l = nn::Linear::new(3, 2, true).unwrap();
    let w0 = l.weight.to_vec::<f32>().unwrap();
    l.bias = Some(meta(&[2]).requires_grad_(true));
    let mut src = BTreeMap::new();
    src.insert(
        "weight".to_string(),
        Tensor::full(&[2, 3], 7.0, DType::F32).unwrap(),
    );
    src.insert(
        "bias".to_string(),
        Tensor::full(&[2], 7.0, DType::F32).unwrap(),
    );
    let r = l.load_state_dict(&src, true);
    assert!(matches!(r, Err(Error::MetaTensor { .. })), "{r:?}");
    assert_eq!(l.weight.to_vec::<f32>().unwrap(), w0, "weight half-loaded");
}

/// `to_empty` twice keeps the values of the first; tied weights stay tied; real parameters of a
/// mixed module are kept; forward without reset gives the zeros' output (bias only).
#[test]
fn to_empty_twice_tied_and_mixed() {
    let _rng = generator_lock();
    // twice
    let mut l = linear_on_meta(3, 2);
    l.to_empty(Device::Cpu).unwrap();
    tp::manual_seed(1);
    l.reset_parameters().unwrap();
    let w = l.weight.to_vec::<f32>().unwrap();
    l.to_empty(Device::Cpu).unwrap();
    assert_eq!(
        l.weight.to_vec::<f32>().unwrap(),
        w,
        "second to_empty changed values"
    );
    // tied: two layers sharing one meta weight, then one to_empty on a container
    let a = linear_on_meta(3, 3);
    let b = nn::Linear::from_weights(a.weight.clone(), None).unwrap();
    let mut seq = nn::Sequential::new().add(a).add(b);
    seq.to_empty(Device::Cpu).unwrap();
    seq.reset_parameters().unwrap();
    // named_parameters lists a tied tensor once (PyTorch's remove_duplicate)
    let ps = seq.named_parameters();
    let w0 = ps.iter().find(|(n, _)| n == "0.weight").unwrap().1.clone();
    let w1 = seq.get(1).unwrap().named_parameters()[0].1.clone();
    assert_eq!(
        w0.to_vec::<f32>().unwrap(),
        w1.to_vec::<f32>().unwrap(),
        "tie broken"
    );
    w0.add_(&Tensor::ones(&[3, 3], DType::F32).unwrap()).ok();
    assert_eq!(
        w0.to_vec::<f32>().unwrap(),
        w1.to_vec::<f32>().unwrap(),
        "tie broken after write"
    );
    // mixed: a real weight, a meta bias
    let mut m = nn::Linear::new(3, 2, true).unwrap();
    let real = m.weight.to_vec::<f32>().unwrap();
    m.bias = Some(meta(&[2]).requires_grad_(true));
    m.to_empty(Device::Cpu).unwrap();
    assert_eq!(
        m.weight.to_vec::<f32>().unwrap(),
        real,
        "to_empty touched a real parameter"
    );
    let y = m
        .forward(&Tensor::zeros(&[1, 3], DType::F32).unwrap())
        .unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![0.0, 0.0]);
    // a view of a meta parameter taken before to_empty sees the memory
    let mut l = linear_on_meta(4, 2);
    let view = l.weight.narrow(1, 1, 2).unwrap();
    l.to_empty(Device::Cpu).unwrap();
    tp::manual_seed(2);
    l.reset_parameters().unwrap();
    assert_eq!(view.device(), Device::Cpu);
    assert_eq!(
        view.contiguous().unwrap().to_vec::<f32>().unwrap(),
        l.weight
            .narrow(1, 1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
    );
}

/// `reset_parameters` on a frozen parameter keeps it frozen; on a non-contiguous parameter it
/// errors (not a panic, not a silent write into the wrong elements).
#[test]
fn reset_on_frozen_and_non_contiguous_parameters() {
    let mut l = nn::Linear::new(3, 2, true).unwrap();
    l.weight.set_requires_grad(false).unwrap();
    l.reset_parameters().unwrap();
    assert!(!l.weight.requires_grad(), "reset unfroze the weight");
    let base = Tensor::zeros(&[3, 2], DType::F32)
        .unwrap()
        .requires_grad_(true);
    let mut nc = nn::Linear::from_weights(base.t().unwrap(), None).unwrap();
    let r = catch_unwind(AssertUnwindSafe(|| nc.reset_parameters()));
    assert!(matches!(r, Ok(Err(Error::InvalidArgument { .. }))), "{r:?}");
}

fn zeros2(shape: &[usize]) -> Tensor {
    Tensor::zeros(shape, DType::F64).unwrap()
}

/// `nn::init` with non-finite arguments, int tensors and bogus `mark_rows_of` marks: clear
/// errors, never a panic, never silently wrong values.
#[test]
fn init_with_hostile_arguments() {
    let _rng = generator_lock();
    type Case = (&'static str, fn() -> tp::Result<Vec<f64>>, bool);
    // (case, fill, must error)
    let cases: [Case; 10] = [
        (
            "normal_ mean NaN",
            || {
                let t = zeros2(&[3]);
                init::normal_(&t, f64::NAN, 1.0)?;
                t.to_vec()
            },
            true,
        ),
        (
            "normal_ std inf",
            || {
                let t = zeros2(&[3]);
                init::normal_(&t, 0.0, f64::INFINITY)?;
                t.to_vec()
            },
            true,
        ),
        (
            "uniform_ NaN low",
            || {
                let t = zeros2(&[3]);
                init::uniform_(&t, f64::NAN, 1.0)?;
                t.to_vec()
            },
            true,
        ),
        (
            "uniform_ full f64 range",
            || {
                let t = zeros2(&[64]);
                init::uniform_(&t, -f64::MAX, f64::MAX)?;
                t.to_vec()
            },
            // high - low overflows: refused rather than filled with infinities
            true,
        ),
        (
            "constant_ on int64",
            || {
                let t = Tensor::zeros(&[3], DType::I64)?;
                init::constant_(&t, 2.0)?;
                t.to_vec_f64()
            },
            false,
        ),
        (
            "zeros_ on bool",
            || {
                let t = Tensor::ones(&[3], DType::Bool)?;
                init::zeros_(&t)?;
                t.to_vec_f64()
            },
            false,
        ),
        (
            "mark_rows_of first row past the end",
            || {
                let t = zeros2(&[2, 3]);
                t.mark_rows_of(&[4, 3], 10);
                init::normal_(&t, 1.0, 1.0)?;
                t.to_vec()
            },
            true,
        ),
        (
            "mark_rows_of first row usize::MAX",
            || {
                let t = zeros2(&[2, 3]);
                t.mark_rows_of(&[4, 3], usize::MAX);
                init::normal_(&t, 1.0, 1.0)?;
                t.to_vec()
            },
            true,
        ),
        (
            "mark_rows_of wrong row width",
            || {
                let t = zeros2(&[2, 3]);
                t.mark_rows_of(&[4, 5], 1);
                init::normal_(&t, 1.0, 1.0)?;
                t.to_vec()
            },
            true,
        ),
        (
            "mark_rows_of rows beyond the whole",
            || {
                let t = zeros2(&[6, 3]);
                t.mark_rows_of(&[4, 3], 0);
                init::normal_(&t, 1.0, 1.0)?;
                t.to_vec()
            },
            true,
        ),
    ];
    let mut bad = Vec::new();
    for (name, f, must_err) in cases {
        match catch_unwind(f) {
            Err(p) => bad.push(format!(
                "{name}: PANIC {}",
                p.downcast_ref::<String>().cloned().unwrap_or_default()
            )),
            Ok(Err(e)) if must_err => {
                let _ = e;
            }
            Ok(Err(e)) => bad.push(format!("{name}: error {e} (PyTorch accepts it)")),
            Ok(Ok(v)) if must_err => bad.push(format!("{name}: accepted, gave {v:?}")),
            Ok(Ok(v)) if v.iter().any(|x| !x.is_finite()) => bad.push(format!(
                "{name}: non-finite values {:?}",
                &v[..4.min(v.len())]
            )),
            Ok(Ok(_)) => {}
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The default device: nesting restores each level, a panic inside restores it, other threads
/// keep the CPU, and a meta default must not leak into operations on CPU tensors (PyTorch's
/// default device changes factory functions only).
#[test]
fn default_device_scoping() {
    tp::with_default_device(Device::Meta, || {
        tp::with_default_device(Device::Cpu, || {
            assert_eq!(tp::get_default_device(), Device::Cpu);
        });
        assert_eq!(tp::get_default_device(), Device::Meta);
        let other = std::thread::spawn(tp::get_default_device).join().unwrap();
        assert_eq!(
            other,
            Device::Cpu,
            "the default device leaked to another thread"
        );
    });
    let r = catch_unwind(|| tp::with_default_device(Device::Meta, || panic!("inside")));
    assert!(r.is_err());
    assert_eq!(
        tp::get_default_device(),
        Device::Cpu,
        "not restored after a panic"
    );
}

/// A CPU training step run while the thread's default device is meta (e.g. inside
/// `with_default_device(Meta, ..)` that also builds a second model, or after
/// `set_default_device(Meta)`) must compute on the CPU tensors it is given.
#[test]
fn cpu_work_under_a_meta_default_device() {
    let _rng = generator_lock();
    type Case = (&'static str, fn() -> tp::Result<Vec<f64>>);
    let cases: [Case; 4] = [
        ("linear + mse + backward + Adam", || {
            tp::manual_seed(4);
            let l = nn::Linear::new(3, 2, true)?;
            let mut o = Adam::new(l.parameters(), AdamOptions::default())?;
            let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[1, 3])?;
            tp::with_default_device(Device::Meta, || -> tp::Result<()> {
                let y = l.forward(&x)?;
                nn::functional::mse_loss(&y, &Tensor::from_vec(vec![0.5f32, -1.0], &[1, 2])?)?
                    .backward()?;
                o.step()
            })?;
            l.weight.to_vec_f64()
        }),
        ("cross_entropy", || {
            let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 0.0], &[2, 2])?;
            let t = Tensor::from_vec(vec![0i64, 1], &[2])?;
            tp::with_default_device(Device::Meta, || nn::functional::cross_entropy(&x, &t))?
                .to_vec_f64()
        }),
        ("gpt forward", || {
            use tp::models::{Gpt, GptConfig};
            let g = Gpt::new(GptConfig {
                vocab_size: 11,
                block_size: 4,
                n_layer: 1,
                n_head: 2,
                n_embd: 8,
                dropout: 0.0,
                dtype: DType::F32,
            })?;
            let idx = Tensor::from_vec(vec![1i64, 2, 3], &[1, 3])?;
            tp::with_default_device(Device::Meta, || g.forward(&idx))?
                .sum()?
                .to_vec_f64()
        }),
        ("multihead attention forward", || {
            let m = nn::MultiheadAttention::new(4, 2, 0.0, true)?;
            let x = Tensor::ones(&[2, 3, 4], DType::F32)?;
            tp::with_default_device(Device::Meta, || m.forward(&x))?
                .sum()?
                .to_vec_f64()
        }),
    ];
    let mut bad = Vec::new();
    for (name, f) in cases {
        match catch_unwind(f) {
            Err(_) => bad.push(format!("{name}: PANIC")),
            Ok(Err(e)) => bad.push(format!("{name}: {e}")),
            Ok(Ok(_)) => {}
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// A CUDA default device on a machine where CUDA cannot be used, and layers wrapped for
/// activation checkpointing built on meta: errors, not panics; the wrapper resets what it wraps.
#[test]
fn other_defaults_and_wrappers() {
    let _rng = generator_lock();
    if !tp::cuda::is_available() {
        let r = catch_unwind(|| {
            tp::with_default_device(Device::Cuda(0), || nn::Linear::new(3, 2, true))
        });
        assert!(
            matches!(r, Ok(Err(_))),
            "Linear under a CUDA default without CUDA: {r:?}"
        );
        let mut l = linear_on_meta(3, 2);
        let r = catch_unwind(AssertUnwindSafe(|| l.to_empty(Device::Cuda(0))));
        assert!(
            matches!(r, Ok(Err(_))),
            "to_empty(cuda:0) without CUDA: {r:?}"
        );
        assert!(
            l.weight.device().is_meta(),
            "a failed to_empty moved the weight"
        );
    }
    let mut w = tp::with_default_device(Device::Meta, || -> tp::Result<_> {
        Ok(tp::utils::checkpoint::CheckpointWrapper::new(
            nn::Linear::new(3, 2, true)?,
        ))
    })
    .unwrap();
    w.to_empty(Device::Cpu).unwrap();
    tp::manual_seed(8);
    w.reset_parameters().unwrap();
    let mut e = nn::Linear::new(3, 2, true).unwrap();
    tp::manual_seed(8);
    e.reset_parameters().unwrap();
    let got: Vec<Vec<f32>> = w.parameters().iter().map(|p| p.to_vec().unwrap()).collect();
    let want: Vec<Vec<f32>> = e.parameters().iter().map(|p| p.to_vec().unwrap()).collect();
    assert_eq!(got, want);
}
