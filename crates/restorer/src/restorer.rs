//! starling's restorer: a static, no-libc program that turns itself into a
//! process described by a restore plan — a clone of a remote-fork template,
//! or a migrated process with all its threads.
//!
//! It is compiled by `build.rs` straight with `rustc` (`panic=abort`, linked
//! `-static -nostartfiles -no-pie` at `abi::RESTORER_BASE`) because a
//! `no_std` binary needs `panic=abort`, which a workspace profile cannot set
//! per package on stable Rust. The plan's records are the process image's
//! `repr(C)` layer (`crates/image/src/abi`), compiled into this binary.
//!
//! Inputs (`abi::restorer`): the plan on `PLAN_FD`, read to EOF; a
//! seqpacket socket to the fault handler on `HANDLER_FD`; the process's
//! stdio on 0-2.
//!
//! Steps: (1) block every signal; optionally a PID namespace: unshare, an
//! init with PID 1 (which mounts a `/proc` of that namespace in a mount
//! namespace of its own), and the process with `set_tid` = its PID (PID 1 forks
//! several for a hierarchical clone ticket; for a process tree — one plan
//! per process — each restored process first forks its children with their
//! PIDs, which then restore themselves from their own plans, starting the
//! sessions and process groups they led and joining the others'); (2) move off the kernel-made
//! stack onto a static one, unmap it, move vDSO/vvar to the image's
//! addresses; (3) map every region at its exact address; (4) create a
//! userfaultfd, register the regions with data to fetch, pass it to the
//! handler; (5) restore fds, cwd, umask, rlimits, the memory layout `/proc`
//! shows (`PR_SET_MM_MAP`: arg/env areas, brk, auxv, and the exe link, once
//! the image no longer maps our own executable), sigactions; (6) create the
//! other threads with `clone3` `set_tid` = their TIDs; every thread restores
//! its own name, fs/gs base, robust list, clear-tid address, rseq and credentials
//! and queues its pending signals, then waits at a barrier while the leader
//! arms the interval timers and re-creates the POSIX timers with their IDs; (7) each thread resumes with `rt_sigreturn` on
//! a frame holding its registers, FPU state, signal mask and altstack.
//!
//! Failures before the process resumes exit with an `abi::restorer::RestorerExit` code.

#![no_std]
#![no_main]

#[path = "../../image/src/abi/mod.rs"]
#[allow(dead_code)]
mod abi;

use abi::plan::*;
use abi::regs::{GpRegs, FP_XSTATE_MAGIC1, FPX_SW_BYTES_OFFSET, FXSAVE_BYTES, USER_CS, USER_SS};
use abi::restorer::{Record, RecordTag, RestorerExit, HANDLER_FD, JOIN_FD, PLAN_FD, RECORD_SIZE};
use abi::signal::{SigInfo, Sigaction};
use abi::PAGE_SIZE as PAGE;
use core::arch::{asm, global_asm};
use core::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

// ---------------------------------------------------------------------------
// raw system calls

mod nr {
    pub const READ: usize = 0;
    pub const WRITE: usize = 1;
    pub const OPEN: usize = 2;
    pub const CLOSE: usize = 3;
    pub const LSEEK: usize = 8;
    pub const SOCKET: usize = 41;
    pub const CONNECT: usize = 42;
    pub const MMAP: usize = 9;
    pub const MPROTECT: usize = 10;
    pub const MUNMAP: usize = 11;
    pub const RT_SIGACTION: usize = 13;
    pub const RT_SIGPROCMASK: usize = 14;
    pub const RT_SIGRETURN: usize = 15;
    pub const IOCTL: usize = 16;
    pub const MREMAP: usize = 25;
    pub const DUP2: usize = 33;
    pub const NANOSLEEP: usize = 35;
    pub const SETITIMER: usize = 38;
    pub const GETPID: usize = 39;
    pub const KILL: usize = 62;
    pub const SENDMSG: usize = 46;
    pub const EXIT: usize = 60;
    pub const WAIT4: usize = 61;
    pub const FCNTL: usize = 72;
    pub const CHDIR: usize = 80;
    pub const UMASK: usize = 95;
    pub const SETPGID: usize = 109;
    pub const DUP3: usize = 292;
    pub const SETSID: usize = 112;
    pub const GETSID: usize = 124;
    pub const SETGROUPS: usize = 116;
    pub const SETRESUID: usize = 117;
    pub const SETRESGID: usize = 119;
    pub const CAPSET: usize = 126;
    pub const RT_SIGTIMEDWAIT: usize = 128;
    pub const RT_SIGQUEUEINFO: usize = 129;
    pub const PRCTL: usize = 157;
    pub const MOUNT: usize = 165;
    pub const SECCOMP: usize = 317;
    pub const ARCH_PRCTL: usize = 158;
    pub const GETTID: usize = 186;
    pub const FUTEX: usize = 202;
    pub const SET_TID_ADDRESS: usize = 218;
    pub const TIMER_CREATE: usize = 222;
    pub const TIMER_SETTIME: usize = 223;
    pub const TIMER_DELETE: usize = 226;
    pub const EXIT_GROUP: usize = 231;
    pub const UNSHARE: usize = 272;
    pub const SET_ROBUST_LIST: usize = 273;
    pub const PIPE2: usize = 293;
    pub const RT_TGSIGQUEUEINFO: usize = 297;
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

/// Print "starling-restorer: <what> 0x<value> (errno <e>)" on stderr and exit
/// the whole thread group with `code`.
fn die(code: RestorerExit, what: &str, value: u64, err: isize) -> ! {
    write_all(2, b"starling-restorer: ");
    write_all(2, what.as_bytes());
    write_all(2, b" 0x");
    write_num(2, value, true);
    write_all(2, b" (errno ");
    write_num(2, (-err) as u64, false);
    write_all(2, b")\n");
    exit_group(code as i32)
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
    die(RestorerExit::BadPlan, "internal panic", 0, 0)
}

// ---------------------------------------------------------------------------
// static storage: the restorer never allocates

const STACK_BYTES: usize = 256 * 1024;
/// Stack of each further thread while it restores itself.
const THREAD_STACK_BYTES: usize = 16 * 1024;

#[repr(C, align(4096))]
struct Aligned<const N: usize>([u8; N]);

/// The leader's stack, inside our image, so that the kernel-made stack
/// (placed at a random address that may collide with the image's) can be
/// unmapped.
static mut STACK: Aligned<STACK_BYTES> = Aligned([0; STACK_BYTES]);
/// One stack per further thread (untouched ones cost no memory).
static mut THREAD_STACKS: Aligned<{ THREAD_STACK_BYTES * MAX_THREADS as usize }> =
    Aligned([0; THREAD_STACK_BYTES * MAX_THREADS as usize]);
/// The plan, read from `PLAN_FD`.
static mut PLAN: Aligned<PLAN_MAX_BYTES> = Aligned([0; PLAN_MAX_BYTES]);
/// Our /proc/self/maps.
static mut MAPS: Aligned<65536> = Aligned([0; 65536]);
/// Parking lot for the host vDSO/vvar while they move to the image's
/// addresses (mremap onto it replaces these pages; they are never touched).
static mut PARKING: Aligned<{ 16 * 4096 }> = Aligned([0; 16 * 4096]);
/// Path buffer for NUL-terminating plan strings (leader only).
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

// `clone3(args, size)` for a thread: in the child (rax = 0, on the stack the
// args name) call `entry(arg)`, which never returns. r8/r9 carry entry and
// arg across the syscall (only rcx and r11 are clobbered; the child starts
// with the parent's other registers).
global_asm!(
    ".globl starling_restorer_clone_thread",
    "starling_restorer_clone_thread:",
    "mov r8, rdx",
    "mov r9, rcx",
    "mov eax, {clone3}",
    "syscall",
    "test rax, rax",
    "jnz 1f",
    "xor ebp, ebp",
    "and rsp, -16",
    "mov rdi, r9",
    "call r8",
    "ud2",
    "1:",
    "ret",
    clone3 = const nr::CLONE3,
);

// Resume: make rsp point at the frame's `uc` (where `rt_sigreturn` expects
// it: the return address slot of a signal handler has been popped) and
// return from the "signal".
global_asm!(
    ".globl starling_restorer_sigreturn",
    "starling_restorer_sigreturn:",
    "mov rsp, rdi",
    "mov eax, {sigreturn}",
    "syscall",
    "ud2",
    sigreturn = const nr::RT_SIGRETURN,
);

extern "C" {
    fn starling_restorer_clone_thread(args: *const CloneArgs, size: usize, entry: extern "C" fn(u64) -> !, arg: u64) -> isize;
    fn starling_restorer_sigreturn(uc: *const Ucontext) -> !;
}

// ---------------------------------------------------------------------------
// the plan

/// The whole buffer the plan was read into.
fn plan_buffer() -> &'static [u8] {
    // SAFETY: PLAN is only written by `read_plan`, before any reader exists
    // and before any other thread.
    unsafe { &(*core::ptr::addr_of!(PLAN)).0 }
}

