//! A thread's registers.

/// x86-64 general-purpose registers, in the kernel's `struct
/// user_regs_struct` order (what `PTRACE_GETREGS` fills), so a capture
/// copies them as they are. `fs_base`/`gs_base` are part of it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct GpRegs {
    pub r15: u64,
    pub r14: u64,
    pub r13: u64,
    pub r12: u64,
    pub rbp: u64,
    pub rbx: u64,
    pub r11: u64,
    pub r10: u64,
    pub r9: u64,
    pub r8: u64,
    pub rax: u64,
    pub rcx: u64,
    pub rdx: u64,
    pub rsi: u64,
    pub rdi: u64,
    /// The system call the thread is in (-1 if none): `PTRACE_GETREGS`'s
    /// view; not restored (`rt_sigreturn` does no syscall restart).
    pub orig_rax: u64,
    pub rip: u64,
    pub cs: u64,
    pub eflags: u64,
    pub rsp: u64,
    pub ss: u64,
    pub fs_base: u64,
    pub gs_base: u64,
    pub ds: u64,
    pub es: u64,
    pub fs: u64,
    pub gs: u64,
}

/// 64-bit user code segment selector.
pub const USER_CS: u64 = 0x33;
/// User data/stack segment selector.
pub const USER_SS: u64 = 0x2b;
/// RFLAGS of a freshly resumed thread: IF and the always-one bit.
pub const USER_EFLAGS: u64 = 0x202;

/// Size of the legacy FXSAVE area: the least FPU state a thread carries
/// (x87, MXCSR, XMM). An XSAVE area (AVX and beyond) is larger and starts
/// with the same 512 bytes.
pub const FXSAVE_BYTES: usize = 512;
/// Offset of the software-reserved bytes in an FXSAVE/XSAVE area, where the
/// kernel's signal frames keep `struct _fpx_sw_bytes`.
pub const FPX_SW_BYTES_OFFSET: usize = 464;
/// `_fpx_sw_bytes.magic1`: this area is an extended (XSAVE) frame.
pub const FP_XSTATE_MAGIC1: u32 = 0x4650_5853;
/// Written right after the XSAVE area of a signal frame.
pub const FP_XSTATE_MAGIC2: u32 = 0x4650_5845;
/// The FPU area must sit at this alignment in a signal frame (XRSTOR).
pub const FPU_ALIGN: u64 = 64;

/// An FXSAVE area, aligned as `fxsave64` requires.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
pub struct FxSave(pub [u8; FXSAVE_BYTES]);

impl FxSave {
    pub const fn zeroed() -> FxSave {
        FxSave([0; FXSAVE_BYTES])
    }
}

impl core::fmt::Debug for FxSave {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "FxSave({} bytes)", FXSAVE_BYTES)
    }
}
