//! `starling-config`: one typed configuration for every starling program,
//! read at the edges and passed down.
//!
//! Only the edges — the `starling` CLI, the C ABI (`libstarling`) and the
//! Python module — build a [`Config`]: from the defaults, then the config
//! file (`--config FILE`, else `$STARLING_CONFIG`, else
//! `/etc/starling/config.toml` if it exists), then the environment
//! (`STARLING_*`), then (the CLI) its flags. Libraries take the typed
//! sections they need ([`ClientSettings`], [`ForkSettings`],
//! [`HeadSettings`], [`AgentSettings`]) and read no environment variable.
//! This crate itself reads nothing from the process either: the edge hands
//! it the environment as a function ([`Sources::env`]).
//!
//! [`SETTINGS`] is the one table of every setting (key, variable, flag,
//! default, meaning); the README's table is generated from it
//! ([`markdown_table`]) and a test keeps the two equal.
//!
//! The file has a section per role, so one file serves a whole host:
//!
//! ```toml
//! log = "info"
//! [client]
//! cluster = "10.0.0.1:7077"
//! [fork]
//! mcdist = "push"
//! [head]
//! listen = "10.0.0.1:7077"
//! state = "/srv/starling/head"
//! [agent]
//! head = "10.0.0.1:7077"
//! cache_mib = 32768
//! ```
//!
//! Besides the configuration this crate holds the two other things every
//! side needs to agree on about a machine: which embedded cluster a command
//! means ([`instance`]) and that cluster's record ([`record`]).

pub mod instance;
pub mod record;
pub mod roles;

pub use instance::{ClusterDirs, DirOwner, Instance};
pub use record::{ClusterState, HostRecord, LinkRecord, SlurmRecord};

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The port a head listens on by default (`head.listen`).
pub const HEAD_PORT: u16 = 7077;

/// The config file read when neither `--config` nor `STARLING_CONFIG` names one (if it exists).
pub const DEFAULT_FILE: &str = "/etc/starling/config.toml";
/// The variable naming another config file.
pub const CONFIG_ENV: &str = "STARLING_CONFIG";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, #[source] source: std::io::Error },
    #[error("{} is unreadable ({source}); run `starling down` then `starling up`", path.display())]
    Record { path: PathBuf, #[source] source: serde_json::Error },
    #[error("{}: {source}", path.display())]
    Toml { path: PathBuf, #[source] source: Box<toml::de::Error> },
    #[error("{}: unknown setting {key:?} (the README lists every setting)", path.display())]
    UnknownKey { path: PathBuf, key: String },
    #[error("{origin}: {value:?} is not {expected}")]
    BadValue { origin: String, value: String, expected: &'static str },
    #[error("the embedded cluster instance (STARLING_INSTANCE, embedded.instance) must be a number from 0 to 9, not {0:?}")]
    Instance(String),
}

/// Everything configurable, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// `env_logger` filter (`info`, `debug`, `starling_head=debug`...);
    /// `None`: warnings for commands, info for the head and agents.
    pub log: Option<String>,
    /// Which embedded cluster (`starling up`) commands mean.
    pub instance: Instance,
    /// Whose: root's system directories, or the user's own (from the effective uid).
    pub owner: DirOwner,
    pub client: ClientSettings,
    pub fork: ForkSettings,
    pub head: HeadSettings,
    pub agent: AgentSettings,
}

/// The client side: `starling exec/run/batch/status`, libstarling and the
/// Python module (their connection to the head).
#[derive(Clone, Debug, PartialEq)]
pub struct ClientSettings {
    /// The head's address; `None`: the embedded cluster's record.
    pub cluster: Option<String>,
    /// Recipe cache, prethrow profiles, job bindings, shadow index.
    pub cache_dir: PathBuf,
    /// zstd on chunk transfers and on frames over the link.
    pub compress: bool,
    /// Send the program's predicted file bindings with the launch.
    pub prethrow: bool,
    /// Push content the head lacks in the launch's flight.
    pub push: bool,
    pub chunking: Chunking,
    /// Append one JSON line of client-side counters per launch here.
    pub stats_file: Option<PathBuf>,
    /// The client certificate's directory, for a head named by `cluster` (mutual TLS).
    pub auth: Option<PathBuf>,
}

/// How files are cut into chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chunking {
    /// FastCDC: an edit changes only the chunks around it.
    ContentDefined,
    /// Fixed blocks of the largest chunk size (for measuring what CDC saves).
    Fixed,
}

/// Remote fork, on the client (libstarling, Python) and on the hosts (the
/// agent's fault handlers); the local backend uses both halves.
#[derive(Clone, Debug, PartialEq)]
pub struct ForkSettings {
    pub backend: Backend,
    /// `None`: multicast on, except for a one-clone ticket (nobody to share with).
    pub mcdist: Option<Multicast>,
    /// Fetch-avoidance heuristics (zero and file pages not fetched).
    pub heuristics: bool,
    /// Where the page server listens; `None`: the address the hosts reach
    /// this machine at (127.0.0.1 for the local backend).
    pub page_server_bind: Option<SocketAddr>,
    /// Pages fetched per fault: the faulting one and following `Fetch` pages.
    pub prefetch: usize,
    /// How long a host's fault handler busy-polls for the page server's
    /// reply before it sleeps in `read` (µs; 0: it sleeps at once).
    pub reply_spin_us: u32,
    /// Encrypt fork and migration traffic (page server, multicast pages,
    /// migration stream); a side that sets it gets it whatever its peer's.
    pub encrypt: bool,
    /// A ticket's clones reach only each other, their parent and loopback
    /// (the parent's side: it asks for it in its ticket request and each
    /// clone's launch); `On` where the host can enforce it, `Required` or
    /// no ticket.
    pub isolate_network: starling_proto::NetworkIsolation,
}

