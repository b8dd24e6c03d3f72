//! What the clones of one ticket on one host share: the descriptor, fetched
//! once, and the ticket's multicast receiver, joined once.
//!
//! A clone host may run several clones of a ticket: the clones of a
//! hierarchical task, or several spread tasks placed on the same host. Each
//! clone has its own fault handler (its own userfaultfd, presence bitmap and
//! TCP connection to the page server), but they all hold one [`HostTicket`]:
//!
//! * [`HostTicket::descriptor`] fetches the encoded descriptor the first time
//!   it is asked (the others wait for that fetch and get its bytes), checked
//!   against its BLAKE3 hash as before;
//! * [`HostTicket::group`] joins the ticket's multicast group the first time
//!   (one HELLO, one probe, one group socket and one receive thread per
//!   host), and every handler fetches through that one receiver. A page that
//!   arrives is offered to every clone registered as a [`Member`] (each
//!   installs it if it has not got it), and a page several clones wait for
//!   goes to each of them: one datagram, every clone of the host.
//!
//! Nothing about sealing changes: the receiver drops datagrams whose keyed
//! BLAKE3 MAC does not verify under the ticket's key, the page server's TCP
//! connections prove the key both ways, and a [`HostTicket`] is only shared
//! by launches that carry the same page server, key and descriptor hash
//! ([`HostTickets::get`]).
//!
//! A clone that dies (even by SIGKILL) only ends its own handler, which
//! leaves the members; the receiver and the descriptor live as long as any
//! clone of the ticket on the host holds the [`HostTicket`].

use crate::fault::{join_group, FaultOptions};
use crate::page_server::{descriptor_pages, PageClient, MAX_BATCH};
use crate::{PageProtocolError, Result, PAGE_SIZE};
use starling_mcdist::{Fetched, Mode, PageSink, Receiver};
use starling_proto::SecretKey;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// The ticket's multicast group as this host's clones use it.
#[derive(Clone)]
pub(crate) enum Group {
    /// Joined: the one receiver, and how (multicast, or multicast with push).
    Joined(Arc<Receiver>, Mode),
    /// Not joined: multicast switched off, not offered, or not working here.
    Unicast(Mode),
}

/// One ticket on one host (see the module doc).
pub struct HostTicket {
    server: SocketAddr,
    key: SecretKey,
    opts: FaultOptions,
    /// The descriptor once fetched; held while it is being fetched (so the
    /// others wait for that fetch instead of making their own).
    descriptor: Mutex<Option<Arc<Vec<u8>>>>,
    /// The group once joined (or found unusable); None until first asked.
    group: Mutex<Option<Group>>,
    members: Arc<Members>,
    /// Descriptor fetches made (the rest were answered from the first).
    descriptor_fetches: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl HostTicket {
    /// The clones of a ticket whose page server is `server`, keyed by `key`.
    pub fn new(server: SocketAddr, key: SecretKey, opts: FaultOptions) -> HostTicket {
        HostTicket {
            server,
            key,
            opts,
            descriptor: Mutex::new(None),
            group: Mutex::new(None),
            members: Arc::default(),
            descriptor_fetches: AtomicU64::new(0),
        }
    }

    pub fn server(&self) -> SocketAddr {
        self.server
    }

    pub fn key(&self) -> &SecretKey {
        &self.key
    }

    pub fn options(&self) -> &FaultOptions {
        &self.opts
    }

    /// How many times this host fetched the descriptor (1 once any clone
    /// asked, unless a fetch failed).
    pub fn descriptor_fetches(&self) -> u64 {
        self.descriptor_fetches.load(Ordering::Relaxed)
    }

    /// The ticket's group, joined on first use over `client` (a connection
    /// to the page server, which says where the group is).
    pub(crate) fn group(&self, client: &mut PageClient) -> Group {
        let mut g = lock(&self.group);
        if let Some(group) = g.as_ref() {
            return group.clone();
        }
        let sink: Arc<dyn PageSink> = self.members.clone();
        let (rx, mode) = join_group(client, &self.opts, sink);
        let group = match rx {
            Some(rx) => Group::Joined(Arc::new(rx), mode),
            None => Group::Unicast(mode),
        };
        *g = Some(group.clone());
        group
    }

    /// Register `sink` (a clone's installer) for the pages the group brings
    /// that nobody waits for; it leaves when the returned [`Member`] drops.
    pub(crate) fn join(&self, sink: Arc<dyn PageSink>) -> Member {
        let id = self.members.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.members.list).push((id, sink));
        Member { members: self.members.clone(), id }
    }

