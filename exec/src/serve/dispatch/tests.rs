use super::*;

fn cfg(policy: LivePolicy) -> DispatchConfig {
    DispatchConfig { policy, layers: 7, old: 1, per_instance: 2, max_coop: 64, load_ratio: 6 }
}

fn drain(d: &mut Dispatcher) -> Vec<Dispatch> {
    std::iter::from_fn(|| d.next_dispatch()).collect()
}

#[test]
fn before_scaling_only_old_serves_with_bounded_outstanding() {
    let mut d = Dispatcher::new(cfg(LivePolicy::Zigzag));
    (0..5).for_each(|b| d.arrive(b));
    let out = drain(&mut d);
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|x| x.to == 1 && x.split.is_none()));
    d.done(0);
    assert_eq!(d.next_dispatch().map(|x| x.batch), Some(2));
    assert_eq!(d.queued(), 2);
}

#[test]
fn zigzag_plans_the_queue_when_the_first_layer_lands() {
    let mut d = Dispatcher::new(cfg(LivePolicy::Zigzag));
    (0..6).for_each(|b| d.arrive(b));
    d.scaling(2);
    assert!(drain(&mut d).len() == 2, "new holds nothing yet: old only");
    d.resident(1);
    let out = drain(&mut d);
    // Figure 12's case (L = 7, T = 6, N = 4 still queued): the optimum's splits, x = 0 to old.
    let xs: Vec<u32> = out.iter().map(|x| x.split.map_or(0, |s| s.layers)).collect();
    let want = zigzag::zigzag(&Plan::uniform(7, 6, 4)).unwrap().x;
    assert_eq!(xs, want);
    for x in &out {
        match x.split {
            Some(s) => assert_eq!((x.to, s.then), (2, 1)),
            None => assert_eq!(x.to, 1),
        }
    }
}

#[test]
fn zigzag_plans_the_longest_prefix_of_a_long_queue_its_budget_allows_and_the_rest_best_effort() {
    // An overload: 5,000 batches of a 32-stage model queued when the first stage lands. Planned
    // whole, the program would need 7.8·10⁸ cells (refused above MAX_BATCHES; below it, seconds
    // on the router's loop); the router plans the first `horizon` and splits the rest as
    // best-effort does.
    let layers = 32;
    let horizon = zigzag::batches_within(layers, PLAN_STEPS);
    assert!((12..200).contains(&horizon), "{horizon}");
    let mut d =
        Dispatcher::new(DispatchConfig { layers, max_coop: usize::MAX, load_ratio: 4, ..cfg(LivePolicy::Zigzag) });
    d.scaling(2);
    d.resident(1);
    (0..5000).for_each(|b| d.arrive(b));
    let out = drain(&mut d);
    assert_eq!(out.len(), 5000);
    let xs: Vec<u32> = out.iter().map(|x| x.split.map_or(0, |s| s.layers)).collect();
    let plan = zigzag::zigzag(&Plan::uniform(layers, 4, horizon)).unwrap().x;
    assert_eq!(xs[..horizon], plan[..]);
    assert!(plan.contains(&0) && plan.iter().any(|&x| x > 1), "the plan differs from best-effort's: {plan:?}");
    assert!(xs[horizon..].iter().all(|&x| x == 1), "one stage resident: best-effort gives the rest x = 1");
}

#[test]
fn best_effort_splits_by_what_is_resident_at_dispatch() {
    let mut d = Dispatcher::new(cfg(LivePolicy::BestEffort));
    d.scaling(2);
    d.resident(1);
    (0..3).for_each(|b| d.arrive(b));
    assert!(drain(&mut d).iter().all(|x| x.split == Some(Split { layers: 1, then: 1 })));
    d.resident(6);
    d.arrive(3);
    assert_eq!(d.next_dispatch().unwrap().split, Some(Split { layers: 3, then: 1 }), "at most half");
}

