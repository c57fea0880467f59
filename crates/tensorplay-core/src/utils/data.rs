//! Datasets, samplers and batching (`torch.utils.data`).
//!
//! A [`TensorDataset`] holds tensors that share their first dimension (row `i` of each is
//! sample `i`); a [`Sampler`] says in which order an epoch visits the rows; a [`DataLoader`]
//! cuts that order into batches and gathers each batch's rows of every tensor. There are no
//! worker processes: batches are gathered on the calling thread, when the iterator reaches
//! them.
//!
//! ```
//! use tensorplay_core as tp;
//! use tp::utils::data::{DataLoader, RandomSampler, TensorDataset};
//!
//! let x = tp::Tensor::from_vec((0..10).map(|i| i as f32).collect(), &[5, 2])?;
//! let y = tp::Tensor::from_vec(vec![0i64, 1, 0, 1, 0], &[5])?;
//! let dataset = TensorDataset::new(vec![x, y])?;
//! let mut loader = DataLoader::new(&dataset, 2)?
//!     .sampler(Box::new(RandomSampler::new(dataset.len(), 0)));
//! assert_eq!(loader.len(), 3); // 2 + 2 + 1
//! for epoch in 0..2 {
//!     loader.set_epoch(epoch); // a new order every epoch
//!     for batch in &loader {
//!         let batch = batch?; // [x rows, y rows]
//!         assert_eq!(batch[0].shape()[1], 2);
//!         assert_eq!(batch[0].shape()[0], batch[1].shape()[0]);
//!     }
//! }
//! # Ok::<(), tp::Error>(())
//! ```

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use crate::{Error, Result, Tensor};

/// The order in which one epoch visits a dataset (`torch.utils.data.Sampler`).
pub trait Sampler: Send + Sync {
    /// The dataset indices of one epoch, in order (`list(iter(sampler))`).
    fn indices(&self) -> Vec<usize>;
    /// How many indices [`Sampler::indices`] returns (`len(sampler)`).
    fn len(&self) -> usize;
    /// Whether an epoch visits no index.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Makes later epochs use the order of epoch `epoch` (`sampler.set_epoch(epoch)`).
    /// Samplers whose order depends on the epoch ([`RandomSampler`] and the
    /// `DistributedSampler` of the distributed layer) override it; the default does nothing.
    fn set_epoch(&mut self, epoch: u64) {
        let _ = epoch;
    }
}

/// The indices `0..len` in order (`torch.utils.data.SequentialSampler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequentialSampler {
    len: usize,
}

impl SequentialSampler {
    /// A sampler over a dataset of `len` samples.
    pub fn new(len: usize) -> SequentialSampler {
        SequentialSampler { len }
    }
}

impl Sampler for SequentialSampler {
    fn indices(&self) -> Vec<usize> {
        (0..self.len).collect()
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A permutation of `0..len` (`torch.utils.data.RandomSampler` without replacement).
///
/// Unlike PyTorch's, the order is a pure function of `(seed, epoch)`: every call of
/// [`Sampler::indices`] returns the same permutation until [`RandomSampler::set_epoch`]
/// changes the epoch, and every process computes the same one (the generator is ChaCha8
/// seeded with `seed + epoch`, wrapping). The permutations are ours, not PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RandomSampler {
    len: usize,
    seed: u64,
    epoch: u64,
}

impl RandomSampler {
    /// A sampler over a dataset of `len` samples, at epoch 0.
    pub fn new(len: usize, seed: u64) -> RandomSampler {
        RandomSampler {
            len,
            seed,
            epoch: 0,
        }
    }
    /// Makes [`Sampler::indices`] return the permutation of epoch `epoch`.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }
    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    /// The seed given at construction.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

impl Sampler for RandomSampler {
    fn indices(&self) -> Vec<usize> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed.wrapping_add(self.epoch));
        let mut v: Vec<usize> = (0..self.len).collect();
        v.shuffle(&mut rng);
        v
    }
    fn len(&self) -> usize {
        self.len
    }
    fn set_epoch(&mut self, epoch: u64) {
        RandomSampler::set_epoch(self, epoch);
    }
}

/// Tensors that share their first dimension, sample `i` being row `i` of each
/// (`torch.utils.data.TensorDataset`).
#[derive(Debug, Clone)]
pub struct TensorDataset {
    tensors: Vec<Tensor>,
}

