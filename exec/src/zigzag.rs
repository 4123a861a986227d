//! Zigzag scheduling of cooperative execution while a scaling instance loads (BlitzScale, seed
//! `004_…`, §5.2 and Figure 12). Pure: no I/O, no clock.
//!
//! An overloaded instance (*old*) holds every layer; a scaling one (*new*) receives its layers one
//! by one. Each queued batch `i` runs its first `x_i` layers on new and the other `L − x_i` on old,
//! which receives the activation. The paper formulates the choice of every `x_i` as an ILP whose
//! formulas are missing from our copy of the text, so this module uses the model below instead
//! (the issue's, stated here in full) and solves it exactly.
//!
//! **Model.** The time unit is one layer's execution of one batch. Layer `k` (1-based) becomes
//! resident on new at `(k − 1)·T` (`T` = per-layer load time ÷ per-layer execution time; `t = 0`
//! when layer 1 is resident). `N` batches are queued at `t = 0`, served FIFO. Old runs its parts
//! back to back: it starts batch `i` (0-based) at `S_i = Σ_{j<i} (L − x_j)` and finishes it at
//! `S_i + L − x_i`, its latency. New runs one layer at a time, only resident layers, the lowest
//! batch first (a landing layer preempts work on later batches). Old may start batch `i` only once
//! new finished its `x_i` layers:
//! * C2: `Σ_{j≤i} x_j ≤ S_i` (new has done all its work for batches `0..=i` by then);
//! * C3: `x_i ≥ 1 ⇒ T·(x_i − 1) + 1 ≤ S_i` (its last layer was resident and run by then).
//!
//! Minimise `Σ w_i · latency_i` (`w_i = 1` unless batches carry weights, e.g. prefill tokens).
//! Every `x_i < L` (a batch always ends on old). [`zigzag`] solves this exactly by dynamic
//! programming over `(i, Σ_{j<i} x_j)`: the latency of batch `i` and both constraints depend only
//! on that prefix sum and `x_i`. No ILP solver is needed. The property tests check the optimum
//! against an exhaustive search over the exact event [`simulate`] on small instances.
//!
//! **Its size.** The program has `N · (N·(L − 1) + 1)` cells and up to `L` steps a cell
//! ([`dp_steps`]): quadratic in the batches. [`zigzag`] refuses, before it allocates anything, an
//! instance over [`MAX_DP_CELLS`] cells or [`MAX_DP_STEPS`] steps ([`ZigzagError::TooLarge`]);
//! a caller with a long queue plans its first [`batches_within`] batches and splits the rest
//! otherwise (the router splits them best-effort at dispatch).
//!
//! **Best effort** (the paper's Figure 12(a)) fixes each batch's split when the batch is
//! scheduled: as many layers on new as are resident at that moment, at most `⌊L/2⌋`. Batches
//! queued at `t = 0`, while only layer 1 is resident, all get `x = 1`; [`simulate`] then gives
//! their latencies (old waits for new where C2/C3 do not hold).

/// One planning problem.
#[derive(Debug, Clone, PartialEq)]
pub struct Instance {
    /// Layers of the model, `L ≥ 1`.
    pub layers: u32,
    /// Load time of one layer over the execution time of one layer, `T ≥ 1`.
    pub load_ratio: u32,
    /// Weight of each queued batch (its length is the number of batches `N`).
    pub weights: Vec<f64>,
}

impl Instance {
    /// `batches` batches of weight 1.
    pub fn uniform(layers: u32, load_ratio: u32, batches: usize) -> Instance {
        Instance { layers, load_ratio, weights: vec![1.0; batches] }
    }

    /// Number of batches.
    pub fn batches(&self) -> usize {
        self.weights.len()
    }

    fn check(&self) -> Result<(), ZigzagError> {
        if self.layers == 0 {
            return Err(ZigzagError::Invalid("a model has at least one layer".into()));
        }
        if self.load_ratio == 0 {
            return Err(ZigzagError::Invalid("the load ratio T is at least 1".into()));
        }
        if self.weights.len() > MAX_BATCHES {
            return Err(ZigzagError::Invalid(format!("at most {MAX_BATCHES} batches")));
        }
        if self.layers > MAX_LAYERS {
            return Err(ZigzagError::Invalid(format!("at most {MAX_LAYERS} layers")));
        }
        if let Some(w) = self.weights.iter().find(|w| !w.is_finite() || **w < 0.0) {
            return Err(ZigzagError::Invalid(format!("weight {w}: weights are finite and ≥ 0")));
        }
        Ok(())
    }
}

/// Most batches a plan takes.
pub const MAX_BATCHES: usize = 4096;
/// Most layers a plan takes.
pub const MAX_LAYERS: u32 = 4096;
/// Most cells of [`zigzag`]'s dynamic program (2 bytes each: 128 MiB).
pub const MAX_DP_CELLS: u64 = 1 << 26;
/// Most steps of [`zigzag`]'s dynamic program (0.3 s at 32 layers on one core here, release build).
pub const MAX_DP_STEPS: u64 = 1 << 30;

