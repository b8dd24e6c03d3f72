//! `starling`: borrow a cluster's CPUs for a command's heavy phases.
//!
//! This is a thin layer: argument parsing and output formatting. The work is
//! done by the library crates (see docs/ARCHITECTURE.md).

mod owner;

use anyhow::{Context as _, Result};
use clap::{Args, Parser, Subcommand};
use starling_client::Context;
use starling_cluster::{LocalCluster, UpOptions};
use starling_config::{roles, Config, Sources};
use starling_proto::Msg;
use starling_session::discover::Target;
use std::ffi::OsString;
use std::path::PathBuf;

const ABOUT: &str = "Run ordinary Linux programs on a cluster's CPUs as if they ran here.";
const LONG_ABOUT: &str = "\
Run ordinary Linux programs on a cluster's CPUs as if they ran here.

`starling exec -- CMD` runs CMD on a cluster host that sees this machine's files, environment,
working directory and arguments; stdin/stdout/stderr stream live, and files the command creates or
changes are committed back here atomically when it exits.

Quick start (an embedded cluster of emulated hosts on this machine, needs root):
  starling up --hosts 4          # start 4 emulated hosts + the head
  starling status                # see them
  starling exec -- uname -n      # run something on one of them
  make -j8 CC='starling exec --job build gcc'
  starling run -n 8 -- CMD       # a job of 8 tasks (each gets STARLING_TASK=0..7)
  starling down                  # remove everything

  starling up --link coffee-shop # the same, behind an emulated slow link (160 ms RTT, ~1.4 Mbit/s)
  starling up --host-link 1gbit  # each emulated host behind its own 1 Gbit/s link
  starling up --slurm -N 4       # or: the hosts are 4 nodes of a Slurm job (agents as a job step)

Programs can also fork themselves onto the cluster: see include/starling.h (C) and `import starling`.

Configuration: flags, then STARLING_* variables, then the config file (--config FILE, else
$STARLING_CONFIG, else /etc/starling/config.toml), then defaults. STARLING_CLUSTER=IP:PORT selects
a cluster (like --cluster); STARLING_INSTANCE=1..9 selects another embedded cluster on this
machine; STARLING_LOG=info|debug turns on logging. The README lists every setting.";

#[derive(Parser)]
#[command(name = "starling", version, about = ABOUT, long_about = LONG_ABOUT)]
struct Cli {
    /// Read settings from this TOML file (sections [client], [fork], [head], [agent]) instead of
    /// $STARLING_CONFIG or /etc/starling/config.toml.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the embedded local cluster: N emulated hosts (each an agent in its own network,
    /// mount and UTS namespace with its own root) plus the head that clients talk to.
    ///
    /// With --slurm the hosts are the nodes of a Slurm allocation instead: the head starts here,
    /// one job is submitted (sbatch --nodes N --ntasks-per-node=1 --exclusive) whose step runs
    /// `srun --overlap --ntasks-per-node=1 starling agent --head HEAD --name NODE` on every node,
    /// and `up` returns once every node's agent has registered. Inside an allocation
    /// ($SLURM_JOB_ID set, e.g. under salloc) its nodes are used as a step of it instead of
    /// submitting a job. `starling status` shows the job and its nodes; `starling down` cancels it.
    ///
    /// Example: starling up --slurm -N 4 --partition batch --time 1:00:00
    Up(UpArgs),
    /// Stop the embedded cluster and remove everything it made (processes, mounts, namespaces,
    /// bridge). Safe after a crash or a kill -9 of any part. Host caches are kept for next time.
    Down {
        /// List every object removed, not just the summary.
        #[arg(short, long)]
        verbose: bool,
    },
    /// List the cluster's hosts (name, address, agent pid, cores, load, running tasks) and network.
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Cluster head address (default: the embedded cluster started by `starling up`).
        #[arg(long)]
        cluster: Option<String>,
    },
    /// Print the address of the head's live dashboard (a web page: hosts, jobs and tickets with
    /// their progress, running tasks and clones, bytes over the link, cache hits, page faults;
    /// updated live). Open it in a browser. The page is at /, its data at /api/state (JSON) and
    /// /api/events (server-sent events), on the head's metrics listener: `starling up` starts it on
    /// 127.0.0.1 (a free port) unless --metrics ADDR or head.metrics says where.
    Dashboard {
        /// Cluster head address (default: the embedded cluster started by `starling up`).
        #[arg(long)]
        cluster: Option<String>,
    },
    /// List every running task of the cluster: id, job, host, state, CPU time, resident memory,
    /// how long it has run, command. A user other than root sees their own tasks only.
    Ps {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// A roaming task's (`exec --roam`) migration decisions, oldest first, each with the
        /// sensor values that caused it.
        #[arg(long, value_name = "TASK")]
        why: Option<String>,
        /// Cluster head address (default: the embedded cluster started by `starling up`).
        #[arg(long)]
        cluster: Option<String>,
    },
    /// Re-attach to a task on a terminal whose `starling exec` went away.
    ///
    /// A task on a terminal (`exec` from a terminal, `-t`, `exec --roam`) outlives its client:
    /// if that `starling exec` is killed or loses its link to the cluster, the task keeps running
    /// where it is (`starling ps` shows it `detached`), its output is kept (up to 4 MiB, oldest
    /// dropped first) and the files it asks for wait. `starling attach TASK` makes this terminal
    /// its terminal again: the output goes on from the first byte the last client had not
    /// written, keys, window size and Ctrl-C reach the task, its changes are committed here when
    /// it ends and its exit status is this command's. A task that ended while detached is kept
    /// (the latest 64) so an attach still gets its output, changes and status. Its X connections
    /// (`exec -X`) and its migration manager (`--roam`) do not come back: it stays where it is.
    ///
    /// A task with a client attached is refused unless --force, which takes it over (that
    /// client prints why and exits with status 255).
    ///
    /// Example: starling attach t1763876543210000
    Attach {
        /// The task (as `starling ps` shows it).
        task: String,
        /// Take the task over from the client attached to it.
        #[arg(long)]
        force: bool,
        /// Cluster head address (default: the embedded cluster started by `starling up`).
        #[arg(long)]
        cluster: Option<String>,
    },
    /// Move a running task to another host while it runs (live migration).
    ///
    /// Any exec, run or batch task, or a remote-fork clone (it first fetches the rest of its
    /// memory from its parent), moves; the clones of a hierarchical ticket do not.
    ///
    /// Its memory is copied while it runs, then it is frozen for a moment, its registers, files it
    /// wrote, unread input and what it printed move with it, and it resumes on the target with the
    /// same PID and threads; the rest of its memory follows in the background. Its output,
    /// signals (Ctrl-C) and exit status stay with the client that started it. A task that holds
    /// something that cannot move (a network connection, a pipe to another process, a device) is
    /// refused before it is touched, naming what holds it; if the target fails before the switch
    /// the task runs on where it was.
    ///
    /// Example: starling migrate t1763876543210000 --to h2
    Migrate {
        /// The task (as `starling ps` shows it).
        task: String,
        /// Target host, `home` (the home site of `exec --roam`), or `auto` for the least loaded
        /// other host with a free core (never home).
        #[arg(long, default_value = "auto")]
        to: String,
        /// Machine-readable report.
        #[arg(long)]
        json: bool,
        /// Freeze the task and send all its memory before it resumes (no copy while it runs, none
        /// after): the way VM migration used to be done, for comparison. The pause grows with memory.
        #[arg(long)]
        stop_and_copy: bool,
        /// Cluster head address (default: the embedded cluster started by `starling up`).
        #[arg(long)]
        cluster: Option<String>,
    },
    /// Run a command on the cluster as if it ran here.
    ///
    /// The command sees this machine's whole file system (read through a content-addressed cache on the
    /// host), environment, cwd, umask, uid/gid and rlimits. It sees every change made here before it
    /// started and none made while it runs. Its file changes are committed here when it exits; a file
    /// changed here meanwhile is not overwritten: the command's version is saved beside it as
    /// FILE.starling-conflict. The exit status is the command's (128+N if killed by signal N);
    /// 255 means starling itself failed (no cluster, host lost): then nothing was committed.
    ///
    /// Example: make -j8 CC='starling exec gcc'
    Exec(ExecArgs),
    /// Run N copies of a command as one job: task i gets STARLING_TASK=i and STARLING_TASKS=N.
    ///
    /// One process, one connection and one launch carry the whole job (one prethrow); all tasks
    /// see this machine as it was when the job started. The head starts tasks as cores free up.
    /// Output is passed through line by line; a progress bar (tasks done/running/queued, bytes
    /// moved) is shown on a terminal. Exit status: 0 if every task exited 0, 255 if starling lost
    /// a task, else the first failing task's status.
    ///
    /// Example: starling run -n 16 -- sh -c 'render --tile $STARLING_TASK/$STARLING_TASKS'
    Run(RunArgs),
    /// Run each line of FILE (or stdin with `-`) as a shell command, all as one job (like GNU parallel).
    ///
    /// Blank lines and lines starting with # are skipped. Same output, progress and exit rules as `run`.
    Batch(BatchArgs),
    /// Run the host agent (the daemon that runs tasks on a host). `starling up` starts these for
    /// you; on a real machine run `starling agent --head HEAD_IP:7077 --name NAME` as root, or
    /// `starling agent --listen 0.0.0.0:7078` and start the head with `--agent HOST:7078`.
    Agent(AgentArgs),
    /// Run the cluster head (what clients connect to). `starling up` starts one for you.
    Head(HeadArgs),
    /// Play the owner of an emulated host (Linger-Longer): run CMD as that host's owner
    /// workload, or set the owner's keyboard state.
    ///
    /// Starling's own work on every host (its guests) runs in the agent's guest cgroup at
    /// starvation CPU priority (cpu.idle); the owner is everything else. On an emulated host
    /// the owner is what this command runs: CMD runs in the host's network, mount and UTS
    /// namespaces and in the host's owner cgroup (NOT the guest cgroup), so the host's owner
    /// monitor counts its CPU. `--active` / `--idle` say whether someone is at the host's
    /// keyboard. `starling status` shows each host's owner state (idle, active-light,
    /// active-busy), owner CPU and what the guests do about it.
    ///
    /// Examples: starling owner h1 -- sh -c 'while :; do :; done & while :; do :; done'
    ///           starling owner h1 --active
    Owner(OwnerArgs),
    /// Join tokens: a host enrols with one (`starling agent --join HEAD --token T`).
    ///
    /// Run on the head's machine, as the owner of its credentials directory (--auth DIR, else
    /// head.auth, else the embedded cluster's).
    #[command(subcommand)]
    Token(TokenCmd),
    /// Remote users' certificates: a user's runs tasks as its uid only.
    #[command(subcommand)]
    User(UserCmd),
    /// Enrolled hosts' certificates.
    #[command(subcommand)]
    Host(HostCmd),
    /// The cluster's certificate authority.
    #[command(subcommand)]
    Ca(CaCmd),
}

