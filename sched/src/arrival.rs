//! Arrival processes: Poisson, Gamma inter-arrivals (shape < 1 is bursty), a Markov-modulated
//! Poisson process, and replay of a trace's timestamps rescaled to a target rate.
//!
//! Random numbers come from a small seeded generator (SplitMix64) so a run is reproducible from
//! its seed alone; the exponential, normal and gamma samplers are the textbook ones (inversion,
//! Box–Muller, Marsaglia–Tsang).

use std::sync::Arc;

use crate::scheduler::Ms;

/// A seeded generator (SplitMix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5851_f42d_4c95_7f2d)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// Exponential with mean `mean`.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -self.unit().ln() * mean
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f64 {
        (-2.0 * self.unit().ln()).sqrt() * (std::f64::consts::TAU * self.unit()).cos()
    }

    /// Gamma with `shape` and scale 1.
    pub fn gamma(&mut self, shape: f64) -> f64 {
        if shape < 1.0 {
            // Boost: Γ(k) = Γ(k+1) · U^(1/k).
            return self.gamma(shape + 1.0) * self.unit().powf(1.0 / shape);
        }
        let d = shape - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let x = self.normal();
            let v = (1.0 + c * x).powi(3);
            if v <= 0.0 {
                continue;
            }
            let u = self.unit();
            if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
                return d * v;
            }
        }
    }
}

/// How a model's requests arrive.
#[derive(Debug, Clone, PartialEq)]
pub enum Arrival {
    /// Exponential gaps.
    Poisson,
    /// Gamma gaps of this shape (coefficient of variation 1/√shape).
    Gamma(f64),
    /// Markov-modulated Poisson: states with rate multipliers (normalized to mean 1, so the
    /// model's rate stays its average), exponential dwell times of this mean.
    Mmpp {
        /// Rate multipliers.
        levels: Vec<f64>,
        /// Mean time in a state, ms.
        dwell_ms: f64,
    },
    /// Replay of these timestamps (ms from the first), rescaled to the model's rate and looped.
    Trace(Arc<Vec<Ms>>),
    /// Deterministic bursts of `burst` requests every `period_ms`, the first at `offset_ms`
    /// (the model's rate is ignored: the spec sets it).
    Periodic {
        /// Period, ms.
        period_ms: f64,
        /// Requests per burst.
        burst: u32,
        /// First burst, ms.
        offset_ms: f64,
    },
}

/// Why an arrival spec was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("arrival {spec:?}: {detail}")]
pub struct ArrivalError {
    /// The spec.
    pub spec: String,
    /// What is wrong.
    pub detail: String,
}

impl Arrival {
    /// Parses `poisson`, `gamma:SHAPE`, `mmpp:L1,L2,…:DWELL_MS`, `periodic:PERIOD_MS:BURST[:OFFSET_MS]`
    /// or `trace:PATH` (CSV whose first column is a timestamp: seconds, or
    /// `YYYY-MM-DD HH:MM:SS.fff`; a header line is skipped).
    pub fn parse(spec: &str) -> Result<Arrival, ArrivalError> {
        let bad = |detail: &str| ArrivalError { spec: spec.to_string(), detail: detail.to_string() };
        let (kind, rest) = spec.split_once(':').unwrap_or((spec, ""));
        match kind {
            "poisson" if rest.is_empty() => Ok(Arrival::Poisson),
            "gamma" => match rest.parse::<f64>() {
                Ok(k) if k > 0.0 && k.is_finite() => Ok(Arrival::Gamma(k)),
                _ => Err(bad("gamma:SHAPE needs a positive shape")),
            },
            "mmpp" => {
                let (levels, dwell) = rest.rsplit_once(':').ok_or_else(|| bad("mmpp:L1,L2,…:DWELL_MS"))?;
                let levels: Vec<f64> = levels
                    .split(',')
                    .map(|l| l.trim().parse().map_err(|_| bad("a level is not a number")))
                    .collect::<Result<_, _>>()?;
                let dwell_ms: f64 = dwell.parse().map_err(|_| bad("the dwell time is not a number"))?;
                if levels.len() < 2
                    || levels.iter().any(|l| !(*l >= 0.0 && l.is_finite()))
                    || levels.iter().sum::<f64>() <= 0.0
                {
                    return Err(bad("at least two non-negative levels, not all zero"));
                }
                if !(dwell_ms > 0.0 && dwell_ms.is_finite()) {
                    return Err(bad("the dwell time must be positive"));
                }
                let mean = levels.iter().sum::<f64>() / levels.len() as f64;
                Ok(Arrival::Mmpp { levels: levels.iter().map(|l| l / mean).collect(), dwell_ms })
            }
            "periodic" => {
                let f: Vec<&str> = rest.split(':').collect();
                let num = |s: &str| s.trim().parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0);
                match (
                    f.first().and_then(|s| num(s)),
                    f.get(1).and_then(|s| s.trim().parse::<u32>().ok()),
                    f.get(2).map(|s| num(s)),
                ) {
                    (Some(p), Some(b), off) if p > 0.0 && b > 0 && f.len() <= 3 && off != Some(None) => {
                        Ok(Arrival::Periodic { period_ms: p, burst: b, offset_ms: off.flatten().unwrap_or(0.0) })
                    }
                    _ => Err(bad("periodic:PERIOD_MS:BURST[:OFFSET_MS] with a positive period and burst")),
                }
            }
            "trace" => {
                let text = std::fs::read_to_string(rest).map_err(|e| bad(&format!("reading {rest}: {e}")))?;
                Ok(Arrival::Trace(Arc::new(parse_trace(&text).map_err(|e| bad(&e))?)))
            }
            _ => Err(bad("expected poisson, gamma:SHAPE, mmpp:L1,L2,…:DWELL_MS or trace:PATH")),
        }
    }
}

