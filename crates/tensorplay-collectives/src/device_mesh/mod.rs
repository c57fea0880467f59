//! `torch.distributed.device_mesh`: the ranks of a job arranged as an n-dimensional array,
//! with a process group along each dimension ([`DeviceMesh`], [`init_device_mesh`]).
//!
//! A 2-D mesh `[2, 2]` named `["dp", "tp"]` over 4 ranks lays them out row-major:
//!
//! ```text
//!          tp=0  tp=1
//!   dp=0     0     1      mesh["tp"] on rank 2: ranks [2, 3]
//!   dp=1     2     3      mesh["dp"] on rank 2: ranks [0, 2]
//! ```
//!
//! Tensor parallelism runs over `mesh["tp"]`, data parallelism over `mesh["dp"]`; fully
//! sharded and pipeline parallelism will take their groups from the same mesh.
//!
//! ```no_run
//! use tensorplay::distributed::{self as dist, device_mesh::init_device_mesh};
//! # fn main() -> Result<(), dist::Error> {
//! dist::init_process_group("cpu", Default::default())?; // 4 ranks
//! let mesh = init_device_mesh(&[2, 2], &["dp", "tp"])?;
//! let tp = mesh.get_group("tp")?; // this rank's tensor-parallel group
//! assert_eq!(mesh["tp"].size(0)?, 2);
//! println!("tp rank {} of dp slice {}", mesh.get_local_rank("tp")?, mesh.get_local_rank("dp")?);
//! # let _ = tp;
//! # Ok(())
//! # }
//! ```

mod layout;
#[cfg(test)]
mod tests;

use std::fmt;
use std::ops::Index;

use crate::{
    Error, ProcessGroup, Result, all_gather_object, barrier, get_rank, get_world_size, new_group,
};

/// A dimension of a [`DeviceMesh`], by name (`"tp"`) or by index (`1`), as PyTorch's
/// `mesh_dim: int | str`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MeshDim<'a> {
    /// The dimension's index, `0..ndim`.
    Index(usize),
    /// The dimension's name, as given to [`init_device_mesh`].
    Name(&'a str),
}

impl From<usize> for MeshDim<'_> {
    fn from(i: usize) -> Self {
        MeshDim::Index(i)
    }
}

impl<'a> From<&'a str> for MeshDim<'a> {
    fn from(name: &'a str) -> Self {
        MeshDim::Name(name)
    }
}

impl fmt::Display for MeshDim<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MeshDim::Index(i) => write!(f, "{i}"),
            MeshDim::Name(n) => write!(f, "{n:?}"),
        }
    }
}

/// This process's view of a mesh of ranks (`torch.distributed.device_mesh.DeviceMesh`): its
/// shape, the names of its dimensions, the global ranks it covers (row-major), this process's
/// coordinates, and this process's process group along each dimension.
///
/// Built by [`init_device_mesh`] (which creates the groups) or [`DeviceMesh::from_group`] (a
/// 1-D mesh over an existing group). `mesh["tp"]` is the 1-D sub-mesh of dimension `"tp"`
/// that contains this process (it panics on an unknown name, as indexing does; use
/// [`DeviceMesh::sub_mesh`] for a `Result`). Cheap to clone (the groups are shared).
#[derive(Clone)]
pub struct DeviceMesh {
    shape: Vec<usize>,
    names: Vec<String>,
    /// The global ranks of the mesh's positions, row-major.
    ranks: Vec<usize>,
    /// This process's coordinates.
    coords: Vec<usize>,
    /// This process's group along each dimension.
    groups: Vec<ProcessGroup>,
    /// The 1-D sub-mesh of each dimension containing this process (empty for a 1-D mesh,
    /// which is its own).
    dims: Vec<DeviceMesh>,
    /// This process's global rank.
    me: usize,
}

