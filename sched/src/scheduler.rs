//! The interface every scheduler implements, shared by the simulator and the real-time engine.
//!
//! A scheduler is sans-IO: it never reads a clock or sleeps. The driver tells it the time with
//! every event (a request arrived, a GPU became free, a timer it asked for is due) and carries out
//! the [`Decision`]s it returns: run a batch on a GPU at a given time, drop a request that can no
//! longer meet its deadline, or preempt a GPU's running batch.

/// Milliseconds since the start of the run.
pub type Ms = f64;
/// A GPU's index.
pub type GpuId = usize;
/// A model's index in the scenario.
pub type ModelId = usize;

/// One inference request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    /// Unique id.
    pub id: u64,
    /// The model it queries.
    pub model: ModelId,
    /// When the scheduler received it.
    pub arrival: Ms,
    /// When it must be complete (arrival + the model's SLO).
    pub deadline: Ms,
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Run `requests` (all of `model`) as one batch on `gpu`, starting at `start` (≥ now).
    Dispatch {
        /// The GPU.
        gpu: GpuId,
        /// The model.
        model: ModelId,
        /// The batch.
        requests: Vec<Request>,
        /// When execution starts (after the control and data delays).
        start: Ms,
    },
    /// The request cannot meet its deadline: report it dropped to its sender.
    Drop(Request),
    /// Abort the batch running on `gpu`; the scheduler has taken its requests back.
    Preempt {
        /// The GPU.
        gpu: GpuId,
    },
}

/// A batching scheduler.
pub trait Scheduler {
    /// Its name (`symphony`, `flex`, …).
    fn name(&self) -> &'static str;
    /// A request arrived at `now`.
    fn on_arrival(&mut self, now: Ms, req: Request, out: &mut Vec<Decision>);
    /// `gpu` finished its batch at `now` (GPUs start free; the scheduler knows them from its
    /// construction).
    fn on_gpu_free(&mut self, now: Ms, gpu: GpuId, out: &mut Vec<Decision>);
    /// The time asked for by [`next_timer`](Self::next_timer) has come.
    fn on_timer(&mut self, now: Ms, out: &mut Vec<Decision>);
    /// When the scheduler next wants [`on_timer`](Self::on_timer), if ever.
    fn next_timer(&self) -> Option<Ms>;
    /// Requests it still holds (queued, not dispatched or dropped).
    fn queued(&self) -> usize;
}

/// The schedulers [`Scenario::scheduler`](crate::Scenario::scheduler) makes by name.
pub const SCHEDULERS: [&str; 7] =
    ["symphony", "symphony-wc", "clockwork", "clockwork-real", "nexus", "flex", "flex-np"];

/// Drops (into `out`) the requests at the head of a deadline-ordered queue that cannot finish by
/// their deadline even alone, started now.
pub fn drop_expired(
    p: &crate::profile::Profile,
    delay: crate::time::Delay,
    now: Ms,
    q: &mut std::collections::VecDeque<Request>,
    out: &mut Vec<Decision>,
) {
    while let Some(r) = q.front() {
        if crate::profile::largest_batch(p, delay, now, now, r.deadline, 1) > 0 {
            return;
        }
        out.push(Decision::Drop(*r));
        q.pop_front();
    }
}

/// Test support shared by the schedulers' tests.
#[cfg(test)]
pub(crate) mod testing {
    use proptest::prelude::*;

    use super::{GpuId, ModelId, Request, Scheduler};
    use crate::profile::Profile;
    use crate::time::Delay;

    /// Three models of unlike shapes.
    pub(crate) fn profiles() -> Vec<Profile> {
        vec![
            Profile::new("a", 1.0, 4.0, 30.0, 16).unwrap(),
            Profile::new("b", 2.5, 1.0, 25.0, 8).unwrap(),
            Profile::new("c", 0.5, 8.0, 60.0, 32).unwrap(),
        ]
    }

    /// A small dispatch delay.
    pub(crate) const DELAY: Delay = Delay { ctrl_ms: 0.5, data_ms: 0.1 };

    /// Random events: (clock step, arrival unless 0, model, GPU). Half the steps keep the clock
    /// where it is, as arrivals read in one burst do; three events in four are arrivals.
    pub(crate) fn events(gpus: usize) -> impl Strategy<Value = Vec<(u8, u8, ModelId, GpuId)>> {
        proptest::collection::vec((0u8..4, 0u8..4, 0usize..3, 0..gpus), 1..400)
    }

    /// Feeds `events` to both schedulers and checks they decide alike at every step.
    pub(crate) fn same_decisions(
        a: &mut dyn Scheduler,
        b: &mut dyn Scheduler,
        ps: &[Profile],
        events: Vec<(u8, u8, ModelId, GpuId)>,
    ) -> Result<(), TestCaseError> {
        let (mut now, mut id) = (0.0, 0u64);
        for (step, arrival, model, gpu) in events {
            now += f64::from(step.saturating_sub(1));
            let (mut da, mut db) = (Vec::new(), Vec::new());
            if arrival > 0 {
                id += 1;
                let r = Request { id, model, arrival: now, deadline: now + ps[model].slo_ms };
                a.on_arrival(now, r, &mut da);
                b.on_arrival(now, r, &mut db);
            } else {
                a.on_gpu_free(now, gpu, &mut da);
                b.on_gpu_free(now, gpu, &mut db);
            }
            prop_assert_eq!(&da, &db);
            prop_assert_eq!(a.queued(), b.queued());
        }
        Ok(())
    }
}
