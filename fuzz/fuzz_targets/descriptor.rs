//! A process descriptor as a page server or migration source may send it. Decoding must never
//! panic; one that decodes and validates lowers to restore plans (one per process of its tree) that
//! the restorer's own check (`abi::plan::validate_tree`) accepts — the restorer never sees a plan
//! built from bad input.
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_image::{lower, Descriptor, PlanOptions};

fuzz_target!(|data: &[u8]| {
    let Ok(d) = Descriptor::decode(data) else { return };
    if d.validate().is_err() {
        return;
    }
    for (count, new_pid_namespace) in [(1, true), (1, false), (2, true)] {
        if count > 1 && d.threads.len() != 1 {
            continue;
        }
        // A process tree is only moved, never cloned: one copy, in a PID namespace of its own
        // (its processes get their pids back with set_tid), as `lower`'s callers give it.
        if !d.descendants.is_empty() && (count != 1 || !new_pid_namespace) {
            continue;
        }
        // A moved process joins its target's guest groups last (a clone, 0 groups, does not).
        let join_groups = if count == 1 { 2 } else { 0 };
        let opts = PlanOptions { clone_id: 1, clone_count: count, new_pid_namespace, clone_id_in_rax: true, seccomp: &[], terminal: false, join_groups };
        let plan = lower(&d, opts);
        let mut offsets = [0u64; starling_image::abi::plan::MAX_TREE_PLANS];
        if let Err(e) = starling_image::abi::plan::validate_tree(&plan, &mut offsets) {
            panic!("a validated descriptor lowered to a plan the restorer refuses: {e:?}");
        }
    }
});
