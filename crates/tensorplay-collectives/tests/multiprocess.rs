//! Multi-process tests of the collectives: real processes through `spawn`, talking over
//! 127.0.0.1 with the "cpu" backend. Every result is compared with the same computation done in
//! one process. Many checks are batched into each spawned world to keep the suite fast.

use std::time::Duration;

use tensorplay_collectives::{self as dist, InitOptions, ReduceOp};
use tensorplay_core::{DType, Tensor};

#[path = "multiprocess/blame.rs"]
mod blame;
#[path = "multiprocess/device_mesh.rs"]
mod device_mesh;
#[path = "multiprocess/double.rs"]
mod double;
#[path = "multiprocess/low_precision.rs"]
mod low_precision;
#[path = "multiprocess/one_bad_rank.rs"]
mod one_bad_rank;
#[path = "multiprocess/shm_cma.rs"]
mod shm_cma;
#[path = "multiprocess/shm_paths.rs"]
mod shm_paths;

use tensorplay_testkit::backend_suite::{
    Case, Ctx, TestResult, all_collectives, as_f64, check, check_case, check_named, ops_for,
    reduce_ref, tensor, values,
};

fn init(timeout_s: u64) -> dist::Result<()> {
    dist::init_process_group(
        "cpu",
        InitOptions {
            timeout: Duration::from_secs(timeout_s),
            ..Default::default()
        },
    )
}

/// A serde value with what JSON would lose: NaN, a map with non-string keys, nesting.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Obj {
    rank: usize,
    name: String,
    weights: Vec<f64>,
    by_id: std::collections::BTreeMap<(u8, i64), Option<bool>>,
}

fn obj(rank: usize) -> Obj {
    Obj {
        rank,
        name: "r".repeat(rank * 7 + 1), // a different size on every rank
        weights: vec![f64::NAN, -0.0, rank as f64 + 0.5],
        by_id: [
            ((rank as u8, -(rank as i64)), Some(rank.is_multiple_of(2))),
            ((9, 9), None),
        ]
        .into(),
    }
}

/// A value whose `Serialize` fails.
struct Unserializable;
impl serde::Serialize for Unserializable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "cannot serialize this on purpose",
        ))
    }
}
impl<'de> serde::Deserialize<'de> for Unserializable {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Ok(Unserializable)
    }
}

/// `all_gather_object` and `broadcast_object_list` against the values every rank can compute.
const OBJECT_CASES: &[Case] = &[
    Case {
        name: "all_gather_object",
        run: gather_objects,
    },
    Case {
        name: "empty objects",
        run: empty_objects,
    },
    Case {
        name: "broadcast_object_list",
        run: broadcast_objects,
    },
    Case {
        name: "empty object list",
        run: broadcast_empty_list,
    },
    Case {
        name: "objects of other types",
        run: objects_of_other_types,
    },
    Case {
        name: "unserializable object",
        run: unserializable_object,
    },
];

/// all_gather_object and broadcast_object_list against the values every rank can compute:
/// [`OBJECT_CASES`] in order, stopping at the first that fails.
fn object_collectives(rank: usize, n: usize) -> TestResult {
    let members: Vec<usize> = (0..n).collect();
    let cx = Ctx {
        rank,
        n,
        group: None,
        members: &members,
        me: rank,
        k: n,
    };
    for case in OBJECT_CASES {
        check_case(case, &cx)?;
    }
    Ok(())
}

/// All_gather_object of values JSON would lose.
fn gather_objects(cx: &Ctx<'_>) -> TestResult {
    let &Ctx { rank, n, .. } = cx;
    let got = dist::all_gather_object(&obj(rank), None)?;
    assert_eq!(got.len(), n);
    for (r, g) in got.iter().enumerate() {
        let want = obj(r);
        assert_eq!(g.rank, want.rank);
        assert_eq!(g.name, want.name);
        assert_eq!(g.by_id, want.by_id);
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&g.weights),
            bits(&want.weights),
            "rank {rank}: from {r}"
        );
    }
    Ok(())
}

