//! This node's place in the job: the number of nodes, this node's rank, and the rendezvous
//! endpoint (the store on the master node), from the flags, else from the scheduler that
//! started the launcher (one launcher per node):
//!
//! | | flags | Slurm (`srun --ntasks-per-node=1 tensorplay-run ...`) | Open MPI (`mpirun --npernode 1 tensorplay-run ...`) |
//! |---|---|---|---|
//! | nodes | `--nnodes` | `SLURM_NNODES` | `OMPI_COMM_WORLD_SIZE` |
//! | node rank | `--node-rank` | `SLURM_NODEID` | `OMPI_COMM_WORLD_RANK` |
//! | master address | `--master-addr`, `--rdzv-endpoint HOST[:PORT]` | `MASTER_ADDR`, else the first host of `SLURM_JOB_NODELIST` | `MASTER_ADDR` (required with several nodes) |
//! | master port | `--master-port`, `--rdzv-endpoint`'s port (29400 when absent, as torchrun) | `MASTER_PORT`, else `20000 + SLURM_JOB_ID % 20000` | `MASTER_PORT`, else 29500 |
//!
//! Slurm counts only in a task of `srun` (`SLURM_PROCID` set): in an `salloc` shell the
//! launcher is a one-node job unless its flags say otherwise. A flag always wins. The scheduler must start one launcher per node: several tasks per
//! node would each start `--nproc-per-node` processes, so that is refused with what to run
//! instead (or start the program itself with `srun`/`mpirun`: it reads the same variables).

use tensorplay_collectives::launch_env;

/// The flags that place this node (all optional: `None` when not given).
#[derive(Debug, Default, Clone)]
pub(crate) struct Flags {
    pub(crate) nnodes: Option<usize>,
    pub(crate) node_rank: Option<usize>,
    pub(crate) master_addr: Option<String>,
    pub(crate) master_port: Option<u16>,
    pub(crate) rdzv_endpoint: Option<String>,
}

/// This node's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Node {
    pub(crate) nnodes: usize,
    pub(crate) node_rank: usize,
    pub(crate) master_addr: String,
    /// `None`: pick a free port (one node only).
    pub(crate) master_port: Option<u16>,
    /// Which scheduler the values came from, for the launcher's first line (`None`: flags
    /// and defaults only).
    pub(crate) scheduler: Option<String>,
    /// A remark for the launcher's first line (an `salloc` shell taken for one node).
    pub(crate) note: Option<String>,
}

/// `--nnodes` as given: a number of nodes, or an elastic range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nodes {
    /// `N`: a fixed number of nodes, each launcher with its node rank.
    Fixed(usize),
    /// `MIN:MAX`: rounds of MIN to MAX nodes, numbered by the launchers' rendezvous.
    Elastic {
        /// The fewest nodes a round may start with.
        min: usize,
        /// The most nodes a round may have.
        max: usize,
    },
}

/// Parses `--nnodes`: `N` or `MIN:MAX` with `1 <= MIN <= MAX` (`N` = 0 is refused later,
/// with the scheduler's values).
pub(crate) fn parse_nnodes(s: &str) -> Result<Nodes, String> {
    let expected = "expected N or MIN:MAX with 1 <= MIN <= MAX (for example 2 or 1:4)";
    let num = |p: &str| p.trim().parse::<usize>().ok();
    let Some((lo, hi)) = s.split_once(':') else {
        return num(s)
            .map(Nodes::Fixed)
            .ok_or_else(|| format!("--nnodes {s:?}: {expected}"));
    };
    let (Some(min), Some(max)) = (num(lo), num(hi)) else {
        return Err(format!("--nnodes {s:?}: {expected}"));
    };
    if min == 0 {
        return Err(format!(
            "--nnodes {s:?}: MIN must be at least 1; {expected}"
        ));
    }
    if min > max {
        return Err(format!(
            "--nnodes {s:?}: MIN ({min}) is larger than MAX ({max}); {expected}"
        ));
    }
    Ok(Nodes::Elastic { min, max })
}

