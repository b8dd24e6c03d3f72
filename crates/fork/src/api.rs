//! The fork API: tickets, clone, join, kill — over one of two backends.
//!
//! Numbering follows SnowFlock: `clone` returns 0 in the caller (the
//! *parent*) and 1..=m in the m clones of a ticket.
//!
//! Backend choice (`fork.backend`, `STARLING_FORK_BACKEND`; the caller
//! passes the resolved [`Config`]: this crate reads no environment):
//! * `cluster` (the default): clones run on the hosts of the starling
//!   cluster found as `starling exec` finds it (`STARLING_CLUSTER`, else
//!   `/run/starling/cluster.json`); the head grants by free cores. No
//!   reachable cluster is an error (one line naming both remedies), never a
//!   silent fallback: a program asking for remote CPUs should know it got none.
//! * `local`: clones on this machine ([`crate::local`]), up to
//!   [`MAX_LOCAL_CLONES`]; used by the restore-correctness suite.

use crate::dump::dump;
use crate::Descriptor;
use starling_image::abi::counters::CloneCounters;
use crate::cluster::{CloneState, ClusterClones, ClusterLink};
use crate::fault::FaultOptions;
use crate::host::HostTicket;
use crate::local::LocalClone;
use crate::page_server::{PageServer, PageServerOptions};
use crate::template::{fork_template, ForkOutcome, Template};
use crate::PageClass;
use crate::{ForkError, Result, UsageError};
use starling_image::abi::counters::realtime_ns;
use starling_config::{Backend as BackendSetting, Config, ForkSettings, Multicast};
use std::sync::atomic::{AtomicU32, Ordering};

/// Most clones a local ticket grants (this machine's memory and PIDs are finite).
pub const MAX_LOCAL_CLONES: u32 = 64;

/// In a clone: its ID (0 in a process that is not a clone).
static CLONE_ID: AtomicU32 = AtomicU32::new(0);

pub fn current_clone_id() -> u32 {
    CLONE_ID.load(Ordering::Relaxed)
}

/// The clones of a ticket, wherever they run.
enum Clones {
    Local(Vec<LocalClone>),
    Cluster(ClusterClones),
}

struct Active {
    template: Template,
    server: PageServer,
    clones: Clones,
    descriptor_bytes: usize,
    descriptor: Descriptor,
    stamps: ParentStamps,
}

/// The parent's critical-path stamps of a ticket's clones (CLOCK_REALTIME
/// ns; the head's and hosts' come with each clone's `CloneStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParentStamps {
    /// The ticket was granted.
    pub ticket_ns: u64,
    /// The template is forked and its record read.
    pub template_ns: u64,
    /// The descriptor is dumped and the page server serves it.
    pub descriptor_ns: u64,
}

impl ParentStamps {
    /// A clone's counters with the parent's stamps filled in.
    pub fn apply(&self, mut c: CloneCounters) -> CloneCounters {
        c.stamp_ticket_ns = self.ticket_ns;
        c.stamp_template_ns = self.template_ns;
        c.stamp_descriptor_ns = self.descriptor_ns;
        c
    }
}

pub use starling_proto::ExecutorProgress;

/// Where a ticket's clones run.
pub enum Backend {
    Local,
    /// The head's grant: ticket id and (host, clones there).
    /// `unisolated`: granted hosts whose clones run without the ticket's own network, and why.
    Cluster { link: std::sync::Arc<ClusterLink>, ticket: u64, placement: Vec<(String, u32)>, unisolated: Vec<starling_proto::Unisolated> },
}

/// A reservation of clones.
pub struct Ticket {
    pub requested: u32,
    pub allocation: u32,
    pub hierarchical: bool,
    backend: Backend,
    settings: ForkSettings,
    active: Option<Active>,
    used: bool,
    granted_ns: u64,
}

