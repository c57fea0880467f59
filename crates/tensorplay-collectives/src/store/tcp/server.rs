//! The TCP store's server: the shared key-value map, the accepting thread and one thread per
//! connection that decodes and executes requests.

use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::wire::{
    MAX_VALUE_LEN, OP_ADD, OP_CHECK, OP_COMPARE_SET, OP_DELETE, OP_GET, OP_NUM_KEYS, OP_SET,
    OP_WAIT, ST_ERROR, ST_OK, ST_TIMEOUT, WireError, WireResult, get_bytes, get_key, get_keys,
    get_u8, get_u64, put_bytes, put_u32, put_u64,
};
use crate::store::memory::parse_counter;
use crate::{Error, Result};

/// The state shared by the server's threads.
#[derive(Debug, Default)]
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    stop: AtomicBool,
    /// Open connections, so that shutdown can close them and wake their threads.
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
}

/// Result of a blocking wait on the server.
enum Waited {
    Done,
    TimedOut(Vec<String>),
    Stopped,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks until all `keys` exist, `timeout` passes, or the server stops.
    fn wait_keys(&self, keys: &[String], timeout: Duration) -> Waited {
        let deadline = Instant::now().checked_add(timeout);
        let mut m = self.lock();
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return Waited::Stopped;
            }
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !m.contains_key(k.as_str()))
                .cloned()
                .collect();
            if missing.is_empty() {
                return Waited::Done;
            }
            m = match deadline {
                None => self.changed.wait(m).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Waited::TimedOut(missing);
                    }
                    self.changed
                        .wait_timeout(m, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }
}