/// An empty value and a unit value.
fn empty_objects(cx: &Ctx<'_>) -> TestResult {
    let &Ctx { n, .. } = cx;
    // an empty value and a unit value
    assert_eq!(dist::all_gather_object(&(), None)?.len(), n);
    let empty: Vec<Vec<u8>> = dist::all_gather_object(&Vec::new(), None)?;
    assert_eq!(empty, vec![Vec::<u8>::new(); n]);
    Ok(())
}

/// Broadcast_object_list from the last rank.
fn broadcast_objects(cx: &Ctx<'_>) -> TestResult {
    let &Ctx { rank, n, .. } = cx;
    // broadcast from the last rank; the others start with lists of other lengths
    let src = n - 1;
    let mut list: Vec<Obj> = if rank == src {
        vec![obj(src), obj(0)]
    } else {
        vec![obj(rank); rank]
    };
    dist::broadcast_object_list(&mut list, src, None)?;
    assert_eq!(list.len(), 2, "rank {rank}");
    assert_eq!((list[0].rank, list[1].rank), (src, 0), "rank {rank}");
    assert_eq!(list[1].name, obj(0).name);
    Ok(())
}

/// An empty list broadcasts as an empty list.
fn broadcast_empty_list(cx: &Ctx<'_>) -> TestResult {
    let &Ctx { rank, .. } = cx;
    // an empty list broadcasts as an empty list
    let mut none: Vec<String> = if rank == 0 { vec![] } else { vec!["x".into()] };
    dist::broadcast_object_list(&mut none, 0, None)?;
    assert!(none.is_empty(), "rank {rank}: {none:?}");
    Ok(())
}

/// A rank sending another type.
fn objects_of_other_types(cx: &Ctx<'_>) -> TestResult {
    let &Ctx { rank, n, .. } = cx;
    if n > 1 {
        // a rank sending another type: a Mismatch naming the rank, not a wrong value
        let r = if rank == 0 {
            dist::all_gather_object(&"a string".to_string(), None).map(|_| ())
        } else {
            dist::all_gather_object(&7u8, None).map(|_| ())
        };
        let e = r.expect_err("types differ").to_string();
        assert!(
            e.contains("all_gather_object") && e.contains("decode"),
            "{e}"
        );
    }
    Ok(())
}

/// A value the last rank cannot serialize.
fn unserializable_object(cx: &Ctx<'_>) -> TestResult {
    let &Ctx { rank, n, .. } = cx;
    if n > 1 {
        // a value the last rank cannot serialize: every rank fails at once, none waits
        let r = if rank == n - 1 {
            dist::all_gather_object(&Unserializable, None).map(|_| ())
        } else {
            dist::all_gather_object(&7u8, None).map(|_| ())
        };
        let e = r.expect_err("one rank cannot serialize").to_string();
        let want = if rank == n - 1 {
            "a value serde can serialize".to_string()
        } else {
            format!("rank {} could not serialize", n - 1)
        };
        assert!(e.contains(&want), "rank {rank}: {e}");
    }
    Ok(())
}