#[derive(Subcommand)]
enum CaCmd {
    /// Replace the cluster's CA while it runs. Makes a new CA, re-signs the head's and the other
    /// role certificates and the credentials `user add` wrote here; the head then gives every
    /// connected agent (and any that connects later) a certificate of the new CA over its
    /// connection. Until `ca rotate --finish`, certificates of both CAs are accepted; after it,
    /// one of the old CA is refused with one line (and connections still using one end).
    ///
    /// Example: starling ca rotate; (agents and users updated) starling ca rotate --finish
    Rotate {
        /// Close the rotation's window: retire the previous CA.
        #[arg(long)]
        finish: bool,
        #[command(flatten)]
        auth: AuthDirArg,
    },
}

/// Where the cluster's credentials are, for the administrator's commands.
#[derive(Args)]
struct AuthDirArg {
    /// The cluster's credentials directory (the head's --auth). [default: head.auth, else the
    /// embedded cluster's]
    #[arg(long, value_name = "DIR")]
    auth: Option<PathBuf>,
}

#[derive(Subcommand)]
enum TokenCmd {
    /// Print a new join token: good for one enrolment, until it expires. The head keeps only its
    /// hash; the token also carries the CA's fingerprint, so the joining host checks the head.
    ///
    /// Example: starling token create --ttl 30m
    Create {
        /// How long it stays valid: a number of seconds, or with a unit s, m, h, d.
        #[arg(long, default_value = "1h", value_parser = parse_ttl)]
        ttl: std::time::Duration,
        #[command(flatten)]
        auth: AuthDirArg,
    },
}

#[derive(Subcommand)]
enum UserCmd {
    /// Issue user NAME a certificate naming its uid, gid and supplementary groups: a
    /// client holding it (STARLING_AUTH=DIR, over TCP) runs tasks as that uid with exactly
    /// that gid and those groups, whatever its spec says.
    ///
    /// Example: starling user add alice --uid 1000 --groups 27,100 --out /tmp/alice-creds
    Add {
        name: String,
        #[arg(long)]
        uid: u32,
        /// [default: the uid]
        #[arg(long)]
        gid: Option<u32>,
        /// Supplementary groups (numbers, comma-separated) besides the gid. [default: none]
        #[arg(long, value_name = "G1,G2,...", value_delimiter = ',')]
        groups: Vec<u32>,
        /// Where to write the user's credentials (ca.pem, client.pem, client.key; made 0700):
        /// give this directory to the user. [default: DIR/users.d/NAME]
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
        /// Allow uid 0 (tasks as root, unless the head refuses root tasks).
        #[arg(long)]
        root: bool,
        #[command(flatten)]
        auth: AuthDirArg,
    },
    /// Revoke user NAME's certificate: the head refuses it from now on and drops its
    /// connections. `user add NAME` may then issue a new one (that is how a user's key is rotated).
    Revoke {
        name: String,
        #[command(flatten)]
        auth: AuthDirArg,
    },
}

#[derive(Subcommand)]
enum HostCmd {
    /// Revoke enrolled host HOST's certificate: the head refuses it from now on and drops its
    /// connection. The host may enrol again with a new token (that is how its key is rotated).
    Revoke {
        host: String,
        #[command(flatten)]
        auth: AuthDirArg,
    },
}

/// `--ttl`: seconds, or a number with a unit s, m, h or d.
fn parse_ttl(s: &str) -> Result<std::time::Duration, String> {
    let (num, unit) = s.find(|c: char| !c.is_ascii_digit()).map_or((s, ""), |i| s.split_at(i));
    let n: u64 = num.parse().map_err(|_| format!("{s:?}: a number of seconds, or with a unit s, m, h, d (e.g. 30m)"))?;
    let secs = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        u => return Err(format!("{s:?}: unknown unit {u:?} (s, m, h, d)")),
    };
    Ok(std::time::Duration::from_secs(n.saturating_mul(secs)))
}

#[derive(Args)]
struct OwnerArgs {
    /// The emulated host (as `starling status` names it).
    host: String,
    /// Someone is at the host's keyboard now.
    #[arg(long, conflicts_with_all = ["idle", "command"])]
    active: bool,
    /// Nobody is at the host's keyboard.
    #[arg(long, conflicts_with = "command")]
    idle: bool,
    /// The owner workload and its arguments. Its exit status is this command's.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "CMD")]
    command: Vec<OsString>,
}

#[derive(Args)]
struct UpArgs {
    /// Number of emulated hosts.
    #[arg(long, default_value_t = 4)]
    hosts: usize,
    /// Emulated WAN link between this machine (the client) and the cluster's head:
    /// lan (no shaping), cable-modem (70 ms RTT, 4 Mib/s up, 16 Mib/s down),
    /// coffee-shop (160 ms RTT, 1400 Kib/s up, 1500 Kib/s down), or RTT_MS,UP_KBIT,DOWN_KBIT.
    #[arg(long, default_value = "lan", value_parser = parse_link)]
    link: String,
    /// Shape each emulated host's own link (its veth pair, both directions) to RATE with a
    /// token bucket: NUMBER[k|m|g]bit, e.g. 1gbit or 100mbit (or ...bps for bytes/s), so
    /// fan-out is measured with a per-machine bottleneck. Rate only: no delay (the kernel
    /// here has no netem). Separate from --link (client ↔ head).
    #[arg(long, value_name = "RATE", value_parser = parse_host_link, conflicts_with = "slurm")]
    host_link: Option<starling_cluster::HostLink>,
    /// MTU of the emulated cluster's bridge and host links (68..=65535). At the default, 9000,
    /// a 4 KiB page is one multicast datagram; 1500 (Ethernet's) splits it in three.
    #[arg(long, default_value_t = starling_cluster::DEFAULT_MTU, value_parser = clap::value_parser!(u32).range(68..=65535), conflicts_with = "slurm")]
    mtu: u32,
    /// Run the head without its shared relay cache: every content request goes to the client
    /// (for measuring what the cache saves).
    #[arg(long)]
    no_relay_cache: bool,
    /// The hosts are the nodes of a Slurm job (or of the allocation this runs in) instead of
    /// emulated hosts.
    #[arg(long, conflicts_with_all = ["hosts", "link"])]
    slurm: bool,
    /// Number of Slurm nodes (sbatch --nodes). [default: Slurm's, or the whole allocation]
    #[arg(short = 'N', long, requires = "slurm", value_name = "NODES")]
    nodes: Option<u32>,
    /// Slurm partition (sbatch --partition). [default: Slurm's default partition]
    #[arg(long, requires = "slurm")]
    partition: Option<String>,
    /// Slurm time limit (sbatch --time: MINUTES, HH:MM:SS, D-HH...). [default: the partition's]
    #[arg(long, requires = "slurm")]
    time: Option<String>,
    /// Slurm account to charge (sbatch --account).
    #[arg(long, requires = "slurm")]
    account: Option<String>,
    /// Where the head listens, IP or IP:PORT, reachable from the nodes. [default: this machine's
    /// address on its route to the Slurm controller, a free port]
    #[arg(long, requires = "slurm", value_name = "ADDR")]
    listen: Option<String>,
    /// Give up (and cancel the job) if not every agent has registered after this many seconds,
    /// counting the time the job waits in the queue.
    #[arg(long, requires = "slurm", default_value_t = 300, value_name = "SECONDS")]
    wait: u64,
    /// The head serves Prometheus metrics at http://ADDR/metrics (see `starling head --help`).
    #[arg(long, value_name = "IP:PORT")]
    metrics: Option<String>,
    /// The head refuses tasks that would run as root (root's own `starling exec` included).
    #[arg(long)]
    no_root_tasks: bool,
    /// FOR MEASUREMENTS ONLY (bench/auth_bench.py): no credentials and no local socket; every
    /// connection is plain TCP and the head believes the uid any client claims (any local user can
    /// run tasks as root). Never on a machine with users you would not give root.
    #[arg(long, conflicts_with = "slurm")]
    insecure: bool,
    /// What every host's guests do when its owner becomes active: LF (linger at starvation
    /// priority, never move), LL (linger, then move to an idle host after
    /// T_lingr = ((1-l)/(h-l))·T_migr), PM (suspend, move after agent.pm_pause_s) or IE (kill,
    /// rerun from the start on an idle host). A task's own `--policy` wins. [default: agent.policy, LF]
    #[arg(long, value_parser = parse_policy)]
    policy: Option<starling_config::GuestPolicy>,
    #[command(flatten)]
    peers: PeerFlags,
    /// Hosts the head refers to one holder of a chunk at most (host-to-host chunk sharing; those
    /// are then referred to in turn); 0: the head sends every chunk itself. [default: head.peer_referrals, 3]
    #[arg(long, value_name = "N")]
    peer_referrals: Option<u32>,
}

