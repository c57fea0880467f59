//! The intra-op thread pool (`torch.set_num_threads`): how many threads the CPU kernels use and
//! how work is split among them.
//!
//! Work is always cut into the same pieces, whatever the thread count (a piece's size depends
//! on the problem only), and pieces that are combined are combined in their order; so one
//! thread and eight give the same bits. Small problems (under [`MIN_PARALLEL_WORK`] elements)
//! stay on the calling thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use rayon::prelude::*;

/// The fewest elements of work for which a kernel uses more than one thread.
pub(crate) const MIN_PARALLEL_WORK: usize = 1 << 15;

/// 0 until set: the default rule applies.
static NUM_THREADS: AtomicUsize = AtomicUsize::new(0);

/// The most intra-op threads: a larger count from [`set_num_threads`] or `OMP_NUM_THREADS` is
/// taken as this (a pool of 100,000 threads took minutes to start its first operation).
pub(crate) const MAX_NUM_THREADS: usize = 1024;

/// Sets the number of threads the CPU kernels may use (`torch.set_num_threads`): matrix
/// products, elementwise operations, row kernels (softmax, LayerNorm, GELU) and attention, each
/// above a size threshold. `0` restores the default (see [`get_num_threads`]); a count above
/// 1024 is taken as 1024. Results do not depend on the number.
pub fn set_num_threads(n: usize) {
    NUM_THREADS.store(n.min(MAX_NUM_THREADS), Ordering::Relaxed);
}

/// The number of threads the CPU kernels may use: the last [`set_num_threads`], else
/// `OMP_NUM_THREADS` when it is a positive integer (as PyTorch reads it; at most 1024; another
/// value is reported on standard error and ignored), else 1 inside a rank
/// started by `spawn` or `tensorplay-run` (the environment has `RANK` and `WORLD_SIZE`, as
/// torchrun's ranks do, where PyTorch defaults to one thread per rank), else the cores this
/// process may run on (its CPU affinity and cgroup quota).
pub fn get_num_threads() -> usize {
    match NUM_THREADS.load(Ordering::Relaxed) {
        0 => default_threads(),
        n => n,
    }
}

fn default_threads() -> usize {
    // the environment and the cgroup files are read once (dozens of syscalls)
    static DEFAULT: OnceLock<usize> = OnceLock::new();
    *DEFAULT.get_or_init(|| {
        let omp = std::env::var("OMP_NUM_THREADS").ok().and_then(|v| {
            match v.trim().parse::<usize>() {
                Ok(n) if (1..=MAX_NUM_THREADS).contains(&n) => Some(n),
                Ok(n) if n > MAX_NUM_THREADS => {
                    super::warn_once(
                        "OMP_NUM_THREADS",
                        &format!("OMP_NUM_THREADS={n} is above {MAX_NUM_THREADS}; using {MAX_NUM_THREADS}"),
                    );
                    Some(MAX_NUM_THREADS)
                }
                _ => {
                    super::warn_once(
                        "OMP_NUM_THREADS",
                        &format!(
                            "OMP_NUM_THREADS={v:?} is not a positive integer; ignored (the \
                             default rule chooses the thread count)"
                        ),
                    );
                    None
                }
            }
        });
        let in_rank =
            std::env::var_os("RANK").is_some() && std::env::var_os("WORLD_SIZE").is_some();
        match omp {
            Some(n) => n,
            None if in_rank => 1,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    })
}

/// A pool of `n` threads, built once per count.
fn pool(n: usize) -> Option<Arc<rayon::ThreadPool>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<rayon::ThreadPool>>>> = OnceLock::new();
    let mut pools = POOLS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(p) = pools.get(&n) {
        return Some(p.clone());
    }
    let p = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("tensorplay-intraop-{i}"))
        .build()
        .ok()?;
    let p = Arc::new(p);
    pools.insert(n, p.clone());
    Some(p)
}

/// The threads to use for `work` elements: 1 below the threshold or when one is asked for.
fn threads_for(work: usize) -> usize {
    if work < MIN_PARALLEL_WORK {
        1
    } else {
        get_num_threads()
    }
}

/// Runs `op` inside the intra-op pool when `work` is worth more than one thread (with
/// `parallel = true`), else on this thread (`parallel = false`).
pub(crate) fn with_pool<R: Send>(work: usize, op: impl FnOnce(bool) -> R + Send) -> R {
    let n = threads_for(work);
    if n > 1
        && let Some(p) = pool(n)
    {
        return p.install(|| op(true));
    }
    op(false)
}

/// `f(i, chunk)` for the consecutive `chunk`-element pieces of `out` (the last may be
/// shorter), in parallel when `work` (elements) is large enough.
pub(crate) fn for_each_chunk<E: Send>(
    out: &mut [E],
    chunk: usize,
    work: usize,
    f: impl Fn(usize, &mut [E]) + Sync + Send,
) {
    let chunk = chunk.max(1);
    with_pool(work, |par| {
        if par {
            out.par_chunks_mut(chunk)
                .enumerate()
                .for_each(|(i, c)| f(i, c));
        } else {
            out.chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c));
        }
    })
}

/// `f(i, chunk)` for the pieces of `out` as [`for_each_chunk`], collecting the results in the
/// pieces' order.
pub(crate) fn map_chunks<E: Send, R: Send>(
    out: &mut [E],
    chunk: usize,
    work: usize,
    f: impl Fn(usize, &mut [E]) -> R + Sync + Send,
) -> Vec<R> {
    let chunk = chunk.max(1);
    with_pool(work, |par| {
        if par {
            out.par_chunks_mut(chunk)
                .enumerate()
                .map(|(i, c)| f(i, c))
                .collect()
        } else {
            out.chunks_mut(chunk)
                .enumerate()
                .map(|(i, c)| f(i, c))
                .collect()
        }
    })
}

/// `f(i)` for `i` in `0..n`, collected in order, in parallel when `work` is large enough.
pub(crate) fn map_tasks<R: Send>(
    n: usize,
    work: usize,
    f: impl Fn(usize) -> R + Sync + Send,
) -> Vec<R> {
    with_pool(work, |par| {
        if par {
            (0..n).into_par_iter().map(&f).collect()
        } else {
            (0..n).map(&f).collect()
        }
    })
}

/// `f(i, piece)` for the pieces in order of `pieces` (each owned by one call), in parallel when
/// `work` is large enough.
pub(crate) fn for_each_piece<T: Send>(
    pieces: Vec<T>,
    work: usize,
    f: impl Fn(usize, T) + Sync + Send,
) {
    with_pool(work, |par| {
        if par {
            pieces
                .into_par_iter()
                .enumerate()
                .for_each(|(i, p)| f(i, p));
        } else {
            pieces.into_iter().enumerate().for_each(|(i, p)| f(i, p));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_thread_count_is_capped() {
        let before = NUM_THREADS.load(Ordering::Relaxed);
        for (asked, want) in [
            (100_000, MAX_NUM_THREADS),
            (MAX_NUM_THREADS, MAX_NUM_THREADS),
        ] {
            set_num_threads(asked);
            assert_eq!(get_num_threads(), want, "set_num_threads({asked})");
        }
        NUM_THREADS.store(before, Ordering::Relaxed);
    }
}
