//! Live migration of a running, unmodified process (Snowbird's and
//! Linger-Longer's mechanism, at process level): it moves to another host
//! while it runs, and the old host is left with nothing of it.
//!
//! ```text
//!  source (the host it runs on)                 target
//!  precheck: nothing unmovable ─ refuse
//!  arm write tracking (uffd-WP, injected)
//!  round 0: every page ───────── Pages ───────▶ staging
//!  rounds 1..8: written pages ── Pages ───────▶ staging   (until the set stops shrinking)
//!  freeze (ptrace), capture ──── Image ───────▶ restore (restorer, same PID/TIDs), resume
//!  page server (frozen memory) ◀─ faults ────── fault handler: staged pages, else fetch
//!                              ◀─ drain ─────── every page still at the source
//!  kill ◀──────────────────────── Complete ──── (the source holds nothing)
//! ```
//!
//! [`freeze`], [`inject`], [`capture`]: the image from outside (ptrace,
//! injected system calls, `/proc`) into `starling-image`'s descriptor.
//! [`dirty`]: which pages it writes while it runs. [`wire`]: the frames
//! between the two hosts. [`source`] and [`target`]: the two drivers; what
//! else must travel (the task's files, its I/O) is the caller's payload.
//! The restore itself is remote fork's stage (`starling_fork::restore`),
//! with pre-copied pages served locally.

pub mod capture;
pub mod dirty;
pub mod freeze;
pub mod inject;
pub mod ptrace;
pub mod source;
pub mod staging;
pub mod target;
pub mod wire;

/// Everything that can go wrong while migrating.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("{what} on thread {tid}: {source}")]
    Ptrace { what: &'static str, tid: i32, #[source] source: std::io::Error },
    #[error("reading {path}: {source}")]
    Proc { path: String, #[source] source: std::io::Error },
    #[error("process or thread {0} is gone")]
    Gone(i32),
    #[error("process {0} keeps creating threads faster than they can be stopped")]
    ThreadStorm(i32),
    #[error("process {0} has no private executable mapping to run injected calls from")]
    NoCode(i32),
    #[error("injected system call {nr} in thread {tid}: {detail}")]
    Injection { tid: i32, nr: libc::c_long, detail: String },
    #[error("write tracking: {what}: {source}")]
    Tracking { what: &'static str, #[source] source: std::io::Error },
    #[error("cannot move: {0}")]
    Unmovable(String),
    #[error("cannot move: fd {fd} ({target}) is {what}")]
    UnmovableFd { fd: i32, target: String, what: String },
    #[error("cannot move: {0}")]
    Sessions(#[from] starling_image::SessionError),
    #[error("cannot move: process {0} of the task was orphaned (a parent of it ended): only the first process and its descendants move, and it would end with the source")]
    Orphan(u64),
    #[error("cannot move: process {pid} of the task is in {what} {host_id} (as this host numbers it), whose leader is not part of the task (it has ended or is outside it)")]
    LeaderOutside { pid: u64, what: &'static str, host_id: i32 },
    #[error(transparent)]
    Fork(#[from] starling_fork::ForkError),
    #[error(transparent)]
    Descriptor(#[from] starling_image::DescriptorError),
    #[error(transparent)]
    Wire(#[from] wire::WireError),
    #[error("the caller's {stage} step failed: {reason}")]
    Hook { stage: &'static str, reason: String },
    #[error("malformed migration stream: {0}")]
    Stream(String),
    #[error("the target failed before the process resumed there: {0}")]
    TargetFailed(String),
    #[error("the connection to the other host was lost after the process resumed there: {0}")]
    LostAfterSwitch(String),
}

pub type Result<T> = std::result::Result<T, MigrateError>;
