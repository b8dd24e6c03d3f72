//! A control-channel frame as a peer may send it: the 12-byte header, then the body (zstd or not,
//! as the flags say). Decoding must never panic, hang or allocate past the frame limit; a body that
//! decodes re-encodes to a frame that decodes to a message that encodes to the same bytes (bytes,
//! not `==`: a message may carry a NaN).
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_proto::frame::{decode_flagged, encode_with, parse_header};

fuzz_target!(|data: &[u8]| {
    let Some((head, body)) = data.split_first_chunk::<12>() else { return };
    let Ok((_len, flags)) = parse_header(head) else { return };
    if let Ok(msg) = decode_flagged(body, flags) {
        let once = encode_with(&msg, false).expect("a decoded message encodes");
        let (h2, b2) = once.split_first_chunk::<12>().expect("a frame has a header");
        let (_, f2) = parse_header(h2).expect("our own header parses");
        let again = decode_flagged(b2, f2).expect("our own frame decodes");
        assert_eq!(encode_with(&again, false).expect("encodes"), once);
    }
});
