//! The launch schedule of one backward pass, as a state machine without sockets, clocks or
//! threads: parameters are marked ready in whatever order autograd produces their gradients,
//! and buckets come out to launch strictly in bucket order (bucket `k` only after buckets
//! `0..k`), so that every rank issues the same all-reduces in the same order whatever its
//! readiness order was.

/// Where a parameter's gradient sits: its bucket and its position in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    pub(crate) bucket: usize,
    /// Element offset in the bucket's flat buffer.
    pub(crate) offset: usize,
    pub(crate) numel: usize,
}

/// Why a parameter could not be marked ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum MarkError {
    /// The parameter was marked ready already in this pass (a second backward through the same
    /// forward, or a gradient accumulated twice).
    Twice(usize),
    /// Not a parameter this schedule reduces.
    Unknown(usize),
}

/// The per-pass readiness state of a bucket assignment.
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    slots: Vec<Slot>,
    /// Parameters per bucket.
    sizes: Vec<usize>,
    /// Parameters still missing per bucket in this pass.
    missing: Vec<usize>,
    marked: Vec<bool>,
    /// The next bucket to launch.
    next: usize,
    /// The order parameters were marked in, this pass.
    order: Vec<usize>,
}

impl Schedule {
    /// A schedule for `buckets` (parameter indices per bucket, `0..n` each exactly once) with
    /// the element count of every parameter.
    pub(crate) fn new(buckets: &[Vec<usize>], numels: &[usize]) -> Schedule {
        let mut slots = vec![
            Slot {
                bucket: 0,
                offset: 0,
                numel: 0
            };
            numels.len()
        ];
        for (b, members) in buckets.iter().enumerate() {
            let mut offset = 0;
            for &p in members {
                slots[p] = Slot {
                    bucket: b,
                    offset,
                    numel: numels[p],
                };
                offset += numels[p];
            }
        }
        let sizes: Vec<usize> = buckets.iter().map(Vec::len).collect();
        Schedule {
            slots,
            missing: sizes.clone(),
            sizes,
            marked: vec![false; numels.len()],
            next: 0,
            order: Vec::with_capacity(numels.len()),
        }
    }

    /// Starts a new pass: nothing is ready, nothing launched.
    pub(crate) fn reset(&mut self) {
        self.missing.clone_from(&self.sizes);
        self.marked.iter_mut().for_each(|m| *m = false);
        self.next = 0;
        self.order.clear();
    }

    /// Where parameter `p` sits.
    pub(crate) fn slot(&self, p: usize) -> Slot {
        self.slots[p]
    }

    /// Elements in bucket `b`.
    pub(crate) fn bucket_numel(&self, b: usize) -> usize {
        self.slots
            .iter()
            .filter(|s| s.bucket == b)
            .map(|s| s.numel)
            .sum()
    }

    /// Marks parameter `p`'s gradient ready; returns the buckets that can launch now, in
    /// launch order (possibly none: an earlier bucket is still incomplete).
    pub(crate) fn mark(&mut self, p: usize) -> Result<Vec<usize>, MarkError> {
        let Some(m) = self.marked.get_mut(p) else {
            return Err(MarkError::Unknown(p));
        };
        if *m {
            return Err(MarkError::Twice(p));
        }
        *m = true;
        self.order.push(p);
        self.missing[self.slots[p].bucket] -= 1;
        let mut launch = Vec::new();
        while self.next < self.missing.len() && self.missing[self.next] == 0 {
            launch.push(self.next);
            self.next += 1;
        }
        Ok(launch)
    }

    /// Whether `p` was marked in this pass.
    pub(crate) fn is_marked(&self, p: usize) -> bool {
        self.marked.get(p).copied().unwrap_or(false)
    }

    /// The parameters not marked yet, in index order.
    pub(crate) fn unmarked(&self) -> Vec<usize> {
        (0..self.marked.len())
            .filter(|&p| !self.marked[p])
            .collect()
    }

    /// Whether every bucket was handed out for launch.
    #[cfg(test)]
    pub(crate) fn all_launched(&self) -> bool {
        self.next == self.sizes.len()
    }

    /// The order the parameters were marked in during this pass.
    pub(crate) fn ready_order(&self) -> &[usize] {
        &self.order
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn launches_wait_for_earlier_buckets() {
        // bucket 0: params 3, 2; bucket 1: 1; bucket 2: 0
        let mut s = Schedule::new(&[vec![3, 2], vec![1], vec![0]], &[5, 6, 7, 8]);
        assert_eq!(
            s.slot(2),
            Slot {
                bucket: 0,
                offset: 8,
                numel: 7
            }
        );
        assert_eq!(s.bucket_numel(0), 15);
        assert_eq!(
            s.mark(1),
            Ok(vec![]),
            "bucket 1 is complete but bucket 0 is not"
        );
        assert_eq!(s.mark(3), Ok(vec![]));
        assert_eq!(s.mark(3), Err(MarkError::Twice(3)));
        assert_eq!(s.mark(9), Err(MarkError::Unknown(9)));
        assert_eq!(s.unmarked(), vec![0, 2]);
        assert_eq!(s.mark(2), Ok(vec![0, 1]));
        assert!(!s.all_launched());
        assert_eq!(s.mark(0), Ok(vec![2]));
        assert!(s.all_launched());
        assert_eq!(s.ready_order(), &[1, 3, 2, 0]);
        s.reset();
        assert!(!s.all_launched() && s.unmarked().len() == 4);
    }

    proptest! {
        /// Whatever order gradients become ready in, every bucket launches exactly once, in
        /// bucket order, and the last launch comes with the last mark.
        #[test]
        fn any_readiness_order_launches_in_bucket_order(
            n in 1usize..30,
            cuts in proptest::collection::vec(any::<bool>(), 30),
            seed in any::<u64>(),
        ) {
            // buckets over the reversed parameters, cut where `cuts` says
            let mut buckets: Vec<Vec<usize>> = vec![vec![]];
            for p in (0..n).rev() {
                buckets.last_mut().unwrap().push(p);
                if cuts[p] && p != 0 {
                    buckets.push(vec![]);
                }
            }
            let mut s = Schedule::new(&buckets, &vec![1; n]);
            // a permutation from the seed
            let mut order: Vec<usize> = (0..n).collect();
            let mut x = seed | 1;
            for i in (1..n).rev() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let mut launched = Vec::new();
            for (i, &p) in order.iter().enumerate() {
                let l = s.mark(p).unwrap();
                if i + 1 < n {
                    prop_assert!(!s.all_launched() || l.is_empty() || launched.len() + l.len() == buckets.len());
                }
                launched.extend(l);
            }
            prop_assert_eq!(launched, (0..buckets.len()).collect::<Vec<_>>());
            prop_assert!(s.all_launched());
        }
    }
}
