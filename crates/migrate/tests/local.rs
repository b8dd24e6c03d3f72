//! Live migration on one machine: a running multi-threaded C program moves
//! from itself to a restored copy (new PID namespace, same PID and TIDs),
//! through the real source and target drivers over TCP on loopback. Its
//! output must be exactly an undisturbed run's.

use starling_fork::restore::{Restore, RestoreProgram};
use starling_image::PlanOptions;
use starling_migrate::capture::CaptureOptions;
use starling_migrate::source::{migrate_out, SourceHooks, SourceOptions};
use starling_migrate::target::receive;
use std::io::{BufRead, BufReader, Read, Write};
use starling_fork::page_server::connect_proven;
use std::net::TcpListener;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;

#[path = "../../../tests/require.rs"]
mod require;

/// Root is needed (ptrace of another process's threads, PID namespaces,
/// `set_tid`): fail with the reason unless skipping is allowed (tests/require.rs).
fn require_root() -> bool {
    require::root("live migration (ptrace, PID namespaces, set_tid)")
}

fn build(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/c");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let st = Command::new("cc")
        .args(["-O1", "-g", "-Wall", "-pthread"])
        .arg(dir.join(format!("{name}.c")))
        .arg("-o")
        .arg(&out)
        .status()
        .expect("run cc");
    assert!(st.success(), "cc {name}.c failed");
    out
}

struct NoHooks;

impl SourceHooks for NoHooks {
    fn prepare(&mut self) -> Result<Vec<u8>, String> {
        Ok(Vec::new())
    }
    fn at_freeze(&mut self) -> Result<Vec<u8>, String> {
        Ok(Vec::new())
    }
    fn resumed(&mut self) {}
}

