//! Every schedule on every shape up to 8 ranks, 16 micro-batches and 4 stages per rank,
//! through the simulator; the text form; broken lists that the simulator must refuse.

use super::super::sim::{Costs, simulate};
use super::*;

const KINDS: [ScheduleKind; 4] = [
    ScheduleKind::GPipe,
    ScheduleKind::OneFOneB,
    ScheduleKind::Interleaved1F1B,
    ScheduleKind::InterleavedZeroBubble,
];

/// Every shape the schedule accepts up to the limits, and the count refused.
fn shapes(kind: ScheduleKind) -> (Vec<PipelineShape>, usize) {
    let (mut ok, mut refused) = (vec![], 0);
    for ranks in 1..=8 {
        for stages_per_rank in 1..=4 {
            for microbatches in 1..=16 {
                let shape = PipelineShape {
                    ranks,
                    stages_per_rank,
                    microbatches,
                };
                match kind.check(&shape) {
                    Ok(()) => ok.push(shape),
                    Err(_) => refused += 1,
                }
            }
        }
    }
    (ok, refused)
}

#[test]
fn every_schedule_on_every_shape_is_complete_ordered_and_deadlock_free() {
    let mut ran = 0;
    for kind in KINDS {
        let (ok, _) = shapes(kind);
        assert!(!ok.is_empty(), "{kind}: no shape");
        for shape in ok {
            let lists = kind.actions(&shape).unwrap();
            let case = format!("{kind} on {shape:?}");
            let rep = simulate(&shape, &lists, &Costs::default())
                .unwrap_or_else(|e| panic!("{case}: {e}"));
            let theory = kind.theoretical_bubble(&shape);
            let (p, m) = (shape.ranks, shape.microbatches);
            match kind {
                ScheduleKind::GPipe | ScheduleKind::OneFOneB => {
                    assert!(
                        (rep.bubble - theory).abs() < 1e-12,
                        "{case}: bubble {} vs {theory}",
                        rep.bubble
                    );
                }
                ScheduleKind::Interleaved1F1B => {
                    // Megatron's bound, and never worse than 1F1B's
                    let one_f_one_b = (p as f64 - 1.0) / (m as f64 + p as f64 - 1.0);
                    assert!(
                        rep.bubble <= one_f_one_b + 1e-12,
                        "{case}: bubble {} > 1F1B's {one_f_one_b}",
                        rep.bubble
                    );
                    assert!(
                        rep.bubble <= theory + 1e-12 || shape.stages_per_rank == 1,
                        "{case}: bubble {} > {theory}",
                        rep.bubble
                    );
                }
                ScheduleKind::InterleavedZeroBubble => {
                    let base = simulate(
                        &shape,
                        &ScheduleKind::Interleaved1F1B.actions(&shape).unwrap(),
                        &Costs::default(),
                    )
                    .unwrap();
                    assert!(
                        rep.bubble <= base.bubble + 1e-12,
                        "{case}: bubble {} > interleaved 1F1B's {}",
                        rep.bubble,
                        base.bubble
                    );
                    if p > 1 {
                        assert!(
                            rep.bubble < base.bubble,
                            "{case}: no bubble filled ({})",
                            rep.bubble
                        );
                    }
                }
            }
            // memory: 1F1B holds at most p - r micro-batches on rank r, GPipe all m
            for (r, &peak) in rep.peak_in_flight.iter().enumerate() {
                match kind {
                    ScheduleKind::OneFOneB => assert_eq!(peak, (p - r).min(m), "{case}: rank {r}"),
                    ScheduleKind::GPipe => assert_eq!(peak, m, "{case}: rank {r}"),
                    _ => {}
                }
            }
            ran += 1;
        }
    }
    // GPipe and 1F1B: m >= p, 100 shapes each; the interleaved two: m a multiple of p,
    // 42 (p, m) pairs times 4 values of v, each
    assert_eq!(ran, 2 * 100 + 2 * 4 * 42, "shapes run");
}

