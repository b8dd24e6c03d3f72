//! Unit tests: the plan a descriptor lowers to, read back through the abi
//! records as the restorer reads them; descriptor validation; counters.
// Offsets and ids of the small plans built here fit every narrower type they are cast to.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use crate::abi::counters::{CloneCounter, CloneCounters};
use crate::abi::plan::*;
use crate::abi::process::ProcessCore;
use crate::*;
use std::vec::Vec;

fn descriptor() -> Descriptor {
    crate::sample::descriptor(&[42, 43])
}

fn read<T: Copy>(plan: &[u8], off: u64) -> T {
    assert!(off as usize + core::mem::size_of::<T>() <= plan.len());
    // SAFETY: bounds checked above; T is a plan record of u64s.
    unsafe { core::ptr::read_unaligned(plan.as_ptr().add(off as usize).cast::<T>()) }
}

#[test]
fn lowered_plan_reads_back_as_the_restorer_reads_it() {
    let d = descriptor();
    d.validate().expect("valid");
    let opts = PlanOptions { clone_id: 3, clone_count: 1, new_pid_namespace: true, clone_id_in_rax: true, seccomp: &[], terminal: false, join_groups: 0 };
    let plan = lower(&d, opts);
    let h: PlanHeader = read(&plan, 0);
    assert_eq!((h.magic, h.version, h.total_len), (PLAN_MAGIC, PLAN_VERSION, plan.len() as u64));
    assert_eq!(h.flags, PLAN_FLAG_NEW_PIDNS | PLAN_FLAG_CLONE_ID_IN_RAX);
    assert_eq!((h.clone_id, h.n_threads, h.n_regions, h.n_fds, h.n_signals), (3, 2, 2, 3, 1));
    assert_eq!(h.blob_off % 64, 0);
    assert_eq!(h.process.pid, 42);
    let blob = |r: BlobRef| &plan[(h.blob_off + r.off) as usize..(h.blob_off + r.off + r.len) as usize];
    assert_eq!(blob(h.cwd), b"/home/u");
    assert_eq!(blob(h.groups), [100u32.to_le_bytes(), 27u32.to_le_bytes()].concat().as_slice());
    for (i, want) in [(0u64, (42u64, 832u64)), (1, (43, 512))] {
        let t: PlanThread = read(&plan, h.threads_off + i * THREAD_SIZE as u64);
        assert_eq!((t.core.tid, t.fpu.len), want);
        assert_eq!((h.blob_off + t.fpu.off) % 64, 0, "FPU area {i} aligned for XRSTOR");
        assert_eq!(blob(t.fpu)[0], want.0 as u8);
    }
    let heap: PlanRegion = read(&plan, h.regions_off);
    assert_eq!(heap.map_kind(), Some(MapKind::AnonRegister));
    let lib: PlanRegion = read(&plan, h.regions_off + REGION_SIZE as u64);
    assert_eq!((lib.map_kind(), lib.file_offset), (Some(MapKind::FilePrivate), 0x2000));
    assert_eq!(blob(lib.path), b"/usr/lib/x.so");
    let stdout: PlanFd = read(&plan, h.fds_off);
    assert_eq!((stdout.fd, stdout.restore_kind()), (1, Some(FdRestore::Inherit)));
    let file: PlanFd = read(&plan, h.fds_off + FD_SIZE as u64);
    assert_eq!((file.fd, file.restore_kind(), file.offset, file.open_flags), (5, Some(FdRestore::Reopen), 77, 2));
    assert_eq!(blob(file.path), b"/data/in");
    // A descriptor of the file stderr writes to: a dup of fd 2, no path.
    let stream: PlanFd = read(&plan, h.fds_off + 2 * FD_SIZE as u64);
    assert_eq!((stream.fd, stream.restore_kind(), stream.offset, stream.path.len), (9, Some(FdRestore::Dup), 2, 0));
    let sig: PlanSignal = read(&plan, h.signals_off);
    assert_eq!((sig.tid, sig.info.signo()), (0, 10));
}