/// `HOST[:PORT]` as torchrun's `--rdzv-endpoint` takes it (IPv6 in brackets:
/// `[fd00::1]:29500`); the port defaults to 29400.
pub(crate) fn parse_endpoint(s: &str) -> Result<(String, u16), String> {
    let bad = || {
        format!(
            "--rdzv-endpoint: expected HOST[:PORT] (for example 10.0.0.1:29500 or [fd00::1]:29500), got {s:?}"
        )
    };
    let s = s.trim();
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest.split_once(']').ok_or_else(bad)?;
        match after {
            "" => (h, None),
            p => (h, Some(p.strip_prefix(':').ok_or_else(bad)?)),
        }
    } else {
        match s.rsplit_once(':') {
            Some((h, _)) if h.contains(':') => (s, None), // a bare IPv6 address
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    if host.is_empty() {
        return Err(bad());
    }
    let port = match port {
        None => 29400,
        Some(p) => p.parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(bad)?,
    };
    Ok((host.to_string(), port))
}

fn number(get: &dyn Fn(&str) -> Option<String>, var: &str) -> Result<Option<usize>, String> {
    match get(var) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| format!("{var}={v:?} is not a whole number")),
    }
}

/// Places this node from `flags` and the environment `get` (see the module's docs).
pub(crate) fn resolve(flags: &Flags, get: &dyn Fn(&str) -> Option<String>) -> Result<Node, String> {
    let mut master_addr = flags.master_addr.clone();
    let mut master_port = flags.master_port;
    if let Some(ep) = &flags.rdzv_endpoint {
        if flags.master_addr.is_some() || flags.master_port.is_some() {
            return Err(
                "--rdzv-endpoint names the master's address and port: give it or --master-addr/--master-port, not both"
                    .into(),
            );
        }
        let (h, p) = parse_endpoint(ep)?;
        master_addr = Some(h);
        master_port = Some(p);
    }
    // which scheduler started this launcher, if any: (name, nodes, node rank, tasks per node)
    // a task of `srun` has SLURM_PROCID; an `salloc` shell has SLURM_NNODES without it (a
    // launcher started there by hand is a one-node job unless its flags say otherwise)
    let slurm = match get("SLURM_PROCID") {
        Some(_) => number(get, "SLURM_NNODES")?,
        None => None,
    };
    let ompi = number(get, "OMPI_COMM_WORLD_SIZE")?;
    let (scheduler, nodes, rank) = if let Some(nn) = slurm {
        let ntasks = number(get, "SLURM_NTASKS")?;
        if let Some(nt) = ntasks
            && nt != nn
            && (flags.nnodes.is_none() || flags.node_rank.is_none())
        {
            return Err(format!(
                "under Slurm, start one tensorplay-run per node (`srun --ntasks-per-node=1 tensorplay-run --nproc-per-node N ...`): SLURM_NTASKS={nt} tasks on SLURM_NNODES={nn} nodes; or start the program itself with srun (`srun ./train`: it reads SLURM_PROCID and SLURM_NTASKS)"
            ));
        }
        let rank = number(get, "SLURM_NODEID")?;
        if rank.is_none() && flags.node_rank.is_none() && nn > 1 {
            return Err(
                "under Slurm with several nodes SLURM_NODEID must be set (or pass --node-rank)"
                    .into(),
            );
        }
        (Some("Slurm"), Some(nn), rank)
    } else if let Some(size) = ompi {
        let local = number(get, "OMPI_COMM_WORLD_LOCAL_SIZE")?;
        if local.is_some_and(|l| l != 1) && (flags.nnodes.is_none() || flags.node_rank.is_none()) {
            return Err(format!(
                "under Open MPI, start one tensorplay-run per node (`mpirun --npernode 1 -x MASTER_ADDR tensorplay-run --nproc-per-node N ...`): OMPI_COMM_WORLD_LOCAL_SIZE={} launchers on this node; or start the program itself with mpirun (it reads OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE)",
                local.unwrap_or(0)
            ));
        }
        let rank = number(get, "OMPI_COMM_WORLD_RANK")?;
        if rank.is_none() && flags.node_rank.is_none() && size > 1 {
            return Err("under Open MPI with several launchers OMPI_COMM_WORLD_RANK must be set (or pass --node-rank)".into());
        }
        (Some("Open MPI"), Some(size), rank)
    } else {
        (None, None, None)
    };
    let nnodes = flags.nnodes.or(nodes).unwrap_or(1);
    let node_rank = flags.node_rank.or(rank).unwrap_or(0);
    if scheduler.is_some() {
        if master_addr.is_none() {
            master_addr = launch_env::lookup("MASTER_ADDR", get).map(|f| f.value);
        }
        if master_port.is_none() {
            master_port = launch_env::lookup("MASTER_PORT", get)
                .map(|f| {
                    f.value
                        .trim()
                        .parse::<u16>()
                        .map_err(|_| format!("{}={:?} is not a port", f.from, f.value))
                })
                .transpose()?;
        }
    }
    if nnodes == 0 {
        return Err("--nnodes (or SLURM_NNODES / OMPI_COMM_WORLD_SIZE) must be at least 1".into());
    }
    if master_addr.as_deref().is_some_and(|a| a.trim().is_empty()) {
        return Err(
            "the master's address is empty (--master-addr, --rdzv-endpoint or MASTER_ADDR): expected a host name or IP address"
                .into(),
        );
    }
    if node_rank >= nnodes {
        return Err(format!(
            "--node-rank {node_rank} is outside 0..{nnodes} (--nnodes){}",
            scheduler.map_or(String::new(), |s| format!(
                " (node rank and count from {s})"
            ))
        ));
    }
    if master_addr.is_none() && nnodes > 1 {
        // under a scheduler, MASTER_ADDR (or Slurm's node list) was looked up already
        let env = scheduler.map_or(String::new(), |s| {
            format!(", or set MASTER_ADDR (under {s})")
        });
        return Err(format!(
            "several nodes need the master's address: pass --master-addr HOST (with --master-port) or --rdzv-endpoint HOST:PORT{env}; 127.0.0.1 would reach only this node"
        ));
    }
    let note = (scheduler.is_none()
        && flags.nnodes.is_none()
        && get("SLURM_NNODES").is_some_and(|n| n.trim() != "1"))
    .then(|| {
        "SLURM_NNODES is set but this is not a task of srun (no SLURM_PROCID): a one-node job; for several nodes run `srun --ntasks-per-node=1 tensorplay-run ...`".to_string()
    });
    Ok(Node {
        nnodes,
        node_rank,
        master_addr: master_addr.unwrap_or_else(|| "127.0.0.1".into()),
        master_port,
        scheduler: scheduler.map(str::to_string),
        note,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn nnodes_specs_parse_or_are_refused() {
        assert_eq!(parse_nnodes("2"), Ok(Nodes::Fixed(2)));
        assert_eq!(parse_nnodes("1:4"), Ok(Nodes::Elastic { min: 1, max: 4 }));
        assert_eq!(parse_nnodes("2:2"), Ok(Nodes::Elastic { min: 2, max: 2 }));
        for (bad, why) in [
            ("3:2", "larger than MAX"),
            ("0:2", "at least 1"),
            ("a:b", "MIN:MAX"),
            ("1:", "MIN:MAX"),
            (":2", "MIN:MAX"),
            ("1:2:3", "MIN:MAX"),
            ("x", "MIN:MAX"),
            ("-1", "MIN:MAX"),
        ] {
            let e = parse_nnodes(bad).unwrap_err();
            assert!(e.starts_with("--nnodes") && e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn endpoints_parse_as_torchrun_spells_them() {
        let ok = |s: &str| parse_endpoint(s).unwrap();
        assert_eq!(ok("10.0.0.1:29500"), ("10.0.0.1".into(), 29500));
        assert_eq!(ok("node01"), ("node01".into(), 29400));
        assert_eq!(ok("[fd00::1]:1234"), ("fd00::1".into(), 1234));
        assert_eq!(ok("[fd00::1]"), ("fd00::1".into(), 29400));
        assert_eq!(ok("fd00::1"), ("fd00::1".into(), 29400));
        for bad in [
            "",
            ":29500",
            "host:",
            "host:0",
            "host:70000",
            "host:x",
            "[fd00::1",
            "[a]x",
        ] {
            let e = parse_endpoint(bad).unwrap_err();
            assert!(e.contains("HOST[:PORT]"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn flags_alone_and_flags_over_the_scheduler() {
        let none = env(&[]);
        let n = resolve(&Flags::default(), &none).unwrap();
        assert_eq!(
            (n.nnodes, n.node_rank, n.master_addr.as_str()),
            (1, 0, "127.0.0.1")
        );
        assert_eq!((n.master_port, n.scheduler), (None, None));
        let flags = Flags {
            nnodes: Some(3),
            node_rank: Some(2),
            rdzv_endpoint: Some("10.1.1.1:2222".into()),
            ..Flags::default()
        };
        let slurm = env(&[
            ("SLURM_NNODES", "4"),
            ("SLURM_NODEID", "1"),
            ("SLURM_JOB_ID", "7"),
        ]);
        let n = resolve(&flags, &slurm).unwrap();
        assert_eq!((n.nnodes, n.node_rank), (3, 2));
        assert_eq!(
            (n.master_addr.as_str(), n.master_port),
            ("10.1.1.1", Some(2222))
        );
        let both = Flags {
            master_addr: Some("a".into()),
            rdzv_endpoint: Some("b:1".into()),
            ..Flags::default()
        };
        assert!(resolve(&both, &none).unwrap_err().contains("not both"));
    }

    #[test]
    fn slurm_places_one_launcher_per_node() {
        let vars = env(&[
            ("SLURM_NNODES", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
            ("SLURM_JOB_ID", "123456"),
        ]);
        let n = resolve(&Flags::default(), &vars).unwrap();
        assert_eq!(
            n,
            Node {
                nnodes: 2,
                node_rank: 1,
                master_addr: "gpu07".into(),
                master_port: Some(23456), // 20000 + 123456 % 20000
                scheduler: Some("Slurm".into()),
                note: None,
            }
        );
        // MASTER_ADDR/MASTER_PORT exported in the batch script win over the derived ones
        let vars = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NNODES", "2"),
            ("SLURM_NODEID", "0"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
            ("MASTER_ADDR", "10.9.9.9"),
            ("MASTER_PORT", "29501"),
        ]);
        let n = resolve(&Flags::default(), &vars).unwrap();
        assert_eq!(
            (n.master_addr.as_str(), n.master_port),
            ("10.9.9.9", Some(29501))
        );
        // eight tasks on two nodes: each would start --nproc-per-node processes
        let vars = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NNODES", "2"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_NODEID", "0"),
        ]);
        let e = resolve(&Flags::default(), &vars).unwrap_err();
        assert!(
            e.contains("--ntasks-per-node=1") && e.contains("SLURM_NTASKS=8"),
            "{e}"
        );
        let vars = env(&[("SLURM_PROCID", "0"), ("SLURM_NNODES", "two")]);
        let e = resolve(&Flags::default(), &vars).unwrap_err();
        assert!(e.contains("SLURM_NNODES"), "{e}");
        // an salloc shell (no task of srun): a one-node job
        let vars = env(&[("SLURM_NNODES", "2"), ("SLURM_JOB_NODELIST", "gpu[07-08]")]);
        let n = resolve(&Flags::default(), &vars).unwrap();
        assert_eq!((n.nnodes, n.master_addr.as_str()), (1, "127.0.0.1"));
        assert_eq!(n.scheduler, None);
        assert!(n.note.is_some_and(|t| t.contains("not a task of srun")));
    }

    #[test]
    fn missing_or_empty_values_are_named() {
        let vars = env(&[("OMPI_COMM_WORLD_SIZE", "2"), ("MASTER_ADDR", "10.0.0.1")]);
        let e = resolve(&Flags::default(), &vars).unwrap_err();
        assert!(e.contains("OMPI_COMM_WORLD_RANK"), "{e}");
        let vars = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NNODES", "2"),
            ("MASTER_ADDR", "x"),
        ]);
        let e = resolve(&Flags::default(), &vars).unwrap_err();
        assert!(e.contains("SLURM_NODEID"), "{e}");
        let vars = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NNODES", "2"),
            ("SLURM_NODEID", "0"),
            ("MASTER_ADDR", " "),
        ]);
        let e = resolve(&Flags::default(), &vars).unwrap_err();
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let flags = Flags {
            nnodes: Some(0),
            ..Flags::default()
        };
        let e = resolve(&flags, &env(&[])).unwrap_err();
        assert!(e.contains("at least 1"), "{e}");
    }

    #[test]
    fn several_nodes_without_a_master_address_are_refused() {
        let flags = Flags {
            nnodes: Some(2),
            node_rank: Some(1),
            master_port: Some(29500),
            ..Flags::default()
        };
        let e = resolve(&flags, &env(&[])).unwrap_err();
        assert!(
            e.contains("--master-addr") && e.contains("--rdzv-endpoint"),
            "{e}"
        );
        let flags = Flags {
            master_addr: Some("10.0.0.1".into()),
            ..flags
        };
        assert_eq!(resolve(&flags, &env(&[])).unwrap().master_addr, "10.0.0.1");
    }

    #[test]
    fn open_mpi_places_one_launcher_per_node_and_needs_the_master() {
        let vars = env(&[
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
        ]);
        let n = resolve(&Flags::default(), &vars).unwrap();
        assert_eq!((n.nnodes, n.node_rank), (2, 1));
        assert_eq!(
            (n.master_addr.as_str(), n.master_port),
            ("10.0.0.1", Some(29500))
        );
        assert_eq!(n.scheduler.as_deref(), Some("Open MPI"));
        let vars = env(&[
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
        ]);
        let e = resolve(&Flags::default(), &vars).unwrap_err();
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let vars = env(&[
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ]);
        let e = resolve(&Flags::default(), &vars).unwrap_err();
        assert!(e.contains("--npernode 1"), "{e}");
    }
}
