//! The process descriptor: everything a clone host needs to rebuild a frozen
//! template, except the page contents (those come from the page server, the
//! host's own files, or are zero).
//!
//! [`dump`] reads the template from outside (`/proc/PID/smaps`, `pagemap`,
//! `fd`/`fdinfo`, `stat`, `status`, `prlimit`) and combines it with the
//! [`TemplateRecord`] the template wrote about itself. The result is
//! serde/bincode ([`Descriptor::encode`]); for a typical program it is a few
//! kilobytes, dominated by the run-length page classes.
//!
//! State that cannot follow a clone is refused with an error naming the
//! mapping: mappings of deleted files, device and I/O mappings, hugetlb,
//! mappings already registered with a userfaultfd, files replaced since
//! they were mapped.

use crate::template::TemplateRecord;
use crate::{ForkError, Result, PAGE_SIZE};
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt};

pub const DESCRIPTOR_VERSION: u32 = 1;
/// Upper bound accepted by [`Descriptor::decode`].
pub const MAX_DESCRIPTOR_BYTES: u64 = 64 << 20;

/// How a clone obtains one page.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageClass {
    /// Never touched (or below the resume stack pointer): zero-fill locally.
    Zero,
    /// Unmodified page of a private file mapping: read from the host's copy.
    File,
    /// Anonymous or copy-on-written: fetch from the page server.
    Fetch,
}

/// Run-length encoded page classes of one region.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct PageRuns(pub Vec<(PageClass, u32)>);

