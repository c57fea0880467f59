//! Devices: parsing, and CUDA that either works (round trip) or fails with a clear error.

use tensorplay_core::{self as tp, DType, Device, Error, Tensor, cuda};

#[test]
fn device_strings() {
    assert_eq!(Device::parse("cpu").unwrap(), Device::Cpu);
    assert_eq!(Device::parse("cuda").unwrap(), Device::Cuda(0));
    assert_eq!(Device::parse("cuda:3").unwrap(), Device::Cuda(3));
    for bad in ["", "gpu", "cuda:", "cuda:-1", "cuda:x", "CPU", "cuda:1:2"] {
        let e = Device::parse(bad).unwrap_err();
        assert!(matches!(e, Error::InvalidDevice { .. }), "{bad:?}: {e}");
        assert!(e.to_string().contains("cuda:N"));
    }
    assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
}

#[test]
fn cuda_round_trip_or_clear_error() -> tp::Result<()> {
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    let xt = x.t()?; // a strided view: the copy must respect the layout
    if !cuda::is_available() {
        for dev in ["cuda", "cuda:0", "cuda:7"] {
            let e = xt.to(dev).unwrap_err();
            assert!(matches!(e, Error::CudaUnavailable { .. }), "{dev}: {e}");
        }
        assert!(matches!(
            Tensor::zeros(&[2], (DType::F32, Device::Cuda(0))),
            Err(Error::CudaUnavailable { .. })
        ));
        assert_eq!(cuda::device_count(), 0);
        return Ok(());
    }
    println!("CUDA available: {} device(s)", cuda::device_count());
    let g = xt.to("cuda:0")?;
    assert_eq!(g.device(), Device::Cuda(0));
    assert_eq!(g.shape(), &[3, 2]);
    assert_eq!(g.to_vec::<f32>()?, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    let back = g.cpu()?;
    assert_eq!(back.device(), Device::Cpu);
    assert_eq!(back.to_vec::<f32>()?, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    // gradients flow back across the copy
    let w = Tensor::from_vec(vec![1.0f64, 2.0], &[2])?.requires_grad_(true);
    let on_gpu = w.to("cuda")?;
    on_gpu.cpu()?.mul_scalar(3.0)?.sum()?.backward()?;
    assert_eq!(w.grad().unwrap().to_vec::<f64>()?, vec![3.0, 3.0]);
    // arithmetic on CUDA tensors is reported, not attempted
    assert!(matches!(g.add(&g), Err(Error::NotSupported { .. })));
    Ok(())
}
