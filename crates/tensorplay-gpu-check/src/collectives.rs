//! The collectives and RPC on CUDA: NCCL at world size 1 for every collective, dtype and op,
//! the timeout of a communicator whose second rank never joins, RPC of a CUDA tensor.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tensorplay as tp;
use tp::distributed::{self as dist, InitOptions, ReduceOp, rpc};
use tp::{DType, Device, Tensor};

use super::{Res, e, input, same};

/// Every collective at world size 1 on `cuda:0`: each is the identity on its data.
pub(crate) fn nccl_world_one() -> Res {
    dist::init_process_group(
        "nccl",
        InitOptions {
            timeout: Duration::from_secs(60),
            ..Default::default()
        },
    )
    .map_err(e)?;
    let cuda = |t: &Tensor| t.to("cuda:0").map_err(e);
    // bfloat16 needs compute capability 8.0 (refused otherwise: see the 16-bit check)
    let bf16 = Tensor::zeros(&[1], DType::BF16)
        .and_then(|t| t.to("cuda:0"))
        .is_ok();
    let dtypes = [
        DType::F32,
        DType::F64,
        DType::I64,
        DType::Bool,
        DType::F16,
        DType::BF16,
    ];
    for dt in dtypes.into_iter().filter(|&d| d != DType::BF16 || bf16) {
        let x = input(dt, 1000)?;
        let ops: &[ReduceOp] = match dt {
            DType::F32 | DType::F64 | DType::BF16 | DType::F16 => &[
                ReduceOp::Sum,
                ReduceOp::Product,
                ReduceOp::Min,
                ReduceOp::Max,
                ReduceOp::Avg,
            ],
            DType::I64 | DType::Bool => &[
                ReduceOp::Sum,
                ReduceOp::Product,
                ReduceOp::Min,
                ReduceOp::Max,
            ],
        };
        for &op in ops {
            let t = cuda(&x)?;
            dist::all_reduce(&t, op, None).map_err(e)?;
            same(&format!("all_reduce {op:?} {dt}"), &t, &x)?;
            let t = cuda(&x)?;
            dist::reduce(&t, 0, op, None).map_err(e)?;
            same(&format!("reduce {op:?} {dt}"), &t, &x)?;
            let o = cuda(&Tensor::zeros(&[1000], dt).map_err(e)?)?;
            dist::reduce_scatter_tensor(&o, &cuda(&x)?, op, None).map_err(e)?;
            same(&format!("reduce_scatter_tensor {op:?} {dt}"), &o, &x)?;
            let o = cuda(&Tensor::zeros(&[1000], dt).map_err(e)?)?;
            dist::reduce_scatter(&o, &[cuda(&x)?], op, None).map_err(e)?;
            same(&format!("reduce_scatter {op:?} {dt}"), &o, &x)?;
        }
        let t = cuda(&x)?;
        dist::broadcast(&t, 0, None).map_err(e)?;
        same(&format!("broadcast {dt}"), &t, &x)?;
        let zeros = || cuda(&Tensor::zeros(&[1000], dt).map_err(e)?);
        let o = zeros()?;
        dist::all_gather_into_tensor(&o, &cuda(&x)?, None).map_err(e)?;
        same(&format!("all_gather_into_tensor {dt}"), &o, &x)?;
        let o = zeros()?;
        dist::all_gather(std::slice::from_ref(&o), &cuda(&x)?, None).map_err(e)?;
        same(&format!("all_gather {dt}"), &o, &x)?;
        let o = zeros()?;
        dist::gather(&cuda(&x)?, Some(std::slice::from_ref(&o)), 0, None).map_err(e)?;
        same(&format!("gather {dt}"), &o, &x)?;
        let o = zeros()?;
        dist::scatter(&o, Some(&[cuda(&x)?]), 0, None).map_err(e)?;
        same(&format!("scatter {dt}"), &o, &x)?;
        let o = zeros()?;
        dist::all_to_all(std::slice::from_ref(&o), &[cuda(&x)?], None).map_err(e)?;
        same(&format!("all_to_all {dt}"), &o, &x)?;
        let o = zeros()?;
        dist::all_to_all_single(&o, &cuda(&x)?, None, None, None).map_err(e)?;
        same(&format!("all_to_all_single {dt}"), &o, &x)?;
    }
    // a CPU tensor is refused by name
    let host = Tensor::zeros(&[2], DType::F32).map_err(e)?;
    match dist::all_reduce(&host, ReduceOp::Sum, None) {
        Err(err) if err.to_string().contains("cuda:0") => {}
        other => return Err(format!("a CPU tensor on nccl: {other:?}")),
    }
    dist::barrier(None).map_err(e)?;
    dist::destroy_process_group().map_err(e)
}

/// Rank 0 asks for NCCL in a world of two whose rank 1 only joins the cpu side: the
/// communicator never completes, and init must time out in time.
pub(crate) fn nccl_timeout(rank: usize) -> Res {
    let backend = if rank == 0 { "nccl" } else { "cpu" };
    let start = Instant::now();
    let r = dist::init_process_group(
        backend,
        InitOptions {
            timeout: Duration::from_secs(8),
            ..Default::default()
        },
    );
    if rank == 1 {
        std::thread::sleep(Duration::from_secs(12));
        return Ok(());
    }
    match r {
        Err(err)
            if err.to_string().contains("ncclCommInitRank")
                && start.elapsed() < Duration::from_secs(30) =>
        {
            Ok(())
        }
        other => Err(format!(
            "expected a timeout of ncclCommInitRank within 30 s, got {other:?} after {:?}",
            start.elapsed()
        )),
    }
}

/// Worker 0 sends a CUDA tensor to worker 1 with the device map cuda:0 -> cuda:0.
pub(crate) fn rpc_cuda(rank: usize) -> Res {
    rpc::register("echo", |t: Tensor| Ok(t));
    let mut opts = rpc::RpcBackendOptions::default();
    if rank == 0 {
        opts.set_device_map(
            "worker1",
            HashMap::from([(Device::Cuda(0), Device::Cuda(0))]),
        );
    }
    rpc::init_rpc(&format!("worker{rank}"), rank, 2, opts).map_err(e)?;
    let r = if rank == 0 {
        (|| {
            let x = input(DType::F32, 100)?.to("cuda:0").map_err(e)?;
            let y: Tensor = rpc::rpc_sync("worker1", "echo", x.clone(), None).map_err(e)?;
            same("rpc echo of a cuda:0 tensor", &y, &x)
        })()
    } else {
        Ok(())
    };
    rpc::shutdown(true).map_err(e)?;
    r
}
