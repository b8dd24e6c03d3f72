//! The program extension (`spawn_program`): the task runs an open
//! executable that is not in its root (here a memfd holding the host's
//! `/bin/sh`), with extra descriptors at fixed numbers and nothing else.
//! Run as root, like tests/sandbox.rs.

use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};
use starling_sandbox::{spawn_program, ExitStatus, SandboxSpec, TaskProgram};
use std::fs;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::symlink;
use std::path::Path;
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_starling-sandbox-test-exe");

fn memfd_with(bytes: &[u8]) -> OwnedFd {
    let fd = nix::sys::memfd::memfd_create(c"test-program", nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC).unwrap();
    let mut f = fs::File::from(fd);
    f.write_all(bytes).unwrap();
    f.into()
}

#[test]
fn memfd_program_gets_its_extra_fds_at_fixed_numbers_only() {
    let dir = tempfile::Builder::new().prefix("starling-program-test").tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let (status, out) = std::thread::spawn(move || {
        unshare(CloneFlags::CLONE_NEWNS).unwrap();
        mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>).unwrap();
        mount(Some("tmpfs"), &root, Some("tmpfs"), MsFlags::empty(), Some("mode=755")).unwrap();
        for d in ["usr", "proc", "dev", "tmp"] {
            fs::create_dir(root.join(d)).unwrap();
        }
        mount(Some("/usr"), &root.join("usr"), None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>).unwrap();
        for d in ["bin", "lib", "lib64"] {
            if let Ok(t) = fs::read_link(Path::new("/").join(d)) {
                symlink(t, root.join(d)).unwrap();
            }
        }
        // The program: not a file under the root at all.
        let program = memfd_with(&fs::read("/bin/sh").unwrap());
        let extra = memfd_with(b"plan-bytes");
        let spec = SandboxSpec {
            root: root.clone(),
            argv: ["sh", "-c", "cat <&3; echo; ls /proc/self/fd | sort -n | tr '\\n' ' '"]
                .iter()
                .map(|a| a.as_bytes().to_vec())
                .collect(),
            env: vec![(b"PATH".to_vec(), b"/usr/bin:/bin".to_vec())],
            cwd: b"/".to_vec(),
            umask: 0o022,
            ..Default::default()
        };
        // Seek the extra memfd to 0 through a clone of it (shared offset).
        {
            use std::io::Seek;
            let mut f = fs::File::from(extra.try_clone().unwrap());
            f.seek(std::io::SeekFrom::Start(0)).unwrap();
        }
        let (out_r, out_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let (_err_r, err_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let stdin: OwnedFd = fs::File::open("/dev/null").unwrap().into();
        let mut sb = spawn_program(Path::new(EXE), &spec, TaskProgram { program, fds: vec![(3, extra)] }, stdin, out_w, err_w)
            .expect("spawn_program");
        let reader = std::thread::spawn(move || {
            let mut s = String::new();
            fs::File::from(out_r).read_to_string(&mut s).unwrap();
            s
        });
        let t0 = Instant::now();
        let status = loop {
            if let Some(st) = sb.try_wait().unwrap() {
                break st;
            }
            assert!(t0.elapsed() < Duration::from_secs(120), "sandbox hung");
            std::thread::sleep(Duration::from_millis(10));
        };
        let _ = nix::mount::umount2(&root, nix::mount::MntFlags::MNT_DETACH);
        (status, reader.join().unwrap())
    })
    .join()
    .unwrap();
    assert_eq!(status, ExitStatus::Code(0), "{out}");
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("plan-bytes"));
    // stdio, the extra at 3, and the directory fd `ls` itself opens: nothing else leaked.
    let fds: Vec<u32> = lines.next().unwrap_or("").split_whitespace().map(|s| s.parse().unwrap()).collect();
    assert_eq!(&fds[..4], &[0, 1, 2, 3], "{out}");
    assert!(fds.len() <= 5, "unexpected descriptors in the task: {fds:?}");
}

#[test]
fn program_extension_refuses_bad_targets() {
    let program = memfd_with(b"x");
    let a = memfd_with(b"a");
    let b = memfd_with(b"b");
    let spec = SandboxSpec {
        root: "/nonexistent".into(),
        argv: vec![b"x".to_vec()],
        env: vec![],
        cwd: b"/".to_vec(),
        umask: 0,
        ..Default::default()
    };
    let null = || -> OwnedFd { fs::File::open("/dev/null").unwrap().into() };
    let err = spawn_program(Path::new(EXE), &spec, TaskProgram { program, fds: vec![(3, a), (3, b)] }, null(), null(), null())
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}
