//! Value types carried by messages: hashes, paths, recipes, attributes.

use crate::{Invalid, ProtoError, MAX_PATH};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A BLAKE3 digest. Names chunks (hash of the bytes) and recipes (hash of
/// the encoded recipe).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
pub struct Hash(pub [u8; 32]);

impl Hash {
    pub fn of(data: &[u8]) -> Hash {
        Hash(*blake3::hash(data).as_bytes())
    }
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }
    pub fn from_hex(s: &str) -> Option<Hash> {
        if s.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Hash(out))
    }
}

impl fmt::Debug for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", &self.to_hex()[..12])
    }
}
impl fmt::Display for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// An absolute, normalised Linux path as raw bytes (paths need not be UTF-8).
/// Valid: starts with `/`, no NUL, no empty/`.`/`..` components (except the
/// root itself), at most [`MAX_PATH`] bytes, each name at most [`MAX_NAME`].
/// Checked when decoded (every decoder: frames, migration payloads, caches):
/// an invalid one never exists in a received value.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "Vec<u8>")]
pub struct WirePath(pub Vec<u8>);

/// Longest file name (NAME_MAX).
pub const MAX_NAME: usize = 255;

impl TryFrom<Vec<u8>> for WirePath {
    type Error = ProtoError;
    fn try_from(bytes: Vec<u8>) -> Result<Self, ProtoError> {
        WirePath::new(bytes)
    }
}

impl WirePath {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, ProtoError> {
        let p = WirePath(bytes.into());
        p.validate()?;
        Ok(p)
    }
    pub fn root() -> Self {
        WirePath(b"/".to_vec())
    }
    pub fn validate(&self) -> Result<(), ProtoError> {
        let b = &self.0;
        if b.is_empty() || b[0] != b'/' {
            return Err(Invalid::PathNotAbsolute(format!("{self:?}")).into());
        }
        if b.len() > MAX_PATH {
            return Err(Invalid::PathTooLong.into());
        }
        if b.contains(&0) {
            return Err(Invalid::PathNul.into());
        }
        if b.len() > 1 {
            for comp in b[1..].split(|&c| c == b'/') {
                if comp.is_empty() || comp == b"." || comp == b".." {
                    return Err(Invalid::PathNotNormalised(format!("{self:?}")).into());
                }
                if comp.len() > MAX_NAME {
                    return Err(Invalid::NameTooLong(comp.len()).into());
                }
            }
        }
        Ok(())
    }
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
    pub fn as_path(&self) -> &std::path::Path {
        use std::os::unix::ffi::OsStrExt;
        std::path::Path::new(std::ffi::OsStr::from_bytes(&self.0))
    }
    /// `self/name` (name must be one component: no `/`, not `.`/`..`).
    pub fn join(&self, name: &[u8]) -> Result<WirePath, ProtoError> {
        let mut v = self.0.clone();
        if v.len() > 1 {
            v.push(b'/');
        }
        v.extend_from_slice(name);
        if name.contains(&b'/') {
            return Err(Invalid::NameHasSlash.into());
        }
        WirePath::new(v)
    }
    pub fn parent(&self) -> Option<WirePath> {
        if self.0.len() <= 1 {
            return None;
        }
        let i = self.0.iter().rposition(|&c| c == b'/').unwrap_or(0);
        Some(if i == 0 { WirePath::root() } else { WirePath(self.0[..i].to_vec()) })
    }
    pub fn file_name(&self) -> &[u8] {
        let i = self.0.iter().rposition(|&c| c == b'/').map(|i| i + 1).unwrap_or(0);
        &self.0[i..]
    }
}

impl fmt::Debug for WirePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", String::from_utf8_lossy(&self.0))
    }
}
impl fmt::Display for WirePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(&self.0))
    }
}

/// One content-defined chunk of a file: its BLAKE3 name and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChunkRef {
    pub hash: Hash,
    pub len: u32,
}

/// A file's recipe: the chunk list that rebuilds its bytes, plus the
/// metadata a reader sees. Named by the hash of its encoding ([`Recipe::name`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recipe {
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime_ns: i64,
    pub chunks: Vec<ChunkRef>,
}

/// Largest chunk any peer may send (the chunker's maximum is far below it).
pub const MAX_CHUNK: u32 = 4 << 20;

