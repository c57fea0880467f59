//! Helpers shared by the multi-process tests: options, a barrier made of RPCs, polling.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tensorplay_rpc as rpc;

/// The error type of a spawned worker.
pub(crate) type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Options with a default timeout of `timeout_s` seconds and `threads` transport threads.
pub(crate) fn opts(timeout_s: u64, threads: usize) -> rpc::RpcBackendOptions {
    rpc::RpcBackendOptions {
        rpc_timeout: Duration::from_secs(timeout_s),
        num_worker_threads: threads,
        ..Default::default()
    }
}

/// `init_rpc` as `worker{rank}` with a 30 s default timeout.
pub(crate) fn init(rank: usize, world: usize) -> rpc::Result<()> {
    rpc::init_rpc(&format!("worker{rank}"), rank, world, opts(30, 4))
}

static ARRIVED: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);

/// Registers the functions of [`barrier`] (call in every worker before `init_rpc`).
pub(crate) fn register_common() {
    rpc::register("test_barrier_arrive", |tag: String| {
        let mut g = ARRIVED.lock().unwrap();
        *g.get_or_insert_with(HashMap::new).entry(tag).or_insert(0) += 1;
        Ok(())
    });
    rpc::register("test_barrier_count", |tag: String| {
        let g = ARRIVED.lock().unwrap();
        Ok(g.as_ref().and_then(|m| m.get(&tag).copied()).unwrap_or(0))
    });
    rpc::register("test_debug_info", |(): ()| {
        let i = rpc::debug_info()?;
        Ok((
            i.num_owner_rrefs,
            i.num_forks,
            i.num_pending_users,
            i.num_pending_children,
        ))
    });
}

/// Waits until every worker of the group reached the barrier `tag` (counted on worker 0).
pub(crate) fn barrier(tag: &str) -> rpc::Result<()> {
    let n = rpc::get_worker_infos()?.len();
    rpc::rpc_sync::<String, ()>(0usize, "test_barrier_arrive", tag.to_string(), None)?;
    eventually(Duration::from_secs(30), || {
        Ok(
            rpc::rpc_sync::<String, usize>(0usize, "test_barrier_count", tag.to_string(), None)?
                == n,
        )
    })
}

/// Polls `f` every 5 ms until it returns true; an error naming the deadline otherwise.
pub(crate) fn eventually(
    deadline: Duration,
    mut f: impl FnMut() -> rpc::Result<bool>,
) -> rpc::Result<()> {
    let start = Instant::now();
    loop {
        if f()? {
            return Ok(());
        }
        if start.elapsed() > deadline {
            return Err(rpc::Error::Transport(format!(
                "condition not reached within {deadline:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The RRef tables of `worker` as `(owners, forks, pending users, pending children)`.
pub(crate) fn debug_counts(worker: usize) -> rpc::Result<(usize, usize, usize, usize)> {
    rpc::rpc_sync(worker, "test_debug_info", (), None)
}

/// The RPC error carried in a core error's `External` (as `RRef::to_here` returns it); panics
/// naming the error when it carries none.
pub(crate) fn rpc_error(e: &tensorplay_core::Error) -> &rpc::Error {
    e.downcast_ref::<rpc::Error>()
        .unwrap_or_else(|| panic!("not an RPC error: {e:?}"))
}