#[test]
fn shapes_a_schedule_cannot_run_are_refused_with_the_argument() {
    let cases: [(ScheduleKind, PipelineShape, &str); 5] = [
        (
            ScheduleKind::OneFOneB,
            PipelineShape {
                ranks: 4,
                stages_per_rank: 1,
                microbatches: 3,
            },
            "n_microbatches must be at least the pipeline's 4 ranks, got 3",
        ),
        (
            ScheduleKind::GPipe,
            PipelineShape {
                ranks: 2,
                stages_per_rank: 2,
                microbatches: 4,
            },
            "stages per rank must be 1",
        ),
        (
            ScheduleKind::Interleaved1F1B,
            PipelineShape {
                ranks: 2,
                stages_per_rank: 2,
                microbatches: 5,
            },
            "a multiple of the pipeline's 2 ranks, got 5",
        ),
        (
            ScheduleKind::InterleavedZeroBubble,
            PipelineShape {
                ranks: 0,
                stages_per_rank: 2,
                microbatches: 4,
            },
            "num_stages (ranks) must be at least 1",
        ),
        (
            ScheduleKind::Interleaved1F1B,
            PipelineShape {
                ranks: 2,
                stages_per_rank: 0,
                microbatches: 4,
            },
            "stages per rank must be at least 1",
        ),
    ];
    for (kind, shape, want) in cases {
        let err = kind.actions(&shape).unwrap_err().to_string();
        assert!(err.contains(want), "{kind} {shape:?}: {err}");
        assert!(err.starts_with(kind.name()), "{kind}: {err}");
    }
}

#[test]
fn one_f_one_b_lists_are_pytorchs() {
    // 2 ranks, 4 micro-batches: rank 0 warms up with one forward
    let shape = PipelineShape {
        ranks: 2,
        stages_per_rank: 1,
        microbatches: 4,
    };
    let csv = to_csv(&ScheduleKind::OneFOneB.actions(&shape).unwrap());
    assert_eq!(
        csv,
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0F2,0SEND_F2,0RECV_B1,0B1,0F3,0SEND_F3,0RECV_B2,0B2,0RECV_B3,0B3\n\
         1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1,1RECV_F2,1F2,1B2,1SEND_B2,1RECV_F3,1F3,1B3,1SEND_B3\n"
    );
}

#[test]
fn the_text_form_round_trips_and_names_bad_cells() {
    for kind in KINDS {
        let shape = PipelineShape {
            ranks: 4,
            stages_per_rank: if kind.is_multi_stage() { 2 } else { 1 },
            microbatches: 8,
        };
        let lists = kind.actions(&shape).unwrap();
        assert_eq!(from_csv(&to_csv(&lists)).unwrap(), lists, "{kind}");
    }
    let cases: [(&str, usize, &str); 5] = [
        ("0F0,0X1\n", 1, "0X1"),
        ("0F0\n1F\n", 2, "1F"),
        ("F0\n", 1, "F0"),
        ("0F0,0SEND_F\n", 1, "0SEND_F"),
        (
            "0F0\n\n0F99999999999999999999999\n",
            3,
            "0F99999999999999999999999",
        ),
    ];
    for (text, line, token) in cases {
        let e = from_csv(text).unwrap_err();
        assert_eq!((e.line, e.token.as_str()), (line, token), "{text:?}");
    }
    assert_eq!(
        "  12RECV_B3 ".parse::<Action>().unwrap(),
        Action::new(12, ActionKind::RecvB, 3)
    );
}