/// Host-to-host chunk sharing, as `agent` and `up` take it.
#[derive(Args)]
struct PeerFlags {
    /// Share no chunks with other hosts: serve none, fetch every chunk from the head (`starling
    /// status` shows PEERS off). [default: agent.peers, on]
    #[arg(long)]
    no_peers: bool,
    /// The TCP port other hosts fetch this host's chunks from (shown by `starling status`, column
    /// PEERS); 0: any free port. [default: agent.peer_port, 0]
    #[arg(long, value_name = "PORT", conflicts_with = "no_peers")]
    peer_port: Option<u16>,
}

impl PeerFlags {
    /// The agent arguments that say the same.
    fn agent_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if self.no_peers {
            args.push("--no-peers".to_string());
        }
        if let Some(p) = self.peer_port {
            args.extend(["--peer-port".to_string(), p.to_string()]);
        }
        args
    }

    fn apply(&self, settings: &mut starling_config::AgentSettings) {
        settings.peers &= !self.no_peers;
        settings.peer_port = self.peer_port.unwrap_or(settings.peer_port);
    }
}

fn parse_policy(s: &str) -> Result<starling_config::GuestPolicy, String> {
    starling_config::GuestPolicy::parse(s).map_err(|e| format!("expected {e}"))
}

fn parse_host_link(s: &str) -> Result<starling_cluster::HostLink, String> {
    starling_cluster::HostLink::parse(s).map_err(|e| e.to_string())
}

fn parse_link(s: &str) -> Result<String, String> {
    starling_link::Profile::parse(s).map(|_| s.to_string()).map_err(|e| e.to_string())
}

#[derive(Args)]
struct ExecArgs {
    /// Run on this host (see `starling status`); default: the least loaded.
    #[arg(long)]
    host: Option<String>,
    /// Job name: tasks launched separately under one job share a consistency point.
    #[arg(long)]
    job: Option<String>,
    /// Cluster head address (default: the embedded cluster started by `starling up`).
    #[arg(long)]
    cluster: Option<String>,
    /// What happens to the task when its host's owner becomes active (Linger-Longer): LF (linger
    /// at starvation priority), LL (linger, then move to an idle host after T_lingr), PM (suspend,
    /// move after a pause) or IE (kill at once and rerun from the start on an idle host: its
    /// uncommitted files are discarded and output already shown is not repeated, so use IE for
    /// programs that are deterministic and read no terminal). [default: the host's policy]
    #[arg(long, value_parser = parse_policy)]
    policy: Option<starling_config::GuestPolicy>,
    /// Run the command on a terminal (a pty on its host, as `ssh -t`) even if stdin is not one.
    ///
    /// By default it gets one when stdin is a terminal and starling is its foreground job, as a shell
    /// starts a command (not a step of make or of a script, not a --job task): then `tty`, `stty size`, python3's prompt, less, top and Ctrl-C work as here,
    /// window-size changes follow, and stdout and stderr arrive as one stream.
    #[arg(short = 't', long = "tty", conflicts_with = "no_tty")]
    tty: bool,
    /// Never a terminal: stdin, stdout and stderr stay pipes (stdout and stderr apart).
    #[arg(short = 'T', long = "no-tty")]
    no_tty: bool,
    /// Forward X11, as `ssh -X`: the command gets a DISPLAY served by its host (a socket in its
    /// own /tmp/.X11-unix, and an XAUTHORITY with a cookie made for this task only), and each X
    /// connection it opens is relayed to your X server ($DISPLAY) through the task's channel; your
    /// real cookie stays here. The display follows the task when it moves (`starling migrate`, --roam): its
    /// X connections are re-attached on the new host, your X server's stays open.
    #[arg(short = 'X', long = "x11")]
    x11: bool,
    /// Send file contents and messages uncompressed (for measurements).
    #[arg(long)]
    no_compress: bool,
    /// Don't send the program's predicted file bindings with the launch (for measurements).
    #[arg(long)]
    no_prethrow: bool,
    /// Start the command at home (this machine, in the same sandbox and file view as a cluster
    /// host: the home site, started if needed) and let it roam: a migration manager moves it to
    /// the cluster while it crunches and back home when you interact with it (Snowbird), as its
    /// profile says. `starling migrate TASK --to HOST|home` moves it by hand; `starling ps` shows
    /// where it is and why, `starling ps --why TASK` every decision with the sensor values
    /// behind it. Needs an embedded cluster (`starling up`).
    #[arg(long, conflicts_with_all = ["host", "job"])]
    roam: bool,
    /// The roaming profile (TOML: states naming sites, rules over averaged sensors, dwell time,
    /// cost/benefit; README, Roaming). [default: the generic profile]
    #[arg(long, value_name = "FILE", requires = "roam")]
    profile: Option<PathBuf>,
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "CMD")]
    command: Vec<OsString>,
}

#[derive(Args)]
struct JobFlags {
    /// Cluster head address (default: the embedded cluster started by `starling up`).
    #[arg(long)]
    cluster: Option<String>,
    /// No progress bar or summary.
    #[arg(long, conflicts_with = "json")]
    quiet: bool,
    /// JSON lines on stdout: started/output/finished events per task, then a summary.
    #[arg(long)]
    json: bool,
    /// What happens to the task when its host's owner becomes active (Linger-Longer): LF (linger
    /// at starvation priority), LL (linger, then move to an idle host after T_lingr), PM (suspend,
    /// move after a pause) or IE (kill at once and rerun from the start on an idle host: its
    /// uncommitted files are discarded and output already shown is not repeated, so use IE for
    /// programs that are deterministic and read no terminal). [default: the host's policy]
    #[arg(long, value_parser = parse_policy)]
    policy: Option<starling_config::GuestPolicy>,
    /// Send file contents and messages uncompressed (for measurements).
    #[arg(long)]
    no_compress: bool,
    /// Don't send predicted file bindings with the launch (for measurements).
    #[arg(long)]
    no_prethrow: bool,
    /// Send the prethrow with every task instead of once per job (for measurements).
    #[arg(long)]
    prethrow_per_task: bool,
}

#[derive(Args)]
struct RunArgs {
    /// Number of tasks.
    #[arg(short = 'n', long = "tasks", default_value_t = 1)]
    tasks: usize,
    #[command(flatten)]
    flags: JobFlags,
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "CMD")]
    command: Vec<OsString>,
}

#[derive(Args)]
struct BatchArgs {
    /// File with one shell command per line, or - for stdin.
    #[arg(value_name = "FILE")]
    file: PathBuf,
    #[command(flatten)]
    flags: JobFlags,
}

#[derive(Args)]
struct AgentArgs {
    /// Head to connect to (or `agent.head` in the config file).
    #[arg(long, conflicts_with = "listen")]
    head: Option<String>,
    /// Instead, listen here for the head to connect (`starling head --agent THIS_ADDR`).
    #[arg(long)]
    listen: Option<String>,
    /// Host name shown in `starling status`.
    #[arg(long)]
    name: Option<String>,
    /// State directory (content cache, task dirs). Must be on a local disk, not overlayfs.
    /// [default: /var/lib/starling/state]
    #[arg(long)]
    state: Option<PathBuf>,
    /// Content cache size bound in MiB (least recently used content is evicted). [default: 8192]
    #[arg(long)]
    cache_mib: Option<u64>,
    /// Name of the agent's cgroups: every task runs in starling/NAME/guest of each cgroup v1
    /// hierarchy (CPU at cpu.idle, memory band), removed when the agent stops. [default: --name]
    #[arg(long)]
    cgroup: Option<String>,
    /// Whose CPU the owner monitor counts: machine (everything that is not a guest) or emulated
    /// (the host's owner cgroup, filled by `starling owner HOST -- CMD`). [default: machine]
    #[arg(long, value_parser = ["machine", "emulated"])]
    owner: Option<String>,
    /// What this host's guests do when its owner becomes active: LF (linger, never move), LL
    /// (linger, then move to an idle host after T_lingr), PM (suspend, then move) or IE (kill,
    /// rerun from the start on an idle host). A task's own `--policy` wins. [default: agent.policy, LF]
    #[arg(long, value_parser = parse_policy)]
    policy: Option<starling_config::GuestPolicy>,
    /// This agent is the home site (the user's own machine; `exec --roam` starts it): the head
    /// places there only what names it, and its tasks are the user's own work (no guest cgroup).
    /// It runs in a mount namespace of its own, so its tasks' mounts stay out of the machine's.
    #[arg(long)]
    home: bool,
    /// The cluster's credentials for this agent (ca.pem, agent.pem, agent.key, copied from the
    /// head's `--auth` directory): its head connection is then mutual TLS, and only the head's
    /// certificate is accepted. Without it the connection is unauthenticated.
    #[arg(long, value_name = "DIR")]
    auth: Option<PathBuf>,
    /// Enrol this host with the head at HEAD:PORT using a join token (`starling token create`),
    /// then serve it: the host makes its own key, the head signs a certificate naming this host
    /// (--name), written to --auth DIR. Once enrolled (DIR holds agent.pem), the token is not
    /// needed again.
    #[arg(long, value_name = "HEAD:PORT", requires_all = ["token", "auth"], conflicts_with_all = ["head", "listen"])]
    join: Option<String>,
    /// The join token (with --join).
    #[arg(long, requires = "join", env = "STARLING_JOIN_TOKEN", hide_env_values = true)]
    token: Option<String>,
    #[command(flatten)]
    peers: PeerFlags,
}

