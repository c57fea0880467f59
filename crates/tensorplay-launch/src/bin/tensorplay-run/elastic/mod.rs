//! The launchers' own rendezvous, for several nodes with `--max-restarts N` or an elastic
//! `--nnodes MIN:MAX` (see `docs/restarts.md`).
//!
//! One launcher hosts a TCP store at the master's address and port (whichever can bind it:
//! node 0's on a cluster), the others connect to it. The job runs in *rounds*; every key of
//! round `r` is under `round/<r>/`:
//!
//! | key | value |
//! |---|---|
//! | `open` | `<why> <restarts> <by>`: `start`, `failure` (counts against `--max-restarts`) or `membership`; the failure restarts made before this round; who opened it |
//! | `joined` | how many launchers entered the round (a counter: the join order) |
//! | `slot/<i>` | the `i`-th launcher to enter: `<hosts the store 0/1> <--node-rank or -> <address> <name>` |
//! | `closed` | the join indices of the launchers taking part (`0,1,3`: the store's host and then the first to enter, at most MAX), or why the round failed to close |
//! | `master` | `<port> <address>`: the children's `MASTER_PORT` and `MASTER_ADDR`, published by node rank 0 |
//! | `waiting` | how many launchers arrived too late for this round and wait for the next |
//! | `fail/<node rank>` | that node's root-cause line when its group failed |
//! | `ok`, `left` | the launchers whose group succeeded, and those that then saw every node succeed |
//!
//! plus `job/failed` (why the whole job stops) and `job/done` (it succeeded). A round closes
//! when MAX launchers entered it, or when at least MIN did and `--rdzv-last-call` passed since
//! the MIN-th; node ranks are then the `--node-rank` of each (fixed membership), or the join
//! order with the store's host first (elastic). A launcher left out waits (`waiting`) for the
//! next round: the running launchers of an elastic job with room open one for it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};

use tensorplay_collectives::store::{Store, TcpStore, ip_toward};

mod join;

/// How often the launchers' store is polled while a round forms or ends.
const POLL: Duration = Duration::from_millis(100);

/// How long the store's host waits, after the job succeeded, for the other launchers to see
/// it before it exits (taking the store with it).
const HOST_LINGER: Duration = Duration::from_secs(5);

/// The rendezvous settings, from the flags.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    /// Fewest nodes a round may have (`--nnodes MIN:MAX`; `N` for `--nnodes N`).
    pub(crate) min: usize,
    /// Most nodes a round may have.
    pub(crate) max: usize,
    /// `--nnodes MIN:MAX` (node ranks follow the join order); else `--node-rank` is kept.
    pub(crate) elastic: bool,
    /// This node's `--node-rank` with fixed membership.
    pub(crate) fixed_rank: Option<usize>,
    /// `--rdzv-last-call`.
    pub(crate) last_call: Duration,
    /// `--rdzv-timeout`.
    pub(crate) timeout: Duration,
    /// `--max-restarts`.
    pub(crate) max_restarts: usize,
    /// The flags every launcher of the job must share (`--nnodes`, `--nproc-per-node`,
    /// `--max-restarts`), as text: the first launcher's are the job's.
    pub(crate) shape: String,
}

/// This node's part in a round that closed.
#[derive(Debug, Clone)]
pub(crate) struct Round {
    /// The round's number (from 0, for the whole job).
    pub(crate) round: u64,
    /// Nodes taking part.
    pub(crate) nnodes: usize,
    /// This node's rank among them.
    pub(crate) node_rank: usize,
    /// The children's `MASTER_ADDR` (node rank 0's address).
    pub(crate) master_addr: String,
    /// The children's `MASTER_PORT` (picked by node rank 0 for this round).
    pub(crate) master_port: u16,
    /// Failure restarts made before this round.
    pub(crate) restarts: usize,
}

/// How joining a round ended.
#[derive(Debug)]
pub(crate) enum Joined {
    /// The round closed with this node in it.
    Round(Round),
    /// Ctrl-C, SIGTERM or SIGHUP while waiting.
    Interrupted,
    /// The job succeeded before this node was admitted.
    JobDone,
}

