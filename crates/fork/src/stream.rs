//! A page-server or migration connection after its key proof: the bytes of
//! the protocol above, in clear or in AES-256-GCM records (`fork.encrypt`).
//!
//! The key proof (`page_server::prove_server`/`prove_client`) settles
//! whether the connection is encrypted (either side may ask; the answer is
//! covered by both MACs, so nobody on the way can turn it off) and gives
//! each direction its own key, derived from the ticket's or move's key and
//! both handshake nonces ([`seal::PAGE_STREAM_CLIENT`],
//! [`seal::PAGE_STREAM_SERVER`]). Records:
//!
//! ```text
//! length u32 (ciphertext + tag, 16..=RECORD + 16) | ciphertext | tag [16]
//! ```
//!
//! with the length as associated data and the record's number in its
//! direction as nonce. **Nonces never repeat under a key**: a key belongs to
//! one direction of one connection (the server's nonce is 32 fresh random
//! bytes per connection), and its records are numbered from 0 up. A record
//! that does not authenticate — tampered, reordered, replayed from another
//! connection — is an `InvalidData` error and ends the connection; so does
//! one cut short. The number is not on the wire: a dropped or repeated
//! record fails the next tag.
//!
//! In clear the same types just buffer (as `BufReader`/`BufWriter` would),
//! so the protocols above do not know which they run on.

use starling_mcdist::seal::{self, Cipher, TAG_LEN};
use std::io::{self, Read, Write};

/// Largest plaintext of one record: what the writer buffers before sealing.
pub const RECORD: usize = 256 * 1024;

/// How much the reader asks of the socket at a time in clear.
const CLEAR_READ: usize = 64 * 1024;

/// The outcome of a key proof: clear, or the connection's two keys.
pub struct Secrecy {
    keys: Option<(Cipher, Cipher)>,
}

impl Secrecy {
    /// No encryption.
    pub fn clear() -> Secrecy {
        Secrecy { keys: None }
    }

    /// The keys of a connection whose proof used these nonces, as its client
    /// (`client = true`: sends with the client→server key) or server.
    pub fn encrypted(key: &starling_proto::SecretKey, nonce_c: &[u8], nonce_s: &[u8], client: bool) -> Secrecy {
        let up = Cipher::derive(key, seal::PAGE_STREAM_CLIENT, &[nonce_c, nonce_s]);
        let down = Cipher::derive(key, seal::PAGE_STREAM_SERVER, &[nonce_c, nonce_s]);
        Secrecy { keys: Some(if client { (up, down) } else { (down, up) }) }
    }

    pub fn is_encrypted(&self) -> bool {
        self.keys.is_some()
    }

    /// The two halves of the connection (`read` and `write` ends of one
    /// socket, e.g. a `TcpStream` and its `try_clone`).
    pub fn split<R: Read, W: Write>(self, read: R, write: W) -> (StreamReader<R>, StreamWriter<W>) {
        let (send, recv) = match self.keys {
            Some((s, r)) => (Some(s), Some(r)),
            None => (None, None),
        };
        (StreamReader::new(read, recv), StreamWriter::new(write, send))
    }
}

/// The reading half (see the module doc).
///
/// Encrypted, it asks the socket for as much as its buffer holds, not for a
/// record's length and then its body: a record that has arrived whole (a
/// page-server reply, a request) costs one `read(2)`, and records that
/// arrived together are opened from the same read. A record split across
/// reads is put together in the buffer.
pub struct StreamReader<R> {
    inner: R,
    cipher: Option<Cipher>,
    /// Records read so far (the next one's nonce).
    count: u64,
    /// Bytes read from `inner`: `[pos, end)` is plaintext not yet taken (in
    /// place of its record when encrypted); encrypted, `[next, filled)` are
    /// the bytes of the records after it (the last one possibly partial).
    buf: Vec<u8>,
    pos: usize,
    end: usize,
    next: usize,
    filled: usize,
}

impl<R: Read> StreamReader<R> {
    /// `cipher`: the peer's sending key, or None in clear.
    pub fn new(inner: R, cipher: Option<Cipher>) -> StreamReader<R> {
        StreamReader { inner, cipher, count: 0, buf: Vec::new(), pos: 0, end: 0, next: 0, filled: 0 }
    }

    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    pub fn is_encrypted(&self) -> bool {
        self.cipher.is_some()
    }

