//! The simulator of the RRef protocol: N workers' owner and user tables in memory, handles
//! passed owner → user, user → user, user → owner and owner → itself, users fetching values
//! (and giving up on them), `remote`s whose creator times out before the owner answers, and a
//! network whose delivery order proptest chooses. Every value reachable from a live handle must
//! be present after every step, and an owner must never be asked to register a fork of a value
//! it already dropped; once every handle is dropped and every message delivered, no owner
//! entry, fork, pending user, pending child or waiting fetch may remain.

use std::collections::HashSet;

use proptest::prelude::*;

use super::message::{ForkRef, Message, Outgoing, Target, WaitLimit};
use super::owner::{GloballyUniqueId as Gid, OwnerTable};
use super::user::UserTable;

/// Something in flight.
#[derive(Debug, Clone)]
enum Net {
    /// A protocol message.
    Msg {
        from: usize,
        to: usize,
        msg: Message,
    },
    /// The owner's answer to a `Remote` or `ForkRequest`: fork `fork` on `to` is registered.
    Ack { to: usize, fork: Gid },
    /// The owner refused a `ForkRequest` (it does not own the value).
    Refused { to: usize, fork: Gid },
    /// An RRef in a call's argument or result, sent by `parent` to `to` as fork `child`.
    Carry {
        to: usize,
        owner: usize,
        id: Gid,
        child: Gid,
        parent: usize,
        parent_is_owner: bool,
    },
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
    /// The worker holding handle `k` passes it to worker `to`.
    Pass(usize, usize),
    /// Handle `k` is dropped.
    Drop(usize),
    /// The worker holding user handle `k` fetches its value (`to_here`); whether it waits for
    /// the answer or gives up (the creation failed, its own timeout) is up to the next steps:
    /// the handle may be dropped while the fetch is in flight.
    Fetch(usize),
    /// The `remote` that made user handle `k` times out before the owner answered: its creator
    /// takes the fork as registered (the owner may still create it) and deletes it when dropped.
    Expire(usize),
    /// Message `i` is delivered.
    Deliver(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => (0..4usize, 0..4usize).prop_map(|(a, b)| Step::Remote(a, b)),
        1 => (0..4usize).prop_map(Step::New),
        2 => (0..4usize).prop_map(Step::SelfCall),
        3 => (0..16usize, 0..4usize).prop_map(|(k, to)| Step::Pass(k, to)),
        2 => (0..16usize).prop_map(Step::Drop),
        2 => (0..16usize).prop_map(Step::Fetch),
        1 => (0..16usize).prop_map(Step::Expire),
        6 => any::<usize>().prop_map(Step::Deliver),
    ]
}

struct RRefSim {
    owners: Vec<OwnerTable<Option<u64>>>,
    users: Vec<UserTable>,
    handles: Vec<Option<Handle>>,
    net: Vec<Net>,
    /// Values whose creation was delivered (or made locally).
    created: HashSet<Gid>,
    /// User forks made by `remote()` (their creator may time out waiting for the owner).
    remote_forks: HashSet<Gid>,
    /// User forks whose `remote()` timed out: taken as registered before the owner answered.
    expired: HashSet<Gid>,
    /// Fetches waiting on their owner for a value: `(owner, id)`. A wait ends when the value
    /// is set or its entry goes (the shell's waiter then sees its channel closed).
    waiting: Vec<(usize, Gid)>,
    next: u64,
    violations: Vec<String>,
}

