//! What the plots of `cascade demo` and `cascade live` share.

use std::path::Path;

use anyhow::Context;

/// Registers the font at `path` as plotters' "sans-serif" (the plots' text).
pub(crate) fn register_font(path: &Path) -> anyhow::Result<()> {
    let data = std::fs::read(path)
        .with_context(|| format!("reading font {} (apt-get install fonts-dejavu-core)", path.display()))?;
    plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, Box::leak(data.into_boxed_slice()))
        .map_err(|_| anyhow::anyhow!("{} is not a usable font", path.display()))
}
