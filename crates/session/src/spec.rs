//! Capturing the caller's configuration: what makes the remote task behave
//! as if it ran here.

use starling_proto::{TaskSpec, WirePath};
use std::ffi::OsString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("cannot determine the current directory: {0}")]
    Cwd(#[source] std::io::Error),
    #[error("the current directory cannot be exported: {0}")]
    CwdPath(#[source] starling_proto::ProtoError),
}

/// Resources carried to the task (all of getrlimit's on Linux).
const RLIMITS: std::ops::Range<u32> = 0..16;

pub fn now_ns() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

pub fn current_umask() -> u32 {
    // SAFETY: umask(2) cannot fail; we immediately restore the value we read.
    unsafe {
        let m = libc::umask(0o022);
        libc::umask(m);
        m as u32
    }
}

/// The spec for running `argv` as if here and now.
pub fn capture(argv: Vec<OsString>) -> Result<TaskSpec, SpecError> {
    let cwd = std::env::current_dir().map_err(SpecError::Cwd)?;
    let cwd = WirePath::new(cwd.as_os_str().as_bytes().to_vec()).map_err(SpecError::CwdPath)?;
    let mut rlimits = Vec::new();
    for r in RLIMITS {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: `lim` is a valid out-pointer for the duration of the call.
        if unsafe { libc::getrlimit(r as _, &mut lim) } == 0 {
            rlimits.push((r, lim.rlim_cur, lim.rlim_max));
        }
    }
    let groups = nix::unistd::getgroups().map(|g| g.into_iter().map(|g| g.as_raw()).collect()).unwrap_or_default();
    Ok(TaskSpec {
        argv: argv.into_iter().map(|a| a.into_vec()).collect(),
        env: std::env::vars_os().map(|(k, v)| (k.into_vec(), v.into_vec())).collect(),
        cwd,
        umask: current_umask(),
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
        groups,
        rlimits,
        host: None,
        job: None,
        prethrow: Vec::new(),
        listings: Vec::new(),
        launch_ns: now_ns(),
        clone: None,
        policy: None,
        x11: None,
        terminal: None,
    })
}
