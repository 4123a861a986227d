//! The demo's live view and record: progress bars from the manager's notices, and the bytes each
//! node holds over time (for the JSON report and the PNG timeline).

use std::collections::BTreeMap;
use std::path::Path;

use cascade_param_pool::manager::Notice;
use indicatif::{MultiProgress, ProgressBar};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
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
                let style = crate::pool::progress::copy_bar_style();
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
            Notice::NodeDown { node, drained } => {
                self.copies.retain(|_, (n, _)| *n != node);
                self.sample(t, node);
                self.mark(t, if drained { format!("node {node} left (drained)") } else { format!("node {node} dead") });
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
        // The plot area is about 1,000 px wide; a 14 px label character about 7.5 px.
        let places = label_places(&self.marks, tmax, tmax * 7.5 / 1000.0);
        for (m, (row, left)) in self.marks.iter().zip(places) {
            chart.draw_series(LineSeries::new(vec![(m.t, 0.0), (m.t, ymax)], BLACK.stroke_width(1)))?;
            let y = ymax * (0.97 - 0.05 * row as f64);
            let (text, h) =
                if left { (format!("{} ", m.what), HPos::Right) } else { (format!(" {}", m.what), HPos::Left) };
            let style = TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(h, VPos::Top));
            chart.draw_series(std::iter::once(Text::new(text, (m.t, y), style)))?;
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

/// The most label rows below the plot's top; more crowded marks share them again.
const LABEL_ROWS: usize = 8;

/// Where each mark's label goes: its row (0 at the top) and whether it is drawn left of its line
/// (it would run past `tmax` otherwise). Labels take, in time order, the first row where they
/// overlap no label before them, each `chars + 1` times `s_per_char` seconds wide.
fn label_places(marks: &[Mark], tmax: f64, s_per_char: f64) -> Vec<(usize, bool)> {
    let mut order: Vec<usize> = (0..marks.len()).collect();
    order.sort_by(|a, b| marks[*a].t.total_cmp(&marks[*b].t));
    let mut row_end: Vec<f64> = Vec::new();
    let mut out = vec![(0, false); marks.len()];
    for i in order {
        let m = &marks[i];
        let w = (m.what.chars().count() + 1) as f64 * s_per_char;
        let left = m.t + w > tmax;
        let (start, end) = if left { (m.t - w, m.t) } else { (m.t, m.t + w) };
        let row = match row_end.iter().position(|&e| e <= start) {
            Some(r) => r,
            None if row_end.len() < LABEL_ROWS => {
                row_end.push(f64::NEG_INFINITY);
                row_end.len() - 1
            }
            // Every row is taken here: the one that frees first.
            None => row_end.iter().enumerate().min_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(r, _)| r),
        };
        row_end[row] = end;
        out[i] = (row, left);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(t: f64, what: &str) -> Mark {
        Mark { t, what: what.into() }
    }

    #[test]
    fn close_labels_take_rows_of_their_own_and_edge_labels_go_left() {
        // The demo's repair: four marks within 11 ms near the plot's right edge, after two that
        // are far apart.
        let marks = vec![
            mark(0.53, "scale-out"),
            mark(0.87, "kill -9 node 4"),
            mark(1.889, "node 4 dead"),
            mark(1.894, "multicast moving bytes (set-up 4 ms)"),
            mark(1.8945, "multicast moving bytes (set-up 4 ms)"),
            mark(1.899, "multicast moving bytes (set-up 6 ms)"),
        ];
        let places = label_places(&marks, 2.2, 0.017);
        assert_eq!(places[0], (0, false));
        assert_eq!(places[1], (0, false), "a label that starts after the last one ends shares its row");
        let rows: std::collections::BTreeSet<usize> = places[2..].iter().map(|p| p.0).collect();
        assert_eq!(rows.len(), 4, "{places:?}");
        assert!(places[3..].iter().all(|p| p.1), "labels that would run past the edge go left: {places:?}");
        assert!(!places[2].1, "a short label that fits stays right of its line");
    }

    #[test]
    fn crowded_labels_reuse_rows_after_the_last_one() {
        let marks: Vec<Mark> = (0..20).map(|i| mark(i as f64 * 0.001, "a long label text")).collect();
        let places = label_places(&marks, 100.0, 0.1);
        assert!(places.iter().all(|p| p.0 < LABEL_ROWS && !p.1), "{places:?}");
        assert_eq!(places[LABEL_ROWS].0, 0, "the row that frees first is reused");
    }
}
