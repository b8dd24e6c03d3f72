//! The C ABI (`include/starling.h`), re-exported by `starling-capi`.
//!
//! Errors are reported as -1/NULL plus a thread-local message read with
//! `sf_last_error`. Nothing here unwinds into C: every entry point catches
//! panics.

use crate::api::Ticket;
use crate::ForkError;
use starling_config::{Config, Sources};
use starling_image::abi::counters::CloneCounter;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_longlong, CString};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: String) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

fn guard<T>(fail: T, f: impl FnOnce() -> crate::Result<T>) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            set_error(e.to_string());
            fail
        }
        Err(_) => {
            set_error("internal error (panic)".into());
            fail
        }
    }
}

/// Opaque to C.
pub type SfTicket = Ticket;

/// The configuration, read here at the C ABI's edge (the config file, then
/// `STARLING_*`) on every ticket request, so a program may change its
/// environment between tickets.
fn config() -> crate::Result<Config> {
    let env = |k: &str| std::env::var_os(k);
    Ok(Config::load(&Sources { file: None, env: &env, euid: nix::unistd::geteuid().as_raw() })?)
}

#[no_mangle]
pub extern "C" fn sf_request_ticket(n: c_int, hierarchical: bool) -> *mut SfTicket {
    guard(std::ptr::null_mut(), || Ok(Box::into_raw(Box::new(Ticket::request(n, hierarchical, &config()?)?))))
}

/// # Safety
/// `t` is NULL or a ticket from `sf_request_ticket` not yet released.
#[no_mangle]
pub unsafe extern "C" fn sf_ticket_allocation(t: *const SfTicket) -> c_int {
    // SAFETY: per the contract, t is NULL or valid.
    match unsafe { t.as_ref() } {
        Some(t) => t.allocation.cast_signed(),
        None => {
            set_error("NULL ticket".into());
            -1
        }
    }
}

/// # Safety
/// As `sf_ticket_allocation`, and not used concurrently from another thread.
#[no_mangle]
pub unsafe extern "C" fn sf_clone(t: *mut SfTicket) -> c_int {
    // SAFETY: per the contract.
    let Some(t) = (unsafe { t.as_mut() }) else {
        set_error("NULL ticket".into());
        return -1;
    };
    guard(-1, || t.clone_now().map(u32::cast_signed))
}

#[no_mangle]
pub extern "C" fn sf_exit(status: c_int) -> ! {
    // exit (not _exit): atexit handlers and stdio flushing deliver results.
    // SAFETY: terminates the process.
    unsafe { libc::exit(status) }
}

/// # Safety
/// As `sf_clone`.
#[no_mangle]
pub unsafe extern "C" fn sf_join(t: *mut SfTicket) -> c_int {
    // SAFETY: per the contract.
    let Some(t) = (unsafe { t.as_mut() }) else {
        set_error("NULL ticket".into());
        return -1;
    };
    guard(-1, || {
        t.join()?;
        match t.unsuccessful() {
            None => Ok(0),
            Some(why) => Err(ForkError::Unsuccessful(why)),
        }
    })
}

/// # Safety
/// As `sf_clone`.
#[no_mangle]
pub unsafe extern "C" fn sf_kill(t: *mut SfTicket) -> c_int {
    // SAFETY: per the contract.
    let Some(t) = (unsafe { t.as_mut() }) else {
        set_error("NULL ticket".into());
        return -1;
    };
    guard(-1, || t.kill().map(|_| 0))
}

/// # Safety
/// As `sf_ticket_allocation`.
#[no_mangle]
pub unsafe extern "C" fn sf_clone_status(t: *const SfTicket, id: c_int) -> c_int {
    // SAFETY: per the contract.
    let Some(t) = (unsafe { t.as_ref() }) else { return -1 };
    t.clone_status(id).unwrap_or(-1)
}

/// Extension: counters of clone `id`'s fault handler; `which` is a
/// `starling_image::abi::counters::CloneCounter` (`SF_CLONE_STAT_*`): 0
/// faults, 1 pages fetched from the page server, 2 zero-filled, 3 read from
/// files, 4 fetch requests, 5 remove/unmap events, 6 distribution mode, 7
/// pages multicast without asking. -1 if unknown.
///
/// # Safety
/// As `sf_ticket_allocation`.
#[no_mangle]
pub unsafe extern "C" fn sf_clone_stat(t: *const SfTicket, id: c_int, which: c_int) -> c_longlong {
    // SAFETY: per the contract.
    let Some(t) = (unsafe { t.as_ref() }) else { return -1 };
    match (t.clone_stats(id), CloneCounter::from_index(which)) {
        (Some(s), Some(c)) => c_longlong::try_from(s.get(c)).unwrap_or(c_longlong::MAX),
        _ => -1,
    }
}

