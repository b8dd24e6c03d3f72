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
//! * the fault handler runs here, in the agent (outside the sandbox): it
//!   receives the clone's userfaultfd over the socket, fetches `Fetch` pages
//!   from the client's page server over TCP and reads `File` pages from the
//!   same files the clone sees (the task's overlay root + the path);
//! * when the clone has ended, the handler's counters go to the client in a
//!   `CloneStats` message.

use anyhow::{anyhow, Context, Result};
use starling_fork::descriptor::{Descriptor, RegionKind};
use starling_fork::fault::{FaultHandler, FaultStats};
use starling_fork::page_server::PageClient;
use starling_proto::conn::Outgoing;
use starling_proto::{CloneSpec, Msg, Stream, TaskId};
use starling_sandbox::TaskProgram;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

/// Fixed descriptor numbers the restorer expects.
const PLAN_FD: i32 = 3;
const HANDLER_FD: i32 = 4;

/// A clone's fault handler, running while the sandbox runs.
pub(crate) struct CloneRun {
    id: u32,
    stats: Arc<FaultStats>,
    stop: Option<OwnedFd>,
    handler: Option<std::thread::JoinHandle<starling_fork::Result<()>>>,
    /// The agent's "last clone's page distribution" (shown by `starling status`).
    distribution: DistributionReport,
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

/// Decode and check the clone spec, start the fault handler, and return the
/// program (restorer + plan + handler socket) the sandbox must run.
pub(crate) fn prepare(spec: &CloneSpec, root: &Path, distribution: DistributionReport) -> Result<(TaskProgram, CloneRun)> {
    let desc = Descriptor::decode(&spec.descriptor).context("the clone's process descriptor")?;
    let server: SocketAddr =
        spec.page_server.parse().map_err(|_| anyhow!("bad page server address {:?}", spec.page_server))?;
    if spec.local_forks != 0 {
        // The client never asks for them (see starling_fork::cluster); refuse
        // rather than silently run fewer clones than were asked for.
        return Err(anyhow!("local forks inside a clone are not supported"));
    }
    let plan = starling_fork::local::plan_memfd(&desc, spec.clone_id)?;
    let (ours, theirs) = starling_fork::local::handler_socketpair()?;
    let program = starling_fork::local::restorer_program()?;
    let (stop_r, stop_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let stats = Arc::new(FaultStats::default());
    let handler_desc = rooted(&desc, root);
    let stats2 = stats.clone();
    let id = spec.clone_id;
    let report = distribution.clone();
    let handler = std::thread::Builder::new()
        .name(format!("clone-fault-{id}"))
        .spawn(move || -> starling_fork::Result<()> {
            // None: the restorer ended before registering anything.
            let Some(uffd) = starling_fork::local::recv_fd(&ours)? else { return Ok(()) };
            let client = PageClient::connect(server)?;
            let mut h = FaultHandler::new(uffd, &handler_desc, client, stats2.clone());
            report_mode(&report, id, &stats2);
            if let Some(n) = std::env::var("STARLING_FORK_PREFETCH").ok().and_then(|v| v.parse().ok()) {
                h.set_prefetch(n);
            }
            h.run(stop_r.as_fd())
        })
        .context("starting the fault handler")?;
    Ok((
        TaskProgram { program, fds: vec![(PLAN_FD, plan), (HANDLER_FD, theirs)] },
        CloneRun { id, stats, stop: Some(stop_w), handler: Some(handler), distribution },
    ))
}

impl CloneRun {
    /// After the sandbox ended: stop the handler and send its counters.
    pub(crate) fn finish(mut self, task: TaskId, tx: &Outgoing) {
        self.stop.take();
        if let Some(h) = self.handler.take() {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    let msg = format!("starling: clone {}: fault handler: {e}\n", self.id);
                    let _ = tx.blocking_send(Msg::Output { task, stream: Stream::Stderr, data: msg.into_bytes() });
                }
                Err(_) => log::warn!("task {task}: fault handler panicked"),
            }
        }
        // A fetch that timed out mid-run may have switched it to unicast.
        report_mode(&self.distribution, self.id, &self.stats);
        let counters = self.stats.snapshot().to_vec();
        let _ = tx.blocking_send(Msg::CloneStats { task, counters });
    }
}

impl Drop for CloneRun {
    fn drop(&mut self) {
        // Not finished (the sandbox failed to start): stopping the handler is
        // enough; it ends once the restorer's end of the socket is gone.
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
