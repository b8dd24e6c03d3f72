//! Clone tasks (remote fork): a task whose program is the restorer.
//!
//! A clone runs in the same sandbox over the same file view as an `exec`
//! task — so the libraries it maps come from the client's files (by path,
//! hash-checked by the view), it sees the client's files, and what it writes
//! comes home at exit under the usual commit rules. What differs:
//!
//! * the program is the static restorer embedded in this binary, run from a
//!   memfd (`starling_sandbox::spawn_program`), with the restore plan on fd 3
//!   and one end of a socketpair to the fault handler on fd 4;
//! * the sandbox does not drop to the client's credentials: the restorer
//!   needs root for its nested PID namespace (clone3 `set_tid` = template
//!   PID) and for a userfaultfd that handles kernel-mode faults, and drops to
//!   the template's uid/gid itself before jumping into the clone;
//! * the fault handlers run here, in the agent (outside the sandbox): a
//!   control thread reads the restorer's records from the socket, and for
//!   each clone's userfaultfd starts a handler that fetches `Fetch` pages
//!   from the client's page server (TCP / mcdist) and reads `File` pages from
//!   the same files the clone sees (the task's overlay root + the path);
//! * every clone of a ticket on this host — the clones of a hierarchical
//!   task, and spread tasks placed here together — shares one
//!   [`HostTicket`] (from the agent's [`HostTickets`]): the descriptor is
//!   fetched once per host, and one multicast receiver brings pages for all
//!   of them;
//! * a hierarchical task (`CloneSpec::local_forks` > 0) restores once and
//!   holds several clones: the restorer forks them at the restore point and
//!   its PID 1 reports each one's exit status over the same socket;
//! * while the clones run, a reporter thread sends each one's handler counters
//!   so far to the head every [`PROGRESS_EVERY`] when they changed
//!   (`CloneProgress`: the dashboard's live fault rate per ticket);
//! * when the clones have ended, each one's status and handler counters go
//!   to the client in a `CloneStats` message.

use crate::{fork_step, AgentError, Result, Step};
use starling_fork::fault::{FaultHandler, FaultStats, Materialize};
use starling_fork::host::{HostTicket, HostTickets};
use starling_fork::image::abi::process::Creds;
use starling_fork::image::{Descriptor, PlanOptions, Region, RegionKind};
use starling_fork::page_server::PageClient;
use starling_fork::restore::{Restore, Serve};
use starling_proto::conn::Outgoing;
use starling_proto::{CloneSpec, Msg, Stream, TaskId};
use starling_sandbox::TaskProgram;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

/// How often a clone task's running clones' counters are looked at (and sent when changed).
pub(crate) const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// The fault handlers' counters of a task's clones, as their handlers start.
type LiveStats = Arc<Mutex<Vec<(u32, Arc<FaultStats>)>>>;

/// The restore of a clone task's clones, running while the sandbox runs.
pub(crate) struct CloneRun {
    /// The task's clones: IDs `first .. first + count`.
    first: u32,
    count: u32,
    restore: Restore,
    /// The agent's "last clone's page distribution" (shown by `starling status`).
    distribution: DistributionReport,
    /// The head's placement stamp (`CloneSpec::placed_ns`).
    placed_ns: u64,
    /// Makes a one-clone task's memory all its own before it moves (none
    /// for a hierarchical task: its clones move as one tree, which is not
    /// supported).
    pub materialize: Option<Materialize>,
    live: LiveStats,
    /// Shared with the ticket's other clones on this host; held until the clones ended.
    _host: Arc<HostTicket>,
    /// The reporter thread (see [`CloneRun::report_progress`]) and what stops it (dropping it).
    reporter: Option<(mpsc::Sender<()>, std::thread::JoinHandle<()>)>,
}

/// A clone task's critical-path stamps taken by the agent (CLOCK_REALTIME
/// ns), shared by all of the task's clones; sent in their `CloneStats`.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct HostStamps {
    pub launch_received_ns: u64,
    /// File view and overlay mounted.
    pub view_mounted_ns: u64,
    /// Descriptor fetched, sandbox started with the restorer.
    pub sandbox_ready_ns: u64,
}

impl HostStamps {
    /// The clone's counters with the host's stamps and the head's placement stamp filled in.
    pub fn apply(&self, spec_placed_ns: u64, mut c: starling_proto::CloneCounters) -> starling_proto::CloneCounters {
        c.stamp_placed_ns = spec_placed_ns;
        c.stamp_launch_received_ns = self.launch_received_ns;
        c.stamp_view_mounted_ns = self.view_mounted_ns;
        c.stamp_sandbox_ready_ns = self.sandbox_ready_ns;
        c
    }
}

