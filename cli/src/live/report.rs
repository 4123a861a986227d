//! The comparison's report: per policy, the burst's latency percentiles, when the new node first
//! helped, throughput during the load, requests lost; `report.json` and `live.png`.

use std::path::Path;

use plotters::prelude::*;
use serde_json::json;

use super::driver::PolicyRun;
use super::LiveArgs;

const BIN: f64 = 0.5;

/// A run's summary figures.
struct Summary {
    p50: f64,
    p99: f64,
    first_helped_s: Option<f64>,
    load_rps: Option<f64>,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn summary(r: &PolicyRun) -> Summary {
    let mut lat: Vec<f64> = r.requests.iter().map(|q| q.1 - q.0).collect();
    let first_helped_s = r
        .requests
        .iter()
        .filter(|q| q.2 == 2)
        .map(|q| q.1)
        .fold(None, |m: Option<f64>, t| Some(m.map_or(t, |m| m.min(t))))
        .map(|t| t - r.scale_at_s);
    let load_rps = r.loaded_s.map(|end| {
        let n = r.requests.iter().filter(|q| q.1 >= r.scale_at_s && q.1 <= end).count();
        n as f64 / (end - r.scale_at_s).max(1e-9)
    });
    Summary { p50: percentile(&mut lat, 0.5), p99: percentile(&mut lat, 0.99), first_helped_s, load_rps }
}

/// One line for the terminal.
pub(super) fn line(r: &PolicyRun) -> String {
    let s = summary(r);
    format!(
        "{:>15}: p50 {:.2} s, p99 {:.2} s; node 2 first helped {} after the scale-out began; {} req/s during \
         the load ({:.1} s); {} of {} lost, {} embeddings off the reference",
        r.policy,
        s.p50,
        s.p99,
        s.first_helped_s.map_or("never".into(), |t| format!("{t:.2} s")),
        s.load_rps.map_or("-".into(), |v| format!("{v:.1}")),
        r.loaded_s.map_or(f64::NAN, |l| l - r.scale_at_s),
        r.lost,
        r.sent,
        r.mismatched
    )
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    (!v.is_empty()).then(|| percentile(&mut v, 0.5))
}

/// The three policies' p99 latencies, s (of one round, or medians over the rounds).
#[derive(Debug, Clone, Copy)]
struct P99s {
    stw: Option<f64>,
    be: Option<f64>,
    zz: Option<f64>,
}

impl P99s {
    /// Of the runs `of` finds by policy name.
    fn of(of: impl Fn(&str) -> Option<f64>) -> P99s {
        P99s { stw: of("stop-the-world"), be: of("best-effort"), zz: of("zigzag") }
    }

    fn zz_over_be(&self) -> Option<f64> {
        self.zz.zip(self.be).map(|(z, b)| z / b)
    }

    fn zz_over_stw(&self) -> Option<f64> {
        self.zz.zip(self.stw).map(|(z, s)| z / s)
    }
}

/// A comparison's median p99s (their ratios are the report's) and its zigzag runs' median T.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ratios {
    p99: P99s,
    load_ratio: Option<f64>,
}