impl TensorDataset {
    /// A dataset over `tensors`, each of shape `[N, ...]` with the same `N` (the trailing
    /// dimensions, dtypes and devices may differ).
    ///
    /// Errors: [`Error::InvalidArgument`] when `tensors` is empty, when one is 0-d, or when
    /// their first dimensions differ (naming the tensor and both sizes).
    pub fn new(tensors: Vec<Tensor>) -> Result<TensorDataset> {
        const OP: &str = "TensorDataset::new";
        let Some(first) = tensors.first() else {
            return Err(Error::invalid(
                OP,
                "tensors",
                "at least one tensor",
                "an empty list",
            ));
        };
        if let Some((i, t)) = tensors.iter().enumerate().find(|(_, t)| t.ndim() == 0) {
            return Err(Error::invalid(
                OP,
                "tensors",
                "tensors with at least one dimension",
                format!("tensors[{i}] of shape {:?}", t.shape()),
            ));
        }
        let n = first.shape()[0];
        if let Some((i, t)) = tensors.iter().enumerate().find(|(_, t)| t.shape()[0] != n) {
            return Err(Error::invalid(
                OP,
                "tensors",
                format!("every first dimension equal to {n} (that of tensors[0])"),
                format!(
                    "tensors[{i}] with first dimension {} (shape {:?})",
                    t.shape()[0],
                    t.shape()
                ),
            ));
        }
        Ok(TensorDataset { tensors })
    }

    /// The number of samples, the tensors' common first dimension (`len(dataset)`).
    pub fn len(&self) -> usize {
        self.tensors[0].shape()[0]
    }

    /// Whether the dataset has no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tensors, in the order given.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// Rows `indices` of every tensor, in that order (`dataset[indices]`): one tensor per
    /// dataset tensor, of shape `[indices.len(), ...]` (a new tensor gathered with
    /// [`Tensor::index_select`], differentiable in the dataset tensor). Indices may repeat.
    ///
    /// Errors: [`Error::IndexOutOfBounds`] for an index `>= len()`, naming it and the length.
    pub fn get_batch(&self, indices: &[usize]) -> Result<Vec<Tensor>> {
        let len = self.len();
        if let Some(&bad) = indices.iter().find(|&&i| i >= len) {
            return Err(Error::IndexOutOfBounds {
                op: "TensorDataset::get_batch",
                index: i64::try_from(bad).unwrap_or(i64::MAX),
                dim: 0,
                size: len,
            });
        }
        // indices < len <= isize::MAX, so they fit in i64
        let idx: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
        let index = Tensor::from_vec(idx, &[indices.len()])?;
        self.tensors
            .iter()
            .map(|t| t.index_select(0, &index.to_device(t.device())?))
            .collect()
    }
}

/// Batches of a [`TensorDataset`] in the order of a [`Sampler`]
/// (`torch.utils.data.DataLoader` with `num_workers=0` and the default collation).
///
/// Each batch is [`TensorDataset::get_batch`] of `batch_size` consecutive indices of the
/// sampler's epoch order: one tensor per dataset tensor, of shape `[batch_size, ...]`, the
/// last batch shorter unless [`DataLoader::drop_last`] is set. The sampler's indices are
/// taken once per [`DataLoader::iter`] call.
pub struct DataLoader<'a> {
    dataset: &'a TensorDataset,
    batch_size: usize,
    sampler: Box<dyn Sampler + 'a>,
    drop_last: bool,
}

impl std::fmt::Debug for DataLoader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("dataset_len", &self.dataset.len())
            .field("batch_size", &self.batch_size)
            .field("sampler_len", &self.sampler.len())
            .field("drop_last", &self.drop_last)
            .finish()
    }
}

impl<'a> DataLoader<'a> {
    /// A loader over `dataset` in batches of `batch_size`, in order
    /// ([`SequentialSampler`]), keeping a short last batch.
    ///
    /// Errors: [`Error::InvalidArgument`] when `batch_size` is 0.
    pub fn new(dataset: &'a TensorDataset, batch_size: usize) -> Result<DataLoader<'a>> {
        if batch_size == 0 {
            return Err(Error::invalid(
                "DataLoader::new",
                "batch_size",
                "a positive batch size",
                batch_size,
            ));
        }
        Ok(DataLoader {
            dataset,
            batch_size,
            sampler: Box::new(SequentialSampler::new(dataset.len())),
            drop_last: false,
        })
    }

    /// Draws the epoch order from `sampler` (`DataLoader(..., sampler=sampler)`). Its
    /// indices must be below `dataset.len()`, or the batch holding one is an error.
    pub fn sampler(mut self, sampler: Box<dyn Sampler + 'a>) -> DataLoader<'a> {
        self.sampler = sampler;
        self
    }

    /// Whether to drop the last batch when it is short (`drop_last=`); default `false`.
    pub fn drop_last(mut self, drop_last: bool) -> DataLoader<'a> {
        self.drop_last = drop_last;
        self
    }

    /// Passes `epoch` to the sampler's [`Sampler::set_epoch`], as PyTorch code calls
    /// `loader.sampler.set_epoch(epoch)` before each epoch.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.sampler.set_epoch(epoch);
    }

