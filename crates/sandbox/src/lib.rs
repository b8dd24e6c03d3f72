//! The task sandbox: how a starling agent runs one task "as if on the client".
//!
//! A task must see the client's file system (a prepared directory, `root`:
//! an overlay over a FUSE view of the client's `/`), run with the client's
//! credentials, umask, limits, environment and working directory, and must
//! not see or outlive the host it borrows. This crate gives it:
//!
//! * its own **mount namespace** (mounts made for it never reach the host),
//!   its own **PID namespace** (it sees only its own processes in a fresh
//!   `/proc`, and everything it starts dies with it), its own IPC namespace
//!   and, when a host name is requested, its own UTS namespace;
//! * a **chroot** into `root` with a fresh `/proc` and a minimal `/dev`;
//! * the client's uid/gid/groups, umask, rlimits, env, cwd and argv, with a
//!   shell-like `PATH` search (127 "command not found", 126 "Permission denied");
//! * the **exact** exit status (`ExitStatus::Code(130)` and
//!   `ExitStatus::Signal(SIGINT)` stay distinct: the status travels on a side
//!   channel, not only as an exit code).
//!
//! # Why a helper process, forked by a zygote
//!
//! The agent is a multi-threaded tokio daemon. A process that unshares a PID
//! namespace cannot create threads afterwards, and code running in a
//! `fork()`ed child of a multi-threaded process may not allocate (another
//! thread may have held the allocator's lock). So the first [`spawn`]
//! executes the starling binary as `starling __sandbox-init`, a
//! single-threaded process whose entry point is [`init_main`]: the *zygote*.
//! For every sandbox it forks an outer init (as a child of the agent, with
//! `CLONE_PARENT`), which executing the binary per task used to be, at the
//! cost of forking the whole agent and starting a 100 MiB binary each time
//! (see `zygote.rs`). The process tree is:
//!
//! ```text
//! agent ─┬ zygote (`__sandbox-init`, serves spawn requests on a socket)
//!        └ outer init (forked by the zygote, root PID ns)
//!             └── reaper (PID 1 of the new PID ns: mounts /proc and /dev, chroots)
//!                    └── task (PID 2: drops credentials, execs argv)
//! ```
//!
//! The spec travels to the outer init in a memfd (fd 3), never in argv; the
//! final status comes back on a pipe (fd 4). That pipe doubles as the
//! outer init's *lifeline*: when the agent dies (even by `kill -9`) its read
//! end closes, the outer init sees `POLLERR` at once and kills the sandbox.
//! The lower levels use `PR_SET_PDEATHSIG(SIGKILL)`. The outer level does
//! not, on purpose: the parent-death signal fires when the *thread* that
//! forked exits, and an agent spawning from tokio's blocking pool would
//! otherwise see its tasks killed whenever an idle pool thread retires.

