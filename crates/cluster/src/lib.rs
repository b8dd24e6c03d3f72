//! `starling-cluster`: an emulated cluster on one machine, for developing and testing starling without racks.
//!
//! `starling up --hosts N` calls [`up`]: it makes a bridge (`stbr0`, 10.213.0.1/24) in the root network
//! namespace, and per host `hI` a network namespace `starling-hI` whose `eth0` (10.213.0.(10+I)) is a veth
//! into the bridge. The head (the relay clients talk to) runs in the root namespace listening on the bridge's
//! address. Each host is a `starling __host-boot` process started inside its namespace; [`host_boot_main`]
//! gives it its own mount and UTS namespaces and root file system (an overlay of `/` with a private upper
//! layer, its own /tmp, /run and hostname) and then execs `starling agent`. `starling down` calls [`down`],
//! which removes all of it — also after a crash, a `kill -9` of any part, or a lost `cluster.json` — because it
//! finds its things by name, namespace and command line rather than trusting a record.
//!
//! # Running an agent on a real host
//!
//! The emulation only supplies what a real machine already has (its own address, hostname and root). On a
//! real cluster host run, as root:
//!
//! ```text
//! starling agent --head HEAD_IP:7077 --name $(hostname) --state /var/lib/starling/state
//! ```
//!
//! where `HEAD_IP:7077` is where `starling head --listen IP:7077 --state DIR` listens, and the state directory
//! is on a local ext4 (or similar) file system — not overlayfs or NFS — because the agent keeps FUSE
//! passthrough backing files and per-task overlay upper directories there. Nothing from this crate is needed.
//!
//! # Layout
//!
//! - `RUN/cluster.json` ([`ClusterState`]) and `RUN/logs/{head,h1,...}.log` describe the running cluster.
//! - `STATE/head` is the head's state; `STATE/hosts/hI/state` is host `hI`'s persistent cache, which survives
//!   `down`/`up`; `STATE/hosts/hI/{layer,root}` are mount points used only inside the host's mount namespace.

mod boot;
pub mod mounts;
mod net;
pub mod procs;
pub mod slurm;
mod sys;

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sys::Doing;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

pub use boot::{host_boot_main, BootError, HOST_STATE_MOUNT};
pub use sys::SysError;
pub use net::{
    netns_path, HostLink, NetConfig, NetError, DEFAULT_BRIDGE, DEFAULT_NETNS_PREFIX, DEFAULT_SUBNET, DEFAULT_VETH_PREFIX, HEAD_PORT,
    MAX_HOSTS,
};

pub use starling_config::instance::{CLUSTER_FILE, RUN_DIR as DEFAULT_RUN_DIR, STATE_DIR as DEFAULT_STATE_DIR};
pub use starling_config::{ClusterDirs, ClusterState, HostRecord, Instance, LinkRecord};

pub use starling_config::roles::CLUSTER_ROLES;
use starling_config::roles;
/// Where the emulated WAN link (`starling up --link`) listens for clients
/// (instance N listens on LINK_PORT + N).
pub const LINK_PORT: u16 = 7079;

/// One embedded cluster of this machine: its [`Instance`]'s directories,
/// and the names, subnet and link port that instance uses.
#[derive(Clone, Debug)]
pub struct LocalCluster {
    pub instance: Instance,
    pub run_dir: PathBuf,
    pub state_dir: PathBuf,
    pub net: NetConfig,
    pub link_port: u16,
}

impl LocalCluster {
    /// Instance `instance`'s cluster, its files in `dirs` (root's or a user's own: [`ClusterDirs`]).
    pub fn new(instance: Instance, dirs: ClusterDirs) -> LocalCluster {
        let n = instance.number();
        let net = if n == 0 {
            NetConfig::default()
        } else {
            let [a, b, _, _] = DEFAULT_SUBNET.octets();
            NetConfig {
                bridge: format!("stbr{n}"),
                netns_prefix: format!("starling{n}-"),
                veth_prefix: format!("stv{n}-"),
                subnet: std::net::Ipv4Addr::new(a, b, n, 0),
            }
        };
        LocalCluster {
            instance,
            run_dir: dirs.run,
            state_dir: dirs.state,
            net,
            link_port: LINK_PORT + u16::from(n),
        }
    }

    /// Options for this instance's cluster of `hosts` hosts: its directories, no extra arguments.
    pub fn options(&self, hosts: usize, exe: PathBuf) -> UpOptions {
        UpOptions { state_dir: self.state_dir.clone(), run_dir: self.run_dir.clone(), ..UpOptions::new(hosts, exe) }
    }

    /// Start this instance's cluster (`opts` from [`LocalCluster::options`]).
    pub fn up(&self, opts: &UpOptions) -> Result<ClusterState> {
        up_with(opts, &UpOverrides { net: self.net.clone(), host_command: None, link_port: self.link_port })
    }

    pub fn down(&self) -> Result<Removed> {
        down_with(&self.run_dir, &self.state_dir, &self.net)
    }

    pub fn load_state(&self) -> Option<ClusterState> {
        load_state(&self.run_dir)
    }