/// Where each plan of a process tree starts in the buffer (one entry for a
/// single process), and how many there are: set by `validate_plan`.
static TREE: [AtomicU64; MAX_TREE_PLANS] = [const { AtomicU64::new(0) }; MAX_TREE_PLANS];
static TREE_LEN: AtomicUsize = AtomicUsize::new(0);
/// The offset of this process's own plan (set in each process of a tree
/// right after the fork that made it).
static PLAN_BASE: AtomicUsize = AtomicUsize::new(0);

/// This process's plan.
fn plan_bytes() -> &'static [u8] {
    &plan_buffer()[PLAN_BASE.load(Ordering::Relaxed)..]
}

fn read_plan() -> usize {
    let mut got = 0usize;
    loop {
        if got == PLAN_MAX_BYTES {
            die(RestorerExit::BadPlan, "plan too large, limit", PLAN_MAX_BYTES as u64, 0);
        }
        // SAFETY: writes at most PLAN_MAX_BYTES - got bytes into our static buffer.
        let n = unsafe {
            let base = core::ptr::addr_of_mut!(PLAN) as *mut u8;
            sys!(nr::READ, PLAN_FD, base.add(got), PLAN_MAX_BYTES - got)
        };
        if n < 0 {
            if n == -4 {
                continue;
            }
            die(RestorerExit::BadPlan, "read plan fd", PLAN_FD as u64, n);
        }
        if n == 0 {
            break;
        }
        got += n as usize;
    }
    // SAFETY: close takes an integer.
    unsafe { sys!(nr::CLOSE, PLAN_FD) };
    got
}

fn header() -> &'static PlanHeader {
    // SAFETY: validated by `validate_plan` (size; the static buffer is page aligned).
    unsafe { &*(plan_bytes().as_ptr() as *const PlanHeader) }
}

/// A table of `count` records of type T at `off`, checked by `validate_plan`.
fn table<T>(off: u64, count: u64) -> &'static [T] {
    // SAFETY: bounds and alignment checked in `validate_plan`; T is a plan
    // record made of u64s, valid for any bytes.
    unsafe { core::slice::from_raw_parts(plan_bytes().as_ptr().add(off as usize) as *const T, count as usize) }
}

fn threads() -> &'static [PlanThread] {
    table(header().threads_off, header().n_threads)
}

fn regions() -> &'static [PlanRegion] {
    table(header().regions_off, header().n_regions)
}

fn fds() -> &'static [PlanFd] {
    table(header().fds_off, header().n_fds)
}

fn pipes() -> &'static [PlanPipe] {
    table(header().pipes_off, header().n_pipes)
}

fn signals() -> &'static [PlanSignal] {
    table(header().signals_off, header().n_signals)
}

/// The bytes a blob reference names (checked by `validate_plan`).
fn blob(r: BlobRef) -> &'static [u8] {
    let start = (header().blob_off + r.off) as usize;
    &plan_bytes()[start..start + r.len as usize]
}

fn blob_ok(r: BlobRef) -> bool {
    r.off.checked_add(r.len).is_some_and(|e| e <= header().blob_len)
}

fn validate_plan(len: usize) {
    let mut offsets = [0u64; MAX_TREE_PLANS];
    match abi::plan::validate_tree(&plan_buffer()[..len], &mut offsets) {
        Ok(n) => {
            for (slot, &off) in TREE.iter().zip(&offsets[..n]) {
                slot.store(off, Ordering::Relaxed);
            }
            TREE_LEN.store(n, Ordering::Relaxed);
        }
        Err(e) => die(RestorerExit::BadPlan, e.what, e.value, 0),
    }
}

/// A process tree's pipes (root only, before any fork): each made with
/// its capacity and its unread bytes, its ends at `pipe_fd_base + 2i` and
/// `+ 1`, where every process of the tree finds them.
fn create_tree_pipes() {
    const F_SETFL: usize = 4;
    const F_SETPIPE_SZ: usize = 1031;
    const O_NONBLOCK: usize = 0o4000;
    let base = header().pipe_fd_base as usize;
    for (i, p) in pipes().iter().enumerate() {
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 writes two ints into `fds`; nonblocking while it is
        // filled (a short write fails instead of blocking for ever).
        let r = unsafe { sys!(nr::PIPE2, fds.as_mut_ptr(), O_NONBLOCK) };
        if r < 0 {
            die(RestorerExit::Fd, "pipe2 for tree pipe", i as u64, r);
        }
        if p.capacity > 0 {
            // SAFETY: fcntl on our own pipe; as root the size may exceed pipe-max-size.
            let r = unsafe { sys!(nr::FCNTL, fds[1], F_SETPIPE_SZ, p.capacity) };
            if r < 0 {
                die(RestorerExit::Fd, "F_SETPIPE_SZ of tree pipe", i as u64, r);
            }
        }
        let data = blob(p.data);
        if !data.is_empty() {
            // SAFETY: writes the plan's bytes into our own pipe.
            let w = unsafe { sys!(nr::WRITE, fds[1], data.as_ptr(), data.len()) };
            if w != data.len() as isize {
                die(RestorerExit::Fd, "refill tree pipe", i as u64, w.min(0));
            }
        }
        for (end, &fd) in fds.iter().enumerate() {
            let at = base + 2 * i + end;
            // SAFETY: fcntl/dup3/close on our own descriptors; `at` is above
            // every fd of the tree's processes (checked by the plan's validation).
            unsafe {
                sys!(nr::FCNTL, fd, F_SETFL, 0);
                let r = sys!(nr::DUP3, fd, at, 0);
                if r < 0 {
                    die(RestorerExit::Fd, "place tree pipe end", at as u64, r);
                }
                sys!(nr::CLOSE, fd);
            }
        }
    }
}

/// A process tree: fork this process's children (the plans naming it as
/// their parent) with their PIDs; each child then forks its own. This runs
/// before anything process-specific is restored, so every process then
/// restores itself from its own plan (memory, fds, threads), and each
/// parent's `wait` reaps its children as before the move. Sessions are
/// only inherited: a process that leads one forks the children that stay
/// in the session it was forked in (`PLAN_FLAG_BEFORE_PARENT_SETSID`),
/// starts its own ([`start_session`]), then forks the rest.
fn fork_descendants() {
    let n = TREE_LEN.load(Ordering::Relaxed);
    let mut me = 0u64;
    'process: loop {
        for early in [true, false] {
            if !early {
                start_session();
            }
            for next in 1..n {
                let off = TREE[next].load(Ordering::Relaxed) as usize;
                // SAFETY: `validate_tree` checked a whole header at every offset it
                // returned; the buffer is page aligned and every offset 64-aligned.
                let h = unsafe { &*(plan_buffer().as_ptr().add(off) as *const PlanHeader) };
                if h.parent != me || (h.flags & PLAN_FLAG_BEFORE_PARENT_SETSID != 0) != early {
                    continue;
                }
                let child = fork_process(Some(h.process.pid));
                if child < 0 {
                    die(RestorerExit::PidNamespace, "clone3 set_tid child pid", h.process.pid, child);
                }
                if child == 0 {
                    PLAN_BASE.store(off, Ordering::Relaxed);
                    me = next as u64;
                    continue 'process;
                }
            }
        }
        return;
    }
}

/// A process that leads its session starts it, and takes the terminal as
/// its controlling one if it had it (`PLAN_FLAG_TERMINAL`): then its
/// process group is the terminal's foreground one, and the children it
/// forks next have the terminal too.
fn start_session() {
    const TIOCSCTTY: usize = 0x540E;
    let h = header();
    if h.process.sid != h.process.pid || h.process.sid == 0 {
        return;
    }
    // SAFETY: setsid/getsid/getpid take no pointers. setsid fails only for a
    // group leader: a process restored without a PID namespace is the
    // sandbox's task, which already leads its session.
    unsafe {
        let r = sys!(nr::SETSID);
        if r < 0 && sys!(nr::GETSID, 0) != sys!(nr::GETPID) {
            die(RestorerExit::PidNamespace, "setsid", h.process.pid, r);
        }
    }
    if h.flags & PLAN_FLAG_TERMINAL != 0 {
        // The new pty's slave the sandbox left on fd 0: no session holds it,
        // so nothing is stolen.
        // SAFETY: TIOCSCTTY takes an int by value (0: do not steal).
        let r = unsafe { sys!(nr::IOCTL, 0, TIOCSCTTY, 0) };
        if r < 0 {
            die(RestorerExit::Fd, "TIOCSCTTY on fd", 0, r);
        }
    }
}

/// How long a process waits for another process of its tree to start the
/// group it joins (1 ms a try): that one does so right after its forks.
const GROUP_WAIT_TRIES: u32 = 60_000;

