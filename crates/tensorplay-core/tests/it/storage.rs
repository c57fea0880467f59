//! Storage that is freed and refilled in place (`resize_storage_`, what fully sharded data
//! parallelism does to unsharded parameters), the version counter kept across such a refill
//! (`preserve_version_counter`), and a module's attached state, which changes what
//! `named_parameters` lists.

use std::sync::Arc;

use tensorplay_core::nn::{self, AttachedState, Module, ModuleFields};
use tensorplay_core::{self as tp, Error, Tensor};

/// A view of a freed storage errors naming the cause on every kind of access, never reads
/// other memory; refilled, the tensor works again; the allocator's count follows.
#[test]
fn a_freed_storage_errors_and_refills() -> tp::Result<()> {
    let n = 1 << 18; // 1 MiB of float32
    // other tests allocate concurrently: a freed count lowered by their allocations is
    // retried; a resize that does not uncount fails every attempt
    let mut freed = 0;
    for _ in 0..20 {
        let t = tp::ones(&[n])?;
        let before = tp::memory::allocated_bytes();
        t.resize_storage_(0)?;
        freed = before.saturating_sub(tp::memory::allocated_bytes());
        if freed >= n * 4 / 2 {
            break;
        }
    }
    assert!(
        freed >= n * 4 / 2,
        "freeing released {freed} bytes, in 20 attempts"
    );
    let t = tp::ones(&[n])?;
    let view = t.narrow(0, 10, 20)?;
    t.resize_storage_(0)?;
    assert_eq!(t.storage_numel(), 0);
    type Access = fn(&Tensor, &Tensor) -> tp::Result<()>;
    let cases: [(&str, Access); 5] = [
        ("to_vec", |t, _| t.to_vec::<f32>().map(|_| ())),
        ("sum of a view", |_, v| v.sum().map(|_| ())),
        ("in-place fill", |t, _| t.fill_(2.0)),
        ("binary op", |t, v| t.narrow(0, 0, 20)?.add(v).map(|_| ())),
        ("copy into", |t, _| t.copy_(&tp::zeros(t.shape())?)),
    ];
    let check = |(name, f): (&str, Access)| -> Result<(), String> {
        match f(&t, &view) {
            Err(Error::InvalidArgument { got, .. }) if got.contains("resize_storage_") => Ok(()),
            other => Err(format!("{name}: {other:?}")),
        }
    };
    for c in cases {
        check(c).unwrap();
    }
    let version = t.version();
    t.resize_storage_(n)?;
    assert_eq!(t.version(), version, "resizing bumped the version");
    t.fill_(3.0)?;
    assert_eq!(view.to_vec::<f32>()?, vec![3.0; 20]);
    Ok(())
}

/// A tensor saved for backward survives being freed and refilled with the same values under
/// `preserve_version_counter`; a plain write still trips the saved-tensor check.
#[test]
fn a_refill_that_keeps_the_version_keeps_backward_valid() -> tp::Result<()> {
    let w = Tensor::from_vec(vec![1.0f64, 2.0, 3.0], &[3])?.requires_grad_(true);
    let x = Tensor::from_vec(vec![4.0f64, 5.0, 6.0], &[3])?;
    let y = w.mul(&x)?.mul(&w)?.sum()?; // saves w
    w.resize_storage_(0)?;
    w.resize_storage_(3)?;
    {
        let _g = tp::no_grad();
        w.preserve_version_counter(|| {
            w.detach()
                .copy_(&Tensor::from_vec(vec![1.0f64, 2.0, 3.0], &[3])?)
        })?;
    }
    y.backward()?;
    assert_eq!(
        w.grad().expect("grad").to_vec::<f64>()?,
        vec![8.0, 20.0, 36.0]
    );

    let z = w.mul(&w)?.sum()?;
    {
        let _g = tp::no_grad();
        w.detach()
            .copy_(&Tensor::from_vec(vec![0.0f64; 3], &[3])?)?;
    }
    assert!(
        z.backward().is_err(),
        "a write without preserve_version_counter went unnoticed"
    );
    Ok(())
}

/// Lists a replacement for one parameter, as `fully_shard` lists shards.
struct Replace(Tensor, Tensor);

impl AttachedState for Replace {
    fn kind(&self) -> &'static str {
        "test"
    }
    fn parameter_in_place_of(&self, param: &Tensor) -> Option<Tensor> {
        (param.id() == self.0.id()).then(|| self.1.clone())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[test]
fn attached_state_replaces_listed_parameters_once() -> tp::Result<()> {
    let mut m = nn::Sequential::new().add(nn::Linear::new(2, 3, true)?);
    let w = m.named_parameters()[0].1.clone();
    let shard = tp::zeros(&[1, 2])?.requires_grad_(true);
    m.core_mut()
        .attach(Arc::new(Replace(w.clone(), shard.clone())))?;
    let listed = m.named_parameters();
    assert_eq!(listed[0].0, "0.weight");
    assert!(
        listed[0].1.id() == shard.id(),
        "the weight was not replaced"
    );
    assert_eq!(listed[1].1.shape(), [3], "the bias changed");
    // attaching twice, and moving a module with attached state, are refused
    let again = m.core_mut().attach(Arc::new(Replace(w.clone(), shard)));
    assert!(
        matches!(again, Err(Error::InvalidArgument { .. })),
        "{again:?}"
    );
    let moved = m.to("cpu");
    assert!(
        matches!(moved, Err(Error::NotSupported { .. })),
        "{moved:?}"
    );
    Ok(())
}