    /// Start the home site of this cluster (`exec --roam`): an agent on this machine, in its
    /// root network namespace, named [`HOME_SITE`], registered with the head as home
    /// (`agent --home`: nothing is placed there unless a launch or a move names it). It lives
    /// until `down` (which finds it by its head address and state directory); returns its pid.
    /// Its tasks get the same file view and sandbox as on any host, so they can move both ways.
    pub fn start_home(&self) -> Result<u32> {
        let state = self.load_state().ok_or(ClusterError::NotRunning)?;
        if state.slurm.is_some() {
            return Err(ClusterError::HomeOnSlurm);
        }
        // Straight to the head, as the hosts reach it (not through the emulated WAN link).
        let head = state.link.as_ref().map_or(state.head_addr.clone(), |l| l.head_direct.clone());
        let dir = host_dir(&state.state_dir, HOME_SITE).join("state");
        std::fs::create_dir_all(&dir).doing(|| format!("mkdir {}", dir.display()))?;
        let mut cmd = Command::new(&state.exe);
        cmd.arg(roles::AGENT)
            .arg("--home")
            .arg("--head")
            .arg(&head)
            .arg("--name")
            .arg(HOME_SITE)
            .arg("--state")
            .arg(&dir)
            .arg("--cache-mib")
            .arg(state.cache_mib_per_host.to_string())
            .arg("--cgroup")
            .arg(format!("{}{HOME_SITE}", state.netns_prefix));
        if let Some(a) = &state.auth {
            cmd.arg("--auth").arg(a);
        }
        spawn_detached(cmd, &log_path(&self.run_dir, HOME_SITE), None)
    }
}

