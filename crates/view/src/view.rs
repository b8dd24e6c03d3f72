//! The read-only FUSE view: inode table, immutable bindings, passthrough opens.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    BackingId, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, KernelConfig, LockOwner, MountOption, OpenAccMode, OpenFlags, ReplyAttr,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyXattr,
    Request, SessionACL,
};
use starling_proto::{Attr, DirEntry, Lookup, NodeKind, WirePath};

use crate::Source;

/// How long the kernel may cache entries and attributes. Within one task the
/// view never changes (bindings are immutable), so "a day" means "forever".
const TTL: Duration = Duration::from_secs(24 * 3600);

/// How a view is mounted. `ViewOptions::default()` is what tasks use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ViewOptions {
    /// Serve regular files by kernel passthrough (falls back per file if the
    /// kernel refuses). Off: every read goes through the daemon.
    pub passthrough: bool,
    /// Request loops serving the mount. More than one so that a lookup
    /// waiting on the network does not stall other task threads.
    pub threads: usize,
    /// For an agent without root, mounting inside its user namespace where
    /// only its own ids exist (as 0): every file is shown owned by 0 (that
    /// user), because the task's copy-on-write layer can only copy up files
    /// (and their directories) whose owner exists there. Off: ids as the
    /// client has them.
    pub single_owner: bool,
}

impl Default for ViewOptions {
    fn default() -> Self {
        ViewOptions { passthrough: true, threads: 4, single_owner: false }
    }
}


/// Counters describing how the view was used (all monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ViewStats {
    /// `Source::lookup` calls (paths not already bound).
    pub lookups_sent: u64,
    /// Requests (lookup, getattr, open...) answered from an existing binding
    /// (prethrow or earlier answer) without asking the source.
    pub lookups_local: u64,
    /// `Source::readdir` calls.
    pub readdirs_sent: u64,
    /// Successful opens of regular files.
    pub opens: u64,
    /// Opens served by kernel passthrough (no read callbacks).
    pub passthrough_opens: u64,
    /// `Source::materialize` calls.
    pub materializations: u64,
    /// `read` requests the daemon had to serve itself (passthrough unavailable).
    pub fallback_reads: u64,
}

#[derive(Default)]
struct Counters {
    lookups_sent: AtomicU64,
    lookups_local: AtomicU64,
    readdirs_sent: AtomicU64,
    opens: AtomicU64,
    passthrough_opens: AtomicU64,
    materializations: AtomicU64,
    fallback_reads: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Path ↔ inode number. Inode numbers are never reused or forgotten: a view
/// lives as long as one task, and the table is small next to the task.
struct Inodes {
    by_path: HashMap<WirePath, u64>,
    /// `paths[ino - 1]` is the path of `ino`; ino 1 is `/`.
    paths: Vec<WirePath>,
}

impl Inodes {
    fn new() -> Inodes {
        let root = WirePath::root();
        Inodes { by_path: HashMap::from([(root.clone(), 1)]), paths: vec![root] }
    }
    fn ino_of(&mut self, path: &WirePath) -> u64 {
        if let Some(&ino) = self.by_path.get(path) {
            return ino;
        }
        self.paths.push(path.clone());
        let ino = self.paths.len() as u64;
        self.by_path.insert(path.clone(), ino);
        ino
    }
    fn path_of(&self, ino: u64) -> Option<&WirePath> {
        self.paths.get(usize::try_from(ino).ok()?.checked_sub(1)?)
    }
}

/// One open file handle.
struct OpenFile {
    /// Kept alive until `release`: the kernel reads through it.
    _backing: Option<Arc<BackingId>>,
    /// The cache file, for daemon-served reads when passthrough is not in use.
    file: Option<File>,
}

/// State shared between the FUSE request threads and the [`ViewMount`] handle.
struct Shared {
    source: Arc<dyn Source>,
    inodes: Mutex<Inodes>,
    /// The bindings: first answer wins, never replaced.
    bindings: Mutex<HashMap<WirePath, Lookup>>,
    /// Directory listings: first answer wins, never replaced.
    listings: Mutex<HashMap<WirePath, Arc<Vec<DirEntry>>>>,
    /// Paths the task looked up or opened, in first-access order.
    accessed: Mutex<(Vec<WirePath>, HashSet<WirePath>)>,
    /// One backing file per inode while any handle is open: the kernel
    /// refuses a second, different backing file for an inode in use.
    backing_by_ino: Mutex<HashMap<u64, Weak<BackingId>>>,
    open_files: Mutex<HashMap<u64, OpenFile>>,
    next_fh: AtomicU64,
    counters: Counters,
    /// [`ViewOptions::single_owner`].
    single_owner: bool,
}

/// Lock a mutex even if a request thread panicked while holding it: the
/// protected maps stay consistent (every update is a single insert).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn io_errno(e: &io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().filter(|&n| n > 0).unwrap_or(libc::EIO))
}

