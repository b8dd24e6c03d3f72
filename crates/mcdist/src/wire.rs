//! Datagram formats (little-endian).
//!
//! **Pages are split into datagrams that fit the link MTU** instead of
//! relying on IP fragmentation: a 4 KiB UDP datagram on a 1500-byte bridge
//! becomes three IP fragments and the loss of any one loses the page, but the
//! kernel only notices after its reassembly timeout (30 s) and holds the
//! other fragments meanwhile. With our own fragments the receiver keeps what
//! arrived, verifies the whole page against the BLAKE3 hash that every
//! fragment carries, and re-requests after its own (milliseconds) timeout.
//! At MTU 1500 a page is 3 datagrams of 64 + 1366 bytes (1458 bytes on IP).
//!
//! ```text
//! group datagram (sender → G:port), header 64 bytes:
//!   0 magic "SFMC" | 4 kind u8 | 5 fragment index u8 | 6 fragment count u8 | 7 0
//!   8 ticket u64 | 16 page address u64 | 24 sequence u64 | 32 MAC [32]
//!   (encrypted FRAGMENT: 32 AEAD tag [16] | sender id [16])
//!   64 payload: bytes [index × ceil(4096/count) ..] of the page (kind FRAGMENT only)
//!   kinds: PROBE (answer to HELLO; address = sequence of the probe), FRAGMENT,
//!          ZERO (the page is all zero), UNREADABLE (the template cannot read it)
//!
//! request datagram (receiver → sender's request socket, unicast), header 40 bytes:
//!   0 magic "SFMQ" | 4 kind u8 (HELLO, PAGES) | 5..8 0 | 8 ticket u64
//!   16 receiver id u32 | 20 count u16 | 22 0 | 24 receive rate bytes/s u64
//!   32 smoothed request→arrival time µs u32 | 36 0 | 40 count × page address u64
//!   then MAC [32] = keyed BLAKE3 of everything before it ("SFMQ" domain)
//! ```
//!
//! **MACs** (keyed BLAKE3 under the ticket's [`SecretKey`], see [`crate::seal`]):
//! a FRAGMENT's MAC covers the ticket, the address and the whole page (every
//! fragment of a page carries the same one; the receiver checks it on the
//! reassembled page); a PROBE's, ZERO's or UNREADABLE's covers kind, ticket,
//! address and sequence. A datagram or page whose MAC does not verify is
//! dropped (`ReceiverStats::forged`, `SenderStats::invalid`) and the page is
//! asked for again.
//!
//! **Encryption** (when the sender's `fork.encrypt` is on; a receiver that
//! requires it drops clear pages): a FRAGMENT's payload is a fragment of the
//! page encrypted with AES-256-GCM ([`seal::Cipher`]) under a key derived
//! from the ticket's key and the sender's random 16-byte id (carried in
//! every fragment), with the ticket and address as associated data and the
//! transmission's sequence number as nonce; the AEAD tag takes the place of
//! the MAC. Every fragment of one transmission carries the same sequence
//! number, tag and id. Nonces never repeat under a key: the key is the
//! sender's own (its id is 128 random bits), and its sequence number grows
//! by one for every datagram it sends that is not a fragment and once per
//! page transmission. What stays in clear: kinds, addresses, sequence
//! numbers, requests (page addresses and rates) — which pages, never their
//! bytes.

use crate::seal::{self, MAC_LEN};
use starling_proto::SecretKey;

pub const PAGE: usize = 4096;
pub const DATA_MAGIC: [u8; 4] = *b"SFMC";
pub const REQ_MAGIC: [u8; 4] = *b"SFMQ";
pub const DATA_HEADER: usize = 64;
pub const REQ_HEADER: usize = 40;
/// Page addresses per request datagram (fits any MTU ≥ 1100).
pub const MAX_REQ_PAGES: usize = 128;
/// IPv4 + UDP header bytes added to every datagram on the wire.
pub const IP_UDP_OVERHEAD: usize = 28;

pub const KIND_PROBE: u8 = 1;
pub const KIND_FRAGMENT: u8 = 2;
pub const KIND_ZERO: u8 = 3;
pub const KIND_UNREADABLE: u8 = 4;

