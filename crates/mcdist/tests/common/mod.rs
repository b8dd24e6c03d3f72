//! What the loopback tests share: a page source whose every page says which page it is.

use starling_mcdist::wire;
use starling_mcdist::{PageSource, SourcePage};

/// `pages` pages from `base`; page i is filled with the byte i + 1.
pub struct Image {
    base: u64,
    regions: Vec<(u64, u64)>,
}

impl Image {
    pub fn new(base: u64, pages: u64) -> Image {
        Image { base, regions: vec![(base, base + pages * wire::PAGE as u64)] }
    }
}

impl PageSource for Image {
    fn regions(&self) -> &[(u64, u64)] {
        &self.regions
    }

    fn read(&mut self, addrs: &[u64]) -> Vec<SourcePage> {
        addrs.iter().map(|a| SourcePage::Data(vec![page_byte(self.base, *a); wire::PAGE])).collect()
    }
}

/// The byte page `addr` of an [`Image`] at `base` is filled with.
pub fn page_byte(base: u64, addr: u64) -> u8 {
    u8::try_from((addr - base) / wire::PAGE as u64 + 1).expect("a few pages")
}
