//! The relay cache (UCop's remdis cache): content-named requests (recipes,
//! chunks) from hosts are answered from a cache shared by all of them, and
//! what is missing is fetched from the task's client exactly once however
//! many hosts ask. Immutable, hash-named content only, so it can never
//! change what a task sees.
//!
//! Host-to-host sharing (`FindChunks`): the relay remembers which hosts
//! asked for each chunk recently (they hold it, or are fetching it and
//! will). A host asking for a chunk another host holds is sent that host's
//! peer address instead of the bytes, so each chunk leaves the head about
//! once however many hosts read it. The hosts that asked form a tree per
//! chunk (each is referred only to hosts that asked before it first did,
//! also when it asks again having lost its copy, so no chain of referrals
//! ever leads back to the asker and no two hosts wait on each other), at most
//! `head.peer_referrals` referrals per holder, so no host serves everyone and
//! none waits on a long chain; a host that cannot get a chunk from its peer
//! asks the head again with `GetChunks`, which always sends the bytes.

use starling_proto::conn::Outgoing;
use starling_proto::{ChunkData, ChunkSource, FileReq, FileResp, Hash, Msg, Recipe, TaskId};
use starling_store::HostCache;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use tokio::sync::{oneshot, watch};

/// Ids of requests the head originates have this bit set; agents number
/// theirs from 0, so the answers never mix.
pub(crate) const HEAD_ID_BIT: u64 = 1 << 63;

/// `EIO`, the answer when content cannot be had.
const EIO: i32 = libc::EIO;

pub(crate) struct Relay {
    cache: HostCache,
    /// Chunks being fetched from a client right now (single flight per chunk).
    inflight: Mutex<HashMap<Hash, watch::Receiver<bool>>>,
    /// Requests the head sent to a client, waiting for their answers.
    waiters: Mutex<HashMap<u64, oneshot::Sender<FileResp>>>,
    next_req: AtomicU64,
    counters: std::sync::Arc<crate::metrics::Counters>,
    holders: Mutex<Holders>,
}

/// Chunks whose holders are remembered (the most recently asked for):
/// 2^18 chunks of 64 KiB on average are 16 GiB of content.
const HELD_CHUNKS: usize = 1 << 18;

/// Which hosts (by peer address) asked for which chunks, and how many
/// hosts each was referred to for it.
struct Holders {
    /// Hosts a holder of a chunk is referred to at most (then it is full,
    /// and those who got it from it are referred instead); 0: none ever.
    referrals: u32,
    by_chunk: HashMap<Hash, Vec<(String, u32)>>,
    /// Chunks in the order first asked for, to forget the oldest.
    order: VecDeque<Hash>,
}

impl Holders {
    fn new(referrals: u32) -> Holders {
        Holders { referrals, by_chunk: HashMap::new(), order: VecDeque::new() }
    }

    /// A peer for `asker` to fetch `h` from (the earliest holder not yet
    /// full that asked before `asker` first did), noting the referral;
    /// `asker` is a holder from now on either way (it will have the chunk,
    /// from the peer or from us). The first asker, asking again, gets the
    /// bytes.
    fn refer(&mut self, h: &Hash, asker: Option<&str>) -> Option<String> {
        if self.referrals == 0 {
            return None;
        }
        let holders = match self.by_chunk.get_mut(h) {
            Some(v) => v,
            None => {
                if self.order.len() >= HELD_CHUNKS {
                    if let Some(old) = self.order.pop_front() {
                        self.by_chunk.remove(&old);
                    }
                }
                self.order.push_back(*h);
                self.by_chunk.entry(*h).or_default()
            }
        };
        // Only hosts that asked before the asker first did. Their copies come
        // from the head or, by the same rule, from hosts that asked earlier
        // still, so no chain of referrals leads back to the asker, even when
        // it asks again (it lost its copy) while hosts it served are
        // themselves fetching the chunk again: a host waiting on a peer that
        // waits on it would wait for good.
        let first_asked = asker.and_then(|me| holders.iter().position(|(addr, _)| addr == me)).unwrap_or(holders.len());
        let peer = holders[..first_asked].iter_mut().find(|(_, n)| *n < self.referrals).map(|(addr, n)| {
            *n += 1;
            addr.clone()
        });
        if let Some(me) = asker {
            if !holders.iter().any(|(addr, _)| addr == me) {
                holders.push((me.to_string(), 0));
            }
        }
        peer
    }

    /// A host left: it holds nothing any more.
    fn forget(&mut self, peer: &str) {
        for v in self.by_chunk.values_mut() {
            v.retain(|(addr, _)| addr != peer);
        }
    }
}

