//! Training on `cuda:0` against the CPU: the fused optimizer updates, an MLP's gradients, the
//! wine_quality example with `--device cuda`, the product description's first example on
//! `"nccl"` at world size 1, and a RemoteModule on `"worker1/cuda:0"`.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tensorplay as tp;
use tp::distributed::nn::{LinearArgs, RemoteModule};
use tp::distributed::optim::{DistributedOptimizer, OptimizerKind};
use tp::distributed::{self as dist, InitOptions, ReduceOp, rpc};
use tp::nn::{self, Module};
use tp::optim::{Adam, AdamOptions, AdamW, AdamWOptions, Optimizer, SGD, SgdOptions};
use tp::{DType, Device, Tensor};

use super::ops::{Gen, close};
use super::{Res, e};

const GPU: Device = Device::Cuda(0);

/// Five steps of each optimizer on float64 and float32 parameters: the GPU's parameters
/// follow the CPU's (the fused kernels do the CPU's arithmetic in the CPU's order, without
/// fused multiply-adds: float64 agrees to 1e-12).
pub(crate) fn optimizers() -> Res {
    type Make = fn(Vec<Tensor>) -> tp::Result<Box<dyn Optimizer>>;
    let kinds: [(&str, Make); 5] = [
        ("SGD", |p| {
            Ok(Box::new(SGD::new(
                p,
                SgdOptions {
                    lr: 0.1,
                    ..Default::default()
                },
            )?))
        }),
        ("SGD momentum nesterov weight decay", |p| {
            Ok(Box::new(SGD::new(
                p,
                SgdOptions {
                    lr: 0.1,
                    momentum: 0.9,
                    nesterov: true,
                    weight_decay: 0.01,
                    ..Default::default()
                },
            )?))
        }),
        ("Adam", |p| {
            Ok(Box::new(Adam::new(
                p,
                AdamOptions {
                    lr: 0.01,
                    weight_decay: 0.1,
                    ..Default::default()
                },
            )?))
        }),
        ("Adam amsgrad", |p| {
            Ok(Box::new(Adam::new(
                p,
                AdamOptions {
                    lr: 0.01,
                    amsgrad: true,
                    ..Default::default()
                },
            )?))
        }),
        ("AdamW", |p| {
            Ok(Box::new(AdamW::new(
                p,
                AdamWOptions {
                    lr: 0.01,
                    ..Default::default()
                },
            )?))
        }),
    ];
    let mut g = Gen::new(4);
    for dt in [DType::F64, DType::F32] {
        let tol = if dt == DType::F64 { 1e-12 } else { 1e-5 };
        for (name, make) in kinds {
            let w0 = Tensor::from_vec(g.values(300), &[20, 15])
                .and_then(|t| t.to_dtype(dt))
                .map_err(e)?;
            let wc = w0.deep_clone().map(|t| t.requires_grad_(true)).map_err(e)?;
            let wg = w0
                .to_device(GPU)
                .map(|t| t.requires_grad_(true))
                .map_err(e)?;
            let (mut oc, mut og) = (
                make(vec![wc.clone()]).map_err(e)?,
                make(vec![wg.clone()]).map_err(e)?,
            );
            for step in 0..5 {
                let grad = Tensor::from_vec(g.values(300), &[20, 15])
                    .and_then(|t| t.to_dtype(dt))
                    .map_err(e)?;
                oc.step_with_grads(&[Some(grad.clone())]).map_err(e)?;
                og.step_with_grads(&[Some(grad.to_device(GPU).map_err(e)?)])
                    .map_err(|x| format!("{name} {dt} step {step} on cuda:0: {x}"))?;
                close(
                    &format!("{name} {dt} after step {step}"),
                    &wg.detach(),
                    &wc.detach(),
                    tol,
                )?;
            }
        }
    }
    Ok(())
}

