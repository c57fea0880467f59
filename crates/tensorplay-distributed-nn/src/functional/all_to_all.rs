//! Personalised exchanges: [`all_to_all`] and [`all_to_all_single`].

use tensorplay_collectives::{self as coll, Part, ProcessGroup};
use tensorplay_core::autograd::{Context, Function, apply};
use tensorplay_core::{Result, Tensor};

use super::agreement::{SHAPE_LEN, agree_dtype, dtype_code, push_shape, read_shape};
use super::group::Grp;
use super::tensors::{check_tensor, fresh, zeros};

/// Rank `r` sends `inputs[j]` to rank `j` and returns the `W` tensors it received, element `j`
/// coming from rank `j` (differentiable `dist.all_to_all`): `y_r[j] = x_j[r]`. Shapes may
/// differ for every (sender, receiver) pair; dtypes must agree.
///
/// Backward: the same exchange of the upstream gradients, `dx_r[j] = g_j[r]`.
///
/// # Errors
/// A list whose length is not the group size, mixed dtypes, ranks disagreeing, timeouts and
/// peer failures.
pub fn all_to_all(inputs: &[Tensor], group: Option<&ProcessGroup>) -> Result<Vec<Tensor>> {
    const OP: &str = "all_to_all";
    let gp = Grp::new(group, OP)?;
    let len = 1 + gp.size * SHAPE_LEN;
    let desc = (|| {
        if inputs.len() != gp.size {
            return Err(gp.err(
                OP,
                "inputs",
                format!("{} tensors (one per rank of the group)", gp.size),
                inputs.len(),
            ));
        }
        let mut d = vec![dtype_code(inputs[0].dtype())];
        for (i, t) in inputs.iter().enumerate() {
            let arg = format!("inputs[{i}]");
            check_tensor(&gp, OP, &arg, t)?;
            if t.dtype() != inputs[0].dtype() {
                return Err(gp.err(OP, &arg, format!("dtype {}", inputs[0].dtype()), t.dtype()));
            }
            push_shape(&mut d, t.shape());
        }
        Ok(d)
    })();
    let all = gp.exchange("the size exchange of all_to_all", desc, len)?;
    agree_dtype(&gp, OP, &all, |d| d[0])?;
    // what rank j sends to this rank: its inputs[rank]
    let shapes: Vec<Vec<usize>> = all
        .iter()
        .map(|d| read_shape(&d[1 + gp.rank * SHAPE_LEN..]))
        .collect();
    let refs: Vec<&Tensor> = inputs.iter().collect();
    apply(AllToAll { gp, shapes }, &refs)
}

struct AllToAll {
    gp: Grp,
    /// Shape of the tensor received from each rank.
    shapes: Vec<Vec<usize>>,
}

impl Function for AllToAll {
    fn name(&self) -> &str {
        "AllToAllBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (dt, dev) = (inputs[0].dtype(), inputs[0].device());
        let outs = self
            .shapes
            .iter()
            .map(|s| zeros(s, dt, dev))
            .collect::<Result<Vec<_>>>()?;
        let list = inputs
            .iter()
            .map(|t| fresh(t))
            .collect::<Result<Vec<_>>>()?;
        coll::all_to_all(&outs, &list, self.gp.pg())?;
        Ok(outs)
    }
    fn backward(&self, _ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            Ok(all_to_all(grads, self.gp.pg())?
                .into_iter()
                .map(Some)
                .collect())
        })
    }
}

