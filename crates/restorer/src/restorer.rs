//! starling's restorer: a static, no-libc program that turns itself into a
//! clone of a frozen template process.
//!
//! It is compiled by `build.rs` straight with `rustc` (`panic=abort`, linked
//! `-static -nostartfiles -no-pie` at a fixed high address, see
//! `RESTORER_BASE` there) because a `no_std` binary needs `panic=abort`, which
//! a workspace profile cannot set per package on stable Rust.
//!
//! Inputs (set up by whoever starts it, e.g. `starling_fork::local`):
//! * fd 3: the restore plan (see `plan.rs`), read to EOF;
//! * fd 4: a unix stream socket to the fault handler, which receives the
//!   clone's userfaultfd over SCM_RIGHTS;
//! * fds 0-2: the clone's stdio.
//!
//! Steps: (1) optional PID namespace: unshare, an init with PID 1, and the
//! clone with `set_tid` = the template's PID; (2) in the clone: move off the
//! kernel-made stack onto a static one, unmap it, move vDSO/vvar to the
//! template's addresses; (3) map every region at its exact address; (4)
//! create a userfaultfd, register the regions with data to fetch, pass it to
//! the handler; (5) restore fds, cwd, umask, rlimits, credentials, signals,
//! fs base, robust list, clear-tid address, rseq; (6) load the resume
//! context and jump, with the clone ID as the return value.
//!
//! Failures before the jump exit with a code from `plan::EXIT_*`.

#![no_std]
#![no_main]

#[path = "plan.rs"]
#[allow(dead_code)]
mod plan;

use core::arch::{asm, global_asm};
use plan::*;

// ---------------------------------------------------------------------------
// raw system calls

mod nr {
    pub const READ: usize = 0;
    pub const WRITE: usize = 1;
    pub const OPEN: usize = 2;
    pub const CLOSE: usize = 3;
    pub const LSEEK: usize = 8;
    pub const MMAP: usize = 9;
    pub const MUNMAP: usize = 11;
    pub const RT_SIGACTION: usize = 13;
    pub const RT_SIGPROCMASK: usize = 14;
    pub const IOCTL: usize = 16;
    pub const MREMAP: usize = 25;
    pub const DUP2: usize = 33;
    pub const SENDMSG: usize = 46;
    pub const EXIT: usize = 60;
    pub const WAIT4: usize = 61;
    pub const FCNTL: usize = 72;
    pub const CHDIR: usize = 80;
    pub const UMASK: usize = 95;
    pub const GETTID: usize = 186;
    pub const SETGROUPS: usize = 116;
    pub const SETRESUID: usize = 117;
    pub const SETRESGID: usize = 119;
    pub const SIGALTSTACK: usize = 131;
    pub const PRCTL: usize = 157;
    pub const ARCH_PRCTL: usize = 158;
    pub const SET_TID_ADDRESS: usize = 218;
    pub const EXIT_GROUP: usize = 231;
    pub const UNSHARE: usize = 272;
    pub const SET_ROBUST_LIST: usize = 273;
    pub const PIPE2: usize = 293;
    pub const PRLIMIT64: usize = 302;
    pub const USERFAULTFD: usize = 323;
    pub const RSEQ: usize = 334;
    pub const CLONE3: usize = 435;
    pub const CLOSE_RANGE: usize = 436;
}

/// # Safety
/// A raw system call can do anything the kernel allows; each caller passes
/// arguments valid for that call (pointers into memory we own, sizes that
/// match). Only rcx and r11 are clobbered by `syscall`.
#[inline(always)]
unsafe fn syscall6(n: usize, a: usize, b: usize, c: usize, d: usize, e: usize, f: usize) -> isize {
    let ret: isize;
    // SAFETY: see the function's contract.
    unsafe {
        asm!("syscall", inlateout("rax") n as isize => ret, in("rdi") a, in("rsi") b, in("rdx") c,
             in("r10") d, in("r8") e, in("r9") f, lateout("rcx") _, lateout("r11") _,
             options(nostack));
    }
    ret
}

macro_rules! sys {
    ($n:expr) => { syscall6($n, 0, 0, 0, 0, 0, 0) };
    ($n:expr, $a:expr) => { syscall6($n, $a as usize, 0, 0, 0, 0, 0) };
    ($n:expr, $a:expr, $b:expr) => { syscall6($n, $a as usize, $b as usize, 0, 0, 0, 0) };
    ($n:expr, $a:expr, $b:expr, $c:expr) => { syscall6($n, $a as usize, $b as usize, $c as usize, 0, 0, 0) };
    ($n:expr, $a:expr, $b:expr, $c:expr, $d:expr) => { syscall6($n, $a as usize, $b as usize, $c as usize, $d as usize, 0, 0) };
    ($n:expr, $a:expr, $b:expr, $c:expr, $d:expr, $e:expr) => { syscall6($n, $a as usize, $b as usize, $c as usize, $d as usize, $e as usize, 0) };
    ($n:expr, $a:expr, $b:expr, $c:expr, $d:expr, $e:expr, $f:expr) => { syscall6($n, $a as usize, $b as usize, $c as usize, $d as usize, $e as usize, $f as usize) };
}

fn exit_group(code: i32) -> ! {
    // SAFETY: exit_group takes a plain integer and never returns.
    unsafe {
        sys!(nr::EXIT_GROUP, code);
        sys!(nr::EXIT, code);
    }
    loop {}
}

