//! Samplers for distributed training (`torch.utils.data.distributed`).
//!
//! [`DistributedSampler`] gives each of `num_replicas` processes a disjoint shard of a
//! dataset's indices, so that data-parallel ranks see different samples of every epoch.

use tensorplay_core::Error;
use tensorplay_core::utils::data::{RandomSampler, Sampler};

const NEW: &str = "DistributedSampler::new";

/// The shard of a dataset's indices that one rank visits in an epoch
/// (`torch.utils.data.distributed.DistributedSampler`), to pass to a `DataLoader` as its
/// sampler.
///
/// Every rank builds the epoch's order the same way — `0..len`, or with
/// [`shuffle`](DistributedSampler::shuffle) (the default) a permutation seeded by
/// `seed + epoch` that is the same on every rank — then makes it `total_size =
/// num_samples * num_replicas` long and takes every `num_replicas`-th index from `rank`:
///
/// - without `drop_last` (the default) `num_samples = ceil(len / num_replicas)` and the order
///   is padded by repeating it from its start, so a few samples are seen twice an epoch;
/// - with `drop_last`, `num_samples = floor(len / num_replicas)` and the order's tail is cut
///   off, so a few samples are not seen that epoch.
///
/// Each rank's shard has `num_samples` indices and the shards interleave back into the
/// epoch's order. As in PyTorch, call [`set_epoch`](DistributedSampler::set_epoch) before each
/// epoch, or every epoch repeats the first one's order.
///
/// Differences from PyTorch: the permutation comes from ChaCha8 (the core's
/// [`RandomSampler`]), not from `torch.randperm`, so the orders are ours; the arithmetic,
/// padding and sharding are PyTorch's exactly (with `shuffle(false)` the shards are
/// identical).
///
/// ```no_run
/// use tensorplay::{self as tp, Tensor};
/// use tp::distributed as dist;
/// use tp::utils::data::{DataLoader, DistributedSampler, TensorDataset};
///
/// fn main() -> tp::Result<()> {
///     dist::init_process_group("cpu", Default::default())?; // env:// (RANK, WORLD_SIZE, ...)
///     let x = tp::randn(&[100, 8])?;
///     let y = tp::randint(0, 2, &[100])?;
///     let dataset = TensorDataset::new(vec![x, y])?;
///     // world size and rank of the default process group
///     let sampler = DistributedSampler::new(dataset.len(), None, None)?.seed(1234);
///     let mut loader = DataLoader::new(&dataset, 16)?.sampler(Box::new(sampler));
///     for epoch in 0..3 {
///         loader.set_epoch(epoch); // `sampler.set_epoch(epoch)` in PyTorch
///         for batch in &loader {
///             let batch = batch?; // [x rows, y rows] of this rank's shard
///             println!("{:?}", batch[0].shape());
///         }
///     }
///     dist::destroy_process_group()?;
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    dataset_len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
    /// Where this epoch resumes in its order (samples all ranks consumed before a restart).
    start: usize,
}

/// Where a [`DistributedSampler`] is in its epochs, to save in a checkpoint and restore at any
/// world size ([`DistributedSampler::state_dict`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SamplerState {
    /// The epoch.
    pub epoch: u64,
    /// Samples of the epoch's order that all ranks together have consumed.
    pub position: usize,
    /// The dataset's length, the seed and the order's settings: a load checks they match.
    pub dataset_len: usize,
    /// The permutations' seed.
    pub seed: u64,
    /// Whether the order is shuffled.
    pub shuffle: bool,
}

impl DistributedSampler {
    /// A sampler over a dataset of `dataset_len` samples for replica `rank` of
    /// `num_replicas`, shuffling with seed 0, keeping every sample, at epoch 0.
    ///
    /// `None` takes the world size (for `num_replicas`) or the rank (for `rank`) of the
    /// default process group, as PyTorch does.
    ///
    /// Errors: [`Error::InvalidArgument`] when `num_replicas` is 0 or `rank` is not below
    /// `num_replicas`; the collectives' error (converted) when a `None` needs a default
    /// process group and there is none.
    pub fn new(
        dataset_len: usize,
        num_replicas: Option<usize>,
        rank: Option<usize>,
    ) -> Result<DistributedSampler, Error> {
        let num_replicas = match num_replicas {
            Some(n) => n,
            None => tensorplay_collectives::get_world_size(None)?,
        };
        if num_replicas == 0 {
            return Err(Error::InvalidArgument {
                op: NEW,
                arg: "num_replicas",
                expected: "a positive number of replicas".to_string(),
                got: "0".to_string(),
            });
        }
        let rank = match rank {
            Some(r) => r,
            None => tensorplay_collectives::get_rank(None)?,
        };
        if rank >= num_replicas {
            return Err(Error::InvalidArgument {
                op: NEW,
                arg: "rank",
                expected: format!("a rank in 0..{num_replicas} (num_replicas = {num_replicas})"),
                got: rank.to_string(),
            });
        }
        Ok(DistributedSampler {
            dataset_len,
            num_replicas,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
            epoch: 0,
            start: 0,
        })
    }

