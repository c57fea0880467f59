//! The frame decoder fed random bytes, mutated well-formed frames and hostile length claims:
//! it returns an error (or a message), never panics, and never allocates what the bytes merely
//! claim.

use proptest::prelude::*;
use tensorplay_core::Tensor;
use tensorplay_rpc::fuzz::{decode_frame, encode_frame, raw_frame};

/// A well-formed frame with tensors of every dtype.
fn sample() -> Vec<u8> {
    let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
    let b = Tensor::from_vec(vec![7i64, 8], &[2]).unwrap();
    let c = Tensor::from_vec(vec![true, false, true], &[3]).unwrap();
    let d = Tensor::from_vec(vec![0.5f64], &[]).unwrap();
    let e = Tensor::from_vec(Vec::<f32>::new(), &[0, 2]).unwrap();
    encode_frame(
        "add",
        "(a) -> b",
        1,
        &[1, 2, 3, 4],
        &[a.t().unwrap(), b, c, d, e],
    )
    .unwrap()
}

#[test]
fn well_formed_frames_decode() {
    assert_eq!(decode_frame(&sample()).unwrap(), 5);
    let empty = encode_frame("", "", 0, &[], &[]).unwrap();
    assert_eq!(decode_frame(&empty).unwrap(), 0);
    // every strict prefix is an error
    let s = sample();
    for n in 0..s.len() {
        assert!(decode_frame(&s[..n]).is_err(), "prefix of {n} bytes");
    }
}

#[test]
fn hostile_length_claims_are_refused_without_allocating_them() {
    // a tensor of 2^38 f32 (1 TiB) that the body length agrees with, and no body
    let f = raw_frame(&[(0, vec![1 << 38])], 1 << 40, &[]).unwrap();
    assert!(decode_frame(&f).is_err());
    // bool and i64 tensors claiming hundreds of GiB with a few bytes of body
    let f = raw_frame(&[(3, vec![1 << 39])], 1 << 39, &[1, 0, 1]).unwrap();
    assert!(decode_frame(&f).is_err());
    let f = raw_frame(&[(2, vec![1 << 20, 1 << 16])], 1 << 39, &[0; 64]).unwrap();
    assert!(decode_frame(&f).is_err());
    // a body beyond the limit, sizes that overflow, an unknown dtype
    assert!(decode_frame(&raw_frame(&[(1, vec![1 << 50])], 1 << 53, &[]).unwrap()).is_err());
    assert!(decode_frame(&raw_frame(&[(1, vec![u64::MAX, 2])], 0, &[]).unwrap()).is_err());
    assert!(
        decode_frame(&raw_frame(&[(0, vec![0, u64::MAX, u64::MAX])], 0, &[]).unwrap()).is_err()
    );
    assert!(decode_frame(&raw_frame(&[(9, vec![1])], 4, &[0; 4]).unwrap()).is_err());
    // a body length that disagrees with the tensors, either way
    assert!(decode_frame(&raw_frame(&[(0, vec![2])], 4, &[0; 8]).unwrap()).is_err());
    assert!(decode_frame(&raw_frame(&[(0, vec![2])], 12, &[0; 12]).unwrap()).is_err());
    // a bool tensor with a byte other than 0 and 1
    assert!(decode_frame(&raw_frame(&[(3, vec![2])], 2, &[1, 2]).unwrap()).is_err());
    // and the same claims, honest, decode
    assert_eq!(
        decode_frame(&raw_frame(&[(3, vec![2])], 2, &[1, 0]).unwrap()).unwrap(),
        1
    );
    assert_eq!(
        decode_frame(&raw_frame(&[(0, vec![0, 1 << 40])], 0, &[]).unwrap()).unwrap(),
        1
    );
    // a header length at the limit with nothing behind it
    let mut f = sample();
    f[4..8].copy_from_slice(&(256u32 << 20).to_le_bytes());
    assert!(decode_frame(&f).is_err());
    f[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(decode_frame(&f).is_err());
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Set(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    /// Overwrite 8 bytes with a little-endian integer (lengths, shapes, counts).
    Word(usize, u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, v)| Mutation::Insert(i, v)),
        (any::<usize>(), 1usize..32).prop_map(|(i, n)| Mutation::Remove(i, n)),
        (
            any::<usize>(),
            prop_oneof![
                Just(0u64),
                Just(1),
                Just(u64::MAX),
                Just(1 << 32),
                Just(1 << 40),
                any::<u64>()
            ]
        )
            .prop_map(|(i, w)| Mutation::Word(i, w)),
    ]
}

fn apply(buf: &mut Vec<u8>, m: &Mutation) {
    let len = buf.len().max(1);
    match m {
        Mutation::Flip(i, b) => {
            if !buf.is_empty() {
                buf[i % len] ^= b;
            }
        }
        Mutation::Set(i, b) => {
            if !buf.is_empty() {
                buf[i % len] = *b;
            }
        }
        Mutation::Truncate(i) => buf.truncate(i % len),
        Mutation::Insert(i, v) => {
            let at = i % (buf.len() + 1);
            buf.splice(at..at, v.iter().copied());
        }
        Mutation::Remove(i, n) => {
            let at = i % len;
            let end = (at + n).min(buf.len());
            if at < end {
                buf.drain(at..end);
            }
        }
        Mutation::Word(i, w) => {
            if buf.len() >= 8 {
                let at = (i % (buf.len() - 7)) & !7;
                buf[at..at + 8].copy_from_slice(&w.to_le_bytes());
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_frame(&bytes);
    }

    #[test]
    fn random_bytes_after_a_valid_prefix_never_panic(
        hlen in 0u32..4096,
        blen in prop_oneof![0u64..4096, any::<u64>()],
        rest in prop::collection::vec(any::<u8>(), 0..1024),
    ) {
        let mut bytes = b"TPR1".to_vec();
        bytes.extend_from_slice(&hlen.to_le_bytes());
        bytes.extend_from_slice(&blen.to_le_bytes());
        bytes.extend_from_slice(&rest);
        let _ = decode_frame(&bytes);
    }

    #[test]
    fn mutated_frames_never_panic(muts in prop::collection::vec(mutation(), 1..6)) {
        let mut buf = sample();
        for m in &muts {
            apply(&mut buf, m);
        }
        let _ = decode_frame(&buf);
    }
}
