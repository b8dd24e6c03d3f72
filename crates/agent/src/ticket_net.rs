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
//! * out: a TCP or UDP (SCTP, DCCP, UDP-Lite) packet to a refused port (the
//!   head's, the agents' control and chunk ports, the port the parent reaches
//!   the cluster at: `TicketNetwork::refused_ports`) is rejected, on any
//!   address; otherwise loopback and the ticket's members (the grant's hosts,
//!   the parent's machine) pass and everything else is rejected;
//! * in: a packet for one of the group's sockets from outside loopback and
//!   the members is dropped (another host's connection to a clone's listener).
//!
//! Addresses cannot tell two tickets on one host apart (both have the host's
//! address and loopback), so each ticket on this host also has a *mark*: its
//! clones' connections carry it in their conntrack mark (set on output, in
//! [`MARK_MASK`]'s bits; the other bits are left to whoever else uses them),
//! and a packet for a clone's socket whose connection carries another
//! ticket's mark is rejected on input. A connection of a process outside every
//! ticket (mark 0: the parent on this machine, the agent) is judged by address
//! alone, as before. Marks are this agent's (the smallest free one per live
//! ticket): two agents sharing one network namespace would share them.
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
    #[error("no cgroup2 mount on this host, so a ticket's sockets cannot be told apart")]
    NoUnified,
    #[error("making the ticket's cgroup {path}: {source}")]
    Cgroup { path: PathBuf, #[source] source: std::io::Error },
    #[error("the ticket's nftables rules: {0}")]
    Nft(#[from] CommandError),
    #[error("this host already runs clones of {MAX_MARKS} isolated tickets; their marks are all taken")]
    NoMark,
    /// The probe's rules were refused: `nft`'s own words (the whole command is in the agent's log).
    #[error("nft refused a ticket's rules: {0}")]
    Refused(String),
}

/// The conntrack mark bits a ticket's mark occupies (the others are left alone).
pub(crate) const MARK_MASK: u32 = 0xffff_0000;

/// Ticket marks a host can tell apart at once (1..=MAX_MARKS; 0 is no ticket's).
const MAX_MARKS: u32 = MARK_MASK >> MARK_MASK.trailing_zeros();

/// One ticket on this host: how many of its clone tasks run here, and what its rules hold.
struct Ticket {
    tasks: usize,
    /// Its connections' conntrack mark (1..=MAX_MARKS), below [`MARK_MASK`].
    mark: u32,
    members: BTreeSet<IpAddr>,
    /// The parents' machines its clones here named (members whatever the head says).
    parents: BTreeSet<IpAddr>,
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

    /// Can this agent enforce a ticket's own network? Makes and removes what a ticket's first
    /// clone would (a group below the guests' and a table matching its sockets), so a host without
    /// root or `CAP_NET_ADMIN`, a cgroup2 hierarchy it can make groups in, `nft` or the kernel's
    /// `socket cgroupv2` match says so here, at the agent's start, rather than at a clone's.
    pub fn probe(&self) -> Result<(), TicketNetError> {
        let unified = self.unified.as_ref().ok_or(TicketNetError::NoUnified)?;
        let rel = self.base.join("ticket-probe");
        let dir = unified.join(&rel);
        std::fs::create_dir_all(&dir).map_err(|source| TicketNetError::Cgroup { path: dir.clone(), source })?;
        let table = format!("{}probe", self.prefix);
        let applied = Nft::new(unified).apply(&ruleset(&table, &rel, &BTreeSet::new(), &BTreeSet::new(), 1));
        if applied.is_ok() {
            if let Err(e) = nft::delete_inet_table(&table) {
                log::warn!("removing the probe table {table}: {e}");
            }
        }
        remove_group(&dir);
        // The reason goes to `starling status` and to every caller granted this host: nft's own
        // words, not the ruleset they came back for.
        applied.map_err(|e| match e {
            CommandError::Failed { command, stderr } => {
                log::debug!("the probe's rules: `{command}` failed");
                TicketNetError::Refused(stderr)
            }
            e => e.into(),
        })?;
        Ok(())
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
                t.parents.insert(parent);
                t.tasks += 1;
            }
            None => {
                let taken: BTreeSet<u32> = live.values().map(|t| t.mark).collect();
                let mark = (1..=MAX_MARKS).find(|m| !taken.contains(m)).ok_or(TicketNetError::NoMark)?;
                std::fs::create_dir_all(&dir).map_err(|source| TicketNetError::Cgroup { path: dir.clone(), source })?;
                let script = ruleset(&self.table(ticket), &rel, &members, &refused, mark);
                if let Err(e) = nft.apply(&script) {
                    let _ = std::fs::remove_dir(&dir);
                    return Err(e.into());
                }
                log::info!("ticket {ticket}: its clones reach only {} (table {})", shown(&members), self.table(ticket));
                live.insert(ticket, Ticket { tasks: 1, mark, members, parents: BTreeSet::from([parent]), refused_ports: refused });
            }
        }
        Ok(TicketNetHold { nets: self.clone(), ticket, procs: dir.join("cgroup.procs") })
    }

    /// The head says `ticket`'s hosts are now `members` (a clone of it moved): its rules here, if
    /// any of its clones runs here, let exactly those and its parents' machines through.
    pub fn set_members(&self, ticket: u64, members: &[IpAddr]) -> Result<(), TicketNetError> {
        let Some(unified) = self.unified.as_ref() else { return Ok(()) };
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let Some(t) = live.get_mut(&ticket) else { return Ok(()) };
        let want: BTreeSet<IpAddr> = members.iter().copied().chain(t.parents.iter().copied()).collect();
        let added: Vec<IpAddr> = want.difference(&t.members).copied().collect();
        let removed: Vec<IpAddr> = t.members.difference(&want).copied().collect();
        if added.is_empty() && removed.is_empty() {
            return Ok(());
        }
        let table = self.table(ticket);
        Nft::new(unified).apply(&(additions(&table, &added, &[]) + &removals(&table, &removed)))?;
        log::info!("ticket {ticket}: its clones here reach only {} now", shown(&want));
        t.members = want;
        Ok(())
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

/// A clone task of `c`'s ticket (started here, or moved here by `starling migrate`) enters the
/// ticket's network `net`: its sandbox `sb` joins the ticket's group and gives up the capabilities
/// that could change the rules. The hold keeps the network until the task ends here.
///
/// Should the rules fail here although the agent's start found it could make them, a job that
/// requires them (`fork.isolate_network = required`) loses the clone with the reason; otherwise
/// the clone runs with the host's network (`Ok(None)`) and `notice` gets a line for its stderr:
/// a clone is never lost for want of isolation it did not require.
pub(crate) fn enter(
    agent: &crate::Agent,
    c: &starling_proto::CloneSpec,
    net: &TicketNetwork,
    sb: &mut starling_sandbox::SandboxSpec,
    notice: impl FnOnce(&str),
) -> Result<Option<TicketNetHold>, crate::AgentError> {
    let parent = c.page_server.parse::<std::net::SocketAddr>().map_err(|_| crate::AgentError::PageServerAddress(c.page_server.clone()))?.ip();
    let hold = match agent.ticket_nets.join(c.ticket, parent, net) {
        Ok(hold) => hold,
        Err(e) if net.required => return Err(e.into()),
        Err(e) => {
            log::warn!("ticket {}: clone {} runs with this host's network: {e}", c.ticket, c.clone_id);
            notice(&format!(
                "starling: clone {} of ticket {} runs with host {}'s whole network, not the ticket's own: {e}\n",
                c.clone_id, c.ticket, agent.cfg.name
            ));
            return Ok(None);
        }
    };
    sb.placement.cgroup_procs.push(hold.procs.clone());
    sb.no_network_admin = true;
    Ok(Some(hold))
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
/// group `rel`'s sockets; `mark` (1..=MAX_MARKS) tells its connections from other tickets' on this
/// host. Deleted first if a table of the name is there (made and deleted in one transaction: `add
/// table` never fails on an existing one).
fn ruleset(table: &str, rel: &Path, members: &BTreeSet<IpAddr>, refused: &BTreeSet<u16>, mark: u32) -> String {
    let level = rel.components().count();
    let rel = rel.display();
    let shift = MARK_MASK.trailing_zeros();
    let (mask, keep, ours) = (MARK_MASK, !MARK_MASK, mark << shift);
    let mut s = format!("add table inet {table}\ndelete table inet {table}\ntable inet {table} {{\n");
    let v4 = elements(members.iter().filter(|a| a.is_ipv4()));
    let v6 = elements(members.iter().filter(|a| a.is_ipv6()));
    let ports = elements(refused.iter());
    let _ = writeln!(s, "  set members4 {{ type ipv4_addr; {}}}", v4.map(|e| format!("elements = {e}; ")).unwrap_or_default());
    let _ = writeln!(s, "  set members6 {{ type ipv6_addr; {}}}", v6.map(|e| format!("elements = {e}; ")).unwrap_or_default());
    let _ = writeln!(s, "  set refused {{ type inet_service; {}}}", ports.map(|e| format!("elements = {e}; ")).unwrap_or_default());
    let _ = writeln!(s, "  chain out {{ type filter hook output priority 0; policy accept; socket cgroupv2 level {level} \"{rel}\" goto clone_out; }}");
    // The mark first: a connection the rules then refuse carries it too, harmlessly.
    let _ = writeln!(
        s,
        "  chain clone_out {{ ct mark set ct mark and {keep:#010x} or {ours:#010x}; \
         meta l4proto tcp th dport @refused reject with tcp reset; \
         meta l4proto {{ udp, udplite, sctp, dccp }} th dport @refused reject with icmpx admin-prohibited; \
         oifname \"lo\" accept; ip daddr @members4 accept; ip6 daddr @members6 accept; reject with icmpx admin-prohibited; }}"
    );
    let _ = writeln!(s, "  chain in {{ type filter hook input priority 0; policy accept; socket cgroupv2 level {level} \"{rel}\" goto clone_in; }}");
    // Another ticket's clone on this host: rejected (not dropped), so its connect fails at once.
    let _ = writeln!(
        s,
        "  chain clone_in {{ ct mark and {mask:#010x} != 0 ct mark and {mask:#010x} != {ours:#010x} reject with icmpx admin-prohibited; \
         iifname \"lo\" accept; ip saddr @members4 accept; ip6 saddr @members6 accept; drop; }}"
    );
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

/// Members the head no longer counts among a ticket's hosts.
fn removals(table: &str, members: &[IpAddr]) -> String {
    let mut s = String::new();
    for (set, v) in [("members4", elements(members.iter().filter(|a| a.is_ipv4()))), ("members6", elements(members.iter().filter(|a| a.is_ipv6())))] {
        if let Some(e) = v {
            let _ = writeln!(s, "delete element inet {table} {set} {e}");
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
        let s = ruleset("starling_h1_t7", Path::new("starling/h1/guest/ticket-7"), &members, &refused, 3);
        assert!(s.starts_with("add table inet starling_h1_t7\ndelete table inet starling_h1_t7\n"), "{s}");
        assert!(s.contains("set members4 { type ipv4_addr; elements = { 10.0.0.1, 10.0.0.2 }; }"), "{s}");
        assert!(s.contains("set members6 { type ipv6_addr; elements = { fd00::1 }; }"), "{s}");
        assert!(s.contains("set refused { type inet_service; elements = { 7077, 40000 }; }"), "{s}");
        assert!(s.contains("socket cgroupv2 level 4 \"starling/h1/guest/ticket-7\" goto clone_out"), "{s}");
        assert!(s.contains("socket cgroupv2 level 4 \"starling/h1/guest/ticket-7\" goto clone_in"), "{s}");
        // Mark 3 in the high half; another ticket's mark on input is refused.
        assert!(s.contains("ct mark set ct mark and 0x0000ffff or 0x00030000;"), "{s}");
        assert!(s.contains("ct mark and 0xffff0000 != 0 ct mark and 0xffff0000 != 0x00030000 reject"), "{s}");
        assert!(s.contains("meta l4proto { udp, udplite, sctp, dccp } th dport @refused reject"), "{s}");
    }

    #[test]
    fn empty_sets_have_no_elements_clause() {
        let s = ruleset("t", Path::new("a/b"), &BTreeSet::new(), &BTreeSet::new(), 1);
        assert!(s.contains("set members6 { type ipv6_addr; }") && s.contains("set refused { type inet_service; }"), "{s}");
        assert_eq!(additions("t", &[], &[]), "");
        assert_eq!(additions("t", &["10.0.0.3".parse().unwrap()], &[9]), "add element inet t members4 { 10.0.0.3 }\nadd element inet t refused { 9 }\n");
        assert_eq!(removals("t", &[]), "");
    }

    #[test]
    fn removed_members_leave_their_familys_set() {
        let gone: Vec<IpAddr> = ["10.0.0.3", "fd00::2", "10.0.0.4"].iter().map(|a| a.parse().unwrap()).collect();
        assert_eq!(
            removals("t", &gone),
            "delete element inet t members4 { 10.0.0.3, 10.0.0.4 }\ndelete element inet t members6 { fd00::2 }\n"
        );
    }
}
