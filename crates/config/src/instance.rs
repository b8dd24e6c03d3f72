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
}