fn write_all(fd: i32, mut buf: &[u8]) {
    while !buf.is_empty() {
        // SAFETY: buf is a live slice; the kernel reads buf.len() bytes from it.
        let n = unsafe { sys!(nr::WRITE, fd, buf.as_ptr(), buf.len()) };
        if n <= 0 {
            return;
        }
        buf = &buf[n as usize..];
    }
}

fn write_num(fd: i32, mut v: u64, hex: bool) {
    let mut tmp = [0u8; 20];
    let base = if hex { 16 } else { 10 };
    let mut i = tmp.len();
    loop {
        i -= 1;
        let d = (v % base) as u8;
        tmp[i] = if d < 10 { b'0' + d } else { b'a' + d - 10 };
        v /= base;
        if v == 0 {
            break;
        }
    }
    write_all(fd, &tmp[i..]);
}

/// Print "starling-restorer: <what> <value> (errno <e>)" on stderr and exit.
fn die(code: i32, what: &str, value: u64, err: isize) -> ! {
    write_all(2, b"starling-restorer: ");
    write_all(2, what.as_bytes());
    write_all(2, b" 0x");
    write_num(2, value, true);
    write_all(2, b" (errno ");
    write_num(2, (-err) as u64, false);
    write_all(2, b")\n");
    exit_group(code)
}

// ---------------------------------------------------------------------------
// memory primitives the compiler may call (there is no libc)

#[no_mangle]
pub unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: the caller guarantees both ranges are valid and disjoint.
    unsafe {
        asm!("rep movsb", inout("rcx") n => _, inout("rdi") dst => _, inout("rsi") src => _, options(nostack));
    }
    dst
}

#[no_mangle]
pub unsafe extern "C" fn memmove(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dst as usize) <= (src as usize) || (dst as usize) >= (src as usize + n) {
        // SAFETY: forward copy is correct when dst precedes src or ranges are disjoint.
        return unsafe { memcpy(dst, src, n) };
    }
    // SAFETY: backward byte copy with the direction flag set, restored after.
    unsafe {
        asm!("std", "rep movsb", "cld", inout("rcx") n => _, inout("rdi") dst.add(n - 1) => _,
             inout("rsi") src.add(n - 1) => _, options(nostack));
    }
    dst
}

#[no_mangle]
pub unsafe extern "C" fn memset(dst: *mut u8, c: i32, n: usize) -> *mut u8 {
    // SAFETY: the caller guarantees dst..dst+n is writable.
    unsafe {
        asm!("rep stosb", inout("rcx") n => _, inout("rdi") dst => _, in("al") c as u8, options(nostack));
    }
    dst
}

#[no_mangle]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    while i < n {
        // SAFETY: the caller guarantees both ranges are readable for n bytes.
        let (x, y) = unsafe { (core::ptr::read_volatile(a.add(i)), core::ptr::read_volatile(b.add(i))) };
        if x != y {
            return x as i32 - y as i32;
        }
        i += 1;
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: same contract as memcmp.
    unsafe { memcmp(a, b, n) }
}

/// The precompiled `core` references the unwinding personality routine; with
/// `panic=abort` nothing ever unwinds, so it is never called.
#[no_mangle]
pub extern "C" fn rust_eh_personality() {}

#[panic_handler]
fn on_panic(_: &core::panic::PanicInfo) -> ! {
    die(EXIT_BAD_PLAN, "internal panic", 0, 0)
}

// ---------------------------------------------------------------------------
// static storage: the restorer never allocates

const PAGE: u64 = 4096;
const STACK_BYTES: usize = 256 * 1024;

#[repr(C, align(4096))]
struct Aligned<const N: usize>([u8; N]);

/// Our own stack, inside our image, so that the kernel-made stack (placed at
/// a random address that may collide with the template's) can be unmapped.
static mut STACK: Aligned<STACK_BYTES> = Aligned([0; STACK_BYTES]);
/// The plan, read from fd 3.
static mut PLAN: Aligned<PLAN_MAX_BYTES> = Aligned([0; PLAN_MAX_BYTES]);
/// Our /proc/self/maps.
static mut MAPS: Aligned<65536> = Aligned([0; 65536]);
/// Parking lot for the host vDSO/vvar while they move to the template's
/// addresses (mremap onto it replaces these pages; they are never touched).
static mut PARKING: Aligned<{ 16 * 4096 }> = Aligned([0; 16 * 4096]);
/// Path buffer for NUL-terminating plan strings.
static mut PATHBUF: Aligned<4096> = Aligned([0; 4096]);

extern "C" {
    static __executable_start: u8;
    static _end: u8;
}

// The entry point: the kernel leaves argc/argv/envp at rsp. We ignore them,
// switch to our static stack and call `restorer_main`.
global_asm!(
    ".globl _start",
    "_start:",
    "xor ebp, ebp",
    "lea rsp, [rip + {stack} + {size}]",
    "and rsp, -16",
    "call {main}",
    "ud2",
    stack = sym STACK,
    size = const STACK_BYTES,
    main = sym restorer_main,
);