#[test]
fn stop_the_world_waits_for_the_whole_model_then_splits_evenly() {
    let mut d = Dispatcher::new(cfg(LivePolicy::StopTheWorld));
    d.scaling(2);
    d.resident(6);
    (0..6).for_each(|b| d.arrive(b));
    assert!(drain(&mut d).iter().all(|x| x.to == 1 && x.split.is_none()));
    d.resident(7);
    let out = drain(&mut d);
    assert_eq!(out.iter().filter(|x| x.to == 2).count(), 2);
    assert!(out.iter().all(|x| x.split.is_none()));
}

#[test]
fn a_failed_batch_is_requeued_once_and_goes_elsewhere() {
    let mut d = Dispatcher::new(cfg(LivePolicy::BestEffort));
    d.scaling(2);
    d.resident(7);
    (0..2).for_each(|b| d.arrive(b));
    let out = drain(&mut d);
    let on_new = out.iter().find(|x| x.to == 2).unwrap().batch;
    d.down(2);
    d.failed(on_new);
    d.failed(on_new); // a second failure report of the same batch changes nothing
    assert_eq!(d.queued(), 1);
    let again = d.next_dispatch().unwrap();
    assert_eq!((again.batch, again.to), (on_new, 1));
    assert!(d.next_dispatch().is_none());
}

#[test]
fn the_cooperative_cap_holds_and_a_dead_old_leaves_batches_waiting_for_new() {
    let mut c = cfg(LivePolicy::BestEffort);
    c.max_coop = 3;
    let mut d = Dispatcher::new(c);
    d.scaling(2);
    d.resident(2);
    (0..10).for_each(|b| d.arrive(b));
    assert_eq!(drain(&mut d).len(), 3);
    d.down(1);
    (0..3).rev().for_each(|b| d.failed(b));
    assert!(d.next_dispatch().is_none(), "old is gone and new cannot run every layer yet");
    d.resident(7);
    let out = drain(&mut d);
    assert_eq!(out.iter().map(|x| (x.batch, x.to, x.split)).collect::<Vec<_>>(), [(0, 2, None), (1, 2, None)]);
}

#[test]
fn policies_parse_their_own_names() {
    for p in LivePolicy::ALL {
        assert_eq!(p.name().parse::<LivePolicy>(), Ok(p));
        assert_eq!(p.to_string(), p.name());
    }
    assert!("fastest".parse::<LivePolicy>().is_err());
}

#[test]
fn zigzag_plans_weighted_batches_with_their_weights() {
    // Prefill batches weigh their prompt tokens (BlitzScale §5.2 "Coping with LLM").
    let weights = [10.0, 10.0, 10.0, 900.0];
    let mut d = Dispatcher::new(cfg(LivePolicy::Zigzag));
    for (b, w) in weights.iter().enumerate() {
        d.arrive_weighted(b as u64, *w);
    }
    d.scaling(2);
    d.resident(1);
    let xs: Vec<u32> = drain(&mut d).iter().map(|x| x.split.map_or(0, |s| s.layers)).collect();
    let inst = Plan { layers: 7, load_ratio: 6, weights: weights.to_vec() };
    assert_eq!(xs, zigzag::zigzag(&inst).unwrap().x);
}

#[test]
fn other_old_instances_take_whole_batches_until_they_are_down() {
    let mut d = Dispatcher::new(cfg(LivePolicy::Zigzag));
    d.serving(3);
    (0..6).for_each(|b| d.arrive(b));
    let out = drain(&mut d);
    assert_eq!(out.len(), 4, "two per instance");
    assert_eq!(out.iter().filter(|x| x.to == 3).count(), 2);
    d.down(3);
    (0..4).for_each(|b| d.done(b));
    assert!(drain(&mut d).iter().all(|x| x.to == 1), "nothing more goes to a node that is down");
}

