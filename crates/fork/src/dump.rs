//! Dump: read a frozen process from outside into the process image.
//!
//! [`dump`] reads a frozen template (`/proc/PID/smaps`, `pagemap`,
//! `fd`/`fdinfo`, `stat`, `status`, `prlimit`) and combines it with the
//! [`TemplateRecord`] the template wrote about itself. The pieces that read
//! `/proc` ([`dump_regions`], [`dump_fds`], [`dump_process`]) are public:
//! live migration's capture reads any process with them, and its threads
//! with ptrace.
//!
//! State that cannot follow is refused with an error naming the mapping:
//! mappings of deleted files, device and I/O mappings, hugetlb, mappings
//! already registered with a userfaultfd, files replaced since they were
//! mapped. Regions inside the restorer's reserved window are a previous
//! restorer's, not the program's, and are left out.

use crate::template::TemplateRecord;
use crate::{ForkError, Result, PAGE_SIZE};
use starling_image::abi::process::{Creds, MmLayout, ProcessCore, Rlimit, N_RLIMITS};
use starling_image::abi::in_restorer_window;
use starling_image::{
    Descriptor, FdEntry, FdKind, PageClass, PageRuns, ProcessState, Region, RegionKind, ThreadState,
    DESCRIPTOR_VERSION,
};
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt};

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
/// A write-protect marker (or a write-protected page) of a userfaultfd.
const PM_UFFD_WP: u64 = 1 << 57;

/// How [`dump_regions`] classifies pages.
#[derive(Debug, Clone, Copy)]
pub struct RegionOptions {
    /// Fetch-avoidance heuristics (setting `fork.heuristics`, default on).
    /// Off, every readable page of a private mapping is classified `Fetch`:
    /// nothing is zero-filled locally or read from the host's file copy, so
    /// every page a clone touches comes from the page server (SnowFlock's
    /// "no heuristics" runs, for benchmarks).
    pub heuristics: bool,
    /// The stack pointer of the thread that runs on `[stack]`: its pages
    /// wholly below it (and the red zone) are dead, so zero. Ignored when it
    /// points elsewhere (a thread on a signal stack).
    pub stack_pointer: u64,
    /// Refuse a mapped file whose inode differs from the mapping's: on the
    /// client the file must still be the one mapped. A migration reads a
    /// task's files through its overlay, whose inode numbers are not the
    /// mapped (underlying) file's; the target gets the same file from the
    /// same view binding instead.
    pub check_inode: bool,
    /// The process is write-tracked by a userfaultfd of ours (migration):
    /// `uw` regions are allowed, and the write-protect markers of pages never
    /// populated (which `pagemap` reports as swap entries) are not pages.
    pub own_write_tracking: bool,
}

/// Dump a frozen template into a descriptor (`heuristics`: see [`RegionOptions`]).
pub fn dump(pid: i32, record: &TemplateRecord, heuristics: bool) -> Result<Descriptor> {
    let opts = RegionOptions { heuristics, stack_pointer: record.thread.regs.rsp, check_inode: true, own_write_tracking: false };
    let mut thread = record.thread;
    thread.tid = u64::try_from(pid).map_err(|_| ForkError::Malformed { what: "template pid", detail: pid.to_string() })?;
    let (core, cwd, groups) = dump_process(pid, record.brk)?;
    let d = Descriptor {
        version: DESCRIPTOR_VERSION,
        regions: dump_regions(pid, opts)?,
        fds: dump_fds(pid, i32::try_from(record.freeze_fd).map_err(|_| ForkError::Malformed { what: "template freeze fd", detail: record.freeze_fd.to_string() })?)?,
        threads: vec![ThreadState { core: thread, fpu: record.fpu.0.to_vec(), pending: vec![] }],
        sigactions: record.sigactions,
        process: ProcessState { core: ProcessCore { pid: thread.tid, ..core }, cwd, groups, pending: vec![], exe: String::new(), auxv: vec![] },
        descendants: Vec::new(),
        pipes: Vec::new(),
    };
    d.validate()?;
    Ok(d)
}

/// The memory of process `pid` (frozen or not: pages are classified by
/// `pagemap` as it is now), every page classified.
pub fn dump_regions(pid: i32, opts: RegionOptions) -> Result<Vec<Region>> {
    regions_of(pid, &Layout::read(pid)?, opts)
}