/// Creates a mesh over all the ranks of the default group (`init_device_mesh`): `mesh_shape`
/// gives the extent of each dimension (their product is the world size) and `mesh_dim_names`
/// one distinct name per dimension.
///
/// Every rank must call it with the same arguments: it creates one process group for every
/// line of ranks along every dimension, dimension by dimension, each with
/// [`new_group`], in the same order on every rank (as PyTorch does), and
/// keeps the groups this rank belongs to. The groups use the world's backend and timeout.
///
/// # Errors
/// Not initialised; [`Error::InvalidArgument`] naming `mesh_shape` (empty, a zero extent, a
/// product other than the world size) or `mesh_dim_names` (not one per dimension, empty or
/// repeated names), or `mesh_shape` when the ranks do not all pass the same shape and names
/// (checked on every rank before any group is made, naming the ranks that differ); errors
/// creating a group. Ends with a barrier over the world.
pub fn init_device_mesh(mesh_shape: &[usize], mesh_dim_names: &[&str]) -> Result<DeviceMesh> {
    const OP: &str = "init_device_mesh";
    let world = get_world_size(None).map_err(|_| Error::NotInitialized { op: OP.into() })?;
    let me = get_rank(None)?;
    layout::validate(OP, me as i64, mesh_shape, mesh_dim_names, world)?;
    // every rank must describe the same mesh: compare before any group is made, so that a rank
    // that disagrees is named on every rank instead of leaving the others waiting in new_group
    let mine = (
        mesh_shape.to_vec(),
        mesh_dim_names.iter().map(|s| s.to_string()).collect(),
    );
    let all: Vec<(Vec<usize>, Vec<String>)> = all_gather_object(&mine, None)?;
    if let Some(other) = all.iter().position(|m| *m != mine) {
        let differ: Vec<usize> = (0..world).filter(|&r| all[r] != all[0]).collect();
        let (shape, names) = &all[other];
        return Err(Error::invalid(
            OP,
            me as i64,
            "mesh_shape",
            format!(
                "the same mesh on every rank (rank 0: {:?} {:?}; ranks {differ:?} differ)",
                all[0].0, all[0].1
            ),
            format!("rank {other}: {shape:?} {names:?}"),
        ));
    }
    let ranks: Vec<usize> = (0..world).collect();
    let mut groups = Vec::with_capacity(mesh_shape.len());
    for dim in 0..mesh_shape.len() {
        let mut mine = None;
        for line in layout::groups_along(mesh_shape, dim) {
            let members: Vec<usize> = line.iter().map(|&i| ranks[i]).collect();
            let g = new_group(&members, None, None)?;
            if members.contains(&me) {
                mine = Some(g);
            }
        }
        groups.push(mine.ok_or_else(|| {
            Error::invalid(OP, me as i64, "mesh_shape", "a mesh covering this rank", me)
        })?);
    }
    // as new_group's callers expect: no rank leaves (and, on rank 0, takes the store away)
    // while another still creates the mesh's groups
    barrier(None)?;
    Ok(DeviceMesh::assemble(
        mesh_shape.to_vec(),
        mesh_dim_names.iter().map(|s| s.to_string()).collect(),
        ranks,
        groups,
        me,
    ))
}

impl DeviceMesh {
    /// A 1-D mesh over the ranks of an existing `group`, its one dimension named `name`
    /// (`DeviceMesh.from_group`); no group is created.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`]: this process is not a member of `group` (`group`), or
    /// `name` is empty (`mesh_dim_names`).
    pub fn from_group(group: &ProcessGroup, name: &str) -> Result<DeviceMesh> {
        const OP: &str = "DeviceMesh::from_group";
        let me = group.my_global_rank();
        if !group.is_member() {
            return Err(Error::invalid(
                OP,
                me as i64,
                "group",
                "a group this process belongs to",
                format!("{group:?}"),
            ));
        }
        layout::validate(OP, me as i64, &[group.size()], &[name], group.size())?;
        Ok(DeviceMesh::assemble(
            vec![group.size()],
            vec![name.to_string()],
            group.ranks().to_vec(),
            vec![group.clone()],
            me,
        ))
    }

    /// Builds the mesh and its 1-D sub-meshes from this process's groups.
    fn assemble(
        shape: Vec<usize>,
        names: Vec<String>,
        ranks: Vec<usize>,
        groups: Vec<ProcessGroup>,
        me: usize,
    ) -> DeviceMesh {
        let at = ranks.iter().position(|&r| r == me).unwrap_or(0);
        let coords = layout::coordinates(&shape, at);
        let dims = if shape.len() == 1 {
            Vec::new()
        } else {
            (0..shape.len())
                .map(|d| DeviceMesh {
                    shape: vec![shape[d]],
                    names: vec![names[d].clone()],
                    ranks: groups[d].ranks().to_vec(),
                    coords: vec![coords[d]],
                    groups: vec![groups[d].clone()],
                    dims: Vec::new(),
                    me,
                })
                .collect()
        };
        DeviceMesh {
            shape,
            names,
            ranks,
            coords,
            groups,
            dims,
            me,
        }
    }

    /// The index of `dim`, or an [`Error::InvalidArgument`] naming `mesh_dim` that lists the
    /// mesh's names.
    fn dim_index(&self, dim: MeshDim<'_>, op: &str) -> Result<usize> {
        let found = match dim {
            MeshDim::Index(i) => (i < self.shape.len()).then_some(i),
            MeshDim::Name(n) => self.names.iter().position(|m| m == n),
        };
        found.ok_or_else(|| {
            Error::invalid(
                op,
                self.me as i64,
                "mesh_dim",
                format!(
                    "a dimension of this mesh: an index below {} or one of {:?}",
                    self.shape.len(),
                    self.names
                ),
                dim,
            )
        })
    }

