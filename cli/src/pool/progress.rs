//! Progress of the pool's long admin calls (`cascade pool register|repair|drain|undrain|deploy|
//! apply-epoch`): while the call runs, the manager's status is read on a second connection
//! (answered while the manager is busy) and each copy it is making gets a bar on stderr, with
//! the bytes in place so far (verified by its multicast, or placed by its load from the file).
//! When stderr is not a terminal (a log, a pipe) the same goes there as plain lines instead: one
//! when a copy starts, one every [`LINE_EVERY`] while it is made, one when it is ready or gone.
//! `--json` callers get neither. A copy made between two reads of the status, never seen
//! loading, still gets its line (or a full bar) when it is first seen ready.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use cascade_param_pool::manager::{AdminRequest, CopyStatus, Status};
use cascade_param_pool::pool::CopyId;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use super::Admin;

/// How often the status is read while a call runs.
const POLL: Duration = Duration::from_millis(250);

/// How often a copy still being made gets a line, off a terminal.
const LINE_EVERY: Duration = Duration::from_secs(10);

/// The style of a copy's bar, shared with the demo's timeline.
pub(crate) fn copy_bar_style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix:>8} {bar:36.cyan/blue} {bytes:>10}/{total_bytes:<10} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
}

/// The copies a call's progress has seen, to tell a copy made between two reads of the status
/// (first seen ready) from one that was there before the call.
#[derive(Default)]
struct Seen(Option<BTreeSet<CopyId>>);

impl Seen {
    /// The copies of `s` that are ready and new since the last status: none in the first status
    /// (the baseline: what the pool held before the call), then each copy seen for the first
    /// time already ready.
    fn new_ready<'s>(&mut self, s: &'s Status) -> Vec<&'s CopyStatus> {
        let first = self.0.is_none();
        let known = self.0.get_or_insert_with(BTreeSet::new);
        s.copies.iter().filter(|c| known.insert(c.id) && !first && c.state == "ready").collect()
    }
}

/// One bar per copy the pool is loading, updated from successive statuses.
pub(super) struct CopyBars {
    bars: MultiProgress,
    open: BTreeMap<CopyId, ProgressBar>,
    seen: Seen,
}

impl CopyBars {
    /// Bars drawn on `bars`.
    pub(super) fn new(bars: MultiProgress) -> CopyBars {
        CopyBars { bars, open: BTreeMap::new(), seen: Seen::default() }
    }

    /// A bar for copy `c`, of `total` bytes.
    fn bar(&self, s: &Status, c: &CopyStatus, total: u64) -> ProgressBar {
        let bar = self.bars.add(ProgressBar::new(total).with_style(copy_bar_style()));
        bar.set_prefix(format!("node {}", c.node));
        bar.set_message(copy_label(s, c));
        bar
    }

    /// Shows `s`: a bar for each loading copy (its bytes in place, when its multicast reported
    /// them), a finished one for a copy that became ready (also for one never seen loading), an
    /// abandoned one for a copy that went without becoming ready (its load failed, or it was
    /// dropped).
    pub(super) fn update(&mut self, s: &Status) {
        for c in self.seen.new_ready(s) {
            let total = size(s, c);
            let bar = self.bar(s, c, total);
            bar.set_position(total);
            bar.finish_with_message(format!("{} ready", bar.message()));
        }
        self.open.retain(|id, bar| {
            match ended(s, *id) {
                None => return true,
                Some(Ended::Ready) => {
                    bar.set_position(bar.length().unwrap_or(0));
                    bar.finish_with_message(format!("{} ready", bar.message()));
                }
                Some(Ended::Gone) => bar.abandon_with_message(format!("{}: gone before it was ready", bar.message())),
            }
            false
        });
        for (c, total) in loading(s) {
            if !self.open.contains_key(&c.id) {
                let bar = self.bar(s, c, total);
                self.open.insert(c.id, bar);
            }
            let bar = &self.open[&c.id];
            if let Some(b) = c.in_place {
                bar.set_position(b);
            }
        }
    }

    /// The bars still open, by copy.
    #[cfg(test)]
    fn open(&self) -> &BTreeMap<CopyId, ProgressBar> {
        &self.open
    }
}

/// What became of a copy that was loading, as `s` shows it.
enum Ended {
    /// It is ready.
    Ready,
    /// It went without becoming ready (its load failed, or it was dropped).
    Gone,
}

/// What became of copy `id`, or `None` while `s` shows it loading.
fn ended(s: &Status, id: CopyId) -> Option<Ended> {
    match s.copies.iter().find(|c| c.id == id).map(|c| c.state.as_str()) {
        Some("loading") => None,
        Some("ready") => Some(Ended::Ready),
        _ => Some(Ended::Gone),
    }
}

