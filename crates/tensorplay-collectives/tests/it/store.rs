//! Stores: the same behaviour on `MemoryStore`, `PrefixStore` and `TcpStore`, plus TCP-specific
//! failure modes (no server, server gone).

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use tensorplay_collectives::Error;
use tensorplay_collectives::store::{MemoryStore, PrefixStore, Store, TcpStore, TcpStoreServer};

const T: Duration = Duration::from_secs(5);

fn local0() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Every operation, on a fresh (empty) store.
fn exercise(s: &dyn Store) {
    assert_eq!(s.num_keys().unwrap(), 0);
    assert!(!s.check(&["a"]).unwrap());
    s.set("a", b"1").unwrap();
    assert_eq!(s.get("a").unwrap(), b"1");
    s.set("a", b"hello").unwrap();
    assert_eq!(s.get("a").unwrap(), b"hello");
    s.set("empty", b"").unwrap();
    assert_eq!(s.get("empty").unwrap(), b"");
    assert!(s.check(&["a", "empty"]).unwrap());
    assert!(!s.check(&["a", "nope"]).unwrap());
    assert!(s.check(&[]).unwrap());

    // add: absent counts as 0; decimal ASCII storage.
    assert_eq!(s.add("cnt", 5).unwrap(), 5);
    assert_eq!(s.add("cnt", -2).unwrap(), 3);
    assert_eq!(s.get("cnt").unwrap(), b"3");
    assert!(s.add("a", 1).is_err(), "add on a non-integer value");
    s.set("big", i64::MAX.to_string().as_bytes()).unwrap();
    assert!(matches!(s.add("big", 1), Err(Error::Store(_))));

    // compare_set (PyTorch semantics).
    assert_eq!(s.compare_set("cs", b"", b"first").unwrap(), b"first");
    assert_eq!(s.compare_set("cs", b"wrong", b"x").unwrap(), b"first");
    assert_eq!(s.compare_set("cs", b"first", b"second").unwrap(), b"second");
    assert_eq!(s.get("cs").unwrap(), b"second");
    assert_eq!(s.compare_set("absent", b"nonempty", b"x").unwrap(), b"");
    assert!(!s.check(&["absent"]).unwrap());

    // wait on existing keys returns at once; zero timeout on a missing key times out.
    s.wait(&["a", "cnt"], Duration::ZERO).unwrap();
    assert!(matches!(
        s.wait(&["missing"], Duration::ZERO),
        Err(Error::Timeout { .. })
    ));

    // binary values
    let bin: Vec<u8> = (0..=255u8).collect();
    s.set("bin", &bin).unwrap();
    assert_eq!(s.get("bin").unwrap(), bin);

    let n = s.num_keys().unwrap();
    assert_eq!(n, 6); // a, empty, cnt, big, cs, bin
    assert!(s.delete_key("a").unwrap());
    assert!(!s.delete_key("a").unwrap());
    assert_eq!(s.num_keys().unwrap(), n - 1);

    s.set_timeout(Duration::from_millis(1234));
    assert_eq!(s.timeout(), Duration::from_millis(1234));
    let start = Instant::now();
    assert!(matches!(s.get("never"), Err(Error::Timeout { .. })));
    assert!(start.elapsed() >= Duration::from_millis(1200));
    s.set_timeout(T);
}

fn tcp_pair() -> (TcpStoreServer, TcpStore) {
    let server = TcpStoreServer::start(local0()).unwrap();
    let client = TcpStore::connect(server.local_addr(), T).unwrap();
    (server, client)
}

#[test]
fn memory_store_operations() {
    exercise(&MemoryStore::new());
}

#[test]
fn prefix_store_operations() {
    // On an empty shared store num_keys counts the whole store, which is only ours here.
    let inner: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let p = PrefixStore::new("pg0", Arc::clone(&inner));
    exercise(&p);
    assert!(inner.check(&["pg0/cnt"]).unwrap());
    assert!(!inner.check(&["cnt"]).unwrap());
}