// Load a `ResumeContext` (rdi) and jump to its rip with eax = clone id (esi).
// Everything the SysV ABI lets the callee rely on is restored: callee-saved
// registers, rsp, MXCSR and the x87 control word.
global_asm!(
    ".globl starling_restorer_jump",
    "starling_restorer_jump:",
    "mov rbx, [rdi + 0]",
    "mov rbp, [rdi + 8]",
    "mov r12, [rdi + 16]",
    "mov r13, [rdi + 24]",
    "mov r14, [rdi + 32]",
    "mov r15, [rdi + 40]",
    "ldmxcsr [rdi + 64]",
    "fldcw [rdi + 68]",
    "mov rsp, [rdi + 48]",
    "mov rax, [rdi + 56]",
    "mov r11, rax",
    "mov eax, esi",
    "xor ecx, ecx",
    "xor edx, edx",
    "xor esi, esi",
    "xor edi, edi",
    "xor r8d, r8d",
    "xor r9d, r9d",
    "xor r10d, r10d",
    "cld",
    "jmp r11",
);

extern "C" {
    fn starling_restorer_jump(ctx: *const ResumeContext, id: u32) -> !;
}

// ---------------------------------------------------------------------------

fn plan_bytes() -> &'static [u8] {
    // SAFETY: PLAN is only written by `read_plan` before any reader exists;
    // the restorer is single-threaded.
    unsafe { &(*core::ptr::addr_of!(PLAN)).0 }
}

fn read_plan() -> usize {
    let mut got = 0usize;
    loop {
        if got == PLAN_MAX_BYTES {
            die(EXIT_BAD_PLAN, "plan too large, limit", PLAN_MAX_BYTES as u64, 0);
        }
        // SAFETY: writes at most PLAN_MAX_BYTES - got bytes into our static buffer.
        let n = unsafe {
            let base = core::ptr::addr_of_mut!(PLAN) as *mut u8;
            sys!(nr::READ, 3, base.add(got), PLAN_MAX_BYTES - got)
        };
        if n < 0 {
            if n == -4 {
                continue;
            }
            die(EXIT_BAD_PLAN, "read plan fd 3", 3, n);
        }
        if n == 0 {
            break;
        }
        got += n as usize;
    }
    // SAFETY: close takes an integer.
    unsafe { sys!(nr::CLOSE, 3) };
    got
}

fn header() -> &'static PlanHeader {
    // SAFETY: validated by `validate_plan` (size, alignment of the static buffer).
    unsafe { &*(plan_bytes().as_ptr() as *const PlanHeader) }
}

fn validate_plan(len: usize) {
    if len < HEADER_SIZE {
        die(EXIT_BAD_PLAN, "plan shorter than header", len as u64, 0);
    }
    let h = header();
    if h.magic != PLAN_MAGIC || h.version != PLAN_VERSION || h.total_len != len as u64 {
        die(EXIT_BAD_PLAN, "plan magic/version/length mismatch", h.version, 0);
    }
    let in_bounds = |off: u64, count: u64, size: usize| -> bool {
        count <= (len as u64) && off % 8 == 0
            && off.checked_add(count.saturating_mul(size as u64)).map_or(false, |e| e <= len as u64)
    };
    if !in_bounds(h.regions_off, h.n_regions, REGION_SIZE) || !in_bounds(h.fds_off, h.n_fds, FD_SIZE)
        || !in_bounds(h.strings_off, h.strings_len, 1)
    {
        die(EXIT_BAD_PLAN, "plan tables out of bounds", len as u64, 0);
    }
    let several = h.clone_count > 1;
    if h.clone_count == 0 || h.clone_count > MAX_CLONES_PER_RESTORE || (several && h.flags & PLAN_FLAG_NEW_PIDNS == 0) {
        die(EXIT_BAD_PLAN, "clone count", h.clone_count, 0);
    }
}

fn regions() -> &'static [PlanRegion] {
    let h = header();
    // SAFETY: bounds and alignment checked in `validate_plan`; PlanRegion is plain u64s.
    unsafe {
        core::slice::from_raw_parts(plan_bytes().as_ptr().add(h.regions_off as usize) as *const PlanRegion, h.n_regions as usize)
    }
}

fn fds() -> &'static [PlanFd] {
    let h = header();
    // SAFETY: bounds and alignment checked in `validate_plan`; PlanFd is plain u64s.
    unsafe { core::slice::from_raw_parts(plan_bytes().as_ptr().add(h.fds_off as usize) as *const PlanFd, h.n_fds as usize) }
}

/// A plan string copied into PATHBUF with a terminating NUL.
fn cstr(off: u64, len: u64) -> *const u8 {
    let h = header();
    if len >= 4095 || off.checked_add(len).map_or(true, |e| e > h.strings_len) {
        die(EXIT_BAD_PLAN, "string out of bounds", off, 0);
    }
    let src = &plan_bytes()[(h.strings_off + off) as usize..(h.strings_off + off + len) as usize];
    // SAFETY: single-threaded; PATHBUF is only used through this function and
    // each result is consumed before the next call.
    unsafe {
        let dst = core::ptr::addr_of_mut!(PATHBUF) as *mut u8;
        core::ptr::copy_nonoverlapping(src.as_ptr(), dst, len as usize);
        *dst.add(len as usize) = 0;
        dst
    }
}

// ---------------------------------------------------------------------------
// step 1: PID namespace

