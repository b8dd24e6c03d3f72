//! Job bindings: the prethrown bindings sent for each job (`exec --job
//! NAME`, keyed by uid and name), so a launch carries only the delta and
//! its task gets them all.

use starling_proto::{Lookup, WirePath};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Jobs idle this long are forgotten (their next launch simply sends more).
const JOB_IDLE: Duration = Duration::from_secs(3600);
/// Bound on one job's bindings.
const JOB_MAX_BINDINGS: usize = 100_000;

struct Job {
    bindings: HashMap<WirePath, Lookup>,
    used: Instant,
}

#[derive(Default)]
pub(crate) struct Jobs {
    jobs: HashMap<String, Job>,
}

impl Jobs {
    /// Merge a launch's (delta) bindings into its job's; returns all of them,
    /// and whether the job was unknown until now.
    pub(crate) fn merge(&mut self, key: String, delta: Vec<(WirePath, Lookup)>) -> (Vec<(WirePath, Lookup)>, bool) {
        self.jobs.retain(|_, j| j.used.elapsed() < JOB_IDLE);
        let fresh = !self.jobs.contains_key(&key);
        let j = self.jobs.entry(key).or_insert_with(|| Job { bindings: HashMap::new(), used: Instant::now() });
        j.used = Instant::now();
        for (p, l) in delta {
            if j.bindings.len() < JOB_MAX_BINDINGS || j.bindings.contains_key(&p) {
                j.bindings.insert(p, l);
            }
        }
        (j.bindings.iter().map(|(p, l)| (p.clone(), l.clone())).collect(), fresh)
    }

    pub(crate) fn len(&self) -> usize {
        self.jobs.len()
    }
}
