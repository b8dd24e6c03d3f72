//! Paths in messages (file requests, bindings, commits): a `WirePath` that validates is absolute,
//! has no NUL, no `.` or `..` component and no name over 255 bytes, whatever bytes it came from.
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_proto::WirePath;

fuzz_target!(|data: &[u8]| {
    let Ok(p) = WirePath::new(data.to_vec()) else { return };
    let b = p.as_bytes();
    assert!(b.first() == Some(&b'/'), "{b:?}");
    assert!(!b.contains(&0), "{b:?}");
    for name in b.split(|&c| c == b'/').skip(1) {
        assert!(name != b"." && name != b"..", "{b:?}");
        assert!(name.len() <= 255, "{b:?}");
    }
});
