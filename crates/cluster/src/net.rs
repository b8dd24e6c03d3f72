//! The emulated cluster's network: one Linux bridge in the root namespace carrying the head's address, and per
//! host a network namespace joined to the bridge by a veth pair.
//!
//! Everything is done with `ip`(8) (iproute2): it is installed wherever starling runs, its behaviour is
//! well known, and its error messages are what an operator would see doing the same by hand.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::sys::{Doing, SysError};
use serde::{Deserialize, Serialize};

/// Name of the bridge of the default cluster.
pub const DEFAULT_BRIDGE: &str = "stbr0";
/// Prefix of every network namespace of the default cluster (`starling-h1`, ...).
pub const DEFAULT_NETNS_PREFIX: &str = "starling-";
/// Prefix of the root-namespace end of each host's veth pair (`stv-h1`, ...).
pub const DEFAULT_VETH_PREFIX: &str = "stv-";
/// The default cluster's /24: the bridge is `.1`, host `hI` is `.(10+I)`.
pub const DEFAULT_SUBNET: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 0);
/// Port the head listens on.
pub use starling_config::HEAD_PORT;
/// Where `ip netns add` keeps its named namespaces.
pub const NETNS_RUN_DIR: &str = "/run/netns";
/// Host `hI` gets address `.(HOST_ADDR_OFFSET + I)`.
const HOST_ADDR_OFFSET: usize = 10;
/// Highest host count that fits the /24 (`.11` ..= `.250`).
pub const MAX_HOSTS: usize = 240;
/// Linux limit on interface names (IFNAMSIZ - 1).
const MAX_IFNAME: usize = 15;
/// Name of the temporary veth end before it is moved into the host's namespace and renamed `eth0`.
const PEER_TMP_PREFIX: &str = "stp";

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("{what} interface name {name:?} is empty, longer than {MAX_IFNAME} bytes or has / : or space")]
    BadInterfaceName { what: &'static str, name: String },
    #[error("{what} prefix {prefix:?} must be at least 2 characters without / or spaces")]
    BadPrefix { what: &'static str, prefix: String },
    #[error("bridge name {bridge:?} must not start with the veth prefix {prefix:?}")]
    BridgeUnderVethPrefix { bridge: String, prefix: String },
    #[error("cannot run ip(8) (is iproute2 installed?): {0}")]
    NoIp(#[source] SysError),
    #[error("`ip {command}` failed: {stderr}")]
    Ip { command: String, stderr: String },
    #[error("cannot run tc(8) (is iproute2 installed?): {0}")]
    NoTc(#[source] SysError),
    #[error("`tc {command}` failed: {stderr}")]
    Tc { command: String, stderr: String },
    #[error("bad --host-link {given:?}: {why}")]
    BadHostLink { given: String, why: &'static str },
}

type Result<T, E = NetError> = std::result::Result<T, E>;

/// The names and addresses one emulated cluster uses. Two clusters with different `NetConfig`s (e.g. a test's
/// and a real one) do not touch each other's namespaces, links or addresses.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct NetConfig {
    pub bridge: String,
    pub netns_prefix: String,
    pub veth_prefix: String,
    /// Network address of the /24 (last octet ignored).
    pub subnet: Ipv4Addr,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            bridge: DEFAULT_BRIDGE.to_string(),
            netns_prefix: DEFAULT_NETNS_PREFIX.to_string(),
            veth_prefix: DEFAULT_VETH_PREFIX.to_string(),
            subnet: DEFAULT_SUBNET,
        }
    }
}

impl NetConfig {
    fn addr(&self, last: u8) -> Ipv4Addr {
        let [a, b, c, _] = self.subnet.octets();
        Ipv4Addr::new(a, b, c, last)
    }
    /// The bridge's address, which is also the head's.
    pub fn bridge_ip(&self) -> Ipv4Addr {
        self.addr(1)
    }
    /// `"10.213.0.0/24"`.
    pub fn subnet_cidr(&self) -> String {
        format!("{}/24", self.addr(0))
    }
    /// Host names are `h1`, `h2`, ... (1-based).
    pub fn host_name(index: usize) -> String {
        format!("h{index}")
    }
    pub fn host_ip(&self, index: usize) -> Ipv4Addr {
        // Callers check `index <= MAX_HOSTS`, so this stays <= 250.
        self.addr(u8::try_from((HOST_ADDR_OFFSET + index).min(254)).unwrap_or(254))
    }
    pub fn netns_name(&self, host: &str) -> String {
        format!("{}{host}", self.netns_prefix)
    }
    pub fn veth_name(&self, host: &str) -> String {
        format!("{}{host}", self.veth_prefix)
    }

    /// Reject names the kernel would refuse (or that would make `down` match foreign links).
    pub fn validate(&self, hosts: usize) -> Result<()> {
        let longest_host = Self::host_name(hosts.max(1));
        let longest_veth = self.veth_name(&longest_host);
        let longest_peer = format!("{PEER_TMP_PREFIX}{}", longest_veth);
        for (what, name) in [("bridge", &self.bridge), ("veth", &longest_veth), ("veth peer", &longest_peer)] {
            if name.is_empty() || name.len() > MAX_IFNAME || name.contains(['/', ' ', ':']) {
                return Err(NetError::BadInterfaceName { what, name: name.clone() });
            }
        }
        for (what, prefix) in [("netns", &self.netns_prefix), ("veth", &self.veth_prefix)] {
            if prefix.len() < 2 || prefix.contains(['/', ' ']) {
                return Err(NetError::BadPrefix { what, prefix: prefix.clone() });
            }
        }
        if self.bridge.starts_with(&self.veth_prefix) {
            return Err(NetError::BridgeUnderVethPrefix { bridge: self.bridge.clone(), prefix: self.veth_prefix.clone() });
        }
        Ok(())
    }
}

/// Run `ip ARGS...`, failing with its stderr.
pub(crate) fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().doing(|| "ip".into()).map_err(NetError::NoIp)?;
    if !out.status.success() {
        return Err(NetError::Ip { command: args.join(" "), stderr: String::from_utf8_lossy(&out.stderr).trim().to_string() });
    }
    Ok(())
}