/// Splits `input` along its first dimension into `W` blocks of `input_split_sizes` rows
/// (`None`: equal blocks), sends block `j` to rank `j`, and returns the blocks received,
/// concatenated in rank order (differentiable `dist.all_to_all_single`). Uneven and zero-size
/// splits are allowed.
///
/// `output_split_sizes` (rows received from each rank) is optional: `None` takes what the
/// senders send; when given, it must match them (`output_split_sizes[j]` on rank `r` equals
/// `input_split_sizes[r]` on rank `j`), and a mismatch is an error on every rank naming the
/// pair — PyTorch hangs (NCCL) or leaves stale memory (gloo) there (pytorch/pytorch#117486).
/// The trailing dimensions and the dtype must agree across ranks.
///
/// Backward: the same exchange with the split lists swapped.
///
/// # Errors
/// A 0-d input, split lists whose length is not the group size or whose sum is not the
/// input's first dimension, a first dimension not divisible by `W` with `None` splits, ranks
/// disagreeing on splits, trailing shape or dtype; timeouts and peer failures.
pub fn all_to_all_single(
    input: &Tensor,
    output_split_sizes: Option<&[usize]>,
    input_split_sizes: Option<&[usize]>,
    group: Option<&ProcessGroup>,
) -> Result<Tensor> {
    const OP: &str = "all_to_all_single";
    let gp = Grp::new(group, OP)?;
    let w = gp.size;
    // [dtype, in_splits (W), out_given, out_splits (W), trailing shape]
    let len = 2 + 2 * w + SHAPE_LEN;
    let desc = (|| {
        check_tensor(&gp, OP, "input", input)?;
        if input.ndim() == 0 {
            return Err(gp.err(
                OP,
                "input",
                "a tensor with at least one dimension",
                "a 0-d tensor",
            ));
        }
        let rows = input.shape()[0];
        let ins: Vec<usize> = match input_split_sizes {
            Some(s) if !s.is_empty() => {
                if s.len() != w {
                    return Err(gp.err(
                        OP,
                        "input_split_sizes",
                        format!("{w} sizes (one per rank of the group)"),
                        format!("{} sizes {s:?}", s.len()),
                    ));
                }
                let total = s.iter().try_fold(0usize, |a, &v| a.checked_add(v));
                if total != Some(rows) {
                    return Err(gp.err(
                        OP,
                        "input_split_sizes",
                        format!("sizes summing to the input's first dimension ({rows})"),
                        match total {
                            Some(t) => format!("{s:?} (sum {t})"),
                            None => format!("{s:?} (the sum overflows)"),
                        },
                    ));
                }
                s.to_vec()
            }
            _ => {
                if !rows.is_multiple_of(w) {
                    return Err(gp.err(
                        OP,
                        "input",
                        format!("a first dimension divisible by the group size {w} (input_split_sizes is None)"),
                        format!("first dimension {rows}"),
                    ));
                }
                vec![rows / w; w]
            }
        };
        let outs = match output_split_sizes {
            Some(s) if !s.is_empty() => {
                if s.len() != w {
                    return Err(gp.err(
                        OP,
                        "output_split_sizes",
                        format!("{w} sizes (one per rank of the group)"),
                        format!("{} sizes {s:?}", s.len()),
                    ));
                }
                if s.iter()
                    .try_fold(0usize, |a, &v| a.checked_add(v))
                    .is_none()
                {
                    return Err(gp.err(
                        OP,
                        "output_split_sizes",
                        "sizes whose sum fits in usize",
                        format!("{s:?} (the sum overflows)"),
                    ));
                }
                Some(s)
            }
            _ => None,
        };
        let mut d = vec![dtype_code(input.dtype())];
        d.extend(ins.iter().map(|&v| v as i64));
        d.push(i64::from(outs.is_some()));
        match outs {
            Some(s) => d.extend(s.iter().map(|&v| v as i64)),
            None => d.extend(std::iter::repeat_n(-1, w)),
        }
        push_shape(&mut d, &input.shape()[1..]);
        Ok(d)
    })();
    let all = gp.exchange("the size exchange of all_to_all_single", desc, len)?;
    agree_dtype(&gp, OP, &all, |d| d[0])?;
    let trailing: Vec<Vec<usize>> = all.iter().map(|d| read_shape(&d[2 + 2 * w..])).collect();
    if let Some(k) = trailing.iter().position(|t| *t != trailing[0]) {
        return Err(coll::Error::Mismatch {
            op: OP.into(),
            detail: coll::detail!(
                "the rows' shapes differ: rank ",
                Part::Rank(gp.g.ranks()[0]),
                format!(" has rows of shape {:?}, rank ", trailing[0]),
                Part::Rank(gp.g.ranks()[k]),
                format!(" of {:?}", trailing[k])
            ),
        }
        .into());
    }
    // send[j][r]: rows rank j sends to rank r
    let sends: Vec<Vec<usize>> = all
        .iter()
        .map(|d| d[1..=w].iter().map(|&v| v as usize).collect())
        .collect();
    for (r, d) in all.iter().enumerate() {
        if d[1 + w] == 0 {
            continue;
        }
        for (j, send) in sends.iter().enumerate() {
            let expect = d[2 + w + j];
            if expect != send[r] as i64 {
                return Err(coll::Error::Mismatch {
                    op: OP.into(),
                    detail: coll::detail!(
                        "rank ",
                        Part::Rank(gp.g.ranks()[j]),
                        format!(" sends {} row(s) to rank ", send[r]),
                        Part::Rank(gp.g.ranks()[r]),
                        // sizes above i64::MAX travel as negative numbers
                        format!(
                            ", which expects {} (its output_split_sizes[{j}])",
                            expect as u64
                        )
                    ),
                }
                .into());
            }
        }
    }
    // what each rank receives must fit in usize (zero-size rows can be that many)
    for r in 0..w {
        let rows: Vec<usize> = sends.iter().map(|s| s[r]).collect();
        if rows
            .iter()
            .try_fold(0usize, |a, &v| a.checked_add(v))
            .is_none()
        {
            return Err(coll::Error::Mismatch {
                op: OP.into(),
                detail: coll::detail!(
                    "rank ",
                    Part::Rank(gp.g.ranks()[r]),
                    format!(" would receive {rows:?} rows from the ranks "),
                    Part::Ranks(gp.g.ranks().to_vec()),
                    ", more than fit in usize"
                ),
            }
            .into());
        }
    }
    let in_splits = sends[gp.rank].clone();
    let out_splits: Vec<usize> = sends.iter().map(|s| s[gp.rank]).collect();
    let f = AllToAllSingle {
        gp,
        in_splits,
        out_splits,
        trailing: trailing[0].clone(),
    };
    Ok(apply(f, &[input])?.remove(0))
}

struct AllToAllSingle {
    gp: Grp,
    in_splits: Vec<usize>,
    out_splits: Vec<usize>,
    trailing: Vec<usize>,
}

impl Function for AllToAllSingle {
    fn name(&self) -> &str {
        "AllToAllSingleBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let x = inputs[0];
        let mut shape = vec![self.out_splits.iter().sum::<usize>()];
        shape.extend_from_slice(&self.trailing);
        let out = zeros(&shape, x.dtype(), x.device())?;
        let inp = fresh(x)?;
        coll::all_to_all_single(
            &out,
            &inp,
            Some(&self.out_splits),
            Some(&self.in_splits),
            self.gp.pg(),
        )?;
        Ok(vec![out])
    }
    fn backward(&self, _ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            Ok(vec![Some(all_to_all_single(
                &grads[0],
                Some(&self.in_splits),
                Some(&self.out_splits),
                self.gp.pg(),
            )?)])
        })
    }
}
