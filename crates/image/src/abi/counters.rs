//! The per-clone counters of a fault handler, by name.

/// What one clone's fault handler did (reported per clone in `CloneStats`
/// and read by `sf_clone_stat` by index, see [`CloneCounter`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct CloneCounters {
    pub faults: u64,
    /// Pages that came from the page server (TCP or multicast).
    pub pages_fetched: u64,
    pub pages_zero: u64,
    /// Pages read from the host's copy of a mapped file.
    pub pages_file: u64,
    pub fetch_requests: u64,
    /// REMOVE/UNMAP events (memory the clone discarded).
    pub events_remove: u64,
    /// How the clone got its pages (`starling_mcdist::Mode` as a number).
    pub mode: u64,
    /// Pages installed from the multicast group without this clone asking
    /// (included in `pages_fetched`).
    pub pages_multicast_unsolicited: u64,
}

/// A counter's index in the C ABI (`sf_clone_stat(t, id, which)`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloneCounter {
    Faults = 0,
    PagesFetched = 1,
    PagesZero = 2,
    PagesFile = 3,
    FetchRequests = 4,
    EventsRemove = 5,
    Mode = 6,
    PagesMulticastUnsolicited = 7,
}

impl CloneCounter {
    pub const fn from_index(i: i32) -> Option<CloneCounter> {
        Some(match i {
            0 => CloneCounter::Faults,
            1 => CloneCounter::PagesFetched,
            2 => CloneCounter::PagesZero,
            3 => CloneCounter::PagesFile,
            4 => CloneCounter::FetchRequests,
            5 => CloneCounter::EventsRemove,
            6 => CloneCounter::Mode,
            7 => CloneCounter::PagesMulticastUnsolicited,
            _ => return None,
        })
    }
}

impl CloneCounter {
    /// Every counter, in index order.
    pub const ALL: [CloneCounter; 8] = [
        CloneCounter::Faults,
        CloneCounter::PagesFetched,
        CloneCounter::PagesZero,
        CloneCounter::PagesFile,
        CloneCounter::FetchRequests,
        CloneCounter::EventsRemove,
        CloneCounter::Mode,
        CloneCounter::PagesMulticastUnsolicited,
    ];

    /// Its name (as the Python API reports it: the field's name).
    pub const fn name(self) -> &'static str {
        match self {
            CloneCounter::Faults => "faults",
            CloneCounter::PagesFetched => "pages_fetched",
            CloneCounter::PagesZero => "pages_zero",
            CloneCounter::PagesFile => "pages_file",
            CloneCounter::FetchRequests => "fetch_requests",
            CloneCounter::EventsRemove => "events_remove",
            CloneCounter::Mode => "mode",
            CloneCounter::PagesMulticastUnsolicited => "pages_multicast_unsolicited",
        }
    }
}

impl CloneCounters {
    pub const fn get(&self, c: CloneCounter) -> u64 {
        match c {
            CloneCounter::Faults => self.faults,
            CloneCounter::PagesFetched => self.pages_fetched,
            CloneCounter::PagesZero => self.pages_zero,
            CloneCounter::PagesFile => self.pages_file,
            CloneCounter::FetchRequests => self.fetch_requests,
            CloneCounter::EventsRemove => self.events_remove,
            CloneCounter::Mode => self.mode,
            CloneCounter::PagesMulticastUnsolicited => self.pages_multicast_unsolicited,
        }
    }
}
