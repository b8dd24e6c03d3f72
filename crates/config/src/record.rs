//! The record of a running embedded cluster, `RUN/cluster.json`: written by
//! `starling up`, read by `down` (to find what to remove), `status` and
//! the client side's discovery (where the head is, whether it keeps a
//! relay cache).

use crate::ConfigError;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ClusterState {
    /// `"IP:PORT"` clients dial: the head (on the bridge's address), or the
    /// emulated WAN link in front of it.
    pub head_addr: String,
    pub head_pid: u32,
    pub bridge: String,
    /// `"10.213.0.0/24"`.
    pub subnet: String,
    /// Names `down` looks for (they differ per instance and in tests).
    pub netns_prefix: String,
    pub veth_prefix: String,
    /// Identities (device, inode) of the hosts' network namespaces, so
    /// `down` finds them even when their names are gone.
    pub netns_ids: Vec<(u64, u64)>,
    /// The starling binary the cluster runs.
    pub exe: PathBuf,
    /// The persistent state directory (host caches survive `down`/`up`).
    pub state_dir: PathBuf,
    /// Content-cache bound of each host and of the head's relay cache.
    pub cache_mib_per_host: u64,
    /// Whether the head keeps a relay cache (pushing content to a head
    /// without one would only waste the link).
    pub relay_cache: bool,
    /// The emulated WAN link between clients and the head, if any.
    pub link: Option<LinkRecord>,
    pub hosts: Vec<HostRecord>,
    /// Unix seconds.
    pub started_at: i64,
    /// Set when the hosts are a Slurm allocation's nodes (`starling up --slurm`) rather than
    /// emulated ones: then `bridge`, `subnet`, the prefixes and `hosts` are empty.
    #[serde(default)]
    pub slurm: Option<SlurmRecord>,
    /// The Unix socket local clients dial instead of `head_addr` (the head's,
    /// or the link relay's when there is a link).
    #[serde(default)]
    pub socket: Option<PathBuf>,
    /// The cluster's credentials, when its TCP connections are mutual TLS
    /// (`client.pem` there lets root dial `head_addr` too).
    #[serde(default)]
    pub auth: Option<PathBuf>,
    /// Each host's emulated link rate in bits per second (`starling up
    /// --host-link`), if shaped.
    #[serde(default)]
    pub host_link_bits: Option<u64>,
}

/// The Slurm job whose nodes run the agents (`starling up --slurm`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SlurmRecord {
    /// The job id (`squeue -j`).
    pub job_id: String,
    /// Whether `starling up` submitted the job (then `down` cancels it) or joined an allocation
    /// it was started in (then `down` stops only the agents' step).
    pub submitted: bool,
    /// The `srun` that runs the agents' step, when it runs on this machine (inside an existing
    /// allocation); a submitted job's `srun` runs in the batch script.
    pub srun_pid: Option<u32>,
    /// The allocation's nodes, once the job runs (`scontrol show hostnames` order).
    pub nodes: Vec<String>,
    pub partition: Option<String>,
    /// The agents' step output (`sbatch --output`, or the local `srun`'s log).
    pub output: PathBuf,
    /// Where each node's agent keeps its state: `DIR/NODE`.
    pub agent_state: PathBuf,
    /// The `SLURM_CONF` `up` ran with, used by `down` and `status` wherever they run.
    #[serde(default)]
    pub conf: Option<PathBuf>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct HostRecord {
    /// `h1`, `h2`, ...
    pub name: String,
    pub netns: String,
    pub ip: String,
    /// Pid of the boot process, which became the agent by exec.
    pub boot_pid: u32,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct LinkRecord {
    /// As given to `starling up --link` (`starling_link::Profile::parse` syntax).
    pub profile: String,
    /// The relay process (`starling __link`).
    pub pid: u32,
    /// Where the head itself listens (behind the link).
    pub head_direct: String,
    /// The relay's counters, rewritten while it runs.
    pub stats_file: PathBuf,
}

impl ClusterState {
    /// The record at `path`: `None` if there is none, an error if it is unreadable.
    pub fn read(path: &Path) -> Result<Option<ClusterState>, ConfigError> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(ConfigError::Io { path: path.into(), source }),
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| ConfigError::Record { path: path.into(), source })
    }

    /// Write the record atomically (a reader sees the old one or the new one).
    pub fn write(&self, path: &Path) -> Result<(), ConfigError> {
        let tmp = path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(self).map_err(|source| ConfigError::Record { path: path.into(), source })?;
        std::fs::write(&tmp, bytes).map_err(|source| ConfigError::Io { path: tmp.clone(), source })?;
        std::fs::rename(&tmp, path).map_err(|source| ConfigError::Io { path: path.into(), source })
    }

    /// A stable name for the cluster's caches in client-side records of
    /// what it holds: its persistent state directory (the caches survive
    /// `down`/`up` and link changes).
    pub fn cluster_id(&self) -> String {
        format!("embedded:{}", self.state_dir.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_reads_back_as_written_and_a_missing_one_is_none() {
        let dir = std::env::temp_dir().join(format!("starling-record-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cluster.json");
        assert!(ClusterState::read(&path).unwrap().is_none());
        let state = ClusterState {
            head_addr: "127.0.0.1:7079".into(),
            head_pid: 42,
            bridge: "stbr0".into(),
            subnet: "10.213.0.0/24".into(),
            netns_prefix: "starling-".into(),
            veth_prefix: "stv-".into(),
            netns_ids: vec![(4, 4026532000)],
            exe: "/usr/bin/starling".into(),
            state_dir: "/var/lib/starling".into(),
            cache_mib_per_host: 1024,
            relay_cache: false,
            link: Some(LinkRecord {
                profile: "coffee-shop".into(),
                pid: 43,
                head_direct: "10.213.0.1:7077".into(),
                stats_file: "/run/starling/link.json".into(),
            }),
            hosts: vec![HostRecord { name: "h1".into(), netns: "starling-h1".into(), ip: "10.213.0.11".into(), boot_pid: 44 }],
            started_at: 1,
            host_link_bits: None,
            slurm: Some(SlurmRecord {
                job_id: "12".into(),
                submitted: true,
                srun_pid: None,
                nodes: vec!["sn1".into(), "sn2".into()],
                partition: Some("debug".into()),
                output: "/var/lib/starling/slurm/job-12.out".into(),
                agent_state: "/var/lib/starling/slurm/nodes".into(),
                conf: Some("/etc/slurm/slurm.conf".into()),
            }),
            socket: None,
            auth: None,
        };
        state.write(&path).unwrap();
        assert_eq!(ClusterState::read(&path).unwrap(), Some(state.clone()));
        assert_eq!(state.cluster_id(), "embedded:/var/lib/starling");
        // A record written before the Slurm field existed still reads (as an embedded cluster).
        let mut old: serde_json::Value = serde_json::to_value(&state).unwrap();
        old.as_object_mut().unwrap().remove("slurm");
        std::fs::write(&path, serde_json::to_vec(&old).unwrap()).unwrap();
        assert_eq!(ClusterState::read(&path).unwrap().unwrap().slurm, None);
        std::fs::write(&path, b"{\"head_addr\": 1}").unwrap();
        let e = ClusterState::read(&path).unwrap_err().to_string();
        assert!(e.contains("cluster.json is unreadable") && e.contains("starling down"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