#[test]
fn tcp_store_operations() {
    let (_server, client) = tcp_pair();
    exercise(&client);
}

#[test]
fn prefix_over_tcp_store_operations() {
    let (_server, client) = tcp_pair();
    let inner: Arc<dyn Store> = Arc::new(client);
    let p = PrefixStore::new("x", Arc::clone(&inner));
    exercise(&p);
    assert!(inner.check(&["x/cnt"]).unwrap());
}

#[test]
fn tcp_new_server_or_client() {
    let server = TcpStore::new_server_or_client("127.0.0.1", 0, true, T).unwrap();
    let addr = server.server_addr();
    assert_ne!(addr.port(), 0);
    let client = TcpStore::new_server_or_client("127.0.0.1", addr.port(), false, T).unwrap();
    server.set("k", b"v").unwrap();
    assert_eq!(client.get("k").unwrap(), b"v");
    // A clone keeps the server alive after the original is dropped.
    let clone = server.clone();
    drop(server);
    client.set("k2", b"v2").unwrap();
    assert_eq!(clone.get("k2").unwrap(), b"v2");
    assert!(TcpStore::new_server_or_client("no such host.invalid", 1, false, T).is_err());
}

fn blocking_get_woken_by_set(waiter: Arc<dyn Store>, setter: Arc<dyn Store>) {
    let h = thread::spawn(move || {
        let start = Instant::now();
        let v = waiter.get("late").unwrap();
        (v, start.elapsed())
    });
    thread::sleep(Duration::from_millis(200));
    setter.set("late", b"here").unwrap();
    let (v, took) = h.join().unwrap();
    assert_eq!(v, b"here");
    assert!(took >= Duration::from_millis(150), "{took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
}

#[test]
fn blocking_get_is_woken_by_set() {
    let m: Arc<dyn Store> = Arc::new(MemoryStore::new());
    blocking_get_woken_by_set(Arc::clone(&m), m);

    let (server, c1) = tcp_pair();
    let c2 = TcpStore::connect(server.local_addr(), T).unwrap();
    blocking_get_woken_by_set(Arc::new(c1), Arc::new(c2));
}

fn wait_times_out(s: &dyn Store) {
    s.set("present", b"1").unwrap();
    let start = Instant::now();
    let err = s
        .wait(&["present", "missing_key"], Duration::from_millis(500))
        .unwrap_err();
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(450), "{took:?}");
    assert!(took < Duration::from_millis(2500), "{took:?}");
    match &err {
        Error::Timeout { detail, .. } => {
            assert!(detail.contains("missing_key"), "{err}");
            assert!(!detail.contains("present"), "{err}");
        }
        other => panic!("expected Timeout, got {other}"),
    }
}

#[test]
fn wait_times_out_naming_missing_keys() {
    wait_times_out(&MemoryStore::new());
    let (_server, c) = tcp_pair();
    wait_times_out(&c);
}

fn concurrent_adds(stores: Vec<Arc<dyn Store>>) {
    let n_per = 200;
    let handles: Vec<_> = stores
        .iter()
        .map(|s| {
            let s = Arc::clone(s);
            thread::spawn(move || {
                let mut seen = Vec::new();
                for _ in 0..n_per {
                    seen.push(s.add("counter", 1).unwrap());
                }
                seen
            })
        })
        .collect();
    let mut all: Vec<i64> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    all.sort_unstable();
    let total = (stores.len() * n_per) as i64;
    assert_eq!(all, (1..=total).collect::<Vec<_>>(), "each value seen once");
    assert_eq!(
        stores[0].get("counter").unwrap(),
        total.to_string().as_bytes()
    );
}

