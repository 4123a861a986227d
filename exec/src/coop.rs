//! Cooperative execution while a new instance loads, run for real: the *new* executor runs the
//! first `x_i` layers of batch `i` (only layers already resident, one at a time, the lowest batch
//! first — a landing layer preempts later batches), hands the activation over, and the *old*
//! executor runs the rest, batches in FIFO order. This is the schedule [`crate::zigzag`] plans and
//! [`crate::zigzag::simulate`] simulates, executed on two threads with real (or emulated)
//! layers and a clock; in-process, the hand-over is a channel (between nodes it is the
//! activation's bytes, [`Activation::to_bytes`]).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::{Activation, ExecError, LayerExec};

/// When each of new's layers becomes resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// Layer `k` (0-based) lands `k ·` this after the start: the model is loading.
    LoadingEvery(Duration),
    /// The first `k` layers are resident from the start and no others arrive.
    First(usize),
}

impl Residency {
    fn at(&self, layer: usize) -> Option<Duration> {
        match *self {
            Residency::LoadingEvery(d) => Some(d * layer as u32),
            Residency::First(k) => (layer < k).then_some(Duration::ZERO),
        }
    }
}

/// Runs `batches` (queued at the start) cooperatively with splits `x`, new's layers arriving as
/// `residency` says. Returns each batch's latency from the start and its final activation.
pub fn run_cooperative(
    new: &dyn LayerExec,
    old: &dyn LayerExec,
    batches: Vec<Activation>,
    x: &[u32],
    residency: Residency,
) -> Result<Vec<(Duration, Activation)>, ExecError> {
    let layers = old.layers();
    if x.len() != batches.len() {
        return Err(ExecError::Input(format!("{} splits for {} batches", x.len(), batches.len())));
    }
    if let Some(bad) = x.iter().find(|&&v| v as usize >= layers) {
        return Err(ExecError::Input(format!("a split of {bad} layers: every batch ends on old ({layers} layers)")));
    }
    if let Some(bad) = x.iter().find(|&&v| v > 0 && residency.at(v as usize - 1).is_none()) {
        return Err(ExecError::Input(format!("a split of {bad} layers: new never holds them ({residency:?})")));
    }
    let (senders, receivers): (Vec<_>, Vec<_>) = x.iter().map(|_| mpsc::channel::<Activation>()).unzip();
    let start = Instant::now();
    std::thread::scope(|s| {
        // New: its pending batches, each with the layers it still owes.
        let mut pending: Vec<(usize, Activation)> = Vec::new();
        for (i, act) in batches.into_iter().enumerate() {
            if x[i] == 0 {
                let _ = senders[i].send(act);
            } else {
                pending.push((i, act));
            }
        }
        let newer = s.spawn(move || -> Result<(), ExecError> {
            // Every layer a pending batch still needs is resident at some point (checked above).
            let resident_at = |k: usize| residency.at(k).unwrap_or(Duration::MAX);
            while !pending.is_empty() {
                let now = start.elapsed();
                match pending.iter().position(|(_, a)| resident_at(a.next_layer) <= now) {
                    Some(p) => {
                        let (i, act) = pending.remove(p);
                        let act = new.run(act.next_layer..act.next_layer + 1, act)?;
                        if act.next_layer == x[i] as usize {
                            let _ = senders[i].send(act);
                        } else {
                            pending.insert(p, (i, act));
                        }
                    }
                    None => {
                        let next = pending.iter().map(|(_, a)| resident_at(a.next_layer)).min().unwrap_or(now);
                        std::thread::sleep(next.saturating_sub(now));
                    }
                }
            }
            Ok(())
        });
        let mut out = Vec::with_capacity(receivers.len());
        for (i, rx) in receivers.into_iter().enumerate() {
            let Ok(act) = rx.recv() else {
                // New failed before handing this batch over: its error says why.
                return match newer.join() {
                    Ok(Err(e)) => Err(e),
                    _ => Err(ExecError::Input(format!("batch {i} was never handed over"))),
                };
            };
            let act = old.run(x[i] as usize..layers, act)?;
            out.push((start.elapsed(), act));
        }
        match newer.join() {
            Ok(r) => r.map(|()| out),
            Err(_) => Err(ExecError::Input("the new instance's thread panicked".into())),
        }
    })
}

#[cfg(test)]
mod tests;
