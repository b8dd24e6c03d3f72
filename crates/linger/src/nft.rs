//! Running `nft` (and the other sbin tools) from a daemon: shared by the
//! guests' network window ([`crate::window`]) and the agent's per-ticket
//! networks. Rules that match `socket cgroupv2` name a group by its path
//! below `/sys/fs/cgroup`, which is where nftables resolves it: where the
//! cgroup2 mount is elsewhere (a v1 machine's `/sys/fs/cgroup/unified`),
//! [`Nft::apply`] runs `nft` in a mount namespace of its own with the
//! cgroup2 mount bound over `/sys/fs/cgroup`.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("running {program}: {source}")]
    Spawn { program: String, #[source] source: io::Error },
    #[error("`{command}` failed: {stderr}")]
    Failed { command: String, stderr: String },
    #[error("the cgroup2 mount's path {0} holds a NUL byte")]
    UnifiedPath(PathBuf),
}

/// `tc`, `ip` and `nft` live in sbin, which a daemon's PATH may lack.
pub fn program(name: &str) -> PathBuf {
    for dir in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return p;
        }
    }
    PathBuf::from(name)
}

/// Run `cmd` with `input` on its stdin; its stdout, or its stderr in the error.
pub fn run(mut cmd: Command, input: Option<&str>) -> Result<String, CommandError> {
    let shown = format!("{} {}", cmd.get_program().to_string_lossy(), cmd.get_args().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" "));
    cmd.stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(Stdio::piped());
    let spawn_err = |source| CommandError::Spawn { program: shown.clone(), source };
    let mut child = cmd.spawn().map_err(spawn_err)?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        use std::io::Write;
        stdin.write_all(text.as_bytes()).map_err(spawn_err)?;
    }
    let out = child.wait_with_output().map_err(spawn_err)?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        let command = match input {
            Some(text) => format!("{shown} <<< {}", text.replace('\n', "; ")),
            None => shown,
        };
        return Err(CommandError::Failed { command, stderr });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `nft` in this network namespace, resolving cgroup paths below the cgroup2 mount `unified`.
#[derive(Clone, Debug)]
pub struct Nft {
    unified: PathBuf,
}

impl Nft {
    pub fn new(unified: &Path) -> Nft {
        Nft { unified: unified.to_path_buf() }
    }

    /// Apply the ruleset `script` (`nft -f -`: all of it or nothing).
    pub fn apply(&self, script: &str) -> Result<String, CommandError> {
        let mut c = Command::new(program("nft"));
        c.args(["-f", "-"]);
        if self.unified != Path::new("/sys/fs/cgroup") {
            let source = std::ffi::CString::new(self.unified.as_os_str().as_encoded_bytes())
                .map_err(|_| CommandError::UnifiedPath(self.unified.clone()))?;
            use std::os::unix::process::CommandExt;
            // SAFETY: the closure runs in the forked child before exec and makes only raw system
            // calls (unshare, mount) on C strings made before the fork; it allocates nothing.
            unsafe {
                c.pre_exec(move || {
                    if libc::unshare(libc::CLONE_NEWNS) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    // Private first, so the bind does not propagate to the caller's namespace.
                    if libc::mount(std::ptr::null(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    if libc::mount(source.as_ptr(), c"/sys/fs/cgroup".as_ptr(), std::ptr::null(), libc::MS_BIND, std::ptr::null()) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        run(c, Some(script))
    }
}

/// The `inet` tables of this network namespace.
pub fn inet_tables() -> Result<Vec<String>, CommandError> {
    let mut c = Command::new(program("nft"));
    c.args(["list", "tables", "inet"]);
    Ok(table_names(&run(c, None)?))
}

/// Names in `nft list tables` lines (`table inet NAME`).
fn table_names(text: &str) -> Vec<String> {
    text.lines().filter_map(|l| l.split_whitespace().nth(2).map(str::to_string)).collect()
}

/// Delete the `inet` table `name` if this namespace holds it.
pub fn delete_inet_table(name: &str) -> Result<(), CommandError> {
    if inet_tables()?.iter().any(|t| t == name) {
        let mut c = Command::new(program("nft"));
        c.args(["delete", "table", "inet", name]);
        run(c, None)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_the_third_word() {
        assert_eq!(table_names("table inet starling_h1\ntable inet other\n"), ["starling_h1", "other"]);
        assert!(table_names("").is_empty());
    }
}