impl Recipe {
    /// The RecipeName: hash of the canonical encoding of the whole recipe.
    pub fn name(&self) -> Hash {
        Hash::of(&bincode::serialize(self).expect("recipe encodes"))
    }
    /// Identity of the bytes alone (ignores metadata): files with equal
    /// content share one assembled copy in a host cache.
    pub fn content_id(&self) -> Hash {
        Hash::of(&bincode::serialize(&self.chunks).expect("chunks encode"))
    }
    pub fn validate(&self) -> Result<(), ProtoError> {
        let mut total: u64 = 0;
        for c in &self.chunks {
            if c.len == 0 || c.len > MAX_CHUNK {
                return Err(Invalid::ChunkLength(c.len).into());
            }
            total += u64::from(c.len);
        }
        if total != self.size {
            return Err(Invalid::RecipeSize { total, size: self.size }.into());
        }
        Ok(())
    }
}

/// Chunk bytes in flight, optionally zstd-compressed. [`ChunkData::open`]
/// decompresses and verifies the bytes against the name before anyone uses them.
/// The bytes travel as one length-prefixed byte string (`serde_bytes`: one
/// copy, not a sequence decoded element by element).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkData {
    pub hash: Hash,
    pub compressed: bool,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

impl fmt::Debug for ChunkData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkData({:?}, {} B{})", self.hash, self.data.len(), if self.compressed { ", zstd" } else { "" })
    }
}

/// How much of a chunk zstd is tried on first: if this prefix does not
/// shrink, the chunk is sent as is without compressing the rest.
const COMPRESS_SAMPLE: usize = 8 << 10;

/// Whether zstd saves at least 1/16 of `bytes`.
fn shrinks(bytes: &[u8]) -> Option<Vec<u8>> {
    let z = zstd::bulk::compress(bytes, 3).ok()?;
    (z.len() + bytes.len() / 16 < bytes.len()).then_some(z)
}

impl ChunkData {
    /// Package `bytes` for the wire (hashing them for their name). See
    /// [`ChunkData::seal_named`].
    pub fn seal(bytes: &[u8], compress: bool) -> ChunkData {
        ChunkData::seal_named(Hash::of(bytes), bytes.to_vec(), compress)
    }

    /// Package bytes whose name `hash` the caller already knows (it read
    /// and verified them, or they come from its own cache: the receiver
    /// verifies them anyway), without hashing them again. With `compress`,
    /// zstd is tried on a prefix first and on the whole chunk only if the
    /// prefix shrank; the result is kept only if it saves at least 1/16 of
    /// the size (incompressible data such as video or already-compressed
    /// archives costs one small attempt per chunk, then goes as is).
    pub fn seal_named(hash: Hash, bytes: Vec<u8>, compress: bool) -> ChunkData {
        if compress && bytes.len() >= 256 {
            let sample_shrinks = bytes.len() <= COMPRESS_SAMPLE || shrinks(&bytes[..COMPRESS_SAMPLE]).is_some();
            if sample_shrinks {
                if let Some(z) = shrinks(&bytes) {
                    return ChunkData { hash, compressed: true, data: z };
                }
            }
        }
        ChunkData { hash, compressed: false, data: bytes }
    }

    /// Decompress (bounded by [`MAX_CHUNK`]) and verify against the name.
    pub fn open(&self) -> Result<Vec<u8>, ProtoError> {
        self.clone().into_verified()
    }

