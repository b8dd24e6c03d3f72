//! `starling up --slurm`: the cluster's hosts are the nodes of a Slurm allocation.
//!
//! Like Ray, Dask-jobqueue or an HTCondor glidein, starling joins the allocation as a job step: the
//! head runs on the submitting machine (listening on its address towards the Slurm controller, or
//! `--listen`), one job is submitted with `sbatch --nodes=N --ntasks-per-node=1 --exclusive` whose
//! script runs `srun --overlap --ntasks-per-node=1 starling agent --head HEAD --name $SLURMD_NODENAME
//! --state DIR/$SLURMD_NODENAME`, so every node runs one agent that dials the head. Started inside an
//! allocation (`$SLURM_JOB_ID`), `starling up --slurm` runs that `srun` itself, as a step of it.
//!
//! The record ([`ClusterState`] with a [`SlurmRecord`]) lets plain `exec`/`run`/`status` find the
//! head and lets `starling down` cancel the job (or stop the step), wait until Slurm has ended it and
//! then remove the head. Slurm's own error messages come back as one line ([`SlurmError::Refused`]).

use crate::sys::Doing;
use crate::{
    cache_mib_per_host, cluster_file, load_state, lock_run_dir, log_path, log_tail, spawn_detached, teardown, wait_listening,
    ClusterError, ClusterState, LocalCluster, Object, Result,
};
use starling_config::{roles, SlurmRecord};
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Slurm's port for slurmctld when its configuration does not say (only used to pick a route).
const SLURMCTLD_PORT: u16 = 6817;
/// How long `down` waits for Slurm to end the job after `scancel` (Slurm's default KillWait is 30 s).
const CANCEL_TIMEOUT: Duration = Duration::from_secs(90);

