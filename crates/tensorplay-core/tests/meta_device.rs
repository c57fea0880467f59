//! The meta device and deferred initialisation: tensors with shapes and no elements, modules
//! built on it, `to_empty`, and `nn::init`'s per-tensor streams that give a shard the values
//! of the whole tensor's rows.
//!
//! A binary of its own: these tests compare draws of the process-wide default generator, which
//! the many tests of `it` would draw from meanwhile; here the few that draw hold
//! [`generator_lock`].

use tensorplay_testkit::generator_lock;

use tensorplay::{
    self as tp, DType, Device, Error, Tensor,
    nn::{self, Module, init},
};

type R = Result<(), String>;

fn named(m: &dyn Module) -> Vec<(String, Vec<f64>)> {
    m.named_parameters()
        .into_iter()
        .map(|(n, p)| {
            let v = p.to_dtype(DType::F64).and_then(|t| t.to_vec::<f64>());
            (n, v.unwrap_or_default())
        })
        .collect()
}

/// Creation functions on the meta device give shapes without elements and draw nothing.
#[test]
fn creation_on_the_meta_device_allocates_and_draws_nothing() {
    let _rng = generator_lock();
    type Make = fn() -> tp::Result<Tensor>;
    let cases: [(&str, Make, &[usize]); 7] = [
        (
            "zeros",
            || Tensor::zeros(&[3, 4], (DType::F64, Device::Meta)),
            &[3, 4],
        ),
        (
            "ones",
            || Tensor::ones(&[5], (DType::I64, Device::Meta)),
            &[5],
        ),
        (
            "randn",
            || Tensor::randn(&[2, 2], (DType::F32, Device::Meta)),
            &[2, 2],
        ),
        (
            "rand",
            || Tensor::rand(&[7], (DType::F32, Device::Meta)),
            &[7],
        ),
        (
            "empty",
            || Tensor::empty(&[1, 2, 3], (DType::F32, Device::Meta)),
            &[1, 2, 3],
        ),
        (
            "arange",
            || Tensor::arange(0.0, 6.0, 2.0, (DType::F32, Device::Meta)),
            &[3],
        ),
        (
            "default device",
            || tp::with_default_device(Device::Meta, || tp::randn(&[4, 1])),
            &[4, 1],
        ),
    ];
    let check = |(name, make, shape): (&str, Make, &[usize])| -> R {
        tp::manual_seed(3);
        let t = make().map_err(|e| format!("{name}: {e}"))?;
        let after = tp::randn(&[3])
            .and_then(|t| t.to_vec::<f32>())
            .map_err(|e| e.to_string())?;
        tp::manual_seed(3);
        let fresh = tp::randn(&[3])
            .and_then(|t| t.to_vec::<f32>())
            .map_err(|e| e.to_string())?;
        if t.device() != Device::Meta || t.shape() != shape || t.storage_numel() != t.numel() {
            return Err(format!("{name}: {:?} on {}", t.shape(), t.device()));
        }
        if after != fresh {
            return Err(format!("{name}: the default generator moved"));
        }
        // views are layout only; elements are refused, naming the operation
        let v = t
            .reshape(&[t.numel()])
            .map_err(|e| format!("{name}: reshape: {e}"))?;
        if v.device() != Device::Meta {
            return Err(format!("{name}: a view left the meta device"));
        }
        match t.to_dtype(DType::F64).and_then(|x| x.sum()) {
            Err(Error::MetaTensor { .. }) => {}
            other => return Err(format!("{name}: sum gave {other:?}")),
        }
        match t.to("cpu") {
            Err(Error::MetaTensor { op: "to" }) => Ok(()),
            other => Err(format!("{name}: to(cpu) gave {other:?}")),
        }
    };
    for c in cases {
        check(c).unwrap();
    }
    assert_eq!(tp::get_default_device(), Device::Cpu);
    assert_eq!(Device::parse("meta").unwrap().to_string(), "meta");
}

