//! `cargo xtask test-multihost`: K simulated hosts on this machine, each a network namespace
//! with its own `/dev/shm` (a tmpfs mounted in its own mount namespace) and hostname (its own
//! UTS namespace), connected by veth pairs to a bridge that lives in a namespace of its own,
//! with addresses from a private range that exist only inside those namespaces. Nothing runs in
//! the root namespace's network and nothing is added to it: every job talks only over the
//! harness's own links.
//!
//! Each scenario starts `tensorplay-run --nnodes K --node-rank h` on every host `h` (the
//! launcher's ranks join the job through `spawn`, so the project's own multi-process tests run
//! unchanged with their ranks spread over the hosts), waits for all of them within a deadline,
//! and counts the scenario passed when every launcher exited 0. Everything is removed at the
//! end, also after a failure (the hosts are dropped on every path, and the job's processes are
//! stopped first); namespaces left by a run that was killed outright carry the name prefix and
//! are removed at the next start. Needs root (`ip netns`); without it the command says so and
//! fails.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The prefix of every namespace this harness makes.
const PREFIX: &str = "tpmh-";
/// The switch's namespace (the bridge).
const SWITCH: &str = "tpmh-switch";
/// The test subnet: host `h` is `10.0.0.{h+1}/24`, inside its namespace only (host 0 is the
/// README's `--master-addr 10.0.0.1`).
const SUBNET: &str = "10.0.0";
/// The store's port on host 0.
const MASTER_PORT: u16 = 29500;
/// The launchers running now, stopped on Ctrl-C before the hosts are removed.
static RUNNING: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// The least a host of a job must send over its link (ARP and IPv6 chatter stay below).
const MIN_CROSS_BYTES: u64 = 4096;

/// Runs `ip` with `args`; an error with its output when it fails.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("could not run ip: {e} (install iproute2)"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The namespaces with this harness's prefix.
fn ours() -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output();
    let text = out
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(PREFIX))
        .map(str::to_string)
        .collect()
}

/// Removes every namespace with this harness's prefix (their veths and bridge go with them).
fn remove_all() {
    for ns in ours() {
        let _ = ip(&["netns", "del", &ns]);
    }
}

/// Whether this process runs as root.
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// K simulated hosts; dropping them removes every namespace.
pub(crate) struct Hosts {
    k: usize,
    /// The hosts file every host sees as `/etc/hosts` (its hostnames resolve to its address).
    etc_hosts: PathBuf,
}