#[repr(C)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// fork() via clone3, with one `set_tid` entry (the PID in the innermost
/// namespace) or, for `None`, the next free PID.
fn fork_process(pid: Option<u64>) -> isize {
    let tid = [pid.unwrap_or(0) as i32];
    let args = CloneArgs {
        flags: 0, pidfd: 0, child_tid: 0, parent_tid: 0, exit_signal: 17, /* SIGCHLD */
        stack: 0, stack_size: 0, tls: 0,
        set_tid: if pid.is_some() { tid.as_ptr() as u64 } else { 0 },
        set_tid_size: if pid.is_some() { 1 } else { 0 },
        cgroup: 0,
    };
    // SAFETY: clone3 without CLONE_VM is a fork: the child gets a copy of our
    // memory and continues here with the same (copied) stack; `args` and
    // `tid` are live for the duration of the call.
    unsafe { sys!(nr::CLONE3, &args as *const CloneArgs, core::mem::size_of::<CloneArgs>()) }
}

/// Reap one child (any: we may be a PID-ns init and inherit orphans):
/// (pid, raw wait status), or None when there is no child left.
fn reap_one() -> Option<(isize, i32)> {
    loop {
        let mut status: i32 = 0;
        // SAFETY: status is a live i32; wait4(-1, ...) reaps any child.
        let r = unsafe { sys!(nr::WAIT4, -1isize, &mut status as *mut i32, 0, 0) };
        if r == -4 {
            continue;
        }
        return if r < 0 { None } else { Some((r, status)) };
    }
}

/// A raw wait status as an exit code (128+sig for a signal).
fn exit_code(status: i32) -> i32 {
    let sig = status & 0x7f;
    if sig == 0 { (status >> 8) & 0xff } else { 128 + sig }
}

/// Wait for `child` and return its exit code.
fn wait_for(child: isize) -> i32 {
    loop {
        match reap_one() {
            None => return EXIT_PIDNS,
            Some((pid, status)) if pid == child => return exit_code(status),
            Some(_) => {}
        }
    }
}

/// The handler socket's descriptor as the restorer is started with it
/// (the clones move their copy out of the way of the template's fds).
const HANDLER_SOCK: i32 = 4;

/// Which of the plan's clones this process is (0: the first, with the
/// template's PID). Set in each clone right after the fork that made it.
static CLONE_INDEX: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(0);

fn clone_index() -> u64 {
    CLONE_INDEX.load(core::sync::atomic::Ordering::Relaxed)
}

/// The ID of the clone this process becomes.
fn my_clone_id() -> u64 {
    header().clone_id + clone_index()
}

/// Tell the handler that a clone ended (one record; best effort: the
/// handler may already be gone when the whole task is being killed).
fn send_exit(sock: i32, clone_id: u64, status: i32) {
    send_record(sock, [RECORD_EXIT, clone_id, status as u32 as u64], None);
}

/// Become PID 1 of a new PID namespace and start the plan's clones in it:
/// the first with the template's PID (so glibc's cached TID is right), the
/// others with the next free PIDs — each a fork of this process, which has
/// done nothing clone-specific yet, so every clone then restores itself from
/// the same plan (a host restores once per ticket; no page is fetched twice
/// for the forks because nothing has been fetched yet). PID 1 reaps them,
/// reports each one's status on the handler socket, and exits with the first
/// clone's code once all have ended.
fn enter_pid_namespace(template_pid: u64, count: u64) {
    const CLONE_NEWPID: usize = 0x2000_0000;
    // SAFETY: unshare takes flags only; it affects our future children.
    let r = unsafe { sys!(nr::UNSHARE, CLONE_NEWPID) };
    if r < 0 {
        die(EXIT_PIDNS, "unshare(CLONE_NEWPID)", 0, r);
    }
    let init = fork_process(Some(1));
    if init < 0 {
        die(EXIT_PIDNS, "clone3 init set_tid", 1, init);
    }
    if init > 0 {
        // The original process: relay the namespace's result.
        exit_group(wait_for(init));
    }
    // PID 1 of the new namespace. Die with our parent (the launcher).
    // SAFETY: prctl with integer arguments.
    unsafe { sys!(nr::PRCTL, 1 /* PR_SET_PDEATHSIG */, 9) };
    let first = header().clone_id;
    let mut pids = [0isize; MAX_CLONES_PER_RESTORE as usize];
    let mut running = 0u64;
    for i in 0..count {
        let pid = fork_process(if i == 0 { Some(template_pid) } else { None });
        if pid == 0 {
            CLONE_INDEX.store(i, core::sync::atomic::Ordering::Relaxed);
            // SAFETY: prctl with integer arguments.
            unsafe { sys!(nr::PRCTL, 1, 9) };
            return;
        }
        if pid < 0 {
            if i == 0 {
                die(EXIT_PIDNS, "clone3 set_tid template pid", template_pid, pid);
            }
            // This clone never ran: report it as having exited with the
            // restorer's PID-namespace failure code.
            send_exit(HANDLER_SOCK, first + i, EXIT_PIDNS << 8);
            continue;
        }
        pids[i as usize] = pid;
        running += 1;
    }
    let mut first_code = EXIT_PIDNS;
    while running > 0 {
        let Some((pid, status)) = reap_one() else { break };
        if let Some(i) = pids[..count as usize].iter().position(|&p| p == pid) {
            send_exit(HANDLER_SOCK, first + i as u64, status);
            if i == 0 {
                first_code = exit_code(status);
            }
            running -= 1;
        }
    }
    exit_group(first_code)
}

// ---------------------------------------------------------------------------
// step 2: our own mappings

struct MapsLine<'a> {
    start: u64,
    end: u64,
    name: &'a [u8],
}

fn parse_hex(s: &[u8]) -> u64 {
    let mut v = 0u64;
    for &c in s {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => break,
        };
        v = (v << 4) | d as u64;
    }
    v
}