/// What `starling up --slurm` asks for.
#[derive(Clone, Debug, Default)]
pub struct SlurmRequest {
    /// `--nodes`; `None`: Slurm's default (1), or the whole existing allocation.
    pub nodes: Option<u32>,
    pub partition: Option<String>,
    /// `--time` in Slurm's syntax (`30`, `1:00:00`, `2-0`).
    pub time: Option<String>,
    pub account: Option<String>,
    /// Where the head listens: `IP` or `IP:PORT` that the nodes can reach. Default: this machine's
    /// address on its route to the Slurm controller, and a free port.
    pub listen: Option<String>,
    /// The allocation `starling up` runs in (`$SLURM_JOB_ID`, read by the caller): used instead of
    /// submitting a new job.
    pub existing_job: Option<String>,
    /// `SLURM_CONF` (read by the caller), kept in the record so `down` from another shell reaches
    /// the same Slurm.
    pub conf: Option<PathBuf>,
    /// The starling binary (the nodes run the same path: a shared or identical install).
    pub exe: PathBuf,
    /// Extra arguments appended to `exe head ...`.
    pub head_args: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    #[error("{tool} not found: starling --slurm needs Slurm's commands on this machine (Debian: apt-get install slurm-client)")]
    Missing { tool: &'static str },
    #[error("{tool}: {message}")]
    Refused { tool: &'static str, message: String },
    #[error("cannot run {tool}: {source}")]
    Run {
        tool: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{tool} answered {output:?}, expected {expected}")]
    Unexpected { tool: &'static str, output: String, expected: &'static str },
    #[error("cannot find this machine's address towards the Slurm controller ({why}); name one with --listen IP")]
    NoRoute { why: String },
    #[error("--listen {0:?} is neither an IP address nor IP:PORT")]
    BadListen(String),
}

/// Run a Slurm command (with `SLURM_CONF=conf` if given); its stdout, or its error lines as one line.
fn slurm(conf: Option<&Path>, tool: &'static str, args: &[&str]) -> Result<String, SlurmError> {
    let mut cmd = Command::new(tool);
    if let Some(c) = conf {
        cmd.env("SLURM_CONF", c);
    }
    let out = match cmd.args(args).output() {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(SlurmError::Missing { tool }),
        Err(source) => return Err(SlurmError::Run { tool, source }),
    };
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    Err(SlurmError::Refused { tool, message: one_line(tool, &String::from_utf8_lossy(&out.stderr), out.status) })
}

/// Slurm's messages (`sbatch: error: Batch job submission failed: Invalid partition name specified`)
/// without the tool's prefixes, repeated lines once, in one line.
fn one_line(tool: &str, stderr: &str, status: std::process::ExitStatus) -> String {
    let mut parts: Vec<String> = Vec::new();
    for line in stderr.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let mut l = line;
        for prefix in [format!("{tool}: error: "), format!("{tool}: "), "error: ".to_string()] {
            if let Some(rest) = l.strip_prefix(prefix.as_str()) {
                l = rest;
            }
        }
        if !parts.iter().any(|p| p == l) {
            parts.push(l.to_string());
        }
    }
    if parts.is_empty() {
        format!("failed ({status})")
    } else {
        parts.join("; ")
    }
}

/// A job as `squeue` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobInfo {
    /// `PENDING`, `RUNNING`, `COMPLETING`, `FAILED`...
    pub state: String,
    /// Why it pends (`Resources`, `Priority`...), `None` if Slurm gives none.
    pub reason: Option<String>,
    /// Its nodes, expanded (`sn[1-2]` → `sn1`, `sn2`).
    pub nodes: Vec<String>,
}

impl JobInfo {
    /// Still holding (or waiting for) nodes.
    pub fn active(&self) -> bool {
        matches!(self.state.as_str(), "PENDING" | "CONFIGURING" | "RUNNING" | "COMPLETING" | "SUSPENDED" | "REQUEUED" | "RESIZING")
    }
}

/// Pending reasons that no amount of waiting resolves: the request exceeds what the partition,
/// account or QOS allows per job, or names what does not exist.
const HOPELESS_REASONS: [&str; 11] = [
    "BadConstraints",
    "PartitionConfig",
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "InvalidAccount",
    "InvalidQOS",
    "AccountNotAllowed",
    "QOSMaxNodePerJobLimit",
    "QOSMaxWallDurationPerJobLimit",
    "AssocMaxNodesPerJobLimit",
    "AssocMaxWallDurationPerJobLimit",
];

impl JobInfo {
    /// Why the job will never start, if Slurm says so (`PartitionConfig`: asks for more than the
    /// partition has...).
    pub fn hopeless(&self) -> Option<&str> {
        let r = self.reason.as_deref()?;
        (self.state == "PENDING" && HOPELESS_REASONS.iter().any(|h| r.starts_with(h))).then_some(r)
    }
}

/// The job `job_id`, or `None` once Slurm has forgotten it.
pub fn job_info(conf: Option<&Path>, job_id: &str) -> Result<Option<JobInfo>, SlurmError> {
    let out = match slurm(conf, "squeue", &["-h", "-j", job_id, "--states=all", "-o", "%T|%r|%N"]) {
        Ok(o) => o,
        Err(SlurmError::Refused { message, .. }) if message.contains("Invalid job id") => return Ok(None),
        Err(e) => return Err(e),
    };
    let Some(line) = out.lines().find(|l| !l.trim().is_empty()) else { return Ok(None) };
    let mut f = line.trim().splitn(3, '|');
    let state = f.next().unwrap_or_default().to_string();
    let reason = f.next().filter(|r| !r.is_empty() && *r != "None" && *r != "(null)").map(str::to_string);
    let nodelist = f.next().unwrap_or_default().trim();
    let nodes = if nodelist.is_empty() || nodelist == "(null)" { Vec::new() } else { hostnames(conf, nodelist)? };
    Ok(Some(JobInfo { state, reason, nodes }))
}

/// `scontrol show hostnames LIST`.
pub fn hostnames(conf: Option<&Path>, list: &str) -> Result<Vec<String>, SlurmError> {
    Ok(slurm(conf, "scontrol", &["show", "hostnames", list])?.lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_string).collect())
}