fn world(n: usize) -> TestResult {
    dist::spawn::spawn(n, move |rank| -> TestResult {
        init(30)?;
        all_collectives(rank, n, None, &(0..n).collect::<Vec<_>>())?;
        check_named("world size, rank and backend", || {
            assert_eq!(dist::get_world_size(None)?, n);
            assert_eq!(dist::get_rank(None)?, rank);
            assert_eq!(dist::get_backend(None)?, "cpu");
            Ok(())
        })?;
        object_collectives(rank, n)?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

#[test]
fn world_size_1_is_identity() -> TestResult {
    world(1)
}

#[test]
fn world_size_2() -> TestResult {
    world(2)
}

#[test]
fn world_size_3() -> TestResult {
    world(3)
}

#[test]
fn world_size_4_with_subgroups() -> TestResult {
    dist::spawn::spawn(4, |rank| -> TestResult {
        init(30)?;
        all_collectives(rank, 4, None, &[0, 1, 2, 3])?;
        // every rank creates every group, in the same order
        let g123 = dist::new_group(&[1, 2, 3], None, None)?;
        let g02 = dist::new_group(&[0, 2], None, None)?;
        let g13 = dist::new_group(&[1, 3], None, None)?;
        check_named("subgroup [1, 2, 3]", || {
            if rank >= 1 {
                assert_eq!(g123.rank(), Some(rank - 1));
                assert_eq!(dist::get_rank(Some(&g123))?, rank - 1);
                assert_eq!(g123.global_rank(0)?, 1);
                all_collectives(rank, 4, Some(&g123), &[1, 2, 3])?;
            } else {
                assert_eq!(g123.rank(), None);
                let e = dist::get_rank(Some(&g123)).unwrap_err();
                assert!(
                    matches!(&e, dist::Error::InvalidArgument { rank: 0, arg, .. } if arg == "group"),
                    "{e:?}"
                );
                let e = e.to_string();
                assert!(e.contains("get_rank") && e.contains("[1, 2, 3]"), "{e}");
                let t = Tensor::zeros(&[1], DType::F32)?;
                assert!(dist::all_reduce(&t, ReduceOp::Sum, Some(&g123)).is_err());
            }
            Ok(())
        })?;
        // two overlapping groups used alternately: the world and the pairs
        check_named("overlapping pair groups", || {
            let pair = if rank % 2 == 0 { &g02 } else { &g13 };
            for i in 0..3 {
                let t = tensor(&[rank as f64 + i as f64], &[1], DType::F64);
                dist::all_reduce(&t, ReduceOp::Sum, Some(pair))?;
                let partner = rank ^ 2;
                check(
                    "pair group",
                    as_f64(&t),
                    vec![(rank + partner) as f64 + 2.0 * i as f64],
                )?;
                let w = tensor(&[1.0], &[1], DType::F64);
                dist::all_reduce(&w, ReduceOp::Sum, None)?;
                check("world between pair ops", as_f64(&w), vec![4.0])?;
            }
            Ok(())
        })?;
        // src is a global rank; one outside the group is an error
        check_named("global src outside the group", || {
            let t = Tensor::zeros(&[2], DType::F32)?;
            if rank % 2 == 1 {
                let e = dist::broadcast(&t, 0, Some(&g13)).unwrap_err();
                assert!(e.to_string().contains("src"), "{e}");
                dist::broadcast(&t, 3, Some(&g13))?;
            }
            Ok(())
        })?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

#[test]
fn mismatched_shapes_are_an_error_on_every_rank() -> TestResult {
    dist::spawn::spawn(2, |rank| -> TestResult {
        init(10)?;
        let t = Tensor::zeros(&[3 + rank], DType::F32)?;
        let e = dist::all_reduce(&t, ReduceOp::Sum, None).unwrap_err();
        assert!(
            matches!(&e, dist::Error::Mismatch { detail, .. } if detail.ranks() == [0, 1]),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("rank 0 passed float32 [3]") && msg.contains("rank 1 passed float32 [4]"),
            "{msg}"
        );
        // splits that disagree
        let x = Tensor::zeros(&[4], DType::F32)?;
        let y = Tensor::zeros(&[4], DType::F32)?;
        let splits: &[usize] = if rank == 0 { &[1, 3] } else { &[2, 2] };
        let e = dist::all_to_all_single(&y, &x, Some(&[2, 2]), Some(splits), None).unwrap_err();
        assert!(matches!(&e, dist::Error::Mismatch { .. }), "{e:?}");
        assert!(e.to_string().contains("sends"), "{e}");
        // bad arguments on one rank only: that rank gets its own error, the other a mismatch
        // naming it, and both stay in step for the next call
        let t = if rank == 0 {
            Tensor::zeros(&[2], DType::Bool)?
        } else {
            Tensor::zeros(&[2], DType::F32)?
        };
        let e = dist::all_reduce(&t, ReduceOp::Sum, None).unwrap_err();
        // the rank that rejected its own arguments: a field of either error
        let own_or_named = |e: &dist::Error, bad: usize, arg: &str| match e {
            dist::Error::InvalidArgument { rank, arg: a, .. } => *rank == bad as i64 && a == arg,
            // "rank(s) [bad] rejected their own arguments: rank bad: ..."
            dist::Error::Mismatch { detail, .. } => {
                detail.parts().get(1) == Some(&dist::Part::Ranks(vec![bad]))
                    && detail.contains("rejected their own arguments")
            }
            _ => false,
        };
        assert!(own_or_named(&e, 0, "tensor"), "{e:?}");
        assert_eq!(rank == 0, matches!(e, dist::Error::InvalidArgument { .. }));
        if rank == 0 {
            assert!(
                e.to_string()
                    .contains("float32, float64, int64, bfloat16 or float16"),
                "{e}"
            );
        }
        let t = Tensor::zeros(&[2], DType::F32)?;
        let e = dist::broadcast(&t, if rank == 0 { 9 } else { 0 }, None).unwrap_err();
        assert!(own_or_named(&e, 0, "src"), "{e:?}");
        let out = Tensor::zeros(&[4 + rank], DType::F32)?; // wrong size on rank 1 only
        let e = dist::all_gather_into_tensor(&out, &Tensor::zeros(&[2], DType::F32)?, None)
            .unwrap_err();
        assert!(own_or_named(&e, 1, "output"), "{e:?}");
        if rank == 1 {
            assert!(e.to_string().contains("elements"), "{e}");
        }
        let out = Tensor::zeros(&[2], DType::I64)?;
        let op = if rank == 0 {
            ReduceOp::Avg
        } else {
            ReduceOp::Sum
        }; // Avg on int64: rank 0 only
        let e = dist::reduce_scatter_tensor(&out, &Tensor::zeros(&[4], DType::I64)?, op, None)
            .unwrap_err();
        assert!(own_or_named(&e, 0, "op"), "{e:?}");
        if rank == 0 {
            assert!(e.to_string().contains("Avg"), "{e}");
        }
        // the group still works afterwards
        let ok = Tensor::ones(&[2], DType::F32)?;
        dist::all_reduce(&ok, ReduceOp::Sum, None)?;
        check("after mismatch", as_f64(&ok), vec![2.0, 2.0])?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

#[test]
fn bad_arguments_are_clear_errors() -> TestResult {
    let t = Tensor::zeros(&[2], DType::F32)?;
    let e = dist::all_reduce(&t, ReduceOp::Sum, None).unwrap_err();
    assert!(matches!(e, dist::Error::NotInitialized { .. }), "{e}");
    dist::spawn::spawn(2, |rank| -> TestResult {
        init(10)?;
        let t = Tensor::zeros(&[2], DType::F32)?;
        let e = dist::broadcast(&t, 5, None).unwrap_err();
        assert!(e.to_string().contains("src"), "{e}");
        let b = Tensor::zeros(&[2], DType::Bool)?;
        assert!(dist::all_reduce(&b, ReduceOp::Sum, None).is_err());
        let f = Tensor::zeros(&[2], DType::F32)?;
        assert!(dist::all_reduce(&f, ReduceOp::BXor, None).is_err());
        let expanded = Tensor::zeros(&[1], DType::F32)?.expand(&[3])?;
        assert!(dist::all_reduce(&expanded, ReduceOp::Sum, None).is_err());
        if rank == 0 {
            assert!(dist::send(&t, 0, None, 0).is_err());
        }
        let cuda = t.to("cuda");
        assert!(cuda.is_err()); // no GPU on CI; a CUDA tensor would be refused by "cpu" too
        assert!(dist::init_process_group("cpu", InitOptions::default()).is_err());
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}

#[test]
fn a_dead_rank_is_reported_not_a_hang() -> TestResult {
    dist::spawn::spawn(3, |rank| -> TestResult {
        init(5)?;
        if rank == 2 {
            std::process::exit(0); // dies without taking part
        }
        let t = Tensor::ones(&[4], DType::F32)?;
        let start = std::time::Instant::now();
        let e = dist::all_reduce(&t, ReduceOp::Sum, None).unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "took {:?}",
            start.elapsed()
        );
        // rank 2 is named by a field: the peer that failed, or a rank waited for
        let names_2 = match &e {
            dist::Error::PeerFailed { peer, detail, .. } => {
                *peer == 2 || detail.ranks().contains(&2)
            }
            dist::Error::Timeout { detail, .. } => detail.ranks().contains(&2),
            _ => false,
        };
        assert!(names_2, "the error names rank 2: {e:?}");
        Ok(())
    })?;
    Ok(())
}

#[test]
fn a_rank_that_never_joins_times_out() -> TestResult {
    // notes every 0.4 s, on stderr as under tensorplay-run
    let opts = dist::SpawnOptions {
        env: vec![
            ("TENSORPLAY_RDZV_REPORT_SECS".into(), "0.4".into()),
            ("TENSORPLAY_RUN".into(), "1".into()),
        ],
        ..dist::SpawnOptions::new(3)
    };
    let r = dist::spawn::spawn_with(opts, |rank| -> TestResult {
        if rank == 2 {
            return Ok(()); // never calls init_process_group
        }
        let start = std::time::Instant::now();
        let e = init(3).unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "took {:?}",
            start.elapsed()
        );
        // rank 0 hosts the store: it names the missing rank. The others name it too, unless
        // rank 0 has already given up and exited, taking the store with it: then they report
        // the store as gone, which is also an error in time rather than a hang.
        let msg = e.to_string();
        let names_rank = msg.contains("2 of 3") || msg.contains("rank 2") || msg.contains("[2]");
        assert!(names_rank || (rank != 0 && msg.contains("store")), "{msg}");
        if rank == 0 {
            // give the others time to see the timeout themselves before the store goes away,
            // then fail on purpose so that the parent gets this rank's output
            std::thread::sleep(Duration::from_millis(500));
            return Err("rank 0 ends here on purpose".into());
        }
        Ok(())
    });
    let Err(dist::Error::Spawn {
        rank,
        reason,
        output,
    }) = r
    else {
        return Err(format!("expected rank 0's failure on purpose, got {r:?}").into());
    };
    assert_eq!(rank, 0, "{output}");
    // the failure line is quoted in the reason (and kept out of the output)
    assert!(reason.contains("rank 0 ends here on purpose"), "{reason}");
    // while waiting, rank 0 said who it waited for (several times in 3 s)
    let notes = output
        .lines()
        .filter(|l| {
            l.contains("rendezvous: rank 0 has waited") && l.contains("waiting for ranks 2")
        })
        .count();
    assert!(notes >= 2, "{notes} notes in: {output}");
    Ok(())
}

#[test]
fn nccl_without_gpu_is_a_clear_error() {
    if tensorplay_core::cuda::is_available() {
        return;
    }
    let e = dist::spawn::spawn(1, |_rank| -> TestResult {
        tensorplay_nccl::register();
        let e = dist::init_process_group(
            "nccl",
            InitOptions {
                timeout: Duration::from_secs(5),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("libcuda") || e.to_string().contains("GPU"),
            "{e}"
        );
        Ok(())
    });
    assert!(e.is_ok(), "{e:?}");
}

/// Regression: an `irecv` posted before the matching `isend` used to hold the backend's lock
/// while it waited, so the `isend` behind it never ran and both ranks timed out.
#[test]
fn irecv_posted_before_isend_does_not_block_it() -> TestResult {
    dist::spawn::spawn(2, |rank| -> TestResult {
        init(10)?;
        let peer = 1 - rank;
        for round in 0..3u64 {
            let inp = Tensor::zeros(&[4], DType::F64)?;
            let wr = dist::irecv(&inp, peer, None, round)?;
            // give the receive time to start waiting before the send is posted
            std::thread::sleep(Duration::from_millis(50));
            let v = (round * 10) as f64 + rank as f64;
            let out = tensor(&[v; 4], &[4], DType::F64);
            let ws = dist::isend(&out, peer, None, round)?;
            ws.wait(Some(Duration::from_secs(10)))?;
            wr.wait(Some(Duration::from_secs(10)))?;
            let want = (round * 10) as f64 + peer as f64;
            check("irecv before isend", as_f64(&inp), vec![want; 4])?;
        }
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}