    /// [`ChunkData::open`], consuming the chunk (no copy when it was not compressed).
    pub fn into_verified(self) -> Result<Vec<u8>, ProtoError> {
        let bytes = if self.compressed {
            zstd::bulk::decompress(&self.data, MAX_CHUNK as usize)
                .map_err(|source| ProtoError::from(Invalid::ChunkZstd { hash: self.hash, source }))?
        } else {
            self.data
        };
        if Hash::of(&bytes) != self.hash {
            return Err(Invalid::ChunkMismatch(self.hash).into());
        }
        Ok(bytes)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeKind {
    File,
    Dir,
    Symlink,
    /// FIFOs, sockets and device nodes: visible (so `ls` is right) but not openable.
    Special,
}

/// What `stat` says about a node in the client's file system.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attr {
    pub kind: NodeKind,
    pub ino: u64,
    pub size: u64,
    /// Full st_mode including the file-type bits.
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    pub atime_ns: i64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl NodeKind {
    /// The kind of a local file.
    pub fn of(ft: std::fs::FileType) -> NodeKind {
        if ft.is_dir() {
            NodeKind::Dir
        } else if ft.is_file() {
            NodeKind::File
        } else if ft.is_symlink() {
            NodeKind::Symlink
        } else {
            NodeKind::Special
        }
    }
}

impl Attr {
    /// The attributes of a local file, as `lstat` gave them.
    pub fn of(meta: &std::fs::Metadata) -> Attr {
        use std::os::unix::fs::MetadataExt;
        let ns = |s: i64, n: i64| s.saturating_mul(1_000_000_000).saturating_add(n);
        Attr {
            kind: NodeKind::of(meta.file_type()),
            ino: meta.ino(),
            size: meta.size(),
            mode: meta.mode(),
            nlink: u32::try_from(meta.nlink()).unwrap_or(u32::MAX),
            uid: meta.uid(),
            gid: meta.gid(),
            rdev: meta.rdev(),
            atime_ns: ns(meta.atime(), meta.atime_nsec()),
            mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// The answer to "what is at this path?" — a *binding* in UCop's terms.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Lookup {
    /// Nothing there (ENOENT), or not exported (`/proc`, `/sys`, ...).
    Absent,
    Dir(Attr),
    Symlink(Attr, Vec<u8>),
    /// A regular file and the name of its recipe.
    File(Attr, Hash),
    Special(Attr),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: Vec<u8>,
    pub kind: NodeKind,
}

/// Host-visible identifier of one task, assigned by the head.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TaskId(pub u64);

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}", self.0)
    }
}

/// One row of `starling ps`: a task the head has placed and not yet seen end.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskRow {
    pub task: TaskId,
    pub job: Option<String>,
    pub host: String,
    /// The command line, shortened.
    pub command: String,
    /// `running`, `moving to HOST`, or a clone task's `clones A..B`.
    pub state: String,
    /// CPU seconds used by its processes (on its current host), if known.
    pub cpu_seconds: Option<f64>,
    /// Resident memory of its processes, if known.
    pub rss_bytes: Option<u64>,
    /// Seconds since it started.
    pub runtime_seconds: f64,
    /// Threads of its processes that are runnable now (state R), if known: a roaming task's
    /// migration manager reads its CPU demand from this and `cpu_seconds`.
    pub runnable: Option<u32>,
    /// A roaming task's (`exec --roam`): why it runs where it does, and its manager's decisions.
    pub roam: Option<RoamLog>,
    /// Its stream (terminal, pipes, X) goes straight between its client and the home site now,
    /// not through the head, if known.
    pub direct: Option<bool>,
    /// Stream messages of the task the head relayed, both ways ([`crate::Msg::is_stream`]).
    pub relayed: u64,
}

/// A roaming task's record at the head (`starling ps`, `ps --why`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoamLog {
    /// Why it runs where it runs now (the latest decision that moved it, or its start).
    pub reason: String,
    /// Its migration manager's decisions (and moves by hand), oldest first, at most
    /// [`MAX_ROAM_DECISIONS`] (older ones are dropped).
    pub decisions: Vec<RoamDecision>,
}

/// Most decisions the head keeps per roaming task.
pub const MAX_ROAM_DECISIONS: usize = 256;

/// One decision of a roaming task's migration manager: with the sensor values that caused it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoamDecision {
    /// Client wall clock (ms since the epoch).
    pub at_ms: i64,
    /// The manager's state before and after (profile state names; equal when it stayed).
    pub from_state: String,
    pub to_state: String,
    /// Where the task ran, and where the decision sends it (a host name, `home`, or
    /// `cluster` for any host).
    pub from_site: String,
    pub to_site: String,
    /// What the decision was: `move`, `moved`, `stay` (a rule fired but the move was held back:
    /// dwell time, cost/benefit) or `failed`.
    pub action: String,
    /// In words: the rule that fired and why the move was made or held back.
    pub reason: String,
    /// The averaged sensors behind it (name, value).
    pub sensors: Vec<(String, f64)>,
}

/// What one task uses on its host (for `starling ps`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskUsage {
    pub task: TaskId,
    pub cpu_seconds: f64,
    pub rss_bytes: u64,
    /// Threads in state R (running or waiting for a CPU) now.
    pub runnable: u32,
    /// Its stream goes straight to its client now (a task at home: `crate::path`).
    pub direct: bool,
}

