//! Running system calls inside a frozen process (compel's parasite-less
//! mode): the state only the process itself can read (dispositions,
//! interval timers, per-thread altstack and clear-tid address, brk) and the
//! userfaultfd that tracks its writes.
//!
//! A `syscall; int3` stub is poked over the first word of an executable
//! mapping (every thread is stopped, so nobody runs it by accident); a
//! thread's registers are pointed at it with the call's number and
//! arguments, `orig_rax = -1` (no restart of a system call the thread was
//! in), and every signal blocked; it runs until the trap; then its registers
//! and mask are put back. Out-arguments go to a scratch page mapped in the
//! process and unmapped before its memory is dumped.

use crate::freeze::Frozen;
use crate::ptrace::{self, Stop};
use crate::{MigrateError, Result};
use std::os::unix::fs::FileExt;

/// `syscall` (0f 05) then `int3` (cc) padding the word.
const STUB: u64 = u64::from_le_bytes([0x0f, 0x05, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc]);
const SCRATCH_BYTES: u64 = 4096;

pub struct Injector<'a> {
    frozen: &'a Frozen,
    code: u64,
    saved_code: u64,
    scratch: Option<u64>,
    mem: std::fs::File,
    done: bool,
}

/// The first executable private mapping of `pid`.
fn code_address(pid: i32) -> Result<u64> {
    let path = format!("/proc/{pid}/maps");
    let maps = std::fs::read_to_string(&path).map_err(|e| MigrateError::Proc { path: path.clone(), source: e })?;
    maps.lines()
        .find_map(|l| {
            let mut it = l.split_whitespace();
            let range = it.next()?;
            let perms = it.next()?;
            // Private only: poking a shared mapping would change its file.
            (perms == "r-xp").then_some(())?;
            u64::from_str_radix(range.split('-').next()?, 16).ok()
        })
        .ok_or(MigrateError::NoCode(pid))
}

impl<'a> Injector<'a> {
    pub fn new(frozen: &'a Frozen) -> Result<Injector<'a>> {
        let pid = frozen.pid;
        let code = code_address(pid)?;
        let saved_code = ptrace::peek(pid, code)?;
        ptrace::poke(pid, code, STUB)?;
        let path = format!("/proc/{pid}/mem");
        let mem = std::fs::OpenOptions::new().read(true).open(&path).map_err(|e| MigrateError::Proc { path, source: e })?;
        Ok(Injector { frozen, code, saved_code, scratch: None, mem, done: false })
    }

    /// Run system call `nr` with `args` in thread `tid`; its raw result.
    pub fn syscall(&self, tid: i32, nr: libc::c_long, args: [u64; 6]) -> Result<i64> {
        let saved = ptrace::get_regs(tid)?;
        let mask = ptrace::get_sigmask(tid)?;
        ptrace::set_sigmask(tid, !0)?;
        let mut r = saved;
        r.rax = nr.cast_unsigned();
        r.orig_rax = u64::MAX;
        r.rdi = args[0];
        r.rsi = args[1];
        r.rdx = args[2];
        r.r10 = args[3];
        r.r8 = args[4];
        r.r9 = args[5];
        r.rip = self.code;
        ptrace::set_regs(tid, &r)?;
        ptrace::cont(tid, 0)?;
        match ptrace::wait_stop(tid)? {
            Stop::Event => {}
            Stop::Signal(sig) => return Err(MigrateError::Injection { tid, nr, detail: format!("stopped by signal {sig}") }),
            Stop::Exited => return Err(MigrateError::Gone(tid)),
        }
        let result = ptrace::get_regs(tid)?.rax.cast_signed();
        ptrace::set_regs(tid, &saved)?;
        ptrace::set_sigmask(tid, mask)?;
        Ok(result)
    }

    /// As [`Injector::syscall`], failing on a negative result.
    pub fn call(&self, tid: i32, nr: libc::c_long, args: [u64; 6]) -> Result<u64> {
        let r = self.syscall(tid, nr, args)?;
        if (-4095..0).contains(&r) {
            return Err(MigrateError::Injection { tid, nr, detail: format!("errno {}", -r) });
        }
        Ok(r.cast_unsigned())
    }

    /// A page in the process for out-arguments.
    pub fn scratch(&mut self) -> Result<u64> {
        if let Some(s) = self.scratch {
            return Ok(s);
        }
        let prot = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
        let addr = self.call(self.frozen.pid, libc::SYS_mmap, [0, SCRATCH_BYTES, prot, flags, u64::MAX, 0])?;
        self.scratch = Some(addr);
        Ok(addr)
    }

    /// Read `len` bytes the process wrote at `addr`.
    pub fn read(&self, addr: u64, len: usize) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; len];
        self.mem
            .read_exact_at(&mut buf, addr)
            .map_err(|e| MigrateError::Proc { path: format!("/proc/{}/mem", self.frozen.pid), source: e })?;
        Ok(buf)
    }

    /// Remove every trace: unmap the scratch page, put the code back.
    pub fn finish(mut self) -> Result<()> {
        self.cleanup()
    }

    fn cleanup(&mut self) -> Result<()> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        if let Some(s) = self.scratch.take() {
            self.call(self.frozen.pid, libc::SYS_munmap, [s, SCRATCH_BYTES, 0, 0, 0, 0])?;
        }
        ptrace::poke(self.frozen.pid, self.code, self.saved_code)
    }
}

impl Drop for Injector<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.cleanup() {
            log::warn!("migration: cleaning up injection in {}: {e}", self.frozen.pid);
        }
    }
}
