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
//! * a hierarchical task (`CloneSpec::local_forks` > 0) restores once and
//!   holds several clones: the restorer forks them at the restore point and
//!   its PID 1 reports each one's exit status over the same socket;
//! * when the clones have ended, each one's status and handler counters go
//!   to the client in a `CloneStats` message.

use crate::{fork_step, AgentError, Result, Step};
use starling_fork::descriptor::{Descriptor, RegionKind};
use starling_fork::fault::{FaultHandler, FaultStats};
use starling_fork::page_server::PageClient;
use starling_proto::conn::Outgoing;
use starling_fork::local::RestorerRecord;
use starling_proto::{CloneSpec, ExitStatus, Msg, Stream, TaskId};
use starling_sandbox::TaskProgram;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

/// Fixed descriptor numbers the restorer expects.
const PLAN_FD: i32 = 3;
const HANDLER_FD: i32 = 4;

/// The fault handlers of a clone task's clones, running while the sandbox runs.
pub(crate) struct CloneRun {
    /// The task's clones: IDs `first .. first + count`.
    first: u32,
    count: u32,
    /// Closing it (the write end of a pipe every handler polls) stops them.
    stop: Option<OwnedFd>,
    /// Reads the restorer's records and starts a handler per clone.
    control: Option<std::thread::JoinHandle<Control>>,
    /// The agent's "last clone's page distribution" (shown by `starling status`).
    distribution: DistributionReport,
}

