//! Placement: which host runs a launch, and which hosts a fork ticket's
//! clones go to. Pure functions over the head's view of its hosts.

use crate::Host;
use starling_proto::conn::Outgoing;
use starling_proto::{Msg, NetworkIsolation, Unisolated};
use std::collections::{BTreeSet, HashMap};

/// Why a launch or a ticket cannot be placed (told to the client as its message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Unplaceable {
    #[error("the cluster has no hosts (are the agents running? see `starling status`)")]
    NoHosts,
    #[error("no host named {name:?} (hosts: {})", known.join(", "))]
    NoSuchHost { name: String, known: Vec<String> },
    #[error("host {host} has {has} cores; the task needs {needs}")]
    HostTooSmall { host: String, has: u32, needs: u32 },
    #[error("no host has the {0} cores the task needs")]
    NoHostLargeEnough(u32),
    #[error("no free cores in the cluster")]
    NoFreeCores,
    #[error("fork.isolate_network is `required`, and {} of the {could} clones the cluster could grant would be on hosts that cannot enforce a ticket's own network: {} (set it to `on` to run clones there with their host's whole network)", could - isolated, cannot.iter().map(|(h, why)| format!("{h} ({why})")).collect::<Vec<_>>().join(", "))]
    CannotIsolate { could: u32, isolated: u32, cannot: Vec<(String, String)> },
}

/// Can a launch (needing `cores` on one host) ever be placed? `Err`: why not.
pub(crate) fn check_placeable(hosts: &HashMap<String, Host>, want: Option<&str>, cores: u32) -> Result<(), Unplaceable> {
    if want.is_none() && hosts.values().all(|h| h.info.home) {
        return Err(Unplaceable::NoHosts);
    }
    if let Some(w) = want {
        let Some(h) = hosts.get(w) else {
            let mut known: Vec<_> = hosts.keys().cloned().collect();
            known.sort_by_key(|a| natural_key(a));
            return Err(Unplaceable::NoSuchHost { name: w.to_string(), known });
        };
        if h.info.cores.max(1) < cores {
            return Err(Unplaceable::HostTooSmall { host: w.to_string(), has: h.info.cores, needs: cores });
        }
    } else if hosts.values().filter(|h| !h.info.home).all(|h| h.info.cores.max(1) < cores) {
        return Err(Unplaceable::NoHostLargeEnough(cores));
    }
    Ok(())
}

/// A host with `cores` free (the named one, else the least loaded, never the
/// home site), now holding them; `None` if every eligible host is busy.
/// `idle_owner`: only a host whose owner is idle (an IE rerun).
pub(crate) fn pick<'a>(hosts: &'a mut HashMap<String, Host>, want: Option<&str>, cores: u32, idle_owner: bool) -> Option<&'a mut Host> {
    let free = |h: &Host| h.cores_busy + cores <= h.info.cores.max(1) && (!idle_owner || owner_idle(h));
    let name = match want {
        Some(w) => hosts.get(w).filter(|h| free(h)).map(|h| h.info.name.clone())?,
        None => hosts
            .values()
            .filter(|h| free(h) && !h.info.home)
            .min_by(|a, b| {
                memory_pressed(a)
                    .cmp(&memory_pressed(b))
                    .then(owner_rank(a).total_cmp(&owner_rank(b)))
                    .then(load(a).total_cmp(&load(b)))
                    .then(natural_key(&a.info.name).cmp(&natural_key(&b.info.name)))
            })
            .map(|h| h.info.name.clone())?,
    };
    let h = hosts.get_mut(&name)?;
    h.cores_busy += cores;
    Some(h)
}

/// Linger-Longer placement: hosts whose owner is idle (or unknown) first
/// (0), then by the owner's CPU (1 + share): guests go where owners are least
/// in the way.
fn owner_rank(h: &Host) -> f64 {
    match &h.info.owner {
        Some(o) if o.state != "idle" => 1.0 + f64::from(o.cpu),
        _ => 0.0,
    }
}

/// The host's memory band capped or froze its guests: such hosts come last (a new guest there
/// would be held at once, and the policy is moving guests away: `head::linger`).
fn memory_pressed(h: &Host) -> bool {
    h.info.owner.as_ref().is_some_and(|o| o.guest_mem_cap.is_some() || o.guests_frozen)
}

