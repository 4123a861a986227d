//! Helpers shared by this crate's tests.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A scratch directory under the system's temp dir, removed when dropped (also when a test
/// panics). Unique per process and call; not created (a store creates its own directory).
pub(crate) struct Scratch(PathBuf);

impl Scratch {
    pub(crate) fn new(tag: &str) -> Scratch {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("cascade-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        Scratch(d)
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Opens a manager on the embedded store in `meta`, making the pool (`--init`) when the store
/// is new.
pub(crate) fn open_manager(
    mesh: std::sync::Arc<dyn cascade_transport::Mesh>,
    meta: &Path,
    mut cfg: crate::manager::ManagerConfig,
) -> Result<crate::manager::Manager<crate::EmbeddedStore>, crate::manager::ManagerError> {
    cfg.init = !crate::EmbeddedStore::exists(meta);
    crate::manager::Manager::open(mesh, crate::EmbeddedStore::open(meta)?, cfg)
}
