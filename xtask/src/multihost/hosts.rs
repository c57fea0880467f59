//! The simulated hosts: namespaces, links, the fault injector.

use std::path::PathBuf;
use std::process::Command;

/// The prefix of every namespace this harness makes.
pub(crate) const PREFIX: &str = "tpmh-";

/// The switch's namespace (the bridge).
pub(crate) const SWITCH: &str = "tpmh-switch";

/// The test subnet: host `h` is `10.0.0.{h+1}/24`, inside its namespace only (host 0 is the
/// README's `--master-addr 10.0.0.1`).
pub(crate) const SUBNET: &str = "10.0.0";

/// Runs `ip` with `args`; an error with its output when it fails.
pub(crate) fn ip(args: &[&str]) -> Result<(), String> {
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
pub(crate) fn ours() -> Vec<String> {
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
pub(crate) fn remove_all() {
    for ns in ours() {
        let _ = ip(&["netns", "del", &ns]);
    }
}

/// Whether this process runs as root.
pub(crate) fn is_root() -> bool {
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
    pub(crate) fn inject(&self, f: Fault) -> Result<(), String> {
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