/// A layer built on the meta device, given memory and reset, equals the same layer built
/// eagerly and reset from the same seed; reset draws one stream per parameter.
#[test]
fn modules_built_on_meta_then_reset_equal_eager_ones_reset_alike() {
    let _rng = generator_lock();
    type Build = fn() -> tp::Result<Box<dyn Module>>;
    let cases: [(&str, Build); 5] = [
        ("Linear", || Ok(Box::new(nn::Linear::new(5, 3, true)?))),
        ("Linear without bias", || {
            Ok(Box::new(nn::Linear::new(4, 6, false)?))
        }),
        ("Embedding", || Ok(Box::new(nn::Embedding::new(7, 3)?))),
        ("LayerNorm", || {
            Ok(Box::new(nn::LayerNorm::new(&[4], 1e-5)?))
        }),
        ("MultiheadAttention", || {
            Ok(Box::new(nn::MultiheadAttention::new(8, 2, 0.0, true)?))
        }),
    ];
    let check = |(name, build): (&str, Build)| -> R {
        let e = |e: Error| format!("{name}: {e}");
        let mut lazy = tp::with_default_device(Device::Meta, build).map_err(e)?;
        if let Some((n, p)) = lazy
            .named_parameters()
            .into_iter()
            .find(|(_, p)| !p.device().is_meta())
        {
            return Err(format!("{name}: {n} on {}", p.device()));
        }
        lazy.to_empty(Device::Cpu).map_err(e)?;
        tp::manual_seed(11);
        lazy.reset_parameters().map_err(e)?;
        let mut eager = build().map_err(e)?;
        tp::manual_seed(11);
        eager.reset_parameters().map_err(e)?;
        let (a, b) = (named(lazy.as_ref()), named(eager.as_ref()));
        if a != b {
            return Err(format!("{name}: {a:?} != {b:?}"));
        }
        if lazy.parameters().iter().any(|p| !p.requires_grad()) {
            return Err(format!("{name}: a parameter lost requires_grad"));
        }
        // reset draws: a second reset changes the random parameters
        lazy.reset_parameters().map_err(e)?;
        let random = name != "LayerNorm";
        if random == (named(lazy.as_ref()) == b) {
            return Err(format!(
                "{name}: a second reset left random={random} values as they were"
            ));
        }
        Ok(())
    };
    for c in cases {
        check(c).unwrap();
    }
    let mut l = nn::Linear::new(2, 2, true).unwrap();
    assert!(matches!(
        l.to_empty(Device::Meta),
        Err(Error::InvalidArgument { .. })
    ));
}

/// A tensor marked as rows `a..b` of a whole one is filled with those rows' values.
#[test]
fn init_fills_a_shard_with_the_whole_tensors_rows() {
    let _rng = generator_lock();
    type Fill = fn(&Tensor) -> tp::Result<()>;
    let fills: [(&str, Fill); 3] = [
        ("normal_", |t| init::normal_(t, 0.5, 2.0)),
        ("uniform_", |t| init::uniform_(t, -1.0, 3.0)),
        ("ones_", init::ones_),
    ];
    // (case, whole shape, first row, rows held)
    let cuts: [(&str, &[usize], usize, usize); 5] = [
        ("first rows", &[6, 3], 0, 2),
        ("middle rows, odd first element", &[5, 3], 1, 3),
        ("last row", &[5, 3], 4, 1),
        ("1-d", &[9], 4, 5),
        ("0-d whole", &[], 0, 1),
    ];
    for (fname, fill) in fills {
        for (cname, whole_shape, first, held) in cuts {
            for dtype in [DType::F32, DType::F64] {
                let name = format!("{fname}, {cname}, {dtype}");
                let whole = Tensor::zeros(whole_shape, dtype).unwrap();
                let mut shape = whole_shape.to_vec();
                if shape.is_empty() {
                    shape.push(1);
                } else {
                    shape[0] = held;
                }
                let part = Tensor::zeros(&shape, dtype).unwrap().requires_grad_(true);
                part.mark_rows_of(whole_shape, first);
                tp::manual_seed(2);
                fill(&whole).unwrap();
                tp::manual_seed(2);
                fill(&part).unwrap();
                let w: Vec<f64> = whole.to_dtype(DType::F64).unwrap().to_vec().unwrap();
                let p: Vec<f64> = part.to_dtype(DType::F64).unwrap().to_vec().unwrap();
                let row: usize = whole_shape.iter().skip(1).product();
                assert_eq!(p, w[first * row..(first + held) * row], "{name}");
                assert!(part.is_leaf(), "{name}: history recorded");
            }
        }
    }
    // no draw on the meta device; bad arguments
    let m = Tensor::zeros(&[2], (DType::F32, Device::Meta)).unwrap();
    assert!(init::normal_(&m, 0.0, 1.0).is_ok());
    let t = Tensor::zeros(&[2], DType::F32).unwrap();
    assert!(matches!(
        init::normal_(&t, 0.0, -1.0),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        init::uniform_(&t, 1.0, 0.0),
        Err(Error::InvalidArgument { .. })
    ));
    let i = Tensor::zeros(&[2], DType::I64).unwrap();
    assert!(matches!(
        init::normal_(&i, 0.0, 1.0),
        Err(Error::UnsupportedDType { .. })
    ));
}
