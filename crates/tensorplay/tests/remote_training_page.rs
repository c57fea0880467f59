//! `docs/remote-training.md`: its program is this file's `page` module, word for word (checked
//! here, so page and test cannot drift), and it runs: a `RemoteModule` on worker1 trained from
//! the driver with distributed autograd and `DistributedOptimizer`, its first step equal to the
//! same SGD step taken locally on a copy of the module, its loss falling. Also: `Hosted::into_inner`
//! (the module out of `get_module_rref().to_here()`), and RPC errors inside closures that
//! return `tp::Result`.

// page begin
mod page {
    use tensorplay as tp;
    use tp::distributed::autograd as dist_autograd;
    use tp::distributed::nn::{LinearArgs, RemoteModule, register_module};
    use tp::distributed::optim::{DistributedOptimizer, OptimizerKind};
    use tp::distributed::rpc;
    use tp::nn::{Module, functional as F};
    use tp::optim::SgdOptions;

    const LR: f64 = 0.1;

    pub(crate) fn main() -> tp::Result<()> {
        tp::distributed::spawn(2, |rank| {
            register_module::<tp::nn::Linear>(); // every worker knows the types it may build
            let name = if rank == 0 { "driver" } else { "worker1" };
            rpc::init_rpc(name, rank, 2, Default::default())?;
            if rank == 0 {
                train()?;
            }
            rpc::shutdown(true)?; // worker1 serves until the driver is done
            Ok(())
        })?;
        Ok(())
    }

    /// Fits y = x . [1, -2, 3, 0.5] with an nn::Linear that lives on worker1.
    fn train() -> tp::Result<()> {
        tp::manual_seed(0);
        let x = tp::randn(&[64, 4])?;
        let w = tp::Tensor::from_vec(vec![1.0f32, -2.0, 3.0, 0.5], &[4, 1])?;
        let y = x.matmul(&w)?;
        let args = LinearArgs {
            in_features: 4,
            out_features: 1,
            bias: true,
        };
        let model = RemoteModule::<tp::nn::Linear>::new("worker1/cpu", args)?;
        let params = model.remote_parameters(true)?; // RRefs to weight and bias on worker1
        let sgd = SgdOptions {
            lr: LR,
            ..Default::default()
        };
        let opt = DistributedOptimizer::new(OptimizerKind::Sgd(sgd), &params)?;

        // the same first step, taken here on a copy of the module, for comparison
        let copy = model.get_module_rref().to_here(None)?.into_inner()?;
        F::mse_loss(&copy.forward(&x)?, &y)?.backward()?;
        let expected = copy
            .parameters()
            .iter()
            .map(|p| p.sub(&p.grad().unwrap().mul_scalar(LR)?))
            .collect::<tp::Result<Vec<_>>>()?;

        let mut losses = Vec::new();
        for step in 0..100 {
            let ctx = dist_autograd::context()?;
            let loss = F::mse_loss(&model.forward(&x)?, &y)?; // the forward runs on worker1
            losses.push(loss.item_f64()?);
            dist_autograd::backward(ctx.id(), &[loss], false)?; // reaches worker1's parameters
            opt.step(ctx.id())?; // worker1's SGD applies the gradients of this context
            if step == 0 {
                let after = params
                    .iter()
                    .map(|p| p.to_here(None))
                    .collect::<tp::Result<Vec<_>>>()?;
                for (a, e) in after.iter().zip(&expected) {
                    let diff = a.sub(e)?.abs()?.max()?.item_f64()?;
                    assert!(
                        diff < 1e-6,
                        "the remote step differs from the local one by {diff}"
                    );
                }
            }
        }
        println!("loss {:.4} -> {:.1e} in 100 steps", losses[0], losses[99]);
        assert!(losses[99] < losses[0] / 100.0, "{losses:?}");
        Ok(())
    }
}
// page end

use tensorplay as tp;

