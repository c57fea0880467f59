//! The batch offsets of `gpt_distributed`: every (seed, stream, step, row) gets its own offset
//! from a counter-based hash, reduced to the valid range without modulo bias. The rule is
//! written in docs/models.md ("Batches"); `benchmarks/gpt_batches.py` implements the same text
//! for the PyTorch twin, and the committed fixture `data/gpt_batch_offsets.json` holds the
//! first 64 training offsets at seed 0, which both sides reproduce.

use std::ops::Range;

/// The stream of training batches.
pub(crate) const TRAIN: u64 = 0;
/// The stream of validation batches.
pub(crate) const VALIDATION: u64 = 1;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's finaliser: a bijection of 64-bit words.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The 64-bit word of `(seed, stream, step, row, attempt)`: starting from 0, each field `x` in
/// turn is absorbed as `h = mix((h ^ x) + GOLDEN)` (wrapping).
fn word(seed: u64, stream: u64, step: u64, row: u64, attempt: u64) -> u64 {
    [seed, stream, step, row, attempt]
        .into_iter()
        .fold(0, |h, x| mix((h ^ x).wrapping_add(GOLDEN)))
}

/// The offset in `0..positions` of row `row` of batch `step` of `stream`: the first word (over
/// attempts 0, 1, ...) below `2^64 - (2^64 mod positions)`, modulo `positions`, so every offset
/// is equally likely. `positions` must be at least 1 (the callers pass a text longer than a
/// context).
pub(crate) fn offset(positions: u64, seed: u64, stream: u64, step: u64, row: u64) -> u64 {
    assert!(positions > 0, "offset: no valid position");
    // 2^64 mod n, in 64 bits: (2^64 - n) mod n; when it is 0 every word is accepted, otherwise
    // words from 2^64 - (2^64 mod n) on are rejected
    let excess = positions.wrapping_neg() % positions;
    let accept = |w: u64| excess == 0 || w < excess.wrapping_neg();
    (0..)
        .map(|attempt| word(seed, stream, step, row, attempt))
        .find(|&w| accept(w))
        .map(|w| w % positions)
        .unwrap_or(0)
}

/// The offsets of the `rows` rows of batch `step` of `stream`, over a sequence of `len` tokens
/// holding inputs of `context` tokens and their next-token targets (`len - context` valid
/// offsets).
pub(crate) fn batch_offsets(
    len: usize,
    context: usize,
    seed: u64,
    stream: u64,
    step: usize,
    rows: usize,
) -> Vec<usize> {
    let positions = (len - context) as u64;
    (0..rows)
        .map(|r| offset(positions, seed, stream, step as u64, r as u64) as usize)
        .collect()
}

/// The rows of a batch of `batch` rows that rank `rank` of `world` takes under data
/// parallelism: a contiguous `batch / world` (`world` divides `batch`).
pub(crate) fn shard_rows(batch: usize, rank: usize, world: usize) -> Range<usize> {
    let rows = batch / world;
    rank * rows..(rank + 1) * rows
}

#[cfg(test)]
mod tests {
    use super::*;
    // the job's own split and constants: the tests check the batches the job draws
    use crate::{BATCH, CONTEXT, Corpus, VAL_BATCHES, WORLD};

    #[test]
    fn gpt_batch_offsets_match_the_fixture() {
        // written by benchmarks/gpt_batches.py from the rule's text; .ci/run checks it there too
        let text = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/data/gpt_batch_offsets.json"
        ));
        let f: serde_json::Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("the fixture is not JSON: {e}"));
        let c = Corpus::load().unwrap();
        let positions = (c.train.len() - CONTEXT) as u64;
        for (key, want) in [
            ("positions", positions),
            ("seed", 0),
            ("stream", TRAIN),
            ("rows_per_step", BATCH as u64),
        ] {
            assert_eq!(
                f[key].as_u64(),
                Some(want),
                "the fixture's {key}: {}",
                f[key]
            );
        }
        let want: Vec<u64> = f["offsets"]
            .as_array()
            .unwrap_or_else(|| panic!("the fixture's offsets: {}, expected a list", f["offsets"]))
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64()
                    .unwrap_or_else(|| panic!("the fixture's offset {i}: {v}, expected a number"))
            })
            .collect();
        assert_eq!(want.len(), 64, "the fixture's number of offsets");
        for (i, &w) in want.iter().enumerate() {
            let (step, row) = (i / BATCH, i % BATCH);
            let got = batch_offsets(c.train.len(), CONTEXT, 0, TRAIN, step, BATCH)[row] as u64;
            assert_eq!(got, w, "offset {i} (step {step}, row {row})");
        }
    }

    #[test]
    fn gpt_batches_are_distinct_and_shards_disjoint() {
        let c = Corpus::load().unwrap();
        for (seed, stream, data) in [
            (0, TRAIN, &c.train),
            (1, TRAIN, &c.train),
            (2, TRAIN, &c.train),
            (0, VALIDATION, &c.val),
        ] {
            let case = format!("seed {seed}, stream {stream}");
            let steps = if stream == TRAIN { 600 } else { VAL_BATCHES };
            let mut all = Vec::new();
            for step in 0..steps {
                let batch = batch_offsets(data.len(), CONTEXT, seed, stream, step, BATCH);
                assert!(
                    batch.iter().all(|&at| at + CONTEXT < data.len()),
                    "{case}: an offset leaves the text"
                );
                // the data-parallel shards of the batch: disjoint, and together the batch
                let mut seen = vec![0; BATCH];
                for rank in 0..WORLD {
                    for r in shard_rows(BATCH, rank, WORLD) {
                        seen[r] += 1;
                    }
                }
                assert!(
                    seen.iter().all(|&n| n == 1),
                    "{case}, step {step}: {seen:?}"
                );
                all.extend(batch);
            }
            let n = all.len();
            all.sort_unstable();
            all.dedup();
            assert!(
                all.len() * 100 >= n * 95,
                "{case}: {} distinct offsets of {n}",
                all.len()
            );
        }
        // the old generator, re-seeded one step from the last, gave ~615 distinct of 9600
    }

    #[test]
    fn offsets_are_in_range_and_unbiased_at_the_edges() {
        for (positions, case) in [
            (1u64, "one position"),
            (2, "a power of two"),
            (3, "three"),
            (
                (1 << 63) + 1,
                "just above 2^63: half the words are rejected",
            ),
            (u64::MAX, "2^64 - 1"),
        ] {
            let mut hist = std::collections::BTreeMap::new();
            for step in 0..300 {
                let at = offset(positions, 0, TRAIN, step, 0);
                assert!(at < positions, "{case}: {at} >= {positions}");
                if positions <= 3 {
                    *hist.entry(at).or_insert(0) += 1;
                }
            }
            // each small position is drawn about equally often (300/n, well within 40%)
            for (&at, &count) in &hist {
                let expect = 300.0 / positions as f64;
                assert!(
                    (count as f64 - expect).abs() < 0.4 * expect,
                    "{case}: position {at} drawn {count} times of 300"
                );
            }
            if positions <= 3 {
                assert_eq!(hist.len() as u64, positions, "{case}: {hist:?}");
            }
        }
    }
}
