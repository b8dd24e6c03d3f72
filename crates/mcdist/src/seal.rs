//! Message authentication codes (keyed BLAKE3) under a ticket's or a
//! move's key ([`SecretKey`], defined with the control messages that carry
//! it).
//!
//! A ticket's key is made by whoever serves its pages (the parent of a
//! remote fork, the source of a move) and reaches the hosts that fetch them
//! only over authenticated control channels (see docs/SECURITY.md). Every
//! multicast datagram carries a MAC under that key and every request
//! datagram ends with one; the page server's TCP connections start with a
//! mutual challenge under it. Without the key a peer can neither fetch
//! pages nor inject any.
//!
//! Where the network is not trusted (`fork.encrypt`, on by default) the
//! payloads are also encrypted: [`Cipher`] is AES-256-GCM (ring, the AEAD
//! rustls already uses) under a key derived from the ticket's key with
//! BLAKE3's KDF, one context per use ([`PAGE_STREAM_CLIENT`],
//! [`PAGE_STREAM_SERVER`], [`MULTICAST_PAGE`]), so no two uses ever share
//! a key and each use keeps its nonces unique on its own (see its callers).

use starling_proto::SecretKey;

/// Length of a MAC on the wire.
pub const MAC_LEN: usize = 32;

/// Keyed BLAKE3 of the concatenation of `parts`, then a domain label and
/// its length (a suffix, so a page given first starts on a chunk boundary
/// and is hashed with all of BLAKE3's SIMD lanes).
pub fn mac(key: &SecretKey, domain: &[u8], parts: &[&[u8]]) -> [u8; MAC_LEN] {
    let mut h = blake3::Hasher::new_keyed(&key.0);
    for p in parts {
        h.update(p);
    }
    h.update(domain);
    h.update(&u64::try_from(domain.len()).unwrap_or(u64::MAX).to_le_bytes());
    *h.finalize().as_bytes()
}

/// Whether `tag` is `key`'s MAC of `parts` (compared in constant time).
pub fn verify(key: &SecretKey, domain: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    let Ok(tag) = <[u8; MAC_LEN]>::try_from(tag) else { return false };
    blake3::Hash::from(mac(key, domain, parts)) == blake3::Hash::from(tag)
}

/// KDF context of a page-server or migration connection, client → server
/// (salted with both handshake nonces: one key per connection and direction).
pub const PAGE_STREAM_CLIENT: &str = "starling 2026-11 page stream, client to server";
/// KDF context of the same connection, server → client.
pub const PAGE_STREAM_SERVER: &str = "starling 2026-11 page stream, server to client";
/// KDF context of a multicast sender's pages (salted with the sender's random id).
pub const MULTICAST_PAGE: &str = "starling 2026-11 multicast page";

/// Length of an AEAD tag on the wire.
pub const TAG_LEN: usize = 16;
/// Length of an AEAD nonce.
pub const NONCE_LEN: usize = 12;

/// An AEAD key for one use of a ticket's or move's key (module doc).
pub struct Cipher(ring::aead::LessSafeKey);

impl Cipher {
    /// The key of `context` derived from `key` and `salt` (BLAKE3 `derive_key`
    /// of the key followed by the salt).
    pub fn derive(key: &SecretKey, context: &str, salt: &[&[u8]]) -> Cipher {
        let mut h = blake3::Hasher::new_derive_key(context);
        h.update(&key.0);
        for s in salt {
            h.update(s);
        }
        let k = h.finalize();
        let unbound = ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, k.as_bytes()).expect("AES-256 takes a 32-byte key");
        Cipher(ring::aead::LessSafeKey::new(unbound))
    }

    /// Encrypt `data` in place; the tag. `nonce` must never have been used
    /// with this key before (the caller's counter).
    pub fn seal(&self, nonce: [u8; NONCE_LEN], aad: &[u8], data: &mut [u8]) -> [u8; TAG_LEN] {
        let tag = self
            .0
            .seal_in_place_separate_tag(ring::aead::Nonce::assume_unique_for_key(nonce), ring::aead::Aad::from(aad), data)
            .expect("AES-GCM seals any length below 64 GiB");
        let mut out = [0u8; TAG_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Decrypt `data` in place if `tag` authenticates it (with `aad` and
    /// `nonce`); false (and `data` unspecified) if not.
    pub fn open(&self, nonce: [u8; NONCE_LEN], aad: &[u8], data: &mut [u8], tag: &[u8]) -> bool {
        let Ok(tag) = <[u8; TAG_LEN]>::try_from(tag) else { return false };
        self.0
            .open_in_place_separate_tag(ring::aead::Nonce::assume_unique_for_key(nonce), ring::aead::Aad::from(aad), tag.into(), data, 0..)
            .is_ok()
    }
}

/// A nonce from a counter (the first 8 bytes, little-endian; the rest zero).
pub fn counter_nonce(n: u64) -> [u8; NONCE_LEN] {
    let mut out = [0u8; NONCE_LEN];
    out[..8].copy_from_slice(&n.to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_depend_on_key_domain_and_data() {
        let (a, b) = (SecretKey([1; 32]), SecretKey([2; 32]));
        let m = mac(&a, b"d", &[b"x", b"y"]);
        assert!(verify(&a, b"d", &[b"xy"], &m));
        assert!(!verify(&b, b"d", &[b"xy"], &m));
        assert!(!verify(&a, b"e", &[b"xy"], &m));
        assert!(!verify(&a, b"d", &[b"xz"], &m));
        assert!(!verify(&a, b"d", &[b"xy"], &m[..31]));
        assert_ne!(SecretKey::random(), SecretKey::random());
    }

    #[test]
    fn ciphers_open_only_what_they_sealed() {
        let key = SecretKey([3; 32]);
        let a = Cipher::derive(&key, PAGE_STREAM_CLIENT, &[b"salt"]);
        let mut data = b"a page of memory".to_vec();
        let tag = a.seal(counter_nonce(1), b"aad", &mut data);
        assert_ne!(&data[..], b"a page of memory");
        let sealed = data.clone();
        let open = |c: &Cipher, nonce: u64, aad: &[u8], bytes: &[u8], tag: &[u8]| {
            let mut d = bytes.to_vec();
            c.open(counter_nonce(nonce), aad, &mut d, tag).then_some(d)
        };
        assert_eq!(open(&a, 1, b"aad", &sealed, &tag).as_deref(), Some(&b"a page of memory"[..]));
        // Another context, salt or key, nonce, associated data, ciphertext or tag: refused.
        assert!(open(&Cipher::derive(&key, PAGE_STREAM_SERVER, &[b"salt"]), 1, b"aad", &sealed, &tag).is_none());
        assert!(open(&Cipher::derive(&key, PAGE_STREAM_CLIENT, &[b"salu"]), 1, b"aad", &sealed, &tag).is_none());
        assert!(open(&Cipher::derive(&SecretKey([4; 32]), PAGE_STREAM_CLIENT, &[b"salt"]), 1, b"aad", &sealed, &tag).is_none());
        assert!(open(&a, 2, b"aad", &sealed, &tag).is_none());
        assert!(open(&a, 1, b"aae", &sealed, &tag).is_none());
        let mut flipped = sealed.clone();
        flipped[3] ^= 0x40;
        assert!(open(&a, 1, b"aad", &flipped, &tag).is_none());
        assert!(open(&a, 1, b"aad", &sealed, &tag[..15]).is_none());
    }
}
