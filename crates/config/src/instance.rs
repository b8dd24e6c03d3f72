//! Which embedded cluster a command means, and where its files are.
//!
//! Several embedded clusters can coexist on one machine (tests, benchmarks,
//! development): instance N (1–9, `STARLING_INSTANCE` / `embedded.instance`)
//! has its own run and state directories (and, in `starling-cluster`, its
//! own bridge, namespaces and subnet); 0 is the default one.

use crate::ConfigError;
use std::path::PathBuf;

/// `cluster.json` and the logs of the default running cluster.
pub const RUN_DIR: &str = "/run/starling";
/// Persistent state of the default cluster: the head's directory and the
/// per-host caches, which survive `down`/`up`.
pub const STATE_DIR: &str = "/var/lib/starling";
/// Name of the record of the running cluster inside the run dir.
pub const CLUSTER_FILE: &str = "cluster.json";
/// Highest instance number.
pub const MAX_INSTANCE: u8 = 9;

/// An embedded cluster's number: 0 (the default) or 1..=[`MAX_INSTANCE`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Instance(u8);

impl Instance {
    /// The instance numbered `n`; refuses numbers past [`MAX_INSTANCE`].
    pub fn numbered(n: u8) -> Result<Instance, ConfigError> {
        if n > MAX_INSTANCE {
            return Err(ConfigError::Instance(n.to_string()));
        }
        Ok(Instance(n))
    }

    /// Parse a setting's text: empty means the default instance.
    pub fn parse(text: &str) -> Result<Instance, ConfigError> {
        let text = text.trim();
        if text.is_empty() {
            return Ok(Instance(0));
        }
        text.parse::<u8>().ok().filter(|n| *n <= MAX_INSTANCE).map(Instance).ok_or_else(|| ConfigError::Instance(text.into()))
    }

    pub fn number(self) -> u8 {
        self.0
    }

    /// `/run/starling` for the default instance, `/run/starling-N` for N.
    pub fn run_dir(self) -> PathBuf {
        numbered_dir(RUN_DIR, self.0)
    }

    /// `/var/lib/starling` for the default instance, `/var/lib/starling-N` for N.
    pub fn state_dir(self) -> PathBuf {
        numbered_dir(STATE_DIR, self.0)
    }

    /// The record of this instance's running cluster.
    pub fn cluster_file(self) -> PathBuf {
        self.run_dir().join(CLUSTER_FILE)
    }
}

fn numbered_dir(base: &str, n: u8) -> PathBuf {
    if n == 0 {
        base.into()
    } else {
        format!("{base}-{n}").into()
    }
}

/// Whose clusters a command starts and finds. Root's embedded clusters live in [`RUN_DIR`] and
/// [`STATE_DIR`]; an ordinary user cannot write there, so the clusters they start themselves (`up
/// --slurm` from a login node) live in their own runtime and state directories, and their commands
/// still find root's cluster when they have none of their own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DirOwner {
    /// Root: the system directories.
    System,
    /// An ordinary user: `$XDG_RUNTIME_DIR/starling` and `$XDG_STATE_HOME/starling` (else
    /// `~/.local/state/starling`), numbered per instance as the system ones are. Without a runtime
    /// directory the run files go beside the state (`~/.local/state/starling-run`), not in a shared
    /// /tmp where another user could make the directory first.
    User { run_base: PathBuf, state_base: PathBuf },
}

