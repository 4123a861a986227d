use std::time::Duration;

use super::*;
use crate::emulated::Emulated;
use crate::zigzag::{best_effort, zigzag, Instance};

/// The real-time tests run one at a time: run side by side on this 2-core machine, their
/// threads delay each other's wake-ups, which is not what they measure.
static TIMING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn timing() -> std::sync::MutexGuard<'static, ()> {
    TIMING.lock().unwrap_or_else(|e| e.into_inner())
}

fn one_token() -> Activation {
    Activation::new(vec![vec![1]], vec![vec![1]]).unwrap()
}

/// Runs `x` for real with emulated layers of `unit` and compares each batch's latency, in units,
/// with the planner's prediction: the worst batch's error, or the first batch more than 5% off.
fn run_once(inst: &Instance, x: &[u32], predicted: &[u64], unit: Duration) -> Result<f64, String> {
    let l = inst.layers as usize;
    let (new, old) = (Emulated::uniform(l, unit), Emulated::uniform(l, unit));
    let batches = (0..x.len()).map(|_| one_token()).collect();
    let out = run_cooperative(&new, &old, batches, x, Residency::LoadingEvery(unit * inst.load_ratio)).unwrap();
    let mut worst = 0.0f64;
    for (i, ((t, act), want)) in out.iter().zip(predicted).enumerate() {
        assert_eq!(act.next_layer, l, "batch {i} ran every layer");
        let got = t.as_secs_f64() / unit.as_secs_f64();
        let err = (got - *want as f64).abs() / *want as f64;
        worst = worst.max(err);
        if err > 0.05 {
            return Err(format!("batch {i}: measured {got:.2} units, planned {want} ({:.1}% off)", err * 100.0));
        }
    }
    Ok(worst)
}

/// [`run_once`] within 5% for every batch, in the best of up to three runs. The layers are real
/// sleeps, and this binary's other tests (real candle compute among them) run beside these on
/// two cores, so a run can only come out *slower* than the plan when the machine is busy, never
/// faster: a run within 5% shows the executor follows the plan; three runs off it fail.
fn check(inst: &Instance, x: &[u32], predicted: &[u64], unit: Duration) {
    let mut errors = Vec::new();
    for _ in 0..3 {
        match run_once(inst, x, predicted, unit) {
            Ok(worst) => {
                eprintln!(
                    "L = {}, T = {}, x = {x:?}: worst batch {:.2}% off the plan ({} slower runs before)",
                    inst.layers,
                    inst.load_ratio,
                    worst * 100.0,
                    errors.len()
                );
                return;
            }
            Err(e) => errors.push(e),
        }
    }
    panic!("x {x:?}: three runs off the plan: {errors:?}");
}

#[test]
fn figure_12_runs_as_planned() {
    let _t = timing();
    let inst = Instance::uniform(7, 6, 6);
    let z = zigzag(&inst).unwrap();
    check(&inst, &z.x, &z.latencies, Duration::from_millis(40));
    let b = best_effort(&inst).unwrap();
    check(&inst, &b.x, &b.latencies, Duration::from_millis(40));
}

#[test]
fn a_32_layer_model_runs_as_planned() {
    let _t = timing();
    let inst = Instance::uniform(32, 4, 12);
    let z = zigzag(&inst).unwrap();
    // 12 ms units: a thread's wake-up delay under load is a smaller share of each layer.
    check(&inst, &z.x, &z.latencies, Duration::from_millis(12));
}

#[test]
fn splits_that_leave_nothing_for_old_are_refused() {
    let e = Emulated::uniform(3, Duration::ZERO);
    let r = Residency::LoadingEvery(Duration::ZERO);
    assert!(run_cooperative(&e, &e, vec![one_token()], &[3], r).is_err());
    assert!(run_cooperative(&e, &e, vec![one_token()], &[1, 1], r).is_err());
    // A split into layers new never holds.
    assert!(run_cooperative(&e, &e, vec![one_token()], &[2], Residency::First(1)).is_err());
}

/// BlitzScale Figure 7(d): with k of L layers resident on new, cooperative execution serves
/// about L / (L − min(k, L/2)) times one instance's throughput (within 10%).
///
/// The layers are real sleeps, and the rest of this binary's tests (real candle compute among
/// them) run beside this one on two cores, so a run can only come out *slower* than the
/// pipeline allows, never faster. Each k therefore takes the best of up to three runs, as a
/// benchmark takes its minimum: a pipeline that does not overlap new and old misses the model
/// on every run, while one delayed wake-up no longer fails the test.
#[test]
fn cooperative_throughput_rises_with_the_resident_layers() {
    let _t = timing();
    let (l, n, unit) = (8usize, 40usize, Duration::from_millis(5));
    let e = Emulated::uniform(l, unit);
    let single = (n * l) as f64 * unit.as_secs_f64();
    for k in [1, 2, 4, 6, 8] {
        let split = k.min(l / 2) as u32;
        let want = l as f64 / (l - split as usize) as f64;
        let mut runs = Vec::new();
        for _ in 0..3 {
            let batches = (0..n).map(|_| one_token()).collect();
            let out = run_cooperative(&e, &e, batches, &vec![split; n], Residency::First(k)).unwrap();
            let got = single / out.last().unwrap().0.as_secs_f64();
            runs.push(got);
            if (got / want - 1.0).abs() <= 0.10 {
                break;
            }
        }
        let got = runs.iter().copied().fold(f64::MIN, f64::max);
        eprintln!("k = {k} of {l}: {got:.3}x one instance (model {want:.3}x; runs {runs:.3?})");
        assert!((got / want - 1.0).abs() <= 0.10, "k = {k}: {runs:.3?}x, model {want:.3}x");
    }
}
