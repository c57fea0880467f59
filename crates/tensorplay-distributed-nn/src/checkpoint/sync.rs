//! How the ranks of a checkpoint call exchange what they know and agree on outcomes: over the
//! group given, the default group, or (one process without a group) not at all.

use serde::Serialize;
use serde::de::DeserializeOwned;
use tensorplay_collectives::{self as dist, ProcessGroup};
use tensorplay_core::{Error, Result};

use super::state_dict::world_group;

/// The ranks a checkpoint call runs over.
pub(crate) struct Ranks {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    group: Option<ProcessGroup>,
}

impl Ranks {
    /// `group`, else the default group when one is initialised, else this process alone.
    pub(crate) fn of(group: Option<&ProcessGroup>) -> Result<Ranks> {
        let group = group.cloned().or_else(world_group);
        let (rank, world) = match &group {
            Some(g) => (dist::get_rank(Some(g))?, dist::get_world_size(Some(g))?),
            None => (0, 1),
        };
        Ok(Ranks { rank, world, group })
    }

    /// The group, when there is one.
    pub(crate) fn group(&self) -> Option<&ProcessGroup> {
        self.group.as_ref()
    }

    /// Every rank's `x`, in rank order.
    pub(crate) fn gather<T: Serialize + DeserializeOwned>(&self, x: &T) -> Result<Vec<T>> {
        match &self.group {
            Some(g) => Ok(dist::all_gather_object(x, Some(g))?),
            None => {
                let bytes = serde_json::to_vec(x).map_err(|e| Error::Custom {
                    context: "checkpoint".into(),
                    message: e.to_string(),
                })?;
                let back = serde_json::from_slice(&bytes).map_err(|e| Error::Custom {
                    context: "checkpoint".into(),
                    message: e.to_string(),
                })?;
                Ok(vec![back])
            }
        }
    }

    /// `Ok` on every rank when every rank's `mine` is `Ok`; else this rank's own error, or on
    /// the ranks that succeeded an [`Error::Checkpoint`] about `what` naming those that failed
    /// and the first one's reason.
    pub(crate) fn agree(&self, mine: Result<()>, what: &str) -> Result<()> {
        let all: Vec<Option<String>> =
            self.gather(&mine.as_ref().err().map(ToString::to_string))?;
        mine?;
        match failed_ranks(all.iter().map(Option::as_deref)) {
            None => Ok(()),
            Some(problem) => Err(Error::Checkpoint {
                path: what.to_string(),
                problem,
            }),
        }
    }
}

/// "rank(s) [..] failed; rank r: <reason>" for the ranks whose problem is `Some`, or `None`.
pub(crate) fn failed_ranks<'a>(problems: impl Iterator<Item = Option<&'a str>>) -> Option<String> {
    let failed: Vec<(usize, &str)> = problems
        .enumerate()
        .filter_map(|(r, p)| p.map(|p| (r, p)))
        .collect();
    let (first, why) = failed.first()?;
    let ranks: Vec<usize> = failed.iter().map(|(r, _)| *r).collect();
    Some(format!(
        "rank(s) {ranks:?} failed, nothing was changed; rank {first}: {why}"
    ))
}