/// Cells of [`zigzag`]'s dynamic program for `batches` batches over `layers` layers: one per
/// batch and prefix sum `Σ_{j<i} x_j ∈ [0, N·(L − 1)]`.
pub fn dp_cells(layers: u32, batches: usize) -> u64 {
    let (n, l) = (batches as u64, u64::from(layers));
    n.saturating_mul(n.saturating_mul(l.saturating_sub(1)).saturating_add(1))
}

/// An upper bound on the steps of [`zigzag`]'s dynamic program: every cell tries up to `L` splits.
pub fn dp_steps(layers: u32, batches: usize) -> u64 {
    dp_cells(layers, batches).saturating_mul(u64::from(layers))
}

/// The most batches (at most [`MAX_BATCHES`]) that [`zigzag`] plans over `layers` layers within
/// `steps` steps of its dynamic program, and within [`MAX_DP_CELLS`] and [`MAX_DP_STEPS`]: the
/// longest prefix of a queue worth planning exactly.
pub fn batches_within(layers: u32, steps: u64) -> usize {
    let fits = |n: usize| dp_cells(layers, n) <= MAX_DP_CELLS && dp_steps(layers, n) <= steps.min(MAX_DP_STEPS);
    // Both grow with n: the largest n that fits, by bisection on [0, MAX_BATCHES].
    let (mut lo, mut hi) = (0, MAX_BATCHES);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Why a plan could not be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ZigzagError {
    /// The instance is malformed.
    #[error("invalid instance: {0}")]
    Invalid(String),
    /// A split does not fit the instance.
    #[error("split {x:?}: {why}")]
    BadSplit {
        /// The split.
        x: Vec<u32>,
        /// What is wrong.
        why: String,
    },
    /// The exact plan would take more memory or time than the planner allows itself.
    #[error(
        "{batches} batches over {layers} layers: the exact plan needs {cells} cells and up to {steps} steps \
         (at most {max_cells} and {max_steps}); plan the first {fits} batches and split the rest otherwise"
    )]
    TooLarge {
        /// Batches asked for.
        batches: usize,
        /// Layers of the model.
        layers: u32,
        /// Cells the dynamic program would need.
        cells: u64,
        /// Steps it could take.
        steps: u64,
        /// [`MAX_DP_CELLS`].
        max_cells: u64,
        /// [`MAX_DP_STEPS`].
        max_steps: u64,
        /// The most batches that fit ([`batches_within`]).
        fits: usize,
    },
}

/// A schedule: each batch's split and the latencies that follow from it.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// Layers of each batch run on new.
    pub x: Vec<u32>,
    /// Each batch's latency (time units since `t = 0`).
    pub latencies: Vec<u64>,
}

impl Schedule {
    /// Σ latency.
    pub fn sum(&self) -> u64 {
        self.latencies.iter().sum()
    }

    /// The largest latency.
    pub fn max(&self) -> u64 {
        self.latencies.iter().copied().max().unwrap_or(0)
    }

    /// Σ w_i · latency_i.
    pub fn weighted(&self, weights: &[f64]) -> f64 {
        // A fold from +0: `Sum` for floats starts at −0, which an empty queue printed as "-0.0".
        self.latencies.iter().zip(weights).fold(0.0, |s, (l, w)| s + *l as f64 * w)
    }
}

cascade_sched::named_enum! {
    /// The policies [`plan`] knows.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Policy("policy") {
        /// The exact optimum of the model.
        Zigzag = "zigzag",
        /// The paper's baseline: each batch's split fixed when it is scheduled.
        BestEffort = "best-effort",
    }
}

/// The schedule of `policy` for `inst`.
pub fn plan(inst: &Instance, policy: Policy) -> Result<Schedule, ZigzagError> {
    match policy {
        Policy::Zigzag => zigzag(inst),
        Policy::BestEffort => best_effort(inst),
    }
}

