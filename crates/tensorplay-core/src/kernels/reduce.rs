//! Sums of contiguous rows (`sum` over trailing dimensions, and over everything): each row in
//! the fixed lanes of [`sum_by`], a long row cut into fixed pieces whose partial sums are added
//! in order, so the result does not depend on the thread count.

use super::isa::dispatch;
use super::math::Elem;
use super::parallel::{for_each_chunk, map_tasks};
use super::rows::sum_by;
use crate::storage::StorageElement;
use crate::storage::pool::take;

/// Elements of a long row summed as one piece (its partial sums are then added in order).
const SUM_PIECE: usize = 1 << 15;

/// The sum of each of the `rows` contiguous rows of `n` elements of `x` (`x.len() == rows *
/// n`); a row of no elements sums to zero.
pub(crate) fn sum_rows<E: Elem + StorageElement>(x: &[E], rows: usize, n: usize) -> Vec<E> {
    let mut out = take::<E>(rows);
    if n == 0 {
        out.fill(E::store(<E::Acc as num_traits::Zero>::zero()));
        return out;
    }
    if n >= SUM_PIECE {
        // few long rows: the pieces of each row in parallel, added in order
        for (r, o) in out.iter_mut().enumerate() {
            let row = &x[r * n..(r + 1) * n];
            let parts = map_tasks(n.div_ceil(SUM_PIECE), n, |j| {
                let piece = &row[j * SUM_PIECE..((j + 1) * SUM_PIECE).min(n)];
                dispatch(
                    #[inline(always)]
                    || sum_by(piece, E::load),
                )
            });
            let total = parts
                .into_iter()
                .fold(<E::Acc as num_traits::Zero>::zero(), |a, p| a + p);
            *o = E::store(total);
        }
        return out;
    }
    // many short rows: whole rows per piece
    let per = (SUM_PIECE / n).max(1);
    for_each_chunk(&mut out, per, x.len(), |i, sums| {
        let xs = &x[i * per * n..(i * per + sums.len()) * n];
        dispatch(
            #[inline(always)]
            || {
                for (s, row) in sums.iter_mut().zip(xs.chunks_exact(n)) {
                    *s = E::store(sum_by(row, E::load));
                }
            },
        )
    });
    out
}

/// Whether `dims` (sorted, distinct) are the trailing dimensions of an `ndim`-d tensor.
pub(crate) fn trailing(dims: &[usize], ndim: usize) -> bool {
    !dims.is_empty()
        && dims.len() <= ndim
        && dims
            .iter()
            .enumerate()
            .all(|(i, &d)| d == ndim - dims.len() + i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailing_dims() {
        for (dims, ndim, want) in [
            (&[2usize][..], 3, true),
            (&[1, 2][..], 3, true),
            (&[0, 1, 2][..], 3, true),
            (&[0][..], 3, false),
            (&[1][..], 3, false),
            (&[0, 2][..], 3, false),
            (&[][..], 3, false),
        ] {
            assert_eq!(trailing(dims, ndim), want, "{dims:?} of {ndim}");
        }
    }
}