impl Shared {
    fn path_of(&self, ino: INodeNo) -> Option<WirePath> {
        lock(&self.inodes).path_of(ino.0).cloned()
    }

    fn note_access(&self, path: &WirePath) {
        let mut acc = lock(&self.accessed);
        if acc.1.insert(path.clone()) {
            acc.0.push(path.clone());
        }
    }

    /// The binding for `path`, asking the source only if there is none yet.
    /// Two threads racing on one path may both ask; the first answer stored wins.
    fn binding(&self, path: &WirePath) -> Result<Lookup, Errno> {
        if let Some(b) = lock(&self.bindings).get(path) {
            bump(&self.counters.lookups_local);
            return Ok(b.clone());
        }
        // A directory whose listing the task already has is complete: a name
        // not in it is absent, without asking (temp and output files are new
        // names every run, so no profile can predict them).
        if let Some(parent) = path.parent() {
            let listed = lock(&self.listings).get(&parent).map(|l| l.iter().any(|e| e.name == path.file_name()));
            if listed == Some(false) {
                bump(&self.counters.lookups_local);
                return Ok(lock(&self.bindings).entry(path.clone()).or_insert(Lookup::Absent).clone());
            }
        }
        bump(&self.counters.lookups_sent);
        let answer = self.source.lookup(path).map_err(|e| {
            log::debug!("view: source lookup {path} failed: {e}");
            io_errno(&e)
        })?;
        let answer = sanitize(answer);
        Ok(lock(&self.bindings).entry(path.clone()).or_insert(answer).clone())
    }

    fn listing(&self, path: &WirePath) -> Result<Arc<Vec<DirEntry>>, Errno> {
        if let Some(l) = lock(&self.listings).get(path) {
            return Ok(l.clone());
        }
        bump(&self.counters.readdirs_sent);
        let mut entries = self.source.readdir(path).map_err(|n| Errno::from_i32(if n > 0 { n } else { libc::EIO }))?;
        // Names from the peer must be single components; anything else is dropped.
        entries.retain(|e| {
            !e.name.is_empty() && e.name != b"." && e.name != b".." && !e.name.contains(&b'/') && !e.name.contains(&0)
        });
        // Keep the listing consistent with what the task was told by lookup:
        // a name already bound as absent is not listed.
        {
            let bindings = lock(&self.bindings);
            entries.retain(|e| match path.join(&e.name) {
                Ok(child) => !matches!(bindings.get(&child), Some(Lookup::Absent)),
                Err(_) => false,
            });
        }
        let entries = Arc::new(entries);
        Ok(lock(&self.listings).entry(path.clone()).or_insert(entries).clone())
    }

    fn file_attr(&self, ino: u64, lookup: &Lookup) -> Option<FileAttr> {
        let (attr, kind) = match lookup {
            Lookup::Absent => return None,
            Lookup::Dir(a) => (a, FileType::Directory),
            Lookup::Symlink(a, _) => (a, FileType::Symlink),
            Lookup::File(a, _) => (a, FileType::RegularFile),
            Lookup::Special(a) => (a, special_type(a.mode)),
        };
        let mut a = to_file_attr(ino, attr, kind);
        if self.single_owner {
            (a.uid, a.gid) = (0, 0);
        }
        Some(a)
    }
}