/// The copies `s` shows loading, each with its model's size in bytes.
fn loading(s: &Status) -> impl Iterator<Item = (&CopyStatus, u64)> {
    s.copies.iter().filter(|c| c.state == "loading").map(|c| (c, size(s, c)))
}

/// Copy `c`'s model's size in bytes (0 if `s` lacks the model).
fn size(s: &Status, c: &CopyStatus) -> u64 {
    s.models.iter().find(|m| m.id == c.model).map_or(0, |m| m.bytes)
}

/// A copy's name in progress output: its model, id and kind.
fn copy_label(s: &Status, c: &CopyStatus) -> String {
    let name = s
        .models
        .iter()
        .find(|m| m.id == c.model)
        .map_or_else(|| format!("model {}", c.model), |m| m.name.escape_debug().to_string());
    format!("{name} (copy {}, {})", c.id, c.kind)
}

/// The same as [`CopyBars`] as plain lines, for stderr that is not a terminal (sans-IO: the
/// caller says when it is and prints the lines).
pub(super) struct CopyLines {
    /// Each copy being made: its line's prefix and when it last had a line.
    open: BTreeMap<CopyId, (String, std::time::Instant)>,
    seen: Seen,
}

impl CopyLines {
    /// Nothing seen yet.
    pub(super) fn new() -> CopyLines {
        CopyLines { open: BTreeMap::new(), seen: Seen::default() }
    }

    /// The lines `s`, seen at `now`, calls for: a copy that started, one still loading whose
    /// last line is [`LINE_EVERY`] old, one that became ready or went, one made since the
    /// last status without being seen loading.
    pub(super) fn update(&mut self, s: &Status, now: std::time::Instant) -> Vec<String> {
        let mut lines: Vec<String> = (self.seen.new_ready(s).into_iter())
            .map(|c| format!("node {}: {}: ready ({} bytes)", c.node, copy_label(s, c), size(s, c)))
            .collect();
        self.open.retain(|id, (label, _)| {
            match ended(s, *id) {
                None => return true,
                Some(Ended::Ready) => lines.push(format!("{label}: ready")),
                Some(Ended::Gone) => lines.push(format!("{label}: gone before it was ready")),
            }
            false
        });
        for (c, total) in loading(s) {
            let at = || match c.in_place {
                Some(b) => format!("{b} of {total} bytes in place"),
                None => format!("{total} bytes to place"),
            };
            match self.open.get_mut(&c.id) {
                None => {
                    let label = format!("node {}: {}", c.node, copy_label(s, c));
                    lines.push(format!("{label}: started, {}", at()));
                    self.open.insert(c.id, (label, now));
                }
                Some((label, last)) if now.duration_since(*last) >= LINE_EVERY => {
                    lines.push(format!("{label}: {}", at()));
                    *last = now;
                }
                Some(_) => {}
            }
        }
        lines
    }
}

