//! Stage tests: descriptor encoding/validation, dump refusals, page server.

use starling_fork::dump::dump;
use starling_fork::{Descriptor, PageClass};
use starling_fork::page_server::{PageClient, PageReply, PageServer};
use starling_fork::template::TemplateRecord;
use starling_fork::ForkError;

/// Fork a child that runs `setup` and then sleeps; returns its pid.
fn sleeping_child(setup: impl FnOnce()) -> i32 {
    // SAFETY: the child only runs `setup` (simple syscalls) and pause()s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        setup();
        loop {
            // SAFETY: pause blocks until a signal; we are killed by the parent.
            unsafe { libc::pause() };
        }
    }
    pid
}

fn reap(pid: i32) {
    // SAFETY: kill and reap our own child.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
}

#[test]
fn descriptor_roundtrip_and_rejects_bad_bytes() {
    let pid = sleeping_child(|| {});
    std::thread::sleep(std::time::Duration::from_millis(100));
    let d = dump(pid, &TemplateRecord::zeroed(), true);
    reap(pid);
    let d = d.expect("dump a plain child");
    assert!(d.regions.iter().any(|r| matches!(r.kind, starling_fork::image::RegionKind::Vdso)));
    let bytes = d.encode();
    assert_eq!(Descriptor::decode(&bytes).expect("decode"), d);
    let mut trailing = bytes.clone();
    trailing.push(0);
    assert!(Descriptor::decode(&trailing).is_err());
    assert!(Descriptor::decode(&bytes[..bytes.len() / 2]).is_err());
    let mut bad = d.clone();
    bad.regions.reverse();
    assert!(Descriptor::decode(&bad.encode()).is_err(), "out-of-order regions must be refused");
    let (_, _, fetch) = d.page_totals();
    assert!(fetch > 0, "a live process has anonymous pages to fetch");
}

#[test]
fn dump_refuses_mapping_of_deleted_file() {
    let path = std::env::temp_dir().join(format!("sf-deleted-{}", std::process::id()));
    std::fs::write(&path, vec![7u8; 8192]).unwrap();
    let cpath = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    let pid = sleeping_child(move || {
        // SAFETY: open/mmap/unlink of our own temp file in the child.
        unsafe {
            let fd = libc::open(cpath.as_ptr(), libc::O_RDONLY);
            libc::mmap(std::ptr::null_mut(), 8192, libc::PROT_READ, libc::MAP_PRIVATE, fd, 0);
            libc::unlink(cpath.as_ptr());
        }
    });
    std::thread::sleep(std::time::Duration::from_millis(200));
    let r = dump(pid, &TemplateRecord::zeroed(), true);
    reap(pid);
    match r {
        Err(ForkError::Unclonable { mapping, reason }) => {
            assert!(mapping.contains("sf-deleted-"), "{mapping}");
            assert!(reason.contains("deleted"), "{reason}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn page_server_serves_data_zero_and_refuses_outside() {
    // Serve a child's copy of a buffer that we fill before forking.
    let layout = std::alloc::Layout::from_size_align(3 * 4096, 4096).unwrap();
    // SAFETY: non-zero-size layout; freed at the end.
    let buf = unsafe { std::alloc::alloc_zeroed(layout) };
    // SAFETY: writes inside the allocation.
    unsafe { buf.add(4096).write_bytes(0xab, 4096) };
    let base = buf as u64;
    let pid = sleeping_child(|| {});
    let mut server = PageServer::start(pid, vec![(base, base + 3 * 4096)], "127.0.0.1:0".parse().unwrap()).unwrap();
    // The parent's later writes do not show: the child's image is frozen.
    // SAFETY: writes inside the allocation.
    unsafe { buf.write_bytes(0x11, 4096) };
    let mut client = PageClient::connect(server.addr()).unwrap();
    let replies = client.fetch(&[base, base + 4096, base + 8192]).unwrap();
    assert!(matches!(replies[0], PageReply::Zero));
    match &replies[1] {
        PageReply::Data(d) => assert!(d.iter().all(|&b| b == 0xab)),
        _ => panic!("expected data"),
    }
    assert!(matches!(replies[2], PageReply::Zero));
    // Outside the served regions: the server closes the connection.
    assert!(client.fetch(&[base + 3 * 4096]).is_err());
    let mut c2 = PageClient::connect(server.addr()).unwrap();
    assert!(c2.fetch(&[base + 1]).is_err(), "unaligned address must be refused");
    server.stop();
    reap(pid);
    // SAFETY: same layout as allocated.
    unsafe { std::alloc::dealloc(buf, layout) };
    let _ = PageClass::Zero;
}