/// The name the home site (the user's own machine, `exec --roam`) has in `status`, `ps` and
/// `migrate --to`.
pub const HOME_SITE: &str = "home";

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("--hosts must be between 1 and {MAX_HOSTS}, not {0}")]
    Hosts(usize),
    #[error("the cluster's credentials: {0}")]
    Auth(#[from] starling_auth::AuthError),
    #[error("the hosts' credentials: {0}")]
    Ident(#[from] starling_auth::IdentError),
    #[error(transparent)]
    Net(#[from] NetError),
    #[error(transparent)]
    Sys(#[from] SysError),
    #[error("a cluster is already running (head pid {pid} at {addr}, {hosts} hosts); run `starling down` first")]
    AlreadyRunning { pid: u32, addr: String, hosts: usize },
    #[error("leftovers of an earlier cluster exist ({}); run `starling down` first", .0.join(", "))]
    Leftovers(Vec<String>),
    #[error("another `starling up` or `down` is in progress ({} is locked)", .0.display())]
    Busy(PathBuf),
    #[error("{} belongs to uid {owner}, not to you (uid {me}): a cluster's run directory must be its owner's; remove it or set XDG_RUNTIME_DIR", path.display())]
    NotOurs { path: PathBuf, owner: u32, me: u32 },
    #[error("the head (pid {pid}) exited before listening on {addr}:\n{log}")]
    HeadExited { pid: u32, addr: SocketAddr, log: String },
    #[error("the head (pid {pid}) is not listening on {addr} after {START_TIMEOUT:?}:\n{log}")]
    HeadNotListening { pid: u32, addr: SocketAddr, log: String },
    #[error("host {host} (pid {pid}) did not boot: {why}")]
    HostDidNotBoot { host: String, pid: u32, why: BootFailure },
    #[error("the head died while the hosts booted:\n{0}")]
    HeadDied(String),
    #[error(transparent)]
    Record(#[from] starling_config::ConfigError),
    #[error(transparent)]
    Slurm(#[from] slurm::SlurmError),
    #[error("no embedded cluster is running here (start one with `starling up`)")]
    NotRunning,
    #[error("a Slurm cluster has no home site here: `exec --roam` needs an embedded cluster (`starling up`)")]
    HomeOnSlurm,
    #[error("teardown incomplete: {}\n(removed: {})", problems.join("; "), removed.join("; "))]
    Teardown { problems: Vec<String>, removed: Vec<String> },
}

/// Why a host did not boot (with the end of its log).
#[derive(Debug)]
pub enum BootFailure {
    Exited(String),
    TimedOut(String),
}

impl std::fmt::Display for BootFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BootFailure::Exited(log) => write!(f, "it exited:\n{log}"),
            BootFailure::TimedOut(log) => write!(f, "not booted after {START_TIMEOUT:?}:\n{log}"),
        }
    }
}

pub type Result<T, E = ClusterError> = std::result::Result<T, E>;

/// How long `up` waits for the head to listen and for each host to finish booting.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long `down` waits for killed processes to disappear, per round.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

pub struct UpOptions {
    pub hosts: usize,
    /// The starling binary.
    pub exe: PathBuf,
    pub state_dir: PathBuf,
    pub run_dir: PathBuf,
    /// Extra arguments appended to `exe head ...`.
    pub head_args: Vec<String>,
    /// Extra arguments appended to each host's `exe agent ...` (e.g. `--policy LL`).
    pub agent_args: Vec<String>,
    /// WAN link profile between clients and the head (`starling_link::Profile::parse`
    /// syntax). `None` or `lan`: clients talk to the head directly.
    pub link: Option<String>,
    /// For measurements only (`up --insecure`): no credentials, no local socket; every connection
    /// is plain TCP and the head believes every spec's uid, as before authentication existed.
    pub insecure: bool,
    /// Shape each host's link to this rate (`starling up --host-link`).
    pub host_link: Option<HostLink>,
    /// MTU of the bridge and every host's link (`starling up --mtu`): at the default, 9000, a
    /// 4 KiB page and its header travel as one multicast datagram.
    pub mtu: u32,
}

impl UpOptions {
    /// Default directories, no extra head arguments.
    pub fn new(hosts: usize, exe: PathBuf) -> UpOptions {
        UpOptions {
            hosts,
            exe,
            state_dir: DEFAULT_STATE_DIR.into(),
            run_dir: DEFAULT_RUN_DIR.into(),
            head_args: Vec::new(),
            agent_args: Vec::new(),
            link: None,
            insecure: false,
            host_link: None,
            mtu: DEFAULT_MTU,
        }
    }
}

/// The embedded cluster's default link MTU (jumbo frames: a page per datagram).
pub const DEFAULT_MTU: u32 = 9000;

/// What [`up_with`] can change beyond [`UpOptions`]; the default is what [`up`] does.
#[derive(Clone, Debug)]
pub struct UpOverrides {
    /// Names and subnet; tests use their own so they never touch a real cluster (pass the same to
    /// [`down_with`]; `down` also reads them from `cluster.json`).
    pub net: NetConfig,
    /// Run this in each host instead of `exe agent ...` (e.g. `["sleep", "infinity"]` in tests).
    pub host_command: Option<Vec<String>>,
    /// Loopback port of the emulated WAN link, if any.
    pub link_port: u16,
}

impl Default for UpOverrides {
    fn default() -> Self {
        UpOverrides { net: NetConfig::default(), host_command: None, link_port: LINK_PORT }
    }
}

fn cluster_file(run_dir: &Path) -> PathBuf {
    run_dir.join(CLUSTER_FILE)
}

/// `STATE/hosts/NAME`.
pub fn host_dir(state_dir: &Path, host: &str) -> PathBuf {
    state_dir.join("hosts").join(host)
}

/// The log of process `name` (`head`, `h1`...).
pub fn log_path(run_dir: &Path, name: &str) -> PathBuf {
    run_dir.join("logs").join(format!("{name}.log"))
}

fn read_state_file(run_dir: &Path) -> Option<ClusterState> {
    ClusterState::read(&cluster_file(run_dir)).unwrap_or_else(|e| {
        log::warn!("ignoring {e}");
        None
    })
}

/// The running cluster, or `None` if there is none (no file, an unreadable one, or one whose head is dead).
pub fn load_state(run_dir: &Path) -> Option<ClusterState> {
    let state = read_state_file(run_dir)?;
    let head_alive =
        procs::is_alive(state.head_pid) && procs::cmdline(state.head_pid).get(1).is_some_and(|role| role == roles::HEAD);
    head_alive.then_some(state)
}

/// Create bridge, namespaces and veths, start the head (`exe head --listen BRIDGE_IP:7077 --state STATE/head
/// HEAD_ARGS...`) and one `exe __host-boot` per host inside its namespace, all detached (own session, output to
/// `RUN/logs/NAME.log`); wait until the head accepts connections and every host has exec'd its agent; write
/// `RUN/cluster.json`. Refuses if a cluster (or the leftovers of one) exists. On failure, tears down what it made.
pub fn up(opts: &UpOptions) -> Result<ClusterState> {
    up_with(opts, &UpOverrides::default())
}

/// [`up`] with other names/subnet or another program in place of the agent.
pub fn up_with(opts: &UpOptions, overrides: &UpOverrides) -> Result<ClusterState> {
    let net = &overrides.net;
    if opts.hosts == 0 || opts.hosts > MAX_HOSTS {
        return Err(ClusterError::Hosts(opts.hosts));
    }
    net.validate(opts.hosts)?;
    let exe = std::fs::canonicalize(&opts.exe).doing(|| format!("starling binary {}", opts.exe.display()))?;
    let state_dir = absolute(&opts.state_dir)?;
    let run_dir = absolute(&opts.run_dir)?;
    let _lock = lock_run_dir(&run_dir, false)?;
    if let Some(running) = load_state(&run_dir) {
        let hosts = running.slurm.as_ref().map_or(running.hosts.len(), |s| s.nodes.len());
        return Err(ClusterError::AlreadyRunning { pid: running.head_pid, addr: running.head_addr, hosts });
    }
    let leftovers: Vec<String> = net::list_netns(&net.netns_prefix)
        .into_iter()
        .chain(net::link_exists(&net.bridge).then(|| net.bridge.clone()))
        .collect();
    if !leftovers.is_empty() {
        return Err(ClusterError::Leftovers(leftovers));
    }

    match start(opts, overrides, &exe, &state_dir, &run_dir) {
        Ok(state) => Ok(state),
        Err(e) => {
            if let Err(cleanup) = teardown(&run_dir, &state_dir, net) {
                log::warn!("cleaning up after a failed up: {cleanup:#}");
            }
            Err(e)
        }
    }
}

/// Serialises `up` and `down` on one run dir: without it, a second `up` failing on the first one's bridge would
/// tear the first one down while it is still starting. `up` refuses to wait; `down` waits for a running `up`
/// (which is bounded by its start timeouts).
fn lock_run_dir(run_dir: &Path, wait: bool) -> Result<Flock<File>> {
    std::fs::create_dir_all(run_dir).doing(|| format!("mkdir {}", run_dir.display()))?;
    // A user's run dir may sit in a shared place (`/tmp/starling-UID-run` without HOME): never use
    // one that someone else made first.
    let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(run_dir).doing(|| format!("stat {}", run_dir.display()))?);
    let me = nix::unistd::geteuid().as_raw();
    if owner != me {
        return Err(ClusterError::NotOurs { path: run_dir.to_path_buf(), owner, me });
    }
    let path = run_dir.join(".lock");
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .doing(|| format!("open {}", path.display()))?;
    let how = if wait { FlockArg::LockExclusive } else { FlockArg::LockExclusiveNonblock };
    Flock::lock(file, how).map_err(|(_, errno)| match errno {
        Errno::EWOULDBLOCK => ClusterError::Busy(path.clone()),
        other => SysError { what: format!("locking {}", path.display()), source: other.into() }.into(),
    })
}

fn absolute(p: &Path) -> Result<PathBuf> {
    if p.is_absolute() {
        Ok(p.to_path_buf())
    } else {
        Ok(std::env::current_dir().doing(|| "cannot determine the current directory".into())?.join(p))
    }
}

fn start(
    opts: &UpOptions,
    overrides: &UpOverrides,
    exe: &Path,
    state_dir: &Path,
    run_dir: &Path,
) -> Result<ClusterState> {
    let cfg = &overrides.net;
    std::fs::create_dir_all(run_dir.join("logs")).doing(|| format!("mkdir {}", run_dir.display()))?;
    std::fs::create_dir_all(state_dir.join("head")).doing(|| format!("mkdir {}", state_dir.display()))?;

    net::create_bridge(cfg, opts.mtu)?;
    for i in 1..=opts.hosts {
        net::create_host_netns(cfg, i, opts.mtu)?;
        if let Some(l) = &opts.host_link {
            net::shape_host(cfg, i, l)?;
        }
    }

    let cache_mib = cache_mib_per_host(state_dir, opts.hosts);
    let head_addr = SocketAddr::from((cfg.bridge_ip(), HEAD_PORT));
    // A new CA and certificates for every `up`: every TCP connection of the cluster is mutual TLS;
    // local users reach the head through its Unix socket, which names them.
    let auth_dir = run_dir.join(AUTH_DIR);
    match std::fs::remove_dir_all(&auth_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(SysError { what: format!("removing {}", auth_dir.display()), source: e }.into()),
    }
    let auth = (!opts.insecure).then(|| starling_auth::AuthDir::new(&auth_dir));
    if let Some(a) = &auth {
        a.init()?;
    }
    let head_socket = run_dir.join(HEAD_SOCKET);
    let mut head = Command::new(exe);
    head.arg(roles::HEAD).arg("--listen").arg(head_addr.to_string()).arg("--state").arg(state_dir.join("head"));
    if auth.is_some() {
        head.arg("--auth").arg(&auth_dir).arg("--socket").arg(&head_socket);
    }
    if !opts.head_args.iter().any(|a| a.starts_with("--cache-mib")) {
        head.arg("--cache-mib").arg(cache_mib.to_string());
    }
    head.args(&opts.head_args);
    let head_pid = spawn_detached(head, &log_path(run_dir, "head"), None)?;
    wait_listening(head_addr, head_pid, &log_path(run_dir, "head"))?;

    let mut hosts = Vec::with_capacity(opts.hosts);
    for i in 1..=opts.hosts {
        let name = NetConfig::host_name(i);
        let netns = cfg.netns_name(&name);
        let hdir = host_dir(state_dir, &name);
        std::fs::create_dir_all(hdir.join("state")).doing(|| format!("mkdir {}", hdir.display()))?;
        // The host's /run is its own: its agent's credentials go into its state directory.
        let mut agent_args = Vec::new();
        if let Some(a) = &auth {
            give_agent_credentials(a, &name, &hdir.join("state").join(AUTH_DIR))?;
            // One argument (`--auth=PATH`): a path argument under /var/lib/starling would make an
            // older `starling down` of the default instance take the agent for one of its own.
            agent_args = vec![format!("--auth={}/{AUTH_DIR}", boot::HOST_STATE_MOUNT)];
        }
        agent_args.extend(opts.agent_args.iter().cloned());
        let boot_args = boot::BootArgs {
            name: name.clone(),
            head: head_addr.to_string(),
            host_dir: hdir,
            cache_mib,
            cgroup: netns.clone(),
            agent_args,
            exec: overrides.host_command.clone().unwrap_or_default(),
        };
        let mut cmd = Command::new(exe);
        cmd.arg(roles::HOST_BOOT).args(boot_args.to_args());
        let ns_file = File::open(netns_path(&netns)).doing(|| format!("open netns {netns}"))?;
        let boot_pid = spawn_detached(cmd, &log_path(run_dir, &name), Some(&ns_file))?;
        hosts.push(HostRecord { name, netns, ip: cfg.host_ip(i).to_string(), boot_pid });
    }
    for h in &hosts {
        wait_booted(h.boot_pid, &log_path(run_dir, &h.name))
            .map_err(|why| ClusterError::HostDidNotBoot { host: h.name.clone(), pid: h.boot_pid, why })?;
    }
    if !procs::is_alive(head_pid) {
        return Err(ClusterError::HeadDied(log_tail(&log_path(run_dir, "head"))));
    }

    // The emulated WAN link: clients reach the head only through it.
    let mut client_addr = head_addr.to_string();
    let mut client_socket = head_socket.clone();
    let mut link = None;
    if let Some(profile) = opts.link.as_deref().filter(|p| *p != "lan") {
        let listen = SocketAddr::from(([127, 0, 0, 1], overrides.link_port));
        let stats_file = run_dir.join("link.json");
        let mut relay = Command::new(exe);
        relay
            .arg(roles::LINK)
            .arg("--listen")
            .arg(listen.to_string())
            .arg("--target")
            .arg(head_addr.to_string())
            .arg("--profile")
            .arg(profile)
            .arg("--stats")
            .arg(&stats_file);
        if auth.is_some() {
            relay.arg("--auth").arg(&auth_dir).arg("--socket").arg(run_dir.join(LINK_SOCKET));
        }
        let pid = spawn_detached(relay, &log_path(run_dir, "link"), None)?;
        wait_listening(listen, pid, &log_path(run_dir, "link"))?;
        client_addr = listen.to_string();
        client_socket = run_dir.join(LINK_SOCKET);
        link = Some(LinkRecord { profile: profile.to_string(), pid, head_direct: head_addr.to_string(), stats_file });
    }

    let state = ClusterState {
        head_addr: client_addr,
        head_pid,
        bridge: cfg.bridge.clone(),
        subnet: cfg.subnet_cidr(),
        netns_prefix: cfg.netns_prefix.clone(),
        veth_prefix: cfg.veth_prefix.clone(),
        netns_ids: hosts.iter().filter_map(|h| net::ns_id(&netns_path(&h.netns))).collect(),
        exe: exe.to_path_buf(),
        state_dir: state_dir.to_path_buf(),
        cache_mib_per_host: cache_mib,
        relay_cache: !opts.head_args.iter().any(|a| a == "--no-relay-cache"),
        link,
        hosts,
        started_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX)),
        slurm: None,
        socket: auth.is_some().then_some(client_socket),
        auth: auth.is_some().then_some(auth_dir),
        host_link_bits: opts.host_link.map(|l| l.bits_per_sec),
    };
    state.write(&cluster_file(run_dir))?;
    Ok(state)
}

