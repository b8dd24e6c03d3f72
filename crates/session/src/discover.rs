//! Finding the cluster's head: `--cluster ADDR` / `STARLING_CLUSTER` /
//! `client.cluster` (all one setting, resolved by the edge), else the
//! embedded cluster's record written by `starling up`. Resolved once per
//! command into a [`Target`], which carries what else the record says.

use starling_config::{ClientSettings, ClusterState, ClusterDirs, ConfigError};

/// One line telling the user how to get a cluster.
pub const NO_CLUSTER: &str =
    "no starling cluster is running: start one with `starling up` (or point to one with --cluster ADDR / STARLING_CLUSTER)";

#[derive(Debug, thiserror::Error)]
pub enum DiscoverError {
    #[error("{NO_CLUSTER}")]
    NoCluster,
    #[error(transparent)]
    Record(#[from] ConfigError),
}

/// The head a command talks to, and what is known about its cluster.
#[derive(Clone, Debug)]
pub struct Target {
    /// `IP:PORT` to dial.
    pub head_addr: String,
    /// A stable name for the cluster's caches in client-side records of
    /// what it holds: the embedded cluster's state dir (its caches survive
    /// `down`/`up` and link changes), else the head's address.
    pub cluster_id: String,
    /// Whether the head keeps a relay cache (pushing content to a head
    /// without one would only waste the link). Assumed for a named head.
    pub relay_cache: bool,
    /// The embedded cluster's record, when the head was found through it.
    pub record: Option<ClusterState>,
    /// The local socket to dial instead of `head_addr` (the kernel names us to the head).
    pub socket: Option<std::path::PathBuf>,
    /// Credentials for TLS to `head_addr` (the client certificate).
    pub auth: Option<std::path::PathBuf>,
}

impl Target {
    /// The head `client.cluster` names, else the one the first running record in `dirs` names
    /// (a user's own cluster, then root's).
    pub fn resolve(client: &ClientSettings, dirs: &ClusterDirs) -> Result<Target, DiscoverError> {
        if let Some(addr) = client.cluster.as_deref().filter(|a| !a.is_empty()) {
            return Ok(Target { auth: client.auth.clone(), ..Target::named(addr) });
        }
        for file in dirs.cluster_files() {
            if let Some(record) = ClusterState::read(&file)? {
                return Ok(Target::embedded(record));
            }
        }
        Err(DiscoverError::NoCluster)
    }

    /// Whether we reach the head over its own local socket, with no network
    /// between us (an embedded cluster without an emulated link, `up
    /// --slurm`'s head): frames are then not worth compressing.
    pub fn head_is_local(&self) -> bool {
        self.record.as_ref().is_some_and(|r| r.link.is_none()) && self.socket.as_ref().is_some_and(|p| p.exists())
    }

    /// A head given by address.
    pub fn named(addr: &str) -> Target {
        Target {
            head_addr: addr.to_string(),
            cluster_id: addr.to_string(),
            relay_cache: true,
            record: None,
            socket: None,
            auth: None,
        }
    }

    /// The head of an embedded cluster, from its record.
    pub fn embedded(record: ClusterState) -> Target {
        Target {
            head_addr: record.head_addr.clone(),
            cluster_id: record.cluster_id(),
            relay_cache: record.relay_cache,
            socket: record.socket.clone(),
            auth: record.auth.clone(),
            record: Some(record),
        }
    }
}
