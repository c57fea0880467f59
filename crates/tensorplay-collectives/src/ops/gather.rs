//! The gathering collectives: `all_gather`, `all_gather_into_tensor`, `gather`.

use tensorplay_core::Tensor;

use super::check::{DESC, agree, checks_enabled, dtype_name, fmt_shape, numel_of, shape_desc};
use super::stage::{self, Out};
use super::{blocking, call, check_writable, queued, resolve};
use crate::group::ProcessGroup;
use crate::work::Work;
use crate::{Error, Part, Result, detail};

/// Every rank's `tensor` is written into `tensor_list[r]` on every rank (`dist.all_gather`).
/// `tensor_list` has one tensor per rank of the group; rank `r`'s input may have its own
/// shape, and `tensor_list[r]` must have that shape.
///
/// # Errors
/// Not initialised, not a member, tensors the group's backend does not move, a list of the
/// wrong length, dtypes that differ across ranks, `tensor_list[r]` not of rank `r`'s shape,
/// a timeout or a failed peer.
#[track_caller]
pub fn all_gather(
    tensor_list: &[Tensor],
    tensor: &Tensor,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "all_gather")?;
    blocking(&g, "all_gather", site, Some(tensor), || {
        let c = call(&g, "all_gather")?;
        // descriptor: own input shape, then the shapes of own tensor_list, so that every rank
        // sees every rank's list and a wrong one fails the call on every rank, not only there
        let len = DESC * (1 + c.size);
        let local = (|| -> Result<(Vec<i64>, ())> {
            c.accept("tensor", tensor)?;
            if tensor_list.len() != c.size {
                return Err(c.err(
                    "tensor_list",
                    format!("{} tensors (one per rank)", c.size),
                    tensor_list.len(),
                ));
            }
            let mut d = shape_desc(tensor);
            for (r, o) in tensor_list.iter().enumerate() {
                c.accept(&format!("tensor_list[{r}]"), o)?;
                check_writable(&c, &format!("tensor_list[{r}]"), o)?;
                d.extend(shape_desc(o));
            }
            Ok((d, ()))
        })();
        let (all, ()) = c.exchange_checked(len, local)?;
        agree(&c, &all, 0..1, "dtype", |v| dtype_name(v[0]))?;
        for (q, dq) in all.iter().enumerate() {
            for (r, dr) in all.iter().enumerate() {
                let listed = &dq[DESC * (1 + r)..DESC * (2 + r)];
                if listed == &dr[..DESC] {
                    continue;
                }
                let expected = format!(
                    "the shape rank {} passed: {}",
                    c.g.ranks()[r],
                    fmt_shape(&dr[..DESC])
                );
                if q == c.rank {
                    return Err(c.err(&format!("tensor_list[{r}]"), expected, fmt_shape(listed)));
                }
                return Err(Error::Mismatch {
                    op: "all_gather".into(),
                    detail: detail!(
                        "rank ",
                        Part::Rank(c.g.ranks()[q]),
                        format!(
                            "'s tensor_list[{r}] is {} but must have the shape rank ",
                            fmt_shape(listed)
                        ),
                        Part::Rank(c.g.ranks()[r]),
                        format!(" passed: {}", fmt_shape(&dr[..DESC]))
                    ),
                });
            }
        }
        let outs = stage::outs(tensor_list)?;
        let views = stage::views(&outs);
        let inp = tensor_list
            .iter()
            .try_fold(stage::input(tensor, None)?, |t, o| {
                stage::input(&t, Some(o))
            })?;
        c.run(|b| b.all_gather(&views, &inp, c.timeout()))?;
        stage::finish_all(outs)
    })
}

/// Gathers every rank's `input` into `output`, concatenated along the first dimension in rank
/// order (`dist.all_gather_into_tensor`); `output` has `size * input.numel()` elements
/// (shape `[size * d0, ...]` or `[size, d0, ...]`). `input` may be a view into `output`.
///
/// # Errors
/// As [`all_gather`], and an `output` of the wrong size or dtype.
#[track_caller]
pub fn all_gather_into_tensor(
    output: &Tensor,
    input: &Tensor,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "all_gather_into_tensor")?;
    blocking(&g, "all_gather_into_tensor", site, Some(input), || {
        agit_impl(&g, output, input)
    })
}

/// [`all_gather_into_tensor`] with `async_op=True`.
#[track_caller]
pub fn all_gather_into_tensor_async(
    output: &Tensor,
    input: &Tensor,
    group: Option<&ProcessGroup>,
) -> Result<Work> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "all_gather_into_tensor")?;
    let (o, i, g2) = (output.clone(), input.clone(), g.clone());
    queued(&g, "all_gather_into_tensor", site, Some(input), move || {
        agit_impl(&g2, &o, &i)
    })
}