fn mlp(dt: DType) -> tp::Result<nn::Sequential> {
    let mut g = Gen::new(11);
    let mut linear = |i: usize, o: usize| -> tp::Result<nn::Linear> {
        let scale = 1.0 / (i as f64).sqrt();
        let w = Tensor::from_vec(
            g.values(i * o).into_iter().map(|v| v * scale).collect(),
            &[o, i],
        )?;
        let b = Tensor::from_vec(g.values(o), &[o])?;
        nn::Linear::from_weights(
            w.to_dtype(dt)?.requires_grad_(true),
            Some(b.to_dtype(dt)?.requires_grad_(true)),
        )
    };
    Ok(nn::Sequential::new()
        .add(linear(11, 64)?)
        .add(nn::ReLU::new())
        .add(linear(64, 64)?)
        .add(nn::Tanh::new())
        .add(linear(64, 6)?))
}

/// An MLP 11-64-64-6 with cross-entropy: the GPU's loss and every parameter's gradient
/// against the CPU's (float64 1e-10, float32 1e-4).
pub(crate) fn mlp_gradients() -> Res {
    let mut g = Gen::new(5);
    for dt in [DType::F64, DType::F32] {
        let tol = if dt == DType::F64 { 1e-10 } else { 1e-4 };
        let cpu = mlp(dt).map_err(e)?;
        let mut gpu = mlp(dt).map_err(e)?;
        gpu.to_device(GPU).map_err(e)?;
        let x = Tensor::from_vec(g.values(32 * 11), &[32, 11])
            .and_then(|t| t.to_dtype(dt))
            .map_err(e)?;
        let y = Tensor::from_vec(
            (0..32).map(|i| (i * 5 % 6) as i64).collect::<Vec<_>>(),
            &[32],
        )
        .map_err(e)?;
        let lc = nn::functional::cross_entropy(&cpu.call(&x).map_err(e)?, &y).map_err(e)?;
        let lg = nn::functional::cross_entropy(
            &gpu.call(&x.to_device(GPU).map_err(e)?).map_err(e)?,
            &y.to_device(GPU).map_err(e)?,
        )
        .map_err(e)?;
        close(&format!("MLP {dt} loss"), &lg, &lc, tol)?;
        lc.backward().map_err(e)?;
        lg.backward().map_err(e)?;
        for ((name, pc), (_, pg)) in cpu
            .named_parameters()
            .into_iter()
            .zip(gpu.named_parameters())
        {
            let (gc, gg) = (
                pc.grad().ok_or("no CPU gradient")?,
                pg.grad()
                    .ok_or_else(|| format!("{name}: no gradient on cuda:0"))?,
            );
            close(&format!("MLP {dt} gradient of {name}"), &gg, &gc, tol)?;
        }
    }
    Ok(())
}