/// Writes `sweep.json` and prints a table of the comparisons at each link rate.
pub(super) fn sweep(a: &LiveArgs, rows: &[(u64, Ratios)]) -> anyhow::Result<()> {
    let f = |x: Option<f64>| x.map_or("—".to_string(), |x| format!("{x:.2}"));
    println!("link (Mbit/s) | T | p99 stw / be / zz (s) | zz ÷ be (≤ 0.8) | zz ÷ stw (≤ 0.6)");
    for (mbit, r) in rows {
        println!(
            "{mbit} | {} | {} / {} / {} | {} | {}",
            r.load_ratio.map_or("—".to_string(), |t| format!("{t:.0}")),
            f(r.p99.stw),
            f(r.p99.be),
            f(r.p99.zz),
            f(r.p99.zz_over_be()),
            f(r.p99.zz_over_stw())
        );
    }
    let json: Vec<_> = rows
        .iter()
        .map(|(mbit, r)| {
            json!({
                "link_mbit": mbit, "report": format!("{mbit}mbit/report.json"), "load_ratio_T": r.load_ratio,
                "median_p99_s": {"stop-the-world": r.p99.stw, "best-effort": r.p99.be, "zigzag": r.p99.zz},
                "p99_zigzag_over_best_effort": r.p99.zz_over_be(),
                "p99_zigzag_over_stop_the_world": r.p99.zz_over_stw(),
            })
        })
        .collect();
    let path = a.out.join("sweep.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&json!({ "rounds": a.rounds, "rates": json }))?)?;
    println!("wrote {}", path.display());
    Ok(())
}

/// Writes `report.json` and `live.png` and returns the ratios; fails when a request was lost or
/// an embedding is off. With several rounds, each policy's figures are the medians over the
/// rounds, and the plot shows the round whose zigzag p99 is the median.
pub(super) fn write(a: &LiveArgs, rounds: &[Vec<PolicyRun>]) -> anyhow::Result<Ratios> {
    let names: Vec<String> = rounds.first().map(|r| r.iter().map(|p| p.policy.clone()).collect()).unwrap_or_default();
    let runs_of = |name: &str| -> Vec<&PolicyRun> { rounds.iter().flatten().filter(|r| r.policy == name).collect() };
    let med = |name: &str, f: &dyn Fn(&Summary) -> Option<f64>| {
        median(runs_of(name).iter().filter_map(|r| f(&summary(r))).collect())
    };
    let p99 = P99s::of(|name| med(name, &|s| Some(s.p99)));
    let policies: Vec<_> = names
        .iter()
        .map(|name| {
            let runs = runs_of(name);
            let per_round: Vec<_> = runs
                .iter()
                .map(|r| {
                    let s = summary(r);
                    json!({
                        "requests": r.sent,
                        "rate_rps": r.rate_rps,
                        "one_instance_rps": r.capacity_rps,
                        "load_ratio_T": r.load_ratio,
                        "scale_out_at_s": r.scale_at_s,
                        "first_layer_at_s": r.first_layer_s,
                        "loaded_at_s": r.loaded_s,
                        "transfer_s": r.transfer_s,
                        "first_request_helped_by_new_after_s": s.first_helped_s,
                        "throughput_during_load_rps": s.load_rps,
                        "latency_p50_s": s.p50,
                        "latency_p99_s": s.p99,
                        "requests_split": r.requests.iter().filter(|q| q.3 > 0).count(),
                        "requests_lost": r.lost,
                        "embeddings_off_reference": r.mismatched,
                        "batches_requeued": r.requeued,
                    })
                })
                .collect();
            json!({
                "policy": name,
                "median_latency_p50_s": med(name, &|s| Some(s.p50)),
                "median_latency_p99_s": med(name, &|s| Some(s.p99)),
                "median_first_request_helped_by_new_after_s": med(name, &|s| s.first_helped_s),
                "median_throughput_during_load_rps": med(name, &|s| s.load_rps),
                "requests_lost": runs.iter().map(|r| r.lost).sum::<u64>(),
                "embeddings_off_reference": runs.iter().map(|r| r.mismatched).sum::<u64>(),
                "rounds": per_round,
            })
        })
        .collect();
    let per_round_ratios: Vec<_> = rounds
        .iter()
        .map(|runs| {
            let round = P99s::of(|n| runs.iter().find(|r| r.policy == n).map(|r| summary(r).p99));
            json!({
                "zigzag_over_best_effort": round.zz_over_be(),
                "zigzag_over_stop_the_world": round.zz_over_stw(),
            })
        })
        .collect();
    let report = json!({
        "model": "all-MiniLM-L6-v2",
        "netns": a.netns,
        "link_mbit": if a.netns { Some(a.link()) } else { None },
        "burst_x_capacity": a.burst,
        "burst_s": a.burst_s,
        "max_batch": a.max_batch,
        "max_coop": a.max_coop,
        "copy_source": a.source.name(),
        "rounds": rounds.len(),
        "policies": policies,
        "p99_zigzag_over_best_effort": p99.zz_over_be(),
        "p99_zigzag_over_stop_the_world": p99.zz_over_stw(),
        "p99_ratios_per_round": per_round_ratios,
    });
    std::fs::write(a.out.join("report.json"), serde_json::to_vec_pretty(&report)?)?;
    let of = if rounds.len() > 1 { format!(" (medians of {} rounds)", rounds.len()) } else { String::new() };
    if let Some(r) = p99.zz_over_be() {
        println!("p99 zigzag / best-effort = {r:.2}{of} (target ≤ 0.8)");
    }
    if let Some(r) = p99.zz_over_stw() {
        println!("p99 zigzag / stop-the-world = {r:.2}{of} (target ≤ 0.6)");
    }
    // The round whose zigzag p99 is the median (the first round without a zigzag run).
    let shown = {
        let mut by: Vec<(f64, usize)> = rounds
            .iter()
            .enumerate()
            .filter_map(|(i, runs)| runs.iter().find(|r| r.policy == "zigzag").map(|r| (summary(r).p99, i)))
            .collect();
        by.sort_by(|x, y| x.0.total_cmp(&y.0));
        by.get(by.len() / 2).map_or(0, |x| x.1)
    };
    let png = a.out.join("live.png");
    match rounds.get(shown).map(|runs| plot(&png, &a.font, runs, shown + 1)) {
        Some(Ok(())) => {
            println!("wrote {} and {} (round {})", a.out.join("report.json").display(), png.display(), shown + 1)
        }
        Some(Err(e)) => eprintln!("no plot: {e:#}"),
        None => {}
    }
    let lost: u64 = rounds.iter().flatten().map(|r| r.lost).sum();
    let off: u64 = rounds.iter().flatten().map(|r| r.mismatched).sum();
    if lost > 0 || off > 0 {
        anyhow::bail!("{lost} requests lost, {off} embeddings off the reference");
    }
    let load_ratio = median(runs_of("zigzag").iter().map(|r| f64::from(r.load_ratio)).collect());
    Ok(Ratios { p99, load_ratio })
}

/// Per bin of answer time: (bin start, requests/s served, p99 latency of those answered).
fn series(r: &PolicyRun) -> Vec<(f64, f64, f64)> {
    let end = r.requests.iter().map(|q| q.1).fold(0.0, f64::max);
    let bins = (end / BIN).ceil() as usize + 1;
    let mut lat: Vec<Vec<f64>> = vec![Vec::new(); bins];
    for q in &r.requests {
        lat[(q.1 / BIN) as usize].push(q.1 - q.0);
    }
    lat.into_iter()
        .enumerate()
        .map(|(i, mut l)| {
            let n = l.len() as f64;
            let p = if l.is_empty() { f64::NAN } else { percentile(&mut l, 0.99) };
            (i as f64 * BIN, n / BIN, p)
        })
        .collect()
}

fn plot(path: &Path, font: &Path, runs: &[PolicyRun], round: usize) -> anyhow::Result<()> {
    crate::plot::register_font(font)?;
    let all: Vec<Vec<(f64, f64, f64)>> = runs.iter().map(series).collect();
    let tmax = all.iter().flatten().map(|p| p.0).fold(1.0, f64::max) + BIN;
    let rmax = all.iter().flatten().map(|p| p.1).fold(1.0, f64::max) * 1.15;
    let lmax = all.iter().flatten().map(|p| p.2).filter(|v| v.is_finite()).fold(0.1, f64::max) * 1.15;
    let root = BitMapBackend::new(path, (1100, 800)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(400);
    let colors = [RED, BLUE, RGBColor(0, 150, 0), MAGENTA];
    let color = |i: usize| colors[i % colors.len()];
    let mut up = ChartBuilder::on(&top)
        .caption(format!("live autoscaling of all-MiniLM-L6-v2: requests/s served (round {round})"), ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..tmax, 0f64..rmax)?;
    up.configure_mesh().x_desc("seconds since the burst began").y_desc("requests/s").draw()?;
    let mut down = ChartBuilder::on(&bottom)
        .caption("p99 latency of the requests answered in each 0.5 s", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..tmax, 0f64..lmax)?;
    down.configure_mesh().x_desc("seconds since the burst began").y_desc("seconds").draw()?;
    for (i, (r, s)) in runs.iter().zip(&all).enumerate() {
        let c = color(i);
        up.draw_series(LineSeries::new(s.iter().map(|p| (p.0, p.1)), c.stroke_width(2)))?
            .label(r.policy.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        down.draw_series(LineSeries::new(s.iter().filter(|p| p.2.is_finite()).map(|p| (p.0, p.2)), c.stroke_width(2)))?;
        // The load's progress: its first layer and its end, in the policy's colour.
        for t in [r.first_layer_s, r.loaded_s].into_iter().flatten() {
            up.draw_series(DashedLineSeries::new(vec![(t, 0.0), (t, rmax)], 6, 4, c.stroke_width(1)))?;
        }
    }
    if let Some(r) = runs.first() {
        up.draw_series(LineSeries::new(vec![(r.scale_at_s, 0.0), (r.scale_at_s, rmax)], BLACK.stroke_width(1)))?;
        up.draw_series(std::iter::once(Text::new(" scale-out", (r.scale_at_s, rmax * 0.95), ("sans-serif", 13))))?;
    }
    up.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    root.present()?;
    Ok(())
}
