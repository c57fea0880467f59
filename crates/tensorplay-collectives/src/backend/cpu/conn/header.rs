//! The message header of the CPU backend's peer connections: the kind of call, the call's
//! signature and the payload length, its 40-byte encoding, and the check that reports
//! mismatched calls.

use crate::{Error, Part, Result, detail};

/// Magic number at the start of every header ("TPC1").
const MAGIC: u32 = 0x3143_5054;
/// Header size in bytes.
pub(in crate::backend::cpu) const HDR: usize = 40;
/// "No reduce op" in a header.
pub(in crate::backend::cpu) const NO_REDOP: u8 = 255;

/// The kind of call a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(in crate::backend::cpu) enum Kind {
    /// all_reduce.
    AllReduce = 1,
    /// broadcast.
    Broadcast = 2,
    /// reduce.
    Reduce = 3,
    /// all_gather.
    AllGather = 4,
    /// reduce_scatter.
    ReduceScatter = 5,
    /// gather.
    Gather = 6,
    /// scatter.
    Scatter = 7,
    /// all_to_all.
    AllToAll = 8,
    /// barrier.
    Barrier = 9,
    /// send/recv.
    P2p = 10,
}

impl Kind {
    /// The operation's name.
    pub(in crate::backend::cpu) fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Gather => "gather",
            Kind::Scatter => "scatter",
            Kind::AllToAll => "all_to_all",
            Kind::Barrier => "barrier",
            Kind::P2p => "send/recv",
        }
    }
    pub(in crate::backend::cpu) fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::AllReduce,
            2 => Kind::Broadcast,
            3 => Kind::Reduce,
            4 => Kind::AllGather,
            5 => Kind::ReduceScatter,
            6 => Kind::Gather,
            7 => Kind::Scatter,
            8 => Kind::AllToAll,
            9 => Kind::Barrier,
            10 => Kind::P2p,
            _ => return None,
        })
    }
}

/// A message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::backend::cpu) struct Header {
    /// The call.
    pub(in crate::backend::cpu) kind: Kind,
    /// Element dtype code (0 f32, 1 f64, 2 i64).
    pub(in crate::backend::cpu) dtype: u8,
    /// Reduce op code, or [`NO_REDOP`].
    pub(in crate::backend::cpu) redop: u8,
    /// Collective sequence number, or the p2p tag.
    pub(in crate::backend::cpu) seq: u64,
    /// The call's total element count (0 where ranks legitimately differ).
    pub(in crate::backend::cpu) count: u64,
    /// The root, or 0.
    pub(in crate::backend::cpu) aux: u64,
    /// Payload bytes of this message.
    pub(in crate::backend::cpu) len: u64,
}

impl Header {
    pub(super) fn encode(&self) -> [u8; HDR] {
        let mut b = [0u8; HDR];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.dtype;
        b[6] = self.redop;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.aux.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub(super) fn decode(b: &[u8; HDR]) -> Option<Header> {
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let mut m = [0u8; 4];
        m.copy_from_slice(&b[0..4]);
        if u32::from_le_bytes(m) != MAGIC {
            return None;
        }
        Some(Header {
            kind: Kind::from_u8(b[4])?,
            dtype: b[5],
            redop: b[6],
            seq: u64_at(8),
            count: u64_at(16),
            aux: u64_at(24),
            len: u64_at(32),
        })
    }

    pub(in crate::backend::cpu) fn describe(&self) -> String {
        // the core's wire codes (`DType::code`)
        let name = tensorplay_core::DType::from_code(self.dtype).map(|d| d.to_string());
        let dt = name.as_deref().unwrap_or("?");
        match self.kind {
            Kind::P2p => format!("send(tag={}, {} elements of {dt})", self.seq, self.count),
            k => format!(
                "{} #{} ({} elements of {dt}{}{})",
                k.name(),
                self.seq,
                self.count,
                if self.redop == NO_REDOP {
                    String::new()
                } else {
                    format!(", op {}", redop_name(self.redop))
                },
                if matches!(
                    k,
                    Kind::Broadcast | Kind::Reduce | Kind::Gather | Kind::Scatter
                ) {
                    format!(", root {}", self.aux)
                } else {
                    String::new()
                }
            ),
        }
    }

    /// Checks a received header against the expected one.
    pub(in crate::backend::cpu) fn check(
        &self,
        got: &Header,
        rank: usize,
        peer: usize,
    ) -> Result<()> {
        if self == got {
            return Ok(());
        }
        let same_call = Header { len: 0, ..*self } == Header { len: 0, ..*got };
        let detail = if same_call {
            detail!(
                "rank ",
                Part::Rank(peer),
                format!(" sent {} bytes but rank ", got.len),
                Part::Rank(rank),
                format!(" expected {} bytes in {}", self.len, self.describe())
            )
        } else if self.kind == Kind::P2p && got.kind == Kind::P2p && self.seq != got.seq {
            detail!(
                "rank ",
                Part::Rank(rank),
                " called recv(src=",
                Part::Rank(peer),
                format!(", tag={}) but the next message from rank ", self.seq),
                Part::Rank(peer),
                format!(
                    " has tag {} (messages from one peer arrive in order)",
                    got.seq
                )
            )
        } else {
            detail!(
                "rank ",
                Part::Rank(rank),
                format!(" called {} but rank ", self.describe()),
                Part::Rank(peer),
                format!(" called {}", got.describe())
            )
        };
        Err(Error::Mismatch {
            op: self.kind.name().into(),
            detail,
        })
    }
}

/// The name of a reduce-op code.
fn redop_name(c: u8) -> &'static str {
    ["Sum", "Product", "Min", "Max", "Avg", "BAnd", "BOr", "BXor"]
        .get(c as usize)
        .copied()
        .unwrap_or("?")
}