/// Days since 1970-01-01 of a civil date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Seconds of a trace timestamp: a number, or `YYYY-MM-DD hh:mm:ss[.frac]` (UTC, `T` allowed).
pub fn timestamp_s(field: &str) -> Option<f64> {
    if let Ok(s) = field.parse::<f64>() {
        return Some(s);
    }
    let (date, time) = field.trim().split_once([' ', 'T'])?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, mo, da) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let (h, mi) = (t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?);
    let s = t.next()?.trim_end_matches('Z').parse::<f64>().ok()?;
    Some(days_from_civil(y, mo, da) as f64 * 86_400.0 + h * 3600.0 + mi * 60.0 + s)
}

/// Timestamps of a trace CSV, in ms from the first, sorted.
pub fn parse_trace(text: &str) -> Result<Vec<Ms>, String> {
    let mut ts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let first = line.split(',').next().unwrap_or("").trim();
        if first.is_empty() {
            continue;
        }
        match timestamp_s(first) {
            Some(s) => ts.push(s * 1000.0),
            None if i == 0 => continue, // header
            None => return Err(format!("line {}: {first:?} is not a timestamp", i + 1)),
        }
    }
    if ts.len() < 2 {
        return Err("a trace needs at least two timestamps".into());
    }
    ts.sort_by(f64::total_cmp);
    let t0 = ts[0];
    Ok(ts.into_iter().map(|t| t - t0).collect())
}

/// Generates one model's arrival times.
#[derive(Debug, Clone)]
pub struct ArrivalGen {
    kind: Arrival,
    /// Mean gap, ms.
    mean_gap: f64,
    rng: Rng,
    now: Ms,
    state: usize,
    state_until: Ms,
    /// Trace replay: index, loop offset, time scale.
    idx: usize,
    offset: Ms,
    scale: f64,
}

impl ArrivalGen {
    /// Arrivals at `rate_rps` on average, starting after time 0.
    pub fn new(kind: Arrival, rate_rps: f64, seed: u64) -> ArrivalGen {
        let mean_gap = match &kind {
            Arrival::Periodic { period_ms, burst, .. } => period_ms / *burst as f64,
            _ if rate_rps > 0.0 => 1000.0 / rate_rps,
            _ => f64::INFINITY,
        };
        let scale = match &kind {
            Arrival::Trace(ts) => {
                let span = ts.last().copied().unwrap_or(0.0).max(1e-9);
                let native_gap = span / (ts.len() - 1).max(1) as f64;
                mean_gap / native_gap
            }
            _ => 1.0,
        };
        let mut g = ArrivalGen {
            kind,
            mean_gap,
            rng: Rng::new(seed),
            now: 0.0,
            state: 0,
            state_until: 0.0,
            idx: 0,
            offset: 0.0,
            scale,
        };
        if let Arrival::Mmpp { dwell_ms, .. } = &g.kind {
            g.state_until = g.rng.exp(*dwell_ms);
        }
        g
    }