#[derive(Args)]
struct HeadArgs {
    /// Where to listen for clients and agents. [default: 0.0.0.0:7077]
    #[arg(long)]
    listen: Option<String>,
    /// Dial an agent started with `starling agent --listen ADDR` (repeatable).
    #[arg(long = "agent")]
    agents: Vec<String>,
    /// KEY=VALUE shown in `starling status` (repeatable).
    #[arg(long = "fact")]
    facts: Vec<String>,
    /// State directory (the relay's shared content cache lives here; it persists across runs).
    /// [default: /var/lib/starling/head]
    #[arg(long)]
    state: Option<PathBuf>,
    /// Relay cache size bound in MiB. [default: 8192]
    #[arg(long)]
    cache_mib: Option<u64>,
    /// Forward every content request to the client (for measuring the relay cache's effect).
    #[arg(long)]
    no_relay_cache: bool,
    /// Hosts referred to one holder of a chunk at most (host-to-host chunk sharing); 0: the head
    /// sends every chunk itself. [default: 3]
    #[arg(long, value_name = "N")]
    peer_referrals: Option<u32>,
    /// Serve Prometheus metrics at http://ADDR/metrics (tasks by state, relay cache hits, clones,
    /// page faults served, per-host cores and load). Example: --metrics 0.0.0.0:9477
    #[arg(long, value_name = "IP:PORT")]
    metrics: Option<String>,
    /// The cluster's credentials directory: every TCP connection (agents, remote clients, the link
    /// relay) must then be mutual TLS with a certificate of this cluster's CA. Without it, TCP is
    /// unauthenticated: whoever reaches --listen runs tasks as any uid. `starling up` makes one.
    #[arg(long, value_name = "DIR")]
    auth: Option<PathBuf>,
    /// With --auth: create the cluster's CA and one certificate per role in DIR (0700, keys 0600)
    /// and exit (an existing CA is never replaced). Copy ca.pem, agent.pem and agent.key to each agent host (README,
    /// Authentication).
    #[arg(long, requires = "auth")]
    init: bool,
    /// Unix socket for local clients (made mode 0666): the kernel tells the head who they are and
    /// their tasks run as that user, whatever they claim.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Refuse tasks that would run as root (a root user's, or a certified remote client's).
    #[arg(long)]
    no_root_tasks: bool,
}

fn init_logging(filter: Option<&str>, default: &str) {
    env_logger::Builder::new().parse_filters(filter.unwrap_or(default)).format_timestamp_millis().init();
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime")
}

/// `exec`'s runtime: one thread. A task's client only passes a few messages,
/// its output and its file answers (those on blocking threads): worker
/// threads would cost more to start than they save, for every compile of a
/// `make -j CC='starling exec gcc'` (issue 18).
fn exec_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime")
}

/// The daemons (head, agent, link relay) write to connections whose other end
/// may close at any moment: that must fail the write on that connection
/// (EPIPE), not end the process. `main` gives every command SIGPIPE's
/// default disposition, and TLS records go out with writev, which (unlike
/// a plain socket write, sent with MSG_NOSIGNAL) raises SIGPIPE: an agent
/// answering a peer that had just dropped it died of it silently, and the
/// head lost that host with every task on it. Tasks start with default
/// dispositions whatever this is (the sandbox's init restores them).
fn daemon_ignores_sigpipe() {
    // SAFETY: setting a signal's disposition to SIG_IGN touches no memory.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
}

/// When `main` began: the client's per-stage times count from here.
static STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

fn main() {
    STARTED.get_or_init(std::time::Instant::now);
    // Behave like other Unix tools when our output pipe closes (`starling status | head`):
    // die quietly of SIGPIPE. `exec` handles EPIPE itself.
    // SAFETY: restoring the default disposition of a signal touches no memory.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // Hidden entry points re-executed by the daemons themselves: they must
    // run before anything starts a thread.
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some(starling_sandbox::INIT_SUBCOMMAND) => starling_sandbox::init_main(),
        Some(roles::HOST_BOOT) => starling_cluster::host_boot_main(&args[2..]),
        Some(roles::LINK) => link_main(&args[2..]),
        _ => {}
    }
    let cli = Cli::parse();
    let code = match run(cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("starling: {}", one_line(&e));
            starling_client::EXIT_STARLING_FAILURE
        }
    };
    std::process::exit(code);
}

/// An error and its causes in one line. The crates' typed errors already
/// name their cause in their message; a cause is added only if it is not
/// in the line yet (contexts added here with anyhow are).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !line.contains(&c) {
            line.push_str(": ");
            line.push_str(&c);
        }
    }
    line
}

/// The configuration: defaults, the file, then the environment (flags are applied by each command).
fn load_config(file: Option<&std::path::Path>) -> Result<Config> {
    let env = |k: &str| std::env::var_os(k);
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    Ok(Config::load(&Sources { file, env: &env, euid })?)
}

/// The head the client settings (and flags) name, found once.
fn client_context(cfg: &Config, cluster: Option<String>) -> Result<Context> {
    let mut settings = cfg.client.clone();
    if cluster.is_some() {
        settings.cluster = cluster;
    }
    let target = Target::resolve(&settings, &cfg.dirs())?;
    Ok(Context { target, settings, started: *STARTED.get_or_init(std::time::Instant::now) })
}

