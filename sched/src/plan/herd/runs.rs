//! HERD's second construction: each affinity set's model-streams sorted by the GPUs they need
//! and cut into contiguous *runs*, one run per group, by a dynamic programme, with bisection on
//! the burst tolerance t.
//!
//! Why runs: at a given t every stream i of group j needs size_j ≥ L_j + (t − 1)·n_i, so a group
//! costs ⌈L_j + (t − 1)·n_max,j⌉ GPUs (t ≥ 1; with t < 1 the smallest stream binds instead).
//! Σ L_j is fixed; what a plan chooses is the Σ n_max,j it pays, and putting streams of similar
//! size together pays each large n once. The greedy plan spreads the largest streams over the
//! groups instead, and pays every one of them (measured on `herd_1000x10.toml`: min bt 15.98
//! greedy, 43.79 by runs, against the bound 55.9).
//!
//! For a fixed t the programme finds, per affinity set, the fewest GPUs that cover its streams
//! with g runs (each within Ḡ GPUs and one GPU's memory), then shares the groups among the sets
//! by a knapsack; t is feasible when that total fits the cluster. This is a heuristic for the
//! ILP (contiguity in n is not always optimal once memory binds), used beside the greedy plan;
//! not from the paper.

use std::time::Instant;

use super::HerdProblem;

/// Bisection steps on t: the interval shrinks by 2⁻⁴⁰, far below any difference a plan makes.
const STEPS: usize = 40;

impl HerdProblem {
    /// The sorted-runs plan with the highest t the bisection reaches by `deadline` (it stops
    /// there with the best t so far; the two end points are always tried): a group per stream.
    /// `None` when not even the lowest t fits (more affinity sets than groups, a stream too large
    /// for one GPU's memory, or fewer GPUs than the runs need).
    pub(crate) fn runs(&self, deadline: Instant) -> Option<Vec<usize>> {
        let sets = self.affinity_sets();
        if sets.len() > self.groups {
            return None;
        }
        if self.streams.is_empty() {
            return Some(Vec::new());
        }
        let members: Vec<Vec<usize>> = sets
            .iter()
            .map(|&c| {
                let mut v: Vec<usize> = (0..self.streams.len()).filter(|&i| self.streams[i].affinity == c).collect();
                v.sort_by(|&a, &b| self.streams[b].gpus_needed.total_cmp(&self.streams[a].gpus_needed).then(a.cmp(&b)));
                v
            })
            .collect();
        let total: f64 = self.streams.iter().map(|s| s.gpus_needed).sum();
        let n_min = self.streams.iter().map(|s| s.gpus_needed).fold(f64::INFINITY, f64::min);
        let (mut lo, mut hi) = (1.0 - total / n_min, self.upper_bound());
        let mut best = self.runs_at(&members, lo)?;
        if let Some(at_hi) = self.runs_at(&members, hi) {
            return Some(at_hi);
        }
        for _ in 0..STEPS {
            if Instant::now() >= deadline {
                break;
            }
            let mid = lo + (hi - lo) / 2.0;
            match self.runs_at(&members, mid) {
                Some(plan) => {
                    best = plan;
                    lo = mid;
                }
                None => hi = mid,
            }
        }
        Some(best)
    }

    /// A runs plan in which every stream tolerates `t` within the cluster's GPUs, if one exists.
    fn runs_at(&self, members: &[Vec<usize>], t: f64) -> Option<Vec<usize>> {
        let g_max = self.groups;
        // Per set: the fewest GPUs for its streams in g runs, and where each run starts.
        let per_set: Vec<(Vec<f64>, Vec<Vec<usize>>)> = members.iter().map(|set| self.cut(set, t)).collect();
        // Knapsack over the sets: best[c][g] the fewest GPUs for sets 0..c in g groups.
        let inf = f64::INFINITY;
        let mut best = vec![vec![inf; g_max + 1]; per_set.len() + 1];
        let mut took = vec![vec![0usize; g_max + 1]; per_set.len() + 1];
        best[0][0] = 0.0;
        for (c, (cost, _)) in per_set.iter().enumerate() {
            for g in 0..=g_max {
                if best[c][g] == inf {
                    continue;
                }
                for (k, &gpus) in cost.iter().enumerate().skip(1) {
                    if g + k <= g_max && best[c][g] + gpus < best[c + 1][g + k] {
                        best[c + 1][g + k] = best[c][g] + gpus;
                        took[c + 1][g + k] = k;
                    }
                }
            }
        }
        let last = &best[per_set.len()];
        // The most groups that fit: every group a run fills can take GPUs up to Ḡ, and the
        // leximin moves afterwards can only spread streams over groups that have GPUs.
        let g = (0..=g_max).rev().find(|&g| last[g] <= f64::from(self.gpus))?;
        // Walk back: each set's run count, then its runs, numbered group by group.
        let mut counts = vec![0usize; per_set.len()];
        let mut left = g;
        for c in (0..per_set.len()).rev() {
            counts[c] = took[c + 1][left];
            left -= counts[c];
        }
        let mut assign = vec![0usize; self.streams.len()];
        let mut next_group = 0usize;
        for ((set, (_, cuts)), &k) in members.iter().zip(&per_set).zip(&counts) {
            let mut end = set.len();
            for runs_left in (1..=k).rev() {
                let start = cuts[end][runs_left];
                for &i in &set[start..end] {
                    assign[i] = next_group;
                }
                next_group += 1;
                end = start;
            }
        }
        Some(assign)
    }

    /// The fewest GPUs covering `set` (sorted by n, largest first) with g contiguous runs at
    /// tolerance `t`, for g = 0..=groups (∞ where impossible), and `cuts[k][g]`, the start of
    /// the last run when the first k streams are cut into g runs.
    fn cut(&self, set: &[usize], t: f64) -> (Vec<f64>, Vec<Vec<usize>>) {
        let (k_len, g_max) = (set.len(), self.groups);
        let n: Vec<f64> = set.iter().map(|&i| self.streams[i].gpus_needed).collect();
        let mut load = vec![0.0; k_len + 1];
        let mut mem = vec![0.0; k_len + 1];
        for (k, &i) in set.iter().enumerate() {
            load[k + 1] = load[k] + n[k];
            mem[k + 1] = mem[k] + self.streams[i].mem_mb;
        }
        let inf = f64::INFINITY;
        let mut dp = vec![vec![inf; g_max + 1]; k_len + 1];
        let mut cuts = vec![vec![0usize; g_max + 1]; k_len + 1];
        dp[0][0] = 0.0;
        let mem_cap = self.gpu_mem_mb * (1.0 + 1e-9) + 1e-9;
        for k in 1..=k_len {
            for a in (0..k).rev() {
                // The run [a, k): its load and memory only grow as it reaches back, and so does
                // the GPUs it needs (n[a] grows too), so the first run over a limit ends the scan.
                if mem[k] - mem[a] > mem_cap {
                    break;
                }
                let binding = if t >= 1.0 { n[a] } else { n[k - 1] };
                let gpus = (load[k] - load[a] + (t - 1.0) * binding - 1e-9).ceil().max(1.0);
                if gpus > f64::from(self.group_max) {
                    break;
                }
                for g in 1..=g_max {
                    let c = dp[a][g - 1] + gpus;
                    if c < dp[k][g] {
                        dp[k][g] = c;
                        cuts[k][g] = a;
                    }
                }
            }
        }
        let cost = dp.pop().unwrap_or_default();
        (cost, cuts)
    }
}
