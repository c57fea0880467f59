//! Running one scenario: the launchers on every host, the fault, the verdict.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::hosts::{Fault, Hosts};

/// The store's port on host 0.
pub(crate) const MASTER_PORT: u16 = 29500;

/// The launchers running now, stopped on Ctrl-C before the hosts are removed.
pub(crate) static RUNNING: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// The least a host of a job must send over its link (ARP and IPv6 chatter stay below).
pub(crate) const MIN_CROSS_BYTES: u64 = 4096;

/// One job: a program started by `tensorplay-run` on every host.
pub(crate) struct Scenario {
    pub(crate) name: String,
    pub(crate) hosts: usize,
    pub(crate) per_host: usize,
    pub(crate) program: Vec<String>,
    pub(crate) deadline: Duration,
    /// The program is one libtest test (each rank must report running it).
    pub(crate) is_libtest: bool,
    /// How each host starts its part of the job.
    pub(crate) start: Start,
    /// A fault to inject; with a lost host, the scenario passes when every launcher fails in
    /// time and the other hosts name the lost rank.
    pub(crate) fault: Option<Fault>,
}

/// Variables per host (index: host).
pub(crate) type HostEnv = Vec<Vec<(String, String)>>;

/// How each host starts its part of a scenario.
pub(crate) enum Start {
    /// `tensorplay-run --nnodes K --node-rank h --master-addr 10.0.0.1 --master-port 29500`.
    Flags,
    /// `tensorplay-run --nnodes K --node-rank h --rdzv-endpoint 10.0.0.1:29500`.
    Endpoint,
    /// `tensorplay-run` without placement flags, under a scheduler's variables, as
    /// `srun --ntasks-per-node=1 tensorplay-run` or `mpirun --npernode 1 tensorplay-run`
    /// start it.
    LauncherUnder(HostEnv),
    /// The program itself, one process per host, under a scheduler's variables, as
    /// `srun ./train` or `mpirun ./train` start it.
    Direct(HostEnv),
}

/// A started launcher and its output.
pub(crate) struct Launched {
    pub(crate) child: Child,
    pub(crate) out: std::thread::JoinHandle<()>,
    /// The output so far (a fault is injected once every host printed its marker).
    pub(crate) seen: std::sync::Arc<std::sync::Mutex<String>>,
}

/// The output of one launcher, read as it comes.
pub(crate) type Seen = std::sync::Arc<std::sync::Mutex<String>>;