impl Hosts {
    /// Makes `k` hosts connected to one bridge (stale namespaces of an earlier run first
    /// removed).
    pub(crate) fn create(k: usize) -> Result<Hosts, String> {
        remove_all();
        let etc_hosts = std::env::temp_dir().join(format!("tpmh-hosts-{}", std::process::id()));
        let mut text = String::from("127.0.0.1 localhost\n");
        for h in 0..k {
            text.push_str(&format!("{SUBNET}.{} {PREFIX}host{h}\n", h + 1));
        }
        std::fs::write(&etc_hosts, text).map_err(|e| format!("writing {etc_hosts:?}: {e}"))?;
        let hosts = Hosts { k, etc_hosts };
        ip(&["netns", "add", SWITCH])?;
        ip(&["-n", SWITCH, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", SWITCH, "link", "set", "br0", "up"])?;
        for h in 0..k {
            let ns = hosts.name(h);
            ip(&["netns", "add", &ns])?;
            let port = format!("port{h}");
            ip(&[
                "link", "add", &port, "netns", SWITCH, "type", "veth", "peer", "name", "eth0",
                "netns", &ns,
            ])?;
            ip(&["-n", SWITCH, "link", "set", &port, "master", "br0", "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", hosts.addr(h)),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// Host `h`'s namespace (also its hostname).
    pub(crate) fn name(&self, h: usize) -> String {
        format!("{PREFIX}host{h}")
    }

    /// Host `h`'s address.
    pub(crate) fn addr(&self, h: usize) -> String {
        format!("{SUBNET}.{}", h + 1)
    }

    /// Injects `f`.
    fn inject(&self, f: Fault) -> Result<(), String> {
        match f {
            Fault::LinkDown(h) => ip(&["-n", SWITCH, "link", "set", &format!("port{h}"), "down"]),
            Fault::KillHost(h) => {
                let pids = Command::new("ip")
                    .args(["netns", "pids", &self.name(h)])
                    .output()
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                    .unwrap_or_default();
                for p in pids.split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", p]).status();
                }
                Ok(())
            }
            Fault::Blackhole(h) => {
                for other in (0..self.k).filter(|&o| o != h) {
                    let (a, b) = (self.addr(h), self.addr(other));
                    for (ns, to) in [(self.name(other), a), (self.name(h), b)] {
                        let to = format!("{to}/32");
                        ip(&["-n", &ns, "route", "add", "blackhole", &to])?;
                    }
                }
                Ok(())
            }
            Fault::Cap(mbit) => {
                for h in 0..self.k {
                    let ok = Command::new("ip")
                        .args(["netns", "exec", &self.name(h), "tc", "qdisc", "add", "dev"])
                        .args(["eth0", "root", "tbf", "rate", &format!("{mbit}mbit")])
                        .args(["burst", "64kb", "latency", "400ms"])
                        .status()
                        .is_ok_and(|st| st.success());
                    if !ok {
                        return Err(format!("could not cap host {h}'s link (tc tbf)"));
                    }
                }
                Ok(())
            }
        }
    }

    /// The bytes host `h` sent over its link (received by its port on the bridge).
    pub(crate) fn bytes_from(&self, h: usize) -> u64 {
        Command::new("ip")
            .args(["netns", "exec", SWITCH, "cat"])
            .arg(format!("/sys/class/net/port{h}/statistics/rx_bytes"))
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(0)
    }

    /// `cmd` to run on host `h`: in its network namespace, with its own `/dev/shm` and
    /// hostname. The processes `cmd` starts share them (they are one host).
    pub(crate) fn command(&self, h: usize, cmd: &[String]) -> Command {
        let mut c = Command::new("ip");
        c.args([
            "netns",
            "exec",
            &self.name(h),
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
        ])
        .arg(format!(
            "mount -t tmpfs -o size=2g tmpfs /dev/shm && mount --bind {} /etc/hosts && hostname {} && exec \"$@\"",
            self.etc_hosts.display(),
            self.name(h)
        ))
        .arg("sh")
        .args(cmd);
        c
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = self.k;
        remove_all();
        let _ = std::fs::remove_file(&self.etc_hosts);
    }
}

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
type HostEnv = Vec<Vec<(String, String)>>;

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
struct Launched {
    child: Child,
    out: std::thread::JoinHandle<()>,
    /// The output so far (a fault is injected once every host printed its marker).
    seen: std::sync::Arc<std::sync::Mutex<String>>,
}

/// The output of one launcher, read as it comes.
type Seen = std::sync::Arc<std::sync::Mutex<String>>;

fn collect(mut r: impl Read + Send + 'static) -> (std::thread::JoinHandle<()>, Seen) {
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

/// A fault injected into a running scenario.
#[derive(Clone, Copy)]
pub(crate) enum Fault {
    /// Host `h`'s link set down once every host printed the marker.
    LinkDown(usize),
    /// Every process of host `h` killed (SIGKILL) once every host printed the marker.
    KillHost(usize),
    /// Host `h` partitioned by blackhole routes (its packets to the others, and theirs to it,
    /// silently dropped; the links stay up) once every host printed the marker.
    Blackhole(usize),
    /// Every host's link capped at this many Mbit/s (tbf) before the job starts.
    Cap(u32),
}

/// The line a fault job prints once every rank is in (see `fault_loop`).
const MARKER: &str = "fault_loop: running";

fn signal(child: &Child, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status();
}

/// Starts `c` (on host `h`), collecting its output.
fn start(mut c: Command, h: usize) -> Result<Launched, String> {
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
fn run_scenario(
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
    let outs: Vec<String> = launched
        .into_iter()
        .map(|l| {
            let _ = l.out.join();
            std::mem::take(&mut *l.seen.lock().unwrap_or_else(|e| e.into_inner()))
        })
        .collect();
    RUNNING.lock().unwrap_or_else(|e| e.into_inner()).clear();
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

/// Builds `cargo` targets and returns the executables of those whose name is in `names`.
fn executables(args: &[&str], names: &[&str]) -> Result<Vec<(String, PathBuf)>, String> {
    let out = Command::new("cargo")
        .args(args)
        .args(["--message-format=json", "-q"])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("could not run cargo: {e}"))?;
    if !out.status.success() {
        // the JSON messages hid the compiler's errors: show them
        let _ = Command::new("cargo").args(args).status();
        return Err(format!(
            "cargo {} failed (its errors are above)",
            args.join(" ")
        ));
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(exe) = field(line, "\"executable\":\"") else {
            continue;
        };
        let Some(name) = field(line, "\"name\":\"") else {
            continue;
        };
        if names.contains(&name.as_str()) {
            found.push((name, PathBuf::from(exe)));
        }
    }
    Ok(found)
}

/// The string value after `key` in a JSON line (no escapes in the values read here).
fn field(line: &str, key: &str) -> Option<String> {
    let i = line.find(key)? + key.len();
    let j = line[i..].find('"')?;
    Some(line[i..i + j].to_string())
}

/// A libtest test run as one rank: the named test alone, its output shown.
fn libtest(bin: &Path, test: &str) -> Vec<String> {
    vec![
        bin.display().to_string(),
        test.into(),
        "--exact".into(),
        "--nocapture".into(),
        "--test-threads=1".into(),
        "-q".into(),
    ]
}

/// The scenarios: the project's multi-process tests with their ranks spread over the hosts.
fn scenarios(
    multiprocess: &Path,
    conformance: &Path,
    rpc: &[(String, PathBuf)],
    wine: &Path,
    fault_loop: &Path,
    rpc_fault_loop: &Path,
) -> Vec<Scenario> {
    let minutes = |m: u64| Duration::from_secs(60 * m);
    let mut v = vec![
        Scenario {
            name: "collectives, 2 hosts x 1 rank (world_size_2)".into(),
            hosts: 2,
            per_host: 1,
            program: libtest(multiprocess, "world_size_2"),
            deadline: minutes(3),
            is_libtest: true,
            start: Start::Flags,
            fault: None,
        },
        Scenario {
            name: "collectives, 3 hosts x 1 rank (world_size_3), tensorplay-run --rdzv-endpoint"
                .into(),
            hosts: 3,
            per_host: 1,
            program: libtest(multiprocess, "world_size_3"),
            deadline: minutes(3),
            is_libtest: true,
            start: Start::Endpoint,
            fault: None,
        },
        Scenario {
            name: "collectives, 2 hosts x 2 ranks (world_size_4_with_subgroups)".into(),
            hosts: 2,
            per_host: 2,
            program: libtest(multiprocess, "world_size_4_with_subgroups"),
            deadline: minutes(3),
            is_libtest: true,
            start: Start::Flags,
            fault: None,
        },
    ];
    // the functional collectives' conformance vectors (each rank judges its own records)
    for (test, hosts, per_host) in [
        ("functional_world_2", 2, 1),
        ("functional_subgroup_world_3", 3, 1),
        ("generated_world_3", 3, 1),
        ("generated_world_4", 2, 2),
    ] {
        v.push(Scenario {
            name: format!("conformance vectors {test}, {hosts} hosts x {per_host} rank(s)"),
            hosts,
            per_host,
            program: libtest(conformance, test),
            deadline: minutes(5),
            is_libtest: true,
            start: Start::Flags,
            fault: None,
        });
    }
    for (file, bin) in rpc {
        for (test, world) in list_tests(bin) {
            v.push(Scenario {
                name: format!("rpc {file}::{test}, {world} hosts x 1 worker"),
                hosts: world,
                per_host: 1,
                program: libtest(bin, &test),
                deadline: minutes(3),
                is_libtest: true,
                start: Start::Flags,
                fault: None,
            });
        }
    }
    // the main job on 2 hosts, under the launcher or started directly with `env`
    let wine_job = |name: &str, start: Start| Scenario {
        name: name.into(),
        hosts: 2,
        per_host: 1,
        program: vec![wine.display().to_string()],
        deadline: minutes(10),
        is_libtest: false,
        start,
        fault: None,
    };
    v.push(wine_job("wine_distributed, 2 hosts x 1 rank", Start::Flags));
    // as `srun ./wine_distributed` starts it: Slurm's variables only, MASTER_ADDR from the
    // node list (a hostname), MASTER_PORT from the job id
    let slurm: HostEnv = (0..2)
        .map(|h| {
            vec![
                ("SLURM_PROCID".to_string(), h.to_string()),
                ("SLURM_NTASKS".into(), "2".into()),
                ("SLURM_LOCALID".into(), "0".into()),
                ("SLURM_NNODES".into(), "2".into()),
                ("SLURM_NODEID".into(), h.to_string()),
                ("SLURM_JOB_NODELIST".into(), format!("{PREFIX}host[0-1]")),
                ("SLURM_JOB_ID".into(), "4242".into()),
            ]
        })
        .collect();
    v.push(wine_job(
        "wine_distributed under Slurm's variables (srun), 2 hosts x 1 rank",
        Start::Direct(slurm.clone()),
    ));
    // `srun --ntasks-per-node=1 tensorplay-run --nproc-per-node 2 ...`: the launcher takes
    // the node count, its node rank and the master from the same variables
    v.push(Scenario {
        name: "collectives, 2 hosts x 2 ranks (world_size_4_with_subgroups), srun --ntasks-per-node=1 tensorplay-run (Slurm's variables)".into(),
        hosts: 2,
        per_host: 2,
        program: libtest(multiprocess, "world_size_4_with_subgroups"),
        deadline: minutes(3),
        is_libtest: true,
        start: Start::LauncherUnder(slurm),
        fault: None,
    });
    // as `mpirun -x MASTER_ADDR ./wine_distributed` starts it
    let ompi: HostEnv = (0..2)
        .map(|h| {
            vec![
                ("OMPI_COMM_WORLD_RANK".to_string(), h.to_string()),
                ("OMPI_COMM_WORLD_SIZE".into(), "2".into()),
                ("OMPI_COMM_WORLD_LOCAL_RANK".into(), "0".into()),
                ("OMPI_COMM_WORLD_LOCAL_SIZE".into(), "1".into()),
                ("MASTER_ADDR".into(), format!("{SUBNET}.1")),
            ]
        })
        .collect();
    v.push(wine_job(
        "wine_distributed under Open MPI's variables (mpirun), 2 hosts x 1 rank",
        Start::Direct(ompi.clone()),
    ));
    v.push(Scenario {
        name: "collectives, 2 hosts x 1 rank (world_size_2), mpirun --npernode 1 -x MASTER_ADDR tensorplay-run (Open MPI's variables)".into(),
        hosts: 2,
        per_host: 1,
        program: libtest(multiprocess, "world_size_2"),
        deadline: minutes(3),
        is_libtest: true,
        start: Start::LauncherUnder(ompi),
        fault: None,
    });
    let faulty = |name: &str, job: &Path, hosts: usize, fault: Fault| Scenario {
        name: name.into(),
        hosts,
        per_host: 1,
        program: vec![
            job.display().to_string(),
            "--seconds".into(),
            "60".into(),
            "--timeout-secs".into(),
            "10".into(),
        ],
        deadline: minutes(2),
        is_libtest: false,
        start: Start::Flags,
        fault: Some(fault),
    };
    // the ring's timeouts cascade: the ranks beside the cut-off one give up first; the
    // failure reports (ops/failure_report.rs) let the others name the right rank
    v.push(faulty(
        "fault: host 1's link down in the middle of all_reduce, 3 hosts x 1 rank",
        fault_loop,
        3,
        Fault::LinkDown(1),
    ));
    v.push(faulty(
        "fault: host 1 partitioned by blackhole routes in the middle of all_reduce, 3 hosts x 1 rank",
        fault_loop,
        3,
        Fault::Blackhole(1),
    ));
    v.push(faulty(
        "fault: host 2's processes killed in the middle of all_reduce, 3 hosts x 1 rank",
        fault_loop,
        3,
        Fault::KillHost(2),
    ));
    v.push(faulty(
        "fault: host 1's link down in the middle of rpc_sync calls, 3 hosts x 1 worker",
        rpc_fault_loop,
        3,
        Fault::LinkDown(1),
    ));
    v.push(Scenario {
        name: "collectives under a 100 Mbit/s cap on every link, 3 hosts x 1 rank (world_size_3)"
            .into(),
        hosts: 3,
        per_host: 1,
        program: libtest(multiprocess, "world_size_3"),
        deadline: minutes(3),
        is_libtest: true,
        start: Start::Flags,
        fault: Some(Fault::Cap(100)),
    });
    v
}

/// The tests of a libtest binary named `world<N>_...` with N of 2 or 3 (one spawn each).
fn list_tests(bin: &Path) -> Vec<(String, usize)> {
    let out = Command::new(bin).args(["--list", "-q"]).output();
    let text = out
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    text.lines()
        .filter_map(|l| l.strip_suffix(": test"))
        .filter_map(|t| {
            let n = t.strip_prefix("world")?.split('_').next()?.parse().ok()?;
            (n == 2 || n == 3).then(|| (t.to_string(), n))
        })
        .collect()
}

/// `cargo xtask test-multihost`.
pub(crate) fn test_multihost(filter: Option<&str>) -> Result<(), String> {
    if !is_root() {
        return Err(
            "test-multihost needs root: it creates network, mount and UTS namespaces (run it as root, as CI does)"
                .into(),
        );
    }
    // Ctrl-C, SIGTERM or SIGHUP: the jobs' launchers get the signal too (they stop their
    // ranks); the hosts go with them
    let _ = ctrlc::set_handler(|| {
        let pids: Vec<u32> = RUNNING.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let kill = |sig: &str| {
            for p in &pids {
                let _ = Command::new("kill").args([sig, &p.to_string()]).status();
            }
        };
        // the launchers pass it on to their ranks and wait for them
        kill("-TERM");
        std::thread::sleep(Duration::from_secs(3));
        kill("-KILL");
        remove_all();
        eprintln!("test-multihost: interrupted; the simulated hosts were removed");
        std::process::exit(130);
    });
    // `--workspace`, as `cargo test --workspace` builds them: the same features, so nothing
    // is compiled twice in CI
    let tests = executables(
        &[
            "test",
            "--workspace",
            "--no-run",
            "--test",
            "multiprocess",
            "--test",
            "rpc",
            "--test",
            "rref",
            "--test",
            "dist_autograd",
            "--test",
            "vectors",
        ],
        &["multiprocess", "rpc", "rref", "dist_autograd", "vectors"],
    )?;
    let bins = executables(
        &[
            "build",
            "--workspace",
            "--bin",
            "tensorplay-run",
            "--example",
            "wine_distributed",
            "--example",
            "fault_loop",
            "--example",
            "rpc_fault_loop",
        ],
        &[
            "tensorplay-run",
            "wine_distributed",
            "fault_loop",
            "rpc_fault_loop",
        ],
    )?;
    let find = |list: &[(String, PathBuf)], name: &str| {
        list.iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| p.clone())
            .ok_or_else(|| format!("cargo did not report the harness's executable {name}"))
    };
    let launcher = &find(&bins, "tensorplay-run")?;
    let multiprocess = &find(&tests, "multiprocess")?;
    let conformance = &find(&tests, "vectors")?;
    let wine = &find(&bins, "wine_distributed")?;
    let fault_loop = &find(&bins, "fault_loop")?;
    let rpc_fault_loop = &find(&bins, "rpc_fault_loop")?;
    let rpc: Vec<(String, PathBuf)> = tests
        .iter()
        .filter(|(n, _)| ["rpc", "rref", "dist_autograd"].contains(&n.as_str()))
        .cloned()
        .collect();
    let mut all = scenarios(
        multiprocess,
        conformance,
        &rpc,
        wine,
        fault_loop,
        rpc_fault_loop,
    );
    if let Some(f) = filter {
        all.retain(|s| s.name.contains(f));
    }
    let (mut passed, mut failed) = (0, 0);
    for s in &all {
        let t0 = Instant::now();
        let r = Hosts::create(s.hosts).and_then(|hosts| run_scenario(&hosts, launcher, s));
        match r {
            Ok((ms, lines))
                if matches!(
                    s.fault,
                    Some(Fault::LinkDown(_) | Fault::KillHost(_) | Fault::Blackhole(_))
                ) =>
            {
                passed += 1;
                println!(
                    "ok     {} ({:.1} s; every launcher failed {:.1} s after the fault, the lost rank named)",
                    s.name,
                    t0.elapsed().as_secs_f64(),
                    ms.first().copied().unwrap_or(0) as f64 / 1000.0
                );
                for l in lines {
                    println!("         {l}");
                }
            }
            Ok((sent, _)) => {
                passed += 1;
                let kib: Vec<String> = sent.iter().map(|b| format!("{}", b / 1024)).collect();
                println!(
                    "ok     {} ({:.1} s; KiB sent across by each host: {})",
                    s.name,
                    t0.elapsed().as_secs_f64(),
                    kib.join(", ")
                );
            }
            Err(e) => {
                failed += 1;
                println!(
                    "FAILED {} ({:.1} s)\n{e}",
                    s.name,
                    t0.elapsed().as_secs_f64()
                );
            }
        }
    }
    remove_all();
    let left = ours();
    if !left.is_empty() {
        println!("error: namespaces left behind: {left:?}");
        failed += 1;
    }
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        return Err(format!("{failed} multi-host scenario(s) failed"));
    }
    Ok(())
}
