//! Helpers for tests that check the output a task streams (this crate's and
//! the head's, through the `test-support` feature): not part of the protocol.

use crate::{Msg, Stream, TaskId};

/// Task 1's stdout carrying `data`.
pub fn output(data: &[u8]) -> Msg {
    Msg::Output { task: TaskId(1), stream: Stream::Stdout, data: data.to_vec() }
}

/// The bytes the output messages among `ms` carry, in order (other messages carry none).
pub fn output_bytes(ms: &[Msg]) -> Vec<u8> {
    ms.iter().flat_map(|m| if let Msg::Output { data, .. } = m { data.clone() } else { Vec::new() }).collect()
}
