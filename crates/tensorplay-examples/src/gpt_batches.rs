//! The batch offsets of `gpt_distributed`: every (seed, stream, step, row) gets its own offset
//! from a counter-based hash, reduced to the valid range without modulo bias. The rule is
//! written in docs/models.md ("Batches"); `benchmarks/gpt_batches.py` implements the same text
//! for the PyTorch twin, and the committed fixture `data/gpt_batch_offsets.json` holds the
//! first 64 training offsets at seed 0, which both sides reproduce.

use std::ops::Range;

/// The stream of training batches.
pub const TRAIN: u64 = 0;
/// The stream of validation batches.
pub const VALIDATION: u64 = 1;

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
pub fn offset(positions: u64, seed: u64, stream: u64, step: u64, row: u64) -> u64 {
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
pub fn batch_offsets(
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
pub fn shard_rows(batch: usize, rank: usize, world: usize) -> Range<usize> {
    let rows = batch / world;
    rank * rows..(rank + 1) * rows
}
