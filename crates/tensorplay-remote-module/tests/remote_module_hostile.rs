//! RemoteModule under misuse: absurd remote devices, constructors and interface methods that
//! panic or fail, forwards with wrong shapes, dtypes and input counts (errors naming the
//! owner), handles passed to workers that did not register the type, foreign module RRefs,
//! and calls after the owner shut down. Each is a typed error, never a panic or a hang, and
//! the module stays usable.

use std::time::{Duration, Instant};

use tensorplay_collectives::spawn::spawn;
use tensorplay_core::nn::{Linear, Module, ModuleCore};
use tensorplay_core::{DType, Error, Result, Tensor};
use tensorplay_remote_module::{
    LinearArgs, RemoteConstructible, RemoteModule, interface, register_interface, register_module,
};
use tensorplay_rpc::{self as rpc, autograd};

type TestResult = std::result::Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// `y = x * w` with `w = [1, 2, 3]`; `Args = mode`: 0 builds, 1 panics, 2 fails.
#[derive(Module)]
struct Touchy {
    w: Tensor,
    core: ModuleCore,
}

impl Module for Touchy {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.mul(&self.w)
    }
}

impl RemoteConstructible for Touchy {
    type Args = u8;
    const TYPE_NAME: &'static str = "tests::Touchy";
    fn construct(mode: &u8) -> Result<Touchy> {
        match mode {
            1 => panic!("Touchy constructor panics"),
            2 => Err(Error::InvalidArgument {
                op: "Touchy::construct",
                arg: "mode",
                expected: "0".into(),
                got: "2".into(),
            }),
            _ => Ok(Touchy {
                w: Tensor::from_vec(vec![1.0f64, 2.0, 3.0], &[3])?.requires_grad_(true),
                core: ModuleCore::new(),
            }),
        }
    }
}

/// Methods that panic, one under the write lock.
#[interface(crate = "tensorplay_remote_module")]
pub trait Explodes {
    /// Panics while reading.
    fn boom(&self, x: f64) -> Result<f64>;
    /// Panics while writing, after scaling `w` by `k`.
    fn boom_mut(&mut self, k: f64) -> Result<()>;
    /// The sum of `w`.
    fn total(&self) -> Result<f64>;
}

impl Explodes for Touchy {
    fn boom(&self, x: f64) -> Result<f64> {
        if x > 0.0 {
            panic!("boom {x}");
        }
        Ok(x)
    }
    fn boom_mut(&mut self, k: f64) -> Result<()> {
        let _g = tensorplay_core::no_grad();
        self.w = self.w.mul_scalar(k)?.detach().requires_grad_(true);
        panic!("boom_mut after scaling");
    }
    fn total(&self) -> Result<f64> {
        self.w.sum()?.item::<f64>()
    }
}

fn register_all(rank: usize) {
    register_module::<Linear>();
    // worker2 does not know Touchy
    if rank != 2 {
        register_interface::<ExplodesInterface, Touchy>();
    }
    rpc::register(
        "forward_touchy",
        |(m, x): (RemoteModule<Touchy>, Tensor)| m.forward(&x),
    );
}

fn init(rank: usize, world: usize) -> rpc::Result<()> {
    rpc::init_rpc(
        &format!("worker{rank}"),
        rank,
        world,
        rpc::RpcBackendOptions {
            rpc_timeout: Duration::from_secs(20),
            ..Default::default()
        },
    )
}

fn vals(t: &Tensor) -> Vec<f64> {
    t.to_vec::<f64>().expect("values")
}

/// The remote error inside `e`, if any: `(worker, kind, message)`.
fn remote(e: &Error) -> Option<(&str, &str, &str)> {
    match e.downcast_ref::<rpc::Error>() {
        Some(rpc::Error::Remote {
            worker,
            kind,
            message,
        }) => Some((worker, kind, message)),
        _ => None,
    }
}

fn devices() -> TestResult {
    let long = format!("{}/cpu", "w".repeat(100_000));
    for bad in [
        "rank:99999999999999999999",
        "rank:99999999999999999999/cpu",
        "rank:-1/cpu",
        "rank: 1/cpu",
        "rank:1/cpu ",
        "wörker1/cpu",
        "worker1/cuda:-1",
        "worker1/cuda:99999999999999999999",
        "worker1\0/cpu",
        long.as_str(),
    ] {
        let t0 = Instant::now();
        let e = RemoteModule::<Touchy>::new(bad, 0).expect_err(bad);
        assert!(t0.elapsed() < Duration::from_secs(5), "{bad}: slow");
        let text = e.to_string();
        assert!(!text.is_empty(), "{bad}");
        assert!(
            matches!(
                e,
                Error::InvalidArgument { .. } | Error::InvalidDevice { .. }
            ) || matches!(
                e.downcast_ref::<rpc::Error>(),
                Some(rpc::Error::UnknownWorker { .. })
            ),
            "{}: {e:?}",
            &bad[..bad.len().min(40)]
        );
    }
    // a rank beyond the world: UnknownWorker naming it
    let e = RemoteModule::<Touchy>::new("rank:5/cpu", 0).unwrap_err();
    assert!(
        matches!(
            e.downcast_ref::<rpc::Error>(),
            Some(rpc::Error::UnknownWorker { .. })
        ) && e.to_string().contains('5'),
        "{e:?}"
    );
    // huge layers are refused by the owner, which survives
    let e = RemoteModule::<Linear>::new(
        "worker1",
        LinearArgs {
            in_features: usize::MAX / 2,
            out_features: 3,
            bias: true,
        },
    )
    .unwrap_err();
    assert!(remote(&e).is_some_and(|(w, _, _)| w == "worker1"), "{e:?}");
    let e = RemoteModule::<Linear>::new(
        "worker1",
        LinearArgs {
            in_features: 1 << 40,
            out_features: 1 << 20,
            bias: false,
        },
    )
    .unwrap_err();
    assert!(remote(&e).is_some_and(|(w, _, _)| w == "worker1"), "{e:?}");
    Ok(())
}

