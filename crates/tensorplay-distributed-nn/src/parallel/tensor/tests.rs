//! The chunk arithmetic in memory: a rank's piece of a plain and of a stacked weight, and the
//! whole rebuilt from the pieces, for a table of shapes.

use tensorplay_core::{DType, Error, Tensor};

use super::shard::{chunk, unchunk};

/// A `[rows, cols]` tensor of `0..rows*cols`, split along `dim` into `stacked` blocks over
/// `world` ranks; `want[r]` is rank `r`'s values.
struct Case {
    name: &'static str,
    rows: usize,
    cols: usize,
    dim: usize,
    stacked: usize,
    world: usize,
    want: &'static [&'static [f64]],
}

const CASES: &[Case] = &[
    Case {
        name: "rows over 2",
        rows: 4,
        cols: 1,
        dim: 0,
        stacked: 1,
        world: 2,
        want: &[&[0.0, 1.0], &[2.0, 3.0]],
    },
    Case {
        name: "columns over 2",
        rows: 2,
        cols: 4,
        dim: 1,
        stacked: 1,
        world: 2,
        want: &[&[0.0, 1.0, 4.0, 5.0], &[2.0, 3.0, 6.0, 7.0]],
    },
    Case {
        name: "q, k, v stacked rows over 2",
        rows: 12,
        cols: 1,
        dim: 0,
        stacked: 3,
        world: 2,
        want: &[
            &[0.0, 1.0, 4.0, 5.0, 8.0, 9.0],
            &[2.0, 3.0, 6.0, 7.0, 10.0, 11.0],
        ],
    },
    Case {
        name: "2 stacked blocks over 3",
        rows: 6,
        cols: 1,
        dim: 0,
        stacked: 2,
        world: 3,
        want: &[&[0.0, 3.0], &[1.0, 4.0], &[2.0, 5.0]],
    },
    Case {
        name: "world 1 keeps everything",
        rows: 3,
        cols: 2,
        dim: 0,
        stacked: 3,
        world: 1,
        want: &[&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]],
    },
];

fn check(c: &Case) -> Result<(), Error> {
    let n = c.rows * c.cols;
    let full = Tensor::arange(0.0, n as f64, 1.0, DType::F64)?.reshape(&[c.rows, c.cols])?;
    let mut pieces = Vec::new();
    for r in 0..c.world {
        let p = chunk("test", "weight", &full, c.dim, c.stacked, r, c.world)?;
        assert_eq!(p.to_vec_f64()?, c.want[r], "case {}: rank {r}", c.name);
        assert!(!p.requires_grad(), "case {}: a detached copy", c.name);
        pieces.push(p);
    }
    let whole = unchunk(&pieces, c.dim, c.stacked)?;
    assert_eq!(
        whole.shape(),
        full.shape(),
        "case {}: rebuilt shape",
        c.name
    );
    assert_eq!(
        whole.to_vec_f64()?,
        full.to_vec_f64()?,
        "case {}: rebuilt",
        c.name
    );
    Ok(())
}

#[test]
fn pieces_and_the_whole() -> Result<(), Error> {
    for c in CASES {
        check(c)?;
    }
    Ok(())
}

#[test]
fn extents_that_do_not_divide_name_the_module() -> Result<(), Error> {
    let full = Tensor::zeros(&[6, 2], DType::F32)?;
    // (dim, stacked, rank, world, argument named)
    let cases = [
        (0, 1, 0, 4, "module"),
        (0, 3, 0, 4, "module"),
        (2, 1, 0, 2, "module"),
        (0, 1, 2, 2, "rank"),
    ];
    for (dim, stacked, rank, world, want) in cases {
        match chunk(
            "ColwiseParallel",
            "weight",
            &full,
            dim,
            stacked,
            rank,
            world,
        ) {
            Err(Error::InvalidArgument { op, arg, .. }) => {
                assert_eq!(
                    (op, arg),
                    ("ColwiseParallel", want),
                    "{dim} {stacked} {world}"
                )
            }
            other => panic!("dim {dim} stacked {stacked} world {world}: {other:?}"),
        }
    }
    Ok(())
}
