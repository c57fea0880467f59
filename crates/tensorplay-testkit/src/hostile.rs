//! Bytes a hostile peer or a corrupt file would hold, built from a valid message, so that each
//! test states which fault it injects rather than writing its own byte surgery.

/// One way to damage a valid message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Damage {
    /// Only the first `n` bytes (a peer that died mid-write, a file cut short).
    Truncate(usize),
    /// Bit `bit` (0-7) of byte `at` flipped (a corrupt disk or link).
    FlipBit {
        /// The byte's index.
        at: usize,
        /// The bit within it, 0 = least significant.
        bit: u8,
    },
    /// The little-endian `u64` at `at` replaced by `value` (a length or count that lies).
    LieU64 {
        /// The field's byte offset.
        at: usize,
        /// What it claims instead.
        value: u64,
    },
    /// `n` bytes of `byte` appended (trailing garbage).
    Append {
        /// How many bytes.
        n: usize,
        /// Their value.
        byte: u8,
    },
}

/// `valid` with `damage` applied; offsets past the end leave the bytes as they are (the caller
/// asked for a fault the message cannot carry), which [`damaged`]'s tests pin down.
pub fn damaged(valid: &[u8], damage: Damage) -> Vec<u8> {
    let mut b = valid.to_vec();
    match damage {
        Damage::Truncate(n) => b.truncate(n),
        Damage::FlipBit { at, bit } => {
            if let Some(x) = b.get_mut(at) {
                *x ^= 1 << (bit % 8);
            }
        }
        Damage::LieU64 { at, value } => {
            if let Some(f) = b.get_mut(at..at + 8) {
                f.copy_from_slice(&value.to_le_bytes());
            }
        }
        Damage::Append { n, byte } => b.extend(std::iter::repeat_n(byte, n)),
    }
    b
}

/// Every truncation of `valid` (lengths `0..len`), the usual first fuzz of a decoder.
pub fn truncations(valid: &[u8]) -> impl Iterator<Item = Vec<u8>> + '_ {
    (0..valid.len()).map(|n| valid[..n].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn damages() {
        let v = [1u8, 2, 3, 4, 5, 6, 7, 8, 9];
        for (name, d, want) in [
            ("truncate", Damage::Truncate(2), vec![1, 2]),
            (
                "flip",
                Damage::FlipBit { at: 0, bit: 1 },
                vec![3, 2, 3, 4, 5, 6, 7, 8, 9],
            ),
            (
                "flip past the end",
                Damage::FlipBit { at: 99, bit: 0 },
                v.to_vec(),
            ),
            (
                "lie",
                Damage::LieU64 {
                    at: 1,
                    value: u64::MAX,
                },
                vec![1, 255, 255, 255, 255, 255, 255, 255, 255],
            ),
            (
                "append",
                Damage::Append { n: 2, byte: 0 },
                [&v[..], &[0, 0]].concat(),
            ),
        ] {
            assert_eq!(damaged(&v, d), want, "case {name}");
        }
        assert_eq!(truncations(&v).count(), 9);
    }
}
