//! Shape, strides and storage offset of a tensor view.

use crate::{Error, Result};

/// The view of a storage that a tensor is: `shape`, element `strides` and a start `offset`
/// (all in elements, not bytes). Strides may be 0 (broadcast views from `expand`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<usize>,
    pub(crate) offset: usize,
}

/// Row-major (C-contiguous) strides of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1usize;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc *= shape[i].max(1);
    }
    strides
}

impl Layout {
    /// Elements `start..start + len` along dimension `dim` (which exists; the range within its
    /// size, checked by the caller): the same strides, the offset moved to `start` (kept where
    /// `len` is 0).
    pub(crate) fn narrowed(&self, dim: usize, start: usize, len: usize) -> Layout {
        let mut l = self.clone();
        l.shape[dim] = len;
        if len > 0 {
            l.offset += start * self.strides[dim];
        }
        l
    }

    /// A row-major layout of `shape` starting at offset 0.
    pub fn contiguous(shape: &[usize]) -> Layout {
        Layout {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The strides, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// The offset of the first element in the storage, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Whether the elements are laid out row-major without gaps (size-1 dims ignored).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1usize;
        for i in (0..self.shape.len()).rev() {
            if self.shape[i] == 1 {
                continue;
            }
            if self.strides[i] != acc {
                return false;
            }
            acc *= self.shape[i];
        }
        true
    }

    /// `Some(offset)` when contiguous: the elements are `storage[offset..offset + numel]`.
    pub fn contiguous_range(&self) -> Option<std::ops::Range<usize>> {
        self.is_contiguous()
            .then(|| self.offset..self.offset + self.numel())
    }

    /// The largest storage index this layout touches plus one (0 for empty tensors).
    pub fn storage_extent(&self) -> usize {
        if self.numel() == 0 {
            return 0;
        }
        self.offset
            + self
                .shape
                .iter()
                .zip(&self.strides)
                .map(|(&s, &st)| (s - 1) * st)
                .sum::<usize>()
            + 1
    }

    /// Calls `f` with the storage index of every element, in row-major order.
    #[inline]
    pub fn for_each_offset(&self, mut f: impl FnMut(usize)) {
        if let Some(r) = self.contiguous_range() {
            r.for_each(f);
            return;
        }
        let n = self.numel();
        if n == 0 {
            return;
        }
        let nd = self.shape.len();
        let inner = self.shape[nd - 1];
        let inner_stride = self.strides[nd - 1];
        let mut idx = vec![0usize; nd];
        let mut base = self.offset;
        let outer = n / inner;
        for _ in 0..outer {
            let mut o = base;
            for _ in 0..inner {
                f(o);
                o += inner_stride;
            }
            // advance the outer index (dims 0..nd-1)
            let mut d = nd - 1;
            while d > 0 {
                d -= 1;
                idx[d] += 1;
                base += self.strides[d];
                if idx[d] < self.shape[d] {
                    break;
                }
                base -= self.strides[d] * self.shape[d];
                idx[d] = 0;
            }
        }
    }

    /// Storage indices of all elements in row-major order.
    pub fn offsets(&self) -> Vec<usize> {
        let mut v = Vec::with_capacity(self.numel());
        self.for_each_offset(|o| v.push(o));
        v
    }

    /// This layout viewed with `shape` broadcast to `target` (stride 0 on broadcast dims).
    pub fn broadcast_to(&self, target: &[usize], op: &'static str) -> Result<Layout> {
        if target.len() < self.shape.len() {
            return Err(Error::ShapeMismatch {
                op,
                lhs: self.shape.clone(),
                rhs: target.to_vec(),
            });
        }
        let lead = target.len() - self.shape.len();
        let mut strides = vec![0usize; target.len()];
        for (i, &t) in target.iter().enumerate() {
            if i < lead {
                continue;
            }
            let s = self.shape[i - lead];
            if s == t {
                strides[i] = if t == 1 { 0 } else { self.strides[i - lead] };
            } else if s == 1 {
                strides[i] = 0;
            } else {
                return Err(Error::ShapeMismatch {
                    op,
                    lhs: self.shape.clone(),
                    rhs: target.to_vec(),
                });
            }
        }
        Ok(Layout {
            shape: target.to_vec(),
            strides,
            offset: self.offset,
        })
    }
}

/// The number of elements of `shape`, or an [`Error::InvalidArgument`] naming `op` when that
/// number, or the row-major strides of `shape` (which treat size-0 dims as size 1), overflow
/// `usize`.
pub(crate) fn checked_numel(shape: &[usize], op: &'static str) -> Result<usize> {
    let fits = shape
        .iter()
        .try_fold(1usize, |acc, &s| acc.checked_mul(s.max(1)))
        .is_some();
    if !fits {
        return Err(Error::invalid(
            op,
            "shape",
            "a shape whose number of elements fits in usize",
            format!("{shape:?}"),
        ));
    }
    Ok(shape.iter().product())
}

/// The broadcast shape of `a` and `b` (NumPy/PyTorch rules), or a `ShapeMismatch` naming `op`
/// (an `InvalidArgument` when the broadcast shape has more elements than `usize` can count).
pub fn broadcast_shapes(a: &[usize], b: &[usize], op: &'static str) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(Error::ShapeMismatch {
                op,
                lhs: a.to_vec(),
                rhs: b.to_vec(),
            });
        };
    }
    checked_numel(&out, op)?;
    Ok(out)
}

