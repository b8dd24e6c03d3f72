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
    // The clone's critical path (issue 16): when each stage ended, stamped
    // where it happened (all hosts of one cluster share the clock, else
    // differences across machines are only as good as their clock sync).
    /// CLOCK_REALTIME ns (0: not recorded): the parent was granted the ticket (parent).
    pub stamp_ticket_ns: u64,
    /// CLOCK_REALTIME ns (0: not recorded): the template fork is done: its record reached the parent (parent).
    pub stamp_template_ns: u64,
    /// CLOCK_REALTIME ns (0: not recorded): the descriptor is dumped and the page server serves it (parent).
    pub stamp_descriptor_ns: u64,
    /// CLOCK_REALTIME ns (0: not recorded): the head placed the clone's task on a host (head).
    pub stamp_placed_ns: u64,
    /// CLOCK_REALTIME ns (0: not recorded): the host's agent received the launch (host).
    pub stamp_launch_received_ns: u64,
    /// CLOCK_REALTIME ns (0: not recorded): the task's file view and overlay are mounted (host).
    pub stamp_view_mounted_ns: u64,
    /// CLOCK_REALTIME ns (0: not recorded): the descriptor is fetched and the sandbox runs the restorer (host).
    pub stamp_sandbox_ready_ns: u64,
    /// CLOCK_REALTIME ns (0: not recorded): the restorer handed over this clone's userfaultfd: the clone is mapped (host).
    pub stamp_restorer_running_ns: u64,
    /// CLOCK_REALTIME ns (0: not recorded): the first page from the page server was installed (host).
    pub stamp_first_page_ns: u64,
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
    StampTicket = 8,
    StampTemplate = 9,
    StampDescriptor = 10,
    StampPlaced = 11,
    StampLaunchReceived = 12,
    StampViewMounted = 13,
    StampSandboxReady = 14,
    StampRestorerRunning = 15,
    StampFirstPage = 16,
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
            8 => CloneCounter::StampTicket,
            9 => CloneCounter::StampTemplate,
            10 => CloneCounter::StampDescriptor,
            11 => CloneCounter::StampPlaced,
            12 => CloneCounter::StampLaunchReceived,
            13 => CloneCounter::StampViewMounted,
            14 => CloneCounter::StampSandboxReady,
            15 => CloneCounter::StampRestorerRunning,
            16 => CloneCounter::StampFirstPage,
            _ => return None,
        })
    }
}

impl CloneCounter {
    /// Every counter, in index order.
    pub const ALL: [CloneCounter; 17] = [
        CloneCounter::Faults,
        CloneCounter::PagesFetched,
        CloneCounter::PagesZero,
        CloneCounter::PagesFile,
        CloneCounter::FetchRequests,
        CloneCounter::EventsRemove,
        CloneCounter::Mode,
        CloneCounter::PagesMulticastUnsolicited,
        CloneCounter::StampTicket,
        CloneCounter::StampTemplate,
        CloneCounter::StampDescriptor,
        CloneCounter::StampPlaced,
        CloneCounter::StampLaunchReceived,
        CloneCounter::StampViewMounted,
        CloneCounter::StampSandboxReady,
        CloneCounter::StampRestorerRunning,
        CloneCounter::StampFirstPage,
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
            CloneCounter::StampTicket => "stamp_ticket_ns",
            CloneCounter::StampTemplate => "stamp_template_ns",
            CloneCounter::StampDescriptor => "stamp_descriptor_ns",
            CloneCounter::StampPlaced => "stamp_placed_ns",
            CloneCounter::StampLaunchReceived => "stamp_launch_received_ns",
            CloneCounter::StampViewMounted => "stamp_view_mounted_ns",
            CloneCounter::StampSandboxReady => "stamp_sandbox_ready_ns",
            CloneCounter::StampRestorerRunning => "stamp_restorer_running_ns",
            CloneCounter::StampFirstPage => "stamp_first_page_ns",
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
            CloneCounter::StampTicket => self.stamp_ticket_ns,
            CloneCounter::StampTemplate => self.stamp_template_ns,
            CloneCounter::StampDescriptor => self.stamp_descriptor_ns,
            CloneCounter::StampPlaced => self.stamp_placed_ns,
            CloneCounter::StampLaunchReceived => self.stamp_launch_received_ns,
            CloneCounter::StampViewMounted => self.stamp_view_mounted_ns,
            CloneCounter::StampSandboxReady => self.stamp_sandbox_ready_ns,
            CloneCounter::StampRestorerRunning => self.stamp_restorer_running_ns,
            CloneCounter::StampFirstPage => self.stamp_first_page_ns,
        }
    }
}

/// Now on CLOCK_REALTIME, in ns since the epoch (what the stamps hold).
#[cfg(feature = "std")]
pub fn realtime_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}
