//! The restorer's plan check on any bytes: it must never panic (in the restorer a panic is a
//! crash of the process being restored) and must refuse whatever it does not accept in full.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = starling_image::abi::plan::validate(data);
});
