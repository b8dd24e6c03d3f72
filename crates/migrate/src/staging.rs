//! Pages the target received before the freeze, by address.

use starling_fork::fault::LocalPages;
use starling_image::PAGE_SIZE;
use std::collections::HashMap;

const PAGE: usize = PAGE_SIZE as usize;

/// Pre-copied pages: the batches as they arrived, and where each page's
/// latest copy is.
#[derive(Default)]
pub struct Staging {
    batches: Vec<Vec<u8>>,
    index: HashMap<u64, (u32, u32)>,
}

impl Staging {
    /// Keep a batch (`data` holds `addrs.len()` pages); later copies of a
    /// page replace earlier ones.
    pub fn add(&mut self, addrs: &[u64], data: Vec<u8>) -> bool {
        if data.len() != addrs.len() * PAGE || self.batches.len() >= u32::MAX as usize {
            return false;
        }
        let b = self.batches.len() as u32;
        for (i, &a) in addrs.iter().enumerate() {
            self.index.insert(a, (b, i as u32));
        }
        self.batches.push(data);
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
        let &(b, i) = self.index.get(&addr)?;
        let off = i as usize * PAGE;
        Some(&self.batches[b as usize][off..off + PAGE])
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
}
