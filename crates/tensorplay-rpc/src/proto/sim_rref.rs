//! The simulator of the RRef protocol: N workers' owner tables in memory, users following the
//! shell's rules (a user deletes its fork once the owner confirmed it), and a network whose
//! delivery order proptest chooses. Every value reachable from a live handle must be present
//! after every step; once every handle is dropped and every message delivered, no owner entry
//! or fork may remain.

use proptest::prelude::*;

use super::owner::{GloballyUniqueId as Gid, OwnerTable};

#[derive(Debug, Clone)]
enum Msg {
    /// `remote()`: create `id` on `owner` for user fork `fork`.
    Remote {
        owner: usize,
        id: Gid,
        fork: Gid,
        value: u64,
    },
    /// The owner's answer to a `remote()` (to the user that holds `fork`).
    RemoteAck { fork: Gid },
    /// A user deletes its fork.
    UserDelete { owner: usize, id: Gid, fork: Gid },
    /// An owner handle passed to user `to` (registered early by the owner).
    Fork {
        to: usize,
        owner: usize,
        id: Gid,
        fork: Gid,
    },
    /// The result of a self-call whose function returned `RRef::new(v)`: an owner handle in
    /// a message from `w` to itself.
    SelfResult { w: usize, id: Gid },
}

#[derive(Debug, Clone)]
enum Handle {
    Owner {
        w: usize,
        id: Gid,
    },
    User {
        w: usize,
        owner: usize,
        id: Gid,
        fork: Gid,
        confirmed: bool,
        dropped: bool,
    },
}

#[derive(Debug, Clone)]
enum Step {
    /// Worker `a` calls `remote()` on worker `b`.
    Remote(usize, usize),
    /// Worker `w` makes an RRef with `RRef::new`.
    New(usize),
    /// Worker `w` calls a function on itself that returns `RRef::new(v)`.
    SelfCall(usize),
    /// The owner of handle `k` passes it to worker `to`.
    Pass(usize, usize),
    /// Handle `k` is dropped.
    Drop(usize),
    /// Message `i` is delivered.
    Deliver(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => (0..4usize, 0..4usize).prop_map(|(a, b)| Step::Remote(a, b)),
        1 => (0..4usize).prop_map(Step::New),
        2 => (0..4usize).prop_map(Step::SelfCall),
        2 => (0..16usize, 0..4usize).prop_map(|(k, to)| Step::Pass(k, to)),
        2 => (0..16usize).prop_map(Step::Drop),
        5 => any::<usize>().prop_map(Step::Deliver),
    ]
}

struct RRefSim {
    tables: Vec<OwnerTable<Option<u64>>>,
    handles: Vec<Option<Handle>>,
    net: Vec<Msg>,
    next: u64,
    violations: Vec<String>,
}

impl RRefSim {
    fn new(n: usize) -> RRefSim {
        RRefSim {
            tables: (0..n).map(|_| OwnerTable::default()).collect(),
            handles: Vec::new(),
            net: Vec::new(),
            next: 0,
            violations: Vec::new(),
        }
    }

    fn id(&mut self, w: usize) -> Gid {
        self.next += 1;
        Gid {
            created_on: w,
            local_id: self.next,
        }
    }

    /// Every value reachable from a live handle is present on its owner.
    fn check_reachable(&mut self, when: &str) {
        for h in self.handles.iter().flatten() {
            let (owner, id) = match *h {
                Handle::Owner { w, id } => (w, id),
                Handle::User {
                    owner,
                    id,
                    confirmed: true,
                    dropped: false,
                    ..
                } => (owner, id),
                Handle::User { .. } => continue,
            };
            if self.tables[owner].get(id).is_none_or(Option::is_none) {
                self.violations.push(format!(
                    "after {when}: {h:?} is live but its owner {owner} has no value for {id}"
                ));
            }
        }
    }

    fn drop_handle(&mut self, k: usize) {
        let Some(h) = self.handles.get_mut(k).and_then(Option::take) else {
            return;
        };
        match h {
            Handle::Owner { w, id } => self.tables[w].drop_local(id),
            Handle::User {
                owner,
                id,
                fork,
                confirmed: true,
                ..
            } => {
                self.net.push(Msg::UserDelete { owner, id, fork });
            }
            Handle::User {
                w,
                owner,
                id,
                fork,
                confirmed: false,
                ..
            } => {
                // deleted once confirmed, as the shell does
                self.handles[k] = Some(Handle::User {
                    w,
                    owner,
                    id,
                    fork,
                    confirmed: false,
                    dropped: true,
                });
            }
        }
    }