//!
//! # Using it from the agent
//!
//! ```no_run
//! use starling_sandbox::{spawn, ExitStatus, SandboxSpec, INIT_SUBCOMMAND};
//! # fn agent_main() -> std::io::Result<()> {
//! // First thing in the binary's main, before any thread exists:
//! if std::env::args_os().nth(1).is_some_and(|a| a == INIT_SUBCOMMAND) {
//!     starling_sandbox::init_main();
//! }
//! # let (spec, stdin, stdout, stderr): (SandboxSpec, std::os::fd::OwnedFd, std::os::fd::OwnedFd, std::os::fd::OwnedFd) = todo!();
//! // Later, per task. "/proc/self/exe" keeps working even if the binary
//! // on disk has been replaced since the agent started.
//! let mut sandbox = spawn("/proc/self/exe".as_ref(), &spec, stdin, stdout, stderr)?;
//! sandbox.signal(libc::SIGTERM)?; // relayed to the task
//! match sandbox.wait()? {
//!     ExitStatus::Code(c) => println!("exited {c}"),
//!     ExitStatus::Signal(s) => println!("killed by signal {s}"),
//! }
//! # Ok(()) }
//! ```
//!
//! An async agent can instead wrap [`Sandboxed::pidfd`] in
//! `tokio::io::unix::AsyncFd`, await readability, then call
//! [`Sandboxed::try_wait`].
//!
//! # Statuses
//!
//! The task's own exit code or fatal signal, exactly; or
//! [`EXIT_SETUP_FAILED`] (125) when the sandbox could not be set up,
//! [`EXIT_NOT_EXECUTABLE`] (126) or [`EXIT_NOT_FOUND`] (127) when the
//! command could not be run. In those cases a line starting `starling: `
//! explains why on the task's stderr.
//!
//! # Hardening ([`Confinement::Task`])
//!
//! An ordinary task runs with `no_new_privs`, a seccomp filter that returns
//! `EPERM` for [`harden::DENIED_SYSCALLS`] (module loading, kexec, bpf,
//! perf, keyrings, reboot, swap, `open_by_handle_at`, mounting, `ptrace`),
//! and, unless its uid is 0, no capabilities at all (effective, permitted,
//! inheritable, ambient and bounding sets empty). The restorer of a clone or
//! of a moved task ([`Confinement::Restorer`]) needs root for its nested PID
//! namespace and userfaultfd and is left as it was (less `CAP_NET_ADMIN` and
//! `CAP_NET_RAW` for a clone of a ticket with its own network:
//! [`SandboxSpec::no_network_admin`]); for a moved task it installs
//! [`harden::task_filter_bytes`] itself: see docs/SECURITY.md.
//!
//! # Limits
//!
//! `chroot` (not `pivot_root`) confines the file-system view; a task that
//! runs as uid 0 keeps its capabilities and could leave it. Tasks of
//! ordinary users cannot.

pub mod harden;
mod init;
pub mod program;
mod spawn;
mod status;
pub mod terminal;
mod zygote;

use serde::{Deserialize, Serialize};
use std::io;
use std::path::PathBuf;

pub use harden::HardenError;
pub use program::TaskProgram;
pub use spawn::{kill_sandbox, spawn, spawn_program, Sandboxed};
pub use terminal::{TerminalError, TerminalLine};
pub use starling_proto::ExitStatus;

/// Entry point of `starling __sandbox-init`, the zygote ([`zygote`]); never
/// returns. Call it first thing in `main`, before any thread exists.
pub fn init_main() -> ! {
    zygote::zygote_main()
}

/// Descriptor numbers the outer init finds its inputs at: the spec the agent
/// writes and the status pipe it reads, put in place by the zygote.
pub(crate) const SPEC_FD: std::os::fd::RawFd = 3;
pub(crate) const STATUS_FD: std::os::fd::RawFd = 4;

/// Signals relayed from the agent to the outer init, to PID 1, to the task.
const RELAYED: [nix::sys::signal::Signal; 9] = {
    use nix::sys::signal::Signal;
    [
        Signal::SIGHUP,
        Signal::SIGINT,
        Signal::SIGQUIT,
        Signal::SIGTERM,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
        Signal::SIGALRM,
        Signal::SIGWINCH,
        Signal::SIGCONT,
    ]
};

/// Whether [`Sandboxed::signal`] can deliver `signo` to the task.
pub(crate) fn is_relayed(signo: i32) -> bool {
    RELAYED.iter().any(|&s| s as i32 == signo)
}

/// The hidden subcommand the agent's binary must route to [`init_main`].
pub use starling_config::roles::SANDBOX_INIT as INIT_SUBCOMMAND;

/// Status of a sandbox that could not be set up (mount, chroot, chdir,
/// credentials...), as env(1) does for its own failures.
pub const EXIT_SETUP_FAILED: i32 = 125;
/// Status when the command was found but could not be executed.
pub const EXIT_NOT_EXECUTABLE: i32 = 126;
/// Status when the command was not found.
pub const EXIT_NOT_FOUND: i32 = 127;