#[test]
fn without_its_entry_stage_new_runs_the_blocks_between_two_segments_on_old() {
    let mut d = Dispatcher::new(cfg(LivePolicy::BestEffort));
    d.scaling(2);
    (0..4).for_each(|b| d.arrive(b));
    assert!(drain(&mut d).iter().all(|x| x.to == 1 && x.split.is_none()), "nothing resident: old only");
    // Stages 1..=k: old runs the entry, new stages 1..x with at most half the 6 blocks, old the rest.
    d.after_entry(1);
    let out = drain(&mut d);
    assert_eq!(out.len(), 2, "the two batches still queued");
    let three = (1, Some(Split { layers: 1, then: 2 }), Some(Split { layers: 2, then: 1 }));
    assert!(out.iter().all(|x| (x.to, x.split, x.onward) == three), "{out:?}");
    for (k, x) in [(2, 3), (3, 4), (5, 4)] {
        d.after_entry(k);
        d.arrive(10 + u64::from(k));
        let got = d.next_dispatch().unwrap();
        assert_eq!(got.to, 1);
        assert_eq!(got.split, Some(Split { layers: 1, then: 2 }));
        assert_eq!(got.onward, Some(Split { layers: x, then: 1 }), "after_entry {k}");
    }
    // Every block but no entry is not the whole model: still three segments, never whole to new.
    d.after_entry(6);
    d.arrive(20);
    let got = d.next_dispatch().unwrap();
    assert_eq!((got.to, got.onward.map(|o| o.then)), (1, Some(1)));
    // Once the entry lands the usual two segments resume.
    d.resident(7);
    d.arrive(21);
    let got = d.next_dispatch().unwrap();
    assert_eq!(got.onward, None);
}

#[test]
fn stop_the_world_ignores_blocks_without_the_entry_stage() {
    let mut d = Dispatcher::new(cfg(LivePolicy::StopTheWorld));
    d.scaling(2);
    d.after_entry(6);
    (0..4).for_each(|b| d.arrive(b));
    assert!(drain(&mut d).iter().all(|x| x.to == 1 && x.split.is_none()));
}

#[test]
fn zigzag_without_the_entry_stage_plans_over_the_blocks() {
    let mut d = Dispatcher::new(cfg(LivePolicy::Zigzag));
    d.scaling(2);
    (0..6).for_each(|b| d.arrive(b));
    assert_eq!(drain(&mut d).len(), 2, "new holds nothing yet: old only");
    d.after_entry(1);
    let out = drain(&mut d);
    // The paper's problem over the 6 blocks (T = 6, the 4 batches still queued), each split one
    // stage longer for the entry stage that old runs first.
    let want = zigzag::zigzag(&Plan::uniform(6, 6, 4)).unwrap().x;
    let got: Vec<u32> = out.iter().map(|x| x.onward.map_or(0, |o| o.layers)).collect();
    let shifted: Vec<u32> = want.iter().map(|&x| if x > 0 { x + 1 } else { 0 }).collect();
    assert_eq!(got, shifted);
    assert!(want.iter().any(|&x| x > 0), "the plan gives new some blocks: {want:?}");
}

#[test]
fn an_instance_back_after_its_link_failed_takes_batches_again() {
    let mut d = Dispatcher::new(cfg(LivePolicy::BestEffort));
    d.serving(3);
    d.down(3);
    assert!(d.is_down(3) && !d.is_down(1) && !d.is_down(9));
    assert!(!d.up(3, 6, 5), "a whole-batch instance comes back only with every stage");
    assert!(!d.up(9, 7, 6), "an unknown node is not taken");
    assert!(d.up(3, 7, 6));
    assert!(!d.up(3, 7, 6), "only a node that is down comes back");
    (0..4).for_each(|b| d.arrive(b));
    assert_eq!(drain(&mut d).iter().filter(|x| x.to == 3).count(), 2);
    // The new instance comes back with what it holds now, and cooperates again.
    d.scaling(2);
    d.resident(1);
    d.down(2);
    assert!(d.up(2, 4, 3));
    (0..4).for_each(|b| d.done(b));
    d.arrive(4);
    assert_eq!(d.next_dispatch().unwrap().split, Some(Split { layers: 3, then: 1 }));
}
