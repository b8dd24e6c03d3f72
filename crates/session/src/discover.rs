//! Finding the cluster: `--cluster ADDR`, then `$STARLING_CLUSTER`, then the
//! embedded local cluster's state file written by `starling up`.

use anyhow::{bail, Result};

pub const RUN_DIR: &str = "/run/starling";

/// The run dir of the embedded cluster this process means (`STARLING_INSTANCE`).
pub fn run_dir() -> std::path::PathBuf {
    match std::env::var("STARLING_INSTANCE") {
        Ok(n) if !n.is_empty() => format!("{RUN_DIR}-{n}").into(),
        _ => RUN_DIR.into(),
    }
}

#[derive(serde::Deserialize)]
struct StateFile {
    head_addr: String,
    #[serde(default)]
    extra: std::collections::BTreeMap<String, String>,
}

/// A stable name for the cluster's caches, for client-side records of what
/// the cluster holds: the embedded cluster's persistent state dir (its
/// caches survive `down`/`up` and link changes), else the head address.
pub fn cluster_id(flag: Option<&str>, head_addr: &str) -> String {
    if flag.is_some() || std::env::var_os("STARLING_CLUSTER").is_some() {
        return head_addr.to_string();
    }
    std::fs::read(run_dir().join("cluster.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<StateFile>(&b).ok())
        .and_then(|s| s.extra.get("state_dir").cloned())
        .map(|d| format!("embedded:{d}"))
        .unwrap_or_else(|| head_addr.to_string())
}

/// Whether the embedded cluster's head keeps a relay cache (pushing content
/// to a head without one would only waste the link).
pub fn relay_cache_on(flag: Option<&str>) -> bool {
    if flag.is_some() || std::env::var_os("STARLING_CLUSTER").is_some() {
        return true;
    }
    std::fs::read(run_dir().join("cluster.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<StateFile>(&b).ok())
        .map(|s| s.extra.get("relay_cache").map(|v| v != "off").unwrap_or(true))
        .unwrap_or(true)
}

/// The head address to use, or an error telling the user how to get one.
pub fn head_addr(flag: Option<&str>) -> Result<String> {
    if let Some(a) = flag {
        return Ok(a.to_string());
    }
    if let Ok(a) = std::env::var("STARLING_CLUSTER") {
        if !a.is_empty() {
            return Ok(a);
        }
    }
    let path = run_dir().join("cluster.json");
    match std::fs::read(&path) {
        Ok(bytes) => match serde_json::from_slice::<StateFile>(&bytes) {
            Ok(s) => Ok(s.head_addr),
            Err(e) => bail!("{} is unreadable ({e}); run `starling down` then `starling up`", path.display()),
        },
        Err(_) => bail!(no_cluster_message()),
    }
}

pub fn no_cluster_message() -> String {
    "no starling cluster is running: start one with `starling up` (or point to one with --cluster ADDR / STARLING_CLUSTER)".into()
}
