//! Matrix products through the `gemm` crate (any strides, no copies of transposed views).

use super::{float_dispatch, same_device, with_two};
use crate::autograd::{Context, Function, apply};
use crate::backend::{self, DeviceStorage as _};
use crate::layout::{Layout, broadcast_shapes};
use crate::storage::StorageElement;
use crate::{Error, Result, Tensor};

/// `out[b] = a[b] @ bmat[b]` for row-major batched layouts; `a`: [.., m, k], `b`: [.., k, n],
/// both already broadcast to the batch shape.
#[allow(clippy::too_many_arguments)]
fn bmm_kernel<T: GemmElem>(
    sa: &[T],
    la: &Layout,
    sb: &[T],
    lb: &Layout,
    batch: &[usize],
    m: usize,
    k: usize,
    n: usize,
) -> Vec<T> {
    let nb: usize = batch.iter().product();
    if m * n == 0 || k == 0 {
        return vec![T::default(); nb * m * n];
    }
    // every element is written by the product (gemm does not read the destination)
    let mut out = crate::storage::pool::take::<T>(nb * m * n);
    let nd = la.ndim();
    let bl = |l: &Layout| Layout {
        shape: batch.to_vec(),
        strides: l.strides[..nd - 2].to_vec(),
        offset: l.offset,
    };
    let (oa, ob) = (bl(la).offsets(), bl(lb).offsets());
    let (a_rs, a_cs) = (la.strides[nd - 2] as isize, la.strides[nd - 1] as isize);
    let (b_rs, b_cs) = (lb.strides[nd - 2] as isize, lb.strides[nd - 1] as isize);
    for bi in 0..nb {
        let dst = &mut out[bi * m * n..(bi + 1) * m * n];
        let (ta, tb) = (&sa[oa[bi]..], &sb[ob[bi]..]);
        gemm_into(dst, (m, n, k), (ta, a_rs, a_cs), (tb, b_rs, b_cs), false);
    }
    out
}

/// `dst (m x n, row-major) = [dst +] lhs (m x k) @ rhs (k x n)` through `gemm`, with
/// `read_dst` adding the product onto what `dst` holds. `lhs` and `rhs` start at their first
/// element and are walked by (row stride, column stride). Above 2^18 multiply-adds gemm splits
/// the output's tiles over the intra-op threads.
pub(crate) fn gemm_into<T: GemmElem>(
    dst: &mut [T],
    (m, n, k): (usize, usize, usize),
    (lhs, lhs_rs, lhs_cs): (&[T], isize, isize),
    (rhs, rhs_rs, rhs_cs): (&[T], isize, isize),
    read_dst: bool,
) {
    if m * n == 0 || k == 0 {
        return;
    }
    assert!(
        dst.len() >= m * n,
        "gemm_into: dst holds {} of {m} x {n}",
        dst.len()
    );
    let last = |rs: isize, cs: isize, r: usize, c: usize| {
        (r - 1) * rs.unsigned_abs() + (c - 1) * cs.unsigned_abs()
    };
    assert!(
        last(lhs_rs, lhs_cs, m, k) < lhs.len() && last(rhs_rs, rhs_cs, k, n) < rhs.len(),
        "gemm_into: an operand's extent passes its slice"
    );
    T::gemm(
        dst,
        (m, n, k),
        (lhs, lhs_rs, lhs_cs),
        (rhs, rhs_rs, rhs_cs),
        read_dst,
    );
}

/// The element types of the matrix products, each with its product kernel: float32 and
/// float64 through the `gemm` crate, the 16-bit types accumulating in float32 and rounding
/// each output element once.
pub(crate) trait GemmElem: StorageElement {
    /// [`gemm_into`] after its checks.
    fn gemm(
        dst: &mut [Self],
        dims: (usize, usize, usize),
        lhs: (&[Self], isize, isize),
        rhs: (&[Self], isize, isize),
        read_dst: bool,
    );
}
/// `GemmElem` for each element type, with the function that computes its product.
macro_rules! gemm_elem {
    ($($t:ty => $f:path),* $(,)?) => {$(
        impl GemmElem for $t {
            fn gemm(
                dst: &mut [Self],
                dims: (usize, usize, usize),
                lhs: (&[Self], isize, isize),
                rhs: (&[Self], isize, isize),
                read_dst: bool,
            ) {
                $f(dst, dims, lhs, rhs, read_dst)
            }
        }
    )*};
}
gemm_elem!(
    f32 => gemm_crate,
    f64 => gemm_crate,
    crate::bf16 => crate::kernels::gemm16::gemm_bf16,
    crate::f16 => crate::kernels::gemm16::gemm_f16,
);

