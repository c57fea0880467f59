//! `checkpoint::async_save`: what it commits equals a synchronous save's, across ranks and
//! resharded on load; and a process SIGKILLed at random moments of a run of async saves never
//! leaves its folder without a loadable checkpoint whose tensors and values come from one save.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use tensorplay_core::nn::Module;
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::checkpoint::{self as dcp, StateDict, StateValue, model_state};
use tensorplay_testkit::{SharedDir, TempDir, cpu_world_in, generator_lock};

use super::state_dict::{mlp, same, sharded};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

#[test]
fn async_save_commits_what_save_would() {
    let root = SharedDir::new("dcp-async");
    let dir = root.dir().join("ckpt");
    cpu_world_in(2, Duration::from_secs(60), &root, |_rank| -> TestResult {
        let m = sharded(3)?;
        let sd = model_state(&m, "model")?;
        let handle = dcp::async_save(&sd, &dir, None)?;
        // training goes on: the weights change before the files are written
        for p in m.parameters() {
            p.detach().fill_(0.0)?;
        }
        let md = handle.wait()?;
        if md.tensors.len() != 6 {
            return Err(format!("metadata lists {} tensors", md.tensors.len()).into());
        }
        Ok(())
    });
    if tensorplay_collectives::spawn::is_spawned_child() {
        return;
    }
    // one process, no group: the weights as they were when async_save returned
    let _g = generator_lock();
    let m = mlp(99).unwrap();
    let mut sd = model_state(&m, "model").unwrap();
    dcp::load(&mut sd, &dir, None).unwrap();
    let want = mlp(3).unwrap().state_dict().unwrap();
    same(
        "async, loaded in one process",
        &m.state_dict().unwrap(),
        &want,
    )
    .unwrap();
}

/// The environment variable that makes this test's binary the saving process.
const CHILD: &str = "TP_DCP_KILL_CHILD";
/// Elements of the saved tensor: 16 MiB of float32, so that a write takes a while.
const N: usize = 4 << 20;

/// The state of save number `k`: a tensor of `k`s and the value `k`.
fn state_of(k: u64) -> tp::Result<StateDict> {
    let t = Tensor::full(&[N], k as f64, DType::F32)?;
    let mut sd = StateDict::new();
    sd.insert("w".into(), StateValue::tensor(&t));
    sd.insert("k".into(), StateValue::Value(serde_json::json!(k)));
    Ok(sd)
}

/// The saving process: async saves one after the other, forever (until killed).
fn saving_child(dir: &Path) -> ! {
    let mut k = 1u64;
    loop {
        let r = state_of(k).and_then(|sd| dcp::async_save(&sd, dir, None)?.wait());
        if let Err(e) = r {
            eprintln!("child: save {k} failed: {e}");
            std::process::exit(3);
        }
        k += 1;
    }
}

/// Loads the folder's checkpoint: the tensor's elements must all be the saved value `k`.
fn loadable(dir: &Path) -> Result<u64, String> {
    let mut sd = state_of(0).map_err(|e| e.to_string())?;
    dcp::load(&mut sd, dir, None).map_err(|e| e.to_string())?;
    let k = sd["k"]
        .as_value()
        .and_then(serde_json::Value::as_u64)
        .ok_or("no k")?;
    let w = sd["w"]
        .as_tensor()
        .ok_or("no w")?
        .to_vec::<f32>()
        .map_err(|e| e.to_string())?;
    match w.iter().position(|&x| x != k as f32) {
        Some(i) => Err(format!("value {k} but element {i} is {}", w[i])),
        None => Ok(k),
    }
}

#[test]
fn a_process_killed_during_async_saves_leaves_a_loadable_checkpoint() {
    if let Some(d) = std::env::var_os(CHILD) {
        saving_child(Path::new(&d));
    }
    let tmp = TempDir::new("dcp-kill");
    let dir = tmp.dir().join("ckpt");
    dcp::save(&state_of(0).unwrap(), &dir, None).unwrap();
    let exe = std::env::current_exe().unwrap();
    // deterministic "random" moments: 20 kills between 40 and 400 ms after start
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut seen = Vec::new();
    for kill in 0..20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let wait = 40 + x % 360;
        let mut child = Command::new(&exe)
            .args([
                "dcp_async::a_process_killed_during_async_saves_leaves_a_loadable_checkpoint",
                "--exact",
                "--test-threads=1",
            ])
            .env(CHILD, &dir)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(wait));
        if let Ok(Some(status)) = child.try_wait() {
            panic!("kill {kill}: the saving process ended by itself: {status}");
        }
        child.kill().unwrap(); // SIGKILL
        let _ = child.wait();
        match loadable(&dir) {
            Ok(k) => seen.push(k),
            Err(e) => {
                panic!("kill {kill} after {wait} ms: the folder has no loadable checkpoint: {e}")
            }
        }
    }
    // the kills landed at different moments: not always before the first save committed
    eprintln!("committed saves seen after the kills: {seen:?}");
    assert!(
        seen.iter().any(|&k| k > 0),
        "no save ever committed: {seen:?}"
    );
}
