//! `DeviceMesh` across real processes: a world of 4 as a [2, 2] mesh ("dp", "tp"). Each rank
//! checks its coordinates and the members of its groups against the row-major layout, then an
//! all-reduce over `mesh["tp"]` and one over `mesh["dp"]` against the same sums done in one
//! process, and the argument errors.

use tensorplay_collectives::device_mesh::{DeviceMesh, init_device_mesh};
use tensorplay_collectives::{self as dist, Error, ReduceOp};
use tensorplay_core::{DType, Tensor};

use super::{TestResult, init, values};

/// What rank `rank` of a [2, 2] mesh must see along one dimension.
struct DimCase {
    dim: &'static str,
    /// The members of the rank's group, from its rank.
    members: fn(usize) -> Vec<usize>,
    /// Its coordinate along the dimension.
    coordinate: fn(usize) -> usize,
}

const DIMS: &[DimCase] = &[
    DimCase {
        dim: "dp",
        members: |r| vec![r % 2, r % 2 + 2],
        coordinate: |r| r / 2,
    },
    DimCase {
        dim: "tp",
        members: |r| vec![r / 2 * 2, r / 2 * 2 + 1],
        coordinate: |r| r % 2,
    },
];

fn check_dim(rank: usize, mesh: &DeviceMesh, c: &DimCase) -> TestResult {
    let at = format!("rank {rank}, dim {}", c.dim);
    let members = (c.members)(rank);
    assert_eq!(mesh.get_group(c.dim)?.ranks(), members, "{at}: group");
    assert_eq!(mesh[c.dim].ranks(), members, "{at}: mesh[dim]");
    assert_eq!(mesh[c.dim].shape(), [2], "{at}: sub-mesh shape");
    assert_eq!(mesh.size(c.dim)?, 2, "{at}: size");
    assert_eq!(mesh.get_local_rank(c.dim)?, (c.coordinate)(rank), "{at}");
    assert_eq!(
        mesh[c.dim].get_local_rank(0)?,
        (c.coordinate)(rank),
        "{at}: sub-mesh coordinate"
    );
    // the sum over the group equals the one-process sum of the members' inputs
    let t = Tensor::from_vec(values(rank, 6, 3), &[2, 3])?.to_dtype(DType::F64)?;
    dist::all_reduce(&t, ReduceOp::Sum, Some(mesh.get_group(c.dim)?))?;
    let want: Vec<f64> = (0..6)
        .map(|i| members.iter().map(|&m| values(m, 6, 3)[i]).sum())
        .collect();
    assert_eq!(t.to_vec_f64()?, want, "{at}: all_reduce over the group");
    Ok(())
}

fn bad_arg(r: Result<DeviceMesh, Error>, want_arg: &str, what: &str) {
    match r {
        Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, want_arg, "{what}"),
        other => panic!("{what}: expected InvalidArgument({want_arg}), got {other:?}"),
    }
}

#[test]
fn device_mesh_2x2_over_world_4() -> TestResult {
    dist::spawn::spawn(4, |rank| -> TestResult {
        init(30)?;
        let mesh = init_device_mesh(&[2, 2], &["dp", "tp"])?;
        assert_eq!(mesh.shape(), [2, 2]);
        assert_eq!(mesh.ranks(), [0, 1, 2, 3]);
        assert_eq!(mesh.get_coordinate(), [rank / 2, rank % 2]);
        assert_eq!(mesh.mesh_dim_names(), ["dp", "tp"]);
        for c in DIMS {
            check_dim(rank, &mesh, c)?;
        }
        // by index as by name
        assert_eq!(mesh.get_group(1)?.ranks(), mesh.get_group("tp")?.ranks());
        // the dimensions in the other order: the transposed layout of the same ranks
        let t = mesh.sub_mesh_of(&["tp", "dp"])?;
        assert_eq!(t.ranks(), [0, 2, 1, 3], "rank {rank}: transposed");
        assert_eq!(t.get_coordinate(), [rank % 2, rank / 2]);
        // a 1-D mesh over an existing group creates nothing
        let world = DeviceMesh::from_group(&dist::default_group("mesh test")?, "all")?;
        assert_eq!(
            (world.ranks(), world.get_local_rank("all")?),
            (&[0, 1, 2, 3][..], rank)
        );
        // errors, on every rank, before any group is created
        match mesh.get_group("pp") {
            Err(Error::InvalidArgument { arg, expected, .. }) => {
                assert_eq!(arg, "mesh_dim");
                assert!(expected.contains("\"dp\", \"tp\""), "{expected}");
            }
            other => panic!("unknown dim: {other:?}"),
        }
        bad_arg(
            init_device_mesh(&[2, 3], &["dp", "tp"]),
            "mesh_shape",
            "6 != 4",
        );
        bad_arg(
            init_device_mesh(&[4], &["dp", "tp"]),
            "mesh_dim_names",
            "names",
        );
        bad_arg(
            mesh.sub_mesh_of(&["tp", "tp"]),
            "mesh_dim_names",
            "repeated",
        );
        // rank 3 describes another mesh: every rank is told, naming rank 3, before any group
        // is made (no rank is left waiting in new_group)
        let (shape, names): (&[usize], &[&str]) = if rank == 3 {
            (&[4], &["x"])
        } else {
            (&[2, 2], &["dp", "tp"])
        };
        match init_device_mesh(shape, names) {
            Err(Error::InvalidArgument {
                arg, expected, got, ..
            }) => {
                assert_eq!(arg, "mesh_shape");
                assert!(expected.contains("ranks [3] differ"), "{expected}");
                let want = if rank == 3 { "rank 0:" } else { "rank 3:" };
                assert!(got.starts_with(want), "rank {rank}: {got}");
            }
            other => panic!("rank {rank}: meshes that differ: {other:?}"),
        }
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}
