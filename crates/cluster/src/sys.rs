//! A failed system call or I/O step, named by what it was doing.

/// What failed (`mount proc on /x/proc`, `mkdir -p /y`...) and the OS's error.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct SysError {
    pub what: String,
    #[source]
    pub source: std::io::Error,
}

/// Name the step of a failed call: `result.doing(|| format!("mkdir {p}"))`.
pub(crate) trait Doing<T> {
    fn doing(self, what: impl FnOnce() -> String) -> Result<T, SysError>;
}

impl<T> Doing<T> for Result<T, std::io::Error> {
    fn doing(self, what: impl FnOnce() -> String) -> Result<T, SysError> {
        self.map_err(|source| SysError { what: what(), source })
    }
}

impl<T> Doing<T> for Result<T, nix::errno::Errno> {
    fn doing(self, what: impl FnOnce() -> String) -> Result<T, SysError> {
        self.map_err(|e| SysError { what: what(), source: e.into() })
    }
}