impl Ticket {
    /// Reserve up to `n` clones where `config.fork.backend` says.
    pub fn request(n: i32, hierarchical: bool, config: &Config) -> Result<Ticket> {
        let requested = u32::try_from(n).ok().filter(|n| *n >= 1).ok_or(UsageError::TicketSize(n))?;
        if current_clone_id() != 0 {
            return Err(UsageError::NestedTicket.into());
        }
        let settings = config.fork.clone();
        let (allocation, backend) = match settings.backend {
            BackendSetting::Local => (requested.min(MAX_LOCAL_CLONES), Backend::Local),
            BackendSetting::Cluster => {
                let link = ClusterLink::get(config)?;
                let grant = link.request(requested, hierarchical)?;
                if !grant.unisolated.is_empty() {
                    // The caller asked for isolation where it can be had (`on`): say where it cannot.
                    let hosts: Vec<String> = grant.unisolated.iter().map(|u| format!("{} ({})", u.host, u.why)).collect();
                    eprintln!(
                        "starling: ticket {}: clones on {} run with their host's whole network, not the ticket's own (fork.isolate_network = required refuses such hosts)",
                        grant.ticket,
                        hosts.join(", ")
                    );
                }
                let allocation = grant.placement.iter().map(|(_, k)| *k).sum();
                (allocation, Backend::Cluster { link, ticket: grant.ticket, placement: grant.placement, unisolated: grant.unisolated })
            }
        };
        let granted_ns = realtime_ns();
        Ok(Ticket { requested, allocation, hierarchical, backend, settings, active: None, used: false, granted_ns })
    }

    /// Tell the cluster's head how an executor on this ticket stands (its dashboard shows it);
    /// nothing for the local backend, which has no head.
    pub fn report_executor(&self, progress: starling_proto::ExecutorProgress) -> Result<()> {
        match &self.backend {
            Backend::Local => Ok(()),
            Backend::Cluster { link, ticket, .. } => link.executor_progress(*ticket, progress),
        }
    }

    /// Hosts and clones per host (cluster backend); empty for the local one.
    pub fn placement(&self) -> &[(String, u32)] {
        match &self.backend {
            Backend::Local => &[],
            Backend::Cluster { placement, .. } => placement,
        }
    }

    /// Granted hosts whose clones run with their host's whole network rather than the ticket's own
    /// (they cannot enforce it; `fork.isolate_network = on`), and why; empty for the local backend.
    pub fn unisolated(&self) -> &[starling_proto::Unisolated] {
        match &self.backend {
            Backend::Local => &[],
            Backend::Cluster { unisolated, .. } => unisolated,
        }
    }