/// A TCP store server (the master side of PyTorch's `TCPStore`): it holds the key-value map
/// and serves [`TcpStore`](super::TcpStore) clients, one thread per connection, until it is
/// dropped.
///
/// Dropping it stops accepting connections, closes the open ones (clients blocked in `get` or
/// `wait` get an [`Error::Store`]) and joins the accepting thread.
#[derive(Debug)]
pub struct TcpStoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port; see [`local_addr`](Self::local_addr)) and starts
    /// serving on a background thread.
    ///
    /// # Errors
    /// [`Error::Store`] when the address cannot be bound (for example, already in use) or the
    /// thread cannot be started.
    pub fn start(addr: SocketAddr) -> Result<TcpStoreServer> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| Error::Store(format!("cannot bind the store server to {addr}: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::Store(format!("store server at {addr}: {e}")))?;
        let shared = Arc::new(Shared::default());
        let sh = Arc::clone(&shared);
        let acceptor = std::thread::Builder::new()
            .name(format!("tcp-store-server-{}", local.port()))
            .spawn(move || accept_loop(listener, sh))
            .map_err(|e| Error::Store(format!("cannot start the store server thread: {e}")))?;
        tracing::debug!(%local, "tcp store server started");
        Ok(TcpStoreServer {
            addr: local,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The address the server is bound to (with the actual port when started on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// An address a client on this machine can connect to: the bound address, or loopback
    /// when bound to the unspecified address (`0.0.0.0` / `::`).
    pub fn connect_addr(&self) -> SocketAddr {
        let mut a = self.addr;
        if a.ip().is_unspecified() {
            a.set_ip(if a.is_ipv4() {
                Ipv4Addr::LOCALHOST.into()
            } else {
                Ipv6Addr::LOCALHOST.into()
            });
        }
        a
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake waiters (they hold the map lock while checking `stop`, so take it to avoid a
        // lost wake-up between their check and their wait).
        drop(self.shared.lock());
        self.shared.changed.notify_all();
        // Unblock `accept` with a throwaway connection.
        let _ = TcpStream::connect_timeout(&self.connect_addr(), Duration::from_secs(1));
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
        // Close every open connection; their threads see EOF or an error and exit.
        for (_, s) in self
            .shared
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
        {
            let _ = s.shutdown(Shutdown::Both);
        }
        tracing::debug!(addr = %self.addr, "tcp store server stopped");
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = conn else { continue };
        let _ = stream.set_nodelay(true);
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        match stream.try_clone() {
            Ok(c) => {
                shared
                    .conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id, c);
            }
            Err(_) => continue,
        }
        let sh = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name("tcp-store-conn".into())
            .spawn(move || {
                serve_connection(stream, &sh);
                sh.conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&id);
            });
        if spawned.is_err()
            && let Some(s) = shared
                .conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id)
        {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Serves requests on one connection until it closes, the server stops, or a protocol error.
fn serve_connection(stream: TcpStream, shared: &Shared) {
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut writer = write_half;
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        // An error here means the connection closed (or the server shut it down).
        let Ok(op) = get_u8(&mut reader) else { return };
        let reply = match handle_request(op, &mut reader, shared) {
            Ok(Some(reply)) => reply,
            Ok(None) => return, // stopping
            Err(WireError::Io(_)) => return,
            Err(WireError::Protocol(msg)) => {
                let mut r = vec![ST_ERROR];
                put_bytes(&mut r, format!("protocol error: {msg}").as_bytes());
                let _ = writer.write_all(&r);
                let _ = writer.shutdown(Shutdown::Both);
                return;
            }
        };
        if writer.write_all(&reply).is_err() {
            return;
        }
    }
}

fn err_reply(msg: &str) -> Vec<u8> {
    let mut r = vec![ST_ERROR];
    put_bytes(&mut r, msg.as_bytes());
    r
}

/// Decodes and executes one request; returns the encoded reply, or `None` when the server is
/// stopping.
fn handle_request(op: u8, r: &mut impl Read, shared: &Shared) -> WireResult<Option<Vec<u8>>> {
    let mut out = vec![ST_OK];
    match op {
        OP_SET => {
            let key = get_key(r)?;
            let value = get_bytes(r, MAX_VALUE_LEN, "value")?;
            shared.lock().insert(key, value);
            shared.changed.notify_all();
        }
        OP_GET => {
            let key = get_key(r)?;
            let timeout = Duration::from_millis(get_u64(r)?);
            let keys = [key];
            match shared.wait_keys(&keys, timeout) {
                Waited::Stopped => return Ok(None),
                Waited::TimedOut(missing) => {
                    out[0] = ST_TIMEOUT;
                    put_keys(&mut out, &missing);
                }
                Waited::Done => match shared.lock().get(&keys[0]) {
                    Some(v) => put_bytes(&mut out, v),
                    None => return Ok(Some(err_reply("the key was deleted while waiting"))),
                },
            }
        }
        OP_ADD => {
            let key = get_key(r)?;
            let delta = get_u64(r)? as i64;
            let mut m = shared.lock();
            let cur = match parse_counter(&key, m.get(&key).map(|v| v.as_slice()).unwrap_or(b"")) {
                Ok(c) => c,
                Err(Error::Store(m)) => return Ok(Some(err_reply(&m))),
                Err(e) => return Ok(Some(err_reply(&e.to_string()))),
            };
            let Some(new) = cur.checked_add(delta) else {
                return Ok(Some(err_reply(&format!(
                    "add: {cur} + {delta} overflows i64 for key {key:?}"
                ))));
            };
            m.insert(key, new.to_string().into_bytes());
            drop(m);
            shared.changed.notify_all();
            put_u64(&mut out, new as u64);
        }
        OP_COMPARE_SET => {
            let key = get_key(r)?;
            let expected = get_bytes(r, MAX_VALUE_LEN, "expected value")?;
            let desired = get_bytes(r, MAX_VALUE_LEN, "desired value")?;
            let mut m = shared.lock();
            let matches = match m.get(&key) {
                None => expected.is_empty(),
                Some(v) => *v == expected,
            };
            if matches {
                put_bytes(&mut out, &desired);
                m.insert(key, desired);
                drop(m);
                shared.changed.notify_all();
            } else {
                let cur = m.get(&key).map(|v| v.as_slice()).unwrap_or(b"");
                put_bytes(&mut out, cur);
            }
        }
        OP_WAIT => {
            let keys = get_keys(r)?;
            let timeout = Duration::from_millis(get_u64(r)?);
            match shared.wait_keys(&keys, timeout) {
                Waited::Stopped => return Ok(None),
                Waited::TimedOut(missing) => {
                    out[0] = ST_TIMEOUT;
                    put_keys(&mut out, &missing);
                }
                Waited::Done => {}
            }
        }
        OP_CHECK => {
            let keys = get_keys(r)?;
            let m = shared.lock();
            out.push(u8::from(keys.iter().all(|k| m.contains_key(k))));
        }
        OP_DELETE => {
            let key = get_key(r)?;
            out.push(u8::from(shared.lock().remove(&key).is_some()));
        }
        OP_NUM_KEYS => {
            put_u64(&mut out, shared.lock().len() as u64);
        }
        other => return Err(WireError::Protocol(format!("unknown opcode {other}"))),
    }
    Ok(Some(out))
}

fn put_keys(out: &mut Vec<u8>, keys: &[impl AsRef<str>]) {
    put_u32(out, keys.len() as u32);
    for k in keys {
        put_bytes(out, k.as_ref().as_bytes());
    }
}
