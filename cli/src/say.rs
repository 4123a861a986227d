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

/// Says why the command failed, as `main` returning the error would, without the backtrace:
/// `Error: …`, then `Caused by:` and each cause (numbered when there are several).
///
/// anyhow captures a backtrace for every error when `RUST_BACKTRACE` is set, and printed it
/// under the message of a plain mistake (a missing file, a model of the other architecture) to
/// anyone who keeps that variable set for panics. `RUST_LIB_BACKTRACE=1` still shows it (the
/// variable anyhow itself reads first, for errors alone).
pub(crate) fn error(e: &anyhow::Error) {
    let wanted = std::env::var_os("RUST_LIB_BACKTRACE").is_some_and(|v| v != "0");
    line(format_args!("Error: {}", if wanted { format!("{e:?}") } else { chain(e) }));
}

/// `e` and its causes, as anyhow's `{:?}` writes them without a backtrace.
fn chain(e: &anyhow::Error) -> String {
    let causes: Vec<String> = e.chain().skip(1).map(|c| c.to_string()).collect();
    let mut s = e.to_string();
    match causes.as_slice() {
        [] => {}
        [one] => s += &format!("\n\nCaused by:\n    {one}"),
        many => {
            s += "\n\nCaused by:";
            for (i, c) in many.iter().enumerate() {
                s += &format!("\n    {i}: {c}");
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_error_reads_as_anyhows_without_a_backtrace() {
        let one = anyhow::anyhow!("inner").context("outer");
        assert_eq!(super::chain(&one), "outer\n\nCaused by:\n    inner");
        let two = one.context("top");
        assert_eq!(super::chain(&two), "top\n\nCaused by:\n    0: outer\n    1: inner");
        assert_eq!(super::chain(&anyhow::anyhow!("alone")), "alone");
    }
}
