//! Latency profiles: ℓ(b) = α·b + β per model, with an SLO and a maximum batch.

use crate::scheduler::Ms;

/// A model's profile.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// Model name.
    pub name: String,
    /// Per-request cost, ms.
    pub alpha_ms: f64,
    /// Fixed cost of a batch, ms.
    pub beta_ms: f64,
    /// Latency SLO, ms.
    pub slo_ms: f64,
    /// Largest batch the model runs.
    pub max_batch: usize,
}

/// Why a profile table could not be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ProfileError {
    /// A line did not parse.
    #[error("{table} line {line}: {detail}")]
    Line {
        /// The table.
        table: String,
        /// 1-based line.
        line: usize,
        /// What is wrong.
        detail: String,
    },
    /// A value out of range.
    #[error("model {model}: {detail}")]
    Invalid {
        /// The model.
        model: String,
        /// What is wrong.
        detail: String,
    },
    /// No such model in the table.
    #[error("no model {0:?} in the profile table")]
    Unknown(String),
}

impl Profile {
    /// A profile, checked: α ≥ 0, β ≥ 0, α + β > 0, SLO > ℓ(1), max batch ≥ 1.
    pub fn new(
        name: &str,
        alpha_ms: f64,
        beta_ms: f64,
        slo_ms: f64,
        max_batch: usize,
    ) -> Result<Profile, ProfileError> {
        let bad = |detail: String| ProfileError::Invalid { model: name.to_string(), detail };
        if !(alpha_ms >= 0.0
            && beta_ms >= 0.0
            && alpha_ms + beta_ms > 0.0
            && alpha_ms.is_finite()
            && beta_ms.is_finite())
        {
            return Err(bad(format!("α = {alpha_ms}, β = {beta_ms}: need α, β ≥ 0 and α + β > 0")));
        }
        if !(slo_ms.is_finite() && slo_ms > alpha_ms + beta_ms) {
            return Err(bad(format!("SLO {slo_ms} ms cannot fit even a batch of one ({} ms)", alpha_ms + beta_ms)));
        }
        if max_batch == 0 {
            return Err(bad("max batch must be at least 1".into()));
        }
        Ok(Profile { name: name.to_string(), alpha_ms, beta_ms, slo_ms, max_batch })
    }

    /// ℓ(b): milliseconds to run a batch of `b`.
    pub fn latency(&self, b: usize) -> Ms {
        self.alpha_ms * b as f64 + self.beta_ms
    }

    /// The largest batch (≤ max batch) that runs within `budget` ms; 0 if none does.
    pub fn max_batch_within(&self, budget: Ms) -> usize {
        if budget < self.latency(1) {
            return 0;
        }
        if self.alpha_ms <= 0.0 {
            return self.max_batch;
        }
        (((budget - self.beta_ms) / self.alpha_ms).floor() as usize).clamp(1, self.max_batch)
    }
}

/// The largest batch (≤ `cap`) that, started no earlier than `max(now + delay(b), gpu_free_at)`,
/// finishes by `dl`; 0 if not even one request does.
pub fn largest_batch(p: &Profile, delay: crate::time::Delay, now: Ms, gpu_free_at: Ms, dl: Ms, cap: usize) -> usize {
    let cap = cap.min(p.max_batch);
    // now + d_ctrl + d_data·b + α·b + β ≤ dl
    let by_delay = (dl - now - delay.ctrl_ms - p.beta_ms) / (delay.data_ms + p.alpha_ms);
    // gpu_free_at + α·b + β ≤ dl
    let by_gpu = if p.alpha_ms > 0.0 {
        (dl - gpu_free_at - p.beta_ms) / p.alpha_ms
    } else if gpu_free_at + p.beta_ms <= dl {
        f64::INFINITY
    } else {
        0.0
    };
    let b = by_delay.min(by_gpu);
    if b.is_nan() || b < 1.0 {
        0
    } else if b >= cap as f64 {
        cap
    } else {
        b.floor() as usize
    }
}

/// The largest batch of consecutive requests of `deadlines` (sorted ascending) that can start
/// no earlier than `max(now + delay(b), gpu_free_at)` and finish by the earliest deadline among
/// them, and among the largest the one with the earliest deadlines: `(first index, size)`;
/// size 0 when no request can finish even alone. Requests before the first index are left for
/// later (when the queue is backed up, they are the ones that would force small batches).
pub fn best_window(
    p: &Profile,
    delay: crate::time::Delay,
    now: Ms,
    gpu_free_at: Ms,
    deadlines: impl Fn(usize) -> Ms,
    n: usize,
) -> (usize, usize) {
    if n == 0 {
        return (0, 0);
    }
    let fits = |i: usize| largest_batch(p, delay, now, gpu_free_at, deadlines(i), usize::MAX);
    // b_i = min(fits(i), n − i): fits grows with i, n − i shrinks. The first i where
    // fits(i) ≥ n − i is where the largest window starts, or just before it.
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if fits(mid).min(p.max_batch) >= (n - mid).min(p.max_batch) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let size = |i: usize| if i < n { fits(i).min(n - i).min(p.max_batch) } else { 0 };
    let mut best = size(lo);
    if lo > 0 {
        best = best.max(size(lo - 1));
    }
    if best == 0 {
        return (0, 0);
    }
    // The earliest start with that size: fits(i) ≥ best and n − i ≥ best.
    (first_reaching(fits, 0, n - best, best), best)
}