/// Refuse answers the kernel cannot represent: a symlink target must be
/// non-empty, NUL-free and at most PATH_MAX bytes. Such a node is shown as absent.
fn sanitize(l: Lookup) -> Lookup {
    match l {
        Lookup::Symlink(_, t) if t.is_empty() || t.contains(&0) || t.len() > starling_proto::MAX_PATH => {
            log::warn!("view: source gave a malformed symlink target; treating as absent");
            Lookup::Absent
        }
        other => other,
    }
}

fn special_type(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFSOCK => FileType::Socket,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        _ => FileType::NamedPipe,
    }
}

fn kind_type(kind: NodeKind) -> FileType {
    match kind {
        NodeKind::File => FileType::RegularFile,
        NodeKind::Dir => FileType::Directory,
        NodeKind::Symlink => FileType::Symlink,
        // The exact special type is only known after a lookup; readdir's d_type is a hint.
        NodeKind::Special => FileType::NamedPipe,
    }
}

/// FUSE carries device numbers in 32 bits; the low half is the kernel's
/// old-style encoding, which is what FUSE passes on.
fn fuse_rdev(rdev: u64) -> u32 {
    #[allow(clippy::cast_possible_truncation)]
    let low = rdev as u32;
    low
}

fn time_of(ns: i64) -> SystemTime {
    let d = Duration::from_nanos(ns.unsigned_abs());
    if ns >= 0 {
        UNIX_EPOCH.checked_add(d).unwrap_or(UNIX_EPOCH)
    } else {
        UNIX_EPOCH.checked_sub(d).unwrap_or(UNIX_EPOCH)
    }
}

fn to_file_attr(ino: u64, a: &Attr, kind: FileType) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: time_of(a.atime_ns),
        mtime: time_of(a.mtime_ns),
        ctime: time_of(a.ctime_ns),
        crtime: time_of(a.ctime_ns),
        kind,
        perm: (a.mode & 0o7777) as u16,
        nlink: a.nlink.max(1),
        uid: a.uid,
        gid: a.gid,
        rdev: fuse_rdev(a.rdev),
        blksize: 4096,
        flags: 0,
    }
}

/// The fuser file system; all state lives in [`Shared`].
struct ViewFs {
    shared: Arc<Shared>,
    /// Set in `init` once the kernel has agreed to passthrough.
    passthrough: bool,
}

impl ViewFs {
    /// Reply to lookup/getattr-style requests: (ino, binding) for a path.
    fn resolve(&self, path: &WirePath) -> Result<(u64, Lookup), Errno> {
        let binding = self.shared.binding(path)?;
        let ino = lock(&self.shared.inodes).ino_of(path);
        Ok((ino, binding))
    }
}

impl ViewFs {
    fn live_backing(&self, ino: u64) -> Option<Arc<BackingId>> {
        lock(&self.shared.backing_by_ino).get(&ino).and_then(Weak::upgrade)
    }

    fn open_passthrough(&self, fh: u64, id: Arc<BackingId>, reply: ReplyOpen) {
        // Record the handle before replying: release may arrive right after.
        lock(&self.shared.open_files).insert(fh, OpenFile { _backing: Some(id.clone()), file: None });
        reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id);
        bump(&self.shared.counters.opens);
        bump(&self.shared.counters.passthrough_opens);
    }
}