/// Start the restorer with the plan and socket at their numbers and
/// `stdout` as its fd 1.
fn spawn_restorer(p: &RestoreProgram, stdout: OwnedFd) -> std::process::Child {
    let fds: Vec<(i32, i32)> = p.fds.iter().map(|(n, fd)| (*n, fd.as_raw_fd())).collect();
    let mut cmd = Command::new(format!("/proc/self/fd/{}", p.program.as_raw_fd()));
    cmd.stdin(Stdio::null()).stdout(Stdio::from(stdout));
    // SAFETY: only fcntl/dup2 between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let moved: Vec<(i32, i32)> = fds.iter().map(|&(n, fd)| (n, libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 100))).collect();
            for (n, fd) in moved {
                if fd < 0 || libc::dup2(fd, n) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    cmd.spawn().expect("spawn restorer")
}

/// A program started with its stdout piped to us.
struct Running {
    child: std::process::Child,
    pid: i32,
    out: BufReader<std::process::ChildStdout>,
    seen: String,
}

fn start(mut cmd: Command) -> Running {
    cmd.stdout(Stdio::piped());
    // SAFETY: close_range between fork and exec: the test harness's own
    // descriptors (cargo's jobserver pipe) are not the program's.
    unsafe {
        cmd.pre_exec(|| {
            libc::syscall(libc::SYS_close_range, 3, u32::MAX, 0);
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("start");
    let pid = i32::try_from(child.id()).expect("a pid fits in i32");
    let out = BufReader::new(child.stdout.take().unwrap());
    Running { child, pid, out, seen: String::new() }
}

impl Running {
    fn read_until(&mut self, needle: &str) {
        while !self.seen.contains(needle) {
            let mut line = String::new();
            assert!(self.out.read_line(&mut line).unwrap() > 0, "program ended before {needle:?}:\n{}", self.seen);
            self.seen.push_str(&line);
        }
    }

    fn rest(&mut self) -> String {
        self.out.read_to_string(&mut self.seen).unwrap();
        self.seen.clone()
    }
}

/// What the target side saw: the restorer's exit and each process's outcome.
type TargetEnd = Result<(std::process::ExitStatus, Vec<starling_fork::restore::Outcome>), String>;

/// Move `p` to a restored copy on this machine (writing into the same stdout pipe).
fn migrate(p: &Running) -> (Result<starling_migrate::source::SourceReport, starling_migrate::MigrateError>, TargetEnd) {
    let stdout_w: OwnedFd = std::fs::OpenOptions::new().write(true).open(format!("/proc/{}/fd/1", p.pid)).unwrap().into();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // The move's key (the head makes it on a cluster): the target's page-server client proves it.
    let key = starling_proto::SecretKey::random();
    let target = std::thread::spawn(move || -> TargetEnd {
        let inc = receive(accept_proven(&listener, &key), key, true, &mut |_| Ok(())).map_err(|e| e.to_string())?;
        let desc = inc.descriptor.clone();
        let lost = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let lost2 = lost.clone();
        let serve = inc.serve(desc.clone(), 16, Arc::new(move |why| lost2.lock().unwrap().push(why)));
        let plan = PlanOptions { clone_id: 0, clone_count: 1, new_pid_namespace: true, clone_id_in_rax: false, seccomp: &[], terminal: false, join_groups: 0 };
        let (program, restore) = Restore::start(&desc, plan, serve).map_err(|e| e.to_string())?;
        let mut restorer = spawn_restorer(&program, stdout_w);
        drop(program);
        if !restore.wait_all_running() {
            inc.failed("the restorer ended before the process ran");
            return Err(format!("restorer failed: {:?}", restorer.wait()));
        }
        if let Err(e) = inc.resumed(Vec::new()) {
            let _ = restorer.kill();
            let _ = restorer.wait();
            return Err(e.to_string());
        }
        let status = restorer.wait().unwrap();
        let (outcomes, channel) = restore.finish();
        if let Some(e) = channel {
            return Err(e.to_string());
        }
        let lost = lost.lock().unwrap();
        if !lost.is_empty() {
            return Err(format!("the restored process was lost: {lost:?}; outcomes {outcomes:?}"));
        }
        Ok((status, outcomes))
    });
    let mut opts = SourceOptions::new(CaptureOptions { root: "/".into(), heuristics: true, reconnect: None }, "127.0.0.1".parse().unwrap());
    opts.key = key;
    let report = migrate_out(p.pid, connect_proven(addr, &key, true).unwrap(), &opts, &mut NoHooks);
    (report, target.join().unwrap())
}

/// The target's side of the move's key proof, as the agent does it (encrypted).
fn accept_proven(listener: &TcpListener, key: &starling_proto::SecretKey) -> starling_fork::page_server::Halves {
    let (s, _) = listener.accept().unwrap();
    let secrecy = starling_fork::page_server::prove_server(key, true, &mut &s, &mut &s).unwrap();
    starling_fork::page_server::halves(s, secrecy).unwrap()
}

/// Run `cmd` undisturbed, then again with a move once `ready` was printed;
/// the two outputs must be equal. Returns the migration's report.
fn moved_run_matches(cmd: impl Fn() -> Command, ready: &str) -> starling_migrate::source::SourceReport {
    let reference = cmd().output().expect("reference run");
    assert!(reference.status.success(), "reference run failed: {reference:?}");
    let reference = String::from_utf8(reference.stdout).unwrap();
    let mut p = start(cmd());
    p.read_until(ready);
    let (report, target) = migrate(&p);
    let report = report.expect("migrate");
    let original = p.child.wait().unwrap();
    assert_eq!(original.signal(), Some(libc::SIGKILL), "the source copy is killed once the target holds everything");
    let (status, outcomes) = target.expect("target side");
    let seen = p.rest();
    assert!(status.success(), "restored run: {status:?}\n{seen}");
    assert!(outcomes.iter().all(|o| o.handler_error.is_none()), "{outcomes:?}");
    assert_eq!(seen, reference, "output of the migrated run differs from an undisturbed run");
    println!("{report:?}");
    report
}

#[test]
fn threads_mid_work_move_and_finish_identically() {
    if !require_root() {
        return;
    }
    let exe = build("workers");
    let report = moved_run_matches(
        || {
            let mut c = Command::new(&exe);
            c.args(["200", "32", "20000"]);
            c
        },
        "round 5 ",
    );
    assert_eq!(report.threads, 5, "main thread and 4 workers");
    assert!(report.footprint_pages >= 32 * 256, "the 32 MiB heap was copied: {report:?}");
}

#[test]
fn open_file_timer_handlers_mask_umask_cwd_survive() {
    if !require_root() {
        return;
    }
    let exe = build("state");
    let data = std::env::temp_dir().join(format!("migrate-state-{}", std::process::id()));
    std::fs::write(&data, (0..200u8).map(|i| i.wrapping_mul(7).wrapping_add(3)).collect::<Vec<u8>>()).unwrap();
    let report = moved_run_matches(
        || {
            let mut c = Command::new(&exe);
            c.arg(&data).arg("60").current_dir(std::env::temp_dir());
            c
        },
        "step 20 ok",
    );
    assert_eq!(report.threads, 1);
    let _ = std::fs::remove_file(&data);
}

#[test]
fn python_numpy_computation_moves_mid_way() {
    if !require_root() {
        return;
    }
    if Command::new("python3").args(["-c", "import numpy"]).status().map(|s| !s.success()).unwrap_or(true) {
        assert!(std::env::var_os("STARLING_TEST_ALLOW_SKIP").is_some(), "python3 with numpy is needed (pip install numpy)");
        return;
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/numpy_work.py");
    moved_run_matches(
        || {
            let mut c = Command::new("python3");
            c.arg(&script).args(["80", "300", "0.02"]);
            c
        },
        "step 5 ",
    );
}

/// A socket held for good: every look finds it (the task runs on between
/// them), the refusal names it and says how often it looked, and the task
/// goes on undisturbed (`cat`, so it waits for the test, not for a time).
#[test]
fn a_socket_is_refused_before_anything_is_frozen() {
    if !require_root() {
        return;
    }
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut cmd = Command::new("cat");
    let sock = listener.as_raw_fd();
    // SAFETY: dup2 between fork and exec puts a socket at fd 5.
    unsafe {
        cmd.pre_exec(move || {
            libc::dup2(sock, 5);
            Ok(())
        });
    }
    // `start` closes fds from 3 up after this hook: reorder by doing it here.
    let mut p = {
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut child = cmd.spawn().expect("start");
        let pid = i32::try_from(child.id()).expect("a pid fits in i32");
        let out = BufReader::new(child.stdout.take().unwrap());
        Running { child, pid, out, seen: String::new() }
    };
    let mut input = p.child.stdin.take().unwrap();
    input.write_all(b"before\n").unwrap();
    p.read_until("before\n");
    let (report, target) = migrate(&p);
    let looks = SourceOptions::new(CaptureOptions { root: "/".into(), heuristics: true, reconnect: None }, "127.0.0.1".parse().unwrap()).socket_looks;
    match report {
        Err(starling_migrate::MigrateError::UnmovableFd { fd: 5, what, .. }) => {
            assert!(what.contains("socket") && what.contains(&format!("each of {looks} looks")), "{what}");
        }
        other => panic!("expected a refusal naming fd 5, got {other:?}"),
    }
    assert!(target.is_err(), "nothing arrived at the target");
    input.write_all(b"after\n").unwrap();
    drop(input);
    let status = p.child.wait().unwrap();
    let out = p.rest();
    assert!(status.success() && out == "before\nafter\n", "the program ran on undisturbed: {status:?}\n{out}");
}

/// A task that holds a socket half of the time (100 ms of every 200 ms) is
/// moved by one migration: it is looked at again until it holds none, before
/// pre-copy and at the freeze (one look each refused it 3 times in 4).
#[test]
fn a_task_holding_a_socket_now_and_then_moves_in_one_migration() {
    if !require_root() {
        return;
    }
    let exe = build("connects");
    moved_run_matches(
        || {
            let mut c = Command::new(&exe);
            c.arg("30");
            c
        },
        "ready",
    );
}

#[test]
fn target_lost_mid_migration_leaves_the_process_running_here() {
    if !require_root() {
        return;
    }
    let exe = build("workers");
    let mut c = Command::new(&exe);
    c.args(["60", "16", "10000"]);
    let mut p = start(c);
    p.read_until("round 3 ");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // A target that takes some pages, then dies.
    let key = starling_proto::SecretKey::random();
    let target = std::thread::spawn(move || {
        let (mut r, w) = accept_proven(&listener, &key);
        let mut buf = vec![0u8; 4 << 20];
        let _ = r.read_exact(&mut buf);
        drop((r, w));
    });
    let mut opts = SourceOptions::new(CaptureOptions { root: "/".into(), heuristics: true, reconnect: None }, "127.0.0.1".parse().unwrap());
    opts.key = key;
    let r = migrate_out(p.pid, connect_proven(addr, &key, true).unwrap(), &opts, &mut NoHooks);
    target.join().unwrap();
    assert!(r.is_err(), "the migration must fail: {r:?}");
    let status = p.child.wait().unwrap();
    let out = p.rest();
    assert!(status.success() && out.contains("done "), "the program ran on here, nothing lost: {status:?}\n{out}");
}

#[test]
fn memory_rewritten_faster_than_a_round_is_sent_once_before_the_switch_and_once_after() {
    if !require_root() {
        return;
    }
    let exe = build("sweeper");
    let mut p = start({
        let mut c = Command::new(&exe);
        c.arg("32");
        c
    });
    p.read_until("sweeping");
    let (report, target) = migrate(&p);
    let report = report.expect("migrate");
    assert_eq!(p.child.wait().unwrap().signal(), Some(libc::SIGKILL), "the source copy is killed once the target holds everything");
    let (status, outcomes) = target.expect("target side");
    let seen = p.rest();
    assert!(status.success() && seen.ends_with("every page as written, 20 passes after the move\n"), "restored run: {status:?}\n{seen}");
    assert!(outcomes.iter().all(|o| o.handler_error.is_none()), "{outcomes:?}");
    println!("{report:?}");
    let sweep = 32 * 256;
    assert!(report.footprint_pages >= sweep, "the 32 MiB were copied: {report:?}");
    // Every page is rewritten while a round sends it: no round is sent (8
    // rounds of all of it before). Either the first copy's probe sees it and
    // goes to the switch with the rest unsent, or the whole first copy goes
    // and the round after it finds (nearly) all of it written again, which
    // is not smaller, so pre-copy stops without sending it ...
    assert_eq!(report.rounds, 0, "{report:?}");
    assert!(report.precopy_pages <= report.footprint_pages, "{report:?}");
    // ... and what it wrote goes at the freeze or is fetched after (the
    // program checked each page's bytes after the move).
    assert!(report.freeze_pages + report.postcopy_pages >= sweep * 9 / 10, "{report:?}");
}
