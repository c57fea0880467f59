//! The TCP store's wire protocol: the limits, opcodes and status codes, and the little-endian,
//! length-prefixed encoding and decoding helpers shared by the server and the client.

use std::io::Read;
use std::time::Duration;

use crate::{Error, Result};

/// The longest key accepted, in bytes (64 KiB).
pub const MAX_KEY_LEN: usize = 64 * 1024;
/// The largest value accepted, in bytes (1 GiB).
pub const MAX_VALUE_LEN: usize = 1 << 30;
/// The most keys one `wait` or `check` request may name.
pub(super) const MAX_KEYS: usize = 1 << 20;

pub(super) const OP_SET: u8 = 1;
pub(super) const OP_GET: u8 = 2;
pub(super) const OP_ADD: u8 = 3;
pub(super) const OP_COMPARE_SET: u8 = 4;
pub(super) const OP_WAIT: u8 = 5;
pub(super) const OP_CHECK: u8 = 6;
pub(super) const OP_DELETE: u8 = 7;
pub(super) const OP_NUM_KEYS: u8 = 8;

pub(super) const ST_OK: u8 = 0;
pub(super) const ST_TIMEOUT: u8 = 1;
pub(super) const ST_ERROR: u8 = 2;

pub(super) fn put_u32(buf: &mut Vec<u8>, v: u32) {
    buf.extend_from_slice(&v.to_le_bytes());
}

pub(super) fn put_u64(buf: &mut Vec<u8>, v: u64) {
    buf.extend_from_slice(&v.to_le_bytes());
}

/// Appends a length-prefixed field; the caller has validated `b.len()` against the limits.
pub(super) fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    // Lengths are validated to be at most 1 GiB before reaching here, so they fit in u32.
    put_u32(buf, b.len() as u32);
    buf.extend_from_slice(b);
}

pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// An I/O-level failure while decoding: either the transport broke or the peer sent garbage.
pub(super) enum WireError {
    Io(std::io::Error),
    Protocol(String),
}

impl From<std::io::Error> for WireError {
    fn from(e: std::io::Error) -> Self {
        WireError::Io(e)
    }
}

pub(super) type WireResult<T> = std::result::Result<T, WireError>;

pub(super) fn get_u8(r: &mut impl Read) -> WireResult<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

pub(super) fn get_u32(r: &mut impl Read) -> WireResult<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

pub(super) fn get_u64(r: &mut impl Read) -> WireResult<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// Reads a length-prefixed field of at most `max` bytes. The buffer grows as data arrives, so
/// a bogus length cannot make the reader allocate more than the peer actually sends.
pub(super) fn get_bytes(r: &mut impl Read, max: usize, what: &str) -> WireResult<Vec<u8>> {
    let len = get_u32(r)? as usize;
    if len > max {
        return Err(WireError::Protocol(format!(
            "{what} of {len} bytes exceeds the limit of {max} bytes"
        )));
    }
    let mut v = Vec::with_capacity(len.min(1 << 16));
    let n = r.by_ref().take(len as u64).read_to_end(&mut v)?;
    if n != len {
        return Err(WireError::Io(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("connection closed in the middle of a {what}"),
        )));
    }
    Ok(v)
}

pub(super) fn get_key(r: &mut impl Read) -> WireResult<String> {
    let b = get_bytes(r, MAX_KEY_LEN, "key")?;
    String::from_utf8(b).map_err(|_| WireError::Protocol("key is not valid UTF-8".into()))
}

pub(super) fn get_keys(r: &mut impl Read) -> WireResult<Vec<String>> {
    let n = get_u32(r)? as usize;
    if n > MAX_KEYS {
        return Err(WireError::Protocol(format!(
            "{n} keys in one request exceed the limit of {MAX_KEYS}"
        )));
    }
    (0..n).map(|_| get_key(r)).collect()
}

pub(super) fn check_key(op: &str, key: &str) -> Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(Error::invalid(
            op,
            -1,
            "key",
            format!("at most {MAX_KEY_LEN} bytes"),
            format!("{} bytes", key.len()),
        ));
    }
    Ok(())
}

pub(super) fn check_value(op: &str, arg: &str, v: &[u8]) -> Result<()> {
    if v.len() > MAX_VALUE_LEN {
        return Err(Error::invalid(
            op,
            -1,
            arg,
            format!("at most {MAX_VALUE_LEN} bytes"),
            format!("{} bytes", v.len()),
        ));
    }
    Ok(())
}
