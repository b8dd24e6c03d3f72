//! Live migration on one machine: a running multi-threaded C program moves
//! from itself to a restored copy (new PID namespace, same PID and TIDs),
//! through the real source and target drivers over TCP on loopback. Its
//! output must be exactly an undisturbed run's.

use starling_fork::restore::{Restore, RestoreProgram};
use starling_image::PlanOptions;
use starling_migrate::capture::CaptureOptions;
use starling_migrate::source::{migrate_out, SourceHooks, SourceOptions};
use starling_migrate::target::receive;
use std::io::{BufRead, BufReader, Read};
use std::net::{TcpListener, TcpStream};
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

#[test]
fn threads_mid_work_move_and_finish_identically() {
    if !require_root() {
        return;
    }
    let exe = build("workers");
    let args = ["60", "32", "20000"];
    let reference = Command::new(&exe).args(args).output().expect("reference run");
    assert!(reference.status.success());
    let reference = String::from_utf8(reference.stdout).unwrap();

    let mut cmd = Command::new(&exe);
    cmd.args(args).stdout(Stdio::piped());
    // SAFETY: close_range between fork and exec: the test harness's own
    // descriptors (cargo's jobserver pipe) are not the program's.
    unsafe {
        cmd.pre_exec(|| {
            libc::syscall(libc::SYS_close_range, 3, u32::MAX, 0);
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("start");
    let pid = child.id() as i32;
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    while !seen.contains("round 5 ") {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "program ended early:\n{seen}");
        seen.push_str(&line);
    }
    // The restored copy writes into the same pipe.
    let stdout_w: OwnedFd = std::fs::OpenOptions::new().write(true).open(format!("/proc/{pid}/fd/1")).unwrap().into();

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let target = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let inc = receive(s, &mut |_| Ok(())).expect("receive the image");
        let desc = inc.descriptor.clone();
        assert_eq!(desc.threads.len(), 5, "main thread and 4 workers");
        let serve = inc.serve(desc.clone(), 16, Arc::new(|why| panic!("lost: {why}")));
        let plan = PlanOptions { clone_id: 0, clone_count: 1, new_pid_namespace: true, clone_id_in_rax: false };
        let (program, restore) = Restore::start(&desc, plan, serve).expect("restore");
        let mut restorer = spawn_restorer(&program, stdout_w);
        drop(program);
        assert!(restore.wait_running(0), "the restored process never reported running");
        inc.resumed().unwrap();
        let status = restorer.wait().unwrap();
        let (outcomes, channel) = restore.finish();
        assert!(channel.is_none(), "{channel:?}");
        (status, outcomes)
    });
    let opts = SourceOptions::new(CaptureOptions { root: "/".into(), heuristics: true }, "127.0.0.1".parse().unwrap());
    let report = migrate_out(pid, TcpStream::connect(addr).unwrap(), &opts, &mut NoHooks).expect("migrate");
    let original = child.wait().unwrap();
    assert_eq!(original.signal(), Some(libc::SIGKILL), "the source copy is killed once the target holds everything");
    let (status, outcomes) = target.join().unwrap();
    out.read_to_string(&mut seen).unwrap();
    assert!(status.success(), "restored run: {status:?}\n{seen}");
    assert!(outcomes.iter().all(|o| o.handler_error.is_none()), "{outcomes:?}");
    assert_eq!(seen, reference, "output of the migrated run differs from an undisturbed run");
    assert_eq!(report.threads, 5);
    assert!(report.footprint_pages >= 32 * 256, "the 32 MiB heap was copied: {report:?}");
    println!("{report:?}");
}
