//! Masking: `masked_fill`, and the triangle selections `triu` / `tril` that causal attention
//! masks are made of. All three are differentiable (through `where`): the gradient flows to the
//! kept elements and is zero at the replaced ones.

use crate::{DType, Error, Result, Tensor};

/// `[rows, cols]` bool, true where `j - i >= diagonal` (`upper`) or `j - i <= diagonal`.
fn triangle(rows: usize, cols: usize, diagonal: i64, upper: bool) -> Result<Tensor> {
    let n = crate::layout::checked_numel(&[rows, cols], "triu/tril")?;
    let mut v = crate::storage::try_vec(n, false, "triu/tril", "shape")?;
    for i in 0..rows {
        for j in 0..cols {
            let d = j as i64 - i as i64;
            v[i * cols + j] = if upper { d >= diagonal } else { d <= diagonal };
        }
    }
    Tensor::from_vec(v, &[rows, cols])
}

impl Tensor {
    /// Replaces the elements where `mask` is true by `value` (`torch.Tensor.masked_fill`).
    ///
    /// `mask` is a bool tensor broadcastable to this tensor's shape (the output has this
    /// tensor's shape and dtype); `value` is converted to the dtype (`-inf` is allowed for
    /// float tensors, as attention masks use). Differentiable in `self`: the gradient is zero
    /// at the filled elements.
    ///
    /// Errors: [`Error::UnsupportedDType`] when `mask` is not bool, [`Error::ShapeMismatch`]
    /// when it does not broadcast to this shape, [`Error::InvalidArgument`] for a NaN or
    /// infinite `value` on an int64 tensor.
    ///
    /// ```
    /// use tensorplay::Tensor;
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    /// let m = Tensor::from_vec(vec![false, true], &[2])?;
    /// let y = x.masked_fill(&m, f64::NEG_INFINITY)?;
    /// assert_eq!(y.to_vec::<f32>()?, [1.0, f32::NEG_INFINITY, 3.0, f32::NEG_INFINITY]);
    /// # Ok::<(), tensorplay::Error>(())
    /// ```
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        if mask.dtype() != DType::Bool {
            return Err(Error::UnsupportedDType {
                op: "masked_fill",
                dtype: mask.dtype(),
                expected: "bool for the mask",
            });
        }
        if crate::layout::broadcast_shapes(mask.shape(), self.shape(), "masked_fill")?
            != self.shape()
        {
            return Err(Error::ShapeMismatch {
                op: "masked_fill (mask must broadcast to the input's shape)",
                lhs: self.shape().to_vec(),
                rhs: mask.shape().to_vec(),
            });
        }
        let fill = Tensor::full(&[], value, (self.dtype(), self.device()))?;
        let keep = mask.logical_not()?;
        self.where_(&keep, &fill)
    }

    /// The upper triangle of the last two dimensions (`torch.triu`): elements with
    /// `col - row >= diagonal` are kept, the others set to zero. `diagonal = 0` keeps the main
    /// diagonal, `1` starts above it, negative values below it. Works on any dtype and any
    /// number of leading (batch) dimensions; differentiable (zero gradient below the triangle).
    ///
    /// Errors: [`Error::InvalidArgument`] for a tensor of fewer than 2 dimensions.
    ///
    /// ```
    /// use tensorplay::Tensor;
    /// let x = Tensor::from_vec(vec![1i64, 2, 3, 4, 5, 6, 7, 8, 9], &[3, 3])?;
    /// assert_eq!(x.triu(1)?.to_vec::<i64>()?, [0, 2, 3, 0, 0, 6, 0, 0, 0]);
    /// assert_eq!(x.tril(0)?.to_vec::<i64>()?, [1, 0, 0, 4, 5, 0, 7, 8, 9]);
    /// # Ok::<(), tensorplay::Error>(())
    /// ```
    pub fn triu(&self, diagonal: i64) -> Result<Tensor> {
        self.triangle_select(diagonal, true, "triu")
    }

    /// The lower triangle of the last two dimensions (`torch.tril`): elements with
    /// `col - row <= diagonal` are kept, the others set to zero. See [`Tensor::triu`] for the
    /// conventions and errors.
    pub fn tril(&self, diagonal: i64) -> Result<Tensor> {
        self.triangle_select(diagonal, false, "tril")
    }

    fn triangle_select(&self, diagonal: i64, upper: bool, op: &'static str) -> Result<Tensor> {
        let nd = self.ndim();
        if nd < 2 {
            return Err(Error::invalid(
                op,
                "input",
                "a tensor of at least 2 dimensions",
                format!("shape {:?}", self.shape()),
            ));
        }
        let (rows, cols) = (self.shape()[nd - 2], self.shape()[nd - 1]);
        let keep = triangle(rows, cols, diagonal, upper)?.to_device(self.device())?;
        let zero = Tensor::full(&[], 0.0, (self.dtype(), self.device()))?;
        self.where_(&keep, &zero)
    }
}

/// The additive causal mask of attention: `[rows, cols]` of `dtype`, `0` where key `j` may be
/// seen from query `i` (`j <= i`: PyTorch's `is_causal`, aligned to the top left) and `-inf`
/// elsewhere.
pub(crate) fn causal_bias(rows: usize, cols: usize, dtype: DType) -> Result<Tensor> {
    let n = crate::layout::checked_numel(&[rows, cols], "causal mask")?;
    let mut v = crate::storage::try_vec(n, 0.0f64, "causal mask", "shape")?;
    for i in 0..rows {
        for j in (i + 1)..cols {
            v[i * cols + j] = f64::NEG_INFINITY;
        }
    }
    Tensor::from_vec(v, &[rows, cols])?.to_dtype(dtype)
}