/// Where a ticket's clones run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// On the hosts of the starling cluster.
    Cluster,
    /// On this machine (the restore-correctness suite).
    Local,
}

/// Multicast page distribution (`starling-mcdist`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Multicast {
    /// Unicast TCP from the page server.
    Off,
    /// Pages go once to the ticket's multicast group.
    On,
    /// Multicast, and each requested page also pushes its neighbours.
    Push,
}

/// `starling head`.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadSettings {
    pub listen: String,
    /// Agents to dial (started with `starling agent --listen`).
    pub agents: Vec<String>,
    /// Facts shown by `starling status`.
    pub facts: Vec<(String, String)>,
    /// Persistent state (the relay cache).
    pub state: PathBuf,
    /// Relay cache bound.
    pub cache_mib: u64,
    /// Serve content-named requests from a shared cache (off only for measurements).
    pub relay_cache: bool,
    /// Where to serve Prometheus `/metrics` (`IP:PORT`); `None`: not served.
    pub metrics: Option<String>,
    /// The cluster's credentials (`starling_auth::AuthDir`): with them every
    /// TCP connection is mutual TLS; `None`: TCP is unauthenticated.
    pub auth: Option<PathBuf>,
    /// The Unix socket local clients use (the kernel names their uid).
    pub socket: Option<PathBuf>,
    /// Whether tasks may run as root (a root client's, or a certified one's).
    pub root_tasks: bool,
    /// Hosts a holder of a chunk is referred to at most (`FindChunks`); 0:
    /// the head sends every chunk itself.
    pub peer_referrals: u32,
}

/// `starling agent`.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentSettings {
    /// The head to connect to, or
    pub head: Option<String>,
    /// where to listen for the head to connect.
    pub listen: Option<String>,
    /// Host name in `starling status`; `None`: the machine's hostname.
    pub name: Option<String>,
    /// Content cache and task dirs (a local disk file system, not overlayfs).
    pub state: PathBuf,
    /// Content cache bound.
    pub cache_mib: u64,
    /// How output files are chunked.
    pub chunking: Chunking,
    /// The agent's cgroups are `starling/CGROUP/{guest,owner}` in each v1
    /// hierarchy; `None`: the agent's name.
    pub cgroup: Option<String>,
    /// Who the host's owner is (whose CPU the monitor counts).
    pub owner: OwnerKind,
    /// Free memory (MemAvailable, MiB) below which guests are capped at what they use.
    pub low_water_mib: u64,
    /// Free memory (MiB) above which the cap is lifted.
    pub high_water_mib: u64,
    /// Guests' disk reads and writes (bytes/s per disk) while the owner does disk or network I/O; 0: no limit.
    pub guest_disk_bps: u64,
    /// Guests' network sends (bytes/s per interface) while the owner does disk or network I/O; 0: no limit.
    pub guest_net_bps: u64,
    /// What happens to this host's guests when its owner becomes active.
    pub policy: GuestPolicy,
    /// PM: how long guests stay suspended before they are moved (seconds).
    pub pm_pause_s: u64,
    /// The cluster's credentials (`ca.pem`, `agent.pem`, `agent.key`): the
    /// head connection is mutual TLS; `None`: plain TCP.
    pub auth: Option<PathBuf>,
    /// Share chunks with the other hosts (serve what this host holds, fetch
    /// what the head refers it to); off: every chunk comes from the head.
    pub peers: bool,
    /// The port other hosts fetch chunks from; 0: any free port (announced to the head).
    pub peer_port: u16,
    /// Seconds a peer that owes this host chunks may send nothing before it
    /// is dropped and the chunks are fetched from the head.
    pub peer_stall_s: u64,
}

/// The Linger-Longer policy of a host's guests (a wire type: tasks carry their own).
pub use starling_proto::GuestPolicy;

/// Whose CPU a host's owner monitor counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerKind {
    /// A real host: everything on the machine that is not a guest; keyboard from terminal access times.
    Machine,
    /// An emulated host: what runs in the host's owner cgroup (`starling owner HOST -- CMD`);
    /// keyboard set by `starling owner HOST --active|--idle`.
    Emulated,
}

impl Default for ForkSettings {
    fn default() -> Self {
        ForkSettings { backend: Backend::Cluster, mcdist: None, heuristics: true, page_server_bind: None, prefetch: 16, reply_spin_us: 0, encrypt: true, isolate_network: starling_proto::NetworkIsolation::On }
    }
}

impl Default for HeadSettings {
    fn default() -> Self {
        HeadSettings {
            listen: format!("0.0.0.0:{HEAD_PORT}"),
            agents: Vec::new(),
            facts: Vec::new(),
            state: "/var/lib/starling/head".into(),
            cache_mib: 8192,
            relay_cache: true,
            metrics: None,
            auth: None,
            socket: None,
            root_tasks: true,
            peer_referrals: 3,
        }
    }
}

impl Default for AgentSettings {
    fn default() -> Self {
        AgentSettings {
            head: None,
            listen: None,
            name: None,
            state: "/var/lib/starling/state".into(),
            cache_mib: 8192,
            chunking: Chunking::ContentDefined,
            cgroup: None,
            owner: OwnerKind::Machine,
            low_water_mib: 1024,
            high_water_mib: 2048,
            guest_disk_bps: 0,
            guest_net_bps: 0,
            policy: GuestPolicy::LingerForever,
            pm_pause_s: 600,
            auth: None,
            peers: true,
            peer_port: 0,
            peer_stall_s: 5,
        }
    }
}

