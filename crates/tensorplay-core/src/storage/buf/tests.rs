use super::*;

/// A storage, the dtype and length its buffer reports, and its bytes.
struct Case {
    name: &'static str,
    storage: CpuStorage,
    buf: Option<(DType, usize)>,
    bytes: Vec<u8>,
}

fn check(c: Case) {
    let name = c.name;
    assert_eq!(c.storage.as_bytes(), &c.bytes[..], "{name}: bytes");
    let got = c.storage.as_buf().map(|b| (b.dtype(), b.len()));
    assert_eq!(got, c.buf, "{name}: buffer");
    let Some(b) = c.storage.as_buf() else {
        return;
    };
    assert_eq!(b.as_bytes(), &c.bytes[..], "{name}: buffer bytes");
    assert_eq!(
        b.elem_size(),
        b.dtype().size_in_bytes(),
        "{name}: element size"
    );
    let back = HostBuf::from_bytes(b.dtype(), b.as_bytes()).map(|x| x.to_storage());
    assert_eq!(
        back.as_ref().map(CpuStorage::as_bytes),
        Some(&c.bytes[..]),
        "{name}: from_bytes round trip"
    );
    let mut copy = b.to_storage();
    let mut m = copy.as_buf_mut().expect("a buffer's copy has a buffer");
    assert_eq!(
        m.as_bytes_mut().len(),
        c.bytes.len(),
        "{name}: writable bytes"
    );
}

#[test]
fn every_dtype_has_a_byte_view_of_its_own_size() {
    let cases = [
        Case {
            name: "float32",
            storage: CpuStorage::F32(vec![1.0, -2.5]),
            buf: Some((DType::F32, 2)),
            bytes: [1.0f32.to_ne_bytes(), (-2.5f32).to_ne_bytes()].concat(),
        },
        Case {
            name: "float64",
            storage: CpuStorage::F64(vec![0.125]),
            buf: Some((DType::F64, 1)),
            bytes: 0.125f64.to_ne_bytes().to_vec(),
        },
        Case {
            name: "int64",
            storage: CpuStorage::I64(vec![-3, 1 << 40]),
            buf: Some((DType::I64, 2)),
            bytes: [(-3i64).to_ne_bytes(), (1i64 << 40).to_ne_bytes()].concat(),
        },
        Case {
            name: "bool: one byte each, no writable buffer",
            storage: CpuStorage::Bool(vec![true, false, true]),
            buf: None,
            bytes: vec![1, 0, 1],
        },
    ];
    for c in cases {
        check(c);
    }
}

#[test]
fn buffers_split_and_slice_by_elements() {
    let mut s = CpuStorage::I64(vec![1, 2, 3, 4, 5]);
    let b = s.as_buf_mut().unwrap();
    let (lo, hi) = b.split_at(2);
    assert_eq!(lo.into_ref().as_bytes().len(), 16);
    let mut hi = hi.into_slice(1..3);
    hi.as_bytes_mut()
        .copy_from_slice(bytes::as_bytes(&[40i64, 50]));
    assert_eq!(i64::of_buf(hi.as_ref()), Some(&[40, 50][..]));
    assert_eq!(f32::of_buf(hi.as_ref()), None, "another dtype's slice");
    assert_eq!(s.as_buf().unwrap().slice(1..4).len(), 3);
    assert!(matches!(&s, CpuStorage::I64(v) if v == &[1, 2, 3, 40, 50]));
    assert!(
        HostBuf::from_bytes(DType::Bool, &[0, 1]).is_none(),
        "bool has no buffer"
    );
    assert!(
        HostBuf::from_bytes(DType::F32, &[0; 6]).is_none(),
        "not whole elements"
    );
}