/// The program of `docs/remote-training.md`'s first `rust` block.
fn page_block(markdown: &str) -> Option<String> {
    let start = markdown.find("```rust")?;
    let body = &markdown[start..];
    let body = &body[body.find('\n')? + 1..];
    Some(body[..body.find("```")?].to_string())
}

/// The `page` module of this file, dedented by one level (4 spaces).
fn page_module(source: &str) -> Option<String> {
    let begin = source.find("mod page {\n")? + "mod page {\n".len();
    let end = source.find("}\n// page end")?;
    let lines: Vec<&str> = source[begin..end]
        .lines()
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect();
    Some(lines.join("\n") + "\n")
}

#[test]
fn remote_training_page_is_this_test() {
    let markdown = include_str!("../../../docs/remote-training.md");
    let source = include_str!("remote_training_page.rs");
    let block = page_block(markdown).expect("docs/remote-training.md has a ```rust block");
    let module = page_module(source).expect("this file has its page module");
    // the page's `fn main` is the module's `pub(crate) fn main`
    let module = module.replacen("pub(crate) fn main()", "fn main()", 1);
    if block != module {
        let first = block
            .lines()
            .zip(module.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| block.lines().count().min(module.lines().count()));
        panic!(
            "docs/remote-training.md's program and tests/remote_training_page.rs differ at line \
             {}:\n page: {:?}\n test: {:?}",
            first + 1,
            block.lines().nth(first),
            module.lines().nth(first)
        );
    }
}

#[test]
fn remote_training_page_runs() -> tp::Result<()> {
    page::main()
}

use tp::distributed::nn::{LinearArgs, RemoteModule, register_module};
use tp::distributed::rpc::{self, RRef};
use tp::nn::Module;

