//! `starling ps`: every task the head has placed and not yet seen end, with
//! what it uses now (asked of the agents).

use crate::Head;
use starling_proto::{Msg, TaskRow, TaskUsage};
use std::collections::HashMap;
use std::time::Duration;

/// How long `ps` waits for the agents' usage (a slow agent's tasks show
/// without it).
const USAGE_WAIT: Duration = Duration::from_millis(1500);

/// A command line for display, at most 120 characters.
pub(crate) fn command_line(argv: &[Vec<u8>]) -> String {
    let mut s = argv.iter().map(|a| String::from_utf8_lossy(a)).collect::<Vec<_>>().join(" ");
    if s.chars().count() > 120 {
        s = s.chars().take(119).collect::<String>() + "…";
    }
    s
}

impl Head {
    /// What the tasks of `hosts` (every host: `None`) use now, asked of their agents, by answering
    /// connection: a task that just moved may still be listed by its source (winding down) as well.
    /// A slow agent's tasks are missing after [`USAGE_WAIT`].
    pub(crate) async fn usage(&self, hosts: Option<&[String]>) -> HashMap<(u64, starling_proto::TaskId), TaskUsage> {
        let nonce = self.next_task.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let agents: Vec<_> = {
            let mut st = self.state.lock().unwrap();
            st.usage_waiters.insert(nonce, tx);
            st.hosts.values().filter(|h| hosts.is_none_or(|n| n.contains(&h.info.name))).map(|h| h.tx.clone()).collect()
        };
        let mut asked = 0;
        for a in agents {
            asked += usize::from(a.send(Msg::UsageRequest { nonce }).await.is_ok());
        }
        let mut usage: HashMap<(u64, starling_proto::TaskId), TaskUsage> = HashMap::new();
        let deadline = tokio::time::Instant::now() + USAGE_WAIT;
        for _ in 0..asked {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some((conn, rows))) => usage.extend(rows.into_iter().map(|u| ((conn, u.task), u))),
                _ => break,
            }
        }
        self.state.lock().unwrap().usage_waiters.remove(&nonce);
        usage
    }

    /// The rows of `starling ps` for `viewer`: the uid of the user who asked, as the kernel
    /// (a local client) or their certificate says. A user other than root sees only their own
    /// tasks (command lines are theirs to show); `None` (root, the administrator's client
    /// certificate, a head without authentication) sees every task.
    pub async fn ps(&self, viewer: Option<u32>) -> Vec<TaskRow> {
        let usage = self.usage(None).await;
        // A task listed by two connections (it just moved): its row is its route's host's.
        let st = &*self.state.lock().unwrap();
        let mut rows: Vec<TaskRow> = st
            .routes
            .iter()
            .filter(|(_, r)| viewer.is_none_or(|uid| r.uid == uid))
            .map(|(task, r)| {
                let u = st.hosts.get(&r.host).and_then(|h| usage.get(&(h.conn_id, *task)));
                TaskRow {
                    task: *task,
                    job: r.job.clone(),
                    host: r.host.clone(),
                    command: r.command.clone(),
                    state: match (&r.moving, r.rerun.as_ref()) {
                        (Some(m), _) => format!("moving to {}", m.to),
                        (None, Some(re)) if r.host == crate::eviction::QUEUED_FOR_RERUN => {
                            format!("queued for rerun {} (IE)", re.runs)
                        }
                        (None, Some(re)) if re.evicting.is_some() => "evicting (IE)".into(),
                        (None, Some(re)) if re.runs > 1 => format!("running (IE rerun {})", re.runs),
                        _ if r.outlive.is_some() && r.client.is_none() => "detached".into(),
                        _ => "running".into(),
                    },
                    cpu_seconds: u.map(|u| u.cpu_seconds + r.cpu_before),
                    rss_bytes: u.map(|u| u.rss_bytes),
                    runtime_seconds: r.started.elapsed().as_secs_f64(),
                    runnable: u.map(|u| u.runnable),
                    roam: r.roam.clone(),
                    direct: u.map(|u| u.direct),
                    relayed: r.relayed,
                }
            })
            .collect();
        rows.sort_by_key(|r| r.task);
        rows
    }

    /// An agent's answer to a usage request.
    /// `conn`: the host connection it came on.
    pub(crate) fn usage_reply(&self, conn: u64, nonce: u64, tasks: Vec<TaskUsage>) {
        if let Some(w) = self.state.lock().unwrap().usage_waiters.get(&nonce) {
            let _ = w.send((conn, tasks));
        }
    }
}
