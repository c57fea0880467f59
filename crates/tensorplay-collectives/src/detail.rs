//! [`Detail`]: the explanation an [`Error`](crate::Error) carries, a text whose rank numbers are
//! typed fields. A backend numbers the ranks of its group `0..size`; the group maps every rank
//! field of an error it returns through its member list (see `Error::map_ranks`), so the text
//! a person reads names global ranks without any text being rewritten.

use std::fmt;

/// One piece of a [`Detail`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Part {
    /// Words, shown as they are.
    Text(String),
    /// One rank, shown as its number (`3`).
    Rank(usize),
    /// A list of ranks, shown as `[1, 3]`.
    Ranks(Vec<usize>),
}

/// The explanation of an error: words and ranks, the ranks kept as numbers so that they can be
/// renumbered (from a subgroup's ranks to global ranks) and asserted on. `Display` shows the
/// words and the rank numbers in order ("rank 2 never reached this call").
///
/// Build one with [`detail!`](crate::detail) (pieces: strings, [`Part::Rank`],
/// [`Part::Ranks`]), or from a `String`/`&str` when it names no rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Detail {
    parts: Vec<Part>,
}

/// A [`Detail`] from its pieces: each argument is a string (`&str`, `String`) or a
/// [`Part`] (`Part::Rank(r)`, `Part::Ranks(v)`):
/// `detail!("rank ", Part::Rank(peer), format!(" sent {n} bytes"))`.
#[macro_export]
macro_rules! detail {
    ($($part:expr),* $(,)?) => {
        $crate::Detail::from_parts(vec![$($crate::Part::from($part)),*])
    };
}

impl Detail {
    /// A detail made of `parts`, in order (adjacent texts are joined).
    pub fn from_parts(parts: Vec<Part>) -> Detail {
        let mut d = Detail::default();
        for p in parts {
            d.push(p);
        }
        d
    }

    /// "rank 1, rank 3": each of `ranks` named, comma-separated.
    pub fn rank_names(ranks: &[usize]) -> Detail {
        let mut d = Detail::default();
        for (i, &r) in ranks.iter().enumerate() {
            d.push(if i == 0 { "rank " } else { ", rank " });
            d.push(Part::Rank(r));
        }
        d
    }

    /// The pieces, in order.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// Every rank this detail names, in order of appearance (lists flattened).
    pub fn ranks(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for p in &self.parts {
            match p {
                Part::Rank(r) => out.push(*r),
                Part::Ranks(v) => out.extend_from_slice(v),
                Part::Text(_) => {}
            }
        }
        out
    }

    /// Whether the shown text contains `pat`.
    pub fn contains(&self, pat: &str) -> bool {
        self.to_string().contains(pat)
    }

    /// Appends a piece (a text next to a text is joined to it).
    pub fn push(&mut self, part: impl Into<Part>) {
        match (self.parts.last_mut(), part.into()) {
            (_, Part::Text(t)) if t.is_empty() => {}
            (Some(Part::Text(last)), Part::Text(t)) => last.push_str(&t),
            (_, p) => self.parts.push(p),
        }
    }

    /// This detail followed by `other`.
    pub fn join(mut self, other: impl Into<Detail>) -> Detail {
        for p in other.into().parts {
            self.push(p);
        }
        self
    }

    /// This detail with every rank `r` replaced by `f(r)`: how a group turns its backend's
    /// group ranks into global ranks.
    pub fn map_ranks(self, f: &impl Fn(usize) -> usize) -> Detail {
        let parts = self
            .parts
            .into_iter()
            .map(|p| match p {
                Part::Rank(r) => Part::Rank(f(r)),
                Part::Ranks(v) => Part::Ranks(v.into_iter().map(f).collect()),
                text => text,
            })
            .collect();
        Detail { parts }
    }

