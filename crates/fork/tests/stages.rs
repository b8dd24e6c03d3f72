//! Stage tests: descriptor encoding/validation, dump refusals, page server.

use starling_fork::dump::dump;
use starling_fork::{Descriptor, PageClass};
use starling_fork::page_server::{PageClient, PageReply, PageServer, PageServerOptions};
use starling_fork::template::TemplateRecord;
use starling_fork::ForkError;

/// Fork a child that runs `setup` and then sleeps; returns its pid once `setup` is done (the child
/// says so over a pipe: no guessing how long it takes).
fn sleeping_child(setup: impl FnOnce()) -> i32 {
    let mut ready = [0i32; 2];
    // SAFETY: pipe writes two fds into the array.
    assert_eq!(unsafe { libc::pipe(ready.as_mut_ptr()) }, 0);
    // SAFETY: the child only runs `setup` (simple syscalls), writes one byte and pause()s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        setup();
        // SAFETY: one byte from a local to the pipe's write end.
        unsafe { libc::write(ready[1], [1u8].as_ptr().cast(), 1) };
        loop {
            // SAFETY: pause blocks until a signal; we are killed by the parent.
            unsafe { libc::pause() };
        }
    }
    let mut byte = [0u8; 1];
    // SAFETY: the parent closes its copy of the write end, then blocks reading one byte (EOF if
    // the child died first, which the assertion reports).
    let n = unsafe {
        libc::close(ready[1]);
        let n = libc::read(ready[0], byte.as_mut_ptr().cast(), 1);
        libc::close(ready[0]);
        n
    };
    assert_eq!(n, 1, "the child died during its setup");
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