/// The host's owner is idle (or the host has none).
fn owner_idle(h: &Host) -> bool {
    h.info.owner.as_ref().is_none_or(|o| o.state == "idle")
}

/// Share of a host's cores held.
fn load(h: &Host) -> f64 {
    f64::from(h.cores_busy) / f64::from(h.info.cores.max(1))
}

/// Where a clone of `ticket` (launched by client connection `conn`, placed or moved to `host`)
/// may connect: the ticket's hosts ([`ticket_hosts`]) and `host`, by the address each registered
/// from; refused everywhere: `control_ports` (the head's, the agents' it
/// dials), every host's chunk port and the ports the client `asked` to refuse too (the port it
/// reaches the cluster at: a link relay's); a client never adds members. The parent's machine is
/// added by the agent (the page server's address).
pub(crate) fn ticket_network(
    st: &crate::State,
    conn: u64,
    ticket: u64,
    host: &str,
    control_ports: &[u16],
    asked: &starling_proto::TicketNetwork,
) -> starling_proto::TicketNetwork {
    let mut names = ticket_hosts(st, conn, ticket);
    names.insert(host);
    let members = addresses(st, &names);
    let chunk_ports = st.hosts.values().filter_map(|h| h.info.peer.as_deref()?.parse::<std::net::SocketAddr>().ok()).map(|a| a.port());
    let mut refused_ports: Vec<u16> = control_ports.iter().copied().chain(chunk_ports).chain(asked.refused_ports.iter().copied()).collect();
    refused_ports.sort_unstable();
    refused_ports.dedup();
    starling_proto::TicketNetwork { members, refused_ports, required: asked.required }
}

/// The hosts of `ticket`'s network (launched by client connection `conn`): its grant's, and those
/// its clones run on or are moving to (a clone moved outside the grant takes its new host in).
pub(crate) fn ticket_hosts(st: &crate::State, conn: u64, ticket: u64) -> BTreeSet<&str> {
    let granted = st.grants.get(&(conn, ticket)).into_iter().flatten().map(String::as_str);
    let clones = st.routes.values().filter(|r| r.client_conn == conn && r.ticket_net.as_ref().is_some_and(|t| t.ticket == ticket));
    let running = clones.flat_map(|r| std::iter::once(r.host.as_str()).chain(r.moving.as_ref().map(|m| m.to.as_str())));
    granted.chain(running).collect()
}

/// The registered addresses of hosts `names` (sorted, each once).
fn addresses(st: &crate::State, names: &BTreeSet<&str>) -> Vec<std::net::IpAddr> {
    let set: BTreeSet<std::net::IpAddr> = names.iter().filter_map(|n| st.hosts.get(*n)).filter_map(|h| h.info.addr.parse().ok()).collect();
    set.into_iter().collect()
}

/// `ticket`'s hosts changed from `before` (a clone of it moved): tell each host running a clone
/// of it the members now, so its clones' listeners there let the moved clone in (and stop
/// letting in a host it left). Nothing when they did not change. Sent by the caller.
pub(crate) fn members_changed(st: &crate::State, conn: u64, ticket: u64, before: &BTreeSet<String>) -> Vec<(Outgoing, Msg)> {
    let now = ticket_hosts(st, conn, ticket);
    if now.iter().copied().eq(before.iter().map(String::as_str)) {
        return Vec::new();
    }
    let members = addresses(st, &now);
    let running: BTreeSet<&str> =
        st.routes.values().filter(|r| r.client_conn == conn && r.ticket_net.as_ref().is_some_and(|t| t.ticket == ticket)).map(|r| r.host.as_str()).collect();
    running
        .iter()
        .filter_map(|n| st.hosts.get(*n))
        .filter(|h| h.info.cannot_isolate.is_none())
        .map(|h| (h.tx.clone(), Msg::TicketMembers { ticket, members: members.clone() }))
        .collect()
}

/// A fork ticket's grant: up to `n` clones by free cores (cores minus
/// tasks placed there). Hierarchical tickets fill each host's cores before
/// moving on (one restore per host, then local forks); others spread
/// round-robin so clones land on as many hosts as possible. The grant is
/// advisory: the clones are then launched as tasks.
pub(crate) fn grant(hosts: &HashMap<String, Host>, n: u32, hierarchical: bool) -> Result<Vec<(String, u32)>, Unplaceable> {
    grant_among(hosts, n, hierarchical, |_| true)
}

