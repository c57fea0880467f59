//! `DistributedDataParallel` in 16 bits across real processes: the compress hooks
//! (`bf16_compress_hook`, `fp16_compress_hook`) on float32 gradients, bit for bit against the
//! single-process computation of what they promise, and a model whose parameters are bfloat16
//! or float16 (16-bit buckets) against the single-process mean of the ranks' gradients.

use std::time::Duration;

use tensorplay_collectives as dist;
use tensorplay_core::nn::Module;
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::parallel::{
    CommHook, DistributedDataParallel as Ddp, default_hooks,
};
use tensorplay_testkit::{Tol, check_close, cpu_world};

use super::ddp::{SEED, SMALL_CAP, TestResult, mlp, mse, options, rows};

const DIMS: [usize; 4] = [5, 16, 12, 3];
const PER_RANK: usize = 4;
const STEPS: usize = 2;

/// How the gradients travel.
#[derive(Clone, Copy, Debug)]
enum Transport {
    /// float32 parameters, the hook compressing to the dtype.
    Hook(DType),
    /// Parameters (and so gradients and buckets) of the dtype, no hook.
    Params(DType),
}

struct Case {
    name: &'static str,
    world: usize,
    transport: Transport,
}

const CASES: [Case; 6] = [
    Case {
        name: "bf16_compress_hook, world 2",
        world: 2,
        transport: Transport::Hook(DType::BF16),
    },
    Case {
        name: "bf16_compress_hook, world 3",
        world: 3,
        transport: Transport::Hook(DType::BF16),
    },
    Case {
        name: "fp16_compress_hook, world 2",
        world: 2,
        transport: Transport::Hook(DType::F16),
    },
    Case {
        name: "fp16_compress_hook, world 4",
        world: 4,
        transport: Transport::Hook(DType::F16),
    },
    Case {
        name: "bfloat16 parameters, world 3",
        world: 3,
        transport: Transport::Params(DType::BF16),
    },
    Case {
        name: "float16 parameters, world 2",
        world: 2,
        transport: Transport::Params(DType::F16),
    },
];

/// Each rank's local gradients (one flat `f64` vector per parameter), computed here in one
/// process on that rank's rows.
fn local_grads(
    reference: &dyn Module,
    step: usize,
    world: usize,
    dtype: DType,
) -> tp::Result<Vec<Vec<Vec<f64>>>> {
    (0..world)
        .map(|r| {
            let (x, y) = rows(
                step * PER_RANK * world + r * PER_RANK,
                PER_RANK,
                &DIMS,
                dtype,
            )?;
            reference.zero_grad()?;
            mse(&reference.call(&x)?, &y)?.backward()?;
            reference
                .parameters()
                .iter()
                .map(|p| {
                    p.grad()
                        .ok_or(tp::Error::Autograd("no grad".into()))?
                        .to_vec_f64()
                })
                .collect()
        })
        .collect()
}

/// What a compress hook promises for one parameter: each rank's gradient rounded to `low`,
/// divided by the world in float32 and rounded again, the ranks' values summed exactly and
/// rounded once to `low`, widened back.
fn compressed_mean(ranks: &[&Vec<f64>], low: DType) -> tp::Result<Vec<f64>> {
    let n = ranks[0].len();
    let mut sum = vec![0.0f64; n];
    for g in ranks {
        let part = Tensor::from_vec(g.to_vec(), &[n])?
            .to_dtype(DType::F32)?
            .to_dtype(low)?
            .div_scalar(ranks.len() as f64)?
            .to_vec_f64()?;
        sum.iter_mut().zip(part).for_each(|(s, v)| *s += v);
    }
    Tensor::from_vec(sum, &[n])?.to_dtype(low)?.to_vec_f64()
}

fn run_case(c: &Case, rank: usize) -> TestResult {
    let (param_dtype, hook_dtype) = match c.transport {
        Transport::Hook(d) => (DType::F32, Some(d)),
        Transport::Params(d) => (d, None),
    };
    let ddp = Ddp::with_options(mlp(&DIMS, param_dtype, SEED)?, options(SMALL_CAP))?;
    if let Some(d) = hook_dtype {
        let hook: Box<CommHook> = match d {
            DType::BF16 => Box::new(default_hooks::bf16_compress_hook),
            _ => Box::new(default_hooks::fp16_compress_hook),
        };
        ddp.register_comm_hook(hook)?;
    }
    let reference = mlp(&DIMS, param_dtype, SEED)?;
    let names: Vec<String> = reference
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    for step in 0..STEPS {
        let what = format!("{} (rank {rank}), step {step}", c.name);
        let (x, y) = rows(
            step * PER_RANK * c.world + rank * PER_RANK,
            PER_RANK,
            &DIMS,
            param_dtype,
        )?;
        ddp.zero_grad()?;
        mse(&ddp.call(&x)?, &y)?.backward()?;
        let locals = local_grads(&reference, step, c.world, param_dtype)?;
        for (k, p) in ddp.module().parameters().iter().enumerate() {
            let g = p
                .grad()
                .ok_or_else(|| format!("{what}: no grad of {}", names[k]))?;
            if g.dtype() != param_dtype {
                return Err(format!("{what}: grad of {} is {}", names[k], g.dtype()).into());
            }
            let ranks: Vec<&Vec<f64>> = locals.iter().map(|l| &l[k]).collect();
            let (want, tol) = match hook_dtype {
                Some(low) => (compressed_mean(&ranks, low)?, Tol::EXACT),
                None => {
                    // the mean of the ranks' 16-bit gradients: at most two roundings (the
                    // scaling by 1/world and the float32 sum's) of one epsilon each
                    let n = ranks[0].len();
                    let mean: Vec<f64> = (0..n)
                        .map(|i| ranks.iter().map(|g| g[i]).sum::<f64>() / c.world as f64)
                        .collect();
                    let eps = tp::finfo(param_dtype)?.eps;
                    let big = mean.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                    (
                        mean,
                        Tol {
                            abs: 2.0 * eps * big,
                            rel: 2.0 * eps,
                        },
                    )
                }
            };
            check_close(
                &format!("{what}: grad of {}", names[k]),
                &g.to_vec_f64()?,
                &want,
                tol,
            )?;
        }
        // the parameters step identically on every rank (the gradients agree bit for bit)
        let mine: Vec<Vec<u64>> = ddp
            .module()
            .parameters()
            .iter()
            .map(|p| {
                Ok(p.grad()
                    .map(|g| g.to_vec_f64())
                    .transpose()?
                    .unwrap_or_default())
            })
            .map(|v: tp::Result<Vec<f64>>| Ok(v?.iter().map(|x| x.to_bits()).collect()))
            .collect::<tp::Result<_>>()?;
        let all = dist::all_gather_object(&mine, None)?;
        if all.iter().any(|a| *a != mine) {
            return Err(format!("{what}: the ranks' gradients differ").into());
        }
    }
    Ok(())
}

#[test]
fn sixteen_bit_gradients_match_one_process() {
    for c in &CASES {
        cpu_world(c.world, Duration::from_secs(30), |rank| run_case(c, rank));
    }
}
