//! The cross-rank check: before any data moves, every rank all-gathers a short descriptor of
//! its call (the collective, the phase, dtypes, shapes, roots, ops) over the group's cpu
//! control channel and compares; a disagreement is an [`Error::Mismatch`] on every rank naming
//! the ranks and values. The same exchange serves [`all_gather_metadata`] for the layers above.

use tensorplay_core::{DType, Tensor};

use super::translate::to_global;
use super::{Call, blocking, call, resolve};
use crate::backend::{BufMut, BufRef};
use crate::group::ProcessGroup;
use crate::{Detail, Error, Part, ReduceOp, Result, detail};

/// Whether the pure checks run (`TENSORPLAY_COLLECTIVE_CHECK=0` skips them for speed).
pub(super) fn checks_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("TENSORPLAY_COLLECTIVE_CHECK").map_or(true, |v| v != "0" && v != "false")
    })
}

impl Call<'_> {
    /// All ranks' descriptors (one all-gather of `desc`, which has the same length on every
    /// rank). The collective's name travels with it: ranks that called different collectives
    /// get an [`Error::Mismatch`] naming them instead of pairing unrelated descriptors.
    ///
    /// A rank whose own argument checks gave an error in `local` still takes part (with a
    /// flag), so that when one rank alone passes bad arguments every rank fails this call
    /// together — that rank with its own error, the others with an [`Error::Mismatch`] naming
    /// it and quoting its error — and the ranks stay in step for the next call. Every check a
    /// collective makes of its own arguments therefore goes into `local`, never returns early.
    pub(super) fn exchange_local(&self, desc: &[i64], local: Result<()>) -> Result<Vec<Vec<i64>>> {
        if self.size == 1 {
            local?;
            return Ok(vec![desc.to_vec()]);
        }
        let mut d = vec![
            op_id(self.op),
            phase_id(current_phase()),
            i64::from(local.is_err()),
        ];
        d.extend_from_slice(desc);
        let n = d.len();
        let desc = &d[..];
        let mut out = vec![0i64; n * self.size];
        let counts = vec![n; self.size];
        self.ctl()?
            .all_gather(
                BufRef::I64(desc),
                BufMut::I64(&mut out),
                &counts,
                self.timeout(),
            )
            .map_err(|e| match to_global(self.g.ranks(), e) {
                // name the collective the user called, not the check's internal all_gather
                Error::PeerFailed {
                    rank, peer, detail, ..
                } => Error::PeerFailed {
                    rank,
                    peer,
                    op: format!(
                        "{}{} (while checking arguments across ranks)",
                        self.op,
                        phase_words()
                    ),
                    detail: plain(detail).join(detail!(
                        " (did rank ",
                        Part::Rank(peer),
                        " exit or fail?)"
                    )),
                },
                Error::Timeout {
                    rank,
                    timeout,
                    detail,
                    ..
                } => Error::Timeout {
                    op: format!(
                        "{}{} (while checking arguments across ranks)",
                        self.op,
                        phase_words()
                    ),
                    rank,
                    timeout,
                    detail: plain(detail).join(
                        " (did that rank skip this call, for example a backward pass the other \
                         ranks run?)",
                    ),
                },
                // the backend's own check: the descriptors differ in length, so the ranks called
                // different collectives
                Error::Mismatch { detail, .. } => Error::Mismatch {
                    op: format!("{} (while checking arguments across ranks)", self.op),
                    detail: self.user_terms(detail).join(
                        ": the ranks' argument descriptors differ in length (did they call \
                         different collectives?), and this group can no longer be used",
                    ),
                },
                other => other,
            })?;
        let all: Vec<Vec<i64>> = out.chunks(n).map(|c| c.to_vec()).collect();
        agree(self, &all, 0..2, "the collective called", |v| {
            format!("{}{}", op_name(v[0]), phase_name(v[1]))
        })?;
        let bad: Vec<usize> = (0..self.size).filter(|&r| all[r][2] != 0).collect();
        if !bad.is_empty() {
            // every rank takes part in this second exchange (all saw the same flags), so that
            // each rank's own error text reaches the others
            let texts = self.error_texts(local.as_ref().err())?;
            local?;
            let global: Vec<usize> = bad.iter().map(|&r| self.g.ranks()[r]).collect();
            let mut detail = detail!(
                "rank(s) ",
                Part::Ranks(global.clone()),
                " rejected their own arguments: "
            );
            for (i, (&r, &g)) in bad.iter().zip(&global).enumerate() {
                // each rank's own error arrives as its text (already in global ranks)
                let sep = if i == 0 { "rank " } else { "; rank " };
                detail = detail.join(detail!(sep, Part::Rank(g), format!(": {}", texts[r])));
            }
            return Err(Error::Mismatch {
                op: self.op.to_string(),
                detail,
            });
        }
        Ok(all.into_iter().map(|mut v| v.split_off(3)).collect())
    }

    /// [`Call::exchange_local`] for checks that also produce values (split sizes, a root):
    /// `local` is this rank's descriptor and values, or its own error, in which case a
    /// descriptor of `len` zeros stands in, so that every rank still takes part and fails the
    /// call together.
    pub(super) fn exchange_checked<T>(
        &self,
        len: usize,
        local: Result<(Vec<i64>, T)>,
    ) -> Result<(Vec<Vec<i64>>, T)> {
        match local {
            Ok((d, v)) => Ok((self.exchange_local(&d, Ok(()))?, v)),
            Err(e) => {
                let mine = e.clone();
                self.exchange_local(&vec![0; len], Err(e))?;
                Err(mine)
            }
        }
    }

    /// All-gathers each rank's error text (at most [`TEXT_WORDS`] * 8 bytes; empty for a rank
    /// without one) over the control channel.
    fn error_texts(&self, mine: Option<&Error>) -> Result<Vec<String>> {
        let text = mine.map(ToString::to_string).unwrap_or_default();
        let mut bytes = [0u8; TEXT_WORDS * 8];
        let mut cut = text.len().min(bytes.len());
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        bytes[..cut].copy_from_slice(&text.as_bytes()[..cut]);
        let words: Vec<i64> = bytes
            .chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect();
        let mut out = vec![0i64; TEXT_WORDS * self.size];
        self.ctl()?
            .all_gather(
                BufRef::I64(&words),
                BufMut::I64(&mut out),
                &vec![TEXT_WORDS; self.size],
                self.timeout(),
            )
            .map_err(|e| to_global(self.g.ranks(), e))?;
        Ok(out
            .chunks(TEXT_WORDS)
            .map(|c| {
                let b: Vec<u8> = c.iter().flat_map(|w| w.to_le_bytes()).collect();
                let n = b.iter().position(|&x| x == 0).unwrap_or(b.len());
                String::from_utf8_lossy(&b[..n]).into_owned()
            })
            .collect())
    }

    /// [`in_user_terms`] for this call's argument check.
    fn user_terms(&self, detail: Detail) -> Detail {
        let phase = phase_name(phase_id(current_phase()));
        in_user_terms(
            detail,
            &format!(
                "{}{phase} (checking its arguments with the other ranks)",
                self.op
            ),
        )
    }
}

