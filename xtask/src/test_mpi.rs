//! `cargo xtask test-mpi`: the `"mpi"` backend under `mpirun`. Installs the system's MPI when
//! it is missing (Debian's Open MPI, with the headers and libclang the bindings need; needs
//! root, as CI runs), builds `tensorplay-mpi` with its feature `mpi`, runs its test binary as a
//! singleton and under `mpirun -np 2`, `3` and `4` (`--test-threads=1`: every rank runs the
//! same tests in the same order), then the faults: a rank past a collective's timeout (the
//! error, and the job ends), a receive past it (the watchdog's report and exit code 124) and a
//! rank killed (the job ends, never hangs). Ends with `N passed, M failed`.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The packages the backend builds and runs with (Debian's names).
const PACKAGES: &[&str] = &["libopenmpi-dev", "openmpi-bin", "libclang-dev"];

/// What `mpirun` needs here: root (CI runs as root), more ranks than cores, and no
/// cross-memory attach (containers forbid it).
const MPI_ENV: &[(&str, &str)] = &[
    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
    ("OMPI_MCA_btl_vader_single_copy_mechanism", "none"),
    ("OMPI_MCA_rmaps_base_oversubscribe", "1"),
];

/// The watchdog's exit code (`tensorplay_mpi::TIMEOUT_EXIT_CODE`).
const TIMEOUT_EXIT_CODE: i32 = 124;

/// How long one `mpirun` may take before it counts as a hang.
const JOB_LIMIT: Duration = Duration::from_secs(300);

/// Whether `pkg` is installed (a removed package whose configuration files remain is not).
fn installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success() && o.stdout == b"install ok installed")
}

/// Installs what is missing of [`PACKAGES`] (quiet; `apt-get update` once if the first try
/// fails).
fn install() -> Result<(), String> {
    let missing: Vec<&str> = PACKAGES.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("test-mpi: installing {}", missing.join(" "));
    let apt = |args: &[&str]| {
        Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
    args.extend(&missing);
    if apt(&args) || (apt(&["update", "-q"]) && apt(&args)) {
        Ok(())
    } else {
        Err(format!(
            "could not install {} (apt-get as root): install them and run again",
            missing.join(" ")
        ))
    }
}

/// Builds the MPI test binary and the faults example; returns their paths.
fn build() -> Result<(PathBuf, PathBuf), String> {
    let args = [
        "test",
        "-p",
        "tensorplay-mpi",
        "--features",
        "mpi",
        "--no-run",
        "--message-format=json",
        "-q",
    ];
    let out = Command::new("cargo")
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("could not run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo {} failed (its errors are above)",
            args.join(" ")
        ));
    }
    let json = String::from_utf8_lossy(&out.stdout);
    let test = json
        .lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\""))
        .filter(|l| l.contains("\"name\":\"mpi\"") && l.contains("\"test\":true"))
        .find_map(executable)
        .ok_or("cargo built no `mpi` test binary of tensorplay-mpi")?;
    let ex = [
        "build",
        "-p",
        "tensorplay-mpi",
        "--features",
        "mpi",
        "--example",
        "mpi_faults",
        "--message-format=json",
        "-q",
    ];
    let out = Command::new("cargo")
        .args(ex)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("could not run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo {} failed (its errors are above)",
            ex.join(" ")
        ));
    }
    let faults = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| executable(l).filter(|p| p.ends_with("mpi_faults")))
        .ok_or("cargo built no mpi_faults example")?;
    Ok((test, faults))
}

fn executable(line: &str) -> Option<PathBuf> {
    let key = "\"executable\":\"";
    let i = line.find(key)? + key.len();
    let j = line[i..].find('"')?;
    Some(PathBuf::from(&line[i..i + j]))
}

/// A finished job: its exit code (None: killed at [`JOB_LIMIT`]), its output and time.
struct Job {
    code: Option<i32>,
    output: String,
    took: Duration,
}

/// Runs `mpirun -np n exe args` (or `exe args` alone when `n` is 0), at most [`JOB_LIMIT`].
fn mpirun(n: usize, exe: &PathBuf, args: &[&str]) -> Result<Job, String> {
    let mut c = if n == 0 {
        Command::new(exe)
    } else {
        let mut c = Command::new("mpirun");
        c.args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &n.to_string(),
        ])
        .arg(exe);
        c
    };
    c.args(args).envs(MPI_ENV.iter().copied());
    let start = Instant::now();
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start {c:?}: {e}"))?;
    // read both pipes on threads so the child never blocks on a full pipe
    let mut so = child.stdout.take().ok_or("no stdout")?;
    let mut se = child.stderr.take().ok_or("no stderr")?;
    let ro = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut so, &mut s);
        s
    });
    let re = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut se, &mut s);
        s
    });
    let code = loop {
        if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
            break st.code();
        }
        if start.elapsed() > JOB_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = format!(
        "{}{}",
        ro.join().unwrap_or_default(),
        re.join().unwrap_or_default()
    );
    Ok(Job {
        code,
        output,
        took: start.elapsed(),
    })
}