    /// Whether each epoch's order is a permutation (`shuffle=`); default `true`.
    pub fn shuffle(mut self, shuffle: bool) -> DistributedSampler {
        self.shuffle = shuffle;
        self
    }

    /// The seed of the permutations (`seed=`), to be the same on every rank; default 0.
    pub fn seed(mut self, seed: u64) -> DistributedSampler {
        self.seed = seed;
        self
    }

    /// Whether to cut the order's tail instead of padding it (`drop_last=`); default `false`.
    pub fn drop_last(mut self, drop_last: bool) -> DistributedSampler {
        self.drop_last = drop_last;
        self
    }

    /// Makes later epochs use the order of epoch `epoch` (`sampler.set_epoch(epoch)`): with
    /// shuffling, the permutation seeded by `seed + epoch`. Call it with the same epoch on
    /// every rank.
    pub fn set_epoch(&mut self, epoch: u64) {
        if epoch != self.epoch {
            self.start = 0;
        }
        self.epoch = epoch;
    }

    /// Where the epoch stands once this rank has taken `consumed` of its indices (and every
    /// other rank as many, as data-parallel ranks do): the samples of the epoch's order all
    /// ranks consumed together, `start + consumed * num_replicas`, at most the dataset's length.
    pub fn state_dict(&self, consumed: usize) -> SamplerState {
        SamplerState {
            epoch: self.epoch,
            position: self
                .start
                .saturating_add(consumed.saturating_mul(self.num_replicas))
                .min(self.dataset_len),
            dataset_len: self.dataset_len,
            seed: self.seed,
            shuffle: self.shuffle,
        }
    }

    /// Resumes at `state` (saved at any number of replicas): the epoch continues from the saved
    /// position. The order is the saved epoch's (the same permutation whatever the world
    /// size), its first `position` samples are skipped, and what remains is shared among this
    /// sampler's replicas as a whole epoch is: each rank takes every `num_replicas`-th index
    /// from its rank, the remainder padded by repeating it from its start (or cut, with
    /// `drop_last`). So no sample is repeated or skipped across the restart, except the
    /// padding's repeats (and `drop_last`'s cut) of the remaining part. The resumed position
    /// holds until [`set_epoch`](Self::set_epoch) moves to another epoch: call it every epoch,
    /// as PyTorch asks, or every later epoch starts from the position too.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the state is of another dataset length, seed or
    /// shuffling, or its position is past the dataset's end.
    pub fn load_state_dict(&mut self, state: &SamplerState) -> Result<(), Error> {
        let mine = (self.dataset_len, self.seed, self.shuffle);
        let theirs = (state.dataset_len, state.seed, state.shuffle);
        if mine != theirs || state.position > state.dataset_len {
            return Err(Error::InvalidArgument {
                op: "DistributedSampler::load_state_dict",
                arg: "state",
                expected: format!(
                    "a state of this sampler's dataset length, seed and shuffling {mine:?}, its \
                     position at most the length"
                ),
                got: format!("{theirs:?} at position {}", state.position),
            });
        }
        self.epoch = state.epoch;
        self.start = state.position;
        Ok(())
    }

    /// The number of indices of this rank's shard (`sampler.num_samples`, `len(sampler)`):
    /// `ceil(len / num_replicas)`, or `floor(len / num_replicas)` with `drop_last`, where `len`
    /// is what remains of the epoch (the dataset's length, less a resumed position).
    pub fn num_samples(&self) -> usize {
        let len = self.dataset_len - self.start.min(self.dataset_len);
        if self.drop_last {
            // PyTorch: ceil((len - num_replicas) / num_replicas) when len % num_replicas != 0,
            // which is floor(len / num_replicas), and 0 when len < num_replicas
            len / self.num_replicas
        } else {
            len.div_ceil(self.num_replicas)
        }
    }

    /// The length of the padded or cut order, all shards together (`sampler.total_size`):
    /// `num_samples * num_replicas`.
    pub fn total_size(&self) -> usize {
        // never above dataset_len + num_replicas - 1, so no overflow short of usize::MAX
        self.num_samples().saturating_mul(self.num_replicas)
    }

    /// The number of samples of the dataset.
    pub fn dataset_len(&self) -> usize {
        self.dataset_len
    }

    /// The number of replicas the dataset is split between.
    pub fn num_replicas(&self) -> usize {
        self.num_replicas
    }