/// Create the bridge with its address. No forwarding or NAT is set up, so nothing routes beyond the bridge.
/// `mtu`: the bridge's and every veth's (set on each port too: a bridge takes its ports' smallest).
pub(crate) fn create_bridge(cfg: &NetConfig, mtu: u32) -> Result<()> {
    // Multicast snooping off: the bridge then floods multicast to every port, so IP multicast between hosts
    // works without an IGMP querier. nf_call_iptables off: bridged host-to-host frames never meet the
    // machine's firewall rules.
    let mtu = mtu.to_string();
    ip(&["link", "add", &cfg.bridge, "mtu", &mtu, "type", "bridge", "mcast_snooping", "0", "nf_call_iptables", "0"])?;
    ip(&["addr", "add", &format!("{}/24", cfg.bridge_ip()), "dev", &cfg.bridge])?;
    ip(&["link", "set", &cfg.bridge, "up"])
}

/// Create host `index`'s namespace and wire it to the bridge: `eth0` with its address, `lo` up, a default
/// route via the bridge address and a multicast route on `eth0`.
pub(crate) fn create_host_netns(cfg: &NetConfig, index: usize, mtu: u32) -> Result<()> {
    let host = NetConfig::host_name(index);
    let ns = cfg.netns_name(&host);
    let veth = cfg.veth_name(&host);
    let peer = format!("{PEER_TMP_PREFIX}{veth}");
    ip(&["netns", "add", &ns])?;
    let mtu = mtu.to_string();
    ip(&["link", "add", &veth, "mtu", &mtu, "type", "veth", "peer", "name", &peer, "mtu", &mtu])?;
    ip(&["link", "set", &peer, "netns", &ns])?;
    ip(&["link", "set", &veth, "master", &cfg.bridge])?;
    ip(&["link", "set", &veth, "up"])?;
    ip(&["-n", &ns, "link", "set", &peer, "name", "eth0"])?;
    ip(&["-n", &ns, "addr", "add", &format!("{}/24", cfg.host_ip(index)), "dev", "eth0"])?;
    ip(&["-n", &ns, "link", "set", "lo", "up"])?;
    ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
    ip(&["-n", &ns, "route", "add", "default", "via", &cfg.bridge_ip().to_string()])?;
    ip(&["-n", &ns, "route", "add", "224.0.0.0/4", "dev", "eth0"])
}

/// An emulated per-host link (`starling up --host-link RATE`): each host's
/// veth pair is shaped with a token bucket (tbf) to `bits_per_sec` in each
/// direction, so the head and the other hosts see it behind a link of that
/// speed. No added delay: this kernel has no netem, and a delay in user space
/// would sit in every byte's path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostLink {
    pub bits_per_sec: u64,
}

impl HostLink {
    /// `NUMBER[k|m|g]bit` (bits per second, tc's notation: `1gbit`, `500mbit`),
    /// or the same with `bps` for bytes per second (`100mbps`).
    pub fn parse(s: &str) -> Result<HostLink> {
        let bad = |why| NetError::BadHostLink { given: s.to_string(), why };
        if s.contains(',') {
            return Err(bad("only a rate is supported (e.g. 1gbit): a delay needs netem, which this kernel lacks"));
        }
        let lower = s.trim().to_ascii_lowercase();
        let (num, per_unit) = if let Some(n) = lower.strip_suffix("bit") {
            (n, 1u64)
        } else if let Some(n) = lower.strip_suffix("bps") {
            (n, 8u64)
        } else {
            return Err(bad("expected a rate such as 1gbit, 500mbit or 100mbps"));
        };
        let (digits, scale) = match num.as_bytes().last() {
            Some(b'k') => (&num[..num.len() - 1], 1_000u64),
            Some(b'm') => (&num[..num.len() - 1], 1_000_000),
            Some(b'g') => (&num[..num.len() - 1], 1_000_000_000),
            _ => (num, 1),
        };
        let n: u64 = digits.parse().map_err(|_| bad("the rate must be a whole number with an optional k, m or g"))?;
        let bits = n.checked_mul(scale).and_then(|b| b.checked_mul(per_unit)).ok_or_else(|| bad("rate too large"))?;
        if bits < 8_000 {
            return Err(bad("rate below 8kbit"));
        }
        Ok(HostLink { bits_per_sec: bits })
    }