/// This machine's address on its route to the Slurm controller (`SlurmctldHost` of `scontrol show
/// config`): an address the nodes can reach when the controller can reach them.
fn address_towards_controller(conf: Option<&Path>) -> Result<IpAddr, SlurmError> {
    let config = slurm(conf, "scontrol", &["show", "config"])?;
    let value = config
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once('=')?;
            let k = k.trim();
            (k == "SlurmctldHost[0]" || k == "ControlMachine").then(|| v.trim().to_string())
        })
        .ok_or(SlurmError::Unexpected { tool: "scontrol", output: "no SlurmctldHost".into(), expected: "SlurmctldHost[0] = HOST(ADDR)" })?;
    // `host(addr)` or `host`.
    let host = match value.split_once('(') {
        Some((_, rest)) => rest.trim_end_matches(')').to_string(),
        None => value.clone(),
    };
    let port = config
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == "SlurmctldPort").then(|| v.trim().split('-').next().and_then(|p| p.parse().ok()))?
        })
        .unwrap_or(SLURMCTLD_PORT);
    let addr = (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| SlurmError::NoRoute { why: format!("resolving the controller {host}: {e}") })?
        .find(SocketAddr::is_ipv4)
        .ok_or_else(|| SlurmError::NoRoute { why: format!("the controller {host} has no IPv4 address") })?;
    let sock = UdpSocket::bind("0.0.0.0:0").map_err(|e| SlurmError::NoRoute { why: e.to_string() })?;
    sock.connect(addr).map_err(|e| SlurmError::NoRoute { why: format!("no route to the controller {addr}: {e}") })?;
    Ok(sock.local_addr().map_err(|e| SlurmError::NoRoute { why: e.to_string() })?.ip())
}

/// Where the head listens: `--listen` (an IP, or IP:PORT), else the route to the controller; a
/// free port unless one is given.
fn head_listen_addr(conf: Option<&Path>, listen: Option<&str>) -> Result<SocketAddr> {
    let (ip, port) = match listen {
        Some(l) => {
            if let Ok(sa) = l.parse::<SocketAddr>() {
                (sa.ip(), sa.port())
            } else {
                (l.parse::<IpAddr>().map_err(|_| SlurmError::BadListen(l.to_string()))?, 0)
            }
        }
        None => (address_towards_controller(conf)?, 0),
    };
    if port != 0 {
        return Ok(SocketAddr::new(ip, port));
    }
    let probe = TcpListener::bind((ip, 0)).doing(|| format!("binding a port on {ip} for the head"))?;
    Ok(probe.local_addr().doing(|| "reading the probe's port".into())?)
}

/// Quote for `/bin/sh`.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The agents' step: one `starling agent` per node, named after it, with its own state directory.
fn agent_step(exe: &Path, agent_state: &Path, head: SocketAddr, cache_mib: u64) -> Vec<String> {
    let script = r#"n=${SLURMD_NODENAME:-$(hostname -s)}; mkdir -p "$2/$n" && exec "$1" agent --head "$3" --name "$n" --state "$2/$n" --cache-mib "$4""#;
    vec![
        "--overlap".into(),
        "--ntasks-per-node=1".into(),
        "--kill-on-bad-exit=0".into(),
        "/bin/sh".into(),
        "-c".into(),
        script.into(),
        "starling-agent".into(),
        exe.display().to_string(),
        agent_state.display().to_string(),
        head.to_string(),
        cache_mib.to_string(),
    ]
}

impl LocalCluster {
    /// Start the head and the Slurm job (or step) whose nodes run the agents, and write the record.
    /// Returns once the job is submitted; the caller waits for the agents (see [`job_info`]).
    pub fn slurm_up(&self, req: &SlurmRequest) -> Result<ClusterState> {
        let exe = std::fs::canonicalize(&req.exe).doing(|| format!("starling binary {}", req.exe.display()))?;
        let _lock = lock_run_dir(&self.run_dir, false)?;
        if let Some(running) = load_state(&self.run_dir) {
            return Err(ClusterError::AlreadyRunning {
                pid: running.head_pid,
                addr: running.head_addr,
                hosts: running.slurm.as_ref().map_or(running.hosts.len(), |s| s.nodes.len()),
            });
        }
        // Slurm's commands are there and the controller answers before anything is started.
        slurm(req.conf.as_deref(), "squeue", &["-h", "-j", "0", "--states=all"]).or_else(|e| match e {
            SlurmError::Refused { ref message, .. } if message.contains("Invalid job id") => Ok(String::new()),
            e => Err(e),
        })?;
        let head_addr = head_listen_addr(req.conf.as_deref(), req.listen.as_deref())?;
        match self.slurm_start(req, &exe, head_addr) {
            Ok(s) => Ok(s),
            Err(e) => {
                if let Err(cleanup) = teardown(&self.run_dir, &self.state_dir, &self.net) {
                    log::warn!("cleaning up after a failed up --slurm: {cleanup:#}");
                }
                Err(e)
            }
        }
    }

