//! Restore-correctness suite: one small C program per kind of state
//! (`tests/c/*.c`), compiled here with `cc` against this crate's static
//! library and run. Each program clones itself through the local backend;
//! every clone checks its state and exits 0, the parent joins and checks the
//! statuses (and, for the heap, the number of pages fetched).

use std::io::Read;
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

/// Build and run a suite program on the local backend; (success, stdout, stderr).
fn run_program(name: &str, args: &[&str]) -> (bool, String, String) {
    let exe = build(name);
    let mut child = Command::new(&exe)
        .args(args)
        // This suite tests restore on this machine (the cluster suite is tests/test_fork.py).
        .env("STARLING_FORK_BACKEND", "local")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn test program");
    // Readers drain the pipes while we wait, so a chatty program cannot block on a full pipe.
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("piped")));
    let err = drain(Box::new(child.stderr.take().expect("piped")));
    // A bound on a hang only: every program ends in seconds.
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if start.elapsed() > Duration::from_secs(600) {
            let _ = child.kill();
            panic!("{name} did not end within 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (stdout, stderr) = (out.join().expect("stdout reader"), err.join().expect("stderr reader"));
    println!("--- {name} stdout:\n{stdout}--- {name} stderr:\n{stderr}");
    (status.success(), stdout, stderr)
}

/// Run a suite program whose clones check their state: it must exit 0 and report PASS.
fn run(name: &str, args: &[&str]) -> String {
    let (ok, stdout, stderr) = run_program(name, args);
    assert!(ok, "{name} failed\n{stderr}");
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

/// MAP_SHARED: a shared file mapping stays the (shared) file; shared anonymous memory is a private copy.
#[test]
fn shared_file_and_anonymous_mappings() {
    run("shared_maps", &[]);
}

/// Memory moved with mremap, in the parent before cloning and in the clone before fetching.
#[test]
fn mremapped_memory() {
    run("mremap", &[]);
}

/// Pipes become EOF/EPIPE placeholders at their fd numbers; sockets are closed.
#[test]
fn pipe_placeholders_and_closed_sockets() {
    run("pipes_sockets", &[]);
}

/// The alternate signal stack (the handler runs on it) and soft/hard rlimits.
#[test]
fn sigaltstack_and_rlimits() {
    run("altstack_rlimits", &[]);
}

/// Run `refused MODE`: sf_clone must fail, naming the mapping at the address the program mapped.
fn assert_refused(mode: &str, reason_words: &[&str]) {
    let (ok, stdout, stderr) = run_program("refused", &[mode]);
    assert!(ok, "refused {mode} exited non-zero: {stdout}{stderr}");
    assert!(!stdout.contains("CLONE RAN"), "a clone ran: {stdout}");
    let start = stdout.lines().find_map(|l| l.strip_prefix("MAPPING ")).expect("MAPPING line").trim().to_string();
    let error = stdout.lines().find_map(|l| l.strip_prefix("REFUSED: ")).expect("REFUSED line").to_lowercase();
    assert!(error.contains(&start), "the error names another mapping than {start}: {error}");
    assert!(reason_words.iter().any(|w| error.contains(w)), "the error gives no reason among {reason_words:?}: {error}");
}

/// VM_DONTCOPY mappings (a perf_event ring buffer, MADV_DONTFORK memory) are absent, as after fork.
#[test]
fn dontcopy_mappings_are_absent_as_after_fork() {
    run("dontfork", &[]);
}

/// Puts `/proc/sys/vm/nr_hugepages` back as it was when dropped.
struct HugePages(Option<String>);

impl Drop for HugePages {
    fn drop(&mut self) {
        if let Some(before) = &self.0 {
            let _ = std::fs::write("/proc/sys/vm/nr_hugepages", before);
        }
    }
}

/// A hugetlb mapping. The test reserves one 2 MiB huge page if none is free, as an admin would
/// (`sysctl vm.nr_hugepages`), and gives it back afterwards.
#[test]
fn hugetlb_mapping_is_refused() {
    let free = |text: &str| {
        text.lines().find_map(|l| l.strip_prefix("HugePages_Free:")).and_then(|v| v.trim().parse::<u64>().ok())
    };
    let meminfo = std::fs::read_to_string("/proc/meminfo").expect("read /proc/meminfo");
    let _restore = match free(&meminfo) {
        Some(n) if n > 0 => HugePages(None),
        Some(_) => {
            let before = std::fs::read_to_string("/proc/sys/vm/nr_hugepages").expect("read nr_hugepages");
            let more = before.trim().parse::<u64>().expect("nr_hugepages is a number") + 1;
            let guard = HugePages(Some(before));
            std::fs::write("/proc/sys/vm/nr_hugepages", more.to_string()).expect("reserve a huge page (needs root)");
            let now = std::fs::read_to_string("/proc/meminfo").expect("read /proc/meminfo");
            assert!(free(&now).is_some_and(|n| n > 0), "the kernel gave no huge page (memory too fragmented?)");
            guard
        }
        None => panic!("no HugePages_Free in /proc/meminfo: this kernel has no hugetlbfs"),
    };
    assert_refused("hugetlb", &["huge"]);
}