impl Filesystem for ViewFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        // Passthrough: backing files live on ext4 (stack depth 0), so depth 1
        // suffices, and keeps room for the overlay mounted on top (depth 2).
        if self.passthrough {
            self.passthrough = false;
            match config.add_capabilities(InitFlags::FUSE_PASSTHROUGH) {
                Ok(()) => match config.set_max_stack_depth(1) {
                    Ok(_) => self.passthrough = true,
                    Err(max) => log::warn!("view: stack depth 1 refused (max {max}); reads go through the daemon"),
                },
                Err(_) => log::warn!("view: kernel lacks FUSE passthrough; reads go through the daemon"),
            }
        }
        // Lookups in one directory may run concurrently (otherwise the kernel
        // serialises them per directory inode).
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        // Symlink targets never change: let the page cache keep them.
        let _ = config.add_capabilities(InitFlags::FUSE_CACHE_SYMLINKS);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some(parent_path) = self.shared.path_of(parent) else {
            return reply.error(Errno::ENOENT);
        };
        let Ok(path) = parent_path.join(name.as_bytes()) else {
            return reply.error(Errno::ENOENT);
        };
        self.shared.note_access(&path);
        match self.resolve(&path) {
            Err(e) => reply.error(e),
            Ok((ino, binding)) => match self.shared.file_attr(ino, &binding) {
                Some(attr) => reply.entry(&TTL, &attr, Generation(0)),
                None => {
                    // Negative entry (node id 0): the kernel caches the
                    // absence for TTL, so repeated probes (the dynamic
                    // linker's search path) don't even reach the daemon.
                    let mut attr = to_file_attr(0, &ABSENT_ATTR, FileType::RegularFile);
                    attr.ino = INodeNo(0);
                    reply.entry(&TTL, &attr, Generation(0))
                }
            },
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let Some(path) = self.shared.path_of(ino) else {
            return reply.error(Errno::ENOENT);
        };
        match self.shared.binding(&path) {
            Err(e) => reply.error(e),
            Ok(b) => match self.shared.file_attr(ino.0, &b) {
                Some(attr) => reply.attr(&TTL, &attr),
                None => reply.error(Errno::ENOENT),
            },
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let Some(path) = self.shared.path_of(ino) else {
            return reply.error(Errno::ENOENT);
        };
        match self.shared.binding(&path) {
            Ok(Lookup::Symlink(_, target)) => reply.data(&target),
            Ok(Lookup::Absent) => reply.error(Errno::ENOENT),
            Ok(_) => reply.error(Errno::EINVAL),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.acc_mode() != OpenAccMode::O_RDONLY || flags.0 & libc::O_TRUNC != 0 {
            // The overlay copies a file up before writing; a direct write is a bug.
            return reply.error(Errno::EROFS);
        }
        let Some(path) = self.shared.path_of(ino) else {
            return reply.error(Errno::ENOENT);
        };
        self.shared.note_access(&path);
        let (attr, recipe) = match self.shared.binding(&path) {
            Ok(Lookup::File(attr, recipe)) => (attr, recipe),
            Ok(Lookup::Absent) => return reply.error(Errno::ENOENT),
            Ok(Lookup::Dir(_)) => return reply.error(Errno::EISDIR),
            Ok(Lookup::Symlink(..)) => return reply.error(Errno::ELOOP),
            // Fifos, sockets and devices are shown but cannot be opened.
            Ok(Lookup::Special(_)) => return reply.error(Errno::ENXIO),
            Err(e) => return reply.error(e),
        };
        let fh = self.shared.next_fh.fetch_add(1, Ordering::Relaxed);

        // Another handle of this inode still open: reuse its backing file
        // (the kernel refuses a second, different one for an inode in use).
        if let Some(id) = self.live_backing(ino.0) {
            return self.open_passthrough(fh, id, reply);
        }
        // Not holding any lock here: materialize may wait on the network.
        bump(&self.shared.counters.materializations);
        let file = match self.shared.source.materialize(&path, &recipe) {
            Ok(f) => f,
            Err(e) => {
                log::warn!("view: materialize {path} failed: {e}");
                return reply.error(io_errno(&e));
            }
        };
        match file.metadata() {
            Ok(m) if m.is_file() && m.len() == attr.size => {}
            Ok(m) => {
                log::warn!("view: materialized {path} is {} bytes, binding says {}", m.len(), attr.size);
                return reply.error(Errno::EIO);
            }
            Err(e) => return reply.error(io_errno(&e)),
        }
        let backing = if self.passthrough {
            reply.open_backing(&file)
        } else {
            Err(io::Error::new(io::ErrorKind::Unsupported, "passthrough disabled"))
        };
        match backing {
            Ok(id) => {
                // A concurrent open of the same inode may have registered one
                // meanwhile; the first registered stays, ours is closed.
                let id = {
                    let mut by_ino = lock(&self.shared.backing_by_ino);
                    match by_ino.get(&ino.0).and_then(Weak::upgrade) {
                        Some(existing) => existing,
                        None => {
                            let id = Arc::new(id);
                            by_ino.insert(ino.0, Arc::downgrade(&id));
                            id
                        }
                    }
                };
                self.open_passthrough(fh, id, reply);
            }
            Err(e) => {
                log::debug!("view: passthrough unavailable for {path} ({e}); serving reads");
                lock(&self.shared.open_files).insert(fh, OpenFile { _backing: None, file: Some(file) });
                reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE);
                bump(&self.shared.counters.opens);
            }
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        bump(&self.shared.counters.fallback_reads);
        // Clone the descriptor so the read runs without holding the table lock.
        let file = match lock(&self.shared.open_files).get(&fh.0).and_then(|o| o.file.as_ref().map(File::try_clone)) {
            Some(Ok(f)) => f,
            Some(Err(e)) => return reply.error(io_errno(&e)),
            None => return reply.error(Errno::EBADF),
        };
        let mut buf = vec![0u8; size as usize];
        let mut filled = 0;
        while filled < buf.len() {
            match file.read_at(&mut buf[filled..], offset + filled as u64) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return reply.error(io_errno(&e)),
            }
        }
        reply.data(&buf[..filled]);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // Dropping the last Arc<BackingId> closes the backing file in the kernel.
        lock(&self.shared.open_files).remove(&fh.0);
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EISDIR);
        }
        // Listing fetched lazily in readdir; a directory handle carries no state.
        reply.opened(FileHandle(ino.0), FopenFlags::empty());
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let Some(path) = self.shared.path_of(ino) else {
            return reply.error(Errno::ENOENT);
        };
        let listing = match self.shared.listing(&path) {
            Ok(l) => l,
            Err(e) => return reply.error(e),
        };
        let parent_ino = match path.parent() {
            Some(p) => lock(&self.shared.inodes).ino_of(&p),
            None => ino.0,
        };
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let mut index = start;
        // Entries 0 and 1 are "." and ".."; entry k+2 is listing[k]. The
        // offset handed to the kernel is the index of the next entry.
        while index < listing.len() + 2 {
            let (child_ino, kind, name): (u64, FileType, &[u8]) = match index {
                0 => (ino.0, FileType::Directory, b"."),
                1 => (parent_ino, FileType::Directory, b".."),
                k => {
                    let e = &listing[k - 2];
                    let child_ino = match path.join(&e.name) {
                        Ok(child) => lock(&self.shared.inodes).ino_of(&child),
                        Err(_) => {
                            index += 1;
                            continue;
                        }
                    };
                    (child_ino, kind_type(e.kind), &e.name)
                }
            };
            if reply.add(INodeNo(child_ino), (index + 1) as u64, kind, OsStr::from_bytes(name)) {
                break;
            }
            index += 1;
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let files = lock(&self.shared.inodes).paths.len() as u64;
        // A read-only view: nothing free.
        reply.statfs(0, 0, 0, files, 0, 4096, 255, 4096);
    }

    fn getxattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, _size: u32, reply: ReplyXattr) {
        // The client's xattrs are not exported; overlayfs probes trusted.overlay.*.
        reply.error(Errno::NO_XATTR);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: ReplyXattr) {
        if size == 0 {
            reply.size(0)
        } else {
            reply.data(&[])
        }
    }

    fn access(&self, _req: &Request, _ino: INodeNo, mask: fuser::AccessFlags, reply: ReplyEmpty) {
        // Only reached without default_permissions; the mount is read-only.
        if mask.contains(fuser::AccessFlags::W_OK) {
            reply.error(Errno::EROFS)
        } else {
            reply.ok()
        }
    }
}

