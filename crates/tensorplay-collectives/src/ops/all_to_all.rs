//! The exchanges between every pair of ranks: `all_to_all`, `all_to_all_single`.

use tensorplay_core::{DType, Tensor};

use super::check::{agree, dtype_code, dtype_name};
use super::stage::{self, Out};
use super::{Call, blocking, call, check_writable, queued, resolve};
use crate::group::ProcessGroup;
use crate::work::Work;
use crate::{Error, Part, Result, detail};

/// Rank `r` sends `input_list[s]` to rank `s`, which receives it into `output_list[r]`
/// (`dist.all_to_all`). Sizes may differ per pair but must agree between sender and receiver.
///
/// # Errors
/// Not initialised, not a member, lists of the wrong length, tensors the group's backend does
/// not move or of differing dtypes, sizes that disagree between a sender and its receiver (on
/// every rank), a timeout or a failed peer.
#[track_caller]
pub fn all_to_all(
    output_list: &[Tensor],
    input_list: &[Tensor],
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "all_to_all")?;
    blocking(&g, "all_to_all", site, input_list.first(), || {
        let c = call(&g, "all_to_all")?;
        let local = (|| -> Result<(DType, Vec<usize>, Vec<usize>)> {
            for (name, l) in [("output_list", output_list), ("input_list", input_list)] {
                if l.len() != c.size {
                    return Err(c.err(name, format!("{} tensors (one per rank)", c.size), l.len()));
                }
            }
            let dt = input_list[0].dtype();
            for (r, t) in input_list.iter().chain(output_list).enumerate() {
                c.accept(&format!("tensor {r} of the lists"), t)?;
                if t.dtype() != dt {
                    return Err(c.err("lists", format!("one dtype ({dt})"), t.dtype()));
                }
            }
            for (r, t) in output_list.iter().enumerate() {
                check_writable(&c, &format!("output_list[{r}]"), t)?;
            }
            let send = input_list.iter().map(|t| t.numel()).collect();
            let recv = output_list.iter().map(|t| t.numel()).collect();
            Ok((dt, send, recv))
        })();
        a2a_check(&c, local)?;
        let mut inputs = stage::inputs(input_list)?;
        for t in &mut inputs {
            for o in output_list {
                *t = stage::input(t, Some(o))?;
            }
        }
        let outs = stage::outs(output_list)?;
        let views = stage::views(&outs);
        c.run(|b| b.all_to_all(&views, &inputs, c.timeout()))?;
        stage::finish_all(outs)
    })
}

/// Checks that what each rank sends to each other rank is what that rank expects to receive;
/// `local` is this rank's dtype and element counts sent and expected per rank, or its own
/// argument error (which then fails the call on every rank). Returns the counts.
fn a2a_check(
    c: &Call<'_>,
    local: Result<(DType, Vec<usize>, Vec<usize>)>,
) -> Result<(Vec<usize>, Vec<usize>)> {
    let local = local.map(|(dt, send, recv)| {
        let mut d = vec![dtype_code(dt)];
        d.extend(send.iter().map(|&x| x as i64));
        d.extend(recv.iter().map(|&x| x as i64));
        (d, (send, recv))
    });
    let (all, counts) = c.exchange_checked(1 + 2 * c.size, local)?;
    agree(c, &all, 0..1, "dtype", |v| dtype_name(v[0]))?;
    let n = c.size;
    for r in 0..n {
        for s in 0..n {
            let sends = all[r][1 + s];
            let expects = all[s][1 + n + r];
            if sends != expects {
                return Err(Error::Mismatch {
                    op: c.op.to_string(),
                    detail: detail!(
                        "rank ",
                        Part::Rank(c.g.ranks()[r]),
                        format!(" sends {sends} elements to rank "),
                        Part::Rank(c.g.ranks()[s]),
                        " but rank ",
                        Part::Rank(c.g.ranks()[s]),
                        format!(" expects {expects} from rank "),
                        Part::Rank(c.g.ranks()[r])
                    ),
                });
            }
        }
    }
    Ok(counts)
}

