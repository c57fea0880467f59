//! The collectives that send from one root: `broadcast`, `scatter`.

use tensorplay_core::Tensor;

use super::check::{DESC, agree, checks_enabled, dtype_name, fmt_shape, numel_of, shape_desc};
use super::stage::{self, Out};
use super::{blocking, call, check_writable, queued, resolve};
use crate::group::ProcessGroup;
use crate::work::Work;
use crate::{Error, Part, Result, detail};

/// In-place broadcast from global rank `src` (`dist.broadcast`).
///
/// # Errors
/// Not initialised, not a member, `src` outside the group, a tensor the group's backend does
/// not move, ranks that disagree on shape or `src` (on every rank), a timeout or a failed peer.
#[track_caller]
pub fn broadcast(tensor: &Tensor, src: usize, group: Option<&ProcessGroup>) -> Result<()> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "broadcast")?;
    blocking(&g, "broadcast", site, Some(tensor), || {
        broadcast_impl(&g, tensor, src)
    })
}

/// [`broadcast`] with `async_op=True`.
#[track_caller]
pub fn broadcast_async(tensor: &Tensor, src: usize, group: Option<&ProcessGroup>) -> Result<Work> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "broadcast")?;
    let (t, g2) = (tensor.clone(), g.clone());
    queued(&g, "broadcast", site, Some(tensor), move || {
        broadcast_impl(&g2, &t, src)
    })
}

fn broadcast_impl(g: &ProcessGroup, t: &Tensor, src: usize) -> Result<()> {
    let c = call(g, "broadcast")?;
    let root = c.root("src", src);
    let local = root
        .as_ref()
        .map(|_| ())
        .map_err(Clone::clone)
        .and_then(|_| c.accept("tensor", t))
        .and_then(|_| check_writable(&c, "tensor", t));
    if !checks_enabled() {
        local?;
    } else {
        let mut d = shape_desc(t);
        d.push(src as i64);
        let all = c.exchange_local(&d, local)?;
        agree(&c, &all, 0..DESC, "dtype and shape", fmt_shape)?;
        agree(&c, &all, DESC..DESC + 1, "src", |v| format!("src {}", v[0]))?;
    }
    let root = root?;
    let out = Out::new(t)?;
    c.run(|b| b.broadcast(out.t(), root, c.timeout()))?;
    out.finish()
}

/// Sends `scatter_list[r]` of global rank `src` to rank `r`'s `tensor` (`dist.scatter`).
/// `scatter_list` is required on `src` (one tensor per rank, of that rank's `tensor` shape);
/// other ranks pass `None`.
///
/// # Errors
/// As [`broadcast`], and a missing or unusable `scatter_list` on `src` (an error on every
/// rank) or element counts that do not match the receivers'.
#[track_caller]
pub fn scatter(
    tensor: &Tensor,
    scatter_list: Option<&[Tensor]>,
    src: usize,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "scatter")?;
    blocking(&g, "scatter", site, Some(tensor), || {
        let c = call(&g, "scatter")?;
        let root = c.root("src", src);
        let local = root
            .as_ref()
            .map(|_| ())
            .map_err(Clone::clone)
            .and_then(|_| c.accept("tensor", tensor))
            .and_then(|_| check_writable(&c, "tensor", tensor));
        // descriptor: own output shape, src, and (on src) the list's element counts
        let mut d = shape_desc(tensor);
        d.push(src as i64);
        let mut local_err = None;
        let list_ok = if root.as_ref().is_ok_and(|&r| r == c.rank) {
            let checked = match scatter_list {
                Some(l) if l.len() == c.size => l
                    .iter()
                    .enumerate()
                    .try_for_each(|(r, t)| {
                        c.accept(&format!("scatter_list[{r}]"), t)?;
                        if t.dtype() != tensor.dtype() {
                            return Err(c.err(
                                &format!("scatter_list[{r}]"),
                                format!("{} (the dtype of tensor)", tensor.dtype()),
                                t.dtype(),
                            ));
                        }
                        Ok(())
                    })
                    .map(|()| l),
                l => Err(c.err(
                    "scatter_list",
                    format!("{} tensors (one per rank) on the source rank", c.size),
                    l.map_or_else(|| "None".to_string(), |l| format!("{} tensors", l.len())),
                )),
            };
            match checked {
                Ok(l) => {
                    d.extend(l.iter().map(|t| t.numel() as i64));
                    1
                }
                Err(e) => {
                    local_err = Some(e);
                    d.extend(std::iter::repeat_n(-1, c.size));
                    0
                }
            }
        } else {
            d.extend(std::iter::repeat_n(0, c.size));
            1
        };
        d.push(list_ok);
        let all = c.exchange_local(&d, local)?;
        let root = root?;
        agree(&c, &all, 0..1, "dtype", |v| dtype_name(v[0]))?;
        agree(&c, &all, DESC..DESC + 1, "src", |v| format!("src {}", v[0]))?;
        let sd = &all[root];
        if sd[sd.len() - 1] == 0 {
            return Err(local_err.unwrap_or_else(|| Error::Mismatch {
                op: "scatter".into(),
                detail: detail!(
                    "the source rank ",
                    Part::Rank(src),
                    format!(" passed no usable scatter_list of {} tensors", c.size)
                ),
            }));
        }
        let counts: Vec<usize> = all.iter().map(|d| numel_of(d)).collect();
        for r in 0..c.size {
            let listed = sd[DESC + 1 + r];
            if listed != counts[r] as i64 {
                return Err(Error::Mismatch {
                    op: "scatter".into(),
                    detail: detail!(
                        format!("scatter_list[{r}] on the source rank "),
                        Part::Rank(src),
                        format!(" has {listed} elements but rank "),
                        Part::Rank(c.g.ranks()[r]),
                        format!(" expects {} ({})", counts[r], fmt_shape(&all[r]))
                    ),
                });
            }
        }
        let inputs = match scatter_list {
            Some(l) if c.rank == root => Some(
                l.iter()
                    .map(|t| stage::input(t, Some(tensor)))
                    .collect::<Result<Vec<_>>>()?,
            ),
            _ => None,
        };
        let out = Out::new(tensor)?;
        c.run(|b| b.scatter(inputs.as_deref(), out.t(), &counts, root, c.timeout()))?;
        out.finish()
    })
}
