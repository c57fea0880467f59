//! RemoteModule across real processes (PyTorch's `remote_module_test.py` scenarios, adapted):
//! forward sync/async, several inputs, remote_parameters, get_module_rref().to_here() equal to
//! the remote state, train/eval, every unsupported method, a handle sent to a third worker,
//! from_module_rref with a strong assertion, the remote_device rows that need workers, creation
//! errors from the constructor, an interface with two methods and one the type does not
//! implement, and a model whose middle layer is remote, trained with distributed autograd and
//! DistributedOptimizer, equal to the same model trained in one process.

use std::time::Duration;

use tensorplay_collectives::spawn::spawn;
use tensorplay_core::nn::{Linear, Module, ModuleCore, Sequential};
use tensorplay_core::optim::{Optimizer, SGD, SgdOptions};
use tensorplay_core::{Error, Result, Tensor};
use tensorplay_remote_module::{
    LayerSpec, LinearArgs, RemoteConstructible, RemoteModule, interface, register_interface,
    register_module,
};
use tensorplay_rpc::{self as rpc, DistributedOptimizer, OptimizerKind, RRef, autograd};

type TestResult = std::result::Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// A float64 linear layer with deterministic weights: `y = x W^T + b * scale`.
#[derive(Module)]
struct DetLinear {
    inner: Linear,
    scale: f64,
    core: ModuleCore,
}

/// `(in, out, seed)`; `in == 0` makes the constructor fail.
type DetArgs = (usize, usize, u64);

fn det_values(n: usize, seed: u64) -> Vec<f64> {
    (0..n)
        .map(|i| (((i as u64 * 7 + seed * 13) % 17) as f64 - 8.0) / 20.0)
        .collect()
}

impl Module for DetLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.inner.forward(x)
    }
}

impl RemoteConstructible for DetLinear {
    type Args = DetArgs;
    const TYPE_NAME: &'static str = "tests::DetLinear";
    fn construct(&(i, o, seed): &DetArgs) -> Result<DetLinear> {
        if i == 0 {
            return Err(Error::InvalidArgument {
                op: "DetLinear::construct",
                arg: "in_features",
                expected: "at least 1".into(),
                got: "0".into(),
            });
        }
        let w = Tensor::from_vec(det_values(i * o, seed), &[o, i])?.requires_grad_(true);
        let b = Tensor::from_vec(det_values(o, seed + 1), &[o])?.requires_grad_(true);
        Ok(DetLinear {
            inner: Linear::from_weights(w, Some(b))?,
            scale: 1.0,
            core: ModuleCore::new(),
        })
    }
    /// `forward(a) + b`: several inputs.
    fn forward_many(&self, inputs: &[Tensor]) -> Result<Tensor> {
        match inputs {
            [a] => self.call(a),
            [a, b] => self.call(a)?.add(b),
            _ => Err(Error::InvalidArgument {
                op: "DetLinear::forward_many",
                arg: "inputs",
                expected: "1 or 2 inputs".into(),
                got: inputs.len().to_string(),
            }),
        }
    }
}

/// An interface with two methods.
#[interface(crate = "tensorplay_remote_module")]
pub trait Scorer {
    /// `forward(x).sum() * k * scale`.
    fn score(&self, x: Tensor, k: f64) -> Result<Tensor>;
    /// Sets `scale`, returns the old one.
    fn set_scale(&mut self, scale: f64) -> Result<f64>;
}

impl Scorer for DetLinear {
    fn score(&self, x: Tensor, k: f64) -> Result<Tensor> {
        self.forward(&x)?.sum()?.mul_scalar(k * self.scale)
    }
    fn set_scale(&mut self, scale: f64) -> Result<f64> {
        Ok(std::mem::replace(&mut self.scale, scale))
    }
}

fn x_input() -> Tensor {
    Tensor::from_vec(det_values(12, 5), &[3, 4]).expect("x")
}