#[test]
fn add_is_atomic_across_threads_and_connections() {
    let m: Arc<dyn Store> = Arc::new(MemoryStore::new());
    concurrent_adds(vec![Arc::clone(&m); 4]);

    let server = TcpStoreServer::start(local0()).unwrap();
    let shared: Arc<dyn Store> = Arc::new(TcpStore::connect(server.local_addr(), T).unwrap());
    let mut stores = vec![Arc::clone(&shared), shared];
    for _ in 0..2 {
        stores.push(Arc::new(TcpStore::connect(server.local_addr(), T).unwrap()));
    }
    concurrent_adds(stores);
}

#[test]
fn client_retries_until_the_server_starts() {
    // Find a free port, release it, start the server on it a bit later.
    let port = std::net::TcpListener::bind(local0())
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let h = thread::spawn(move || {
        thread::sleep(Duration::from_millis(300));
        let s = TcpStoreServer::start(addr).unwrap();
        thread::sleep(Duration::from_secs(2));
        drop(s);
    });
    let c = TcpStore::connect(addr, T).unwrap();
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k").unwrap(), b"v");
    h.join().unwrap();
}

#[test]
fn connecting_without_a_server_times_out_clearly() {
    let port = std::net::TcpListener::bind(local0())
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let start = Instant::now();
    let err = TcpStore::connect(addr, Duration::from_millis(700)).unwrap_err();
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(500), "{took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    let msg = err.to_string();
    assert!(matches!(err, Error::Timeout { .. }), "{msg}");
    assert!(msg.contains(&addr.to_string()), "{msg}");
}

#[test]
fn server_dropped_while_client_waits_gives_an_error() {
    let (server, client) = tcp_pair();
    let addr = server.local_addr();
    client.set_timeout(Duration::from_secs(30));
    let h = thread::spawn(move || {
        let start = Instant::now();
        let r = client.get("never");
        (r, start.elapsed(), client)
    });
    thread::sleep(Duration::from_millis(300));
    drop(server);
    let (r, took, client) = h.join().unwrap();
    let err = r.unwrap_err();
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(matches!(err, Error::Store(_)), "{err}");
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
    // Later calls fail fast too (reconnect refused).
    let start = Instant::now();
    assert!(matches!(client.set("k", b"v"), Err(Error::Store(_))));
    assert!(start.elapsed() < Duration::from_secs(6));
}

#[test]
fn oversized_keys_are_rejected() {
    let (_server, c) = tcp_pair();
    let key = "k".repeat(64 * 1024 + 1);
    assert!(matches!(
        c.set(&key, b"v"),
        Err(Error::InvalidArgument { .. })
    ));
    // The connection still works.
    c.set("ok", b"v").unwrap();
    assert_eq!(c.get("ok").unwrap(), b"v");
}

#[test]
fn garbage_on_the_wire_is_a_protocol_error_not_a_crash() {
    use std::io::{Read, Write};
    let (server, c) = tcp_pair();
    let mut raw = std::net::TcpStream::connect(server.local_addr()).unwrap();
    raw.set_read_timeout(Some(T)).unwrap();
    // Unknown opcode.
    raw.write_all(&[200]).unwrap();
    let mut resp = Vec::new();
    raw.read_to_end(&mut resp).unwrap();
    assert_eq!(resp[0], 2, "error status");
    assert!(String::from_utf8_lossy(&resp[5..]).contains("unknown opcode"));
    // Oversized key length.
    let mut raw = std::net::TcpStream::connect(server.local_addr()).unwrap();
    raw.set_read_timeout(Some(T)).unwrap();
    let mut req = vec![1u8];
    req.extend_from_slice(&u32::MAX.to_le_bytes());
    raw.write_all(&req).unwrap();
    let mut resp = Vec::new();
    raw.read_to_end(&mut resp).unwrap();
    assert_eq!(resp[0], 2);
    assert!(String::from_utf8_lossy(&resp[5..]).contains("exceeds"));
    // The server still serves others.
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k").unwrap(), b"v");
}