impl Relay {
    /// `referrals`: hosts one holder of a chunk is referred to at most (`head.peer_referrals`).
    pub(crate) fn open(dir: &std::path::Path, bytes: u64, referrals: u32, counters: std::sync::Arc<crate::metrics::Counters>) -> std::io::Result<Relay> {
        Ok(Relay {
            cache: HostCache::open(dir, bytes)?,
            inflight: Mutex::new(HashMap::new()),
            waiters: Mutex::new(HashMap::new()),
            next_req: AtomicU64::new(0),
            counters,
            holders: Mutex::new(Holders::new(referrals)),
        })
    }

    /// Content a client pushed ahead of its launch.
    pub(crate) fn take_push(&self, recipes: &[Recipe], chunks: &[ChunkData]) {
        for r in recipes {
            let _ = self.cache.put_recipe(r);
        }
        for c in chunks {
            match c.open() {
                Ok(bytes) => {
                    let _ = self.cache.put_chunk(&c.hash, &bytes);
                }
                Err(e) => log::warn!("client pushed a bad chunk: {e}"),
            }
        }
    }

    /// Of `names` (recipe or chunk names), those the cache holds.
    pub(crate) fn holds(&self, names: &[Hash]) -> Vec<Hash> {
        names
            .iter()
            .filter(|h| self.cache.has_chunk(h) || matches!(self.cache.get_recipe(h), Ok(Some(_))))
            .copied()
            .collect()
    }

    /// Whether a client's answer `id` answers a request of ours.
    pub(crate) fn is_ours(&self, id: u64) -> bool {
        id & HEAD_ID_BIT != 0
    }

    /// A client's answer to a request of ours.
    pub(crate) fn answered(&self, id: u64, resp: FileResp) {
        if let Some(w) = self.waiters.lock().unwrap().remove(&id) {
            let _ = w.send(resp);
        }
    }

    /// Ask `client` (the one that owns `task`) for content; `None` if it is gone.
    async fn ask_client(&self, client: &Outgoing, task: TaskId, req: FileReq) -> Option<FileResp> {
        let id = HEAD_ID_BIT | self.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.waiters.lock().unwrap().insert(id, tx);
        if client.send(Msg::FileRequest { task, id, req }).await.is_err() {
            self.waiters.lock().unwrap().remove(&id);
            return None;
        }
        rx.await.ok()
    }

    /// A host left (its peer address, if it had one): refer nobody to it.
    pub(crate) fn forget_peer(&self, peer: Option<&str>) {
        if let Some(p) = peer {
            self.holders.lock().unwrap().forget(p);
        }
    }

    /// Answer a content-named request from the cache, fetching what is
    /// missing from the task's client (`None`: gone) exactly once however
    /// many hosts ask. `asker`: the peer address of the host asking.
    pub(crate) async fn serve(&self, client: Option<Outgoing>, task: TaskId, req: FileReq, asker: Option<String>) -> FileResp {
        let Some(client) = client else {
            log::warn!("task {task}: a host asked for content and the task has no client to fetch it from; answering EIO");
            return FileResp::Errno(EIO);
        };
        match req {
            FileReq::GetRecipe { name } => {
                if let Ok(Some(r)) = self.cache.get_recipe(&name) {
                    crate::metrics::add(&self.counters.relay_recipe_hits, 1);
                    return FileResp::Recipe(Some(r));
                }
                crate::metrics::add(&self.counters.relay_recipe_misses, 1);
                let resp = self.ask_client(&client, task, FileReq::GetRecipe { name }).await.unwrap_or_else(|| {
                    log::warn!("task {task}: its client went away before it answered for a recipe; answering EIO");
                    FileResp::Errno(EIO)
                });
                if let FileResp::Recipe(Some(r)) = &resp {
                    if r.name() == name {
                        let _ = self.cache.put_recipe(r);
                    }
                }
                resp
            }
            FileReq::GetChunks { hashes } => self.serve_chunks(&client, task, &hashes).await,
            FileReq::FindChunks { hashes } => self.find_chunks(&client, task, &hashes, asker.as_deref()).await,
            _ => FileResp::Errno(EIO),
        }
    }

