//! A live migration's stream, as a peer that passed the move's key proof may send it: the source's
//! frames to the target, fed through the target's own `FrameReader`, and the target's answers to the
//! source. Decoding never panics nor allocates beyond the bytes that arrived; a decoded frame
//! re-encodes to the bytes it was read from; the reader refuses what it cannot use.
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_migrate::target::{FrameReader, Taken};
use starling_migrate::wire::{self, ToSource, ToTarget};

/// Decode frames of type T from `data` until one fails; each decoded frame must re-encode to the
/// exact bytes it came from (the format is canonical, so nothing is read two ways).
fn frames<T: serde::Serialize + serde::de::DeserializeOwned>(data: &[u8], mut each: impl FnMut(T) -> bool) {
    let mut rest = data;
    loop {
        let before = rest;
        let Ok(frame) = wire::recv::<T>(&mut rest) else { return };
        let mut again = Vec::new();
        wire::send(&mut again, &frame).expect("a decoded frame encodes");
        assert_eq!(again, before[..before.len() - rest.len()], "a frame re-encodes to its own bytes");
        if !each(frame) {
            return;
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut reader = FrameReader::default();
    frames::<ToTarget>(data, |frame| matches!(reader.take(frame), Ok(Taken::Prepare(_) | Taken::Staged)));
    frames::<ToSource>(data, |_| true);
});