impl ClientSettings {
    /// The defaults; the cache directory follows the XDG rules (`env` as in [`Sources`]).
    pub fn defaults(env: &dyn Fn(&str) -> Option<OsString>) -> ClientSettings {
        let base = env("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| env("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| "/tmp".into());
        ClientSettings {
            cluster: None,
            cache_dir: base.join("starling"),
            compress: true,
            prethrow: true,
            push: true,
            chunking: Chunking::ContentDefined,
            stats_file: None,
            auth: None,
        }
    }
}

/// Where a configuration comes from.
pub struct Sources<'a> {
    /// `--config FILE` (it must exist); `None`: `$STARLING_CONFIG`, else
    /// [`DEFAULT_FILE`] if it exists.
    pub file: Option<&'a Path>,
    /// The process environment; the edges pass `|k| std::env::var_os(k)`.
    pub env: &'a dyn Fn(&str) -> Option<OsString>,
    /// The process's effective uid: an ordinary user's clusters live in their own directories.
    pub euid: u32,
}

impl Config {
    /// Where this command's embedded cluster keeps its files ([`Config::instance`] of [`Config::owner`]).
    pub fn dirs(&self) -> ClusterDirs {
        ClusterDirs::new(self.instance, &self.owner)
    }

    /// Defaults, then the file, then the environment.
    pub fn load(src: &Sources) -> Result<Config, ConfigError> {
        let mut cfg = Config {
            log: None,
            instance: Instance::default(),
            owner: DirOwner::of(src.euid, src.env),
            client: ClientSettings::defaults(src.env),
            fork: ForkSettings::default(),
            head: HeadSettings::default(),
            agent: AgentSettings::default(),
        };
        let named = src.file.map(Path::to_path_buf).or_else(|| (src.env)(CONFIG_ENV).filter(|v| !v.is_empty()).map(PathBuf::from));
        let file = match named {
            Some(path) => Some(path),
            None => Some(PathBuf::from(DEFAULT_FILE)).filter(|p| p.exists()),
        };
        if let Some(path) = file {
            let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Io { path: path.clone(), source })?;
            cfg.apply_file(&path, &text)?;
        }
        for s in SETTINGS {
            let Some(var) = s.env else { continue };
            let Some(value) = (src.env)(var).filter(|v| !v.is_empty()) else { continue };
            let value = value.to_string_lossy().into_owned();
            (s.apply)(&mut cfg, Raw::Text(&value)).map_err(|expected| ConfigError::BadValue {
                origin: var.to_string(),
                value: value.clone(),
                expected,
            })?;
        }
        Ok(cfg)
    }

    /// Apply a config file's text (`path` names it in errors).
    pub fn apply_file(&mut self, path: &Path, text: &str) -> Result<(), ConfigError> {
        let table: toml::Table =
            text.parse().map_err(|e| ConfigError::Toml { path: path.into(), source: Box::new(e) })?;
        let mut entries = Vec::new();
        for (k, v) in &table {
            match v {
                toml::Value::Table(section) => {
                    for (k2, v2) in section {
                        entries.push((format!("{k}.{k2}"), v2));
                    }
                }
                _ => entries.push((k.clone(), v)),
            }
        }
        for (key, value) in entries {
            let s = SETTINGS
                .iter()
                .find(|s| s.key == key)
                .ok_or_else(|| ConfigError::UnknownKey { path: path.into(), key: key.clone() })?;
            (s.apply)(self, Raw::Toml(value)).map_err(|expected| ConfigError::BadValue {
                origin: format!("{}: {key}", path.display()),
                value: shown(value),
                expected,
            })?;
        }
        Ok(())
    }
}

/// A file's value as an error message shows it.
fn shown(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        other => format!("{other:?}"),
    }
}

/// Parse an on/off switch: `on|off|true|false|yes|no|1|0` (any case).
/// Every switch of starling is parsed by this one function.
pub fn parse_switch(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" | "1" => Some(true),
        "off" | "false" | "no" | "0" => Some(false),
        _ => None,
    }
}

/// A value as it came: text (environment, flag) or a TOML value (file).
enum Raw<'a> {
    Text(&'a str),
    Toml(&'a toml::Value),
}

const SWITCH: &str = "on or off";
const TEXT: &str = "a string";
const NUMBER: &str = "a whole number";

impl Raw<'_> {
    fn text(&self) -> Result<String, &'static str> {
        match self {
            Raw::Text(t) => Ok(t.trim().to_string()),
            Raw::Toml(toml::Value::String(s)) => Ok(s.clone()),
            Raw::Toml(_) => Err(TEXT),
        }
    }
    fn switch(&self) -> Result<bool, &'static str> {
        match self {
            Raw::Toml(toml::Value::Boolean(b)) => Ok(*b),
            other => parse_switch(&other.text().map_err(|_| SWITCH)?).ok_or(SWITCH),
        }
    }
    fn number(&self) -> Result<u64, &'static str> {
        match self {
            Raw::Toml(toml::Value::Integer(i)) => u64::try_from(*i).map_err(|_| NUMBER),
            other => other.text().map_err(|_| NUMBER)?.parse().map_err(|_| NUMBER),
        }
    }
    fn list(&self) -> Result<Vec<String>, &'static str> {
        const LIST: &str = "a list of strings (or comma-separated text)";
        match self {
            Raw::Text(t) => Ok(t.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()),
            Raw::Toml(toml::Value::Array(a)) => a.iter().map(|v| v.as_str().map(String::from).ok_or(LIST)).collect(),
            Raw::Toml(_) => Err(LIST),
        }
    }
    fn pairs(&self) -> Result<Vec<(String, String)>, &'static str> {
        const PAIRS: &str = "a table of strings (or KEY=VALUE,... text)";
        match self {
            Raw::Text(t) => t
                .split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|kv| kv.split_once('=').map(|(k, v)| (k.trim().into(), v.trim().into())).ok_or(PAIRS))
                .collect(),
            Raw::Toml(toml::Value::Table(t)) => {
                t.iter().map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())).ok_or(PAIRS)).collect()
            }
            Raw::Toml(_) => Err(PAIRS),
        }
    }
    fn chunking(&self) -> Result<Chunking, &'static str> {
        Ok(if self.switch()? { Chunking::ContentDefined } else { Chunking::Fixed })
    }
}

