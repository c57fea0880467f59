//! Joining rounds: entering the newest round, closing it (MAX launchers, or MIN and the last
//! call), and placing this node in it (node ranks, the children's master).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use tensorplay_collectives::store::Store;

use super::{Joined, Launchers, POLL, Round, key};

/// A launcher that entered a round (the `slot/<i>` key).
#[derive(Debug)]
struct Slot {
    /// Its join index.
    index: usize,
    /// Whether it hosts the store.
    host: bool,
    /// Its `--node-rank` (fixed membership).
    fixed: Option<usize>,
    /// `hostname:pid`.
    name: String,
}

impl Launchers {
    /// Enters round `r` (the launcher's slot is taken; the round may not have closed yet).
    pub(super) fn enter(&mut self, r: u64) -> Result<(), String> {
        let n = self
            .store
            .add(&key(r, "joined"), 1)
            .map_err(|e| self.err(e))?;
        let idx = usize::try_from(n - 1).map_err(|_| self.err("bad join counter"))?;
        let fixed = self
            .cfg
            .fixed_rank
            .map_or_else(|| "-".to_string(), |r| r.to_string());
        let v = format!("{} {fixed} {} {}", u8::from(self.host), self.addr, self.me);
        self.store
            .set(&key(r, &format!("slot/{idx}")), v.as_bytes())
            .map_err(|e| self.err(e))?;
        self.round = r;
        self.slot = idx;
        self.current = None;
        Ok(())
    }

    /// Enters the newest round (round 0 is opened by whoever comes first).
    ///
    /// # Errors
    /// When the store fails or the job failed already.
    pub(crate) fn start(&mut self) -> Result<(), String> {
        if let Some(m) = self.job_failed()? {
            return Err(m);
        }
        // launchers with other flags would give ranks that clash or never exist
        let shape = self.first("job/shape", &self.cfg.shape)?;
        if shape != self.cfg.shape {
            return Err(format!(
                "this launcher ({}) was started with `{}`, the job's launchers with `{shape}`: \
                 every node of a job needs the same --nnodes, --nproc-per-node and --max-restarts",
                self.me, self.cfg.shape
            ));
        }
        self.first(&key(0, "open"), &format!("start 0 {}", self.me))?;
        let mut r = 0;
        while self.has(&key(r + 1, "open"))? {
            r += 1;
        }
        self.enter(r)
    }

    /// `open`'s value of round `r`: (why, restarts, by).
    pub(super) fn opened(&self, r: u64) -> Result<(String, usize, String), String> {
        let v = self.text(&key(r, "open"))?;
        let mut it = v.splitn(3, ' ');
        let why = it.next().unwrap_or("").to_string();
        let restarts = it.next().and_then(|k| k.parse().ok()).unwrap_or(0);
        Ok((why, restarts, it.next().unwrap_or("").to_string()))
    }

    /// The `i`-th launcher to enter round `r`.
    fn slot(&self, r: u64, i: usize, interrupted: &AtomicBool) -> Result<Slot, String> {
        let v = self.await_text(&key(r, &format!("slot/{i}")), interrupted)?;
        let mut it = v.splitn(4, ' ');
        Ok(Slot {
            index: i,
            host: it.next() == Some("1"),
            fixed: it.next().and_then(|f| f.parse::<usize>().ok()),
            // (then its address, for a person reading the store)
            name: it.nth(1).unwrap_or("").to_string(),
        })
    }