/// Where the agent keeps the last clone's page distribution mode.
pub(crate) type DistributionReport = Arc<std::sync::Mutex<Option<String>>>;

/// Record (and log) how clone `id` gets its pages.
fn report_mode(report: &DistributionReport, id: u32, stats: &FaultStats) {
    // Compared by name: the agent does not depend on starling-mcdist.
    let text = stats.mode().as_str().to_string();
    if text == "unknown" {
        return;
    }
    let fallback = text.starts_with("unicast (");
    let mut g = report.lock().unwrap_or_else(|p| p.into_inner());
    if g.as_deref() != Some(text.as_str()) {
        if fallback {
            log::warn!("clone {id}: page distribution falls back to unicast (multicast unavailable)");
        } else {
            log::info!("clone {id}: page distribution {text}");
        }
    }
    *g = Some(text);
}

/// The descriptor as the handler must see it: file paths resolved under the
/// task's root (the handler is outside the sandbox's chroot).
pub(crate) fn rooted(desc: &Descriptor, root: &Path) -> Descriptor {
    let mut d = desc.clone();
    root_file_paths(&mut d.regions, root);
    d
}

fn root_file_paths(regions: &mut [Region], root: &Path) {
    for r in regions {
        if let RegionKind::File { path, .. } = &mut r.kind {
            *path = root.join(path.trim_start_matches('/')).to_string_lossy().into_owned();
        }
    }
}

/// Fetch and check the clone spec's descriptor, start the restore (whose
/// control thread starts a fault handler per clone as its userfaultfd
/// arrives), and return the program (restorer + plan + handler socket) the
/// sandbox must run.
pub(crate) fn prepare(
    spec: &CloneSpec,
    root: &Path,
    distribution: DistributionReport,
    tickets: &HostTickets,
    settings: &starling_config::ForkSettings,
    rootless: bool,
) -> Result<(TaskProgram, CloneRun)> {
    let server: SocketAddr =
        spec.page_server.parse().map_err(|_| AgentError::PageServerAddress(spec.page_server.clone()))?;
    let options = starling_fork::fault::FaultOptions::from_settings(settings);
    let key = spec.page_key;
    let host = tickets.get(server, &key, &spec.descriptor_hash.0, &options);
    let (encoded, mode) = host.descriptor(&spec.descriptor_hash.0, spec.descriptor_len as usize).map_err(fork_step(Step::FetchDescriptor))?;
    match mode {
        Some(mode) => log::debug!("clone {}: descriptor ({} bytes) by {}", spec.clone_id, encoded.len(), mode.as_str()),
        None => log::debug!("clone {}: descriptor ({} bytes) as fetched for this host before", spec.clone_id, encoded.len()),
    }
    let mut desc = Descriptor::decode(&encoded).map_err(|e| fork_step(Step::DecodeDescriptor)(e.into()))?;
    if rootless {
        // The agent's user namespace maps one id, 0 (its user outside): the clone runs as that
        // user whoever the template was, as this agent's exec tasks do.
        desc.process.core.creds = Creds::default();
        desc.process.groups.clear();
    }
    let (first, count) = (spec.clone_id, 1 + spec.local_forks);
    let handler_desc = Arc::new(rooted(&desc, root));
    let report = distribution.clone();
    let materialize = if count == 1 { Some(Materialize::new().map_err(fork_step(Step::PrepareRestore))?) } else { None };
    let asked = materialize.clone();
    let live: LiveStats = Arc::default();
    let registry = live.clone();
    let shared = host.clone();
    let serve: Serve = Arc::new(move |clone_id, uffd, stats, stop| {
        registry.lock().unwrap_or_else(|p| p.into_inner()).push((clone_id, stats.clone()));
        let client = PageClient::connect(server, &key, shared.options().encrypt)?;
        let mut h = FaultHandler::on_host(uffd, &handler_desc, client, stats.clone(), &shared);
        if let Some(m) = &asked {
            h = h.with_materialize(m.clone(), server);
        }
        report_mode(&report, clone_id, &stats);
        h.run(stop)
    });
    // Clones run under the same filter as exec tasks: the restorer installs
    // it (with no_new_privs) on every thread just before they resume.
    let seccomp = starling_sandbox::harden::task_filter_bytes().map_err(crate::AgentError::Filter)?;
    let plan = PlanOptions { clone_id: first, clone_count: count, new_pid_namespace: true, clone_id_in_rax: true, seccomp: &seccomp, terminal: false, join_groups: 0 };
    let (program, restore) = Restore::start(&desc, plan, serve).map_err(fork_step(Step::PrepareRestore))?;
    Ok((TaskProgram { program: program.program, fds: program.fds }, CloneRun { first, count, restore, placed_ns: spec.placed_ns, distribution, materialize, live, _host: host, reporter: None }))
}

