//! The template: a frozen `fork()` child holding the caller's state.
//!
//! [`fork_template`] calls libc `fork()` (so `pthread_atfork` handlers run as
//! usual). The child records a *resume point* inside this module's frame —
//! the callee-saved registers, rsp and rip into the image's [`GpRegs`], and
//! the FPU state with `fxsave64` — then records what only it can read about
//! itself exactly (signal dispositions and mask, fs base, clear-tid address,
//! robust list, rseq area, alternate signal stack, brk), sends that
//! [`TemplateRecord`] to the parent over a pipe, and freezes blocked in
//! `read()` on another pipe. It never leaves that frame: a restored clone
//! resumes at the resume point with its clone ID in rax (the restorer's
//! `rt_sigreturn` frame), so the save routine "returns" the ID instead of 0
//! and the clone returns out of [`fork_template`] as [`ForkOutcome::Clone`].

use crate::{ForkError, Result, TemplateFailure};
use starling_image::abi::regs::{FxSave, GpRegs, USER_CS, USER_EFLAGS, USER_SS};
use starling_image::abi::signal::{Sigaction, SigactionTable};
use starling_image::abi::thread::{AltStack, RobustList, Rseq, ThreadCore};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

// Save a resume point and return 0: callee-saved registers, the stack
// pointer after return and the return address into `*rdi` (a `GpRegs`:
// `user_regs_struct` offsets), the FPU state into `*rsi` (an `FxSave`). A
// thread resumed from these registers with eax = id returns `id` from here.
core::arch::global_asm!(
    ".globl starling_fork_save_resume_point",
    ".type starling_fork_save_resume_point,@function",
    "starling_fork_save_resume_point:",
    "mov [rdi + 0], r15",
    "mov [rdi + 8], r14",
    "mov [rdi + 16], r13",
    "mov [rdi + 24], r12",
    "mov [rdi + 32], rbp",
    "mov [rdi + 40], rbx",
    "mov rax, [rsp]",
    "mov [rdi + 128], rax",
    "lea rax, [rsp + 8]",
    "mov [rdi + 152], rax",
    "fxsave64 [rsi]",
    "xor eax, eax",
    "ret",
);

extern "C" {
    /// Returns 0 after saving; returns the clone ID when resumed by a restorer.
    fn starling_fork_save_resume_point(regs: *mut GpRegs, fpu: *mut FxSave) -> u32;
}

const RECORD_MAGIC: u64 = u64::from_le_bytes(*b"STRLTMPL");
/// rseq signature glibc uses on x86-64.
pub const RSEQ_SIG: u32 = 0x5305_3053;

/// What the template records about itself before freezing: the image's
/// per-thread state and dispositions, plus what only the pipe protocol
/// needs. Sent raw over a pipe to the parent: both sides are the same
/// binary, so the layout agrees.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TemplateRecord {
    pub magic: u64,
    pub thread: ThreadCore,
    pub fpu: FxSave,
    pub sigactions: SigactionTable,
    pub brk: u64,
    /// The fd the template is frozen on: not part of the clone's fd table.
    pub freeze_fd: u64,
}

impl TemplateRecord {
    /// An all-zero record (what a process that is not a template "recorded").
    pub fn zeroed() -> Self {
        TemplateRecord {
            magic: 0,
            thread: ThreadCore::default(),
            fpu: FxSave::zeroed(),
            sigactions: SigactionTable::default(),
            brk: 0,
            freeze_fd: 0,
        }
    }
}

/// A frozen template, seen from the parent.
#[derive(Debug)]
pub struct Template {
    pub pid: i32,
    pub record: TemplateRecord,
    /// Closing this ends the template (its `read()` returns EOF and it exits).
    freeze_writer: Option<OwnedFd>,
}

impl Template {
    /// Unfreeze and reap the template. Idempotent.
    pub fn release(&mut self) {
        if self.freeze_writer.take().is_some() {
            let mut status = 0;
            // SAFETY: waits for our own child; status is a live local.
            unsafe { libc::waitpid(self.pid, &mut status, 0) };
        }
    }
}

impl Drop for Template {
    fn drop(&mut self) {
        self.release();
    }
}

