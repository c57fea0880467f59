//! Collectives of Rust values (`all_gather_object`, `broadcast_object_list`): any `serde` value,
//! encoded with `postcard` into an int64 tensor and sent with the tensor collectives.
//!
//! The encoding is compact and not self-describing: the receiving rank must ask for the type
//! the sender sent (the same program on every rank does), and types that serde can only
//! deserialize by looking at the data (`serde_json::Value`, `#[serde(untagged)]` enums) are
//! refused with an error. Floats arrive bit for bit (NaN included), maps may have any key type.
//! Bytes that do not decode as the asked type, or leave bytes over, are an error; but two types
//! with the same encoding (`i64` and `u64`, `Vec<u8>` and a `String` of valid UTF-8) are not
//! told apart. A rank that cannot serialize its value makes every rank fail at once, naming it.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{
    Error, Part, ProcessGroup, Result, all_gather, broadcast, detail, get_rank, get_world_size,
};
use tensorplay_core::{DType, Device, Tensor};

/// Bytes as little-endian int64 words (the last one zero-padded): the tensor the collectives
/// carry.
fn pack(bytes: &[u8], words: usize) -> Result<Tensor> {
    let mut v = vec![0i64; words];
    for (w, chunk) in v.iter_mut().zip(bytes.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = i64::from_le_bytes(b);
    }
    Ok(Tensor::from_vec(v, &[words])?)
}

/// The first `len` bytes of a packed tensor.
fn unpack(t: &Tensor, len: usize) -> Result<Vec<u8>> {
    let words = t.to_vec::<i64>()?;
    let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    out.truncate(len);
    Ok(out)
}

fn encode<T: Serialize + ?Sized>(op: &'static str, rank: usize, value: &T) -> Result<Vec<u8>> {
    postcard::to_stdvec(value).map_err(|e| {
        Error::invalid(
            op,
            rank as i64,
            "object",
            "a value serde can serialize",
            format!("an error: {e}"),
        )
    })
}

fn decode<T: DeserializeOwned>(op: &'static str, rank: usize, from: usize, b: &[u8]) -> Result<T> {
    let decoded = postcard::take_from_bytes::<T>(b).and_then(|(v, rest)| {
        if rest.is_empty() {
            Ok(v)
        } else {
            // bytes left over: the sender sent something larger than a T
            Err(postcard::Error::DeserializeBadEncoding)
        }
    });
    decoded.map_err(|e| Error::Mismatch {
        op: op.to_string(),
        detail: detail!(
            "rank ",
            Part::Rank(rank),
            format!(" could not decode the {} bytes from rank ", b.len()),
            Part::Rank(from),
            format!(
                " as {}: {e} (every rank must use the same type; self-describing types such as \
                 serde_json::Value are not supported)",
                std::any::type_name::<T>()
            )
        ),
    })
}

/// The length a rank sends in place of its byte count when it could not serialize its value,
/// so that the others fail at once naming it instead of waiting for bytes that never come.
const ENCODE_FAILED: i64 = -1;

/// The length to send for an encoding result.
fn len_of(encoded: &Result<Vec<u8>>) -> i64 {
    encoded.as_ref().map_or(ENCODE_FAILED, |b| b.len() as i64)
}

fn byte_len(op: &'static str, rank: usize, from: usize, v: i64) -> Result<usize> {
    if v == ENCODE_FAILED {
        return Err(Error::Mismatch {
            op: op.to_string(),
            detail: detail!(
                "rank ",
                Part::Rank(from),
                " could not serialize its object (rank ",
                Part::Rank(rank),
                " stops too)"
            ),
        });
    }
    usize::try_from(v).map_err(|_| Error::Mismatch {
        op: op.to_string(),
        detail: detail!(
            "rank ",
            Part::Rank(rank),
            format!(" got a length of {v} bytes from rank "),
            Part::Rank(from)
        ),
    })
}

