use proptest::prelude::*;

use super::*;

#[test]
fn figure_12_golden_case() {
    let inst = Instance::uniform(7, 6, 6);
    let z = zigzag(&inst).unwrap();
    assert_eq!(z.x, [0, 2, 2, 3, 4, 4]);
    assert_eq!(z.latencies, [7, 12, 17, 21, 24, 27]);
    assert_eq!((z.sum(), z.max()), (108, 27));
    // The model's latencies are the ones the event simulation gives.
    assert_eq!(simulate(&inst, &z.x).unwrap(), z.latencies);
    let b = best_effort(&inst).unwrap();
    assert_eq!(b.x, [1; 6]);
    assert_eq!(b.latencies, [7, 13, 19, 25, 31, 37]);
    assert_eq!(b.sum(), 132);
}

#[test]
fn bad_input_is_refused() {
    assert!(zigzag(&Instance::uniform(0, 1, 1)).is_err());
    assert!(zigzag(&Instance::uniform(4, 0, 1)).is_err());
    assert!(zigzag(&Instance { layers: 4, load_ratio: 1, weights: vec![1.0, f64::NAN] }).is_err());
    let inst = Instance::uniform(4, 2, 2);
    assert!(simulate(&inst, &[1]).is_err());
    assert!(simulate(&inst, &[5, 0]).is_err());
    assert_eq!(zigzag(&Instance::uniform(4, 2, 0)).unwrap().x, Vec::<u32>::new());
}

#[test]
fn an_instance_too_large_to_plan_exactly_is_refused_before_anything_is_allocated() {
    // 4,096 batches over 4,096 layers: 6.9·10¹⁰ cells, 137 GB of choices. Before the bound the
    // planner tried to allocate them and the process aborted.
    let big = Instance::uniform(MAX_LAYERS, 1, MAX_BATCHES);
    let fits = batches_within(MAX_LAYERS, MAX_DP_STEPS);
    let e = zigzag(&big).expect_err("refused");
    let text = e.to_string();
    let ZigzagError::TooLarge { batches, layers, cells, steps, fits: f, .. } = e else {
        panic!("expected TooLarge: {e:?}")
    };
    assert_eq!((batches, layers, f), (MAX_BATCHES, MAX_LAYERS, fits));
    assert_eq!((cells, steps), (dp_cells(MAX_LAYERS, MAX_BATCHES), dp_steps(MAX_LAYERS, MAX_BATCHES)));
    assert!(cells > MAX_DP_CELLS && steps > MAX_DP_STEPS);
    assert!(
        text.contains("4096 batches over 4096 layers") && text.contains(&format!("plan the first {fits} batches")),
        "{text}"
    );
    // Many batches of a small model, too: 4,096 over 32 layers is 5.2·10⁸ cells.
    assert!(matches!(zigzag(&Instance::uniform(32, 4, MAX_BATCHES)), Err(ZigzagError::TooLarge { .. })));
    // The planner-speed cases are well inside the bounds.
    assert!(batches_within(32, MAX_DP_STEPS) >= 12 && batches_within(80, MAX_DP_STEPS) >= 16);
    assert!(zigzag(&Instance::uniform(80, 4, 16)).is_ok());
}

#[test]
fn batches_within_is_the_longest_prefix_whose_program_fits() {
    for layers in [1, 2, 7, 32, 80, MAX_LAYERS] {
        for budget in [0, 1, 100, 10_000, 1 << 22, MAX_DP_STEPS, u64::MAX] {
            let n = batches_within(layers, budget);
            let fits =
                |n: usize| dp_steps(layers, n) <= budget.min(MAX_DP_STEPS) && dp_cells(layers, n) <= MAX_DP_CELLS;
            assert!(fits(n), "L = {layers}, budget {budget}: {n} batches do not fit");
            assert!(n == MAX_BATCHES || !fits(n + 1), "L = {layers}, budget {budget}: {} batches fit too", n + 1);
        }
    }
    // A prefix that fits a small budget is planned, and its optimum is the exhaustive one.
    let n = batches_within(4, 600); // 6 · 19 · 4 = 456 steps; 7 batches take 616
    assert_eq!(n, 6);
    let inst = Instance::uniform(4, 2, n);
    assert_eq!(zigzag(&inst).unwrap().weighted(&inst.weights), exhaustive(&inst));
}

/// An empty queue plans nothing at no cost: +0, not the −0 `zigzag --batches 0 --json` printed.
#[test]
fn an_empty_queue_costs_a_positive_zero() {
    let inst = Instance::uniform(7, 6, 0);
    for s in [zigzag(&inst).unwrap(), best_effort(&inst).unwrap()] {
        assert!(s.x.is_empty());
        let w = s.weighted(&inst.weights);
        assert!(w == 0.0 && w.is_sign_positive(), "{w:?}");
    }
}

#[test]
fn one_layer_models_run_on_old_only() {
    let z = zigzag(&Instance::uniform(1, 3, 3)).unwrap();
    assert_eq!(z.x, [0, 0, 0]);
    assert_eq!(z.latencies, [1, 2, 3]);
}

/// Every split with every x_i < L, simulated: the least weighted latency.
fn exhaustive(inst: &Instance) -> f64 {
    let (n, l) = (inst.batches(), inst.layers);
    let mut x = vec![0u32; n];
    let mut best = f64::INFINITY;
    loop {
        let lat = simulate(inst, &x).unwrap();
        best = best.min(lat.iter().zip(&inst.weights).map(|(a, w)| *a as f64 * w).sum());
        let mut i = 0;
        loop {
            if i == n {
                return best;
            }
            x[i] += 1;
            if x[i] < l {
                break;
            }
            x[i] = 0;
            i += 1;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    /// The DP's optimum over the model equals the best of every split run through the exact
    /// event simulation, and the simulation gives the model's latencies for the DP's split.
    #[test]
    fn the_optimum_equals_exhaustive_search_over_the_simulation(
        layers in 1u32..6, load_ratio in 1u32..6, weights in proptest::collection::vec(0u32..4, 0..5),
    ) {
        let inst = Instance { layers, load_ratio, weights: weights.iter().map(|&w| f64::from(w)).collect() };
        let z = zigzag(&inst).unwrap();
        prop_assert_eq!(&simulate(&inst, &z.x).unwrap(), &z.latencies);
        let ours = z.weighted(&inst.weights);
        let best = exhaustive(&inst);
        prop_assert!((ours - best).abs() < 1e-9, "dp {} vs exhaustive {} for x {:?}", ours, best, z.x);
        // Best effort is never better than the optimum.
        prop_assert!(best_effort(&inst).unwrap().weighted(&inst.weights) >= ours - 1e-9);
    }
}
