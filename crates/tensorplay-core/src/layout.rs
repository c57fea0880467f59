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

#[cfg(test)]
mod tests {
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
