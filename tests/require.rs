//! What a Rust test needs to run its subject, checked in one place (included by the crates'
//! tests with `#[path = "../../../tests/require.rs"] mod require;`; the Python twin is
//! `tests/require.py`).
//!
//! A test that cannot run what it tests (not root, no FUSE, no nft, a missing tool) FAILS with
//! the reason. Only `STARLING_TEST_ALLOW_SKIP=1` (README.md, "Tests") turns that into a skip:
//! the functions then print the reason and return `false`, and the test returns early.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Stdio};

pub const ALLOW_SKIP_VAR: &str = "STARLING_TEST_ALLOW_SKIP";

pub fn skips_allowed() -> bool {
    std::env::var_os(ALLOW_SKIP_VAR).is_some_and(|v| v == "1")
}

/// `true` if `ok`; otherwise panics with `reason`, or (with the opt-out) prints it and returns `false`.
#[track_caller]
pub fn require(ok: bool, reason: &str) -> bool {
    if ok {
        return true;
    }
    if skips_allowed() {
        eprintln!("SKIPPED ({ALLOW_SKIP_VAR}=1): {reason}");
        return false;
    }
    panic!("cannot run: {reason} (set {ALLOW_SKIP_VAR}=1 to skip such tests instead)");
}

/// Effective uid 0.
#[track_caller]
pub fn root(what: &str) -> bool {
    // SAFETY: geteuid has no preconditions and touches no memory.
    require(unsafe { libc::geteuid() } == 0, &format!("{what} needs root"))
}

/// An executable that runs (`NAME ARG` exits, whatever its status); `package` provides it on Debian.
#[track_caller]
pub fn tool(name: &str, arg: &str, package: &str) -> bool {
    let runs = Command::new(name).arg(arg).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok();
    require(runs, &format!("{name} not found (apt-get install -y {package})"))
}

/// A path that must exist (a device node, a kernel interface).
#[track_caller]
pub fn path(p: &str, why: &str) -> bool {
    require(Path::new(p).exists(), &format!("{p} missing: {why}"))
}
