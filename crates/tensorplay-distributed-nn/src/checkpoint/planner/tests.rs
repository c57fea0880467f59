//! The planner in memory: tables of save plans, and a simulator that saves a tensor laid out
//! one way over N ranks and loads it laid out another way over M ranks, element by element.

use proptest::prelude::*;

use super::*;

fn chunk(offsets: &[usize], sizes: &[usize]) -> ChunkStorageMetadata {
    ChunkStorageMetadata {
        offsets: offsets.to_vec(),
        sizes: sizes.to_vec(),
    }
}

fn offer(fqn: &str, size: &[usize], offsets: &[usize], sizes: &[usize]) -> WriteOffer {
    WriteOffer {
        fqn: fqn.into(),
        dtype: "F32".into(),
        size: size.to_vec(),
        offsets: offsets.to_vec(),
        sizes: sizes.to_vec(),
    }
}

/// How the ranks of a layout hold a tensor.
#[derive(Debug, Clone, Copy)]
enum Layout {
    /// Every rank the whole.
    Replicated,
    /// `torch.chunk` pieces along `dim` (fully sharded: dim 0; tensor parallel: 0 or 1).
    Chunked { dim: usize },
    /// Rank `r` holds the chunk of every one of `stacked` equal blocks along dim 0 (a fused
    /// q/k/v projection split by tensor parallelism).
    Stacked { stacked: usize },
}

/// Rank `rank`'s pieces of a tensor of `shape` under `layout` over `world` ranks, with their
/// offsets in its local tensor.
fn pieces(shape: &[usize], layout: Layout, rank: usize, world: usize) -> Vec<LocalChunk> {
    let whole = chunk(&vec![0; shape.len()], shape);
    match layout {
        Layout::Replicated => vec![LocalChunk {
            local_offsets: vec![0; shape.len()],
            chunk: whole,
        }],
        Layout::Chunked { dim } => {
            let n = shape[dim];
            let per = n.div_ceil(world);
            let (start, end) = ((rank * per).min(n), ((rank + 1) * per).min(n));
            let mut c = whole;
            c.offsets[dim] = start;
            c.sizes[dim] = end - start;
            vec![LocalChunk {
                local_offsets: vec![0; shape.len()],
                chunk: c,
            }]
        }
        Layout::Stacked { stacked } => {
            let block = shape[0] / stacked;
            let piece = block / world;
            (0..stacked)
                .map(|i| {
                    let mut c = whole.clone();
                    c.offsets[0] = i * block + rank * piece;
                    c.sizes[0] = piece;
                    let mut local_offsets = vec![0; shape.len()];
                    local_offsets[0] = i * piece;
                    LocalChunk {
                        chunk: c,
                        local_offsets,
                    }
                })
                .collect()
        }
    }
}

/// The local tensor's shape: the extent of its pieces.
fn local_shape(shape: &[usize], p: &[LocalChunk]) -> Vec<usize> {
    let mut s = vec![0; shape.len()];
    for c in p {
        for ((e, o), n) in s.iter_mut().zip(&c.local_offsets).zip(&c.chunk.sizes) {
            *e = (*e).max(o + n);
        }
    }
    if p.is_empty() {
        vec![0; shape.len()]
    } else {
        s
    }
}

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut st = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        st[d] = st[d + 1] * shape[d + 1];
    }
    st
}

/// Every index of the box `sizes`, row-major.
fn each_index(sizes: &[usize], mut f: impl FnMut(&[usize])) {
    if sizes.contains(&0) {
        return;
    }
    let mut i = vec![0; sizes.len()];
    loop {
        f(&i);
        let mut d = sizes.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            i[d] += 1;
            if i[d] < sizes[d] {
                break;
            }
            i[d] = 0;
        }
    }
}

fn flat(idx: &[usize], st: &[usize]) -> usize {
    idx.iter().zip(st).map(|(i, s)| i * s).sum()
}