fn agit_impl(g: &ProcessGroup, output: &Tensor, input: &Tensor) -> Result<()> {
    let c = call(g, "all_gather_into_tensor")?;
    let local = c
        .accept("input", input)
        .and_then(|_| c.accept("output", output))
        .and_then(|_| check_writable(&c, "output", output))
        .and_then(|_| {
            if output.dtype() != input.dtype() || output.numel() != input.numel() * c.size {
                return Err(c.err(
                    "output",
                    format!(
                        "{} with {} elements (world {} x input {})",
                        input.dtype(),
                        input.numel() * c.size,
                        c.size,
                        input.numel()
                    ),
                    format!("{} with {} elements", output.dtype(), output.numel()),
                ));
            }
            Ok(())
        });
    if !checks_enabled() {
        local?;
    } else {
        let all = c.exchange_local(&shape_desc(input), local)?;
        agree(&c, &all, 0..DESC, "input dtype and shape", fmt_shape)?;
    }
    let inp = stage::input(input, Some(output))?;
    let out = Out::new(output)?;
    c.run(|b| b.all_gather_into_tensor(out.t(), &inp, c.timeout()))?;
    out.finish()
}

/// Gathers every rank's `tensor` into `gather_list` on global rank `dst` (`dist.gather`).
/// `gather_list` is required on `dst` (one tensor per rank, each of that rank's input shape)
/// and ignored elsewhere.
///
/// # Errors
/// As [`all_gather`], and `dst` outside the group or a missing or unusable `gather_list` on
/// `dst` (an error on every rank).
#[track_caller]
pub fn gather(
    tensor: &Tensor,
    gather_list: Option<&[Tensor]>,
    dst: usize,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "gather")?;
    blocking(&g, "gather", site, Some(tensor), || {
        let c = call(&g, "gather")?;
        let root = c.root("dst", dst);
        let local = root
            .as_ref()
            .map(|_| ())
            .map_err(Clone::clone)
            .and_then(|_| c.accept("tensor", tensor));
        // descriptor: own input shape, dst, whether the list on dst is usable, and (on dst) the
        // list's shapes, so that a bad gather_list is an error on every rank, not only on dst
        let w = DESC;
        let mut d = shape_desc(tensor);
        d.push(dst as i64);
        let mut local_err = None;
        if root.as_ref().is_ok_and(|&r| r == c.rank) {
            let checked = (|| -> Result<&[Tensor]> {
                let list = gather_list.ok_or_else(|| {
                    c.err(
                        "gather_list",
                        format!("{} tensors on the destination rank", c.size),
                        "None",
                    )
                })?;
                if list.len() != c.size {
                    return Err(c.err(
                        "gather_list",
                        format!("{} tensors (one per rank)", c.size),
                        list.len(),
                    ));
                }
                for (r, o) in list.iter().enumerate() {
                    c.accept(&format!("gather_list[{r}]"), o)?;
                    check_writable(&c, &format!("gather_list[{r}]"), o)?;
                }
                Ok(list)
            })();
            match checked {
                Ok(list) => {
                    d.push(1);
                    list.iter()
                        .for_each(|o| d.extend_from_slice(&shape_desc(o)[..w]));
                }
                Err(e) => {
                    d.push(0);
                    d.extend(std::iter::repeat_n(0, c.size * w));
                    local_err = Some(e);
                }
            }
        } else {
            d.push(1);
            d.extend(std::iter::repeat_n(0, c.size * w));
        }
        let all = c.exchange_local(&d, local)?;
        let root = root?;
        agree(&c, &all, 0..1, "dtype", |v| dtype_name(v[0]))?;
        agree(&c, &all, w..w + 1, "dst", |v| format!("dst {}", v[0]))?;
        let rd = &all[root];
        if rd[w + 1] == 0 {
            return Err(local_err.unwrap_or_else(|| Error::Mismatch {
                op: "gather".into(),
                detail: detail!(
                    "the destination rank ",
                    Part::Rank(dst),
                    format!(" passed no usable gather_list of {} tensors", c.size)
                ),
            }));
        }
        for r in 0..c.size {
            let listed = &rd[w + 2 + r * w..w + 2 + (r + 1) * w];
            if listed != &all[r][..w] {
                return Err(Error::Mismatch {
                    op: "gather".into(),
                    detail: detail!(
                        format!("gather_list[{r}] on the destination rank "),
                        Part::Rank(dst),
                        format!(" is {} but rank ", fmt_shape(listed)),
                        Part::Rank(c.g.ranks()[r]),
                        format!(" passed {}", fmt_shape(&all[r]))
                    ),
                });
            }
        }
        let counts: Vec<usize> = all.iter().map(|d| numel_of(d)).collect();
        let list = if c.rank == root { gather_list } else { None };
        let outs = list.map(stage::outs).transpose()?;
        let views = outs.as_deref().map(stage::views);
        let mut inp = stage::input(tensor, None)?;
        for o in list.unwrap_or(&[]) {
            inp = stage::input(&inp, Some(o))?;
        }
        c.run(|b| b.gather(&inp, views.as_deref(), &counts, root, c.timeout()))?;
        outs.map_or(Ok(()), stage::finish_all)
    })
}