#[test]
fn the_restorers_plan_check_accepts_a_lowered_plan_and_refuses_damaged_ones() {
    let d = descriptor();
    let opts = || PlanOptions { clone_id: 3, clone_count: 1, new_pid_namespace: true, clone_id_in_rax: true, seccomp: &[], terminal: false, join_groups: 0 };
    let plan = lower(&d, opts());
    assert_eq!(crate::abi::plan::validate(&plan), Ok(()));
    let what = |bytes: &[u8]| crate::abi::plan::validate(bytes).map_err(|e| e.what);
    assert_eq!(what(&plan[..plan.len() - 1]), Err("plan magic/version/length mismatch"));
    assert_eq!(what(&plan[..16]), Err("plan shorter than header"));
    let h: PlanHeader = read(&plan, 0);
    // A region of an unknown kind (the map field of the first region record).
    let mut bad = plan.clone();
    let map_at = h.regions_off as usize + 3 * 8;
    bad[map_at..map_at + 8].copy_from_slice(&99u64.to_le_bytes());
    assert_eq!(what(&bad), Err("region"));
    // A thread table that runs past the end.
    let mut bad = plan.clone();
    let n_threads_at = core::mem::offset_of!(PlanHeader, n_threads);
    bad[n_threads_at..n_threads_at + 8].copy_from_slice(&1_000_000u64.to_le_bytes());
    assert_eq!(what(&bad), Err("plan tables out of bounds"));
    // More groups to join than the restorer keeps descriptors for.
    let mut bad = plan.clone();
    let join_at = core::mem::offset_of!(PlanHeader, join_groups);
    bad[join_at..join_at + 8].copy_from_slice(&(MAX_JOIN_GROUPS + 1).to_le_bytes());
    assert_eq!(what(&bad), Err("groups to join"));
}

#[test]
fn validation_refuses_inconsistent_threads() {
    let mut d = descriptor();
    d.threads[0].core.tid = 7;
    assert!(matches!(d.validate(), Err(DescriptorError::Invalid(m)) if m.contains("leader")));
    let mut d = descriptor();
    d.threads[1].core.tid = 42;
    assert!(matches!(d.validate(), Err(DescriptorError::Invalid(m)) if m.contains("duplicate")));
    let mut d = descriptor();
    d.threads[1].fpu.truncate(100);
    assert!(matches!(d.validate(), Err(DescriptorError::Invalid(m)) if m.contains("FPU")));
    let mut d = descriptor();
    d.threads[0].fpu[464] = 0; // XSAVE area without its magic
    assert!(matches!(d.validate(), Err(DescriptorError::Invalid(m)) if m.contains("magic")));
    let mut d = descriptor();
    d.fds[3].kind = FdKind::Stream { of: 5 }; // only stdout or stderr is a stream
    assert!(matches!(d.validate(), Err(DescriptorError::Invalid(m)) if m.contains("streams")));
}

/// Two timers: a periodic one signalling the process, a one-shot one signalling thread 43.
fn with_timers() -> Descriptor {
    use crate::abi::process::{PosixTimer, TimeSpec, SIGEV_SIGNAL, SIGEV_THREAD_ID};
    let mut d = descriptor();
    let timers = &mut d.process.core.timers;
    timers.table[0] = PosixTimer { id: 2, clock: 1, notify: SIGEV_SIGNAL, signo: 10, sigval: 7, tid: 0,
                                   interval: TimeSpec { sec: 0, nsec: 10_000_000 }, remaining: TimeSpec { sec: 0, nsec: 5 } };
    timers.table[1] = PosixTimer { id: 5, clock: (-6i64) as u64, notify: SIGEV_THREAD_ID, signo: 34, sigval: 0, tid: 43,
                                   interval: TimeSpec::default(), remaining: TimeSpec { sec: 1000, nsec: 0 } };
    timers.count = 2;
    d
}

