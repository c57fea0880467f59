//! Rank translation of errors: a backend numbers the ranks of its group `0..size`, which in a
//! subgroup are not the ranks users know (`new_group(&[0, 2])`: the backend's rank 1 is global
//! rank 2). Every error that leaves a backend or the control channel passes through here once.

use crate::Error;

/// The global rank of group rank `r` (itself when out of range).
fn global(ranks: &[usize], r: usize) -> usize {
    ranks.get(r).copied().unwrap_or(r)
}

/// `text` with every "rank N" and "ranks [N, M]" (group ranks) renamed to global ranks.
fn text(ranks: &[usize], text: &str) -> String {
    let text = lists(ranks, text);
    singles(ranks, &text)
}

/// Renames the members of every "ranks [..]" list.
fn lists(ranks: &[usize], text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("ranks [") {
        let (head, tail) = rest.split_at(i + "ranks [".len());
        out.push_str(head);
        let Some(end) = tail.find(']') else {
            rest = tail;
            break;
        };
        let items: Vec<String> = tail[..end]
            .split(',')
            .map(|x| match x.trim().parse::<usize>() {
                Ok(r) => global(ranks, r).to_string(),
                Err(_) => x.trim().to_string(),
            })
            .collect();
        out.push_str(&items.join(", "));
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// Renames every "rank N".
fn singles(ranks: &[usize], text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("rank ") {
        let (head, tail) = rest.split_at(i + "rank ".len());
        out.push_str(head);
        let n = tail.bytes().take_while(u8::is_ascii_digit).count();
        match tail[..n].parse::<usize>() {
            Ok(r) => out.push_str(&global(ranks, r).to_string()),
            Err(_) => out.push_str(&tail[..n]),
        }
        rest = &tail[n..];
    }
    out.push_str(rest);
    out
}

fn rank_i64(ranks: &[usize], rank: i64) -> i64 {
    usize::try_from(rank).map_or(rank, |r| global(ranks, r) as i64)
}

/// `e` (from a backend of the group whose global ranks are `ranks`) with global ranks.
pub(crate) fn to_global(ranks: &[usize], e: Error) -> Error {
    match e {
        Error::Timeout {
            op,
            rank,
            timeout,
            detail,
        } => Error::Timeout {
            op,
            rank: rank_i64(ranks, rank),
            timeout,
            detail: text(ranks, &detail),
        },
        Error::PeerFailed {
            rank,
            peer,
            op,
            detail,
        } => Error::PeerFailed {
            rank: global(ranks, rank),
            peer: global(ranks, peer),
            op,
            detail: text(ranks, &detail),
        },
        Error::Mismatch { op, detail } => Error::Mismatch {
            op,
            detail: text(ranks, &detail),
        },
        Error::Backend { backend, detail } => Error::Backend {
            backend,
            detail: text(ranks, &detail),
        },
        Error::InvalidArgument {
            op,
            rank,
            arg,
            expected,
            got,
        } => Error::InvalidArgument {
            op,
            rank: rank_i64(ranks, rank),
            arg,
            expected,
            got,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_ranks_in_errors_become_global_ranks() {
        let e = Error::PeerFailed {
            rank: 0,
            peer: 1,
            op: "all_reduce".into(),
            detail: "rank 1 closed; rank 0 waited; rank x".into(),
        };
        let t = text(
            &[3, 5],
            "ranks [1] of 2 never joined; rank 0 waited; ranks [0, 1]",
        );
        assert_eq!(
            t,
            "ranks [5] of 2 never joined; rank 3 waited; ranks [3, 5]"
        );
        match to_global(&[3, 5], e) {
            Error::PeerFailed {
                rank, peer, detail, ..
            } => {
                assert_eq!((rank, peer), (3, 5));
                assert_eq!(detail, "rank 5 closed; rank 3 waited; rank x");
            }
            other => panic!("{other:?}"),
        }
    }
}