    /// Closes round `r` with `count` launchers in it (unless another launcher closed it
    /// first): the store's host and then the first to enter, at most MAX.
    fn close(&self, r: u64, count: usize, interrupted: &AtomicBool) -> Result<(), String> {
        let mut slots = (0..count)
            .map(|i| self.slot(r, i, interrupted))
            .collect::<Result<Vec<_>, _>>()?;
        slots.sort_by_key(|s| (!s.host, s.index));
        let mut members: Vec<usize> = slots.iter().take(self.cfg.max).map(|s| s.index).collect();
        members.sort_unstable();
        let v = members
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",");
        self.first(&key(r, "closed"), &v).map(drop)
    }

    /// The join indices taking part in round `r`, once it closed (`Err`: why it failed to).
    pub(super) fn members(&self, r: u64) -> Result<Option<Vec<usize>>, String> {
        let k = key(r, "closed");
        if !self.has(&k)? {
            return Ok(None);
        }
        let v = self.text(&k)?;
        v.split(',')
            .map(|i| i.parse::<usize>().ok())
            .collect::<Option<Vec<_>>>()
            .map(Some)
            .ok_or(v)
    }

    /// Waits until the round entered last closes, then places this node in it; a launcher
    /// that is not in it waits for the next round and enters it.
    ///
    /// # Errors
    /// When fewer than MIN launchers joined within `--rdzv-timeout`, no round had room for
    /// this launcher within it, the job failed, node ranks clash, or the store fails.
    pub(crate) fn await_close(&mut self, interrupted: &AtomicBool) -> Result<Joined, String> {
        let mut deadline = Instant::now() + self.cfg.timeout;
        let mut min_at: Option<Instant> = None;
        let mut waiting = false;
        loop {
            if interrupted.load(Ordering::SeqCst) {
                return Ok(Joined::Interrupted);
            }
            if let Some(m) = self.job_failed()? {
                return Err(m);
            }
            let r = self.round;
            if waiting {
                if self.has(&key(r + 1, "open"))? {
                    self.enter(r + 1)?;
                    (waiting, min_at) = (false, None);
                    deadline = Instant::now() + self.cfg.timeout;
                } else if self.has("job/done")? {
                    return Ok(Joined::JobDone);
                } else if !self.host && Instant::now() >= deadline {
                    // (the store's host waits on: it must outlive the job)
                    return Err(format!(
                        "no round with room for this node opened within {:?} (--rdzv-timeout): the job has its {} nodes (--nnodes)",
                        self.cfg.timeout, self.cfg.max
                    ));
                } else {
                    std::thread::sleep(POLL);
                }
                continue;
            }
            match self.members(r) {
                Ok(Some(m)) if m.contains(&self.slot) => {
                    return self.place(&m, interrupted).map(Joined::Round);
                }
                Ok(Some(m)) => {
                    // not in this round: wait for the next (a running elastic job with room
                    // opens one as soon as it sees this)
                    self.store
                        .add(&key(r, "waiting"), 1)
                        .map_err(|e| self.err(e))?;
                    eprintln!(
                        "tensorplay-run: round {r} started with {} node(s) without this one: waiting for the next round",
                        m.len()
                    );
                    waiting = true;
                    deadline = Instant::now() + self.cfg.timeout;
                    continue;
                }
                Ok(None) => {}
                Err(why) => return Err(why),
            }
            let count = self.count(&key(r, "joined"))?;
            let (min, max) = (self.cfg.min, self.cfg.max);
            if count >= max {
                self.close(r, count, interrupted)?;
                continue;
            }
            if count >= min {
                let t = *min_at.get_or_insert_with(Instant::now);
                if t.elapsed() >= self.cfg.last_call {
                    self.close(r, count, interrupted)?;
                    continue;
                }
            }
            if Instant::now() >= deadline {
                let why = format!(
                    "only {count} node(s) joined round {r} within {:?} (--rdzv-timeout), at least {min} needed (--nnodes)",
                    self.cfg.timeout
                );
                // whoever closes first decides: a round that just reached MIN goes on
                self.first(&key(r, "closed"), &why)?;
                continue;
            }
            std::thread::sleep(POLL);
        }
    }

    /// Node ranks and the children's master in the round that closed with the launchers
    /// `members` (join indices).
    fn place(&mut self, members: &[usize], interrupted: &AtomicBool) -> Result<Round, String> {
        let r = self.round;
        let n = members.len();
        let mut slots = members
            .iter()
            .map(|&i| self.slot(r, i, interrupted))
            .collect::<Result<Vec<_>, _>>()?;
        let node_rank = if self.cfg.elastic {
            slots.sort_by_key(|s| (!s.host, s.index));
            slots.iter().position(|s| s.index == self.slot)
        } else {
            let mut seen = vec![None::<&str>; n];
            for s in &slots {
                let why = match s.fixed {
                    Some(k) if k < n => seen[k].replace(s.name.as_str()).map(|other| {
                        format!("launchers {other} and {} both have --node-rank {k}", s.name)
                    }),
                    Some(k) => Some(format!(
                        "launcher {} has --node-rank {k}, outside 0..{n} (--nnodes)",
                        s.name
                    )),
                    None => Some(format!("launcher {} has no --node-rank", s.name)),
                };
                if let Some(why) = why {
                    let why = format!("round {r}: {why}: start one launcher per node rank");
                    self.fail_job(&why);
                    return Err(why);
                }
            }
            self.cfg.fixed_rank
        }
        .ok_or_else(|| self.err("this launcher is missing from its round"))?;
        if node_rank == 0 {
            // node 0's ranks host the children's store: a port free on this machine
            let port = tensorplay_collectives::rendezvous::free_port()
                .map_err(|e| format!("finding a free port for round {r}: {e}"))?;
            self.store
                .set(
                    &key(r, "master"),
                    format!("{port} {}", self.addr).as_bytes(),
                )
                .map_err(|e| self.err(e))?;
        }
        let m = self.await_text(&key(r, "master"), interrupted)?;
        let (port, addr) = m
            .split_once(' ')
            .and_then(|(p, a)| Some((p.parse::<u16>().ok()?, a.to_string())))
            .ok_or_else(|| self.err(format!("bad master {m:?} for round {r}")))?;
        let (_, restarts, _) = self.opened(r)?;
        let round = Round {
            round: r,
            nnodes: n,
            node_rank,
            master_addr: addr,
            master_port: port,
            restarts,
        };
        self.current = Some(round.clone());
        Ok(round)
    }
}
