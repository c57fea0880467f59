//! The elementwise and row kernels beside PyTorch's `torch_ops_step.py` anchor: one thread,
//! float32, 8192 x 128 rows (1,048,576 floats), forward only, the best of 20 timed calls after
//! 5 warm-up calls. Prints exactly the anchor's lines with the prefix `tensorplay-ops`:
//! `exp_1m`, `softmax_1m`, `layernorm_1m`, `gelu_tanh_1m` and `sdpa_causal` (q, k, v of
//! shape [16, 4, 64, 32]), in microseconds; then rows without an anchor yet: `log_1m` (of
//! `|x| + 0.5`), `erf_1m`, `gelu_erf_1m`, `cross_entropy_1m` (the 8192 x 128 logits
//! against int64 targets, forward only) and `sdpa_causal_fwd_bwd` (`sdpa_causal`'s forward
//! and the gradients of q, k and v, the GPT training step's attention).
//!
//! `cargo bench -p tensorplay-core --bench ops_step`; `cargo xtask bench-core` runs it beside
//! the anchor. `TENSORPLAY_CPU_CAPABILITY=default|avx2|avx512` picks the kernels' level.

use std::time::Instant;

use clap::Parser;
use tensorplay_core::nn::functional as F;
use tensorplay_core::{self as tp, Tensor};

/// The command line (`cargo bench -p tensorplay-core --bench ops_step [-- THREADS]`).
#[derive(Parser, Debug)]
#[command(
    name = "ops_step",
    about = "The elementwise and row kernels, in the anchor's lines."
)]
struct Args {
    /// Intra-op threads.
    #[arg(default_value_t = 1)]
    threads: usize,
    /// Run only this row (for profiling), `--repeat` times.
    #[arg(long)]
    only: Option<String>,
    /// With `--only`: how many calls.
    #[arg(long, default_value_t = 200)]
    repeat: usize,
    /// Given by `cargo bench` to every benchmark; nothing changes.
    #[arg(long, hide = true)]
    bench: bool,
}

/// One timed operation.
type Op<'a> = Box<dyn FnMut() -> tp::Result<Tensor> + 'a>;

fn best(mut f: impl FnMut() -> tp::Result<Tensor>) -> tp::Result<f64> {
    for _ in 0..5 {
        f()?;
    }
    let mut best = f64::INFINITY;
    for _ in 0..20 {
        let t = Instant::now();
        let y = f()?;
        best = best.min(t.elapsed().as_secs_f64());
        drop(y);
    }
    Ok(best * 1e6)
}

fn main() -> tp::Result<()> {
    let args = Args::parse();
    tp::set_num_threads(args.threads);
    tp::manual_seed(0);
    let x = tp::randn(&[8192, 128])?;
    let (w, b) = (tp::randn(&[128])?, tp::randn(&[128])?);
    let q = tp::randn(&[16, 4, 64, 32])?;
    let k = tp::randn(&[16, 4, 64, 32])?;
    let v = tp::randn(&[16, 4, 64, 32])?;
    let pos = x.abs()?.add_scalar(0.5)?;
    let target = Tensor::from_vec((0..8192).map(|i| i % 128).collect::<Vec<i64>>(), &[8192])?;
    let _guard = tp::no_grad();
    let (ql, kl, vl) = (
        q.detach().requires_grad_(true),
        k.detach().requires_grad_(true),
        v.detach().requires_grad_(true),
    );
    let g = tp::randn(&[16, 4, 64, 32])?;
    let rows: [(&str, Op<'_>); 10] = [
        ("exp_1m", Box::new(|| x.exp())),
        ("softmax_1m", Box::new(|| x.softmax(-1))),
        (
            "layernorm_1m",
            Box::new(|| F::layer_norm(&x, &[128], Some(&w), Some(&b), 1e-5)),
        ),
        ("gelu_tanh_1m", Box::new(|| x.gelu_tanh())),
        (
            "sdpa_causal",
            Box::new(|| F::scaled_dot_product_attention(&q, &k, &v, None, 0.0, true, None)),
        ),
        ("log_1m", Box::new(|| pos.log())),
        ("erf_1m", Box::new(|| x.erf())),
        (
            "gelu_erf_1m",
            Box::new(|| F::gelu(&x, F::Approximate::None)),
        ),
        (
            "cross_entropy_1m",
            Box::new(|| F::cross_entropy(&x, &target)),
        ),
        (
            "sdpa_causal_fwd_bwd",
            Box::new(|| {
                let _grad = tp::set_grad_enabled(true);
                let y = F::scaled_dot_product_attention(&ql, &kl, &vl, None, 0.0, true, None)?;
                let inputs = [ql.clone(), kl.clone(), vl.clone()];
                let opts = tp::autograd::GradOptions::default();
                let grads = tp::autograd::grad(&[y], &inputs, &[Some(g.clone())], opts)?;
                grads
                    .into_iter()
                    .flatten()
                    .next()
                    .map_or_else(|| tp::zeros(&[1]), Ok)
            }),
        ),
    ];
    for (name, mut f) in rows {
        if let Some(only) = &args.only {
            if only == name {
                for _ in 0..args.repeat {
                    f()?;
                }
            }
            continue;
        }
        println!("tensorplay-ops {name} {:.1} us", best(f)?);
    }
    Ok(())
}