/// The first index in `lo..=hi` where the non-decreasing `fits` reaches `want`, knowing that it
/// does at `hi`.
fn first_reaching(fits: impl Fn(usize) -> usize, mut lo: usize, mut hi: usize, want: usize) -> usize {
    while lo < hi {
        let mid = (lo + hi) / 2;
        if fits(mid) >= want {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// [`best_window`] of `n` requests, given `window`, its answer for the first `n − 1`, when the
/// last request has the latest deadline: the usual case of an arrival joining a backed-up
/// queue. `fits(i)` is [`largest_batch`] at request i's deadline (uncapped but by the model's
/// `max_batch`, at the same `now` and `gpu_free_at` as `window`). The window grows by at most
/// one request, and starts where it did or later, so this reads one deadline when it does not
/// grow and searches forward from the old start (doubling steps, then halving) when it does,
/// instead of two binary searches over the whole queue.
pub fn grow_window(
    fits: impl Fn(usize) -> usize,
    max_batch: usize,
    n: usize,
    window: (usize, usize),
) -> (usize, usize) {
    let (first, size) = window;
    let want = size + 1;
    // A window of size + 1 must start by n − want; fits grows with the start.
    if n < want || size >= max_batch || fits(n - want) < want {
        return window;
    }
    // Every start before `first` fits fewer than `size` requests, so none fits `want`.
    let (mut lo, last) = (first, n - want);
    let mut step = 1;
    while lo + step <= last && fits(lo + step - 1) < want {
        lo += step;
        step *= 2;
    }
    (first_reaching(fits, lo, (lo + step - 1).min(last), want), want)
}

/// One row of a profile table.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Model.
    pub model: String,
    /// GPU the profile was measured on.
    pub gpu: String,
    /// α, ms.
    pub alpha_ms: f64,
    /// β, ms.
    pub beta_ms: f64,
    /// SLO, ms, where the table has one (Symphony's).
    pub slo_ms: Option<f64>,
}

/// The tables shipped with Cascade (`sched/data/`, see its SOURCE.md).
pub const TABLES: [(&str, &str); 3] = [
    ("symphony_1080ti", include_str!("../data/symphony_1080ti.csv")),
    ("symphony_a100", include_str!("../data/symphony_a100.csv")),
    ("shepherd_v100", include_str!("../data/shepherd_v100.csv")),
];

/// Parses a profile table: CSV with a header naming `model`, `gpu`, `alpha_ms`, `beta_ms` and
/// optionally `slo_ms` (other columns are ignored).
pub fn parse_table(table: &str, text: &str) -> Result<Vec<Row>, ProfileError> {
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let err = |line: usize, detail: String| ProfileError::Line { table: table.to_string(), line: line + 1, detail };
    let (_, header) = lines.next().ok_or_else(|| err(0, "empty table".into()))?;
    let cols: Vec<&str> = header.split(',').map(str::trim).collect();
    let col = |name: &str| cols.iter().position(|c| *c == name);
    let (m, g, a, b) = match (col("model"), col("gpu"), col("alpha_ms"), col("beta_ms")) {
        (Some(m), Some(g), Some(a), Some(b)) => (m, g, a, b),
        _ => return Err(err(0, format!("header {header:?} lacks model, gpu, alpha_ms or beta_ms"))),
    };
    let s = col("slo_ms");
    lines
        .map(|(i, l)| {
            let f: Vec<&str> = l.split(',').map(str::trim).collect();
            let get = |c: usize| f.get(c).copied().ok_or_else(|| err(i, format!("missing column {}", cols[c])));
            let num = |c: usize| -> Result<f64, ProfileError> {
                let v = get(c)?;
                v.parse().map_err(|_| err(i, format!("{}: {v:?} is not a number", cols[c])))
            };
            Ok(Row {
                model: get(m)?.to_string(),
                gpu: get(g)?.to_string(),
                alpha_ms: num(a)?,
                beta_ms: num(b)?,
                slo_ms: s.map(num).transpose()?,
            })
        })
        .collect()
}

/// The row for `model` in the shipped table `table` (e.g. `shepherd_v100`).
pub fn lookup(table: &str, model: &str) -> Result<Row, ProfileError> {
    let text = TABLES.iter().find(|(n, _)| *n == table).map(|(_, t)| *t).ok_or_else(|| ProfileError::Line {
        table: table.to_string(),
        line: 0,
        detail: format!("no such table (have {})", TABLES.map(|t| t.0).join(", ")),
    })?;
    parse_table(table, text)?.into_iter().find(|r| r.model == model).ok_or_else(|| ProfileError::Unknown(model.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_tables_parse_and_hold_the_papers_values() {
        for (name, text) in TABLES {
            let rows = parse_table(name, text).unwrap();
            assert!(rows.len() >= 15, "{name}: {} rows", rows.len());
        }
        let r = lookup("shepherd_v100", "ResNeSt269").unwrap();
        assert_eq!((r.alpha_ms, r.beta_ms), (4.37, 74.20));
        let d = lookup("symphony_1080ti", "DenseNet121").unwrap();
        assert_eq!(d.slo_ms, Some(29.0));
        assert!(matches!(lookup("shepherd_v100", "nope"), Err(ProfileError::Unknown(_))));
    }

    #[test]
    fn bad_tables_and_profiles_are_refused_with_the_line() {
        let e = parse_table("t", "model,gpu,alpha_ms,beta_ms\nA,G,x,1\n").unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("alpha_ms"), "{e}");
        assert!(parse_table("t", "name,alpha\n").is_err());
        assert!(Profile::new("m", 1.0, 5.0, 5.5, 8).is_err(), "SLO below ℓ(1)");
        assert!(Profile::new("m", -1.0, 5.0, 50.0, 8).is_err());
    }

    #[test]
    fn best_window_skips_requests_that_would_force_small_batches() {
        let p = Profile::new("m", 1.0, 5.0, 25.0, 16).unwrap();
        let d = crate::time::Delay::default();
        // Short queue: the prefix.
        assert_eq!(best_window(&p, d, 0.0, 0.0, |i| 25.0 + i as f64, 4), (0, 4));
        // Backed up: the first two can only run in batches of ≤ 2 and 3 requests;
        // from the third on a full batch of 16 fits.
        let dl = |i: usize| [7.5, 8.5, 21.0, 22.0][i.min(3)] + if i > 3 { i as f64 } else { 0.0 };
        assert_eq!(best_window(&p, d, 0.0, 0.0, dl, 40), (2, 16));
        // Nothing fits.
        assert_eq!(best_window(&p, d, 10.0, 0.0, |_| 12.0, 5), (0, 0));
        // Brute force agrees on random queues.
        let mut x = 12345u64;
        for _ in 0..500 {
            let n = (x % 50) as usize + 1;
            let mut ds: Vec<f64> = (0..n)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((x >> 33) % 3000) as f64 / 100.0
                })
                .collect();
            ds.sort_by(f64::total_cmp);
            let got = best_window(&p, d, 0.0, 0.0, |i| ds[i], n);
            let mut want = (0, 0);
            for (i, d) in ds.iter().enumerate() {
                for b in 1..=(n - i).min(16) {
                    if p.latency(b) <= *d && b > want.1 {
                        want = (i, b);
                    }
                }
            }
            assert_eq!(got, want, "{ds:?}");
        }
    }

    proptest::proptest! {
        /// Growing the window one appended request at a time gives what `best_window` gives for
        /// every prefix of a sorted queue.
        #[test]
        fn growing_the_window_matches_the_full_search(
            mut ds in proptest::collection::vec(0u32..4000, 1..200),
            now in 0u32..1000,
            max_batch in 1usize..40,
        ) {
            let p = Profile::new("m", 0.7, 4.0, 30.0, max_batch).unwrap();
            let d = crate::time::Delay { ctrl_ms: 0.5, data_ms: 0.1 };
            ds.sort_unstable();
            let dl = |i: usize| f64::from(ds[i]) / 100.0;
            let now = f64::from(now) / 100.0;
            let mut w = (0, 0);
            let fits = |i: usize| largest_batch(&p, d, now, now, dl(i), usize::MAX);
            for n in 1..=ds.len() {
                w = grow_window(fits, max_batch, n, w);
                proptest::prop_assert_eq!(w, best_window(&p, d, now, now, dl, n), "n = {}", n);
            }
        }
    }

    #[test]
    fn latency_and_largest_batch_within_a_budget() {
        let p = Profile::new("ResNet50", 1.053, 5.072, 25.0, 64).unwrap();
        assert!((p.latency(16) - 21.92).abs() < 1e-9);
        assert_eq!(p.max_batch_within(25.0 / (1.0 + 1.0 / 8.0)), 16, "Symphony Table 4's staggered batch");
        assert_eq!(p.max_batch_within(12.5), 7, "and its uncoordinated one");
        assert_eq!(p.max_batch_within(6.0), 0);
        assert_eq!(p.max_batch_within(1e9), 64);
    }
}
