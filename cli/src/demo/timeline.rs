//! The demo's live view and record: progress bars from the manager's notices, and the bytes each
//! node holds over time (for the JSON report and the PNG timeline).

use std::collections::BTreeMap;
use std::path::Path;

use cascade_param_pool::manager::Notice;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use plotters::prelude::*;
use serde::Serialize;

/// One sample: at `t` seconds, `node` holds `bytes`.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Sample {
    pub(crate) t: f64,
    pub(crate) node: u32,
    pub(crate) bytes: u64,
}

/// Something that happened, for the report and the plot's markers.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Mark {
    pub(crate) t: f64,
    pub(crate) what: String,
}

/// Follows the manager's notices.
pub(crate) struct Timeline {
    bars: MultiProgress,
    open: BTreeMap<u64, ProgressBar>,
    /// Copy → (node, bytes in place).
    copies: BTreeMap<u64, (u32, u64)>,
    names: BTreeMap<u32, String>,
    pub(crate) samples: Vec<Sample>,
    pub(crate) marks: Vec<Mark>,
    /// When each multicast began moving bytes (the manager's `Transferring` notices).
    pub(crate) transfers: Vec<f64>,
    /// Keep finished bars on screen (otherwise they are cleared).
    pub(crate) keep_bars: bool,
}

impl Timeline {
    pub(crate) fn new(nodes: impl Iterator<Item = u32>) -> Timeline {
        Timeline {
            bars: MultiProgress::new(),
            open: BTreeMap::new(),
            copies: BTreeMap::new(),
            names: BTreeMap::new(),
            samples: nodes.map(|node| Sample { t: 0.0, node, bytes: 0 }).collect(),
            marks: Vec::new(),
            transfers: Vec::new(),
            keep_bars: true,
        }
    }

    /// Names model `id` in the bars.
    pub(crate) fn name(&mut self, id: u32, name: &str) {
        self.names.insert(id, name.to_string());
    }

    /// Prints a line above the bars.
    pub(crate) fn println(&self, line: &str) {
        if self.bars.is_hidden() {
            println!("{line}");
        } else {
            let _ = self.bars.println(line);
        }
    }

    fn node_bytes(&self, node: u32) -> u64 {
        self.copies.values().filter(|(n, _)| *n == node).map(|(_, b)| b).sum()
    }

    fn sample(&mut self, t: f64, node: u32) {
        let bytes = self.node_bytes(node);
        self.samples.push(Sample { t, node, bytes });
    }

    pub(crate) fn mark(&mut self, t: f64, what: String) {
        self.marks.push(Mark { t, what });
    }

    pub(crate) fn on(&mut self, t: f64, n: Notice) {
        match n {
            Notice::Creating { copy, model, node, from, bytes } => {
                let style =
                    ProgressStyle::with_template("{prefix:>8} {bar:36.cyan/blue} {bytes:>10}/{total_bytes:<10} {msg}")
                        .unwrap_or_else(|_| ProgressStyle::default_bar())
                        .progress_chars("=> ");
                let bar = self.bars.add(ProgressBar::new(bytes).with_style(style));
                bar.set_prefix(format!("node {node}"));
                let name = self.names.get(&model).cloned().unwrap_or_else(|| format!("model {model}"));
                bar.set_message(format!("{name} via {from}"));
                self.open.insert(copy, bar);
                self.copies.insert(copy, (node, 0));
            }
            Notice::Progress { copy, node, bytes, .. } => {
                if let Some(b) = self.open.get(&copy) {
                    b.set_position(bytes);
                }
                self.copies.insert(copy, (node, bytes));
                self.sample(t, node);
            }
            Notice::Ready { copy, node, bytes } => {
                if let Some(b) = self.open.remove(&copy) {
                    b.set_position(bytes);
                    if self.keep_bars {
                        b.finish();
                    } else {
                        b.finish_and_clear();
                    }
                }
                self.copies.insert(copy, (node, bytes));
                self.sample(t, node);
            }
            Notice::Failed { copy, reason } => {
                if let Some(b) = self.open.remove(&copy) {
                    b.abandon_with_message(format!("failed: {reason}"));
                }
                if let Some((node, _)) = self.copies.remove(&copy) {
                    self.sample(t, node);
                }
            }
            Notice::Dropped { copy, node, .. } => {
                self.copies.remove(&copy);
                self.sample(t, node);
            }
            Notice::NodeDown { node } => {
                self.copies.retain(|_, (n, _)| *n != node);
                self.sample(t, node);
                self.mark(t, format!("node {node} dead"));
            }
            Notice::Lost { model, reason } => self.mark(t, format!("model {model} lost: {reason}")),
            Notice::Transferring { setup_seconds, .. } => {
                self.transfers.push(t);
                self.mark(t, format!("multicast moving bytes (set-up {:.0} ms)", setup_seconds * 1e3));
            }
        }
    }

    /// Draws bytes per node over time to `path`.
    pub(crate) fn plot(&self, path: &Path, font: &Path, title: &str) -> anyhow::Result<()> {
        crate::plot::register_font(font)?;
        let tmax = self.samples.iter().map(|s| s.t).fold(0.0f64, f64::max).max(0.1) * 1.15;
        let ymax = self.samples.iter().map(|s| s.bytes).max().unwrap_or(1).max(1) as f64 / 1048576.0 * 1.1;
        let root = BitMapBackend::new(path, (1100, 620)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..tmax, 0f64..ymax)?;
        chart.configure_mesh().x_desc("seconds").y_desc("MiB held").label_style(("sans-serif", 15)).draw()?;
        let nodes: std::collections::BTreeSet<u32> = self.samples.iter().map(|s| s.node).collect();
        for (i, node) in nodes.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            // A step line: the node holds its last sample's bytes until the next one.
            let mut pts = Vec::new();
            let mut last = 0.0;
            for s in self.samples.iter().filter(|s| s.node == *node) {
                pts.push((s.t, last));
                last = s.bytes as f64 / 1048576.0;
                pts.push((s.t, last));
            }
            pts.push((tmax, last));
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
                .label(format!("node {node}"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        }
        for (i, m) in self.marks.iter().enumerate() {
            chart.draw_series(LineSeries::new(vec![(m.t, 0.0), (m.t, ymax)], BLACK.stroke_width(1)))?;
            // Staggered, so labels of close marks do not overlap.
            let y = ymax * (0.97 - 0.05 * (i % 3) as f64);
            chart.draw_series(std::iter::once(Text::new(format!(" {}", m.what), (m.t, y), ("sans-serif", 14))))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()?;
        root.present()?;
        Ok(())
    }
}
