//! `starling-client`: the front-ends of `starling exec`, `run` and `batch`.
//!
//! What runs a task — finding the head, the session, answering file
//! faults, committing — is `starling-session`'s; this crate prepares
//! launches (prethrow prediction, push of what the head lacks) and shows
//! what happens (live output, progress bars, JSON lines, exit statuses).
//!
//! - [`exec`] drives one task end to end.
//! - [`job`] runs many tasks as one job.
//! - [`launch`] prepares a launch from what earlier runs used.
//! - [`shadow`] remembers what the head's caches hold.
//! - [`roam`] is a roaming task's migration manager (`exec --roam`).
//! - [`terminal`] runs a task on a pty when `starling exec` runs on a terminal.

pub mod exec;
pub mod job;
pub mod launch;
pub mod roam;
pub mod shadow;
pub mod terminal;
pub mod x11;
pub mod xsense;

use starling_config::ClientSettings;
use starling_session::discover::Target;
use starling_session::{Session, SessionError, SessionOptions};

/// Exit status `starling exec` uses for its own failures (cluster missing,
/// host lost, protocol error), as ssh does.
pub const EXIT_STARLING_FAILURE: i32 = 255;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error("cannot handle signals: {0}")]
    Signals(#[source] std::io::Error),
    #[error("preparing the launch was interrupted")]
    Interrupted,
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// What every command needs: the head (found once) and the client's settings.
#[derive(Clone, Debug)]
pub struct Context {
    pub target: Target,
    pub settings: ClientSettings,
    /// When the command started (for the per-stage times of `client.stats_file`).
    pub started: std::time::Instant,
}

impl Context {
    /// A session to the head, set up as the settings say.
    pub async fn session(&self) -> Result<Session> {
        let opts = SessionOptions {
            compress: self.settings.compress,
            cache_dir: self.settings.cache_dir.clone(),
            chunking: self.settings.chunking,
        };
        Ok(Session::connect(&self.target, opts).await?)
    }
}
