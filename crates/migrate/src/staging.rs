//! Pages the target received before the freeze, by address.
//!
//! They are kept in anonymous mappings of their own, marked `MADV_DONTFORK`:
//! the agent forks to start the restored task's sandbox during the pause, and
//! fork() copies the page tables of everything the agent holds (2 GiB staged
//! in ordinary heap memory cost ~100 ms of pause). The agent's children only
//! exec, and no allocator ever hands these pages to anything else.

use starling_fork::fault::LocalPages;
use starling_image::PAGE_BYTES;
use std::collections::HashMap;

const PAGE: usize = PAGE_BYTES;
/// Pages per mapping (64 MiB).
const SLAB_PAGES: usize = 16384;

/// One anonymous mapping of `SLAB_PAGES` pages, filled from the start.
struct Slab {
    base: *mut u8,
    used: usize,
}

// SAFETY: a Slab owns its mapping outright; the bytes are plain data, written
// only through `&mut Staging` and read through `&Staging`.
unsafe impl Send for Slab {}
// SAFETY: as above: shared access only reads.
unsafe impl Sync for Slab {}

impl Slab {
    fn new() -> Option<Slab> {
        let len = SLAB_PAGES * PAGE;
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        // SAFETY: madvise on the mapping just made; MADV_DONTFORK only changes what a child inherits.
        if unsafe { libc::madvise(base, len, libc::MADV_DONTFORK) } != 0 {
            log::debug!("staging: MADV_DONTFORK: {}", std::io::Error::last_os_error());
        }
        Some(Slab { base: base.cast(), used: 0 })
    }

    fn page(&self, i: usize) -> &[u8] {
        debug_assert!(i < self.used);
        // SAFETY: page i < used lies inside the mapping and was written by `push`.
        unsafe { std::slice::from_raw_parts(self.base.add(i * PAGE), PAGE) }
    }

    /// Copy `page` over page `i` (< used).
    fn put(&mut self, i: usize, page: &[u8]) {
        assert!(i < self.used && page.len() == PAGE, "page {i} of a slab with {} pages", self.used);
        // SAFETY: i < used <= SLAB_PAGES, so the page lies inside the mapping, which
        // `&mut self` alone writes; `page` is PAGE bytes and cannot overlap it.
        unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), self.base.add(i * PAGE), PAGE) };
    }

    /// Copy one page in; its index.
    fn push(&mut self, page: &[u8]) -> usize {
        let i = self.used;
        // SAFETY: i < SLAB_PAGES (checked by the caller), so the page lies inside the mapping,
        // which nothing else writes; `page` is PAGE bytes and cannot overlap it.
        unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), self.base.add(i * PAGE), PAGE) };
        self.used += 1;
        i
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping this Slab made; no slice of it outlives `&self`.
        unsafe { libc::munmap(self.base.cast(), SLAB_PAGES * PAGE) };
    }
}

/// Pre-copied pages: where each page's latest copy is.
#[derive(Default)]
pub struct Staging {
    slabs: Vec<Slab>,
    index: HashMap<u64, (u32, u32)>,
}

impl Staging {
    /// Keep a batch (`data` holds `addrs.len()` pages); later copies of a
    /// page replace earlier ones. False if the batch is malformed or there
    /// is no memory for it.
    pub fn add(&mut self, addrs: &[u64], data: Vec<u8>) -> bool {
        if data.len() != addrs.len() * PAGE {
            return false;
        }
        for (&a, page) in addrs.iter().zip(data.chunks_exact(PAGE)) {
            if let Some(&(s, i)) = self.index.get(&a) {
                // Sent again (written since): its slot takes the new copy,
                // so a page re-sent every round is staged once, not per round.
                self.slabs[s as usize].put(i as usize, page);
                continue;
            }
            if self.slabs.last().is_none_or(|s| s.used == SLAB_PAGES) {
                match Slab::new() {
                    Some(s) => self.slabs.push(s),
                    None => return false,
                }
            }
            let Ok(s) = u32::try_from(self.slabs.len() - 1) else { return false };
            let slab = self.slabs.last_mut().expect("pushed above");
            let i = u32::try_from(slab.push(page)).expect("fewer than SLAB_PAGES pages per slab");
            self.index.insert(a, (s, i));
        }
        true
    }

    /// Forget pages written after they were sent.
    pub fn invalidate(&mut self, addrs: &[u64]) {
        for a in addrs {
            self.index.remove(a);
        }
    }

    pub fn pages(&self) -> usize {
        self.index.len()
    }
}

impl LocalPages for Staging {
    fn page(&self, addr: u64) -> Option<&[u8]> {
        let &(s, i) = self.index.get(&addr)?;
        Some(self.slabs[s as usize].page(i as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latest_copy_wins_and_invalidated_pages_are_gone() {
        let mut s = Staging::default();
        assert!(s.add(&[0x1000, 0x2000], [vec![1u8; PAGE], vec![2u8; PAGE]].concat()));
        assert!(s.add(&[0x2000], vec![3u8; PAGE]));
        assert!(!s.add(&[0x3000], vec![0u8; 10]), "a batch whose bytes do not match its pages is refused");
        assert_eq!(s.page(0x1000).map(|p| p[0]), Some(1));
        assert_eq!(s.page(0x2000).map(|p| p[0]), Some(3));
        s.invalidate(&[0x1000]);
        assert!(s.page(0x1000).is_none());
        assert_eq!(s.pages(), 1);
    }

    #[test]
    fn a_page_sent_again_takes_its_old_slot() {
        let mut s = Staging::default();
        for round in 1..=9u8 {
            assert!(s.add(&[0x1000, 0x2000], [vec![round; PAGE], vec![round + 100; PAGE]].concat()));
        }
        assert_eq!(s.slabs.len(), 1);
        assert_eq!(s.slabs[0].used, 2, "nine copies of two pages hold two slots");
        assert_eq!(s.page(0x1000).map(|p| p[0]), Some(9));
        assert_eq!(s.page(0x2000).map(|p| p[PAGE - 1]), Some(109));
    }

    #[test]
    fn pages_beyond_one_slab_keep_their_bytes() {
        let mut s = Staging::default();
        let n = SLAB_PAGES + 3;
        for k in 0..n as u64 {
            let mut page = vec![0u8; PAGE];
            page[..8].copy_from_slice(&(k * 7 + 1).to_le_bytes());
            assert!(s.add(&[k * PAGE as u64], page));
        }
        assert_eq!(s.slabs.len(), 2);
        for k in [0u64, SLAB_PAGES as u64 - 1, SLAB_PAGES as u64, n as u64 - 1] {
            let got = s.page(k * PAGE as u64).expect("staged");
            assert_eq!(u64::from_le_bytes(got[..8].try_into().unwrap()), k * 7 + 1);
        }
    }
}
