//! The emulated executor — a **test double** for cluster-scale experiments: running a layer takes
//! the time a profile says and computes nothing. The activation passes through unchanged except
//! for its next-layer index.

use std::ops::Range;
use std::time::Duration;

use crate::{Activation, ExecError, LayerExec};

/// Per-layer time from a latency profile: a batch of `b` takes `(alpha + beta·b) / L` per layer,
/// the model's whole-batch latency ℓ(b) = α + β·b spread evenly over its `L` layers.
#[derive(Debug, Clone, PartialEq)]
pub struct Emulated {
    layers: usize,
    alpha: Duration,
    beta: Duration,
}

impl Emulated {
    /// `layers` layers, ℓ(b) = `alpha` + `beta`·b for the whole model.
    pub fn new(layers: usize, alpha: Duration, beta: Duration) -> Emulated {
        Emulated { layers, alpha, beta }
    }

    /// Every layer takes `per_layer`, whatever the batch.
    pub fn uniform(layers: usize, per_layer: Duration) -> Emulated {
        Emulated { layers, alpha: per_layer * layers as u32, beta: Duration::ZERO }
    }

    /// One layer's time for a batch of `batch`.
    pub fn layer_time(&self, batch: usize) -> Duration {
        (self.alpha + self.beta * batch as u32) / self.layers.max(1) as u32
    }
}

impl LayerExec for Emulated {
    fn layers(&self) -> usize {
        self.layers
    }

    fn run(&self, layers: Range<usize>, mut act: Activation) -> Result<Activation, ExecError> {
        if layers.end > self.layers || layers.start > layers.end {
            return Err(ExecError::NoSuchLayer { layer: layers.end, layers: self.layers });
        }
        if act.next_layer != layers.start {
            return Err(ExecError::OutOfOrder { have: act.next_layer, want: layers.start });
        }
        let batch = act.ids.dims2()?.0;
        std::thread::sleep(self.layer_time(batch) * layers.len() as u32);
        act.next_layer = layers.end;
        Ok(act)
    }
}