/// Attributes sent with a negative entry (ignored by the kernel).
const ABSENT_ATTR: Attr = Attr {
    kind: NodeKind::File,
    ino: 0,
    size: 0,
    mode: 0,
    nlink: 1,
    uid: 0,
    gid: 0,
    rdev: 0,
    atime_ns: 0,
    mtime_ns: 0,
    ctime_ns: 0,
};

/// A mounted view. Dropping it unmounts (lazily if something, such as an
/// overlay, still uses it).
pub struct ViewMount {
    shared: Arc<Shared>,
    /// Owns the kernel mount; `unmount` takes it, so the session thread's own
    /// clean-up never unmounts whatever is at the mount point later.
    unmounter: fuser::SessionUnmounter,
    /// A duplicate of the session's /dev/fuse descriptor, to ask the kernel
    /// whether the connection is still alive after unmounting.
    conn: OwnedFd,
    thread: Option<JoinHandle<io::Result<()>>>,
    mountpoint: PathBuf,
}

/// Every fuser request thread allocates a zeroed 16 MiB read buffer
/// (`MAX_WRITE_SIZE`) when the session starts, and frees it when the session
/// ends. glibc's *dynamic* mmap threshold rises to the size of the largest
/// mmapped chunk freed, so after the first view has been unmounted every
/// later buffer comes from a malloc arena and calloc memsets all 16 MiB:
/// 64 MiB of page faults per mounted view, measured as ~35% of an agent's
/// CPU when 32 clones start. A fixed threshold keeps such buffers mmapped,
/// so only the pages a request actually touches are ever faulted in.
fn fix_malloc_mmap_threshold() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: mallopt only changes allocator tuning; 1 MiB is a valid
        // M_MMAP_THRESHOLD (≤ HEAP_MAX/2), and setting it disables the
        // dynamic adjustment described above.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20) };
    });
}

