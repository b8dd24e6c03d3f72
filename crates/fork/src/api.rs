//! The fork API over the local backend: tickets, clone, join, kill.
//!
//! Numbering follows SnowFlock: `clone` returns 0 in the caller (the
//! *parent*) and 1..=m in the m clones of a ticket.

use crate::descriptor::{dump, Descriptor};
use crate::local::LocalClone;
use crate::page_server::PageServer;
use crate::template::{fork_template, ForkOutcome, Template};
use crate::descriptor::PageClass;
use crate::{ForkError, Result};
use std::sync::atomic::{AtomicU32, Ordering};

/// Most clones a local ticket grants (this machine's memory and PIDs are finite).
pub const MAX_LOCAL_CLONES: u32 = 64;

/// In a clone: its ID (0 in a process that is not a clone).
static CLONE_ID: AtomicU32 = AtomicU32::new(0);

pub fn current_clone_id() -> u32 {
    CLONE_ID.load(Ordering::Relaxed)
}

struct Active {
    template: Template,
    server: PageServer,
    clones: Vec<LocalClone>,
    descriptor_bytes: usize,
    descriptor: Descriptor,
}

/// A reservation of clones.
pub struct Ticket {
    pub requested: u32,
    pub allocation: u32,
    pub hierarchical: bool,
    active: Option<Active>,
    used: bool,
}

impl Ticket {
    pub fn request(n: i32, hierarchical: bool) -> Result<Ticket> {
        if n < 1 {
            return Err(ForkError::Other(format!("ticket for {n} clones")));
        }
        let allocation = (n as u32).min(MAX_LOCAL_CLONES);
        Ok(Ticket { requested: n as u32, allocation, hierarchical, active: None, used: false })
    }

    /// Fork: 0 in the parent, the clone ID (1..=allocation) in each clone.
    pub fn clone_now(&mut self) -> Result<u32> {
        if current_clone_id() != 0 {
            return Err(ForkError::Other("a clone cannot clone (no nested clones yet)".into()));
        }
        if self.used {
            return Err(ForkError::Other("ticket already used".into()));
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
        let descriptor = dump(template.pid, &template.record)?;
        let descriptor_bytes = descriptor.encode().len();
        let served: Vec<(u64, u64)> = descriptor
            .regions
            .iter()
            .filter(|r| r.pages.count(PageClass::Fetch) > 0)
            .map(|r| (r.start, r.end))
            .collect();
        let bind = std::env::var("STARLING_PAGE_SERVER_BIND").ok().and_then(|v| v.parse().ok())
            .unwrap_or_else(|| "127.0.0.1:0".parse().expect("literal address"));
        let server = PageServer::start(template.pid, served, bind)?;
        let mut active = Active { template, server, clones: Vec::new(), descriptor_bytes, descriptor };
        for id in 1..=self.allocation {
            match LocalClone::launch(&active.descriptor, id, active.server.addr()) {
                Ok(c) => active.clones.push(c),
                Err(e) => {
                    active.clones.iter_mut().for_each(LocalClone::kill);
                    active.clones.iter_mut().for_each(|c| { let _ = c.wait(); });
                    return Err(e);
                }
            }
        }
        self.active = Some(active);
        Ok(0)
    }

    fn active(&mut self) -> Result<&mut Active> {
        if current_clone_id() != 0 {
            return Err(ForkError::Other("only the parent can join or kill".into()));
        }
        self.active.as_mut().ok_or_else(|| ForkError::Other("ticket has no clones".into()))
    }

    /// Wait for every clone, then release the template and the page server.
    /// Returns an error if a fault handler failed.
    pub fn join(&mut self) -> Result<()> {
        let a = self.active()?;
        let mut first_err = None;
        for c in &mut a.clones {
            if let Err(e) = c.wait() {
                first_err.get_or_insert(e);
            }
        }
        a.template.release();
        a.server.stop();
        first_err.map_or(Ok(()), Err)
    }

    /// Kill every clone at once, then release like `join`.
    pub fn kill(&mut self) -> Result<()> {
        let a = self.active()?;
        a.clones.iter_mut().for_each(LocalClone::kill);
        for c in &mut a.clones {
            let _ = c.wait();
        }
        a.template.release();
        a.server.stop();
        Ok(())
    }

    fn clone_ref(&self, id: i32) -> Option<&LocalClone> {
        self.active.as_ref()?.clones.iter().find(|c| c.id as i32 == id)
    }

    /// Exit status of clone `id` once joined.
    pub fn clone_status(&self, id: i32) -> Option<i32> {
        self.clone_ref(id)?.status()
    }

    /// [faults, pages fetched, zero pages, file pages, fetch requests, remove events].
    pub fn clone_stats(&self, id: i32) -> Option<[u64; 6]> {
        Some(self.clone_ref(id)?.stats.snapshot())
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