/// What a live migration did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MigrationReport {
    pub task: TaskId,
    pub from: String,
    pub to: String,
    pub threads: u32,
    /// Freeze → running on the target (as the source saw it).
    pub pause_ms: f64,
    /// Request → the source holds nothing.
    pub total_ms: f64,
    /// Pre-copy rounds after the first full copy.
    pub rounds: u32,
    /// Resident anonymous memory at the start (pages of 4 KiB).
    pub footprint_pages: u64,
    pub precopy_pages: u64,
    pub freeze_pages: u64,
    pub postcopy_pages: u64,
    /// Pages that reached the target when it held them already (fetched
    /// or pushed twice), thrown away there.
    pub discarded_pages: u64,
    /// Bytes the source sent for memory (pages, frames, page-server replies).
    pub memory_bytes: u64,
    /// Bytes of the task's files and I/O state sent at the freeze.
    pub state_bytes: u64,
    /// Faults the target served after the switch (staged or fetched pages),
    /// and their service time: upper bounds (µs) of the power-of-two
    /// buckets holding the median and the 99th percentile.
    pub postcopy_faults: u64,
    pub fault_p50_us: Option<u64>,
    pub fault_p99_us: Option<u64>,
    /// Where the pause went, in order: the source's steps while the task
    /// was frozen, then the target's until it ran (named, ms).
    pub phases_ms: Vec<(String, f64)>,
    /// A clone of an isolated ticket moved to a host that cannot enforce the ticket's own
    /// network (`fork.isolate_network = on`, the host named by the caller): why; it runs there
    /// with the host's whole network. Filled in by the head.
    pub unisolated: Option<String>,
}

/// How a task ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitStatus {
    Code(i32),
    Signal(i32),
}

impl ExitStatus {
    /// The status a shell would report: the code, or 128 + signal.
    pub fn shell_code(&self) -> i32 {
        match *self {
            ExitStatus::Code(c) => c & 0xff,
            ExitStatus::Signal(s) => 128 + s,
        }
    }
}

/// Everything a host needs to start a command as if on the client
/// (UCop's configuration transparency).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSpec {
    pub argv: Vec<Vec<u8>>,
    pub env: Vec<(Vec<u8>, Vec<u8>)>,
    pub cwd: WirePath,
    pub umask: u32,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    /// (resource, soft, hard) as in getrlimit(2).
    pub rlimits: Vec<(u32, u64, u64)>,
    /// Requested host name, or any host.
    pub host: Option<String>,
    /// Job name: tasks of one job share a consistency point and a prethrow.
    pub job: Option<String>,
    /// Bindings the client sends ahead of execution (prethrow).
    pub prethrow: Vec<(WirePath, Lookup)>,
    /// Complete directory listings bound at launch (output and temp
    /// directories): names missing from them are absent, without asking.
    pub listings: Vec<(WirePath, Vec<DirEntry>)>,
    /// Client wall clock at launch (ns since the epoch): the consistency point.
    pub launch_ns: i64,
    /// Set when the task is a clone of a running process (the fork API):
    /// instead of exec'ing `argv`, the host restores the process.
    pub clone: Option<CloneSpec>,
    /// Run the task on a pseudo-terminal of this size and these modes (the
    /// client's stdin is a terminal, or `-t`): stdout and stderr are then
    /// one stream, as with `ssh -t`. `None`: plain pipes.
    #[serde(default)]
    pub terminal: Option<TerminalSize>,
    /// What happens to this task when its host's owner becomes active
    /// (`exec/run --policy`); `None`: the host's own policy.
    pub policy: Option<GuestPolicy>,
    /// `exec --x11`: the task gets a `DISPLAY` served by its host, each X connection relayed to
    /// the client's own X server (as `ssh -X`). `None`: no display.
    pub x11: Option<X11Forward>,
}

/// An X11-forwarded task's display: the authorization its programs must present (written
/// into the task's Xauthority on its host). It is a stand-in made by the client for this task
/// only: the client checks it in each connection's setup and puts the real server's cookie in
/// its place, so the real one never leaves the user's machine (as `ssh -X` does).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct X11Forward {
    /// The authorization protocol (`MIT-MAGIC-COOKIE-1`).
    pub auth_name: String,
    /// The stand-in cookie.
    #[serde(with = "serde_bytes")]
    pub auth_data: Vec<u8>,
}

/// Longest authorization name and data an [`X11Forward`] carries.
pub const X11_AUTH_MAX: usize = 256;