/// Mount a read-only view of `source` at `mountpoint` (background session
/// threads). Mounted with `allow_other` (tasks run as the client's uid),
/// `default_permissions` (the kernel checks the client's modes), `ro`,
/// `nosuid`, `nodev`.
pub fn mount(source: Arc<dyn Source>, mountpoint: &Path) -> io::Result<ViewMount> {
    mount_with(source, mountpoint, ViewOptions::default())
}

/// [`mount`] with explicit options.
pub fn mount_with(source: Arc<dyn Source>, mountpoint: &Path, options: ViewOptions) -> io::Result<ViewMount> {
    fix_malloc_mmap_threshold();
    let shared = Arc::new(Shared {
        source,
        inodes: Mutex::new(Inodes::new()),
        bindings: Mutex::new(HashMap::new()),
        listings: Mutex::new(HashMap::new()),
        accessed: Mutex::new((Vec::new(), HashSet::new())),
        backing_by_ino: Mutex::new(HashMap::new()),
        open_files: Mutex::new(HashMap::new()),
        next_fh: AtomicU64::new(1),
        counters: Counters::default(),
        single_owner: options.single_owner,
    });
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("starling-view".into()),
        MountOption::Subtype("starling".into()),
        MountOption::RO,
        MountOption::DefaultPermissions,
        MountOption::NoSuid,
        MountOption::NoDev,
    ];
    config.acl = SessionACL::All;
    config.n_threads = Some(options.threads.max(1));
    config.clone_fd = true;
    let fs = ViewFs { shared: shared.clone(), passthrough: options.passthrough };
    let mut session = fuser::Session::new(fs, mountpoint, &config)?;
    let conn = session.as_fd().try_clone_to_owned()?;
    let unmounter = session.unmount_callable();
    let thread = std::thread::Builder::new().name("starling-view".into()).spawn(move || session.run())?;
    Ok(ViewMount { shared, unmounter, conn, thread: Some(thread), mountpoint: mountpoint.to_path_buf() })
}

