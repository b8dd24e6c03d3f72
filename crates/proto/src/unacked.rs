//! A task's output its client has not acknowledged writing yet ([`Msg::OutputAck`]), bounded.
//!
//! Kept by whoever carries a terminal task's output to its client, so that what a client that
//! went away had not written reaches the next one (`starling attach`): the head for the output it
//! relays (`head::attach`), a home agent for the output it sends its client directly
//! (`agent::direct`, handed to the head when that client goes away). A client acknowledges each
//! output on the path it came by, so each keeper counts only its own.

use crate::Msg;
use std::collections::VecDeque;

/// Most output bytes kept per task for a client that has not acknowledged them.
pub const MAX_UNACKED: usize = 4 << 20;

/// `Output` messages not acknowledged yet, oldest first.
#[derive(Debug, Default)]
pub struct UnackedOutput {
    msgs: VecDeque<Msg>,
    /// The first message's first bytes that were acknowledged.
    front_acked: usize,
    bytes: usize,
    /// Output dropped unacknowledged (over [`MAX_UNACKED`]).
    pub dropped: u64,
}

fn output_len(m: &Msg) -> usize {
    match m {
        Msg::Output { data, .. } => data.len(),
        _ => 0,
    }
}

impl UnackedOutput {
    /// Keep output `m`. Returns how many of the oldest messages were dropped to stay within
    /// [`MAX_UNACKED`].
    pub fn push(&mut self, m: Msg) -> usize {
        self.bytes += output_len(&m);
        self.msgs.push_back(m);
        let mut gone = 0;
        while self.bytes > MAX_UNACKED {
            let Some(old) = self.msgs.pop_front() else { break };
            let n = output_len(&old) - std::mem::take(&mut self.front_acked);
            self.bytes -= n;
            self.dropped += n as u64;
            gone += 1;
        }
        gone
    }

    /// The client wrote `bytes` more of the output. Returns how many messages it has now
    /// written whole (no longer kept).
    pub fn ack(&mut self, mut bytes: u64) -> usize {
        let mut done = 0;
        while bytes > 0 {
            let Some(front) = self.msgs.front() else { break };
            let left = output_len(front) - self.front_acked;
            if bytes < left as u64 {
                let b = usize::try_from(bytes).unwrap_or(left);
                self.front_acked += b;
                self.bytes -= b;
                break;
            }
            bytes -= left as u64;
            self.bytes -= left;
            self.front_acked = 0;
            self.msgs.pop_front();
            done += 1;
        }
        done
    }

    /// How many messages are kept.
    pub fn len(&self) -> usize {
        self.msgs.len()
    }

    /// Whether the client wrote all of it.
    pub fn is_empty(&self) -> bool {
        self.msgs.is_empty()
    }

    /// The kept output from message `from` on (the first one without its acknowledged bytes).
    pub fn from(&self, from: usize) -> Vec<Msg> {
        let mut out = Vec::new();
        for (i, m) in self.msgs.iter().enumerate().skip(from) {
            match m {
                Msg::Output { task, stream, data } if i == 0 && self.front_acked > 0 => {
                    out.push(Msg::Output { task: *task, stream: *stream, data: data[self.front_acked..].to_vec() });
                }
                m => out.push(m.clone()),
            }
        }
        out
    }

    /// All of it (the first message without its acknowledged bytes), no longer kept.
    pub fn take(&mut self) -> Vec<Msg> {
        let out = self.from(0);
        self.msgs.clear();
        self.front_acked = 0;
        self.bytes = 0;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{output as out, output_bytes as bytes};

    #[test]
    fn what_is_kept_starts_at_the_first_byte_not_acknowledged() {
        let mut u = UnackedOutput::default();
        u.push(out(b"abc"));
        u.push(out(b"defg"));
        assert_eq!(u.ack(2), 0);
        assert_eq!(u.ack(3), 1, "abc written whole");
        assert_eq!(bytes(&u.from(0)), b"fg");
        assert_eq!(bytes(&u.take()), b"fg");
        assert!(u.is_empty() && u.from(0).is_empty());
    }

    #[test]
    fn unacknowledged_output_is_bounded_oldest_dropped_first() {
        let mut u = UnackedOutput::default();
        let big = vec![b'x'; MAX_UNACKED / 2];
        assert_eq!(u.push(out(&big)), 0);
        assert_eq!(u.push(out(&big)), 0);
        assert_eq!(u.push(out(b"tail")), 1);
        assert_eq!(u.dropped, big.len() as u64);
        let kept = bytes(&u.take());
        assert_eq!(kept.len(), big.len() + 4);
        assert!(kept.ends_with(b"tail"));
    }
}