impl CloneRun {
    /// Start reporting the clones' counters to the head while they run: every
    /// [`PROGRESS_EVERY`], a `CloneProgress` for each clone whose counters changed
    /// since the last one sent. Stopped (and joined) by [`CloneRun::finish`], so
    /// none follows the clone's `CloneStats`.
    pub(crate) fn report_progress(&mut self, task: TaskId, tx: &Outgoing) {
        let (stop, stopped) = mpsc::channel::<()>();
        let (live, tx) = (self.live.clone(), tx.clone());
        let spawned = std::thread::Builder::new().name(format!("clone-progress-{task}")).spawn(move || {
            let mut sent: std::collections::HashMap<u32, starling_proto::CloneCounters> = Default::default();
            // Ends when `finish` drops the sender (or the head's connection is gone).
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(PROGRESS_EVERY) {
                let now: Vec<(u32, starling_proto::CloneCounters)> =
                    live.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(id, s)| (*id, s.snapshot())).collect();
                for (clone_id, counters) in now {
                    if sent.get(&clone_id) == Some(&counters) {
                        continue;
                    }
                    if tx.blocking_send(Msg::CloneProgress { task, clone_id, counters }).is_err() {
                        return;
                    }
                    sent.insert(clone_id, counters);
                }
            }
        });
        match spawned {
            Ok(handle) => self.reporter = Some((stop, handle)),
            // Only the dashboard's live view misses it: the final counters still come.
            Err(e) => log::warn!("task {task}: no live clone counters: {e}"),
        }
    }

    /// After the sandbox ended: stop the handlers, then send each clone's
    /// status and counters (none when the clone moved away: its new host
    /// reports its end).
    pub(crate) fn finish(mut self, task: TaskId, tx: &Outgoing, moved: bool, stamps: &HostStamps) {
        let say = |msg: String| {
            let _ = tx.blocking_send(Msg::Output { task, stream: Stream::Stderr, data: msg.into_bytes() });
        };
        if let Some((stop, handle)) = self.reporter.take() {
            drop(stop);
            let _ = handle.join();
        }
        let (first, last) = (self.first, self.first + self.count - 1);
        let (outcomes, channel) = self.restore.finish();
        if moved {
            return;
        }
        if let Some(e) = channel {
            say(format!("starling: clones {first}..{last}: {e}\n"));
        }
        for o in outcomes {
            if let Some(e) = &o.handler_error {
                say(format!("starling: {e}\n"));
            }
            // A fetch that timed out mid-run may have switched it to unicast.
            let stats = FaultStats::default();
            stats.mode.store(u8::try_from(o.counters.mode).unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
            report_mode(&self.distribution, o.clone_id, &stats);
            let _ = tx.blocking_send(Msg::CloneStats { task, clone_id: o.clone_id, status: o.status, counters: stamps.apply(self.placed_ns, o.counters) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use starling_fork::image::PageRuns;

    #[test]
    fn handler_sees_file_paths_under_the_task_root() {
        let region = |kind| Region {
            start: 0x1000,
            end: 0x2000,
            prot: 1,
            shared: false,
            growsdown: false,
            kind,
            pages: PageRuns(vec![]),
        };
        let mut regions = vec![
            region(RegionKind::File { path: "/usr/lib/libc.so.6".into(), offset: 0, inode: 1 }),
            region(RegionKind::Anonymous { name: "[heap]".into() }),
        ];
        root_file_paths(&mut regions, Path::new("/var/lib/starling/tasks/7/root"));
        assert_eq!(
            regions[0].kind,
            RegionKind::File { path: "/var/lib/starling/tasks/7/root/usr/lib/libc.so.6".into(), offset: 0, inode: 1 }
        );
        assert_eq!(regions[1].kind, RegionKind::Anonymous { name: "[heap]".into() });
    }

    #[test]
    fn host_stamps_fill_their_slots_and_keep_the_handlers() {
        let stamps = HostStamps { launch_received_ns: 11, view_mounted_ns: 12, sandbox_ready_ns: 13 };
        let handler = starling_proto::CloneCounters { faults: 5, stamp_restorer_running_ns: 14, stamp_first_page_ns: 15, ..Default::default() };
        let c = stamps.apply(10, handler);
        assert_eq!(
            (c.stamp_placed_ns, c.stamp_launch_received_ns, c.stamp_view_mounted_ns, c.stamp_sandbox_ready_ns),
            (10, 11, 12, 13)
        );
        assert_eq!((c.faults, c.stamp_restorer_running_ns, c.stamp_first_page_ns), (5, 14, 15));
        // The parent's stamps are the parent's to fill.
        assert_eq!((c.stamp_ticket_ns, c.stamp_template_ns, c.stamp_descriptor_ns), (0, 0, 0));
    }

}
