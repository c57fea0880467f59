//! Rank translation of errors: a backend numbers the ranks of its group `0..size`, which in a
//! subgroup are not the ranks users know (`new_group(&[0, 2])`: the backend's rank 1 is global
//! rank 2). Every error that leaves a backend or the control channel passes through here once:
//! each rank field is mapped through the group's member list ([`Error::map_ranks`]); no text is
//! rewritten.

use crate::Error;

/// `e` (from a backend of the group whose global ranks are `ranks`) with global ranks; a rank
/// out of range (not a member's) stays as it is.
pub(crate) fn to_global(ranks: &[usize], e: Error) -> Error {
    e.map_ranks(|r| ranks.get(r).copied().unwrap_or(r))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Part, detail};

    #[test]
    fn group_ranks_in_errors_become_global_ranks() {
        let e = Error::PeerFailed {
            rank: 0,
            peer: 1,
            op: "all_reduce".into(),
            detail: detail!(
                "rank ",
                Part::Rank(1),
                " closed; ranks ",
                Part::Ranks(vec![0, 1]),
                " waited; rank x; rank 1 in words"
            ),
        };
        let g = to_global(&[3, 5], e);
        match &g {
            Error::PeerFailed {
                rank, peer, detail, ..
            } => {
                assert_eq!((*rank, *peer), (3, 5));
                assert_eq!(detail.ranks(), [5, 3, 5]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            g.to_string(),
            "rank 3: connection to rank 5 failed during all_reduce: rank 5 closed; ranks [3, 5] \
             waited; rank x; rank 1 in words"
        );
        let t = to_global(
            &[3, 5],
            Error::Timeout {
                op: "barrier".into(),
                rank: -1,
                timeout: std::time::Duration::from_secs(1),
                detail: detail!("rank ", Part::Rank(7), " is out of range"),
            },
        );
        assert!(
            matches!(&t, Error::Timeout { rank: -1, detail, .. } if detail.ranks() == [7]),
            "{t:?}"
        );
    }
}
