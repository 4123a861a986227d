//! [`say!`]: a line for the operator on standard error that never panics.
//!
//! `eprintln!` panics when stderr cannot be written: a daemon run as `cascade node … 2>&1 | tee
//! log` and stopped with Ctrl-C loses its `tee` to the same signal, and its first words on the
//! way out (SIGPIPE is ignored in daemons, so the write fails with EPIPE) panicked, so it
//! exited with 101 in the middle of its graceful stop. A daemon's lines go through here; what
//! cannot be written is dropped, as the log lines (`tracing`) already are.

/// Writes one line to standard error, dropping it if stderr cannot take it.
pub(crate) fn line(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{args}");
}

/// `eprintln!` for daemons: the line is dropped, not a panic, when stderr cannot be written.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::say::line(format_args!($($arg)*))
    };
}
pub(crate) use say;