/// The mappings of a process with their `VmFlags`, as `/proc/PID/smaps`
/// lists them. Reading `smaps` walks every page table of the process (it
/// counts resident pages): its cost grows with the memory, which a live
/// migration must not pay while the process is frozen. So it reads the
/// layout while the process runs and, frozen, only [`Layout::refresh`]es it.
#[derive(Default)]
pub struct Layout(Vec<MapsEntry>);

impl Layout {
    /// The layout now (reads `smaps`).
    pub fn read(pid: i32) -> Result<Layout> {
        Ok(Layout(parse_smaps(&read_proc(&format!("/proc/{pid}/smaps"))?)?))
    }

    /// The layout now, from `/proc/PID/maps` (no page-table walk), each
    /// mapping with the `VmFlags` this layout read for it. The flags the
    /// dump looks at (`io`, `pf`, `ht`, `gd`, a userfaultfd's `um`/`ui`/`uw`)
    /// are fixed when a mapping is made or registered; a mapping that is not
    /// exactly one of this layout's (range, permissions, offset, inode,
    /// name) makes it read `smaps` again.
    pub fn refresh(&self, pid: i32) -> Result<Layout> {
        let mut now = parse_smaps(&read_proc(&format!("/proc/{pid}/maps"))?)?;
        for m in &mut now {
            let known = self.0.binary_search_by_key(&m.start, |k| k.start).ok().map(|i| &self.0[i]);
            match known.filter(|k| (k.end, k.perms, k.offset, k.inode, &k.name) == (m.end, m.perms, m.offset, m.inode, &m.name)) {
                Some(k) => m.vm_flags.clone_from(&k.vm_flags),
                None => return Layout::read(pid),
            }
        }
        Ok(Layout(now))
    }
}

/// [`dump_regions`] with the mappings `layout` lists.
pub fn regions_of(pid: i32, layout: &Layout, opts: RegionOptions) -> Result<Vec<Region>> {
    regions_with(pid, layout, opts, &mut |_| None)
}

