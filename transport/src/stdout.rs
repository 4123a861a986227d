//! What a binary does when its standard output cannot be written, for every Cascade binary (they
//! all link the transport): `println!` panics then, and the hook installed here turns that panic
//! into what a Unix tool says.

/// Installs a panic hook for `println!`'s failures: a closed stdout (`Broken pipe`: the reader of
/// `| head` went away) is silent, any other failure to write it (ENOSPC, EIO) is said in one line
/// without a backtrace ("cannot write the output: No space left on device (os error 28)"), and
/// any other panic is reported as before. The panic still unwinds, so what the process holds is
/// released on the way out (peers stopped, namespaces and temporary directories removed), and
/// it exits with status 101. Call it first in `main`.
pub fn report_write_failures_briefly() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let p = info.payload();
        let msg = p.downcast_ref::<String>().map(String::as_str).or_else(|| p.downcast_ref::<&str>().copied());
        match msg.and_then(|m| m.strip_prefix("failed printing to stdout: ")) {
            Some(cause) if cause.starts_with("Broken pipe") => {}
            Some(cause) => eprintln!("cannot write the output: {cause}"),
            None => report(info),
        }
    }));
}