    /// The next arrival time (ms), or `None` with a rate of zero.
    pub fn next_arrival(&mut self) -> Option<Ms> {
        if !self.mean_gap.is_finite() {
            return None;
        }
        let t = match &self.kind {
            Arrival::Poisson => self.now + self.rng.exp(self.mean_gap),
            Arrival::Gamma(k) => self.now + self.rng.gamma(*k) * self.mean_gap / k,
            Arrival::Mmpp { levels, dwell_ms } => {
                let (levels, dwell) = (levels.clone(), *dwell_ms);
                let mut t = self.now;
                loop {
                    let level = levels[self.state];
                    let gap = if level > 0.0 { self.rng.exp(self.mean_gap / level) } else { f64::INFINITY };
                    if t + gap <= self.state_until {
                        break t + gap;
                    }
                    // Memoryless: restart the draw at the switch.
                    t = self.state_until;
                    let next = (self.rng.next_u64() % (levels.len() as u64 - 1)) as usize;
                    self.state = if next >= self.state { next + 1 } else { next };
                    self.state_until = t + self.rng.exp(dwell);
                }
            }
            Arrival::Periodic { period_ms, burst, offset_ms } => {
                let t = offset_ms + (self.idx / *burst as usize) as f64 * period_ms;
                self.idx += 1;
                t
            }
            Arrival::Trace(ts) => {
                if self.idx >= ts.len() {
                    self.idx = 0;
                    self.offset += ts.last().copied().unwrap_or(0.0) * self.scale + self.mean_gap;
                }
                let t = self.offset + ts[self.idx] * self.scale;
                self.idx += 1;
                t.max(self.now)
            }
        };
        self.now = t;
        Some(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mean_and_cv(kind: Arrival, n: usize) -> (f64, f64) {
        let mut g = ArrivalGen::new(kind, 1000.0, 7); // mean gap 1 ms
        let mut last = 0.0;
        let gaps: Vec<f64> = (0..n)
            .map(|_| {
                let t = g.next_arrival().unwrap();
                let gap = t - last;
                last = t;
                gap
            })
            .collect();
        let mean = gaps.iter().sum::<f64>() / n as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n as f64;
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn processes_have_the_rate_and_burstiness_asked_for() {
        let (m, cv) = mean_and_cv(Arrival::Poisson, 200_000);
        assert!((m - 1.0).abs() < 0.01 && (cv - 1.0).abs() < 0.02, "poisson mean {m} cv {cv}");
        let (m, cv) = mean_and_cv(Arrival::Gamma(0.25), 200_000);
        assert!((m - 1.0).abs() < 0.02 && (cv - 2.0).abs() < 0.08, "gamma(0.25) mean {m} cv {cv}");
        let (m, cv) = mean_and_cv(Arrival::Gamma(4.0), 200_000);
        assert!((m - 1.0).abs() < 0.01 && (cv - 0.5).abs() < 0.02, "gamma(4) mean {m} cv {cv}");
        let mmpp = Arrival::parse("mmpp:0.2,1.8:50").unwrap();
        let (m, cv) = mean_and_cv(mmpp, 200_000);
        assert!((m - 1.0).abs() < 0.05 && cv > 1.1, "mmpp mean {m} cv {cv}");
    }

    #[test]
    fn runs_are_reproducible_from_the_seed() {
        let a: Vec<f64> = (0..100)
            .map({
                let mut g = ArrivalGen::new(Arrival::Gamma(0.5), 50.0, 3);
                move |_| g.next_arrival().unwrap()
            })
            .collect();
        let b: Vec<f64> = (0..100)
            .map({
                let mut g = ArrivalGen::new(Arrival::Gamma(0.5), 50.0, 3);
                move |_| g.next_arrival().unwrap()
            })
            .collect();
        assert_eq!(a, b);
    }

    #[test]
    fn traces_replay_rescaled_and_bad_specs_are_refused() {
        let ts =
            parse_trace("TIMESTAMP,x\n2023-11-16 18:17:03.5,1\n2023-11-16 18:17:04.0,2\n2023-11-16 18:17:05.5,3\n")
                .unwrap();
        assert_eq!(ts, vec![0.0, 500.0, 2000.0]);
        // Native mean gap 1000 ms; at 10 rps (100 ms) the trace is compressed ten times.
        let mut g = ArrivalGen::new(Arrival::Trace(Arc::new(ts)), 10.0, 1);
        let got: Vec<f64> = (0..4).map(|_| g.next_arrival().unwrap()).collect();
        assert_eq!(&got[..3], &[0.0, 50.0, 200.0]);
        assert!(got[3] > 200.0, "the trace loops forward: {got:?}");
        let mut p = ArrivalGen::new(Arrival::parse("periodic:120:3:5").unwrap(), 0.0, 1);
        let got: Vec<f64> = (0..7).map(|_| p.next_arrival().unwrap()).collect();
        assert_eq!(got, vec![5.0, 5.0, 5.0, 125.0, 125.0, 125.0, 245.0]);
        for bad in [
            "gamma:-1",
            "mmpp:1:5",
            "mmpp:1,2:0",
            "weibull",
            "trace:/nonexistent.csv",
            "periodic:0:5",
            "periodic:10:0",
            "periodic:10:2:x",
        ] {
            assert!(Arrival::parse(bad).is_err(), "{bad}");
        }
        assert!(parse_trace("t\n1\nfoo\n").is_err());
    }

    #[test]
    fn the_azure_code_trace_timestamps_parse() {
        // Its first rows, as in AzureLLMInferenceTrace_code.csv.
        let ts = parse_trace("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04.0319600,3180,8\n").unwrap();
        assert!((ts[1] - 52.0).abs() < 1e-6, "{ts:?}");
    }
}