// Returned once per fork and unpacked at once: a Box would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub enum ForkOutcome {
    /// We are the caller; the template is frozen.
    Parent(Template),
    /// We are a clone that resumed inside `fork_template`.
    Clone(u32),
}

fn pipe_cloexec() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(ForkError::errno("pipe2"));
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Fork a template. In the parent returns the frozen template (after it has
/// sent its record); in a clone returns the clone ID.
pub fn fork_template() -> Result<ForkOutcome> {
    let (state_r, state_w) = pipe_cloexec()?;
    let (freeze_r, freeze_w) = pipe_cloexec()?;
    let parent_pid = std::process::id().cast_signed();
    // SAFETY: fork in a possibly multi-threaded process: the child only runs
    // `template_child`, which calls async-signal-safe syscalls, glibc's
    // malloc_trim (malloc is fork-safe in glibc: its atfork handlers reset
    // the locks) and writes to a pipe, then blocks or _exits.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(ForkError::errno("fork"));
    }
    if pid == 0 {
        let state_w_fd = state_w.as_raw_fd();
        let freeze_r_fd = freeze_r.as_raw_fd();
        std::mem::forget(state_w);
        std::mem::forget(freeze_r);
        drop(state_r);
        drop(freeze_w);
        crate::template_hook::run_in_template();
        let id = template_child(state_w_fd, freeze_r_fd, parent_pid);
        return Ok(ForkOutcome::Clone(id));
    }
    drop(state_w);
    drop(freeze_r);
    let mut template = Template { pid, record: TemplateRecord::zeroed(), freeze_writer: Some(freeze_w) };
    let mut buf = vec![0u8; std::mem::size_of::<TemplateRecord>()];
    let mut got = 0;
    let mut file = std::fs::File::from(state_r);
    use std::io::Read;
    // Read the record, then wait for EOF: the template closes its end right
    // before blocking, so after EOF it no longer changes its fd table.
    loop {
        let n = if got < buf.len() { file.read(&mut buf[got..]) } else { file.read(&mut [0u8; 1]) };
        match n {
            Ok(0) => break,
            Ok(n) if got < buf.len() => got += n,
            Ok(_) => return Err(ForkError::Template(TemplateFailure::RecordTooLong)),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ForkError::io("read template record", e)),
        }
    }
    if got != buf.len() {
        return Err(ForkError::Template(TemplateFailure::Died { got }));
    }
    // SAFETY: the buffer holds exactly one TemplateRecord written by the same
    // binary; read_unaligned copes with the Vec's alignment; all fields are
    // plain integers, valid for any bit pattern.
    template.record = unsafe { std::ptr::read_unaligned(buf.as_ptr() as *const TemplateRecord) };
    if template.record.magic != RECORD_MAGIC {
        return Err(ForkError::Template(TemplateFailure::BadMagic));
    }
    Ok(ForkOutcome::Parent(template))
}

/// The template's side. Returns only in a clone, with its ID.
#[inline(never)]
fn template_child(state_w: RawFd, freeze_r: RawFd, parent_pid: i32) -> u32 {
    let mut record = TemplateRecord::zeroed();
    // SAFETY: writes the resume context into `record`. The "returns twice"
    // hazard of setjmp does not bite here: when it returns non-zero nothing
    // from this frame but the return value is used, and the callee-saved
    // registers the caller relies on are restored by the restorer exactly as
    // saved here.
    let id = unsafe { starling_fork_save_resume_point(&mut record.thread.regs, &mut record.fpu) };
    if id != 0 {
        return id;
    }
    freeze(&mut record, state_w, freeze_r, parent_pid)
}

