//! Restore-correctness suite: one small C program per kind of state
//! (`tests/c/*.c`), compiled here with `cc` against this crate's static
//! library and run. Each program clones itself through the local backend;
//! every clone checks its state and exits 0, the parent joins and checks the
//! statuses (and, for the heap, the number of pages fetched).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// target/<profile>/libstarling_fork.a, next to the deps dir holding this test.
fn staticlib() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>");
    let lib = profile_dir.join("libstarling_fork.a");
    assert!(lib.exists(), "{} missing (cargo builds it with the crate's staticlib type)", lib.display());
    lib
}

fn out_dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fork-restore-suite");
    std::fs::create_dir_all(&d).expect("create tmp dir");
    d
}

fn cc(args: &[&str]) {
    let status = Command::new("cc").args(args).status().expect("run cc");
    assert!(status.success(), "cc {args:?} failed");
}

fn build(name: &str) -> PathBuf {
    let c = manifest().join("tests/c");
    let include = manifest().join("../../include");
    let out = out_dir().join(name);
    cc(&[
        "-O1", "-g", "-Wall", "-I", include.to_str().unwrap(), "-I", c.to_str().unwrap(),
        c.join(format!("{name}.c")).to_str().unwrap(), staticlib().to_str().unwrap(),
        "-lpthread", "-ldl", "-lm", "-o", out.to_str().unwrap(),
    ]);
    out
}

fn run(name: &str, args: &[&str]) -> String {
    let exe = build(name);
    let mut child = Command::new(&exe)
        .args(args)
        // This suite tests restore on this machine (the cluster suite is tests/test_fork.py).
        .env("STARLING_FORK_BACKEND", "local")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn test program");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            break;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("{name} timed out");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    println!("--- {name} stdout:\n{stdout}--- {name} stderr:\n{stderr}");
    assert!(out.status.success(), "{name} failed: {:?}\n{stderr}", out.status);
    assert!(stdout.contains(&format!("PASS {name}")), "{name} did not report PASS");
    stdout
}

#[test]
fn heap_brk_mmap_and_lazy_1gib() {
    let out = run("heap", &[]);
    assert!(out.contains("fetched"));
}

#[test]
fn stack_tls_errno() {
    run("stack_tls_errno", &[]);
}

#[test]
fn env_cwd_umask_open_file() {
    run("env_cwd_file", &[]);
}

#[test]
fn pid_rseq_sched_getcpu_vdso() {
    run("pid_sched_vdso", &[]);
}

#[test]
fn mutexes_threads_signals() {
    run("mutex_signal", &[]);
}

#[test]
fn dlopen_library() {
    let plugin = out_dir().join("libsfplugin.so");
    cc(&["-shared", "-fPIC", manifest().join("tests/c/plugin.c").to_str().unwrap(), "-o", plugin.to_str().unwrap()]);
    run("dlopen", &[plugin.to_str().unwrap()]);
}

/// Threads started in a clone on stacks glibc cached from threads that ended
/// in the parent: their discards (REMOVE events) race with another thread's
/// faults, and no page may arrive as zeros (see tests/c/cached_stack_threads.c).
#[test]
fn threads_on_cached_stacks_while_faulting() {
    run("cached_stack_threads", &[]);
}
