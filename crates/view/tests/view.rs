//! Real mounts: these tests need root, /dev/fuse and overlayfs.

use std::collections::BTreeSet;
use std::fs;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use starling_view::{mount, scan_upper, DirSource, Lookup, Overlay, Source, UpperEntry, WirePath};

#[path = "../../../tests/require.rs"]
mod require;

/// Root, /dev/fuse and overlayfs: without them these tests fail (see tests/require.rs).
fn can_mount() -> bool {
    require::root("mounting FUSE and overlayfs")
        && require::path("/dev/fuse", "the FUSE device (modprobe fuse)")
        && require::require(
            std::fs::read_to_string("/proc/filesystems").is_ok_and(|f| f.contains("overlay")),
            "overlayfs not in /proc/filesystems (modprobe overlay)",
        )
}

fn wp(s: &str) -> WirePath {
    WirePath::new(s.as_bytes().to_vec()).unwrap()
}

fn write_mode(path: &Path, data: &[u8], mode: u32) {
    let mut f = fs::OpenOptions::new().create(true).truncate(true).write(true).mode(mode).open(path).unwrap();
    f.write_all(data).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

/// A source tree, its cache and a mount point, all in one temp dir.
struct Fixture {
    _tmp: tempfile::TempDir,
    src: PathBuf,
    cache: PathBuf,
    mnt: PathBuf,
    base: PathBuf,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().canonicalize().unwrap();
    let (src, cache, mnt) = (base.join("src"), base.join("cache"), base.join("mnt"));
    for d in [&src, &mnt] {
        fs::create_dir(d).unwrap();
    }
    Fixture { _tmp: tmp, src, cache, mnt, base }
}

fn errno_of(r: io::Result<impl Sized>) -> Option<i32> {
    r.err().and_then(|e| e.raw_os_error())
}

#[test]
fn view_shows_source_attrs_contents_and_listings() {
    if !can_mount() {
        return;
    }
    let fx = fixture();
    fs::create_dir(fx.src.join("a")).unwrap();
    fs::create_dir(fx.src.join("empty")).unwrap();
    write_mode(&fx.src.join("a/hello.txt"), b"hello world\n", 0o640);
    nix::unistd::chown(&fx.src.join("a/hello.txt"), Some(1234.into()), Some(5678.into())).unwrap();
    // 3 MiB of non-repeating bytes: several passthrough read requests' worth.
    let big: Vec<u8> = (0..3u32 << 20).map(|i| (i.wrapping_mul(2654435761) >> 13).to_le_bytes()[0]).collect();
    write_mode(&fx.src.join("big.bin"), &big, 0o755);
    std::os::unix::fs::symlink("a/hello.txt", fx.src.join("link")).unwrap();
    nix::unistd::mkfifo(&fx.src.join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
    nix::sys::stat::mknod(
        &fx.src.join("null"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(1, 3),
    )
    .unwrap();

    let source = Arc::new(DirSource::new(&fx.src, &fx.cache).unwrap());
    let view = mount(source.clone(), &fx.mnt).unwrap();

    // stat reports the client's attributes.
    let want = fs::symlink_metadata(fx.src.join("a/hello.txt")).unwrap();
    let got = fs::symlink_metadata(fx.mnt.join("a/hello.txt")).unwrap();
    assert!(got.is_file());
    assert_eq!(got.len(), 12);
    assert_eq!(got.mode(), want.mode());
    assert_eq!((got.uid(), got.gid()), (1234, 5678));
    assert_eq!((got.mtime(), got.mtime_nsec()), (want.mtime(), want.mtime_nsec()));
    assert_eq!(got.nlink(), 1);
    let d = fs::metadata(fx.mnt.join("a")).unwrap();
    assert!(d.is_dir());
    assert_eq!(d.mode(), fs::metadata(fx.src.join("a")).unwrap().mode());

    // readdir lists the same names, plus "." and "..".
    let names = |p: &Path| -> BTreeSet<Vec<u8>> {
        fs::read_dir(p).unwrap().map(|e| e.unwrap().file_name().as_bytes().to_vec()).collect()
    };
    assert_eq!(names(&fx.mnt), names(&fx.src));
    assert!(names(&fx.mnt.join("empty")).is_empty());
    let mut dir = nix::dir::Dir::open(&fx.mnt.join("a"), nix::fcntl::OFlag::O_RDONLY, nix::sys::stat::Mode::empty()).unwrap();
    let raw: BTreeSet<Vec<u8>> = dir.iter().map(|e| e.unwrap().file_name().to_bytes().to_vec()).collect();
    assert_eq!(raw, BTreeSet::from([b".".to_vec(), b"..".to_vec(), b"hello.txt".to_vec()]));

    // readlink, and reading through the link.
    assert_eq!(fs::read_link(fx.mnt.join("link")).unwrap(), Path::new("a/hello.txt"));
    assert!(fs::symlink_metadata(fx.mnt.join("link")).unwrap().file_type().is_symlink());
    assert_eq!(fs::read(fx.mnt.join("link")).unwrap(), b"hello world\n");

    // contents, served by passthrough: the daemon never saw a read.
    assert_eq!(fs::read(fx.mnt.join("a/hello.txt")).unwrap(), b"hello world\n");
    assert!(fs::read(fx.mnt.join("big.bin")).unwrap() == big, "big.bin differs");
    let stats = view.stats();
    assert!(stats.passthrough_opens >= 2, "{stats:?}");
    assert_eq!(stats.opens, stats.passthrough_opens, "{stats:?}");
    assert_eq!(stats.fallback_reads, 0, "{stats:?}");

    // Read-only: writes and creations are refused.
    assert_eq!(errno_of(fs::OpenOptions::new().write(true).open(fx.mnt.join("a/hello.txt"))), Some(libc::EROFS));
    assert_eq!(errno_of(fs::File::create(fx.mnt.join("new"))), Some(libc::EROFS));

    // Special nodes: visible with their type, not openable.
    let fifo = fs::symlink_metadata(fx.mnt.join("fifo")).unwrap();
    assert!(fifo.file_type().is_fifo());
    let null = fs::symlink_metadata(fx.mnt.join("null")).unwrap();
    assert!(null.file_type().is_char_device());
    assert_eq!(null.rdev(), nix::sys::stat::makedev(1, 3));
    assert_eq!(errno_of(fs::File::open(fx.mnt.join("null"))), Some(libc::EACCES));
    // No reader on the other end: a non-blocking write-open fails.
    let o = fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(fx.mnt.join("fifo"));
    assert_eq!(errno_of(o), Some(libc::ENXIO));

    // Absent paths: ENOENT, and the absence is a recorded binding.
    assert_eq!(errno_of(fs::metadata(fx.mnt.join("nope"))), Some(libc::ENOENT));
    assert_eq!(errno_of(fs::metadata(fx.mnt.join("a/nope/deeper"))), Some(libc::ENOENT));
    let bindings = view.bindings();
    assert_eq!(bindings.get(&wp("/nope")), Some(&Lookup::Absent));
    assert!(matches!(bindings.get(&wp("/a/hello.txt")), Some(Lookup::File(a, _)) if a.size == 12));
    assert!(matches!(bindings.get(&wp("/link")), Some(Lookup::Symlink(_, t)) if t == b"a/hello.txt"));
    let accessed = view.accessed_paths();
    for p in ["/a", "/a/hello.txt", "/big.bin", "/link", "/nope", "/a/nope"] {
        assert!(accessed.contains(&wp(p)), "{p} not in {accessed:?}");
    }
    // "/a/nope/deeper" is never asked: its parent does not exist.
    assert!(!accessed.contains(&wp("/a/nope/deeper")));
    // One source lookup per path at most.
    assert_eq!(view.stats().lookups_sent, source.lookup_count());
    view.unmount().unwrap();
}

#[test]
fn bindings_are_immutable_and_preload_answers_locally() {
    if !can_mount() {
        return;
    }
    let fx = fixture();
    write_mode(&fx.src.join("hello.txt"), b"old\n", 0o644);
    write_mode(&fx.src.join("ghost"), b"exists on the client, but prethrown as absent", 0o644);
    let source = Arc::new(DirSource::new(&fx.src, &fx.cache).unwrap());
    let view = mount(source.clone(), &fx.mnt).unwrap();

    // Prethrow: "/" as on the client, "/ghost" as absent, "/alias.txt"
    // bound to hello.txt's recipe.
    let root_binding = source.lookup(&WirePath::root()).unwrap();
    let hello_binding = source.lookup(&wp("/hello.txt")).unwrap();
    view.preload(vec![
        (WirePath::root(), root_binding),
        (wp("/ghost"), Lookup::Absent),
        (wp("/alias.txt"), hello_binding.clone()),
    ]);
    let asked_before = source.lookup_count();
    assert_eq!(errno_of(fs::metadata(fx.mnt.join("ghost"))), Some(libc::ENOENT));
    assert_eq!(fs::read(fx.mnt.join("alias.txt")).unwrap(), b"old\n");
    assert_eq!(source.lookup_count(), asked_before, "preloaded paths must not reach the source");
    assert!(view.stats().lookups_local >= 2);
    // The listing hides a name the task was told is absent.
    assert!(!fs::read_dir(&fx.mnt).unwrap().any(|e| e.unwrap().file_name() == "ghost"));

    // First observation of hello.txt via the view.
    assert_eq!(fs::read(fx.mnt.join("hello.txt")).unwrap(), b"old\n");
    assert_eq!(errno_of(fs::metadata(fx.mnt.join("late.txt"))), Some(libc::ENOENT));
    let first = view.bindings();

    // The client changes its files after the task saw them...
    write_mode(&fx.src.join("hello.txt"), b"new and longer\n", 0o600);
    write_mode(&fx.src.join("late.txt"), b"late\n", 0o644);
    // ...and the kernel forgets its cached dentries and inodes, so the next
    // accesses really reach the view (best effort: needs a writable /proc/sys).
    let dropped = fs::write("/proc/sys/vm/drop_caches", "2").is_ok();
    let asked = source.lookup_count();
    let m = fs::metadata(fx.mnt.join("hello.txt")).unwrap();
    assert_eq!((m.len(), m.mode() & 0o777), (4, 0o644));
    assert_eq!(fs::read(fx.mnt.join("hello.txt")).unwrap(), b"old\n");
    assert_eq!(errno_of(fs::metadata(fx.mnt.join("late.txt"))), Some(libc::ENOENT));
    assert_eq!(source.lookup_count(), asked, "a bound path was asked again (drop_caches: {dropped})");
    assert_eq!(view.bindings().get(&wp("/hello.txt")), first.get(&wp("/hello.txt")));
    let recipe_of = |l: Option<&Lookup>| match l {
        Some(Lookup::File(_, r)) => Some(*r),
        _ => None,
    };
    assert_eq!(recipe_of(view.bindings().get(&wp("/hello.txt"))), recipe_of(Some(&hello_binding)));
    // Preload cannot override a binding either.
    view.preload(vec![(wp("/hello.txt"), Lookup::Absent)]);
    assert_eq!(fs::read(fx.mnt.join("hello.txt")).unwrap(), b"old\n");
    assert_eq!(view.bindings().get(&wp("/hello.txt")), first.get(&wp("/hello.txt")));
    drop(view);
    // Dropping unmounted it.
    assert_eq!(errno_of(fs::metadata(fx.mnt.join("hello.txt"))), Some(libc::ENOENT));
}

/// Only the variant and the path, for comparing scan results with expectations.
fn shape(e: &UpperEntry) -> (String, &'static str) {
    let kind = match e {
        UpperEntry::File { .. } => "file",
        UpperEntry::Dir { opaque: true, .. } => "opaque-dir",
        UpperEntry::Dir { opaque: false, .. } => "dir",
        UpperEntry::Symlink { .. } => "symlink",
        UpperEntry::Whiteout { .. } => "whiteout",
    };
    (e.path().to_string(), kind)
}

#[test]
fn overlay_changes_are_scanned_from_upper() {
    if !can_mount() {
        return;
    }
    let fx = fixture();
    write_mode(&fx.src.join("keep.txt"), b"keep", 0o644);
    write_mode(&fx.src.join("mod.txt"), b"original", 0o644);
    write_mode(&fx.src.join("del.txt"), b"delete me", 0o644);
    fs::create_dir_all(fx.src.join("olddir/sub")).unwrap();
    write_mode(&fx.src.join("olddir/x.txt"), b"x", 0o644);
    write_mode(&fx.src.join("olddir/sub/y.txt"), b"y", 0o644);
    fs::create_dir(fx.src.join("dir2")).unwrap();
    write_mode(&fx.src.join("dir2/z.txt"), b"z", 0o644);

    let source = Arc::new(DirSource::new(&fx.src, &fx.cache).unwrap());
    let view = mount(source, &fx.mnt).unwrap();
    let task_dir = fx.base.join("task");
    fs::create_dir(&task_dir).unwrap();
    let ov = Overlay::mount(&fx.mnt, &task_dir).unwrap();
    let root = ov.root().to_path_buf();
    let upper = ov.upper().to_path_buf();

    // Reads through the overlay still use passthrough underneath.
    assert_eq!(fs::read(root.join("keep.txt")).unwrap(), b"keep");
    // Task activity.
    write_mode(&root.join("new.txt"), b"brand new", 0o600);
    let mut f = fs::OpenOptions::new().append(true).open(root.join("mod.txt")).unwrap();
    f.write_all(b" changed").unwrap();
    drop(f);
    fs::remove_file(root.join("del.txt")).unwrap();
    fs::create_dir(root.join("newdir")).unwrap();
    fs::set_permissions(root.join("newdir"), fs::Permissions::from_mode(0o750)).unwrap();
    fs::remove_dir_all(root.join("olddir")).unwrap();
    fs::create_dir(root.join("olddir")).unwrap();
    write_mode(&root.join("olddir/fresh.txt"), b"fresh", 0o644);
    std::os::unix::fs::symlink("keep.txt", root.join("lnk")).unwrap();
    fs::write(root.join("dir2/z.txt"), b"zz").unwrap();
    // redirect_dir=off: renaming a lower directory is refused with EXDEV.
    assert_eq!(errno_of(fs::rename(root.join("dir2"), root.join("dir3"))), Some(libc::EXDEV));

    assert_eq!(fs::read(root.join("mod.txt")).unwrap(), b"original changed");
    assert_eq!(errno_of(fs::metadata(root.join("olddir/x.txt"))), Some(libc::ENOENT));
    let stats = view.stats();
    assert_eq!(stats.fallback_reads, 0, "{stats:?}");
    assert!(stats.passthrough_opens >= 3, "{stats:?}");
    // The client's files are untouched.
    assert_eq!(fs::read(fx.src.join("mod.txt")).unwrap(), b"original");
    assert!(fx.src.join("del.txt").exists());

    ov.unmount().unwrap();
    view.unmount().unwrap();

    let entries = scan_upper(&upper).unwrap();
    let got: Vec<_> = entries.iter().map(shape).collect();
    let want: Vec<(String, &str)> = [
        ("/del.txt", "whiteout"),
        ("/dir2", "dir"),
        ("/dir2/z.txt", "file"),
        ("/lnk", "symlink"),
        ("/mod.txt", "file"),
        ("/new.txt", "file"),
        ("/newdir", "dir"),
        ("/olddir", "opaque-dir"),
        ("/olddir/fresh.txt", "file"),
    ]
    .iter()
    .map(|(p, k)| (p.to_string(), *k))
    .collect();
    assert_eq!(got, want);
    for e in &entries {
        match e {
            UpperEntry::File { path, host_path, mode, uid, .. } => {
                let want: &[u8] = match path.to_string().as_str() {
                    "/mod.txt" => b"original changed",
                    "/new.txt" => b"brand new",
                    "/olddir/fresh.txt" => b"fresh",
                    "/dir2/z.txt" => b"zz",
                    other => panic!("unexpected file {other}"),
                };
                assert_eq!(fs::read(host_path).unwrap(), want, "{path}");
                assert_eq!(*uid, 0);
                if path.to_string() == "/new.txt" {
                    assert_eq!(*mode, 0o600);
                }
            }
            UpperEntry::Dir { path, mode, .. } if path.to_string() == "/newdir" => assert_eq!(*mode, 0o750),
            UpperEntry::Symlink { target, .. } => assert_eq!(target, b"keep.txt"),
            _ => {}
        }
    }
}

#[test]
fn a_chrooted_shell_runs_inside_the_overlay() {
    if !can_mount() {
        return;
    }
    let fx = fixture();
    // A client "/" with the host's /usr grafted in, merged-/usr style.
    fs::create_dir_all(fx.src.join("usr")).unwrap();
    fs::create_dir_all(fx.src.join("data")).unwrap();
    for (link, target) in [("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")] {
        std::os::unix::fs::symlink(target, fx.src.join(link)).unwrap();
    }
    write_mode(&fx.src.join("data/hello.txt"), b"hello from the client\n", 0o644);
    let source = Arc::new(DirSource::new(&fx.src, &fx.cache).unwrap().graft(wp("/usr"), "/usr"));
    let view = mount(source, &fx.mnt).unwrap();
    let task_dir = fx.base.join("task");
    fs::create_dir(&task_dir).unwrap();
    let ov = Overlay::mount(&fx.mnt, &task_dir).unwrap();
    let root = ov.root().to_path_buf();

    let mut cmd = Command::new("/bin/sh");
    cmd.args(["-c", "cat /data/hello.txt && echo made > /data/out.txt && ls /data"])
        .env_clear()
        .env("PATH", "/usr/bin:/bin");
    let chroot_to = std::ffi::CString::new(root.as_os_str().as_bytes()).unwrap();
    // SAFETY: the closure runs in the forked child before exec and calls only
    // chroot(2) and chdir(2), which are async-signal-safe; it allocates nothing
    // (the CString was built before the fork).
    unsafe {
        cmd.pre_exec(move || {
            if libc::chroot(chroot_to.as_ptr()) != 0 || libc::chdir(c"/".as_ptr()) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "status {:?}, stderr {}", out.status, String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello from the client\nhello.txt\nout.txt\n");
    let stats = view.stats();
    assert_eq!(stats.fallback_reads, 0, "{stats:?}");
    assert!(stats.passthrough_opens >= 3, "sh, libc and cat at least: {stats:?}");
    assert!(view.accessed_paths().contains(&wp("/usr/bin/cat")));

    let upper = ov.upper().to_path_buf();
    ov.unmount().unwrap();
    drop(view);
    let entries = scan_upper(&upper).unwrap();
    let got: Vec<_> = entries.iter().map(shape).collect();
    assert_eq!(got, vec![("/data".to_string(), "dir"), ("/data/out.txt".to_string(), "file")]);
    match &entries[1] {
        UpperEntry::File { host_path, .. } => assert_eq!(fs::read(host_path).unwrap(), b"made\n"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn without_passthrough_the_daemon_serves_reads() {
    if !can_mount() {
        return;
    }
    let fx = fixture();
    let big: Vec<u8> = (0..(1u32 << 20) + 123).map(|i| (i.wrapping_mul(40503) >> 7).to_le_bytes()[0]).collect();
    write_mode(&fx.src.join("big.bin"), &big, 0o644);
    let source = Arc::new(DirSource::new(&fx.src, &fx.cache).unwrap());
    let options = starling_view::ViewOptions { passthrough: false, threads: 2, single_owner: false };
    let view = starling_view::mount_with(source, &fx.mnt, options).unwrap();
    assert!(fs::read(fx.mnt.join("big.bin")).unwrap() == big, "contents differ");
    let stats = view.stats();
    assert_eq!((stats.opens, stats.passthrough_opens), (1, 0), "{stats:?}");
    assert!(stats.fallback_reads > 0, "{stats:?}");
}

/// Wraps a source; a lookup of "/slow" says it has started, then waits until the gate opens (or
/// 120 s pass, which it records: a bound on a hang, not a timing).
struct SlowSource {
    inner: DirSource,
    state: std::sync::Mutex<SlowState>,
    cv: std::sync::Condvar,
}

#[derive(Default)]
struct SlowState {
    entered: bool,
    open: bool,
    timed_out: bool,
}

impl Source for SlowSource {
    fn lookup(&self, path: &WirePath) -> io::Result<Lookup> {
        if path.as_bytes() == b"/slow" {
            let mut st = self.state.lock().unwrap();
            st.entered = true;
            self.cv.notify_all();
            let (mut st, waited) =
                self.cv.wait_timeout_while(st, std::time::Duration::from_secs(120), |st| !st.open).unwrap();
            st.timed_out = waited.timed_out();
        }
        self.inner.lookup(path)
    }
    fn readdir(&self, path: &WirePath) -> Result<Vec<starling_view::DirEntry>, i32> {
        self.inner.readdir(path)
    }
    fn materialize(&self, path: &WirePath, recipe: &starling_view::Hash) -> io::Result<fs::File> {
        self.inner.materialize(path, recipe)
    }
}

#[test]
fn a_slow_lookup_does_not_block_other_requests() {
    if !can_mount() {
        return;
    }
    let fx = fixture();
    write_mode(&fx.src.join("slow"), b"slow", 0o644);
    write_mode(&fx.src.join("fast.txt"), b"fast", 0o644);
    let source = Arc::new(SlowSource {
        inner: DirSource::new(&fx.src, &fx.cache).unwrap(),
        state: std::sync::Mutex::new(SlowState::default()),
        cv: std::sync::Condvar::new(),
    });
    let view = mount(source.clone(), &fx.mnt).unwrap();
    fs::metadata(&fx.mnt).unwrap(); // bind "/" first
    let slow_path = fx.mnt.join("slow");
    let slow = std::thread::spawn(move || fs::read(slow_path).map_err(|e| e.to_string()));
    // Wait until the slow lookup is stuck in the source.
    let st = source.state.lock().unwrap();
    let (st, waited) = source.cv.wait_timeout_while(st, std::time::Duration::from_secs(120), |st| !st.entered).unwrap();
    assert!(!waited.timed_out(), "the slow lookup never reached the source");
    drop(st);
    // Same directory as the stuck lookup: needs FUSE_PARALLEL_DIROPS as well as several threads.
    // With the gate still shut, this can only return if it did not queue behind the slow lookup.
    assert_eq!(fs::read(fx.mnt.join("fast.txt")).unwrap(), b"fast");
    {
        let st = source.state.lock().unwrap();
        assert!(!st.open && !st.timed_out, "the fast lookup waited for the slow one");
    }
    assert!(!slow.is_finished(), "the slow lookup ended before the gate opened");
    source.state.lock().unwrap().open = true;
    source.cv.notify_all();
    assert_eq!(slow.join().unwrap().unwrap(), b"slow");
    assert!(!source.state.lock().unwrap().timed_out);
    drop(view);
}

#[test]
fn unmounting_the_view_under_a_live_overlay_detaches_lazily() {
    if !can_mount() {
        return;
    }
    let fx = fixture();
    write_mode(&fx.src.join("a.txt"), b"still here", 0o644);
    let source = Arc::new(DirSource::new(&fx.src, &fx.cache).unwrap());
    let view = mount(source, &fx.mnt).unwrap();
    let task_dir = fx.base.join("task");
    fs::create_dir(&task_dir).unwrap();
    let ov = Overlay::mount(&fx.mnt, &task_dir).unwrap();
    // Busy (the overlay stacks on it): detached, not an error, no hang.
    view.unmount().unwrap();
    assert_eq!(errno_of(fs::metadata(fx.mnt.join("a.txt"))), Some(libc::ENOENT));
    // The overlay keeps the detached view alive and readable.
    assert_eq!(fs::read(ov.root().join("a.txt")).unwrap(), b"still here");
    ov.unmount().unwrap();
}