pub(crate) fn collect(mut r: impl Read + Send + 'static) -> (std::thread::JoinHandle<()>, Seen) {
    let seen = Seen::default();
    let s2 = seen.clone();
    let h = std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        while let Ok(n) = r.read(&mut buf) {
            if n == 0 {
                break;
            }
            s2.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    (h, seen)
}

/// The line a fault job prints once every rank is in (see `fault_loop`).
pub(crate) const MARKER: &str = "fault_loop: running";

pub(crate) fn signal(child: &Child, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status();
}

/// The whole output of each ended launcher (no longer running).
pub(crate) fn outputs(launched: Vec<Launched>) -> Vec<String> {
    RUNNING.lock().unwrap_or_else(|e| e.into_inner()).clear();
    launched
        .into_iter()
        .map(|l| {
            let _ = l.out.join();
            std::mem::take(&mut *l.seen.lock().unwrap_or_else(|e| e.into_inner()))
        })
        .collect()
}

/// Starts `c` (on host `h`), collecting its output.
pub(crate) fn start(mut c: Command, h: usize) -> Result<Launched, String> {
    let mut child = c
        .spawn()
        .map_err(|e| format!("could not start host {h}: {e}"))?;
    RUNNING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(child.id());
    let (o, e) = (child.stdout.take(), child.stderr.take());
    let (out, seen) = collect(o.map_or_else(
        || Box::new(std::io::empty()) as Box<dyn Read + Send>,
        |o| {
            Box::new(o.chain(e.map_or_else(
                || Box::new(std::io::empty()) as Box<dyn Read + Send>,
                |e| Box::new(e) as Box<dyn Read + Send>,
            ))) as Box<dyn Read + Send>
        },
    ));
    Ok(Launched { child, out, seen })
}

/// Runs `s` on `hosts`: `Ok` with the bytes each host sent over its link when every launcher
/// exits 0 within the deadline (and, for a test, every rank ran it), or, for a fault, the
/// milliseconds from the fault to the last launcher's end and each host's failure line;
/// else the launchers' output.
pub(crate) fn run_scenario(
    hosts: &Hosts,
    launcher: &Path,
    s: &Scenario,
) -> Result<(Vec<u64>, Vec<String>), String> {
    let mut launched = Vec::new();
    for h in 0..s.hosts {
        if let Start::Direct(envs) = &s.start {
            let mut c = hosts.command(h, &s.program);
            c.stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .envs(envs[h].iter().map(|(k, v)| (k.as_str(), v.as_str())));
            for v in [
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "MASTER_PORT",
                "TENSORPLAY_RUN",
            ] {
                c.env_remove(v);
            }
            if !envs[h].iter().any(|(k, _)| k == "MASTER_ADDR") {
                c.env_remove("MASTER_ADDR");
            }
            launched.push(start(c, h)?);
            continue;
        }
        if h == 0
            && let Some(f @ Fault::Cap(_)) = s.fault
        {
            hosts.inject(f)?;
        }
        let mut cmd: Vec<String> = vec![
            launcher.display().to_string(),
            "--nproc-per-node".into(),
            s.per_host.to_string(),
        ];
        let place = [
            "--nnodes".to_string(),
            s.hosts.to_string(),
            "--node-rank".into(),
            h.to_string(),
        ];
        match &s.start {
            Start::Flags => {
                cmd.extend(place);
                cmd.extend(["--master-addr".into(), hosts.addr(0)]);
                cmd.extend(["--master-port".into(), MASTER_PORT.to_string()]);
            }
            Start::Endpoint => {
                cmd.extend(place);
                let ep = format!("{}:{MASTER_PORT}", hosts.addr(0));
                cmd.extend(["--rdzv-endpoint".into(), ep]);
            }
            Start::LauncherUnder(_) | Start::Direct(_) => {}
        }
        cmd.push("--".into());
        cmd.extend(s.program.iter().cloned());
        let mut c = hosts.command(h, &cmd);
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("TENSORPLAY_SPAWN_VERBOSE", "0");
        if let Start::LauncherUnder(envs) = &s.start {
            c.envs(envs[h].iter().map(|(k, v)| (k.as_str(), v.as_str())));
        }
        launched.push(start(c, h)?);
    }
    let start = Instant::now();
    let mut codes: Vec<Option<i32>> = vec![None; launched.len()];
    let mut timed_out = false;
    let mut injected: Option<Instant> = None;
    while codes.iter().any(Option::is_none) {
        if let (Some(f @ (Fault::LinkDown(_) | Fault::KillHost(_) | Fault::Blackhole(_))), None) =
            (s.fault, injected)
            && launched.iter().all(|l| {
                l.seen
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .contains(MARKER)
            })
        {
            // the job runs everywhere: let it get into its collectives, then break it
            std::thread::sleep(Duration::from_secs(1));
            if let Err(e) = hosts.inject(f) {
                eprintln!("test-multihost: injecting the fault: {e}");
            }
            injected = Some(Instant::now());
        }
        for (l, code) in launched.iter_mut().zip(codes.iter_mut()) {
            if code.is_none()
                && let Ok(Some(st)) = l.child.try_wait()
            {
                *code = Some(st.code().unwrap_or(-1));
            }
        }
        if start.elapsed() > s.deadline && !timed_out {
            timed_out = true;
            for l in &launched {
                signal(&l.child, "-TERM");
            }
            std::thread::sleep(Duration::from_secs(8));
            for l in &launched {
                signal(&l.child, "-KILL");
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let ended = injected.map(|t| t.elapsed());
    let outs = outputs(launched);
    let sent: Vec<u64> = (0..s.hosts).map(|h| hosts.bytes_from(h)).collect();
    let mut report = String::new();
    if let Some(Fault::LinkDown(lost) | Fault::KillHost(lost) | Fault::Blackhole(lost)) = s.fault {
        // every launcher must fail on its own, in time; the other hosts name the lost rank
        // collectives name ranks; RPC names workers (`worker<rank>`)
        let named = format!("rank {}", lost * s.per_host);
        let worker = format!("worker{}", lost * s.per_host);
        match ended {
            None => report.push_str("the fault was never injected (no host printed the marker)\n"),
            Some(_) if timed_out => report.push_str("a launcher did not end after the fault\n"),
            Some(t) => {
                let silent: Vec<usize> = (0..s.hosts)
                    .filter(|&h| {
                        h != lost && !outs[h].contains(&named) && !outs[h].contains(&worker)
                    })
                    .collect();
                if codes.contains(&Some(0)) {
                    report.push_str("a launcher exited 0 after the fault\n");
                } else if !silent.is_empty() {
                    report.push_str(&format!(
                        "hosts {silent:?} failed without naming the lost {named}\n"
                    ));
                } else {
                    let lines = outs
                        .iter()
                        .enumerate()
                        .map(|(h, o)| {
                            let l = o.lines().find(|l| l.contains("failed:")).unwrap_or("");
                            format!("host {h}: {}", l.chars().take(400).collect::<String>())
                        })
                        .collect();
                    return Ok((vec![t.as_millis() as u64], lines));
                }
            }
        }
    } else if !timed_out && codes.iter().all(|c| *c == Some(0)) {
        // a test filter that matched nothing would also exit 0: every rank must have run
        let ran: usize = outs
            .iter()
            .map(|o| o.matches("running 1 test").count())
            .sum();
        if s.is_libtest && ran != s.hosts * s.per_host {
            report.push_str(&format!(
                "{ran} of {} ranks ran the test (a filter that matched nothing?)\n",
                s.hosts * s.per_host
            ));
        } else if let (Start::LauncherUnder(_), Some(h)) = (
            &s.start,
            outs.iter()
                .position(|o| !o.contains("tensorplay-run: under ")),
        ) {
            // the launcher must say it placed itself from the scheduler's variables
            report.push_str(&format!(
                "host {h}'s launcher did not say it read the scheduler's variables\n"
            ));
        } else if let Some(h) = sent.iter().position(|&b| b < MIN_CROSS_BYTES) {
            // every host's ranks must have talked across the link, not over a loopback
            report.push_str(&format!(
                "host {h} sent only {} bytes over its link (at least {MIN_CROSS_BYTES} expected): the job did not cross hosts\n",
                sent[h]
            ));
        } else {
            return Ok((sent, Vec::new()));
        }
    }
    if timed_out {
        report.push_str(&format!("timed out after {:?}\n", s.deadline));
    }
    for (h, (code, out)) in codes.iter().zip(&outs).enumerate() {
        let tail: Vec<&str> = out.lines().rev().take(40).collect();
        report.push_str(&format!(
            "--- host {h} ({}): exit {code:?}, last lines:\n",
            hosts.addr(h)
        ));
        for l in tail.iter().rev() {
            report.push_str(l);
            report.push('\n');
        }
    }
    Err(report)
}