    /// This replica's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The epoch's order before sharding: `total_size` indices, the same on every rank.
    fn epoch_order(&self) -> Vec<usize> {
        let order: Vec<usize> = if self.shuffle {
            let mut perm = RandomSampler::new(self.dataset_len, self.seed);
            perm.set_epoch(self.epoch);
            perm.indices()
        } else {
            (0..self.dataset_len).collect()
        };
        // a resumed epoch: what the ranks had not consumed
        let order = &order[self.start.min(order.len())..];
        // padding repeats the order from its start (as often as needed when the padding is
        // longer than the order); drop_last cuts it to total_size <= len
        order
            .iter()
            .copied()
            .cycle()
            .take(self.total_size())
            .collect()
    }
}

impl Sampler for DistributedSampler {
    /// This rank's shard of the epoch's order: `order[rank..total_size]` stepping by
    /// `num_replicas`, `num_samples` indices.
    fn indices(&self) -> Vec<usize> {
        self.epoch_order()
            .into_iter()
            .skip(self.rank)
            .step_by(self.num_replicas)
            .collect()
    }
    fn len(&self) -> usize {
        self.num_samples()
    }
    fn set_epoch(&mut self, epoch: u64) {
        DistributedSampler::set_epoch(self, epoch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sampler(len: usize, replicas: usize, rank: usize) -> DistributedSampler {
        DistributedSampler::new(len, Some(replicas), Some(rank)).unwrap()
    }

    /// Every rank's shard at `epoch`.
    fn shards(
        len: usize,
        replicas: usize,
        drop_last: bool,
        shuffle: bool,
        epoch: u64,
    ) -> Vec<Vec<usize>> {
        (0..replicas)
            .map(|r| {
                let mut s = sampler(len, replicas, r)
                    .drop_last(drop_last)
                    .shuffle(shuffle)
                    .seed(5);
                s.set_epoch(epoch);
                s.indices()
            })
            .collect()
    }

    /// The shards interleaved back into one order (`order[i]` is on rank `i % replicas`).
    fn interleave(shards: &[Vec<usize>]) -> Vec<usize> {
        let n = shards.first().map_or(0, Vec::len);
        (0..n)
            .flat_map(|k| shards.iter().map(move |s| s[k]))
            .collect()
    }

    #[test]
    fn pytorch_cases_without_shuffle() {
        let s = shards(10, 3, false, false, 0);
        assert_eq!(
            s,
            vec![vec![0, 3, 6, 9], vec![1, 4, 7, 0], vec![2, 5, 8, 1]]
        );
        let one = sampler(10, 3, 0).shuffle(false);
        assert_eq!((one.num_samples(), one.total_size()), (4, 12));

        let s = shards(10, 3, true, false, 0);
        assert_eq!(s, vec![vec![0, 3, 6], vec![1, 4, 7], vec![2, 5, 8]]);
        let one = sampler(10, 3, 0).drop_last(true);
        assert_eq!((one.num_samples(), one.total_size()), (3, 9));

        // divisible: drop_last changes nothing
        assert_eq!(shards(8, 4, true, false, 0), shards(8, 4, false, false, 0));
        assert_eq!(shards(8, 4, false, false, 0)[3], [3, 7]);
    }

    #[test]
    fn fewer_samples_than_replicas() {
        // padding longer than the order: it repeats as often as needed
        assert_eq!(shards(1, 4, false, false, 0), vec![vec![0]; 4]);
        assert_eq!(
            shards(2, 5, false, false, 0),
            vec![vec![0], vec![1], vec![0], vec![1], vec![0]]
        );
        // drop_last: nothing for anyone
        let s = sampler(3, 4, 2).drop_last(true);
        assert_eq!((s.num_samples(), s.total_size()), (0, 0));
        assert!(s.indices().is_empty());
        assert!(Sampler::is_empty(&s));
        // an empty dataset
        for drop_last in [false, true] {
            let s = sampler(0, 3, 1).drop_last(drop_last);
            assert_eq!((s.num_samples(), s.total_size()), (0, 0));
            assert!(s.indices().is_empty());
        }
    }

    #[test]
    fn shuffled_order_is_a_seeded_permutation() {
        let a = interleave(&shards(20, 4, false, true, 0));
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..20).collect::<Vec<_>>());
        assert_ne!(a, (0..20).collect::<Vec<_>>());
        // the order is the core's RandomSampler permutation of seed + epoch
        let mut r = RandomSampler::new(20, 5);
        r.set_epoch(2);
        assert_eq!(interleave(&shards(20, 4, false, true, 2)), r.indices());
        // same (seed, epoch): same shards; the seed matters
        assert_eq!(shards(20, 4, false, true, 0), shards(20, 4, false, true, 0));
        let other_seed: Vec<Vec<usize>> = (0..4)
            .map(|k| sampler(20, 4, k).seed(6).indices())
            .collect();
        assert_ne!(other_seed, shards(20, 4, false, true, 0));
    }