/// A ticket's grant: (host, clones there).
pub(crate) type Placement = Vec<(String, u32)>;

/// A fork ticket's grant as its network isolation wants it: `Off`, by free cores; `On`, from the
/// hosts that can enforce a ticket's own network first and then from the others (returned with
/// why they cannot: their clones get their host's network); `Required`, only from hosts that can,
/// refused naming the others when that grants fewer clones than the whole cluster would.
pub(crate) fn grant_isolated(
    hosts: &HashMap<String, Host>,
    n: u32,
    hierarchical: bool,
    isolation: NetworkIsolation,
) -> Result<(Placement, Vec<Unisolated>), Unplaceable> {
    let can = |h: &Host| h.info.cannot_isolate.is_none();
    let total = |g: &[(String, u32)]| g.iter().map(|(_, k)| *k).sum::<u32>();
    let why_not = |name: &str| hosts.get(name).and_then(|h| h.info.cannot_isolate.clone());
    match isolation {
        NetworkIsolation::Off => Ok((grant(hosts, n, hierarchical)?, Vec::new())),
        NetworkIsolation::On => {
            // No host with a free core at all: refused as any ticket is.
            grant(hosts, n, hierarchical)?;
            let mut out = grant_among(hosts, n, hierarchical, can).unwrap_or_default();
            let left = n - total(&out);
            if left > 0 {
                if let Ok(more) = grant_among(hosts, left, hierarchical, |h| !can(h)) {
                    out.extend(more);
                }
            }
            let unisolated = out.iter().filter_map(|(h, _)| Some(Unisolated { host: h.clone(), why: why_not(h)? })).collect();
            Ok((out, unisolated))
        }
        NetworkIsolation::Required => {
            let all = grant(hosts, n, hierarchical)?;
            let isolated = grant_among(hosts, n, hierarchical, can).unwrap_or_default();
            if total(&isolated) < total(&all) {
                let mut cannot: Vec<(String, String)> =
                    hosts.values().filter(|h| !h.info.home).filter_map(|h| Some((h.info.name.clone(), h.info.cannot_isolate.clone()?))).collect();
                cannot.sort_by_key(|(h, _)| natural_key(h));
                return Err(Unplaceable::CannotIsolate { could: total(&all), isolated: total(&isolated), cannot });
            }
            Ok((isolated, Vec::new()))
        }
    }
}

/// [`grant`] from the hosts `eligible` keeps.
fn grant_among(hosts: &HashMap<String, Host>, n: u32, hierarchical: bool, eligible: impl Fn(&Host) -> bool) -> Result<Vec<(String, u32)>, Unplaceable> {
    let mut free: Vec<(String, u32)> = hosts
        .values()
        .filter(|h| !h.info.home && eligible(h))
        .map(|h| (h.info.name.clone(), h.info.cores.saturating_sub(h.cores_busy)))
        .filter(|(_, f)| *f > 0)
        .collect();
    if free.is_empty() {
        return Err(if hosts.values().all(|h| h.info.home) { Unplaceable::NoHosts } else { Unplaceable::NoFreeCores });
    }
    free.sort_by(|a, b| b.1.cmp(&a.1).then(natural_key(&a.0).cmp(&natural_key(&b.0))));
    let mut out: Vec<(String, u32)> = Vec::new();
    let mut left = n;
    if hierarchical {
        for (h, f) in free {
            if left == 0 {
                break;
            }
            let k = f.min(left);
            out.push((h, k));
            left -= k;
        }
    } else {
        while left > 0 && free.iter().any(|(_, f)| *f > 0) {
            for (h, f) in free.iter_mut() {
                if left == 0 || *f == 0 {
                    continue;
                }
                *f -= 1;
                left -= 1;
                match out.iter_mut().find(|(o, _)| o == h) {
                    Some((_, k)) => *k += 1,
                    None => out.push((h.clone(), 1)),
                }
            }
        }
    }
    Ok(out)
}