/// Saves a tensor of `shape` (element `i` = `i`) laid out as `saved` over `n` ranks, loads it
/// laid out as `loaded` over `m` ranks; every loaded local tensor must equal its cut of the
/// whole, each element written once.
fn round_trip(
    shape: &[usize],
    saved: Layout,
    n: usize,
    loaded: Layout,
    m: usize,
) -> Result<(), String> {
    let whole_st = strides(shape);
    let offers: Vec<Vec<WriteOffer>> = (0..n)
        .map(|r| {
            pieces(shape, saved, r, n)
                .into_iter()
                .map(|p| offer("t", shape, &p.chunk.offsets, &p.chunk.sizes))
                .collect()
        })
        .collect();
    let plan = plan_writes(&offers)?;
    let mut on_disk: Vec<(ChunkStorageMetadata, Vec<usize>)> = Vec::new();
    for (r, w) in plan.writes.iter().enumerate() {
        for &i in w {
            let c = offers[r][i].chunk();
            let mut data = Vec::new();
            each_index(&c.sizes, |ix| {
                let g: Vec<usize> = ix.iter().zip(&c.offsets).map(|(a, b)| a + b).collect();
                data.push(flat(&g, &whole_st));
            });
            on_disk.push((c, data));
        }
    }
    let saved_chunks: Vec<ChunkStorageMetadata> = on_disk.iter().map(|(c, _)| c.clone()).collect();
    for r in 0..m {
        let dest = pieces(shape, loaded, r, m);
        let ls = local_shape(shape, &dest);
        let lst = strides(&ls);
        let mut local = vec![usize::MAX; ls.iter().product()];
        for item in plan_reads(&dest, &saved_chunks) {
            let (sc, data) = &on_disk[item.saved];
            let sst = strides(&sc.sizes);
            let d = &dest[item.dest];
            each_index(&item.sizes, |ix| {
                let g: Vec<usize> = ix.iter().zip(&item.offsets).map(|(a, b)| a + b).collect();
                let s: Vec<usize> = g.iter().zip(&sc.offsets).map(|(a, b)| a - b).collect();
                let l: Vec<usize> = g
                    .iter()
                    .zip(&d.chunk.offsets)
                    .zip(&d.local_offsets)
                    .map(|((a, b), o)| a - b + o)
                    .collect();
                let at = flat(&l, &lst);
                assert_eq!(local[at], usize::MAX, "element written twice");
                local[at] = data[flat(&s, &sst)];
            });
        }
        for p in &dest {
            let mut bad = None;
            each_index(&p.chunk.sizes, |ix| {
                let g: Vec<usize> = ix
                    .iter()
                    .zip(&p.chunk.offsets)
                    .map(|(a, b)| a + b)
                    .collect();
                let l: Vec<usize> = ix
                    .iter()
                    .zip(&p.local_offsets)
                    .map(|(a, b)| a + b)
                    .collect();
                if local[flat(&l, &lst)] != flat(&g, &whole_st) && bad.is_none() {
                    bad = Some(g);
                }
            });
            if let Some(g) = bad {
                return Err(format!("rank {r} of {m}: element {g:?} wrong"));
            }
        }
    }
    Ok(())
}

fn layouts(rank_dims: usize, shape0: usize) -> Vec<Layout> {
    let mut v = vec![Layout::Replicated, Layout::Chunked { dim: 0 }];
    if rank_dims > 1 {
        v.push(Layout::Chunked { dim: 1 });
    }
    if shape0.is_multiple_of(6) && shape0 > 0 {
        v.push(Layout::Stacked { stacked: 3 });
    }
    v
}

