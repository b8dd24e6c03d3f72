//! A fork ticket's own network (SnowFlock's virtual network per impromptu
//! cluster): the clones of one ticket reach each other and their parent,
//! and nothing else on the cluster's network.
//!
//! Clones run in their host's network namespace (the sandbox makes mount,
//! PID and IPC namespaces, not a network one), so a listener in one clone is
//! reached at its host's address, as the executor's workers and any MPI-like
//! program of clones expect. The boundary is therefore drawn in the host's
//! namespace, by cgroup rather than by a namespace of their own (a veth and
//! an address per clone would change what a clone's address is, and need
//! routes between hosts): every clone task of ticket T joins the cgroup2
//! group `starling/NAME/guest/ticket-T` (below the guests' group, so the
//! guests' network window still matches it), and an nftables table
//! `starling_NAME_tT` matches the sockets of that group (`socket cgroupv2`):
//!
//! * out: a TCP connection to a refused port (the head's, the agents' control
//!   and chunk ports: `TicketNetwork::refused_ports`) is reset, on any
//!   address; otherwise loopback and the ticket's members (the grant's hosts,
//!   the parent's machine) pass and everything else is rejected;
//! * in: a packet for one of the group's sockets from outside loopback and
//!   the members is dropped (another host's connection to a clone's listener).
//!
//! The table and group are made by the ticket's first clone task on this
//! host (members added by later ones) and removed by its last; a restarted
//! agent removes what a killed one left ([`TicketNets::sweep`]), as does its
//! stop. Processes outside the group — the agent's fault handlers, other
//! tasks — are not matched.

use starling_linger::nft::{self, CommandError, Nft};
use starling_proto::TicketNetwork;
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