#[test]
fn posix_timers_are_checked_by_the_descriptor_and_the_plan() {
    let d = with_timers();
    d.validate().expect("valid timers");
    let opts = || PlanOptions { clone_id: 0, clone_count: 1, new_pid_namespace: true, clone_id_in_rax: false, seccomp: &[], terminal: false, join_groups: 0 };
    let plan = lower(&d, opts());
    assert_eq!(crate::abi::plan::validate(&plan), Ok(()));
    let h: PlanHeader = read(&plan, 0);
    assert_eq!(h.process.timers.used(), &d.process.core.timers.table[..2], "the restorer reads them in place");
    let refused = |change: &dyn Fn(&mut Descriptor), why: &str| {
        let mut d = with_timers();
        change(&mut d);
        assert!(matches!(d.validate(), Err(DescriptorError::Invalid(ref m)) if m.contains(why)), "descriptor: {why}");
        // The plan check refuses the same table (lowered without the descriptor's check).
        let what = crate::abi::plan::validate(&lower(&d, opts())).map_err(|e| e.what);
        assert!(what.is_err_and(|w| w.contains(why)), "plan: {why}: {what:?}");
    };
    refused(&|d| d.process.core.timers.count = 33, "count");
    refused(&|d| d.process.core.timers.table[1].tid = 44, "not one of the process's");
    refused(&|d| d.process.core.timers.table[1].id = 1, "ascending");
    refused(&|d| d.process.core.timers.table[0].clock = 3, "clock"); // a thread's CPU clock
    refused(&|d| d.process.core.timers.table[0].signo = 0, "signal");
    refused(&|d| d.process.core.timers.table[0].notify = 3, "notification");
    refused(&|d| d.process.core.timers.table[0].interval.nsec = 1_000_000_000, "time");
}

#[test]
fn descriptor_round_trips_and_refuses_trailing_bytes() {
    let d = descriptor();
    let bytes = d.encode();
    assert_eq!(Descriptor::decode(&bytes).expect("decode"), d);
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(matches!(Descriptor::decode(&longer), Err(DescriptorError::Decode(_))));
}

#[test]
fn counters_by_index_follow_the_c_abi() {
    let c = CloneCounters { faults: 1, pages_fetched: 2, pages_zero: 3, pages_file: 4, fetch_requests: 5,
                            events_remove: 6, mode: 7, pages_multicast_unsolicited: 8,
                            stamp_ticket_ns: 9, stamp_template_ns: 10, stamp_descriptor_ns: 11, stamp_placed_ns: 12,
                            stamp_launch_received_ns: 13, stamp_view_mounted_ns: 14, stamp_sandbox_ready_ns: 15,
                            stamp_restorer_running_ns: 16, stamp_first_page_ns: 17 };
    let got: Vec<u64> = (0..17).map(|i| c.get(CloneCounter::from_index(i).expect("index"))).collect();
    assert_eq!(got, (1..=17).collect::<Vec<u64>>());
    assert_eq!(CloneCounter::from_index(17), None);
    assert_eq!(CloneCounter::from_index(-1), None);
    // The header names every stamp's index as the counter is named (include/starling.h).
    let header = include_str!("../../../include/starling.h");
    let mut defined = Vec::new();
    for line in header.lines() {
        let mut words = line.split_whitespace();
        if let (Some("#define"), Some(name), Some(index)) = (words.next(), words.next(), words.next()) {
            if let Some(stage) = name.strip_prefix("SF_CLONE_STAMP_") {
                let index: i32 = index.parse().expect("a stamp's index is a number");
                let counter = CloneCounter::from_index(index).expect("the header's index exists");
                assert_eq!(counter.name(), std::format!("stamp_{}_ns", stage.to_lowercase()), "{name}");
                defined.push(index);
            }
        }
    }
    assert_eq!(defined, (8..=16).collect::<Vec<i32>>(), "one SF_CLONE_STAMP_* per stamp, in order");
}

