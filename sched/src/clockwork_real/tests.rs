use std::collections::HashSet;

use proptest::prelude::*;

use super::*;
use crate::scheduler::testing::{events, profiles, same_decisions, DELAY};

fn req(id: u64, at: Ms, slo: Ms) -> Request {
    Request { id, model: 0, arrival: at, deadline: at + slo }
}

fn one(p: Profile, gpus: usize) -> ClockworkReal {
    ClockworkReal::new(&[p], gpus, Delay::default(), 5.0)
}

#[test]
fn an_idle_gpu_takes_a_lone_request_at_once() {
    let mut s = one(Profile::new("m", 1.0, 9.0, 100.0, 64).unwrap(), 1);
    let mut out = Vec::new();
    s.on_arrival(0.0, req(0, 0.0, 100.0), &mut out);
    assert!(matches!(&out[..], [Decision::Dispatch { requests, start, .. }] if requests.len() == 1 && *start == 0.0));
}

#[test]
fn batches_are_chosen_ahead_and_in_any_size() {
    let mut s = one(Profile::new("m", 1.0, 9.0, 100.0, 64).unwrap(), 1);
    let mut out = Vec::new();
    s.on_arrival(0.0, req(0, 0.0, 100.0), &mut out); // alone, busy until 10
    out.clear();
    for i in 1..=3 {
        s.on_arrival(i as f64, req(i, i as f64, 100.0), &mut out);
    }
    assert!(out.is_empty(), "nothing is chosen before the window opens at 10 − 5");
    assert_eq!(s.next_timer(), Some(5.0));
    s.on_timer(5.0, &mut out);
    // Three queued at 5 ms: one batch of three (not two, as with compiled sizes 1, 2, 4, …),
    // to start when the GPU frees.
    match &out[..] {
        [Decision::Dispatch { requests, start, .. }] => {
            assert_eq!(requests.len(), 3);
            assert_eq!(*start, 10.0);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.queued(), 0);
}

#[test]
fn a_request_that_meets_its_slo_only_without_the_buffer_is_dropped() {
    // ℓ(1) = 10 ms and an SLO of 14 ms: it would finish in time, but Clockwork schedules against
    // 14 − 5 (raised to ahead + 5 = 10, which a batch ending at 10 does not beat).
    let mut s = one(Profile::new("m", 1.0, 9.0, 14.0, 8).unwrap(), 1);
    let mut out = Vec::new();
    s.on_arrival(0.0, req(0, 0.0, 14.0), &mut out);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(s.next_timer(), Some(10.0));
    s.on_timer(10.0, &mut out);
    assert!(matches!(&out[..], [Decision::Drop(r)] if r.id == 0), "{out:?}");
    assert_eq!(s.queued(), 0);
    // With a looser SLO the same request runs at once.
    let mut s = one(Profile::new("m", 1.0, 9.0, 16.0, 8).unwrap(), 1);
    s.on_arrival(0.0, req(1, 0.0, 16.0), &mut out);
    assert!(matches!(&out[1..], [Decision::Dispatch { .. }]), "{out:?}");
}

#[test]
fn when_more_arrived_than_the_oldest_deadline_allows_the_oldest_are_dropped() {
    // Busy until 20 with another model; requests of a model with ℓ(b) = 2b + 4 and a 40 ms SLO
    // (35 buffered) arrive at 1, 2, …. When the window opens at 15:
    // * with 8 queued, the batch is the six that meet the first one's deadline (20 + 2·6 + 4 =
    //   36), as the plain `clockwork` would choose;
    // * with 10 queued, every strategy of the first two fails — each would grow to the 8 or 9
    //   requests behind it, which miss its deadline ("a greater batch size might be achievable
    //   by a subsequent request") — so the third's strategy runs 3..=9 and the first two, which
    //   cannot be included, are dropped.
    for (n, dropped, batch) in [(8u64, vec![], (1..=6).collect::<Vec<u64>>()), (10, vec![1, 2], (3..=9).collect())] {
        let ps = [Profile::new("z", 0.0, 20.0, 100.0, 8).unwrap(), Profile::new("x", 2.0, 4.0, 40.0, 64).unwrap()];
        let mut s = ClockworkReal::new(&ps, 1, Delay::default(), 5.0);
        let mut out = Vec::new();
        s.on_arrival(0.0, Request { id: 0, model: 0, arrival: 0.0, deadline: 100.0 }, &mut out);
        for i in 1..=n {
            let t = i as f64;
            s.on_arrival(t, Request { id: i, model: 1, arrival: t, deadline: t + 40.0 }, &mut out);
        }
        assert_eq!(out.len(), 1);
        out.clear();
        assert_eq!(s.next_timer(), Some(15.0));
        s.on_timer(15.0, &mut out);
        let drops: Vec<u64> =
            out.iter().filter_map(|d| if let Decision::Drop(r) = d { Some(r.id) } else { None }).collect();
        assert_eq!(drops, dropped, "{n} queued");
        match out.last() {
            Some(Decision::Dispatch { requests, start, .. }) => {
                assert_eq!(requests.iter().map(|r| r.id).collect::<Vec<_>>(), batch, "{n} queued");
                assert_eq!(*start, 20.0);
            }
            other => panic!("{other:?}"),
        }
    }
}

/// The same over long runs, where queues build up and models compete in every window.
#[test]
fn cursors_decide_as_one_entry_per_strategy_over_long_runs() {
    let ps = profiles();
    for seed in 1..=4u64 {
        let mut x = seed;
        let mut next = |n: u64| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) % n
        };
        // Mostly arrivals, the clock moving by 0–1 ms: a load the three GPUs cannot keep up with.
        let evs: Vec<(u8, u8, usize, usize)> =
            (0..20_000).map(|_| (next(3) as u8, u8::from(next(8) > 0), next(3) as usize, next(3) as usize)).collect();
        let mut fast = ClockworkReal::new(&ps, 3, DELAY, 5.0);
        let mut naive = ClockworkReal::new(&ps, 3, DELAY, 5.0);
        naive.naive = true;
        let r = same_decisions(&mut fast, &mut naive, &ps, evs);
        assert!(r.is_ok(), "seed {seed}: {r:?}");
    }
}