/// A transport-level detail without the transport's internals: which shared-memory step a
/// peer did not reach or died in, and the internal call numbers (its words reworded, its
/// ranks kept).
pub(super) fn plain(detail: Detail) -> Detail {
    detail.map_text(plain_words)
}

/// [`plain`] for words.
fn plain_words(detail: &str) -> String {
    let mut s = detail.to_string();
    for (from, to) in [
        (
            "never reached this point of the shared-memory ",
            "never reached this call",
        ),
        ("died or failed inside a shared-memory ", "died or failed"),
    ] {
        while let Some(i) = s.find(from) {
            // drop the internal collective's name that follows
            let rest = &s[i + from.len()..];
            let skip = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            s = format!("{}{to}{}", &s[..i], &rest[skip..]);
        }
    }
    while let Some(i) = s.find(" (call #") {
        match s[i..].find(')') {
            Some(j) => s.replace_range(i..i + j + 1, ""),
            None => break,
        }
    }
    s
}

/// A transport-level mismatch ("rank 0 called all_gather #3 (...) but rank 1 called
/// barrier #3 (...)") in the user's terms: this rank's side becomes `mine`, the call the user
/// made; the other side's internal all-gather becomes "another collective (checking its
/// arguments)"; the internal sequence numbers go.
pub(super) fn in_user_terms(detail: Detail, mine: &str) -> Detail {
    let Some((left, right)) = detail.split_once(" but ") else {
        return detail;
    };
    let left = match left.split_once(" called ") {
        Some((who, _)) => who.join(format!(" called {mine}")),
        None => left,
    };
    let right = match right.split_once(" called ") {
        Some((who, what)) => {
            let what = what.to_string();
            let name = what.split(" #").next().unwrap_or(&what);
            let rest = what.find(" (").map_or("", |i| &what[i..]);
            if name == "all_gather" {
                who.join(" called another collective (checking its arguments)")
            } else {
                who.join(format!(" called {name}{rest}"))
            }
        }
        None => right,
    };
    plain(left.join(" but ").join(right))
}

