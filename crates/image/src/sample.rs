//! A small but complete descriptor, shaped like a real process's: two
//! regions (a heap with a zero and a fetched page, a file-backed page),
//! each kind of fd, threads with FPU areas (the first an XSAVE area), a
//! queued signal. The image's unit tests lower and check it, and the fuzz
//! corpus (`fuzz/examples/seeds.rs`) starts from it. Compiled for tests
//! and with the `sample` feature.

use crate::abi::process::ProcessCore;
use crate::abi::regs::{FP_XSTATE_MAGIC1, FXSAVE_BYTES};
use crate::abi::signal::{SigInfo, SigactionTable};
use crate::abi::thread::ThreadCore;
use crate::*;
use std::string::ToString;
use std::vec;
use std::vec::Vec;

/// Bytes of the first thread's FPU area (an XSAVE area); the others' are FXSAVE's.
pub const FIRST_FPU_BYTES: usize = 832;

fn thread(tid: u64, fpu_len: usize) -> ThreadState {
    let mut fpu = vec![0u8; fpu_len];
    if fpu_len > FXSAVE_BYTES {
        fpu[464..468].copy_from_slice(&FP_XSTATE_MAGIC1.to_le_bytes());
    }
    fpu[0] = tid.to_le_bytes()[0]; // tells the areas apart
    ThreadState { core: ThreadCore { tid, ..ThreadCore::default() }, fpu, pending: vec![] }
}

/// The sample process with these thread ids (the first is its pid).
pub fn descriptor(threads: &[u64]) -> Descriptor {
    let mut info = [0u64; 16];
    info[0] = 10; // SIGUSR1
    Descriptor {
        version: DESCRIPTOR_VERSION,
        regions: vec![
            Region { start: 0x1000, end: 0x3000, prot: 3, shared: false, growsdown: false,
                     kind: RegionKind::Anonymous { name: "[heap]".to_string() },
                     pages: PageRuns(vec![(PageClass::Zero, 1), (PageClass::Fetch, 1)]) },
            Region { start: 0x10000, end: 0x11000, prot: 5, shared: false, growsdown: false,
                     kind: RegionKind::File { path: "/usr/lib/x.so".to_string(), offset: 0x2000, inode: 9 },
                     pages: PageRuns(vec![(PageClass::File, 1)]) },
        ],
        fds: vec![
            FdEntry { fd: 1, kind: FdKind::PipeWrite },
            FdEntry { fd: 5, kind: FdKind::Reopen { path: "/data/in".to_string(), flags: 2, offset: 77 } },
            FdEntry { fd: 6, kind: FdKind::Socket },
            FdEntry { fd: 9, kind: FdKind::Stream { of: 2 } },
        ],
        threads: threads
            .iter()
            .enumerate()
            .map(|(i, &t)| thread(t, if i == 0 { FIRST_FPU_BYTES } else { FXSAVE_BYTES }))
            .collect::<Vec<_>>(),
        sigactions: SigactionTable::default(),
        process: ProcessState {
            core: ProcessCore { pid: threads[0], umask: 0o027, ..ProcessCore::default() },
            cwd: "/home/u".to_string(),
            groups: vec![100, 27],
            pending: vec![SigInfo(info)],
            exe: "/usr/bin/sample".to_string(),
            auxv: vec![6, 4096, 0, 0],
        },
        descendants: vec![],
        pipes: vec![],
    }
}
