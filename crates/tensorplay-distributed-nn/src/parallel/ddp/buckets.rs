//! Which parameters share a bucket: PyTorch's assignment by size (`reducer.cpp`,
//! `compute_bucket_assignment_by_size`), as a pure function of the parameters' order, sizes and
//! dtypes.

/// One parameter as the assignment sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ParamSpec {
    /// Number of elements.
    pub(crate) numel: usize,
    /// Bytes per element.
    pub(crate) elem_bytes: usize,
    /// Parameters only share a bucket with parameters of the same key (dtype and device).
    pub(crate) key: u64,
}

/// The default size of every bucket after the first (`bucket_cap_mb=25`), in bytes.
#[cfg(test)]
pub(crate) const DEFAULT_BUCKET_CAP_BYTES: usize = 25 * 1024 * 1024;
/// The size of the first bucket (PyTorch's `_DEFAULT_FIRST_BUCKET_BYTES`): small, so that the
/// first all-reduce starts early in backward.
pub(crate) const FIRST_BUCKET_BYTES: usize = 1024 * 1024;

/// Groups the parameters `order` (indices into `params`, in the order their gradients are
/// expected to become ready) into buckets: each (dtype, device) key fills its own bucket until
/// it holds at least its limit — `limits[0]` for the key's first bucket, `limits[1]` for the
/// next, the last limit for all the rest — then closes it. Buckets come out sorted by where
/// their first parameter sits in `order`, so bucket 0 holds the first gradients to be ready.
/// Every index of `order` lands in exactly one bucket, in `order`'s order within it.
pub(crate) fn assign(params: &[ParamSpec], order: &[usize], limits: &[usize]) -> Vec<Vec<usize>> {
    struct Open {
        key: u64,
        members: Vec<usize>,
        bytes: usize,
        limit_at: usize,
    }
    let limit = |i: usize| -> usize {
        limits
            .get(i)
            .or_else(|| limits.last())
            .copied()
            .unwrap_or(usize::MAX)
    };
    let mut open: Vec<Open> = Vec::new();
    // (position in `order` of the first member, members)
    let mut done: Vec<(usize, Vec<usize>)> = Vec::new();
    let mut first_pos: std::collections::HashMap<usize, usize> = Default::default();
    for (pos, &p) in order.iter().enumerate() {
        first_pos.insert(p, pos);
        let spec = params[p];
        let slot = match open.iter().position(|o| o.key == spec.key) {
            Some(i) => i,
            None => {
                open.push(Open {
                    key: spec.key,
                    members: Vec::new(),
                    bytes: 0,
                    limit_at: 0,
                });
                open.len() - 1
            }
        };
        let o = &mut open[slot];
        o.members.push(p);
        o.bytes += spec.numel * spec.elem_bytes;
        if o.bytes >= limit(o.limit_at) {
            let members = std::mem::take(&mut o.members);
            o.bytes = 0;
            o.limit_at += 1;
            done.push((first_pos[&members[0]], members));
        }
    }
    for o in open {
        if !o.members.is_empty() {
            done.push((first_pos[&o.members[0]], o.members));
        }
    }
    done.sort_by_key(|(pos, _)| *pos);
    done.into_iter().map(|(_, m)| m).collect()
}

/// A stable 64-bit fingerprint of an assignment (FNV-1a over the members), compared across
/// ranks so that no two ranks ever pair different buckets.
pub(crate) fn fingerprint(buckets: &[Vec<usize>], params: &[ParamSpec]) -> i64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |v: u64| {
        for b in v.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for b in buckets {
        eat(b.len() as u64);
        for &p in b {
            eat(p as u64);
            eat(params[p].numel as u64);
            eat(params[p].key);
        }
    }
    h as i64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn f32s(sizes: &[usize]) -> Vec<ParamSpec> {
        sizes
            .iter()
            .map(|&numel| ParamSpec {
                numel,
                elem_bytes: 4,
                key: 0,
            })
            .collect()
    }

    /// The MLP of the benchmark: reverse order, a first bucket of at least 1 MiB, then 25 MiB.
    #[test]
    fn first_bucket_is_small_then_the_cap() {
        // 784x1024, 1024, 1024x1024, 1024, 1024x1024, 1024, 1024x10, 10 (float32)
        let p = f32s(&[802_816, 1024, 1_048_576, 1024, 1_048_576, 1024, 10_240, 10]);
        let order: Vec<usize> = (0..p.len()).rev().collect();
        let b = assign(&p, &order, &[FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_BYTES]);
        // 7, 6, 5 are 41 KiB; adding 4 (4 MiB) closes the first bucket; the rest fit in 25 MiB
        assert_eq!(b, vec![vec![7, 6, 5, 4], vec![3, 2, 1, 0]]);
        let one = assign(&p, &order, &[usize::MAX]);
        assert_eq!(one, vec![vec![7, 6, 5, 4, 3, 2, 1, 0]]);
        let tiny = assign(&p, &order, &[1]);
        assert_eq!(
            tiny.len(),
            8,
            "a limit of one byte gives one bucket per parameter"
        );
    }

    /// Parameters of different dtypes never share a bucket; buckets are ordered by their first
    /// member.
    #[test]
    fn dtypes_get_their_own_buckets() {
        let mut p = f32s(&[10, 10, 10, 10]);
        p[1].key = 1;
        p[1].elem_bytes = 8;
        p[2].key = 1;
        p[2].elem_bytes = 8;
        let b = assign(&p, &[3, 2, 1, 0], &[usize::MAX]);
        assert_eq!(b, vec![vec![3, 0], vec![2, 1]]);
        assert_ne!(fingerprint(&b, &p), fingerprint(&[vec![3, 0, 2, 1]], &p));
    }

    proptest! {
        /// Every parameter is in exactly one bucket, buckets hold one key, and a closed bucket
        /// holds at least its limit.
        #[test]
        fn assignment_is_a_partition(
            sizes in proptest::collection::vec((1usize..5000, 0u64..3), 1..40),
            cap in 1usize..20_000,
        ) {
            let p: Vec<ParamSpec> = sizes.iter().map(|&(numel, key)| ParamSpec {
                numel, elem_bytes: 4 << (key % 2), key,
            }).collect();
            let order: Vec<usize> = (0..p.len()).rev().collect();
            let b = assign(&p, &order, &[cap / 4 + 1, cap]);
            let mut seen: Vec<usize> = b.iter().flatten().copied().collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..p.len()).collect::<Vec<_>>());
            for bucket in &b {
                prop_assert!(bucket.iter().all(|&i| p[i].key == p[bucket[0]].key));
            }
            // bucket order follows the order of their first members
            let firsts: Vec<usize> = b.iter()
                .map(|m| order.iter().position(|&x| x == m[0]).unwrap())
                .collect();
            prop_assert!(firsts.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
