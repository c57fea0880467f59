//! The scenarios `cargo xtask test-multihost` runs, and the executables they need.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::hosts::{Fault, PREFIX, SUBNET};
use super::run::{HostEnv, Scenario, Start};

/// Builds `cargo` targets and returns the executables of those whose name is in `names`.
pub(crate) fn executables(args: &[&str], names: &[&str]) -> Result<Vec<(String, PathBuf)>, String> {
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
        // a target is asked for by its name, or as `PACKAGE:NAME` where several packages
        // have a target of that name (each crate's integration tests are its target `it`)
        let package = field(line, "\"package_id\":\"")
            .and_then(|id| Some(id.rsplit('/').next()?.split('#').next()?.to_string()))
            .unwrap_or_default();
        let qualified = format!("{package}:{name}");
        if names.contains(&qualified.as_str()) {
            found.push((qualified, PathBuf::from(exe)));
        } else if names.contains(&name.as_str()) {
            found.push((name, PathBuf::from(exe)));
        }
    }
    Ok(found)
}

/// The path of executable `name` among those [`executables`] found.
pub(crate) fn find(list: &[(String, PathBuf)], name: &str) -> Result<PathBuf, String> {
    list.iter()
        .find(|(n, _)| n == name)
        .map(|(_, p)| p.clone())
        .ok_or_else(|| format!("cargo did not report the executable {name}"))
}

/// The string value after `key` in a JSON line (no escapes in the values read here).
pub(crate) fn field(line: &str, key: &str) -> Option<String> {
    let i = line.find(key)? + key.len();
    let j = line[i..].find('"')?;
    Some(line[i..i + j].to_string())
}

/// A libtest test run as one rank: the named test alone, its output shown.
pub(crate) fn libtest(bin: &Path, test: &str) -> Vec<String> {
    vec![
        bin.display().to_string(),
        test.into(),
        "--exact".into(),
        "--nocapture".into(),
        "--test-threads=1".into(),
        "-q".into(),
    ]
}

/// The modules of `tensorplay-rpc`'s test binary whose worlds run spread over the hosts.
const RPC_MODULES: [&str; 3] = ["rpc", "rref", "dist_autograd"];

/// The scenarios: the project's multi-process tests with their ranks spread over the hosts.
pub(crate) fn scenarios(
    multiprocess: &Path,
    conformance: &Path,
    rpc: &Path,
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
    for module in RPC_MODULES {
        for (test, world) in list_tests(rpc, module) {
            v.push(Scenario {
                name: format!("rpc {test}, {world} hosts x 1 worker"),
                hosts: world,
                per_host: 1,
                program: libtest(rpc, &test),
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

/// The tests of a libtest binary in module `module` (`module::world<N>_...`) with N of 2 or 3
/// (one spawn each).
pub(crate) fn list_tests(bin: &Path, module: &str) -> Vec<(String, usize)> {
    let out = Command::new(bin).args(["--list", "-q"]).output();
    let text = out
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    text.lines()
        .filter_map(|l| l.strip_suffix(": test"))
        .filter_map(|t| {
            let test = t.strip_prefix(module)?.strip_prefix("::")?;
            let n = test
                .strip_prefix("world")?
                .split('_')
                .next()?
                .parse()
                .ok()?;
            (n == 2 || n == 3).then(|| (t.to_string(), n))
        })
        .collect()
}
