//! The client side of `starling exec`: everything that runs on the user's machine.
//!
//! - [`discover`] finds the cluster head.
//! - [`spec`] captures the caller's configuration (argv, env, cwd, umask,
//!   credentials, rlimits) into a [`starling_proto::TaskSpec`].
//! - [`files`] answers the file-view faults a task raises on its host: it is
//!   the authoritative copy of the user's `/` (configuration transparency).
//! - [`commit`] applies a finished task's file changes atomically, refusing
//!   to overwrite anything the user changed meanwhile.
//! - [`exec`] drives one task end to end.

pub mod commit;
pub mod discover;
pub mod exec;
pub mod files;
pub mod job;
pub mod prethrow;
pub mod session;
pub mod shadow;
pub mod spec;

/// Exit status `starling exec` uses for its own failures (cluster missing,
/// host lost, protocol error), as ssh does.
pub const EXIT_STARLING_FAILURE: i32 = 255;