/// Once every process of the tree is forked: a process leading its group
/// (not its session: `setsid` made that) starts it, one in a group another
/// process of the tree leads joins it as soon as it exists. Children forked
/// before got the group their parent was forked in, as sessions go.
fn take_group() {
    const EPERM: isize = -1;
    let p = &header().process;
    if p.pgid == 0 || p.sid == p.pid {
        return;
    }
    let own = p.pgid == p.pid;
    for _ in 0..GROUP_WAIT_TRIES {
        // SAFETY: setpgid with integer arguments, for ourselves.
        let r = unsafe { sys!(nr::SETPGID, 0, if own { 0 } else { p.pgid }) };
        if r == 0 {
            if header().flags & PLAN_FLAG_TERMINAL_FOREGROUND != 0 {
                take_foreground(p.pgid);
            }
            return;
        }
        // EPERM: no such group in our session yet.
        if r != EPERM || own {
            die(RestorerExit::PidNamespace, "setpgid", p.pgid, r);
        }
        let wait = [0u64, 1_000_000]; // struct timespec: 1 ms
        // SAFETY: nanosleep reads a timespec on our stack; no remainder asked for.
        unsafe { sys!(nr::NANOSLEEP, wait.as_ptr(), 0) };
    }
    die(RestorerExit::PidNamespace, "process group never started", p.pgid, 0)
}

/// Make our group the foreground one of the terminal we inherited on fd 0
/// from the session's leader (who took it as its controlling terminal
/// before forking us). Every signal is blocked, so the kernel lets a
/// background group do this without SIGTTOU.
fn take_foreground(pgid: u64) {
    const TIOCSPGRP: usize = 0x5410;
    let group = pgid as i32;
    // SAFETY: TIOCSPGRP reads a pid_t on our stack.
    let r = unsafe { sys!(nr::IOCTL, 0, TIOCSPGRP, &group as *const i32) };
    if r < 0 {
        die(RestorerExit::Fd, "TIOCSPGRP (the terminal's foreground group)", pgid, r);
    }
}