impl DirOwner {
    /// The owner for effective uid `euid` with environment `env` (as in [`crate::Sources`]).
    pub fn of(euid: u32, env: &dyn Fn(&str) -> Option<std::ffi::OsString>) -> DirOwner {
        if euid == 0 {
            return DirOwner::System;
        }
        let var = |k: &str| env(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        // No HOME either (a bare service account): a per-uid name; `up` refuses a directory it
        // does not own (crates/cluster).
        let state_base = var("XDG_STATE_HOME")
            .or_else(|| var("HOME").map(|h| h.join(".local/state")))
            .map_or_else(|| PathBuf::from(format!("/tmp/starling-{euid}")), |d| d.join("starling"));
        let run_base = var("XDG_RUNTIME_DIR").map_or_else(|| PathBuf::from(format!("{}-run", state_base.display())), |d| d.join("starling"));
        DirOwner::User { run_base, state_base }
    }
}

/// Where one instance's files are, for one [`DirOwner`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterDirs {
    /// `cluster.json`, logs, the head's socket.
    pub run: PathBuf,
    /// The head's directory, host caches, credentials: kept across `down`/`up`.
    pub state: PathBuf,
    /// For a user: the system run directory of the same instance, where root's cluster is found
    /// when the user has not started one of their own.
    pub system_run: Option<PathBuf>,
}

impl ClusterDirs {
    pub fn new(instance: Instance, owner: &DirOwner) -> ClusterDirs {
        match owner {
            DirOwner::System => ClusterDirs { run: instance.run_dir(), state: instance.state_dir(), system_run: None },
            DirOwner::User { run_base, state_base } => {
                let numbered = |base: &PathBuf| numbered_dir(&base.to_string_lossy(), instance.number());
                ClusterDirs { run: numbered(run_base), state: numbered(state_base), system_run: Some(instance.run_dir()) }
            }
        }
    }

    /// The record of the cluster this owner started.
    pub fn cluster_file(&self) -> PathBuf {
        self.run.join(CLUSTER_FILE)
    }

    /// Where a running cluster's record is looked for, in order: the owner's own, then (for a
    /// user) the system's.
    pub fn cluster_files(&self) -> Vec<PathBuf> {
        let mut v = vec![self.cluster_file()];
        v.extend(self.system_run.as_ref().map(|d| d.join(CLUSTER_FILE)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instances_zero_to_nine_have_their_own_dirs() {
        assert_eq!(Instance::parse("").unwrap().run_dir(), PathBuf::from("/run/starling"));
        assert_eq!(Instance::parse("3").unwrap().state_dir(), PathBuf::from("/var/lib/starling-3"));
        assert_eq!(Instance::parse("9").unwrap().cluster_file(), PathBuf::from("/run/starling-9/cluster.json"));
        for bad in ["10", "x", "-1", "1.5"] {
            assert!(Instance::parse(bad).is_err(), "{bad} accepted");
        }
        assert!(Instance::numbered(10).is_err());
    }

    #[test]
    fn a_user_gets_dirs_of_their_own_and_still_finds_roots_cluster() {
        let env = |k: &str| match k {
            "XDG_RUNTIME_DIR" => Some("/run/user/1000".into()),
            "HOME" => Some("/home/u".into()),
            _ => None,
        };
        assert_eq!(DirOwner::of(0, &env), DirOwner::System);
        let d = ClusterDirs::new(Instance::parse("2").unwrap(), &DirOwner::of(1000, &env));
        assert_eq!(d.run, PathBuf::from("/run/user/1000/starling-2"));
        assert_eq!(d.state, PathBuf::from("/home/u/.local/state/starling-2"));
        assert_eq!(
            d.cluster_files(),
            vec![PathBuf::from("/run/user/1000/starling-2/cluster.json"), PathBuf::from("/run/starling-2/cluster.json")]
        );
        let no_runtime = |k: &str| (k == "HOME").then(|| "/home/u".into());
        let d = ClusterDirs::new(Instance::default(), &DirOwner::of(1000, &no_runtime));
        assert_eq!((d.run, d.state), (PathBuf::from("/home/u/.local/state/starling-run"), PathBuf::from("/home/u/.local/state/starling")));
        let bare = ClusterDirs::new(Instance::default(), &DirOwner::of(1000, &|_: &str| None));
        assert_eq!((bare.run, bare.state), (PathBuf::from("/tmp/starling-1000-run"), PathBuf::from("/tmp/starling-1000")));
        let root = ClusterDirs::new(Instance::default(), &DirOwner::System);
        assert_eq!(root.cluster_files(), vec![PathBuf::from("/run/starling/cluster.json")]);
    }
}