impl std::fmt::Debug for X11Forward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "X11Forward({}, ..)", self.auth_name)
    }
}

/// The Linger-Longer policies (the seed's ch. 3): what a guest does when
/// its host's owner becomes active.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GuestPolicy {
    /// LF: linger at starvation priority, never move.
    LingerForever,
    /// LL: linger, move after T_lingr = ((1−l)/(h−l))·T_migr when an idle host exists.
    LingerLonger,
    /// PM: suspend the guests, move them if the owner is still active after a pause.
    PauseAndMigrate,
    /// IE: kill the guest at once and rerun it from the start on a host whose owner is idle;
    /// its uncommitted files are discarded and the output it already sent is not sent again.
    ImmediateEviction,
}

impl GuestPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            GuestPolicy::LingerForever => "LF",
            GuestPolicy::LingerLonger => "LL",
            GuestPolicy::PauseAndMigrate => "PM",
            GuestPolicy::ImmediateEviction => "IE",
        }
    }

    /// `LF`, `LL`, `PM` or `IE` (any case).
    pub fn parse(text: &str) -> Result<GuestPolicy, &'static str> {
        match text.trim().to_ascii_uppercase().as_str() {
            "LF" => Ok(GuestPolicy::LingerForever),
            "LL" => Ok(GuestPolicy::LingerLonger),
            "PM" => Ok(GuestPolicy::PauseAndMigrate),
            "IE" => Ok(GuestPolicy::ImmediateEviction),
            _ => Err("LF, LL, PM or IE"),
        }
    }
}

/// The terminal a task runs on: the client terminal's window size and line
/// modes (its termios), recreated on the task's host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TerminalSize {
    pub rows: u16,
    pub cols: u16,
    /// The client terminal's modes as it had them before starling put it in
    /// raw mode; `None`: the kernel's defaults for a new pty.
    pub modes: Option<TerminalModes>,
}

/// A terminal's line modes: the fields of Linux's `struct termios`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TerminalModes {
    pub iflag: u32,
    pub oflag: u32,
    pub cflag: u32,
    pub lflag: u32,
    pub line: u8,
    /// Control characters (`c_cc`, [`TERMINAL_CC_LEN`] entries at most).
    pub cc: Vec<u8>,
    pub ispeed: u32,
    pub ospeed: u32,
}

/// Most control characters a [`TerminalModes`] carries (Linux's NCCS).
pub const TERMINAL_CC_LEN: usize = 32;

/// Largest encoded process descriptor accepted (they are kilobytes).
pub const MAX_DESCRIPTOR: usize = 16 << 20;

/// A 32-byte secret (a ticket's or a move's key). Its `Debug` never shows it.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretKey(pub [u8; 32]);

impl SecretKey {
    /// A fresh key from the kernel's random source (`getrandom(2)`).
    pub fn random() -> SecretKey {
        let mut k = [0u8; 32];
        let mut got = 0usize;
        while got < k.len() {
            // SAFETY: writes at most `k.len() - got` bytes into the live local array from offset `got`.
            let n = unsafe { libc::getrandom(k[got..].as_mut_ptr().cast(), k.len() - got, 0) };
            match usize::try_from(n) {
                Ok(n) => got += n,
                Err(_) if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
                // getrandom(2) only fails on bad arguments (it blocks until the pool is seeded).
                Err(_) => panic!("getrandom failed: {}", std::io::Error::last_os_error()),
            }
        }
        SecretKey(k)
    }
}

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretKey(..)")
    }
}

/// What a host needs to restore one clone of a frozen template process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloneSpec {
    /// The ticket this clone belongs to (one multicast group per ticket).
    pub ticket: u64,
    /// 1..m; the value `sf_clone` returns in this clone.
    pub clone_id: u32,
    /// The encoded process descriptor (`starling_fork::descriptor`, opaque
    /// here) is not in the launch: the host fetches it from the page server
    /// like a page (multicast to the ticket's group when that works) and
    /// checks it against this hash (BLAKE3) and length.
    pub descriptor_hash: Hash,
    pub descriptor_len: u32,
    /// Where the template's page server listens (`IP:PORT`, reachable from hosts).
    pub page_server: String,
    /// The ticket's secret, made by the parent: the host must prove it to
    /// the page server, and multicast pages are sealed with it. It travels
    /// only in this launch (client → head → agent, each hop authenticated).
    pub page_key: SecretKey,
    /// Hierarchical mode: further clones on this host, forked from the
    /// first by its restorer (ids clone_id+1 ..= clone_id+local_forks); the
    /// task then occupies 1 + local_forks cores.
    pub local_forks: u32,
    /// When the head placed the task (CLOCK_REALTIME ns; set by the head,
    /// 0 from the client): the clone's critical-path stamp, sent back in
    /// its `CloneStats`.
    pub placed_ns: u64,
    /// The ticket's own network (SnowFlock's virtual network per impromptu
    /// cluster): `Some` when the clone may reach only its ticket's members;
    /// the head fills it in at placement (from the client: no members, and
    /// the ports it refuses besides the cluster's: the one it reaches the
    /// cluster at). `None`: the job asked for its hosts' whole network
    /// (`fork.isolate_network` off).
    pub network: Option<TicketNetwork>,
}

