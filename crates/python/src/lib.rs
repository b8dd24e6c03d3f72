//! `import starling`: the Python binding of starling's remote fork.
//!
//! Why it exists: a Python program (numpy, a pricing library...) should be
//! able to borrow CPUs the way a C program does through `include/starling.h`,
//! without ctypes and without breaking the interpreter. The API mirrors the C
//! one; all fork logic stays in `starling_fork` — this crate only converts
//! types, maps errors to `starling.Error`, and runs CPython's fork protocol
//! around the clone, which only code inside the interpreter can do:
//!
//! * `PyOS_BeforeFork()` before the clone (import lock, `before` handlers of
//!   `os.register_at_fork`), with the GIL held, exactly as `os.fork` does;
//! * `PyOS_AfterFork_Child()` in the *template* — the frozen `fork()` child
//!   the clones are made from — before it freezes (through
//!   [`starling_fork::template_hook`]), so every clone starts from memory in
//!   which the child handlers have already run (GIL re-created and held by
//!   the clone's only thread, other threads' states dropped, `threading`
//!   fixed up, `after_in_child` handlers run);
//! * `PyOS_AfterFork_Parent()` in the parent once the clone call returns
//!   (also when it fails, pairing `PyOS_BeforeFork` as `os.fork` does).
//!
//! Numbering: `clone` returns 0 in the parent and 1..m in the m clones of a
//! ticket (m = `ticket.allocation`).
//!
//! ```python
//! t = starling.request_ticket(4)
//! cid = starling.clone(t)
//! if cid > 0:
//!     work(cid, t.allocation)
//!     starling.exit(0)
//! statuses = starling.join(t)      # [("exited", 0), ...] for clones 1..m
//! ```

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::ffi;
use pyo3::prelude::*;
use starling_fork::api::Ticket as CoreTicket;
use starling_fork::template_hook::with_template_child_hook;
use starling_fork::ForkError;

create_exception!(
    starling,
    Error,
    PyException,
    "A starling fork call failed; str(error) is the core's one-line reason."
);

fn to_py_err(e: ForkError) -> PyErr {
    Error::new_err(e.to_string())
}

/// A reservation of clones (`starling.request_ticket(n)`).
///
/// Dropping a ticket whose clones were not joined kills them.
#[pyclass(name = "Ticket", module = "starling")]
struct Ticket {
    core: CoreTicket,
}

#[pymethods]
impl Ticket {
    /// Number of clones granted (m <= n requested).
    #[getter]
    fn allocation(&self) -> u32 {
        self.core.allocation
    }

    /// Number of clones requested.
    #[getter]
    fn requested(&self) -> u32 {
        self.core.requested
    }

    #[getter]
    fn hierarchical(&self) -> bool {
        self.core.hierarchical
    }

    /// Size in bytes of the encoded process descriptor, once cloned.
    #[getter]
    fn descriptor_bytes(&self) -> Option<usize> {
        self.core.descriptor_bytes()
    }

    fn __repr__(&self) -> String {
        format!(
            "starling.Ticket(requested={}, allocation={}, hierarchical={})",
            self.core.requested,
            self.core.allocation,
            if self.core.hierarchical { "True" } else { "False" }
        )
    }
}

/// Reserve `n >= 1` clones (`ticket.allocation` of them are granted, by
/// free cores). `hierarchical=True` fills each host's cores first and
/// restores the process once per host, forking that host's further clones
/// from the restore; otherwise clones spread over as many hosts as possible,
/// each restored on its own. Raises `starling.Error` on failure.
#[pyfunction]
#[pyo3(signature = (n, hierarchical = false))]
fn request_ticket(n: i32, hierarchical: bool) -> PyResult<Ticket> {
    Ok(Ticket { core: CoreTicket::request(n, hierarchical).map_err(to_py_err)? })
}

/// Runs in the template (the fork child the clones are made from) before it
/// freezes: CPython's child-side fork protocol.
fn after_fork_in_template() {
    // SAFETY: we are in the fork child of `clone` below, on the thread that
    // held the GIL when it called fork() (with PyOS_BeforeFork done) — the
    // exact state in which os.fork calls PyOS_AfterFork_Child.
    unsafe { ffi::PyOS_AfterFork_Child() }
}

/// Fork: returns 0 in the parent and the clone ID (1..m) in each clone.
///
/// The clones continue from here with the caller's memory (fetched lazily).
/// Only the calling thread follows, as with `os.fork`. Raises
/// `starling.Error` if the ticket was already used, or in a clone.
#[pyfunction]
fn clone(_py: Python<'_>, mut ticket: PyRefMut<'_, Ticket>) -> PyResult<u32> {
    // SAFETY: the `Python` token proves this thread holds the GIL, which
    // PyOS_BeforeFork requires; it is paired with PyOS_AfterFork_Parent in
    // the parent or PyOS_AfterFork_Child in the template below.
    unsafe { ffi::PyOS_BeforeFork() };
    // The GIL stays held across the fork, as in os.fork: the template must
    // be a copy of a thread that holds it.
    let outcome = with_template_child_hook(after_fork_in_template, || ticket.core.clone_now());
    match outcome {
        // A clone: its memory is the template's, which already ran
        // PyOS_AfterFork_Child; running a fork handler again would be wrong.
        Ok(id) if id > 0 => Ok(id),
        // The parent, or a failure (always before the fork or in the parent).
        other => {
            // SAFETY: GIL held (token above), PyOS_BeforeFork ran above in
            // this process; this is os.fork's parent/failure path.
            unsafe { ffi::PyOS_AfterFork_Parent() };
            other.map_err(to_py_err)
        }
    }
}