    /// `FindChunks`: a peer for each chunk some other host holds, the
    /// bytes of the others, in the order asked.
    async fn find_chunks(&self, client: &Outgoing, task: TaskId, hashes: &[Hash], asker: Option<&str>) -> FileResp {
        let peers: Vec<Option<String>> = {
            let mut holders = self.holders.lock().unwrap();
            hashes.iter().map(|h| holders.refer(h, asker)).collect()
        };
        let to_send: Vec<Hash> = hashes.iter().zip(&peers).filter(|(_, p)| p.is_none()).map(|(h, _)| *h).collect();
        crate::metrics::add(&self.counters.relay_chunks_to_peers, u64::try_from(hashes.len() - to_send.len()).unwrap_or(0));
        let mut data = if to_send.is_empty() {
            Vec::new().into_iter()
        } else {
            match self.serve_chunks(client, task, &to_send).await {
                FileResp::Chunks(c) => c.into_iter(),
                other => return other,
            }
        };
        let mut out = Vec::with_capacity(hashes.len());
        for (h, peer) in hashes.iter().zip(peers) {
            match peer {
                Some(addr) => out.push(ChunkSource::Peer { hash: *h, addr }),
                None => match data.next() {
                    Some(c) => out.push(ChunkSource::Data(c)),
                    None => return FileResp::Errno(EIO),
                },
            }
        }
        FileResp::ChunkSources(out)
    }

    async fn serve_chunks(&self, client: &Outgoing, task: TaskId, hashes: &[Hash]) -> FileResp {
        let hits = hashes.iter().filter(|h| self.cache.has_chunk(h)).count();
        crate::metrics::add(&self.counters.relay_chunk_hits, u64::try_from(hits).unwrap_or(0));
        crate::metrics::add(&self.counters.relay_chunk_misses, u64::try_from(hashes.len() - hits).unwrap_or(0));
        // Up to three passes: a chunk another task was fetching may
        // still be missing if that fetch failed; then fetch it ourselves.
        // What this request fetched itself is served from memory, not read back.
        let mut fresh: HashMap<Hash, Vec<u8>> = HashMap::new();
        for _ in 0..3 {
            let (mine, theirs, done_tx) = self.claim(hashes);
            if let Some(done_tx) = done_tx {
                fresh.extend(self.fetch_into_cache(client, task, &mine).await);
                let mut inflight = self.inflight.lock().unwrap();
                for h in &mine {
                    inflight.remove(h);
                }
                let _ = done_tx.send(true);
            }
            for mut w in theirs {
                let _ = w.wait_for(|done| *done).await;
            }
            if hashes.iter().all(|h| self.cache.has_chunk(h)) {
                break;
            }
        }
        let mut out = Vec::with_capacity(hashes.len());
        // Served as stored, not hashed again: they were verified when they
        // entered this cache, and the host verifies them on receipt (a chunk
        // damaged on this disk is refused there, never used).
        for (i, h) in hashes.iter().enumerate() {
            // A hash asked for twice in one batch is taken from memory once, then read back.
            let mut bytes = if hashes[i + 1..].contains(h) { fresh.get(h).cloned() } else { fresh.remove(h) };
            if bytes.is_none() {
                bytes = self.cache.get_chunk_unverified(h).ok().flatten();
            }
            if bytes.is_none() {
                // Evicted (or lost) since it was checked: ask the client again.
                bytes = self.fetch_into_cache(client, task, std::slice::from_ref(h)).await.remove(h);
            }
            match bytes {
                // Head → host is the cluster network: no need to spend CPU compressing.
                Some(bytes) => {
                    crate::metrics::add(&self.counters.relay_bytes_to_hosts, u64::try_from(bytes.len()).unwrap_or(0));
                    out.push(ChunkData::seal_named(*h, bytes, false))
                }
                None => {
                    log::warn!("task {task}: chunk {h:?} is neither in the relay cache nor had from the client; answering EIO");
                    return FileResp::Errno(EIO);
                }
            }
        }
        FileResp::Chunks(out)
    }

    /// Split the missing chunks into those this request will fetch (now
    /// marked in flight) and the fetches of others to wait for.
    #[allow(clippy::type_complexity)]
    fn claim(&self, hashes: &[Hash]) -> (Vec<Hash>, Vec<watch::Receiver<bool>>, Option<watch::Sender<bool>>) {
        let mut mine = Vec::new();
        let mut theirs = Vec::new();
        let mut inflight = self.inflight.lock().unwrap();
        for h in hashes {
            if self.cache.has_chunk(h) || mine.contains(h) {
                continue;
            }
            match inflight.get(h) {
                Some(w) => theirs.push(w.clone()),
                None => mine.push(*h),
            }
        }
        if mine.is_empty() {
            return (mine, theirs, None);
        }
        let (done_tx, done_rx) = watch::channel(false);
        for h in &mine {
            inflight.insert(*h, done_rx.clone());
        }
        (mine, theirs, Some(done_tx))
    }