/// Why the local group must stop while it runs.
#[derive(Debug)]
pub(crate) enum Event {
    /// A new round was opened (this node has entered it); what to tell the user.
    NewRound(String),
    /// The job failed elsewhere: the message.
    JobFailed(String),
}

/// What a local failure leads to.
#[derive(Debug)]
pub(crate) enum After {
    /// A next round is open (this node entered it): `(counted, restarts, by)`.
    Next(bool, usize, String),
    /// No restarts are left: the job failed.
    Exhausted,
}

/// How the exit barrier after a local success ended.
#[derive(Debug)]
pub(crate) enum Finish {
    /// Every node succeeded (or the others could not be heard from: the note).
    Done(Option<String>),
    /// The job restarts (another node's group failed): the note; this node entered the round.
    Rejoin(String),
}

/// This launcher's handle on the launchers' rendezvous.
pub(crate) struct Launchers {
    store: TcpStore,
    cfg: Config,
    endpoint: String,
    /// Whether this launcher hosts the store (it must stay alive for the job).
    pub(crate) host: bool,
    /// `hostname:pid`, for messages.
    me: String,
    /// This node's address toward the store: the children's `MASTER_ADDR` when it is node 0.
    addr: String,
    /// The round entered last, and this launcher's join index in it.
    round: u64,
    slot: usize,
    current: Option<Round>,
    lost: bool,
}

fn key(r: u64, what: &str) -> String {
    format!("round/{r}/{what}")
}

/// `host:port` as one address (IPv4 preferred, as the stores do).
fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    let all: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host:?}: {e}"))?
        .collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or_else(|| all.first())
        .copied()
        .ok_or_else(|| format!("{host:?} has no address"))
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname(2) writes at most `buf.len()` bytes into our buffer.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if rc == 0 && end > 0 {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "?".into()
    }
}

impl Launchers {
    /// Hosts the launchers' store on `port` when `host` is an address of this machine (bound
    /// on every interface, as rank 0's store is: a host name may resolve to a loopback address
    /// here and to the network's elsewhere) and no other launcher here hosts it already; else
    /// connects to it, waiting up to `--rdzv-timeout` for its host to start.
    ///
    /// # Errors
    /// When `host` does not resolve, or no store answers in time.
    pub(crate) fn connect(host: &str, port: u16, cfg: Config) -> Result<Launchers, String> {
        let endpoint = format!("{host}:{port}");
        let at = resolve(host, port)
            .map_err(|e| format!("the launchers' rendezvous at {endpoint}: {e}"))?;
        let local = at.ip().is_loopback() || std::net::TcpListener::bind((at.ip(), 0)).is_ok();
        let any: IpAddr = if at.is_ipv4() {
            Ipv4Addr::UNSPECIFIED.into()
        } else {
            Ipv6Addr::UNSPECIFIED.into()
        };
        let hosted = if local {
            TcpStore::new_server_or_client(&any.to_string(), port, true, cfg.timeout).map_err(|e| {
                format!("this machine has {host} but could not host the store there: {e}")
            })
        } else {
            Err(format!("{host} is not an address of this machine"))
        };
        let (store, is_host) = match hosted {
            Ok(s) => (s, true),
            Err(why) => match TcpStore::connect(at, cfg.timeout) {
                Ok(s) => (s, false),
                Err(e) => {
                    return Err(format!(
                        "the launchers' rendezvous at {endpoint}: {e} (not hosted here: {why})"
                    ));
                }
            },
        };
        let addr = ip_toward(at).map_or_else(|| host.to_string(), |ip| ip.to_string());
        Ok(Launchers {
            store,
            cfg,
            endpoint,
            host: is_host,
            me: format!("{}:{}", hostname(), std::process::id()),
            addr,
            round: 0,
            slot: 0,
            current: None,
            lost: false,
        })
    }

    /// Whether node ranks follow the join order (`--nnodes MIN:MAX`).
    pub(crate) fn elastic(&self) -> bool {
        self.cfg.elastic
    }

    /// Where the store is, for messages.
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn err(&self, e: impl std::fmt::Display) -> String {
        format!("the launchers' rendezvous at {}: {e}", self.endpoint)
    }

    fn has(&self, k: &str) -> Result<bool, String> {
        self.store.check(&[k]).map_err(|e| self.err(e))
    }