/// In a clone: flush `sys.stdout` and `sys.stderr`, then exit with `status`
/// (C `exit`: atexit handlers and C stdio run). Does not return.
///
/// Python-level `atexit` handlers and finalizers do not run, as with
/// `os._exit` in a fork child.
#[pyfunction]
#[pyo3(signature = (status = 0))]
fn exit(py: Python<'_>, status: i32) -> PyResult<()> {
    let sys = py.import("sys")?;
    for stream in ["stdout", "stderr"] {
        if let Ok(s) = sys.getattr(stream) {
            if !s.is_none() {
                if let Err(e) = s.call_method0("flush") {
                    // The clone is exiting either way; say why output may be lost.
                    e.print(py);
                }
            }
        }
    }
    starling_fork::ffi::sf_exit(status)
}

/// One clone's result in the form Python callers use.
///
/// The core reports an exit code, or 128 + signal when the clone was killed
/// (the convention of `sf_clone_status`; codes 129..=192 are therefore read
/// as signals), and nothing when it does not know (lost).
fn describe_status(py: Python<'_>, status: Option<i32>) -> PyResult<Py<PyAny>> {
    let t = match status {
        None => ("lost", py.None()).into_pyobject(py)?,
        Some(s) if (129..=128 + 64).contains(&s) => ("killed", s - 128).into_pyobject(py)?,
        Some(s) => ("exited", s).into_pyobject(py)?,
    };
    Ok(t.into_any().unbind())
}

fn all_statuses(py: Python<'_>, ticket: &Ticket) -> PyResult<Vec<Py<PyAny>>> {
    (1..=ticket.core.allocation as i32).map(|id| describe_status(py, ticket.core.clone_status(id))).collect()
}

/// Parent only: wait for every clone (the GIL is released meanwhile).
/// Returns one `(kind, value)` per clone 1..m: `("exited", code)`,
/// `("killed", signal)` or `("lost", None)`.
#[pyfunction]
fn join(py: Python<'_>, mut ticket: PyRefMut<'_, Ticket>) -> PyResult<Vec<Py<PyAny>>> {
    let core = &mut ticket.core;
    py.detach(|| core.join()).map_err(to_py_err)?;
    all_statuses(py, &ticket)
}

/// Parent only: kill every clone at once and reap them. Returns the statuses
/// like `join`.
#[pyfunction]
fn kill(py: Python<'_>, mut ticket: PyRefMut<'_, Ticket>) -> PyResult<Vec<Py<PyAny>>> {
    let core = &mut ticket.core;
    py.detach(|| core.kill()).map_err(to_py_err)?;
    all_statuses(py, &ticket)
}

/// Result of clone `id` (1..m) after `join`/`kill`, as in `join`'s list;
/// `("lost", None)` if unknown or still running.
#[pyfunction]
fn clone_status(py: Python<'_>, ticket: PyRef<'_, Ticket>, id: i32) -> PyResult<Py<PyAny>> {
    describe_status(py, ticket.core.clone_status(id))
}

/// Fault-handler counters of clone `id` after it ran, as a dict by name
/// (faults, pages_fetched, pages_zero, pages_file, fetch_requests,
/// events_remove, mode, pages_multicast_unsolicited), or None.
#[pyfunction]
fn clone_stats(ticket: PyRef<'_, Ticket>, id: i32) -> Option<std::collections::BTreeMap<&'static str, u64>> {
    use starling_fork::image::abi::counters::CloneCounter;
    let c = ticket.core.clone_stats(id)?;
    Some(CloneCounter::ALL.iter().map(|&k| (k.name(), c.get(k))).collect())
}

/// This process's clone ID: 0 unless it is a clone.
#[pyfunction]
fn current_clone_id() -> u32 {
    starling_fork::api::current_clone_id()
}

#[pymodule]
#[pyo3(name = "starling")]
fn starling_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("Error", m.py().get_type::<Error>())?;
    m.add_class::<Ticket>()?;
    m.add_function(wrap_pyfunction!(request_ticket, m)?)?;
    m.add_function(wrap_pyfunction!(clone, m)?)?;
    m.add_function(wrap_pyfunction!(exit, m)?)?;
    m.add_function(wrap_pyfunction!(join, m)?)?;
    m.add_function(wrap_pyfunction!(kill, m)?)?;
    m.add_function(wrap_pyfunction!(clone_status, m)?)?;
    m.add_function(wrap_pyfunction!(clone_stats, m)?)?;
    m.add_function(wrap_pyfunction!(current_clone_id, m)?)?;
    Ok(())
}
