//! Symphony's autoscaling advice (§4.4): with a flat-top scheduler, the bad rate above the peak
//! and the GPU idle fraction below it say how many GPUs to add or release.

use serde::Serialize;

/// What to do with the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Advice {
    /// GPUs to add: N·r/(1−r) when the bad rate r exceeds the threshold.
    pub add_gpus: f64,
    /// GPUs to release: N·f for an idle fraction f (when nothing is to be added).
    pub release_gpus: f64,
}

/// Advice for `gpus` GPUs that saw `bad_rate` and `idle_fraction`; `threshold` is the bad rate
/// tolerated (e.g. 0.01).
pub fn advise(gpus: usize, bad_rate: f64, idle_fraction: f64, threshold: f64) -> Advice {
    let n = gpus as f64;
    if bad_rate > threshold {
        let r = bad_rate.min(0.99);
        Advice { add_gpus: n * r / (1.0 - r), release_gpus: 0.0 }
    } else {
        Advice { add_gpus: 0.0, release_gpus: n * idle_fraction.clamp(0.0, 1.0) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advice_follows_section_4_4() {
        let a = advise(8, 0.2, 0.0, 0.01);
        assert!((a.add_gpus - 2.0).abs() < 1e-9, "8 · 0.2 / 0.8 = 2");
        let r = advise(8, 0.001, 0.5, 0.01);
        assert_eq!(r, Advice { add_gpus: 0.0, release_gpus: 4.0 });
    }
}
