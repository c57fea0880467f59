//! The TCP store (`TCPStore`): a server thread that holds the key-value map, and clients that
//! talk to it over one TCP connection each.
//!
//! # Protocol
//!
//! Little-endian and length-prefixed. A request is a `u8` opcode followed by its fields; a
//! string or byte field is a `u32` length and the bytes (keys at most [`MAX_KEY_LEN`] bytes,
//! values at most [`MAX_VALUE_LEN`] bytes), a timeout is a `u64` in milliseconds. A response
//! is a `u8` status — `0` ok (followed by the operation's result), `1` timeout (followed by
//! the list of missing keys), `2` error (followed by a message) — so blocking requests (`get`,
//! `wait`) block on the server, which answers "timeout" itself when the client's timeout
//! passes; the client never polls.

use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Store;
use super::memory::parse_counter;
use crate::{Error, Result};

/// The longest key accepted, in bytes (64 KiB).
pub const MAX_KEY_LEN: usize = 64 * 1024;
/// The largest value accepted, in bytes (1 GiB).
pub const MAX_VALUE_LEN: usize = 1 << 30;
/// The most keys one `wait` or `check` request may name.
const MAX_KEYS: usize = 1 << 20;
/// Extra time, on top of an operation's timeout, that a client waits for the server's answer
/// before declaring the server dead.
const READ_MARGIN: Duration = Duration::from_secs(2);

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_COMPARE_SET: u8 = 4;
const OP_WAIT: u8 = 5;
const OP_CHECK: u8 = 6;
const OP_DELETE: u8 = 7;
const OP_NUM_KEYS: u8 = 8;

const ST_OK: u8 = 0;
const ST_TIMEOUT: u8 = 1;
const ST_ERROR: u8 = 2;

// ---------------------------------------------------------------------------------------------
// Wire helpers
// ---------------------------------------------------------------------------------------------

