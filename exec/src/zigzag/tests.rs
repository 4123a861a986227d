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