    fn slurm_start(&self, req: &SlurmRequest, exe: &Path, head_addr: SocketAddr) -> Result<ClusterState> {
        let base = self.state_dir.join("slurm");
        let agent_state = base.join("nodes");
        for d in [self.run_dir.join("logs"), base.join("head"), agent_state.clone()] {
            std::fs::create_dir_all(&d).doing(|| format!("mkdir {}", d.display()))?;
        }
        // Outputs of earlier jobs (no cluster of this instance runs): a new Slurm may reuse their ids.
        if let Ok(entries) = std::fs::read_dir(&base) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with("job-") {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let nodes = req.nodes.map_or(1, |n| usize::try_from(n).unwrap_or(usize::MAX));
        let cache_mib = cache_mib_per_host(&self.state_dir, nodes);
        let mut head = Command::new(exe);
        head.arg(roles::HEAD).arg("--listen").arg(head_addr.to_string()).arg("--state").arg(base.join("head"));
        if !req.head_args.iter().any(|a| a.starts_with("--cache-mib")) {
            head.arg("--cache-mib").arg(cache_mib.to_string());
        }
        // Local users through the head's Unix socket (the kernel names them). The agents on the
        // allocation's nodes have no credentials yet: the head's TCP port is unauthenticated
        // (it says so in its log; docs/SECURITY.md).
        head.arg("--socket").arg(self.run_dir.join(crate::HEAD_SOCKET));
        head.args(&req.head_args);
        let head_log = log_path(&self.run_dir, "head");
        let head_pid = spawn_detached(head, &head_log, None)?;
        wait_listening(head_addr, head_pid, &head_log)?;

        let step = agent_step(exe, &agent_state, head_addr, cache_mib);
        let (job_id, srun_pid, output) = match &req.existing_job {
            Some(job) => {
                let mut srun = Command::new("srun");
                if let Some(c) = &req.conf {
                    srun.env("SLURM_CONF", c);
                }
                srun.arg(format!("--jobid={job}"));
                if let Some(n) = req.nodes {
                    srun.arg(format!("--nodes={n}"));
                }
                srun.args(&step);
                let log = log_path(&self.run_dir, "slurm-step");
                let pid = match spawn_detached(srun, &log, None) {
                    Err(ClusterError::Sys(e)) if e.source.kind() == std::io::ErrorKind::NotFound => {
                        return Err(SlurmError::Missing { tool: "srun" }.into())
                    }
                    r => r?,
                };
                (job.clone(), Some(pid), log)
            }
            None => {
                let script = format!(
                    "#!/bin/sh\n# starling agents, one per node of this allocation (written by `starling up --slurm`)\nexec srun {}\n",
                    step.iter().map(|a| sh_quote(a)).collect::<Vec<_>>().join(" ")
                );
                let script_path = self.run_dir.join("slurm-agents.sh");
                std::fs::write(&script_path, script).doing(|| format!("write {}", script_path.display()))?;
                let output = base.join("job-%j.out");
                let mut args = vec![
                    "--parsable".to_string(),
                    "--job-name=starling".into(),
                    "--ntasks-per-node=1".into(),
                    "--exclusive".into(),
                    format!("--output={}", output.display()),
                ];
                if let Some(n) = req.nodes {
                    args.push(format!("--nodes={n}"));
                }
                for (flag, v) in [("partition", &req.partition), ("time", &req.time), ("account", &req.account)] {
                    if let Some(v) = v {
                        args.push(format!("--{flag}={v}"));
                    }
                }
                args.push(script_path.display().to_string());
                let argv: Vec<&str> = args.iter().map(String::as_str).collect();
                let out = slurm(req.conf.as_deref(), "sbatch", &argv)?;
                let id = out.trim().split(';').next().unwrap_or_default().to_string();
                if id.is_empty() || !id.chars().all(|c| c.is_ascii_digit()) {
                    return Err(SlurmError::Unexpected { tool: "sbatch", output: out, expected: "a job id" }.into());
                }
                let output = base.join(format!("job-{id}.out"));
                (id, None, output)
            }
        };
        let state = ClusterState {
            head_addr: head_addr.to_string(),
            head_pid,
            bridge: String::new(),
            subnet: String::new(),
            netns_prefix: String::new(),
            veth_prefix: String::new(),
            netns_ids: Vec::new(),
            exe: exe.to_path_buf(),
            state_dir: self.state_dir.clone(),
            cache_mib_per_host: cache_mib,
            relay_cache: !req.head_args.iter().any(|a| a == "--no-relay-cache"),
            link: None,
            hosts: Vec::new(),
            started_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX)),
            socket: Some(self.run_dir.join(crate::HEAD_SOCKET)),
            auth: None,
            host_link_bits: None,
            slurm: Some(SlurmRecord {
                job_id,
                submitted: req.existing_job.is_none(),
                srun_pid,
                nodes: Vec::new(),
                partition: req.partition.clone(),
                output,
                agent_state,
                conf: req.conf.clone(),
            }),
        };
        state.write(&cluster_file(&self.run_dir))?;
        Ok(state)
    }

    /// Record the allocation's nodes once the agents run.
    pub fn slurm_record_nodes(&self, nodes: Vec<String>) -> Result<ClusterState> {
        let path = cluster_file(&self.run_dir);
        let mut state = ClusterState::read(&path)?.ok_or_else(|| crate::SysError {
            what: format!("reading {}", path.display()),
            source: std::io::ErrorKind::NotFound.into(),
        })?;
        if let Some(s) = state.slurm.as_mut() {
            s.nodes = nodes;
        }
        state.write(&path)?;
        Ok(state)
    }
}