fn accuracy(bin: &Path, device: &str) -> Result<f64, String> {
    let out = Command::new(bin)
        .args(["--seed", "0", "--device", device])
        .output()
        .map_err(|x| format!("running {}: {x}", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "wine_quality --device {device} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    text.lines()
        .find_map(|l| l.strip_prefix("test accuracy "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("wine_quality --device {device} printed no accuracy: {text}"))
}

/// The wine_quality example (in the bundle beside this binary) on the CPU and with
/// `--device cuda`: the accuracies within 0.01.
pub(crate) fn wine_quality(bin: &Path) -> Res {
    let cpu = accuracy(bin, "cpu")?;
    let gpu = accuracy(bin, "cuda")?;
    println!("        wine_quality test accuracy: cpu {cpu:.4}, cuda {gpu:.4}");
    if (cpu - gpu).abs() > 0.01 {
        return Err(format!(
            "accuracy on cuda {gpu:.4} is not within 0.01 of the CPU's {cpu:.4}"
        ));
    }
    Ok(())
}

/// The product description's first example at world size 1 on `"nccl"`: a CUDA tensor that
/// requires grad through the differentiable all_reduce, then `y.sum().backward()`; and the
/// Max/Min/Product adjoints on CUDA.
pub(crate) fn first_example_nccl() -> Res {
    dist::init_process_group(
        "nccl",
        InitOptions {
            timeout: Duration::from_secs(60),
            ..Default::default()
        },
    )
    .map_err(e)?;
    let r = (|| {
        let x = Tensor::randn(&[4, 8], (DType::F32, GPU))
            .map_err(e)?
            .requires_grad_(true);
        let y = dist::nn::functional::all_reduce(&x, ReduceOp::Sum, None).map_err(e)?;
        y.sum().and_then(|s| s.backward()).map_err(e)?;
        let ones = Tensor::ones(&[4, 8], DType::F32).map_err(e)?;
        close(
            "all_reduce Sum backward on nccl",
            &x.grad().ok_or("no gradient")?,
            &ones,
            0.0,
        )?;
        close(
            "all_reduce Sum forward on nccl",
            &y,
            &x.detach().cpu().map_err(e)?,
            0.0,
        )?;
        for op in [ReduceOp::Max, ReduceOp::Min, ReduceOp::Product] {
            let x = Tensor::randn(&[3, 5], (DType::F64, GPU))
                .map_err(e)?
                .requires_grad_(true);
            let y = dist::nn::functional::all_reduce(&x, op, None).map_err(e)?;
            y.mul_scalar(3.0)
                .and_then(|t| t.sum())
                .and_then(|s| s.backward())
                .map_err(e)?;
            // at world size 1 every adjoint is the incoming gradient
            let want = Tensor::full(&[3, 5], 3.0, DType::F64).map_err(e)?;
            close(
                &format!("all_reduce {op:?} backward on nccl"),
                &x.grad().ok_or("no gradient")?,
                &want,
                1e-12,
            )?;
        }
        Ok(())
    })();
    dist::destroy_process_group().map_err(e)?;
    r
}

/// Rank 1 hosts two Linear(6, 4) layers made from the same seed, one on `cuda:0` and one on
/// the CPU; rank 0 trains each for 5 steps with distributed autograd and a
/// DistributedOptimizer: the losses agree (float32, 1e-5).
pub(crate) fn remote_module_cuda(rank: usize) -> Res {
    rpc::register("gpu_check_seed", |s: u64| {
        tp::manual_seed(s);
        Ok(())
    });
    rpc::init_rpc(
        &format!("worker{rank}"),
        rank,
        2,
        rpc::RpcBackendOptions::default(),
    )
    .map_err(e)?;
    let r = if rank == 0 {
        (|| {
            let train = |device: &str| -> Result<Vec<f64>, String> {
                let () = rpc::rpc_sync("worker1", "gpu_check_seed", 3u64, None).map_err(e)?;
                let m = RemoteModule::<nn::Linear>::new(
                    &format!("worker1/{device}"),
                    LinearArgs {
                        in_features: 6,
                        out_features: 4,
                        bias: true,
                    },
                )
                .map_err(e)?;
                let opt = DistributedOptimizer::new(
                    OptimizerKind::Sgd(SgdOptions {
                        lr: 0.2,
                        momentum: 0.5,
                        ..Default::default()
                    }),
                    &m.remote_parameters(true).map_err(e)?,
                )
                .map_err(e)?;
                let mut g = Gen::new(6);
                let x = Tensor::from_vec(g.values(8 * 6), &[8, 6])
                    .and_then(|t| t.to_dtype(DType::F32))
                    .map_err(e)?;
                let y = Tensor::from_vec(g.values(8 * 4), &[8, 4])
                    .and_then(|t| t.to_dtype(DType::F32))
                    .map_err(e)?;
                let mut losses = Vec::new();
                for _ in 0..5 {
                    let ctx = dist::autograd::context().map_err(e)?;
                    let loss =
                        nn::functional::mse_loss(&m.forward(&x).map_err(e)?, &y).map_err(e)?;
                    losses.push(loss.item_f64().map_err(e)?);
                    dist::autograd::backward(ctx.id(), &[loss], false).map_err(e)?;
                    opt.step(ctx.id()).map_err(e)?;
                }
                Ok(losses)
            };
            let cpu = train("cpu")?;
            let gpu = train("cuda:0")?;
            println!("        losses: cpu {cpu:.6?}, cuda:0 {gpu:.6?}");
            for (i, (a, b)) in gpu.iter().zip(&cpu).enumerate() {
                if (a - b).abs() > 1e-5 * b.abs().max(1.0) {
                    return Err(format!(
                        "step {i}: loss {a} on worker1/cuda:0, {b} on worker1/cpu"
                    ));
                }
            }
            if cpu[4] >= cpu[0] {
                return Err(format!("the loss did not fall: {cpu:?}"));
            }
            Ok(())
        })()
    } else {
        Ok(())
    };
    rpc::shutdown(true).map_err(e)?;
    r
}