fn put_u32(buf: &mut Vec<u8>, v: u32) {
    buf.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(buf: &mut Vec<u8>, v: u64) {
    buf.extend_from_slice(&v.to_le_bytes());
}

/// Appends a length-prefixed field; the caller has validated `b.len()` against the limits.
fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    // Lengths are validated to be at most 1 GiB before reaching here, so they fit in u32.
    put_u32(buf, b.len() as u32);
    buf.extend_from_slice(b);
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// An I/O-level failure while decoding: either the transport broke or the peer sent garbage.
enum WireError {
    Io(std::io::Error),
    Protocol(String),
}

impl From<std::io::Error> for WireError {
    fn from(e: std::io::Error) -> Self {
        WireError::Io(e)
    }
}

type WireResult<T> = std::result::Result<T, WireError>;

fn get_u8(r: &mut impl Read) -> WireResult<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn get_u32(r: &mut impl Read) -> WireResult<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn get_u64(r: &mut impl Read) -> WireResult<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// Reads a length-prefixed field of at most `max` bytes. The buffer grows as data arrives, so
/// a bogus length cannot make the reader allocate more than the peer actually sends.
fn get_bytes(r: &mut impl Read, max: usize, what: &str) -> WireResult<Vec<u8>> {
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

fn get_key(r: &mut impl Read) -> WireResult<String> {
    let b = get_bytes(r, MAX_KEY_LEN, "key")?;
    String::from_utf8(b).map_err(|_| WireError::Protocol("key is not valid UTF-8".into()))
}

fn get_keys(r: &mut impl Read) -> WireResult<Vec<String>> {
    let n = get_u32(r)? as usize;
    if n > MAX_KEYS {
        return Err(WireError::Protocol(format!(
            "{n} keys in one request exceed the limit of {MAX_KEYS}"
        )));
    }
    (0..n).map(|_| get_key(r)).collect()
}

fn check_key(op: &str, key: &str) -> Result<()> {
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

fn check_value(op: &str, arg: &str, v: &[u8]) -> Result<()> {
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

// ---------------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------------

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
/// and serves [`TcpStore`] clients, one thread per connection, until it is dropped.
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

// ---------------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------------

/// One connection to the server. `None` after an I/O error left it in an unknown state; the
/// next request reconnects.
#[derive(Debug)]
struct Conn {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

#[derive(Debug)]
struct Inner {
    addr: SocketAddr,
    conn: Mutex<Option<Conn>>,
    timeout: Mutex<Duration>,
    /// The server this store started (see [`TcpStore::new_server_or_client`]); kept alive as
    /// long as any clone of the store.
    server: Option<Arc<TcpStoreServer>>,
}

/// A client of a [`TcpStoreServer`] (PyTorch's `TCPStore`), implementing [`Store`].
///
/// Cloning is cheap: clones share one connection (requests are serialized by a mutex) and,
/// when this store started the server, keep the server alive.
#[derive(Debug, Clone)]
pub struct TcpStore {
    inner: Arc<Inner>,
}

/// A decoded response.
enum Reply {
    Ok(Vec<u8>),
    TimedOut(Vec<String>),
}

/// A raw response: a reply, or an error the server reported (the connection stays usable).
enum Response {
    Reply(Reply),
    ServerError(String),
}

fn open_conn(addr: SocketAddr, connect_timeout: Duration) -> std::io::Result<Conn> {
    let s = TcpStream::connect_timeout(&addr, connect_timeout.max(Duration::from_millis(1)))?;
    s.set_nodelay(true)?;
    let w = s.try_clone()?;
    Ok(Conn {
        reader: BufReader::new(s),
        writer: w,
    })
}

impl TcpStore {
    /// Connects to the server at `addr`, retrying until `timeout` passes (the server may start
    /// after the client). `timeout` also becomes the store's operation timeout.
    ///
    /// # Errors
    /// [`Error::Timeout`] naming the address and the last connection error when no server
    /// answered within `timeout`.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpStore> {
        let conn = connect_retrying(addr, timeout)?;
        Ok(TcpStore {
            inner: Arc::new(Inner {
                addr,
                conn: Mutex::new(Some(conn)),
                timeout: Mutex::new(timeout),
                server: None,
            }),
        })
    }

    /// PyTorch's `TCPStore(host, port, is_master=...)`: when `is_server`, starts a
    /// [`TcpStoreServer`] on `host:port` in this process (it lives as long as any clone of the
    /// returned store), then connects to it; otherwise connects to `host:port`, retrying up to
    /// `timeout` (seconds-scale; also the store's operation timeout).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `host` does not resolve; [`Error::Store`] when the server
    /// cannot bind; [`Error::Timeout`] when no server answers within `timeout`.
    pub fn new_server_or_client(
        host: &str,
        port: u16,
        is_server: bool,
        timeout: Duration,
    ) -> Result<TcpStore> {
        let addr = resolve(host, port)?;
        if !is_server {
            return TcpStore::connect(addr, timeout);
        }
        let server = Arc::new(TcpStoreServer::start(addr)?);
        let caddr = server.connect_addr();
        let conn = connect_retrying(caddr, timeout)?;
        Ok(TcpStore {
            inner: Arc::new(Inner {
                addr: caddr,
                conn: Mutex::new(Some(conn)),
                timeout: Mutex::new(timeout),
                server: Some(server),
            }),
        })
    }

    /// The address of the server this store talks to.
    pub fn server_addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// The server this store started, when it was created by
    /// [`new_server_or_client`](Self::new_server_or_client) with `is_server`.
    pub fn server(&self) -> Option<&Arc<TcpStoreServer>> {
        self.inner.server.as_ref()
    }

    /// Sends one request and reads its reply. `wait_for` is how long the server may block on
    /// it (zero for non-blocking requests); the socket's read timeout is set slightly above.
    fn request(&self, op: &str, req: &[u8], wait_for: Duration) -> Result<Reply> {
        let addr = self.inner.addr;
        let mut guard = self.inner.conn.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            // The previous request broke the connection: try once to reconnect.
            let conn =
                open_conn(addr, self.timeout().min(Duration::from_secs(5))).map_err(|e| {
                    Error::Store(format!(
                        "{op}: cannot reconnect to the store server at {addr}: {e}"
                    ))
                })?;
            *guard = Some(conn);
        }
        let Some(conn) = guard.as_mut() else {
            return Err(Error::Store(format!("{op}: no connection to {addr}")));
        };
        let io_limit = wait_for.max(self.timeout()).saturating_add(READ_MARGIN);
        let result = exchange(conn, req, io_limit);
        match result {
            Ok(Response::Reply(reply)) => Ok(reply),
            Ok(Response::ServerError(m)) => Err(Error::Store(format!(
                "{op} on the store server at {addr}: {m}"
            ))),
            Err(e) => {
                // The stream is in an unknown state (maybe half a reply): drop it.
                *guard = None;
                Err(match e {
                    WireError::Io(e) => {
                        let what = match e.kind() {
                            std::io::ErrorKind::UnexpectedEof => {
                                "the server closed the connection (is it still running?)".into()
                            }
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                                format!("no answer within {io_limit:?}")
                            }
                            _ => e.to_string(),
                        };
                        Error::Store(format!("{op} on the store server at {addr}: {what}"))
                    }
                    WireError::Protocol(m) => Error::Store(format!(
                        "{op} on the store server at {addr}: protocol error: {m}"
                    )),
                })
            }
        }
    }

    fn timeout_err(&self, op: &str, timeout: Duration, missing: &[String]) -> Error {
        Error::Timeout {
            op: op.into(),
            rank: -1,
            timeout,
            detail: format!(
                "keys {missing:?} were never set (store server {})",
                self.inner.addr
            ),
        }
    }
}

fn exchange(conn: &mut Conn, req: &[u8], io_limit: Duration) -> WireResult<Response> {
    conn.writer.set_write_timeout(Some(io_limit))?;
    conn.reader.get_ref().set_read_timeout(Some(io_limit))?;
    conn.writer.write_all(req)?;
    let r = &mut conn.reader;
    match get_u8(r)? {
        ST_OK => {
            // The payload is read by the caller-specific decoder below; we hand back the raw
            // rest by reading it according to the request's opcode.
            let payload = match req[0] {
                OP_GET | OP_COMPARE_SET => get_bytes(r, MAX_VALUE_LEN, "value")?,
                OP_ADD | OP_NUM_KEYS => get_u64(r)?.to_le_bytes().to_vec(),
                OP_CHECK | OP_DELETE => vec![get_u8(r)?],
                _ => Vec::new(),
            };
            Ok(Response::Reply(Reply::Ok(payload)))
        }
        ST_TIMEOUT => {
            let keys = get_keys(r)?;
            Ok(Response::Reply(Reply::TimedOut(keys)))
        }
        ST_ERROR => {
            let msg = get_bytes(r, MAX_VALUE_LEN, "error message")?;
            Ok(Response::ServerError(
                String::from_utf8_lossy(&msg).into_owned(),
            ))
        }
        s => Err(WireError::Protocol(format!("unknown response status {s}"))),
    }
}

fn connect_retrying(addr: SocketAddr, timeout: Duration) -> Result<Conn> {
    let start = Instant::now();
    let deadline = start.checked_add(timeout);
    let mut delay = Duration::from_millis(10);
    let every = crate::rendezvous::report_interval();
    let mut next_note = start + every;
    loop {
        if Instant::now() >= next_note {
            next_note += every;
            crate::rendezvous::waiting_note(&format!(
                "still waiting for the store server at {addr} after {:.0}s of {:.0}s (in a \
                 rendezvous, rank 0 starts it: is rank 0 running?)",
                start.elapsed().as_secs_f64(),
                timeout.as_secs_f64()
            ));
        }
        let remaining = deadline.map_or(Duration::from_secs(1), |d| {
            d.saturating_duration_since(Instant::now())
        });
        let err = match open_conn(addr, remaining.min(Duration::from_secs(1))) {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        let now = Instant::now();
        if deadline.is_some_and(|d| now + delay >= d) {
            return Err(Error::Timeout {
                op: "store connect".into(),
                rank: -1,
                timeout,
                detail: format!("no store server answered at {addr} (last error: {err})"),
            });
        }
        std::thread::sleep(delay);
        delay = (delay * 2).min(Duration::from_millis(200));
    }
}

/// Resolves `host:port` to one socket address (IPv4 preferred).
pub(crate) fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| {
            Error::invalid(
                "resolve",
                -1,
                "host",
                "a resolvable host name or IP address",
                format!("{host:?} ({e})"),
            )
        })?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| {
            Error::invalid(
                "resolve",
                -1,
                "host",
                "a resolvable host name or IP address",
                format!("{host:?} (no addresses)"),
            )
        })
}

