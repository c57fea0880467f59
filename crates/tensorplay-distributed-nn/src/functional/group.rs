//! Group resolution: the group of a call (`None` is the default group), this process's rank
//! in it, and global `src`/`dst` ranks turned into group ranks.

use tensorplay_collectives::{self as coll, ProcessGroup};
use tensorplay_core::Result;

/// The group of a call and this process's place in it.
#[derive(Clone)]
pub(super) struct Grp {
    pub(super) g: ProcessGroup,
    /// Group rank of this process.
    pub(super) rank: usize,
    /// Group size.
    pub(super) size: usize,
    /// Global rank of this process.
    pub(super) global: usize,
}

impl Grp {
    pub(super) fn new(group: Option<&ProcessGroup>, op: &'static str) -> Result<Grp> {
        let g = match group {
            Some(g) => g.clone(),
            None => coll::default_group(op)?,
        };
        let global = g.my_global_rank();
        let rank = g.rank().ok_or_else(|| {
            coll::Error::invalid(
                op,
                global as i64,
                "group",
                format!("a group this rank belongs to (members: {:?})", g.ranks()),
                format!("group {:?} without rank {global}", g.ranks()),
            )
        })?;
        let size = g.size();
        Ok(Grp {
            g,
            rank,
            size,
            global,
        })
    }

    pub(super) fn pg(&self) -> Option<&ProcessGroup> {
        Some(&self.g)
    }

    /// An invalid-argument error for this rank.
    pub(super) fn err(
        &self,
        op: &str,
        arg: &str,
        expected: impl Into<String>,
        got: impl std::fmt::Display,
    ) -> coll::Error {
        coll::Error::invalid(op, self.global as i64, arg, expected, got)
    }

    /// The group rank of global rank `root` (for `src`/`dst`).
    pub(super) fn root(&self, op: &str, arg: &str, root: usize) -> coll::Result<usize> {
        self.g
            .ranks()
            .iter()
            .position(|&r| r == root)
            .ok_or_else(|| {
                self.err(
                    op,
                    arg,
                    format!("a global rank in the group {:?}", self.g.ranks()),
                    root,
                )
            })
    }

    /// All-gathers `desc` (or, when this rank's own checks failed, a placeholder of `len`
    /// values and the error): every rank fails together when one rank's arguments are bad.
    pub(super) fn exchange(
        &self,
        op: &'static str,
        desc: coll::Result<Vec<i64>>,
        len: usize,
    ) -> Result<Vec<Vec<i64>>> {
        let (d, local) = match desc {
            Ok(d) => {
                debug_assert_eq!(d.len(), len);
                (d, Ok(()))
            }
            Err(e) => (vec![0; len], Err(e)),
        };
        Ok(coll::all_gather_metadata(op, &d, local, self.pg())?)
    }
}