fn run(cli: Cli) -> Result<i32> {
    let mut cfg = load_config(cli.config.as_deref())?;
    match cli.cmd {
        Cmd::Exec(a) => {
            init_logging(cfg.log.as_deref(), "warn");
            cfg.client.compress &= !a.no_compress;
            cfg.client.prethrow &= !a.no_prethrow;
            let ctx = client_context(&cfg, a.cluster)?;
            let mut spec = starling_session::spec::capture(a.command)?;
            spec.policy = a.policy;
            let terminal = match (a.tty, a.no_tty) {
                (true, _) => starling_client::terminal::TerminalMode::Always,
                (_, true) => starling_client::terminal::TerminalMode::Never,
                _ => starling_client::terminal::TerminalMode::Auto,
            };
            let rt = exec_runtime();
            let (host, roam) = if a.roam {
                let roam = roam_profile(a.profile.as_deref())?;
                rt.block_on(ensure_home(&cfg, &ctx.target))?;
                (Some(starling_cluster::HOME_SITE.to_string()), Some(roam))
            } else {
                (a.host, None)
            };
            let opts = starling_client::exec::ExecOptions { host, job: a.job, terminal, roam, x11: a.x11 };
            let code = rt.block_on(starling_client::exec::run(&ctx, spec, opts))?;
            // The process exits next and its threads end with it: shutting the
            // runtime down first would only wake each blocking thread to join it.
            std::mem::forget(rt);
            Ok(code)
        }
        Cmd::Run(a) => {
            init_logging(cfg.log.as_deref(), "warn");
            if a.tasks == 0 || a.tasks > starling_proto::MAX_JOB_TASKS {
                anyhow::bail!("-n must be between 1 and {}", starling_proto::MAX_JOB_TASKS);
            }
            let policy = a.flags.policy;
            let (ctx, opts) = job_context(&mut cfg, a.flags)?;
            let mut spec = starling_session::spec::capture(a.command)?;
            spec.policy = policy;
            let argvs = vec![None; a.tasks];
            Ok(runtime().block_on(starling_client::job::run(&ctx, spec, argvs, opts))?)
        }
        Cmd::Batch(a) => {
            init_logging(cfg.log.as_deref(), "warn");
            let text = if a.file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).context("reading commands from stdin")?
            } else {
                std::fs::read_to_string(&a.file).with_context(|| format!("reading {}", a.file.display()))?
            };
            let cmds = starling_client::job::batch_commands(&text);
            if cmds.is_empty() {
                anyhow::bail!("{}: no commands", a.file.display());
            }
            let policy = a.flags.policy;
            let (ctx, opts) = job_context(&mut cfg, a.flags)?;
            let mut spec = starling_session::spec::capture(vec!["/bin/sh".into()])?;
            spec.policy = policy;
            Ok(runtime().block_on(starling_client::job::run(&ctx, spec, cmds.into_iter().map(Some).collect(), opts))?)
        }
        Cmd::Status { json, cluster } => {
            init_logging(cfg.log.as_deref(), "warn");
            let ctx = client_context(&cfg, cluster)?;
            runtime().block_on(status(json, &ctx.target))
        }
        Cmd::Dashboard { cluster } => {
            init_logging(cfg.log.as_deref(), "warn");
            let ctx = client_context(&cfg, cluster)?;
            let st = runtime().block_on(fetch_status(&ctx.target))?;
            match st.facts.iter().find(|(k, _)| k == "metrics") {
                Some((_, url)) => {
                    println!("{}", url.strip_suffix("metrics").unwrap_or(url));
                    Ok(0)
                }
                None => anyhow::bail!(
                    "the head serves no dashboard: it was started without a metrics listener (start it with `starling up --metrics 127.0.0.1:9477`, `starling head --metrics ADDR` or head.metrics in the config)"
                ),
            }
        }
        Cmd::Ps { json, why, cluster } => {
            init_logging(cfg.log.as_deref(), "warn");
            let ctx = client_context(&cfg, cluster)?;
            match why {
                Some(t) => runtime().block_on(ps_why(parse_task(&t)?, json, &ctx.target)),
                None => runtime().block_on(ps(json, &ctx.target)),
            }
        }
        Cmd::Attach { task, force, cluster } => {
            init_logging(cfg.log.as_deref(), "warn");
            let ctx = client_context(&cfg, cluster)?;
            let task = parse_task(&task)?;
            let rt = exec_runtime();
            let code = rt.block_on(starling_client::exec::attach(&ctx, task, force))?;
            // As for exec: the blocking stdin thread ends with the process.
            std::mem::forget(rt);
            Ok(code)
        }
        Cmd::Migrate { task, to, json, stop_and_copy, cluster } => {
            init_logging(cfg.log.as_deref(), "warn");
            let ctx = client_context(&cfg, cluster)?;
            let task = parse_task(&task)?;
            let to = (to != "auto").then_some(to);
            runtime().block_on(migrate(task, to, stop_and_copy, json, &ctx.target))
        }
        Cmd::Up(a) => {
            init_logging(cfg.log.as_deref(), "warn");
            up(&cfg, a)
        }
        Cmd::Down { verbose } => {
            init_logging(cfg.log.as_deref(), "warn");
            let removed = LocalCluster::new(cfg.instance, cfg.dirs()).down()?;
            if removed.is_empty() {
                println!("no starling cluster was running; nothing to remove");
            } else {
                println!("{}", removed.summary());
                if verbose {
                    for r in removed.iter() {
                        println!("  {r}");
                    }
                }
            }
            Ok(0)
        }
        Cmd::Agent(a) => {
            daemon_ignores_sigpipe();
            init_logging(cfg.log.as_deref(), "info");
            let mut settings = cfg.agent.clone();
            settings.head = a.head.or(settings.head);
            settings.listen = a.listen.or(settings.listen);
            if a.name.is_some() {
                settings.name = a.name;
            }
            settings.state = a.state.unwrap_or(settings.state);
            settings.cache_mib = a.cache_mib.unwrap_or(settings.cache_mib);
            if a.cgroup.is_some() {
                settings.cgroup = a.cgroup;
            }
            match a.owner.as_deref() {
                Some("emulated") => settings.owner = starling_config::OwnerKind::Emulated,
                Some(_) => settings.owner = starling_config::OwnerKind::Machine,
                None => {}
            }
            if let Some(p) = a.policy {
                settings.policy = p;
            }
            if a.auth.is_some() {
                settings.auth = a.auth;
            }
            if a.join.is_some() {
                settings.head.clone_from(&a.join);
            }
            a.peers.apply(&mut settings);
            if settings.high_water_mib < settings.low_water_mib {
                anyhow::bail!(
                    "agent.high_water_mib ({}) must not be below agent.low_water_mib ({})",
                    settings.high_water_mib,
                    settings.low_water_mib
                );
            }
            if settings.head.is_none() && settings.listen.is_none() {
                anyhow::bail!("agent needs --head ADDR or --listen ADDR (or agent.head / agent.listen in the config file)");
            }
            // Without root: a user namespace of our own, where we are 0 (before any thread starts).
            let rootless = enter_rootless_namespace()?;
            if a.home {
                private_mounts()?;
            }
            let name = settings.name.clone().unwrap_or_else(nix_hostname);
            let cfg = starling_agent::AgentConfig {
                settings,
                name,
                fork: cfg.fork,
                exe: std::env::current_exe().context("locating the starling binary")?,
                compress: true,
                rootless,
                home: a.home,
            };
            runtime().block_on(async {
                if let (Some(head), Some(token), Some(dir)) = (&a.join, &a.token, &cfg.settings.auth) {
                    let dir = starling_auth::AuthDir::new(dir);
                    if dir.has(starling_auth::Role::Agent) {
                        log::info!("{} already holds this host's credentials: not enrolling again", dir.dir.display());
                    } else {
                        starling_auth::enrol::join(head, token, &cfg.name, &dir).await?;
                        log::info!("enrolled as host {} with {head}; credentials in {}", cfg.name, dir.dir.display());
                    }
                }
                starling_agent::run(cfg).await.map_err(anyhow::Error::from)
            })?;
            Ok(0)
        }
        Cmd::Token(TokenCmd::Create { ttl, auth }) => {
            let dir = admin_auth_dir(&cfg, auth)?;
            println!("{}", dir.create_token(ttl)?);
            eprintln!(
                "starling: a join token for one host, valid {} s: on it run `starling agent --join HEAD:PORT --token TOKEN --auth DIR --name NAME`",
                ttl.as_secs()
            );
            Ok(0)
        }
        Cmd::User(UserCmd::Add { name, uid, gid, groups, out, root, auth }) => {
            if uid == 0 && !root {
                anyhow::bail!("a certificate for uid 0 runs tasks as root: pass --root to mean it");
            }
            let dir = admin_auth_dir(&cfg, auth)?;
            let out = out.unwrap_or_else(|| dir.dir.join("users.d").join(&name));
            let gid = gid.unwrap_or(uid);
            dir.add_user(&name, uid, gid, &groups, &out)?;
            eprintln!(
                "starling: user {name} (uid {uid}, gid {gid}, groups {groups:?}) certified; give them {d} and have them set STARLING_AUTH={d} (revoke: `starling user revoke {name}`)",
                d = out.display()
            );
            Ok(0)
        }
        Cmd::User(UserCmd::Revoke { name, auth }) => {
            let serial = admin_auth_dir(&cfg, auth)?.revoke("user", &name)?;
            eprintln!("starling: user {name}'s certificate (serial {serial}) revoked; the head refuses it and drops its connections");
            Ok(0)
        }
        Cmd::Ca(CaCmd::Rotate { finish: false, auth }) => {
            let r = admin_auth_dir(&cfg, auth)?.rotate_ca()?;
            eprintln!(
                "starling: new CA {fp}; the head's, the shared role certificates and {n} user(s)' credentials re-issued{users}; \
                 the head gives each connected agent a certificate of the new CA. Old and new CAs are both trusted until \
                 `starling ca rotate --finish`.",
                fp = r.fingerprint,
                n = r.users.len(),
                users = if r.users.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", r.users.iter().map(|(u, d)| format!("{u} in {}", d.display())).collect::<Vec<_>>().join(", "))
                }
            );
            if !r.users_elsewhere.is_empty() {
                eprintln!(
                    "starling: no credentials here to re-issue for user(s) {}: give them new ones (`user revoke`, `user add`) before --finish",
                    r.users_elsewhere.join(", ")
                );
            }
            println!("{}", r.fingerprint);
            Ok(0)
        }
        Cmd::Ca(CaCmd::Rotate { finish: true, auth }) => {
            admin_auth_dir(&cfg, auth)?.finish_rotation()?;
            eprintln!("starling: the previous CA is retired: its certificates are refused from now on");
            Ok(0)
        }
        Cmd::Host(HostCmd::Revoke { host, auth }) => {
            let serial = admin_auth_dir(&cfg, auth)?.revoke("host", &host)?;
            eprintln!("starling: host {host}'s certificate (serial {serial}) revoked; the head refuses it and drops its connection");
            Ok(0)
        }
        Cmd::Owner(a) => {
            init_logging(cfg.log.as_deref(), "warn");
            owner::run(&cfg, &a.host, a.active, a.idle, a.command)
        }
        Cmd::Head(a) => {
            daemon_ignores_sigpipe();
            init_logging(cfg.log.as_deref(), "info");
            let mut settings = cfg.head.clone();
            settings.listen = a.listen.unwrap_or(settings.listen);
            settings.agents.extend(a.agents);
            for f in &a.facts {
                let (k, v) = f.split_once('=').context("--fact takes KEY=VALUE")?;
                settings.facts.push((k.to_string(), v.to_string()));
            }
            settings.state = a.state.unwrap_or(settings.state);
            settings.cache_mib = a.cache_mib.unwrap_or(settings.cache_mib);
            settings.relay_cache &= !a.no_relay_cache;
            settings.peer_referrals = a.peer_referrals.unwrap_or(settings.peer_referrals);
            if a.metrics.is_some() {
                settings.metrics = a.metrics;
            }
            if a.init {
                let dir = a.auth.as_ref().expect("clap: --init requires --auth");
                starling_auth::AuthDir::new(dir).init()?;
                eprintln!(
                    "starling: made the cluster's CA and certificates in {d}. Run the head with `starling head --auth {d}`; \
                     give each agent host ca.pem, agent.pem and agent.key (README, Authentication)",
                    d = dir.display()
                );
                return Ok(0);
            }
            if a.auth.is_some() {
                settings.auth = a.auth;
            }
            if a.socket.is_some() {
                settings.socket = a.socket;
            }
            settings.root_tasks &= !a.no_root_tasks;
            runtime().block_on(starling_head::run(settings))?;
            Ok(0)
        }
    }
}

/// The credentials directory the administrator's commands work on: --auth, else head.auth,
/// else the embedded cluster's (made by `starling up`).
fn admin_auth_dir(cfg: &starling_config::Config, arg: AuthDirArg) -> Result<starling_auth::AuthDir> {
    let dir = match arg.auth.or_else(|| cfg.head.auth.clone()) {
        Some(d) => d,
        None => {
            let local = LocalCluster::new(cfg.instance, cfg.dirs()).run_dir.join(starling_cluster::AUTH_DIR);
            if !local.exists() {
                anyhow::bail!("no credentials directory: pass --auth DIR (the head's --auth), or set head.auth");
            }
            local
        }
    };
    let dir = starling_auth::AuthDir::new(dir);
    if !dir.ca_key().exists() {
        anyhow::bail!("{} holds no cluster CA key (ca.key): run this on the head's machine, with the head's --auth DIR", dir.dir.display());
    }
    Ok(dir)
}