/// Where a clone of an isolated ticket may connect (filled in by the head,
/// enforced by each host's agent with nftables).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TicketNetwork {
    /// The ticket's hosts (the grant's) and the parent's machine.
    pub members: Vec<std::net::IpAddr>,
    /// Ports (TCP, UDP, SCTP, DCCP) refused to the clone on every address,
    /// members' included: the head's and the agents' control and chunk ports,
    /// and the one the parent reaches the cluster at (a link relay's).
    pub refused_ports: Vec<u16>,
    /// The job set `fork.isolate_network = required`: a host that cannot
    /// enforce the network fails the clone. Otherwise (`on`) it runs the
    /// clone with its whole network and says so on the clone's stderr.
    pub required: bool,
}

/// What a fork ticket asks of its clones' network (`fork.isolate_network`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum NetworkIsolation {
    /// The clones get their hosts' whole network.
    Off,
    /// Their ticket's own network wherever the host can enforce one: the
    /// grant prefers such hosts, and names the others (their clones run with
    /// the whole network).
    #[default]
    On,
    /// Their ticket's own network, or no ticket: the grant holds only hosts
    /// that can enforce it, and the ticket is refused, naming the hosts that
    /// cannot, when that would grant fewer clones than the cluster could.
    Required,
}

/// A host of a grant whose clones run without their ticket's own network, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unisolated {
    pub host: String,
    pub why: String,
}

/// Members and refused ports of a [`TicketNetwork`] at most (a ticket's
/// hosts are a cluster's; each port is one host's or the head's).
pub const MAX_TICKET_NETWORK: usize = 4096;

/// The variable a job's task finds its index in (0..n).
pub const TASK_INDEX_ENV: &str = "STARLING_TASK";
/// The variable a job's task finds the job's number of tasks in.
pub const TASK_COUNT_ENV: &str = "STARLING_TASKS";

impl TicketNetwork {
    /// No more members or refused ports than [`MAX_TICKET_NETWORK`].
    pub fn validate(&self) -> Result<(), ProtoError> {
        check_len("a ticket network's members", self.members.len(), MAX_TICKET_NETWORK)?;
        check_len("a ticket network's refused ports", self.refused_ports.len(), MAX_TICKET_NETWORK)
    }
}

fn check_len(what: &'static str, len: usize, max: usize) -> Result<(), ProtoError> {
    if len > max {
        return Err(Invalid::TooLarge { what, len, max }.into());
    }
    Ok(())
}

impl TaskSpec {
    /// `argv` in `cwd` as root with umask 022, and nothing else: no
    /// environment, limits, host, job, bindings, clone, terminal or policy.
    /// Callers set the fields they mean (the client fills every one).
    pub fn new(argv: Vec<Vec<u8>>, cwd: WirePath) -> TaskSpec {
        TaskSpec {
            argv,
            env: Vec::new(),
            cwd,
            umask: 0o022,
            uid: 0,
            gid: 0,
            groups: Vec::new(),
            rlimits: Vec::new(),
            host: None,
            job: None,
            prethrow: Vec::new(),
            listings: Vec::new(),
            launch_ns: 0,
            clone: None,
            terminal: None,
            policy: None,
            x11: None,
        }
    }

    /// Make this the spec of task `index` of a job of `count` tasks
    /// ([`TASK_INDEX_ENV`], [`TASK_COUNT_ENV`]).
    pub fn set_task_index(&mut self, index: usize, count: usize) {
        self.env.retain(|(k, _)| k != TASK_INDEX_ENV.as_bytes() && k != TASK_COUNT_ENV.as_bytes());
        self.env.push((TASK_INDEX_ENV.as_bytes().to_vec(), index.to_string().into_bytes()));
        self.env.push((TASK_COUNT_ENV.as_bytes().to_vec(), count.to_string().into_bytes()));
    }

