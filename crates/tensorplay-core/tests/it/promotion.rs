//! Type promotion of mixed-dtype and scalar arithmetic, as in PyTorch.

use tensorplay_core::{self as tp, DType, Tensor};

#[test]
fn integer_and_float_promotion() -> tp::Result<()> {
    let i = Tensor::from_vec(vec![1i64, 2, 3], &[3])?;
    assert_eq!(i.add_scalar(2.0)?.dtype(), DType::I64);
    assert_eq!(i.add_scalar(2.0)?.to_vec::<i64>()?, vec![3, 4, 5]);
    let f = i.add_scalar(0.5)?;
    assert_eq!(f.dtype(), DType::F32);
    assert_eq!(f.to_vec::<f32>()?, vec![1.5, 2.5, 3.5]);
    assert_eq!(i.mul_scalar(0.5)?.to_vec::<f32>()?, vec![0.5, 1.0, 1.5]);
    assert_eq!(i.div_scalar(2.0)?.to_vec::<f32>()?, vec![0.5, 1.0, 1.5]);
    let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0], &[3])?;
    assert_eq!(x.add(&i)?.dtype(), DType::F64);
    assert_eq!(i.div(&i)?.dtype(), DType::F32);
    // true division, not multiplication by the reciprocal
    let t = Tensor::from_vec(vec![1.0f32], &[1])?;
    assert_eq!(t.div_scalar(3.0)?.to_vec::<f32>()?, vec![1.0f32 / 3.0]);
    Ok(())
}