/// Everything needed to start one task in a sandbox.
///
/// `Default` is a task of uid 0 with no environment in `/`, for tests and
/// tools that set the few fields they care about; the agent sets every field
/// from the task's authenticated spec and never starts from it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct SandboxSpec {
    /// Directory to chroot into, already populated (a view of the client's
    /// `/`). It must contain the mount points `proc` and `dev`.
    pub root: PathBuf,
    pub argv: Vec<Vec<u8>>,
    pub env: Vec<(Vec<u8>, Vec<u8>)>,
    /// Working directory, a path inside `root`.
    pub cwd: Vec<u8>,
    pub umask: u32,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
    /// (resource, soft, hard) as in getrlimit(2).
    pub rlimits: Vec<(u32, u64, u64)>,
    /// Host name inside the sandbox (gets its own UTS namespace), or the host's.
    pub hostname: Option<String>,
    /// Started by an agent without root, inside its user namespace where only
    /// its own ids exist (as 0) and setgroups is denied: the task keeps those
    /// ids (`uid`, `gid` and `groups` are ignored) and /dev/pts has no tty group.
    #[serde(default)]
    pub rootless: bool,
    /// Where the agent puts the sandbox before it runs anything (its guest
    /// cgroup, CPU and OOM priority); applied by [`spawn`] in the child.
    #[serde(skip)]
    pub placement: Placement,
    /// What the program gives up before it starts.
    #[serde(default)]
    pub confinement: Confinement,
    /// Run the task on a new pty of this size and modes, its controlling
    /// terminal; the sandbox's stdin must then be the other end of a
    /// [`TerminalLine`], which receives the pty's master (see [`terminal`]).
    #[serde(default)]
    pub terminal: Option<starling_proto::TerminalSize>,
    /// Give up `CAP_NET_ADMIN` and `CAP_NET_RAW` (bounding set included, so
    /// nothing it starts gets them back), whatever the uid: a clone of a
    /// ticket with its own network, whose rules live in the host's network
    /// namespace that the clone shares ([`harden::drop_network_admin`]).
    #[serde(default)]
    pub no_network_admin: bool,
}

/// What the sandbox's first process does to itself before exec, so that it
/// and everything it starts are placed from their first instruction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// `cgroup.procs` files to write itself into (`0`).
    pub cgroup_procs: Vec<PathBuf>,
    /// Switch to `SCHED_IDLE`.
    pub sched_idle: bool,
    /// Set its `oom_score_adj` (-1000..=1000).
    pub oom_score_adj: Option<i32>,
}

/// How much of the host's privilege a task's program keeps.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Confinement {
    /// An ordinary program (`exec`, `run`, `batch`): `no_new_privs`, the
    /// seccomp filter, and no capabilities unless its uid is 0.
    #[default]
    Task,
    /// The restorer of a remote-fork clone or of a moved task: it starts as
    /// root with its capabilities (nested PID namespace, `set_tid`,
    /// userfaultfd) and drops to the restored process's credentials itself.
    /// Not filtered here: a moved `exec` task gets the filter back from the
    /// restorer itself, as it resumes ([`harden::task_filter_bytes`] in its plan).
    Restorer,
}

impl SandboxSpec {
    /// Rejects what could never be executed: empty argv, NUL bytes where C
    /// strings are needed, malformed environment entries, a bad umask.
    pub fn validate(&self) -> io::Result<()> {
        let invalid = |what: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, what.to_string()));
        if self.argv.is_empty() {
            return invalid("empty argv");
        }
        if self.argv.iter().any(|a| a.contains(&0)) {
            return invalid("argv contains NUL");
        }
        if self.env.iter().any(|(k, v)| k.is_empty() || k.contains(&0) || k.contains(&b'=') || v.contains(&0)) {
            return invalid("malformed environment entry");
        }
        if self.cwd.contains(&0) {
            return invalid("cwd contains NUL");
        }
        if self.umask > 0o777 {
            return invalid("umask out of range");
        }
        if let Some(h) = &self.hostname {
            if h.is_empty() || h.len() > 64 || h.contains('\0') {
                return invalid("host name must be 1 to 64 bytes without NUL");
            }
        }
        Ok(())
    }

    /// The value of `name` in the task's environment: the first entry, which
    /// is what getenv(3) in the task would return.
    pub fn env_var(&self, name: &[u8]) -> Option<&[u8]> {
        self.env.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_slice())
    }
}