/// Sort "h2" before "h10".
pub(crate) fn natural_key(s: &str) -> (String, u64) {
    let digits: String = s.chars().rev().take_while(char::is_ascii_digit).collect::<Vec<_>>().into_iter().rev().collect();
    let prefix = s[..s.len() - digits.len()].to_string();
    (prefix, digits.parse().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use starling_proto::HostInfo;

    fn hosts(spec: &[(&str, u32, u32)]) -> HashMap<String, Host> {
        spec.iter()
            .map(|&(name, cores, busy)| {
                let info = HostInfo {
                    name: name.into(),
                    addr: String::new(),
                    pid: 1,
                    cores,
                    mem_bytes: 0,
                    load: 0.0,
                    running: 0,
                    page_distribution: None,
                    owner: None,
                    home: false,
                    peer: None,
                    cannot_isolate: None,
                };
                (name.to_string(), Host { info, tx: tokio::sync::mpsc::channel(1).0, cores_busy: busy, conn_id: 0 })
            })
            .collect()
    }

    fn owned(state: &str, cpu: f32) -> Option<starling_proto::OwnerReport> {
        Some(starling_proto::OwnerReport {
            state: state.into(),
            cpu,
            guest_cpu: 0.0,
            keyboard: "idle".into(),
            mem_available: 0,
            guest_mem: 0,
            guest_mem_cap: None,
            guests_frozen: false,
            low_water: 0,
            high_water: 0,
            priority: "cpu.idle".into(),
            policy: "LF".into(),
            pause_s: 600,
            suspended: false,
            doing: String::new(),
            guest_cgroup: String::new(),
            owner_cgroup: String::new(),
            rate_windows: None,
        })
    }

    #[test]
    fn launches_go_to_idle_owners_first_then_the_lightest_owner() {
        // h1: owner busy, nothing placed; h2: owner light, one task; h3: owner idle, one task.
        let mut h = hosts(&[("h1", 4, 0), ("h2", 4, 1), ("h3", 4, 1)]);
        h.get_mut("h1").unwrap().info.owner = owned("active-busy", 0.9);
        h.get_mut("h2").unwrap().info.owner = owned("active-light", 0.2);
        h.get_mut("h3").unwrap().info.owner = owned("idle", 0.0);
        assert_eq!(pick(&mut h, None, 1, false).unwrap().info.name, "h3", "idle owner first, even with more tasks");
        h.get_mut("h3").unwrap().cores_busy = 4;
        assert_eq!(pick(&mut h, None, 1, false).unwrap().info.name, "h2", "then the lightest owner");
        h.get_mut("h2").unwrap().cores_busy = 4;
        assert_eq!(pick(&mut h, None, 1, false).unwrap().info.name, "h1", "a busy owner's host still takes work when nothing else can");
    }

    #[test]
    fn hosts_whose_guests_are_held_for_memory_come_last() {
        // h1: owner idle but its guests capped by the memory band; h2: owner light; h3: idle, frozen.
        let mut h = hosts(&[("h1", 4, 0), ("h2", 4, 1), ("h3", 4, 1)]);
        h.get_mut("h1").unwrap().info.owner = owned("idle", 0.0);
        h.get_mut("h1").unwrap().info.owner.as_mut().unwrap().guest_mem_cap = Some(64 << 20);
        h.get_mut("h2").unwrap().info.owner = owned("active-light", 0.2);
        h.get_mut("h3").unwrap().info.owner = owned("idle", 0.0);
        h.get_mut("h3").unwrap().info.owner.as_mut().unwrap().guests_frozen = true;
        assert_eq!(pick(&mut h, None, 1, false).unwrap().info.name, "h2", "an owner at work before capped guests");
        h.get_mut("h2").unwrap().cores_busy = 4;
        assert_eq!(pick(&mut h, None, 1, false).unwrap().info.name, "h1", "then capped, idle, less loaded first");
        h.get_mut("h1").unwrap().cores_busy = 4;
        assert_eq!(pick(&mut h, None, 1, false).unwrap().info.name, "h3", "a frozen host still takes work when nothing else can");
        assert_eq!(pick(&mut h, Some("h3"), 1, false).unwrap().info.name, "h3", "named: placed there");
    }

    #[test]
    fn hierarchical_tickets_fill_hosts_and_spread_ones_go_round() {
        let h = hosts(&[("h1", 4, 0), ("h2", 4, 1), ("h10", 2, 0)]);
        assert_eq!(grant(&h, 6, true).unwrap(), vec![("h1".to_string(), 4), ("h2".to_string(), 2)]);
        assert_eq!(grant(&h, 5, false).unwrap(), vec![("h1".to_string(), 2), ("h2".to_string(), 2), ("h10".to_string(), 1)]);
        // More than there are free cores: what is free.
        assert_eq!(grant(&h, 100, true).unwrap().iter().map(|(_, k)| k).sum::<u32>(), 9);
        assert_eq!(grant(&hosts(&[]), 1, false), Err(Unplaceable::NoHosts));
        assert_eq!(grant(&hosts(&[("h1", 2, 2)]), 1, false), Err(Unplaceable::NoFreeCores));
    }

    #[test]
    fn isolated_tickets_prefer_hosts_that_can_enforce_and_required_ones_refuse_the_others() {
        let mut h = hosts(&[("h1", 2, 0), ("h2", 2, 0), ("h3", 2, 0)]);
        h.get_mut("h2").unwrap().info.cannot_isolate = Some("no root".into());
        let two = |v: &[(&str, u32)]| v.iter().map(|(n, k)| (n.to_string(), *k)).collect::<Vec<_>>();
        // Enough cores on the hosts that can: only them (spread round them).
        assert_eq!(grant_isolated(&h, 4, false, NetworkIsolation::On).unwrap(), (two(&[("h1", 2), ("h3", 2)]), vec![]));
        assert_eq!(grant_isolated(&h, 4, false, NetworkIsolation::Required).unwrap(), (two(&[("h1", 2), ("h3", 2)]), vec![]));
        // Off spreads over every host, as before.
        assert_eq!(grant_isolated(&h, 3, false, NetworkIsolation::Off).unwrap().0, two(&[("h1", 1), ("h2", 1), ("h3", 1)]));
        // More than they have: On takes the rest from h2 and names it; Required refuses, naming h2.
        let unisolated = vec![Unisolated { host: "h2".into(), why: "no root".into() }];
        assert_eq!(grant_isolated(&h, 6, false, NetworkIsolation::On).unwrap(), (two(&[("h1", 2), ("h3", 2), ("h2", 2)]), unisolated));
        let refused = grant_isolated(&h, 5, true, NetworkIsolation::Required).unwrap_err();
        assert_eq!(refused, Unplaceable::CannotIsolate { could: 5, isolated: 4, cannot: vec![("h2".into(), "no root".into())] });
        assert!(refused.to_string().contains("h2 (no root)"), "{refused}");
        // Only hosts that cannot: On runs there (named), Required refuses.
        let mut only = hosts(&[("rl1", 2, 0)]);
        only.get_mut("rl1").unwrap().info.cannot_isolate = Some("not root".into());
        assert_eq!(grant_isolated(&only, 1, false, NetworkIsolation::On).unwrap().1, vec![Unisolated { host: "rl1".into(), why: "not root".into() }]);
        assert!(matches!(grant_isolated(&only, 1, false, NetworkIsolation::Required), Err(Unplaceable::CannotIsolate { could: 1, isolated: 0, .. })));
        // A full cluster is refused as before.
        assert_eq!(grant_isolated(&hosts(&[("h1", 2, 2)]), 1, false, NetworkIsolation::Required), Err(Unplaceable::NoFreeCores));
    }

    #[test]
    fn launches_go_to_the_least_loaded_host_and_wait_when_all_are_busy() {
        let mut h = hosts(&[("h1", 2, 1), ("h2", 2, 0)]);
        assert_eq!(pick(&mut h, None, 1, false).map(|h| h.info.name.clone()).as_deref(), Some("h2"));
        assert_eq!(h["h2"].cores_busy, 1);
        assert_eq!(pick(&mut h, Some("h1"), 1, false).map(|h| h.info.name.clone()).as_deref(), Some("h1"));
        assert!(pick(&mut h, None, 2, false).is_none(), "no host has 2 free cores");
        assert_eq!(
            check_placeable(&h, Some("h3"), 1),
            Err(Unplaceable::NoSuchHost { name: "h3".into(), known: vec!["h1".into(), "h2".into()] })
        );
        assert_eq!(check_placeable(&h, None, 3), Err(Unplaceable::NoHostLargeEnough(3)));
        assert_eq!(check_placeable(&h, None, 2), Ok(()), "busy now, placeable later");
    }
}