/// [`regions_of`], but the page classes of a region for which `known`
/// has them (given the region without its pages) are not read from
/// `pagemap`: reading it walks the region's page tables, which a live
/// migration does while the process runs, not while it is frozen.
pub fn regions_with(pid: i32, layout: &Layout, opts: RegionOptions, known: &mut dyn FnMut(&Region) -> Option<PageRuns>) -> Result<Vec<Region>> {
    let smaps = &layout.0;
    let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap"))
        .map_err(|e| ForkError::io(format!("open /proc/{pid}/pagemap"), e))?;
    let mut regions = Vec::new();
    for m in smaps {
        if m.name == "[vsyscall]" || in_restorer_window(m.start, m.end) {
            continue; // the kernel's, at the same address everywhere / a restorer's leftovers
        }
        let prot = u8::from(m.perms[0] == b'r') | u8::from(m.perms[1] == b'w') << 1 | u8::from(m.perms[2] == b'x') << 2;
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
            _ if has("um") || has("ui") || (has("uw") && !opts.own_write_tracking) => {
                return refuse("already registered with a userfaultfd")
            }
            "/dev/zero (deleted)" | "[anon_shmem]" => RegionKind::SharedAnonymous { name: m.name.clone() },
            n if n.starts_with("/SYSV") => RegionKind::SharedAnonymous { name: m.name.clone() },
            n if n.starts_with('/') => {
                if n.ends_with(" (deleted)") {
                    return refuse("mapping of a deleted file");
                }
                // Through the process's own root: a chrooted process in
                // another mount namespace shows paths relative to it. But a
                // file of an overlay mounted where we see it too (a task's
                // own upper, written by the task) shows our full path to it.
                let meta = std::fs::metadata(format!("/proc/{pid}/root{n}"))
                    .or_else(|e| if e.kind() == std::io::ErrorKind::NotFound { std::fs::metadata(n) } else { Err(e) })
                    .map_err(|e| ForkError::Unclonable { mapping: desc.clone(), reason: format!("stat: {e}") })?;
                if !meta.file_type().is_file() {
                    return refuse("mapping of a device or special file");
                }
                if opts.check_inode && meta.ino() != m.inode {
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
        let mut region = Region { start: m.start, end: m.end, prot, shared, growsdown: has("gd"), kind, pages: PageRuns::default() };
        let known = if special { None } else { known(&region) };
        let (kind, mut pages) = (region.kind.clone(), PageRuns::default());
        if let Some(runs) = known {
            pages = runs;
        } else if special || (shared && matches!(kind, RegionKind::File { .. })) {
            // Supplied by the kernel / by the shared file itself.
            let class = if special { PageClass::Zero } else { PageClass::File };
            (0..npages).for_each(|_| pages.push(class));
        } else {
            let mut raw = vec![0u8; npages * 8];
            pagemap
                .read_exact_at(&mut raw, m.start / PAGE_SIZE * 8)
                .map_err(|e| ForkError::io(format!("read pagemap of {desc}"), e))?;
            let is_file = matches!(kind, RegionKind::File { .. });
            // fork() copies no page table entries of shared mappings: a template's pagemap
            // shows shared anonymous pages as absent even where the parent wrote data. The page
            // server reads them through the shared object, so every readable one is fetched.
            let shared_anonymous = matches!(kind, RegionKind::SharedAnonymous { .. });
            // Pages of the stack wholly below its thread's stack pointer
            // minus the red zone are dead.
            let dead_stack_below = if m.name == "[stack]" && (m.start..m.end).contains(&opts.stack_pointer) {
                opts.stack_pointer.saturating_sub(128) & !(PAGE_SIZE - 1)
            } else {
                0
            };
            for (i, chunk) in raw.chunks_exact(8).enumerate() {
                let e = u64::from_le_bytes(chunk.try_into().expect("8-byte chunk"));
                let addr = m.start + i as u64 * PAGE_SIZE;
                // A write-protect marker on a page never populated is no page.
                let marker = opts.own_write_tracking && e & PM_SWAPPED != 0 && e & PM_UFFD_WP != 0;
                let swapped = e & PM_SWAPPED != 0 && !marker;
                let class = if (!opts.heuristics || shared_anonymous) && prot & 1 != 0 {
                    // Heuristics off: the page server serves every readable page.
                    PageClass::Fetch
                } else if addr + PAGE_SIZE <= dead_stack_below {
                    PageClass::Zero
                } else if swapped || (e & PM_PRESENT != 0 && (e & PM_FILE == 0 || !is_file)) {
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
        region.pages = pages;
        regions.push(region);
    }

    Ok(regions)
}

/// The open descriptors of `pid` (but `skip`), classified.
pub fn dump_fds(pid: i32, skip: i32) -> Result<Vec<FdEntry>> {
    let dir = format!("/proc/{pid}/fd");
    let mut fds: Vec<i32> = std::fs::read_dir(&dir)
        .map_err(|e| ForkError::io(format!("list {dir}"), e))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd != skip)
        .collect();
    fds.sort_unstable();
    // The files stdout and stderr write to, when they are regular files
    // opened for writing (`prog > log`): every descriptor of such a file is
    // a stream (see `FdKind::Stream`).
    let written_file = |fd: i32| -> Option<(u64, u64)> {
        let info = read_proc(&format!("/proc/{pid}/fdinfo/{fd}")).ok()?;
        let flags = info.lines().find_map(|l| l.strip_prefix("flags:")).and_then(|v| u32::from_str_radix(v.trim(), 8).ok())?;
        if flags & libc::O_ACCMODE as u32 == libc::O_RDONLY as u32 {
            return None;
        }
        let m = std::fs::metadata(format!("{dir}/{fd}")).ok()?;
        m.file_type().is_file().then(|| (m.dev(), m.ino()))
    };
    let std_files: Vec<(i32, (u64, u64))> = [1, 2].into_iter().filter_map(|fd| Some((fd, written_file(fd)?))).collect();
    let mut out = Vec::new();
    for fd in fds {
        let link = format!("{dir}/{fd}");
        let Ok(target) = std::fs::read_link(&link) else { continue }; // closed meanwhile
        let target = target.to_string_lossy().into_owned();
        let info = read_proc(&format!("/proc/{pid}/fdinfo/{fd}")).unwrap_or_default();
        let field = |name: &str| info.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
        let flags = field("flags:").and_then(|v| u32::from_str_radix(v, 8).ok()).unwrap_or(0);
        let pos = field("pos:").and_then(|v| v.parse().ok()).unwrap_or(0);
        let writes = flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32;
        let kind = if target.starts_with('/') && !target.ends_with(" (deleted)") {
            match std::fs::metadata(&link) {
                Ok(m) if m.file_type().is_file() && writes && std_files.iter().any(|(_, f)| *f == (m.dev(), m.ino())) => {
                    // fd 1 and 2 stream to themselves; another descriptor of
                    // the same file to the first of them that writes it.
                    let of = if fd == 1 || fd == 2 { fd } else { std_files.iter().find(|(_, f)| *f == (m.dev(), m.ino())).map_or(1, |(s, _)| *s) };
                    FdKind::Stream { of }
                }
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

/// Process-wide state of `pid` from `/proc`: (core, cwd, supplementary
/// groups). `brk` is the current break (only the process itself knows it
/// exactly; `stat` has where it started).
pub fn dump_process(pid: i32, brk: u64) -> Result<(ProcessCore, String, Vec<u32>)> {
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd"))
        .map_err(|e| ForkError::io(format!("read /proc/{pid}/cwd"), e))?
        .to_string_lossy()
        .into_owned();
    let status = read_proc(&format!("/proc/{pid}/status"))?;
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim).unwrap_or("");
    let umask = u64::from_str_radix(field("Umask:"), 8).unwrap_or(0o022);
    // "Uid:" real effective saved fs
    let ids = |name: &str| -> [u64; 3] {
        let v: Vec<u64> = field(name).split_whitespace().filter_map(|x| x.parse().ok()).collect();
        [v.first().copied().unwrap_or(0), v.get(1).copied().unwrap_or(0), v.get(2).copied().unwrap_or(0)]
    };
    let ([ruid, euid, suid], [rgid, egid, sgid]) = (ids("Uid:"), ids("Gid:"));
    let groups = field("Groups:").split_whitespace().filter_map(|g| g.parse().ok()).collect();
    let mut rlimits = [Rlimit::default(); N_RLIMITS];
    for (res, slot) in rlimits.iter_mut().enumerate() {
        let mut lim = libc::rlimit64 { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: prlimit64 with a NULL new limit only writes the old one into `lim`.
        if unsafe { libc::prlimit64(pid, res.try_into().expect("an rlimit index is below N_RLIMITS"), std::ptr::null(), &mut lim) } == 0 {
            *slot = Rlimit { soft: lim.rlim_cur, hard: lim.rlim_max };
        }
    }
    let stat = read_proc(&format!("/proc/{pid}/stat"))?;
    // Fields after the ")" that closes comm; field 3 (state) is index 0.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = rest.split_whitespace().map(|v| v.parse().unwrap_or(0)).collect();
    let at = |n: usize| f.get(n - 3).copied().unwrap_or(0); // n = field number from proc(5)
    let mm = MmLayout {
        start_code: at(26), end_code: at(27), start_stack: at(28),
        start_data: at(45), end_data: at(46), start_brk: at(47), brk,
        arg_start: at(48), arg_end: at(49), env_start: at(50), env_end: at(51),
    };
    let core = ProcessCore {
        pid: 0,
        // The restorer's session and group (a clone's; a migration's
        // capture names the tree's own).
        sid: 0,
        pgid: 0,
        tpgid: 0,
        umask,
        creds: Creds { ruid, euid, suid, rgid, egid, sgid },
        rlimits,
        itimers: Default::default(),
        timers: Default::default(),
        mm,
    };
    Ok((core, cwd, groups))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags_of(l: &Layout, start: u64) -> Option<Vec<String>> {
        l.0.iter().find(|m| m.start == start).map(|m| m.vm_flags.clone())
    }

    #[test]
    fn a_refreshed_layout_has_the_flags_smaps_shows() {
        let pid = i32::try_from(std::process::id()).expect("a pid fits an i32");
        let before = Layout::read(pid).expect("smaps");
        // A mapping made after the layout was read, with a flag only smaps shows (gd).
        let len = 16 * 4096;
        // SAFETY: a fresh anonymous mapping, unmapped below; nothing refers to it.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_GROWSDOWN, -1, 0)
        };
        assert_ne!(p, libc::MAP_FAILED);
        let refreshed = before.refresh(pid).expect("maps");
        // Nothing changed since: the flags are copied, not read again.
        let again = refreshed.refresh(pid).expect("maps");
        let fresh = Layout::read(pid).expect("smaps");
        // SAFETY: unmaps the mapping made above.
        unsafe { libc::munmap(p, len) };
        let new = flags_of(&refreshed, p as u64).expect("the new mapping is listed");
        assert!(new.iter().any(|f| f == "gd"), "{new:?}");
        assert!(!refreshed.0.is_empty());
        for m in refreshed.0.iter().chain(&again.0) {
            // Mappings that other test threads change meanwhile may differ: compare those both saw.
            if let Some(f) = flags_of(&fresh, m.start) {
                assert_eq!(m.vm_flags, f, "mapping at {:#x}", m.start);
            }
        }
    }
}