    /// Whether bytes are in hand that a read can take without asking
    /// `inner` (plaintext, or received bytes of a record still to open).
    pub fn has_buffered(&self) -> bool {
        self.pos < self.end || self.next < self.filled
    }

    /// One `read` from `inner` into the buffer past `filled`, at least `need`
    /// bytes of room from `next` on (earlier, consumed bytes are dropped to
    /// make room); the number of bytes read.
    fn fill(&mut self, need: usize) -> io::Result<usize> {
        if self.next == self.filled {
            (self.next, self.filled) = (0, 0);
        }
        if self.next + need > self.buf.len() {
            self.buf.copy_within(self.next..self.filled, 0);
            (self.filled, self.next) = (self.filled - self.next, 0);
            if need > self.buf.len() {
                self.buf.resize(need.max(CLEAR_READ), 0);
            }
        }
        if self.buf.len() == self.filled {
            // Only the start of a record is in hand and it is still short of `need`.
            self.buf.resize(self.filled + CLEAR_READ, 0);
        }
        loop {
            match self.inner.read(&mut self.buf[self.filled..]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => {
                    let n = r?;
                    self.filled += n;
                    return Ok(n);
                }
            }
        }
    }

    /// Fill the buffer: `Ok(false)` at a clean end of the connection.
    fn refill(&mut self) -> io::Result<bool> {
        if self.cipher.is_none() {
            (self.next, self.filled) = (0, 0);
            let n = self.fill(CLEAR_READ)?;
            (self.pos, self.end, self.next) = (0, n, n);
            return Ok(n > 0);
        }
        loop {
            let have = self.filled - self.next;
            let need = if have < 4 {
                4
            } else {
                let len: [u8; 4] = self.buf[self.next..self.next + 4].try_into().expect("4 bytes");
                let n = u32::from_le_bytes(len) as usize;
                if !(TAG_LEN..=RECORD + TAG_LEN).contains(&n) {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, format!("an encrypted record of {n} bytes")));
                }
                if have >= 4 + n {
                    return self.open(len, n).map(|()| true);
                }
                4 + n
            };
            if self.fill(need)? == 0 {
                return match have {
                    0 => Ok(false),
                    _ => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the connection ended inside an encrypted record")),
                };
            }
        }
    }

    /// Open the record of `n` bytes (after its length `len`) at `next`, in place.
    fn open(&mut self, len: [u8; 4], n: usize) -> io::Result<()> {
        let cipher = self.cipher.as_ref().expect("encrypted");
        let start = self.next + 4;
        let (data, tag) = self.buf[start..start + n].split_at_mut(n - TAG_LEN);
        if !cipher.open(seal::counter_nonce(self.count), &len, data, tag) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "an encrypted record failed authentication"));
        }
        self.count += 1;
        (self.pos, self.end, self.next) = (start, start + n - TAG_LEN, start + n);
        Ok(())
    }
}

