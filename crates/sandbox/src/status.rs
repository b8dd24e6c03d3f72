//! The side channel that carries a task's exact status up the process tree.
//!
//! An exit code alone cannot tell `exit(130)` from death by SIGINT once it
//! has passed through a shell-like `128 + signal` encoding, so each level
//! writes one fixed-size record before it exits: a tag byte (`C`ode or
//! `S`ignal) and the value as a little-endian i32.

use starling_proto::ExitStatus;

pub(crate) const RECORD_LEN: usize = 5;

pub(crate) fn encode(status: ExitStatus) -> [u8; RECORD_LEN] {
    let (tag, value) = match status {
        ExitStatus::Code(c) => (b'C', c),
        ExitStatus::Signal(s) => (b'S', s),
    };
    let v = value.to_le_bytes();
    [tag, v[0], v[1], v[2], v[3]]
}

/// Decodes a record; anything else (short, unknown tag) is `None`.
pub(crate) fn decode(bytes: &[u8]) -> Option<ExitStatus> {
    if bytes.len() != RECORD_LEN {
        return None;
    }
    let value = i32::from_le_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);
    match bytes[0] {
        b'C' => Some(ExitStatus::Code(value)),
        b'S' => Some(ExitStatus::Signal(value)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_keep_code_and_signal_apart() {
        for st in [ExitStatus::Code(0), ExitStatus::Code(130), ExitStatus::Signal(2), ExitStatus::Code(-1)] {
            assert_eq!(decode(&encode(st)), Some(st));
        }
        assert_ne!(encode(ExitStatus::Code(2)), encode(ExitStatus::Signal(2)));
        assert_eq!(decode(b"C12"), None);
        assert_eq!(decode(b"X\0\0\0\0"), None);
    }
}
