//! Connecting the CPU backend's full TCP mesh through the store, with a handshake that names
//! both ends of every connection.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::store::Store;
use crate::{Detail, Error, Part, Result, detail};

/// Magic number of the connection handshake.
const HELLO: u64 = 0x5450_4c41_5943_5055;

/// Connects the full mesh: publishes this rank's listening address as `addr/<rank>`, connects
/// to every lower rank and accepts every higher one, with a handshake naming both ends.
/// Returns one stream per rank (`None` at this rank).
pub(in crate::backend::cpu) fn connect_mesh(
    store: &dyn Store,
    rank: usize,
    size: usize,
    timeout: Duration,
    bind_host: &str,
) -> Result<Vec<Option<TcpStream>>> {
    const OP: &str = "cpu backend init";
    let deadline = Instant::now() + timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let tmo = |detail: Detail| Error::Timeout {
        op: OP.into(),
        rank: rank as i64,
        timeout,
        detail,
    };
    let listener = TcpListener::bind((bind_host, 0))
        .map_err(|e| Error::Io(format!("binding a listener on {bind_host}: {e}")))?;
    let addr = listener.local_addr()?;
    store.set(&format!("addr/{rank}"), addr.to_string().as_bytes())?;

    let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    // Lower ranks: wait for their addresses, connect, handshake.
    let keys: Vec<String> = (0..rank).map(|j| format!("addr/{j}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    if !refs.is_empty()
        && let Err(e) = store.wait(&refs, left().max(Duration::from_millis(1)))
    {
        let missing: Vec<usize> = (0..rank)
            .filter(|j| !store.check(&[&format!("addr/{j}")]).unwrap_or(false))
            .collect();
        return Err(match e {
            Error::Timeout { .. } => tmo(detail!(
                "ranks ",
                Part::Ranks(missing),
                format!(" of {size} never joined (no address published)")
            )),
            e => e,
        });
    }
    for (j, key) in keys.iter().enumerate() {
        let v = store.get(key)?;
        let text = String::from_utf8_lossy(&v).into_owned();
        let target: SocketAddr = text
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| Error::Store(format!("rank {j} published a bad address {text:?}")))?;
        let s = loop {
            match TcpStream::connect_timeout(&target, left().max(Duration::from_millis(1))) {
                Ok(s) => break s,
                Err(e) if left().is_zero() => {
                    return Err(tmo(detail!(
                        "could not connect to rank ",
                        Part::Rank(j),
                        format!(" at {target}: {e}")
                    )));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        let fail = |e: io::Error| Error::PeerFailed {
            rank,
            peer: j,
            op: OP.into(),
            detail: format!("handshake with {target}: {e}").into(),
        };
        s.set_nodelay(true).map_err(fail)?;
        s.set_read_timeout(Some(left().max(Duration::from_millis(1))))
            .map_err(fail)?;
        let mut hello = Vec::with_capacity(24);
        hello.extend_from_slice(&HELLO.to_le_bytes());
        hello.extend_from_slice(&(rank as u64).to_le_bytes());
        hello.extend_from_slice(&(size as u64).to_le_bytes());
        (&s).write_all(&hello).map_err(fail)?;
        let mut reply = [0u8; 16];
        (&s).read_exact(&mut reply).map_err(fail)?;
        if reply[..8] != HELLO.to_le_bytes() || reply[8..] != (j as u64).to_le_bytes() {
            return Err(Error::PeerFailed {
                rank,
                peer: j,
                op: OP.into(),
                detail: detail!(
                    format!("{target} is not rank "),
                    Part::Rank(j),
                    " of this group (bad handshake)"
                ),
            });
        }
        streams[j] = Some(s);
    }
    // Higher ranks connect to us.
    listener.set_nonblocking(true)?;
    let mut waiting = size - rank - 1;
    while waiting > 0 {
        match listener.accept() {
            Ok((s, from)) => {
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(left().max(Duration::from_millis(1))))?;
                let mut hello = [0u8; 24];
                if (&s).read_exact(&mut hello).is_err() || hello[..8] != HELLO.to_le_bytes() {
                    tracing::warn!(
                        "cpu backend rank {rank}: ignoring a bad connection from {from}"
                    );
                    continue;
                }
                let mut w = [0u8; 8];
                w.copy_from_slice(&hello[8..16]);
                let j = u64::from_le_bytes(w) as usize;
                w.copy_from_slice(&hello[16..24]);
                let their_size = u64::from_le_bytes(w) as usize;
                if their_size != size || j <= rank || j >= size || streams[j].is_some() {
                    return Err(Error::Mismatch {
                        op: OP.into(),
                        detail: detail!(
                            "rank ",
                            Part::Rank(rank),
                            format!(
                                " (world size {size}) got a connection from a process claiming \
                                 rank "
                            ),
                            Part::Rank(j),
                            format!(" of world size {their_size}")
                        ),
                    });
                }
                let mut reply = [0u8; 16];
                reply[..8].copy_from_slice(&HELLO.to_le_bytes());
                reply[8..].copy_from_slice(&(rank as u64).to_le_bytes());
                (&s).write_all(&reply).map_err(|e| Error::PeerFailed {
                    rank,
                    peer: j,
                    op: OP.into(),
                    detail: format!("handshake: {e}").into(),
                })?;
                streams[j] = Some(s);
                waiting -= 1;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if left().is_zero() {
                    let missing: Vec<usize> =
                        (rank + 1..size).filter(|&j| streams[j].is_none()).collect();
                    return Err(tmo(detail!(
                        "ranks ",
                        Part::Ranks(missing),
                        format!(" of {size} never joined (never connected to rank "),
                        Part::Rank(rank),
                        ")"
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::Io(format!("accepting connections: {e}"))),
        }
    }
    Ok(streams)
}
