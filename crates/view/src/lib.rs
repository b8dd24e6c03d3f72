//! starling-view: the file system a remote task runs in.
//!
//! A task started on a cluster host must see the *client's* files, not the
//! host's (UCop's "configuration transparency"): the client's `/usr/bin/gcc`,
//! its headers, its `/etc`, its working directory. The host builds that world
//! from two stacked layers and chroots the task into the result:
//!
//! ```text
//!   task (chroot)  ──►  overlayfs  (merged dir, [`Overlay::root`])
//!                        ├─ upper: per-task dir on ext4   ← every write lands here
//!                        └─ lower: FUSE view ([`mount`])  ← read-only image of the client's `/`
//!                                   ├─ metadata: [`Source`] (network round trip to the client)
//!                                   └─ contents: local files in the host cache (FUSE passthrough)
//! ```
//!
//! **Why FUSE passthrough.** UCop proxied reads through its FUSE daemon and
//! measured 10–60× native cost for short reads, so it handed out symlinks to
//! hash-named cache files instead — which broke programs that `lstat`,
//! `readlink` or `realpath` their own files. Linux ≥ 6.9 lets a FUSE daemon
//! answer `open` with a *backing file*: the kernel then serves `read`, `mmap`
//! and `splice` straight from that file without ever calling the daemon. A
//! regular file in the view is therefore a real regular file (right `stat`,
//! right path) that reads at native speed. The daemon is only involved in
//! `lookup`, `getattr`, `readdir`, `readlink`, `open` and `release`. If the
//! kernel refuses passthrough for a file, `read` falls back to the daemon
//! (counted in [`ViewStats::fallback_reads`]).
//!
//! **Why an overlay.** The view itself is read-only: it mirrors authoritative
//! state that lives on the client, and a network file system that accepted
//! writes would need leases or per-write round trips. Instead the task writes
//! into an overlayfs upper directory on local ext4 (full local speed, and the
//! kernel does copy-up of existing files, so rewriting an old output works —
//! UCop refused that). When the task exits, [`scan_upper`] lists what it
//! created, modified, deleted ([`UpperEntry::Whiteout`]) or replaced
//! wholesale ([`UpperEntry::Dir`] with `opaque`), and the caller ships those
//! changes back to the client, guarded by the bindings the task saw.
//! The overlay is mounted with `redirect_dir=nofollow,index=off,metacopy=off,xino=off`
//! so that the upper dir is self-describing: renaming a lower directory fails
//! with `EXDEV` (tools such as `mv` then copy), and every modified file in the
//! upper dir holds its complete contents.
//!
//! **Why bindings are immutable.** UCop's consistency contract is
//! *task-end-to-start*: a task sees every change the client committed before
//! the task was launched, and nothing has to be checked after that. The view
//! therefore asks the client about each path at most once and records the
//! answer (a *binding*, [`Lookup`]) — including "absent". Later lookups,
//! `getattr`s and opens of that path are answered from the record, and the
//! kernel is told to cache entries and attributes for a day. A task never
//! sees a file change under it half-way through, and at exit
//! [`ViewMount::bindings`] tells the caller exactly which version of each
//! path the task's outputs were based on (the "base" a commit is checked
//! against). [`ViewMount::preload`] seeds bindings sent ahead of the task
//! (UCop's *prethrow*), which removes one network round trip per path.
//!
//! Special nodes (`Lookup::Special`) appear with their type and mode. Device
//! nodes cannot be opened (the view and the overlay are `nodev`: EACCES),
//! sockets give ENXIO, and a FIFO opens as a fresh local pipe (the kernel
//! implements FIFO opens without asking the file system) — never the
//! client's pipe, as in UCop.
//!
//! Concurrency: fuser 0.18 can run several request loops, each with its own
//! cloned `/dev/fuse` descriptor, and the view asks for
//! `FUSE_PARALLEL_DIROPS`, so one slow network lookup does not hold up the
//! lookups and opens of other threads of a parallel build.
//!
//! Everything here needs root (mounting FUSE and overlayfs, registering
//! backing files).

mod dir_source;
mod overlay;
mod upper;
mod view;

pub use dir_source::DirSource;
pub use overlay::Overlay;
pub use upper::{scan_upper, UpperEntry};
pub use view::{mount, mount_with, ViewMount, ViewOptions, ViewStats};

pub use starling_proto::{Attr, DirEntry, Hash, Lookup, NodeKind, WirePath};

/// Where the view's metadata and content come from.
///
/// Called from FUSE request threads; every method may block (a network round
/// trip to the client). The view calls `lookup` at most once per path that
/// succeeds (the answer becomes an immutable binding), `readdir` at most once
/// per directory, and `materialize` when a file is opened and no open file
/// handle for it is alive.
pub trait Source: Send + Sync + 'static {
    /// What is bound at `path` on the client. `Ok(Lookup::Absent)` is an
    /// answer (recorded, shown as ENOENT); `Err` is a failure to get an answer
    /// (not recorded; the task sees the error, e.g. EIO).
    fn lookup(&self, path: &WirePath) -> std::io::Result<Lookup>;
    /// The names in directory `path`, or an errno.
    fn readdir(&self, path: &WirePath) -> Result<Vec<DirEntry>, i32 /*errno*/>;
    /// A local file (on ext4, in the host cache) holding exactly the bytes of
    /// the file bound at `path` with recipe name `recipe`. The source fetches
    /// missing chunks and assembles it.
    fn materialize(&self, path: &WirePath, recipe: &Hash) -> std::io::Result<std::fs::File>;
}
