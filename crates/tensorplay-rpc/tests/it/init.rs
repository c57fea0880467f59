//! Initialisation: `tcp://` rendezvous, RPC and a process group in one job (sharing the store,
//! initialised in either order), and device maps checked on every worker.

use std::collections::HashMap;
use std::time::Duration;

use tensorplay_collectives::spawn::spawn;
use tensorplay_collectives::{self as dist, InitOptions, ReduceOp};
use tensorplay_core::{Device, Tensor};
use tensorplay_rpc as rpc;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn tcp_url() -> String {
    let addr = std::env::var("MASTER_ADDR").expect("MASTER_ADDR");
    let port = std::env::var("MASTER_PORT").expect("MASTER_PORT");
    format!("tcp://{addr}:{port}")
}

fn opts(init_method: String) -> rpc::RpcBackendOptions {
    rpc::RpcBackendOptions {
        rpc_timeout: Duration::from_secs(20),
        init_method,
        ..Default::default()
    }
}

fn pg_init(init_method: String) -> dist::Result<()> {
    dist::init_process_group(
        "cpu",
        InitOptions {
            init_method,
            timeout: Duration::from_secs(20),
            ..Default::default()
        },
    )
}

/// One RPC and one all_reduce, both checked.
fn use_both(rank: usize) -> TestResult {
    let other = 1 - rank;
    let got: usize = rpc::rpc_sync(other, "plus_ten", rank, None)?;
    assert_eq!(got, rank + 10);
    let t = Tensor::from_vec(vec![rank as f64 + 1.0], &[1])?;
    dist::all_reduce(&t, ReduceOp::Sum, None)?;
    assert_eq!(t.to_vec::<f64>()?, vec![3.0]);
    Ok(())
}

#[test]
fn tcp_init_and_process_group_in_either_order() -> TestResult {
    spawn(2, |rank| -> TestResult {
        rpc::register("plus_ten", |x: usize| Ok(x + 10));
        // tcp://, RPC first (both are collective: every rank uses the same order)
        rpc::init_rpc(&format!("worker{rank}"), rank, 2, opts(tcp_url()))?;
        pg_init(tcp_url())?;
        let w = rpc::get_worker_info("worker1")?;
        assert_eq!(w.id, 1);
        use_both(rank)?;
        rpc::shutdown(true)?;
        dist::destroy_process_group()?;
        // env://, the process group first
        pg_init("env://".into())?;
        rpc::init_rpc(&format!("worker{rank}"), rank, 2, opts("env://".into()))?;
        use_both(rank)?;
        dist::destroy_process_group()?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

#[test]
fn device_maps_are_checked_on_every_worker() -> TestResult {
    spawn(2, |rank| -> TestResult {
        rpc::register("plus_ten", |x: usize| Ok(x + 10));
        let other = format!("worker{}", 1 - rank);
        let me = format!("worker{rank}");
        // a map to a worker that is not in the job, on rank 1 only: both fail, naming it
        let mut bad = opts("env://".into());
        if rank == 1 {
            bad.set_device_map("worker7", HashMap::from([(Device::Cpu, Device::Cpu)]));
        }
        let e = rpc::init_rpc(&me, rank, 2, bad).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("device_maps") && text.contains("worker7"),
            "{text}"
        );
        if rank == 0 {
            assert!(text.contains("\"worker1\""), "{text}");
        }
        // two devices onto one target
        let mut dup = opts("env://".into());
        dup.set_device_map(
            &other,
            HashMap::from([
                (Device::Cuda(0), Device::Cuda(1)),
                (Device::Cuda(1), Device::Cuda(1)),
            ]),
        );
        let e = rpc::init_rpc(&me, rank, 2, dup).unwrap_err();
        assert!(e.to_string().contains("cuda:1"), "{e}");
        // a map onto this worker itself
        let mut own = opts("env://".into());
        own.set_device_map(&me, HashMap::from([(Device::Cpu, Device::Cpu)]));
        let e = rpc::init_rpc(&me, rank, 2, own).unwrap_err();
        assert!(e.to_string().contains(&me), "{e}");
        // a good map: host tensors stay host tensors
        let mut good = opts("env://".into());
        good.set_device_map(&other, HashMap::from([(Device::Cuda(0), Device::Cuda(0))]));
        rpc::init_rpc(&me, rank, 2, good)?;
        let got: usize = rpc::rpc_sync(other.as_str(), "plus_ten", rank, None)?;
        assert_eq!(got, rank + 10);
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}