    /// Cores the task occupies on its host: one per process-level clone it
    /// starts (hierarchical clone tasks), else one.
    pub fn cores(&self) -> u32 {
        self.clone.as_ref().map_or(1, |c| 1 + c.local_forks)
    }

    pub fn validate(&self) -> Result<(), ProtoError> {
        if self.argv.is_empty() {
            return Err(Invalid::EmptyArgv.into());
        }
        if self.argv.iter().any(|a| a.contains(&0)) {
            return Err(Invalid::ArgvNul.into());
        }
        if self.env.iter().any(|(k, v)| k.is_empty() || k.contains(&0) || k.contains(&b'=') || v.contains(&0)) {
            return Err(Invalid::BadEnv.into());
        }
        self.cwd.validate()?;
        if let Some(c) = &self.clone {
            if c.descriptor_len == 0 || c.descriptor_len as usize > MAX_DESCRIPTOR {
                return Err(Invalid::CloneDescriptor.into());
            }
            // 255 further clones at most: the restorer's MAX_CLONES_PER_RESTORE.
            if c.clone_id == 0 || c.page_server.len() > 256 || c.local_forks > 255 || c.clone_id.checked_add(c.local_forks).is_none() {
                return Err(Invalid::CloneSpec.into());
            }
            if let Some(n) = &c.network {
                n.validate()?;
            }
        }
        if self.umask > 0o777 {
            return Err(Invalid::Umask.into());
        }
        if let Some(t) = &self.terminal {
            if t.modes.as_ref().is_some_and(|m| m.cc.len() > TERMINAL_CC_LEN) {
                return Err(Invalid::TerminalModes.into());
            }
        }
        if let Some(x) = &self.x11 {
            check_len("X11 authorization name", x.auth_name.len(), X11_AUTH_MAX)?;
            check_len("X11 authorization data", x.auth_data.len(), X11_AUTH_MAX)?;
        }
        for (p, entries) in &self.listings {
            p.validate()?;
            if entries.iter().any(|e| e.name.is_empty() || e.name.contains(&b'/') || e.name.contains(&0)) {
                return Err(Invalid::ListingName.into());
            }
        }
        for (p, l) in &self.prethrow {
            p.validate()?;
            if let Lookup::Symlink(_, t) = l {
                if t.contains(&0) || t.len() > crate::MAX_PATH {
                    return Err(Invalid::SymlinkTarget.into());
                }
            }
        }
        Ok(())
    }
}

/// What a host advertises about itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostInfo {
    pub name: String,
    pub addr: String,
    pub pid: u32,
    pub cores: u32,
    pub mem_bytes: u64,
    /// 1-minute load average.
    pub load: f32,
    pub running: u32,
    /// How the last remote-fork clone on this host got its pages
    /// (`multicast`, `multicast+push`, `unicast`, `unicast (multicast
    /// unavailable)`); None before the first clone.
    #[serde(default)]
    pub page_distribution: Option<String>,
    /// The host's owner and what the guests do about them (Linger-Longer);
    /// None if the agent has no guest cgroup.
    #[serde(default)]
    pub owner: Option<OwnerReport>,
    /// The site is the user's own machine (`starling agent --home`, started by `exec --roam`):
    /// the head places there only what names it (a roaming task's start, `migrate --to home`).
    #[serde(default)]
    pub home: bool,
    /// `IP:PORT` where this host serves the chunks it holds to other hosts
    /// of the cluster (`FindChunks`); None if it does not.
    #[serde(default)]
    pub peer: Option<String>,
    /// Why this host cannot enforce a fork ticket's own network (no root or
    /// `CAP_NET_ADMIN`, no cgroup2 hierarchy it can make groups in, no
    /// `nft`), found by the agent at start; None: it can.
    #[serde(default)]
    pub cannot_isolate: Option<String>,
}

