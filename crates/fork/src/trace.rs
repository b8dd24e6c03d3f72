//! TEMPORARY (not for merge): stage time stamps of the fault path, dumped to /tmp.
use std::sync::Mutex;
static MARKS: Mutex<Vec<(u32, &'static str, u64)>> = Mutex::new(Vec::new());
pub fn now() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}
pub fn mark(what: &'static str) {
    let t = now();
    let tid = unsafe { libc::gettid() } as u32;
    if let Ok(mut m) = MARKS.lock() {
        if m.len() < 1_000_000 { m.push((tid, what, t)); }
    }
}
pub fn dump(role: &str) {
    let Ok(mut m) = MARKS.lock() else { return };
    if m.is_empty() { return; }
    let mut s = String::new();
    for (tid, w, t) in m.drain(..) { s.push_str(&format!("{tid} {w} {t}\n")); }
    let _ = std::fs::write(format!("/tmp/sftrace-{role}-{}-{}.txt", std::process::id(), now()), s);
}
