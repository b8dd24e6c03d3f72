//! Prometheus `/metrics` on the head (`starling head --metrics ADDR`, `head.metrics`).
//!
//! A fixed-path HTTP/1.x `GET` answered in the plain-text exposition format (version 0.0.4); any
//! other path is a 404. Gauges come from the head's [`crate::Snapshot`] at scrape time (tasks by
//! state, hosts with their cores, load, running cores and memory); counters are kept by the head as
//! things happen ([`Counters`]): tasks started and ended (finished, error, lost), clones and the
//! page faults their hosts served, and the relay cache's hits, misses and bytes.

use crate::Head;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Counters the head bumps as it works. All monotonic.
#[derive(Default, Debug)]
pub(crate) struct Counters {
    pub(crate) tasks_started: AtomicU64,
    pub(crate) tasks_finished: AtomicU64,
    pub(crate) tasks_failed: AtomicU64,
    pub(crate) tasks_lost: AtomicU64,
    /// IE: runs killed (owner returned, host lost) and queued to run again from the start.
    pub(crate) tasks_rerun: AtomicU64,
    pub(crate) clones: AtomicU64,
    pub(crate) clone_faults: AtomicU64,
    pub(crate) clone_pages_fetched: AtomicU64,
    pub(crate) relay_recipe_hits: AtomicU64,
    pub(crate) relay_recipe_misses: AtomicU64,
    pub(crate) relay_chunk_hits: AtomicU64,
    pub(crate) relay_chunk_misses: AtomicU64,
    /// Content bytes the relay fetched from clients (over the client's link).
    pub(crate) relay_bytes_from_clients: AtomicU64,
    /// Content bytes the relay served to hosts.
    pub(crate) relay_bytes_to_hosts: AtomicU64,
    /// Chunks the relay told a host to fetch from another host instead of sending them.
    pub(crate) relay_chunks_to_peers: AtomicU64,
}

/// Add `n` to a counter.
pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

impl Head {
    /// Count what a host's task message says (before it is routed to the client).
    pub(crate) fn count(&self, m: &starling_proto::Msg) {
        use starling_proto::Msg;
        let c = &self.counters;
        self.groups.lock().unwrap().count(m);
        match m {
            Msg::Finished { .. } => add(&c.tasks_finished, 1),
            Msg::Error { .. } => add(&c.tasks_failed, 1),
            Msg::CloneStats { counters, .. } => {
                add(&c.clones, 1);
                add(&c.clone_faults, counters.faults);
                add(&c.clone_pages_fetched, counters.pages_fetched);
            }
            _ => {}
        }
    }
}

/// A label value, escaped as the exposition format wants.
fn label(v: &str) -> String {
    v.replace('\\', r"\\").replace('"', "\\\"").replace('\n', r"\n")
}