/// One host's owner monitor and guest containment, sent with each load report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OwnerReport {
    /// `idle`, `active-light` or `active-busy`.
    pub state: String,
    /// Share of all the host's cores the owner used over the last interval (0..=1).
    pub cpu: f32,
    /// Share the guests used.
    pub guest_cpu: f32,
    /// `active` or `idle`.
    pub keyboard: String,
    /// The machine's MemAvailable.
    pub mem_available: u64,
    /// What the guests use, and their cap if one is set.
    pub guest_mem: u64,
    pub guest_mem_cap: Option<u64>,
    pub guests_frozen: bool,
    /// The host's memory band (bytes of MemAvailable): below `low_water` the guests are capped,
    /// below half of it frozen, at `high_water` released. The head moves an LL or PM guest of a
    /// capped or frozen host to one whose free memory minus the guest's stays above its `high_water`.
    pub low_water: u64,
    pub high_water: u64,
    /// How guests get starvation priority: `cpu.idle` or `SCHED_IDLE`.
    pub priority: String,
    /// `LF`, `LL` or `PM`.
    pub policy: String,
    /// PM: seconds guests stay suspended before the head moves them.
    pub pause_s: u64,
    /// PM: the guests are suspended because the owner is active.
    pub suspended: bool,
    /// What the policy is doing, in words.
    pub doing: String,
    /// The guest and owner cgroups, relative to each v1 hierarchy's root.
    pub guest_cgroup: String,
    pub owner_cgroup: String,
    /// The guests' disk and network rate windows while they are applied
    /// (e.g. `disk 2.0 MiB/s on vda, net 2.0 MiB/s on eth0`), else `None`.
    pub rate_windows: Option<String>,
}

/// What the task's view held at a path before the task changed it. The
/// client commits a change only if its own copy still matches this base.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Base {
    Absent,
    File(Hash),
    Dir,
    Symlink(Vec<u8>),
    Special,
}

/// One file-system change a task made, returned at exit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    /// Create or replace a regular file (its chunks travel ahead in `ChangeChunks`).
    File { path: WirePath, recipe: Recipe, base: Base },
    Mkdir { path: WirePath, mode: u32, base: Base },
    Symlink { path: WirePath, target: Vec<u8>, base: Base },
    /// Remove whatever is at path (recursively for a directory).
    Remove { path: WirePath, base: Base },
    /// Permission change on a directory that already existed.
    Chmod { path: WirePath, mode: u32 },
}

impl Change {
    pub fn path(&self) -> &WirePath {
        match self {
            Change::File { path, .. }
            | Change::Mkdir { path, .. }
            | Change::Symlink { path, .. }
            | Change::Remove { path, .. }
            | Change::Chmod { path, .. } => path,
        }
    }
    pub fn validate(&self) -> Result<(), ProtoError> {
        self.path().validate()?;
        if self.path().0 == b"/" {
            return Err(Invalid::ReplaceRoot.into());
        }
        match self {
            Change::File { recipe, .. } => recipe.validate(),
            Change::Symlink { target, .. } if target.is_empty() || target.contains(&0) => {
                Err(Invalid::SymlinkTarget.into())
            }
            _ => Ok(()),
        }
    }
}

impl TerminalModes {
    /// The modes of a terminal as `tcgetattr(3)` gave them.
    pub fn from_termios(t: &libc::termios) -> TerminalModes {
        TerminalModes {
            iflag: t.c_iflag,
            oflag: t.c_oflag,
            cflag: t.c_cflag,
            lflag: t.c_lflag,
            line: t.c_line,
            cc: t.c_cc.to_vec(),
            ispeed: t.c_ispeed,
            ospeed: t.c_ospeed,
        }
    }

    /// These modes over `base` (a terminal's current termios), for `tcsetattr(3)`.
    pub fn to_termios(&self, base: &libc::termios) -> libc::termios {
        let mut t = *base;
        t.c_iflag = self.iflag;
        t.c_oflag = self.oflag;
        t.c_cflag = self.cflag;
        t.c_lflag = self.lflag;
        t.c_line = self.line;
        for (dst, src) in t.c_cc.iter_mut().zip(&self.cc) {
            *dst = *src;
        }
        t.c_ispeed = self.ispeed;
        t.c_ospeed = self.ospeed;
        t
    }
}

/// A `starling.Executor`'s futures so far (`Msg::ExecutorProgress`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecutorProgress {
    /// Workers connected to the pool so far.
    pub workers: u32,
    pub submitted: u64,
    /// Completed with a result.
    pub done: u64,
    /// Completed with an exception (the call raised, its worker was lost, the pool broke).
    pub failed: u64,
    pub cancelled: u64,
    /// The pool was shut down: no more notes will come.
    pub closed: bool,
}