proptest! {
    /// The cursors (one heap entry per model and batch size, failed-for-lateness strategies
    /// skipped together) decide exactly as one heap entry per strategy popped one by one.
    #[test]
    fn cursors_decide_as_one_entry_per_strategy(evs in events(3)) {
        let ps = profiles();
        let mut fast = ClockworkReal::new(&ps, 3, DELAY, 5.0);
        let mut naive = ClockworkReal::new(&ps, 3, DELAY, 5.0);
        naive.naive = true;
        same_decisions(&mut fast, &mut naive, &ps, evs)?;
    }

    /// Every request is dispatched, dropped or still queued, once; batches hold at most
    /// `MAX_BATCH` requests of one model, start no earlier than decided, do not overlap on a
    /// GPU, and finish by every member's buffered deadline.
    #[test]
    fn every_request_is_accounted_for_once_and_batches_are_sound(evs in events(2)) {
        let ps = profiles();
        let mut s = ClockworkReal::new(&ps, 2, DELAY, 5.0);
        let (mut now, mut id) = (0.0, 0u64);
        let mut seen = HashSet::new();
        let mut busy = [0.0f64; 2];
        let mut out = Vec::new();
        for (step, arrival, model, gpu) in evs {
            now += f64::from(step);
            if let Some(t) = s.next_timer().filter(|&t| t <= now) {
                s.on_timer(t, &mut out);
            }
            if arrival > 0 {
                s.on_arrival(now, Request { id, model, arrival: now, deadline: now + ps[model].slo_ms }, &mut out);
                id += 1;
            } else {
                s.on_gpu_free(now, gpu, &mut out);
            }
            for d in out.drain(..) {
                match d {
                    Decision::Drop(r) => prop_assert!(seen.insert(r.id)),
                    Decision::Dispatch { gpu, model, requests, start } => {
                        prop_assert!(!requests.is_empty() && requests.len() <= MAX_BATCH.min(ps[model].max_batch));
                        prop_assert!(start >= busy[gpu] - 1e-9);
                        let end = start + ps[model].latency(requests.len());
                        busy[gpu] = end;
                        for r in requests {
                            prop_assert_eq!(r.model, model);
                            prop_assert!(end <= r.arrival + (ps[model].slo_ms - BUFFER_MS).max(10.0) + 1e-9);
                            prop_assert!(seen.insert(r.id));
                        }
                    }
                    Decision::Preempt { .. } => prop_assert!(false, "Clockwork never preempts"),
                }
            }
        }
        prop_assert_eq!(seen.len() + s.queued(), id as usize);
    }
}
