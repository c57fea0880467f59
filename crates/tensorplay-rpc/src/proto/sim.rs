//! The simulator: several workers' protocol tables in memory, with a network whose delivery
//! order proptest chooses (messages between two workers are not ordered). After every run,
//! once every handle is dropped and every message delivered, the invariants must hold.

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::context::{ContextId, ContextTable};

/// A message in flight.
#[derive(Debug, Clone)]
enum Msg {
    /// A request within `ctx` (which the callee may pass on `hops` more times).
    Request {
        from: usize,
        to: usize,
        ctx: ContextId,
        hops: usize,
    },
    /// Its response.
    Response { to: usize, ctx: ContextId },
    /// A context's cleanup.
    Cleanup { to: usize, ctx: ContextId },
}

impl Msg {
    fn to(&self) -> usize {
        match *self {
            Msg::Request { to, .. } | Msg::Response { to, .. } | Msg::Cleanup { to, .. } => to,
        }
    }
}

/// What a test run does, one step at a time.
#[derive(Debug, Clone)]
enum Step {
    /// Worker `w` opens a context (its guard is held).
    Open(usize),
    /// Worker `w` calls worker `to` inside its `k`-th open context; the callee calls on `hops`
    /// more times.
    Call {
        w: usize,
        k: usize,
        to: usize,
        hops: usize,
    },
    /// Worker `w` drops the guard of its `k`-th open context.
    Release { w: usize, k: usize },
    /// The network delivers message `i` (modulo the messages in flight).
    Deliver(usize),
}

fn step(n: usize) -> impl Strategy<Value = Step> {
    prop_oneof![
        1 => (0..n).prop_map(Step::Open),
        3 => (0..n, 0..4usize, 0..n, 0..3usize).prop_map(|(w, k, to, hops)| Step::Call { w, k, to, hops }),
        2 => (0..n, 0..4usize).prop_map(|(w, k)| Step::Release { w, k }),
        4 => any::<usize>().prop_map(Step::Deliver),
    ]
}

/// N workers' context tables and the network between them.
struct ContextSim {
    now: Instant,
    workers: Vec<ContextTable<()>>,
    /// Per worker: the guards it holds.
    guards: Vec<Vec<ContextId>>,
    /// Per worker: the contexts it released (a released context must never reopen).
    released: Vec<Vec<ContextId>>,
    net: Vec<Msg>,
    violations: Vec<String>,
}

impl ContextSim {
    fn new(n: usize) -> ContextSim {
        ContextSim {
            now: Instant::now(),
            workers: (0..n)
                .map(|w| ContextTable::new(w, Duration::from_secs(3600)))
                .collect(),
            guards: vec![Vec::new(); n],
            released: vec![Vec::new(); n],
            net: Vec::new(),
            violations: Vec::new(),
        }
    }

    fn release(&mut self, w: usize, ctx: ContextId) {
        for c in self.workers[w].release(ctx, self.now) {
            self.net.push(Msg::Cleanup {
                to: c.to,
                ctx: c.context,
            });
        }
        self.released[w].push(ctx);
    }

    fn call(&mut self, w: usize, to: usize, ctx: ContextId, hops: usize) {
        // a context released meanwhile is not sent on
        if self.workers[w].sent(ctx, to).is_some() {
            self.net.push(Msg::Request {
                from: w,
                to,
                ctx,
                hops,
            });
        }
    }

    fn run(&mut self, s: &Step) {
        let n = self.workers.len();
        match *s {
            Step::Open(w) => {
                let (id, ()) = self.workers[w].create();
                self.guards[w].push(id);
            }
            Step::Call { w, k, to, hops } => {
                if let Some(&ctx) = self.guards[w].get(k) {
                    self.call(w, to, ctx, hops);
                }
            }
            Step::Release { w, k } => {
                if k < self.guards[w].len() {
                    let ctx = self.guards[w].remove(k);
                    self.release(w, ctx);
                }
            }
            Step::Deliver(i) => {
                if self.net.is_empty() {
                    return;
                }
                let m = self.net.remove(i % self.net.len());
                let to = m.to();
                match m {
                    Msg::Request {
                        from, ctx, hops, ..
                    } => {
                        let opened = self.workers[to].received(ctx, true, self.now).is_some();
                        if opened && self.released[to].contains(&ctx) {
                            self.violations.push(format!(
                                "worker {to} reopened context {ctx:#x}, which it had released"
                            ));
                        }
                        if opened && hops > 0 {
                            self.call(to, (to + 1) % n, ctx, hops - 1);
                        }
                        self.net.push(Msg::Response { to: from, ctx });
                    }
                    Msg::Response { ctx, .. } => {
                        self.workers[to].received(ctx, false, self.now);
                    }
                    Msg::Cleanup { ctx, .. } => self.release(to, ctx),
                }
            }
        }
    }

    /// Drops every guard, then delivers every message in the order `order` picks.
    fn finish(&mut self, order: &[usize]) {
        for w in 0..self.workers.len() {
            for ctx in std::mem::take(&mut self.guards[w]) {
                self.release(w, ctx);
            }
        }
        let mut k = 0;
        while !self.net.is_empty() {
            let i = order.get(k % order.len().max(1)).copied().unwrap_or(0) + k;
            self.run(&Step::Deliver(i));
            k += 1;
        }
    }

    fn check(&self) -> Result<(), String> {
        if let Some(v) = self.violations.first() {
            return Err(v.clone());
        }
        for (w, t) in self.workers.iter().enumerate() {
            if t.len() != 0 {
                return Err(format!(
                    "worker {w} still has {} open context(s) after every guard was dropped and every message delivered",
                    t.len()
                ));
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// No context survives its release on any worker, and no released context is reopened,
    /// whatever the delivery order.
    #[test]
    fn contexts_are_released_everywhere_in_any_delivery_order(
        n in 2..5usize,
        steps in proptest::collection::vec(step(4), 0..40),
        order in proptest::collection::vec(0..8usize, 1..8),
    ) {
        let mut sim = ContextSim::new(n);
        for s in &steps {
            let s = match *s {
                Step::Open(w) => Step::Open(w % n),
                Step::Call { w, k, to, hops } => Step::Call { w: w % n, k, to: to % n, hops },
                Step::Release { w, k } => Step::Release { w: w % n, k },
                Step::Deliver(i) => Step::Deliver(i),
            };
            sim.run(&s);
        }
        sim.finish(&order);
        if let Err(e) = sim.check() {
            return Err(TestCaseError::fail(format!("{e}\nsteps: {steps:?}")));
        }
    }
}