/// The home agent's mounts (its tasks' views and overlays) in a mount namespace of its own,
/// propagating nothing back to the machine's. Must run before any thread is started.
fn private_mounts() -> Result<()> {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).context("unshare(CLONE_NEWNS) for the home agent")?;
    nix::mount::mount(None::<&str>, "/", None::<&str>, nix::mount::MsFlags::MS_REC | nix::mount::MsFlags::MS_PRIVATE, None::<&str>)
        .context("making the home agent's mounts private")?;
    Ok(())
}

/// `exec --roam`'s profile: the file given, else the generic one.
fn roam_profile(file: Option<&std::path::Path>) -> Result<starling_client::exec::Roam> {
    use starling_client::roam::Profile;
    Ok(match file {
        Some(f) => {
            let text = std::fs::read_to_string(f).with_context(|| format!("reading the profile {}", f.display()))?;
            let profile = Profile::parse(&text).with_context(|| format!("{}", f.display()))?;
            starling_client::exec::Roam { profile, name: f.display().to_string() }
        }
        None => starling_client::exec::Roam { profile: Profile::generic(), name: "generic".into() },
    })
}

/// The home site is registered with the head: start it if it is not (an embedded cluster's).
async fn ensure_home(cfg: &Config, target: &Target) -> Result<()> {
    let has_home = |s: &starling_proto::ClusterStatus| s.hosts.iter().any(|h| h.home);
    if has_home(&fetch_status(target).await?) {
        return Ok(());
    }
    let local = LocalCluster::new(cfg.instance, cfg.dirs());
    let pid = local.start_home().context("starting the home site")?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if has_home(&fetch_status(target).await?) {
            return Ok(());
        }
        if std::time::Instant::now() > deadline || !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            anyhow::bail!(
                "the home site (agent pid {pid}) did not register with the head; its log is {}",
                starling_cluster::log_path(&local.run_dir, starling_cluster::HOME_SITE).display()
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// An agent started without root (as Slurm starts job steps) moves into a user namespace and a
/// mount namespace of its own, where its user is 0: there it may mount each task's FUSE view and
/// overlay and give tasks their namespaces; the tasks run as that user. Needs `/dev/fuse`
/// read-write for the user (most distributions ship it so; an admin grants it once otherwise).
/// Returns whether it did (false: already root). Must run before any thread is started.
fn enter_rootless_namespace() -> Result<bool> {
    // SAFETY: geteuid/getegid have no preconditions and cannot fail.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    if uid == 0 {
        return Ok(false);
    }
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/fuse") {
        anyhow::bail!(
            "the agent runs without root (uid {uid}) and cannot open /dev/fuse ({e}): an admin grants it once, \
             e.g. `setfacl -m u:$(id -un {uid}):rw /dev/fuse` (or run the agent as root)"
        );
    }
    // SAFETY: unshare takes no pointers; the process is single-threaded here (main() has started
    // no thread yet), which CLONE_NEWUSER requires.
    if unsafe { libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) } != 0 {
        let e = std::io::Error::last_os_error();
        anyhow::bail!("the agent runs without root (uid {uid}) and cannot create a user namespace ({e}): this kernel or its settings (user.max_user_namespaces, kernel.unprivileged_userns_clone) forbid it; run the agent as root");
    }
    std::fs::write("/proc/self/setgroups", "deny").context("writing /proc/self/setgroups")?;
    std::fs::write("/proc/self/uid_map", format!("0 {uid} 1")).context("writing /proc/self/uid_map")?;
    std::fs::write("/proc/self/gid_map", format!("0 {gid} 1")).context("writing /proc/self/gid_map")?;
    // Our mounts stay ours.
    // SAFETY: all pointers are NUL-terminated literals or null, as mount(2) allows for MS_PRIVATE.
    let rc = unsafe {
        libc::mount(std::ptr::null(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null())
    };
    if rc != 0 {
        anyhow::bail!("making the agent's mounts private: {}", std::io::Error::last_os_error());
    }
    log::info!("running without root: uid {uid} is 0 in the agent's own user namespace");
    Ok(true)
}

/// Hidden `__link --listen A --target B --profile P --stats FILE`: the emulated WAN link relay.
fn link_main(args: &[String]) -> ! {
    daemon_ignores_sigpipe();
    init_logging(None, "info");
    let get = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let (Some(listen), Some(target), Some(profile)) = (get("--listen"), get("--target"), get("--profile")) else {
        eprintln!("starling __link: internal: needs --listen, --target and --profile");
        std::process::exit(2);
    };
    let profile = match starling_link::Profile::parse(&profile) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("starling __link: {e:#}");
            std::process::exit(2);
        }
    };
    let counters = std::sync::Arc::new(starling_link::Counters::default());
    let res = runtime().block_on(async {
        if let Some(stats) = get("--stats") {
            tokio::spawn(starling_link::publish_counters(stats.into(), profile, counters.clone()));
        }
        log::info!("link {listen} -> {target}: {}", profile.describe());
        let l = tokio::net::TcpListener::bind(&listen)
            .await
            .map_err(|source| anyhow::Error::from(starling_link::LinkError::Listen { addr: listen.clone(), source }))?;
        // With the cluster's credentials: local users through a Unix socket, the relay's certificate to the head.
        let auth = match (get("--auth"), get("--socket")) {
            (Some(dir), Some(sock)) => {
                let dir = starling_auth::AuthDir::new(dir);
                dir.connector(starling_auth::Role::Relay)?; // fail now if they are unusable
                let _ = std::fs::remove_file(&sock);
                let socket = tokio::net::UnixListener::bind(&sock).with_context(|| format!("binding {sock}"))?;
                std::fs::set_permissions(&sock, std::os::unix::fs::PermissionsExt::from_mode(0o666))
                    .with_context(|| format!("chmod {sock}"))?;
                Some(starling_link::RelayAuth { socket, dir })
            }
            _ => None,
        };
        starling_link::run_relay_with(l, auth, target, profile, counters).await.map_err(anyhow::Error::from)
    });
    if let Err(e) = res {
        eprintln!("starling __link: {e:#}");
    }
    std::process::exit(1);
}

/// A job's context and options: the client settings with the flags applied.
fn job_context(cfg: &mut Config, f: JobFlags) -> Result<(Context, starling_client::job::JobOptions)> {
    use starling_client::job::Report;
    cfg.client.compress &= !f.no_compress;
    cfg.client.prethrow &= !f.no_prethrow;
    let ctx = client_context(cfg, f.cluster)?;
    let report = if f.json {
        Report::Json
    } else if f.quiet {
        Report::Quiet
    } else {
        Report::Auto
    };
    Ok((ctx, starling_client::job::JobOptions { prethrow_per_task: f.prethrow_per_task, report }))
}

fn nix_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_else(|_| "host".into())
}

/// A task id as `starling ps` prints it (`t123`), or just its number.
fn parse_task(s: &str) -> Result<starling_proto::TaskId> {
    let n = s.strip_prefix('t').unwrap_or(s);
    n.parse().map(starling_proto::TaskId).map_err(|_| anyhow::anyhow!("{s:?} is not a task id (see `starling ps`)"))
}

/// Send one request to the head and wait for the reply `pick` accepts.
async fn ask<T>(target: &Target, req: Msg, mut pick: impl FnMut(Msg) -> Option<T>) -> Result<T> {
    let (mut incoming, tx) = starling_session::connect(target).await?;
    tx.send(req).await.ok();
    loop {
        let m = incoming.recv().await.context("reading the head's reply")?;
        if let Msg::Error { message, .. } = &m {
            anyhow::bail!("head: {message}");
        }
        if let Some(v) = pick(m) {
            return Ok(v);
        }
    }
}

fn human_bytes(b: f64) -> String {
    match b {
        b if b >= (1u64 << 30) as f64 => format!("{:.1} GiB", b / (1u64 << 30) as f64),
        b if b >= (1u64 << 20) as f64 => format!("{:.1} MiB", b / (1u64 << 20) as f64),
        b if b >= 1024.0 => format!("{:.1} KiB", b / 1024.0),
        b => format!("{b:.0} B"),
    }
}

fn human_duration(s: f64) -> String {
    // Whole seconds, saturating (a negative or NaN age reads as 0).
    let t = std::time::Duration::try_from_secs_f64(s).map_or(0, |d| d.as_secs());
    match s {
        s if s >= 3600.0 => format!("{}h{:02}m", t / 3600, (t % 3600) / 60),
        s if s >= 60.0 => format!("{}m{:02}s", t / 60, t % 60),
        s => format!("{s:.1}s"),
    }
}

