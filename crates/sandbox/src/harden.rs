//! What an ordinary task gives up before its program starts: new privileges
//! (`PR_SET_NO_NEW_PRIVS`), every capability when it is not root, and the
//! system calls no task needs (a seccomp filter built with `seccompiler`).
//!
//! Order in the task (PID 2), see `init::task_main`:
//!
//! ```text
//! drop_privileged_sets (still root: bounding set, ambient)  — only when uid != 0
//! drop_network_admin (still root: two capabilities, all sets) — a clone of an isolated ticket
//! setgroups / setgid / setuid                               — permitted, effective cleared by the kernel
//! clear_capabilities (inheritable too)                      — only when uid != 0
//! install_filter (no_new_privs, then the filter)            — every confined task
//! execve
//! ```
//!
//! The sandbox's own mounts (`/proc`, `/dev`) are made by PID 1 before the
//! task exists, so the filter refusing `mount` costs the task nothing.

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};
use std::collections::BTreeMap;

/// A hardening step that failed (the task is not started).
#[derive(Debug, thiserror::Error)]
pub enum HardenError {
    #[error("cannot drop capability {cap} from the bounding set: {source}")]
    BoundingSet { cap: u32, source: nix::errno::Errno },
    #[error("cannot clear the ambient capabilities: {0}")]
    Ambient(nix::errno::Errno),
    #[error("cannot clear the capability sets: {0}")]
    Capset(nix::errno::Errno),
    #[error("cannot set no_new_privs: {0}")]
    NoNewPrivs(nix::errno::Errno),
    #[error("this architecture has no seccomp filter: {0}")]
    Arch(seccompiler::BackendError),
    #[error("cannot build the seccomp filter: {0}")]
    Build(seccompiler::BackendError),
    #[error("cannot install the seccomp filter: {0}")]
    Install(seccompiler::Error),
}

/// System calls a task gets `EPERM` for, by name (for docs and messages).
///
/// Kernel modules, kexec, bpf, perf events, the kernel keyring, reboot,
/// swap, file handles (`open_by_handle_at` escapes a chroot), mounting
/// (old and new mount API) and `ptrace`. Debugging one's own children is a
/// legitimate need; it is refused for now (see docs/SECURITY.md).
pub const DENIED_SYSCALLS: [(&str, libc::c_long); 25] = [
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("reboot", libc::SYS_reboot),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("fsopen", libc::SYS_fsopen),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fspick", libc::SYS_fspick),
    ("move_mount", libc::SYS_move_mount),
    ("open_tree", libc::SYS_open_tree),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("ptrace", libc::SYS_ptrace),
];

/// x86-64's x32 ABI numbers the same calls with this bit set, under the same
/// audit architecture: a deny list must name both.
#[cfg(target_arch = "x86_64")]
const X32_SYSCALL_BIT: libc::c_long = 0x4000_0000;

/// The filter: every call of [`DENIED_SYSCALLS`] returns `EPERM`, everything
/// else is allowed; a call from another architecture (i386 `int 0x80`)
/// kills the process (seccompiler's architecture check).
pub fn task_filter() -> Result<BpfProgram, HardenError> {
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(HardenError::Arch)?;
    let mut rules = BTreeMap::new();
    for (_, nr) in DENIED_SYSCALLS {
        rules.insert(nr, Vec::new());
        #[cfg(target_arch = "x86_64")]
        rules.insert(nr | X32_SYSCALL_BIT, Vec::new());
    }
    let eperm = u32::try_from(libc::EPERM).expect("EPERM is a small positive number");
    SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(eperm), arch)
        .and_then(BpfProgram::try_from)
        .map_err(HardenError::Build)
}

/// [`task_filter`] as raw `struct sock_filter`s (8 bytes each, native
/// byte order), for a restore plan: the restorer of a moved task installs
/// it as the process resumes.
pub fn task_filter_bytes() -> Result<Vec<u8>, HardenError> {
    Ok(task_filter()?
        .iter()
        .flat_map(|i| {
            let mut b = [0u8; 8];
            b[0..2].copy_from_slice(&i.code.to_ne_bytes());
            b[2] = i.jt;
            b[3] = i.jf;
            b[4..8].copy_from_slice(&i.k.to_ne_bytes());
            b
        })
        .collect())
}

