//! `starling-session`: the client side of starling below any front-end.
//!
//! Everything a program needs to run tasks on a cluster as if they ran
//! here, and nothing about how they are shown (progress bars, JSON lines:
//! those are `starling-client`'s). Used by the CLI's `exec`/`run`/`batch`
//! and by the remote fork (libstarling, the Python module).
//!
//! - [`discover`] finds the head, once per command ([`discover::Target`]).
//! - [`Session`]: one connection to the head carrying any number of tasks.
//! - [`files`] answers the file-view faults a task raises on its host: it
//!   is the authoritative copy of the user's `/` (configuration transparency).
//! - [`commit`] applies a finished task's file changes atomically, refusing
//!   to overwrite anything the user changed meanwhile.
//! - [`spec`] captures the caller's configuration (argv, env, cwd, umask,
//!   credentials, rlimits) into a [`starling_proto::TaskSpec`].
//! - [`prethrow`] binds paths at launch so tasks need not ask back for them.

pub mod commit;
pub mod discover;
pub mod files;
pub mod prethrow;
mod session;
pub mod spec;

pub use session::{connect, Grant, Pending, Session, SessionError, SessionOptions, TaskEvent, TaskHandle, X11Event};