impl RRefSim {
    fn new(n: usize) -> RRefSim {
        RRefSim {
            owners: (0..n).map(|_| OwnerTable::default()).collect(),
            users: (0..n).map(UserTable::new).collect(),
            handles: Vec::new(),
            net: Vec::new(),
            created: HashSet::new(),
            remote_forks: HashSet::new(),
            expired: HashSet::new(),
            waiting: Vec::new(),
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

    fn send(&mut self, from: usize, out: Vec<Outgoing>) {
        for o in out {
            self.net.push(Net::Msg {
                from,
                to: o.to,
                msg: o.message,
            });
        }
    }

    fn set_value(&mut self, w: usize, id: Gid) {
        *self.owners[w].slot(id) = Some(id.local_id);
        self.created.insert(id);
    }

    /// Every value reachable from a live handle is present on its owner (or not created yet).
    fn check_reachable(&mut self, when: &str) {
        for h in self.handles.iter().flatten() {
            let (owner, id) = match *h {
                Handle::Owner { w, id } => (w, id),
                Handle::User {
                    w, owner, id, fork, ..
                } if self.users[w].is_confirmed(fork) => (owner, id),
                Handle::User { .. } => continue,
            };
            let present = match self.owners[owner].get(id) {
                // a timed-out `remote` whose creation has not arrived yet
                None => {
                    matches!(*h, Handle::User { fork, .. } if self.expired.contains(&fork))
                        && !self.created.contains(&id)
                }
                Some(v) => v.is_some() || !self.created.contains(&id),
            };
            if !present {
                self.violations.push(format!(
                    "after {when}: {h:?} is live but its owner {owner} has no value for {id}"
                ));
            }
        }
    }

    /// The worker holding user handle `k` sends a fetch of its value.
    fn fetch(&mut self, k: usize) {
        let Some(Some(Handle::User { w, owner, id, fork })) = self.handles.get(k).cloned() else {
            return;
        };
        self.users[w].value_request(fork);
        self.net.push(Net::Msg {
            from: w,
            to: owner,
            msg: Message::Fetch {
                rref: ForkRef::new(owner, id, fork),
                timeout: WaitLimit::new(None),
            },
        });
    }

    /// Ends the fetches whose value was set or whose entry went, releasing the entry as the
    /// shell does after a wait.
    fn end_waits(&mut self) {
        let mut i = 0;
        while i < self.waiting.len() {
            let (w, id) = self.waiting[i];
            match self.owners[w].get(id) {
                Some(None) => i += 1,
                _ => {
                    self.waiting.swap_remove(i);
                    let _ = self.owners[w].release_if_unused(id);
                }
            }
        }
    }

    fn drop_handle(&mut self, k: usize) {
        let Some(h) = self.handles.get_mut(k).and_then(Option::take) else {
            return;
        };
        match h {
            Handle::Owner { w, id } => {
                let _ = self.owners[w].drop_local(id);
            }
            Handle::User { w, fork, .. } => {
                let out = self.users[w].dropped(fork);
                self.send(w, out);
            }
        }
    }

    fn pass(&mut self, k: usize, to: usize) {
        let Some(Some(h)) = self.handles.get(k).cloned() else {
            return;
        };
        match h {
            Handle::Owner { w, id } => {
                let child = self.id(w);
                if to == w {
                    self.owners[w].sent_to_self(id);
                } else {
                    // early fork registration by the owner
                    self.owners[w].add_fork(id, child);
                }
                self.net.push(Net::Carry {
                    to,
                    owner: w,
                    id,
                    child,
                    parent: w,
                    parent_is_owner: true,
                });
            }
            Handle::User { w, owner, id, fork } => {
                let child = self.id(w);
                self.users[w].forked(fork, child);
                self.net.push(Net::Carry {
                    to,
                    owner,
                    id,
                    child,
                    parent: w,
                    parent_is_owner: false,
                });
            }
        }
    }

    fn deliver(&mut self, n: Net) {
        match n {
            Net::Carry {
                to,
                owner,
                id,
                child,
                parent,
                parent_is_owner,
            } => {
                if to == owner {
                    // the owner resolves to its own value
                    self.owners[to].add_local(id);
                    self.handles.push(Some(Handle::Owner { w: to, id }));
                    if parent_is_owner {
                        let _ = self.owners[to].arrived_from_self(id);
                    } else if parent == to {
                        let out = self.users[to].child_accepted(child);
                        self.send(to, out);
                    } else {
                        self.net.push(Net::Msg {
                            from: to,
                            to: parent,
                            msg: Message::ChildAccept {
                                child: child.into(),
                            },
                        });
                    }
                    return;
                }
                let out = self.users[to].received(owner, id, child, parent, parent_is_owner);
                self.send(to, out);
                self.handles.push(Some(Handle::User {
                    w: to,
                    owner,
                    id,
                    fork: child,
                }));
            }
            Net::Ack { to, fork } => {
                let out = self.users[to].confirmed(fork, true);
                self.send(to, out);
            }
            Net::Refused { to, fork } => {
                let out = self.users[to].confirmed(fork, false);
                self.send(to, out);
            }
            Net::Msg { from, to, msg } => match msg {
                Message::Remote { rref, .. } => {
                    let (id, fork) = (rref.rref_id(), rref.fork_id());
                    self.owners[to].add_fork(id, fork);
                    self.set_value(to, id);
                    let _ = self.owners[to].release_if_unused(id);
                    self.net.push(Net::Ack { to: from, fork });
                }
                Message::ForkRequest { rref, .. } => {
                    let (id, fork) = (rref.rref_id(), rref.fork_id());
                    if self.created.contains(&id) && self.owners[to].get(id).is_none() {
                        self.violations.push(format!(
                            "worker {to} was asked to register fork {fork} of {id}, whose value it already dropped"
                        ));
                    }
                    if self.owners[to].request_fork(id, fork, to) {
                        self.net.push(Net::Ack { to: from, fork });
                    } else {
                        self.net.push(Net::Refused { to: from, fork });
                    }
                }
                Message::Fetch { rref, .. } => {
                    // the shell's `value()`: the entry (made empty when missing: the creation
                    // may not have arrived yet) and a wait for its value; a fetch overtaken by
                    // its fork's deletion is answered at once
                    let (id, fork) = (rref.rref_id(), rref.fork_id());
                    if self.owners[to].value_request(id, fork) {
                        let _ = self.owners[to].slot(id);
                        self.waiting.push((to, id));
                    }
                }
                Message::UserDelete { rref, requests } => {
                    let _ = self.owners[to].remove_fork(rref.rref_id(), rref.fork_id(), requests);
                }
                Message::ChildAccept { child } => {
                    let out = self.users[to].child_accepted(child.into());
                    self.send(to, out);
                }
                other => self
                    .violations
                    .push(format!("unexpected message {}", other.name())),
            },
        }
    }

    fn run(&mut self, s: &Step) {
        let n = self.owners.len();
        match *s {
            Step::Remote(a, b) => {
                let (a, b) = (a % n, b % n);
                let id = self.id(a);
                if a == b {
                    // on itself: an owner handle, the value computed here
                    self.owners[a].add_local(id);
                    self.set_value(a, id);
                    self.handles.push(Some(Handle::Owner { w: a, id }));
                } else {
                    let fork = self.id(a);
                    self.users[a].created(b, id, fork);
                    self.remote_forks.insert(fork);
                    self.handles.push(Some(Handle::User {
                        w: a,
                        owner: b,
                        id,
                        fork,
                    }));
                    self.net.push(Net::Msg {
                        from: a,
                        to: b,
                        msg: Message::Remote {
                            call: Target {
                                func: "f".into(),
                                sig: String::new(),
                            },
                            rref: ForkRef::new(b, id, fork),
                        },
                    });
                }
            }
            Step::New(w) => {
                let w = w % n;
                let id = self.id(w);
                self.set_value(w, id);
                self.owners[w].add_local(id);
                self.handles.push(Some(Handle::Owner { w, id }));
            }
            Step::SelfCall(w) => {
                let w = w % n;
                // the function runs: RRef::new(v) ...
                let id = self.id(w);
                self.set_value(w, id);
                self.owners[w].add_local(id);
                let k = self.handles.len();
                self.handles.push(Some(Handle::Owner { w, id }));
                // ... its result is encoded for this worker itself ...
                self.pass(k, w);
                // ... and the function's handle is dropped before the caller decodes
                self.drop_handle(k);
            }
            Step::Pass(k, to) => self.pass(k, to % n),
            Step::Drop(k) => self.drop_handle(k),
            Step::Fetch(k) => self.fetch(k),
            Step::Expire(k) => {
                if let Some(Some(Handle::User { w, fork, .. })) = self.handles.get(k).cloned()
                    && self.remote_forks.contains(&fork)
                    && !self.users[w].is_confirmed(fork)
                {
                    self.expired.insert(fork);
                    let out = self.users[w].confirmed(fork, true);
                    self.send(w, out);
                }
            }
            Step::Deliver(i) => {
                if self.net.is_empty() {
                    return;
                }
                let m = self.net.remove(i % self.net.len());
                self.deliver(m);
            }
        }
        self.end_waits();
        self.check_reachable(&format!("{s:?}"));
    }

    /// Whether worker `w` waits for nothing: it holds no user fork or pending child, and no
    /// request of its own (a message it sent, a call carrying an RRef, a fork request whose
    /// answer is on its way) is in flight. A graceful shutdown's barrier passes once every
    /// worker is flushed, and the workers leave.
    fn flushed(&self, w: usize) -> bool {
        self.users[w].is_empty()
            && !self.net.iter().any(|m| match *m {
                Net::Msg { from, .. } => from == w,
                Net::Ack { to, .. } | Net::Refused { to, .. } => to == w,
                Net::Carry { parent, .. } => parent == w,
            })
    }

    /// A graceful shutdown: every handle dropped, messages delivered in `order`'s order until
    /// every worker is flushed; then nothing may still be in flight to a worker that left.
    fn finish(&mut self, order: &[usize]) {
        let mut k = 0;
        loop {
            for h in 0..self.handles.len() {
                self.drop_handle(h);
            }
            if (0..self.users.len()).all(|w| self.flushed(w)) {
                if let Some(m) = self.net.first() {
                    self.violations.push(format!(
                        "{m:?} is in flight after every worker passed the shutdown barrier and left"
                    ));
                }
                break;
            }
            if self.net.is_empty() {
                // a worker waits for something that will never come: check_empty names it
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
        if let Some((w, id)) = self.waiting.first() {
            return Err(format!(
                "worker {w} keeps an entry for {id} for a fetch that no value or deletion will end (only its timeout)"
            ));
        }
        for (w, t) in self.owners.iter().enumerate() {
            if t.counts() != (0, 0) {
                return Err(format!(
                    "worker {w} still owns {:?} (values, forks) after every handle was dropped and every message delivered",
                    t.counts()
                ));
            }
            if t.remembered() != (0, 0) {
                return Err(format!(
                    "worker {w} still remembers {:?} (deletions waiting for messages of their fork, forks with counted requests) after every message was delivered",
                    t.remembered()
                ));
            }
        }
        for (w, t) in self.users.iter().enumerate() {
            if !t.is_empty() {
                return Err(format!(
                    "worker {w} still holds user forks or pending children {t:?} after every handle was dropped and every message delivered"
                ));
            }
        }
        Ok(())
    }
}

fn run_case(n: usize, steps: &[Step], order: &[usize]) -> Result<(), String> {
    let mut sim = RRefSim::new(n);
    for s in steps {
        sim.run(s);
    }
    sim.finish(order);
    sim.check_empty()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// Values stay while reachable and go once unreachable, whatever the delivery order.
    #[test]
    fn rrefs_keep_reachable_values_and_leave_nothing_behind(
        n in 2..5usize,
        steps in proptest::collection::vec(step(), 0..48),
        order in proptest::collection::vec(0..8usize, 1..8),
    ) {
        if let Err(e) = run_case(n, &steps, &order) {
            return Err(TestCaseError::fail(format!("{e}\nsteps: {steps:?}")));
        }
    }
}

/// The minimal case the simulator found for the self-call bug (a function on worker 0 called
/// by worker 0 returns `RRef::new(v)`), kept as a regression seed.
#[test]
fn a_self_call_returning_a_new_rref_keeps_its_value() {
    run_case(2, &[Step::SelfCall(0)], &[0]).unwrap();
}

/// A user passes its RRef on to another user and drops it before the child is confirmed:
/// the owner must keep the value until the child's fork is registered.
#[test]
fn a_user_to_user_fork_outlives_its_dropped_parent() {
    let steps = [
        Step::Remote(0, 1), // worker 0 holds a user fork of a value on worker 1
        Step::Deliver(0),   // the creation arrives; its ack is in flight
        Step::Deliver(0),   // worker 0's fork is confirmed
        Step::Pass(0, 2),   // worker 0 passes it to worker 2
        Step::Drop(0),      // and drops its own at once
        Step::Deliver(0),   // worker 2 receives it and asks the owner
        Step::Deliver(0),   // the fork request arrives
    ];
    run_case(3, &steps, &[0]).unwrap();
}

/// The leak seen under load (`failures::world3_errors_and_timeouts`): a user fetches the value
/// of a `remote` that then times out, gives up and drops its RRef; on the owner the deletion
/// is served before the fetch (another stream), so the fetch finds no entry and makes an
/// empty one that nothing fills or deletes any more: it stays until the fetch's own timeout.
/// Both orders of the creation and the deletion, and the same without a timeout (a user that
/// gives up on its fetch, e.g. after the creation's error came back).
#[test]
fn a_fetch_overtaken_by_its_forks_deletion_leaves_no_entry() {
    use Step::{Deliver, Drop, Expire, Fetch, Remote};
    let cases: [(&str, Vec<Step>); 3] = [
        (
            "created, deleted, then fetched",
            vec![
                Remote(0, 1), // net: [remote]
                Fetch(0),     // net: [remote, fetch]
                Expire(0),    // the creation times out on worker 0
                Drop(0),      // net: [remote, fetch, delete]
                Deliver(0),   // the creation; net: [fetch, delete, ack]
                Deliver(1),   // the deletion overtakes the fetch
                Deliver(0),   // the fetch
                Deliver(0),   // the ack, after the timeout: ignored
            ],
        ),
        (
            "deleted, created, then fetched",
            vec![
                Remote(0, 1),
                Fetch(0),
                Expire(0),
                Drop(0),
                Deliver(2), // the deletion first
                Deliver(0), // the creation, which finds the deletion
                Deliver(1), // its ack
                Deliver(0), // the fetch
            ],
        ),
        (
            "confirmed, fetch abandoned, deleted, then fetched",
            vec![
                Remote(0, 1),
                Fetch(0),   // net: [remote, fetch]
                Deliver(0), // the creation; net: [fetch, ack]
                Deliver(1), // worker 0's fork is confirmed
                Drop(0),    // it gives up on the fetch; net: [fetch, delete]
                Deliver(1), // the deletion
                Deliver(0), // the fetch
            ],
        ),
    ];
    let failed: Vec<String> = cases
        .iter()
        .filter_map(|(name, steps)| {
            run_case(2, steps, &[0])
                .err()
                .map(|e| format!("{name}: {e}"))
        })
        .collect();
    assert!(failed.is_empty(), "{failed:#?}");
}