    /// This detail with every text piece replaced by `f(text)` (the ranks untouched): for
    /// rewording, never for renumbering.
    pub fn map_text(self, f: impl Fn(&str) -> String) -> Detail {
        Detail::from_parts(
            self.parts
                .into_iter()
                .map(|p| match p {
                    Part::Text(t) => Part::Text(f(&t)),
                    other => other,
                })
                .collect(),
        )
    }

    /// The pieces before and after the first occurrence of `pat` in a text piece, or `None`
    /// when no text piece contains it.
    pub fn split_once(&self, pat: &str) -> Option<(Detail, Detail)> {
        let i = self
            .parts
            .iter()
            .position(|p| matches!(p, Part::Text(t) if t.contains(pat)))?;
        let Part::Text(t) = &self.parts[i] else {
            return None;
        };
        let (head, tail) = t.split_once(pat)?;
        let mut left = Detail::from_parts(self.parts[..i].to_vec());
        left.push(head);
        let mut right = Detail::from(tail);
        for p in &self.parts[i + 1..] {
            right.push(p.clone());
        }
        Some((left, right))
    }
}

impl fmt::Display for Detail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for p in &self.parts {
            match p {
                Part::Text(t) => f.write_str(t)?,
                Part::Rank(r) => write!(f, "{r}")?,
                Part::Ranks(v) => write!(f, "{v:?}")?,
            }
        }
        Ok(())
    }
}

impl From<String> for Part {
    fn from(t: String) -> Part {
        Part::Text(t)
    }
}

impl From<&str> for Part {
    fn from(t: &str) -> Part {
        Part::Text(t.to_string())
    }
}

impl From<&String> for Part {
    fn from(t: &String) -> Part {
        Part::Text(t.clone())
    }
}

/// A detail that names no rank.
impl From<String> for Detail {
    fn from(t: String) -> Detail {
        Detail::from_parts(vec![Part::Text(t)])
    }
}

/// A detail that names no rank.
impl From<&str> for Detail {
    fn from(t: &str) -> Detail {
        Detail::from(t.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_renumbered_as_fields_and_shown_in_the_text() {
        let d = crate::detail!(
            "ranks ",
            Part::Ranks(vec![1]),
            " of 2 never joined; rank ",
            Part::Rank(0),
            " waited"
        );
        assert_eq!(d.ranks(), [1, 0]);
        assert_eq!(d.to_string(), "ranks [1] of 2 never joined; rank 0 waited");
        let g = d.map_ranks(&|r| [3, 5][r]);
        assert_eq!(g.ranks(), [5, 3]);
        assert_eq!(g.to_string(), "ranks [5] of 2 never joined; rank 3 waited");
        // a number in the words is not a rank
        let plain = Detail::from("rank 1 closed").map_ranks(&|r| r + 10);
        assert_eq!(plain.to_string(), "rank 1 closed");
        assert_eq!(plain.ranks(), Vec::<usize>::new());
        let names = Detail::rank_names(&[1, 3]).map_ranks(&|r| r * 2);
        assert_eq!(
            (names.to_string().as_str(), names.ranks()),
            ("rank 2, rank 6", vec![2, 6])
        );
        assert_eq!(Detail::rank_names(&[]).to_string(), "");
    }

    #[test]
    fn split_and_reword_keep_the_ranks() {
        let d = crate::detail!(
            "rank ",
            Part::Rank(0),
            " called x but rank ",
            Part::Rank(2),
            " called y"
        );
        let (l, r) = d.split_once(" but ").unwrap();
        assert_eq!(
            (l.to_string().as_str(), l.ranks()),
            ("rank 0 called x", vec![0])
        );
        assert_eq!(
            (r.to_string().as_str(), r.ranks()),
            ("rank 2 called y", vec![2])
        );
        assert!(d.split_once(" nowhere ").is_none());
        let w = d.map_text(|t| t.replace("called", "ran"));
        assert_eq!(w.to_string(), "rank 0 ran x but rank 2 ran y");
        assert_eq!(w.ranks(), [0, 2]);
    }
}
