//! Writes well-formed seed inputs into the corpora (a fuzzer that starts from valid bytes gets past
//! the magic numbers at once): a descriptor like a small real process's, the plans it lowers to in
//! each mode, and a few control frames. Run once after a format changes:
//! `cargo +nightly run --manifest-path fuzz/Cargo.toml --example seeds`.
use starling_image::*;
use starling_migrate::wire::{self as migrate_wire, ToSource, ToTarget};
use starling_proto::{Msg, TaskId, TaskSpec, WirePath, X11Forward};
use std::path::Path;

fn put(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::create_dir_all(dir).expect("mkdir");
    std::fs::write(dir.join(name), bytes).expect("write seed");
}

fn main() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for (name, threads) in [("one-thread", &[42u64][..]), ("two-threads", &[42, 43][..])] {
        let d = starling_image::sample::descriptor(threads);
        d.validate().expect("the seed descriptor is valid");
        put(&corpus.join("descriptor"), name, &d.encode());
        for (mode, count, pidns) in [("clone", 1, true), ("migrate", 1, false), ("hier", 2, true)] {
            if count > 1 && threads.len() > 1 {
                continue;
            }
            let plan = lower(&d, PlanOptions { clone_id: 1, clone_count: count, new_pid_namespace: pidns, clone_id_in_rax: true, seccomp: &[], terminal: false, join_groups: if mode == "migrate" { 2 } else { 0 } });
            abi::plan::validate(&plan).expect("the seed plan is valid");
            put(&corpus.join("plan"), &format!("{name}-{mode}"), &plan);
        }
    }
    // A process tree: a child with a pipe to its own child, bytes in flight in it.
    let mut tree = starling_image::sample::descriptor(&[42]);
    let mut child = starling_image::sample::descriptor(&[50]);
    child.fds.push(FdEntry { fd: 12, kind: FdKind::TreePipe { pipe: 0, write: true, flags: 1 } });
    let mut grandchild = starling_image::sample::descriptor(&[51]);
    grandchild.fds.insert(0, FdEntry { fd: 0, kind: FdKind::TreePipe { pipe: 0, write: false, flags: 0 } });
    tree.pipes = vec![PipeImage { capacity: 65536, data: b"in flight".to_vec() }];
    tree.descendants = vec![(0, child), (1, grandchild)];
    tree.validate().expect("the seed tree is valid");
    put(&corpus.join("descriptor"), "tree", &tree.encode());
    let plan = lower(&tree, PlanOptions { clone_id: 0, clone_count: 1, new_pid_namespace: true, clone_id_in_rax: false, seccomp: &[], terminal: false, join_groups: 2 });
    abi::plan::validate_tree(&plan, &mut [0; abi::plan::MAX_TREE_PLANS]).expect("the seed tree plan is valid");
    put(&corpus.join("plan"), "tree-migrate", &plan);
    let spec = TaskSpec { env: vec![(b"A".to_vec(), b"1".to_vec())], ..TaskSpec::new(vec![b"cc".to_vec(), b"-c".to_vec(), b"x.c".to_vec()], WirePath::new(b"/home/u".to_vec()).expect("path")) };
    let x11 = TaskSpec { x11: Some(X11Forward { auth_name: "MIT-MAGIC-COOKIE-1".into(), auth_data: vec![7; 16] }), ..spec.clone() };
    let frames = [
        ("launch", Msg::Launch { spec, reference: 7 }),
        ("launch-x11", Msg::Launch { spec: x11, reference: 8 }),
        ("x11-open", Msg::X11Open { task: TaskId(9), stream: 0 }),
        ("x11-data", Msg::X11Data { task: TaskId(9), stream: 0, data: b"l\0\x0b\0\0\0\x12\0\x10\0\0\0MIT-MAGIC-COOKIE-1\0\0".to_vec() }),
        ("x11-close", Msg::X11Close { task: TaskId(9), stream: 0 }),
    ];
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
        ToTarget::Pages { process: 0, addrs: vec![0x1000, 0x2000], data: [vec![1u8; PAGE_BYTES], vec![2u8; PAGE_BYTES]].concat() },
        ToTarget::Stale { process: 0, addrs: vec![0x1000] },
        ToTarget::Image { descriptor: starling_image::sample::descriptor(&[42]).encode(), stale: vec![vec![0x2000]], page_servers: vec!["10.0.0.1:4000".into()], payload: b"files".to_vec() },
    ];
    for frame in &to_target {
        migrate_wire::send(&mut stream, frame).expect("encode");
    }
    put(&corpus.join("migrate_stream"), "move", &stream);
    let mut answers = Vec::new();
    let to_source = [
        ToSource::Prepared,
        ToSource::Resumed { phases_ms: vec![("restore".into(), 1.5)] },
        ToSource::Complete { local_pages: 1, remote_pages: 1, faults: 1, fault_p50_us: Some(64), fault_p99_us: None, discarded_pages: 1 },
        ToSource::Failed { reason: "no room".into() },
    ];
    for frame in &to_source {
        migrate_wire::send(&mut answers, frame).expect("encode");
    }
    put(&corpus.join("migrate_stream"), "answers", &answers);
    // The page server's protocol as crates/fork/src/page_server.rs documents it: a multicast query
    // and a request for two pages; and (after a first byte giving the batch size) a reply to three.
    let mut requests = b"SFPM\0\0\0\0SFPQ".to_vec();
    requests.extend(2u32.to_le_bytes());
    requests.extend(0x1000u64.to_le_bytes());
    requests.extend(0x7fff_f000u64.to_le_bytes());
    put(&corpus.join("page_server"), "requests", &requests);
    let mut reply = vec![3u8];
    reply.extend(b"SFPR");
    reply.extend(3u32.to_le_bytes());
    reply.push(0); // zero page
    reply.push(1); // data
    reply.extend(vec![0x5au8; PAGE_BYTES]);
    reply.push(2); // unreadable
    put(&corpus.join("page_server"), "reply", &reply);
    println!("seeds written under {}", corpus.display());
}