/// One setting: how it is named everywhere, and how it is applied.
pub struct Setting {
    /// In the config file: `section.key` (or a top-level `key`).
    pub key: &'static str,
    /// The environment variable, if any.
    pub env: Option<&'static str>,
    /// The command-line flag (and the commands that take it), if any.
    pub flag: &'static str,
    pub default: &'static str,
    pub meaning: &'static str,
    apply: fn(&mut Config, Raw<'_>) -> Result<(), &'static str>,
}

/// Every setting of starling.
pub static SETTINGS: &[Setting] = &[
    Setting {
        key: "log",
        env: Some("STARLING_LOG"),
        flag: "",
        default: "warn (head, agent: info)",
        meaning: "log filter (env_logger syntax: `debug`, `starling_head=debug`...)",
        apply: |c, v| {
            c.log = Some(v.text()?);
            Ok(())
        },
    },
    Setting {
        key: "embedded.instance",
        env: Some("STARLING_INSTANCE"),
        flag: "",
        default: "0",
        meaning: "which embedded cluster on this machine (`up`, `down`, `status`, discovery): 1–9 get their own run/state dirs, bridge, namespaces and subnet",
        apply: |c, v| {
            let n = match v {
                Raw::Toml(toml::Value::Integer(i)) => i.to_string(),
                other => other.text()?,
            };
            c.instance = Instance::parse(&n).map_err(|_| "a number from 0 to 9")?;
            Ok(())
        },
    },
    Setting {
        key: "client.cluster",
        env: Some("STARLING_CLUSTER"),
        flag: "--cluster (exec, run, batch, status)",
        default: "the embedded cluster's record",
        meaning: "the head's address `IP:PORT`",
        apply: |c, v| {
            c.client.cluster = Some(v.text()?);
            Ok(())
        },
    },
    Setting {
        key: "client.auth",
        env: Some("STARLING_AUTH"),
        flag: "",
        default: "none",
        meaning: "directory with the cluster's ca.pem, client.pem and client.key, for a head named by `client.cluster` (mutual TLS)",
        apply: |c, v| {
            c.client.auth = Some(v.text()?).filter(|t| !t.is_empty()).map(PathBuf::from);
            Ok(())
        },
    },
    Setting {
        key: "client.cache_dir",
        env: Some("STARLING_CACHE"),
        flag: "",
        default: "$XDG_CACHE_HOME/starling, ~/.cache/starling",
        meaning: "client-side caches: recipes, prethrow profiles, job bindings, what the head holds",
        apply: |c, v| {
            c.client.cache_dir = v.text()?.into();
            Ok(())
        },
    },
    Setting {
        key: "client.compress",
        env: None,
        flag: "--no-compress (exec, run, batch)",
        default: "on",
        meaning: "zstd on file contents and on frames over the link",
        apply: |c, v| {
            c.client.compress = v.switch()?;
            Ok(())
        },
    },
    Setting {
        key: "client.prethrow",
        env: None,
        flag: "--no-prethrow (exec, run, batch)",
        default: "on",
        meaning: "send the program's predicted file bindings with the launch",
        apply: |c, v| {
            c.client.prethrow = v.switch()?;
            Ok(())
        },
    },
    Setting {
        key: "client.push",
        env: Some("STARLING_PUSH"),
        flag: "",
        default: "on",
        meaning: "push content the head's relay cache lacks in the launch's flight",
        apply: |c, v| {
            c.client.push = v.switch()?;
            Ok(())
        },
    },
    Setting {
        key: "client.chunking",
        env: Some("STARLING_CHUNKING"),
        flag: "",
        default: "on",
        meaning: "content-defined chunking (off: fixed 4 MiB blocks, for measurements; its own recipe cache)",
        apply: |c, v| {
            c.client.chunking = v.chunking()?;
            Ok(())
        },
    },
    Setting {
        key: "client.stats_file",
        env: Some("STARLING_STATS_FILE"),
        flag: "",
        default: "none",
        meaning: "append one JSON line of client-side counters per launch (benchmarks); `starling exec` adds its stage times (`stages_ms`: setup, connect, prepare, launch, run_commit, learn) and the process CPU each took (`stages_cpu_ms`; setup's from the process's start), `since_main_ms`, when it ended (`ended_unix_ms`: with `since_main_ms`, when each launch of a build ran) and its own CPU (`cpu_user_ms`, `cpu_sys_ms`)",
        apply: |c, v| {
            c.client.stats_file = Some(v.text()?.into());
            Ok(())
        },
    },
    Setting {
        key: "fork.backend",
        env: Some("STARLING_FORK_BACKEND"),
        flag: "",
        default: "cluster",
        meaning: "where clones run: `cluster` (the cluster's hosts) or `local` (this machine)",
        apply: |c, v| {
            c.fork.backend = match v.text()?.as_str() {
                "cluster" => Backend::Cluster,
                "local" => Backend::Local,
                _ => return Err("cluster or local"),
            };
            Ok(())
        },
    },
    Setting {
        key: "fork.mcdist",
        env: Some("STARLING_MCDIST"),
        flag: "",
        default: "on (off for a one-clone ticket)",
        meaning: "page distribution: `off` (unicast TCP), `on` (multicast), `push` (multicast + neighbours); on hosts, `off` refuses multicast",
        apply: |c, v| {
            let t = v.text().or_else(|_| v.switch().map(|b| if b { "on" } else { "off" }.to_string()))?;
            c.fork.mcdist = Some(match (t.as_str(), parse_switch(&t)) {
                ("push", _) => Multicast::Push,
                (_, Some(true)) => Multicast::On,
                (_, Some(false)) => Multicast::Off,
                _ => return Err("off, on or push"),
            });
            Ok(())
        },
    },
    Setting {
        key: "fork.encrypt",
        env: Some("STARLING_FORK_ENCRYPT"),
        flag: "",
        default: "on",
        meaning: "encrypt remote-fork and migration traffic (page-server connections, multicast pages, the migration stream: AES-256-GCM under the ticket's or move's key); a connection is encrypted when either end asks, and a host that asks takes no multicast pages in clear (`docs/SECURITY.md`)",
        apply: |c, v| {
            c.fork.encrypt = v.switch()?;
            Ok(())
        },
    },
    Setting {
        key: "fork.isolate_network",
        env: Some("STARLING_FORK_ISOLATE_NETWORK"),
        flag: "",
        default: "on",
        meaning: "a ticket's clones reach only each other, their parent and loopback, never the head's or agents' ports (nftables on each host); `on`: where the host can enforce it (root, cgroup2, `nft`: `starling status` shows which cannot), else the clone runs with its host's network and a notice on stderr; `required`: only such hosts, else the ticket is refused naming the others; `off`: the hosts' whole network (the parent's setting, per job)",
        apply: |c, v| {
            use starling_proto::NetworkIsolation;
            let t = v.text().or_else(|_| v.switch().map(|b| if b { "on" } else { "off" }.to_string()))?;
            c.fork.isolate_network = match (t.as_str(), parse_switch(&t)) {
                ("required", _) => NetworkIsolation::Required,
                (_, Some(true)) => NetworkIsolation::On,
                (_, Some(false)) => NetworkIsolation::Off,
                _ => return Err("off, on or required"),
            };
            Ok(())
        },
    },
    Setting {
        key: "fork.heuristics",
        env: Some("STARLING_FORK_HEURISTICS"),
        flag: "",
        default: "on",
        meaning: "fetch-avoidance heuristics (off: every readable private page comes from the page server)",
        apply: |c, v| {
            c.fork.heuristics = v.switch()?;
            Ok(())
        },
    },
    Setting {
        key: "fork.page_server_bind",
        env: Some("STARLING_PAGE_SERVER_BIND"),
        flag: "",
        default: "the address the hosts reach this machine at",
        meaning: "where the parent's page server listens (`IP:PORT`)",
        apply: |c, v| {
            c.fork.page_server_bind = Some(v.text()?.parse().map_err(|_| "an IP:PORT address")?);
            Ok(())
        },
    },
    Setting {
        key: "fork.prefetch",
        env: Some("STARLING_FORK_PREFETCH"),
        flag: "",
        default: "16",
        meaning: "most pages fetched per fault (the faulting page and following unserved ones, when faults walk memory in order; else 1; 1..=1024), by the hosts' fault handlers",
        apply: |c, v| {
            c.fork.prefetch = usize::try_from(v.number()?).ok().filter(|n| (1..=1024).contains(n)).ok_or("a number from 1 to 1024")?;
            Ok(())
        },
    },
    Setting {
        key: "fork.reply_spin_us",
        env: Some("STARLING_FORK_REPLY_SPIN_US"),
        flag: "",
        default: "0",
        meaning: "how long (µs, 0..=1000) a host's fault handler busy-polls for the page server's reply before it sleeps: saves the handler's wake-up per fetch at the cost of a core while it waits (0: off)",
        apply: |c, v| {
            c.fork.reply_spin_us = u32::try_from(v.number()?).ok().filter(|n| *n <= 1000).ok_or("a number from 0 to 1000")?;
            Ok(())
        },
    },
    Setting {
        key: "head.listen",
        env: None,
        flag: "--listen (head)",
        default: "0.0.0.0:7077",
        meaning: "where the head listens for clients and agents",
        apply: |c, v| {
            c.head.listen = v.text()?;
            Ok(())
        },
    },
    Setting {
        key: "head.agents",
        env: None,
        flag: "--agent (head, repeatable)",
        default: "none",
        meaning: "agents to dial (started with `agent --listen`)",
        apply: |c, v| {
            c.head.agents = v.list()?;
            Ok(())
        },
    },
    Setting {
        key: "head.facts",
        env: None,
        flag: "--fact KEY=VALUE (head, repeatable)",
        default: "none",
        meaning: "facts shown by `starling status`",
        apply: |c, v| {
            c.head.facts = v.pairs()?;
            Ok(())
        },
    },
    Setting {
        key: "head.state",
        env: None,
        flag: "--state (head)",
        default: "/var/lib/starling/head",
        meaning: "the head's state directory (its relay cache persists there)",
        apply: |c, v| {
            c.head.state = v.text()?.into();
            Ok(())
        },
    },
    Setting {
        key: "head.cache_mib",
        env: None,
        flag: "--cache-mib (head)",
        default: "8192",
        meaning: "relay cache bound in MiB",
        apply: |c, v| {
            c.head.cache_mib = v.number()?;
            Ok(())
        },
    },
    Setting {
        key: "head.relay_cache",
        env: None,
        flag: "--no-relay-cache (head, up)",
        default: "on",
        meaning: "serve content-named requests from the head's shared cache (off: every one goes to the client)",
        apply: |c, v| {
            c.head.relay_cache = v.switch()?;
            Ok(())
        },
    },
    Setting {
        key: "head.metrics",
        env: None,
        flag: "--metrics (head, up)",
        default: "none (`up`: 127.0.0.1, a free port)",
        meaning: "IP:PORT where the head serves Prometheus `/metrics` (tasks by state, relay cache, clones, page faults, per-host cores and load) and the live dashboard (`/`, `/api/state`, `/api/events`)",
        apply: |c, v| {
            c.head.metrics = Some(v.text()?).filter(|t| !t.is_empty());
            Ok(())
        },
    },
    Setting {
        key: "head.auth",
        env: None,
        flag: "--auth (head)",
        default: "none (TCP unauthenticated)",
        meaning: "the cluster's credentials directory (`head --init --auth DIR` makes it): every TCP connection is then mutual TLS",
        apply: |c, v| {
            c.head.auth = Some(v.text()?).filter(|t| !t.is_empty()).map(PathBuf::from);
            Ok(())
        },
    },
    Setting {
        key: "head.socket",
        env: None,
        flag: "--socket (head)",
        default: "none",
        meaning: "Unix socket for local clients; their tasks run as the uid the kernel names",
        apply: |c, v| {
            c.head.socket = Some(v.text()?).filter(|t| !t.is_empty()).map(PathBuf::from);
            Ok(())
        },
    },
    Setting {
        key: "head.root_tasks",
        env: None,
        flag: "--no-root-tasks (head, up)",
        default: "on",
        meaning: "whether tasks may run as root (root's own, or a certified remote client's)",
        apply: |c, v| {
            c.head.root_tasks = v.switch()?;
            Ok(())
        },
    },
    Setting {
        key: "head.peer_referrals",
        env: Some("STARLING_PEER_REFERRALS"),
        flag: "--peer-referrals (head, up)",
        default: "3",
        meaning: "hosts the head refers to one holder of a chunk at most (host-to-host chunk sharing; each is then referred to in turn); 0: the head sends every chunk itself",
        apply: |c, v| {
            c.head.peer_referrals = u32::try_from(v.number()?).map_err(|_| NUMBER)?;
            Ok(())
        },
    },
    Setting {
        key: "agent.head",
        env: None,
        flag: "--head (agent)",
        default: "none",
        meaning: "the head an agent connects to",
        apply: |c, v| {
            c.agent.head = Some(v.text()?);
            Ok(())
        },
    },
    Setting {
        key: "agent.listen",
        env: None,
        flag: "--listen (agent)",
        default: "none",
        meaning: "instead, where an agent listens for the head (`head --agent`)",
        apply: |c, v| {
            c.agent.listen = Some(v.text()?);
            Ok(())
        },
    },
    Setting {
        key: "agent.name",
        env: None,
        flag: "--name (agent)",
        default: "the hostname",
        meaning: "host name in `starling status`",
        apply: |c, v| {
            c.agent.name = Some(v.text()?);
            Ok(())
        },
    },
    Setting {
        key: "agent.state",
        env: None,
        flag: "--state (agent)",
        default: "/var/lib/starling/state",
        meaning: "the agent's content cache and task dirs (a local disk, not overlayfs)",
        apply: |c, v| {
            c.agent.state = v.text()?.into();
            Ok(())
        },
    },
    Setting {
        key: "agent.cache_mib",
        env: None,
        flag: "--cache-mib (agent)",
        default: "8192",
        meaning: "content cache bound in MiB",
        apply: |c, v| {
            c.agent.cache_mib = v.number()?;
            Ok(())
        },
    },
    Setting {
        key: "agent.chunking",
        env: Some("STARLING_CHUNKING"),
        flag: "",
        default: "on",
        meaning: "content-defined chunking of the tasks' output files",
        apply: |c, v| {
            c.agent.chunking = v.chunking()?;
            Ok(())
        },
    },
    Setting {
        key: "agent.cgroup",
        env: None,
        flag: "--cgroup (agent)",
        default: "the agent's name",
        meaning: "the agent's cgroups are `starling/NAME/guest` (every task) and `starling/NAME/owner` in each cgroup v1 hierarchy (`up` passes the host's netns name)",
        apply: |c, v| {
            c.agent.cgroup = Some(v.text()?);
            Ok(())
        },
    },
    Setting {
        key: "agent.owner",
        env: None,
        flag: "--owner (agent)",
        default: "machine",
        meaning: "whose CPU the owner monitor counts: `machine` (all but the guests; keyboard from terminal access times) or `emulated` (the host's owner cgroup, `starling owner`)",
        apply: |c, v| {
            c.agent.owner = match v.text()?.as_str() {
                "machine" => OwnerKind::Machine,
                "emulated" => OwnerKind::Emulated,
                _ => return Err("machine or emulated"),
            };
            Ok(())
        },
    },
    Setting {
        key: "agent.policy",
        env: Some("STARLING_POLICY"),
        flag: "--policy (agent, up)",
        default: "LF",
        meaning: "what the host's guests do when its owner becomes active: `LF` (linger at starvation priority, never move), `LL` (linger, then move to an idle host after T_lingr = ((1−l)/(h−l))·T_migr) `PM` (suspend, move to an idle host if the owner is still active after `agent.pm_pause_s`) or `IE` (kill, rerun from the start on an idle host); a task's `exec/run/batch --policy` wins",
        apply: |c, v| {
            c.agent.policy = GuestPolicy::parse(&v.text()?)?;
            Ok(())
        },
    },
    Setting {
        key: "agent.pm_pause_s",
        env: Some("STARLING_PM_PAUSE_S"),
        flag: "",
        default: "600",
        meaning: "PM policy: seconds guests stay suspended while the owner is active before they are moved (Condor's 10 minutes)",
        apply: |c, v| {
            c.agent.pm_pause_s = v.number()?;
            Ok(())
        },
    },
    Setting {
        key: "agent.low_water_mib",
        env: Some("STARLING_LOW_WATER_MIB"),
        flag: "",
        default: "1024",
        meaning: "free memory (MemAvailable, MiB) below which the guests' memory is capped at what they use (below half of it they are frozen)",
        apply: |c, v| {
            c.agent.low_water_mib = v.number()?;
            Ok(())
        },
    },
    Setting {
        key: "agent.high_water_mib",
        env: Some("STARLING_HIGH_WATER_MIB"),
        flag: "",
        default: "2048",
        meaning: "free memory (MiB) above which the guests' cap and freeze are lifted",
        apply: |c, v| {
            c.agent.high_water_mib = v.number()?;
            Ok(())
        },
    },
    Setting {
        key: "agent.guest_disk_bps",
        env: Some("STARLING_GUEST_DISK_BPS"),
        flag: "",
        default: "0 (no limit)",
        meaning: "the guests' disk window: bytes/s each disk may read and write for guests while the owner does disk or network I/O (blkio throttle; lifted after 5 s of quiet owner I/O)",
        apply: |c, v| {
            c.agent.guest_disk_bps = v.number()?;
            Ok(())
        },
    },
    Setting {
        key: "agent.guest_net_bps",
        env: Some("STARLING_GUEST_NET_BPS"),
        flag: "",
        default: "0 (no limit)",
        meaning: "the guests' network window: bytes/s guests may send on each interface while the owner does disk or network I/O (nftables `socket cgroupv2` + an htb class; lifted after 5 s of quiet owner I/O)",
        apply: |c, v| {
            c.agent.guest_net_bps = v.number()?;
            Ok(())
        },
    },
    Setting {
        key: "agent.auth",
        env: None,
        flag: "--auth (agent)",
        default: "none (TCP unauthenticated)",
        meaning: "directory with the cluster's ca.pem, agent.pem and agent.key: the head connection is then mutual TLS",
        apply: |c, v| {
            c.agent.auth = Some(v.text()?).filter(|t| !t.is_empty()).map(PathBuf::from);
            Ok(())
        },
    },
    Setting {
        key: "agent.peers",
        env: Some("STARLING_PEERS"),
        flag: "--no-peers (agent, up)",
        default: "on",
        meaning: "share chunks with the other hosts: serve those this host holds on its peer port, fetch those the head refers it to (off: every chunk from the head; `starling status` shows each host's peer port or `off`)",
        apply: |c, v| {
            c.agent.peers = v.switch()?;
            Ok(())
        },
    },
    Setting {
        key: "agent.peer_port",
        env: Some("STARLING_PEER_PORT"),
        flag: "--peer-port (agent, up)",
        default: "0 (any free port)",
        meaning: "the TCP port other hosts fetch this host's chunks from (announced to the head; open it in firewalls between hosts)",
        apply: |c, v| {
            c.agent.peer_port = u16::try_from(v.number()?).map_err(|_| "a port number (0 to 65535)")?;
            Ok(())
        },
    },
    Setting {
        key: "agent.peer_stall_s",
        env: Some("STARLING_PEER_STALL_S"),
        flag: "",
        default: "5",
        meaning: "seconds a peer that owes this host chunks may send nothing before it is dropped (and shunned for a minute) and the chunks come from the head (1 or more)",
        apply: |c, v| {
            c.agent.peer_stall_s = v.number().ok().filter(|n| *n >= 1).ok_or("a whole number of seconds, 1 or more")?;
            Ok(())
        },
    },
];

/// The README's table of settings.
pub fn markdown_table() -> String {
    let mut out = String::from("| setting (config file) | environment | flag | default | meaning |\n|---|---|---|---|---|\n");
    let or_dash = |s: &str| if s.is_empty() { "–".to_string() } else { format!("`{s}`") };
    for s in SETTINGS {
        out.push_str(&format!(
            "| `{}` | {} | {} | {} | {} |\n",
            s.key,
            or_dash(s.env.unwrap_or("")),
            or_dash(s.flag),
            s.default,
            s.meaning
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// `vars` as the environment, `file` as the config file (none: an
    /// empty one, so /etc/starling/config.toml cannot decide the outcome).
    fn load(vars: &[(&str, &str)], file: Option<&str>) -> Result<Config, ConfigError> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let mut vars: HashMap<String, OsString> = vars.iter().map(|(k, v)| (k.to_string(), OsString::from(v))).collect();
        vars.entry(CONFIG_ENV.into()).or_insert_with(|| "/dev/null".into());
        let env = move |k: &str| vars.get(k).cloned();
        // Tests run in parallel: a directory of its own per call.
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("starling-config-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.toml");
        if let Some(text) = file {
            std::fs::write(&path, text).unwrap();
        }
        let cfg = Config::load(&Sources { file: file.map(|_| path.as_path()), env: &env, euid: 0 });
        let _ = std::fs::remove_dir_all(&dir);
        cfg
    }

    #[test]
    fn defaults_without_file_or_environment() {
        let c = load(&[("HOME", "/home/u")], None).unwrap();
        assert_eq!(c.client.cache_dir, PathBuf::from("/home/u/.cache/starling"));
        assert_eq!(c.fork, ForkSettings::default());
        assert_eq!(c.head.listen, "0.0.0.0:7077");
        assert_eq!(c.instance.number(), 0);
        assert!(c.client.push && c.client.compress);
    }

    #[test]
    fn environment_overrides_the_file() {
        let file = "log = \"debug\"\n[client]\ncluster = \"10.0.0.1:7077\"\npush = false\n[fork]\nmcdist = \"push\"\nprefetch = 4\n[head]\nfacts = { site = \"lab\" }\nagents = [\"a:1\", \"b:2\"]\n[agent]\ncache_mib = 100\nchunking = false\n";
        let c = load(&[("STARLING_CLUSTER", "10.0.0.2:7077"), ("STARLING_FORK_PREFETCH", "8")], Some(file)).unwrap();
        assert_eq!(c.client.cluster.as_deref(), Some("10.0.0.2:7077"));
        assert!(!c.client.push);
        assert_eq!(c.fork.mcdist, Some(Multicast::Push));
        assert_eq!(c.fork.prefetch, 8);
        assert_eq!(c.head.facts, vec![("site".to_string(), "lab".to_string())]);
        assert_eq!(c.head.agents, vec!["a:1".to_string(), "b:2".to_string()]);
        assert_eq!(c.agent.cache_mib, 100);
        assert_eq!(c.agent.chunking, Chunking::Fixed);
        assert_eq!(c.log.as_deref(), Some("debug"));
    }

    #[test]
    fn a_tickets_network_is_on_by_default_and_can_be_required_or_off() {
        use starling_proto::NetworkIsolation;
        assert_eq!(load(&[], None).unwrap().fork.isolate_network, NetworkIsolation::On);
        for (v, want) in [("required", NetworkIsolation::Required), ("on", NetworkIsolation::On), ("off", NetworkIsolation::Off), ("no", NetworkIsolation::Off)] {
            assert_eq!(load(&[("STARLING_FORK_ISOLATE_NETWORK", v)], None).unwrap().fork.isolate_network, want, "{v}");
        }
        assert!(load(&[("STARLING_FORK_ISOLATE_NETWORK", "sometimes")], None).is_err());
    }

    #[test]
    fn off_means_off_everywhere() {
        for off in ["off", "OFF", "0", "false", "no"] {
            let c = load(
                &[("STARLING_PUSH", off), ("STARLING_CHUNKING", off), ("STARLING_MCDIST", off), ("STARLING_FORK_HEURISTICS", off)],
                None,
            )
            .unwrap();
            assert!(!c.client.push && !c.fork.heuristics, "{off}");
            assert_eq!(c.client.chunking, Chunking::Fixed, "{off}");
            assert_eq!(c.agent.chunking, Chunking::Fixed, "{off}");
            assert_eq!(c.fork.mcdist, Some(Multicast::Off), "{off}");
        }
    }

    #[test]
    fn bad_values_and_unknown_keys_are_refused_with_their_origin() {
        let e = load(&[("STARLING_MCDIST", "sometimes")], None).unwrap_err().to_string();
        assert!(e.contains("STARLING_MCDIST") && e.contains("off, on or push"), "{e}");
        let e = load(&[("STARLING_INSTANCE", "12")], None).unwrap_err().to_string();
        assert!(e.contains("STARLING_INSTANCE") && e.contains("0 to 9"), "{e}");
        let e = load(&[("STARLING_FORK_BACKEND", "remote")], None).unwrap_err().to_string();
        assert!(e.contains("cluster or local"), "{e}");
        let e = load(&[], Some("[client]\nclutser = \"x\"\n")).unwrap_err().to_string();
        assert!(e.contains("client.clutser"), "{e}");
        let e = load(&[], Some("[head]\ncache_mib = \"big\"\n")).unwrap_err().to_string();
        assert!(e.contains("head.cache_mib") && e.contains("whole number"), "{e}");        let e = load(&[("STARLING_PEER_STALL_S", "0")], None).unwrap_err().to_string();
        assert!(e.contains("STARLING_PEER_STALL_S") && e.contains("1 or more"), "{e}");
        let e = load(&[], Some("[agent]\npeer_port = 70000\n")).unwrap_err().to_string();
        assert!(e.contains("agent.peer_port") && e.contains("port number"), "{e}");
    }

    #[test]
    fn peer_sharing_settings() {
        let c = load(&[], None).unwrap();
        assert!(c.agent.peers);
        assert_eq!((c.agent.peer_port, c.agent.peer_stall_s, c.head.peer_referrals), (0, 5, 3));
        let file = "[agent]\npeers = false\npeer_port = 7100\n[head]\npeer_referrals = 0\n";
        let c = load(&[("STARLING_PEER_STALL_S", "2")], Some(file)).unwrap();
        assert!(!c.agent.peers);
        assert_eq!((c.agent.peer_port, c.agent.peer_stall_s, c.head.peer_referrals), (7100, 2, 0));
        let c = load(&[("STARLING_PEERS", "off")], None).unwrap();
        assert!(!c.agent.peers);
    }

    #[test]
    fn every_key_is_named_once() {
        let mut keys: Vec<&str> = SETTINGS.iter().map(|s| s.key).collect();
        keys.sort_unstable();
        let n = keys.len();
        keys.dedup();
        assert_eq!(keys.len(), n);
    }

    #[test]
    fn the_readme_table_is_this_table() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
        assert!(
            readme.contains(&markdown_table()),
            "README.md's table of settings differs from starling_config::SETTINGS; paste this:\n{}",
            markdown_table()
        );
    }
}
