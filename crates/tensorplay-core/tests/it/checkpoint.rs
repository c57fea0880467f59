//! Checkpoints on disk: safetensors round trips (bit-exact, every dtype and shape), optimizer
//! state round trips (bit-identical next steps), atomic saves under SIGKILL, and refusals of
//! truncated, corrupt and foreign files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tensorplay_core::optim::{
    Adam, AdamOptions, AdamW, AdamWOptions, Optimizer, OptimizerState, SGD, SgdOptions,
};
use tensorplay_core::serialize::{CHECKSUM_KEY, load_with_metadata, save_with_metadata};
use tensorplay_core::{self as tp, DType, Error, Tensor};
use tensorplay_testkit::TempDir;

/// A temporary folder of this test, removed when dropped.
/// The tensor's elements as bit patterns (NaN payloads and -0.0 compared exactly).
fn bits(t: &Tensor) -> (DType, Vec<usize>, Vec<u64>) {
    let v = tensorplay_testkit::element_bits(t).unwrap();
    (t.dtype(), t.shape().to_vec(), v)
}

fn assert_same(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (k, t) in a {
        assert_eq!(
            bits(t),
            bits(&b[k]),
            "tensor {k} differs after the round trip"
        );
    }
}

fn every_kind() -> tp::Result<BTreeMap<String, Tensor>> {
    tp::manual_seed(7);
    let specials = vec![
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(0x7fc0_1234), // a NaN with a payload
        f32::MIN_POSITIVE / 8.0,     // subnormal
        f32::MAX,
        1.0 / 3.0,
    ];
    let mut m = BTreeMap::new();
    m.insert("f32.scalar".into(), Tensor::scalar(2.5f32));
    m.insert("f64.scalar".into(), Tensor::scalar(-1e-300f64));
    m.insert("i64.scalar".into(), Tensor::scalar(i64::MIN));
    m.insert("bool.scalar".into(), Tensor::scalar(true));
    m.insert(
        "f32.empty".into(),
        Tensor::from_vec(Vec::<f32>::new(), &[0])?,
    );
    m.insert(
        "f64.empty3d".into(),
        Tensor::from_vec(Vec::<f64>::new(), &[2, 0, 3])?,
    );
    m.insert(
        "i64.empty".into(),
        Tensor::from_vec(Vec::<i64>::new(), &[0, 4])?,
    );
    m.insert(
        "bool.empty".into(),
        Tensor::from_vec(Vec::<bool>::new(), &[0])?,
    );
    m.insert("f32.specials".into(), Tensor::from_vec(specials, &[2, 4])?);
    m.insert(
        "f64.specials".into(),
        Tensor::from_vec(
            vec![
                f64::from_bits(0x7ff8_0000_dead_beef),
                -0.0,
                f64::MIN_POSITIVE / 3.0,
            ],
            &[3],
        )?,
    );
    m.insert(
        "i64.values".into(),
        Tensor::from_vec(vec![i64::MAX, -1, 0, 42, i64::MIN, 7], &[3, 2])?,
    );
    m.insert(
        "bool.mask".into(),
        Tensor::from_vec(vec![true, false, false, true, true], &[5, 1])?,
    );
    // the 16-bit types: zeros, infinities, a NaN with a payload, a subnormal, the largest
    // finite value, and a third
    let bf16_bits = [0, 0x8000, 0x7f80, 0xff80, 0x7fc5, 0x0001, 0x7f7f, 0x3eab];
    let f16_bits = [0, 0x8000, 0x7c00, 0xfc00, 0x7e05, 0x0001, 0x7bff, 0x3555];
    m.insert(
        "bf16.specials".into(),
        Tensor::from_vec(bf16_bits.map(tp::bf16::from_bits).to_vec(), &[2, 4])?,
    );
    m.insert(
        "f16.specials".into(),
        Tensor::from_vec(f16_bits.map(tp::f16::from_bits).to_vec(), &[2, 4])?,
    );
    m.insert(
        "bf16.transposed".into(),
        tp::randn(&[3, 5])?.bfloat16()?.t()?,
    );
    // a view: transposed, so its elements are not in storage order
    m.insert("f32.transposed".into(), tp::randn(&[3, 5])?.t()?);
    // large: 3 Mi elements (12 MiB)
    m.insert("f32.large".into(), tp::randn(&[1024, 3072])?);
    m.insert(
        "f64.4d".into(),
        tp::randn(&[2, 3, 4, 5])?.to_dtype(DType::F64)?,
    );
    Ok(m)
}