fn vals(t: &Tensor) -> Vec<f64> {
    t.to_dtype(tensorplay_core::DType::F64)
        .and_then(|t| t.to_vec::<f64>())
        .expect("values")
}

fn register_all(rank: usize) {
    register_module::<Linear>();
    register_module::<Sequential>();
    register_module::<tensorplay_core::nn::Embedding>();
    // worker1 knows DetLinear without the Scorer interface, the others with it
    if rank == 1 {
        register_module::<DetLinear>();
    } else {
        register_interface::<ScorerInterface, DetLinear>();
    }
    rpc::register(
        "forward_on_third",
        |(m, x): (RemoteModule<DetLinear>, Tensor)| m.forward(&x),
    );
    rpc::register(
        "build_from_rref",
        |(rd, r): (String, RRef<tensorplay_remote_module::Hosted<DetLinear>>)| {
            RemoteModule::from_module_rref(&rd, r)?.forward(&x_input())
        },
    );
    rpc::register("barrier_ping", |(): ()| Ok(()));
}

fn init(rank: usize, world: usize) -> rpc::Result<()> {
    rpc::init_rpc(
        &format!("worker{rank}"),
        rank,
        world,
        rpc::RpcBackendOptions {
            rpc_timeout: Duration::from_secs(30),
            ..Default::default()
        },
    )
}

fn is_unsupported(r: Result<impl std::fmt::Debug>, method: &str) {
    match r {
        Err(Error::NotSupported { op, detail }) => {
            assert_eq!(op, method);
            assert!(detail.starts_with("here: RemoteModule holds no local state; "));
        }
        other => panic!("{method}: {other:?}"),
    }
}