/// Starts `driver` and `worker1`, runs `f` on the driver, shuts down.
fn on_driver(f: fn() -> tp::Result<()>) -> tp::Result<()> {
    tp::distributed::spawn(2, move |rank| {
        register_module::<tp::nn::Linear>();
        rpc::register("ident", |v: f64| Ok(v));
        rpc::register("fail", |(): ()| -> tp::Result<f64> {
            Err(tp::Error::InvalidArgument {
                op: "fail",
                arg: "()",
                expected: "nothing".into(),
                got: "a failure on purpose".into(),
            })
        });
        let name = if rank == 0 { "driver" } else { "worker1" };
        rpc::init_rpc(name, rank, 2, Default::default())?;
        if rank == 0 {
            f()?;
        }
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// `get_module_rref().to_here()` is a `Hosted<Linear>`; `into_inner` gives a `Linear` equal to
/// the remote one (same parameters, same outputs, same training flag), whether taken out (the
/// only handle) or rebuilt (a cloned handle, which stays usable).
#[test]
fn module_rref_to_here_gives_the_module() -> tp::Result<()> {
    on_driver(|| {
        let args = LinearArgs {
            in_features: 3,
            out_features: 2,
            bias: true,
        };
        let mut remote = RemoteModule::<tp::nn::Linear>::new("worker1/cpu", args)?;
        remote.eval()?;
        let x = tp::randn(&[5, 3])?;
        let want_out = remote.forward(&x)?.to_vec::<f32>()?;
        let want_params: Vec<Vec<f32>> = remote
            .remote_parameters(true)?
            .iter()
            .map(|p| p.to_here(None)?.to_vec::<f32>())
            .collect::<tp::Result<_>>()?;
        assert_eq!(want_params.len(), 2);
        let rref = remote.get_module_rref();
        type Case = (
            &'static str,
            fn(&RRef<tp::distributed::nn::Hosted<tp::nn::Linear>>) -> tp::Result<tp::nn::Linear>,
        );
        let cases: [Case; 2] = [
            ("the only handle: taken out", |r| {
                r.to_here(None)?.into_inner()
            }),
            ("a cloned handle: rebuilt", |r| {
                let hosted = r.to_here(None)?;
                let kept = hosted.clone();
                let m = hosted.into_inner()?;
                assert_eq!(kept.read().parameters().len(), 2, "the clone stays usable");
                Ok(m)
            }),
        ];
        for (name, take) in cases {
            let m = take(&rref)?;
            let params: Vec<Vec<f32>> = m
                .parameters()
                .iter()
                .map(|p| p.to_vec::<f32>())
                .collect::<tp::Result<_>>()?;
            assert_eq!(params, want_params, "{name}: parameters");
            assert_eq!(m.forward(&x)?.to_vec::<f32>()?, want_out, "{name}: outputs");
            assert!(
                !m.is_training(),
                "{name}: the remote module is in eval mode"
            );
        }
        Ok(())
    })
}

/// RRef fetches inside closures (`collect`, `and_then`), in each form a program may write:
/// `to_here`'s `tp::Result` as it is, `?` into `rpc::Result` (the RPC error comes back as
/// itself, not `Core(External(..))`), and `to_here_async`'s RPC error converted by `?` into
/// `tp::Result`. The values, or the owner's error carried whole, naming the worker.
#[test]
fn rpc_errors_convert_inside_closures() -> tp::Result<()> {
    /// What a result shows: its values, or the kind and worker of the RPC error it carries
    /// (an `rpc::Error` itself, or inside a `tp::Error`).
    fn shown<T: std::fmt::Debug, E: std::fmt::Display + 'static>(r: Result<T, E>) -> String {
        let e = match r {
            Ok(v) => return format!("{v:?}"),
            Err(e) => e,
        };
        let any = &e as &dyn std::any::Any;
        let carried = any.downcast_ref::<rpc::Error>().or_else(|| {
            any.downcast_ref::<tp::Error>()
                .and_then(|e| e.downcast_ref::<rpc::Error>())
        });
        match carried {
            Some(rpc::Error::Remote {
                worker,
                kind,
                message,
            }) => format!("{kind} on {worker}: {}", message.contains("on purpose")),
            _ => format!("other error: {e}"),
        }
    }
    on_driver(|| {
        type Form = fn(&[RRef<f64>]) -> String;
        let forms: [(&str, Form); 4] = [
            ("collect into tp::Result", |rrefs| {
                shown(
                    rrefs
                        .iter()
                        .map(|r| r.to_here(None))
                        .collect::<tp::Result<Vec<_>>>(),
                )
            }),
            ("and_then on a tp::Result", |rrefs| {
                let started: tp::Result<()> = Ok(());
                let first = started.and_then(|_| rrefs[0].to_here(None));
                shown(first.and_then(|a| rrefs[1].to_here(None).map(|b| vec![a, b])))
            }),
            ("? into rpc::Result", |rrefs| {
                shown(
                    rrefs
                        .iter()
                        .map(|r| Ok(r.to_here(None)?))
                        .collect::<rpc::Result<Vec<_>>>(),
                )
            }),
            ("to_here_async, ? into tp::Result", |rrefs| {
                shown(
                    rrefs
                        .iter()
                        .map(|r| Ok(r.to_here_async(None)?.wait()?))
                        .collect::<tp::Result<Vec<_>>>(),
                )
            }),
        ];
        let good = |v: f64| rpc::remote::<f64, f64>("worker1", "ident", v, None);
        let bad = || rpc::remote::<(), f64>("worker1", "fail", (), None);
        for (form, fetch) in forms {
            let cases = [
                ("all fetched", [good(1.5)?, good(-2.0)?], "[1.5, -2.0]"),
                (
                    "the second failed",
                    [good(1.5)?, bad()?],
                    "InvalidArgument on worker1: true",
                ),
                (
                    "the first failed",
                    [bad()?, good(3.0)?],
                    "InvalidArgument on worker1: true",
                ),
            ];
            for (name, rrefs, want) in cases {
                assert_eq!(fetch(&rrefs), want, "{form}, {name}");
            }
        }
        Ok(())
    })
}