    /// The batch size.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The dataset.
    pub fn dataset(&self) -> &'a TensorDataset {
        self.dataset
    }

    /// The number of batches of an epoch (`len(loader)`): `ceil(n / batch_size)`, or
    /// `floor(n / batch_size)` with `drop_last`, `n` being the sampler's length.
    pub fn len(&self) -> usize {
        batch_count(self.sampler.len(), self.batch_size, self.drop_last)
    }

    /// Whether an epoch has no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The batches of one epoch, in the sampler's order (`iter(loader)`); each item is
    /// `Ok(tensors)` as [`TensorDataset::get_batch`] returns it, or its error.
    pub fn iter(&self) -> Batches<'a> {
        Batches {
            dataset: self.dataset,
            indices: self.sampler.indices(),
            batch_size: self.batch_size,
            drop_last: self.drop_last,
            pos: 0,
        }
    }
}

impl<'a> IntoIterator for &DataLoader<'a> {
    type Item = Result<Vec<Tensor>>;
    type IntoIter = Batches<'a>;
    fn into_iter(self) -> Batches<'a> {
        self.iter()
    }
}

fn batch_count(n: usize, batch_size: usize, drop_last: bool) -> usize {
    if drop_last {
        n / batch_size
    } else {
        n.div_ceil(batch_size)
    }
}

/// The iterator of [`DataLoader::iter`]: one `Result<Vec<Tensor>>` per batch.
#[derive(Debug, Clone)]
pub struct Batches<'a> {
    dataset: &'a TensorDataset,
    indices: Vec<usize>,
    batch_size: usize,
    drop_last: bool,
    pos: usize,
}

impl Iterator for Batches<'_> {
    type Item = Result<Vec<Tensor>>;

    fn next(&mut self) -> Option<Result<Vec<Tensor>>> {
        let rest = self.indices.len() - self.pos;
        if rest == 0 || (self.drop_last && rest < self.batch_size) {
            return None;
        }
        let end = self.pos + rest.min(self.batch_size);
        let batch = self.dataset.get_batch(&self.indices[self.pos..end]);
        self.pos = end;
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let rest = self.indices.len() - self.pos;
        let n = batch_count(rest, self.batch_size, self.drop_last);
        (n, Some(n))
    }
}

impl ExactSizeIterator for Batches<'_> {}