/// Everything but training, driven by worker0 against worker1 and worker2.
fn scenarios() -> TestResult {
    let args: DetArgs = (4, 2, 3);
    let m = RemoteModule::<DetLinear>::new("worker1/cpu", args)?;
    // the remote state, fetched whole, equals a module built from the same arguments
    let copy = m.get_module_rref().to_here(None)?;
    let local = DetLinear::construct(&args)?;
    assert_eq!(copy.read().state_dict()?.len(), 2);
    for ((k1, v1), (k2, v2)) in copy
        .read()
        .state_dict()?
        .iter()
        .zip(local.state_dict()?.iter())
    {
        assert_eq!(k1, k2);
        assert_eq!(vals(v1), vals(v2));
    }
    // forward, sync and async, equals the local forward of the copy
    let x = x_input();
    let want = vals(&copy.read().forward(&x)?);
    assert_eq!(vals(&m.forward(&x)?), want);
    assert_eq!(vals(&m.forward_async(&x)?.wait()?), want);
    assert_eq!(vals(&Module::call(&m, &x)?), want);
    // several inputs
    let b = Tensor::from_vec(vec![1.0f64; 6], &[3, 2])?;
    let many = m.forward_many(&[x.clone(), b])?;
    assert_eq!(
        vals(&many),
        want.iter().map(|v| v + 1.0).collect::<Vec<_>>()
    );
    let e = m.forward_many(&[]).unwrap_err();
    assert!(e.to_string().contains("1 or 2 inputs"), "{e}");
    // remote parameters: RRefs owned by worker1 holding the module's values
    let ps = m.remote_parameters(true)?;
    assert_eq!(ps.len(), 2);
    let mut got: Vec<Vec<f64>> = Vec::new();
    for p in &ps {
        assert_eq!(p.owner_name(), "worker1");
        got.push(vals(&p.to_here(None)?));
    }
    let want_params: Vec<Vec<f64>> = local.parameters().iter().map(vals).collect();
    assert_eq!(got, want_params);
    assert_eq!(
        m.remote_parameters(false)?.len(),
        0,
        "DetLinear's own parameters: none"
    );
    // train / eval, both ways, with mode honoured
    let mut m = m;
    assert!(m.is_training());
    m.eval()?;
    assert!(!m.is_training_remote()? && !m.is_training());
    m.train(true)?;
    assert!(m.is_training_remote()?);
    m.train(false)?;
    assert!(!m.is_training_remote()?, "train(false) sets eval mode");
    m.train(true)?;
    // every method that would change local state
    is_unsupported(m.state_dict(), "state_dict");
    is_unsupported(
        m.load_state_dict(&Default::default(), true),
        "load_state_dict",
    );
    is_unsupported(m.zero_grad(), "zero_grad");
    is_unsupported(m.requires_grad_(false), "requires_grad_");
    is_unsupported(m.to(tensorplay_core::Device::Cpu), "to");
    is_unsupported(m.cpu(), "cpu");
    is_unsupported(m.cuda(0), "cuda");
    is_unsupported(
        m.register_forward_hook(Box::new(|_, _| Ok(None))),
        "register_forward_hook",
    );
    // Debug names the owner and the device
    let dbg = format!("{m:?}");
    assert!(dbg.contains("worker1") && dbg.contains("Cpu"), "{dbg}");
    // a local model holding it lists its local parameters only, and runs through it
    let local_first = DetLinear::construct(&(3, 4, 9))?;
    let first_params = local_first.parameters().len();
    let hybrid = Sequential::new().add(local_first).add(m);
    assert_eq!(hybrid.parameters().len(), first_params);
    let h = hybrid.forward(&Tensor::from_vec(det_values(6, 2), &[2, 3])?)?;
    assert_eq!(h.shape(), &[2, 2]);
    // a handle sent to a third worker works there
    let m = RemoteModule::<DetLinear>::new("worker1", args)?;
    let third: Tensor = rpc::rpc_sync("worker2", "forward_on_third", (m.clone(), x.clone()), None)?;
    assert_eq!(vals(&third), want);
    // a clone passed in an RPC leaves this handle usable: both reach the same module
    assert_eq!(vals(&m.forward(&x)?), want);
    let twin = m.clone();
    drop(m);
    assert_eq!(vals(&twin.forward(&x)?), want);
    // from_module_rref, on this worker and on a third one: the same outputs
    let m = RemoteModule::<DetLinear>::new("rank:1/cpu", args)?;
    let again = RemoteModule::from_module_rref("worker1/cpu", m.get_module_rref())?;
    assert_eq!(vals(&again.forward(&x)?), want);
    let on_third: Tensor = rpc::rpc_sync(
        "worker2",
        "build_from_rref",
        ("worker1/cpu".to_string(), m.get_module_rref()),
        None,
    )?;
    assert_eq!(vals(&on_third), want);
    let e = RemoteModule::from_module_rref("worker2/cpu", m.get_module_rref()).unwrap_err();
    assert!(e.to_string().contains("worker1/cpu"), "{e}");
    // the core's layers
    let lin = RemoteModule::<Linear>::new(
        "worker2/cpu",
        LinearArgs {
            in_features: 4,
            out_features: 3,
            bias: true,
        },
    )?;
    let lcopy = lin.get_module_rref().to_here(None)?;
    let xf = x.to_dtype(tensorplay_core::DType::F32)?;
    assert_eq!(vals(&lin.forward(&xf)?), vals(&lcopy.read().forward(&xf)?));
    let seq = RemoteModule::<Sequential>::new(
        "worker2/cpu",
        vec![
            LayerSpec::Linear(LinearArgs {
                in_features: 4,
                out_features: 8,
                bias: true,
            }),
            LayerSpec::Tanh,
            LayerSpec::GELU,
            LayerSpec::Dropout(0.0),
            LayerSpec::Linear(LinearArgs {
                in_features: 8,
                out_features: 2,
                bias: false,
            }),
            LayerSpec::Sigmoid,
            LayerSpec::ReLU,
        ],
    )?;
    assert_eq!(seq.remote_parameters(true)?.len(), 3);
    let scopy = seq.get_module_rref().to_here(None)?;
    assert_eq!(vals(&seq.forward(&xf)?), vals(&scopy.read().forward(&xf)?));
    // a layer the owner cannot build: its error
    let e =
        RemoteModule::<Sequential>::new("worker2/cpu", vec![LayerSpec::Dropout(1.5)]).unwrap_err();
    assert!(e.to_string().contains('p'), "{e}");
    let emb = RemoteModule::<tensorplay_core::nn::Embedding>::new("worker1", (10, 3))?;
    let idx = Tensor::from_vec(vec![1i64, 7, 7], &[3])?;
    let ecopy = emb.get_module_rref().to_here(None)?;
    assert_eq!(
        vals(&emb.forward(&idx)?),
        vals(&ecopy.read().forward(&idx)?)
    );
    Ok(())
}