/// A plan string copied into PATHBUF with a terminating NUL (leader only,
/// before any other thread exists).
fn cstr(r: BlobRef) -> *const u8 {
    if r.len >= 4095 {
        die(RestorerExit::BadPlan, "string too long", r.off, 0);
    }
    let src = blob(r);
    // SAFETY: single-threaded here; PATHBUF is only used through this
    // function and each result is consumed before the next call.
    unsafe {
        let dst = core::ptr::addr_of_mut!(PATHBUF) as *mut u8;
        core::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
        *dst.add(src.len()) = 0;
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

/// A raw wait status as an exit code (128+sig for a signal).
fn exit_code(status: i32) -> i32 {
    let sig = status & 0x7f;
    if sig == 0 { (status >> 8) & 0xff } else { 128 + sig }
}

/// Signals passed on towards the restored process (the sandbox's own
/// relayed set: HUP INT QUIT USR1 USR2 ALRM TERM CONT WINCH).
const RELAYED: u64 = bit(1) | bit(2) | bit(3) | bit(10) | bit(12) | bit(14) | bit(15) | bit(18) | bit(28);
const SIGCHLD: u64 = 17;

const fn bit(sig: u64) -> u64 {
    1 << (sig - 1)
}

/// Wait for the next relayed signal or SIGCHLD (all are blocked):
/// its number, or 0 if interrupted.
fn next_signal() -> u64 {
    let set = RELAYED | bit(SIGCHLD);
    let mut info = [0u64; 16];
    // SAFETY: rt_sigtimedwait reads an 8-byte set and writes a 128-byte siginfo.
    let r = unsafe { sys!(nr::RT_SIGTIMEDWAIT, &set as *const u64, info.as_mut_ptr(), 0, 8) };
    if r > 0 { r as u64 } else { 0 }
}

/// Reap one ended child without blocking: (pid, raw status).
fn reap_nohang() -> Option<(isize, i32)> {
    let mut status: i32 = 0;
    // SAFETY: status is a live i32; WNOHANG (1) never blocks.
    let r = unsafe { sys!(nr::WAIT4, -1isize, &mut status as *mut i32, 1, 0) };
    (r > 0).then_some((r, status))
}

/// The original process, once it started the PID namespace's init: pass
/// the signals it gets on to `child` (the sandbox relays the user's
/// Ctrl-C and SIGTERM to it), and exit with `child`'s code when it ends.
fn relay_until_exit(child: isize) -> ! {
    loop {
        let sig = next_signal();
        if sig != SIGCHLD && sig != 0 {
            // SAFETY: kill with integer arguments, to our own child.
            unsafe { sys!(nr::KILL, child, sig) };
            continue;
        }
        while let Some((pid, status)) = reap_nohang() {
            if pid == child {
                exit_group(exit_code(status));
            }
        }
        if sig == 0 && reap_one_blocking_none() {
            exit_group(RestorerExit::PidNamespace as i32);
        }
    }
}

/// True when there is no child left at all.
fn reap_one_blocking_none() -> bool {
    // SAFETY: wait4 with WNOHANG on any child; ECHILD (-10) means none.
    unsafe { sys!(nr::WAIT4, -1isize, 0, 1, 0) == -10 }
}

/// Which of the plan's processes this one is (0: the first, with the
/// image's PID). Set in each right after the fork that made it.
static CLONE_INDEX: AtomicU64 = AtomicU64::new(0);

fn clone_index() -> u64 {
    CLONE_INDEX.load(Ordering::Relaxed)
}

/// The clone ID of this process (the plan's `clone_id` + its index).
fn my_clone_id() -> u64 {
    header().clone_id + clone_index()
}

/// Send one record over the handler socket, with `fd` attached
/// (SCM_RIGHTS) when given. Returns sendmsg's result.
fn send_record(sock: i32, rec: Record, fd: Option<i32>) -> isize {
    let iov = Iovec { base: &rec as *const Record as u64, len: RECORD_SIZE as u64 };
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

/// Tell the handler that a process ended (best effort: the handler may
/// already be gone when the whole task is being killed).
fn send_exit(sock: i32, clone_id: u64, status: i32) {
    send_record(sock, Record { tag: RecordTag::Exited as u64, clone_id, value: status as u32 as u64 }, None);
}

/// Become PID 1 of a new PID namespace and start the plan's processes in
/// it: the first with the image's PID (so glibc's cached TID is right), the
/// others with the next free PIDs — each a fork of this process, which has
/// done nothing process-specific yet, so every one then restores itself
/// from the same plan (a host restores once per ticket; no page is fetched
/// twice for the forks because nothing has been fetched yet). PID 1 reaps
/// them, reports each one's status on the handler socket, and exits with
/// the first one's code once all have ended.
fn enter_pid_namespace(pid: u64, count: u64) {
    const CLONE_NEWPID: usize = 0x2000_0000;
    // SAFETY: unshare takes flags only; it affects our future children.
    let r = unsafe { sys!(nr::UNSHARE, CLONE_NEWPID) };
    if r < 0 {
        die(RestorerExit::PidNamespace, "unshare(CLONE_NEWPID)", 0, r);
    }
    // A pipe only the original process writes to (never, in fact): PID 1
    // reads EOF from it once the original is gone. See below.
    let mut original_alive = [0i32; 2];
    const O_NONBLOCK: usize = 0o4000;
    const O_CLOEXEC: usize = 0o2_000_000;
    // SAFETY: pipe2 writes two fds into the live local array.
    let r = unsafe { sys!(nr::PIPE2, original_alive.as_mut_ptr(), O_NONBLOCK | O_CLOEXEC) };
    if r < 0 {
        die(RestorerExit::PidNamespace, "pipe2", 0, r);
    }
    let init = fork_process(Some(1));
    if init < 0 {
        die(RestorerExit::PidNamespace, "clone3 init set_tid", 1, init);
    }
    if init > 0 {
        // The original process: relay signals in, and the namespace's result out.
        // SAFETY: closes our copy of the read end; the write end stays open for our life.
        unsafe { sys!(nr::CLOSE, original_alive[0]) };
        relay_until_exit(init);
    }
    // PID 1 of the new namespace. Die with our parent (the launcher kills
    // the original process to kill the clone).
    // SAFETY: closes the copy of the write end this fork inherited; prctl with integer arguments.
    unsafe {
        sys!(nr::CLOSE, original_alive[1]);
        sys!(nr::PRCTL, 1 /* PR_SET_PDEATHSIG */, 9);
    }
    // A parent killed between the fork and the prctl sends no death signal,
    // and this namespace would live on without it, holding the fault
    // handler's socket (a local kill then waited forever): EOF here means
    // the original is already gone (EAGAIN: it is alive, and the death
    // signal now covers it).
    let mut byte = 0u8;
    // SAFETY: a one-byte read into a live local; then closes the read end.
    let gone = unsafe {
        let n = sys!(nr::READ, original_alive[0], &mut byte as *mut u8, 1);
        sys!(nr::CLOSE, original_alive[0]);
        n == 0
    };
    if gone {
        exit_group(RestorerExit::PidNamespace as i32);
    }
    mount_own_proc();
    let first = header().clone_id;
    let mut pids = [0isize; MAX_CLONES_PER_RESTORE as usize];
    let mut running = 0u64;
    for i in 0..count {
        let child = fork_process(if i == 0 { Some(pid) } else { None });
        if child == 0 {
            CLONE_INDEX.store(i, Ordering::Relaxed);
            // SAFETY: prctl with integer arguments.
            unsafe { sys!(nr::PRCTL, 1, 9) };
            return;
        }
        if child < 0 {
            if i == 0 {
                die(RestorerExit::PidNamespace, "clone3 set_tid pid", pid, child);
            }
            // This one never ran: report it as having exited with the
            // restorer's PID-namespace failure code.
            send_exit(HANDLER_FD, first + i, (RestorerExit::PidNamespace as i32) << 8);
            continue;
        }
        pids[i as usize] = child;
        running += 1;
    }
    let mut first_code = RestorerExit::PidNamespace as i32;
    while running > 0 {
        let sig = next_signal();
        if sig != SIGCHLD && sig != 0 {
            for &p in pids[..count as usize].iter().filter(|&&p| p > 0) {
                // SAFETY: kill with integer arguments, to our own child.
                unsafe { sys!(nr::KILL, p, sig) };
            }
            continue;
        }
        // Orphans re-parented to us are reaped too.
        while let Some((child, status)) = reap_nohang() {
            if let Some(i) = pids[..count as usize].iter().position(|&p| p == child) {
                send_exit(HANDLER_FD, first + i as u64, status);
                if i == 0 {
                    first_code = exit_code(status);
                }
                pids[i] = 0;
                running -= 1;
            }
        }
        if sig == 0 && reap_one_blocking_none() {
            break;
        }
    }
    exit_group(first_code)
}

/// In a mount namespace of our own, a `/proc` of the new PID namespace over
/// the sandbox's. The sandbox's `/proc` numbers processes as its own
/// namespace does, in which the restored ones have other IDs than they see
/// for themselves: `/proc/<getpid()>` and `/proc/self/task/<tid>` (glibc's
/// `pthread_getname_np`, tools reading their own threads) named another
/// process or thread, or none. Called by PID 1 before it forks the
/// processes, which inherit the namespace. Best effort: where it is not
/// allowed (an agent without root whose sandbox hides parts of `/proc`)
/// everything else is restored as before.
fn mount_own_proc() {
    const CLONE_NEWNS: usize = 0x0002_0000;
    const MS_NOSUID: usize = 2;
    const MS_NODEV: usize = 4;
    const MS_NOEXEC: usize = 8;
    const MS_PRIVATE: usize = 1 << 18;
    let proc_dir = b"/proc\0";
    // SAFETY: unshare takes flags only; it gives this process (and the
    // processes it forks next) a copy of the sandbox's mount namespace.
    if unsafe { sys!(nr::UNSHARE, CLONE_NEWNS) } < 0 {
        return;
    }
    // SAFETY: mount with NUL-terminated static strings and no data. Making
    // our copy of /proc private first keeps the new mount from propagating
    // back into the sandbox's namespace (or further) if /proc was shared.
    unsafe {
        if sys!(nr::MOUNT, 0, proc_dir.as_ptr(), 0, MS_PRIVATE, 0) < 0 {
            return;
        }
        sys!(nr::MOUNT, b"proc\0".as_ptr(), proc_dir.as_ptr(), b"proc\0".as_ptr(), MS_NOSUID | MS_NODEV | MS_NOEXEC, 0);
    }
}

// ---------------------------------------------------------------------------
// step 2: our own mappings

struct MapsLine<'a> {
    start: u64,
    end: u64,
    /// PROT_* bits of its "rwxp" field.
    prot: u64,
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
        die(RestorerExit::Vdso, "open /proc/self/maps", 0, fd);
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
            die(RestorerExit::Vdso, "own maps too large", len as u64, 0);
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
        let perms = &line[(sp + 1).min(line.len())..];
        let prot = [b'r', b'w', b'x'].iter().enumerate().fold(0, |p, (bit, &c)| if perms.get(bit) == Some(&c) { p | 1 << bit } else { p });
        f(&MapsLine { start, end, prot, name });
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
        let slot = match r.map_kind() {
            Some(MapKind::Vvar) => 0,
            Some(MapKind::VvarVclock) => 1,
            Some(MapKind::Vdso) => 2,
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
            die(RestorerExit::Vdso, "vdso/vvar larger than parking", len, 0);
        }
        let r = mremap_fixed(s, len, parking + park_off);
        if r < 0 {
            die(RestorerExit::Vdso, "park vdso/vvar", s, r);
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
            die(RestorerExit::Vdso, "vdso/vvar size differs from template's (different kernel?)", ts, 0);
        }
        let r = mremap_fixed(parked[i], e - s, ts);
        if r < 0 {
            die(RestorerExit::Vdso, "move vdso/vvar to template address", ts, r);
        }
    }
}

/// Replace each mapping of our own image that our executable backs with an
/// anonymous copy at the same address. The kernel changes a process's exe
/// link only while no mapping of the old executable is left
/// (`replace_mm_exe_file`: EBUSY), and the image cannot move, as we run
/// from it (CRIU's restorer blob is anonymous memory for the same reason).
/// The copy is made, given the mapping's protection, then `mremap`ed over
/// it in one step: the next instruction runs from identical bytes. Only
/// this thread exists, and nothing between the copy and the move writes
/// the image's file-backed data (the stack and the tables are bss, anonymous).
fn detach_own_image() {
    const MAP_PRIVATE_ANONYMOUS: u64 = 0x22;
    let (own_start, own_end) =
        (core::ptr::addr_of!(__executable_start) as u64 & !(PAGE - 1), (core::ptr::addr_of!(_end) as u64).next_multiple_of(PAGE));
    let mut backed = [(0u64, 0u64, 0u64); 8];
    let mut n = 0;
    for_each_own_mapping(|m| {
        if m.start >= own_start && m.end <= own_end && m.name.first().is_some_and(|&c| c != b'[') {
            if n == backed.len() {
                die(RestorerExit::Map, "too many file mappings of the restorer at", m.start, 0);
            }
            backed[n] = (m.start, m.end, m.prot);
            n += 1;
        }
    });
    for &(start, end, prot) in &backed[..n] {
        let len = end - start;
        // SAFETY: a fresh anonymous mapping wherever the kernel likes.
        let copy = unsafe { sys!(nr::MMAP, 0, len, 3 /* PROT_READ | PROT_WRITE */, MAP_PRIVATE_ANONYMOUS, -1isize, 0) };
        if copy < 0 {
            die(RestorerExit::Map, "anonymous copy of the restorer at", start, copy);
        }
        // SAFETY: both ranges are mapped (ours, readable; the copy, writable) and disjoint.
        unsafe { memcpy(copy as *mut u8, start as *const u8, len as usize) };
        // SAFETY: mprotect of the mapping we just made.
        let r = unsafe { sys!(nr::MPROTECT, copy, len, prot) };
        let r = if r < 0 { r } else { mremap_fixed(copy as u64, len, start) };
        if r < 0 {
            die(RestorerExit::Map, "replace the restorer's file mapping at", start, r);
        }
    }
}

// ---------------------------------------------------------------------------
// step 3/4: regions and userfaultfd

fn open_path(path: BlobRef, flags: u64) -> isize {
    let p = cstr(path);
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
            die(RestorerExit::BadPlan, "bad region", r.start, 0);
        }
        if r.start < own_end + PAGE && r.end + PAGE > own_start {
            die(RestorerExit::Collision, "region collides with the restorer image at", r.start, 0);
        }
        let len = r.end - r.start;
        let res = match r.map_kind() {
            Some(MapKind::Vvar | MapKind::VvarVclock | MapKind::Vdso) => continue,
            Some(kind @ (MapKind::FilePrivate | MapKind::FileShared)) => {
                let shared = kind == MapKind::FileShared;
                let writable = shared && (r.prot & 2) != 0;
                let fd = open_path(r.path, if writable { 2 } else { 0 });
                if fd < 0 {
                    die(RestorerExit::Map, "open file of region", r.start, fd);
                }
                let flags = if shared { MAP_SHARED } else { MAP_PRIVATE } | MAP_FIXED_NOREPLACE;
                // SAFETY: maps a file at an address no mapping of ours uses (NOREPLACE).
                let m = unsafe { sys!(nr::MMAP, r.start, len, r.prot, flags, fd, r.file_offset) };
                // SAFETY: closing the fd we opened; the mapping keeps the file.
                unsafe { sys!(nr::CLOSE, fd) };
                m
            }
            Some(MapKind::AnonRegister | MapKind::AnonPlain) => {
                let mut flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE;
                if r.flags & REGION_FLAG_GROWSDOWN != 0 {
                    flags |= MAP_GROWSDOWN;
                }
                // SAFETY: anonymous mapping at an address no mapping of ours uses (NOREPLACE).
                unsafe { sys!(nr::MMAP, r.start, len, r.prot, flags, -1isize, 0) }
            }
            None => die(RestorerExit::BadPlan, "unknown region kind", r.map, 0),
        };
        if res < 0 || res as u64 != r.start {
            die(RestorerExit::Map, "mmap region", r.start, res);
        }
    }
}

use abi::uffd::{
    UffdioApi, UffdioRange, UffdioRegister, UFFDIO_API, UFFDIO_REGISTER, UFFDIO_REGISTER_MODE_MISSING, UFFD_API,
    USERFAULTFD_IOC_NEW, UFFD_FEATURE_EVENT_REMAP, UFFD_FEATURE_EVENT_REMOVE, UFFD_FEATURE_EVENT_UNMAP,
};