#[derive(Debug, thiserror::Error)]
pub enum TicketNetError {
    #[error("no cgroup2 mount on this host, so a ticket's sockets cannot be told apart; run the job with fork.isolate_network off to give its clones the whole network")]
    NoUnified,
    #[error("making the ticket's cgroup {path}: {source}")]
    Cgroup { path: PathBuf, #[source] source: std::io::Error },
    #[error("the ticket's nftables rules (set fork.isolate_network off to run without them): {0}")]
    Nft(#[from] CommandError),
}

/// One ticket on this host: how many of its clone tasks run here, and what its rules hold.
struct Ticket {
    tasks: usize,
    members: BTreeSet<IpAddr>,
    refused_ports: BTreeSet<u16>,
}

/// The ticket networks of this agent's clone tasks.
pub(crate) struct TicketNets {
    /// The cgroup2 mount, if any.
    unified: Option<PathBuf>,
    /// `starling/NAME/guest`: the tickets' groups are below it.
    base: PathBuf,
    /// `starling_NAME_t`: the tables' names are this and the ticket.
    prefix: String,
    live: Mutex<HashMap<u64, Ticket>>,
}

/// A clone task's hold on its ticket's network; the last one dropped removes it.
pub(crate) struct TicketNetHold {
    nets: Arc<TicketNets>,
    ticket: u64,
    /// The group's `cgroup.procs` (the sandbox joins it after the guest groups).
    pub procs: PathBuf,
}

impl Drop for TicketNetHold {
    fn drop(&mut self) {
        self.nets.leave(self.ticket);
    }
}

impl TicketNets {
    /// `cgroup_name`: the agent's cgroup name (`agent.cgroup`, else its name).
    pub fn new(cgroup_name: &str) -> TicketNets {
        let unified = starling_linger::Hierarchies::discover().unified().map(Path::to_path_buf);
        let safe: String = cgroup_name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        TicketNets {
            unified,
            base: starling_linger::guest::guest_rel(cgroup_name),
            prefix: format!("starling_{safe}_t"),
            live: Mutex::new(HashMap::new()),
        }
    }

    fn table(&self, ticket: u64) -> String {
        format!("{}{ticket}", self.prefix)
    }

    fn group_rel(&self, ticket: u64) -> PathBuf {
        self.base.join(format!("ticket-{ticket}"))
    }

    /// A clone task of `ticket` starts here: make (or widen) its network. `parent`: the parent's
    /// machine (its page server's address).
    pub fn join(self: &Arc<Self>, ticket: u64, parent: IpAddr, net: &TicketNetwork) -> Result<TicketNetHold, TicketNetError> {
        let unified = self.unified.as_ref().ok_or(TicketNetError::NoUnified)?;
        let rel = self.group_rel(ticket);
        let dir = unified.join(&rel);
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let members: BTreeSet<IpAddr> = net.members.iter().copied().chain(std::iter::once(parent)).collect();
        let refused: BTreeSet<u16> = net.refused_ports.iter().copied().collect();
        let nft = Nft::new(unified);
        match live.get_mut(&ticket) {
            Some(t) => {
                let new_members: Vec<IpAddr> = members.difference(&t.members).copied().collect();
                let new_ports: Vec<u16> = refused.difference(&t.refused_ports).copied().collect();
                if !new_members.is_empty() || !new_ports.is_empty() {
                    nft.apply(&additions(&self.table(ticket), &new_members, &new_ports))?;
                    t.members.extend(new_members);
                    t.refused_ports.extend(new_ports);
                }
                t.tasks += 1;
            }
            None => {
                std::fs::create_dir_all(&dir).map_err(|source| TicketNetError::Cgroup { path: dir.clone(), source })?;
                let script = ruleset(&self.table(ticket), &rel, &members, &refused);
                if let Err(e) = nft.apply(&script) {
                    let _ = std::fs::remove_dir(&dir);
                    return Err(e.into());
                }
                log::info!("ticket {ticket}: its clones reach only {} (table {})", shown(&members), self.table(ticket));
                live.insert(ticket, Ticket { tasks: 1, members, refused_ports: refused });
            }
        }
        Ok(TicketNetHold { nets: self.clone(), ticket, procs: dir.join("cgroup.procs") })
    }

    fn leave(&self, ticket: u64) {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let Some(t) = live.get_mut(&ticket) else { return };
        t.tasks -= 1;
        if t.tasks > 0 {
            return;
        }
        live.remove(&ticket);
        if let Err(e) = nft::delete_inet_table(&self.table(ticket)) {
            log::warn!("ticket {ticket}: removing its nftables table: {e}");
        }
        if let Some(u) = &self.unified {
            remove_group(&u.join(self.group_rel(ticket)));
        }
    }

    /// Remove every ticket table and group of this agent (what a killed agent left; at stop).
    pub fn sweep(&self) {
        match nft::inet_tables() {
            Ok(tables) => {
                for t in tables.iter().filter(|t| t.strip_prefix(&self.prefix).is_some_and(|n| n.parse::<u64>().is_ok())) {
                    if let Err(e) = nft::delete_inet_table(t) {
                        log::warn!("removing the ticket table {t}: {e}");
                    }
                }
            }
            // No nft on this host: there is nothing of ours to remove either.
            Err(e) => log::debug!("listing nftables tables: {e}"),
        }
        self.live.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let Some(u) = &self.unified else { return };
        for e in std::fs::read_dir(u.join(&self.base)).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with("ticket-") {
                remove_group(&e.path());
            }
        }
    }
}

/// rmdir a ticket's group: its processes have ended, but the last may take a moment to leave it.
fn remove_group(dir: &Path) {
    for _ in 0..100 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => std::thread::sleep(std::time::Duration::from_millis(20)),
            Err(e) => {
                log::warn!("removing {}: {e}", dir.display());
                return;
            }
        }
    }
    log::warn!("{} still has processes; left in place (removed when the agent stops)", dir.display());
}

fn shown(members: &BTreeSet<IpAddr>) -> String {
    members.iter().map(IpAddr::to_string).collect::<Vec<_>>().join(", ")
}

/// `{ a, b }` of an nftables set, or nothing for an empty one.
fn elements<T: std::fmt::Display>(items: impl Iterator<Item = T>) -> Option<String> {
    let v: Vec<String> = items.map(|i| i.to_string()).collect();
    (!v.is_empty()).then(|| format!("{{ {} }}", v.join(", ")))
}