/// Read /proc/self/maps and call `f` for each line.
fn for_each_own_mapping(mut f: impl FnMut(&MapsLine)) {
    // SAFETY: open of a NUL-terminated literal path.
    let fd = unsafe { sys!(nr::OPEN, b"/proc/self/maps\0".as_ptr(), 0 /* O_RDONLY */) };
    if fd < 0 {
        die(EXIT_VDSO, "open /proc/self/maps", 0, fd);
    }
    let mut len = 0usize;
    // SAFETY: MAPS is only used here; single-threaded.
    let buf = unsafe { &mut (*core::ptr::addr_of_mut!(MAPS)).0 };
    loop {
        // SAFETY: reads into the unused tail of our static buffer.
        let n = unsafe { sys!(nr::READ, fd, buf.as_mut_ptr().add(len), buf.len() - len) };
        if n <= 0 {
            break;
        }
        len += n as usize;
        if len == buf.len() {
            die(EXIT_VDSO, "own maps too large", len as u64, 0);
        }
    }
    // SAFETY: closing our own fd.
    unsafe { sys!(nr::CLOSE, fd) };
    for line in buf[..len].split(|&c| c == b'\n') {
        if line.is_empty() {
            continue;
        }
        let dash = line.iter().position(|&c| c == b'-').unwrap_or(0);
        let sp = line.iter().position(|&c| c == b' ').unwrap_or(0);
        let start = parse_hex(&line[..dash]);
        let end = parse_hex(&line[dash + 1..sp]);
        // name: after the 5th space-separated field
        let mut fields = 0;
        let mut i = 0;
        while i < line.len() && fields < 5 {
            if line[i] == b' ' {
                fields += 1;
                while i + 1 < line.len() && line[i + 1] == b' ' {
                    i += 1;
                }
            }
            i += 1;
        }
        let name = if i <= line.len() { &line[i.min(line.len())..] } else { &[][..] };
        f(&MapsLine { start, end, name });
    }
}

fn mremap_fixed(from: u64, len: u64, to: u64) -> isize {
    // SAFETY: moves a whole mapping of ours to an address we chose
    // (MREMAP_MAYMOVE|MREMAP_FIXED = 3); nothing references the old range.
    unsafe { sys!(nr::MREMAP, from, len, len, 3, to) }
}

fn fix_own_mappings() {
    let mut stack = (0u64, 0u64);
    let mut specials = [(0u64, 0u64); 3]; // vvar, vvar_vclock, vdso
    for_each_own_mapping(|m| match m.name {
        b"[stack]" => stack = (m.start, m.end),
        b"[vvar]" => specials[0] = (m.start, m.end),
        b"[vvar_vclock]" => specials[1] = (m.start, m.end),
        b"[vdso]" => specials[2] = (m.start, m.end),
        _ => {}
    });
    if stack.1 > stack.0 {
        // SAFETY: we run on STACK (in our image); the kernel-made stack only
        // holds argv/envp/auxv, which we never read.
        unsafe { sys!(nr::MUNMAP, stack.0, stack.1 - stack.0) };
    }
    let mut targets = [(0u64, 0u64); 3];
    for r in regions() {
        let slot = match r.kind {
            REGION_VVAR => 0,
            REGION_VVAR_VCLOCK => 1,
            REGION_VDSO => 2,
            _ => continue,
        };
        targets[slot] = (r.start, r.end);
    }
    // Park first (targets may overlap where ours are), then move into place.
    let parking = core::ptr::addr_of!(PARKING) as u64;
    let mut park_off = 0u64;
    let mut parked = [0u64; 3];
    for i in 0..3 {
        let (s, e) = specials[i];
        if e <= s {
            continue;
        }
        let len = e - s;
        if park_off + len > 16 * PAGE {
            die(EXIT_VDSO, "vdso/vvar larger than parking", len, 0);
        }
        let r = mremap_fixed(s, len, parking + park_off);
        if r < 0 {
            die(EXIT_VDSO, "park vdso/vvar", s, r);
        }
        parked[i] = parking + park_off;
        park_off += len;
    }
    for i in 0..3 {
        let (s, e) = specials[i];
        if e <= s {
            continue;
        }
        let (ts, te) = targets[i];
        if te <= ts {
            // The template had none: drop ours.
            // SAFETY: unmapping our own parked special mapping.
            unsafe { sys!(nr::MUNMAP, parked[i], e - s) };
            continue;
        }
        if te - ts != e - s {
            die(EXIT_VDSO, "vdso/vvar size differs from template's (different kernel?)", ts, 0);
        }
        let r = mremap_fixed(parked[i], e - s, ts);
        if r < 0 {
            die(EXIT_VDSO, "move vdso/vvar to template address", ts, r);
        }
    }
}

// ---------------------------------------------------------------------------
// step 3/4: regions and userfaultfd

fn open_path(off: u64, len: u64, flags: u64) -> isize {
    let p = cstr(off, len);
    // SAFETY: p is a NUL-terminated path in PATHBUF.
    unsafe { sys!(nr::OPEN, p, flags | 0o2000000 /* O_CLOEXEC */, 0) }
}

