//! The C ABI from C: `c/transfer_test.c` compiled with the `cc` crate's compiler
//! (`-std=c11 -Wall -Wextra -Werror`) against the committed header and the cdylib, then run;
//! and the cdylib exports nothing but `cascade_*`.
#![allow(clippy::unwrap_used)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The directory cargo put this crate's cdylib and staticlib in (beside the test's deps).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    for dir in [deps, deps.parent().unwrap()] {
        if dir.join("libcascade_ffi.so").is_file() {
            return dir.to_path_buf();
        }
    }
    panic!("libcascade_ffi.so not found beside {}", deps.display());
}

fn compiler() -> cc::Tool {
    cc::Build::new()
        .target(env!("CASCADE_FFI_TARGET"))
        .host(env!("CASCADE_FFI_HOST"))
        .opt_level(0)
        .cargo_metadata(false)
        .get_compiler()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Compiles the C test with `extra` flags; the compiler's complaint when it fails.
fn compile(out: &Path, name: &str, extra: &[&str]) -> Result<PathBuf, String> {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = lib_dir();
    let exe = out.join(name);
    let mut cmd = compiler().to_command();
    cmd.args(["-std=c11", "-Wall", "-Wextra", "-Werror"])
        .args(extra)
        .arg("-I")
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join("c/transfer_test.c"))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lcascade_ffi");
    let o = cmd.output().unwrap();
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    Ok(exe)
}

#[test]
fn a_c_program_transfers_verifies_and_reports_errors() {
    let dir = std::env::temp_dir().join(format!("cascade-c-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = compile(&dir, "transfer_test", &[]).unwrap_or_else(|e| panic!("compiling the C test failed:\n{e}"));
    run_c_test(&exe, &dir);
}

/// The same program under AddressSanitizer and UndefinedBehaviorSanitizer (with leak
/// detection): every byte the library writes into the caller's buffers is checked against
/// their bounds by ASan's `memcpy` interceptors, and what the program frees must be all it
/// allocated. The library itself is not instrumented (that would need a nightly toolchain).
#[test]
fn the_c_program_is_clean_under_address_and_undefined_sanitizers() {
    let dir = std::env::temp_dir().join(format!("cascade-c-abi-asan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let flags = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"];
    match compile(&dir, "transfer_test_asan", &flags) {
        Ok(exe) => run_c_test(&exe, &dir),
        Err(e) if e.contains("asan") || e.contains("ubsan") || e.contains("sanitize") => {
            eprintln!("skipped: the C compiler has no sanitizer runtime here: {e}");
            let _ = std::fs::remove_dir_all(&dir);
        }
        Err(e) => panic!("compiling the C test with sanitizers failed:\n{e}"),
    }
}

fn run_c_test(exe: &Path, dir: &Path) {
    let (p0, p1) = (free_port(), free_port());
    // cargo's LD_LIBRARY_PATH for tests also names target/debug, whose uplifted copy of the
    // library only `cargo build` refreshes: load the one this test run built.
    let o = Command::new(exe)
        .env("LD_LIBRARY_PATH", lib_dir())
        .arg(p0.to_string())
        .arg(p1.to_string())
        .arg(dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    let _ = std::fs::remove_dir_all(dir);
    assert!(o.status.success(), "the C test failed:\n{stdout}\n{stderr}");
    for line in [
        "wrote 1048576 bytes in 4 verified WRITEs",
        "read 1048576 bytes back",
        "received \"hello from node 0\"",
        "notified \"written\" behind a 1048576-byte WRITE",
    ] {
        assert!(stdout.contains(line), "missing {line:?}:\n{stdout}");
    }
    // The provoked errors come back with their messages.
    assert!(stdout.contains("provoked error -1: cascade_post: ops[0].kind is 77"), "{stdout}");
    assert!(stdout.contains("provoked error -1: cascade_endpoint_create: config is null"), "{stdout}");
    assert!(stdout.contains("refused WRITE (status -5)"), "{stdout}");
    assert!(stdout.contains("multicast done (status 0)"), "{stdout}");
    assert!(stdout.contains("bytes equal to the source"), "{stdout}");
    assert!(stdout.trim_end().ends_with("ok"), "{stdout}");
}

#[test]
fn the_cdylib_exports_only_cascade_symbols() {
    let lib = lib_dir().join("libcascade_ffi.so");
    let o = match Command::new("nm").args(["-D", "--defined-only"]).arg(&lib).output() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipped: nm (binutils) is not installed: {e}");
            return;
        }
    };
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    let exported: Vec<&str> = text
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (kind, name) = (f.nth(1)?, f.next()?);
            // Text and data symbols: what a C program can link against.
            matches!(kind, "T" | "D" | "B" | "R").then_some(name)
        })
        .collect();
    assert!(exported.len() >= 20, "{exported:?}");
    let foreign: Vec<&&str> = exported.iter().filter(|n| !n.starts_with("cascade_")).collect();
    assert!(foreign.is_empty(), "symbols outside cascade_*: {foreign:?}");
}

#[test]
fn the_python_example_transfers_between_two_processes() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/ffi_transfer.py");
    let lib = lib_dir().join("libcascade_ffi.so");
    let o = match Command::new("python3").arg(&script).arg("--lib").arg(&lib).output() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipped: python3 is not installed: {e}");
            return;
        }
    };
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("wrote 4194304 bytes into node 1"), "{stdout}");
    assert!(stdout.contains("node 1 says: verified"), "{stdout}");
}