#[test]
fn every_dtype_and_shape_round_trips_bit_exact() -> tp::Result<()> {
    let dir = TempDir::new("roundtrip");
    let tensors = every_kind()?;
    let path = dir.path("all.safetensors");
    tp::save(&tensors, &path)?;
    let back = tp::load(&path)?;
    assert_same(&tensors, &back);
    // loaded tensors are on the CPU, without grad
    assert!(
        back.values()
            .all(|t| !t.device().is_cuda() && !t.requires_grad())
    );
    // a second save over the first replaces it
    let mut fewer = tensors.clone();
    fewer.remove("f32.large");
    tp::save(&fewer, &path)?;
    assert_same(&fewer, &tp::load(&path)?);
    Ok(())
}

#[test]
fn metadata_round_trips_and_the_checksum_key_is_reserved() -> tp::Result<()> {
    let dir = TempDir::new("meta");
    let path = dir.path("m.safetensors");
    let t = BTreeMap::from([("w".to_string(), Tensor::scalar(1.0f32))]);
    let meta = BTreeMap::from([
        ("step".to_string(), "12".to_string()),
        ("note".to_string(), "é \"quoted\"".to_string()),
    ]);
    save_with_metadata(&t, &meta, &path)?;
    let (back, meta_back) = load_with_metadata(&path)?;
    assert_same(&t, &back);
    assert_eq!(meta, meta_back);
    let bad = BTreeMap::from([(CHECKSUM_KEY.to_string(), "0".to_string())]);
    let e = save_with_metadata(&t, &bad, &path).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                arg: "metadata",
                ..
            }
        ),
        "{e}"
    );
    Ok(())
}

#[test]
fn a_module_state_dict_round_trips_into_another_module() -> tp::Result<()> {
    use tp::nn::{Linear, Module};
    let dir = TempDir::new("module");
    let path = dir.path("model.safetensors");
    tp::manual_seed(1);
    let model = Linear::new(4, 3, true)?;
    tp::save(&model.state_dict()?, &path)?;
    let mut other = Linear::new(4, 3, true)?;
    assert_ne!(bits(&other.weight), bits(&model.weight));
    other.load_state_dict(&tp::load(&path)?, true)?;
    assert_same(&model.state_dict()?, &other.state_dict()?);
    Ok(())
}

/// Parameters of two groups (f32 and f64), and their gradients at step `k`.
fn params() -> tp::Result<Vec<Tensor>> {
    tp::manual_seed(3);
    Ok(vec![
        tp::randn(&[4, 3])?.requires_grad_(true),
        tp::randn(&[3])?.requires_grad_(true),
        tp::randn(&[2, 2])?
            .to_dtype(DType::F64)?
            .requires_grad_(true),
    ])
}

fn grads(k: usize, ps: &[Tensor]) -> tp::Result<Vec<Option<Tensor>>> {
    tp::manual_seed(100 + k as u64);
    ps.iter()
        .enumerate()
        // parameter 1 gets no gradient at step 0: its state starts later
        .map(|(i, p)| {
            if i == 1 && k == 0 {
                Ok(None)
            } else {
                tp::randn(p.shape())?.to_dtype(p.dtype()).map(Some)
            }
        })
        .collect()
}

fn deep_copy(ps: &[Tensor]) -> tp::Result<Vec<Tensor>> {
    ps.iter()
        .map(|p| Ok(p.detach().deep_clone()?.requires_grad_(true)))
        .collect()
}

type Make = fn(Vec<Tensor>) -> tp::Result<Box<dyn Optimizer>>;

