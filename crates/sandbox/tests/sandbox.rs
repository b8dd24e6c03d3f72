//! Real sandboxes, run as root: each test builds a root directory holding
//! what a shell needs (the host's /usr bound read-only, plus /bin, /lib...
//! as the host has them) inside a private mount namespace of its own
//! thread, and starts tasks in it through the test stand-in binary.

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use starling_sandbox::{spawn, ExitStatus, SandboxSpec, Sandboxed};
use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_starling-sandbox-test-exe");

/// Run `body` with a fresh sandbox root, in a thread that has its own mount
/// namespace. The temporary directory is created and removed by the calling
/// thread, in whose namespace it is only ever an empty directory: nothing
/// recursive ever walks the bind mounts.
fn with_root<T: Send + 'static>(body: impl FnOnce(&Path) -> T + Send + 'static) -> T {
    let dir = tempfile::Builder::new().prefix("starling-sandbox-test").tempdir().expect("tempdir");
    let root = dir.path().to_path_buf();
    let out = std::thread::spawn(move || {
        unshare(CloneFlags::CLONE_NEWNS).expect("unshare(CLONE_NEWNS) in the test thread");
        mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>).expect("rprivate");
        build_root(&root);
        let out = body(&root);
        // Not needed for the host (the namespace dies with this thread) but
        // keeps the thread from ever deleting through a mount.
        let _ = umount2(&root, MntFlags::MNT_DETACH);
        out
    })
    .join();
    drop(dir);
    match out {
        Ok(v) => v,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

fn build_root(root: &Path) {
    mount(Some("tmpfs"), root, Some("tmpfs"), MsFlags::empty(), Some("mode=755")).expect("tmpfs root");
    for d in ["usr", "proc", "dev", "etc", "tmp"] {
        fs::create_dir(root.join(d)).unwrap();
    }
    fs::set_permissions(root.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
    bind_ro(Path::new("/usr"), &root.join("usr"));
    for d in ["bin", "sbin", "lib", "lib64"] {
        let host = Path::new("/").join(d);
        match fs::read_link(&host) {
            Ok(target) => symlink(target, root.join(d)).unwrap(),
            Err(_) if host.is_dir() => {
                fs::create_dir(root.join(d)).unwrap();
                bind_ro(&host, &root.join(d));
            }
            Err(_) => {}
        }
    }
    // A file found on PATH that is not executable (for the 126 case).
    fs::create_dir(root.join("tmp/noexec")).unwrap();
    fs::write(root.join("tmp/noexec/notexec"), "#!/bin/sh\necho should-not-run\n").unwrap();
    fs::set_permissions(root.join("tmp/noexec/notexec"), fs::Permissions::from_mode(0o644)).unwrap();
}

fn bind_ro(src: &Path, dst: &Path) {
    mount(Some(src), dst, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>).expect("bind");
    mount(None::<&str>, dst, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY, None::<&str>)
        .expect("remount ro");
}

fn spec(root: &Path, argv: &[&str]) -> SandboxSpec {
    SandboxSpec {
        root: root.to_path_buf(),
        argv: argv.iter().map(|a| a.as_bytes().to_vec()).collect(),
        env: vec![(b"PATH".to_vec(), b"/usr/local/bin:/usr/bin:/bin".to_vec()), (b"LC_ALL".to_vec(), b"C".to_vec())],
        cwd: b"/".to_vec(),
        umask: 0o022,
        ..Default::default()
    }
}

struct Started {
    sandbox: Sandboxed,
    stdout: fs::File,
    stderr: fs::File,
}

fn start(spec: &SandboxSpec) -> Started {
    let (out_r, out_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    let (err_r, err_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    let stdin: OwnedFd = fs::File::open("/dev/null").unwrap().into();
    let sandbox = spawn(Path::new(EXE), spec, stdin, out_w, err_w).expect("spawn");
    Started { sandbox, stdout: out_r.into(), stderr: err_r.into() }
}

/// Wait with a deadline, through the non-blocking `try_wait`: a hang fails the test.
fn wait_deadline(sandbox: &mut Sandboxed, limit: Duration) -> ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(st) = sandbox.try_wait().expect("try_wait") {
            return st;
        }
        assert!(t0.elapsed() < limit, "sandbox {} did not end within {limit:?}", sandbox.pid());
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[derive(Debug)]
struct Output {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

fn run(spec: &SandboxSpec) -> Output {
    let Started { mut sandbox, stdout, stderr } = start(spec);
    let read_all = |mut f: fs::File| {
        std::thread::spawn(move || {
            let mut s = String::new();
            f.read_to_string(&mut s).unwrap();
            s
        })
    };
    let (out, err) = (read_all(stdout), read_all(stderr));
    let status = wait_deadline(&mut sandbox, Duration::from_secs(120));
    Output { status, stdout: out.join().unwrap(), stderr: err.join().unwrap() }
}

fn sh(root: &Path, script: &str) -> Output {
    run(&spec(root, &["sh", "-c", script]))
}

#[test]
fn echo_output_arrives_on_the_stdout_pipe() {
    with_root(|root| {
        let o = run(&spec(root, &["echo", "hi"]));
        assert_eq!(o.status, ExitStatus::Code(0), "stderr: {}", o.stderr);
        assert_eq!(o.stdout, "hi\n");
        assert_eq!(o.stderr, "");
    })
}

#[test]
fn exit_codes_are_exact_and_distinct_from_signals() {
    with_root(|root| {
        assert_eq!(sh(root, "exit 3").status, ExitStatus::Code(3));
        assert_eq!(sh(root, "exit 0").status, ExitStatus::Code(0));
        assert_eq!(sh(root, "exit 130").status, ExitStatus::Code(130));
        assert_eq!(sh(root, "kill -INT $$").status, ExitStatus::Signal(libc::SIGINT));
        assert_eq!(sh(root, "kill -9 $$").status, ExitStatus::Signal(libc::SIGKILL));
        let o = sh(root, "echo to-stderr >&2; exit 7");
        assert_eq!((o.status, o.stderr.as_str()), (ExitStatus::Code(7), "to-stderr\n"));
    })
}

#[test]
fn missing_and_unexecutable_commands_behave_like_a_shell() {
    with_root(|root| {
        let o = run(&spec(root, &["no-such-command-xyz", "arg"]));
        assert_eq!(o.status, ExitStatus::Code(127));
        assert_eq!(o.stderr, "starling: no-such-command-xyz: command not found\n");

        let o = run(&spec(root, &["/no/such/path"]));
        assert_eq!(o.status, ExitStatus::Code(127));
        assert!(o.stderr.starts_with("starling: /no/such/path: "), "{}", o.stderr);

        let mut s = spec(root, &["notexec"]);
        s.env[0].1 = b"/tmp/noexec:/usr/bin".to_vec();
        let o = run(&s);
        assert_eq!(o.status, ExitStatus::Code(126));
        assert_eq!(o.stderr, "starling: notexec: Permission denied\n");
        assert_eq!(o.stdout, "");
    })
}

#[test]
fn the_tasks_own_path_is_searched_inside_the_root() {
    with_root(|root| {
        // A script only the sandbox has, found through the task's PATH.
        fs::create_dir(root.join("tmp/mybin")).unwrap();
        fs::write(root.join("tmp/mybin/hello-sbx"), "#!/bin/sh\necho hello from $0\n").unwrap();
        fs::set_permissions(root.join("tmp/mybin/hello-sbx"), fs::Permissions::from_mode(0o755)).unwrap();
        let mut s = spec(root, &["hello-sbx"]);
        s.env[0].1 = b"/tmp/mybin:/usr/bin".to_vec();
        let o = run(&s);
        assert_eq!(o.status, ExitStatus::Code(0), "{}", o.stderr);
        assert_eq!(o.stdout, "hello from /tmp/mybin/hello-sbx\n");
        // Without it on PATH, it is not found.
        assert_eq!(run(&spec(root, &["hello-sbx"])).status, ExitStatus::Code(127));
    })
}

/// Read the task's stdout up to the line "ready", so signals arrive after
/// the task has installed its traps.
fn await_ready(stdout: &mut BufReader<fs::File>) {
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
}

#[test]
fn signals_are_forwarded_to_the_task() {
    with_root(|root| {
        // Default disposition: the task dies of the forwarded SIGTERM.
        let Started { mut sandbox, stdout, .. } = start(&spec(root, &["sh", "-c", "echo ready; exec sleep 100"]));
        await_ready(&mut BufReader::new(stdout));
        // Signals the inits cannot relay are refused, not misdelivered.
        assert_eq!(sandbox.signal(libc::SIGSTOP).unwrap_err().kind(), std::io::ErrorKind::InvalidInput);
        sandbox.signal(libc::SIGTERM).unwrap();
        assert_eq!(wait_deadline(&mut sandbox, Duration::from_secs(120)), ExitStatus::Signal(libc::SIGTERM));
        assert!(sandbox.signal(libc::SIGTERM).is_err(), "no signal after the end");

        // A trap sees it, and its exit code comes back exactly.
        let script = "trap 'echo got-usr1; exit 42' USR1; echo ready; while :; do sleep 0.05; done";
        let Started { mut sandbox, stdout, .. } = start(&spec(root, &["sh", "-c", script]));
        let mut stdout = BufReader::new(stdout);
        await_ready(&mut stdout);
        sandbox.signal(libc::SIGUSR1).unwrap();
        assert_eq!(wait_deadline(&mut sandbox, Duration::from_secs(120)), ExitStatus::Code(42));
        let mut rest = String::new();
        stdout.read_to_string(&mut rest).unwrap();
        assert_eq!(rest, "got-usr1\n");

        // SIGKILL from the agent ends the whole sandbox.
        let Started { mut sandbox, stdout, .. } = start(&spec(root, &["sh", "-c", "echo ready; sleep 100 & wait"]));
        let mut stdout = BufReader::new(stdout);
        await_ready(&mut stdout);
        sandbox.signal(libc::SIGKILL).unwrap();
        assert_eq!(wait_deadline(&mut sandbox, Duration::from_secs(120)), ExitStatus::Signal(libc::SIGKILL));
        // Every holder of the stdout pipe (the background sleep too) is gone.
        let mut rest = String::new();
        stdout.read_to_string(&mut rest).unwrap();
        assert_eq!(rest, "");
    })
}

#[test]
fn the_task_is_pid_2_and_sees_only_its_namespace_in_proc() {
    with_root(|root| {
        let o = sh(root, "echo $$; test -e /proc/self/status && echo has-proc-self");
        assert_eq!(o.status, ExitStatus::Code(0), "{}", o.stderr);
        assert_eq!(o.stdout, "2\nhas-proc-self\n");

        let o = run(&spec(root, &["ls", "/proc"]));
        assert_eq!(o.status, ExitStatus::Code(0), "{}", o.stderr);
        let mut pids: Vec<&str> = o.stdout.lines().filter(|l| l.bytes().all(|b| b.is_ascii_digit())).collect();
        pids.sort();
        assert_eq!(pids, ["1", "2"], "all of /proc: {}", o.stdout);
    })
}

#[test]
fn dev_is_minimal_and_usable() {
    with_root(|root| {
        let script = "head -c 3 /dev/zero | od -An -tx1; head -c 16 /dev/urandom | wc -c; \
                      echo discard > /dev/null && echo null-ok; test -c /dev/full && echo full-ok; \
                      echo to-fd-link > /dev/stdout; ls -A /dev";
        let o = sh(root, script);
        assert_eq!(o.status, ExitStatus::Code(0), "{}", o.stderr);
        let lines: Vec<&str> = o.stdout.lines().collect();
        assert_eq!(lines[0].trim(), "00 00 00");
        assert_eq!(lines[1].trim(), "16");
        assert_eq!(&lines[2..4], ["null-ok", "full-ok"]);
        assert_eq!(lines[4], "to-fd-link");
        let mut listed: Vec<&str> = lines[5..].to_vec();
        listed.sort();
        let expected = [
            "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero",
        ];
        assert_eq!(listed, expected, "no host disks or other devices may appear");
        let o = sh(root, "test -e /dev/sda || test -e /dev/vda || test -e /dev/nvme0n1 || test -e /dev/mem");
        assert_eq!(o.status, ExitStatus::Code(1));
        let o = sh(root, "test -d /dev/pts && test -d /dev/shm && touch /dev/shm/x && echo ok");
        assert_eq!(o.stdout, "ok\n", "{}", o.stderr);
    })
}

#[test]
fn umask_rlimits_and_cwd_are_the_clients() {
    with_root(|root| {
        let mut s = spec(root, &["sh", "-c", "umask; ulimit -n; ulimit -Hn; pwd"]);
        s.umask = 0o027;
        s.cwd = b"/tmp/noexec".to_vec();
        let hard = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap().1;
        s.rlimits = vec![(libc::RLIMIT_NOFILE, 123, hard.min(4096))];
        let o = run(&s);
        assert_eq!(o.status, ExitStatus::Code(0), "{}", o.stderr);
        assert_eq!(o.stdout, format!("0027\n123\n{}\n/tmp/noexec\n", hard.min(4096)));
    })
}

#[test]
fn credentials_drop_to_the_clients() {
    with_root(|root| {
        let mut s = spec(root, &["sh", "-c", "id -u; id -g; id -G; touch /tmp/mine; stat -c %u:%g /tmp/mine; touch /etc/x"]);
        s.uid = 65534;
        s.gid = 65533;
        s.groups = vec![65533, 4242];
        s.cwd = b"/tmp".to_vec();
        let o = run(&s);
        assert_eq!(o.stdout, "65534\n65533\n65533 4242\n65534:65533\n", "{}", o.stderr);
        // /etc belongs to root: the task really is unprivileged.
        assert_eq!(o.status, ExitStatus::Code(1));
        assert!(o.stderr.contains("Permission denied"), "{}", o.stderr);
    })
}

#[test]
fn no_descriptor_other_than_stdio_leaks_into_the_task() {
    with_root(|root| {
        // A descriptor the "agent" leaked without close-on-exec.
        let devnull = fs::File::open("/dev/null").unwrap();
        let raw = nix::unistd::dup(devnull.as_raw_fd()).unwrap();
        // SAFETY: dup just returned this descriptor; nothing else owns it.
        let leaked = unsafe { OwnedFd::from_raw_fd(raw) };
        assert!(!nix::fcntl::FdFlag::from_bits_truncate(nix::fcntl::fcntl(raw, nix::fcntl::F_GETFD).unwrap())
            .contains(nix::fcntl::FdFlag::FD_CLOEXEC));
        let o = run(&spec(root, &["ls", "/proc/self/fd"]));
        drop(leaked);
        assert_eq!(o.status, ExitStatus::Code(0), "{}", o.stderr);
        // 0-2 and the directory ls itself opened to list.
        assert_eq!(o.stdout, "0\n1\n2\n3\n");
    })
}

#[test]
fn hostname_gets_its_own_uts_namespace() {
    with_root(|root| {
        let host_before = nix::unistd::gethostname().unwrap();
        let mut s = spec(root, &["cat", "/proc/sys/kernel/hostname"]);
        s.hostname = Some("sbx-test-host".into());
        let o = run(&s);
        assert_eq!((o.status, o.stdout.as_str()), (ExitStatus::Code(0), "sbx-test-host\n"), "{}", o.stderr);
        assert_eq!(nix::unistd::gethostname().unwrap(), host_before);
    })
}

#[test]
fn setup_failures_are_reported_not_hung() {
    with_root(|root| {
        let mut s = spec(root, &["pwd"]);
        s.cwd = b"/no/such/dir".to_vec();
        let o = run(&s);
        assert_eq!(o.status, ExitStatus::Code(125));
        assert_eq!(o.stderr, "starling: cannot change directory to /no/such/dir: No such file or directory\n");

        // A root without the /proc mount point.
        fs::remove_dir(root.join("proc")).unwrap();
        let o = run(&spec(root, &["true"]));
        assert_eq!(o.status, ExitStatus::Code(125));
        assert!(o.stderr.starts_with("starling: ") && o.stderr.contains("/proc"), "{}", o.stderr);

        let o = run(&spec(&root.join("does-not-exist"), &["true"]));
        assert_eq!(o.status, ExitStatus::Code(125));
        assert!(o.stderr.contains("not a directory"), "{}", o.stderr);
    })
}

#[test]
fn bad_specs_are_refused_before_starting_anything() {
    let mut s = spec(Path::new("/"), &[]);
    let devnull = || -> OwnedFd { fs::File::open("/dev/null").unwrap().into() };
    let err = spawn(Path::new(EXE), &s, devnull(), devnull(), devnull()).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    s.argv = vec![b"a\0b".to_vec()];
    assert!(spawn(Path::new(EXE), &s, devnull(), devnull(), devnull()).is_err());
}

#[test]
fn pidfd_becomes_readable_when_the_sandbox_ends() {
    with_root(|root| {
        // The task runs until the test creates /tmp/go in its root.
        let script = "while [ ! -e /tmp/go ]; do sleep 0.01; done; exit 5";
        let Started { mut sandbox, .. } = start(&spec(root, &["sh", "-c", script]));
        let pidfd = sandbox.pidfd().expect("pidfd on this kernel").try_clone_to_owned().unwrap();
        let mut fds = [nix::poll::PollFd::new(pidfd.as_fd(), nix::poll::PollFlags::POLLIN)];
        assert_eq!(nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO).unwrap(), 0, "not readable while running");
        fs::write(root.join("tmp/go"), b"").unwrap();
        let n = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(60_000u16)).unwrap();
        assert_eq!(n, 1);
        assert_eq!(sandbox.try_wait().unwrap(), Some(ExitStatus::Code(5)));
        assert_eq!(sandbox.wait().unwrap(), ExitStatus::Code(5));
    })
}

/// Children of the process `pid`, from /proc.
fn children(pid: u32) -> Vec<u32> {
    fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // Field 3, after the parenthesised command name, is the state.
        Ok(stat) => !stat.rsplit_once(") ").map(|(_, rest)| rest.starts_with('Z')).unwrap_or(false),
        Err(_) => false,
    }
}

#[test]
fn killing_the_agent_with_sigkill_kills_its_tasks() {
    with_root(|root| {
        /// Kills the stand-in agent even if an assertion fails first.
        struct Agent(std::process::Child);
        impl Drop for Agent {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let mut agent = Agent(
            std::process::Command::new(EXE)
                .args(["hold", root.to_str().unwrap(), "sleep", "1000"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        );
        let mut line = String::new();
        BufReader::new(agent.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let outer: u32 = line.trim().parse().unwrap();
        // Find the task (host pid) under outer init -> PID 1 -> task.
        let t0 = Instant::now();
        let task = loop {
            if let Some(&pid1) = children(outer).first() {
                if let Some(&task) = children(pid1).first() {
                    if fs::read_to_string(format!("/proc/{task}/comm")).unwrap_or_default() == "sleep\n" {
                        break task;
                    }
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(120), "task never started");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(alive(task));
        agent.0.kill().unwrap();
        agent.0.wait().unwrap();
        // The task would sleep 1000 s: gone well before that means its agent's death ended it.
        let t0 = Instant::now();
        while alive(task) || alive(outer) {
            assert!(t0.elapsed() < Duration::from_secs(120), "task {task} outlived its agent");
            std::thread::sleep(Duration::from_millis(10));
        }
    })
}

#[test]
fn when_the_task_exits_the_rest_of_its_namespace_is_killed() {
    with_root(|root| {
        // The background sleep keeps stdout open: run() returns only once
        // it is gone too.
        let t0 = Instant::now();
        let o = sh(root, "sleep 1000 & echo started; exit 4");
        assert_eq!((o.status, o.stdout.as_str()), (ExitStatus::Code(4), "started\n"));
        // It would sleep 1000 s: run() returning well before means it was killed with the task.
        assert!(t0.elapsed() < Duration::from_secs(300), "the background process outlived the task");
    })
}

#[test]
fn a_spec_larger_than_a_pipe_buffer_reaches_the_task_intact() {
    with_root(|root| {
        let mut s = spec(root, &["sh", "-c", "echo ${#BIG_A} ${#BIG_B} ${#BIG_C} $BIG_MARK"]);
        for name in ["BIG_A", "BIG_B", "BIG_C"] {
            s.env.push((name.as_bytes().to_vec(), vec![b'x'; 100_000]));
        }
        s.env.push((b"BIG_MARK".to_vec(), b"end".to_vec()));
        let o = run(&s);
        assert_eq!((o.status, o.stdout.as_str()), (ExitStatus::Code(0), "100000 100000 100000 end\n"), "{}", o.stderr);
    })
}

/// `Field:\tvalue` lines of /proc/self/status as the task printed them.
fn status_field<'a>(status: &'a str, field: &str) -> &'a str {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field).and_then(|r| r.strip_prefix(':')))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no {field} in the task's /proc/self/status:\n{status}"))
}

#[test]
fn an_ordinary_users_task_has_no_capabilities_no_new_privs_and_the_filter() {
    with_root(|root| {
        let mut s = spec(root, &["cat", "/proc/self/status"]);
        (s.uid, s.gid) = (65534, 65534);
        let o = run(&s);
        assert_eq!(o.status, ExitStatus::Code(0), "{}", o.stderr);
        for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            assert_eq!(status_field(&o.stdout, set), "0000000000000000", "{set}");
        }
        assert_eq!(status_field(&o.stdout, "NoNewPrivs"), "1");
        assert_eq!(status_field(&o.stdout, "Seccomp"), "2");
    })
}

#[test]
fn a_root_task_keeps_its_capabilities_but_is_filtered() {
    with_root(|root| {
        let o = run(&spec(root, &["cat", "/proc/self/status"]));
        assert_eq!(o.status, ExitStatus::Code(0), "{}", o.stderr);
        assert_ne!(status_field(&o.stdout, "CapEff"), "0000000000000000");
        assert_eq!(status_field(&o.stdout, "NoNewPrivs"), "1");
        assert_eq!(status_field(&o.stdout, "Seccomp"), "2");
        // Root, with CAP_SYS_ADMIN, still cannot mount: the filter says EPERM.
        let o = sh(root, "mkdir -p /tmp/m && mount -t tmpfs none /tmp/m; echo rc=$?");
        assert!(o.stdout.ends_with("rc=32\n") || o.stdout.ends_with("rc=1\n"), "mount did not fail: {o:?}");
        assert!(o.stderr.contains("ermission denied") || o.stderr.contains("not permitted"), "{}", o.stderr);
    })
}

#[test]
fn a_restorer_without_network_admin_lacks_those_two_capabilities_only() {
    // CAP_NET_ADMIN (12) and CAP_NET_RAW (13); CAP_SYS_ADMIN (21) stays.
    let (net, sys_admin) = (0x3000u64, 1u64 << 21);
    with_root(move |root| {
        let mut s = spec(root, &["cat", "/proc/self/status"]);
        s.confinement = starling_sandbox::Confinement::Restorer;
        for no_network_admin in [false, true] {
            s.no_network_admin = no_network_admin;
            let o = run(&s);
            assert_eq!(o.status, ExitStatus::Code(0), "{}", o.stderr);
            for set in ["CapEff", "CapPrm", "CapBnd"] {
                let caps = u64::from_str_radix(status_field(&o.stdout, set), 16).unwrap();
                assert_eq!(caps & net, if no_network_admin { 0 } else { net }, "{set} {caps:x} (no_network_admin {no_network_admin})");
                assert_ne!(caps & sys_admin, 0, "{set} {caps:x}");
            }
        }
    })
}

#[test]
fn a_restorer_task_is_left_unconfined() {
    with_root(|root| {
        let mut s = spec(root, &["cat", "/proc/self/status"]);
        s.confinement = starling_sandbox::Confinement::Restorer;
        let o = run(&s);
        assert_eq!(o.status, ExitStatus::Code(0), "{}", o.stderr);
        assert_eq!(status_field(&o.stdout, "NoNewPrivs"), "0");
        assert_eq!(status_field(&o.stdout, "Seccomp"), "0");
    })
}

/// A terminal task: PID 1 makes a pty in the sandbox's own devpts, the
/// master comes back on the terminal line, the task runs on the slave as its
/// controlling terminal with the requested size and modes, and a window-size
/// change reaches it as SIGWINCH.
#[test]
fn terminal_task_gets_a_pty_of_the_requested_size() {
    with_root(|root| {
        let mut s = spec(root, &["sh", "-c", "trap 'stty size; exit 7' WINCH; tty; stty size; stty -a | grep -o -- '-echo '; echo ready; while :; do sleep 0.1; done"]);
        // Modes: the kernel's defaults with ECHO off (a visible, checkable difference).
        let (m, _probe) = {
            // A pty of our own, only to read default modes from.
            // SAFETY: posix_openpt with flags; checked below.
            let fd = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY) };
            assert!(fd >= 0);
            // SAFETY: the descriptor was just opened and is owned here.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            let mut modes = starling_sandbox::terminal::get_modes(owned.as_fd()).unwrap();
            modes.lflag &= !libc::ECHO;
            (modes, owned)
        };
        s.terminal = Some(starling_proto::TerminalSize { rows: 33, cols: 111, modes: Some(m) });
        let (line, theirs) = starling_sandbox::TerminalLine::new().unwrap();
        let (out_r, out_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let (err_r, err_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let mut sandbox = spawn(Path::new(EXE), &s, theirs, out_w, err_w).expect("spawn");
        drop((out_r, err_r));
        let master = line.receive_master().expect("terminal line").expect("a pty master from the sandbox");
        let mut reader = BufReader::new(fs::File::from(master.try_clone().unwrap()));
        let mut seen = String::new();
        loop {
            let mut l = String::new();
            assert!(reader.read_line(&mut l).unwrap() > 0, "the pty closed early; got {seen:?}");
            seen.push_str(&l);
            if l.starts_with("ready") {
                break;
            }
        }
        assert!(seen.contains("/dev/pts/0\r\n"), "{seen:?}");
        assert!(seen.contains("33 111\r\n"), "{seen:?}");
        assert!(seen.contains("-echo "), "ECHO off as requested: {seen:?}");
        starling_sandbox::terminal::set_size(master.as_fd(), 20, 70).unwrap();
        let mut rest = String::new();
        let mut buf = [0u8; 4096];
        // Until the task ended (EIO on the master once every slave is closed).
        while let Ok(n @ 1..) = reader.get_mut().read(&mut buf) {
            rest.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        assert!(rest.contains("20 70\r\n"), "the SIGWINCH trap printed the new size: {rest:?}");
        assert_eq!(wait_deadline(&mut sandbox, Duration::from_secs(120)), ExitStatus::Code(7));
    });
}

/// The zygote of this thread's mount namespace: the child of this process
/// running `__sandbox-init` in the same mount namespace that has children of
/// none of its own (outer inits are forked as this process's children).
fn this_threads_zygote() -> Option<i32> {
    use std::os::unix::fs::MetadataExt;
    let ns = |p: &str| fs::metadata(p).map(|m| m.ino()).ok();
    let ours = ns("/proc/thread-self/ns/mnt");
    let me = std::process::id();
    let children: String = fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| fs::read_to_string(t.unwrap().path().join("children")).ok())
        .collect::<Vec<_>>()
        .join(" ");
    children.split_whitespace().filter_map(|c| c.parse::<i32>().ok()).find(|&pid| {
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let ppid = stat.rsplit(')').next().and_then(|s| s.split_whitespace().nth(1)).and_then(|p| p.parse::<u32>().ok());
        cmdline.windows(b"__sandbox-init".len()).any(|w| w == b"__sandbox-init")
            && ppid == Some(me)
            && ns(&format!("/proc/{pid}/ns/mnt")) == ours
    })
}

#[test]
fn each_sandbox_is_a_new_fork_and_a_killed_zygote_is_replaced() {
    with_root(|root| {
        // Two tasks in a row: each is PID 2 of its own namespace and finds
        // nothing the other left in its (tmpfs) /dev/shm.
        let first = sh(root, "echo $$; touch /dev/shm/left-behind");
        assert_eq!((first.status, first.stdout.as_str()), (ExitStatus::Code(0), "2\n"), "stderr: {}", first.stderr);
        let second = sh(root, "echo $$; ls /dev/shm");
        assert_eq!((second.status, second.stdout.as_str()), (ExitStatus::Code(0), "2\n"), "stderr: {}", second.stderr);
        let zygote = this_threads_zygote().expect("the sandboxes were started through a zygote, a child of this process");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(zygote), nix::sys::signal::Signal::SIGKILL).unwrap();
        // Wait until it is dead (a zombie: the library reaps it). A request
        // sent while the kill is still pending may be read by the dying
        // zygote and then fail: replacing it is for a zygote already gone.
        let t0 = Instant::now();
        while !fs::read_to_string(format!("/proc/{zygote}/stat")).is_ok_and(|s| s.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('Z'))) {
            assert!(t0.elapsed() < Duration::from_secs(120), "the killed zygote did not die");
            std::thread::sleep(Duration::from_millis(5));
        }
        // The next sandbox starts (through a new zygote) and runs normally.
        let after = sh(root, "echo $$");
        assert_eq!((after.status, after.stdout.as_str()), (ExitStatus::Code(0), "2\n"), "stderr: {}", after.stderr);
        let replaced = this_threads_zygote().expect("a new zygote");
        assert_ne!(replaced, zygote, "the killed zygote was not replaced");
    })
}