    /// The rate as tc writes it (`1000000000bit`).
    pub fn tc_rate(&self) -> String {
        format!("{}bit", self.bits_per_sec)
    }

    /// Human form (`1 Gbit/s`).
    pub fn describe(&self) -> String {
        let b = self.bits_per_sec;
        if b.is_multiple_of(1_000_000_000) {
            format!("{} Gbit/s", b / 1_000_000_000)
        } else if b.is_multiple_of(1_000_000) {
            format!("{} Mbit/s", b / 1_000_000)
        } else {
            format!("{} kbit/s", b / 1_000)
        }
    }
}

/// Run `tc ARGS...`, failing with its stderr.
fn tc(args: &[&str]) -> Result<()> {
    let out = Command::new("tc").args(args).output().doing(|| "tc".into()).map_err(NetError::NoTc)?;
    if !out.status.success() {
        return Err(NetError::Tc { command: args.join(" "), stderr: String::from_utf8_lossy(&out.stderr).trim().to_string() });
    }
    Ok(())
}

/// Shape host `index`'s link: a tbf on the bridge-side veth end (traffic to
/// the host) and one on the host's `eth0` (traffic from it).
pub(crate) fn shape_host(cfg: &NetConfig, index: usize, link: &HostLink) -> Result<()> {
    let host = NetConfig::host_name(index);
    let ns = cfg.netns_name(&host);
    let veth = cfg.veth_name(&host);
    let rate = link.tc_rate();
    // The bucket holds 10 ms at the rate (tbf needs at least one timer
    // tick's worth), at least 64 KiB; the queue holds 50 ms before dropping.
    let burst = (link.bits_per_sec / 8 / 100).max(64 << 10).to_string();
    let shaper = ["root", "tbf", "rate", &rate, "burst", &burst, "latency", "50ms"];
    let mut down = vec!["qdisc", "replace", "dev", &veth];
    down.extend(shaper);
    tc(&down)?;
    let mut up = vec!["-n", &ns, "qdisc", "replace", "dev", "eth0"];
    up.extend(shaper);
    tc(&up)
}

/// Path of a named network namespace's handle.
pub fn netns_path(name: &str) -> PathBuf {
    Path::new(NETNS_RUN_DIR).join(name)
}

/// Named network namespaces whose name starts with `prefix`.
pub(crate) fn list_netns(prefix: &str) -> Vec<String> {
    list_names(Path::new(NETNS_RUN_DIR), prefix)
}

/// Interfaces in the root network namespace whose name starts with `prefix` (from /sys/class/net).
pub(crate) fn list_links(prefix: &str) -> Vec<String> {
    list_names(Path::new("/sys/class/net"), prefix)
}

fn list_names(dir: &Path, prefix: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut names: Vec<String> =
        entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|n| n.starts_with(prefix)).collect();
    names.sort();
    names
}

pub(crate) fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// Identity (device, inode) of a namespace handle such as `/run/netns/X` or `/proc/PID/ns/net`.
pub(crate) fn ns_id(path: &Path) -> Option<(u64, u64)> {
    let md = std::fs::metadata(path).ok()?;
    Some((md.dev(), md.ino()))
}

/// Identities of the existing namespaces with our prefix.
pub(crate) fn netns_ids(prefix: &str) -> BTreeSet<(u64, u64)> {
    list_netns(prefix).iter().filter_map(|n| ns_id(&netns_path(n))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_link_rates_parse_in_tc_notation() {
        assert_eq!(HostLink::parse("1gbit").unwrap().bits_per_sec, 1_000_000_000);
        assert_eq!(HostLink::parse("500mbit").unwrap().bits_per_sec, 500_000_000);
        assert_eq!(HostLink::parse("100Mbps").unwrap().bits_per_sec, 800_000_000);
        assert_eq!(HostLink::parse("64kbit").unwrap().bits_per_sec, 64_000);
        assert_eq!(HostLink::parse("1gbit").unwrap().tc_rate(), "1000000000bit");
        assert_eq!(HostLink::parse("1gbit").unwrap().describe(), "1 Gbit/s");
        for bad in ["", "fast", "1g", "1.5gbit", "1gbit,10ms", "1kbit", "99999999999999gbit"] {
            let e = HostLink::parse(bad).unwrap_err();
            assert!(matches!(e, NetError::BadHostLink { .. }), "{bad:?}: {e}");
        }
        assert!(HostLink::parse("1gbit,5ms").unwrap_err().to_string().contains("netem"));
    }
}