/// The size of an error text in the second exchange of a failed check, in 8-byte words
/// (512 bytes).
const TEXT_WORDS: usize = 64;

thread_local! {
    static PHASE: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the collectives it issues on this thread marked as belonging to `phase` (for
/// example `"backward"`; up to 8 ASCII bytes are compared and shown): the cross-rank check then
/// also compares phases, so that a rank in a backward pass never pairs its collective with
/// another rank's forward collective of the same shape (which would silently mix their data).
/// The innermost phase wins; the layers above use this, users rarely need to.
pub fn with_phase<R>(phase: &'static str, f: impl FnOnce() -> R) -> R {
    let prev = PHASE.with(|p| p.replace(Some(phase)));
    let r = f();
    PHASE.with(|p| p.set(prev));
    r
}

pub(super) fn current_phase() -> Option<&'static str> {
    PHASE.with(std::cell::Cell::get)
}

/// A phase as carried in the descriptor: its first 8 bytes, packed (0 for none), so that
/// every process can name it.
fn phase_id(phase: Option<&'static str>) -> i64 {
    let Some(p) = phase else { return 0 };
    let mut b = [0u8; 8];
    for (d, s) in b.iter_mut().zip(p.bytes()) {
        *d = s;
    }
    i64::from_le_bytes(b)
}

/// This thread's phase in words, for this rank's own messages.
fn phase_words() -> String {
    match current_phase() {
        None => String::new(),
        Some("backward") => " (in a backward pass through a differentiable collective)".into(),
        Some(p) => format!(" (in {p})"),
    }
}

fn phase_name(id: i64) -> String {
    if id == 0 {
        return String::new();
    }
    let b = id.to_le_bytes();
    let n = b.iter().position(|&c| c == 0).unwrap_or(8);
    format!(" (in {})", String::from_utf8_lossy(&b[..n]))
}

/// The collectives that exchange descriptors, by id.
const OP_NAMES: &[&str] = &[
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
];
fn op_id(op: &str) -> i64 {
    // the list form of reduce_scatter runs reduce_scatter_tensor's exchange
    let op = if op == "reduce_scatter" {
        "reduce_scatter_tensor"
    } else {
        op
    };
    match OP_NAMES.iter().position(|&o| o == op) {
        Some(i) => i as i64,
        None => {
            // other callers of the exchange (`all_gather_metadata`): a stable hash of the name,
            // remembered so that a mismatch can be reported by name
            let h = op.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            let id = 1000 + (h % 1_000_000_000) as i64;
            let mut names = EXTRA_OPS.lock().unwrap_or_else(|e| e.into_inner());
            if !names.iter().any(|(i, _)| *i == id) {
                names.push((id, op.to_string()));
            }
            id
        }
    }
}

static EXTRA_OPS: std::sync::Mutex<Vec<(i64, String)>> = std::sync::Mutex::new(Vec::new());

/// The name of an exchange id (see [`op_id`]).
fn op_name(id: i64) -> String {
    if let Some(n) = usize::try_from(id).ok().and_then(|i| OP_NAMES.get(i)) {
        return (*n).to_string();
    }
    let names = EXTRA_OPS.lock().unwrap_or_else(|e| e.into_inner());
    names
        .iter()
        .find(|(i, _)| *i == id)
        .map_or_else(|| format!("another collective (#{id})"), |(_, n)| n.clone())
}

/// All-gathers a short `i64` vector (metadata: shapes, split sizes, flags) from every rank of
/// `group` (the default group for `None`); returns one vector per group rank, in group-rank
/// order. Every rank must pass a vector of the same length.
///
/// `op` names the caller's operation; ranks calling different operations fail with
/// [`Error::Mismatch`] — and the group stays usable — when their descriptors have the same
/// length; descriptors of different lengths also fail the call on every rank with an
/// [`Error::Mismatch`], but the backend then shuts the group down. A rank whose own argument checks failed passes them as `local`: it
/// still takes part, so that every rank fails together — that rank with its own error, the
/// others with an [`Error::Mismatch`] naming it — and the ranks stay in step. This is how the
/// layers above (the differentiable collectives) agree on shapes before moving data; it runs in
/// the group's collective order and honours the group's timeout (an [`Error::Timeout`] naming
/// the rank that did not arrive). With one rank it returns `[desc]` without communicating.
///
/// # Errors
/// [`Error::NotInitialized`] without a default group, [`Error::InvalidArgument`] when this rank
/// is not in `group`, `local`'s error, [`Error::Mismatch`], [`Error::Timeout`],
/// [`Error::PeerFailed`].
#[track_caller]
pub fn all_gather_metadata(
    op: &'static str,
    desc: &[i64],
    local: Result<()>,
    group: Option<&ProcessGroup>,
) -> Result<Vec<Vec<i64>>> {
    let site = std::panic::Location::caller();
    let g = resolve(group, op)?;
    blocking(&g, op, site, None, || {
        call(&g, op)?.exchange_local(desc, local)
    })
}

pub(super) fn dtype_code(d: DType) -> i64 {
    i64::from(d.code())
}
pub(super) fn dtype_name(c: i64) -> String {
    u8::try_from(c)
        .ok()
        .and_then(DType::from_code)
        .map_or_else(|| format!("dtype #{c}"), |d| d.to_string())
}
pub(super) fn op_code(op: ReduceOp) -> i64 {
    op as i64
}
/// The name of an [`op_code`], for errors.
pub(super) fn op_label(code: i64) -> String {
    const OPS: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];
    OPS.iter()
        .find(|&&op| op_code(op) == code)
        .map_or_else(|| format!("#{code}"), |op| format!("{op:?}"))
}

