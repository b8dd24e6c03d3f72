//! The owner's network bytes, one of the owner I/O that switches the guests'
//! rate windows on ([`crate::window`]).
//!
//! Counted by nftables in the agent's network namespace: a table
//! `starling_NAME_io` holds named counters that every packet sent or received
//! on an interface but `lo` bumps when it matches (sockets are told apart by
//! their cgroup2 group, as the network window does):
//!
//! * an emulated host: the packets of sockets in the owner group
//!   (`starling/NAME/owner` in the cgroup2 mount, which `starling owner HOST
//!   -- CMD` joins). The agent's own traffic (reports, a move's pages) is in
//!   neither group and not counted.
//! * a real host: every packet (`all`) minus those of sockets in any
//!   starling group (`starling/` in the cgroup2 mount: every agent's guests
//!   on the machine). The agent's own transfers count as the owner's: they
//!   are its guests' data, and shaping the guests meanwhile costs them little.
//!
//! The table is installed by [`NetCounters::install`] (a killed agent's is
//! replaced) and removed by [`NetCounters::remove`].

use crate::nft::{delete_inet_table, program, run, CommandError, Nft};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Debug, thiserror::Error)]
pub enum NetIoError {
    #[error("owner network counters: {0}")]
    Command(#[from] CommandError),
    #[error("owner network counters: `nft -j list counters` said something else than counters: {0}")]
    Listing(#[from] serde_json::Error),
    #[error("owner network counters: table {table} has no counter {counter}")]
    NoCounter { table: String, counter: &'static str },
}

/// Whose packets are the owner's.
#[derive(Clone, Debug)]
pub enum NetSource {
    /// An emulated host: sockets in this group (relative to the cgroup2 mount).
    Group(PathBuf),
    /// A real host: everything but sockets in this group (`starling`, every agent's guests).
    AllBut(PathBuf),
}

/// The counters of one agent's namespace.
#[derive(Clone, Debug)]
pub struct NetCounters {
    pub table: String,
    source: NetSource,
}

/// The owner's packets (an emulated host) or every packet (a real host).
const OWNER: &str = "owner";
const ALL: &str = "all";
/// A real host's guests' packets.
const GUESTS: &str = "guests";

/// `starling_NAME_io` (`NAME`: the agent's cgroup name, made an nft identifier).
pub fn table_name(name: &str) -> String {
    format!("starling_{}_io", name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect::<String>())
}

/// `socket cgroupv2 level N "REL"`: a socket in `rel` or below it.
fn in_group(rel: &Path) -> String {
    format!("socket cgroupv2 level {} \"{}\"", rel.components().count(), rel.display())
}

/// The ruleset counting `source`'s packets in table `t`.
fn ruleset(t: &str, source: &NetSource) -> String {
    let mut s = format!(
        "add table inet {t}\n\
         add chain inet {t} out {{ type filter hook output priority 0; policy accept; }}\n\
         add chain inet {t} in {{ type filter hook input priority 0; policy accept; }}\n"
    );
    let (counted, matches): (&[&str], Vec<String>) = match source {
        NetSource::Group(rel) => (&[OWNER], vec![format!(" {}", in_group(rel))]),
        NetSource::AllBut(rel) => (&[ALL, GUESTS], vec![String::new(), format!(" {}", in_group(rel))]),
    };
    for (name, m) in counted.iter().zip(&matches) {
        s += &format!("add counter inet {t} {name}\n");
        for (chain, dir) in [("out", "oifname"), ("in", "iifname")] {
            s += &format!("add rule inet {t} {chain} {dir} != \"lo\"{m} counter name \"{name}\"\n");
        }
    }
    s
}

#[derive(serde::Deserialize)]
struct Listing {
    nftables: Vec<Item>,
}

#[derive(serde::Deserialize)]
struct Item {
    counter: Option<Counter>,
}

#[derive(serde::Deserialize)]
struct Counter {
    name: String,
    bytes: u64,
}

/// `(name, bytes)` of each counter in `nft -j list counters` output.
fn counters(json: &str) -> Result<Vec<(String, u64)>, serde_json::Error> {
    let l: Listing = serde_json::from_str(json)?;
    Ok(l.nftables.into_iter().filter_map(|i| i.counter).map(|c| (c.name, c.bytes)).collect())
}

impl NetCounters {
    /// Count `source`'s packets in this network namespace (replacing a killed agent's table);
    /// `unified` is the cgroup2 mount, `name` the agent's cgroup name.
    pub fn install(unified: &Path, name: &str, source: NetSource) -> Result<NetCounters, NetIoError> {
        let table = table_name(name);
        delete_inet_table(&table)?;
        Nft::new(unified).apply(&ruleset(&table, &source))?;
        Ok(NetCounters { table, source })
    }

    /// The owner's bytes sent and received so far.
    pub fn owner_bytes(&self) -> Result<u64, NetIoError> {
        let mut c = Command::new(program("nft"));
        c.args(["-j", "list", "counters", "table", "inet", &self.table]);
        let all = counters(&run(c, None)?)?;
        let get = |counter: &'static str| {
            all.iter()
                .find(|(n, _)| n == counter)
                .map(|(_, b)| *b)
                .ok_or_else(|| NetIoError::NoCounter { table: self.table.clone(), counter })
        };
        Ok(match self.source {
            NetSource::Group(_) => get(OWNER)?,
            NetSource::AllBut(_) => get(ALL)?.saturating_sub(get(GUESTS)?),
        })
    }

    /// Remove the table (nothing there is fine).
    pub fn remove(&self) -> Result<(), NetIoError> {
        Ok(delete_inet_table(&self.table)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_emulated_owner_is_its_group_in_both_directions() {
        let s = ruleset("t", &NetSource::Group(PathBuf::from("starling/h1/owner")));
        assert!(s.contains("add counter inet t owner\n"), "{s}");
        assert!(s.contains("add rule inet t out oifname != \"lo\" socket cgroupv2 level 3 \"starling/h1/owner\" counter name \"owner\"\n"), "{s}");
        assert!(s.contains("add rule inet t in iifname != \"lo\" socket cgroupv2 level 3 \"starling/h1/owner\" counter name \"owner\"\n"), "{s}");
        assert!(!s.contains(ALL), "{s}");
    }

    #[test]
    fn a_real_owner_is_everything_but_the_starling_groups() {
        let s = ruleset("t", &NetSource::AllBut(PathBuf::from("starling")));
        assert!(s.contains("add rule inet t out oifname != \"lo\" counter name \"all\"\n"), "{s}");
        assert!(s.contains("add rule inet t in iifname != \"lo\" socket cgroupv2 level 1 \"starling\" counter name \"guests\"\n"), "{s}");
    }

    #[test]
    fn table_names_are_identifiers() {
        assert_eq!(table_name("starling7-h1"), "starling_starling7_h1_io");
    }

    #[test]
    fn counters_come_from_nft_json() {
        let j = r#"{"nftables": [{"metainfo": {"version": "1.0.6", "json_schema_version": 1}},
            {"counter": {"family": "inet", "name": "all", "table": "t", "handle": 1, "packets": 3, "bytes": 5000}},
            {"counter": {"family": "inet", "name": "guests", "table": "t", "handle": 2, "packets": 1, "bytes": 1200}}]}"#;
        assert_eq!(counters(j).unwrap(), vec![("all".to_string(), 5000), ("guests".to_string(), 1200)]);
        assert!(counters("not json").is_err());
    }
}
