//! Single decisions of each scheduler, driven by hand through the sans-IO trait.
#![allow(clippy::unwrap_used)]

use cascade_sched::clockwork::Clockwork;
use cascade_sched::flex::Flex;
use cascade_sched::nexus::Nexus;
use cascade_sched::symphony::Symphony;
use cascade_sched::time::Delay;
use cascade_sched::{Decision, Profile, Request, Scheduler};

fn req(id: u64, model: usize, at: f64, slo: f64) -> Request {
    Request { id, model, arrival: at, deadline: at + slo }
}

/// Runs the scheduler's timers up to `until`; returns the dispatches.
fn advance(s: &mut dyn Scheduler, until: f64, out: &mut Vec<Decision>) {
    while let Some(t) = s.next_timer() {
        if t > until {
            break;
        }
        s.on_timer(t, out);
    }
}

fn dispatches(out: &[Decision]) -> Vec<(usize, usize, f64)> {
    out.iter()
        .filter_map(|d| match d {
            Decision::Dispatch { gpu, requests, start, .. } => Some((*gpu, requests.len(), *start)),
            _ => None,
        })
        .collect()
}

#[test]
fn symphony_waits_until_sched_at_while_symphony_wc_dispatches_at_once() {
    // ℓ(b) = b + 10 ms, SLO 30: one request at t = 0 has dl = 30 and sched_at = dl − ℓ(2) = 18.
    let p = vec![Profile::new("m", 1.0, 10.0, 30.0, 16).unwrap()];
    let mut nwc = Symphony::new(&p, 1, Delay::default(), false);
    let mut wc = Symphony::new(&p, 1, Delay::default(), true);
    let mut out = Vec::new();
    nwc.on_arrival(0.0, req(1, 0, 0.0, 30.0), &mut out);
    advance(&mut nwc, 17.9, &mut out);
    assert!(dispatches(&out).is_empty(), "not schedulable before sched_at: {out:?}");
    advance(&mut nwc, 18.0, &mut out);
    assert_eq!(dispatches(&out), vec![(0, 1, 18.0)]);
    let mut out = Vec::new();
    wc.on_arrival(0.0, req(1, 0, 0.0, 30.0), &mut out);
    advance(&mut wc, 0.0, &mut out);
    assert_eq!(dispatches(&out), vec![(0, 1, 0.0)]);
}

#[test]
fn symphony_dispatches_once_the_batch_holds_beta_lambda_requests() {
    // β = 10 ms; one request per ms → λ = 1/ms, β·λ = 10: the tenth request makes it schedulable.
    let p = vec![Profile::new("m", 0.5, 10.0, 60.0, 64).unwrap()];
    let mut s = Symphony::new(&p, 1, Delay::default(), false);
    let mut out = Vec::new();
    for i in 0..10 {
        let t = i as f64;
        advance(&mut s, t, &mut out);
        s.on_arrival(t, req(i, 0, t, 60.0), &mut out);
    }
    advance(&mut s, 9.0, &mut out);
    let d = dispatches(&out);
    assert_eq!(d.len(), 1, "{out:?}");
    assert!(d[0].1 >= 9 && d[0].2 <= 9.0, "a batch of ~β·λ at once, long before sched_at: {d:?}");
}

#[test]
fn clockwork_serves_the_earliest_deadline_with_its_largest_feasible_batch() {
    let p = vec![Profile::new("a", 1.0, 5.0, 100.0, 32).unwrap(), Profile::new("b", 1.0, 5.0, 20.0, 32).unwrap()];
    let mut s = Clockwork::new(&p, 1, Delay::default());
    let mut out = Vec::new();
    // Occupy the GPU, then queue 5 of a (deadline 101+) and 3 of b (deadline 21+).
    s.on_arrival(0.0, req(0, 0, 0.0, 100.0), &mut out);
    for i in 0..5 {
        s.on_arrival(1.0, req(10 + i, 0, 1.0, 100.0), &mut out);
    }
    for i in 0..3 {
        s.on_arrival(1.0, req(20 + i, 1, 1.0, 20.0), &mut out);
    }
    out.clear();
    s.on_gpu_free(6.0, 0, &mut out);
    match &out[..] {
        [Decision::Dispatch { model, requests, .. }] => {
            assert_eq!((*model, requests.len()), (1, 3), "b has the earliest deadline");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn flex_preempts_a_batch_a_third_the_size_of_the_new_one() {
    // Model 0 is slow; one of its requests runs when 3 and then 4 of model 1 arrive.
    let p =
        vec![Profile::new("slow", 1.0, 50.0, 200.0, 64).unwrap(), Profile::new("fast", 0.1, 1.0, 100.0, 64).unwrap()];
    for preempt in [true, false] {
        let mut s = Flex::new(&p, 1, Delay::default(), preempt);
        let mut out = Vec::new();
        s.on_arrival(0.0, req(0, 0, 0.0, 200.0), &mut out);
        assert_eq!(dispatches(&out).len(), 1);
        out.clear();
        for i in 0..3 {
            s.on_arrival(1.0, req(1 + i, 1, 1.0, 100.0), &mut out);
        }
        assert!(out.is_empty(), "3 < 3.03 × 1: no preemption yet: {out:?}");
        s.on_arrival(1.0, req(4, 1, 1.0, 100.0), &mut out);
        let preempted = out.iter().any(|d| matches!(d, Decision::Preempt { gpu: 0 }));
        assert_eq!(preempted, preempt, "{out:?}");
        if preempt {
            assert_eq!(dispatches(&out), vec![(0, 4, 1.0)], "the four fast requests run");
            assert_eq!(s.queued(), 1, "the preempted request (still feasible) is queued again");
        }
    }
}

#[test]
fn nexus_spreads_a_model_over_the_gpus_its_rate_needs() {
    // ℓ(b) = b + 10, SLO 40 → b = 10 at ℓ = 20 ≤ SLO/2: 500 r/s per GPU. 1000 r/s on 4 GPUs.
    let p = vec![Profile::new("m", 1.0, 10.0, 40.0, 64).unwrap()];
    let mut s = Nexus::new(&p, 4, Delay::default(), &[1000.0], 2, 10_000.0);
    let mut out = Vec::new();
    for i in 0..8 {
        s.on_arrival(0.0, req(i, 0, 0.0, 40.0), &mut out);
    }
    let gpus: std::collections::BTreeSet<usize> = dispatches(&out).iter().map(|d| d.0).collect();
    assert!(gpus.len() >= 2, "frontends spread the requests over several GPUs: {out:?}");
}
