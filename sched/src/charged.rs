//! A dispatcher that takes time: the simulator's model of a scheduler's own computation.
//!
//! The simulator otherwise charges a scheduler nothing for deciding, so the reason both papers
//! partition a cluster — one dispatcher's work per request grows with the GPUs and models it
//! owns until it cannot keep up (Symphony's R_max, §4.7; Shepherd's scalability limit Ḡ, §4) —
//! cannot appear in it. [`Charged`] wraps a scheduler and measures the wall time of each of its
//! callbacks on this machine; the virtual clock then holds the dispatcher busy for that long
//! (times `scale`), and events that arrive meanwhile wait, in order, until it is free. A request
//! delivered late keeps its arrival time and deadline, so a dispatcher that falls behind shows
//! as requests served late or dropped, as on a real machine. A decision takes effect at the
//! moment its event is delivered and the time is charged after it (the dispatcher is then busy
//! for the next event): slightly optimistic for one decision, exact for the backlog.
//!
//! Each part of a partitioned cluster gets its own [`Charged`] — one dispatcher per part, each on
//! a core of its own, which is what the papers' deployments had and this 2-core VM's real-time
//! engine cannot give twenty dispatchers.
//!
//! **Not deterministic**: the charge is the host's measured time, so runs differ slightly; the
//! simulator is deterministic for a seed only without it (`goodput` without
//! `--charge-dispatch`). This module reads a clock on purpose: it is the driver's cost model,
//! not a scheduler.

use std::collections::VecDeque;
use std::time::Instant;

use crate::scheduler::{Decision, GpuId, Ms, Request, Scheduler};

/// An event waiting for the dispatcher.
#[derive(Debug, Clone, Copy)]
enum Waiting {
    Arrival(Request),
    GpuFree(GpuId),
}

/// A scheduler whose callbacks cost the virtual clock their measured wall time (module docs).
pub struct Charged {
    inner: Box<dyn Scheduler>,
    scale: f64,
    busy_until: Ms,
    waiting: VecDeque<Waiting>,
    charged_ms: f64,
}

impl Charged {
    /// Wraps `inner`; each callback's wall time × `scale` is charged (1.0: this machine's speed;
    /// 0.5: a dispatcher twice as fast).
    pub fn new(inner: Box<dyn Scheduler>, scale: f64) -> Charged {
        Charged {
            inner,
            scale: scale.max(0.0),
            busy_until: f64::NEG_INFINITY,
            waiting: VecDeque::new(),
            charged_ms: 0.0,
        }
    }

    /// The dispatcher's busy time so far, virtual ms.
    pub fn charged_ms(&self) -> f64 {
        self.charged_ms
    }

    fn charge(&mut self, now: Ms, call: impl FnOnce(&mut dyn Scheduler, &mut Vec<Decision>), out: &mut Vec<Decision>) {
        let t = Instant::now();
        call(self.inner.as_mut(), out);
        let took = t.elapsed().as_secs_f64() * 1e3 * self.scale;
        self.busy_until = now + took;
        self.charged_ms += took;
    }

    /// Delivers the waiting events, oldest first, while the dispatcher is free at `now`.
    fn deliver(&mut self, now: Ms, out: &mut Vec<Decision>) {
        while self.busy_until <= now {
            let Some(ev) = self.waiting.pop_front() else { return };
            match ev {
                Waiting::Arrival(r) => self.charge(now, |s, o| s.on_arrival(now, r, o), out),
                Waiting::GpuFree(g) => self.charge(now, |s, o| s.on_gpu_free(now, g, o), out),
            }
        }
    }
}

impl Scheduler for Charged {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn on_arrival(&mut self, now: Ms, req: Request, out: &mut Vec<Decision>) {
        self.waiting.push_back(Waiting::Arrival(req));
        self.deliver(now, out);
    }

    fn on_gpu_free(&mut self, now: Ms, gpu: GpuId, out: &mut Vec<Decision>) {
        self.waiting.push_back(Waiting::GpuFree(gpu));
        self.deliver(now, out);
    }

    fn on_timer(&mut self, now: Ms, out: &mut Vec<Decision>) {
        self.deliver(now, out);
        if self.busy_until <= now && self.inner.next_timer().is_some_and(|t| t <= now) {
            self.charge(now, |s, o| s.on_timer(now, o), out);
        }
    }

    fn next_timer(&self) -> Option<Ms> {
        let own = (!self.waiting.is_empty()).then_some(self.busy_until);
        let inner = self.inner.next_timer().map(|t| t.max(self.busy_until));
        match (own, inner) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn queued(&self) -> usize {
        self.inner.queued() + self.waiting.iter().filter(|w| matches!(w, Waiting::Arrival(_))).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test double: drops each request, spinning `work` of wall time first.
    struct Spin {
        work: std::time::Duration,
    }

    impl Scheduler for Spin {
        fn name(&self) -> &'static str {
            "spin"
        }
        fn on_arrival(&mut self, _: Ms, req: Request, out: &mut Vec<Decision>) {
            let t = Instant::now();
            while t.elapsed() < self.work {}
            out.push(Decision::Drop(req));
        }
        fn on_gpu_free(&mut self, _: Ms, _: GpuId, _: &mut Vec<Decision>) {}
        fn on_timer(&mut self, _: Ms, _: &mut Vec<Decision>) {}
        fn next_timer(&self) -> Option<Ms> {
            None
        }
        fn queued(&self) -> usize {
            0
        }
    }

    fn req(id: u64, at: Ms) -> Request {
        Request { id, model: 0, arrival: at, deadline: at + 100.0 }
    }

    #[test]
    fn events_wait_while_the_dispatcher_computes() {
        // Each decision spins 2 ms of wall time, charged ×10: 20 virtual ms busy per request.
        let mut c = Charged::new(Box::new(Spin { work: std::time::Duration::from_millis(2) }), 10.0);
        let mut out = Vec::new();
        c.on_arrival(0.0, req(0, 0.0), &mut out);
        assert_eq!(out.len(), 1, "an idle dispatcher decides at once");
        // Two more arrive while it is busy: they wait, and count as queued.
        c.on_arrival(1.0, req(1, 1.0), &mut out);
        c.on_arrival(2.0, req(2, 2.0), &mut out);
        assert_eq!((out.len(), c.queued()), (1, 2));
        let t1 = c.next_timer().unwrap();
        assert!(t1 >= 20.0, "busy until at least 20 ms: {t1}");
        c.on_timer(t1, &mut out);
        assert_eq!((out.len(), c.queued()), (2, 1), "one event per free moment");
        let t2 = c.next_timer().unwrap();
        assert!(t2 >= t1 + 20.0);
        c.on_timer(t2, &mut out);
        assert_eq!((out.len(), c.queued()), (3, 0));
        assert_eq!(c.next_timer(), None);
        assert!(c.charged_ms() >= 60.0, "{}", c.charged_ms());
        // The requests were delivered late but keep their arrival: the drops name them in order.
        let ids: Vec<u64> = out.iter().map(|d| if let Decision::Drop(r) = d { r.id } else { u64::MAX }).collect();
        assert_eq!(ids, vec![0, 1, 2]);
    }
}