fn creation_errors() -> TestResult {
    let args: DetArgs = (4, 2, 3);
    // a device the owner does not have: the owner's error, from the constructor
    let e = RemoteModule::<DetLinear>::new("worker1/cuda:100", args).unwrap_err();
    assert!(e.to_string().contains("no such device"), "{e}");
    // an unknown worker
    let e = RemoteModule::<DetLinear>::new("nosuchworker/cpu", args).unwrap_err();
    assert!(
        matches!(
            e.downcast_ref::<rpc::Error>(),
            Some(rpc::Error::UnknownWorker { .. })
        ),
        "{e:?}"
    );
    // a bad remote device never leaves this worker
    let e = RemoteModule::<DetLinear>::new("worker1/cpu2", args).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidDevice { input } if input == "cpu2"),
        "{e:?}"
    );
    let e = RemoteModule::<DetLinear>::new("trainer:0/cpu", args).unwrap_err();
    assert!(e.to_string().contains("rank:<rank>/<device>"), "{e}");
    // a constructor that fails
    let e = RemoteModule::<DetLinear>::new("worker1", (0, 2, 3)).unwrap_err();
    assert!(e.to_string().contains("in_features"), "{e}");
    // a type the owner never registered
    #[derive(Module)]
    struct Unknown {
        core: ModuleCore,
    }
    impl Module for Unknown {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            Ok(x.clone())
        }
    }
    impl RemoteConstructible for Unknown {
        type Args = ();
        const TYPE_NAME: &'static str = "tests::Unknown";
        fn construct(_: &()) -> Result<Unknown> {
            Ok(Unknown {
                core: ModuleCore::new(),
            })
        }
    }
    let e = RemoteModule::<Unknown>::new("worker1", ()).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("tests::Unknown") && text.contains("register_module"),
        "{text}"
    );
    // the interface: worker2 registered it, worker1 did not
    let s = RemoteModule::<DetLinear>::new_with_interface::<ScorerInterface>("worker2", args)?;
    let x = x_input();
    let want = DetLinear::construct(&args)?.forward(&x)?.sum()?;
    assert_eq!(
        vals(&s.score(x.clone(), 2.0)?),
        vals(&want.mul_scalar(2.0)?)
    );
    assert_eq!(s.set_scale(3.0)?, 1.0);
    assert_eq!(
        vals(&s.score_async(x.clone(), 2.0)?.wait()?),
        vals(&want.mul_scalar(6.0)?)
    );
    assert_eq!(s.set_scale_async(1.0)?.wait()?, 3.0);
    let e = RemoteModule::<DetLinear>::new_with_interface::<ScorerInterface>("worker1", args)
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("Scorer") && text.contains("tests::DetLinear"),
        "{text}"
    );
    // a handle made without the interface does not get its methods at run time either
    let plain = RemoteModule::<DetLinear>::new("worker2", args)?;
    let e = plain.score(x, 1.0).unwrap_err();
    assert!(e.to_string().contains("new_with_interface"), "{e}");
    Ok(())
}

