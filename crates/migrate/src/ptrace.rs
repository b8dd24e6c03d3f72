//! The ptrace requests capture uses, as small checked calls. Layouts are
//! the kernel's (x86-64): `user_regs_struct` is `GpRegs`.

use crate::{MigrateError, Result};
use starling_image::abi::regs::GpRegs;
use starling_image::abi::signal::SigInfo;

const PTRACE_GETREGS: libc::c_uint = 12;
const PTRACE_SETREGS: libc::c_uint = 13;
const PTRACE_GETREGSET: libc::c_uint = 0x4204;
const PTRACE_SEIZE: libc::c_uint = 0x4206;
const PTRACE_INTERRUPT: libc::c_uint = 0x4207;
const PTRACE_PEEKSIGINFO: libc::c_uint = 0x4209;
const PTRACE_GETSIGMASK: libc::c_uint = 0x420a;
const PTRACE_SETSIGMASK: libc::c_uint = 0x420b;
const PTRACE_GET_RSEQ_CONFIGURATION: libc::c_uint = 0x420f;
const PTRACE_GETSIGINFO: libc::c_uint = 0x4202;
const NT_X86_XSTATE: usize = 0x202;
/// `PTRACE_PEEKSIGINFO_SHARED`: the process-wide queue.
const PEEKSIGINFO_SHARED: u32 = 1;
/// Largest XSAVE area we read (AMX tile data makes it ~11 KiB).
pub const MAX_XSTATE: usize = 16 << 10;

fn req(what: &'static str, tid: i32, r: libc::c_long) -> Result<libc::c_long> {
    if r < 0 {
        Err(MigrateError::Ptrace { what, tid, source: std::io::Error::last_os_error() })
    } else {
        Ok(r)
    }
}

/// Attach without stopping.
pub fn seize(tid: i32) -> Result<()> {
    // SAFETY: PTRACE_SEIZE takes a tid and integer options.
    req("PTRACE_SEIZE", tid, unsafe { libc::ptrace(PTRACE_SEIZE, tid, 0, 0) }).map(drop)
}

/// Ask a seized thread to stop (it reports `PTRACE_EVENT_STOP`).
pub fn interrupt(tid: i32) -> Result<()> {
    // SAFETY: integer arguments.
    req("PTRACE_INTERRUPT", tid, unsafe { libc::ptrace(PTRACE_INTERRUPT, tid, 0, 0) }).map(drop)
}

/// Resume a stopped thread, delivering `sig` (0: none).
pub fn cont(tid: i32, sig: i32) -> Result<()> {
    // SAFETY: integer arguments.
    req("PTRACE_CONT", tid, unsafe { libc::ptrace(libc::PTRACE_CONT, tid, 0, sig) }).map(drop)
}

/// Detach (the thread runs on), delivering `sig` (0: none).
pub fn detach(tid: i32, sig: i32) -> Result<()> {
    // SAFETY: integer arguments.
    req("PTRACE_DETACH", tid, unsafe { libc::ptrace(libc::PTRACE_DETACH, tid, 0, sig) }).map(drop)
}

/// How a traced thread stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// `PTRACE_INTERRUPT` (or a group stop) took effect.
    Event,
    /// A signal is about to be delivered: it was dequeued and is ours to
    /// deliver or keep.
    Signal(i32),
    /// The thread exited (or was killed).
    Exited,
}

/// Wait for `tid` to stop.
pub fn wait_stop(tid: i32) -> Result<Stop> {
    loop {
        let mut status = 0;
        // SAFETY: waits for a traced thread; status is a live local.
        let r = unsafe { libc::waitpid(tid, &mut status, libc::__WALL) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            if e.raw_os_error() == Some(libc::ECHILD) {
                return Ok(Stop::Exited);
            }
            return Err(MigrateError::Ptrace { what: "waitpid", tid, source: e });
        }
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            return Ok(Stop::Exited);
        }
        if libc::WIFSTOPPED(status) {
            let sig = libc::WSTOPSIG(status);
            let event = (status >> 16) & 0xff;
            // PTRACE_EVENT_STOP (128): interrupt or group stop; a plain
            // SIGTRAP is our own int3 (injection).
            if event == 128 || sig == libc::SIGTRAP {
                return Ok(Stop::Event);
            }
            return Ok(Stop::Signal(sig));
        }
    }
}

pub fn get_regs(tid: i32) -> Result<GpRegs> {
    let mut regs = GpRegs::default();
    // SAFETY: PTRACE_GETREGS writes a user_regs_struct, which GpRegs is.
    req("PTRACE_GETREGS", tid, unsafe { libc::ptrace(PTRACE_GETREGS, tid, 0, &mut regs as *mut GpRegs) })?;
    Ok(regs)
}

pub fn set_regs(tid: i32, regs: &GpRegs) -> Result<()> {
    // SAFETY: PTRACE_SETREGS reads a user_regs_struct, which GpRegs is.
    req("PTRACE_SETREGS", tid, unsafe { libc::ptrace(PTRACE_SETREGS, tid, 0, regs as *const GpRegs) }).map(drop)
}