    /// The encoded descriptor (`len` bytes, BLAKE3 `hash`), fetched from the
    /// page server as its pseudo-pages (`page_server::DESCRIPTOR_BASE`) the
    /// first time any clone of this host asks: from the ticket's multicast
    /// group when that works here — every host of the ticket asks at about
    /// the same moment and one transmission answers them all — else over
    /// TCP. Returns the bytes and how they came (`None`: fetched before, by
    /// another clone of this host).
    pub fn descriptor(&self, hash: &[u8; 32], len: usize) -> Result<(Arc<Vec<u8>>, Option<Mode>)> {
        if len == 0 || len as u64 > starling_image::MAX_DESCRIPTOR_BYTES {
            return Err(PageProtocolError::DescriptorLength(len).into());
        }
        let mut held = lock(&self.descriptor);
        if let Some(bytes) = held.as_ref() {
            // Launches share a HostTicket only with the same hash (HostTickets::get); checked anyway.
            if bytes.len() != len || starling_proto::Hash::of(bytes).0 != *hash {
                return Err(PageProtocolError::DescriptorHash.into());
            }
            return Ok((bytes.clone(), None));
        }
        self.descriptor_fetches.fetch_add(1, Ordering::Relaxed);
        let (bytes, mode) = self.fetch_descriptor(hash, len)?;
        let bytes = Arc::new(bytes);
        *held = Some(bytes.clone());
        Ok((bytes, Some(mode)))
    }

    fn fetch_descriptor(&self, hash: &[u8; 32], len: usize) -> Result<(Vec<u8>, Mode)> {
        let addrs = descriptor_pages(len);
        let mut client = PageClient::connect(self.server, &self.key, self.opts.encrypt)?;
        let mut pages: Option<Vec<Fetched>> = None;
        let mut mode = match self.group(&mut client) {
            Group::Joined(rx, mode) => {
                match rx.fetch(&addrs) {
                    Ok(p) if p.iter().all(|f| matches!(f, Fetched::Data(_) | Fetched::Zero)) => pages = Some(p),
                    Ok(_) => log::warn!("mcdist: descriptor pages unreadable over multicast; fetching over TCP"),
                    Err(e) => log::warn!("mcdist: descriptor not received ({e}); fetching over TCP"),
                }
                mode
            }
            Group::Unicast(mode) => mode,
        };
        let pages = match pages {
            Some(p) => p,
            None => {
                if matches!(mode, Mode::Multicast | Mode::MulticastPush) {
                    mode = Mode::UnicastFallback;
                }
                let mut out = Vec::with_capacity(addrs.len());
                for batch in addrs.chunks(MAX_BATCH as usize) {
                    out.extend(client.fetch(batch)?.into_iter().map(Fetched::from));
                }
                out
            }
        };
        #[allow(clippy::cast_possible_truncation)] // 4096 fits in any usize
        let page = PAGE_SIZE as usize;
        let mut bytes = Vec::with_capacity(addrs.len() * page);
        for p in pages {
            match p {
                Fetched::Data(d) if d.len() == page => bytes.extend_from_slice(&d),
                Fetched::Zero => bytes.resize(bytes.len() + page, 0),
                _ => return Err(PageProtocolError::DescriptorUnreadable.into()),
            }
        }
        bytes.truncate(len);
        if starling_proto::Hash::of(&bytes).0 != *hash {
            return Err(PageProtocolError::DescriptorHash.into());
        }
        Ok((bytes, mode))
    }
}

/// The clones of a host that take the group's pages nobody waits for.
#[derive(Default)]
pub(crate) struct Members {
    list: Mutex<Vec<(u64, Arc<dyn PageSink>)>>,
    next: AtomicU64,
}

impl PageSink for Members {
    /// Offered to every member; a page counts as taken if any took it.
    fn offer(&self, pages: &[(u64, Fetched)]) -> Vec<bool> {
        let members: Vec<Arc<dyn PageSink>> = lock(&self.list).iter().map(|(_, s)| s.clone()).collect();
        let mut taken = vec![false; pages.len()];
        for m in members {
            for (t, took) in taken.iter_mut().zip(m.offer(pages)) {
                *t |= took;
            }
        }
        taken
    }
}

/// A clone's place among its host's [`Members`]; leaves on drop.
pub(crate) struct Member {
    members: Arc<Members>,
    id: u64,
}

impl Drop for Member {
    fn drop(&mut self) {
        lock(&self.members.list).retain(|(id, _)| *id != self.id);
    }
}

/// A host's tickets: the agent's one registry, so launches of one ticket on
/// this host get the same [`HostTicket`].
#[derive(Default)]
pub struct HostTickets(Mutex<HashMap<TicketKey, Weak<HostTicket>>>);

/// What a launch must carry to share a [`HostTicket`]: the page server, the
/// ticket's key (a launch with another key gets its own, and proves that key
/// itself) and the descriptor's hash.
#[derive(Clone, PartialEq, Eq, Hash)]
struct TicketKey {
    server: SocketAddr,
    key: [u8; 32],
    descriptor: [u8; 32],
}

impl HostTickets {
    /// The ticket's [`HostTicket`] on this host: the one its other clones
    /// here hold, else a new one (with `opts`). Lives as long as a clone
    /// holds it.
    pub fn get(&self, server: SocketAddr, key: &SecretKey, descriptor_hash: &[u8; 32], opts: &FaultOptions) -> Arc<HostTicket> {
        let k = TicketKey { server, key: key.0, descriptor: *descriptor_hash };
        let mut map = lock(&self.0);
        map.retain(|_, t| t.strong_count() > 0);
        if let Some(t) = map.get(&k).and_then(Weak::upgrade) {
            return t;
        }
        let t = Arc::new(HostTicket::new(server, *key, opts.clone()));
        map.insert(k, Arc::downgrade(&t));
        t
    }
}
