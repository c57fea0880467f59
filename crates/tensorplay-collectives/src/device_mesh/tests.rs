//! The mesh arithmetic, in memory: coordinates and groups per dimension for a table of
//! shapes, and the argument errors.

use super::layout::{coordinates, groups_along, index_of, validate};
use crate::Error;

/// A shape, and for one dimension every group along it (as ranks of a mesh over `0..n`).
struct GroupCase {
    name: &'static str,
    shape: &'static [usize],
    dim: usize,
    groups: &'static [&'static [usize]],
}

const GROUP_CASES: &[GroupCase] = &[
    GroupCase {
        name: "1-D",
        shape: &[4],
        dim: 0,
        groups: &[&[0, 1, 2, 3]],
    },
    GroupCase {
        name: "[2, 2] dp",
        shape: &[2, 2],
        dim: 0,
        groups: &[&[0, 2], &[1, 3]],
    },
    GroupCase {
        name: "[2, 2] tp",
        shape: &[2, 2],
        dim: 1,
        groups: &[&[0, 1], &[2, 3]],
    },
    GroupCase {
        name: "[2, 3] rows",
        shape: &[2, 3],
        dim: 0,
        groups: &[&[0, 3], &[1, 4], &[2, 5]],
    },
    GroupCase {
        name: "[2, 3] columns",
        shape: &[2, 3],
        dim: 1,
        groups: &[&[0, 1, 2], &[3, 4, 5]],
    },
    GroupCase {
        name: "[2, 2, 2] middle",
        shape: &[2, 2, 2],
        dim: 1,
        groups: &[&[0, 2], &[1, 3], &[4, 6], &[5, 7]],
    },
    GroupCase {
        name: "[1, 3] extent 1",
        shape: &[1, 3],
        dim: 0,
        groups: &[&[0], &[1], &[2]],
    },
];

fn check_groups(c: &GroupCase) {
    let got = groups_along(c.shape, c.dim);
    let want: Vec<Vec<usize>> = c.groups.iter().map(|g| g.to_vec()).collect();
    assert_eq!(got, want, "case {}", c.name);
    // every rank is in exactly one group of the dimension, at its own coordinate
    for (g, members) in got.iter().enumerate() {
        for (k, &r) in members.iter().enumerate() {
            let coords = coordinates(c.shape, r);
            assert_eq!(coords[c.dim], k, "case {}: rank {r} in group {g}", c.name);
            assert_eq!(index_of(c.shape, &coords), r, "case {}: round trip", c.name);
        }
    }
    let total: usize = c.shape.iter().product();
    let mut all: Vec<usize> = got.concat();
    all.sort_unstable();
    assert_eq!(all, (0..total).collect::<Vec<_>>(), "case {}", c.name);
}

#[test]
fn groups_along_each_dimension() {
    for c in GROUP_CASES {
        check_groups(c);
    }
}

#[test]
fn coordinates_are_row_major() {
    let cases: &[(&[usize], usize, &[usize])] = &[
        (&[4], 3, &[3]),
        (&[2, 2], 2, &[1, 0]),
        (&[2, 3], 5, &[1, 2]),
        (&[2, 3], 4, &[1, 1]),
        (&[2, 2, 2], 6, &[1, 1, 0]),
    ];
    for &(shape, index, want) in cases {
        assert_eq!(
            coordinates(shape, index),
            want,
            "shape {shape:?} index {index}"
        );
        assert_eq!(
            index_of(shape, want),
            index,
            "shape {shape:?} coords {want:?}"
        );
    }
}

/// Arguments `validate` refuses, and the argument the error must name.
struct BadCase {
    name: &'static str,
    shape: &'static [usize],
    names: &'static [&'static str],
    world: usize,
    arg: &'static str,
}

const BAD_CASES: &[BadCase] = &[
    BadCase {
        name: "size differs from the world",
        shape: &[2, 2],
        names: &["dp", "tp"],
        world: 8,
        arg: "mesh_shape",
    },
    BadCase {
        name: "empty shape",
        shape: &[],
        names: &[],
        world: 1,
        arg: "mesh_shape",
    },
    BadCase {
        name: "zero extent",
        shape: &[0, 2],
        names: &["dp", "tp"],
        world: 0,
        arg: "mesh_shape",
    },
    BadCase {
        name: "too few names",
        shape: &[2, 2],
        names: &["dp"],
        world: 4,
        arg: "mesh_dim_names",
    },
    BadCase {
        name: "repeated name",
        shape: &[2, 2],
        names: &["tp", "tp"],
        world: 4,
        arg: "mesh_dim_names",
    },
    BadCase {
        name: "empty name",
        shape: &[4],
        names: &[""],
        world: 4,
        arg: "mesh_dim_names",
    },
];

fn check_bad(c: &BadCase) {
    match validate("init_device_mesh", 3, c.shape, c.names, c.world) {
        Err(Error::InvalidArgument { op, rank, arg, .. }) => {
            assert_eq!(
                (op.as_str(), rank, arg.as_str()),
                ("init_device_mesh", 3, c.arg),
                "case {}",
                c.name
            );
        }
        other => panic!("case {}: expected InvalidArgument, got {other:?}", c.name),
    }
}

#[test]
fn bad_arguments_name_the_argument() {
    for c in BAD_CASES {
        check_bad(c);
    }
    assert!(validate("init_device_mesh", 0, &[2, 2], &["dp", "tp"], 4).is_ok());
    assert!(validate("init_device_mesh", 0, &[1], &["x"], 1).is_ok());
}