/// Still root, before the uid changes: empty the bounding set (needs
/// CAP_SETPCAP) and the ambient set, so nothing can come back by exec.
pub fn drop_privileged_sets() -> Result<(), HardenError> {
    // CAP_LAST_CAP is 40 today; stop at the first number the kernel does not know.
    for cap in 0..64u32 {
        match nix::errno::Errno::result(
            // SAFETY: prctl with integer arguments only.
            unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) },
        ) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINVAL) if cap > 0 => break,
            Err(source) => return Err(HardenError::BoundingSet { cap, source }),
        }
    }
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) };
    nix::errno::Errno::result(rc).map_err(HardenError::Ambient)?;
    Ok(())
}

/// After the uid changed: empty the effective, permitted and inheritable sets.
pub fn clear_capabilities() -> Result<(), HardenError> {
    let mut header = CapHeader { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
    let data = [CapData { effective: 0, permitted: 0, inheritable: 0 }; 2];
    // SAFETY: capset reads a version-3 header and two data records, both
    // live on our stack for the duration of the call.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut CapHeader, data.as_ptr()) };
    nix::errno::Errno::result(rc).map(drop).map_err(HardenError::Capset)
}

/// The capabilities a clone of an isolated ticket gives up: its ticket's rules are nftables rules
/// in the network namespace it shares with its host, which `CAP_NET_ADMIN` could change, and
/// `CAP_NET_RAW` would let it send packets of any shape past them.
/// (`CAP_NET_ADMIN` is 12, `CAP_NET_RAW` 13: linux/capability.h.)
pub const NETWORK_ADMIN: [u32; 2] = [12, 13];

/// Still root: drop [`NETWORK_ADMIN`] from the bounding set (so no `execve` gives them back), the
/// ambient set, and the effective, permitted and inheritable sets; every other capability stays.
pub fn drop_network_admin() -> Result<(), HardenError> {
    for cap in NETWORK_ADMIN {
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) };
        nix::errno::Errno::result(rc).map_err(|source| HardenError::BoundingSet { cap, source })?;
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_LOWER, libc::c_ulong::from(cap), 0, 0) };
        nix::errno::Errno::result(rc).map_err(HardenError::Ambient)?;
    }
    let mut header = CapHeader { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
    let mut data = [CapData { effective: 0, permitted: 0, inheritable: 0 }; 2];
    // SAFETY: capget writes two data records into `data` and reads the header, both live locals.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header as *mut CapHeader, data.as_mut_ptr()) };
    nix::errno::Errno::result(rc).map_err(HardenError::Capset)?;
    for cap in NETWORK_ADMIN {
        let (word, bit) = (usize::from(cap >= 32), 1u32 << (cap % 32));
        data[word].effective &= !bit;
        data[word].permitted &= !bit;
        data[word].inheritable &= !bit;
    }
    // SAFETY: capset reads the header and the two records, live locals; the sets only shrink.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut CapHeader, data.as_ptr()) };
    nix::errno::Errno::result(rc).map(drop).map_err(HardenError::Capset)
}

/// `struct __user_cap_header_struct`.
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct` (two of them in version 3: capabilities 0..32, 32..64).
#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// Set no_new_privs and install `filter` on this (single-threaded) process.
pub fn install_filter(filter: &BpfProgram) -> Result<(), HardenError> {
    // seccompiler sets it too; doing it here makes it explicit and unconditional.
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    nix::errno::Errno::result(rc).map_err(HardenError::NoNewPrivs)?;
    seccompiler::apply_filter(filter).map_err(HardenError::Install)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filter_builds_and_names_every_denied_call_once() {
        let prog = task_filter().expect("filter");
        // Architecture check (3) + load (1) + per call a compare and a return, + default.
        assert!(prog.len() > 3 + 2 * DENIED_SYSCALLS.len(), "filter of {} instructions is too short", prog.len());
        let mut numbers: Vec<_> = DENIED_SYSCALLS.iter().map(|&(_, nr)| nr).collect();
        numbers.sort_unstable();
        numbers.dedup();
        assert_eq!(numbers.len(), DENIED_SYSCALLS.len());
    }
}
