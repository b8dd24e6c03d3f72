//! Outstanding file requests, by request id: a request's answer can come from the head's
//! connection or from a peer host's ([`crate::peers`]), and wakes the thread of the file view
//! that asked ([`crate::remote`]).

use starling_proto::FileResp;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};

/// Outstanding file requests of all tasks on this host, by request id.
#[derive(Default)]
pub struct Waiters {
    next: AtomicU64,
    map: Mutex<HashMap<u64, mpsc::Sender<FileResp>>>,
}

impl Waiters {
    pub(crate) fn register(&self) -> (u64, mpsc::Receiver<FileResp>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (s, r) = mpsc::channel();
        self.map.lock().unwrap().insert(id, s);
        (id, r)
    }
    pub fn complete(&self, id: u64, resp: FileResp) {
        if let Some(s) = self.map.lock().unwrap().remove(&id) {
            let _ = s.send(resp);
        }
    }
    /// Request `id` will not be answered: wake its waiter with an error.
    pub(crate) fn complete_none(&self, id: u64) {
        self.map.lock().unwrap().remove(&id);
    }
    /// The head is gone: wake every waiter with an error.
    pub fn fail_all(&self) {
        self.map.lock().unwrap().clear();
    }
}