    #[test]
    fn set_epoch_through_the_sampler_trait() {
        let mut s = sampler(30, 2, 1);
        let e0 = s.indices();
        Sampler::set_epoch(&mut s, 1);
        assert_eq!(s.epoch(), 1);
        assert_ne!(s.indices(), e0);
        assert_eq!(Sampler::len(&s), 15);
        assert_eq!((s.dataset_len(), s.num_replicas(), s.rank()), (30, 2, 1));
    }

    #[test]
    fn bad_rank_or_num_replicas_errors() {
        let e = DistributedSampler::new(10, Some(0), Some(0)).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    arg: "num_replicas",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("positive"), "{e}");

        let e = DistributedSampler::new(10, Some(3), Some(3)).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "rank", .. }),
            "{e}"
        );
        let msg = e.to_string();
        assert!(msg.contains("0..3") && msg.contains("got 3"), "{msg}");
        assert!(DistributedSampler::new(10, Some(3), Some(7)).is_err());
    }

    proptest! {
        #[test]
        fn shards_partition_the_padded_or_cut_order(
            len in 0usize..60,
            replicas in 1usize..9,
            drop_last in any::<bool>(),
            shuffle in any::<bool>(),
            epoch in 0u64..4,
        ) {
            let s = shards(len, replicas, drop_last, shuffle, epoch);
            let one = sampler(len, replicas, 0).drop_last(drop_last);
            let (num_samples, total) = (one.num_samples(), one.total_size());
            prop_assert_eq!(total, num_samples * replicas);
            for shard in &s {
                prop_assert_eq!(shard.len(), num_samples);
                prop_assert!(shard.iter().all(|&i| i < len));
            }
            let order = interleave(&s);
            prop_assert_eq!(order.len(), total);
            let mut counts = vec![0usize; len];
            for &i in &order {
                counts[i] += 1;
            }
            if drop_last {
                // at most once each, and as many as fit evenly
                prop_assert!(counts.iter().all(|&c| c <= 1));
                prop_assert_eq!(total, len - len % replicas);
            } else {
                // every index, the first `total - len` ones (of the order) twice or more
                prop_assert!(counts.iter().all(|&c| c >= 1));
                prop_assert!(total < len + replicas);
                prop_assert_eq!(num_samples, len.div_ceil(replicas));
            }
            // one order on every rank: its first `min(len, total)` entries are a permutation
            // of distinct indices, the rest repeat it from the start
            let base = len.min(total);
            let mut head = order[..base].to_vec();
            head.sort_unstable();
            head.dedup();
            prop_assert_eq!(head.len(), base);
            for k in base..total {
                prop_assert_eq!(order[k], order[k % len]);
            }
            if !shuffle {
                prop_assert!(order[..base].iter().enumerate().all(|(k, &i)| k == i));
            }
            if shuffle && len >= 10 {
                let next = interleave(&shards(len, replicas, drop_last, shuffle, epoch + 1));
                prop_assert_ne!(next, order);
            }
        }

        #[test]
        fn a_resize_mid_epoch_sees_every_sample_once(
            len in 0usize..60,
            n in 1usize..6,
            m in 1usize..6,
            steps in 0usize..14,
            shuffle in any::<bool>(),
        ) {
            let make = |replicas: usize, rank: usize| {
                let mut s = sampler(len, replicas, rank).shuffle(shuffle).seed(5);
                s.set_epoch(2);
                s
            };
            // n ranks each take `consumed` of their indices (whole rounds, before any padding)
            let consumed = steps.min(len / n);
            let mut seen: Vec<usize> = (0..n)
                .flat_map(|r| make(n, r).indices()[..consumed].to_vec())
                .collect();
            let state = make(n, 0).state_dict(consumed);
            prop_assert_eq!(state.position, consumed * n);
            // a new job of m ranks resumes there
            let after: Vec<Vec<usize>> = (0..m)
                .map(|r| {
                    let mut s = make(m, r);
                    s.load_state_dict(&state).map(|()| s.indices())
                })
                .collect::<Result<_, _>>()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let rest = interleave(&after);
            // its first len - position entries are the rest of the epoch, the others padding
            prop_assert!(rest.len() >= len - state.position);
            seen.extend_from_slice(&rest[..len - state.position]);
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..len).collect::<Vec<_>>());
        }

        #[test]
        fn a_state_of_another_sampler_is_refused(len in 1usize..30, other in 31usize..40) {
            let state = sampler(len, 2, 0).state_dict(0);
            let mut s = sampler(other, 2, 0);
            prop_assert!(s.load_state_dict(&state).is_err());
            let mut s = sampler(len, 2, 0).seed(9);
            prop_assert!(s.load_state_dict(&state).is_err());
        }
    }
}