pub(super) const MAX_DIMS: usize = 8;

/// Length of a [`shape_desc`].
pub(super) const DESC: usize = 3 + MAX_DIMS;

/// `[dtype, ndim, dims (padded with -1), tail]`. A tensor of more than `MAX_DIMS` dims has
/// the product of its dims from `MAX_DIMS - 1` on in the last dim slot (so the element count
/// stays right) and a hash of those dims in `tail` (0 otherwise), so that shapes still compare
/// exactly.
pub(super) fn shape_desc(t: &Tensor) -> Vec<i64> {
    let mut v = vec![dtype_code(t.dtype()), t.ndim() as i64];
    for i in 0..MAX_DIMS {
        v.push(t.shape().get(i).map_or(-1, |&d| d as i64));
    }
    let mut tail = 0;
    if t.ndim() > MAX_DIMS {
        let folded = &t.shape()[MAX_DIMS - 1..];
        v[1 + MAX_DIMS] = folded.iter().product::<usize>() as i64;
        let h = folded.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &d| {
            (h ^ d as u64).wrapping_mul(0x0100_0000_01b3)
        });
        tail = (h >> 1) as i64;
    }
    v.push(tail);
    v
}
pub(super) fn fmt_shape(d: &[i64]) -> String {
    let nd = d[1].max(0) as usize;
    let dims: Vec<String> = d[2..2 + nd.min(MAX_DIMS)]
        .iter()
        .map(|&x| (x as u64).to_string())
        .collect();
    let folded = if nd > MAX_DIMS {
        format!(
            " ({nd} dims: the last is the product of dims {}.., shape hash {:x})",
            MAX_DIMS - 1,
            d[DESC - 1]
        )
    } else {
        String::new()
    };
    format!("{} [{}]{folded}", dtype_name(d[0]), dims.join(", "))
}