#[test]
fn resharding_round_trips_for_every_pair_of_layouts() {
    // a 0-d tensor, rows fewer than ranks, an empty tensor, a fused [3 * 4, 5] projection
    let shapes: &[&[usize]] = &[&[], &[1], &[7], &[0, 3], &[5, 3], &[12, 5], &[6, 4, 2]];
    let mut failures = Vec::new();
    for shape in shapes {
        let ls = if shape.is_empty() {
            vec![Layout::Replicated]
        } else {
            layouts(shape.len(), shape[0])
        };
        for &a in &ls {
            for &b in &ls {
                for n in 1..=4 {
                    for m in 1..=4 {
                        let stacked_ok = |l: Layout, w: usize| match l {
                            Layout::Stacked { stacked } => (shape[0] / stacked) % w == 0,
                            _ => true,
                        };
                        if !stacked_ok(a, n) || !stacked_ok(b, m) {
                            continue;
                        }
                        if let Err(e) = round_trip(shape, a, n, b, m) {
                            failures.push(format!("{shape:?} {a:?}x{n} -> {b:?}x{m}: {e}"));
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

proptest! {
    #[test]
    fn rows_saved_on_n_load_on_m(rows in 0usize..20, cols in 1usize..5, n in 1usize..9, m in 1usize..9) {
        let l = Layout::Chunked { dim: 0 };
        prop_assert_eq!(round_trip(&[rows, cols], l, n, l, m), Ok(()));
    }
}

#[test]
fn replicated_pieces_are_written_once_and_spread_over_the_ranks() {
    let both = |fqn: &str, size: &[usize]| offer(fqn, size, &vec![0; size.len()], size);
    // DDP: every rank holds both tensors whole
    let offers = vec![
        vec![both("a", &[4, 4]), both("b", &[4, 4])],
        vec![both("a", &[4, 4]), both("b", &[4, 4])],
    ];
    let plan = plan_writes(&offers).unwrap();
    assert_eq!(plan.writes, vec![vec![0], vec![1]]);
    // a 0-d value held by every rank: one writer
    let offers = vec![
        vec![both("s", &[])],
        vec![both("s", &[])],
        vec![both("s", &[])],
    ];
    let plan = plan_writes(&offers).unwrap();
    assert_eq!(plan.writes.iter().map(Vec::len).sum::<usize>(), 1);
}

#[test]
fn bad_offers_are_refused_naming_the_tensor_and_ranks() {
    let cases: Vec<(&str, Vec<Vec<WriteOffer>>, &str)> = vec![
        (
            "shapes differ",
            vec![
                vec![offer("w", &[4, 2], &[0, 0], &[2, 2])],
                vec![offer("w", &[5, 2], &[2, 0], &[2, 2])],
            ],
            "rank 0 holds it as F32 of shape [4, 2], rank 1 as F32 of shape [5, 2]",
        ),
        (
            "a hole",
            vec![vec![offer("w", &[4, 2], &[0, 0], &[2, 2])], vec![]],
            "the ranks hold 4 of its 8 elements",
        ),
        (
            "an overlap",
            vec![
                vec![offer("w", &[4, 2], &[0, 0], &[3, 2])],
                vec![offer("w", &[4, 2], &[2, 0], &[2, 2])],
            ],
            "overlap without being the same piece",
        ),
        (
            "past the end",
            vec![vec![offer("w", &[4, 2], &[3, 0], &[2, 2])]],
            "reaches past its shape [4, 2]",
        ),
    ];
    for (name, offers, want) in cases {
        match plan_writes(&offers) {
            Ok(p) => panic!("{name}: planned {p:?}"),
            Err(e) => assert!(e.contains(want) && e.contains("\"w\""), "{name}: {e}"),
        }
    }
}

#[test]
fn intersections() {
    let cases = [
        (
            chunk(&[0, 0], &[2, 4]),
            chunk(&[1, 2], &[4, 4]),
            Some(chunk(&[1, 2], &[1, 2])),
        ),
        (chunk(&[0, 0], &[2, 4]), chunk(&[2, 0], &[2, 4]), None),
        (chunk(&[], &[]), chunk(&[], &[]), Some(chunk(&[], &[]))),
        (chunk(&[0], &[0]), chunk(&[0], &[3]), None),
    ];
    for (i, (a, b, want)) in cases.into_iter().enumerate() {
        assert_eq!(intersect(&a, &b), want, "case {i}");
    }
}

/// 2-D: a [12, 6] tensor split by tensor parallelism over `tp` ranks (rows, columns or three
/// stacked blocks), each piece's rows then fully sharded over `dp` ranks: the composed pieces
/// of all tp x dp ranks hold every element once, at the right local places.
#[test]
fn two_splits_compose_into_pieces_of_the_whole() {
    let shape = [12usize, 6];
    let mut failures = Vec::new();
    for tp_layout in [
        Layout::Chunked { dim: 0 },
        Layout::Chunked { dim: 1 },
        Layout::Stacked { stacked: 3 },
    ] {
        for tp in [1usize, 2] {
            for dp in [1usize, 2, 3, 5] {
                let mut seen = vec![0u32; 72];
                for t in 0..tp {
                    let outer = pieces(&shape, tp_layout, t, tp);
                    let first = local_shape(&shape, &outer);
                    let per = first[0].div_ceil(dp);
                    for d in 0..dp {
                        let rows = (d * per).min(first[0])..((d + 1) * per).min(first[0]);
                        for p in compose_rows(&outer, rows.clone()) {
                            // the element's place in the first-level local tensor must be the
                            // one the outer piece gave it
                            each_index(&p.chunk.sizes, |ix| {
                                let g = [p.chunk.offsets[0] + ix[0], p.chunk.offsets[1] + ix[1]];
                                let l = [
                                    p.local_offsets[0] + ix[0] + rows.start,
                                    p.local_offsets[1] + ix[1],
                                ];
                                let src = outer.iter().find(|o| {
                                    (0..2).all(|k| {
                                        g[k] >= o.chunk.offsets[k]
                                            && g[k] < o.chunk.offsets[k] + o.chunk.sizes[k]
                                    })
                                });
                                let ok = src.is_some_and(|o| {
                                    (0..2).all(|k| {
                                        l[k] == o.local_offsets[k] + g[k] - o.chunk.offsets[k]
                                    })
                                });
                                if !ok {
                                    failures.push(format!(
                                        "{tp_layout:?} tp {tp} dp {dp}: element {g:?} at {l:?}"
                                    ));
                                }
                                seen[g[0] * 6 + g[1]] += 1;
                            });
                        }
                    }
                }
                if seen.iter().any(|&c| c != 1) {
                    failures.push(format!("{tp_layout:?} tp {tp} dp {dp}: counts {seen:?}"));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{:#?}",
        &failures[..failures.len().min(5)]
    );
}
