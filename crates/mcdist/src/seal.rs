//! Per-ticket keys and message authentication codes (keyed BLAKE3).
//!
//! A ticket's key is made by whoever serves its pages (the parent of a
//! remote fork, the source of a move) and reaches the hosts that fetch them
//! only over authenticated control channels (see docs/SECURITY.md). Every
//! multicast datagram carries a MAC under that key and every request
//! datagram ends with one; the page server's TCP connections start with a
//! mutual challenge under it. Without the key a peer can neither fetch
//! pages nor inject any.

/// A ticket's secret: 32 random bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Key(pub [u8; 32]);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)") // never printed
    }
}

/// Length of a MAC on the wire.
pub const MAC_LEN: usize = 32;

impl Key {
    /// A fresh key from the kernel's random source (`getrandom(2)`).
    pub fn random() -> Key {
        let mut k = [0u8; 32];
        let mut got = 0usize;
        while got < k.len() {
            // SAFETY: writes at most `k.len() - got` bytes into the live local array from offset `got`.
            let n = unsafe { libc::getrandom(k[got..].as_mut_ptr().cast(), k.len() - got, 0) };
            match usize::try_from(n) {
                Ok(n) => got += n,
                Err(_) if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
                // getrandom(2) only fails on bad arguments or before the pool is seeded (it blocks then).
                Err(_) => panic!("getrandom failed: {}", std::io::Error::last_os_error()),
            }
        }
        Key(k)
    }

    /// Keyed BLAKE3 of the concatenation of `parts`, then a domain label and
    /// its length (a suffix, so a page given first starts on a chunk
    /// boundary and is hashed with all of BLAKE3's SIMD lanes).
    pub fn mac(&self, domain: &[u8], parts: &[&[u8]]) -> [u8; MAC_LEN] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        for p in parts {
            h.update(p);
        }
        h.update(domain);
        h.update(&u64::try_from(domain.len()).unwrap_or(u64::MAX).to_le_bytes());
        *h.finalize().as_bytes()
    }

    /// Whether `mac` is this key's MAC of `parts` (compared in constant time).
    pub fn verify(&self, domain: &[u8], parts: &[&[u8]], mac: &[u8]) -> bool {
        let Ok(mac) = <[u8; MAC_LEN]>::try_from(mac) else { return false };
        blake3::Hash::from(self.mac(domain, parts)) == blake3::Hash::from(mac)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_depend_on_key_domain_and_data() {
        let (a, b) = (Key([1; 32]), Key([2; 32]));
        let m = a.mac(b"d", &[b"x", b"y"]);
        assert!(a.verify(b"d", &[b"xy"], &m));
        assert!(!b.verify(b"d", &[b"xy"], &m));
        assert!(!a.verify(b"e", &[b"xy"], &m));
        assert!(!a.verify(b"d", &[b"xz"], &m));
        assert!(!a.verify(b"d", &[b"xy"], &m[..31]));
        assert_ne!(Key::random(), Key::random());
    }
}