fn map_regions() {
    const MAP_SHARED: u64 = 1;
    const MAP_PRIVATE: u64 = 2;
    const MAP_ANONYMOUS: u64 = 0x20;
    const MAP_GROWSDOWN: u64 = 0x100;
    const MAP_FIXED_NOREPLACE: u64 = 0x100000;
    // Addresses of linker-defined symbols (taken, never read).
    let (own_start, own_end) =
        (core::ptr::addr_of!(__executable_start) as u64, core::ptr::addr_of!(_end) as u64);
    for r in regions() {
        if r.end <= r.start || r.start % PAGE != 0 || r.end % PAGE != 0 {
            die(EXIT_BAD_PLAN, "bad region", r.start, 0);
        }
        if r.start < own_end + PAGE && r.end + PAGE > own_start {
            die(EXIT_COLLISION, "template region collides with the restorer image at", r.start, 0);
        }
        let len = r.end - r.start;
        let res = match r.kind {
            REGION_VVAR | REGION_VVAR_VCLOCK | REGION_VDSO => continue,
            REGION_FILE_PRIVATE | REGION_FILE_SHARED => {
                let shared = r.kind == REGION_FILE_SHARED;
                let writable = shared && (r.prot & 2) != 0;
                let fd = open_path(r.path_off, r.path_len, if writable { 2 } else { 0 });
                if fd < 0 {
                    die(EXIT_MAP, "open file of region", r.start, fd);
                }
                let flags = if shared { MAP_SHARED } else { MAP_PRIVATE } | MAP_FIXED_NOREPLACE;
                // SAFETY: maps a file at an address no mapping of ours uses (NOREPLACE).
                let m = unsafe { sys!(nr::MMAP, r.start, len, r.prot, flags, fd, r.file_offset) };
                // SAFETY: closing the fd we opened; the mapping keeps the file.
                unsafe { sys!(nr::CLOSE, fd) };
                m
            }
            REGION_ANON_REGISTER | REGION_ANON_PLAIN => {
                let mut flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE;
                if r.flags & REGION_FLAG_GROWSDOWN != 0 {
                    flags |= MAP_GROWSDOWN;
                }
                // SAFETY: anonymous mapping at an address no mapping of ours uses (NOREPLACE).
                unsafe { sys!(nr::MMAP, r.start, len, r.prot, flags, -1isize, 0) }
            }
            _ => die(EXIT_BAD_PLAN, "unknown region kind", r.kind, 0),
        };
        if res < 0 || res as u64 != r.start {
            die(EXIT_MAP, "mmap region", r.start, res);
        }
    }
}

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

const UFFDIO_API: u64 = 0xc018_aa3f;
const UFFDIO_REGISTER: u64 = 0xc020_aa00;
const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;