    /// The mesh's shape (`mesh.shape`).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The number of dimensions (`mesh.ndim`).
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// The names of the dimensions (`mesh.mesh_dim_names`).
    pub fn mesh_dim_names(&self) -> &[String] {
        &self.names
    }

    /// The global ranks of the mesh's positions, row-major (`mesh.mesh.flatten()`).
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// The number of ranks in the mesh (`mesh.size()`).
    pub fn numel(&self) -> usize {
        self.ranks.len()
    }

    /// The extent of dimension `dim` (`mesh.size(mesh_dim)`), by index or name.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `mesh_dim` for an unknown dimension.
    pub fn size<'a>(&self, dim: impl Into<MeshDim<'a>>) -> Result<usize> {
        Ok(self.shape[self.dim_index(dim.into(), "DeviceMesh::size")?])
    }

    /// This process's coordinate along `dim` (`mesh.get_local_rank(mesh_dim)`): its rank in
    /// the group of `dim`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `mesh_dim` for an unknown dimension.
    pub fn get_local_rank<'a>(&self, dim: impl Into<MeshDim<'a>>) -> Result<usize> {
        Ok(self.coords[self.dim_index(dim.into(), "DeviceMesh::get_local_rank")?])
    }

    /// This process's coordinates in the mesh (`mesh.get_coordinate()`).
    pub fn get_coordinate(&self) -> &[usize] {
        &self.coords
    }

    /// This process's global rank (`mesh.get_rank()`).
    pub fn get_rank(&self) -> usize {
        self.me
    }

    /// This process's group along `dim` (`mesh.get_group(mesh_dim)`): the ranks that share
    /// every other coordinate with it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `mesh_dim` for an unknown dimension.
    pub fn get_group<'a>(&self, dim: impl Into<MeshDim<'a>>) -> Result<&ProcessGroup> {
        Ok(&self.groups[self.dim_index(dim.into(), "DeviceMesh::get_group")?])
    }

    /// The 1-D sub-mesh of dimension `dim` that contains this process (`mesh[name]`): its
    /// ranks are those of [`get_group`](Self::get_group).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `mesh_dim` for an unknown dimension.
    pub fn sub_mesh<'a>(&self, dim: impl Into<MeshDim<'a>>) -> Result<&DeviceMesh> {
        let d = self.dim_index(dim.into(), "DeviceMesh::sub_mesh")?;
        Ok(if self.dims.is_empty() {
            self
        } else {
            &self.dims[d]
        })
    }

    /// The sub-mesh of the dimensions `names`, in that order, that contains this process
    /// (`mesh["dp", "tp"]`): the positions that share this process's coordinates in every
    /// other dimension. Its groups are this mesh's; none is created.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `mesh_dim_names`: empty, repeated or unknown names.
    pub fn sub_mesh_of(&self, names: &[&str]) -> Result<DeviceMesh> {
        const OP: &str = "DeviceMesh::sub_mesh_of";
        let mut dims = Vec::with_capacity(names.len());
        for n in names {
            dims.push(self.dim_index(MeshDim::Name(n), OP)?);
        }
        let shape: Vec<usize> = dims.iter().map(|&d| self.shape[d]).collect();
        layout::validate(OP, self.me as i64, &shape, names, shape.iter().product())?;
        let ranks = (0..shape.iter().product())
            .map(|i| {
                let sub = layout::coordinates(&shape, i);
                let mut c = self.coords.clone();
                for (&d, &k) in dims.iter().zip(&sub) {
                    c[d] = k;
                }
                self.ranks[layout::index_of(&self.shape, &c)]
            })
            .collect();
        Ok(DeviceMesh::assemble(
            shape,
            names.iter().map(|s| s.to_string()).collect(),
            ranks,
            dims.iter().map(|&d| self.groups[d].clone()).collect(),
            self.me,
        ))
    }
}

impl Index<&str> for DeviceMesh {
    type Output = DeviceMesh;

    /// `mesh["tp"]`: as [`DeviceMesh::sub_mesh`].
    ///
    /// # Panics
    /// On a name that is not one of the mesh's dimensions (the message lists them); use
    /// [`DeviceMesh::sub_mesh`] to get an error instead.
    fn index(&self, name: &str) -> &DeviceMesh {
        match self.sub_mesh(name) {
            Ok(m) => m,
            Err(e) => panic!("{e}"),
        }
    }
}

impl fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceMesh(shape={:?}, names={:?}, ranks={:?}, coordinate={:?})",
            self.shape, self.names, self.ranks, self.coords
        )
    }
}
