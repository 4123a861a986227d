//! How many threads `candle`'s CPU kernels use, settled once per process, and which thread a
//! model's forward pass runs on ([`on_compute_threads`]).
//!
//! `candle-core` 0.11.1 asks `candle_core::utils::get_num_threads()` for a thread count at every
//! CPU matrix product (and in other kernels). Unless `RAYON_NUM_THREADS` is set, that call counts
//! the physical cores afresh each time with `num_cpus::get_physical()`, which opens, formats and
//! parses `/proc/cpuinfo`: about 270 reads of it per decoded token of SmolLM2-135M, a quarter of
//! `cascade generate`'s time for one prompt (2026-12-05: 8.2 s for 200 tokens, 2.5 s of it in the
//! kernel, against 6.2–6.5 s and 1.1 s with the count settled). [`settle_compute_threads`] writes
//! candle's own answer into `RAYON_NUM_THREADS` once, at start-up, so every later call reads it
//! from the environment instead.

/// The environment variable both `rayon` and `candle` read for their thread count.
pub const THREADS_VAR: &str = "RAYON_NUM_THREADS";

/// Sets [`THREADS_VAR`] to the thread count candle would compute for itself (the physical cores,
/// or the preferred cores of a hybrid CPU, as `candle_core::utils::get_num_threads` decides),
/// unless it is set already; returns the count in force. The count is the one candle used
/// before, so its kernels split their work as they did; `rayon`'s global pool, which reads the
/// same variable, starts with that many threads rather than one per logical CPU (they differ
/// only with SMT, where one per core is what candle's products wanted anyway).
///
/// # Safety
///
/// Writes the process environment: call it before any other thread exists (first thing in
/// `main`), since another thread reading the environment meanwhile is undefined behaviour.
pub unsafe fn settle_compute_threads() -> usize {
    if let Some(n) = std::env::var(THREADS_VAR).ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0) {
        return n;
    }
    let n = candle_core::utils::get_num_threads();
    std::env::set_var(THREADS_VAR, n.to_string());
    n
}

/// Runs `work` on one of rayon's global threads, where there are several and the caller is not
/// one of them (on the caller otherwise), and waits for it.
///
/// A model's forward pass alternates parallel products with serial steps (norms, attention's
/// small products, the KV cache). Called from another thread, each parallel part is injected
/// into the pool and wakes its sleeping threads while the caller blocks: about 200 round trips
/// per decoded token of SmolLM2-135M. From a pool thread the same parts start at once, the
/// caller's thread taking its share (2026-12-06, `cascade generate`: one prompt 37.1–37.8 →
/// 42.9–44.7 tokens/s, eight 108–112 → 119–126, thirty-two 192–193 → 218–223; the same text).
///
/// For a loop that drives one model with the process's compute to itself: the generator
/// ([`crate::llama::generate::Generator`]) and dLoRA's batcher. Not for a served instance: in a
/// process that serves several models from their own threads (the tests' in-process clusters),
/// whole passes queued on the one pool wait behind each other, so a decode instance's step
/// boundary came hundreds of milliseconds late behind other instances' work (tried in
/// `LayerExec::run` itself, 2026-12-06: `pd::a_decode_instance_drops_the_requests_of_a_router_it_lost`
/// failed beside the other tests). `cascade pd`'s and `cascade live`'s instances compute on one
/// thread each, where this runs the work in place anyway.
pub fn on_compute_threads<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() || rayon::current_num_threads() < 2 {
        return work();
    }
    rayon::scope(|_| work())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With several pool threads the work runs on one of them; from a pool thread, on that very
    /// thread; with a pool of one, on the caller.
    #[test]
    fn work_runs_on_a_pool_thread_where_there_are_several() {
        let ran_on = on_compute_threads(rayon::current_thread_index);
        assert_eq!(ran_on.is_some(), rayon::current_num_threads() > 1, "ran on {ran_on:?}");
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        pool.install(|| {
            let me = rayon::current_thread_index();
            assert_eq!(on_compute_threads(rayon::current_thread_index), me);
        });
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        one.install(|| assert_eq!(on_compute_threads(rayon::current_thread_index), Some(0)));
    }

    /// Read system calls this thread has made so far (`/proc/thread-self/io`).
    fn reads() -> u64 {
        let io = std::fs::read_to_string("/proc/thread-self/io").unwrap();
        io.lines().find_map(|l| l.strip_prefix("syscr:")).unwrap().trim().parse().unwrap()
    }

    /// Read system calls of `calls` calls to candle's thread count (net of reading the counter).
    fn reads_per(calls: u64) -> u64 {
        let before = reads();
        for _ in 0..calls {
            std::hint::black_box(candle_core::utils::get_num_threads());
        }
        let during = reads() - before;
        let before = reads();
        let idle = reads() - before;
        during.saturating_sub(idle)
    }

    /// The count is candle's own, and once settled candle reads it back from the environment
    /// without reading a file again. (Runs in a child process of its own, so no other thread
    /// can read the environment while it is written.)
    #[test]
    fn the_settled_count_is_candles_own_and_candle_stops_reading_files_for_it() {
        const CHILD: &str = "CASCADE_TEST_SETTLE_THREADS";
        if std::env::var_os(CHILD).is_some() {
            let own = candle_core::utils::get_num_threads();
            let unsettled = reads_per(100);
            // SAFETY: the child runs this test alone (`--test-threads=1`, one test selected).
            let n = unsafe { settle_compute_threads() };
            assert_eq!(n, own, "the settled count is the one candle computes");
            assert_eq!(std::env::var(THREADS_VAR).unwrap(), own.to_string());
            assert_eq!(candle_core::utils::get_num_threads(), own);
            let settled = reads_per(100);
            assert_eq!(settled, 0, "100 calls read {settled} times once settled ({unsettled} before)");
            // A count given by the user is kept.
            std::env::set_var(THREADS_VAR, "3");
            // SAFETY: as above.
            assert_eq!(unsafe { settle_compute_threads() }, 3);
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "threads::tests::the_settled_count_is_candles_own_and_candle_stops_reading_files_for_it"])
            .args(["--test-threads=1", "--nocapture"])
            .env(CHILD, "1")
            .env_remove(THREADS_VAR)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("1 passed"), "the child failed:\n{text}");
    }
}