impl<R: Read> Read for StreamReader<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        while self.pos == self.end {
            if !self.refill()? {
                return Ok(0);
            }
        }
        let n = out.len().min(self.end - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// The writing half: buffers up to [`RECORD`] bytes, sent (sealed if
/// encrypted) when full and on `flush`.
pub struct StreamWriter<W: Write> {
    inner: W,
    cipher: Option<Cipher>,
    /// Records sent so far (the next one's nonce).
    count: u64,
    /// The length's room, then the pending bytes.
    buf: Vec<u8>,
}

impl<W: Write> StreamWriter<W> {
    /// `cipher`: this side's sending key, or None in clear.
    pub fn new(inner: W, cipher: Option<Cipher>) -> StreamWriter<W> {
        StreamWriter { inner, cipher, count: 0, buf: vec![0u8; 4] }
    }

    pub fn get_ref(&self) -> &W {
        &self.inner
    }

    /// Room left in the pending record.
    pub fn room(&self) -> usize {
        RECORD - (self.buf.len() - 4)
    }

    /// Let `fill` write up to `n` bytes (1..=[`RECORD`]) straight into the
    /// pending record — sent first if they would not fit — and say how many
    /// it wrote; the rest is dropped. For bytes that would otherwise be read
    /// into a buffer of the caller's and copied in here (pages read from
    /// another process).
    pub fn write_in_place(&mut self, n: usize, fill: impl FnOnce(&mut [u8]) -> usize) -> io::Result<()> {
        assert!((1..=RECORD).contains(&n), "write_in_place of {n} bytes");
        if self.room() < n {
            self.send()?;
        }
        let at = self.buf.len();
        self.buf.resize(at + n, 0);
        let used = fill(&mut self.buf[at..]).min(n);
        self.buf.truncate(at + used);
        Ok(())
    }

    /// Send what is buffered (one record when encrypted).
    fn send(&mut self) -> io::Result<()> {
        if self.buf.len() == 4 {
            return Ok(());
        }
        match &self.cipher {
            None => self.inner.write_all(&self.buf[4..])?,
            Some(cipher) => {
                let n = u32::try_from(self.buf.len() - 4 + TAG_LEN).expect("a record is at most RECORD + TAG_LEN");
                let len = n.to_le_bytes();
                self.buf[..4].copy_from_slice(&len);
                let tag = cipher.seal(seal::counter_nonce(self.count), &len, &mut self.buf[4..]);
                // u64 records of 16+ bytes each: the count cannot wrap.
                self.count += 1;
                self.buf.extend_from_slice(&tag);
                self.inner.write_all(&self.buf)?;
            }
        }
        self.buf.truncate(4);
        Ok(())
    }
}

impl<W: Write> Write for StreamWriter<W> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len() - 4 == RECORD {
            self.send()?;
        }
        let n = data.len().min(RECORD - (self.buf.len() - 4));
        self.buf.extend_from_slice(&data[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()?;
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use starling_proto::SecretKey;

    /// What a client sends, as bytes on the wire (`encrypt`: sealed records).
    fn wire(key: &SecretKey, encrypt: bool, messages: &[&[u8]]) -> Vec<u8> {
        let s = if encrypt { Secrecy::encrypted(key, b"c", b"s", true) } else { Secrecy::clear() };
        let (_, mut w) = s.split(io::empty(), Vec::new());
        for m in messages {
            w.write_all(m).unwrap();
            w.flush().unwrap();
        }
        w.inner
    }

    fn read_all(key: &SecretKey, encrypt: bool, bytes: &[u8]) -> io::Result<Vec<u8>> {
        let s = if encrypt { Secrecy::encrypted(key, b"c", b"s", false) } else { Secrecy::clear() };
        let (mut r, _) = s.split(bytes, io::sink());
        let mut out = Vec::new();
        r.read_to_end(&mut out)?;
        Ok(out)
    }

    #[test]
    fn records_round_trip_and_hide_their_bytes() {
        let key = SecretKey([1; 32]);
        let page = [0x5au8; 4096];
        let big = vec![0xa5u8; 3 * RECORD + 7]; // several records in one write
        for encrypt in [false, true] {
            let bytes = wire(&key, encrypt, &[b"SFPQ", &page, &big]);
            let seen = bytes.windows(64).any(|w| w == &page[..64]);
            assert_eq!(seen, !encrypt, "page pattern on the wire, encrypt = {encrypt}");
            let got = read_all(&key, encrypt, &bytes).unwrap();
            assert_eq!(got, [&b"SFPQ"[..], &page, &big].concat());
        }
    }

    /// A socket's side of `bytes`: a read returns what has arrived and was
    /// asked for, never past the next of `arrived` (the offsets where the
    /// sender's writes ended) nor more than `most` bytes; counts the reads.
    struct Socket<'a> {
        bytes: &'a [u8],
        at: usize,
        arrived: Vec<usize>,
        most: usize,
        reads: usize,
    }

    impl<'a> Socket<'a> {
        fn new(bytes: &'a [u8], arrived: Vec<usize>, most: usize) -> Socket<'a> {
            Socket { bytes, at: 0, arrived, most, reads: 0 }
        }
    }

    impl Read for Socket<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            self.reads += 1;
            let upto = self.arrived.iter().copied().find(|&c| c > self.at).unwrap_or(self.bytes.len());
            let n = out.len().min(upto - self.at).min(self.most);
            out[..n].copy_from_slice(&self.bytes[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }

    fn reader<'a>(key: &SecretKey, encrypt: bool, socket: Socket<'a>) -> StreamReader<Socket<'a>> {
        let s = if encrypt { Secrecy::encrypted(key, b"c", b"s", false) } else { Secrecy::clear() };
        s.split(socket, io::sink()).0
    }

    #[test]
    fn a_record_that_arrived_whole_takes_one_read() {
        // A request, a page reply, and a record sent while the first was being read.
        let key = SecretKey([3; 32]);
        let messages: [&[u8]; 3] = [b"SFPQ\x01\0\0\0\0\x10\0\0\0\0\0\0", &[0x77; 4096 + 9], b"last"];
        let bytes = wire(&key, true, &messages);
        let mut ends = Vec::new();
        let mut end = 0;
        for m in &messages {
            end += 4 + m.len() + TAG_LEN;
            ends.push(end);
        }
        assert_eq!(end, bytes.len());
        // Each record arrives on its own; the last two together.
        let mut r = reader(&key, true, Socket::new(&bytes, vec![ends[0], ends[2]], usize::MAX));
        for (i, m) in messages.iter().enumerate() {
            let mut got = vec![0u8; m.len()];
            r.read_exact(&mut got).unwrap();
            assert_eq!(&got, m, "record {i}");
        }
        assert_eq!(r.inner.reads, 2, "one read per arrival, not a length and a body per record");
        assert!(!r.has_buffered());
        assert_eq!(r.read(&mut [0u8; 1]).unwrap(), 0, "then a clean end");
    }

    #[test]
    fn records_split_across_reads_are_put_together() {
        let key = SecretKey([4; 32]);
        let page = [0x5au8; 4096];
        let big = vec![0xa5u8; RECORD + 7]; // two records
        let want = [&b"SFPR"[..], &page, &big, b"x"].concat();
        for encrypt in [false, true] {
            let bytes = wire(&key, encrypt, &[b"SFPR", &page, &big, b"x"]);
            for most in [1, 2, 3, 5, 4099, 70_000, usize::MAX] {
                let mut r = reader(&key, encrypt, Socket::new(&bytes, vec![], most));
                let mut got = Vec::new();
                r.read_to_end(&mut got).unwrap();
                assert!(got == want, "encrypt {encrypt}, reads of at most {most} bytes: {} bytes back, {} sent", got.len(), want.len());
            }
        }
    }

    #[test]
    fn a_connection_cut_inside_a_record_is_an_error_and_at_its_end_a_clean_end() {
        let key = SecretKey([5; 32]);
        let bytes = wire(&key, true, &[b"one", b"two!"]);
        let first = 4 + 3 + TAG_LEN;
        for cut in 0..=bytes.len() {
            for most in [1, usize::MAX] {
                let mut r = reader(&key, true, Socket::new(&bytes[..cut], vec![], most));
                let mut got = Vec::new();
                let res = r.read_to_end(&mut got);
                match cut {
                    0 => assert!(res.is_ok() && got.is_empty(), "cut at 0"),
                    c if c == first => assert!(res.is_ok() && got == b"one", "cut between the records"),
                    c if c == bytes.len() => assert!(res.is_ok() && got == b"onetwo!", "whole"),
                    c => {
                        let e = res.expect_err("a record cut short");
                        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "cut at {c}: {e}");
                        assert_eq!(got, if c > first { &b"one"[..] } else { &b""[..] }, "cut at {c}: only whole records' bytes");
                    }
                }
            }
        }
    }

    #[test]
    fn tampered_reordered_or_foreign_records_are_refused() {
        let key = SecretKey([1; 32]);
        let bytes = wire(&key, true, &[b"first record", b"second record"]);
        let first = 4 + b"first record".len() + TAG_LEN;
        let refused = |b: &[u8], k: &SecretKey| {
            let e = read_all(k, true, b).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        };
        for i in [0usize, 5, first - 1, first + 6] {
            let mut t = bytes.clone();
            t[i] ^= 1;
            if i == 0 {
                // A changed length either reads past the end or fails the tag.
                assert!(read_all(&key, true, &t).is_err());
            } else {
                refused(&t, &key);
            }
        }
        // The second record first: its nonce is the first's.
        refused(&[&bytes[first..], &bytes[..first]].concat(), &key);
        // Another key.
        refused(&bytes, &SecretKey([2; 32]));
        // Cut short.
        assert_eq!(read_all(&key, true, &bytes[..bytes.len() - 1]).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