fn sgd(ps: Vec<Tensor>) -> tp::Result<Box<dyn Optimizer>> {
    let (a, b) = (ps[..2].to_vec(), ps[2..].to_vec());
    let o = SgdOptions {
        lr: 0.1,
        momentum: 0.9,
        nesterov: true,
        weight_decay: 1e-3,
        ..Default::default()
    };
    Ok(Box::new(SGD::with_groups(vec![
        (a, o),
        (
            b,
            SgdOptions {
                dampening: 0.2,
                momentum: 0.5,
                ..o.clone_without_nesterov()
            },
        ),
    ])?))
}
trait NoNesterov {
    fn clone_without_nesterov(&self) -> SgdOptions;
}
impl NoNesterov for SgdOptions {
    fn clone_without_nesterov(&self) -> SgdOptions {
        SgdOptions {
            nesterov: false,
            ..*self
        }
    }
}
fn adam(ps: Vec<Tensor>) -> tp::Result<Box<dyn Optimizer>> {
    let (a, b) = (ps[..2].to_vec(), ps[2..].to_vec());
    let o = AdamOptions {
        lr: 0.01,
        amsgrad: true,
        weight_decay: 0.1,
        ..Default::default()
    };
    Ok(Box::new(Adam::with_groups(vec![
        (a, o),
        (
            b,
            AdamOptions {
                betas: (0.8, 0.99),
                ..Default::default()
            },
        ),
    ])?))
}
fn adamw(ps: Vec<Tensor>) -> tp::Result<Box<dyn Optimizer>> {
    let (a, b) = (ps[..2].to_vec(), ps[2..].to_vec());
    Ok(Box::new(AdamW::with_groups(vec![
        (
            a,
            AdamWOptions {
                lr: 0.02,
                ..Default::default()
            },
        ),
        (
            b,
            AdamWOptions {
                amsgrad: true,
                eps: 1e-6,
                ..Default::default()
            },
        ),
    ])?))
}

#[test]
fn optimizer_state_round_trip_gives_bit_identical_next_steps() -> tp::Result<()> {
    let dir = TempDir::new("optim");
    for (name, make) in [
        ("SGD", sgd as Make),
        ("Adam", adam as Make),
        ("AdamW", adamw as Make),
    ] {
        let ps = params()?;
        let mut opt = make(ps.clone())?;
        for k in 0..3 {
            opt.step_with_grads(&grads(k, &ps)?)?;
        }
        // a scheduler changed the learning rate: the saved groups carry it
        opt.param_groups_mut()[1].lr *= 0.5;
        let path = dir.path(&format!("{name}.safetensors"));
        opt.state_dict()?.save(&path)?;

        // a fresh optimizer over copies of the parameters, restored from the file
        let copies = deep_copy(&ps)?;
        let mut restored = make(copies.clone())?;
        restored.load_state_dict(&OptimizerState::load(&path)?)?;
        assert_eq!(
            restored.param_groups()[1].lr,
            opt.param_groups()[1].lr,
            "{name}: lr"
        );
        for k in 3..7 {
            opt.step_with_grads(&grads(k, &ps)?)?;
            restored.step_with_grads(&grads(k, &copies)?)?;
            for (i, (a, b)) in ps.iter().zip(&copies).enumerate() {
                assert_eq!(
                    bits(a),
                    bits(b),
                    "{name}: parameter {i} differs at step {k}"
                );
            }
        }
        // and the states themselves are equal
        let (a, b) = (opt.state_dict()?, restored.state_dict()?);
        assert_eq!(a.param_groups, b.param_groups, "{name}: groups");
        let (ta, _) = a.to_tensors();
        let (tb, _) = b.to_tensors();
        assert_same(&ta, &tb);
    }
    Ok(())
}

