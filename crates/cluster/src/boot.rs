//! `starling __host-boot`: turns a process that already sits in a host's network namespace into that host.
//!
//! It gives itself private mount and UTS namespaces, builds the host's root file system (an overlay of the
//! machine's `/` with a private, throw-away upper layer, fresh /proc and /sys, private /tmp, /run and /dev/shm,
//! and the host's persistent state directory), names the host, pivots into the new root and finally execs the
//! agent — so the agent's pid is the pid `up` recorded, and `/proc/PID/root` is the host's root.

use std::convert::Infallible;
use std::ffi::CString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::sys::{Doing, SysError};
use starling_config::roles;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::unistd::{chdir, execvp, pivot_root, sethostname};

/// Inside every host, the agent's persistent state directory (bind of `STATE/hosts/hI/state`, on the real
/// file system so FUSE passthrough backing files and per-task overlay upper dirs can live there).
pub const HOST_STATE_MOUNT: &str = "/var/lib/starling/state";

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("unexpected argument {0:?}")]
    UnexpectedArgument(String),
    #[error("missing or bad {0}")]
    Missing(&'static str),
    #[error("host name {0:?} must be 1-63 characters of [A-Za-z0-9-]")]
    BadHostName(String),
    #[error("--state-dir {} must be absolute", .0.display())]
    RelativeStateDir(PathBuf),
    #[error("{} is not UTF-8", .0.display())]
    NotUtf8(PathBuf),
    #[error("path {0:?} cannot be used in overlay options (contains , : or \\)")]
    OverlayUnsafe(String),
    #[error("NUL in command {0:?}")]
    NulInCommand(Vec<String>),
    #[error(transparent)]
    Sys(#[from] SysError),
}

type Result<T, E = BootError> = std::result::Result<T, E>;

/// Parsed `__host-boot` arguments.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct BootArgs {
    pub name: String,
    pub head: String,
    /// `STATE/hosts/NAME`: holds `layer` (tmpfs for the overlay's upper/work), `root` (the merged root) and
    /// `state` (persistent).
    pub host_dir: PathBuf,
    /// The agent's content-cache bound (`agent --cache-mib`).
    pub cache_mib: u64,
    /// The agent's cgroup name (`agent --cgroup`): the host's netns name, unique per cluster and host.
    pub cgroup: String,
    /// Extra arguments for the agent (`up --policy`...), each given as `--agent-arg ARG`.
    pub agent_args: Vec<String>,
    /// Program to exec instead of `exe agent ...` (tests run `sleep infinity`); given after `--`.
    pub exec: Vec<String>,
}

impl BootArgs {
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "--name".to_string(),
            self.name.clone(),
            "--head".to_string(),
            self.head.clone(),
            "--state-dir".to_string(),
            self.host_dir.display().to_string(),
            "--cache-mib".to_string(),
            self.cache_mib.to_string(),
            "--cgroup".to_string(),
            self.cgroup.clone(),
        ];
        for a in &self.agent_args {
            v.push("--agent-arg".to_string());
            v.push(a.clone());
        }
        if !self.exec.is_empty() {
            v.push("--".to_string());
            v.extend(self.exec.iter().cloned());
        }
        v
    }

    pub fn parse(args: &[String]) -> Result<BootArgs> {
        let (mut name, mut head, mut host_dir, mut exec) = (None, None, None, Vec::new());
        let (mut cache_mib, mut cgroup, mut agent_args) = (None, None, Vec::new());
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                a if a == roles::HOST_BOOT => {}
                "--name" => name = it.next().cloned(),
                "--head" => head = it.next().cloned(),
                "--state-dir" => host_dir = it.next().map(PathBuf::from),
                "--cache-mib" => cache_mib = it.next().and_then(|v| v.parse::<u64>().ok()),
                "--cgroup" => cgroup = it.next().cloned(),
                "--agent-arg" => agent_args.extend(it.next().cloned()),
                "--" => {
                    exec = it.by_ref().cloned().collect();
                }
                other => return Err(BootError::UnexpectedArgument(other.to_string())),
            }
        }
        let name = name.ok_or(BootError::Missing("--name"))?;
        if name.is_empty() || name.len() > 63 || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            return Err(BootError::BadHostName(name));
        }
        let host_dir = host_dir.ok_or(BootError::Missing("--state-dir"))?;
        if !host_dir.is_absolute() {
            return Err(BootError::RelativeStateDir(host_dir));
        }
        let cache_mib = cache_mib.ok_or(BootError::Missing("--cache-mib"))?;
        let cgroup = cgroup.ok_or(BootError::Missing("--cgroup"))?;
        Ok(BootArgs { name, head: head.ok_or(BootError::Missing("--head"))?, host_dir, cache_mib, cgroup, agent_args, exec })
    }
}

