//! The page server's TCP protocol after the key proof, both ways: the requests a clone host sends
//! the user's process (`read_request`), and the replies a clone's fault handler reads back
//! (`read_reply`, for a batch size taken from the first byte). Parsing never panics, never reads
//! past what arrived, and never allocates more than one batch. Also what comes before and under
//! them: the server's side of the key proof, and the encrypted records (`fork.encrypt`) a peer
//! without the key can send — refused, never a panic or an allocation beyond one record.
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_fork::page_server::{prove_server, read_reply, read_request, PageRequest, MAX_BATCH};
use starling_fork::stream::Secrecy;
use starling_proto::SecretKey;

fuzz_target!(|data: &[u8]| {
    let key = SecretKey([7; 32]);
    let mut hello = data;
    assert!(prove_server(&key, true, &mut hello, &mut std::io::sink()).is_err(), "a proof without the key");
    let (mut records, _) = Secrecy::encrypted(&key, b"client nonce", b"server nonce", false).split(data, std::io::sink());
    while let Ok(Some(_)) = read_request(&mut records) {}
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
