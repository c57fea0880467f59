//! How a main job's process joins its job: under a launcher (`tensorplay-run`, torchrun's,
//! Slurm's or Open MPI's variables) it takes its rank from the environment; started by hand it
//! is rank 0 and starts the other ranks as processes of itself.

use std::process::{Child, Command, Stdio};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// This process's `(rank, init method, the children rank 0 started)` in a job of exactly
/// `world` processes.
///
/// Errors: `RANK` or `WORLD_SIZE` that is not a number, a `WORLD_SIZE` other than `world`, a
/// `RANK` outside `0..world`, or a child that cannot be started.
pub(crate) fn launch(world: usize) -> Res<(usize, String, Vec<Child>)> {
    let var = |n: &str| tensorplay::distributed::launch_env::lookup_env(n).map(|f| f.value);
    match (var("RANK"), var("WORLD_SIZE")) {
        (Some(r), Some(w)) => {
            let rank: usize = r.parse().map_err(|e| format!("bad RANK {r:?}: {e}"))?;
            let size: usize = w
                .parse()
                .map_err(|e| format!("bad WORLD_SIZE {w:?}: {e}"))?;
            if size != world {
                return Err(format!(
                    "this job runs on exactly {world} processes, WORLD_SIZE is {size}"
                )
                .into());
            }
            if rank >= world {
                return Err(format!("RANK is {rank}, expected 0 to {}", world - 1).into());
            }
            Ok((rank, "env://".into(), Vec::new()))
        }
        _ => {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let exe = std::env::current_exe()?;
            let mut children = Vec::new();
            for rank in 1..world {
                let child = Command::new(&exe)
                    .args(std::env::args().skip(1))
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", world.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .spawn();
                match child {
                    Ok(c) => children.push(c),
                    Err(e) => {
                        stop(children);
                        return Err(format!("starting rank {rank}: {e}").into());
                    }
                }
            }
            Ok((0, format!("tcp://127.0.0.1:{port}"), children))
        }
    }
}

/// Waits for the children rank 0 started and returns `result`, or, when `result` is fine but a
/// child failed, an error naming that child's rank.
pub(crate) fn join<T>(children: Vec<Child>, result: Res<T>) -> Res<T> {
    let mut failed = None;
    for (i, mut c) in children.into_iter().enumerate() {
        let status = c.wait()?;
        if !status.success() && failed.is_none() {
            failed = Some(format!("rank {} failed: {status}", i + 1));
        }
    }
    match (result, failed) {
        (Ok(_), Some(f)) => Err(f.into()),
        (r, _) => r,
    }
}

fn stop(children: Vec<Child>) {
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
}