/// A device/IO mapping (VM_IO|VM_PFNMAP, smaps "io pf") is refused, naming it. Made here with a
/// perf_event ring buffer mapped by the child itself (these machines have no /dev/mem or device
/// BAR; through sf_clone a perf buffer never reaches the template, being VM_DONTCOPY as well).
#[test]
fn dump_refuses_device_io_mapping() {
    let (report_r, report_w) = {
        let mut p = [0i32; 2];
        // SAFETY: pipe writes two fds into the array.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        (p[0], p[1])
    };
    let pid = sleeping_child(move || {
        // struct perf_event_attr, first version (64 bytes): type u32, size u32, config u64, rest 0.
        let mut attr = [0u64; 8];
        attr[0] = 1 /* PERF_TYPE_SOFTWARE */ | (64u64 << 32);
        attr[1] = 9; // PERF_COUNT_SW_DUMMY
        // SAFETY: perf_event_open on ourselves with that attr, then mmap of its ring buffer; the
        // address (0 on failure) goes to the parent over the pipe.
        unsafe {
            // An fd or -1: it always fits.
            let fd = i32::try_from(libc::syscall(libc::SYS_perf_event_open, attr.as_ptr(), 0, -1, -1, 0)).unwrap_or(-1);
            let m = if fd < 0 {
                libc::MAP_FAILED
            } else {
                libc::mmap(std::ptr::null_mut(), 2 * 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
            };
            let addr = if m == libc::MAP_FAILED { 0u64 } else { m as u64 };
            libc::write(report_w, (&addr as *const u64).cast(), 8);
        }
    });
    let mut addr = 0u64;
    // SAFETY: read the 8-byte address the child wrote before it said it was ready; close our ends.
    let n = unsafe {
        let n = libc::read(report_r, (&mut addr as *mut u64).cast(), 8);
        libc::close(report_r);
        libc::close(report_w);
        n
    };
    if n != 8 || addr == 0 {
        reap(pid);
        panic!("the child could not map a perf_event ring buffer (perf_event_open needs root)");
    }
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let r = dump(pid, &TemplateRecord::zeroed(), true);
    reap(pid);
    assert!(smaps.contains(" pf ") && smaps.contains(" io "), "the ring buffer is not VM_IO|VM_PFNMAP here:\n{smaps}");
    match r {
        Err(ForkError::Unclonable { mapping, reason }) => {
            assert!(mapping.starts_with(&format!("{addr:x}-")), "{mapping} is not the ring buffer at {addr:x}");
            assert!(reason.contains("VM_IO") || reason.contains("VM_PFNMAP"), "{reason}");
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
    let key = starling_proto::SecretKey([0x5a; 32]);
    let opts = PageServerOptions { mcdist: starling_mcdist::Switch::Off, key, ..PageServerOptions::default() };
    let mut server = PageServer::start_with(pid, vec![(base, base + 3 * 4096)], "127.0.0.1:0".parse().unwrap(), opts).unwrap();
    // The parent's later writes do not show: the child's image is frozen.
    // SAFETY: writes inside the allocation.
    unsafe { buf.write_bytes(0x11, 4096) };
    // Without the key: a client with another key is refused (and sees the
    // server fail its proof), and a plain request gets not one byte back.
    assert!(PageClient::connect(server.addr(), &starling_proto::SecretKey([0x5b; 32]), true).is_err());
    {
        use std::io::{Read, Write};
        let mut raw = std::net::TcpStream::connect(server.addr()).unwrap();
        let mut req = b"SFPQ".to_vec();
        req.extend_from_slice(&1u32.to_le_bytes());
        req.extend_from_slice(&(base + 4096).to_le_bytes());
        req.resize(4 + 32 + 1, 0); // as long as a hello, so the server reads it all
        raw.write_all(&req).unwrap();
        let mut got = Vec::new();
        let _ = raw.read_to_end(&mut got); // the server closes
        assert!(got.is_empty(), "a connection without the key got {} bytes", got.len());
    }
    assert!(server.stats().refused.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    let mut client = PageClient::connect(server.addr(), &key, true).unwrap();
    let replies = client.fetch(&[base, base + 4096, base + 8192]).unwrap();
    assert!(matches!(replies[0], PageReply::Zero));
    match &replies[1] {
        PageReply::Data(d) => assert!(d.iter().all(|&b| b == 0xab)),
        _ => panic!("expected data"),
    }
    assert!(matches!(replies[2], PageReply::Zero));
    // Outside the served regions: the server closes the connection.
    assert!(client.fetch(&[base + 3 * 4096]).is_err());
    let mut c2 = PageClient::connect(server.addr(), &key, true).unwrap();
    assert!(c2.fetch(&[base + 1]).is_err(), "unaligned address must be refused");
    server.stop();
    reap(pid);
    // SAFETY: same layout as allocated.
    unsafe { std::alloc::dealloc(buf, layout) };
    let _ = PageClass::Zero;
}

/// A relay between a page client and its server, as a sniffer on the wire
/// sees them: it keeps every byte the server sent, and flips one bit of the
/// server's stream at `flip_at` if given. Serves one connection.
fn relay(server: std::net::SocketAddr, flip_at: Option<usize>) -> (std::net::SocketAddr, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    std::thread::spawn(move || {
        let (mut client, _) = listener.accept().unwrap();
        let mut up = std::net::TcpStream::connect(server).unwrap();
        let (mut client_r, mut up_w) = (client.try_clone().unwrap(), up.try_clone().unwrap());
        std::thread::spawn(move || std::io::copy(&mut client_r, &mut up_w));
        let mut buf = [0u8; 65536];
        loop {
            let n = match up.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let mut seen = seen2.lock().unwrap();
            let from = seen.len();
            seen.extend_from_slice(&buf[..n]);
            if let Some(i) = flip_at.filter(|&i| (from..from + n).contains(&i)) {
                buf[i - from] ^= 0x01;
            }
            drop(seen);
            if client.write_all(&buf[..n]).is_err() {
                return;
            }
        }
    });
    (addr, seen)
}

#[test]
fn page_server_encrypts_when_either_side_asks_and_refuses_tampered_records() {
    let layout = std::alloc::Layout::from_size_align(2 * 4096, 4096).unwrap();
    // SAFETY: non-zero-size layout; freed at the end.
    let buf = unsafe { std::alloc::alloc_zeroed(layout) };
    // A page nobody else sends: bytes of a counter the wire must not show.
    let pattern: Vec<u8> = (0..4096u32).map(|i| u8::try_from((i * 7 + 3) % 251).unwrap()).collect();
    // SAFETY: writes inside the allocation.
    unsafe { std::ptr::copy_nonoverlapping(pattern.as_ptr(), buf.add(4096), 4096) };
    let page = buf as u64 + 4096;
    let pid = sleeping_child(|| {});
    let key = starling_proto::SecretKey([0x3c; 32]);
    let serve = |encrypt: bool| {
        let opts = PageServerOptions { mcdist: starling_mcdist::Switch::Off, key, encrypt, ..PageServerOptions::default() };
        PageServer::start_with(pid, vec![(page, page + 4096)], "127.0.0.1:0".parse().unwrap(), opts).unwrap()
    };
    for (server_wants, client_wants) in [(false, false), (true, false), (false, true), (true, true)] {
        let encrypted = server_wants || client_wants;
        let server = serve(server_wants);
        let (via, seen) = relay(server.addr(), None);
        let mut client = PageClient::connect(via, &key, client_wants).unwrap();
        assert_eq!(client.is_encrypted(), encrypted, "server {server_wants}, client {client_wants}");
        match &client.fetch(&[page]).unwrap()[0] {
            PageReply::Data(d) => assert_eq!(&d[..], &pattern[..]),
            _ => panic!("expected the page's data"),
        }
        let seen = seen.lock().unwrap();
        let in_clear = seen.windows(64).any(|w| w == &pattern[..64]);
        assert_eq!(in_clear, !encrypted, "the page in clear on the wire (server {server_wants}, client {client_wants})");
    }
    // One bit flipped in the reply's ciphertext (after the 69-byte SFPB and
    // the record's 4-byte length): the client refuses the record.
    let server = serve(true);
    let (via, _) = relay(server.addr(), Some(69 + 4 + 10));
    let mut client = PageClient::connect(via, &key, true).unwrap();
    let err = client.fetch(&[page]).err().expect("a tampered record must be refused");
    assert!(err.to_string().contains("authentication"), "{err}");
    reap(pid);
    // SAFETY: same layout as allocated.
    unsafe { std::alloc::dealloc(buf, layout) };
}