/// The exact optimum of the model (see the module docs), by dynamic programming over
/// `(batch, layers given to new so far)`.
pub fn zigzag(inst: &Instance) -> Result<Schedule, ZigzagError> {
    inst.check()?;
    let (n, l, t) = (inst.batches(), u64::from(inst.layers), u64::from(inst.load_ratio));
    if n == 0 {
        return Ok(Schedule { x: vec![], latencies: vec![] });
    }
    let (cells, steps) = (dp_cells(inst.layers, n), dp_steps(inst.layers, n));
    if cells > MAX_DP_CELLS || steps > MAX_DP_STEPS {
        return Err(ZigzagError::TooLarge {
            batches: n,
            layers: inst.layers,
            cells,
            steps,
            max_cells: MAX_DP_CELLS,
            max_steps: MAX_DP_STEPS,
            fits: batches_within(inst.layers, MAX_DP_STEPS),
        });
    }
    let max_sum = n as u64 * (l - 1);
    let width = max_sum as usize + 1;
    // cost[i][X]: least weighted latency of batches i.. given Σ_{j<i} x_j = X (∞ if infeasible);
    // choice[i][X]: the x_i that achieves it (x < L ≤ MAX_LAYERS fits 16 bits).
    let mut next = vec![0.0f64; width];
    let mut choice = vec![vec![0u16; width]; n];
    for i in (0..n).rev() {
        let mut cost = vec![f64::INFINITY; width];
        let before = i as u64 * l; // Σ_{j<i} L
        for big_x in 0..=(i as u64 * (l - 1)).min(max_sum) {
            if big_x > before {
                break;
            }
            let start = before - big_x; // S_i
            let mut best = (f64::INFINITY, 0u16);
            for x in 0..l {
                if big_x + x > start {
                    break; // C2, and larger x only worse
                }
                if x >= 1 && t * (x - 1) + 1 > start {
                    break; // C3
                }
                let latency = (start + l - x) as f64;
                let c = inst.weights[i] * latency + next[(big_x + x) as usize];
                if c < best.0 {
                    best = (c, x as u16);
                }
            }
            cost[big_x as usize] = best.0;
            choice[i][big_x as usize] = best.1;
        }
        next = cost;
    }
    let mut x = Vec::with_capacity(n);
    let mut big_x = 0usize;
    for row in &choice {
        let xi = row[big_x];
        x.push(u32::from(xi));
        big_x += usize::from(xi);
    }
    let latencies = model_latencies(inst, &x);
    Ok(Schedule { x, latencies })
}

/// The paper's best-effort baseline for batches queued at `t = 0`: every split is `min(1, ⌊L/2⌋)`
/// (one layer resident then), latencies from the event simulation.
pub fn best_effort(inst: &Instance) -> Result<Schedule, ZigzagError> {
    inst.check()?;
    let x = vec![1.min(inst.layers / 2); inst.batches()];
    let latencies = simulate(inst, &x)?;
    Ok(Schedule { x, latencies })
}

/// Latencies under the model's formula (`S_i + L − x_i`), for a split that meets C2 and C3.
fn model_latencies(inst: &Instance, x: &[u32]) -> Vec<u64> {
    let l = u64::from(inst.layers);
    let mut start = 0u64;
    x.iter()
        .map(|&xi| {
            let done = start + l - u64::from(xi);
            start = done;
            done
        })
        .collect()
}

/// The exact event simulation of a split: new runs one resident layer at a time for the lowest
/// batch that has one to run; old runs batches FIFO, each once new finished its part and old is
/// free. Returns each batch's latency. A batch with `x_i = L` finishes on new.
pub fn simulate(inst: &Instance, x: &[u32]) -> Result<Vec<u64>, ZigzagError> {
    inst.check()?;
    let (l, t) = (inst.layers, u64::from(inst.load_ratio));
    if x.len() != inst.batches() {
        let why = format!("{} splits for {} batches", x.len(), inst.batches());
        return Err(ZigzagError::BadSplit { x: x.to_vec(), why });
    }
    if x.iter().any(|&xi| xi > l) {
        return Err(ZigzagError::BadSplit { x: x.to_vec(), why: format!("more than the {l} layers") });
    }
    // New's schedule, unit step by unit step: done[i] layers of batch i run so far.
    let mut done = vec![0u32; x.len()];
    let mut new_finish: Vec<u64> = x.iter().map(|_| 0).collect();
    let mut left: u64 = x.iter().map(|&v| u64::from(v)).sum();
    let mut now = 0u64;
    while left > 0 {
        // Layer k+1 (0-based k = done[i]) is resident from k·T.
        let pick = (0..x.len()).find(|&i| done[i] < x[i] && u64::from(done[i]) * t <= now);
        match pick {
            Some(i) => {
                done[i] += 1;
                left -= 1;
                now += 1;
                if done[i] == x[i] {
                    new_finish[i] = now;
                }
            }
            None => {
                // Idle until the next layer someone needs lands.
                now = (0..x.len()).filter(|&i| done[i] < x[i]).map(|i| u64::from(done[i]) * t).min().unwrap_or(now);
            }
        }
    }
    // Old: FIFO, back to back where new allows.
    let mut free = 0u64;
    Ok(x.iter()
        .zip(&new_finish)
        .map(|(&xi, &ready)| {
            if xi == l {
                return ready;
            }
            let begin = free.max(ready);
            free = begin + u64::from(l - xi);
            free
        })
        .collect())
}

#[cfg(test)]
mod tests;