fn ok_payload(reply: Reply, store: &TcpStore, op: &str, key: &str) -> Result<Vec<u8>> {
    match reply {
        Reply::Ok(p) => Ok(p),
        Reply::TimedOut(missing) => {
            let missing = if missing.is_empty() {
                vec![key.to_string()]
            } else {
                missing
            };
            Err(store.timeout_err(op, store.timeout(), &missing))
        }
    }
}

fn u64_of(p: &[u8]) -> Result<u64> {
    let b: [u8; 8] = p
        .try_into()
        .map_err(|_| Error::Store("protocol error: expected an 8-byte integer".into()))?;
    Ok(u64::from_le_bytes(b))
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key("store set", key)?;
        check_value("store set", "value", value)?;
        let mut req = Vec::with_capacity(9 + key.len() + value.len());
        req.push(OP_SET);
        put_bytes(&mut req, key.as_bytes());
        put_bytes(&mut req, value);
        ok_payload(
            self.request("set", &req, Duration::ZERO)?,
            self,
            "store set",
            key,
        )?;
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        check_key("store get", key)?;
        let timeout = self.timeout();
        let mut req = vec![OP_GET];
        put_bytes(&mut req, key.as_bytes());
        put_u64(&mut req, millis(timeout));
        match self.request("get", &req, timeout)? {
            Reply::Ok(v) => Ok(v),
            Reply::TimedOut(missing) => Err(self.timeout_err("store get", timeout, &missing)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_key("store add", key)?;
        let mut req = vec![OP_ADD];
        put_bytes(&mut req, key.as_bytes());
        put_u64(&mut req, delta as u64);
        let p = ok_payload(self.request("add", &req, Duration::ZERO)?, self, "add", key)?;
        Ok(u64_of(&p)? as i64)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        check_key("store compare_set", key)?;
        check_value("store compare_set", "expected", expected)?;
        check_value("store compare_set", "desired", desired)?;
        let mut req = vec![OP_COMPARE_SET];
        put_bytes(&mut req, key.as_bytes());
        put_bytes(&mut req, expected);
        put_bytes(&mut req, desired);
        ok_payload(
            self.request("compare_set", &req, Duration::ZERO)?,
            self,
            "compare_set",
            key,
        )
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        if keys.len() > MAX_KEYS {
            return Err(Error::invalid(
                "store wait",
                -1,
                "keys",
                format!("at most {MAX_KEYS} keys"),
                keys.len(),
            ));
        }
        let mut req = vec![OP_WAIT];
        put_u32(&mut req, keys.len() as u32);
        for k in keys {
            check_key("store wait", k)?;
            put_bytes(&mut req, k.as_bytes());
        }
        put_u64(&mut req, millis(timeout));
        match self.request("wait", &req, timeout)? {
            Reply::Ok(_) => Ok(()),
            Reply::TimedOut(missing) => Err(self.timeout_err("store wait", timeout, &missing)),
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        if keys.len() > MAX_KEYS {
            return Err(Error::invalid(
                "store check",
                -1,
                "keys",
                format!("at most {MAX_KEYS} keys"),
                keys.len(),
            ));
        }
        let mut req = vec![OP_CHECK];
        put_u32(&mut req, keys.len() as u32);
        for k in keys {
            check_key("store check", k)?;
            put_bytes(&mut req, k.as_bytes());
        }
        let p = ok_payload(
            self.request("check", &req, Duration::ZERO)?,
            self,
            "check",
            "",
        )?;
        Ok(p.first() == Some(&1))
    }

    fn delete_key(&self, key: &str) -> Result<bool> {
        check_key("store delete_key", key)?;
        let mut req = vec![OP_DELETE];
        put_bytes(&mut req, key.as_bytes());
        let p = ok_payload(
            self.request("delete_key", &req, Duration::ZERO)?,
            self,
            "delete_key",
            key,
        )?;
        Ok(p.first() == Some(&1))
    }

    fn num_keys(&self) -> Result<usize> {
        let p = ok_payload(
            self.request("num_keys", &[OP_NUM_KEYS], Duration::ZERO)?,
            self,
            "num_keys",
            "",
        )?;
        usize::try_from(u64_of(&p)?)
            .map_err(|_| Error::Store("num_keys: count does not fit in usize".into()))
    }

    fn timeout(&self) -> Duration {
        *self.inner.timeout.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_timeout(&self, timeout: Duration) {
        *self.inner.timeout.lock().unwrap_or_else(|e| e.into_inner()) = timeout;
    }
}