/// Splits `input` along its first dimension by `input_split_sizes` (rows; default: equal
/// parts), sends part `s` to rank `s`, and writes what rank `r` sent into `output`'s rows given
/// by `output_split_sizes` (`dist.all_to_all_single`). Rows must have one shape on all ranks.
///
/// # Errors
/// As [`all_to_all`], and split sizes that do not sum to the rows (or rows that do not split
/// evenly when no sizes are given).
#[track_caller]
pub fn all_to_all_single(
    output: &Tensor,
    input: &Tensor,
    output_split_sizes: Option<&[usize]>,
    input_split_sizes: Option<&[usize]>,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "all_to_all_single")?;
    blocking(&g, "all_to_all_single", site, Some(input), || {
        a2as_impl(&g, output, input, output_split_sizes, input_split_sizes)
    })
}

/// [`all_to_all_single`] with `async_op=True`.
#[track_caller]
pub fn all_to_all_single_async(
    output: &Tensor,
    input: &Tensor,
    output_split_sizes: Option<Vec<usize>>,
    input_split_sizes: Option<Vec<usize>>,
    group: Option<&ProcessGroup>,
) -> Result<Work> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "all_to_all_single")?;
    let (o, i, g2) = (output.clone(), input.clone(), g.clone());
    queued(&g, "all_to_all_single", site, Some(input), move || {
        a2as_impl(
            &g2,
            &o,
            &i,
            output_split_sizes.as_deref(),
            input_split_sizes.as_deref(),
        )
    })
}

fn a2as_impl(
    g: &ProcessGroup,
    output: &Tensor,
    input: &Tensor,
    out_splits: Option<&[usize]>,
    in_splits: Option<&[usize]>,
) -> Result<()> {
    let c = call(g, "all_to_all_single")?;
    let local = (|| -> Result<(DType, Vec<usize>, Vec<usize>)> {
        c.accept("input", input)?;
        c.accept("output", output)?;
        check_writable(&c, "output", output)?;
        if input.dtype() != output.dtype() {
            return Err(c.err(
                "output",
                format!("input's dtype {}", input.dtype()),
                output.dtype(),
            ));
        }
        if input.ndim() > 0 && output.ndim() > 0 && input.shape()[1..] != output.shape()[1..] {
            return Err(c.err(
                "output",
                format!("rows of shape {:?} like input's", &input.shape()[1..]),
                format!("{:?}", &output.shape()[1..]),
            ));
        }
        let rn = row_numel(input);
        let send = splits(&c, in_splits, input, "input_split_sizes")?
            .iter()
            .map(|r| r * rn)
            .collect();
        let recv = splits(&c, out_splits, output, "output_split_sizes")?
            .iter()
            .map(|r| r * rn)
            .collect();
        Ok((input.dtype(), send, recv))
    })();
    let (send, recv) = a2a_check(&c, local)?;
    let inp = stage::input(input, Some(output))?;
    let out = Out::new(output)?;
    c.run(|b| b.all_to_all_single(out.t(), &inp, &send, &recv, c.timeout()))?;
    out.finish()
}

/// The rows of `t` for splitting: its first dimension (a scalar is one row).
fn rows(t: &Tensor) -> usize {
    if t.ndim() == 0 { 1 } else { t.shape()[0] }
}

/// The elements of one row of `t`.
fn row_numel(t: &Tensor) -> usize {
    if t.ndim() == 0 {
        1
    } else {
        t.shape()[1..].iter().product::<usize>()
    }
}

/// The rows per rank: the `given` split sizes of argument `arg`, checked to be one per rank
/// summing to `t`'s rows, or equal parts when none are given.
fn splits(c: &Call<'_>, given: Option<&[usize]>, t: &Tensor, arg: &str) -> Result<Vec<usize>> {
    match given {
        Some(s) => {
            let sum = s.iter().try_fold(0usize, |a, &v| a.checked_add(v));
            if s.len() != c.size || sum != Some(rows(t)) {
                return Err(c.err(
                    arg,
                    format!("{} sizes summing to {} rows", c.size, rows(t)),
                    format!("{s:?}"),
                ));
            }
            Ok(s.to_vec())
        }
        None => {
            if !rows(t).is_multiple_of(c.size) {
                return Err(c.err(
                    arg,
                    format!(
                        "given, since {} rows do not split evenly over {} ranks",
                        rows(t),
                        c.size
                    ),
                    "None",
                ));
            }
            Ok(vec![rows(t) / c.size; c.size])
        }
    }
}