    /// Fork: 0 in the parent, the clone ID (1..=allocation) in each clone.
    pub fn clone_now(&mut self) -> Result<u32> {
        if current_clone_id() != 0 {
            return Err(UsageError::NestedClone.into());
        }
        if self.used {
            return Err(UsageError::TicketUsed.into());
        }
        self.used = true;
        // Flush stdio so buffered output is not duplicated into every clone.
        // SAFETY: fflush(NULL) flushes all open output streams.
        unsafe { libc::fflush(std::ptr::null_mut()) };
        let template = match fork_template()? {
            ForkOutcome::Clone(id) => {
                CLONE_ID.store(id, Ordering::Relaxed);
                return Ok(id);
            }
            ForkOutcome::Parent(t) => t,
        };
        let template_ns = realtime_ns();
        let descriptor = dump(template.pid, &template.record, self.settings.heuristics)?;
        // Served by the page server (cluster hosts fetch it like a page).
        let encoded = descriptor.encode();
        let descriptor_bytes = encoded.len();
        let served: Vec<(u64, u64)> = descriptor
            .regions
            .iter()
            .filter(|r| r.pages.count(PageClass::Fetch) > 0)
            .map(|r| (r.start, r.end))
            .collect();
        let default_bind = match &self.backend {
            Backend::Local => std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            // Where the hosts reach this machine (the embedded cluster's bridge address).
            Backend::Cluster { link, .. } => std::net::SocketAddr::new(link.parent_ip, 0),
        };
        let bind = self.settings.page_server_bind.unwrap_or(default_bind);
        // One clone has nobody to share its pages with: by default it gets
        // them over TCP, as multicast would only add the sender's queue and
        // datagram reassembly to every fault (~0.35 ms against ~0.1 ms per
        // fault on the embedded cluster). `fork.mcdist` = on|push still forces it.
        let mcdist = match self.settings.mcdist {
            Some(m) => m,
            None if self.allocation == 1 => Multicast::Off,
            None => Multicast::On,
        };
        // The ticket's secret: clones get it with their launch (over the
        // authenticated control channel), nobody else does.
        let key = starling_proto::SecretKey::random();
        let opts = PageServerOptions { descriptor: encoded.clone(), mcdist, ticket: None, key, encrypt: self.settings.encrypt };
        let server = PageServer::start_with(template.pid, served, bind, opts)?;
        let stamps = ParentStamps { ticket_ns: self.granted_ns, template_ns, descriptor_ns: realtime_ns() };
        let clones = match &self.backend {
            Backend::Local => {
                let mut clones = Vec::new();
                // This machine is the clones' one host: they share a multicast receiver.
                let host = std::sync::Arc::new(HostTicket::new(server.addr(), key, FaultOptions::from_settings(&self.settings)));
                for id in 1..=self.allocation {
                    match LocalClone::launch(&descriptor, id, &host) {
                        Ok(c) => clones.push(c),
                        Err(e) => {
                            clones.iter_mut().for_each(LocalClone::kill);
                            clones.iter_mut().for_each(|c| {
                                let _ = c.wait();
                            });
                            return Err(e);
                        }
                    }
                }
                Clones::Local(clones)
            }
            Backend::Cluster { link, ticket, placement, .. } => Clones::Cluster(ClusterClones::launch(
                link.clone(),
                *ticket,
                placement,
                self.hierarchical,
                &crate::cluster::Template { descriptor: &descriptor, encoded: &encoded, page_server: server.addr(), page_key: key },
            )?),
        };
        self.active = Some(Active { template, server, clones, descriptor_bytes, descriptor, stamps });
        Ok(0)
    }

    fn active(&mut self) -> Result<&mut Active> {
        if current_clone_id() != 0 {
            return Err(UsageError::NotParent.into());
        }
        self.active.as_mut().ok_or(ForkError::Usage(UsageError::NoClones))
    }

    /// Wait for every clone, then release the template and the page server.
    /// Returns an error if a fault handler failed.
    pub fn join(&mut self) -> Result<()> {
        let a = self.active()?;
        let mut first_err = None;
        match &mut a.clones {
            Clones::Local(clones) => {
                for c in clones {
                    if let Err(e) = c.wait() {
                        first_err.get_or_insert(e);
                    }
                }
            }
            // Lost clones are a per-clone state (`clone_state`), not a join failure.
            Clones::Cluster(c) => c.wait_all(),
        }
        a.template.release();
        a.server.stop();
        first_err.map_or(Ok(()), Err)
    }

    /// Kill every clone at once, then release like `join`.
    pub fn kill(&mut self) -> Result<()> {
        let a = self.active()?;
        match &mut a.clones {
            Clones::Local(clones) => {
                clones.iter_mut().for_each(LocalClone::kill);
                for c in clones {
                    let _ = c.wait();
                }
            }
            Clones::Cluster(c) => {
                c.kill();
                c.wait_all();
            }
        }
        a.template.release();
        a.server.stop();
        Ok(())
    }

    /// After `join`: one line saying which clones did not exit 0 (None if
    /// all did), for `sf_join`'s "0 if every clone exited 0, else -1".
    pub fn unsuccessful(&self) -> Option<String> {
        let bad: Vec<String> = (1..=self.allocation.cast_signed())
            .filter_map(|id| match self.clone_state(id) {
                Some(CloneState::Exited(0)) => None,
                Some(CloneState::Exited(c)) => Some(format!("clone {id} exited {c}")),
                Some(CloneState::Killed(s)) => Some(format!("clone {id} was killed by signal {s}")),
                Some(CloneState::Lost(why)) => Some(format!("clone {id} was lost ({why})")),
                Some(CloneState::Running) | None => Some(format!("clone {id} has no status")),
            })
            .collect();
        match bad.len() {
            0 => None,
            1..=3 => Some(bad.join("; ")),
            n => Some(format!("{}; and {} more", bad[..3].join("; "), n - 3)),
        }
    }

