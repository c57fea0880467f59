//! The facade as a user sees it: one error type across layers, custom functions written against
//! `tp::Result`, PyTorch-like conveniences.

use tensorplay as tp;
use tp::autograd::{Context, Function};
use tp::{Tensor, distributed as dist};

/// y = 2x, written against the facade only.
struct Double;
impl Function for Double {
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> tp::Result<Vec<Tensor>> {
        Ok(vec![inputs[0].mul_scalar(2.0)?])
    }
    fn backward(&self, _ctx: &Context, g: &[Tensor]) -> tp::Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g[0].mul_scalar(2.0)?)])
    }
}

#[test]
fn custom_function_through_the_facade() -> tp::Result<()> {
    let x = tp::ones(&[3])?.requires_grad_(true);
    let y = tp::autograd::apply(Double, &[&x])?.remove(0);
    y.sum()?.backward()?;
    assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![2.0; 3]);
    Ok(())
}

#[test]
fn one_error_type_across_layers() {
    fn run() -> tp::Result<()> {
        let t = tp::zeros(&[2])?;
        dist::all_reduce(&t, dist::ReduceOp::Sum, None)?; // no process group: a distributed error
        Ok(())
    }
    let e = run().unwrap_err();
    assert!(
        matches!(
            e.downcast_ref::<dist::Error>(),
            Some(dist::Error::NotInitialized { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("init_process_group"));
}

#[test]
fn conveniences() -> tp::Result<()> {
    let x = tp::arange(0.0, 8.0, 1.0)?;
    assert_eq!(x.reshape(&[4, -1])?.shape(), &[4, 2]);
    assert_eq!(x.reshape(&[2, 4])?.shape(), &[2, 4]);
    assert_eq!(tp::ones(&[1])?.item::<f64>()?, 1.0);
    let c = tp::cat(&[tp::ones(&[2])?, tp::zeros(&[1])?], 0)?;
    assert_eq!(c.to_vec::<f32>()?, vec![1.0, 1.0, 0.0]);
    assert_eq!(
        tp::stack(&[tp::ones(&[2])?, tp::ones(&[2])?], 0)?.shape(),
        &[2, 2]
    );
    Ok(())
}

/// `fn main() -> tp::Result<()>` prints `Error: {:?}`: the Debug form is the message once, not a
/// dump of the variant's fields.
#[test]
fn debug_form_of_errors_is_the_message() {
    let core = tp::zeros(&[2, 3])
        .unwrap()
        .matmul(&tp::zeros(&[2, 3]).unwrap());
    let core = core.unwrap_err();
    assert_eq!(format!("{core:?}"), core.to_string());
    assert!(!format!("{core:?}").contains("ShapeMismatch {"), "{core:?}");

    fn lifted() -> tp::Result<()> {
        dist::all_reduce(&tp::zeros(&[2])?, dist::ReduceOp::Sum, None)?;
        Ok(())
    }
    let e = lifted().unwrap_err();
    let shown = format!("{e:?}");
    assert_eq!(shown, e.to_string(), "{shown}");
    assert!(shown.contains("init_process_group"), "{shown}");
    assert_eq!(shown.matches("not initialized").count(), 1, "{shown}");
    assert!(!shown.contains("External("), "{shown}");

    let rpc = tp::distributed::rpc::rpc_sync::<(), ()>("nobody", "f", (), None).unwrap_err();
    assert_eq!(format!("{rpc:?}"), rpc.to_string());
}

/// Today's other paths stay one release as deprecated aliases of the one path each item has:
/// each names the same item (same type, same function).
#[test]
#[allow(deprecated)]
fn deprecated_paths_name_the_same_items() {
    use std::any::TypeId;
    type M = tp::nn::Linear;
    let cases: [(&str, TypeId, TypeId); 5] = [
        (
            "distributed::nn::parallel::DistributedDataParallel",
            TypeId::of::<tp::distributed::nn::parallel::DistributedDataParallel<M>>(),
            TypeId::of::<tp::nn::parallel::DistributedDataParallel<M>>(),
        ),
        (
            "distributed::nn::data::DistributedSampler",
            TypeId::of::<tp::distributed::nn::data::DistributedSampler>(),
            TypeId::of::<tp::utils::data::DistributedSampler>(),
        ),
        (
            "distributed::nn::checkpoint::Shard",
            TypeId::of::<tp::distributed::nn::checkpoint::Shard>(),
            TypeId::of::<tp::distributed::checkpoint::Shard>(),
        ),
        (
            "distributed::rpc::DistributedOptimizer",
            TypeId::of::<tp::distributed::rpc::DistributedOptimizer>(),
            TypeId::of::<tp::distributed::optim::DistributedOptimizer>(),
        ),
        (
            "distributed::rpc::autograd::ContextGuard",
            TypeId::of::<tp::distributed::rpc::autograd::ContextGuard>(),
            TypeId::of::<tp::distributed::autograd::ContextGuard>(),
        ),
    ];
    for (case, old, new) in cases {
        assert_eq!(
            old, new,
            "case {case}: the deprecated path names another item"
        );
    }
}