/// Entry point of the hidden `__host-boot` subcommand; `args` are the arguments after the subcommand name
/// (a leading `__host-boot` is tolerated). Never returns: it execs the agent or exits with status 1.
pub fn host_boot_main(args: &[String]) -> ! {
    let err = match BootArgs::parse(args).and_then(|a| boot(&a)) {
        Ok(never) => match never {},
        Err(e) => e,
    };
    eprintln!("starling __host-boot: {err:#}");
    std::process::exit(1)
}

fn boot(args: &BootArgs) -> Result<Infallible> {
    // Resolve our own binary before the root changes (it stays reachable: see `keep_reachable`).
    let exe = std::env::current_exe().doing(|| "cannot resolve /proc/self/exe".into())?;

    unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWUTS).doing(|| "unshare(NEWNS|NEWUTS)".into())?;
    // Nothing we mount from here on may propagate back to the machine (or to other hosts).
    mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
        .doing(|| "making mounts private".into())?;

    let root = build_root(&args.host_dir, &exe)?;
    sethostname(&args.name).doing(|| "sethostname".into())?;
    enter_root(&root)?;

    let argv: Vec<String> = if args.exec.is_empty() {
        vec![
            exe.display().to_string(),
            roles::AGENT.into(),
            "--head".into(),
            args.head.clone(),
            "--name".into(),
            args.name.clone(),
            "--state".into(),
            HOST_STATE_MOUNT.into(),
            "--cache-mib".into(),
            args.cache_mib.to_string(),
            "--cgroup".into(),
            args.cgroup.clone(),
            "--owner".into(),
            "emulated".into(),
        ]
        .into_iter()
        .chain(args.agent_args.iter().cloned())
        .collect()
    } else {
        args.exec.clone()
    };
    let cargv: Vec<CString> =
        argv.iter().map(|a| CString::new(a.as_str())).collect::<Result<_, _>>().map_err(|_| BootError::NulInCommand(argv.clone()))?;
    std::env::set_var("HOSTNAME", &args.name);
    Ok(execvp(&cargv[0], &cargv).doing(|| format!("exec {argv:?}"))?)
}

/// A mount option value must not contain the overlay option separators.
fn option_path(p: &Path) -> Result<String> {
    let s = p.to_str().ok_or_else(|| BootError::NotUtf8(p.to_path_buf()))?;
    if s.contains([',', ':', '\\']) {
        return Err(BootError::OverlayUnsafe(s.to_string()));
    }
    Ok(s.to_string())
}

fn mkdirs(p: &Path) -> Result<()> {
    Ok(std::fs::create_dir_all(p).doing(|| format!("mkdir -p {}", p.display()))?)
}

fn mount_fs(fstype: &str, target: &Path, flags: MsFlags, data: Option<&str>) -> Result<()> {
    mkdirs(target)?;
    Ok(mount(Some(fstype), target, Some(fstype), flags, data)
        .doing(|| format!("mount {fstype} on {} ({})", target.display(), data.unwrap_or("")))?)
}

fn bind(source: &Path, target: &Path, recursive: bool) -> Result<()> {
    let flags = if recursive { MsFlags::MS_BIND | MsFlags::MS_REC } else { MsFlags::MS_BIND };
    Ok(mount(Some(source), target, None::<&str>, flags, None::<&str>)
        .doing(|| format!("bind {} on {}", source.display(), target.display()))?)
}

