//! A process descriptor as a page server or migration source may send it. Decoding must never
//! panic; one that decodes and validates lowers to a restore plan that the restorer's own check
//! (`abi::plan::validate`) accepts — the restorer never sees a plan built from bad input.
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
        let opts = PlanOptions { clone_id: 1, clone_count: count, new_pid_namespace, clone_id_in_rax: true, seccomp: &[], terminal: false };
        let plan = lower(&d, opts);
        if let Err(e) = starling_image::abi::plan::validate(&plan) {
            panic!("a validated descriptor lowered to a plan the restorer refuses: {e:?}");
        }
    }
});
