//! Minimal userfaultfd handler-side interface (the `userfaultfd` crate needs
//! libclang at build time, which this platform lacks): read events, and the
//! COPY / ZEROPAGE / WAKE ioctls. Layouts are from `<linux/userfaultfd.h>`.

use std::os::fd::{AsRawFd, OwnedFd};

const UFFDIO_WAKE: libc::c_ulong = 0x8010_aa02;
const UFFDIO_COPY: libc::c_ulong = 0xc028_aa03;
const UFFDIO_ZEROPAGE: libc::c_ulong = 0xc020_aa04;

const EVENT_PAGEFAULT: u8 = 0x12;
const EVENT_FORK: u8 = 0x13;
const EVENT_REMAP: u8 = 0x14;
const EVENT_REMOVE: u8 = 0x15;
const EVENT_UNMAP: u8 = 0x16;

/// One userfaultfd message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Pagefault { addr: u64 },
    Fork,
    Remap { from: u64, to: u64, len: u64 },
    Remove { start: u64, end: u64 },
    Unmap { start: u64, end: u64 },
    Unknown(u8),
}

pub struct Uffd(OwnedFd);

#[repr(C)]
struct Range {
    start: u64,
    len: u64,
}

#[repr(C)]
struct Copy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
struct Zeropage {
    range: Range,
    mode: u64,
    zeropage: i64,
}

impl Uffd {
    /// Wrap a userfaultfd (opened O_NONBLOCK by the restorer).
    pub fn new(fd: OwnedFd) -> Uffd {
        Uffd(fd)
    }

    pub fn raw(&self) -> i32 {
        self.0.as_raw_fd()
    }

    /// Read one pending event; Ok(None) if none is pending.
    pub fn read_event(&self) -> std::io::Result<Option<Event>> {
        let mut msg = [0u8; 32];
        loop {
            // SAFETY: reads at most 32 bytes into our buffer.
            let n = unsafe { libc::read(self.raw(), msg.as_mut_ptr().cast(), msg.len()) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EAGAIN) => return Ok(None),
                    _ => return Err(e),
                }
            }
            if n == 0 {
                return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "userfaultfd EOF"));
            }
            if n != 32 {
                return Err(std::io::Error::other(format!("short userfaultfd message ({n} bytes)")));
            }
            break;
        }
        let u = |off: usize| u64::from_le_bytes(msg[off..off + 8].try_into().expect("8 bytes"));
        // Union starts at offset 8.
        Ok(Some(match msg[0] {
            EVENT_PAGEFAULT => Event::Pagefault { addr: u(16) },
            EVENT_FORK => Event::Fork,
            EVENT_REMAP => Event::Remap { from: u(8), to: u(16), len: u(24) },
            EVENT_REMOVE => Event::Remove { start: u(8), end: u(16) },
            EVENT_UNMAP => Event::Unmap { start: u(8), end: u(16) },
            other => Event::Unknown(other),
        }))
    }

    /// UFFDIO_COPY one buffer to `dst` (in the clone) and wake waiters.
    /// Returns the errno on failure.
    pub fn copy(&self, dst: u64, src: &[u8]) -> Result<(), i32> {
        let mut c = Copy { dst, src: src.as_ptr() as u64, len: src.len() as u64, mode: 0, copy: 0 };
        // SAFETY: the kernel reads `src.len()` bytes from our live slice and
        // writes into the clone's registered range (validated by the kernel
        // against the clone's mm, not ours).
        let r = unsafe { libc::ioctl(self.raw(), UFFDIO_COPY, &mut c as *mut Copy) };
        if r < 0 { Err(errno()) } else { Ok(()) }
    }

    /// UFFDIO_ZEROPAGE a range and wake waiters.
    pub fn zeropage(&self, start: u64, len: u64) -> Result<(), i32> {
        let mut z = Zeropage { range: Range { start, len }, mode: 0, zeropage: 0 };
        // SAFETY: the kernel reads/writes only the struct we pass.
        let r = unsafe { libc::ioctl(self.raw(), UFFDIO_ZEROPAGE, &mut z as *mut Zeropage) };
        if r < 0 { Err(errno()) } else { Ok(()) }
    }

    pub fn wake(&self, start: u64, len: u64) {
        let mut rg = Range { start, len };
        // SAFETY: the kernel reads only the struct we pass.
        unsafe { libc::ioctl(self.raw(), UFFDIO_WAKE, &mut rg as *mut Range) };
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}