    /// Fetch `hashes` from the client into the cache; returns the verified bytes fetched.
    async fn fetch_into_cache(&self, client: &Outgoing, task: TaskId, hashes: &[Hash]) -> HashMap<Hash, Vec<u8>> {
        let mut fetched = HashMap::new();
        let got = match self.ask_client(client, task, FileReq::GetChunks { hashes: hashes.to_vec() }).await {
            Some(FileResp::Chunks(got)) => got,
            Some(FileResp::Errno(e)) => {
                log::warn!("task {task}: its client answered errno {e} for {} chunk(s)", hashes.len());
                Vec::new()
            }
            Some(_) => {
                log::warn!("task {task}: its client answered GetChunks with something else");
                Vec::new()
            }
            None => {
                log::warn!("task {task}: its client went away before it answered for {} chunk(s)", hashes.len());
                Vec::new()
            }
        };
        for c in got {
            if !hashes.contains(&c.hash) {
                continue;
            }
            let hash = c.hash;
            match c.into_verified() {
                Ok(bytes) => {
                    crate::metrics::add(&self.counters.relay_bytes_from_clients, u64::try_from(bytes.len()).unwrap_or(0));
                    let _ = self.cache.put_chunk(&hash, &bytes);
                    fetched.insert(hash, bytes);
                }
                Err(e) => log::warn!("client sent a bad chunk: {e}"),
            }
        }
        fetched
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_referred_only_to_earlier_askers_at_most_three_each() {
        let mut holders = Holders::new(3);
        let h = Hash::of(b"chunk");
        let names: Vec<String> = (1..=16).map(|i| format!("10.0.0.{i}:1")).collect();
        let refs: Vec<Option<String>> = names.iter().map(|n| holders.refer(&h, Some(n))).collect();
        assert_eq!(refs[0], None, "the first asker gets the bytes");
        for (i, r) in refs.iter().enumerate().skip(1) {
            let peer = r.as_deref().expect("a later asker is referred to a peer");
            let at = names.iter().position(|n| n == peer).unwrap();
            assert!(at < i, "asker {i} referred to {at}, which asked after it");
        }
        for n in &names {
            let served = refs.iter().filter(|r| r.as_deref() == Some(n.as_str())).count();
            assert!(served <= 3, "{n} was referred to {served} hosts");
        }
        // Asking again is never a referral to oneself.
        assert_ne!(holders.refer(&h, Some(&names[0])).as_deref(), Some(names[0].as_str()));
        // Hosts that left are referred to nobody: the first asker, full, leaves the head to send it.
        for n in &names[1..] {
            holders.forget(n);
        }
        assert_eq!(holders.refer(&h, Some("10.0.0.99:1")), None);
    }

    #[test]
    fn hosts_that_lost_a_chunk_and_ask_again_are_never_referred_to_each_other() {
        // h1 got the chunk from the head, h2 from h1; both lost it (a wiped cache)
        // and ask again at once: h2 waiting on h1 while h1 waits on h2 would wait for good.
        let mut holders = Holders::new(3);
        let h = Hash::of(b"chunk");
        let (h1, h2) = ("10.0.0.1:1", "10.0.0.2:1");
        assert_eq!(holders.refer(&h, Some(h1)), None);
        assert_eq!(holders.refer(&h, Some(h2)).as_deref(), Some(h1));
        assert_eq!(holders.refer(&h, Some(h1)), None, "the first asker, asking again, is sent the bytes");
        assert_eq!(holders.refer(&h, Some(h2)).as_deref(), Some(h1), "the later asker is referred back up the tree");
        // A host that first asked later is never a source for one that asked earlier.
        let h3 = "10.0.0.3:1";
        assert_eq!(holders.refer(&h, Some(h3)).as_deref(), Some(h1));
        for _ in 0..4 {
            assert_ne!(holders.refer(&h, Some(h2)).as_deref(), Some(h3));
            assert_eq!(holders.refer(&h, Some(h1)), None);
        }
    }

    #[test]
    fn with_no_referrals_every_asker_gets_the_bytes() {
        let mut holders = Holders::new(0);
        let h = Hash::of(b"chunk");
        for i in 1..=4 {
            assert_eq!(holders.refer(&h, Some(&format!("10.0.0.{i}:1"))), None, "asker {i}");
        }
    }

    #[test]
    fn a_holder_is_referred_to_at_most_the_limit() {
        let mut holders = Holders::new(1);
        let h = Hash::of(b"chunk");
        assert_eq!(holders.refer(&h, Some("10.0.0.1:1")), None);
        assert_eq!(holders.refer(&h, Some("10.0.0.2:1")).as_deref(), Some("10.0.0.1:1"));
        // 10.0.0.1 is full: the next asker is referred to the one that got it from it.
        assert_eq!(holders.refer(&h, Some("10.0.0.3:1")).as_deref(), Some("10.0.0.2:1"));
    }
}
