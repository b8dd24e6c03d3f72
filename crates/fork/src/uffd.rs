//! Minimal userfaultfd handler-side interface: read events, and the
//! COPY / ZEROPAGE / WAKE ioctls. The kernel ABI (numbers, layouts) is
//! `starling_image::abi::uffd`, shared with the restorer and the dirty tracker.

use std::os::fd::{AsRawFd, OwnedFd};

use starling_image::abi::uffd::{
    UffdioCopy, UffdioRange, UffdioZeropage, UFFDIO_COPY, UFFDIO_WAKE, UFFDIO_ZEROPAGE, UFFD_EVENT_FORK, UFFD_EVENT_PAGEFAULT,
    UFFD_EVENT_REMAP, UFFD_EVENT_REMOVE, UFFD_EVENT_UNMAP, UFFD_MSG_BYTES,
};

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
        let mut msg = [0u8; UFFD_MSG_BYTES];
        loop {
            // SAFETY: reads at most UFFD_MSG_BYTES into our buffer.
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
            if usize::try_from(n).ok() != Some(UFFD_MSG_BYTES) {
                return Err(std::io::Error::other(format!("short userfaultfd message ({n} bytes)")));
            }
            break;
        }
        let u = |off: usize| u64::from_le_bytes(msg[off..off + 8].try_into().expect("8 bytes"));
        // Union starts at offset 8.
        Ok(Some(match msg[0] {
            UFFD_EVENT_PAGEFAULT => Event::Pagefault { addr: u(16) },
            UFFD_EVENT_FORK => Event::Fork,
            UFFD_EVENT_REMAP => Event::Remap { from: u(8), to: u(16), len: u(24) },
            UFFD_EVENT_REMOVE => Event::Remove { start: u(8), end: u(16) },
            UFFD_EVENT_UNMAP => Event::Unmap { start: u(8), end: u(16) },
            other => Event::Unknown(other),
        }))
    }

    /// UFFDIO_COPY one buffer to `dst` (in the clone) and wake waiters.
    /// Returns the errno on failure.
    pub fn copy(&self, dst: u64, src: &[u8]) -> Result<(), i32> {
        let mut c = UffdioCopy { dst, src: src.as_ptr() as u64, len: src.len() as u64, mode: 0, copy: 0 };
        // SAFETY: the kernel reads `src.len()` bytes from our live slice and
        // writes into the clone's registered range (validated by the kernel
        // against the clone's mm, not ours).
        let r = unsafe { libc::ioctl(self.raw(), UFFDIO_COPY, &mut c as *mut UffdioCopy) };
        if r < 0 { Err(errno()) } else { Ok(()) }
    }

    /// UFFDIO_ZEROPAGE a range and wake waiters.
    pub fn zeropage(&self, start: u64, len: u64) -> Result<(), i32> {
        let mut z = UffdioZeropage { range: UffdioRange { start, len }, mode: 0, zeropage: 0 };
        // SAFETY: the kernel reads/writes only the struct we pass.
        let r = unsafe { libc::ioctl(self.raw(), UFFDIO_ZEROPAGE, &mut z as *mut UffdioZeropage) };
        if r < 0 { Err(errno()) } else { Ok(()) }
    }

    pub fn wake(&self, start: u64, len: u64) {
        let mut rg = UffdioRange { start, len };
        // SAFETY: the kernel reads only the struct we pass.
        unsafe { libc::ioctl(self.raw(), UFFDIO_WAKE, &mut rg as *mut UffdioRange) };
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}