/// One scenario's verdict: `Err` says what was wrong, with the job's output.
fn scenario(
    name: &str,
    n: usize,
    exe: &PathBuf,
    args: &[&str],
    judge: impl Fn(&Job) -> Result<(), String>,
) -> bool {
    match mpirun(n, exe, args).and_then(|job| {
        judge(&job).map_err(|why| format!("{why}\n--- output ---\n{}", job.output))?;
        Ok(job.took)
    }) {
        Ok(took) => {
            eprintln!("test-mpi: {name}: passed ({:.1} s)", took.as_secs_f64());
            true
        }
        Err(e) => {
            eprintln!("test-mpi: {name}: FAILED: {e}");
            false
        }
    }
}

/// Every rank's libtest summary says `ok`, and there are `ranks` of them. The ranks' output
/// interleaves, even within a line, so only the summaries' words are counted.
fn all_ranks_passed(job: &Job, ranks: usize) -> Result<(), String> {
    if job.code != Some(0) {
        return Err(format!("exit code {:?}", job.code));
    }
    let results: Vec<&str> = job
        .output
        .match_indices("test result: ")
        .map(|(i, _)| job.output[i..].lines().next().unwrap_or(""))
        .collect();
    let ok = results
        .iter()
        .filter(|l| l.starts_with("test result: ok.") && !l.contains(" 0 passed;"))
        .count();
    if ok != ranks || results.len() != ranks {
        return Err(format!(
            "{ok} of {ranks} ranks passed their tests ({} summaries)",
            results.len()
        ));
    }
    Ok(())
}

/// Runs the command.
pub(crate) fn test_mpi() -> Result<(), String> {
    install()?;
    let (tests, faults) = build()?;
    let mut passed = 0;
    let mut failed = 0;
    let mut count = |ok: bool| {
        if ok { passed += 1 } else { failed += 1 }
    };
    let lib_args = ["--test-threads=1", "--color", "never"];
    count(scenario(
        "singleton (no mpirun)",
        0,
        &tests,
        &lib_args,
        |j| all_ranks_passed(j, 1),
    ));
    for n in [2, 3, 4] {
        count(scenario(&format!("world {n}"), n, &tests, &lib_args, |j| {
            all_ranks_passed(j, n)
        }));
    }
    count(scenario(
        "a rank past a collective's timeout",
        2,
        &faults,
        &["timeout"],
        |j| {
            // rank 0's error at 3 s; the job ended long before rank 1's 30 s sleep
            match j.code {
                None | Some(0) => return Err(format!("exit code {:?}", j.code)),
                _ if j.took > Duration::from_secs(20) => {
                    return Err(format!("the job took {:?}", j.took));
                }
                _ => {}
            }
            for want in [
                "timed out after 3s on rank 0",
                "rank 1 never reached this call",
            ] {
                if !j.output.contains(want) {
                    return Err(format!("the output lacks {want:?}"));
                }
            }
            Ok(())
        },
    ));
    count(scenario(
        "a receive past the timeout",
        2,
        &faults,
        &["recv-timeout"],
        |j| {
            if j.code != Some(TIMEOUT_EXIT_CODE) {
                return Err(format!("exit code {:?}, want 124", j.code));
            }
            if j.took > Duration::from_secs(20) {
                return Err(format!("the job took {:?}", j.took));
            }
            for want in [
                "recv on rank 0",
                "ran for more than its timeout",
                "MPI_Abort",
            ] {
                if !j.output.contains(want) {
                    return Err(format!("the report lacks {want:?}"));
                }
            }
            Ok(())
        },
    ));
    count(scenario(
        "a rank killed",
        3,
        &faults,
        &["killed"],
        |j| match j.code {
            None => Err("the job hung".into()),
            Some(0) => Err("the job succeeded".into()),
            Some(_) if j.output.contains("finished (unexpected)") => Err("a rank finished".into()),
            Some(_) => Ok(()),
        },
    ));
    eprintln!("test-mpi: {passed} passed, {failed} failed");
    if failed > 0 {
        return Err(format!("{failed} MPI scenario(s) failed"));
    }
    Ok(())
}