/// Create the userfaultfd, register the regions that need fetching, and
/// return the fd (or -1 if no region needs it).
fn register_regions() -> isize {
    if !regions().iter().any(|r| r.kind == REGION_ANON_REGISTER) {
        return -1;
    }
    // SAFETY: userfaultfd takes flags only (O_CLOEXEC|O_NONBLOCK; kernel-mode
    // faults must be handled too, so no UFFD_USER_MODE_ONLY).
    let uffd = unsafe { sys!(nr::USERFAULTFD, 0o2000000 | 0o4000) };
    if uffd < 0 {
        die(EXIT_UFFD, "userfaultfd", 0, uffd);
    }
    let mut api = UffdioApi {
        api: 0xAA,
        features: UFFD_FEATURE_EVENT_REMAP | UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_EVENT_UNMAP,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes the struct we pass.
    let r = unsafe { sys!(nr::IOCTL, uffd, UFFDIO_API, &mut api as *mut UffdioApi) };
    if r < 0 {
        die(EXIT_UFFD, "UFFDIO_API", api.features, r);
    }
    for reg in regions().iter().filter(|r| r.kind == REGION_ANON_REGISTER) {
        let mut rg = UffdioRegister { start: reg.start, len: reg.end - reg.start, mode: 1 /* MISSING */, ioctls: 0 };
        // SAFETY: UFFDIO_REGISTER reads and writes the struct we pass.
        let r = unsafe { sys!(nr::IOCTL, uffd, UFFDIO_REGISTER, &mut rg as *mut UffdioRegister) };
        if r < 0 {
            die(EXIT_UFFD, "UFFDIO_REGISTER", reg.start, r);
        }
    }
    uffd
}

#[repr(C)]
struct Iovec {
    base: u64,
    len: u64,
}

#[repr(C)]
struct Msghdr {
    name: u64,
    namelen: u32,
    _pad: u32,
    iov: u64,
    iovlen: u64,
    control: u64,
    controllen: u64,
    flags: i32,
    _pad2: u32,
}

/// Send one record `[tag, clone id, value]` over the handler socket, with
/// `fd` attached (SCM_RIGHTS) when given. Returns sendmsg's result.
fn send_record(sock: i32, rec: [u64; 3], fd: Option<i32>) -> isize {
    let iov = Iovec { base: rec.as_ptr() as u64, len: RECORD_SIZE as u64 };
    // cmsghdr: len(u64)=20, level(i32)=SOL_SOCKET, type(i32)=SCM_RIGHTS, fd, pad
    let control = [20u64, 1 | (1 << 32), fd.unwrap_or(0) as u32 as u64];
    let msg = Msghdr {
        name: 0, namelen: 0, _pad: 0, iov: &iov as *const Iovec as u64, iovlen: 1,
        control: if fd.is_some() { control.as_ptr() as u64 } else { 0 },
        controllen: if fd.is_some() { 24 } else { 0 },
        flags: 0, _pad2: 0,
    };
    loop {
        // SAFETY: msg and everything it points to are live locals;
        // MSG_NOSIGNAL: a gone handler is an error, not a SIGPIPE.
        let r = unsafe { sys!(nr::SENDMSG, sock, &msg as *const Msghdr, 0x4000) };
        if r != -4 {
            return r;
        }
    }
}

/// Send the clone's userfaultfd (and its ID) to the handler.
fn send_fd(sock: i32, fd: i32, id: u64) {
    let r = send_record(sock, [RECORD_UFFD, id, 0], Some(fd));
    if r < 0 {
        die(EXIT_UFFD, "send userfaultfd to handler", sock as u64, r);
    }
}

// ---------------------------------------------------------------------------
// step 5: process state

fn move_fd_above(fd: i32, min: i32) -> i32 {
    // SAFETY: F_DUPFD_CLOEXEC (1030) duplicates our own fd.
    let n = unsafe { sys!(nr::FCNTL, fd, 1030, min) };
    if n < 0 {
        die(EXIT_FD, "move restorer fd", fd as u64, n);
    }
    // SAFETY: closing the old number, now duplicated.
    unsafe { sys!(nr::CLOSE, fd) };
    n as i32
}

fn restore_fds(keep_above: i32) {
    let mut next_free_check = 0u64;
    for f in fds() {
        if f.fd >= keep_above as u64 {
            die(EXIT_BAD_PLAN, "fd number out of range", f.fd, 0);
        }
        // Close everything between the previous plan fd and this one.
        if f.fd > next_free_check {
            // SAFETY: close_range on fd numbers the clone must not have.
            unsafe { sys!(nr::CLOSE_RANGE, next_free_check, f.fd - 1, 0) };
        }
        next_free_check = f.fd + 1;
        let target = f.fd as i32;
        let opened: isize = match f.kind {
            FD_INHERIT => continue,
            FD_REOPEN => {
                let p = cstr(f.path_off, f.path_len);
                // strip O_CREAT|O_EXCL|O_TRUNC (0o100|0o200|0o1000): the file exists, keep its data.
                let flags = f.open_flags & !(0o100 | 0o200 | 0o1000);
                // SAFETY: p is a NUL-terminated path in PATHBUF.
                unsafe { sys!(nr::OPEN, p, flags, 0) }
            }
            FD_PIPE_READ_EOF | FD_PIPE_WRITE_EPIPE => {
                let mut p = [0i32; 2];
                // SAFETY: pipe2 writes two ints into p.
                let r = unsafe { sys!(nr::PIPE2, p.as_mut_ptr(), 0) };
                if r < 0 {
                    r
                } else {
                    let (keep, drop) = if f.kind == FD_PIPE_READ_EOF { (p[0], p[1]) } else { (p[1], p[0]) };
                    // SAFETY: closing the end the placeholder must not have.
                    unsafe { sys!(nr::CLOSE, drop) };
                    keep as isize
                }
            }
            _ => die(EXIT_BAD_PLAN, "unknown fd kind", f.kind, 0),
        };
        if opened < 0 {
            die(EXIT_FD, "reopen fd", f.fd, opened);
        }
        if opened as i32 != target {
            // SAFETY: dup2 onto the template's fd number, then drop the temporary.
            unsafe {
                let r = sys!(nr::DUP2, opened, target);
                if r < 0 {
                    die(EXIT_FD, "dup2 fd", f.fd, r);
                }
                sys!(nr::CLOSE, opened);
            }
        }
        if f.kind == FD_REOPEN && f.offset != 0 {
            // SAFETY: lseek(SEEK_SET) on our fd.
            let r = unsafe { sys!(nr::LSEEK, target, f.offset, 0) };
            if r < 0 {
                die(EXIT_FD, "lseek fd", f.fd, r);
            }
        }
    }
}

fn restore_process_state() {
    let h = header();
    if h.cwd_len > 0 {
        let p = cstr(h.cwd_off, h.cwd_len);
        // SAFETY: p is NUL-terminated.
        let r = unsafe { sys!(nr::CHDIR, p) };
        if r < 0 {
            die(EXIT_THREAD_STATE, "chdir", 0, r);
        }
    }
    // SAFETY: umask takes an integer.
    unsafe { sys!(nr::UMASK, h.umask & 0o777) };
    for i in 0..N_RLIMITS {
        if h.rlimit_valid & (1 << i) != 0 {
            // Raising a hard limit needs CAP_SYS_RESOURCE: failures are tolerated.
            // SAFETY: prlimit64(0 = self) reads a [u64; 2].
            unsafe { sys!(nr::PRLIMIT64, 0, i, h.rlimits[i].as_ptr(), 0) };
        }
    }
    // Attempt the exact mm layout (brk, arg/env areas). Needs CAP_SYS_RESOURCE;
    // without it glibc's malloc falls back to mmap when brk cannot grow.
    let mut map = [0u64; 13];
    let mm = &h.mm;
    map[..11].copy_from_slice(&[mm.start_code, mm.end_code, mm.start_data, mm.end_data, mm.start_brk, mm.brk,
        mm.start_stack, mm.arg_start, mm.arg_end, mm.env_start, mm.env_end]);
    map[12] = (u32::MAX as u64) << 32; // auxv_size = 0, exe_fd = -1
    // SAFETY: PR_SET_MM(35) / PR_SET_MM_MAP(14) reads a struct prctl_mm_map of 104 bytes.
    unsafe { sys!(nr::PRCTL, 35, 14, map.as_ptr(), 104, 0) };
}

fn restore_signals() {
    let h = header();
    if h.altstack_sp != 0 {
        let ss = [h.altstack_sp, h.altstack_flags, h.altstack_size];
        // SAFETY: sigaltstack reads a stack_t {sp, flags(i32)+pad, size}.
        unsafe { sys!(nr::SIGALTSTACK, ss.as_ptr(), 0) };
    }
    for (i, act) in h.sigactions.iter().enumerate() {
        let sig = i + 1;
        if sig == 9 || sig == 19 || act.handler == 0 && act.flags == 0 {
            continue;
        }
        // SAFETY: rt_sigaction reads a kernel sigaction; handler addresses
        // point into the restored template memory.
        unsafe { sys!(nr::RT_SIGACTION, sig, act as *const KernelSigaction, 0, 8) };
    }
}

fn restore_thread_state() {
    let h = header();
    // SAFETY: ARCH_SET_FS (0x1002) sets our fs base; the restorer itself
    // never uses fs-relative addressing (no TLS in a no_std static binary).
    let r = unsafe { sys!(nr::ARCH_PRCTL, 0x1002, h.fs_base) };
    if r < 0 {
        die(EXIT_THREAD_STATE, "ARCH_SET_FS", h.fs_base, r);
    }
    if h.robust_head != 0 {
        // SAFETY: registers the template's robust list head (restored memory).
        let r = unsafe { sys!(nr::SET_ROBUST_LIST, h.robust_head, h.robust_len) };
        if r < 0 {
            die(EXIT_THREAD_STATE, "set_robust_list", h.robust_head, r);
        }
    }
    if h.tid_address != 0 && clone_index() != 0 {
        // A further clone is a fork of the first and has its own TID. The
        // TID address is glibc's cached TID in the thread control block
        // (`set_tid_address(&pd->tid)`): fork() has the kernel write the new
        // TID there (CLONE_CHILD_SETTID), so do the same. The page is in
        // restored memory: this write faults it in through the handler.
        // SAFETY: gettid takes no arguments; tid_address is the template's
        // 4-byte pd->tid, mapped by `map_regions`.
        unsafe {
            let tid = sys!(nr::GETTID);
            core::ptr::write_volatile(h.tid_address as *mut i32, tid as i32);
        }
    }
    if h.tid_address != 0 {
        // SAFETY: the kernel clears/wakes this address at exit, as in the template.
        unsafe { sys!(nr::SET_TID_ADDRESS, h.tid_address) };
    }
    if h.rseq_addr != 0 {
        // SAFETY: registers the template's rseq area (in restored memory,
        // faults on it are served by the handler).
        let mut r = unsafe { sys!(nr::RSEQ, h.rseq_addr, h.rseq_len, 0, h.rseq_sig) };
        if r == -22 && h.rseq_len != 32 {
            // SAFETY: as above, with the original ABI size.
            r = unsafe { sys!(nr::RSEQ, h.rseq_addr, 32, 0, h.rseq_sig) };
        }
        if r < 0 {
            die(EXIT_THREAD_STATE, "rseq", h.rseq_addr, r);
        }
    }
}

fn drop_credentials() {
    let h = header();
    if h.uid == 0 && h.gid == 0 {
        return;
    }
    // SAFETY: credential syscalls with integer/NULL arguments.
    unsafe {
        sys!(nr::SETGROUPS, 0, 0);
        let r = sys!(nr::SETRESGID, h.gid, h.gid, h.gid);
        if r < 0 {
            die(EXIT_THREAD_STATE, "setresgid", h.gid, r);
        }
        let r = sys!(nr::SETRESUID, h.uid, h.uid, h.uid);
        if r < 0 {
            die(EXIT_THREAD_STATE, "setresuid", h.uid, r);
        }
    }
}

// ---------------------------------------------------------------------------

extern "C" fn restorer_main() -> ! {
    let len = read_plan();
    validate_plan(len);
    let h = header();
    if h.flags & PLAN_FLAG_NEW_PIDNS != 0 {
        enter_pid_namespace(h.template_pid, h.clone_count);
    }
    // From here on we are the process that becomes the clone.
    let max_fd = fds().iter().map(|f| f.fd).max().unwrap_or(2) as i32;
    let keep_above = (max_fd + 1).max(10);
    let handler_sock = move_fd_above(HANDLER_SOCK, keep_above);
    fix_own_mappings();
    map_regions();
    let uffd = register_regions();
    if uffd >= 0 {
        send_fd(handler_sock, uffd as i32, my_clone_id());
        // SAFETY: the handler holds its own reference to the userfaultfd.
        unsafe { sys!(nr::CLOSE, uffd) };
    }
    restore_fds(keep_above);
    // SAFETY: close_range of everything above the template's fds (including
    // the handler socket, no longer needed).
    unsafe { sys!(nr::CLOSE_RANGE, max_fd + 1, u32::MAX, 0) };
    restore_process_state();
    restore_signals();
    restore_thread_state();
    drop_credentials();
    // SAFETY: sets the template's signal mask (8-byte kernel sigset).
    unsafe { sys!(nr::RT_SIGPROCMASK, 2 /* SIG_SETMASK */, &h.sigmask as *const u64, 0, 8) };
    // SAFETY: the context comes from the template's resume point; all memory
    // it refers to has been mapped (and is fetched on demand).
    unsafe { starling_restorer_jump(&h.resume, my_clone_id() as u32) }
}
