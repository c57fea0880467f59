//! Property tests: broadcasting commutes, view round trips, cat of split, matmul and sum
//! against naive loops.

use proptest::prelude::*;
use tensorplay_core::{Tensor, cat};

fn shape_strategy(max_nd: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..=4, 1..=max_nd)
}

/// A shape and values for it.
fn tensor_strategy(max_nd: usize) -> impl Strategy<Value = (Vec<usize>, Vec<f64>)> {
    shape_strategy(max_nd).prop_flat_map(|s| {
        let n: usize = s.iter().product();
        (Just(s), prop::collection::vec(-10.0f64..10.0, n))
    })
}

/// Two shapes that broadcast together: from one full shape, each side drops some leading
/// dims and sets some dims to 1.
fn broadcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    (
        prop::collection::vec(1usize..=4, 0..=4),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(full, ma, mb)| {
            let derive = |mask: u64| {
                let drop = (mask as usize) % (full.len() + 1);
                full[drop..]
                    .iter()
                    .enumerate()
                    .map(|(i, &d)| if mask >> (8 + i) & 1 == 1 { 1 } else { d })
                    .collect::<Vec<usize>>()
            };
            (derive(ma), derive(mb))
        })
}

fn filled(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n)
        .map(|i| ((i as u64 * 2654435761 + seed * 97) % 1000) as f64 / 100.0 - 5.0)
        .collect();
    Tensor::from_vec(v, shape).unwrap()
}

fn row_major_index(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &s)| acc * s + i)
}

fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = flat % shape[d];
        flat /= shape[d];
    }
    idx
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn broadcasting_commutes((sa, sb) in broadcast_pair(), seed in 0u64..1000) {
        let a = filled(&sa, seed);
        let b = filled(&sb, seed + 1);
        let ab = a.add(&b).unwrap();
        let ba = b.add(&a).unwrap();
        prop_assert_eq!(ab.shape(), ba.shape());
        prop_assert_eq!(ab.to_vec::<f64>().unwrap(), ba.to_vec::<f64>().unwrap());
        let ab = a.mul(&b).unwrap();
        let ba = b.mul(&a).unwrap();
        prop_assert_eq!(ab.to_vec::<f64>().unwrap(), ba.to_vec::<f64>().unwrap());
        // and the values are the broadcast ones
        let shape = ab.shape().to_vec();
        let ae = a.expand(&shape).unwrap().to_vec::<f64>().unwrap();
        let be = b.expand(&shape).unwrap().to_vec::<f64>().unwrap();
        let want: Vec<f64> = ae.iter().zip(&be).map(|(x, y)| x * y).collect();
        prop_assert_eq!(ab.to_vec::<f64>().unwrap(), want);
    }

    #[test]
    fn reshape_and_permute_round_trip(
        (shape, v) in tensor_strategy(4),
        perm_seed in any::<u64>(),
    ) {
        let x = Tensor::from_vec(v.clone(), &shape).unwrap();
        let nd = shape.len();
        // a permutation from the seed (Fisher-Yates with a simple LCG)
        let mut perm: Vec<usize> = (0..nd).collect();
        let mut s = perm_seed;
        for i in (1..nd).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            perm.swap(i, (s >> 33) as usize % (i + 1));
        }
        let mut inv = vec![0; nd];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        let p = x.permute(&perm).unwrap();
        // the permuted values are the naive transposition
        let pshape = p.shape().to_vec();
        let pv = p.to_vec::<f64>().unwrap();
        for (flat, &got) in pv.iter().enumerate() {
            let pi = unravel(flat, &pshape);
            let mut xi = vec![0; nd];
            for (k, &d) in perm.iter().enumerate() {
                xi[d] = pi[k];
            }
            prop_assert_eq!(got, v[row_major_index(&xi, &shape)]);
        }
        prop_assert_eq!(p.permute(&inv).unwrap().to_vec::<f64>().unwrap(), v.clone());
        // reshape through the flat form and through the (copied) permuted view
        let n = v.len();
        prop_assert_eq!(x.reshape(&[n]).unwrap().reshape(&shape).unwrap().to_vec::<f64>().unwrap(), v.clone());
        let back = p.reshape(&pshape.iter().rev().copied().collect::<Vec<_>>()).unwrap()
            .reshape(&pshape).unwrap()
            .permute(&inv).unwrap();
        prop_assert_eq!(back.to_vec::<f64>().unwrap(), v);
    }

    #[test]
    fn cat_of_split_is_identity(
        (shape, v) in tensor_strategy(3),
        dim_seed in any::<usize>(),
        split in 1usize..=5,
    ) {
        let x = Tensor::from_vec(v.clone(), &shape).unwrap();
        let dim = (dim_seed % shape.len()) as isize;
        let parts = x.split(split, dim).unwrap();
        prop_assert_eq!(parts.len(), shape[dim as usize].div_ceil(split));
        let y = cat(&parts, dim).unwrap();
        prop_assert_eq!(y.shape(), x.shape());
        prop_assert_eq!(y.to_vec::<f64>().unwrap(), v.clone());
        let chunks = x.chunk(split, dim - shape.len() as isize).unwrap();
        prop_assert_eq!(cat(&chunks, dim).unwrap().to_vec::<f64>().unwrap(), v);
    }

    #[test]
    fn matmul_matches_naive(
        m in 1usize..=12,
        k in 1usize..=12,
        n in 1usize..=12,
        seed in 0u64..1000,
        transpose_a in any::<bool>(),
        transpose_b in any::<bool>(),
    ) {
        let a = filled(&[m, k], seed);
        let b = filled(&[k, n], seed + 7);
        let av = a.to_vec::<f64>().unwrap();
        let bv = b.to_vec::<f64>().unwrap();
        let mut want = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    want[i * n + j] += av[i * k + p] * bv[p * n + j];
                }
            }
        }
        // the same matrices, possibly as transposed views of transposed storage
        let a_in = if transpose_a { a.t().unwrap().contiguous().unwrap().t().unwrap() } else { a.clone() };
        let b_in = if transpose_b { b.t().unwrap().contiguous().unwrap().t().unwrap() } else { b.clone() };
        prop_assert_eq!(a_in.is_contiguous(), !transpose_a || m == 1 || k == 1);
        let got = a_in.matmul(&b_in).unwrap();
        prop_assert_eq!(got.shape(), &[m, n]);
        for (g, w) in got.to_vec::<f64>().unwrap().iter().zip(&want) {
            prop_assert!((g - w).abs() <= 1e-9 * (1.0 + w.abs()), "{} vs {}", g, w);
        }
    }

    #[test]
    fn sum_dims_matches_naive(
        (shape, v) in tensor_strategy(4),
        mask in 1u8..16,
        keepdim in any::<bool>(),
    ) {
        let x = Tensor::from_vec(v.clone(), &shape).unwrap();
        let nd = shape.len();
        let dims: Vec<usize> = (0..nd).filter(|&d| mask >> d & 1 == 1).collect();
        let dims = if dims.is_empty() { vec![0] } else { dims };
        let idims: Vec<isize> = dims.iter().map(|&d| d as isize).collect();
        let got = x.sum_dims(&idims, keepdim).unwrap();
        let kept: Vec<usize> = (0..nd).map(|d| if dims.contains(&d) { 1 } else { shape[d] }).collect();
        let mut want = vec![0.0; kept.iter().product()];
        for (flat, &val) in v.iter().enumerate() {
            let mut idx = unravel(flat, &shape);
            for &d in &dims {
                idx[d] = 0;
            }
            want[row_major_index(&idx, &kept)] += val;
        }
        let want_shape: Vec<usize> = if keepdim {
            kept.clone()
        } else {
            (0..nd).filter(|d| !dims.contains(d)).map(|d| shape[d]).collect()
        };
        prop_assert_eq!(got.shape(), &want_shape[..]);
        for (g, w) in got.to_vec::<f64>().unwrap().iter().zip(&want) {
            prop_assert!((g - w).abs() <= 1e-9 * (1.0 + w.abs()), "{} vs {}", g, w);
        }
        // the same through a transposed view
        if nd >= 2 {
            let t = x.transpose(0, -1).unwrap();
            let total = t.sum().unwrap().item::<f64>().unwrap();
            let naive: f64 = v.iter().sum();
            prop_assert!((total - naive).abs() <= 1e-9 * (1.0 + naive.abs()));
        }
    }
}