/// Extension: what the parent's host sent for the ticket (sender-side
/// counters of the TCP page server and the multicast sender); `which`:
/// 0 bytes on the wire (TCP + multicast, headers included), 1 TCP bytes,
/// 2 multicast bytes, 3 pages requested, 4 pages served (sent), 5 rate
/// cuts, 6 implicit losses, 7 lockstep-suppressed requests, 8 pages
/// pushed, 9 lowest rate limit (bytes/s), 10 rate limit now. -1 if the
/// ticket has not cloned or `which` is out of range.
///
/// # Safety
/// As `sf_ticket_allocation`.
#[no_mangle]
pub unsafe extern "C" fn sf_ticket_stat(t: *const SfTicket, which: c_int) -> c_longlong {
    // SAFETY: per the contract.
    let Some(t) = (unsafe { t.as_ref() }) else { return -1 };
    match (t.wire_stats(), usize::try_from(which)) {
        // The counter's bits as a long long (counts stay far below 2^63).
        (Some(w), Ok(i)) => w.to_array().get(i).map_or(-1, |&v| v.cast_signed()),
        _ => -1,
    }
}

/// Extension: size in bytes of the ticket's encoded descriptor (-1 if none).
///
/// # Safety
/// As `sf_ticket_allocation`.
#[no_mangle]
pub unsafe extern "C" fn sf_descriptor_bytes(t: *const SfTicket) -> c_longlong {
    // SAFETY: per the contract.
    let Some(t) = (unsafe { t.as_ref() }) else { return -1 };
    // A buffer's length is at most isize::MAX, so this never saturates.
    t.descriptor_bytes().map_or(-1, |n| c_longlong::try_from(n).unwrap_or(c_longlong::MAX))
}

/// Extension: free a ticket (kills its clones if not joined).
///
/// # Safety
/// `t` is NULL or a ticket from `sf_request_ticket`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn sf_release_ticket(t: *mut SfTicket) {
    if !t.is_null() {
        // SAFETY: per the contract, we own the box.
        drop(unsafe { Box::from_raw(t) });
    }
}

/// Extension: what became of clone `id`: 0 running (or unknown id),
/// 1 exited, 2 killed by a signal, 3 lost (host or head lost, restore
/// failed; nothing was committed). -1 for a NULL ticket.
///
/// # Safety
/// As `sf_ticket_allocation`.
#[no_mangle]
pub unsafe extern "C" fn sf_clone_state(t: *const SfTicket, id: c_int) -> c_int {
    use crate::cluster::CloneState;
    // SAFETY: per the contract.
    let Some(t) = (unsafe { t.as_ref() }) else { return -1 };
    match t.clone_state(id) {
        None | Some(CloneState::Running) => 0,
        Some(CloneState::Exited(_)) => 1,
        Some(CloneState::Killed(_)) => 2,
        Some(CloneState::Lost(_)) => 3,
    }
}

/// Extension: the granted hosts whose clones run with their host's whole network rather than the
/// ticket's own (`fork.isolate_network = on` and hosts that cannot enforce it): returns how many
/// (0 for none and for the local backend), -1 for a NULL ticket. Host `i` (0-based) is written to
/// `buf` as `NAME\tWHY`, cut to `len - 1` bytes and NUL-terminated; nothing is written when `i`
/// is out of range, `buf` is NULL or `len` is 0.
///
/// # Safety
/// As `sf_ticket_allocation`; `buf` is NULL or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn sf_ticket_unisolated(t: *const SfTicket, i: c_int, buf: *mut c_char, len: usize) -> c_int {
    // SAFETY: per the contract.
    let Some(t) = (unsafe { t.as_ref() }) else {
        set_error("NULL ticket".into());
        return -1;
    };
    let hosts = t.unisolated();
    let entry = usize::try_from(i).ok().and_then(|i| hosts.get(i));
    if let (Some(u), false, true) = (entry, buf.is_null(), len > 0) {
        let text = format!("{}\t{}", u.host, u.why);
        let n = text.len().min(len - 1);
        // SAFETY: buf is valid for len bytes (the contract) and n < len; the source is a live String.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, n);
            *buf.add(n) = 0;
        }
    }
    c_int::try_from(hosts.len()).unwrap_or(c_int::MAX)
}

/// Extension: the address (IP) of the parent's host as clones reach it, in
/// the parent (after a cluster ticket) and in its clones; NULL otherwise.
#[no_mangle]
pub extern "C" fn sf_parent_host() -> *const c_char {
    crate::cluster::parent_host().map_or(std::ptr::null(), |c| c.as_ptr())
}

#[no_mangle]
pub extern "C" fn sf_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}