/// The thread's XSAVE area, as the kernel's uabi format (its software
/// bytes at 464 describe it).
pub fn get_xstate(tid: i32) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; MAX_XSTATE];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: GETREGSET writes at most iov_len bytes into buf and updates iov_len.
    req("PTRACE_GETREGSET(NT_X86_XSTATE)", tid, unsafe {
        libc::ptrace(PTRACE_GETREGSET, tid, NT_X86_XSTATE, &mut iov as *mut libc::iovec)
    })?;
    buf.truncate(iov.iov_len);
    Ok(buf)
}

pub fn get_sigmask(tid: i32) -> Result<u64> {
    let mut mask = 0u64;
    // SAFETY: GETSIGMASK writes an 8-byte sigset.
    req("PTRACE_GETSIGMASK", tid, unsafe { libc::ptrace(PTRACE_GETSIGMASK, tid, 8, &mut mask as *mut u64) })?;
    Ok(mask)
}

pub fn set_sigmask(tid: i32, mask: u64) -> Result<()> {
    // SAFETY: SETSIGMASK reads an 8-byte sigset.
    req("PTRACE_SETSIGMASK", tid, unsafe { libc::ptrace(PTRACE_SETSIGMASK, tid, 8, &mask as *const u64) }).map(drop)
}

/// The siginfo of the signal the thread is stopped for.
pub fn get_siginfo(tid: i32) -> Result<SigInfo> {
    let mut info = SigInfo([0; 16]);
    // SAFETY: GETSIGINFO writes a 128-byte siginfo.
    req("PTRACE_GETSIGINFO", tid, unsafe { libc::ptrace(PTRACE_GETSIGINFO, tid, 0, &mut info as *mut SigInfo) })?;
    Ok(info)
}

#[repr(C)]
struct PeekSiginfoArgs {
    off: u64,
    flags: u32,
    nr: i32,
}

/// Queued signals of the thread (`shared`: of the process), in order.
pub fn pending(tid: i32, shared: bool) -> Result<Vec<SigInfo>> {
    let mut out = Vec::new();
    loop {
        let mut batch = [SigInfo([0; 16]); 32];
        let args = PeekSiginfoArgs { off: out.len() as u64, flags: if shared { PEEKSIGINFO_SHARED } else { 0 }, nr: 32 };
        // SAFETY: PEEKSIGINFO reads the args and writes up to nr siginfos.
        let n = req("PTRACE_PEEKSIGINFO", tid, unsafe {
            libc::ptrace(PTRACE_PEEKSIGINFO, tid, &args as *const PeekSiginfoArgs, batch.as_mut_ptr())
        })?;
        let n = usize::try_from(n).unwrap_or(0);
        out.extend_from_slice(&batch[..n.min(32)]);
        if n < 32 {
            return Ok(out);
        }
    }
}

#[repr(C)]
#[derive(Default)]
struct RseqConfiguration {
    rseq_abi_pointer: u64,
    rseq_abi_size: u32,
    signature: u32,
    flags: u32,
    pad: u32,
}

/// The thread's rseq registration: (address, length, signature); address 0: none.
pub fn rseq(tid: i32) -> Result<(u64, u64, u64)> {
    let mut c = RseqConfiguration::default();
    // SAFETY: writes a struct ptrace_rseq_configuration of the given size.
    req("PTRACE_GET_RSEQ_CONFIGURATION", tid, unsafe {
        libc::ptrace(PTRACE_GET_RSEQ_CONFIGURATION, tid, std::mem::size_of::<RseqConfiguration>(), &mut c as *mut RseqConfiguration)
    })?;
    Ok((c.rseq_abi_pointer, u64::from(c.rseq_abi_size), u64::from(c.signature)))
}

/// The thread's robust-list registration: (head, length).
pub fn robust_list(tid: i32) -> Result<(u64, u64)> {
    let (mut head, mut len) = (0u64, 0usize);
    // SAFETY: get_robust_list writes the head pointer and its length.
    let r = unsafe { libc::syscall(libc::SYS_get_robust_list, tid, &mut head as *mut u64, &mut len as *mut usize) };
    req("get_robust_list", tid, r)?;
    Ok((head, len as u64))
}

/// Read one word of the thread's memory.
pub fn peek(tid: i32, addr: u64) -> Result<u64> {
    // SAFETY: PEEKDATA returns the word; errno tells errors apart from data.
    unsafe {
        *libc::__errno_location() = 0;
        let v = libc::ptrace(libc::PTRACE_PEEKDATA, tid, addr, 0);
        if v == -1 && *libc::__errno_location() != 0 {
            return Err(MigrateError::Ptrace { what: "PTRACE_PEEKDATA", tid, source: std::io::Error::last_os_error() });
        }
        Ok(v.cast_unsigned())
    }
}

/// Write one word of the thread's memory (text pages too).
pub fn poke(tid: i32, addr: u64, word: u64) -> Result<()> {
    // SAFETY: POKEDATA writes one word into the traced process.
    req("PTRACE_POKEDATA", tid, unsafe { libc::ptrace(libc::PTRACE_POKEDATA, tid, addr, word) }).map(drop)
}
