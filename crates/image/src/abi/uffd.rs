//! The userfaultfd kernel ABI (`<linux/userfaultfd.h>`, x86-64), in one place for its three users:
//! the restorer registers a restored process's lazy regions (`UFFDIO_API`, `UFFDIO_REGISTER`
//! MISSING), the fork crate's fault handler answers faults (`UFFDIO_COPY`, `UFFDIO_ZEROPAGE`,
//! `UFFDIO_WAKE`, the event codes), and the migrate crate's dirty tracker write-protects
//! (`UFFDIO_WRITEPROTECT`, `WP_ASYNC`). The `userfaultfd` crate is not used: it needs libclang at
//! build time, which this platform lacks, and the restorer has no std.

/// `_IOWR(0xAA, 0x3F, struct uffdio_api)`.
pub const UFFDIO_API: u64 = 0xc018_aa3f;
/// `_IOWR(0xAA, 0x00, struct uffdio_register)`.
pub const UFFDIO_REGISTER: u64 = 0xc020_aa00;
/// `_IOR(0xAA, 0x02, struct uffdio_range)`.
pub const UFFDIO_WAKE: u64 = 0x8010_aa02;
/// `_IOWR(0xAA, 0x03, struct uffdio_copy)`.
pub const UFFDIO_COPY: u64 = 0xc028_aa03;
/// `_IOWR(0xAA, 0x04, struct uffdio_zeropage)`.
pub const UFFDIO_ZEROPAGE: u64 = 0xc020_aa04;
/// `_IOWR(0xAA, 0x06, struct uffdio_writeprotect)`.
pub const UFFDIO_WRITEPROTECT: u64 = 0xc018_aa06;

/// `_IO(0xAA, 0x00)` on `/dev/userfaultfd`: a userfaultfd for the caller's mm, with the device's
/// file permissions standing in for the privilege the syscall wants (kernel-mode faults).
pub const USERFAULTFD_IOC_NEW: u64 = 0xaa00;
/// The device an admin may grant to a user whose agent runs without root.
pub const USERFAULTFD_DEVICE: &str = "/dev/userfaultfd";

/// The API version `UFFDIO_API` expects.
pub const UFFD_API: u64 = 0xaa;
/// `userfaultfd(2)` flag: no kernel-mode faults, so no privilege needed.
pub const UFFD_USER_MODE_ONLY: u64 = 1;

pub const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
pub const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
pub const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
pub const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;

pub const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
pub const UFFDIO_REGISTER_MODE_WP: u64 = 2;
pub const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1;

/// `struct uffd_msg` is 32 bytes: the event code, then a union at offset 8.
pub const UFFD_MSG_BYTES: usize = 32;
pub const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
pub const UFFD_EVENT_FORK: u8 = 0x13;
pub const UFFD_EVENT_REMAP: u8 = 0x14;
pub const UFFD_EVENT_REMOVE: u8 = 0x15;
pub const UFFD_EVENT_UNMAP: u8 = 0x16;

#[repr(C)]
pub struct UffdioApi {
    pub api: u64,
    pub features: u64,
    pub ioctls: u64,
}

#[repr(C)]
pub struct UffdioRange {
    pub start: u64,
    pub len: u64,
}

#[repr(C)]
pub struct UffdioRegister {
    pub range: UffdioRange,
    pub mode: u64,
    pub ioctls: u64,
}

#[repr(C)]
pub struct UffdioCopy {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
    pub mode: u64,
    pub copy: i64,
}

#[repr(C)]
pub struct UffdioZeropage {
    pub range: UffdioRange,
    pub mode: u64,
    pub zeropage: i64,
}

#[repr(C)]
pub struct UffdioWriteprotect {
    pub range: UffdioRange,
    pub mode: u64,
}
