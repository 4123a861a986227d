use std::time::Duration;

use proptest::prelude::*;

use super::batcher::{BatchConfig, Batcher, Policy, Runnable};
use super::dispatch::{
    artifact_cost, place, place_artifact, route, substitute, AdapterSet, ArtifactFill, Dispatch, Placement, RouteCost,
};
use super::migrate::{MigProblem, MigReplica, MigRequest, PlanSource};
use super::sim::simulate;
use super::workload::LoraScenario;
use super::{CostModel, Mode};

fn reqs(adapters: &[u32]) -> Vec<Runnable> {
    adapters.iter().map(|&a| Runnable { adapter: a, prompt_tokens: 0 }).collect()
}

fn cfg(max_batch: usize) -> BatchConfig {
    BatchConfig { max_batch, ..BatchConfig::default() }
}

#[test]
fn algorithm_1_merges_above_alpha_and_unmerges_below_beta() {
    let c = BatchConfig { alpha0: 0.5, beta0: Some(0.3), ..cfg(8) };
    let mut b = Batcher::new(Policy::Dlora, c, CostModel::paper_7b());
    // 3 of 8 from adapter 1: 0.375 ≤ α, unmerged FCFS.
    let ch = b.decide(&reqs(&[0, 1, 2, 1, 3, 1, 4, 5]));
    assert_eq!((ch.mode, ch.batch.len(), ch.switch_ops), (Mode::Unmerged, 8, 0));
    // 6 of 8 from adapter 1: merge it and run its requests only.
    let ch = b.decide(&reqs(&[0, 1, 1, 1, 1, 1, 1, 2]));
    assert_eq!(ch.mode, Mode::Merged(1));
    assert_eq!(ch.batch, vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(ch.switch_ops, 1);
    // 3 of 8: 0.375 ≥ β, stays merged.
    let ch = b.decide(&reqs(&[0, 1, 2, 1, 3, 1, 4, 5]));
    assert_eq!(ch.mode, Mode::Merged(1));
    assert_eq!(ch.batch, vec![1, 3, 5]);
    // 1 of 8 < β: un-merge, FCFS.
    let ch = b.decide(&reqs(&[0, 1, 2, 3, 4, 5, 6, 7]));
    assert_eq!((ch.mode, ch.batch.len(), ch.switch_ops), (Mode::Unmerged, 8, 1));
    assert_eq!(b.stats().mode_switches, 2);
}

#[test]
fn credits_are_conserved_and_an_adapter_that_cannot_pay_does_not_merge() {
    let c = BatchConfig {
        alpha0: 0.5,
        beta0: Some(0.3),
        // Credits are in batches of 8: 2/8 is two displaced requests' worth.
        credit0: 2.0 / 8.0,
        t_starve: 1e9,
        t_normal: 0.0,
        credit_reversion: Some(0.0),
        ..cfg(8)
    };
    // Free switches: this test is about eligibility, not about amortising a merge.
    let mut b = Batcher::new(Policy::Dlora, c, CostModel { switch_ms: 0.0, ..CostModel::paper_7b() });
    let window = reqs(&[0, 1, 1, 1, 1, 1, 2, 3]);
    // Merging 1 displaces 3 requests: it has 2 requests' worth of credit, so it is not eligible.
    let ch = b.decide(&window);
    assert_eq!(ch.mode, Mode::Unmerged);
    let window = reqs(&[0, 1, 1, 1, 1, 1, 1, 2]);
    // Now it displaces 2 and can pay: merged, adapters 0 and 2 gain one request's worth each.
    let ch = b.decide(&window);
    assert_eq!(ch.mode, Mode::Merged(1));
    let near = |a: f64, b: f64| (a * 8.0 - b).abs() < 1e-9;
    assert!(near(b.credit(0), 3.0) && near(b.credit(1), 0.0) && near(b.credit(2), 3.0) && near(b.credit(3), 2.0));
    let total: f64 = (0..4).map(|a| b.credit(a)).sum();
    assert!(near(total, 8.0));
    // It cannot pay again: not eligible, so it un-merges.
    let ch = b.decide(&window);
    assert_eq!(ch.mode, Mode::Unmerged);
}

#[test]
fn a_merge_is_made_only_when_the_credit_pays_for_its_switches() {
    // Adapter 1 holds 6 of 8 decode steps: each merged iteration saves 5.9 ms (28.8 ms unmerged
    // for the window's 8 sequences, so 21.6 ms for 6, less 15.7 ms merged), and a merge and an
    // un-merge cost 40 ms: at least 7 merged iterations must be paid for.
    let window = reqs(&[0, 1, 1, 1, 1, 1, 1, 2]);
    let decide = |credit_iters: f64| {
        let c = BatchConfig {
            alpha0: 0.5,
            beta0: Some(0.3),
            // Two requests displaced per iteration, 1/8 credit each.
            credit0: credit_iters * 2.0 / 8.0,
            t_starve: 1e9,
            t_normal: 0.0,
            credit_reversion: Some(0.0),
            ..cfg(8)
        };
        Batcher::new(Policy::Dlora, c, CostModel::paper_7b()).decide(&window).mode
    };
    assert_eq!(decide(1.0), Mode::Unmerged);
    assert_eq!(decide(6.0), Mode::Unmerged);
    assert_eq!(decide(7.0), Mode::Merged(1));
    assert_eq!(decide(50.0), Mode::Merged(1));
}

#[test]
fn a_starving_adapter_is_served_first() {
    let c = BatchConfig {
        alpha0: 0.3,
        beta0: Some(0.2),
        // Batches of 4: starving 2.5 requests' worth above the start.
        credit0: 100.0,
        t_starve: 100.0 + 2.5 / 4.0,
        t_normal: 100.0,
        credit_reversion: Some(0.0),
        ..cfg(4)
    };
    let mut b = Batcher::new(Policy::Dlora, c, CostModel::paper_7b());
    let window = reqs(&[0, 1, 1, 1, 1, 1]);
    let mut served0 = None;
    for it in 0..10 {
        let ch = b.decide(&window);
        if ch.batch.contains(&0) {
            served0 = Some((it, ch.starvation));
            break;
        }
    }
    // Adapter 0 gains 1/4 credit per iteration passed over: > 100.625 after 3, served at the 4th.
    assert_eq!(served0, Some((3, true)));
}

#[test]
fn a_starving_adapter_with_a_full_batch_is_served_merged_when_its_starvation_pays_for_the_switches() {
    // Adapter 1 (15 requests) is merged and passes over adapter 0's oldest request, which gains
    // 1/8 credit an iteration and starves after five. Adapter 0 then has 8 starving requests,
    // a full batch (or 5, which are not). Merged, each of its starving iterations saves ~13 ms
    // against the unmerged batch, and it starves until it has paid its credit down to
    // `t_normal` at 7/8 an iteration (it displaces seven of adapter 1's requests); switching
    // from adapter 1 to it and later un-merging costs three 20 ms switches.
    let queue = |of_0: usize| {
        let mut window = vec![0];
        window.extend([1; 15]);
        window.extend(std::iter::repeat_n(0, of_0 - 1));
        reqs(&window)
    };
    let starving_with = |window: &[Runnable], t_normal: f64, merge_starving: bool| {
        let c = BatchConfig {
            credit0: 100.0,
            t_starve: 100.5,
            t_normal,
            credit_reversion: Some(0.0),
            merge_starving,
            ..cfg(8)
        };
        let mut b = Batcher::new(Policy::Dlora, c, CostModel::paper_7b());
        for it in 0..10 {
            let ch = b.decide(window);
            if ch.starvation {
                assert_eq!(it, 5);
                return ch;
            }
            assert_eq!(ch.mode, Mode::Merged(1), "iteration {it}");
        }
        panic!("adapter 0 never starved");
    };
    let full = queue(8);
    let starving = |t_normal: f64, merge_starving: bool| starving_with(&full, t_normal, merge_starving);
    // Credit 10.6 above t_normal: 13 starving iterations, ~170 ms saved against 60 ms of switches.
    let ch = starving(90.0, true);
    assert_eq!((ch.mode, ch.switch_ops), (Mode::Merged(0), 2));
    assert_eq!(ch.batch, [0, 16, 17, 18, 19, 20, 21, 22]);
    // Credit 0.6 above it: one starving iteration, which saves less than the switches cost.
    let ch = starving(100.0, true);
    assert_eq!(ch.mode, Mode::Unmerged);
    assert_eq!(ch.batch, [0, 16, 17, 18, 19, 20, 21, 22], "the starving requests fill the batch");
    // Without merged starvation batches, unmerged whatever the credit.
    assert_eq!(starving(90.0, false).mode, Mode::Unmerged);
    // Five starving requests do not fill the batch of eight: unmerged, three of adapter 1's
    // requests in the free slots.
    let ch = starving_with(&queue(5), 90.0, true);
    assert_eq!((ch.mode, ch.batch), (Mode::Unmerged, vec![0, 1, 2, 3, 16, 17, 18, 19]));
}

#[test]
fn algorithm_2_lowers_alpha_when_merging_would_have_paid_and_raises_it_when_not() {
    let cost = CostModel::paper_7b();
    // One adapter only: merged throughput beats unmerged, α falls until it merges.
    let mut b = Batcher::new(Policy::Dlora, BatchConfig { break_iters: 2, ..cfg(16) }, cost.clone());
    let one = reqs(&[3; 12]);
    let mut merged_at = None;
    for it in 0..200 {
        if b.decide(&one).mode == Mode::Merged(3) {
            merged_at = Some(it);
            break;
        }
    }
    assert!(merged_at.is_some(), "never merged: α = {:?}", b.thresholds());
    assert!(b.stats().tunings > 0);
    // Sixteen adapters, one request each: merging one serves 1 of 16, α only grows.
    let mut b = Batcher::new(Policy::Dlora, BatchConfig { break_iters: 2, alpha0: 0.5, ..cfg(16) }, cost);
    let spread = reqs(&(0..16).collect::<Vec<_>>());
    for _ in 0..100 {
        assert_eq!(b.decide(&spread).mode, Mode::Unmerged);
    }
    assert!(b.thresholds().0 > 0.5, "α = {:?}", b.thresholds());
    let (alpha, beta) = b.thresholds();
    assert!(beta < alpha);
}

#[test]
fn the_baselines_batch_as_named() {
    let cost = CostModel::paper_7b();
    let w = reqs(&[2, 0, 2, 1, 3, 4, 5, 2]);
    let ch = Batcher::new(Policy::MergedOnly, cfg(8), cost.clone()).decide(&w);
    assert_eq!((ch.mode, ch.batch), (Mode::Merged(2), vec![0, 2, 7]));
    let ch = Batcher::new(Policy::UnmergedOnly, cfg(8), cost.clone()).decide(&w);
    assert_eq!((ch.mode, ch.batch.len()), (Mode::Unmerged, 8));
    let c = BatchConfig { slora_max_adapters: 3, ..cfg(8) };
    let ch = Batcher::new(Policy::Slora, c, cost).decide(&w);
    assert_eq!((ch.mode, ch.batch), (Mode::Unmerged, vec![0, 1, 2, 3, 7]));
}

/// Drives a batcher over a random stream: requests arrive, each needs `len` iterations of
/// service; returns the most consecutive iterations a request sat in the window unserved.
fn max_streak(policy: Policy, c: BatchConfig, stream: &[(u32, u32)], per_iter: usize) -> u64 {
    let max_batch = c.max_batch;
    let mut b = Batcher::new(policy, c, CostModel::paper_7b());
    let mut live: Vec<(u32, u32, u64)> = Vec::new();
    let mut next = 0;
    let mut worst = 0;
    for _ in 0..4000 {
        for _ in 0..per_iter {
            if let Some(&(a, len)) = stream.get(next) {
                live.push((a, len, 0));
                next += 1;
            }
        }
        if live.is_empty() && next >= stream.len() {
            break;
        }
        let run: Vec<Runnable> = live.iter().map(|l| Runnable { adapter: l.0, prompt_tokens: 0 }).collect();
        let ch = b.decide(&run);
        for (k, l) in live.iter_mut().enumerate() {
            if ch.batch.binary_search(&k).is_ok() {
                l.1 -= 1;
                l.2 = 0;
            } else if k < max_batch {
                l.2 += 1;
                worst = worst.max(l.2);
            } else {
                l.2 = 0;
            }
        }
        live.retain(|l| l.1 > 0);
    }
    worst
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The starvation bound of the module docs holds on random streams and thresholds.
    #[test]
    fn no_request_waits_longer_than_the_bound(
        stream in prop::collection::vec((0u32..6, 1u32..30), 50..400),
        skew in 0u32..6,
        max_batch in 2usize..12,
        credit0 in 0.0f64..3.0,
        t_normal in 0.0f64..3.0,
        gap in 0.0f64..3.0,
        alpha0 in 0.05f64..1.0,
        per_iter in 1usize..4,
        reversion in 0.0f64..0.9,
    ) {
        // Skew the stream towards adapter 0.
        let stream: Vec<(u32, u32)> = stream.iter().map(|&(a, l)| (if a < skew { 0 } else { a }, l)).collect();
        let c = BatchConfig {
            max_batch, credit0, t_normal, t_starve: t_normal + gap, alpha0, break_iters: 4,
            // λ·(t_starve − credit0) < 1/max_batch, as validate() demands.
            credit_reversion: Some(reversion / (max_batch as f64 * (t_normal + gap - credit0).max(1.0))),
            ..BatchConfig::default()
        };
        prop_assert!(c.validate().is_ok(), "{:?}", c.validate());
        let bound = Batcher::new(Policy::Dlora, c.clone(), CostModel::paper_7b()).starvation_bound().unwrap();
        let worst = max_streak(Policy::Dlora, c, &stream, per_iter);
        prop_assert!(worst <= bound, "waited {worst} > bound {bound}");
    }
}

#[test]
fn merged_only_has_no_such_bound_and_starves_a_minority() {
    // The oldest request's adapter keeps arriving: a request of another adapter in the window waits
    // as long as adapter 0 has a request ahead of it.
    let mut stream = vec![(0u32, 200u32)];
    stream.push((1, 1));
    stream.extend(std::iter::repeat_n((0, 5), 300));
    let worst = max_streak(Policy::MergedOnly, cfg(8), &stream, 1);
    assert!(worst >= 150, "merged-only passed the request over only {worst} times");
    // Tight credits, so that the bound is far below merged-only's wait.
    let tight = BatchConfig { credit0: 1.0, t_normal: 1.0, t_starve: 2.0, ..cfg(8) };
    let dlora = max_streak(Policy::Dlora, tight.clone(), &stream, 1);
    let bound = Batcher::new(Policy::Dlora, tight, CostModel::paper_7b()).starvation_bound().unwrap();
    assert!(bound < 150, "bound {bound}");
    assert!(dlora <= bound, "{dlora} > {bound}");
}

fn tiny_problem(reqs: &[(u32, usize, f64, f64, f64)], reps: &[(f64, f64, f64, Vec<u32>)]) -> MigProblem {
    MigProblem {
        requests: reqs
            .iter()
            .map(|&(adapter, from, exec_ms, mem_bytes, move_ms)| MigRequest {
                adapter,
                from,
                exec_ms,
                mem_bytes,
                move_ms,
            })
            .collect(),
        replicas: reps
            .iter()
            .map(|(b, m, cap, res)| MigReplica { base_ms: *b, base_mem: *m, capacity: *cap, resident: res.clone() })
            .collect(),
        adapter_bytes: 50e6,
        eta_ms: 3.0,
        swap_bytes_per_ms: 25e6,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    /// On tiny instances the exact ILP finds the brute-force optimum; the relaxed and rounded one
    /// and the greedy plan are valid and never worse than moving nothing.
    #[test]
    fn the_ilp_equals_brute_force_on_tiny_instances(
        reqs in prop::collection::vec((0u32..3, 0usize..3, 1.0f64..100.0, 0.0f64..2e9, 0.0f64..20.0), 1..6),
        reps in prop::collection::vec((0.0f64..200.0, 0.0f64..2e9, 1e9f64..4e9, prop::collection::vec(0u32..3, 0..3)), 3),
    ) {
        let p = tiny_problem(&reqs, &reps);
        let (_, best) = p.brute_force();
        let exact = p.solve(false, Duration::from_secs(10));
        prop_assert!(p.check(&exact.to).is_ok());
        prop_assert!((exact.objective - best).abs() <= 1e-6 * best.max(1.0), "ilp {} vs brute force {best} ({:?})", exact.objective, exact.solver_note);
        let relaxed = p.solve(true, Duration::from_secs(10));
        prop_assert!(p.check(&relaxed.to).is_ok());
        prop_assert!(relaxed.objective <= relaxed.greedy_objective + 1e-9);
        prop_assert!(relaxed.greedy_objective <= relaxed.stay_objective + 1e-9);
        prop_assert!(relaxed.objective >= best - 1e-6);
    }
}

#[test]
fn a_lopsided_pair_of_replicas_is_rebalanced_by_the_solver() {
    // Replica 0 holds eight long requests of adapters 0 and 1; replica 1 is idle and holds adapter 0.
    let reqs: Vec<_> = (0..8).map(|i| (i % 2, 0usize, 100.0, 1e8, 2.0)).collect();
    let p = tiny_problem(&reqs, &[(0.0, 0.0, 8e9, vec![0, 1]), (0.0, 0.0, 8e9, vec![0])]);
    let plan = p.solve(true, Duration::from_secs(5));
    assert_eq!(plan.stay_objective, 800.0);
    // Four requests move (2 ms each); adapter 1 is loaded on replica 1 if any of its requests go
    // there (η = 3 ms): the best is 404 + ... ≤ 412.
    assert!(plan.objective <= 412.0 + 1e-6, "{plan:?}");
    assert_eq!(plan.source, PlanSource::Ilp, "{:?}", plan.solver_note);
    let moved = plan.to.iter().filter(|&&j| j == 1).count();
    assert_eq!(moved, 4);
}

#[test]
fn placement_covers_every_adapter_within_the_bound_and_replicates_the_popular_one() {
    let cost = CostModel::paper_7b();
    let shares = [0.5, 0.2, 0.1, 0.1, 0.05, 0.05];
    let on = place(&shares, 4, 3, &cost, 500.0).unwrap();
    for a in 0..6u32 {
        assert!(on.iter().any(|r| r.contains(&a)), "adapter {a} not placed: {on:?}");
    }
    assert!(on.iter().all(|r| r.len() <= 3));
    let copies = |a: u32| on.iter().filter(|r| r.contains(&a)).count();
    assert!(copies(0) >= copies(5), "{on:?}");
    assert!(copies(0) >= 2, "{on:?}");
    assert!(place(&[0.5; 7], 2, 3, &cost, 500.0).is_err());
}

#[test]
fn routing_prefers_the_least_pending_counting_the_load() {
    assert_eq!(route(&[10.0, 5.0], &[true, false], &[true, true], 3.0), Some(1));
    assert_eq!(route(&[10.0, 8.0], &[true, false], &[true, true], 3.0), Some(0));
    assert_eq!(route(&[10.0, 1.0], &[true, false], &[true, false], 3.0), Some(0));
    let mut s = AdapterSet::new(2, &[0, 1]);
    s.touch(0, 5.0);
    // Full: loading 2 evicts the least recently used adapter nobody needs (1).
    assert_eq!(s.load(2, 6.0, 8.0, |_| false), Some(1));
    assert_eq!(s.ready_at(2), Some(8.0));
    // Every resident adapter needed: no room.
    assert!(!s.can_load(|_| true));
}

fn scenario(text: &str) -> LoraScenario {
    let s: LoraScenario = toml::from_str(text).unwrap();
    s.validate().unwrap();
    s
}

#[test]
fn scenarios_are_checked_and_skewness_concentrates_the_load() {
    let base = "duration_s = 10\nrate_rps = 5\nadapters = 8\n";
    let low = scenario(&format!("{base}skewness = 1\n")).adapter_shares();
    let high = scenario(&format!("{base}skewness = 32\n")).adapter_shares();
    let top = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    assert!((low.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    assert!(top(&high) > top(&low) + 0.2, "{low:?} {high:?}");
    let bad: Result<LoraScenario, _> = toml::from_str(&format!("{base}skewness = 4\nbogus = 1\n"));
    assert!(bad.is_err());
    let zero = scenario(&format!("{base}skewness = 4\n"));
    let mut z = zero.clone();
    z.batch.max_batch = 0;
    assert!(z.validate().is_err());
    // A popularity or length law that is no number is refused: a NaN or infinite Zipf exponent
    // put every request on one adapter, an infinite scale made every request max_tokens long.
    for (field, v) in [("zipf", f64::NAN), ("zipf", f64::INFINITY), ("zipf", -1.0), ("scale", f64::INFINITY)] {
        let mut z = zero.clone();
        match field {
            "zipf" => z.zipf_s = v,
            _ => z.lengths.scale = v,
        }
        let e = z.validate().unwrap_err();
        assert!(e.contains(if field == "zipf" { "zipf_s must be finite" } else { "lengths: need finite" }), "{e}");
    }
    let mut flood = zero.clone();
    flood.rate_rps = 1e9;
    assert!(flood.validate().unwrap_err().contains("exceed the simulator's limit"));
    let mut uniform = zero.clone();
    uniform.zipf_s = 0.0;
    uniform.validate().unwrap();
    let reqs = zero.requests();
    assert!(reqs.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
    assert!((reqs.len() as f64 - 50.0).abs() < 25.0, "{}", reqs.len());
    assert_eq!(reqs, zero.requests(), "not deterministic");
}

#[test]
fn drifting_popularity_moves_the_shares_each_phase_and_sigma_zero_is_the_static_law() {
    let base = "duration_s = 60\nrate_rps = 50\nadapters = 8\nskewness = 8\n";
    let fixed = scenario(base);
    let still = scenario(&format!("{base}[drift]\nphase_s = 20\nsigma = 0\n"));
    let moving = scenario(&format!("{base}[drift]\nphase_s = 20\nsigma = 1.5\n"));
    assert_eq!((fixed.phase_count(), still.phase_count(), moving.phase_count()), (1, 3, 3));
    // σ = 0: every phase has the static law's shares, and the same requests are drawn.
    for p in still.phase_shares() {
        assert_eq!(p, fixed.adapter_shares());
    }
    assert_eq!(still.requests(), fixed.requests());
    // σ > 0: each phase's shares sum to one and differ from the others'; the mean is what a
    // placement is given.
    let phases = moving.phase_shares();
    let l1 = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f64>();
    for p in &phases {
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{p:?}");
    }
    assert!(l1(&phases[0], &phases[1]) > 0.2 && l1(&phases[1], &phases[2]) > 0.2, "{phases:?}");
    let mean = moving.adapter_shares();
    for a in 0..8 {
        let m = phases.iter().map(|p| p[a]).sum::<f64>() / 3.0;
        assert!((mean[a] - m).abs() < 1e-12);
    }
    // The requests follow their phase's shares (1,000 per phase: within 0.05 of each share), and
    // keep the static law's arrival times and lengths: the drift has generators of its own.
    let reqs = moving.requests();
    for (k, p) in phases.iter().enumerate() {
        let of_phase: Vec<_> = reqs.iter().filter(|r| (r.arrival_ms / 20_000.0) as usize == k).collect();
        for (a, share) in p.iter().enumerate() {
            let seen = of_phase.iter().filter(|r| r.adapter as usize == a).count() as f64 / of_phase.len() as f64;
            assert!((seen - share).abs() < 0.05, "phase {k}, adapter {a}: {seen} drawn against {share}");
        }
    }
    let when =
        |v: &[super::workload::LoraRequest]| v.iter().map(|r| (r.arrival_ms, r.input, r.output)).collect::<Vec<_>>();
    assert_eq!(when(&reqs), when(&fixed.requests()));
    assert_eq!(reqs, moving.requests(), "not deterministic");
    // Bad drifts are refused.
    for bad in ["phase_s = 0\nsigma = 1", "phase_s = 20\nsigma = -1"] {
        let s: LoraScenario = toml::from_str(&format!("{base}[drift]\n{bad}\n")).unwrap();
        assert!(s.validate().unwrap_err().contains("drift"), "{bad}");
    }
}

#[test]
fn a_replica_whose_kv_cache_fills_preempts_the_newest_and_recomputes_them() {
    // Room for about four requests' prompts and outputs (161 + 338 tokens, lengths within ~30%
    // of that, so that no request alone outgrows it), eight decoding at once: the decode steps
    // outgrow the cache.
    let mut s = scenario(
        "duration_s = 20\nrate_rps = 4\nadapters = 8\nskewness = 8\n\
         [lengths]\ninput_mean = 161\noutput_mean = 338\nsigma = 0.1\n",
    );
    let roomy = simulate(&s, Policy::UnmergedOnly).unwrap();
    assert_eq!(roomy.preemptions, 0);
    s.cost_model = Some(CostModel { kv_capacity_tokens: 2_000, ..CostModel::paper_7b() });
    for p in Policy::ALL {
        let r = simulate(&s, p).unwrap();
        assert!(r.preemptions > 0, "{p:?}: no preemption");
        assert!(r.peak_kv_use <= 1.0, "{p:?}: KV at {} of the capacity", r.peak_kv_use);
        assert_eq!((r.finished, r.unfinished), (r.requests, 0), "{p:?}");
        // Recomputing preempted requests costs time.
        assert!(r.avg_latency_s > roomy.avg_latency_s, "{p:?}");
    }
}

#[test]
fn one_replica_serves_every_request_under_every_policy() {
    let s = scenario("duration_s = 20\nrate_rps = 4\nadapters = 8\nskewness = 8\n");
    for p in Policy::ALL {
        let r = simulate(&s, p).unwrap();
        assert_eq!(r.finished, r.requests, "{p:?}");
        assert_eq!(r.unfinished, 0);
        assert!(r.avg_latency_s > 0.0 && r.p90_latency_s >= 0.0);
        if let Some(b) = r.starvation_bound {
            assert!(r.max_wait_iterations <= b, "{p:?}: {} > {b}", r.max_wait_iterations);
        }
    }
}

#[test]
fn the_cluster_migrates_only_under_dlora_dispatch() {
    let text = "duration_s = 20\nrate_rps = 40\nadapters = 32\nskewness = 8\nreplicas = 4\n[lengths]\nsigma = 1.5\n";
    let mut s = scenario(text);
    for d in Dispatch::ALL {
        s.cluster.dispatch = d;
        let r = simulate(&s, Policy::Dlora).unwrap();
        assert_eq!(r.finished, r.requests, "{d:?}");
        if d != Dispatch::Dlora {
            assert_eq!(r.migrations, 0);
        }
    }
}

#[test]
fn the_artifacts_route_cost_counts_batches_and_picks_the_first_on_ties() {
    // Batches of 256: 300 requests of one adapter are one full merged batch (0.6) and 44 left;
    // with 10 and 250 of two others the leftovers (304) make one unmerged batch more.
    assert!((artifact_cost([300, 10, 250], 256) - 1.6).abs() < 1e-12);
    // Below a batch per replica every cost is 0.
    assert_eq!(artifact_cost([100, 100], 256), 0.0);
    // Ties go to the first candidate; a lower cost wins; loading adds its cost.
    let yes = [true, true, true];
    assert_eq!(route(&[0.0, 0.0, 0.0], &yes, &yes, 0.5), Some(0));
    assert_eq!(route(&[1.0, 0.6, 0.6], &yes, &yes, 0.5), Some(1));
    assert_eq!(route(&[1.0, 0.0, 0.6], &[true, false, true], &yes, 0.5), Some(1));
    assert_eq!(route(&[1.0, 0.6, 0.6], &[true, false, true], &yes, 0.5), Some(2));
    assert_eq!(route(&[0.0], &[false], &[false], 0.5), None);
}

#[test]
fn with_the_artifacts_cost_proactive_dispatch_piles_up_and_migration_spreads_it() {
    // Four replicas, moderate load: every cost is 0, so each adapter's requests go to its first
    // holder; migration moves them out and queues far less.
    let text = "duration_s = 20\nrate_rps = 30\nadapters = 32\nskewness = 8\nreplicas = 4\n\
                [batch]\nmax_batch = 256\n[cluster]\nroute_cost = \"artifact\"\nswap_bytes_per_ms = 1000.0\n";
    let mut s = scenario(text);
    assert_eq!(s.cluster.route_cost, RouteCost::Artifact);
    s.cluster.dispatch = Dispatch::Proactive;
    let piled = simulate(&s, Policy::Dlora).unwrap();
    s.cluster.dispatch = Dispatch::Dlora;
    let moved = simulate(&s, Policy::Dlora).unwrap();
    s.cluster.route_cost = RouteCost::Pending;
    s.cluster.dispatch = Dispatch::Proactive;
    let ours = simulate(&s, Policy::Dlora).unwrap();
    for r in [&piled, &moved, &ours] {
        assert_eq!(r.finished, r.requests);
    }
    assert!(moved.migrations > 0);
    assert!(
        piled.avg_queue_s > 2.0 * moved.avg_queue_s && piled.avg_queue_s > 2.0 * ours.avg_queue_s,
        "artifact proactive {} s, with migration {} s, ours {} s",
        piled.avg_queue_s,
        moved.avg_queue_s,
        ours.avg_queue_s
    );
}

#[test]
fn the_artifacts_placement_is_blind_to_the_workload_and_fills_to_g_plus_m_minus_one() {
    // 8 replicas, 32 adapters: adapter a on replica a mod 8, then 7 more replicas.
    let seq = place_artifact(32, 8, 16, ArtifactFill::Sequential).unwrap();
    for (j, on) in seq.iter().enumerate() {
        let mut want: Vec<u32> = (0..4).map(|k| j as u32 + 8 * k).collect();
        if j < 7 {
            // Round-robin over replicas and adapters, skipping what a replica holds: replica 0
            // skips adapter 0 and takes 1, replica 1 then takes 2, and so on.
            want.push(j as u32 + 1);
        }
        assert_eq!(on, &want, "replica {j}");
    }
    // The periodic-migration mode spreads one adapter to every replica.
    let spread = place_artifact(32, 8, 16, ArtifactFill::Spread(5)).unwrap();
    assert_eq!(spread.iter().map(Vec::len).sum::<usize>(), 39);
    assert!(spread.iter().all(|on| on.contains(&5)));
    assert_eq!(spread.iter().filter(|on| on.len() == 5).count(), 7);
    // One adapter on three replicas: it is everywhere (G + M − 1 = 3).
    assert_eq!(place_artifact(1, 3, 16, ArtifactFill::Sequential).unwrap(), vec![vec![0], vec![0], vec![0]]);
    // A replica holds at most `cap`: with 2 per replica, 4 adapters on 2 replicas are full.
    assert_eq!(place_artifact(4, 2, 2, ArtifactFill::Sequential).unwrap(), vec![vec![0, 2], vec![1, 3]]);
    assert!(place_artifact(5, 2, 2, ArtifactFill::Sequential).is_err());
    assert!(place_artifact(4, 2, 4, ArtifactFill::Spread(4)).is_err());
}

#[test]
fn the_artifacts_substitution_swaps_an_idle_adapter_held_elsewhere_too() {
    let on = vec![vec![0, 1], vec![1, 2], vec![3]];
    let none: Vec<Vec<u32>> = vec![vec![], vec![], vec![]];
    // Replica 1 can give up adapter 1 (also on replica 0), not 2 (only there).
    assert_eq!(substitute(&on, &none, 1, 0), Some(1));
    // Not while a request of adapter 1 waits there.
    assert_eq!(substitute(&on, &[vec![], vec![1], vec![]], 1, 0), None);
    // Replica 2's only adapter has no other replica; replica 0 swaps 1 (lowest id held elsewhere).
    assert_eq!(substitute(&on, &none, 2, 0), None);
    assert_eq!(substitute(&on, &none, 0, 3), Some(1));
    // Never the request's own adapter.
    assert_eq!(substitute(&on, &none, 0, 1), None);
}

#[test]
fn under_the_artifacts_routing_rr_piles_on_one_holder_dlora_keeps_to_holders_and_proactive_swaps() {
    // Four replicas, 8 adapters, adapter 0 half the load; batches of 8 so the artifact's cost
    // (batches queued) grows within the run; a load the aware placement queues 0.3 s under.
    let text = "duration_s = 20\nrate_rps = 2\nadapters = 8\nskewness = 16\nfunctions = 256\nreplicas = 4\n\
                [batch]\nmax_batch = 8\n[cluster]\nroute_cost = \"artifact\"\nplacement = \"artifact\"\n\
                monitor_ms = 1e9\n";
    let mut s = scenario(text);
    assert_eq!(s.cluster.placement, Placement::Artifact);
    let run = |s: &LoraScenario, d: Dispatch| {
        let mut s = s.clone();
        s.cluster.dispatch = d;
        let r = simulate(&s, Policy::Dlora).unwrap();
        assert_eq!(r.finished, r.requests, "{d:?}");
        r
    };
    let rr = run(&s, Dispatch::Rr);
    let holders = run(&s, Dispatch::Dlora);
    let swapping = run(&s, Dispatch::Proactive);
    assert_eq!(rr.adapter_loads, 0);
    // The monitor never fires, so dlora's only loads would be routing's: none.
    assert_eq!((holders.adapter_loads, holders.migrations), (0, 0));
    assert!(swapping.adapter_loads > 0);
    // Adapter 0's one holder carries half the load under round-robin; the burst-tolerance
    // placement gives it replicas and queues far less.
    s.cluster.placement = Placement::Burst;
    let aware = run(&s, Dispatch::Rr);
    assert!(rr.avg_queue_s > 2.0 * aware.avg_queue_s, "blind {} s, aware {} s", rr.avg_queue_s, aware.avg_queue_s);
}

#[test]
fn under_the_artifacts_routing_rr_is_its_dispatch_only_mode() {
    // The artifact's Figure 11 setting. Its blind placement gives adapter 1 (10% of the load) a
    // second replica on replica 0 beside adapter 0 (37%). Round-robin splits adapter 1 between
    // its holders; the artifact's dispatch-only mode sends it to the first holder (every cost is
    // 0 below 256 requests a replica), which saturates replica 0 at 16 req/s.
    let path = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scenarios/lora_8gpu_artifact.toml"));
    let mut s = LoraScenario::load(path).unwrap();
    (s.rate_rps, s.cluster.dispatch) = (16.0, Dispatch::Rr);
    let artifact = simulate(&s, Policy::UnmergedOnly).unwrap();
    s.cluster.route_cost = RouteCost::Pending;
    let rotation = simulate(&s, Policy::UnmergedOnly).unwrap();
    assert_eq!((artifact.adapter_loads, rotation.adapter_loads), (0, 0));
    assert!(
        artifact.avg_queue_s > 10.0 * rotation.avg_queue_s,
        "dispatch-only {} s, round-robin {} s",
        artifact.avg_queue_s,
        rotation.avg_queue_s
    );
}
