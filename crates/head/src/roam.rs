//! Roaming tasks (`starling exec --roam`): the head keeps each one's
//! migration manager's decisions, as the manager notes them on the task's
//! own connection, and says why the task runs where it does (`starling ps`,
//! `ps --why`). The manager itself runs at home, in the task's client: the
//! head only records, and moves the task when asked like any other.

use crate::{Head, Route};
use starling_proto::{MigrationReport, RoamDecision, RoamLog, TaskId, MAX_ROAM_DECISIONS};

/// The decision action of a move the manager asked for and has not seen done yet.
const MOVE: &str = "move";

impl Head {
    /// A roaming task's manager decided something (only the task's own client may say so).
    pub(crate) fn roam_note(&self, conn: u64, task: TaskId, decision: RoamDecision) {
        let mut st = self.state.lock().unwrap();
        let Some(r) = st.routes.get_mut(&task).filter(|r| r.client_conn == conn) else { return };
        let log = r.roam.get_or_insert_with(RoamLog::default);
        if log.decisions.is_empty() || decision.action == "started" {
            log.reason.clone_from(&decision.reason);
        }
        push(log, decision);
    }
}

fn push(log: &mut RoamLog, d: RoamDecision) {
    if log.decisions.len() >= MAX_ROAM_DECISIONS {
        log.decisions.remove(0);
    }
    log.decisions.push(d);
}

/// A roaming task moved: the reason is its manager's last decision if that is a move to this
/// site it is waiting for, else the move was asked for by hand (`starling migrate`).
pub(crate) fn moved(r: &mut Route, report: &MigrationReport) {
    let Some(log) = r.roam.as_mut() else { return };
    let waiting = log.decisions.last_mut().filter(|d| d.action == MOVE && (d.to_site == report.to || d.to_site == "cluster"));
    match waiting {
        Some(d) => {
            d.action = "moved".into();
            // The decision keeps what the move took (`bench/roam_bench.py` reads it from `ps --json`).
            d.reason = format!("{} (moved {} -> {}, pause {:.1} ms, total {:.1} ms)", d.reason, report.from, report.to, report.pause_ms, report.total_ms);
            log.reason.clone_from(&d.reason);
        }
        None => {
            let reason = format!("moved by hand (starling migrate {} -> {}, pause {:.1} ms)", report.from, report.to, report.pause_ms);
            log.reason.clone_from(&reason);
            let at_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
            push(
                log,
                RoamDecision {
                    at_ms,
                    from_site: report.from.clone(),
                    to_site: report.to.clone(),
                    action: "moved".into(),
                    reason,
                    ..RoamDecision::default()
                },
            );
        }
    }
}
