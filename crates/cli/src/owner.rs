//! `starling owner HOST -- CMD | --active | --idle`: play an emulated host's owner.

use anyhow::{bail, Context as _, Result};
use starling_cluster::LocalCluster;
use starling_config::Config;
use starling_linger::cgroup::{Controller, Hierarchies};
use starling_linger::owner::KEYBOARD_FILE;
use std::ffi::{CString, OsString};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};

pub fn run(cfg: &Config, host: &str, active: bool, idle: bool, command: Vec<OsString>) -> Result<i32> {
    let local = LocalCluster::new(cfg.instance, cfg.dirs());
    let Some(state) = local.load_state() else {
        bail!("no embedded cluster is running (instance {}); `starling owner` plays the owner of an emulated host of `starling up`", cfg.instance.number());
    };
    let Some(rec) = state.hosts.iter().find(|h| h.name == host) else {
        let names: Vec<&str> = state.hosts.iter().map(|h| h.name.as_str()).collect();
        bail!("no host {host:?} in the cluster (hosts: {})", names.join(", "));
    };
    if active || idle {
        let file = starling_cluster::host_dir(&state.state_dir, host).join("state").join(KEYBOARD_FILE);
        std::fs::write(&file, if active { "active\n" } else { "idle\n" }).with_context(|| format!("writing {}", file.display()))?;
        return Ok(0);
    }
    if command.is_empty() {
        bail!("give the owner workload after `--` (starling owner {host} -- CMD), or --active / --idle");
    }
    let h = Hierarchies::discover();
    let rel = starling_linger::guest::owner_rel(&rec.netns);
    let mut joins = Vec::new();
    // Blkio (where mounted) counts the owner's disk I/O for the guests' rate windows.
    let blkio = h.path(Controller::Blkio, &rel).ok().filter(|d| d.is_dir()).map(|_| Controller::Blkio);
    // The owner group in the cgroup2 mount (where the agent made it: its rate windows are on) is what
    // the owner's network I/O is counted by.
    let unified = h.unified().map(|u| u.join(&rel)).filter(|d| d.is_dir());
    let dirs = [Controller::Cpuacct, Controller::Memory].into_iter().chain(blkio).map(|c| h.path(c, &rel));
    for dir in dirs.chain(unified.map(Ok)) {
        let procs = dir?.join("cgroup.procs");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&procs)
            .with_context(|| format!("host {host}'s owner cgroup {} (is its agent running?)", procs.display()))?;
        joins.push(f);
    }
    // The host's namespaces and root are its agent's (the boot process execs the agent).
    let pid = rec.boot_pid;
    let ns = |n: &str| File::open(format!("/proc/{pid}/ns/{n}")).with_context(|| format!("host {host}'s {n} namespace (agent pid {pid})"));
    let (net, uts, mnt) = (ns("net")?, ns("uts")?, ns("mnt")?);
    let root = File::open(format!("/proc/{pid}/root")).with_context(|| format!("host {host}'s root"))?;
    let cwd = CString::new(std::env::current_dir().context("the current directory")?.as_os_str().as_bytes())
        .context("the current directory has a NUL byte")?;
    let fds: Vec<i32> = joins.iter().map(AsRawFd::as_raw_fd).collect();
    let (net, uts, mnt, rootfd) = (net.as_raw_fd(), uts.as_raw_fd(), mnt.as_raw_fd(), root.as_raw_fd());
    let mut cmd = std::process::Command::new(&command[0]);
    cmd.args(&command[1..]);
    // SAFETY: the closure runs in the forked (single-threaded) child before exec and makes only raw
    // system calls (write, setns, fchdir, chroot, chdir) on descriptors this function keeps open until
    // `spawn` returns and on a C string made before the fork; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &fds {
                if libc::write(fd, b"0".as_ptr().cast(), 1) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for (fd, kind) in [(net, libc::CLONE_NEWNET), (uts, libc::CLONE_NEWUTS), (mnt, libc::CLONE_NEWNS)] {
                if libc::setns(fd, kind) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if libc::fchdir(rootfd) < 0 || libc::chroot(c".".as_ptr()) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::chdir(cwd.as_ptr()) < 0 && libc::chdir(c"/".as_ptr()) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let status = cmd.status().with_context(|| format!("starting {:?} as host {host}'s owner", command[0]))?;
    drop((joins, root));
    Ok(status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
}