#[test]
fn a_process_tree_lowers_to_one_plan_per_process_parents_first() {
    let mut root = crate::sample::descriptor(&[42, 43]);
    // The root leads its session; the child its own group in it, which the grandchild joins.
    root.process.core.sid = 42;
    root.process.core.pgid = 42;
    let mut child = crate::sample::descriptor(&[50]);
    (child.process.core.sid, child.process.core.pgid) = (42, 50);
    let mut grandchild = crate::sample::descriptor(&[51]);
    (grandchild.process.core.sid, grandchild.process.core.pgid) = (42, 50);
    // A pipe from the child (fd 12, nonblocking) to the grandchild (fd 0).
    child.fds.push(FdEntry { fd: 12, kind: FdKind::TreePipe { pipe: 0, write: true, flags: 0o4001 } });
    grandchild.fds.insert(0, FdEntry { fd: 0, kind: FdKind::TreePipe { pipe: 0, write: false, flags: 0 } });
    root.pipes = std::vec![PipeImage { capacity: 65536, data: b"in flight".to_vec() }];
    root.descendants = std::vec![(0, child), (1, grandchild)];
    root.validate().expect("valid tree");
    assert_eq!(Descriptor::decode(&root.encode()).expect("round trip"), root);
    let opts = PlanOptions { clone_id: 0, clone_count: 1, new_pid_namespace: true, clone_id_in_rax: false, seccomp: &[], terminal: true, join_groups: 2 };
    let plan = lower(&root, opts);
    let mut offsets = [0u64; 8];
    let n = crate::abi::plan::validate_tree(&plan, &mut offsets).expect("a valid tree plan");
    assert_eq!(n, 3);
    let headers: std::vec::Vec<PlanHeader> = offsets[..n].iter().map(|&o| read(&plan, o)).collect();
    assert!(offsets[..n].iter().all(|o| o % 64 == 0), "each plan aligned for its FPU areas: {offsets:?}");
    let got: std::vec::Vec<(u64, u64, u64)> = headers.iter().map(|h| (h.process.pid, h.parent, h.clone_id)).collect();
    assert_eq!(got, [(42, NO_PARENT, 0), (50, 0, 1), (51, 1, 2)]);
    assert!(headers.iter().all(|h| h.join_groups == 2), "every process of the tree joins the groups");
    assert_eq!(headers.iter().map(|h| h.flags & PLAN_FLAG_TERMINAL).collect::<std::vec::Vec<_>>(), [PLAN_FLAG_TERMINAL, 0, 0], "the root takes the terminal");
    let ids: std::vec::Vec<(u64, u64)> = headers.iter().map(|h| (h.process.sid, h.process.pgid)).collect();
    assert_eq!(ids, [(42, 42), (42, 50), (42, 50)]);
    // The pipes: the root's table, every plan's count and fd base above every fd of the tree.
    let got: std::vec::Vec<(u64, u64, u64)> = headers.iter().map(|h| (h.tree_pipes, h.n_pipes, h.pipe_fd_base)).collect();
    assert_eq!(got, [(1, 1, 13), (1, 0, 13), (1, 0, 13)]);
    let pipe: PlanPipe = read(&plan, offsets[0] + headers[0].pipes_off);
    let data_at = (offsets[0] + headers[0].blob_off + pipe.data.off) as usize;
    assert_eq!((pipe.capacity, &plan[data_at..data_at + pipe.data.len as usize]), (65536, &b"in flight"[..]));
    let fd_of = |plan_index: usize, fd: u64| -> PlanFd {
        let h = &headers[plan_index];
        (0..h.n_fds).map(|i| read::<PlanFd>(&plan, offsets[plan_index] + h.fds_off + i * FD_SIZE as u64)).find(|f| f.fd == fd).unwrap()
    };
    let (w, r) = (fd_of(1, 12), fd_of(2, 0));
    assert_eq!((w.kind, w.offset, w.open_flags), (FdRestore::TreePipe as u64, 0, 0o4001), "write end, nonblocking");
    assert_eq!((r.kind, r.offset, r.open_flags), (FdRestore::TreePipe as u64, 0, 0), "a pipe at fd 0 is not the inherited stdin");
    // The child's group in the terminal's foreground (a shell's job): only its plan takes it, and
    // only a group a child of the root's session leads can be named.
    let mut fg = root.clone();
    fg.process.core.tpgid = 50;
    fg.validate().expect("a foreground job");
    let plan = lower(&fg, opts);
    let n = crate::abi::plan::validate_tree(&plan, &mut offsets).expect("a valid tree plan");
    let flags: std::vec::Vec<u64> = offsets[..n].iter().map(|&o| read::<PlanHeader>(&plan, o).flags & PLAN_FLAG_TERMINAL_FOREGROUND).collect();
    assert_eq!(flags, [0, PLAN_FLAG_TERMINAL_FOREGROUND, 0]);
    let plan = lower(&fg, PlanOptions { terminal: false, ..opts });
    let n = crate::abi::plan::validate_tree(&plan, &mut offsets).expect("a valid tree plan");
    assert!(offsets[..n].iter().all(|&o| read::<PlanHeader>(&plan, o).flags & PLAN_FLAG_TERMINAL_FOREGROUND == 0), "no terminal, no foreground");
    for (tpgid, on_child) in [(51, false), (77, false), (50, true)] {
        let mut bad = root.clone();
        if on_child {
            bad.descendants[0].1.process.core.tpgid = tpgid;
        } else {
            bad.process.core.tpgid = tpgid;
        }
        assert!(bad.validate().is_err(), "foreground group {tpgid} (named by the child: {on_child})");
    }
    let mut bad = root.clone();
    bad.pipes.clear();
    assert!(bad.validate().is_err(), "an fd naming a pipe the tree does not have");
    // Refused: a parent after its child, a PID twice, nested descendants.
    let mut bad = root.clone();
    bad.descendants[1].0 = 2;
    assert!(bad.validate().is_err(), "parent not before the child");
    let mut bad = root.clone();
    bad.descendants[1].1.threads[0].core.tid = 50;
    bad.descendants[1].1.process.core.pid = 50;
    assert!(bad.validate().is_err(), "a PID twice");
    let mut bad = root.clone();
    bad.descendants[0].1.descendants = std::vec![(0, crate::sample::descriptor(&[60]))];
    assert!(bad.validate().is_err(), "nested descendants");
    // A group whose leader is not in the tree is refused by the restorer's check too.
    let mut raw = plan.clone();
    let at = usize::try_from(offsets[1]).unwrap() + core::mem::offset_of!(PlanHeader, process) + core::mem::offset_of!(ProcessCore, pgid);
    raw[at..at + 8].copy_from_slice(&42u64.to_le_bytes());
    assert!(crate::abi::plan::validate_tree(&raw, &mut offsets).is_err(), "the grandchild's group has lost its leader");
    // A plan whose parent index is not before it is refused by the restorer's check.
    let mut raw = plan.clone();
    let at = usize::try_from(offsets[2]).unwrap() + core::mem::offset_of!(PlanHeader, parent);
    raw[at..at + 8].copy_from_slice(&5u64.to_le_bytes());
    assert!(crate::abi::plan::validate_tree(&raw, &mut offsets).is_err());
}