/// The ticket's table: sets of members (v4, v6) and refused ports, and the two hooks matching the
/// group `rel`'s sockets. Deleted first if a table of the name is there (made and deleted in one
/// transaction: `add table` never fails on an existing one).
fn ruleset(table: &str, rel: &Path, members: &BTreeSet<IpAddr>, refused: &BTreeSet<u16>) -> String {
    let level = rel.components().count();
    let rel = rel.display();
    let mut s = format!("add table inet {table}\ndelete table inet {table}\ntable inet {table} {{\n");
    let v4 = elements(members.iter().filter(|a| a.is_ipv4()));
    let v6 = elements(members.iter().filter(|a| a.is_ipv6()));
    let ports = elements(refused.iter());
    let _ = writeln!(s, "  set members4 {{ type ipv4_addr; {}}}", v4.map(|e| format!("elements = {e}; ")).unwrap_or_default());
    let _ = writeln!(s, "  set members6 {{ type ipv6_addr; {}}}", v6.map(|e| format!("elements = {e}; ")).unwrap_or_default());
    let _ = writeln!(s, "  set refused {{ type inet_service; {}}}", ports.map(|e| format!("elements = {e}; ")).unwrap_or_default());
    let _ = writeln!(s, "  chain out {{ type filter hook output priority 0; policy accept; socket cgroupv2 level {level} \"{rel}\" goto clone_out; }}");
    let _ = writeln!(
        s,
        "  chain clone_out {{ tcp dport @refused reject with tcp reset; oifname \"lo\" accept; ip daddr @members4 accept; ip6 daddr @members6 accept; reject with icmpx admin-prohibited; }}"
    );
    let _ = writeln!(s, "  chain in {{ type filter hook input priority 0; policy accept; socket cgroupv2 level {level} \"{rel}\" goto clone_in; }}");
    let _ = writeln!(s, "  chain clone_in {{ iifname \"lo\" accept; ip saddr @members4 accept; ip6 saddr @members6 accept; drop; }}");
    s.push_str("}\n");
    s
}

/// Members and refused ports a later clone task of the ticket adds.
fn additions(table: &str, members: &[IpAddr], ports: &[u16]) -> String {
    let mut s = String::new();
    for (set, v) in [("members4", elements(members.iter().filter(|a| a.is_ipv4()))), ("members6", elements(members.iter().filter(|a| a.is_ipv6()))), ("refused", elements(ports.iter()))] {
        if let Some(e) = v {
            let _ = writeln!(s, "add element inet {table} {set} {e}");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ruleset_matches_the_group_and_sorts_addresses_by_family() {
        let members: BTreeSet<IpAddr> = ["10.0.0.2", "fd00::1", "10.0.0.1"].iter().map(|a| a.parse().unwrap()).collect();
        let refused: BTreeSet<u16> = [7077, 40000].into_iter().collect();
        let s = ruleset("starling_h1_t7", Path::new("starling/h1/guest/ticket-7"), &members, &refused);
        assert!(s.starts_with("add table inet starling_h1_t7\ndelete table inet starling_h1_t7\n"), "{s}");
        assert!(s.contains("set members4 { type ipv4_addr; elements = { 10.0.0.1, 10.0.0.2 }; }"), "{s}");
        assert!(s.contains("set members6 { type ipv6_addr; elements = { fd00::1 }; }"), "{s}");
        assert!(s.contains("set refused { type inet_service; elements = { 7077, 40000 }; }"), "{s}");
        assert!(s.contains("socket cgroupv2 level 4 \"starling/h1/guest/ticket-7\" goto clone_out"), "{s}");
        assert!(s.contains("socket cgroupv2 level 4 \"starling/h1/guest/ticket-7\" goto clone_in"), "{s}");
    }

    #[test]
    fn empty_sets_have_no_elements_clause() {
        let s = ruleset("t", Path::new("a/b"), &BTreeSet::new(), &BTreeSet::new());
        assert!(s.contains("set members6 { type ipv6_addr; }") && s.contains("set refused { type inet_service; }"), "{s}");
        assert_eq!(additions("t", &[], &[]), "");
        assert_eq!(additions("t", &["10.0.0.3".parse().unwrap()], &[9]), "add element inet t members4 { 10.0.0.3 }\nadd element inet t refused { 9 }\n");
    }
}