/// What the control thread saw: a handler per clone that registered memory,
/// each clone's exit status, and a protocol error if any.
#[derive(Default)]
struct Control {
    handlers: Vec<(u32, Arc<FaultStats>, std::thread::JoinHandle<starling_fork::Result<()>>)>,
    statuses: std::collections::HashMap<u32, ExitStatus>,
    error: Option<String>,
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
fn rooted(desc: &Descriptor, root: &Path) -> Descriptor {
    let mut d = desc.clone();
    root_file_paths(&mut d.regions, root);
    d
}

fn root_file_paths(regions: &mut [starling_fork::descriptor::Region], root: &Path) {
    for r in regions {
        if let RegionKind::File { path, .. } = &mut r.kind {
            *path = root.join(path.trim_start_matches('/')).to_string_lossy().into_owned();
        }
    }
}

/// Decode and check the clone spec, start the control thread (which starts
/// a fault handler per clone as its userfaultfd arrives), and return the
/// program (restorer + plan + handler socket) the sandbox must run.
pub(crate) fn prepare(
    spec: &CloneSpec,
    root: &Path,
    distribution: DistributionReport,
    settings: &starling_config::ForkSettings,
) -> Result<(TaskProgram, CloneRun)> {
    let server: SocketAddr =
        spec.page_server.parse().map_err(|_| AgentError::PageServerAddress(spec.page_server.clone()))?;
    let options = starling_fork::fault::FaultOptions::from_settings(settings);
    let (encoded, mode) = starling_fork::fault::fetch_descriptor(server, &spec.descriptor_hash.0, spec.descriptor_len as usize, &options)
        .map_err(fork_step(Step::FetchDescriptor))?;
    log::debug!("clone {}: descriptor ({} bytes) by {}", spec.clone_id, encoded.len(), mode.as_str());
    let desc = Descriptor::decode(&encoded).map_err(fork_step(Step::DecodeDescriptor))?;
    let (first, count) = (spec.clone_id, 1 + spec.local_forks);
    let plan = starling_fork::local::plan_memfd(&desc, first, count).map_err(fork_step(Step::PrepareRestore))?;
    let (ours, theirs) = starling_fork::local::handler_socketpair().map_err(fork_step(Step::PrepareRestore))?;
    let program = starling_fork::local::restorer_program().map_err(fork_step(Step::PrepareRestore))?;
    let (stop_r, stop_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| AgentError::Io { step: Step::Pipe, source: e.into() })?;
    let stop_r = Arc::new(stop_r);
    let handler_desc = Arc::new(rooted(&desc, root));
    let report = distribution.clone();
    let control = std::thread::Builder::new()
        .name(format!("clone-ctl-{first}"))
        .spawn(move || {
            let mut seen = Control::default();
            loop {
                match starling_fork::local::recv_record(&ours) {
                    // Every restorer process has ended (or closed the socket).
                    Ok(None) => break,
                    Ok(Some(RestorerRecord::Userfaultfd { clone_id, fd })) => {
                        if !(first..first + count).contains(&clone_id) || seen.handlers.iter().any(|h| h.0 == clone_id) {
                            seen.error = Some(format!("restorer sent a userfaultfd for clone {clone_id}"));
                            continue;
                        }
                        let stats = Arc::new(FaultStats::default());
                        let (desc, stop, stats2, report) = (handler_desc.clone(), stop_r.clone(), stats.clone(), report.clone());
                        let options = options.clone();
                        let handler = std::thread::Builder::new().name(format!("clone-fault-{clone_id}")).spawn(
                            move || -> starling_fork::Result<()> {
                                let client = PageClient::connect(server)?;
                                let h = FaultHandler::new_with(fd, &desc, client, stats2.clone(), options);
                                report_mode(&report, clone_id, &stats2);
                                h.run(stop.as_fd())
                            },
                        );
                        match handler {
                            Ok(h) => seen.handlers.push((clone_id, stats, h)),
                            Err(e) => seen.error = Some(format!("starting the fault handler of clone {clone_id}: {e}")),
                        }
                    }
                    Ok(Some(RestorerRecord::Exited { clone_id, status })) => {
                        seen.statuses.insert(clone_id, status);
                    }
                    Err(e) => {
                        seen.error = Some(e.to_string());
                        break;
                    }
                }
            }
            seen
        })
        .map_err(crate::io_step(Step::StartControlThread))?;
    Ok((
        TaskProgram { program, fds: vec![(PLAN_FD, plan), (HANDLER_FD, theirs)] },
        CloneRun { first, count, stop: Some(stop_w), control: Some(control), distribution },
    ))
}

impl CloneRun {
    /// After the sandbox ended: stop the handlers, then send each clone's
    /// status and counters.
    pub(crate) fn finish(mut self, task: TaskId, tx: &Outgoing) {
        self.stop.take();
        let seen = match self.control.take().map(|c| c.join()) {
            Some(Ok(seen)) => seen,
            _ => {
                log::warn!("task {task}: clone control thread panicked");
                Control::default()
            }
        };
        let say = |msg: String| {
            let _ = tx.blocking_send(Msg::Output { task, stream: Stream::Stderr, data: msg.into_bytes() });
        };
        if let Some(e) = &seen.error {
            say(format!("starling: clones {}..{}: restorer channel: {e}\n", self.first, self.first + self.count - 1));
        }
        let mut counters = std::collections::HashMap::new();
        for (id, stats, handler) in seen.handlers {
            match handler.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => say(format!("starling: clone {id}: fault handler: {e}\n")),
                Err(_) => log::warn!("task {task}: fault handler of clone {id} panicked"),
            }
            // A fetch that timed out mid-run may have switched it to unicast.
            report_mode(&self.distribution, id, &stats);
            counters.insert(id, stats.snapshot().to_vec());
        }
        for id in self.first..self.first + self.count {
            let _ = tx.blocking_send(Msg::CloneStats {
                task,
                clone_id: id,
                status: seen.statuses.get(&id).copied(),
                counters: counters.remove(&id).unwrap_or_else(|| vec![0; starling_fork::fault::COUNTERS]),
            });
        }
    }
}

impl Drop for CloneRun {
    fn drop(&mut self) {
        // Not finished (the sandbox failed to start): stopping the handlers is
        // enough; the control thread ends once the restorer's end of the
        // socket is gone.
        self.stop.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use starling_fork::descriptor::PageRuns;

    #[test]
    fn handler_sees_file_paths_under_the_task_root() {
        let region = |kind| starling_fork::descriptor::Region {
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

}
