//! The page server's TCP protocol after the key proof, both ways: the requests a clone host sends
//! the user's process (`read_request`), and the replies a clone's fault handler reads back
//! (`read_reply`, for a batch size taken from the first byte). Parsing never panics, never reads
//! past what arrived, and never allocates more than one batch.
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_fork::page_server::{read_reply, read_request, PageRequest, MAX_BATCH};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some(request)) = read_request(&mut rest) {
        if let PageRequest::Pages(addrs) = request {
            assert!(!addrs.is_empty() && addrs.len() <= MAX_BATCH as usize);
        }
    }
    if let Some((&n, mut reply)) = data.split_first() {
        let n = usize::from(n).max(1);
        if let Ok(pages) = read_reply(&mut reply, n) {
            assert_eq!(pages.len(), n);
        }
    }
});
