//! Model and optimizer state saved by every layout (one process, DDP, fully sharded, tensor
//! parallel, and 2-D: tensor parallel inside pairs of ranks, fully sharded across them) resume
//! in every layout at other world sizes: two AdamW steps, a save, two more steps after the
//! load, against four uninterrupted steps in one process.

use tensorplay_core::Tensor;
use tensorplay_core::nn::Module;
use tensorplay_core::optim::Optimizer;
use tensorplay_distributed_nn::checkpoint::state_dict::get_model_state_dict;
use tensorplay_distributed_nn::checkpoint::{self as dcp, AppState};
use tensorplay_testkit::{SharedDir, Tol, check_close, generator_lock};

use super::dcp::{Layout, TestResult, at, build};
use super::state_dict::{adamw, full, pair_from};

/// Rows of the whole batch.
const BATCH: usize = 8;

/// This rank's place along the data-parallel ranks of `layout` at `world`: `(index, count)`.
fn data_rank(layout: Layout, rank: usize, world: usize) -> (usize, usize) {
    match layout {
        Layout::Alone | Layout::Tp => (0, 1),
        Layout::Ddp | Layout::Fsdp => (rank, world),
        Layout::TwoD => (rank / 2, world / 2),
    }
}

/// One AdamW step of [`pair_from`]'s model on this rank's rows of step `k`'s batch.
fn train(m: &dyn Module, o: &mut dyn Optimizer, k: usize, (at, of): (usize, usize)) -> TestResult {
    let n = BATCH / of;
    let f = |i: usize, j: usize, s: f64| ((k * 11 + i * 5 + j * 3) as f64 * s).sin();
    let data = |s: f64| -> Vec<f64> {
        (at * n..(at + 1) * n)
            .flat_map(|i| (0..4).map(move |j| f(i, j, s)))
            .collect()
    };
    let x = Tensor::from_vec(data(0.41), &[n, 4])?;
    let y = Tensor::from_vec(data(0.29), &[n, 4])?;
    o.zero_grad()?;
    m.call(&x)?.sub(&y)?.pow_scalar(2.0)?.mean()?.backward()?;
    o.step()?;
    Ok(())
}

#[test]
fn optimizer_state_of_split_layouts_resumes_in_every_layout() {
    let root = SharedDir::new("dcp-layouts");
    let want = {
        let _g = generator_lock();
        let m = pair_from(5).unwrap();
        let mut o = adamw(m.parameters()).unwrap();
        for k in 0..4 {
            train(&m, &mut o, k, (0, 1)).unwrap();
        }
        m.state_dict().unwrap()
    };
    let saves = [
        (Layout::Alone, 1),
        (Layout::Ddp, 2),
        (Layout::Fsdp, 2),
        (Layout::Tp, 2),
        (Layout::TwoD, 4),
    ];
    let loads = [
        (Layout::Alone, 1),
        (Layout::Tp, 2),
        (Layout::TwoD, 4),
        (Layout::TwoD, 2),
        (Layout::Fsdp, 4),
        (Layout::Ddp, 2),
    ];
    for (saved, n) in saves {
        let dir = root.dir().join(format!("{saved:?}-{n}"));
        at(saved, n, &root, |rank| {
            let mut m = build(saved, 5)?;
            let mut o = adamw(m.parameters())?;
            for k in 0..2 {
                train(&*m, &mut o, k, data_rank(saved, rank, n))?;
            }
            let app = AppState {
                model: &mut *m,
                optimizer: Some(&mut o),
            };
            dcp::save_state(&[("app", &app)], &dir, None)?;
            Ok(())
        })
        .unwrap_or_else(|e| panic!("save as {saved:?} at {n}: {e}"));
        for (layout, world) in loads {
            let r = at(layout, world, &root, |rank| {
                let mut m = build(layout, 77)?;
                let mut o = adamw(m.parameters())?;
                {
                    let mut app = AppState {
                        model: &mut *m,
                        optimizer: Some(&mut o),
                    };
                    dcp::load_state(&mut [("app", &mut app)], &dir, None)?;
                }
                for k in 2..4 {
                    train(&*m, &mut o, k, data_rank(layout, rank, world))?;
                }
                let got = get_model_state_dict(&*m, full())?;
                for (k, w) in &want {
                    check_close(
                        &format!("rank {rank}: {k}"),
                        &got[k].to_vec_f64()?,
                        &w.to_vec_f64()?,
                        Tol::scaled(1e-12),
                    )?;
                }
                Ok(())
            });
            if let Err(e) = r {
                panic!("{saved:?} at {n} -> {layout:?} at {world}: {e}");
            }
        }
    }
}
