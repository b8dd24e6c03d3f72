//! starling's remote fork (SnowFlock at process level).
//!
//! `sf_clone` turns the calling process into a *template* (a frozen `fork()`
//! child) and creates clones of it that run the caller's code from inside
//! `sf_clone`, with the clone ID as return value. The pipeline is split into
//! separable stages so that the cluster layer can run each where it belongs:
//!
//! 1. [`template`]: fork, record a resume point and the thread/signal state
//!    the template can read about itself, freeze (client host).
//! 2. [`dump`]: dump the frozen template from outside into the
//!    host-independent process image, a [`Descriptor`] (`starling-image`,
//!    serde/bincode, kilobytes).
//! 3. [`page_server`]: serve the template's pages over TCP (client host).
//! 4. [`restore`]: lower the descriptor into the restorer's flat plan
//!    (`starling_image::lower`), start the static restorer (crate
//!    `starling-restorer`), which maps the regions and becomes the clone, and
//!    serve each clone's userfaultfd with a [`fault`] handler (clone host).
//!    One stage, used by the local backend and by cluster agents alike; a
//!    host's clones of one ticket share the descriptor fetch and the
//!    multicast receiver ([`host`]).
//! 5. [`local`]: a backend that runs 4 on this machine; [`cluster`]: one
//!    that launches each clone as a task on a cluster host (the agent runs
//!    4 there, inside the task's sandbox and file view); [`api`] the
//!    ticket/clone/join/kill calls over either. [`ffi`] is the C ABI.
//!
//! See `README.md` for what follows a clone and what does not.

pub mod api;
pub mod cluster;
pub mod dump;
pub mod fault;
pub mod host;
pub mod ffi;
pub mod local;
pub mod page_server;
pub mod restore;
pub mod stream;
pub mod template;
pub mod template_hook;
pub mod uffd;

/// The process image this crate fills (dump) and restores (plan, restorer).
pub use starling_image as image;
pub use starling_image::{Descriptor, DescriptorError, PageClass, PAGE_SIZE};

/// Everything that can go wrong while forking, serving or restoring.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    #[error("{what}: {source}")]
    Io { what: String, #[source] source: std::io::Error },
    #[error("cannot clone mapping {mapping}: {reason}")]
    Unclonable { mapping: String, reason: String },
    #[error(transparent)]
    Descriptor(#[from] DescriptorError),
    #[error("malformed {what}: {detail}")]
    Malformed { what: &'static str, detail: String },
    #[error("the template {0}")]
    Template(TemplateFailure),
    #[error("page server protocol: {0}")]
    PageProtocol(#[from] PageProtocolError),
    #[error("restorer channel: {0}")]
    RestorerChannel(#[from] RestorerChannelError),
    #[error("{what} at {addr:#x}: errno {errno}")]
    Uffd { what: &'static str, addr: u64, errno: i32 },
    #[error("page {0:#x} of the template is unreadable")]
    PageUnreadable(u64),
    #[error("fault handler of clone {clone}: {source}")]
    Handler { clone: u32, #[source] source: Box<ForkError> },
    #[error("fault handler of clone {0} panicked")]
    HandlerPanicked(u32),
    #[error(transparent)]
    Usage(#[from] UsageError),
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

/// A template that did not report itself properly.
#[derive(Debug, thiserror::Error)]
pub enum TemplateFailure {
    #[error("sent more than its record")]
    RecordTooLong,
    #[error("died before sending its record ({got} bytes)")]
    Died { got: usize },
    #[error("record has a bad magic")]
    BadMagic,
}

/// A page-server peer that broke the `SFPQ`/`SFPR` protocol.
#[derive(Debug, thiserror::Error)]
pub enum PageProtocolError {
    #[error("bad request magic")]
    RequestMagic,
    #[error("batch of {0} pages")]
    BatchSize(usize),
    #[error("page {0:#x} not served")]
    NotServed(u64),
    #[error("bad reply header")]
    ReplyHeader,
    #[error("bad page tag {0}")]
    PageTag(u8),
    #[error("bad mcdist reply")]
    McdistReply,
    #[error("bad mcdist mode {0}")]
    McdistMode(u8),
    #[error("descriptor of {0} bytes")]
    DescriptorLength(usize),
    #[error("descriptor page unreadable")]
    DescriptorUnreadable,
    #[error("descriptor does not match its hash")]
    DescriptorHash,
    #[error("the peer did not prove the ticket's key (wrong key, or not a starling page server)")]
    KeyProof,
}

/// A restorer record that does not follow `starling_image::abi::restorer`.
#[derive(Debug, thiserror::Error)]
pub enum RestorerChannelError {
    #[error("record of {0} bytes")]
    RecordSize(usize),
    #[error("record for clone {0}")]
    CloneId(u64),
    #[error("userfaultfd record without an fd")]
    MissingFd,
    #[error("unknown record tag {0}")]
    UnknownTag(u64),
    #[error("userfaultfd for clone {0}, which this restore does not hold or already sent one")]
    UnexpectedUffd(u32),
    #[error("recvmsg: {0}")]
    Recv(nix::errno::Errno),
}

/// A call the API does not allow in this state.
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    #[error("a clone cannot clone (no nested clones yet)")]
    NestedClone,
    #[error("a clone cannot request tickets (no nested clones yet)")]
    NestedTicket,
    #[error("ticket for {0} clones")]
    TicketSize(i32),
    #[error("ticket already used")]
    TicketUsed,
    #[error("only the parent can join or kill")]
    NotParent,
    #[error("ticket has no clones")]
    NoClones,
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