#[test]
fn adam_step_counts_are_saved_as_pytorch_does_and_load_from_every_form() -> tp::Result<()> {
    let ps = params()?;
    let mut a = adam(ps.clone())?;
    for k in 0..3 {
        a.step_with_grads(&grads(k, &ps)?)?;
    }
    let state = a.state_dict()?;
    let saved = &state.state[&0]["step"];
    assert_eq!(
        (saved.dtype(), saved.shape().to_vec(), saved.to_vec_f64()?),
        (DType::F32, vec![], vec![3.0]),
        "a step count is a 0-d float32, as PyTorch's"
    );
    let past = (1i64 << 24) + 1;
    type Want = Result<(f64, DType), &'static str>;
    let cases: [(&str, Tensor, Want); 8] = [
        (
            "float32, PyTorch's",
            Tensor::scalar(3f32),
            Ok((3.0, DType::F32)),
        ),
        ("float64", Tensor::scalar(3f64), Ok((3.0, DType::F32))),
        (
            "int64, earlier tensorplay",
            Tensor::scalar(3i64),
            Ok((3.0, DType::F32)),
        ),
        // float32 would round 2^24 + 1: kept as int64
        (
            "int64 past 2^24",
            Tensor::scalar(past),
            Ok((past as f64, DType::I64)),
        ),
        ("a fraction", Tensor::scalar(2.5f32), Err("state.0.step")),
        ("negative", Tensor::scalar(-1i64), Err("state.0.step")),
        ("NaN", Tensor::scalar(f32::NAN), Err("state.0.step")),
        (
            "not 0-d",
            Tensor::from_vec(vec![3f32], &[1])?,
            Err("shape [1]"),
        ),
    ];
    let check = |case: &str, step: &Tensor, want: &Want| -> tp::Result<()> {
        let mut s = state.clone();
        s.state
            .get_mut(&0)
            .unwrap()
            .insert("step".into(), step.clone());
        let mut b = adam(deep_copy(&ps)?)?;
        match (b.load_state_dict(&s), want) {
            (Ok(()), Ok((n, dtype))) => {
                let out = &b.state_dict()?.state[&0]["step"];
                assert_eq!(
                    (out.dtype(), out.to_vec_f64()?),
                    (*dtype, vec![*n]),
                    "{case}: the count saved again"
                );
            }
            (Err(e), Err(needle)) => {
                let e = e.to_string();
                assert!(e.contains(needle), "{case}: {e}");
            }
            (got, want) => panic!("{case}: got {got:?}, want {want:?}"),
        }
        Ok(())
    };
    for (case, step, want) in &cases {
        check(case, step, want)?;
    }
    Ok(())
}