/// Build the host's root under `host_dir/root` and return its path.
fn build_root(host_dir: &Path, exe: &Path) -> Result<PathBuf> {
    let layer = host_dir.join("layer");
    let root = host_dir.join("root");
    let state = host_dir.join("state");
    mkdirs(&state)?;

    // Overlayfs refuses an upper dir inside its lower one, and `/` (the lower) holds STATE: put upper and
    // work on a tmpfs of their own. Host-local writes to the root are thus thrown away with the host.
    mount_fs("tmpfs", &layer, MsFlags::empty(), Some("mode=0755"))?;
    let (upper, work) = (layer.join("upper"), layer.join("work"));
    mkdirs(&upper)?;
    mkdirs(&work)?;
    mkdirs(&root)?;
    let data = format!("lowerdir=/,upperdir={},workdir={}", option_path(&upper)?, option_path(&work)?);
    mount(Some("overlay"), &root, Some("overlay"), MsFlags::empty(), Some(data.as_str()))
        .doing(|| format!("mount overlay on {} ({data})", root.display()))?;

    let nosuid_nodev_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    // A fresh proc (same PID namespace) and a sysfs that shows this network namespace's interfaces.
    mount_fs("proc", &root.join("proc"), nosuid_nodev_noexec, None)?;
    mount_fs("sysfs", &root.join("sys"), nosuid_nodev_noexec, None)?;
    // The new sysfs does not carry the cgroup hierarchies the agent's sandboxes use (cpu.idle, memory...).
    let cgroup = Path::new("/sys/fs/cgroup");
    if crate::mounts::mount_points(Path::new("/proc/self/mountinfo")).iter().any(|m| m == cgroup) {
        bind(cgroup, &root.join("sys/fs/cgroup"), true)?;
    }
    // Devices are the machine's (FUSE, null, tty...), but POSIX shared memory is per host.
    mkdirs(&root.join("dev"))?;
    bind(Path::new("/dev"), &root.join("dev"), true)?;
    mount_fs("tmpfs", &root.join("dev/shm"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=1777"))?;
    mount_fs("tmpfs", &root.join("tmp"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=1777"))?;
    mount_fs("tmpfs", &root.join("run"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=0755"))?;

    let state_target = root.join(HOST_STATE_MOUNT.trim_start_matches('/'));
    mkdirs(&state_target)?;
    bind(&state, &state_target, false)?;

    keep_reachable(exe, &root)?;
    Ok(root)
}

/// The starling binary must be at the same path inside the host, but the host root hides some of the
/// machine: the overlay's lower layer is only the root file system (not what is mounted on it), and the host
/// gets private `/tmp` and `/run` (a checkout under /tmp). If the path inside is not the very same file, bind
/// the binary there.
fn keep_reachable(exe: &Path, root: &Path) -> Result<()> {
    let outside = std::fs::metadata(exe).doing(|| format!("stat {}", exe.display()))?;
    let inside = root.join(exe.strip_prefix("/").unwrap_or(exe));
    if let Ok(m) = std::fs::metadata(&inside) {
        if (m.dev(), m.ino()) == (outside.dev(), outside.ino()) {
            return Ok(());
        }
    }
    if let Some(parent) = inside.parent() {
        mkdirs(parent)?;
    }
    if !inside.exists() {
        std::fs::File::create(&inside).doing(|| format!("create {}", inside.display()))?;
    }
    bind(exe, &inside, false)
}

/// Make `root` our root and drop every view of the machine's old root.
fn enter_root(root: &Path) -> Result<()> {
    chdir(root).doing(|| format!("chdir {}", root.display()))?;
    // pivot_root(".", ".") stacks the old root on top of the new one at "/"; detaching "." then removes it,
    // without needing a put_old directory inside the host's root.
    pivot_root(".", ".").doing(|| "pivot_root".into())?;
    umount2(".", MntFlags::MNT_DETACH).doing(|| "detaching the old root".into())?;
    chdir("/").doing(|| "chdir /".into())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn boot_args_round_trip() {
        let a = BootArgs {
            name: "h3".into(),
            head: "10.213.0.1:7077".into(),
            host_dir: "/var/lib/starling/hosts/h3".into(),
            cache_mib: 2048,
            cgroup: "starling6-h3".into(),
            agent_args: s(&["--policy", "LL"]),
            exec: s(&["sleep", "infinity"]),
        };
        assert_eq!(BootArgs::parse(&a.to_args()).unwrap(), a);
        let mut with_sub = s(&["__host-boot"]);
        with_sub.extend(a.to_args());
        assert_eq!(BootArgs::parse(&with_sub).unwrap(), a);
    }

    #[test]
    fn boot_args_rejects_bad_input() {
        assert!(BootArgs::parse(&s(&["--name", "h1", "--head", "x", "--cache-mib", "1"])).is_err(), "missing --state-dir");
        assert!(BootArgs::parse(&s(&["--name", "h 1", "--head", "x", "--state-dir", "/s", "--cache-mib", "1"])).is_err());
        assert!(BootArgs::parse(&s(&["--name", "h1", "--head", "x", "--state-dir", "rel", "--cache-mib", "1"])).is_err());
        assert!(BootArgs::parse(&s(&["--name", "h1", "--head", "x", "--state-dir", "/s"])).is_err(), "missing --cache-mib");
        assert!(BootArgs::parse(&s(&["--name", "h1", "--head", "x", "--state-dir", "/s", "--cache-mib", "lots"])).is_err());
        assert!(BootArgs::parse(&s(&["--name", "h1", "--head", "x", "--state-dir", "/s", "--cache-mib", "1"])).is_err(), "missing --cgroup");
        assert!(BootArgs::parse(&s(&["--bogus"])).is_err());
    }
}
