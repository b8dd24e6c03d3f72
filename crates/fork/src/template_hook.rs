//! A hook the template runs in its `fork()` child before it freezes.
//!
//! Why: a language runtime must repair its own state in a fork child
//! (CPython: `PyOS_AfterFork_Child`, which re-creates the GIL, drops other
//! threads' states and runs `os.register_at_fork(after_in_child=...)`
//! handlers). Running that once in the template, before the template records
//! itself and freezes, means every clone starts from memory in which it has
//! already run — a clone resumes inside the template's frame and must not
//! run it again.
//!
//! The hook is per thread and scoped ([`with_template_child_hook`]): only a
//! clone started from inside the scope on the same thread runs it, so a
//! binding that sets it does not affect other callers (e.g. the C API).

use std::cell::Cell;

thread_local! {
    // A plain fn pointer: no destructor, so reading it in the fork child
    // (which has only this thread) is fine.
    static TEMPLATE_CHILD_HOOK: Cell<Option<fn()>> = const { Cell::new(None) };
}

/// Run `f` (which forks through [`crate::api::Ticket::clone_now`]) with
/// `hook` installed: the template runs `hook` in the fork child before
/// freezing. `hook` runs in a fork child of a possibly multi-threaded
/// process and must not panic.
pub fn with_template_child_hook<R>(hook: fn(), f: impl FnOnce() -> R) -> R {
    struct Restore(Option<fn()>);
    impl Drop for Restore {
        fn drop(&mut self) {
            TEMPLATE_CHILD_HOOK.with(|h| h.set(self.0));
        }
    }
    let _restore = Restore(TEMPLATE_CHILD_HOOK.with(|h| h.replace(Some(hook))));
    f()
}

/// Called by the template in the fork child, before it records itself.
pub(crate) fn run_in_template() {
    if let Some(hook) = TEMPLATE_CHILD_HOOK.with(|h| h.get()) {
        hook();
    }
}
