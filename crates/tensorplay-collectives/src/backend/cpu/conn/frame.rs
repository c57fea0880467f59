//! Framed messages on a peer socket: writing a header and its payload, reading one back
//! (checking the header as soon as it arrives), and mapping I/O errors to the crate's errors.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::header::{HDR, Header};
use crate::{Error, Part, Result, detail};

/// Maps an I/O error on the connection to `peer` to the crate's error.
pub(in crate::backend::cpu) fn io_err(
    e: &io::Error,
    rank: usize,
    peer: usize,
    op: &str,
    timeout: Duration,
    what: &str,
) -> Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::Timeout {
            op: op.into(),
            rank: rank as i64,
            timeout,
            detail: detail!(format!("no progress {what} rank "), Part::Rank(peer)),
        },
        io::ErrorKind::UnexpectedEof => Error::PeerFailed {
            rank,
            peer,
            op: op.into(),
            detail: detail!(
                "connection closed by rank ",
                Part::Rank(peer),
                format!(" while {what} it (did it exit or fail?)")
            ),
        },
        _ => Error::PeerFailed {
            rank,
            peer,
            op: op.into(),
            detail: format!("{what} it: {e}").into(),
        },
    }
}

/// Writes `hdr` then `data` completely.
pub(super) fn write_msg(mut s: &TcpStream, hdr: &[u8], data: &[u8]) -> io::Result<()> {
    let mut storage = [IoSlice::new(hdr), IoSlice::new(data)];
    let mut bufs: &mut [IoSlice<'_>] = &mut storage;
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match s.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one header and then exactly `dst.len()` payload bytes (in the same system calls when
/// possible), calling `check` as soon as the header is complete.
pub(super) fn read_msg(
    mut s: &TcpStream,
    dst: &mut [u8],
    mut check: impl FnMut(Option<Header>) -> Result<()>,
    on_io: impl Fn(&io::Error) -> Error,
) -> Result<()> {
    let mut hdr = [0u8; HDR];
    let mut got = 0usize;
    let total = HDR + dst.len();
    let mut checked = false;
    while got < total {
        let r = if got < HDR {
            let (h, d) = (&mut hdr[got..], &mut dst[..]);
            s.read_vectored(&mut [IoSliceMut::new(h), IoSliceMut::new(d)])
        } else {
            s.read(&mut dst[got - HDR..])
        };
        match r {
            Ok(0) => return Err(on_io(&io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(on_io(&e)),
        }
        if !checked && got >= HDR {
            checked = true;
            check(Header::decode(&hdr))?;
        }
    }
    Ok(())
}

/// Reads exactly `dst.len()` bytes (a continuation of a message's payload).
pub(super) fn read_full(
    mut s: &TcpStream,
    dst: &mut [u8],
    on_io: impl Fn(&io::Error) -> Error,
) -> Result<()> {
    s.read_exact(dst).map_err(|e| on_io(&e))
}
