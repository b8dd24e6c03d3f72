//! The file view's [`Source`] on a host: every fault becomes a request to
//! the client (through the head), answered into the host cache.

use starling_proto::conn::Outgoing;
use starling_proto::{DirEntry, FileReq, FileResp, Hash, Lookup, Msg, TaskId, WirePath};
use starling_store::HostCache;
use std::collections::HashMap;
use std::io;
use crate::waiters::Waiters;
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// A client hashing a very large file can take a while to answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);
/// Chunks per GetChunks request: 64 × 256 KiB max chunk = 16 MiB, under the frame limit.
const CHUNK_BATCH: usize = 64;

pub struct RemoteSource {
    pub task: TaskId,
    pub tx: Outgoing,
    pub waiters: Arc<Waiters>,
    pub cache: Arc<HostCache>,
    /// Chunk sharing with other hosts; `None`: everything from the head.
    pub(crate) peers: Option<Arc<crate::peers::Peers>>,
}

fn eio(msg: impl Into<String>) -> io::Error {
    let m = msg.into();
    log::warn!("{m}");
    io::Error::other(m)
}

impl RemoteSource {
    /// One blocking round trip to the client. Called from FUSE threads.
    fn request(&self, req: FileReq) -> io::Result<FileResp> {
        let rx = self.send(req)?;
        match rx.recv_timeout(REQUEST_TIMEOUT) {
            Ok(FileResp::Errno(e)) => Err(io::Error::from_raw_os_error(e)),
            Ok(r) => Ok(r),
            Err(e) => {
                log::warn!("task {}: a file request got no answer ({e}); EIO", self.task);
                Err(io::Error::from_raw_os_error(libc::EIO))
            }
        }
    }

    /// Send a request without waiting for its answer (the answer comes on the receiver; see [`Fetch`]).
    fn send(&self, req: FileReq) -> io::Result<mpsc::Receiver<FileResp>> {
        let (id, rx) = self.waiters.register();
        self.tx
            .blocking_send(Msg::FileRequest { task: self.task, id, req })
            .map_err(|_| io::Error::from_raw_os_error(libc::EIO))?;
        Ok(rx)
    }
}

/// Batches of GetChunks requests kept in flight at once: the next batches
/// travel (client → head → here) while this thread verifies and writes the
/// current one, so no chunk waits for a round trip of its own.
const WINDOW: usize = 4;

/// A pipelined fetch of chunks, handed out one by one in the order asked.
struct Fetch<'a> {
    src: &'a RemoteSource,
    /// Batches not yet requested.
    to_send: std::collections::VecDeque<&'a [Hash]>,
    /// Batches requested, oldest first, with their answer channels.
    in_flight: std::collections::VecDeque<(&'a [Hash], mpsc::Receiver<FileResp>)>,
    /// Chunks of the oldest answered batch not yet handed out, verified.
    ready: std::collections::VecDeque<(Hash, Vec<u8>)>,
    /// With peers: every chunk this fetch will hand out (pending for peers
    /// until written), and how many of them are written or given up.
    missing: &'a [Hash],
    released: usize,
}

impl<'a> Fetch<'a> {
    fn new(src: &'a RemoteSource, missing: &'a [Hash]) -> Self {
        if let Some(p) = &src.peers {
            // Pending before the head hears of them: once it has, it may refer other hosts to us.
            p.pending.add(missing);
        }
        Fetch { src, to_send: missing.chunks(CHUNK_BATCH).collect(), in_flight: Default::default(), ready: Default::default(), missing, released: 0 }
    }

    /// Chunks handed out before the `upto`-th are written: no longer pending.
    fn release(&mut self, upto: usize) {
        let upto = upto.min(self.missing.len());
        if let (Some(p), true) = (&self.src.peers, upto > self.released) {
            p.pending.remove(&self.missing[self.released..upto]);
        }
        self.released = self.released.max(upto);
    }

    /// The verified bytes of `want`, the next chunk in the order asked.
    fn next(&mut self, want: &Hash) -> io::Result<Vec<u8>> {
        // The caller wrote every chunk it was handed before asking for the next.
        let handed = self.missing.len() - self.to_send.iter().chain(self.in_flight.iter().map(|(b, _)| b)).map(|b| b.len()).sum::<usize>() - self.ready.len();
        self.release(handed);
        while self.ready.is_empty() {
            while self.in_flight.len() < WINDOW {
                let Some(batch) = self.to_send.pop_front() else { break };
                let req = if self.src.peers.is_some() { FileReq::FindChunks { hashes: batch.to_vec() } } else { FileReq::GetChunks { hashes: batch.to_vec() } };
                let rx = self.src.send(req)?;
                self.in_flight.push_back((batch, rx));
            }
            let Some((batch, rx)) = self.in_flight.pop_front() else {
                return Err(eio(format!("chunk {want:?} was not among those fetched")));
            };
            let answer = match rx.recv_timeout(REQUEST_TIMEOUT) {
                Ok(FileResp::Chunks(got)) if self.src.peers.is_none() => got.into_iter().map(starling_proto::ChunkSource::Data).collect(),
                Ok(FileResp::ChunkSources(got)) if self.src.peers.is_some() => got,
                Ok(FileResp::Errno(e)) => return Err(io::Error::from_raw_os_error(e)),
                Ok(_) => return Err(eio("client answered GetChunks with something else")),
                Err(e) => {
                    log::warn!("task {}: a chunk request got no answer ({e}); EIO", self.src.task);
                    return Err(io::Error::from_raw_os_error(libc::EIO));
                }
            };
            // Answers list the chunks in the order asked (the relay and the
            // client both do); anything else is refused.
            if answer.len() != batch.len() || answer.iter().zip(batch).any(|(c, h)| c.hash() != h) {
                return Err(eio(format!("GetChunks answered {} chunk(s), not the {} asked for in order", answer.len(), batch.len())));
            }
            self.take_answer(answer)?;
        }
        let (hash, bytes) = self.ready.pop_front().expect("refilled above");
        if hash != *want {
            return Err(eio(format!("chunk {hash:?} arrived where {want:?} was expected")));
        }
        Ok(bytes)
    }