fn raw_syscall_record(record: &mut TemplateRecord) {
    let t = &mut record.thread;
    t.regs.cs = USER_CS;
    t.regs.ss = USER_SS;
    t.regs.eflags = USER_EFLAGS;
    // SAFETY: (whole function) each syscall writes only into fields of
    // `record` or locals passed by pointer with the sizes the kernel expects.
    unsafe {
        t.tid = i64::from(libc::getpid()).cast_unsigned();
        libc::syscall(libc::SYS_arch_prctl, 0x1003 /* ARCH_GET_FS */, &mut t.regs.fs_base as *mut u64);
        libc::syscall(libc::SYS_arch_prctl, 0x1004 /* ARCH_GET_GS */, &mut t.regs.gs_base as *mut u64);
        // PR_GET_NAME writes at most 16 bytes, NUL-terminated.
        libc::prctl(libc::PR_GET_NAME, t.comm.as_mut_ptr());
        let mut tid_addr: u64 = 0;
        if libc::prctl(libc::PR_GET_TID_ADDRESS, &mut tid_addr as *mut u64) == 0 {
            t.tid_address = tid_addr;
        }
        let mut head: u64 = 0;
        let mut len: usize = 0;
        if libc::syscall(libc::SYS_get_robust_list, 0, &mut head as *mut u64, &mut len as *mut usize) == 0 {
            t.robust = RobustList { head, len: len as u64 };
        }
        libc::syscall(libc::SYS_rt_sigprocmask, libc::SIG_BLOCK, std::ptr::null::<u64>(), &mut t.sigmask as *mut u64, 8);
        for (i, slot) in record.sigactions.0.iter_mut().enumerate() {
            let mut act = Sigaction::default();
            if libc::syscall(libc::SYS_rt_sigaction, i + 1, std::ptr::null::<Sigaction>(), &mut act as *mut Sigaction, 8) == 0 {
                *slot = act;
            }
        }
        let mut ss: libc::stack_t = std::mem::zeroed();
        if libc::sigaltstack(std::ptr::null(), &mut ss) == 0 && ss.ss_flags & libc::SS_DISABLE == 0 {
            t.altstack = AltStack { sp: ss.ss_sp as u64, flags: i64::from(ss.ss_flags).cast_unsigned(), size: ss.ss_size as u64 };
        }
        record.brk = libc::sbrk(0) as u64;
        // glibc (≥ 2.35) registers an rseq area at thread pointer + __rseq_offset.
        let off = libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_offset".as_ptr()) as *const isize;
        let size = libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_size".as_ptr()) as *const u32;
        if !off.is_null() && !size.is_null() && *size > 0 {
            t.rseq = Rseq {
                addr: (t.regs.fs_base.cast_signed() + *off as i64).cast_unsigned(),
                // glibc registers at least the original 32-byte ABI size.
                len: u64::from(*size).max(32),
                sig: u64::from(RSEQ_SIG),
            };
        }
    }
}

fn freeze(record: &mut TemplateRecord, state_w: RawFd, freeze_r: RawFd, parent_pid: i32) -> ! {
    // SAFETY: (whole function) plain syscalls on our own process and fds;
    // `record` is a live local of the caller's frame.
    unsafe {
        libc::setpgid(0, 0); // leave the terminal's process group (no ^C)
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() != parent_pid {
            libc::_exit(1);
        }
        // Let the page server read us with process_vm_readv under Yama.
        libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY);
        // Return free heap to the kernel: those pages become zero-fill.
        libc::malloc_trim(0);
        raw_syscall_record(record);
        record.freeze_fd = i64::from(freeze_r).cast_unsigned();
        record.magic = RECORD_MAGIC;
        let bytes = std::slice::from_raw_parts(record as *const TemplateRecord as *const u8, std::mem::size_of::<TemplateRecord>());
        let mut off = 0;
        while off < bytes.len() {
            let n = libc::write(state_w, bytes[off..].as_ptr().cast(), bytes.len() - off);
            if n <= 0 {
                libc::_exit(1);
            }
            off += n.cast_unsigned(); // n > 0
        }
        libc::close(state_w);
        let mut b = 0u8;
        loop {
            let n = libc::read(freeze_r, (&mut b as *mut u8).cast(), 1);
            if n < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            }
            libc::_exit(0);
        }
    }
}

/// Check whether `fd` is open (used by tests).
pub fn fd_is_open(fd: RawFd) -> bool {
    // SAFETY: F_GETFD on an arbitrary number has no effect beyond the query.
    unsafe { libc::fcntl(fd, libc::F_GETFD) >= 0 }
}
