//! Multicast datagrams and page requests as any host on the network may send them: parsing never
//! panics, and what parses re-encodes to the same bytes it was read from.
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_mcdist::wire::{DataHeader, Request};

fuzz_target!(|data: &[u8]| {
    if let Some((h, payload)) = DataHeader::parse(data) {
        let mut out = vec![0u8; data.len() - payload.len()];
        h.write(&mut out);
        assert_eq!(DataHeader::parse(&[&out[..], payload].concat()).map(|(h2, _)| h2), Some(h));
    }
    let _ = Request::parse(data);
});