impl Admin {
    /// Makes a call that may take long, showing each copy the pool makes meanwhile: a bar on a
    /// terminal, plain lines on stderr otherwise, nothing with `--json` (a failing status read
    /// only stops the progress, never the call).
    pub(super) async fn call_with_progress(&self, req: AdminRequest) -> anyhow::Result<serde_json::Value> {
        if self.json {
            return self.call(req).await;
        }
        let bars = MultiProgress::new();
        let mut view =
            if bars.is_hidden() { View::Lines(CopyLines::new()) } else { View::Bars(CopyBars::new(bars.clone())) };
        // What the pool holds before the call: the copies that are not its work.
        if let Some(s) = self.status().await {
            view.show(&s);
        }
        let call = self.call(req);
        tokio::pin!(call);
        let mut tick = tokio::time::interval(POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut polling = true;
        let r = loop {
            tokio::select! {
                r = &mut call => break r,
                _ = tick.tick(), if polling => match self.status().await {
                    Some(s) => view.show(&s),
                    None => polling = false,
                },
            }
        };
        // The copies' last state, then the bars make way for the answer.
        if let Some(s) = self.status().await {
            view.show(&s);
        }
        let _ = bars.clear();
        r
    }

    /// The manager's status, if it can be read.
    async fn status(&self) -> Option<Status> {
        serde_json::from_value(self.call(AdminRequest::Status).await.ok()?).ok()
    }
}

/// Where progress goes.
enum View {
    /// Bars, on a terminal.
    Bars(CopyBars),
    /// Lines, on stderr that is not one.
    Lines(CopyLines),
}

impl View {
    fn show(&mut self, s: &Status) {
        match self {
            View::Bars(b) => b.update(s),
            View::Lines(l) => {
                for line in l.update(s, std::time::Instant::now()) {
                    eprintln!("{line}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use cascade_param_pool::manager::ModelStatus;
    use indicatif::ProgressDrawTarget;

    use super::*;

    fn copy(id: CopyId, state: &str, in_place: Option<u64>) -> CopyStatus {
        serde_json::from_value(serde_json::json!({
            "id": id, "model": 1, "node": 3, "kind": "host", "state": state, "in_place": in_place,
        }))
        .expect("a copy's status")
    }

    fn status(copies: Vec<CopyStatus>) -> Status {
        let model: ModelStatus =
            serde_json::from_value(serde_json::json!({ "id": 1, "name": "m", "bytes": 1000, "ready": 1 }))
                .expect("a model's status");
        serde_json::from_value(serde_json::json!({
            "k": 2, "models": [model], "copies": copies, "nodes": [], "violations": [], "healthy": false,
        }))
        .expect("a status")
    }

    #[test]
    fn a_copy_s_bar_follows_its_bytes_and_closes_when_it_is_ready_or_gone() {
        let mut v = CopyBars::new(MultiProgress::with_draw_target(ProgressDrawTarget::hidden()));
        v.update(&status(vec![copy(7, "ready", None), copy(8, "loading", None), copy(9, "loading", Some(250))]));
        assert_eq!(v.open().keys().copied().collect::<Vec<_>>(), vec![8, 9], "ready copies get no bar");
        assert_eq!((v.open()[&8].position(), v.open()[&8].length()), (0, Some(1000)), "a file load: no bytes yet");
        assert_eq!(v.open()[&9].position(), 250);
        assert!(v.open()[&9].message().contains("m (copy 9, host)"), "{}", v.open()[&9].message());
        v.update(&status(vec![copy(8, "loading", Some(600)), copy(9, "loading", Some(500))]));
        assert_eq!((v.open()[&8].position(), v.open()[&9].position()), (600, 500));
        let (b8, b9) = (v.open()[&8].clone(), v.open()[&9].clone());
        // 8 is ready; 9 failed (it is no longer in the pool).
        v.update(&status(vec![copy(8, "ready", None)]));
        assert!(v.open().is_empty());
        assert!(b8.is_finished() && b8.position() == 1000 && b8.message().ends_with("ready"), "{}", b8.message());
        assert!(b9.is_finished() && b9.position() == 500 && b9.message().contains("gone"), "{}", b9.message());
    }

    #[test]
    fn off_a_terminal_a_copy_gets_a_line_when_it_starts_every_ten_seconds_and_when_it_ends() {
        let mut v = CopyLines::new();
        let t0 = std::time::Instant::now();
        let lines = v.update(&status(vec![copy(7, "ready", None), copy(8, "loading", None)]), t0);
        assert_eq!(lines, vec!["node 3: m (copy 8, host): started, 1000 bytes to place".to_string()]);
        assert!(v.update(&status(vec![copy(8, "loading", Some(300))]), t0 + Duration::from_secs(4)).is_empty());
        let lines =
            v.update(&status(vec![copy(8, "loading", Some(600)), copy(9, "loading", Some(0))]), t0 + LINE_EVERY);
        assert_eq!(
            lines,
            vec![
                "node 3: m (copy 8, host): 600 of 1000 bytes in place".to_string(),
                "node 3: m (copy 9, host): started, 0 of 1000 bytes in place".to_string(),
            ]
        );
        let lines = v.update(&status(vec![copy(8, "ready", None)]), t0 + LINE_EVERY + Duration::from_secs(1));
        assert_eq!(
            lines,
            vec![
                "node 3: m (copy 8, host): ready".to_string(),
                "node 3: m (copy 9, host): gone before it was ready".to_string()
            ]
        );
        assert!(v.update(&status(vec![copy(8, "ready", None)]), t0 + 3 * LINE_EVERY).is_empty(), "nothing open");
    }

    #[test]
    fn a_copy_made_between_two_reads_gets_its_line_and_the_pool_before_the_call_none() {
        let mut v = CopyLines::new();
        let t0 = std::time::Instant::now();
        assert!(v.update(&status(vec![copy(7, "ready", None)]), t0).is_empty(), "the pool before the call");
        let lines = v.update(&status(vec![copy(7, "ready", None), copy(8, "ready", None)]), t0);
        assert_eq!(lines, vec!["node 3: m (copy 8, host): ready (1000 bytes)".to_string()]);
        assert!(v.update(&status(vec![copy(7, "ready", None), copy(8, "ready", None)]), t0).is_empty(), "once");
    }
}
