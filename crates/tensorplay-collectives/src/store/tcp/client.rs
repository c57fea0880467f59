//! The TCP store's client: [`TcpStore`], its connection to the server (connecting with retries,
//! reconnecting after an I/O error) and the [`Store`] operations encoded as requests.

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::server::TcpStoreServer;
use super::wire::{
    MAX_KEYS, MAX_VALUE_LEN, OP_ADD, OP_CHECK, OP_COMPARE_SET, OP_DELETE, OP_GET, OP_NUM_KEYS,
    OP_SET, OP_WAIT, ST_ERROR, ST_OK, ST_TIMEOUT, WireError, WireResult, check_key, check_value,
    get_bytes, get_keys, get_u8, get_u64, millis, put_bytes, put_u32, put_u64,
};
use crate::store::Store;
use crate::{Error, Result};

/// Extra time, on top of an operation's timeout, that a client waits for the server's answer
/// before declaring the server dead.
const READ_MARGIN: Duration = Duration::from_secs(2);

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
    /// This host's address toward the server (see [`Store::local_ip`]).
    local_ip: Option<std::net::IpAddr>,
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
                local_ip: crate::store::ip_toward(addr),
            }),
        })
    }

    /// This store, telling [`Store::local_ip`] the address this host uses toward `master` (the
    /// address other hosts reach the server at; a server bound to the unspecified address
    /// cannot tell by itself).
    pub(crate) fn reaching(mut self, master: SocketAddr) -> TcpStore {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.local_ip = crate::store::ip_toward(master);
        }
        self
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
                local_ip: crate::store::ip_toward(addr),
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
            )
            .into(),
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
                detail: format!("no store server answered at {addr} (last error: {err})").into(),
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
    fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.inner.local_ip
    }
}