impl ViewMount {
    /// Every binding the task observed (path → answer, `Absent` included),
    /// plus preloaded ones. The first answer for a path is the one the task
    /// sees for its whole life.
    pub fn bindings(&self) -> HashMap<WirePath, Lookup> {
        lock(&self.shared.bindings).clone()
    }

    /// Every complete directory listing the task saw or was given.
    pub fn listings(&self) -> Vec<(WirePath, Vec<DirEntry>)> {
        lock(&self.shared.listings).iter().map(|(p, e)| (p.clone(), e.as_ref().clone())).collect()
    }

    /// Seed bindings before the task starts (prethrow): these paths are then
    /// answered without asking the source. A path already bound keeps its
    /// binding.
    pub fn preload(&self, bindings: Vec<(WirePath, Lookup)>) {
        let mut map = lock(&self.shared.bindings);
        for (path, lookup) in bindings {
            if path.validate().is_ok() {
                map.entry(path).or_insert_with(|| sanitize(lookup));
            }
        }
    }

    /// Seed complete directory listings (prethrow): readdir is answered
    /// locally and names missing from a listing are absent. A directory
    /// already listed keeps its listing.
    pub fn preload_listings(&self, listings: Vec<(WirePath, Vec<DirEntry>)>) {
        let mut map = lock(&self.shared.listings);
        for (path, mut entries) in listings {
            if path.validate().is_err() {
                continue;
            }
            entries.retain(|e| {
                !e.name.is_empty() && e.name != b"." && e.name != b".." && !e.name.contains(&b'/') && !e.name.contains(&0)
            });
            map.entry(path).or_insert_with(|| Arc::new(entries));
        }
    }

    pub fn stats(&self) -> ViewStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ViewStats {
            lookups_sent: get(&c.lookups_sent),
            lookups_local: get(&c.lookups_local),
            readdirs_sent: get(&c.readdirs_sent),
            opens: get(&c.opens),
            passthrough_opens: get(&c.passthrough_opens),
            materializations: get(&c.materializations),
            fallback_reads: get(&c.fallback_reads),
        }
    }

    /// Paths the task looked up or opened, in first-access order (input for
    /// the prethrow profile). Includes paths that turned out absent.
    pub fn accessed_paths(&self) -> Vec<WirePath> {
        lock(&self.shared.accessed).0.clone()
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmount now. If the mount is busy (an overlay still stacked on it, a
    /// process still inside), detach it lazily instead; the request threads
    /// then end when the kernel lets go of the file system.
    pub fn unmount(mut self) -> io::Result<()> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> io::Result<()> {
        let Some(thread) = self.thread.take() else { return Ok(()) };
        let result = match self.unmounter.unmount() {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                log::debug!("view: {} busy, detaching lazily", self.mountpoint.display());
                nix::mount::umount2(&self.mountpoint, nix::mount::MntFlags::MNT_DETACH).map_err(io::Error::from)
            }
            Err(e) => Err(e),
        };
        // Unmounting the last reference to the file system ends the FUSE
        // connection before umount(2) returns, and the request threads exit:
        // wait for them. But an overlay holds its own (private) reference to
        // its lower layer, so the view may live on after the unmount and keep
        // serving it; then the threads are left to end with the connection.
        if connection_ended(&self.conn) {
            match thread.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => log::debug!("view: session ended with {e}"),
                Err(_) => log::warn!("view: a request thread panicked"),
            }
        }
        result
    }
}

/// Whether the FUSE connection behind `conn` is gone (poll reports POLLERR).
fn connection_ended(conn: &OwnedFd) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    loop {
        let mut fds = [PollFd::new(conn.as_fd(), PollFlags::empty())];
        return match poll(&mut fds, PollTimeout::ZERO) {
            Ok(_) => fds[0].revents().is_some_and(|r| r.contains(PollFlags::POLLERR)),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => false,
        };
    }
}

impl Drop for ViewMount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner() {
            log::warn!("view: unmounting {} failed: {e}", self.mountpoint.display());
        }
    }
}