#[test]
fn optimizer_state_of_another_layout_is_refused_unchanged() -> tp::Result<()> {
    let dir = TempDir::new("optim-bad");
    let ps = params()?;
    let mut a = adam(ps.clone())?;
    a.step_with_grads(&grads(1, &ps)?)?;
    let state = a.state_dict()?;
    // another optimizer's state
    let mut s = sgd(deep_copy(&ps)?)?;
    let e = s.load_state_dict(&state).unwrap_err().to_string();
    assert!(
        e.contains("the state of SGD") && e.contains("the state of Adam"),
        "{e}"
    );
    // other groups
    let mut one_group = Adam::new(deep_copy(&ps)?, AdamOptions::default())?;
    let e = one_group.load_state_dict(&state).unwrap_err().to_string();
    assert!(
        e.contains("parameter groups holding parameters [[0, 1, 2]]"),
        "{e}"
    );
    // a moment of the wrong shape, named
    let mut wrong = state.clone();
    wrong
        .state
        .get_mut(&0)
        .unwrap()
        .insert("exp_avg".into(), tp::zeros(&[3, 4])?);
    let mut b = adam(deep_copy(&ps)?)?;
    let before = b.state_dict()?;
    let e = b.load_state_dict(&wrong).unwrap_err().to_string();
    assert!(e.contains("state.0.exp_avg of shape [4, 3]"), "{e}");
    assert!(
        b.state_dict()?.state.len() == before.state.len(),
        "nothing changed"
    );
    // a stepped parameter without its second moment, or with a negative one
    let mut missing = state.clone();
    missing.state.get_mut(&0).unwrap().remove("exp_avg_sq");
    let e = b.load_state_dict(&missing).unwrap_err().to_string();
    assert!(
        e.contains("state.0.exp_avg_sq") && e.contains("missing"),
        "{e}"
    );
    let mut negative = state.clone();
    negative
        .state
        .get_mut(&0)
        .unwrap()
        .insert("exp_avg_sq".into(), tp::full(&[4, 3], -1.0)?);
    let e = b.load_state_dict(&negative).unwrap_err().to_string();
    assert!(e.contains("state.0.exp_avg_sq >= 0"), "{e}");
    // a learning rate that is not finite is not saved
    let mut nan = state.clone();
    nan.param_groups[0].lr = f64::NAN;
    let e = nan
        .save(dir.path("nan.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("param_groups[0]"), "{e}");
    // a model's weights given as an optimizer's state
    let path = dir.path("weights.safetensors");
    tp::save(
        &BTreeMap::from([("w".to_string(), tp::zeros(&[2])?)]),
        &path,
    )?;
    let e = OptimizerState::load(&path).unwrap_err().to_string();
    assert!(
        e.contains("weights.safetensors") && e.contains("not an optimizer's state"),
        "{e}"
    );
    Ok(())
}

fn checkpoint_problem(path: &Path) -> String {
    match tp::load(path) {
        Err(Error::Checkpoint { path: p, problem }) => {
            assert_eq!(p, path.display().to_string(), "the error names the file");
            problem
        }
        other => panic!(
            "{}: expected a checkpoint error, got {other:?}",
            path.display()
        ),
    }
}

#[test]
fn truncated_corrupt_and_foreign_files_are_refused() -> tp::Result<()> {
    let dir = TempDir::new("bad");
    let good = dir.path("good.safetensors");
    let mut m = BTreeMap::new();
    m.insert("a".to_string(), tp::randn(&[64])?);
    m.insert("b".to_string(), Tensor::from_vec(vec![true, false], &[2])?);
    tp::save(&m, &good)?;
    let bytes = std::fs::read(&good).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let write = |name: &str, b: &[u8]| {
        let p = dir.path(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", vec![], "shorter than the 8-byte header length"),
        (
            "four-bytes",
            bytes[..4].to_vec(),
            "shorter than the 8-byte header length",
        ),
        ("half-header", bytes[..8 + header / 2].to_vec(), "truncated"),
        (
            "one-byte-short",
            bytes[..bytes.len() - 1].to_vec(),
            "truncated",
        ),
        (
            "one-byte-long",
            [bytes.as_slice(), &[0]].concat(),
            "truncated or padded",
        ),
        (
            "zip",
            b"PK\x03\x04\x14\x00\x00\x00\x08\x00archive/data.pkl".to_vec(),
            "zip archive",
        ),
        (
            "text",
            b"hello, this is not a checkpoint at all".to_vec(),
            "not a safetensors file",
        ),
    ];
    for (name, b, want) in cases {
        let p = write(&format!("{name}.safetensors"), &b);
        let problem = checkpoint_problem(&p);
        assert!(problem.contains(want), "{name}: {problem:?} lacks {want:?}");
    }
    // one flipped bit in the data: the checksum catches it
    let mut flipped = bytes.clone();
    let last = flipped.len() - 20;
    flipped[last] ^= 0x01;
    let p = write("flipped.safetensors", &flipped);
    assert!(checkpoint_problem(&p).contains("corrupt: the checksum"));
    // one flipped bit in the metadata (a learning rate), or in the checksum's own key
    let meta = BTreeMap::from([("lr".to_string(), "0.001".to_string())]);
    save_with_metadata(&m, &meta, &good)?;
    let bytes = std::fs::read(&good).unwrap();
    let find = |needle: &[u8]| {
        bytes
            .windows(needle.len())
            .position(|w| w == needle)
            .unwrap()
    };
    let mut lr = bytes.clone();
    lr[find(b"0.001") + 4] ^= 0x08; // "0.009"
    let p = write("lr-flipped.safetensors", &lr);
    assert!(checkpoint_problem(&p).contains("corrupt: the checksum"));
    let mut key = bytes.clone();
    key[find(CHECKSUM_KEY.as_bytes())] ^= 0x20; // "Tensorplay.crc32"
    let p = write("key-flipped.safetensors", &key);
    let problem = checkpoint_problem(&p);
    assert!(
        problem.contains("one bit away from `tensorplay.crc32`"),
        "{problem}"
    );
    // a pipe is not read (it would block)
    let e = tp::load("/dev/null").unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");
    // a bool byte that is neither 0 nor 1 (in a file without a checksum, as other programs write)
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::BOOL, vec![2], &[1, 7]).unwrap();
    let p = write(
        "bad-bool.safetensors",
        &safetensors::serialize([("m", view)], None).unwrap(),
    );
    assert!(checkpoint_problem(&p).contains("bool tensor `m`"));
    // a dtype tensorplay lacks, named
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::I16, vec![2], &[0, 60, 0, 60])
            .unwrap();
    let p = write(
        "i16.safetensors",
        &safetensors::serialize([("short", view)], None).unwrap(),
    );
    let problem = checkpoint_problem(&p);
    assert!(problem.contains("`short` has dtype I16"), "{problem}");
    // a missing file
    assert!(checkpoint_problem(&dir.path("missing.safetensors")).contains("could not read it"));
    // a file another program wrote (no checksum) loads
    let view = safetensors::tensor::TensorView::new(
        safetensors::Dtype::I64,
        vec![1],
        &[5, 0, 0, 0, 0, 0, 0, 0],
    )
    .unwrap();
    let p = write(
        "foreign-ok.safetensors",
        &safetensors::serialize([("n", view)], None).unwrap(),
    );
    assert_eq!(tp::load(&p)?["n"].to_vec::<i64>()?, vec![5]);
    // a save into a missing folder names the file
    let e = tp::save(&m, dir.path("no/such/dir/x.safetensors")).unwrap_err();
    assert!(
        matches!(&e, Error::Checkpoint { path, .. } if path.ends_with("x.safetensors")),
        "{e}"
    );
    Ok(())
}

const CHILD_ENV: &str = "TP_CKPT_ATOMIC_CHILD";

/// Run as a child by `a_save_killed_midway_leaves_the_previous_checkpoint`: saves two
/// alternating versions of a 16 MiB checkpoint forever.
#[test]
#[ignore = "the child of a_save_killed_midway_leaves_the_previous_checkpoint, not a test"]
fn atomic_save_child() -> tp::Result<()> {
    let dir = std::env::var_os(CHILD_ENV).expect("run by its parent test, which sets the folder");
    let dir = PathBuf::from(dir);
    let versions = [tp::full(&[4 << 20], 1.0)?, tp::full(&[4 << 20], 2.0)?];
    for k in 0.. {
        let m = BTreeMap::from([("w".to_string(), versions[k % 2].clone())]);
        tp::save(&m, dir.join("ckpt.safetensors"))?;
        if k == 0 {
            std::fs::write(dir.join("ready"), b"1").unwrap();
        }
    }
    Ok(())
}

#[test]
fn a_save_killed_midway_leaves_the_previous_checkpoint() {
    let dir = TempDir::new("atomic");
    let exe = std::env::current_exe().unwrap();
    for round in 0..6u64 {
        let _ = std::fs::remove_file(dir.path("ready"));
        let mut child = std::process::Command::new(&exe)
            .arg(tensorplay_testkit::test_name(
                module_path!(),
                "atomic_save_child",
            ))
            .args(["--exact", "--ignored", "--test-threads=1"])
            .env(CHILD_ENV, dir.dir())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let t0 = std::time::Instant::now();
        while !dir.path("ready").exists() {
            assert!(t0.elapsed().as_secs() < 60, "the child never saved");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // kill it at some point of a later save (writes of 16 MiB take milliseconds)
        std::thread::sleep(std::time::Duration::from_millis(13 * round + 7));
        // SAFETY: kill(2) on our child, which has not been reaped.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        let _ = child.wait();
        let m =
            tp::load(dir.path("ckpt.safetensors")).unwrap_or_else(|e| panic!("round {round}: {e}"));
        let v = m["w"].to_vec::<f32>().unwrap();
        assert!(
            v.len() == 4 << 20 && (v.iter().all(|&x| x == 1.0) || v.iter().all(|&x| x == 2.0)),
            "round {round}: a mixed checkpoint"
        );
    }
    // the temporary files of the killed saves go at the next save
    tp::save(&BTreeMap::new(), dir.path("ckpt.safetensors")).unwrap();
    let left: Vec<String> = std::fs::read_dir(dir.dir())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(left.is_empty(), "stale temporary files: {left:?}");
}

/// The CRC-32 of the tensor's elements as little-endian bytes, row-major.
fn crc_of(t: &Tensor) -> u32 {
    crc32fast::hash(&tensorplay_testkit::le_bytes(t).unwrap())
}

/// The standard output of `script` run by `$ANCHOR_PYTHON` (a Python with torch and
/// safetensors) with `path` as its argument; panics when it fails.
fn run_python(script: &str, path: &Path) -> String {
    let python =
        std::env::var("ANCHOR_PYTHON").expect("ANCHOR_PYTHON: a Python with torch and safetensors");
    let out = std::process::Command::new(python)
        .args(["-c", script])
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// tensorplay reads what PyTorch writes in bfloat16 and float16, with the same bits. Needs a
/// Python with torch and safetensors, as [`pytorch_loads_what_tensorplay_saves`].
#[test]
#[ignore = "needs PyTorch with safetensors: set ANCHOR_PYTHON"]
fn tensorplay_loads_what_pytorch_saves_in_16_bits() -> tp::Result<()> {
    let dir = TempDir::new("torch16");
    let path = dir.path("half.safetensors");
    // PyTorch writes a bfloat16 and a float16 tensor (a transposed view, made contiguous by the
    // writer) and prints each one's elements' bit patterns
    let script = r#"
import sys, torch
from safetensors.torch import save_file
x = torch.linspace(-70000, 70000, 15).reshape(3, 5) / torch.arange(1, 6)
t = {'b': x.to(torch.bfloat16).t().contiguous(), 'h': x.to(torch.float16).t().contiguous()}
save_file(t, sys.argv[1])
for k in sorted(t):
    print(k, str(t[k].dtype).replace('torch.', ''), list(t[k].shape), ' '.join('%04x' % (v & 0xffff) for v in t[k].reshape(-1).view(torch.int16).tolist()))
"#;
    let stdout = run_python(script, &path);
    let loaded = tp::load(&path)?;
    for line in stdout.lines() {
        let name = line.split(' ').next().unwrap();
        let t = &loaded[name];
        let torch_dtype = if t.dtype() == DType::BF16 {
            "bfloat16"
        } else {
            "float16"
        };
        let bits: Vec<String> = tensorplay_testkit::element_bits(t)?
            .iter()
            .map(|b| format!("{b:04x}"))
            .collect();
        let want = format!("{name} {torch_dtype} {:?} {}", t.shape(), bits.join(" "));
        assert_eq!(line, want, "{name} as PyTorch wrote it");
    }
    Ok(())
}

/// PyTorch reads what tensorplay writes, with the same names and values. Needs a Python with
/// torch and safetensors: `ANCHOR_PYTHON=/path/to/python cargo test -p tensorplay-core --test
/// checkpoint -- --ignored` (the anchors' venv: `bash ../shared/anchors/setup.sh`, then `pip
/// install safetensors` into it).
#[test]
#[ignore = "needs PyTorch with safetensors: set ANCHOR_PYTHON"]
fn pytorch_loads_what_tensorplay_saves() -> tp::Result<()> {
    let dir = TempDir::new("torch");
    let path = dir.path("all.safetensors");
    let tensors = every_kind()?;
    tp::save(&tensors, &path)?;
    // PyTorch prints each tensor's name, dtype, shape and the CRC-32 of its elements' bytes
    let script = r#"
import sys, zlib, torch
from safetensors.torch import load_file
for name, t in sorted(load_file(sys.argv[1]).items()):
    b = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b''
    print(name, str(t.dtype).replace('torch.', ''), list(t.shape), '%08x' % zlib.crc32(b))
"#;
    let got = run_python(script, &path);
    let lines: Vec<&str> = got.lines().collect();
    assert_eq!(lines.len(), tensors.len(), "{got}");
    for ((name, t), line) in tensors.iter().zip(&lines) {
        let torch_dtype = match t.dtype() {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I64 => "int64",
            DType::Bool => "bool",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
        };
        let want = format!("{name} {torch_dtype} {:?} {:08x}", t.shape(), crc_of(t));
        assert_eq!(*line, want, "PyTorch's view of {name}");
    }
    Ok(())
}
