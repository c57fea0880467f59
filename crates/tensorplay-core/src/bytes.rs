//! Byte views of host element slices: the one place in the workspace that reads typed memory
//! as bytes, or bytes as typed memory. Transports that move tensors as bytes (the collectives'
//! TCP and shared-memory paths, RPC frames) use these instead of casting pointers themselves.
//!
//! Bytes are in native endianness. Reading any element type's memory as bytes is sound for
//! the types here ([`ByteElement`]: no padding, no pointers); writing bytes into an element's
//! memory, or reading bytes as elements, only for the types where every byte pattern is a
//! value ([`PlainElement`]: `f32`, `f64`, `i64`, but not `bool`, whose only values are the
//! bytes 0 and 1).

use crate::Element;

mod sealed {
    /// Keeps [`super::ByteElement`] closed: its soundness argument holds only for the types
    /// listed in this module.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for i64 {}
    impl Sealed for bool {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// An element type whose memory is exactly its `size_of` bytes, with no padding and no
/// pointers: `f32`, `f64`, `i64`, `bool`, `bf16` and `f16` (the last two are transparent
/// wrappers of a `u16`). Sealed: implemented only here.
pub trait ByteElement: Element + sealed::Sealed {}
impl ByteElement for f32 {}
impl ByteElement for f64 {}
impl ByteElement for i64 {}
impl ByteElement for bool {}
impl ByteElement for half::bf16 {}
impl ByteElement for half::f16 {}

/// A [`ByteElement`] for which every byte pattern of its size is a value (`f32`, `f64`,
/// `i64`, `bf16`, `f16`), so that its memory may be written as bytes and bytes may be read as
/// it.
pub trait PlainElement: ByteElement {}
impl PlainElement for f32 {}
impl PlainElement for f64 {}
impl PlainElement for i64 {}
impl PlainElement for half::bf16 {}
impl PlainElement for half::f16 {}

/// The memory of `s` as bytes: `size_of_val(s)` of them, in native endianness.
pub fn as_bytes<T: ByteElement>(s: &[T]) -> &[u8] {
    // SAFETY: `T` is one of f32, f64, i64, bool, bf16, f16 (sealed): its values are fully initialised
    // bytes without padding, so every byte of the slice may be read as a `u8`; the pointer
    // and length describe exactly the slice's memory, borrowed for the same lifetime, and `u8`
    // has alignment 1.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), size_of_val(s)) }
}

/// The memory of `s` as writable bytes (native endianness).
pub fn as_bytes_mut<T: PlainElement>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`, and every byte pattern is a valid `T` (f32, f64, i64, bf16, f16: the last two wrap a `u16`), so any
    // bytes written through the view leave valid values; the borrow is exclusive for the
    // view's lifetime.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), size_of_val(s)) }
}

/// `b` read as elements of `T`; `None` when `b` is not aligned for `T` or its length is not a
/// whole number of elements.
pub fn from_bytes<T: PlainElement>(b: &[u8]) -> Option<&[T]> {
    let size = size_of::<T>();
    if !b.len().is_multiple_of(size) || b.as_ptr().align_offset(align_of::<T>()) != 0 {
        return None;
    }
    // SAFETY: the pointer is aligned for `T` (checked), the memory holds exactly
    // `b.len() / size` whole elements (checked), every byte pattern is a valid `T`
    // (PlainElement), and the shared borrow of `b` lasts as long as the result.
    Some(unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<T>(), b.len() / size) })
}

/// `b` read as booleans; `None` when a byte is neither 0 nor 1 (the only bytes that are
/// booleans).
pub fn bools_from_bytes(b: &[u8]) -> Option<&[bool]> {
    if b.iter().any(|&x| x > 1) {
        return None;
    }
    // SAFETY: every byte is 0 or 1 (checked), the valid representations of `bool`, which has
    // the size and alignment of `u8`; the shared borrow of `b` lasts as long as the result.
    Some(unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<bool>(), b.len()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes read as `i64` (every byte pattern a value), `f32` (alignment 4) and `bool`.
    struct Case {
        name: &'static str,
        bytes: std::ops::Range<usize>,
        i64s: Option<usize>,
        f32s: Option<usize>,
        bools: bool,
    }

    /// 32 bytes: 1i64, 2i64, then 16 bytes of 0 and 1.
    fn memory() -> [i64; 4] {
        [1, 2, 0x0001_0001_0100_0000, 0x0101_0000_0000_0001]
    }

    fn check(c: Case) {
        let m = memory();
        let b = &as_bytes(&m)[c.bytes];
        let name = c.name;
        assert_eq!(
            from_bytes::<i64>(b).map(<[i64]>::len),
            c.i64s,
            "{name}: as int64"
        );
        assert_eq!(
            from_bytes::<f32>(b).map(<[f32]>::len),
            c.f32s,
            "{name}: as float32"
        );
        assert_eq!(bools_from_bytes(b).is_some(), c.bools, "{name}: as bool");
        if let Some(v) = from_bytes::<i64>(b) {
            assert_eq!(as_bytes(v), b, "{name}: round trip");
        }
    }

    #[test]
    fn bytes_are_read_as_elements_only_when_whole_aligned_and_valid() {
        let cases = [
            Case {
                name: "two int64",
                bytes: 0..16,
                i64s: Some(2),
                f32s: Some(4),
                bools: false,
            },
            Case {
                name: "not whole",
                bytes: 0..12,
                i64s: None,
                f32s: Some(3),
                bools: false,
            },
            Case {
                name: "misaligned",
                bytes: 4..12,
                i64s: None,
                f32s: Some(2),
                bools: false,
            },
            Case {
                name: "odd offset (zero bytes)",
                bytes: 1..5,
                i64s: None,
                f32s: None,
                bools: true,
            },
            Case {
                name: "0/1 bytes",
                bytes: 16..32,
                i64s: Some(2),
                f32s: Some(4),
                bools: true,
            },
            Case {
                name: "empty",
                bytes: 8..8,
                i64s: Some(0),
                f32s: Some(0),
                bools: true,
            },
        ];
        for c in cases {
            check(c);
        }
    }

    #[test]
    fn byte_views_have_each_types_size_and_native_order() {
        assert_eq!(as_bytes(&[1.5f32, -2.0]).len(), 8);
        assert_eq!(as_bytes(&[7i64, 8, 9]).len(), 24);
        assert_eq!(as_bytes(&[true, false, true]), &[1, 0, 1]);
        assert_eq!(
            as_bytes(&[0x0102_0304_0506_0708i64]),
            &0x0102_0304_0506_0708i64.to_ne_bytes()
        );
        let mut v = [0.0f64; 2];
        as_bytes_mut(&mut v).copy_from_slice(as_bytes(&[3.25f64, -1.0]));
        assert_eq!(v, [3.25, -1.0]);
        assert_eq!(bools_from_bytes(&[0, 1, 1]), Some(&[false, true, true][..]));
    }
}