    /// Queue a batch's chunks: the head's as they are, those it referred to
    /// peers fetched from them (all peers asked at once), and whatever a
    /// peer did not deliver intact from the head.
    fn take_answer(&mut self, answer: Vec<starling_proto::ChunkSource>) -> io::Result<()> {
        use starling_proto::ChunkSource;
        let mut by_peer: HashMap<&str, Vec<Hash>> = HashMap::new();
        for s in &answer {
            if let ChunkSource::Peer { hash, addr } = s {
                by_peer.entry(addr.as_str()).or_default().push(*hash);
            }
        }
        let mut from_peers: HashMap<Hash, Vec<u8>> = HashMap::new();
        if let Some(peers) = &self.src.peers {
            let asked: Vec<(&str, crate::peers::Asked)> =
                by_peer.iter().map(|(addr, hashes)| (*addr, peers.ask(addr, self.src.task, hashes.clone()))).collect();
            for (addr, asked) in asked {
                for c in peers.answer(asked) {
                    if !by_peer[addr].contains(&c.hash) {
                        continue;
                    }
                    let hash = c.hash;
                    match c.into_verified() {
                        Ok(bytes) => {
                            from_peers.insert(hash, bytes);
                        }
                        Err(e) => log::warn!("chunk from peer {addr} rejected: {e}; fetching it from the head"),
                    }
                }
            }
        }
        let fallback: Vec<Hash> = answer
            .iter()
            .filter_map(|s| match s {
                ChunkSource::Peer { hash, .. } if !from_peers.contains_key(hash) => Some(*hash),
                _ => None,
            })
            .collect();
        if !fallback.is_empty() {
            log::warn!("task {}: {} chunk(s) not had from peers; fetching them from the head", self.src.task, fallback.len());
            for batch in fallback.chunks(CHUNK_BATCH) {
                let FileResp::Chunks(got) = self.src.request(FileReq::GetChunks { hashes: batch.to_vec() })? else {
                    return Err(eio("client answered GetChunks with something else"));
                };
                for c in got {
                    let hash = c.hash;
                    if batch.contains(&hash) {
                        let bytes = c.into_verified().map_err(|e| eio(format!("chunk from client rejected: {e}")))?;
                        from_peers.insert(hash, bytes);
                    }
                }
            }
        }
        for s in answer {
            match s {
                ChunkSource::Data(c) => {
                    let hash = c.hash;
                    let bytes = c.into_verified().map_err(|e| eio(format!("chunk from client rejected: {e}")))?;
                    self.ready.push_back((hash, bytes));
                }
                ChunkSource::Peer { hash, .. } => {
                    // Asked for twice in one batch: the second use gets a copy.
                    let bytes = match from_peers.get(&hash) {
                        Some(b) => b.clone(),
                        None => return Err(eio(format!("chunk {hash:?} was had from neither a peer nor the head"))),
                    };
                    self.ready.push_back((hash, bytes));
                }
            }
        }
        Ok(())
    }
}

impl Drop for Fetch<'_> {
    fn drop(&mut self) {
        // Done or failed: nothing more of this fetch will arrive.
        self.release(self.missing.len());
    }
}

impl starling_view::Source for RemoteSource {
    fn lookup(&self, path: &WirePath) -> io::Result<Lookup> {
        log::debug!("task {}: lookup {path} (not prethrown)", self.task);
        match self.request(FileReq::Lookup { path: path.clone() })? {
            FileResp::Lookup(l) => Ok(l),
            _ => Err(eio("client answered Lookup with something else")),
        }
    }

    fn readdir(&self, path: &WirePath) -> Result<Vec<DirEntry>, i32> {
        match self.request(FileReq::ReadDir { path: path.clone() }) {
            Ok(FileResp::ReadDir(r)) => r,
            Ok(_) => Err(libc::EIO),
            Err(e) => Err(e.raw_os_error().unwrap_or(libc::EIO)),
        }
    }

    fn materialize(&self, path: &WirePath, name: &Hash) -> io::Result<std::fs::File> {
        let recipe = match self.cache.get_recipe(name)? {
            Some(r) => r,
            None => {
                let FileResp::Recipe(Some(r)) = self.request(FileReq::GetRecipe { name: *name })? else {
                    return Err(eio(format!("client has no recipe for {path}")));
                };
                if r.name() != *name {
                    return Err(eio(format!("recipe for {path} does not match its name")));
                }
                self.cache.put_recipe(&r)?;
                r
            }
        };
        // Content can be evicted (or lost) between the check and the copy:
        // then fetch what is missing again.
        let mut attempt = 0;
        loop {
            let missing = self.cache.missing(&recipe);
            let assembled = if missing.is_empty() {
                self.cache.assemble(&recipe)
            } else {
                let mut fetch = Fetch::new(self, &missing);
                self.cache.assemble_fetching(&recipe, &missing, &mut |h| fetch.next(h))
            };
            match assembled.and_then(std::fs::File::open) {
                Ok(f) => return Ok(f),
                Err(e) if e.kind() == io::ErrorKind::NotFound && attempt < 3 => {
                    attempt += 1;
                    log::info!("{path}: cached content vanished while assembling; fetching again");
                    self.cache.recheck(&recipe);
                }
                Err(e) => return Err(e),
            }
        }
    }
}