/// Errors on every rank when field `range` of the descriptors differs across ranks.
pub(super) fn agree(
    c: &Call<'_>,
    all: &[Vec<i64>],
    range: std::ops::Range<usize>,
    what: &str,
    fmt: impl Fn(&[i64]) -> String,
) -> Result<()> {
    let first = &all[0][range.clone()];
    if all.iter().all(|d| &d[range.clone()] == first) {
        return Ok(());
    }
    let mut detail = Detail::from(format!("{what} must agree across ranks: "));
    for (r, d) in all.iter().enumerate() {
        let sep = if r == 0 { "rank " } else { "; rank " };
        detail = detail.join(detail!(
            sep,
            Part::Rank(c.g.ranks()[r]),
            format!(" passed {}", fmt(&d[range.clone()]))
        ));
    }
    Err(Error::Mismatch {
        op: c.op.to_string(),
        detail,
    })
}

pub(super) fn numel_of(d: &[i64]) -> usize {
    let nd = d[1].max(0) as usize;
    (0..nd.min(MAX_DIMS))
        .map(|i| d[2 + i].max(0) as usize)
        .product()
}

#[cfg(test)]
mod tests {
    use super::{in_user_terms, plain};
    use crate::{Detail, Error, Part, detail};

    /// "rank A called X but rank B called Y", the ranks typed.
    fn called(a: usize, x: &str, b: usize, y: &str) -> Detail {
        detail!(
            "rank ",
            Part::Rank(a),
            format!(" called {x} but rank "),
            Part::Rank(b),
            format!(" called {y}")
        )
    }

    #[test]
    fn transport_mismatches_read_in_the_users_terms() {
        let d = called(
            0,
            "all_gather #3 (36 elements of int64)",
            1,
            "barrier #3 (0 elements of float32)",
        );
        let t = in_user_terms(
            d,
            "all_reduce (in backward) (checking its arguments with the other ranks)",
        );
        assert_eq!(
            t.to_string(),
            "rank 0 called all_reduce (in backward) (checking its arguments with the other ranks) \
             but rank 1 called barrier (0 elements of float32)"
        );
        assert_eq!(t.ranks(), [0, 1]);
        let d = called(
            1,
            "barrier #3 (0 elements of float32)",
            0,
            "all_gather #3 (36 elements of int64)",
        );
        let t = in_user_terms(d, "barrier");
        assert_eq!(
            t.to_string(),
            "rank 1 called barrier but rank 0 called another collective (checking its arguments)"
        );
        assert_eq!(t.ranks(), [1, 0]);
        assert!(!t.contains("#"), "{t}");
    }

    #[test]
    fn transport_internals_are_left_out() {
        let cases = [
            (
                detail!(
                    "rank ",
                    Part::Rank(2),
                    " never reached this point of the shared-memory all_gather (still alive)"
                ),
                "rank 2 never reached this call (still alive)",
            ),
            (
                detail!(
                    "rank ",
                    Part::Rank(0),
                    " died or failed inside a shared-memory all_gather (its connection closed)"
                ),
                "rank 0 died or failed (its connection closed)",
            ),
            (
                called(
                    0,
                    "x",
                    2,
                    "barrier (0 elements) (call #3 and #3 of the group, round 0 and 0): differ",
                ),
                "rank 0 called x but rank 2 called barrier (0 elements): differ",
            ),
        ];
        for (d, want) in cases {
            let ranks = d.ranks();
            let p = plain(d);
            assert_eq!(p.to_string(), want);
            assert_eq!(p.ranks(), ranks, "{want}");
        }
    }

    #[test]
    fn errors_never_say_rank_minus_one() {
        let e = Error::Timeout {
            op: "store get".into(),
            rank: -1,
            timeout: std::time::Duration::from_secs(1),
            detail: "key k".into(),
        };
        assert_eq!(e.to_string(), "store get timed out after 1s: key k");
        let e = Error::invalid("rendezvous", -1, "RANK", "a rank", "\"-1\"");
        assert_eq!(
            e.to_string(),
            "rendezvous: invalid argument `RANK`: expected a rank, got \"-1\""
        );
        let e = Error::invalid("all_reduce", 3, "op", "Sum", "BAnd");
        assert!(matches!(e, Error::InvalidArgument { rank: 3, .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "all_reduce on rank 3: invalid argument `op`: expected Sum, got BAnd"
        );
    }
}