#[test]
fn world3_remote_module() -> TestResult {
    spawn(3, |rank| -> TestResult {
        register_all(rank);
        init(rank, 3)?;
        if rank == 0 {
            scenarios()?;
            creation_errors()?;
        }
        // rank 0 reaches shutdown last; the others wait for it there
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

const STEPS: usize = 15;

fn data() -> Result<(Tensor, Tensor)> {
    Ok((
        Tensor::from_vec(det_values(24, 11), &[6, 4])?,
        Tensor::from_vec(det_values(12, 12), &[6, 2])?,
    ))
}

fn loss_of(out: &Tensor, y: &Tensor) -> Result<Tensor> {
    out.sub(y)?.pow_scalar(2.0)?.mean()
}

/// first (local) -> tanh -> middle (remote on worker1) -> tanh -> last (local).
fn train_distributed() -> Result<Vec<f64>> {
    let (x, y) = data()?;
    let first = DetLinear::construct(&(4, 5, 1))?;
    let last = DetLinear::construct(&(3, 2, 2))?;
    let middle = RemoteModule::<DetLinear>::new("worker1/cpu", (5, 3, 3))?;
    let mut params: Vec<RRef<Tensor>> = middle.remote_parameters(true)?;
    for p in first.parameters().into_iter().chain(last.parameters()) {
        params.push(RRef::new(p)?);
    }
    let opt = DistributedOptimizer::new(
        OptimizerKind::Sgd(SgdOptions {
            lr: 0.1,
            momentum: 0.5,
            ..Default::default()
        }),
        &params,
    )?;
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        let ctx = autograd::context()?;
        let h = first.forward(&x)?.tanh()?;
        let h = middle.forward(&h)?.tanh()?;
        let loss = loss_of(&last.forward(&h)?, &y)?;
        losses.push(loss.item::<f64>()?);
        autograd::backward(ctx.id(), &[loss], false)?;
        opt.step(ctx.id())?;
    }
    Ok(losses)
}

fn train_local() -> Result<Vec<f64>> {
    let (x, y) = data()?;
    let model = Sequential::new()
        .add(DetLinear::construct(&(4, 5, 1))?)
        .add(tensorplay_core::nn::Tanh::new())
        .add(DetLinear::construct(&(5, 3, 3))?)
        .add(tensorplay_core::nn::Tanh::new())
        .add(DetLinear::construct(&(3, 2, 2))?);
    let mut opt = SGD::new(
        model.parameters(),
        SgdOptions {
            lr: 0.1,
            momentum: 0.5,
            ..Default::default()
        },
    )?;
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        opt.zero_grad()?;
        let loss = loss_of(&model.forward(&x)?, &y)?;
        losses.push(loss.item::<f64>()?);
        loss.backward()?;
        opt.step()?;
    }
    Ok(losses)
}

#[test]
fn world2_training_through_a_remote_middle_layer_equals_one_process() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all(rank);
        init(rank, 2)?;
        if rank == 0 {
            let dist = train_distributed()?;
            let local = train_local()?;
            let worst = dist
                .iter()
                .zip(&local)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f64, f64::max);
            assert!(worst < 1e-6, "{dist:?} vs {local:?}");
            assert!(dist[STEPS - 1] < dist[0], "{dist:?}");
        }
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// A deep copy of a module's state.
fn snapshot(m: &dyn Module) -> Result<std::collections::BTreeMap<String, Tensor>> {
    m.state_dict()?
        .into_iter()
        .map(|(k, v)| Ok((k, v.deep_clone()?)))
        .collect()
}

