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
}
