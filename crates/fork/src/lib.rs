//! starling's remote fork (SnowFlock at process level).
//!
//! `sf_clone` turns the calling process into a *template* (a frozen `fork()`
//! child) and creates clones of it that run the caller's code from inside
//! `sf_clone`, with the clone ID as return value. The pipeline is split into
//! separable stages so that the cluster layer can run each where it belongs:
//!
//! 1. [`template`]: fork, record a resume point and the thread/signal state
//!    the template can read about itself, freeze (client host).
//! 2. [`descriptor`]: dump the frozen template from outside into a
//!    host-independent [`descriptor::Descriptor`] (serde/bincode, kilobytes).
//! 3. [`page_server`]: serve the template's pages over TCP (client host).
//! 4. [`plan`]: lower a descriptor into the restorer's flat plan (clone host).
//! 5. the static restorer (crate `starling-restorer`) maps the regions and
//!    becomes the clone; [`fault`] serves its userfaultfd (clone host).
//! 6. [`local`]: a backend that runs 4–5 on this machine; [`cluster`]: one
//!    that launches each clone as a task on a cluster host (the agent runs
//!    4–5 there, inside the task's sandbox and file view); [`api`] the
//!    ticket/clone/join/kill calls over either. [`ffi`] is the C ABI.
//!
//! See `README.md` for what follows a clone and what does not.

pub mod api;
pub mod cluster;
pub mod descriptor;
pub mod fault;
pub mod ffi;
pub mod local;
pub mod page_server;
pub mod plan;
pub mod template;
pub mod template_hook;
pub mod uffd;

pub use starling_restorer::plan::{KernelSigaction, ResumeContext};

/// Page size assumed throughout (x86-64).
pub const PAGE_SIZE: u64 = 4096;

/// Everything that can go wrong while forking, serving or restoring.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    #[error("{what}: {source}")]
    Io { what: String, #[source] source: std::io::Error },
    #[error("cannot clone mapping {mapping}: {reason}")]
    Unclonable { mapping: String, reason: String },
    #[error("malformed {what}: {detail}")]
    Malformed { what: &'static str, detail: String },
    #[error("page server protocol: {0}")]
    Protocol(String),
    #[error("{0}")]
    Other(String),
    #[error("a ticket is for 1 or more clones, not {0}")]
    BadCount(i32),
    /// What a clone tried that only the parent may do.
    #[error("a clone cannot {0} (no nested clones yet)")]
    InClone(&'static str),
    #[error("ticket already used")]
    TicketUsed,
    #[error("ticket has no clones")]
    NoClones,
    /// `sf_join`: which clones did not exit 0.
    #[error("{0}")]
    Unsuccessful(String),
    #[error(transparent)]
    Config(#[from] starling_config::ConfigError),
    #[error(transparent)]
    Discover(#[from] starling_session::discover::DiscoverError),
    #[error(transparent)]
    Session(#[from] starling_session::SessionError),
    #[error("capturing the caller's configuration: {0}")]
    Spec(#[from] starling_session::spec::SpecError),
    #[error("cluster head address {addr:?}: {source}")]
    HeadAddress { addr: String, #[source] source: std::io::Error },
    #[error("launching {clones} on {host}: {source}")]
    Launch { clones: String, host: String, #[source] source: starling_session::SessionError },
    #[error("the process descriptor is too large ({0} bytes)")]
    DescriptorTooLarge(usize),
}

impl ForkError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        ForkError::Io { what: what.into(), source }
    }
    pub(crate) fn errno(what: impl Into<String>) -> Self {
        ForkError::Io { what: what.into(), source: std::io::Error::last_os_error() }
    }
}

pub type Result<T> = std::result::Result<T, ForkError>;