    fn text(&self, k: &str) -> Result<String, String> {
        self.store
            .get(k)
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .map_err(|e| self.err(e))
    }

    fn count(&self, k: &str) -> Result<usize, String> {
        let n = self.store.add(k, 0).map_err(|e| self.err(e))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Sets `k` to `v` unless it is set; the value it has after.
    fn first(&self, k: &str, v: &str) -> Result<String, String> {
        self.store
            .compare_set(k, b"", v.as_bytes())
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .map_err(|e| self.err(e))
    }

    fn job_failed(&self) -> Result<Option<String>, String> {
        if self.has("job/failed")? {
            return self.text("job/failed").map(Some);
        }
        Ok(None)
    }

    /// Marks the whole job failed (the other launchers stop their ranks and exit); best
    /// effort.
    pub(crate) fn fail_job(&self, why: &str) {
        if !self.lost {
            let _ = self.first("job/failed", why);
        }
    }

    /// The value of `k`, polling until it is set (a launcher writes it right after another
    /// step).
    fn await_text(&self, k: &str, interrupted: &AtomicBool) -> Result<String, String> {
        let deadline = Instant::now() + self.cfg.timeout;
        loop {
            if self.has(k)? {
                return self.text(k);
            }
            if let Some(m) = self.job_failed()? {
                return Err(m);
            }
            if interrupted.load(Ordering::SeqCst) {
                return Err("interrupted while joining a round".into());
            }
            if Instant::now() >= deadline {
                return Err(self.err(format!(
                    "{k} was not set within {:?} (did a launcher die?)",
                    self.cfg.timeout
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Asked about every 150 ms while the local group runs: whether another launcher started
    /// a new round (this node enters it before its children are stopped), a node waits to
    /// join an elastic job with room (this launcher opens a membership round), or the job
    /// failed. A store that stops answering is reported once; the group then runs on without
    /// restarts.
    pub(crate) fn watch(&mut self) -> Option<Event> {
        if self.lost {
            return None;
        }
        match self.poll() {
            Ok(e) => e,
            Err(e) => {
                eprintln!(
                    "tensorplay-run: {e}; this node's ranks keep running, but the job can no longer restart (the launcher hosting the store must stay alive)"
                );
                self.lost = true;
                None
            }
        }
    }

    fn poll(&mut self) -> Result<Option<Event>, String> {
        let r = self.round;
        if let Some(m) = self.job_failed()? {
            return Ok(Some(Event::JobFailed(m)));
        }
        if self.has(&key(r + 1, "open"))? {
            let (why, restarts, by) = self.opened(r + 1)?;
            self.enter(r + 1)?;
            let what = match why.as_str() {
                "failure" => format!(
                    "{by}'s ranks failed in round {r}: restarting with round {} (restart {restarts} of {})",
                    r + 1,
                    self.cfg.max_restarts
                ),
                _ => format!(
                    "{by} opened round {} for a node that joins (a membership change, not counted as a restart)",
                    r + 1
                ),
            };
            return Ok(Some(Event::NewRound(format!(
                "{what}; stopping this node's ranks"
            ))));
        }
        let n = self.current.as_ref().map_or(self.cfg.max, |c| c.nnodes);
        // (not once a node finished: the job is ending)
        if self.cfg.elastic
            && n < self.cfg.max
            && self.count(&key(r, "waiting"))? > 0
            && self.count(&key(r, "ok"))? == 0
        {
            let restarts = self.current.as_ref().map_or(0, |c| c.restarts);
            self.first(
                &key(r + 1, "open"),
                &format!("membership {restarts} {}", self.me),
            )?;
            self.enter(r + 1)?;
            return Ok(Some(Event::NewRound(format!(
                "a node waits to join ({n} of at most {} nodes): round {} (a membership change, not counted as a restart); stopping this node's ranks",
                self.cfg.max,
                r + 1
            ))));
        }
        Ok(None)
    }

    /// After the local group failed with `summary`: records it, then enters the next round
    /// (opened by another launcher already, or now when restarts are left), or fails the job.
    ///
    /// # Errors
    /// When the store fails.
    pub(crate) fn after_failure(&mut self, summary: &str) -> Result<After, String> {
        if self.lost {
            return Err("no restart: the launchers' store does not answer".into());
        }
        let r = self.round;
        let cur = self
            .current
            .clone()
            .ok_or_else(|| self.err("failure outside a round"))?;
        self.store
            .set(
                &key(r, &format!("fail/{}", cur.node_rank)),
                summary.as_bytes(),
            )
            .map_err(|e| self.err(e))?;
        if !self.has(&key(r + 1, "open"))? {
            if cur.restarts >= self.cfg.max_restarts {
                let why = format!(
                    "node {} ({}) failed in round {r} and no restarts are left (--max-restarts {}): {summary}",
                    cur.node_rank, self.me, self.cfg.max_restarts
                );
                self.fail_job(&why);
                return Ok(After::Exhausted);
            }
            self.first(
                &key(r + 1, "open"),
                &format!(
                    "failure {} node {} ({})",
                    cur.restarts + 1,
                    cur.node_rank,
                    self.me
                ),
            )?;
        }
        let (why, restarts, by) = self.opened(r + 1)?;
        self.enter(r + 1)?;
        Ok(After::Next(why == "failure", restarts, by))
    }

    /// After the local group succeeded: waits for every node of the round to succeed too (the
    /// store's host then stays a little longer, so the others can see it). A new round
    /// (another node failed) is entered instead.
    ///
    /// # Errors
    /// When the job failed elsewhere.
    pub(crate) fn finish(&mut self) -> Result<Finish, String> {
        let r = self.round;
        let n = self.current.as_ref().map_or(1, |c| c.nnodes);
        if self.lost {
            return Ok(Finish::Done(None));
        }
        let gone = |e: String| Finish::Done(Some(format!("{e}: leaving")));
        if let Err(e) = self.store.add(&key(r, "ok"), 1) {
            return Ok(gone(self.err(e)));
        }
        let deadline = Instant::now() + self.cfg.timeout;
        loop {
            match self.job_failed() {
                Ok(Some(m)) => return Err(m),
                Ok(None) => {}
                Err(e) => return Ok(gone(e)),
            }
            let ok = match self.count(&key(r, "ok")) {
                Ok(k) => k,
                Err(e) => return Ok(gone(e)),
            };
            if ok >= n {
                let _ = self.store.add(&key(r, "left"), 1);
                // a launcher waiting for room (the store's host, maybe) stops waiting
                let _ = self.store.set("job/done", b"1");
                if self.host {
                    let linger = Instant::now() + HOST_LINGER;
                    while Instant::now() < linger
                        && self.count(&key(r, "left")).is_ok_and(|l| l < n)
                    {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    if self.count(&key(r, "waiting")).is_ok_and(|w| w > 0) {
                        // a waiting launcher polls every 100 ms: let it see `job/done`
                        std::thread::sleep(3 * POLL);
                    }
                }
                return Ok(Finish::Done(None));
            }
            match self.has(&key(r + 1, "open")) {
                Ok(true) => {
                    let (_, restarts, by) = self.opened(r + 1)?;
                    self.enter(r + 1)?;
                    return Ok(Finish::Rejoin(format!(
                        "this node's ranks succeeded, but {by} opened round {} (restart {restarts} of {}): the job restarts",
                        r + 1,
                        self.cfg.max_restarts
                    )));
                }
                Ok(false) => {}
                Err(e) => return Ok(gone(e)),
            }
            if Instant::now() >= deadline {
                return Ok(Finish::Done(Some(format!(
                    "{ok} of {n} nodes reported success within {:?} (--rdzv-timeout): leaving",
                    self.cfg.timeout
                ))));
            }
            std::thread::sleep(POLL);
        }
    }

    /// Every failure of every round recorded in the store, one line each (`round R, node
    /// N: ...`); best effort.
    pub(crate) fn every_failure(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.lost {
            return out;
        }
        for r in 0..=self.round {
            let Ok(Some(m)) = self.members(r) else {
                continue;
            };
            let n = m.len();
            for node in 0..n {
                let k = key(r, &format!("fail/{node}"));
                if self.has(&k).unwrap_or(false)
                    && let Ok(line) = self.text(&k)
                {
                    out.push(format!("round {r}, node {node}: {line}"));
                }
            }
        }
        out
    }
}