/// [`gemm_into`] through the `gemm` crate (float32, float64).
fn gemm_crate<T: StorageElement + 'static>(
    dst: &mut [T],
    (m, n, k): (usize, usize, usize),
    (lhs, lhs_rs, lhs_cs): (&[T], isize, isize),
    (rhs, rhs_rs, rhs_cs): (&[T], isize, isize),
    read_dst: bool,
) {
    let threads = crate::kernels::get_num_threads();
    let parallel = threads > 1 && m * n * k >= 1 << 18;
    let mut run = |par: gemm::Parallelism| {
        // SAFETY: the asserts above keep every index gemm touches within the slices
        // (non-negative strides: the callers' layouts have usize strides): rows < m (k) and
        // columns < k (n) of each operand, and dst is m x n row-major.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                read_dst,
                lhs.as_ptr(),
                lhs_cs,
                lhs_rs,
                rhs.as_ptr(),
                rhs_cs,
                rhs_rs,
                one::<T>(),
                one::<T>(),
                false,
                false,
                false,
                par,
            );
        }
    };
    if parallel {
        // inside the intra-op pool, so that gemm's workers are its threads (one pool of
        // `get_num_threads()` threads, not a second one spinning beside it); gemm splits the
        // output's tiles between them and sums each element over the inner dimension in the
        // same blocks whatever the thread count (the thread-count test checks the bits)
        crate::kernels::with_pool(usize::MAX, |_| run(gemm::Parallelism::Rayon(threads)));
    } else {
        run(gemm::Parallelism::None);
    }
}

fn one<T: StorageElement>() -> T {
    T::from_f64(1.0)
}

/// `l` (`[batch dims..., rows, cols]`) as `[nb, rows, cols]` when its batch dims fold into one
/// stride (or are all broadcast), else `None`.
fn batch3(l: &Layout, nb: usize) -> Option<Layout> {
    let nd = l.shape.len();
    let mut stride: Option<usize> = None;
    let mut next: Option<(usize, usize)> = None; // (size, stride) of the batch dim to the right
    for d in (0..nd - 2).rev() {
        let (size, st) = (l.shape[d], l.strides[d]);
        if size == 1 {
            continue;
        }
        match next {
            None => stride = Some(st),
            Some((ns, nst)) if st == ns * nst => {}
            Some(_) => return None,
        }
        next = Some((size, st));
    }
    Some(Layout {
        shape: vec![nb, l.shape[nd - 2], l.shape[nd - 1]],
        strides: vec![stride.unwrap_or(0), l.strides[nd - 2], l.strides[nd - 1]],
        offset: l.offset,
    })
}

fn matmul_kernel(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    same_device("matmul", a, b)?;
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op: "matmul",
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    let (ra, rb) = (a.ndim(), b.ndim());
    let (m, k) = (a.shape()[ra - 2], a.shape()[ra - 1]);
    let (k2, n) = (b.shape()[rb - 2], b.shape()[rb - 1]);
    if k != k2 {
        return Err(Error::invalid(
            "matmul",
            "other",
            format!("{k} rows, matching the {k} columns of self {:?}", a.shape()),
            format!("shape {:?} with {k2} rows", b.shape()),
        ));
    }
    let batch = broadcast_shapes(&a.shape()[..ra - 2], &b.shape()[..rb - 2], "matmul")?;
    let mut sa = batch.clone();
    sa.extend([m, k]);
    let mut sb = batch.clone();
    sb.extend([k, n]);
    let la = a.layout().broadcast_to(&sa, "matmul")?;
    let lb = b.layout().broadcast_to(&sb, "matmul")?;
    let mut shape = batch.clone();
    shape.extend([m, n]);
    if let Some(r) = backend::on_device2(a, b, |ca, _, cb, _| {
        if !a.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "matmul",
                dtype: a.dtype(),
                expected: "a floating dtype (float32, float64, bfloat16 or float16)",
            });
        }
        let nb: usize = batch.iter().product();
        // operands whose batch dims do not fold into one stride are copied first
        let (a_copy, b_copy);
        let (ca, la3) = match batch3(&la, nb) {
            Some(l) => (ca, l),
            None => {
                a_copy = ca.copy_as(&la, a.dtype())?;
                (&a_copy, Layout::contiguous(&[nb, m, k]))
            }
        };
        let (cb, lb3) = match batch3(&lb, nb) {
            Some(l) => (cb, l),
            None => {
                b_copy = cb.copy_as(&lb, b.dtype())?;
                (&b_copy, Layout::contiguous(&[nb, k, n]))
            }
        };
        ca.matmul(&la3, cb, &lb3, nb)
    }) {
        return Ok(backend::device_tensor(r?, &shape));
    }
    float_dispatch!(a.dtype(), "matmul", T => {
        let v = with_two(a, b, "matmul", |da: &[T], _, db: &[T], _| bmm_kernel(da, &la, db, &lb, &batch, m, k, n))?;
        Ok(Tensor::from_cpu(T::into_storage(v), &shape))
    })
}