pub const REQ_HELLO: u8 = 1;
pub const REQ_PAGES: u8 = 2;

/// How many datagrams a page takes at this MTU (IP MTU of the link).
pub fn fragments_for_mtu(mtu: usize) -> u8 {
    let room = mtu.saturating_sub(IP_UDP_OVERHEAD + DATA_HEADER).max(512);
    u8::try_from(PAGE.div_ceil(room).min(8)).expect("at most 8")
}

/// Byte range of fragment `index` of `count`.
pub fn fragment_range(index: u8, count: u8) -> Option<std::ops::Range<usize>> {
    if count == 0 || index >= count {
        return None;
    }
    let len = PAGE.div_ceil(count as usize);
    let start = index as usize * len;
    (start < PAGE).then(|| start..(start + len).min(PAGE))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataHeader {
    pub kind: u8,
    pub index: u8,
    pub count: u8,
    pub ticket: u64,
    pub addr: u64,
    pub seq: u64,
    /// See the module doc ([`DataHeader::seal`]).
    pub mac: [u8; 32],
}

impl DataHeader {
    pub fn write(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&DATA_MAGIC);
        out[4] = self.kind;
        out[5] = self.index;
        out[6] = self.count;
        out[7] = 0;
        out[8..16].copy_from_slice(&self.ticket.to_le_bytes());
        out[16..24].copy_from_slice(&self.addr.to_le_bytes());
        out[24..32].copy_from_slice(&self.seq.to_le_bytes());
        out[32..64].copy_from_slice(&self.mac);
    }

    /// The MAC this header must carry: of `page` for a FRAGMENT (the whole
    /// page), of the header's own fields for the other kinds.
    pub fn expected_mac(&self, key: &SecretKey, page: &[u8]) -> [u8; MAC_LEN] {
        if self.kind == KIND_FRAGMENT {
            seal::mac(key, b"SFMC page", &[page, &self.ticket.to_le_bytes(), &self.addr.to_le_bytes()])
        } else {
            seal::mac(key, b"SFMC control", &[&[self.kind], &self.ticket.to_le_bytes(), &self.addr.to_le_bytes(), &self.seq.to_le_bytes()])
        }
    }

    /// Set the MAC (`page`: the whole page of a FRAGMENT, else empty).
    pub fn seal(&mut self, key: &SecretKey, page: &[u8]) {
        self.mac = self.expected_mac(key, page);
    }

    /// Whether the MAC is right (`page` as for [`DataHeader::seal`]; constant time).
    pub fn verify(&self, key: &SecretKey, page: &[u8]) -> bool {
        blake3::Hash::from(self.expected_mac(key, page)) == blake3::Hash::from(self.mac)
    }

    /// The sender id of an encrypted FRAGMENT (the KDF salt of its key).
    pub fn sender_id(&self) -> [u8; 16] {
        self.mac[16..].try_into().expect("16 bytes")
    }

    /// Encrypt a FRAGMENT's whole `page` in place under `cipher` (the
    /// sender's, of id `sender`) and set the tag; the nonce is `seq`, which
    /// must be this transmission's own (module doc).
    pub fn seal_page(&mut self, cipher: &seal::Cipher, sender: [u8; 16], page: &mut [u8]) {
        let tag = cipher.seal(seal::counter_nonce(self.seq), &self.page_aad(), page);
        self.mac[..seal::TAG_LEN].copy_from_slice(&tag);
        self.mac[seal::TAG_LEN..].copy_from_slice(&sender);
    }

    /// Decrypt a reassembled encrypted `page` in place; false if it does not
    /// authenticate (`cipher`: derived for [`DataHeader::sender_id`]).
    pub fn open_page(&self, cipher: &seal::Cipher, page: &mut [u8]) -> bool {
        cipher.open(seal::counter_nonce(self.seq), &self.page_aad(), page, &self.mac[..seal::TAG_LEN])
    }

    fn page_aad(&self) -> [u8; 16] {
        let mut aad = [0u8; 16];
        aad[..8].copy_from_slice(&self.ticket.to_le_bytes());
        aad[8..].copy_from_slice(&self.addr.to_le_bytes());
        aad
    }

    /// Parse a datagram; None for anything malformed (peers are not trusted).
    pub fn parse(d: &[u8]) -> Option<(DataHeader, &[u8])> {
        if d.len() < DATA_HEADER || d[..4] != DATA_MAGIC {
            return None;
        }
        let u = |o: usize| u64::from_le_bytes(d[o..o + 8].try_into().expect("8 bytes"));
        let h = DataHeader {
            kind: d[4],
            index: d[5],
            count: d[6],
            ticket: u(8),
            addr: u(16),
            seq: u(24),
            mac: d[32..64].try_into().expect("32 bytes"),
        };
        let payload = &d[DATA_HEADER..];
        match h.kind {
            KIND_FRAGMENT => {
                let r = fragment_range(h.index, h.count)?;
                (payload.len() == r.len() && h.addr.is_multiple_of(PAGE as u64)).then_some((h, payload))
            }
            KIND_PROBE | KIND_ZERO | KIND_UNREADABLE => payload.is_empty().then_some((h, payload)),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub kind: u8,
    pub ticket: u64,
    pub receiver: u32,
    pub rate: u64,
    pub rtt_us: u32,
    pub addrs: Vec<u64>,
}

impl Request {
    pub fn encode(&self) -> Vec<u8> {
        let n = self.addrs.len().min(MAX_REQ_PAGES);
        let mut out = vec![0u8; REQ_HEADER + 8 * n];
        out[..4].copy_from_slice(&REQ_MAGIC);
        out[4] = self.kind;
        out[8..16].copy_from_slice(&self.ticket.to_le_bytes());
        out[16..20].copy_from_slice(&self.receiver.to_le_bytes());
        out[20..22].copy_from_slice(&u16::try_from(n).expect("a request holds at most MAX_REQ_PAGES").to_le_bytes());
        out[24..32].copy_from_slice(&self.rate.to_le_bytes());
        out[32..36].copy_from_slice(&self.rtt_us.to_le_bytes());
        for (i, a) in self.addrs[..n].iter().enumerate() {
            out[REQ_HEADER + 8 * i..REQ_HEADER + 8 * i + 8].copy_from_slice(&a.to_le_bytes());
        }
        out
    }

    /// [`Request::encode`] followed by its MAC under `key`.
    pub fn encode_sealed(&self, key: &SecretKey) -> Vec<u8> {
        let mut out = self.encode();
        let mac = seal::mac(key, b"SFMQ", &[&out]);
        out.extend_from_slice(&mac);
        out
    }

    /// Parse a datagram of [`Request::encode_sealed`]; None when malformed or its MAC is wrong.
    pub fn parse_sealed(d: &[u8], key: &SecretKey) -> Option<Request> {
        let body = d.len().checked_sub(MAC_LEN).map(|n| &d[..n])?;
        seal::verify(key, b"SFMQ", &[body], &d[body.len()..]).then(|| Request::parse(body))?
    }

    pub fn parse(d: &[u8]) -> Option<Request> {
        if d.len() < REQ_HEADER || d[..4] != REQ_MAGIC || !matches!(d[4], REQ_HELLO | REQ_PAGES) {
            return None;
        }
        let n = u16::from_le_bytes([d[20], d[21]]) as usize;
        if n > MAX_REQ_PAGES || d.len() != REQ_HEADER + 8 * n {
            return None;
        }
        let u = |o: usize| u64::from_le_bytes(d[o..o + 8].try_into().expect("8 bytes"));
        Some(Request {
            kind: d[4],
            ticket: u(8),
            receiver: u32::from_le_bytes(d[16..20].try_into().expect("4 bytes")),
            rate: u(24),
            rtt_us: u32::from_le_bytes(d[32..36].try_into().expect("4 bytes")),
            addrs: (0..n).map(|i| u(REQ_HEADER + 8 * i)).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_cover_the_page_and_fit_the_mtu() {
        for mtu in [576usize, 1400, 1500, 9000] {
            let n = fragments_for_mtu(mtu);
            let mut covered = 0;
            for i in 0..n {
                let r = fragment_range(i, n).unwrap();
                assert_eq!(r.start, covered);
                covered = r.end;
                assert!(mtu < 600 || r.len() + DATA_HEADER + IP_UDP_OVERHEAD <= mtu, "mtu {mtu}");
            }
            assert_eq!(covered, PAGE);
        }
        assert_eq!(fragments_for_mtu(1500), 3);
        assert_eq!(fragments_for_mtu(9000), 1);
        assert!(fragment_range(3, 3).is_none());
    }

    #[test]
    fn malformed_datagrams_are_refused() {
        let h = DataHeader { kind: KIND_FRAGMENT, index: 1, count: 3, ticket: 7, addr: 0x1000, seq: 9, mac: [5; 32] };
        let r = fragment_range(1, 3).unwrap();
        let mut d = vec![0u8; DATA_HEADER + r.len()];
        h.write(&mut d);
        assert_eq!(DataHeader::parse(&d).unwrap().0, h);
        assert!(DataHeader::parse(&d[..d.len() - 1]).is_none());
        let mut bad = d.clone();
        bad[16] = 1; // unaligned address
        assert!(DataHeader::parse(&bad).is_none());
        let q = Request { kind: REQ_PAGES, ticket: 7, receiver: 2, rate: 1000, rtt_us: 50, addrs: vec![0x1000, 0x2000] };
        let e = q.encode();
        assert_eq!(Request::parse(&e).unwrap(), q);
        assert!(Request::parse(&e[..e.len() - 8]).is_none());
    }

    #[test]
    fn seals_are_checked() {
        let (key, other) = (SecretKey([9; 32]), SecretKey([8; 32]));
        let page = vec![7u8; PAGE];
        let mut h = DataHeader { kind: KIND_FRAGMENT, index: 0, count: 3, ticket: 7, addr: 0x1000, seq: 9, mac: [0; 32] };
        h.seal(&key, &page);
        assert!(h.verify(&key, &page));
        assert!(!h.verify(&other, &page));
        let mut changed = page.clone();
        changed[4095] = 0;
        assert!(!h.verify(&key, &changed));
        let mut z = DataHeader { kind: KIND_ZERO, index: 0, count: 0, ticket: 7, addr: 0x1000, seq: 3, mac: [0; 32] };
        z.seal(&key, &[]);
        assert!(z.verify(&key, &[]));
        z.addr = 0x2000; // a ZERO moved to another page
        assert!(!z.verify(&key, &[]));
        // Encrypted: opens only as sealed, under the sender's key, at its address.
        let sender = [4u8; 16];
        let cipher = seal::Cipher::derive(&key, seal::MULTICAST_PAGE, &[&sender]);
        let mut e = DataHeader { kind: KIND_FRAGMENT, index: 0, count: 1, ticket: 7, addr: 0x1000, seq: 11, mac: [0; 32] };
        let mut sealed = page.clone();
        e.seal_page(&cipher, sender, &mut sealed);
        assert_ne!(sealed, page);
        assert_eq!(e.sender_id(), sender);
        let mut opened = sealed.clone();
        assert!(e.open_page(&cipher, &mut opened));
        assert_eq!(opened, page);
        let moved = DataHeader { addr: 0x2000, ..e.clone() };
        assert!(!moved.open_page(&cipher, &mut sealed.clone()));
        let replayed = DataHeader { seq: 12, ..e.clone() };
        assert!(!replayed.open_page(&cipher, &mut sealed.clone()));
        let mut tampered = sealed.clone();
        tampered[100] ^= 1;
        assert!(!e.open_page(&cipher, &mut tampered));
        assert!(!e.open_page(&seal::Cipher::derive(&other, seal::MULTICAST_PAGE, &[&sender]), &mut sealed.clone()));
        let q = Request { kind: REQ_PAGES, ticket: 7, receiver: 2, rate: 1000, rtt_us: 50, addrs: vec![0x1000] };
        let e = q.encode_sealed(&key);
        assert_eq!(Request::parse_sealed(&e, &key).unwrap(), q);
        assert!(Request::parse_sealed(&e, &other).is_none());
        assert!(Request::parse_sealed(&q.encode(), &key).is_none());
        let mut bad = e.clone();
        bad[REQ_HEADER] ^= 1;
        assert!(Request::parse_sealed(&bad, &key).is_none());
    }
}
