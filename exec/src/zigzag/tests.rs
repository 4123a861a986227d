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
    assert!(zigzag(&Instance { weights: vec![1.0, f64::NAN], ..Instance::uniform(4, 1, 0) }).is_err());
    let inst = Instance::uniform(4, 2, 2);
    assert!(simulate(&inst, &[1]).is_err());
    assert!(simulate(&inst, &[5, 0]).is_err());
    assert_eq!(zigzag(&Instance::uniform(4, 2, 0)).unwrap().x, Vec::<u32>::new());
    let no_layer = Start { resident: 0, ..Start::default() };
    assert!(zigzag(&Instance { start: no_layer, ..Instance::uniform(4, 2, 1) }).is_err());
    let far = Start { old_busy: MAX_OFFSET + 1, ..Start::default() };
    assert!(zigzag(&Instance { start: far, ..Instance::uniform(4, 2, 1) }).is_err());
}

#[test]
fn the_default_start_is_the_papers() {
    // r = 1, τ = T, nobody busy: the same plan as written out in the golden case.
    let paper = Instance::uniform(7, 6, 6);
    let explicit = Start { resident: 1, next_in: Some(6), old_busy: 0, new_busy: 0 };
    let z = zigzag(&Instance { start: explicit, ..paper.clone() }).unwrap();
    assert_eq!(z, zigzag(&paper).unwrap());
    // Later in the load, with every layer resident and old still busy, new takes more of the
    // work than from t = 0, and the batches finish sooner.
    let late = Start { resident: 7, next_in: None, old_busy: 3, new_busy: 0 };
    let inst = Instance { start: late, ..paper.clone() };
    let z = zigzag(&inst).unwrap();
    assert_eq!(simulate(&inst, &z.x).unwrap(), z.latencies);
    assert!(z.x.iter().sum::<u32>() > zigzag(&paper).unwrap().x.iter().sum::<u32>(), "{:?}", z.x);
    assert!(z.sum() < zigzag(&paper).unwrap().sum());
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
        let inst = Instance { weights: weights.iter().map(|&w| f64::from(w)).collect(), ..Instance::uniform(layers, load_ratio, 0) };
        let z = zigzag(&inst).unwrap();
        prop_assert_eq!(&simulate(&inst, &z.x).unwrap(), &z.latencies);
        let ours = z.weighted(&inst.weights);
        let best = exhaustive(&inst);
        prop_assert!((ours - best).abs() < 1e-9, "dp {} vs exhaustive {} for x {:?}", ours, best, z.x);
        // Best effort is never better than the optimum.
        prop_assert!(best_effort(&inst).unwrap().weighted(&inst.weights) >= ours - 1e-9);
    }

    /// The same from any later moment of a load (re-planning): layers already resident, the next
    /// one landing at any time, and either instance still busy with earlier work.
    #[test]
    fn a_later_start_is_optimal_too(
        layers in 1u32..6, load_ratio in 1u32..6, weights in proptest::collection::vec(0u32..4, 0..5),
        resident in 1u32..5, next_in in proptest::option::of(0u64..9), old_busy in 0u64..8, new_busy in 0u64..8,
    ) {
        let start = Start { resident, next_in, old_busy, new_busy };
        let inst = Instance { weights: weights.iter().map(|&w| f64::from(w)).collect(), start, ..Instance::uniform(layers, load_ratio, 0) };
        let z = zigzag(&inst).unwrap();
        prop_assert_eq!(&simulate(&inst, &z.x).unwrap(), &z.latencies);
        let ours = z.weighted(&inst.weights);
        let best = exhaustive(&inst);
        prop_assert!((ours - best).abs() < 1e-9, "dp {} vs exhaustive {} for x {:?}", ours, best, z.x);
        prop_assert!(best_effort(&inst).unwrap().weighted(&inst.weights) >= ours - 1e-9);
    }
}