/// A deliberately broken list, and the error the simulator must give.
fn broken(name: &str) -> (PipelineShape, Vec<Vec<Action>>, &'static str) {
    let shape = PipelineShape {
        ranks: 2,
        stages_per_rank: 1,
        microbatches: 4,
    };
    let mut lists = ScheduleKind::OneFOneB.actions(&shape).unwrap();
    let find = |l: &Vec<Action>, s: &str| l.iter().position(|a| a.to_string() == s).unwrap();
    let want = match name {
        "backward before forward" => {
            let (i, j) = (find(&lists[1], "1F0"), find(&lists[1], "1B0"));
            lists[1].swap(i, j);
            "rank 1: action 1 (1B0) runs before its forward 1F0"
        }
        "receives swapped" => {
            let (i, j) = (find(&lists[1], "1RECV_F0"), find(&lists[1], "1RECV_F1"));
            lists[1].swap(i, j);
            "rank 1 receives 1RECV_F1 as message 0 from rank 0, which sends 0SEND_F0"
        }
        "send before compute" => {
            let (i, j) = (find(&lists[0], "0F1"), find(&lists[0], "0SEND_F1"));
            lists[0].swap(i, j);
            "rank 0: action 2 (0SEND_F1) runs before its forward of stage 0 micro-batch 1"
        }
        "missing backward" => {
            let i = find(&lists[0], "0B2");
            lists[0].remove(i);
            "rank 0 lacks 0B2"
        }
        "wrong rank" => {
            lists[0].push(Action::new(1, ActionKind::Forward, 0));
            "rank 0: action 16 (1F0): stage 1 runs on rank 1"
        }
        "deadlock" => {
            // rank 0 waits for the gradient of micro-batch 0 before it sends micro-batch 0
            let i = find(&lists[0], "0RECV_B0");
            let a = lists[0].remove(i);
            lists[0].insert(0, a);
            "the schedule deadlocks: rank 0 waits at action 0 (0RECV_B0) for rank 1's 1SEND_B0, and rank 1 is at action 0 (1RECV_F0)"
        }
        other => panic!("no case {other}"),
    };
    (shape, lists, want)
}

#[test]
fn broken_lists_fail_the_simulator_with_the_rank_and_action() {
    for name in [
        "backward before forward",
        "receives swapped",
        "send before compute",
        "missing backward",
        "wrong rank",
        "deadlock",
    ] {
        let (shape, lists, want) = broken(name);
        let err = simulate(&shape, &lists, &Costs::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{name}: {err}");
    }
}

#[test]
fn timelines_are_drawn_as_run() {
    let shape = PipelineShape {
        ranks: 2,
        stages_per_rank: 1,
        microbatches: 4,
    };
    let draw = |kind: ScheduleKind| {
        let lists = kind.actions(&shape).unwrap();
        simulate(&shape, &lists, &Costs::default())
            .unwrap()
            .draw(&Costs::default())
    };
    assert_eq!(
        draw(ScheduleKind::OneFOneB),
        "rank 0: F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3\n\
         rank 1: .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .\n"
    );
    assert_eq!(
        draw(ScheduleKind::GPipe),
        "rank 0: F0 F1 F2 F3 .  .  .  B0 B0 B1 B1 B2 B2 B3 B3\n\
         rank 1: .  F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .  .\n"
    );
}

#[test]
fn shapes_and_costs_out_of_range_are_refused_not_panics() {
    let huge = PipelineShape {
        ranks: 1 << 40,
        stages_per_rank: 1 << 40,
        microbatches: 4,
    };
    assert!(simulate(&huge, &[], &Costs::default()).is_err());
    let long = PipelineShape {
        ranks: 1,
        stages_per_rank: 1,
        microbatches: 1 << 60,
    };
    let e = ScheduleKind::GPipe.actions(&long).unwrap_err().to_string();
    assert!(e.contains("(stage, micro-batch) pairs per step"), "{e}");
    let shape = PipelineShape {
        ranks: 2,
        stages_per_rank: 1,
        microbatches: 4,
    };
    let lists = ScheduleKind::OneFOneB.actions(&shape).unwrap();
    for bad in [f64::NAN, -1.0, f64::INFINITY] {
        let costs = Costs {
            forward: bad,
            ..Costs::default()
        };
        let e = simulate(&shape, &lists, &costs).unwrap_err().to_string();
        assert!(e.contains("costs.forward must be a finite time"), "{e}");
    }
    let slow = Costs {
        forward: 1e30,
        ..Costs::default()
    };
    let drawn = simulate(&shape, &lists, &slow).unwrap().draw(&slow);
    assert!(drawn.contains("too long to draw"), "{drawn}");
}