#[test]
fn sessions_and_groups_a_tree_can_reach_are_restorable_and_others_named() {
    let p = |parent: Option<usize>, pid: u64, sid: u64, pgid: u64| SessionIds { parent, pid, sid, pgid };
    // The sandbox's task (2) leads its session; a child leads a group in it, another child a
    // session; a grandchild forked before its parent's setsid stays in the old session and joins
    // its aunt's group; one forked after is in the new session.
    let ok = [p(None, 2, 2, 2), p(Some(0), 3, 2, 3), p(Some(0), 4, 4, 4), p(Some(2), 5, 2, 3), p(Some(2), 6, 4, 4)];
    assert_eq!(check_sessions(&ok), Ok(()));
    assert_eq!(forked_before_parent_setsid(&ok), Ok(std::vec![false, false, false, true, false]), "5 before 4's setsid");
    // A moved clone: everything in the restorer's session and group, or groups of the tree in it.
    assert_eq!(check_sessions(&[p(None, 7, 0, 0), p(Some(0), 8, 0, 8), p(Some(1), 9, 0, 0)]), Ok(()));
    let err = |tree: &[SessionIds]| check_sessions(tree).unwrap_err();
    // Group 3's leader has left it (or ended): nobody may take its ID.
    assert_eq!(err(&[p(None, 2, 2, 2), p(Some(0), 3, 2, 2), p(Some(1), 5, 2, 3)]), SessionError::NoGroupLeader { pid: 5, pgid: 3 });
    // A group of another session cannot be joined.
    assert_eq!(err(&[p(None, 2, 2, 2), p(Some(0), 4, 4, 4), p(Some(0), 3, 2, 4)]), SessionError::GroupOfAnotherSession { pid: 3, pgid: 4 });
    // A session is inherited from the parent, before or after the parent started its own: a
    // child of a process still in the restorer's session cannot be in a session of the tree.
    let early_twice = [p(None, 2, 2, 2), p(Some(0), 4, 4, 4), p(Some(1), 5, 0, 0)];
    assert_eq!(forked_before_parent_setsid(&early_twice), Ok(std::vec![false, true, true]));
    assert_eq!(err(&[p(None, 2, 2, 2), p(Some(0), 3, 0, 0), p(Some(1), 5, 2, 2)]), SessionError::SessionNotInherited { pid: 5, sid: 2 });
    assert_eq!(err(&[p(None, 2, 0, 0), p(Some(0), 3, 9, 9)]), SessionError::NoSessionLeader { pid: 3, sid: 9 });
    assert_eq!(err(&[p(None, 2, 2, 0)]), SessionError::SessionLeaderInOtherGroup { pid: 2, pgid: 0 });
    assert_eq!(err(&[p(None, 2, 2, 2), p(Some(0), 3, 2, 0)]), SessionError::SandboxGroupOtherSession { pid: 3, sid: 2 });
}