/// The last lines of the agents' step output (for error messages), if it has any.
pub fn output_tail(record: &SlurmRecord) -> Option<String> {
    let text = log_tail(&record.output);
    let lines: Vec<&str> = text.lines().skip(1).collect();
    (!lines.is_empty() && record.output.exists())
        .then(|| format!("last lines of {}:\n{}", record.output.display(), lines[lines.len().saturating_sub(6)..].join("\n")))
}

/// `down`'s Slurm part: cancel the job we submitted (or stop the step we started in an existing
/// allocation) and wait until Slurm has ended it. What was done, or what is still there.
pub(crate) fn stop(record: &SlurmRecord) -> (Vec<Object>, Vec<String>) {
    let mut removed = Vec::new();
    let mut problems = Vec::new();
    if let Some(pid) = record.srun_pid.filter(|p| crate::procs::cmdline(*p).first().is_some_and(|a| a.ends_with("srun"))) {
        // srun passes SIGTERM to the step's tasks and ends the step.
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap_or(0)), nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + CANCEL_TIMEOUT;
        while crate::procs::is_alive(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        removed.push(Object::SlurmStep { job: record.job_id.clone(), srun_pid: pid });
    }
    if !record.submitted {
        return (removed, problems);
    }
    let conf = record.conf.as_deref();
    match slurm(conf, "scancel", &[&record.job_id]) {
        Ok(_) => {}
        Err(SlurmError::Refused { message, .. }) if message.contains("already completed") || message.contains("Invalid job id") => {}
        Err(e) => problems.push(e.to_string()),
    }
    let deadline = Instant::now() + CANCEL_TIMEOUT;
    loop {
        match job_info(conf, &record.job_id) {
            Ok(Some(j)) if j.active() => {}
            Ok(_) => {
                removed.push(Object::SlurmJob(record.job_id.clone()));
                break;
            }
            Err(e) => {
                problems.push(format!("checking job {}: {e}", record.job_id));
                break;
            }
        }
        if Instant::now() > deadline {
            problems.push(format!("Slurm job {} is still active {CANCEL_TIMEOUT:?} after scancel", record.job_id));
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    (removed, problems)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn slurm_errors_become_one_line_without_prefixes() {
        let stderr = "sbatch: error: invalid partition specified: nope\nsbatch: error: Batch job submission failed: Invalid partition name specified\n";
        assert_eq!(
            one_line("sbatch", stderr, std::process::ExitStatus::from_raw(256)),
            "invalid partition specified: nope; Batch job submission failed: Invalid partition name specified"
        );
        assert_eq!(one_line("sbatch", "", std::process::ExitStatus::from_raw(256)), "failed (exit status: 1)");
    }

    #[test]
    fn the_step_quotes_survive_the_shell() {
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
        let step = agent_step(Path::new("/usr/bin/starling"), Path::new("/var/lib/s"), "10.0.0.1:7077".parse().unwrap(), 512);
        assert_eq!(step[..3], ["--overlap", "--ntasks-per-node=1", "--kill-on-bad-exit=0"]);
        assert_eq!(step[7..], ["/usr/bin/starling", "/var/lib/s", "10.0.0.1:7077", "512"]);
    }
}
