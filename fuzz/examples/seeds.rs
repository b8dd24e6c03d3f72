//! Writes well-formed seed inputs into the corpora (a fuzzer that starts from valid bytes gets past
//! the magic numbers at once): a descriptor like a small real process's, the plans it lowers to in
//! each mode, and a few control frames. Run once after a format changes:
//! `cargo +nightly run --manifest-path fuzz/Cargo.toml --example seeds`.
use starling_image::abi::process::ProcessCore;
use starling_image::abi::regs::{FP_XSTATE_MAGIC1, FXSAVE_BYTES};
use starling_image::abi::signal::{SigInfo, SigactionTable};
use starling_image::abi::thread::ThreadCore;
use starling_image::*;
use starling_migrate::wire::{self as migrate_wire, ToSource, ToTarget};
use starling_proto::{Msg, TaskSpec, WirePath};
use std::path::Path;

fn thread(tid: u64, fpu_len: usize) -> ThreadState {
    let mut fpu = vec![0u8; fpu_len];
    if fpu_len > FXSAVE_BYTES {
        fpu[464..468].copy_from_slice(&FP_XSTATE_MAGIC1.to_le_bytes());
    }
    ThreadState { core: ThreadCore { tid, ..ThreadCore::default() }, fpu, pending: vec![] }
}

fn descriptor(threads: &[u64]) -> Descriptor {
    let mut info = [0u64; 16];
    info[0] = 10;
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
            FdEntry { fd: 9, kind: FdKind::Stream { of: 2 } },
        ],
        threads: threads.iter().map(|&t| thread(t, if t == threads[0] { 832 } else { FXSAVE_BYTES })).collect(),
        sigactions: SigactionTable::default(),
        process: ProcessState {
            core: ProcessCore { pid: threads[0], umask: 0o027, ..ProcessCore::default() },
            cwd: "/home/u".to_string(),
            groups: vec![100, 27],
            pending: vec![SigInfo(info)],
        },
    }
}

fn put(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::create_dir_all(dir).expect("mkdir");
    std::fs::write(dir.join(name), bytes).expect("write seed");
}

fn main() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for (name, threads) in [("one-thread", &[42u64][..]), ("two-threads", &[42, 43][..])] {
        let d = descriptor(threads);
        d.validate().expect("the seed descriptor is valid");
        put(&corpus.join("descriptor"), name, &d.encode());
        for (mode, count, pidns) in [("clone", 1, true), ("migrate", 1, false), ("hier", 2, true)] {
            if count > 1 && threads.len() > 1 {
                continue;
            }
            let plan = lower(&d, PlanOptions { clone_id: 1, clone_count: count, new_pid_namespace: pidns, clone_id_in_rax: true, seccomp: &[], terminal: false });
            abi::plan::validate(&plan).expect("the seed plan is valid");
            put(&corpus.join("plan"), &format!("{name}-{mode}"), &plan);
        }
    }
    let spec = TaskSpec { env: vec![(b"A".to_vec(), b"1".to_vec())], ..TaskSpec::new(vec![b"cc".to_vec(), b"-c".to_vec(), b"x.c".to_vec()], WirePath::new(b"/home/u".to_vec()).expect("path")) };
    let frames = [("launch", Msg::Launch { spec, reference: 7 })];
    for (name, msg) in frames {
        for compress in [false, true] {
            let bytes = starling_proto::frame::encode_with(&msg, compress).expect("encode");
            put(&corpus.join("frame"), &format!("{name}-{}", if compress { "zstd" } else { "plain" }), &bytes);
        }
    }
    // A whole move as the source sends it, and the target's answers.
    let mut stream = Vec::new();
    let to_target = [
        ToTarget::Prepare { payload: b"view".to_vec() },
        ToTarget::Pages { addrs: vec![0x1000, 0x2000], data: [vec![1u8; PAGE_BYTES], vec![2u8; PAGE_BYTES]].concat() },
        ToTarget::Image { descriptor: descriptor(&[42]).encode(), stale: vec![0x2000], page_server: "10.0.0.1:4000".into(), payload: b"files".to_vec() },
    ];
    for frame in &to_target {
        migrate_wire::send(&mut stream, frame).expect("encode");
    }
    put(&corpus.join("migrate_stream"), "move", &stream);
    let mut answers = Vec::new();
    let to_source = [
        ToSource::Prepared,
        ToSource::Resumed,
        ToSource::Complete { local_pages: 1, remote_pages: 1, faults: 1, fault_p50_us: Some(64), fault_p99_us: None },
        ToSource::Failed { reason: "no room".into() },
    ];
    for frame in &to_source {
        migrate_wire::send(&mut answers, frame).expect("encode");
    }
    put(&corpus.join("migrate_stream"), "answers", &answers);
    println!("seeds written under {}", corpus.display());
}