    /// Exit status of clone `id` once ended: exit code, or 128+signal.
    pub fn clone_status(&self, id: i32) -> Option<i32> {
        self.clone_state(id)?.status_code()
    }

    /// Where clone `id` is: running, exited, killed or lost.
    pub fn clone_state(&self, id: i32) -> Option<CloneState> {
        let id = u32::try_from(id).ok()?;
        match &self.active.as_ref()?.clones {
            Clones::Local(cs) => {
                let c = cs.iter().find(|c| c.id == id)?;
                // The local backend relays the restorer's status: code, or 128+signal.
                Some(match c.status() {
                    None => CloneState::Running,
                    Some(s) if s >= 128 => CloneState::Killed(s - 128),
                    Some(s) => CloneState::Exited(s),
                })
            }
            Clones::Cluster(c) => c.state(id),
        }
    }

    /// [faults, pages fetched, zero pages, file pages, fetch requests, remove
    /// events, distribution mode (`starling_mcdist::Mode` as a number), pages
    /// installed from multicast without asking] (`FaultStats::snapshot`),
    /// then the critical-path stamps (the parent's added here).
    /// Cluster clones report them when they end.
    pub fn clone_stats(&self, id: i32) -> Option<CloneCounters> {
        let id = u32::try_from(id).ok()?;
        let active = self.active.as_ref()?;
        let counters = match &active.clones {
            Clones::Local(cs) => cs.iter().find(|c| c.id == id)?.counters(),
            Clones::Cluster(c) => c.stats(id),
        }?;
        Some(active.stamps.apply(counters))
    }

    /// The host clone `id` runs on (cluster backend).
    pub fn clone_host(&self, id: i32) -> Option<String> {
        match &self.active.as_ref()?.clones {
            Clones::Local(_) => None,
            Clones::Cluster(c) => c.host(u32::try_from(id).ok()?),
        }
    }

    /// Page-server counters: (requests, data pages, zero pages) served so far.
    pub fn server_stats(&self) -> Option<(u64, u64, u64)> {
        use std::sync::atomic::Ordering::Relaxed;
        let s = self.active.as_ref()?.server.stats();
        Some((s.requests.load(Relaxed), s.pages_data.load(Relaxed), s.pages_zero.load(Relaxed)))
    }

    /// What the parent's host sent for this ticket (TCP page server +
    /// multicast sender), readable after join.
    pub fn wire_stats(&self) -> Option<crate::page_server::WireStats> {
        Some(self.active.as_ref()?.server.wire_stats())
    }

    pub fn descriptor(&self) -> Option<&Descriptor> {
        self.active.as_ref().map(|a| &a.descriptor)
    }

    pub fn descriptor_bytes(&self) -> Option<usize> {
        self.active.as_ref().map(|a| a.descriptor_bytes)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if current_clone_id() == 0 && self.active.is_some() {
            let _ = self.kill();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parent_stamps_fill_their_slots_and_keep_the_hosts() {
        let from_host = CloneCounters { pages_fetched: 7, stamp_placed_ns: 20, stamp_first_page_ns: 30, ..Default::default() };
        let c = ParentStamps { ticket_ns: 1, template_ns: 2, descriptor_ns: 3 }.apply(from_host);
        assert_eq!((c.stamp_ticket_ns, c.stamp_template_ns, c.stamp_descriptor_ns), (1, 2, 3));
        assert_eq!((c.pages_fetched, c.stamp_placed_ns, c.stamp_first_page_ns), (7, 20, 30));
    }
}