async fn ps(json: bool, target: &Target) -> Result<i32> {
    let rows = ask(target, Msg::PsRequest, |m| match m {
        Msg::PsReply(rows) => Some(rows),
        _ => None,
    })
    .await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(0);
    }
    // Host and state columns as wide as their longest value ("moving to h12", "queued for rerun 2 (IE)").
    let hw = rows.iter().map(|r| r.host.chars().count()).max().unwrap_or(0).max(8);
    let sw = rows.iter().map(|r| r.state.chars().count()).max().unwrap_or(0).max(14);
    // Roaming tasks (`exec --roam`): where each is, and why, as the last column.
    let roaming = rows.iter().any(|r| r.roam.is_some());
    println!(
        "{:<20} {:<12} {:<hw$} {:<sw$} {:>8} {:>10} {:>8}  COMMAND{}",
        "TASK",
        "JOB",
        "HOST",
        "STATE",
        "CPU",
        "RSS",
        "TIME",
        if roaming { "  SITE/REASON" } else { "" }
    );
    for r in &rows {
        let why = match (&r.roam, roaming) {
            // "direct": its terminal talks to its client here, not through the head.
            (Some(l), _) => format!("  {}{}: {}", r.host, if r.direct == Some(true) { " (direct)" } else { "" }, l.reason),
            (None, true) => "  -".to_string(),
            (None, false) => String::new(),
        };
        println!(
            "{:<20} {:<12} {:<hw$} {:<sw$} {:>8} {:>10} {:>8}  {}{why}",
            r.task.to_string(),
            r.job.as_deref().unwrap_or("-"),
            r.host,
            r.state,
            r.cpu_seconds.map_or("?".into(), human_duration),
            r.rss_bytes.map_or("?".into(), |b| human_bytes(b as f64)),
            human_duration(r.runtime_seconds),
            r.command
        );
    }
    if rows.is_empty() {
        println!("(no tasks running)");
    }
    Ok(0)
}

/// `ps --why TASK`: a roaming task's decisions, with the sensors behind each.
async fn ps_why(task: starling_proto::TaskId, json: bool, target: &Target) -> Result<i32> {
    let rows = ask(target, Msg::PsRequest, |m| match m {
        Msg::PsReply(rows) => Some(rows),
        _ => None,
    })
    .await?;
    let row = rows.into_iter().find(|r| r.task == task).with_context(|| format!("no running task {task} (see `starling ps`)"))?;
    let Some(log) = row.roam else {
        anyhow::bail!("task {task} does not roam (it was not started with `starling exec --roam`)");
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({"task": task, "host": row.host, "reason": log.reason, "decisions": log.decisions}))?);
        return Ok(0);
    }
    println!("{task} runs on {}: {}", row.host, log.reason);
    for d in &log.decisions {
        let secs = d.at_ms.div_euclid(1000);
        let when = format!("{:02}:{:02}:{:02}.{:03}", secs.rem_euclid(86400) / 3600, secs.rem_euclid(3600) / 60, secs.rem_euclid(60), d.at_ms.rem_euclid(1000));
        let sensors: Vec<String> = d.sensors.iter().map(|(k, v)| format!("{k}={v:.2}")).collect();
        println!(
            "{when} UTC  {:<7} {} -> {} ({} -> {})  {}{}",
            d.action,
            d.from_site,
            d.to_site,
            d.from_state,
            d.to_state,
            d.reason,
            if sensors.is_empty() { String::new() } else { format!("  [{}]", sensors.join(" ")) }
        );
    }
    Ok(0)
}

async fn migrate(task: starling_proto::TaskId, to: Option<String>, stop_and_copy: bool, json: bool, target: &Target) -> Result<i32> {
    let result = ask(target, Msg::Migrate { task, to, stop_and_copy }, |m| match m {
        Msg::MigrateReply { task: t, result } if t == task => Some(result),
        _ => None,
    })
    .await?;
    match result {
        Ok(r) => {
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                let page = 4096.0;
                println!(
                    "moved {} from {} to {}: pause {:.1} ms; memory {} ({} copied while it ran, in {} round(s); {} after the switch); files and I/O {}; {} in all",
                    r.task,
                    r.from,
                    r.to,
                    r.pause_ms,
                    human_bytes(r.memory_bytes as f64),
                    human_bytes(r.precopy_pages as f64 * page),
                    r.rounds + 1,
                    human_bytes(r.postcopy_pages as f64 * page),
                    human_bytes(r.state_bytes as f64),
                    human_duration(r.total_ms / 1e3)
                );
            }
            if let Some(why) = &r.unisolated {
                eprintln!(
                    "starling: task {} runs on {} with that host's whole network, not its ticket's own: {why} (fork.isolate_network = required refuses such a move)",
                    r.task, r.to
                );
            }
            Ok(0)
        }
        Err(why) => {
            if json {
                println!("{}", serde_json::json!({"error": why}));
            }
            eprintln!("starling: {why}");
            Ok(1)
        }
    }
}

async fn fetch_status(target: &Target) -> Result<starling_proto::ClusterStatus> {
    let (mut incoming, tx) = starling_session::connect(target).await?;
    tx.send(Msg::StatusRequest).await.ok();
    loop {
        match incoming.recv().await.context("reading the head's reply")? {
            Msg::StatusReply(s) => return Ok(s),
            Msg::Error { message, .. } => anyhow::bail!("head: {message}"),
            _ => {}
        }
    }
}

async fn status(json: bool, target: &Target) -> Result<i32> {
    let mut st = fetch_status(target).await?;
    // The home site (`exec --roam`) is this machine, not a host of the cluster: shown apart.
    let home = st.hosts.iter().position(|h| h.home).map(|i| st.hosts.remove(i));
    let local = target.record.as_ref();
    let slurm = local.and_then(|l| l.slurm.as_ref());
    let mut network = serde_json::Map::new();
    if let Some(l) = local.filter(|_| slurm.is_none()) {
        network.insert("bridge".into(), l.bridge.clone().into());
        network.insert("subnet".into(), l.subnet.clone().into());
    }
    for (k, v) in &st.facts {
        network.insert(k.clone(), v.clone().into());
    }
    if let Some(l) = local.filter(|_| slurm.is_none()) {
        let link = l.link.as_ref().map_or("lan", |k| k.profile.as_str()).to_string();
        let desc = starling_link::Profile::parse(&link).map(|p| p.describe()).unwrap_or(link.clone());
        network.insert("link".into(), link.into());
        network.insert("link_detail".into(), desc.into());
        if let Some(bits) = l.host_link_bits {
            network.insert("host_link".into(), starling_cluster::HostLink { bits_per_sec: bits }.describe().into());
        }
        if let Some(bytes) = l.link.as_ref().and_then(|k| std::fs::read(&k.stats_file).ok()) {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) {
                network.insert("link_counters".into(), v["counters"].clone());
            }
        }
    }
    if json {
        let hosts: Vec<_> = st
            .hosts
            .iter()
            .map(|h| {
                serde_json::json!({"name": h.name, "address": h.addr, "pid": h.pid, "cores": h.cores,
                    "mem_bytes": h.mem_bytes, "load": h.load, "running": h.running,
                    "page_distribution": h.page_distribution, "owner": h.owner, "peer": h.peer,
                    "isolates_network": h.cannot_isolate.is_none(), "cannot_isolate": h.cannot_isolate})
            })
            .collect();
        let home = home.map(|h| serde_json::json!({"name": h.name, "address": h.addr, "pid": h.pid, "cores": h.cores, "running": h.running}));
        let mut out = serde_json::json!({"head": st.head, "network": network, "hosts": hosts, "home": home});
        if let Some(s) = slurm {
            out["slurm"] = serde_json::json!({"job_id": s.job_id, "nodes": s.nodes, "partition": s.partition,
                "submitted": s.submitted, "output": s.output});
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(0);
    }
    let field = |k: &str| network.get(k).and_then(|v| v.as_str()).unwrap_or("?").to_string();
    if let Some(s) = slurm {
        println!(
            "head {}   slurm job {} on {}{}",
            st.head,
            s.job_id,
            if s.nodes.is_empty() { "(no nodes yet)".to_string() } else { s.nodes.join(",") },
            s.partition.as_ref().map_or(String::new(), |p| format!(" (partition {p})"))
        );
    } else {
        println!("head {}   bridge {}   subnet {}", st.head, field("bridge"), field("subnet"));
    }
    if network.contains_key("link") {
        println!("link {}: {}", field("link"), field("link_detail"));
    }
    if network.contains_key("host_link") {
        println!("host links: {} each (tbf)", field("host_link"));
    }
    // PEERS: the port the host serves other hosts its chunks on, or off (agent.peers).
    println!("{:<8} {:<16} {:>8} {:>5} {:>6} {:>8} {:>9} {:>6}", "HOST", "ADDRESS", "PID", "CORES", "LOAD", "RUNNING", "MEMORY", "PEERS");
    for h in &st.hosts {
        let peers = h.peer.as_deref().and_then(|p| p.rsplit_once(':')).map_or("off", |(_, port)| port);
        println!(
            "{:<8} {:<16} {:>8} {:>5} {:>6.2} {:>8} {:>7.1}Gi {:>6}",
            h.name, h.addr, h.pid, h.cores, h.load, h.running, h.mem_bytes as f64 / (1u64 << 30) as f64, peers
        );
    }
    if st.hosts.is_empty() {
        println!("(no hosts connected)");
    }
    // fork.isolate_network: hosts whose clones get their host's whole network (or, `required`, none).
    for h in st.hosts.iter().filter(|h| !h.home) {
        if let Some(why) = &h.cannot_isolate {
            println!("{}: cannot enforce a fork ticket's own network ({why}); its clones run with the host's network", h.name);
        }
    }
    if let Some(h) = &home {
        println!("home site (exec --roam): {} at {}, agent pid {}, {} cores, {} running", h.name, h.addr, h.pid, h.cores, h.running);
    }
    // Linger-Longer: each host's owner and what its guests do about it.
    if !st.hosts.is_empty() {
        println!("{:<8} {:<13} {:>9} {:>9} {:<8} {:<6} DOING", "HOST", "OWNER", "OWNER-CPU", "GUEST-CPU", "KEYBOARD", "POLICY");
        for h in &st.hosts {
            match &h.owner {
                Some(o) => println!(
                    "{:<8} {:<13} {:>8.0}% {:>8.0}% {:<8} {:<6} {}",
                    h.name,
                    o.state,
                    o.cpu * 100.0,
                    o.guest_cpu * 100.0,
                    o.keyboard,
                    o.policy,
                    o.doing
                ),
                None => println!("{:<8} {:<13} {:>9} {:>9} {:<8} {:<6} no guest cgroup: tasks are not contained", h.name, "?", "-", "-", "-", "-"),
            }
        }
        for h in &st.hosts {
            if let Some(w) = h.owner.as_ref().and_then(|o| o.rate_windows.as_deref()) {
                println!("{}: guests' rate windows applied (owner doing disk I/O): {w}", h.name);
            }
        }
    }
    // Remote fork: how each host's last clone got its pages (a fallback to
    // unicast because multicast does not pass is said here and in the logs).
    let dist: Vec<String> =
        st.hosts.iter().filter_map(|h| Some(format!("{} {}", h.name, h.page_distribution.as_deref()?))).collect();
    if !dist.is_empty() {
        println!("page distribution (last clone per host): {}", dist.join(", "));
    }
    Ok(0)
}

