//! The restorer's plan check on any bytes: it must never panic (in the restorer a panic is a
//! crash of the process being restored) and must refuse whatever it does not accept in full.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = starling_image::abi::plan::validate(data);
    // What the restorer runs: a process tree's plans one after the other.
    let mut offsets = [0u64; starling_image::abi::plan::MAX_TREE_PLANS];
    let _ = starling_image::abi::plan::validate_tree(data, &mut offsets);
});