/// The cluster's credentials under the run directory (0700).
pub const AUTH_DIR: &str = "auth";
/// The head's socket for local clients, under the run directory.
pub const HEAD_SOCKET: &str = "head.sock";
/// The link relay's socket for local clients (`up --link`), under the run directory.
pub const LINK_SOCKET: &str = "link.sock";

/// Give host `name`'s agent a key and a certificate issued to it (and the CA's certificate) in
/// `dir` (made afresh, 0700): the head then lets that certificate register as `name` only.
fn give_agent_credentials(auth: &starling_auth::AuthDir, name: &str, dir: &Path) -> Result<()> {
    let _ = std::fs::remove_dir_all(dir);
    auth.issue_host_credentials(name, dir)?;
    Ok(())
}

/// Start `cmd` in its own session (so a terminal hang-up or Ctrl-C of `starling up` does not reach it), with
/// stdin from /dev/null and stdout/stderr to `log`, optionally inside the network namespace `netns`.
fn spawn_detached(mut cmd: Command, log: &Path, netns: Option<&File>) -> Result<u32> {
    let out = File::create(log).doing(|| format!("create {}", log.display()))?;
    cmd.stdin(Stdio::null()).stdout(out.try_clone().doing(|| format!("dup {}", log.display()))?).stderr(out).current_dir("/");
    let ns_fd = netns.map(|f| f.as_raw_fd());
    // SAFETY: the closure runs in the forked child before exec and only makes two raw system calls (setns,
    // setsid), both async-signal-safe; it allocates nothing and touches no lock. `ns_fd` stays open in the
    // parent until `spawn` returns (the caller holds the File), so it is valid in the child.
    unsafe {
        cmd.pre_exec(move || {
            if let Some(fd) = ns_fd {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().doing(|| format!("start {cmd:?}"))?;
    let pid = child.id();
    // Reap it whenever it exits, so a long-lived caller (a test, a daemon) does not collect zombies; when the
    // caller exits first, init adopts it.
    std::thread::spawn(move || child.wait());
    Ok(pid)
}

/// The end of a log, for error messages.
fn log_tail(log: &Path) -> String {
    const TAIL: u64 = 4000;
    let Ok(mut f) = File::open(log) else { return format!("(no log at {})", log.display()) };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(TAIL)));
    let mut bytes = Vec::new();
    let _ = f.take(TAIL).read_to_end(&mut bytes);
    // Lossy: the cut may split a UTF-8 sequence, and a program may write binary junk.
    format!("--- {} ---\n{}", log.display(), String::from_utf8_lossy(&bytes).trim_end())
}

fn wait_listening(addr: SocketAddr, pid: u32, log: &Path) -> Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if !procs::is_alive(pid) {
            return Err(ClusterError::HeadExited { pid, addr, log: log_tail(log) });
        }
        if Instant::now() > deadline {
            return Err(ClusterError::HeadNotListening { pid, addr, log: log_tail(log) });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A host has booted once its boot process has pivoted into its own root (the root differs from ours) and
/// exec'd the agent (argv[1] is no longer `__host-boot`).
fn wait_booted(pid: u32, log: &Path) -> Result<(), BootFailure> {
    let our_root = std::fs::metadata("/").map_err(|e| BootFailure::Exited(format!("stat /: {e}")))?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let root = std::fs::metadata(format!("/proc/{pid}/root/"));
        let pivoted = root.is_ok_and(|r| (r.dev(), r.ino()) != (our_root.dev(), our_root.ino()));
        let exec_done = procs::cmdline(pid).get(1).map(String::as_str) != Some(roles::HOST_BOOT);
        if !procs::is_alive(pid) {
            return Err(BootFailure::Exited(log_tail(log)));
        }
        if pivoted && exec_done {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(BootFailure::TimedOut(log_tail(log)));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The FUSE connections of the starling views mounted in the mount namespaces of `pids` other than ours (a
/// host's; a process in ours would name views that may belong to anyone).
fn fuse_views_of(pids: &BTreeSet<u32>) -> BTreeSet<u64> {
    let mnt_ns = |pid: &str| std::fs::metadata(format!("/proc/{pid}/ns/mnt")).map(|m| m.ino()).ok();
    let ours = mnt_ns("self");
    let mut namespaces = BTreeSet::new();
    let mut views = BTreeSet::new();
    for pid in pids {
        let Some(ns) = mnt_ns(&pid.to_string()) else { continue };
        if Some(ns) == ours || !namespaces.insert(ns) {
            continue;
        }
        views.extend(mounts::view_connections(&std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default()));
    }
    views
}

/// Tear down the default-named cluster: see [`down_with`].
pub fn down(run_dir: &Path, state_dir: &Path) -> Result<Removed> {
    down_with(run_dir, state_dir, &NetConfig::default())
}

/// Tear everything down, from any partial or crashed state, and return what was removed (empty if nothing was
/// there). In order: SIGKILL every process in our network namespaces, the head and boot pids of
/// `cluster.json` (if they still run starling), every starling `agent`/`__host-boot`/`head`/`__sandbox-init`
/// whose command line names `state_dir` or the head's address, and all their descendants, then wait for them;
/// detach mounts below `STATE/hosts` and `RUN`; delete the namespaces, veths and bridge; remove
/// `cluster.json`. The persistent host caches (`STATE/hosts/*/state`) stay. Names come from `cfg` and, if
/// different, from `cluster.json`. Fails (after doing all it can) if something could not be removed.
pub fn down_with(run_dir: &Path, state_dir: &Path, cfg: &NetConfig) -> Result<Removed> {
    let run_dir = absolute(run_dir)?;
    let _lock = lock_run_dir(&run_dir, true)?;
    teardown(&run_dir, &absolute(state_dir)?, cfg)
}

/// `down_with` without the lock (`up` already holds it when it cleans up after itself).
fn teardown(run_dir: &Path, state_dir: &Path, cfg: &NetConfig) -> Result<Removed> {
    let (state_dir, run_dir) = (state_dir.to_path_buf(), run_dir.to_path_buf());
    let record = read_state_file(&run_dir);
    let mut cfgs = vec![cfg.clone()];
    if let Some(r) = &record {
        let mut recorded = cfg.clone();
        recorded.bridge = r.bridge.clone();
        recorded.netns_prefix = r.netns_prefix.clone();
        recorded.veth_prefix = r.veth_prefix.clone();
        if let Some(ip) = r.subnet.split('/').next().and_then(|s| s.parse().ok()) {
            recorded.subnet = ip;
        }
        // A corrupted record must not make us delete foreign links: same rules as for `up`. A Slurm
        // cluster's record names no links at all.
        if r.slurm.is_none() && recorded != *cfg && recorded.validate(1).is_ok() {
            cfgs.push(recorded);
        }
    }

    let mut removed = Removed::default();
    let mut problems = Vec::new();

    // 0. A Slurm cluster's job (or step): Slurm ends the agents on the nodes.
    if let Some(s) = record.as_ref().and_then(|r| r.slurm.as_ref()) {
        let (done, failed) = slurm::stop(s);
        removed.0.extend(done);
        problems.extend(failed);
    }

    // 1. Processes. Repeat because a dying agent's children may just have forked.
    let recorded_ns: BTreeSet<(u64, u64)> = record.iter().flat_map(|r| r.netns_ids.iter().copied()).collect();
    let recorded_pids: BTreeSet<u32> =
        record.iter().flat_map(|r| std::iter::once(r.head_pid).chain(r.hosts.iter().map(|h| h.boot_pid))).collect();
    let head_addr_prefixes: Vec<String> = cfgs.iter().map(|c| format!("{}:", c.bridge_ip())).collect();
    for round in 0..10 {
        let our_ns: BTreeSet<(u64, u64)> =
            cfgs.iter().flat_map(|c| net::netns_ids(&c.netns_prefix)).chain(recorded_ns.iter().copied()).collect();
        let table = procs::scan();
        let ours: BTreeSet<u32> = table
            .iter()
            .filter(|p| {
                let in_our_netns = p.netns.is_some_and(|id| our_ns.contains(&id));
                let starling_role = p.role().is_some_and(|r| CLUSTER_ROLES.contains(&r));
                // Every agent's `--state` is HOST_STATE_MOUNT (and its `--auth` under it) whatever its
                // cluster: that names no cluster.
                let names_us = p.argv.iter().any(|a| {
                    (!Path::new(a).starts_with(HOST_STATE_MOUNT) && Path::new(a).starts_with(&state_dir))
                        || head_addr_prefixes.iter().any(|h| a.starts_with(h))
                });
                in_our_netns || (starling_role && (names_us || recorded_pids.contains(&p.pid)))
            })
            .map(|p| p.pid)
            .collect();
        let targets = procs::with_descendants(&table, &ours);
        if targets.is_empty() {
            break;
        }
        // The file views of the hosts' tasks go with their agents: aborted first, so that no process waits
        // in one (a waiting FUSE request can hold it in uninterruptible sleep, past SIGKILL).
        for n in fuse_views_of(&targets) {
            if mounts::abort_fuse_connection(n) {
                removed.0.push(Object::FuseConnection(n));
            }
        }
        for p in table.iter().filter(|p| targets.contains(&p.pid)) {
            removed.0.push(Object::Process { pid: p.pid, argv: p.argv.clone() });
        }
        let left = procs::kill_and_wait(&targets, KILL_TIMEOUT);
        if round == 9 && !left.is_empty() {
            problems.push(format!("processes still alive after SIGKILL: {left:?}"));
        }
    }

    // 2. Mounts left in our namespace (normally none: hosts mount in their own).
    for m in mounts::detach_under(&[state_dir.join("hosts"), run_dir.clone()]) {
        removed.0.push(Object::Mount(m));
    }
    let still_mounted: Vec<PathBuf> = mounts::mounts_under(&[state_dir.join("hosts"), run_dir.clone()]);
    if !still_mounted.is_empty() {
        problems.push(format!("still mounted: {still_mounted:?}"));
    }

    // 3. Network: namespaces (which also destroys the veth ends inside them), our veths, the bridge.
    for c in &cfgs {
        for ns in net::list_netns(&c.netns_prefix) {
            match net::ip(&["netns", "del", &ns]) {
                Ok(()) => removed.0.push(Object::Netns(ns)),
                Err(e) => problems.push(format!("{e:#}")),
            }
        }
        for veth in net::list_links(&c.veth_prefix) {
            match net::ip(&["link", "del", &veth]) {
                Ok(()) => removed.0.push(Object::Veth(veth)),
                // Deleting a namespace removes its veth pairs asynchronously: gone is what we wanted.
                Err(_) if !net::link_exists(&veth) => removed.0.push(Object::Veth(veth)),
                Err(e) => problems.push(format!("{e:#}")),
            }
        }
        if net::link_exists(&c.bridge) {
            match net::ip(&["link", "del", &c.bridge]) {
                Ok(()) => removed.0.push(Object::Bridge(c.bridge.clone())),
                Err(e) => problems.push(format!("{e:#}")),
            }
        }
    }

    // 4. The hosts' cgroups (`starling/NETNS/{guest,owner}` in each v1 hierarchy), whatever is left of them.
    let hierarchies = starling_linger::Hierarchies::discover();
    for c in &cfgs {
        for name in starling_linger::cgroup::names_with_prefix(&hierarchies, &c.netns_prefix) {
            let rel = Path::new(starling_linger::cgroup::ROOT).join(&name);
            match starling_linger::cgroup::remove_tree(&hierarchies, &rel, KILL_TIMEOUT) {
                Ok(dirs) if !dirs.is_empty() => removed.0.push(Object::Cgroup(rel)),
                Ok(_) => {}
                Err(e) => problems.push(format!("cgroup {}: {e}", rel.display())),
            }
        }
    }

    // 5. The cluster's credentials and sockets (a new `up` makes new ones), then the record.
    for sock in [HEAD_SOCKET, LINK_SOCKET] {
        let _ = std::fs::remove_file(run_dir.join(sock));
    }
    let auth = run_dir.join(AUTH_DIR);
    if auth.exists() {
        if let Err(e) = std::fs::remove_dir_all(&auth) {
            problems.push(format!("cannot remove {}: {e}", auth.display()));
        }
    }
    let file = cluster_file(&run_dir);
    if file.exists() {
        match std::fs::remove_file(&file) {
            Ok(()) => removed.0.push(Object::Record(file)),
            Err(e) => problems.push(format!("cannot remove {}: {e}", file.display())),
        }
    }

    if problems.is_empty() {
        Ok(removed)
    } else {
        Err(ClusterError::Teardown { problems, removed: removed.iter().collect() })
    }
}

/// One thing `down` removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Object {
    Process { pid: u32, argv: Vec<String> },
    Mount(PathBuf),
    /// A FUSE connection of a host's file view (its number under `/sys/fs/fuse/connections`).
    FuseConnection(u64),
    Netns(String),
    Veth(String),
    Bridge(String),
    /// A host's cgroup tree (relative to each v1 hierarchy).
    Cgroup(PathBuf),
    /// `cluster.json`.
    Record(PathBuf),
    /// A Slurm job `starling up --slurm` submitted, cancelled and ended.
    SlurmJob(String),
    /// The agents' step in an existing allocation, stopped through its `srun`.
    SlurmStep { job: String, srun_pid: u32 },
}

impl std::fmt::Display for Object {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Object::Process { pid, argv } => write!(f, "killed pid {pid} ({})", argv.join(" ")),
            Object::Mount(m) => write!(f, "unmounted {}", m.display()),
            Object::FuseConnection(n) => write!(f, "aborted FUSE connection {n}"),
            Object::Netns(n) => write!(f, "deleted netns {n}"),
            Object::Veth(v) => write!(f, "deleted veth {v}"),
            Object::Bridge(b) => write!(f, "deleted bridge {b}"),
            Object::Cgroup(c) => write!(f, "removed cgroup {}", c.display()),
            Object::Record(r) => write!(f, "removed {}", r.display()),
            Object::SlurmJob(j) => write!(f, "cancelled Slurm job {j}"),
            Object::SlurmStep { job, srun_pid } => write!(f, "stopped the agents' step of Slurm job {job} (srun pid {srun_pid})"),
        }
    }
}

/// Everything `down` removed, in order.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Removed(pub Vec<Object>);

impl Removed {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// One line per object (`starling down -v`).
    pub fn iter(&self) -> impl Iterator<Item = String> + '_ {
        self.0.iter().map(Object::to_string)
    }

    /// One line for all of it: `removed cluster: 4 hosts, head, link, bridge stbr0 (31 objects)`.
    pub fn summary(&self) -> String {
        let role = |r: &str| {
            self.0.iter().filter(|o| matches!(o, Object::Process { argv, .. } if argv.get(1).map(String::as_str) == Some(r))).count()
        };
        let netns = self.0.iter().filter(|o| matches!(o, Object::Netns(_))).count();
        let hosts = netns.max(role(roles::AGENT) + role(roles::HOST_BOOT));
        let mut parts = Vec::new();
        if hosts > 0 {
            parts.push(format!("{hosts} host{}", if hosts == 1 { "" } else { "s" }));
        }
        if role(roles::HEAD) > 0 {
            parts.push("head".to_string());
        }
        if role(roles::LINK) > 0 {
            parts.push("link".to_string());
        }
        for o in &self.0 {
            match o {
                Object::Bridge(b) => parts.push(format!("bridge {b}")),
                Object::SlurmJob(j) => parts.push(format!("Slurm job {j} cancelled")),
                Object::SlurmStep { job, .. } => parts.push(format!("agents' step of Slurm job {job}")),
                _ => {}
            }
        }
        if parts.is_empty() {
            parts.push("leftovers".to_string());
        }
        let n = self.0.len();
        format!("removed cluster: {} ({n} object{})", parts.join(", "), if n == 1 { "" } else { "s" })
    }
}

/// Largest content cache an agent keeps by default (`agent --cache-mib`).
const DEFAULT_CACHE_MIB: u64 = 8192;
/// Smallest bound worth running with.
const MIN_CACHE_MIB: u64 = 256;

/// The content-cache bound of each emulated host (and of the head's relay
/// cache): they all share this machine's disk, so together they may fill at
/// most half of what is free under `state_dir` now, and each at most an
/// agent's default. A benchmark on 16 hosts with 8 GiB each would otherwise
/// fill the disk, and a full disk shows up much later as I/O errors inside
/// tasks.
fn cache_mib_per_host(state_dir: &Path, hosts: usize) -> u64 {
    match nix::sys::statvfs::statvfs(state_dir) {
        Ok(s) => cache_share(s.blocks_available().saturating_mul(s.fragment_size()) >> 20, hosts),
        Err(_) => DEFAULT_CACHE_MIB,
    }
}

/// Half of `free_mib` split over `hosts` agents and the head, within bounds.
fn cache_share(free_mib: u64, hosts: usize) -> u64 {
    (free_mib / (2 * (hosts as u64 + 1))).clamp(MIN_CACHE_MIB, DEFAULT_CACHE_MIB)
}

#[cfg(test)]
mod cache_bound_tests {
    use super::*;

    #[test]
    fn caches_share_half_the_free_disk_within_bounds() {
        // 49 GiB free, 16 hosts + head: 1475 MiB each, 25 GiB in all.
        assert_eq!(cache_share(49 << 10, 16), (49 << 10) / 34);
        assert!(cache_share(49 << 10, 16) * 17 <= (49 << 10) / 2);
        // A big disk: never more than an agent's default.
        assert_eq!(cache_share(10 << 20, 4), DEFAULT_CACHE_MIB);
        // A nearly full disk: the minimum (the agent's LRU keeps it there).
        assert_eq!(cache_share(100, 4), MIN_CACHE_MIB);
    }
}

#[cfg(test)]
mod removed_tests {
    use super::*;

    fn process(pid: u32, args: &[&str]) -> Object {
        Object::Process { pid, argv: args.iter().map(|a| a.to_string()).collect() }
    }

    #[test]
    fn down_sums_up_what_it_removed_in_one_line() {
        let mut r = Removed::default();
        r.0.push(process(10, &["/s", "head", "--listen", "10.213.0.1:7077"]));
        r.0.push(process(11, &["/s", "__link", "--listen", "127.0.0.1:7079"]));
        for h in ["h1", "h2"] {
            r.0.push(process(12, &["/s", "agent", "--name", h]));
            r.0.push(Object::Netns(format!("starling-{h}")));
            r.0.push(Object::Veth(format!("stv-{h}")));
        }
        r.0.push(Object::Bridge("stbr0".into()));
        r.0.push(Object::Record("/run/starling/cluster.json".into()));
        assert_eq!(r.summary(), "removed cluster: 2 hosts, head, link, bridge stbr0 (10 objects)");
        assert_eq!(r.iter().count(), 10);
        assert!(r.iter().any(|l| l == "deleted bridge stbr0"));
        let leftover = Removed(vec![Object::Mount("/run/starling/x".into())]);
        assert_eq!(leftover.summary(), "removed cluster: leftovers (1 object)");
    }
}