/// Arguments `up` gives the head: the relay cache switch and the metrics address.
fn head_args(cfg: &Config, no_relay_cache: bool, metrics: Option<&str>, no_root_tasks: bool, peer_referrals: Option<u32>) -> Vec<String> {
    let mut args = Vec::new();
    if let Some(n) = peer_referrals {
        args.extend(["--peer-referrals".to_string(), n.to_string()]);
    }
    if no_root_tasks || !cfg.head.root_tasks {
        args.push("--no-root-tasks".to_string());
    }
    if no_relay_cache || !cfg.head.relay_cache {
        args.push("--no-relay-cache".to_string());
    }
    // The dashboard and /metrics: where asked, else on a free port of this machine's loopback.
    let m = metrics.or(cfg.head.metrics.as_deref()).unwrap_or("127.0.0.1:0");
    args.extend(["--metrics".to_string(), m.to_string()]);
    args
}

fn up(cfg: &Config, a: UpArgs) -> Result<i32> {
    if a.slurm {
        return up_slurm(cfg, a);
    }
    if a.hosts == 0 || a.hosts > 64 {
        anyhow::bail!("--hosts must be between 1 and 64");
    }
    let exe = std::env::current_exe().context("locating the starling binary")?;
    let local = LocalCluster::new(cfg.instance, cfg.dirs());
    // The record must say whether the head keeps a relay cache, whichever way it was switched off.
    let head_args = head_args(cfg, a.no_relay_cache, a.metrics.as_deref(), a.no_root_tasks, a.peer_referrals);
    let mut agent_args = match &a.policy {
        Some(p) => vec!["--policy".to_string(), p.as_str().to_string()],
        None => Vec::new(),
    };
    agent_args.extend(a.peers.agent_args());
    let opts = UpOptions {
        head_args,
        agent_args,
        link: Some(a.link.clone()),
        insecure: a.insecure,
        host_link: a.host_link,
        mtu: a.mtu,
        ..local.options(a.hosts, exe)
    };
    let state = local.up(&opts)?;
    let target = Target::embedded(state.clone());
    // Wait until every agent has registered with the head.
    let rt = runtime();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let st = rt.block_on(fetch_status(&target));
        if let Ok(s) = &st {
            if s.hosts.len() >= state.hosts.len() {
                break;
            }
        }
        if std::time::Instant::now() > deadline {
            let _ = local.down();
            anyhow::bail!(
                "the cluster did not come up within 30 s ({}); logs are in {}/logs",
                match st {
                    Ok(s) => format!("{} of {} hosts registered", s.hosts.len(), state.hosts.len()),
                    Err(e) => one_line(&e),
                },
                local.run_dir.display()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    println!("starling cluster up: {} hosts, head at {}", state.hosts.len(), state.head_addr);
    rt.block_on(status(false, &target))?;
    Ok(0)
}

/// `up --slurm`: start the head, submit the job (or the step), wait until every node's agent registered.
fn up_slurm(cfg: &Config, a: UpArgs) -> Result<i32> {
    use starling_cluster::slurm::{self, SlurmRequest};
    if a.nodes == Some(0) {
        anyhow::bail!("-N must be at least 1");
    }
    if !a.peers.agent_args().is_empty() {
        anyhow::bail!("--no-peers and --peer-port are for emulated hosts; the job's agents take agent.peers and agent.peer_port from their configuration (STARLING_PEERS, STARLING_PEER_PORT pass through srun)");
    }
    let local = LocalCluster::new(cfg.instance, cfg.dirs());
    let head_args = head_args(cfg, a.no_relay_cache, a.metrics.as_deref(), a.no_root_tasks, a.peer_referrals);
    // The edge reads Slurm's environment: inside an allocation, use it.
    let existing_job = std::env::var("SLURM_JOB_ID").ok().filter(|j| !j.is_empty());
    let req = SlurmRequest {
        nodes: a.nodes,
        partition: a.partition,
        time: a.time,
        account: a.account,
        listen: a.listen,
        existing_job: existing_job.clone(),
        conf: std::env::var_os("SLURM_CONF").map(PathBuf::from),
        exe: std::env::current_exe().context("locating the starling binary")?,
        head_args,
    };
    let state = local.slurm_up(&req)?;
    let rec = state.slurm.clone().context("internal: the Slurm record is missing")?;
    let how = if existing_job.is_some() { "a step of the allocation" } else { "submitted" };
    eprintln!("starling: head at {}; Slurm job {} ({how})", state.head_addr, rec.job_id);
    let target = Target::embedded(state.clone());
    let rt = runtime();
    let started = std::time::Instant::now();
    let deadline = started + std::time::Duration::from_secs(a.wait);
    let mut last = String::new();
    let fail = |why: String| -> anyhow::Error {
        let tail = slurm::output_tail(&rec).map_or(String::new(), |t| format!("\n{t}"));
        let _ = local.down();
        anyhow::anyhow!("{why} (the job was cancelled and the head stopped){tail}")
    };
    // The head is asked every 200 ms; Slurm (a shared controller) every 200 ms only until the job
    // runs, then every 2 s to notice it ending.
    let mut asked: Option<(std::time::Instant, Option<slurm::JobInfo>)> = None;
    let nodes = loop {
        let registered: Vec<String> =
            rt.block_on(fetch_status(&target)).map(|s| s.hosts.into_iter().map(|h| h.name).collect()).unwrap_or_default();
        let fresh = match &asked {
            Some((at, Some(j))) => j.state != "RUNNING" || at.elapsed() >= std::time::Duration::from_secs(2),
            _ => true,
        };
        if fresh {
            let j = slurm::job_info(rec.conf.as_deref(), &rec.job_id)
                .map_err(|e| fail(format!("asking Slurm about job {}: {e}", rec.job_id)))?;
            asked = Some((std::time::Instant::now(), j));
        }
        let job = asked.as_ref().and_then(|(_, j)| j.clone());
        let Some(job) = job.clone().filter(|j| j.active()) else {
            let state = job.map_or("gone from squeue".to_string(), |j| j.state);
            return Err(fail(format!("Slurm job {} ended ({state}) before its agents registered", rec.job_id)));
        };
        if let Some(why) = job.hopeless() {
            return Err(fail(format!(
                "Slurm will not start job {}: pending ({why}): the request exceeds what the partition, account or QOS allows (see `scontrol show partition`)",
                rec.job_id
            )));
        }
        if let Some(pid) = rec.srun_pid {
            if !starling_cluster::procs::is_alive(pid) {
                return Err(fail(format!("the agents' srun (pid {pid}) exited before they registered")));
            }
        }
        // Inside an allocation the step may use fewer nodes than it has.
        let want = if rec.submitted { job.nodes.len() } else { a.nodes.map_or(job.nodes.len(), |n| usize::try_from(n).unwrap_or(usize::MAX)) };
        let have = job.nodes.iter().filter(|n| registered.contains(n)).count();
        let line = match job.state.as_str() {
            "RUNNING" => format!("Slurm job {} running on {}: {have} of {want} agents registered", rec.job_id, job.nodes.join(",")),
            s => format!("Slurm job {} {}{}", rec.job_id, s.to_lowercase(), job.reason.as_ref().map_or(String::new(), |r| format!(" ({r})"))),
        };
        if job.state == "RUNNING" && want > 0 && have >= want {
            break job.nodes.into_iter().filter(|n| registered.contains(n)).collect::<Vec<_>>();
        }
        if line != last {
            eprintln!("starling: {line}");
            last = line;
        }
        if std::time::Instant::now() > deadline {
            let missing: Vec<&String> = job.nodes.iter().filter(|n| !registered.contains(n)).collect();
            let what = if job.state == "RUNNING" {
                format!("no agent registered from {}", missing.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", "))
            } else {
                format!("the job is still {}", job.state.to_lowercase())
            };
            return Err(fail(format!("not up after {} s: Slurm job {}: {what}", a.wait, rec.job_id)));
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let state = local.slurm_record_nodes(nodes.clone())?;
    println!(
        "starling cluster up: Slurm job {} on {} ({} agents, {:.1} s), head at {}",
        rec.job_id,
        nodes.join(","),
        nodes.len(),
        started.elapsed().as_secs_f64(),
        state.head_addr
    );
    rt.block_on(status(false, &Target::embedded(state)))?;
    Ok(0)
}