struct MatMul;
impl Function for MatMul {
    fn name(&self) -> &str {
        "MmBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        ctx.save_for_backward(&[inputs[0], inputs[1]]);
        Ok(vec![matmul_kernel(inputs[0], inputs[1])?])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let s = ctx.saved_tensors()?;
        let (a, b) = (&s[0], &s[1]);
        let ga = if ctx.needs_input_grad(0) {
            Some(g[0].matmul(&b.transpose(-1, -2)?)?.sum_to_size(a.shape())?)
        } else {
            None
        };
        let gb = if ctx.needs_input_grad(1) {
            if a.ndim() == 2
                && b.ndim() == 2
                && b.shape()[0] > 1
                && b.strides() == [1, b.shape()[0]]
            {
                // `b` is a transposed matrix (`linear`'s `weight.t()`): compute its gradient in
                // the transposed layout, `(g^T a)^T`, so that the gradient of the matrix it
                // views comes out contiguous (as PyTorch's `mm_mat2_backward` does) instead of
                // as a strided view every reader walks one element per cache line
                Some(g[0].t()?.matmul(a)?.t()?)
            } else {
                Some(a.transpose(-1, -2)?.matmul(&g[0])?.sum_to_size(b.shape())?)
            }
        } else {
            None
        };
        Ok(vec![ga, gb])
    }
}

impl Tensor {
    /// Matrix product with PyTorch's `matmul` rules: 1-d x 1-d is a dot product, 1-d
    /// operands are treated as a row (left) or column (right) vector and that dimension is
    /// removed from the result, and leading (batch) dimensions broadcast. Float only; the
    /// inner dimensions must agree.
    ///
    /// ```
    /// use tensorplay as tp;
    /// use tp::Tensor;
    /// let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    /// let b = Tensor::from_vec(vec![1.0f32, 1.0], &[2])?;
    /// assert_eq!(a.matmul(&b)?.to_vec::<f32>()?, vec![3.0, 7.0]);
    /// # Ok::<(), tp::Error>(())
    /// ```
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        if let Some(x) = crate::amp::to_lower(&[self, other])? {
            return x[0].matmul(&x[1]);
        }
        let (ra, rb) = (self.ndim(), other.ndim());
        if ra == 0 || rb == 0 {
            return Err(Error::invalid(
                "matmul",
                "operands",
                "tensors with at least one dimension",
                "a 0-d tensor",
            ));
        }
        let a = if ra == 1 {
            self.unsqueeze(0)?
        } else {
            self.clone()
        };
        let b = if rb == 1 {
            other.unsqueeze(1)?
        } else {
            other.clone()
        };
        let mut out = apply(MatMul, &[&a, &b])?.remove(0);
        if rb == 1 {
            out = out.squeeze_dim(-1)?;
        }
        if ra == 1 {
            out = out.squeeze_dim(-if rb == 1 { 1 } else { 2 })?;
        }
        Ok(out)
    }

    /// Alias of [`Tensor::matmul`] for 2-d operands (`mm`).
    pub fn mm(&self, other: &Tensor) -> Result<Tensor> {
        if let Some(x) = crate::amp::to_lower(&[self, other])? {
            return x[0].mm(&x[1]);
        }
        if self.ndim() != 2 || other.ndim() != 2 {
            return Err(Error::invalid(
                "mm",
                "operands",
                "two 2-d tensors",
                format!("{:?} and {:?}", self.shape(), other.shape()),
            ));
        }
        self.matmul(other)
    }
}