fn constructors_and_forwards() -> TestResult {
    // a constructor that panics or fails: the owner's error, naming it
    let e = RemoteModule::<Touchy>::new("worker1", 1).unwrap_err();
    assert!(
        remote(&e).is_some_and(|(w, k, m)| w == "worker1"
            && k == "Panic"
            && m.contains("Touchy constructor panics")),
        "{e:?}"
    );
    let e = RemoteModule::<Touchy>::new("worker1", 2).unwrap_err();
    assert!(
        remote(&e).is_some_and(|(w, _, m)| w == "worker1" && m.contains("mode")),
        "{e:?}"
    );
    // a type the owner did not register
    let e = RemoteModule::<Touchy>::new("worker2", 0).unwrap_err();
    assert!(
        e.to_string().contains("tests::Touchy") && e.to_string().contains("worker2"),
        "{e}"
    );
    let m = RemoteModule::<Touchy>::new_with_interface::<ExplodesInterface>("worker1", 0)?;
    let x = Tensor::from_vec(vec![1.0f64, 1.0, 1.0], &[3])?;
    // wrong shape, wrong dtype, wrong count: errors naming the owner
    let bad_shape = Tensor::from_vec(vec![1.0f64; 4], &[4])?;
    let e = m.forward(&bad_shape).unwrap_err();
    assert!(remote(&e).is_some_and(|(w, _, _)| w == "worker1"), "{e:?}");
    assert!(e.to_string().contains("worker1"), "{e}");
    let bad_dtype = Tensor::from_vec(vec![1i64, 1, 1], &[3])?;
    if let Err(e) = m.forward(&bad_dtype) {
        assert!(remote(&e).is_some_and(|(w, _, _)| w == "worker1"), "{e:?}");
    }
    for n in [0usize, 2, 1000] {
        let inputs = vec![x.clone(); n];
        let e = m.forward_many(&inputs).unwrap_err();
        assert!(
            remote(&e)
                .is_some_and(|(w, _, msg)| w == "worker1" && msg.contains(&format!("{n} inputs"))),
            "{n}: {e:?}"
        );
    }
    // a forward inside a context with a bad input leaves no context behind
    {
        let ctx = autograd::context()?;
        assert!(m.forward(&bad_shape).is_err());
        let y = m.forward(&x)?;
        autograd::backward(ctx.id(), &[y.sum()?], false)?;
    }
    // interface methods that panic: the owner's Panic; the module keeps working
    let e = m.boom(1.0).unwrap_err();
    assert!(
        remote(&e)
            .is_some_and(|(w, k, msg)| w == "worker1" && k == "Panic" && msg.contains("boom 1")),
        "{e:?}"
    );
    assert_eq!(m.boom(-1.0)?, -1.0);
    let e = m.boom_mut(2.0).unwrap_err();
    assert!(remote(&e).is_some_and(|(_, k, _)| k == "Panic"), "{e:?}");
    assert_eq!(m.total()?, 12.0);
    assert_eq!(vals(&m.forward(&x)?), vec![2.0, 4.0, 6.0]);
    // a handle passed to a worker that does not know the type still calls the owner
    let y: Tensor = rpc::rpc_sync("worker2", "forward_touchy", (m, x.clone()), None)?;
    assert_eq!(vals(&y), vec![2.0, 4.0, 6.0]);
    // from_module_rref: wrong owner, wrong device, a foreign type's rref
    let m = RemoteModule::<Touchy>::new("worker1", 0)?;
    for rd in ["worker0/cpu", "rank:2", "worker1/cuda:0", "worker1/cpu/x"] {
        let e = RemoteModule::from_module_rref(rd, m.get_module_rref()).unwrap_err();
        assert!(!e.to_string().is_empty(), "{rd}");
    }
    let again = RemoteModule::from_module_rref("rank:1/cpu", m.get_module_rref())?;
    assert_eq!(vals(&again.forward(&x)?), vec![1.0, 2.0, 3.0]);
    Ok(())
}

#[test]
fn world3_remote_module_hostile() -> TestResult {
    spawn(3, |rank| -> TestResult {
        register_all(rank);
        init(rank, 3)?;
        if rank == 0 {
            devices()?;
            constructors_and_forwards()?;
        }
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// A handle whose owner shut down: train(), forward and remote_parameters return an error
/// naming the owner within the timeout.
#[test]
fn world2_owner_gone() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all(rank);
        init(rank, 2)?;
        if rank == 1 {
            // serve until worker0 made its module, then leave without a graceful shutdown
            std::thread::sleep(Duration::from_secs(2));
            std::process::exit(0);
        }
        let mut m = RemoteModule::<Touchy>::new("worker1", 0)?;
        std::thread::sleep(Duration::from_secs(3));
        let t0 = Instant::now();
        let x = Tensor::from_vec(vec![1.0f64; 3], &[3])?;
        let e = m.train(false).unwrap_err();
        assert!(e.to_string().contains("worker1"), "{e}");
        let e = m.forward(&x).unwrap_err();
        assert!(e.to_string().contains("worker1"), "{e}");
        let e = m.remote_parameters(true).unwrap_err();
        assert!(e.to_string().contains("worker1"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
        let _ = DType::F64;
        drop(m);
        rpc::shutdown(false)?;
        Ok(())
    })?;
    Ok(())
}