/// Create the userfaultfd, register the regions that need filling, and
/// return the fd (or -1 if no region needs it).
fn register_regions() -> isize {
    let registered = || regions().iter().filter(|r| r.map_kind() == Some(MapKind::AnonRegister));
    if registered().next().is_none() {
        return -1;
    }
    const FLAGS: u64 = 0o2000000 | 0o4000; // O_CLOEXEC | O_NONBLOCK
    // SAFETY: userfaultfd takes flags only (kernel-mode faults must be
    // handled too, so no UFFD_USER_MODE_ONLY).
    let mut uffd = unsafe { sys!(nr::USERFAULTFD, FLAGS) };
    if uffd == -1 {
        // EPERM: no privilege for kernel-mode faults (an agent without root,
        // vm.unprivileged_userfaultfd = 0). The device grants the same to
        // whoever may open it (an admin's ACL); the sandbox shows it then.
        // SAFETY: open of a NUL-terminated literal path.
        let dev = unsafe { sys!(nr::OPEN, b"/dev/userfaultfd\0".as_ptr(), 0o2000002 /* O_RDWR | O_CLOEXEC */) };
        if dev >= 0 {
            // SAFETY: USERFAULTFD_IOC_NEW takes the flags as its argument.
            uffd = unsafe { sys!(nr::IOCTL, dev, USERFAULTFD_IOC_NEW, FLAGS) };
            // SAFETY: closing the device fd we opened.
            unsafe { sys!(nr::CLOSE, dev) };
        }
    }
    if uffd < 0 {
        die(RestorerExit::Userfaultfd, "userfaultfd", 0, uffd);
    }
    let mut api = UffdioApi {
        api: UFFD_API,
        features: UFFD_FEATURE_EVENT_REMAP | UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_EVENT_UNMAP,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes the struct we pass.
    let r = unsafe { sys!(nr::IOCTL, uffd, UFFDIO_API, &mut api as *mut UffdioApi) };
    if r < 0 {
        die(RestorerExit::Userfaultfd, "UFFDIO_API", api.features, r);
    }
    for reg in registered() {
        let mut rg = UffdioRegister {
            range: UffdioRange { start: reg.start, len: reg.end - reg.start },
            mode: UFFDIO_REGISTER_MODE_MISSING,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes the struct we pass.
        let r = unsafe { sys!(nr::IOCTL, uffd, UFFDIO_REGISTER, &mut rg as *mut UffdioRegister) };
        if r < 0 {
            die(RestorerExit::Userfaultfd, "UFFDIO_REGISTER", reg.start, r);
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

/// Send the process's userfaultfd (and its clone ID) to the handler.
fn send_uffd(sock: i32, fd: i32, id: u64) {
    let r = send_record(sock, Record { tag: RecordTag::Userfaultfd as u64, clone_id: id, value: 0 }, Some(fd));
    if r < 0 {
        die(RestorerExit::Userfaultfd, "send userfaultfd to handler", sock as u64, r);
    }
}

// ---------------------------------------------------------------------------
// step 5: process state

fn move_fd_above(fd: i32, min: i32) -> i32 {
    // SAFETY: F_DUPFD_CLOEXEC (1030) duplicates our own fd.
    let n = unsafe { sys!(nr::FCNTL, fd, 1030, min) };
    if n < 0 {
        die(RestorerExit::Fd, "move restorer fd", fd as u64, n);
    }
    // SAFETY: closing the old number, now duplicated.
    unsafe { sys!(nr::CLOSE, fd) };
    n as i32
}

fn restore_fds(keep_above: i32) {
    let mut next_free_check = 0u64;
    for f in fds() {
        if f.fd >= keep_above as u64 {
            die(RestorerExit::BadPlan, "fd number out of range", f.fd, 0);
        }
        // Close everything between the previous plan fd and this one.
        if f.fd > next_free_check {
            // SAFETY: close_range on fd numbers the process must not have.
            unsafe { sys!(nr::CLOSE_RANGE, next_free_check, f.fd - 1, 0) };
        }
        next_free_check = f.fd + 1;
        let target = f.fd as i32;
        let kind = f.restore_kind();
        let opened: isize = match kind {
            Some(FdRestore::Inherit) => continue,
            Some(FdRestore::Reopen) => {
                let p = cstr(f.path);
                // strip O_CREAT|O_EXCL|O_TRUNC (0o100|0o200|0o1000): the file exists, keep its data.
                let flags = f.open_flags & !(0o100 | 0o200 | 0o1000);
                // SAFETY: p is a NUL-terminated path in PATHBUF.
                unsafe { sys!(nr::OPEN, p, flags, 0) }
            }
            Some(FdRestore::PipeReadEof | FdRestore::PipeWriteEpipe) => {
                let mut p = [0i32; 2];
                // SAFETY: pipe2 writes two ints into p.
                let r = unsafe { sys!(nr::PIPE2, p.as_mut_ptr(), 0) };
                if r < 0 {
                    r
                } else {
                    let (keep, drop) = if kind == Some(FdRestore::PipeReadEof) { (p[0], p[1]) } else { (p[1], p[0]) };
                    // SAFETY: closing the end the placeholder must not have.
                    unsafe { sys!(nr::CLOSE, drop) };
                    keep as isize
                }
            }
            // The stream (stdout/stderr, fds below this one: restored
            // already) that this descriptor of the same file writes to.
            Some(FdRestore::Dup) => {
                if f.offset != 1 && f.offset != 2 {
                    die(RestorerExit::BadPlan, "dup of fd", f.offset, 0);
                }
                // SAFETY: dup2 of fd 1 or 2, which the restorer holds (or
                // EBADF), onto the image's fd number.
                unsafe { sys!(nr::DUP2, f.offset, target) }
            }
            // An end of a pipe of the tree, waiting at its number above every fd.
            Some(FdRestore::TreePipe) => {
                const F_SETFL: usize = 4;
                const O_WRONLY: u64 = 1;
                let at = header().pipe_fd_base + 2 * f.offset + (f.open_flags & O_WRONLY);
                // SAFETY: dup2 of the end the root made (inherited by fork)
                // onto the image's fd number, then its file status flags.
                unsafe {
                    let r = sys!(nr::DUP2, at, target);
                    if r >= 0 {
                        sys!(nr::FCNTL, target, F_SETFL, f.open_flags & 0o4000);
                    }
                    r
                }
            }
            Some(FdRestore::Connect) => connect_unix(&f),
            None => die(RestorerExit::BadPlan, "unknown fd kind", f.kind, 0),
        };
        if opened < 0 {
            die(RestorerExit::Fd, "reopen fd", f.fd, opened);
        }
        if opened as i32 != target {
            // SAFETY: dup2 onto the image's fd number, then drop the temporary.
            unsafe {
                let r = sys!(nr::DUP2, opened, target);
                if r < 0 {
                    die(RestorerExit::Fd, "dup2 fd", f.fd, r);
                }
                sys!(nr::CLOSE, opened);
            }
        }
        if kind == Some(FdRestore::Reopen) && f.offset != 0 {
            // SAFETY: lseek(SEEK_SET) on our fd.
            let r = unsafe { sys!(nr::LSEEK, target, f.offset, 0) };
            if r < 0 {
                die(RestorerExit::Fd, "lseek fd", f.fd, r);
            }
        }
    }
}

/// A Unix stream socket connected to the plan's path, which is told the
/// fd's hello (4 bytes, little-endian) first: a connection of a proxy of the
/// task's host (its X display) that the proxy re-attaches to the same stream.
fn connect_unix(f: &PlanFd) -> isize {
    const AF_UNIX: usize = 1;
    const SOCK_STREAM: usize = 1;
    const F_SETFL: usize = 4;
    let path = blob(f.path);
    // struct sockaddr_un: sa_family_t, then the path (validated: < 108 bytes).
    let mut addr = [0u8; 2 + SOCKET_PATH_MAX as usize];
    addr[0] = AF_UNIX as u8;
    addr[2..2 + path.len()].copy_from_slice(path);
    // SAFETY: socket(2) takes no pointers.
    let s = unsafe { sys!(nr::SOCKET, AF_UNIX, SOCK_STREAM, 0) };
    if s < 0 {
        return s;
    }
    // SAFETY: connect reads `2 + len + 1` bytes of the live local address.
    let r = unsafe { sys!(nr::CONNECT, s, addr.as_ptr(), 2 + path.len() + 1) };
    if r < 0 {
        return r;
    }
    let hello = (f.offset as u32).to_le_bytes();
    let mut sent = 0;
    while sent < hello.len() {
        // SAFETY: write reads the rest of the live local array.
        let n = unsafe { sys!(nr::WRITE, s, hello.as_ptr().add(sent), hello.len() - sent) };
        if n < 0 {
            return n;
        }
        sent += n as usize;
    }
    // SAFETY: fcntl(F_SETFL) on the socket we made.
    unsafe { sys!(nr::FCNTL, s, F_SETFL, f.open_flags & 0o4000) };
    s
}

fn restore_process_state() {
    let h = header();
    if h.cwd.len > 0 {
        let p = cstr(h.cwd);
        // SAFETY: p is NUL-terminated.
        let r = unsafe { sys!(nr::CHDIR, p) };
        if r < 0 {
            die(RestorerExit::ThreadState, "chdir", 0, r);
        }
    }
    let p = &h.process;
    // SAFETY: umask takes an integer.
    unsafe { sys!(nr::UMASK, p.umask & 0o777) };
    for (i, lim) in p.rlimits.iter().enumerate() {
        // Raising a hard limit needs CAP_SYS_RESOURCE: failures are tolerated.
        // SAFETY: prlimit64(0 = self) reads a struct rlimit64 (two u64s).
        unsafe { sys!(nr::PRLIMIT64, 0, i, lim as *const abi::process::Rlimit, 0) };
    }
    restore_mm();
    for (i, act) in h.sigactions.0.iter().enumerate() {
        let sig = i + 1;
        if sig == 9 || sig == 19 || act.handler == 0 && act.flags == 0 {
            continue;
        }
        // SAFETY: rt_sigaction reads a kernel sigaction; handler addresses
        // point into the restored memory.
        unsafe { sys!(nr::RT_SIGACTION, sig, act as *const Sigaction, 0, 8) };
    }
}

/// The process's memory layout as `/proc` shows it (code/data/brk, the
/// argument and environment areas behind `cmdline` and `environ`, the
/// saved auxv) and its exe link, in one `PR_SET_MM_MAP`.
fn restore_mm() {
    let h = header();
    let exe_fd = if h.exe.len > 0 {
        let fd = open_path(h.exe, 0);
        if fd < 0 {
            die(RestorerExit::ThreadState, "open the program's executable", 0, fd);
        }
        detach_own_image();
        fd as u64
    } else {
        u32::MAX as u64
    };
    let mm = &h.process.mm;
    let auxv = blob(h.auxv);
    let mut map = [0u64; 13];
    map[..11].copy_from_slice(&[mm.start_code, mm.end_code, mm.start_data, mm.end_data, mm.start_brk, mm.brk,
        mm.start_stack, mm.arg_start, mm.arg_end, mm.env_start, mm.env_end]);
    map[11] = if auxv.is_empty() { 0 } else { auxv.as_ptr() as u64 };
    map[12] = auxv.len() as u64 | exe_fd << 32; // u32 auxv_size, u32 exe_fd
    // SAFETY: PR_SET_MM(35) / PR_SET_MM_MAP(14) reads a struct prctl_mm_map of
    // 104 bytes and `auxv_size` bytes at `auxv` (in the plan).
    let r = unsafe { sys!(nr::PRCTL, 35, 14, map.as_ptr(), 104, 0) };
    if exe_fd != u32::MAX as u64 {
        // A moved process must not resume under the restorer's name: the
        // move fails before the switch and the process runs on at its source.
        if r < 0 {
            die(RestorerExit::ThreadState, "PR_SET_MM_MAP (memory layout and exe link)", exe_fd, r);
        }
        // SAFETY: closing the fd we opened; the mm holds the file now.
        unsafe { sys!(nr::CLOSE, exe_fd) };
    }
}

// ---------------------------------------------------------------------------
// step 6: threads

/// Further threads that finished restoring themselves (the leader waits
/// for all of them).
static READY: AtomicU32 = AtomicU32::new(0);
/// Set to 1 by the leader once every thread may resume.
static GO: AtomicU32 = AtomicU32::new(0);
/// Where the handler socket was moved to (above the image's fds).
static HANDLER_SOCK: core::sync::atomic::AtomicI32 = core::sync::atomic::AtomicI32::new(-1);

/// The `cgroup.procs` descriptors to join as the last step (`abi::restorer::JOIN_FD`),
/// moved above the image's fds; -1: none (or already joined).
static JOIN_FDS: [core::sync::atomic::AtomicI32; MAX_JOIN_GROUPS as usize] =
    [const { core::sync::atomic::AtomicI32::new(-1) }; MAX_JOIN_GROUPS as usize];

/// Move the plan's `join_groups` descriptors above `keep_above` (the image's
/// fds are restored below it); returns them, ascending, and -1s.
fn move_join_fds(keep_above: i32) -> [i32; MAX_JOIN_GROUPS as usize] {
    let mut out = [-1i32; MAX_JOIN_GROUPS as usize];
    for i in 0..header().join_groups as usize {
        let fd = move_fd_above(JOIN_FD + i as i32, keep_above);
        JOIN_FDS[i].store(fd, Ordering::Relaxed);
        out[i] = fd;
    }
    out
}

/// Close every descriptor from `from` on except those in `keep` (-1s ignored).
fn close_from_except(from: i32, keep: &[i32]) {
    let mut at = from;
    loop {
        // The lowest kept descriptor at or above `at`.
        let next = keep.iter().copied().filter(|&k| k >= at).min();
        let Some(k) = next else { break };
        if k > at {
            // SAFETY: close_range on descriptor numbers the process must not have.
            unsafe { sys!(nr::CLOSE_RANGE, at, k - 1, 0) };
        }
        at = k + 1;
    }
    // SAFETY: as above.
    unsafe { sys!(nr::CLOSE_RANGE, at, u32::MAX, 0) };
}

/// The process's last step before it resumes (after it reported running,
/// before its threads go): it writes itself into each group it was kept out
/// of while it was restored (a moved guest's CPU and freezer groups: until
/// now the restore ran at the priority of whoever started it), once, and
/// lets go of the descriptors. Its other threads wait at the barrier and move
/// with it (`cgroup.procs` moves the whole thread group).
fn join_groups() {
    for slot in &JOIN_FDS {
        let fd = slot.swap(-1, Ordering::Relaxed);
        if fd < 0 {
            continue;
        }
        // SAFETY: writes one byte of a static into our own descriptor.
        let r = unsafe { sys!(nr::WRITE, fd, b"0".as_ptr(), 1) };
        if r != 1 {
            die(RestorerExit::Join, "join cgroup", fd as u64, r.min(0));
        }
        // SAFETY: closing our own descriptor; the program must not inherit it.
        unsafe { sys!(nr::CLOSE, fd) };
    }
}

const FUTEX_WAIT_PRIVATE: usize = 128;
const FUTEX_WAKE_PRIVATE: usize = 129;

fn futex_wait(word: &AtomicU32, while_value: u32) {
    while word.load(Ordering::Acquire) == while_value {
        // SAFETY: FUTEX_WAIT on a live static word; returns at once if it changed.
        unsafe { sys!(nr::FUTEX, word as *const AtomicU32, FUTEX_WAIT_PRIVATE, while_value, 0, 0, 0) };
    }
}

fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live static word.
    unsafe { sys!(nr::FUTEX, word as *const AtomicU32, FUTEX_WAKE_PRIVATE, i32::MAX, 0, 0, 0) };
}

/// Create threads 1.. with their TIDs (when the plan has a PID namespace),
/// each starting in [`thread_main`] on its own restorer stack.
fn create_threads() {
    const CLONE_THREAD_FLAGS: u64 = 0x100 /* VM */ | 0x200 /* FS */ | 0x400 /* FILES */
        | 0x800 /* SIGHAND */ | 0x10000 /* THREAD */ | 0x40000 /* SYSVSEM */;
    let with_tids = header().flags & PLAN_FLAG_NEW_PIDNS != 0;
    let stacks = core::ptr::addr_of_mut!(THREAD_STACKS) as u64;
    for (i, t) in threads().iter().enumerate().skip(1) {
        let tid = [t.core.tid as i32];
        let args = CloneArgs {
            flags: CLONE_THREAD_FLAGS, pidfd: 0, child_tid: 0, parent_tid: 0, exit_signal: 0,
            stack: stacks + ((i - 1) * THREAD_STACK_BYTES) as u64,
            stack_size: THREAD_STACK_BYTES as u64,
            tls: 0,
            set_tid: if with_tids { tid.as_ptr() as u64 } else { 0 },
            set_tid_size: if with_tids { 1 } else { 0 },
            cgroup: 0,
        };
        // SAFETY: a thread on its own static stack slot (one per index,
        // never shared), entering `thread_main`, which never returns.
        let r = unsafe {
            starling_restorer_clone_thread(&args, core::mem::size_of::<CloneArgs>(), thread_main, i as u64)
        };
        if r < 0 {
            die(RestorerExit::Threads, "clone3 thread set_tid", t.core.tid, r);
        }
    }
}

extern "C" fn thread_main(index: u64) -> ! {
    restore_own_thread(index as usize);
    READY.fetch_add(1, Ordering::Release);
    futex_wake_all(&READY);
    futex_wait(&GO, 0);
    resume(index as usize)
}

/// What every thread restores for itself: kernel state is per thread.
fn restore_own_thread(index: usize) {
    let t = &threads()[index].core;
    let leader = index == 0;
    // SAFETY (fs/gs): ARCH_SET_FS (0x1002) / ARCH_SET_GS (0x1001) set this
    // thread's bases; the restorer never uses fs/gs-relative addressing
    // (no TLS in a no_std static binary).
    let r = unsafe { sys!(nr::ARCH_PRCTL, 0x1002, t.regs.fs_base) };
    if r < 0 {
        die(RestorerExit::ThreadState, "ARCH_SET_FS", t.regs.fs_base, r);
    }
    if t.regs.gs_base != 0 {
        // SAFETY: as above.
        unsafe { sys!(nr::ARCH_PRCTL, 0x1001, t.regs.gs_base) };
    }
    if t.comm[0] != 0 {
        // SAFETY: PR_SET_NAME (15) reads at most 16 bytes from the plan's
        // copy of the name, which lives in the restorer's own memory; the
        // kernel NUL-terminates what it keeps. A failure only leaves the
        // restorer's name, so it is not fatal.
        unsafe { sys!(nr::PRCTL, 15, t.comm.as_ptr()) };
    }
    if t.robust.head != 0 {
        // SAFETY: registers the image's robust list head (restored memory).
        let r = unsafe { sys!(nr::SET_ROBUST_LIST, t.robust.head, t.robust.len) };
        if r < 0 {
            die(RestorerExit::ThreadState, "set_robust_list", t.robust.head, r);
        }
    }
    if leader && t.tid_address != 0 && clone_index() != 0 {
        // A further clone is a fork of the first and has its own TID. The
        // TID address is glibc's cached TID in the thread control block
        // (`set_tid_address(&pd->tid)`): fork() has the kernel write the new
        // TID there (CLONE_CHILD_SETTID), so do the same. The page is in
        // restored memory: this write faults it in through the handler.
        // SAFETY: gettid takes no arguments; tid_address is the image's
        // 4-byte pd->tid, mapped by `map_regions`.
        unsafe {
            let tid = sys!(nr::GETTID);
            core::ptr::write_volatile(t.tid_address as *mut i32, tid as i32);
        }
    }
    if t.tid_address != 0 {
        // SAFETY: the kernel clears/wakes this address at exit, as before.
        unsafe { sys!(nr::SET_TID_ADDRESS, t.tid_address) };
    }
    if t.rseq.addr != 0 {
        // SAFETY: registers the image's rseq area (in restored memory,
        // faults on it are served by the handler).
        let mut r = unsafe { sys!(nr::RSEQ, t.rseq.addr, t.rseq.len, 0, t.rseq.sig) };
        if r == -22 && t.rseq.len != 32 {
            // SAFETY: as above, with the original ABI size.
            r = unsafe { sys!(nr::RSEQ, t.rseq.addr, 32, 0, t.rseq.sig) };
        }
        if r < 0 {
            die(RestorerExit::ThreadState, "rseq", t.rseq.addr, r);
        }
    }
    restore_credentials();
    // SAFETY: getpid/gettid take no arguments.
    let (pid, tid) = unsafe { (sys!(nr::GETPID), sys!(nr::GETTID)) };
    for s in signals().iter().filter(|s| s.tid == t.tid) {
        // Queued by the thread itself: only then may a kernel si_code be
        // given (rt_tgsigqueueinfo refuses it towards another thread).
        // SAFETY: reads a 128-byte siginfo from the plan.
        unsafe { sys!(nr::RT_TGSIGQUEUEINFO, pid, tid, s.info.signo(), &s.info as *const SigInfo) };
    }
}

/// Credentials are per thread in the kernel: each thread sets its own.
/// A process none of whose uids is 0 also loses what an `exec` task's
/// sandbox takes from a non-root task: its capability bounding set is
/// emptied (before `setresuid`, while this thread still has CAP_SETPCAP)
/// and its inheritable set cleared (after; `setresuid` already cleared the
/// effective, permitted and ambient sets), so nothing comes back through an
/// `execve`. A process that is root, or can become root again (a uid of 0),
/// keeps them, as a root exec task does.
fn restore_credentials() {
    let h = header();
    let c = &h.process.creds;
    let groups = blob(h.groups);
    let unprivileged = c.ruid != 0 && c.euid != 0 && c.suid != 0;
    if unprivileged {
        // Capabilities 0..=63: the kernel's last one is lower (CAP_LAST_CAP,
        // 40 on 6.x); the ones it does not know fail with EINVAL, harmlessly.
        for cap in 0..64usize {
            // SAFETY: prctl(PR_CAPBSET_DROP = 24, cap) with integer arguments.
            let r = unsafe { sys!(nr::PRCTL, 24, cap) };
            if r < 0 && r != -22 {
                die(RestorerExit::ThreadState, "PR_CAPBSET_DROP", cap as u64, r);
            }
        }
    }
    // SAFETY: credential syscalls with integer arguments and a gid_t array
    // in the plan.
    unsafe {
        let r = sys!(nr::SETGROUPS, groups.len() / 4, groups.as_ptr());
        if r < 0 && !c.is_root() {
            die(RestorerExit::ThreadState, "setgroups", groups.len() as u64 / 4, r);
        }
        let r = sys!(nr::SETRESGID, c.rgid, c.egid, c.sgid);
        if r < 0 {
            die(RestorerExit::ThreadState, "setresgid", c.egid, r);
        }
        let r = sys!(nr::SETRESUID, c.ruid, c.euid, c.suid);
        if r < 0 {
            die(RestorerExit::ThreadState, "setresuid", c.euid, r);
        }
    }
    if unprivileged {
        /// `struct __user_cap_header_struct` and two `__user_cap_data_struct`s (version 3).
        #[repr(C)]
        struct CapHeader {
            version: u32,
            pid: i32,
        }
        let hdr = CapHeader { version: 0x2008_0522, pid: 0 };
        let data = [0u32; 6];
        // SAFETY: capset(2) reads a header and two 12-byte data records from
        // live locals; all-zero sets only drop capabilities.
        let r = unsafe { sys!(nr::CAPSET, &hdr as *const CapHeader, data.as_ptr()) };
        if r < 0 {
            die(RestorerExit::ThreadState, "capset", 0, r);
        }
    }
}

/// The plan's seccomp program, if any: `no_new_privs`, then the filter on
/// every thread at once (they all exist and wait for GO). Nothing the
/// restorer still does after this is denied by the task filter.
fn confine() {
    let prog = blob(header().seccomp);
    if prog.is_empty() {
        return;
    }
    /// The kernel's `struct sock_fprog`.
    #[repr(C)]
    struct SockFprog {
        len: u16,
        filter: *const u8,
    }
    let fprog = SockFprog { len: (prog.len() / 8) as u16, filter: prog.as_ptr() };
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS = 38, 1) with integer arguments.
    let r = unsafe { sys!(nr::PRCTL, 38, 1, 0, 0, 0) };
    if r < 0 {
        die(RestorerExit::ThreadState, "no_new_privs", 0, r);
    }
    // SAFETY: seccomp(SECCOMP_SET_MODE_FILTER = 1, SECCOMP_FILTER_FLAG_TSYNC = 1)
    // reads a sock_fprog on our stack pointing into the plan, both live
    // for the call (the kernel copies the program).
    let r = unsafe { sys!(nr::SECCOMP, 1, 1, &fprog as *const SockFprog) };
    if r != 0 {
        die(RestorerExit::ThreadState, "seccomp", 0, r);
    }
}

/// The kernel's `struct sigevent` (64 bytes; `_tid` is the first word of its union).
#[repr(C)]
struct Sigevent {
    value: u64,
    signo: i32,
    notify: i32,
    tid: i32,
    pad: [i32; 11],
}

/// `prctl(PR_TIMER_CREATE_RESTORE_IDS, …)` (Linux 6.15): while on,
/// `timer_create` takes the new timer's ID from `*created_timer_id`.
const PR_TIMER_CREATE_RESTORE_IDS: usize = 77;
const PR_TIMER_CREATE_RESTORE_IDS_OFF: usize = 0;
const PR_TIMER_CREATE_RESTORE_IDS_ON: usize = 1;

/// Create POSIX timer `t` with the ID the program holds: asked for by ID
/// where the kernel can (`by_id`); else the kernel gives out IDs in
/// ascending order, so lower ones are created and deleted until it gives
/// `t.id` (CRIU's way; the timers come in ascending ID order).
fn create_posix_timer(t: &abi::process::PosixTimer, by_id: bool) {
    let ev = Sigevent { value: t.sigval, signo: t.signo as i32, notify: t.notify as i32, tid: t.tid as i32, pad: [0; 11] };
    loop {
        let mut id: i32 = if by_id { t.id as i32 } else { 0 };
        // SAFETY: timer_create reads a 64-byte sigevent and reads (by ID)
        // and writes an int, both on our stack.
        let r = unsafe { sys!(nr::TIMER_CREATE, t.clock, &ev as *const Sigevent, &mut id as *mut i32) };
        if r < 0 {
            die(RestorerExit::ThreadState, "timer_create", t.id, r);
        }
        if id as u64 == t.id {
            return;
        }
        if by_id || id as u64 > t.id {
            die(RestorerExit::ThreadState, "timer_create gave another ID than", t.id, 0);
        }
        // SAFETY: deletes the timer just made, which nothing else knows.
        unsafe { sys!(nr::TIMER_DELETE, id) };
    }
}

/// The POSIX timers with their IDs, notifications and clocks, each armed
/// with the time it had left (relative: the clocks of another host differ).
fn restore_posix_timers() {
    let timers = header().process.timers.used();
    if timers.is_empty() {
        return;
    }
    // SAFETY: prctl with integer arguments.
    let by_id = unsafe { sys!(nr::PRCTL, PR_TIMER_CREATE_RESTORE_IDS, PR_TIMER_CREATE_RESTORE_IDS_ON, 0, 0, 0) } == 0;
    for t in timers {
        create_posix_timer(t, by_id);
        if t.remaining.is_zero() {
            continue;
        }
        // `struct itimerspec`: interval, then value.
        let spec = [t.interval, t.remaining];
        // SAFETY: timer_settime(flags 0: relative) reads a struct
        // itimerspec (four u64s) on our stack; no old value is asked for.
        let r = unsafe { sys!(nr::TIMER_SETTIME, t.id, 0, spec.as_ptr(), 0) };
        if r < 0 {
            die(RestorerExit::ThreadState, "timer_settime", t.id, r);
        }
    }
    if by_id {
        // SAFETY: prctl with integer arguments.
        unsafe { sys!(nr::PRCTL, PR_TIMER_CREATE_RESTORE_IDS, PR_TIMER_CREATE_RESTORE_IDS_OFF, 0, 0, 0) };
    }
}

/// The leader, after its own thread state: wait for every thread, then the
/// process-wide state that must come last (interval timers, POSIX timers —
/// a `SIGEV_THREAD_ID` one needs its thread —, the shared signal queue),
/// then let all resume.
fn release_threads() {
    let h = header();
    let others = (h.n_threads - 1) as u32;
    loop {
        let ready = READY.load(Ordering::Acquire);
        if ready >= others {
            break;
        }
        futex_wait(&READY, ready);
    }
    // Dropping to another user cleared the dumpable flag; the program had it.
    // SAFETY: prctl(PR_SET_DUMPABLE, 1) with integer arguments.
    unsafe { sys!(nr::PRCTL, 4, 1) };
    for (which, t) in h.process.itimers.iter().enumerate() {
        if t.armed() {
            // SAFETY: setitimer reads a struct itimerval (four u64s).
            unsafe { sys!(nr::SETITIMER, which, t as *const abi::process::ITimer, 0) };
        }
    }
    restore_posix_timers();
    // SAFETY: getpid takes no arguments.
    let pid = unsafe { sys!(nr::GETPID) };
    for s in signals().iter().filter(|s| s.tid == 0) {
        // SAFETY: reads a 128-byte siginfo from the plan; queued to our own
        // process, which may carry a kernel si_code.
        unsafe { sys!(nr::RT_SIGQUEUEINFO, pid, s.info.signo(), &s.info as *const SigInfo) };
    }
    confine();
    // Tell the handler the process is about to run (a migration's switch
    // point), then let go of the socket: the program must not inherit it.
    let sock = HANDLER_SOCK.load(Ordering::Relaxed);
    send_record(sock, Record { tag: RecordTag::Running as u64, clone_id: my_clone_id(), value: 0 }, None);
    // SAFETY: closing our own descriptor; no other thread uses it.
    unsafe { sys!(nr::CLOSE, sock) };
    // After the report: a join into a frozen freezer group stops us right
    // here (a guest suspended where it arrived), and the move is complete.
    join_groups();
    GO.store(1, Ordering::Release);
    futex_wake_all(&GO);
}

// ---------------------------------------------------------------------------
// step 7: resume

/// The kernel's `struct sigcontext` (x86-64).
#[repr(C)]
#[derive(Default)]
struct Sigcontext {
    r8: u64, r9: u64, r10: u64, r11: u64, r12: u64, r13: u64, r14: u64, r15: u64,
    rdi: u64, rsi: u64, rbp: u64, rbx: u64, rdx: u64, rax: u64, rcx: u64, rsp: u64, rip: u64,
    eflags: u64,
    cs: u16, gs: u16, fs: u16, ss: u16,
    err: u64, trapno: u64, oldmask: u64, cr2: u64,
    fpstate: u64,
    reserved: [u64; 8],
}

/// The kernel's `stack_t`.
#[repr(C)]
#[derive(Default)]
struct StackT {
    sp: u64,
    flags: i32,
    _pad: i32,
    size: u64,
}

/// The kernel's `struct ucontext` (x86-64; the sigset is the kernel's 8 bytes).
#[repr(C)]
#[derive(Default)]
struct Ucontext {
    flags: u64,
    link: u64,
    stack: StackT,
    mcontext: Sigcontext,
    sigmask: u64,
}

/// `struct rt_sigframe`: `rt_sigreturn` reads the ucontext at rsp and checks
/// that the whole frame (siginfo included) is accessible.
#[repr(C)]
struct RtSigframe {
    pretcode: u64,
    uc: Ucontext,
    info: [u64; 16],
}

const UC_FP_XSTATE: u64 = 1;
const UC_SIGCONTEXT_SS: u64 = 2;
const UC_STRICT_RESTORE_SS: u64 = 4;
const SS_DISABLE: i32 = 2;

/// Resume thread `index` with all its registers, FPU state, signal mask
/// and altstack, by returning from a signal frame that holds them.
fn resume(index: usize) -> ! {
    let t = &threads()[index];
    let g: &GpRegs = &t.core.regs;
    let mut rax = g.rax;
    if index == 0 && header().flags & PLAN_FLAG_CLONE_ID_IN_RAX != 0 {
        rax = my_clone_id();
    }
    let fpu = blob(t.fpu);
    let xstate = fpu.len() > FXSAVE_BYTES
        && u32::from_le_bytes([fpu[FPX_SW_BYTES_OFFSET], fpu[FPX_SW_BYTES_OFFSET + 1], fpu[FPX_SW_BYTES_OFFSET + 2], fpu[FPX_SW_BYTES_OFFSET + 3]])
            == FP_XSTATE_MAGIC1;
    let a = &t.core.altstack;
    let frame = RtSigframe {
        pretcode: 0,
        uc: Ucontext {
            flags: UC_SIGCONTEXT_SS | UC_STRICT_RESTORE_SS | if xstate { UC_FP_XSTATE } else { 0 },
            link: 0,
            stack: if a.sp != 0 {
                StackT { sp: a.sp, flags: a.flags as i32, _pad: 0, size: a.size }
            } else {
                StackT { sp: 0, flags: SS_DISABLE, _pad: 0, size: 0 }
            },
            mcontext: Sigcontext {
                r8: g.r8, r9: g.r9, r10: g.r10, r11: g.r11, r12: g.r12, r13: g.r13, r14: g.r14, r15: g.r15,
                rdi: g.rdi, rsi: g.rsi, rbp: g.rbp, rbx: g.rbx, rdx: g.rdx, rax, rcx: g.rcx,
                rsp: g.rsp, rip: g.rip, eflags: g.eflags,
                cs: USER_CS as u16, gs: 0, fs: 0, ss: USER_SS as u16,
                fpstate: fpu.as_ptr() as u64,
                ..Sigcontext::default()
            },
            sigmask: t.core.sigmask,
        },
        info: [0; 16],
    };
    // SAFETY: the frame lives on this thread's restorer stack until the
    // kernel has read it; every address the registers name was mapped (and
    // is filled on demand); the FPU area is 64-byte aligned in the plan.
    unsafe { starling_restorer_sigreturn(&frame.uc) }
}

// ---------------------------------------------------------------------------

extern "C" fn restorer_main() -> ! {
    // Nothing may interrupt a half-restored process; each thread's own mask
    // comes back with its frame.
    let all: u64 = !0;
    // SAFETY: rt_sigprocmask(SIG_SETMASK) reads an 8-byte kernel sigset.
    unsafe { sys!(nr::RT_SIGPROCMASK, 2, &all as *const u64, 0, 8) };
    let len = read_plan();
    validate_plan(len);
    let h = header();
    if h.flags & PLAN_FLAG_NEW_PIDNS != 0 {
        enter_pid_namespace(h.process.pid, h.clone_count);
    }
    // From here on we are the process being restored. Its children inherit
    // the tree's pipes, and their sessions (and the terminal) as forks of it.
    create_tree_pipes();
    fork_descendants();
    take_group();
    let max_fd = fds().iter().map(|f| f.fd).max().unwrap_or(2) as i32;
    let keep_above = (max_fd + 1).max(10);
    let handler_sock = move_fd_above(HANDLER_FD, keep_above);
    HANDLER_SOCK.store(handler_sock, Ordering::Relaxed);
    let join = move_join_fds(keep_above);
    fix_own_mappings();
    map_regions();
    let uffd = register_regions();
    if uffd >= 0 {
        send_uffd(handler_sock, uffd as i32, my_clone_id());
        // SAFETY: the handler holds its own reference to the userfaultfd.
        unsafe { sys!(nr::CLOSE, uffd) };
    }
    restore_fds(keep_above);
    // Everything above the image's fds but the handler socket and the
    // groups to join (closed right before the threads resume).
    let mut keep = [-1i32; MAX_JOIN_GROUPS as usize + 1];
    keep[0] = handler_sock;
    keep[1..].copy_from_slice(&join);
    close_from_except(max_fd + 1, &keep);
    restore_process_state();
    create_threads();
    restore_own_thread(0);
    release_threads();
    resume(0)
}