/// The whole exposition text.
pub(crate) fn render(head: &Head) -> String {
    let snap = head.snapshot();
    let c = &head.counters;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, String)]| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "{name}{labels} {value}");
        }
    };
    let n = |v: u64| v.to_string();
    let moving = {
        let st = head.state.lock().unwrap();
        st.routes.values().filter(|r| r.moving.is_some()).count()
    };
    metric(
        "starling_tasks",
        "gauge",
        "Tasks by state: running (placed on a host, holding cores), migrating, queued (waiting for cores).",
        &[
            ("{state=\"running\"}".into(), n(u64::try_from(snap.tasks.len().saturating_sub(moving)).unwrap_or(0))),
            ("{state=\"migrating\"}".into(), n(u64::try_from(moving).unwrap_or(0))),
            ("{state=\"queued\"}".into(), n(u64::try_from(snap.queued).unwrap_or(0))),
        ],
    );
    metric("starling_tasks_started_total", "counter", "Tasks the head placed on a host.", &[(String::new(), n(get(&c.tasks_started)))]);
    metric(
        "starling_tasks_ended_total",
        "counter",
        "Tasks that ended: finished (the program exited), error (the host could not run it), lost (its host or client went away).",
        &[
            ("{how=\"finished\"}".into(), n(get(&c.tasks_finished))),
            ("{how=\"error\"}".into(), n(get(&c.tasks_failed))),
            ("{how=\"lost\"}".into(), n(get(&c.tasks_lost))),
        ],
    );
    metric(
        "starling_tasks_rerun_total",
        "counter",
        "IE: task runs killed (their host's owner returned, or the host was lost) and queued to run again from the start.",
        &[(String::new(), n(get(&c.tasks_rerun)))],
    );
    metric("starling_clones_total", "counter", "Remote-fork clones that ran and reported their counters.", &[(String::new(), n(get(&c.clones)))]);
    metric(
        "starling_clone_page_faults_total",
        "counter",
        "Page faults the clones' hosts served (userfaultfd), as the clones reported them.",
        &[(String::new(), n(get(&c.clone_faults)))],
    );
    metric(
        "starling_clone_pages_fetched_total",
        "counter",
        "Pages clones fetched from their parent's page server.",
        &[(String::new(), n(get(&c.clone_pages_fetched)))],
    );
    metric(
        "starling_relay_requests_total",
        "counter",
        "Content requests the head's relay cache answered: hit (from the cache) or miss (fetched from the client).",
        &[
            ("{kind=\"recipe\",result=\"hit\"}".into(), n(get(&c.relay_recipe_hits))),
            ("{kind=\"recipe\",result=\"miss\"}".into(), n(get(&c.relay_recipe_misses))),
            ("{kind=\"chunk\",result=\"hit\"}".into(), n(get(&c.relay_chunk_hits))),
            ("{kind=\"chunk\",result=\"miss\"}".into(), n(get(&c.relay_chunk_misses))),
            ("{kind=\"chunk\",result=\"peer\"}".into(), n(get(&c.relay_chunks_to_peers))),
        ],
    );
    metric(
        "starling_relay_bytes_total",
        "counter",
        "Content bytes through the relay: from clients (over their link) and to hosts.",
        &[
            ("{direction=\"from_clients\"}".into(), n(get(&c.relay_bytes_from_clients))),
            ("{direction=\"to_hosts\"}".into(), n(get(&c.relay_bytes_to_hosts))),
        ],
    );
    metric("starling_hosts", "gauge", "Hosts (agents) connected to the head.", &[(String::new(), n(u64::try_from(snap.hosts.len()).unwrap_or(0)))]);
    let per_host = |f: &dyn Fn(&starling_proto::HostInfo) -> String| -> Vec<(String, String)> {
        snap.hosts.iter().map(|h| (format!("{{host=\"{}\"}}", label(&h.name)), f(h))).collect()
    };
    metric("starling_host_cores", "gauge", "Cores each host offers.", &per_host(&|h| h.cores.to_string()));
    metric("starling_host_running_cores", "gauge", "Cores the head has placed tasks on, per host.", &per_host(&|h| h.running.to_string()));
    metric("starling_host_load", "gauge", "Each host's 1-minute load average, as its agent last reported it.", &per_host(&|h| h.load.to_string()));
    metric("starling_host_memory_bytes", "gauge", "Each host's memory.", &per_host(&|h| h.mem_bytes.to_string()));
    out
}

/// Serve `GET /metrics` on `addr` until the process ends.
pub(crate) async fn serve(head: Arc<Head>, listener: TcpListener) {
    loop {
        let Ok((sock, peer)) = listener.accept().await else { continue };
        let head = head.clone();
        tokio::spawn(async move {
            if let Err(e) = answer(&head, sock).await {
                log::debug!("metrics request from {peer}: {e}");
            }
        });
    }
}

/// How long a scraper may take to send its request.
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Read one request head (up to 8 KiB, within [`REQUEST_TIMEOUT`]) and answer it; the connection
/// is closed after.
async fn answer(head: &Head, mut sock: TcpStream) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let read = async {
        let mut chunk = [0u8; 1024];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") && !buf.windows(2).any(|w| w == b"\n\n") {
            let n = sock.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
            if buf.len() > 8192 {
                break;
            }
        }
        Ok::<(), std::io::Error>(())
    };
    tokio::time::timeout(REQUEST_TIMEOUT, read)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no request within 10 s"))??;
    let line = String::from_utf8_lossy(&buf);
    let mut words = line.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    const TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
    let (status, kind, body) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => ("200 OK", TEXT, render(head)),
        ("GET", "/" | "/index.html") => ("200 OK", "text/html; charset=utf-8", crate::dashboard::page(head)),
        ("GET", "/api/state") => ("200 OK", "application/json", crate::dashboard::state_json(head)),
        ("GET", "/api/events") => return crate::dashboard::events(head, &mut sock).await,
        ("GET", _) => ("404 Not Found", TEXT, "starling: served here: / (dashboard), /api/state, /api/events, /metrics\n".to_string()),
        _ => ("405 Method Not Allowed", TEXT, "starling: GET /, /api/state, /api/events or /metrics\n".to_string()),
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(reply.as_bytes()).await?;
    sock.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::label;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label(r#"a"b\c"#), r#"a\"b\\c"#);
        assert_eq!(label("x\ny"), r"x\ny");
    }
}