/// Every rank's `object`, in group-rank order, on every rank (`dist.all_gather_object`, which
/// fills a list in place; here the list is returned).
///
/// `T` is any `serde` type; each rank may send a value of a different size. Two all-gathers of
/// int64 tensors carry it (the lengths, then the bytes padded to the longest).
///
/// # Errors
/// [`Error::NotInitialized`] without a default group; [`Error::InvalidArgument`] naming this
/// rank when `object` cannot be serialized or this process is not in `group`;
/// [`Error::Mismatch`] naming both ranks when a peer's bytes do not decode as `T`; the errors of
/// [`all_gather`] (timeouts, failed peers).
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tensorplay as tp;
/// use tp::distributed as dist;
///
/// dist::init_process_group("cpu", Default::default())?;
/// let rank = dist::get_rank(None)?;
/// let all: Vec<(usize, String)> = dist::all_gather_object(&(rank, format!("host of {rank}")), None)?;
/// assert_eq!(all[0].0, 0);
/// # Ok(()) }
/// ```
pub fn all_gather_object<T: Serialize + DeserializeOwned>(
    object: &T,
    group: Option<&ProcessGroup>,
) -> Result<Vec<T>> {
    const OP: &str = "all_gather_object";
    let rank = get_rank(group)?;
    let world = get_world_size(group)?;
    let encoded = encode(OP, rank, object);
    let lens: Vec<Tensor> = (0..world)
        .map(|_| Tensor::zeros(&[1], (DType::I64, Device::Cpu)))
        .collect::<tensorplay_core::Result<_>>()?;
    all_gather(
        &lens,
        &Tensor::from_vec(vec![len_of(&encoded)], &[1])?,
        group,
    )?;
    // this rank's own failure first, then any other rank's
    let bytes = encoded?;
    let lens: Vec<usize> = lens
        .iter()
        .enumerate()
        .map(|(from, t)| byte_len(OP, rank, from, t.to_vec::<i64>()?[0]))
        .collect::<Result<_>>()?;
    let words = lens.iter().max().copied().unwrap_or(0).div_ceil(8);
    let outs: Vec<Tensor> = (0..world)
        .map(|_| Tensor::zeros(&[words], (DType::I64, Device::Cpu)))
        .collect::<tensorplay_core::Result<_>>()?;
    all_gather(&outs, &pack(&bytes, words)?, group)?;
    outs.iter()
        .zip(&lens)
        .enumerate()
        .map(|(from, (t, &len))| decode(OP, rank, from, &unpack(t, len)?))
        .collect()
}

/// Replaces `objects` on every rank with the list held by global rank `src`
/// (`dist.broadcast_object_list`). The other ranks' lists may have any length (an empty `Vec`
/// is the usual argument): they end with `src`'s length and values; `src`'s list is unchanged.
///
/// # Errors
/// As [`all_gather_object`], and those of [`broadcast`] (`src` outside the group, timeouts).
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tensorplay as tp;
/// use tp::distributed as dist;
///
/// dist::init_process_group("cpu", Default::default())?;
/// let mut config: Vec<(String, f64)> = Vec::new();
/// if dist::get_rank(None)? == 0 {
///     config = vec![("lr".into(), 1e-3), ("warmup".into(), 100.0)];
/// }
/// dist::broadcast_object_list(&mut config, 0, None)?;
/// assert_eq!(config.len(), 2);
/// # Ok(()) }
/// ```
pub fn broadcast_object_list<T: Serialize + DeserializeOwned>(
    objects: &mut Vec<T>,
    src: usize,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    const OP: &str = "broadcast_object_list";
    let rank = get_rank(group)?;
    let me = match group {
        Some(g) => g.my_global_rank(),
        None => crate::default_group(OP)?.my_global_rank(),
    };
    let is_src = me == src;
    let encoded = if is_src {
        encode(OP, rank, objects.as_slice())
    } else {
        Ok(Vec::new())
    };
    let len = Tensor::from_vec(vec![len_of(&encoded)], &[1])?;
    broadcast(&len, src, group)?;
    let bytes = encoded?;
    let len = byte_len(OP, rank, src, len.to_vec::<i64>()?[0])?;
    let words = len.div_ceil(8);
    let data = if is_src {
        pack(&bytes, words)?
    } else {
        Tensor::zeros(&[words], (DType::I64, Device::Cpu))?
    };
    broadcast(&data, src, group)?;
    if !is_src {
        *objects = decode(OP, rank, src, &unpack(&data, len)?)?;
    }
    Ok(())
}