#[test]
fn a_display_connection_lowers_to_a_connect_that_names_its_stream() {
    let mut d = crate::sample::descriptor(&[42]);
    let path = "/tmp/.X11-unix/.starling-X10-reattach";
    d.fds.push(FdEntry { fd: 20, kind: FdKind::Reconnect { path: path.into(), hello: 7, flags: 0o4002 } });
    d.validate().expect("valid");
    assert_eq!(Descriptor::decode(&d.encode()).expect("round trip"), d);
    let opts = PlanOptions { clone_id: 0, clone_count: 1, new_pid_namespace: true, clone_id_in_rax: false, seccomp: &[], terminal: false, join_groups: 0 };
    let plan = lower(&d, opts);
    validate(&plan).expect("a valid plan");
    let h: PlanHeader = read(&plan, 0);
    let f = (0..h.n_fds).map(|i| read::<PlanFd>(&plan, h.fds_off + i * FD_SIZE as u64)).find(|f| f.fd == 20).expect("fd 20");
    let at = (h.blob_off + f.path.off) as usize;
    assert_eq!((f.kind, f.offset, f.open_flags), (FdRestore::Connect as u64, 7, 0o4000), "its stream, and only O_NONBLOCK of its flags");
    assert_eq!(&plan[at..at + f.path.len as usize], path.as_bytes());
    // A path that does not fit a sockaddr_un, or is not absolute, is refused.
    for bad_path in ["x".repeat(108), "tmp/.X11-unix/X10".into()] {
        let mut bad = d.clone();
        bad.fds[4].kind = FdKind::Reconnect { path: bad_path.clone(), hello: 7, flags: 0 };
        assert!(bad.validate().is_err(), "{bad_path:?}");
    }
}
