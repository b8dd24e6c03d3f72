//! `import starling`: the Python binding of starling's remote fork.
//!
//! This crate is the native half of the `starling` package (`starling._native`);
//! the Python half (`python/starling/`: `starling.Executor`, `starling.map`, the
//! joblib backend) is built on the functions below and re-exports them.
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

    /// `[(host, clones)]` the head granted (cluster backend; empty for the local one).
    #[getter]
    fn placement(&self) -> Vec<(String, u32)> {
        self.core.placement().to_vec()
    }

    /// `[(host, why)]`: granted hosts that cannot enforce the ticket's own network
    /// (`fork.isolate_network = on`), whose clones run with their host's whole network.
    #[getter]
    fn unisolated(&self) -> Vec<(String, String)> {
        self.core.unisolated().iter().map(|u| (u.host.clone(), u.why.clone())).collect()
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
    let config = config().map_err(to_py_err)?;
    Ok(Ticket { core: CoreTicket::request(n, hierarchical, &config).map_err(to_py_err)? })
}

/// The configuration, read at this module's edge (the config file, then
/// `STARLING_*` as `os.environ` has them) on every ticket request.
fn config() -> Result<starling_config::Config, ForkError> {
    let env = |k: &str| std::env::var_os(k);
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    Ok(starling_config::Config::load(&starling_config::Sources { file: None, env: &env, euid })?)
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
    (1..=ticket.core.allocation.cast_signed()).map(|id| describe_status(py, ticket.core.clone_status(id))).collect()
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
/// events_remove, mode, pages_multicast_unsolicited) and the critical-path
/// stamps in CLOCK_REALTIME ns (`stamp_ticket_ns`, `stamp_template_ns`,
/// `stamp_descriptor_ns`, `stamp_placed_ns`, `stamp_launch_received_ns`,
/// `stamp_view_mounted_ns`, `stamp_sandbox_ready_ns`,
/// `stamp_restorer_running_ns`, `stamp_first_page_ns`; 0: not recorded), or None.
#[pyfunction]
fn clone_stats(ticket: PyRef<'_, Ticket>, id: i32) -> Option<std::collections::BTreeMap<&'static str, u64>> {
    use starling_fork::image::abi::counters::CloneCounter;
    let c = ticket.core.clone_stats(id)?;
    Some(CloneCounter::ALL.iter().map(|&k| (k.name(), c.get(k))).collect())
}

/// Where clone `id` (1..m) is now, without waiting: `("running", None)`,
/// `("exited", code)`, `("killed", signal)`, `("lost", reason)`, or
/// `("unknown", None)` before `clone` or for an ID outside 1..m. Unlike
/// `clone_status` it tells a running clone from a lost one (the executor
/// polls it to notice lost hosts).
#[pyfunction]
fn clone_state(py: Python<'_>, ticket: PyRef<'_, Ticket>, id: i32) -> PyResult<Py<PyAny>> {
    use starling_fork::cluster::CloneState;
    let t = match ticket.core.clone_state(id) {
        None => ("unknown", py.None()).into_pyobject(py)?,
        Some(CloneState::Running) => ("running", py.None()).into_pyobject(py)?,
        Some(CloneState::Exited(c)) => ("exited", c.into_pyobject(py)?.into_any().unbind()).into_pyobject(py)?,
        Some(CloneState::Killed(s)) => ("killed", s.into_pyobject(py)?.into_any().unbind()).into_pyobject(py)?,
        Some(CloneState::Lost(why)) => ("lost", why.into_pyobject(py)?.into_any().unbind()).into_pyobject(py)?,
    };
    Ok(t.into_any().unbind())
}

/// Tell the cluster's head how a `starling.Executor` on `ticket` stands, for its dashboard:
/// workers connected, futures submitted, done (a result), failed (an exception), cancelled, and
/// `closed` once it shut down. Nothing with the local backend (no head).
#[pyfunction]
#[allow(clippy::too_many_arguments)] // one per count: what Python passes by keyword
#[pyo3(signature = (ticket, *, workers, submitted, done, failed, cancelled, closed))]
fn executor_progress(
    py: Python<'_>,
    mut ticket: PyRefMut<'_, Ticket>,
    workers: u32,
    submitted: u64,
    done: u64,
    failed: u64,
    cancelled: u64,
    closed: bool,
) -> PyResult<()> {
    let progress = starling_fork::api::ExecutorProgress { workers, submitted, done, failed, cancelled, closed };
    let core = &mut ticket.core;
    py.detach(|| core.report_executor(progress)).map_err(to_py_err)
}

/// The host clone `id` runs on (cluster backend), or None.
#[pyfunction]
fn clone_host(ticket: PyRef<'_, Ticket>, id: i32) -> Option<String> {
    ticket.core.clone_host(id)
}

/// What the parent's page server sent for this ticket so far (also after
/// `join`), as a dict: bytes_wire (TCP + multicast, with headers),
/// bytes_tcp, bytes_multicast, pages_requested, pages_served, rate_cuts,
/// implicit_losses, lockstep_suppressed, pages_pushed, rate_min, rate_now,
/// descriptor_pages_sent, multicast_data_pages, multicast_data_datagrams,
/// multicast_mtu, multicast_receivers (one per clone host). None before `clone`.
#[pyfunction]
fn ticket_stats(ticket: PyRef<'_, Ticket>) -> Option<std::collections::BTreeMap<&'static str, u64>> {
    const NAMES: [&str; 16] = [
        "bytes_wire",
        "bytes_tcp",
        "bytes_multicast",
        "pages_requested",
        "pages_served",
        "rate_cuts",
        "implicit_losses",
        "lockstep_suppressed",
        "pages_pushed",
        "rate_min",
        "rate_now",
        "descriptor_pages_sent",
        "multicast_data_pages",
        "multicast_data_datagrams",
        "multicast_mtu",
        "multicast_receivers",
    ];
    let w = ticket.core.wire_stats()?;
    Some(NAMES.into_iter().zip(w.to_array()).collect())
}

/// The address clones reach their parent at (`STARLING_PARENT_HOST`; C:
/// `sf_parent_host()`), in the parent once a cluster ticket was requested
/// and in its clones; None before that or with the local backend (whose
/// clones share this machine's network: use 127.0.0.1). Python's
/// `os.environ` is a copy made at start-up and does not show it.
#[pyfunction]
fn parent_host() -> Option<String> {
    starling_fork::cluster::parent_host().map(|c| c.to_string_lossy().into_owned())
}

/// This process's clone ID: 0 unless it is a clone.
#[pyfunction]
fn current_clone_id() -> u32 {
    starling_fork::api::current_clone_id()
}

// The native half of the `starling` package (`starling._native`); the
// package's Python half (python/starling/) re-exports it and adds the
// Executor and the joblib backend.
#[pymodule]
#[pyo3(name = "_native")]
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
    m.add_function(wrap_pyfunction!(clone_state, m)?)?;
    m.add_function(wrap_pyfunction!(clone_host, m)?)?;
    m.add_function(wrap_pyfunction!(ticket_stats, m)?)?;
    m.add_function(wrap_pyfunction!(parent_host, m)?)?;
    m.add_function(wrap_pyfunction!(executor_progress, m)?)?;
    Ok(())
}