impl PageRuns {
    pub fn push(&mut self, class: PageClass) {
        match self.0.last_mut() {
            Some((c, n)) if *c == class && *n < u32::MAX => *n += 1,
            _ => self.0.push((class, 1)),
        }
    }
    pub fn pages(&self) -> u64 {
        self.0.iter().map(|&(_, n)| n as u64).sum()
    }
    pub fn count(&self, class: PageClass) -> u64 {
        self.0.iter().filter(|(c, _)| *c == class).map(|&(_, n)| n as u64).sum()
    }
    /// Expand into one class per page.
    pub fn expand(&self) -> Vec<PageClass> {
        let mut v = Vec::with_capacity(self.pages() as usize);
        for &(c, n) in &self.0 {
            v.extend(std::iter::repeat(c).take(n as usize));
        }
        v
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum RegionKind {
    /// Private anonymous memory (including `[heap]`, `[stack]`, `[anon:…]`).
    Anonymous { name: String },
    /// Shared anonymous memory: fork freezes nothing here, so the clone gets a
    /// private copy of its content at dump time.
    SharedAnonymous { name: String },
    File { path: String, offset: u64, inode: u64 },
    Vvar,
    VvarVclock,
    Vdso,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Region {
    pub start: u64,
    pub end: u64,
    /// PROT_READ=1 | PROT_WRITE=2 | PROT_EXEC=4.
    pub prot: u8,
    pub shared: bool,
    pub growsdown: bool,
    pub kind: RegionKind,
    pub pages: PageRuns,
}

impl Region {
    pub fn len(&self) -> u64 {
        self.end - self.start
    }
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
    pub fn describe(&self) -> String {
        let name = match &self.kind {
            RegionKind::Anonymous { name } | RegionKind::SharedAnonymous { name } => name.as_str(),
            RegionKind::File { path, .. } => path.as_str(),
            RegionKind::Vvar => "[vvar]",
            RegionKind::VvarVclock => "[vvar_vclock]",
            RegionKind::Vdso => "[vdso]",
        };
        format!("{:x}-{:x} {}", self.start, self.end, name)
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum FdKind {
    /// Regular file or directory: reopened by path with its flags and offset.
    Reopen { path: String, flags: u32, offset: u64 },
    PipeRead,
    PipeWrite,
    Socket,
    /// Character/block device, anon inode (eventfd, epoll…), deleted file.
    Other { target: String },
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct FdEntry {
    pub fd: i32,
    pub kind: FdKind,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ThreadState {
    /// rbx, rbp, r12, r13, r14, r15, rsp, rip, mxcsr|fcw<<32.
    pub resume: [u64; 9],
    pub fs_base: u64,
    pub tid_address: u64,
    pub robust_head: u64,
    pub robust_len: u64,
    pub rseq_addr: u64,
    pub rseq_len: u64,
    pub rseq_sig: u64,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct SignalState {
    /// Index = signal number - 1: (handler, flags, restorer, mask).
    pub actions: Vec<[u64; 4]>,
    pub mask: u64,
    /// (sp, flags, size); sp = 0 when none.
    pub altstack: [u64; 3],
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct MmFields {
    pub start_code: u64,
    pub end_code: u64,
    pub start_data: u64,
    pub end_data: u64,
    pub start_brk: u64,
    pub brk: u64,
    pub start_stack: u64,
    pub arg_start: u64,
    pub arg_end: u64,
    pub env_start: u64,
    pub env_end: u64,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ProcessState {
    pub cwd: String,
    pub umask: u32,
    /// (resource, soft, hard); u64::MAX = unlimited.
    pub rlimits: Vec<(u32, u64, u64)>,
    pub uid: u32,
    pub gid: u32,
    pub mm: MmFields,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub version: u32,
    pub template_pid: i32,
    pub regions: Vec<Region>,
    pub fds: Vec<FdEntry>,
    pub thread: ThreadState,
    pub signals: SignalState,
    pub process: ProcessState,
}

impl Descriptor {
    pub fn encode(&self) -> Vec<u8> {
        bincode::serialize(self).expect("descriptor types always serialize")
    }

    /// Decode and validate a descriptor from a peer.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        use bincode::Options;
        if bytes.len() as u64 > MAX_DESCRIPTOR_BYTES {
            return Err(ForkError::Malformed { what: "descriptor", detail: format!("{} bytes", bytes.len()) });
        }
        let d: Descriptor = bincode::DefaultOptions::new()
            .with_fixint_encoding()
            .with_limit(MAX_DESCRIPTOR_BYTES)
            .reject_trailing_bytes()
            .deserialize(bytes)
            .map_err(|e| ForkError::Malformed { what: "descriptor", detail: e.to_string() })?;
        d.validate()?;
        Ok(d)
    }

    /// Structural checks a restorer relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |detail: String| Err(ForkError::Malformed { what: "descriptor", detail });
        if self.version != DESCRIPTOR_VERSION {
            return bad(format!("version {}", self.version));
        }
        if self.template_pid <= 1 {
            return bad(format!("template pid {}", self.template_pid));
        }
        let mut prev_end = 0;
        for r in &self.regions {
            if r.start % PAGE_SIZE != 0 || r.end % PAGE_SIZE != 0 || r.end <= r.start || r.start < prev_end {
                return bad(format!("region {} unaligned, empty or out of order", r.describe()));
            }
            if r.pages.pages() != r.len() / PAGE_SIZE {
                return bad(format!("region {} page classes do not cover it", r.describe()));
            }
            if let RegionKind::File { path, .. } = &r.kind {
                if !path.starts_with('/') || path.contains('\0') {
                    return bad(format!("region {} path", r.describe()));
                }
            }
            prev_end = r.end;
        }
        if self.signals.actions.len() != 64 {
            return bad("signal table size".into());
        }
        let mut prev_fd = -1;
        for f in &self.fds {
            if f.fd <= prev_fd || f.fd > 1 << 20 {
                return bad(format!("fd {} out of order/range", f.fd));
            }
            prev_fd = f.fd;
        }
        Ok(())
    }

    /// Number of pages of each class, over all regions.
    pub fn page_totals(&self) -> (u64, u64, u64) {
        let mut t = (0, 0, 0);
        for r in &self.regions {
            t.0 += r.pages.count(PageClass::Zero);
            t.1 += r.pages.count(PageClass::File);
            t.2 += r.pages.count(PageClass::Fetch);
        }
        t
    }

    pub fn region_at(&self, addr: u64) -> Option<&Region> {
        let i = self.regions.partition_point(|r| r.end <= addr);
        self.regions.get(i).filter(|r| r.start <= addr)
    }
}

// ---------------------------------------------------------------------------
// dumping

fn read_proc(path: &str) -> Result<String> {
    let mut s = String::new();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_string(&mut s))
        .map_err(|e| ForkError::io(format!("read {path}"), e))?;
    Ok(s)
}

struct MapsEntry {
    start: u64,
    end: u64,
    perms: [u8; 4],
    offset: u64,
    inode: u64,
    name: String,
    vm_flags: Vec<String>,
}

fn parse_smaps(text: &str) -> Result<Vec<MapsEntry>> {
    let mut out: Vec<MapsEntry> = Vec::new();
    let malformed = |l: &str| ForkError::Malformed { what: "smaps", detail: l.to_string() };
    for line in text.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(last) = out.last_mut() {
                last.vm_flags = flags.split_whitespace().map(str::to_string).collect();
            }
            continue;
        }
        let mut it = line.splitn(6, ' ');
        let range = it.next().unwrap_or("");
        let Some((s, e)) = range.split_once('-') else { continue };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) else { continue };
        // A header line: range perms offset dev inode [name]
        let perms = it.next().ok_or_else(|| malformed(line))?.as_bytes();
        if perms.len() != 4 {
            return Err(malformed(line));
        }
        let offset = u64::from_str_radix(it.next().ok_or_else(|| malformed(line))?, 16).map_err(|_| malformed(line))?;
        let _dev = it.next().ok_or_else(|| malformed(line))?;
        let inode = it.next().ok_or_else(|| malformed(line))?.parse().map_err(|_| malformed(line))?;
        let name = it.next().unwrap_or("").trim_start().to_string();
        out.push(MapsEntry { start, end, perms: [perms[0], perms[1], perms[2], perms[3]], offset, inode, name, vm_flags: vec![] });
    }
    Ok(out)
}

const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
const PM_FILE: u64 = 1 << 61;

/// Whether the fetch-avoidance heuristics are on (default). With
/// `STARLING_FORK_HEURISTICS=off` every readable page of a private
/// mapping is classified `Fetch`: nothing is zero-filled locally or read
/// from the host's file copy, so every page a clone touches comes from the
/// page server (SnowFlock's "no heuristics" runs, for benchmarks).
pub fn heuristics_enabled() -> bool {
    !matches!(std::env::var("STARLING_FORK_HEURISTICS").as_deref().map(str::trim), Ok("off") | Ok("0"))
}

/// Dump a frozen template into a descriptor.
pub fn dump(pid: i32, record: &TemplateRecord) -> Result<Descriptor> {
    let heuristics = heuristics_enabled();
    let smaps = parse_smaps(&read_proc(&format!("/proc/{pid}/smaps"))?)?;
    let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap"))
        .map_err(|e| ForkError::io(format!("open /proc/{pid}/pagemap"), e))?;
    // Stack pages wholly below the resume rsp minus the red zone are dead.
    let dead_stack_below = record.resume.rsp.saturating_sub(128) & !(PAGE_SIZE - 1);
    let mut regions = Vec::new();
    for m in &smaps {
        if m.name == "[vsyscall]" {
            continue; // provided by every kernel at the same address
        }
        let prot = (m.perms[0] == b'r') as u8 | ((m.perms[1] == b'w') as u8) << 1 | ((m.perms[2] == b'x') as u8) << 2;
        let shared = m.perms[3] == b's';
        let has = |f: &str| m.vm_flags.iter().any(|x| x == f);
        let desc = format!("{:x}-{:x} {}", m.start, m.end, m.name);
        let refuse = |reason: &str| Err(ForkError::Unclonable { mapping: desc.clone(), reason: reason.into() });
        let kind = match m.name.as_str() {
            "[vvar]" => RegionKind::Vvar,
            "[vvar_vclock]" => RegionKind::VvarVclock,
            "[vdso]" => RegionKind::Vdso,
            _ if has("io") || has("pf") => return refuse("device/IO memory (VM_IO/VM_PFNMAP)"),
            _ if has("ht") => return refuse("hugetlbfs memory"),
            _ if has("um") || has("uw") || has("ui") => return refuse("already registered with a userfaultfd"),
            "/dev/zero (deleted)" | "[anon_shmem]" => RegionKind::SharedAnonymous { name: m.name.clone() },
            n if n.starts_with("/SYSV") => RegionKind::SharedAnonymous { name: m.name.clone() },
            n if n.starts_with('/') => {
                if n.ends_with(" (deleted)") {
                    return refuse("mapping of a deleted file");
                }
                let meta = std::fs::metadata(n).map_err(|e| ForkError::Unclonable { mapping: desc.clone(), reason: format!("stat: {e}") })?;
                if !meta.file_type().is_file() {
                    return refuse("mapping of a device or special file");
                }
                if meta.ino() != m.inode {
                    return refuse("file replaced since it was mapped");
                }
                RegionKind::File { path: n.to_string(), offset: m.offset, inode: m.inode }
            }
            n if n.is_empty() || n.starts_with('[') => {
                if shared {
                    RegionKind::SharedAnonymous { name: n.to_string() }
                } else {
                    RegionKind::Anonymous { name: n.to_string() }
                }
            }
            _ => return refuse("unknown mapping type"),
        };
        let special = matches!(kind, RegionKind::Vvar | RegionKind::VvarVclock | RegionKind::Vdso);
        let npages = ((m.end - m.start) / PAGE_SIZE) as usize;
        let mut pages = PageRuns::default();
        if special || (shared && matches!(kind, RegionKind::File { .. })) {
            // Supplied by the kernel / by the shared file itself.
            let class = if special { PageClass::Zero } else { PageClass::File };
            (0..npages).for_each(|_| pages.push(class));
        } else {
            let mut raw = vec![0u8; npages * 8];
            pagemap
                .read_exact_at(&mut raw, m.start / PAGE_SIZE * 8)
                .map_err(|e| ForkError::io(format!("read pagemap of {desc}"), e))?;
            let is_file = matches!(kind, RegionKind::File { .. });
            let is_stack = m.name == "[stack]";
            // fork() copies no page table entries of shared mappings: the template's pagemap
            // shows shared anonymous pages as absent even where the parent wrote data. The page
            // server reads them through the shared object, so every readable one is fetched.
            let shared_anonymous = matches!(kind, RegionKind::SharedAnonymous { .. });
            for (i, chunk) in raw.chunks_exact(8).enumerate() {
                let e = u64::from_le_bytes(chunk.try_into().expect("8-byte chunk"));
                let addr = m.start + i as u64 * PAGE_SIZE;
                let class = if (!heuristics || shared_anonymous) && prot & 1 != 0 {
                    // Heuristics off: the page server serves every readable page.
                    PageClass::Fetch
                } else if is_stack && addr + PAGE_SIZE <= dead_stack_below {
                    PageClass::Zero
                } else if e & PM_SWAPPED != 0 || (e & PM_PRESENT != 0 && (e & PM_FILE == 0 || !is_file)) {
                    // present anon (incl. COW copies in file mappings), swapped, or shared anon
                    PageClass::Fetch
                } else if is_file {
                    PageClass::File
                } else {
                    PageClass::Zero
                };
                pages.push(class);
            }
        }
        regions.push(Region { start: m.start, end: m.end, prot, shared, growsdown: has("gd"), kind, pages });
    }

    let r = record;
    let thread = ThreadState {
        resume: [r.resume.rbx, r.resume.rbp, r.resume.r12, r.resume.r13, r.resume.r14, r.resume.r15,
                 r.resume.rsp, r.resume.rip, r.resume.mxcsr_fcw],
        fs_base: r.fs_base,
        tid_address: r.tid_address,
        robust_head: r.robust_head,
        robust_len: r.robust_len,
        rseq_addr: r.rseq_addr,
        rseq_len: r.rseq_len,
        rseq_sig: r.rseq_sig,
    };
    let signals = SignalState {
        actions: r.sigactions.iter().map(|a| [a.handler, a.flags, a.restorer, a.mask]).collect(),
        mask: r.sigmask,
        altstack: [r.altstack_sp, r.altstack_flags, r.altstack_size],
    };
    let d = Descriptor {
        version: DESCRIPTOR_VERSION,
        template_pid: pid,
        regions,
        fds: dump_fds(pid, record.freeze_fd as i32)?,
        thread,
        signals,
        process: dump_process(pid, record)?,
    };
    d.validate()?;
    Ok(d)
}

fn dump_fds(pid: i32, skip: i32) -> Result<Vec<FdEntry>> {
    let dir = format!("/proc/{pid}/fd");
    let mut fds: Vec<i32> = std::fs::read_dir(&dir)
        .map_err(|e| ForkError::io(format!("list {dir}"), e))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd != skip)
        .collect();
    fds.sort_unstable();
    let mut out = Vec::new();
    for fd in fds {
        let link = format!("{dir}/{fd}");
        let Ok(target) = std::fs::read_link(&link) else { continue }; // closed meanwhile
        let target = target.to_string_lossy().into_owned();
        let info = read_proc(&format!("/proc/{pid}/fdinfo/{fd}")).unwrap_or_default();
        let field = |name: &str| info.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
        let flags = field("flags:").and_then(|v| u32::from_str_radix(v, 8).ok()).unwrap_or(0);
        let pos = field("pos:").and_then(|v| v.parse().ok()).unwrap_or(0);
        let kind = if target.starts_with('/') && !target.ends_with(" (deleted)") {
            match std::fs::metadata(&link) {
                Ok(m) if m.file_type().is_file() || m.file_type().is_dir() => {
                    FdKind::Reopen { path: target, flags, offset: pos }
                }
                _ => FdKind::Other { target },
            }
        } else if target.starts_with("pipe:") {
            if flags & libc::O_ACCMODE as u32 == libc::O_WRONLY as u32 { FdKind::PipeWrite } else { FdKind::PipeRead }
        } else if target.starts_with("socket:") {
            FdKind::Socket
        } else {
            FdKind::Other { target }
        };
        out.push(FdEntry { fd, kind });
    }
    Ok(out)
}

fn dump_process(pid: i32, record: &TemplateRecord) -> Result<ProcessState> {
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd"))
        .map_err(|e| ForkError::io("read template cwd", e))?
        .to_string_lossy()
        .into_owned();
    let status = read_proc(&format!("/proc/{pid}/status"))?;
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim).unwrap_or("");
    let umask = u32::from_str_radix(field("Umask:"), 8).unwrap_or(0o022);
    let first = |s: &str| s.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0); // effective id
    let (uid, gid) = (first(field("Uid:")), first(field("Gid:")));
    let mut rlimits = Vec::new();
    for res in 0..16u32 {
        let mut lim = libc::rlimit64 { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: prlimit64 with a NULL new limit only writes the old one into `lim`.
        if unsafe { libc::prlimit64(pid, res as _, std::ptr::null(), &mut lim) } == 0 {
            rlimits.push((res, lim.rlim_cur, lim.rlim_max));
        }
    }
    let stat = read_proc(&format!("/proc/{pid}/stat"))?;
    // Fields after the ")" that closes comm; field 3 (state) is index 0.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = rest.split_whitespace().map(|v| v.parse().unwrap_or(0)).collect();
    let at = |n: usize| f.get(n - 3).copied().unwrap_or(0); // n = field number from proc(5)
    let mm = MmFields {
        start_code: at(26), end_code: at(27), start_stack: at(28),
        start_data: at(45), end_data: at(46), start_brk: at(47), brk: record.brk,
        arg_start: at(48), arg_end: at(49), env_start: at(50), env_end: at(51),
    };
    Ok(ProcessState { cwd, umask, rlimits, uid, gid, mm })
}