/// Normalises a possibly negative dimension index against `ndim`.
pub fn normalize_dim(dim: isize, ndim: usize, op: &'static str) -> Result<usize> {
    let n = ndim.max(1) as isize;
    let d = if dim < 0 { dim + n } else { dim };
    if d < 0 || d >= n {
        return Err(Error::DimOutOfRange { op, dim, ndim });
    }
    Ok(d as usize)
}

/// The strides that view a tensor of `shape` and `strides` as `new_shape` (same element count)
/// without moving any element, when some exist (`reshape` of a strided view without a copy:
/// dimensions may be split, and merged where they are laid out as one); `None` when the new
/// shape needs a copy. PyTorch's rule (`computeStride`): walk the old dimensions from the last,
/// in chunks whose elements are evenly spaced, and cut each chunk into new dimensions.
pub(crate) fn view_strides(
    shape: &[usize],
    strides: &[usize],
    new_shape: &[usize],
) -> Option<Vec<usize>> {
    let numel: usize = shape.iter().product();
    if numel == 0 || shape.is_empty() {
        // no element to move (or one): any strides describe it
        return Some(contiguous_strides(new_shape));
    }
    let mut out = vec![0usize; new_shape.len()];
    // the new dimensions not placed yet: 0..view_d
    let mut view_d = new_shape.len();
    let mut chunk_stride = *strides.last()?;
    let (mut tensor_numel, mut view_numel) = (1usize, 1usize);
    for d in (0..shape.len()).rev() {
        tensor_numel *= shape[d];
        // a chunk ends where the next (outer) dimension is not laid out right after this one
        let ends = d == 0 || (shape[d - 1] != 1 && strides[d - 1] != tensor_numel * chunk_stride);
        if !ends {
            continue;
        }
        while view_d > 0 && (view_numel < tensor_numel || new_shape[view_d - 1] == 1) {
            out[view_d - 1] = view_numel * chunk_stride;
            view_numel *= new_shape[view_d - 1];
            view_d -= 1;
        }
        if view_numel != tensor_numel {
            return None;
        }
        if d > 0 {
            chunk_stride = strides[d - 1];
            tensor_numel = 1;
            view_numel = 1;
        }
    }
    (view_d == 0).then_some(out)
}

#[cfg(test)]
mod tests {

    #[test]
    fn views_of_strided_tensors_without_a_copy() {
        // (name, shape, strides, new shape, strides of the view or None for a copy)
        type Case<'a> = (
            &'a str,
            &'a [usize],
            &'a [usize],
            &'a [usize],
            Option<&'a [usize]>,
        );
        let cases: &[Case] = &[
            (
                "contiguous split",
                &[4, 6],
                &[6, 1],
                &[4, 2, 3],
                Some(&[6, 3, 1]),
            ),
            (
                "contiguous merge",
                &[4, 2, 3],
                &[6, 3, 1],
                &[24],
                Some(&[1]),
            ),
            // a narrow of the last dim (a third of a fused projection) split into heads
            (
                "narrowed split",
                &[2, 5, 8],
                &[120, 24, 1],
                &[2, 5, 2, 4],
                Some(&[120, 24, 4, 1]),
            ),
            (
                "narrowed merge of the rows",
                &[2, 5, 8],
                &[120, 24, 1],
                &[10, 8],
                Some(&[24, 1]),
            ),
            (
                "narrowed merge across the gap",
                &[2, 5, 8],
                &[120, 24, 1],
                &[2, 40],
                None,
            ),
            ("transposed merge", &[3, 4], &[1, 3], &[12], None),
            (
                "transposed split",
                &[3, 4],
                &[1, 3],
                &[3, 2, 2],
                Some(&[1, 6, 3]),
            ),
            ("size-1 dims", &[1, 4, 1], &[99, 1, 7], &[4], Some(&[1])),
            ("new size-1 dims", &[4], &[2], &[1, 4, 1], Some(&[8, 2, 2])),
            (
                "broadcast dim kept",
                &[3, 4],
                &[0, 1],
                &[3, 2, 2],
                Some(&[0, 2, 1]),
            ),
            ("zero elements", &[0, 4], &[4, 1], &[2, 0], Some(&[1, 1])),
        ];
        for &(name, shape, strides, new_shape, want) in cases {
            let got = view_strides(shape, strides, new_shape);
            assert_eq!(got.as_deref(), want, "{name}");
        }
    }
    use super::*;

    #[test]
    fn offsets_of_transposed_view() {
        let l = Layout {
            shape: vec![3, 2],
            strides: vec![1, 3],
            offset: 1,
        };
        assert_eq!(l.offsets(), vec![1, 4, 2, 5, 3, 6]);
        assert!(!l.is_contiguous());
        assert_eq!(l.storage_extent(), 7);
    }

    #[test]
    fn broadcasting() {
        assert_eq!(
            broadcast_shapes(&[4, 1, 3], &[5, 1], "t").unwrap(),
            vec![4, 5, 3]
        );
        assert!(broadcast_shapes(&[2, 3], &[4], "t").is_err());
        let l = Layout::contiguous(&[3]).broadcast_to(&[2, 3], "t").unwrap();
        assert_eq!(l.offsets(), vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn dims() {
        assert_eq!(normalize_dim(-1, 3, "t").unwrap(), 2);
        assert!(normalize_dim(3, 3, "t").is_err());
        assert_eq!(normalize_dim(0, 0, "t").unwrap(), 0);
    }
}