/// Checkpoints kept by the owners: after 6 steps of the remote-middle-layer model, the owner
/// saves its layer (`save_on_owner`) and every owner its optimizer state (`save_on_owners`);
/// 9 more steps; then the saved state is restored (from the owners' files, and again from
/// `DistributedOptimizer::state_dict`) and the same 9 steps give bit-identical losses. A corrupt
/// file and another job's owners are refused, naming them.
#[test]
fn world2_owners_checkpoint_and_training_resumes_bit_exact() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all(rank);
        init(rank, 2)?;
        if rank == 0 {
            /// Removed when dropped, also when an assertion fails.
            struct Scratch(std::path::PathBuf);
            impl Drop for Scratch {
                fn drop(&mut self) {
                    let _ = std::fs::remove_dir_all(&self.0);
                }
            }
            let dir =
                Scratch(std::env::temp_dir().join(format!("tp-owner-ckpt-{}", std::process::id())));
            std::fs::create_dir_all(&dir.0)?;
            owners_checkpoint(&dir.0)?;
        }
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

fn owners_checkpoint(dir: &std::path::Path) -> TestResult {
    let (x, y) = data()?;
    let mut first = DetLinear::construct(&(4, 5, 1))?;
    let mut last = DetLinear::construct(&(3, 2, 2))?;
    let middle = RemoteModule::<DetLinear>::new("worker1/cpu", (5, 3, 3))?;
    let mut params: Vec<RRef<Tensor>> = middle.remote_parameters(true)?;
    for p in first.parameters().into_iter().chain(last.parameters()) {
        params.push(RRef::new(p)?);
    }
    let kind = OptimizerKind::Adam(tensorplay_core::optim::AdamOptions {
        lr: 0.05,
        ..Default::default()
    });
    let opt = DistributedOptimizer::new(kind, &params)?;
    let steps = |n: usize, first: &DetLinear, last: &DetLinear| -> Result<Vec<u64>> {
        let mut losses = Vec::new();
        for _ in 0..n {
            let ctx = autograd::context()?;
            let h = first.forward(&x)?.tanh()?;
            let h = middle.forward(&h)?.tanh()?;
            let loss = loss_of(&last.forward(&h)?, &y)?;
            losses.push(loss.item::<f64>()?.to_bits());
            autograd::backward(ctx.id(), &[loss], false)?;
            opt.step(ctx.id())?;
        }
        Ok(losses)
    };
    steps(6, &first, &last)?;
    let d = dir.display().to_string();
    let layer = format!("{d}/middle.safetensors");
    middle.save_on_owner(&layer)?;
    let files = opt.save_on_owners(&d, "opt")?;
    assert_eq!(files.keys().collect::<Vec<_>>(), ["worker0", "worker1"]);
    let states = opt.state_dict()?;
    let (first_saved, last_saved) = (snapshot(&first)?, snapshot(&last)?);
    let straight = steps(9, &first, &last)?;

    // restored from the owners' files
    middle.load_on_owner(&layer)?;
    opt.load_on_owners(&d, "opt")?;
    first.load_state_dict(&first_saved, true)?;
    last.load_state_dict(&last_saved, true)?;
    assert_eq!(
        steps(9, &first, &last)?,
        straight,
        "resumed from the owners' files"
    );

    // restored from state_dict, by RPC
    middle.load_on_owner(&layer)?;
    opt.load_state_dict(&states)?;
    first.load_state_dict(&first_saved, true)?;
    last.load_state_dict(&last_saved, true)?;
    assert_eq!(
        steps(9, &first, &last)?,
        straight,
        "resumed from state_dict"
    );

    // a truncated layer file: the owner's error names it
    let bytes = std::fs::read(&layer)?;
    std::fs::write(&layer, &bytes[..bytes.len() / 2])?;
    let e = middle.load_on_owner(&layer).unwrap_err().to_string();
    assert!(
        e.contains("middle.safetensors") && e.contains("truncated"),
        "{e}"
    );
    // states of other owners
    let mut other = states.clone();
    let w1 = other.remove("worker1").ok_or("no worker1 state")?;
    other.insert("worker7".into(), w1);
    let e = opt.load_state_dict(&other).unwrap_err().to_string();
    assert!(e.contains("worker7") && e.contains("worker1"), "{e}");
    Ok(())
}