    fn run(&mut self, s: &Step) {
        let n = self.tables.len();
        match *s {
            Step::Remote(a, b) => {
                let (a, b) = (a % n, b % n);
                let id = self.id(a);
                if a == b {
                    // on itself: an owner handle, the value computed here
                    self.tables[a].add_local(id);
                    *self.tables[a].slot(id) = Some(id.local_id);
                    self.handles.push(Some(Handle::Owner { w: a, id }));
                } else {
                    let fork = self.id(a);
                    self.handles.push(Some(Handle::User {
                        w: a,
                        owner: b,
                        id,
                        fork,
                        confirmed: false,
                        dropped: false,
                    }));
                    self.net.push(Msg::Remote {
                        owner: b,
                        id,
                        fork,
                        value: id.local_id,
                    });
                }
            }
            Step::New(w) => {
                let w = w % n;
                let id = self.id(w);
                *self.tables[w].slot(id) = Some(id.local_id);
                self.tables[w].add_local(id);
                self.handles.push(Some(Handle::Owner { w, id }));
            }
            Step::SelfCall(w) => {
                let w = w % n;
                // the function runs: RRef::new(v) ...
                let id = self.id(w);
                *self.tables[w].slot(id) = Some(id.local_id);
                self.tables[w].add_local(id);
                // ... its result is encoded for this worker itself ...
                self.tables[w].sent_to_self(id);
                // ... and the function's handle is dropped before the caller decodes
                self.tables[w].drop_local(id);
                self.net.push(Msg::SelfResult { w, id });
            }
            Step::Pass(k, to) => {
                let to = to % n;
                if let Some(Some(Handle::Owner { w, id })) = self.handles.get(k).cloned()
                    && w != to
                {
                    {
                        let child = self.id(w);
                        self.tables[w].add_fork(id, child);
                        self.net.push(Msg::Fork {
                            to,
                            owner: w,
                            id,
                            fork: child,
                        });
                    }
                }
            }
            Step::Drop(k) => self.drop_handle(k),
            Step::Deliver(i) => {
                if self.net.is_empty() {
                    return;
                }
                let m = self.net.remove(i % self.net.len());
                match m {
                    Msg::Remote {
                        owner,
                        id,
                        fork,
                        value,
                    } => {
                        let t = &mut self.tables[owner];
                        t.add_fork(id, fork);
                        *t.slot(id) = Some(value);
                        t.release_if_unused(id);
                        self.net.push(Msg::RemoteAck { fork });
                    }
                    Msg::RemoteAck { fork, .. } => {
                        for k in 0..self.handles.len() {
                            if let Some(Handle::User {
                                w,
                                owner,
                                id,
                                fork: f,
                                dropped,
                                ..
                            }) = self.handles[k].clone()
                                && f == fork
                            {
                                {
                                    self.handles[k] = Some(Handle::User {
                                        w,
                                        owner,
                                        id,
                                        fork,
                                        confirmed: true,
                                        dropped,
                                    });
                                    if dropped {
                                        self.drop_handle(k);
                                    }
                                }
                            }
                        }
                    }
                    Msg::UserDelete { owner, id, fork } => self.tables[owner].remove_fork(id, fork),
                    Msg::Fork {
                        to,
                        owner,
                        id,
                        fork,
                    } => {
                        self.handles.push(Some(Handle::User {
                            w: to,
                            owner,
                            id,
                            fork,
                            confirmed: true,
                            dropped: false,
                        }));
                    }
                    Msg::SelfResult { w, id } => {
                        self.tables[w].add_local(id);
                        self.tables[w].arrived_from_self(id);
                        self.handles.push(Some(Handle::Owner { w, id }));
                    }
                }
            }
        }
        self.check_reachable(&format!("{s:?}"));
    }

    fn finish(&mut self, order: &[usize]) {
        let mut k = 0;
        loop {
            for h in 0..self.handles.len() {
                if matches!(
                    self.handles[h],
                    Some(Handle::Owner { .. } | Handle::User { dropped: false, .. })
                ) {
                    self.drop_handle(h);
                }
            }
            if self.net.is_empty() {
                break;
            }
            let i = order.get(k % order.len().max(1)).copied().unwrap_or(0) + k;
            self.run(&Step::Deliver(i));
            k += 1;
        }
    }

    fn check_empty(&self) -> Result<(), String> {
        if let Some(v) = self.violations.first() {
            return Err(v.clone());
        }
        for (w, t) in self.tables.iter().enumerate() {
            if t.counts() != (0, 0) {
                return Err(format!(
                    "worker {w} still owns {:?} (values, forks) after every handle was dropped and every message delivered",
                    t.counts()
                ));
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Values stay while reachable and go once unreachable, whatever the delivery order.
    #[test]
    fn rrefs_keep_reachable_values_and_leave_nothing_behind(
        n in 2..5usize,
        steps in proptest::collection::vec(step(), 0..40),
        order in proptest::collection::vec(0..8usize, 1..8),
    ) {
        let mut sim = RRefSim::new(n);
        for s in &steps {
            sim.run(s);
        }
        sim.finish(&order);
        if let Err(e) = sim.check_empty() {
            return Err(TestCaseError::fail(format!("{e}\nsteps: {steps:?}")));
        }
    }
}