impl std::iter::FusedIterator for Batches<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// x: [n, 2] with row i = [2i, 2i + 1] (f64); y: [n] with y[i] = i (i64).
    fn dataset(n: usize) -> TensorDataset {
        let x = Tensor::from_vec((0..2 * n).map(|v| v as f64).collect(), &[n, 2]).unwrap();
        let y = Tensor::from_vec((0..n as i64).collect(), &[n]).unwrap();
        TensorDataset::new(vec![x, y]).unwrap()
    }

    /// The row ids of each batch, checking the shapes and that x's rows match y's.
    fn batch_rows(loader: &DataLoader<'_>) -> Vec<Vec<usize>> {
        let check = |b: Vec<Tensor>| {
            let (xs, ys) = (b[0].to_vec::<f64>().unwrap(), b[1].to_vec::<i64>().unwrap());
            assert_eq!((b.len(), b[1].shape()), (2, &[ys.len()][..]));
            assert_eq!(b[0].shape(), [ys.len(), 2]);
            let want = ys.iter().flat_map(|&y| [2 * y, 2 * y + 1]);
            assert_eq!(xs, want.map(|v| v as f64).collect::<Vec<_>>());
            ys.into_iter().map(|y| y as usize).collect()
        };
        loader.iter().map(|b| check(b.unwrap())).collect()
    }

    #[test]
    fn sequential_batches_cover_every_row_once_with_a_short_last_batch() {
        let ds = dataset(10);
        let loader = DataLoader::new(&ds, 4).unwrap();
        assert_eq!((loader.len(), loader.iter().len()), (3, 3));
        let rows = vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]];
        assert_eq!(batch_rows(&loader), rows);
        // `for batch in &loader` gives the same batches
        let mut seen = Vec::new();
        for batch in &loader {
            seen.push(batch.unwrap()[1].to_vec::<i64>().unwrap().len());
        }
        assert_eq!(seen, [4, 4, 2]);
        let whole = DataLoader::new(&ds, 16).unwrap();
        assert_eq!(batch_rows(&whole), vec![(0..10).collect::<Vec<_>>()]);
    }

    #[test]
    fn drop_last_drops_only_a_short_last_batch() {
        let (ds8, ds10) = (dataset(8), dataset(10));
        let loader = DataLoader::new(&ds8, 4).unwrap().drop_last(true);
        assert_eq!((loader.len(), batch_rows(&loader).len()), (2, 2));
        let loader = DataLoader::new(&ds10, 4).unwrap().drop_last(true);
        assert_eq!(loader.len(), 2);
        let rows = vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]];
        assert_eq!(batch_rows(&loader), rows);
        let loader = DataLoader::new(&ds10, 16).unwrap().drop_last(true);
        assert!(loader.is_empty() && loader.iter().next().is_none());
        // an empty dataset has no batches
        let ds0 = dataset(0);
        let loader = DataLoader::new(&ds0, 3).unwrap();
        assert!(ds0.is_empty() && loader.is_empty() && loader.iter().next().is_none());
    }

    #[test]
    fn random_sampler_batches_cover_every_row_once() {
        let ds = dataset(23);
        let sampler = RandomSampler::new(ds.len(), 7);
        let mut loader = DataLoader::new(&ds, 5).unwrap().sampler(Box::new(sampler));
        let epoch0 = batch_rows(&loader);
        let sizes: Vec<usize> = epoch0.iter().map(Vec::len).collect();
        assert_eq!(sizes, [5, 5, 5, 5, 3]);
        let mut all: Vec<usize> = epoch0.concat();
        all.sort_unstable();
        assert_eq!(all, (0..23).collect::<Vec<_>>());
        // the same epoch gives the same batches; set_epoch on the loader reaches the sampler
        assert_eq!(batch_rows(&loader), epoch0);
        loader.set_epoch(1);
        assert_ne!(batch_rows(&loader), epoch0);
    }

    #[test]
    fn samplers_give_the_expected_orders() {
        let s = SequentialSampler::new(4);
        assert_eq!((s.indices(), s.len()), (vec![0, 1, 2, 3], 4));
        assert!(SequentialSampler::new(0).is_empty());
        for len in [0usize, 1, 2, 10, 100] {
            let at = |seed, epoch| {
                let mut s = RandomSampler::new(len, seed);
                s.set_epoch(epoch);
                assert_eq!((Sampler::len(&s), s.epoch(), s.seed()), (len, epoch, seed));
                s.indices()
            };
            let a = at(42, 0);
            let mut sorted = a.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..len).collect::<Vec<_>>(), "not a permutation");
            assert_eq!(at(42, 0), a);
            assert_eq!(at(42, 3), at(42, 3));
            if len >= 10 {
                assert_ne!(at(42, 3), a, "len {len}: epochs 0 and 3 gave one order");
                assert_ne!(at(43, 0), a);
                assert_ne!(a, (0..len).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn get_batch_gathers_rows_in_order_with_repeats() {
        let ds = dataset(5);
        let b = ds.get_batch(&[4, 0, 4]).unwrap();
        let x = b[0].to_vec::<f64>().unwrap();
        assert_eq!(x, [8.0, 9.0, 0.0, 1.0, 8.0, 9.0]);
        assert_eq!(b[1].to_vec::<i64>().unwrap(), [4, 0, 4]);
        let empty = ds.get_batch(&[]).unwrap();
        assert_eq!(empty[0].shape(), [0, 2]);
        assert_eq!(empty[1].shape(), [0]);
        assert_eq!(ds.tensors().len(), 2);
    }

    #[test]
    fn bad_inputs_error_with_clear_messages() {
        let arg = |e: &Error| match e {
            Error::InvalidArgument { arg, .. } => *arg,
            _ => "",
        };
        let e = TensorDataset::new(vec![]).unwrap_err();
        assert_eq!(arg(&e), "tensors", "{e}");
        assert!(e.to_string().contains("at least one tensor"), "{e}");

        let a = Tensor::from_vec(vec![0.0f32; 6], &[3, 2]).unwrap();
        let b = Tensor::from_vec(vec![0i64; 4], &[4]).unwrap();
        let e = TensorDataset::new(vec![a.clone(), a.clone(), b]).unwrap_err();
        let msg = e.to_string();
        assert_eq!(arg(&e), "tensors", "{e}");
        assert!(msg.contains("tensors[2] with first dimension 4") && msg.contains("equal to 3"));

        let e = TensorDataset::new(vec![a.clone(), Tensor::scalar(1.0f32)]).unwrap_err();
        assert!(e.to_string().contains("tensors[1]"), "{e}");

        let ds = TensorDataset::new(vec![a]).unwrap();
        let e = DataLoader::new(&ds, 0).unwrap_err();
        assert_eq!(arg(&e), "batch_size", "{e}");

        let e = ds.get_batch(&[0, 3]).unwrap_err();
        assert_eq!(e.variant_name(), "IndexOutOfBounds");
        let msg = "index 3 is out of bounds for dimension 0 with size 3";
        assert!(e.to_string().contains(msg), "{e}");

        // a sampler with an index past the end makes that batch (and only it) an error
        let sampler = Box::new(SequentialSampler::new(4));
        let loader = DataLoader::new(&ds, 2).unwrap().sampler(sampler);
        let batches: Vec<_> = loader.iter().collect();
        assert!(batches.len() == 2 && batches[0].is_ok() && batches[1].is_err());
    }
}
