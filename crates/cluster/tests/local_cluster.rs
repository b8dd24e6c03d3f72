//! End-to-end tests of the emulated cluster (need root, iproute2 and nsenter: they fail without them
//! unless STARLING_TEST_ALLOW_SKIP=1, see tests/require.rs).
//!
//! This binary has its own `main` (harness = false) because it doubles as the `starling` executable `up`
//! starts: `head` (a TCP listener standing in for the real head), `__host-boot` (the real boot code) and a
//! few probes run inside hosts. Hosts run `sleep infinity` instead of the agent. The tests use their own
//! bridge, namespace and veth names, subnet, and state/run directories, so they never touch a real cluster.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

#[path = "../../../tests/require.rs"]
mod require;

use starling_cluster::{
    down_with, host_dir, load_state, procs, up_with, ClusterState, NetConfig, UpOptions, UpOverrides, HOST_STATE_MOUNT,
};

const MCAST_GROUP: Ipv4Addr = Ipv4Addr::new(239, 77, 7, 7);
const MCAST_PORT: u16 = 17077;
const PROBE_PORT: u16 = 17078;

fn test_net() -> NetConfig {
    NetConfig {
        bridge: "sttbr0".into(),
        netns_prefix: "stt-".into(),
        veth_prefix: "sttv-".into(),
        subnet: Ipv4Addr::new(10, 219, 0, 0),
    }
}

struct Dirs {
    base: PathBuf,
    state: PathBuf,
    run: PathBuf,
}

fn dirs(tag: &str) -> Dirs {
    let base = PathBuf::from(format!("/tmp/starling-cluster-test-{tag}-{}", std::process::id()));
    Dirs { state: base.join("state"), run: base.join("run"), base }
}

fn options(d: &Dirs, hosts: usize) -> UpOptions {
    UpOptions {
        hosts,
        exe: std::env::current_exe().unwrap(),
        state_dir: d.state.clone(),
        run_dir: d.run.clone(),
        head_args: vec!["--test-extra-arg".into()],
        agent_args: Vec::new(),
        link: None,
        insecure: false,
        host_link: None,
        mtu: starling_cluster::DEFAULT_MTU,
    }
}

fn sleeping_hosts() -> UpOverrides {
    UpOverrides { net: test_net(), host_command: Some(vec!["sleep".into(), "infinity".into()]), ..Default::default() }
}

/// `up` of the tests' cluster, whose hosts run `sleep infinity`.
fn up(opts: &UpOptions) -> starling_cluster::Result<ClusterState> {
    up_with(opts, &sleeping_hosts())
}

/// `nsenter` into host `pid`'s mount, UTS and network namespaces and run `cmd`; returns (success, stdout).
fn in_host(pid: u32, cmd: &[&str]) -> (bool, String) {
    let out = Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-m", "-u", "-n", "--"])
        .args(cmd)
        .output()
        .expect("nsenter");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// (mount point, file system type) of every mount host `pid` sees, as it sees them.
fn mount_types(pid: u32) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let point = line.split(' ').nth(4)?;
            let fstype = line.split(" - ").nth(1)?.split(' ').next()?;
            Some((point.to_string(), fstype.to_string()))
        })
        .collect()
}

fn me() -> String {
    std::env::current_exe().unwrap().display().to_string()
}

/// Everything the tests' cluster could leave behind; empty means clean.
fn leftovers(d: &Dirs, cfg: &NetConfig) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/run/netns").into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(&cfg.netns_prefix) {
            found.push(format!("netns {name}"));
        }
    }
    for entry in std::fs::read_dir("/sys/class/net").into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == cfg.bridge || name.starts_with(&cfg.veth_prefix) {
            found.push(format!("link {name}"));
        }
    }
    // Mounts under our hosts' dirs in ANY mount namespace (a surviving host namespace would show here).
    let hosts_dir = d.state.join("hosts");
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let mi = entry.path().join("mountinfo");
        for m in starling_cluster::mounts::mount_points(&mi) {
            if m.starts_with(&hosts_dir) {
                found.push(format!("mount {} in {}", m.display(), mi.display()));
            }
        }
    }
    let base = d.base.display().to_string();
    for p in procs::scan() {
        if p.argv.iter().any(|a| a.contains(&base)) {
            found.push(format!("process {} {:?}", p.pid, p.argv));
        }
    }
    found
}

fn check(ok: bool, what: &str, failures: &mut Vec<String>) {
    if ok {
        println!("  ok: {what}");
    } else {
        println!("  FAILED: {what}");
        failures.push(what.to_string());
    }
}

fn assert_clean(d: &Dirs, failures: &mut Vec<String>) {
    let left = leftovers(d, &test_net());
    check(left.is_empty(), &format!("nothing left behind {left:?}"), failures);
}

/// Up with 3 hosts, check each host's identity and isolation, connectivity and multicast, refuse a second up,
/// kill -9 one host, down, check nothing is left and the persistent cache survived.
fn test_lifecycle(f: &mut Vec<String>) {
    let d = dirs("life");
    let cfg = test_net();
    let state: ClusterState = match up(&options(&d, 3)) {
        Ok(s) => s,
        Err(e) => {
            check(false, &format!("up: {e:#}"), f);
            return;
        }
    };
    check(state.hosts.len() == 3, "three hosts recorded", f);
    check(state.head_addr == "10.219.0.1:7077", &format!("head address {}", state.head_addr), f);
    let loaded = load_state(&d.run);
    check(loaded.is_some_and(|l| l.head_pid == state.head_pid), "load_state finds the running cluster", f);
    let head_cmd = procs::cmdline(state.head_pid);
    check(
        head_cmd.iter().any(|a| a == "--test-extra-arg") && head_cmd.get(1).is_some_and(|r| r == "head"),
        &format!("head runs `exe head ... HEAD_ARGS` {head_cmd:?}"),
        f,
    );

    let second = up(&options(&d, 1));
    check(
        second.as_ref().is_err_and(|e| format!("{e}").contains("already running")),
        "second up refuses while a cluster runs",
        f,
    );

    for (i, h) in state.hosts.iter().enumerate() {
        let pid = h.boot_pid;
        check(
            procs::cmdline(pid) == ["sleep", "infinity"],
            &format!("{}: boot pid {pid} became the host command", h.name),
            f,
        );
        let (_, hostname) = in_host(pid, &["hostname"]);
        check(hostname == h.name, &format!("{}: hostname is {hostname:?}", h.name), f);
        let (_, addrs) = in_host(pid, &["ip", "-4", "-o", "addr", "show", "dev", "eth0"]);
        check(addrs.contains(&format!("{}/24", h.ip)), &format!("{}: eth0 has {}", h.name, h.ip), f);
        let (_, link) = in_host(pid, &["ip", "-o", "link", "show", "dev", "eth0"]);
        check(link.contains(" mtu 9000 "), &format!("{}: eth0 has MTU 9000: {link}", h.name), f);
        check(h.ip == cfg.host_ip(i + 1).to_string(), &format!("{}: ip {} follows the plan", h.name, h.ip), f);
        let (ok, _) = in_host(pid, &[&me(), "__probe-connect", &state.head_addr]);
        check(ok, &format!("{}: reaches the head at {}", h.name, state.head_addr), f);

        // /tmp is the host's own: planted through /proc/PID/root, visible inside, invisible on the machine.
        let marker = format!("starling-cluster-test-{}-{}", std::process::id(), h.name);
        let planted = std::fs::write(format!("/proc/{pid}/root/tmp/{marker}"), h.name.as_bytes()).is_ok();
        check(planted, &format!("{}: plant a file in the host's /tmp", h.name), f);
        check(!Path::new("/tmp").join(&marker).exists(), &format!("{}: the machine's /tmp does not see it", h.name), f);
        let (_, seen) = in_host(pid, &["cat", &format!("/tmp/{marker}")]);
        check(seen == h.name, &format!("{}: the host's /tmp has it", h.name), f);

        // ... and the machine's /tmp files are not in the host's.
        let machine_file = Path::new("/tmp").join(format!("{marker}-machine"));
        let _ = std::fs::write(&machine_file, b"machine");
        let leaked = Path::new(&format!("/proc/{pid}/root/tmp/{marker}-machine")).exists();
        let _ = std::fs::remove_file(&machine_file);
        check(!leaked, &format!("{}: the machine's /tmp is not visible in the host", h.name), f);
        let fs_types = mount_types(pid);
        for (point, fstype) in [
            ("/", "overlay"),
            ("/proc", "proc"),
            ("/sys", "sysfs"),
            ("/tmp", "tmpfs"),
            ("/run", "tmpfs"),
            ("/dev/shm", "tmpfs"),
            (HOST_STATE_MOUNT, "ext4"),
        ] {
            let found = fs_types.iter().any(|(p, t)| p == point && t == fstype);
            check(found, &format!("{}: {point} is {fstype}", h.name), f);
        }
        let machine_has_cgroups = mount_types(std::process::id()).iter().any(|(p, _)| p == "/sys/fs/cgroup");
        if machine_has_cgroups {
            check(fs_types.iter().any(|(p, _)| p == "/sys/fs/cgroup"), &format!("{}: sees /sys/fs/cgroup", h.name), f);
        }

        // Root overlay writes stay in the host; the state dir is the persistent ext4 one.
        let etc_marker = format!("/proc/{pid}/root/etc/{marker}");
        check(std::fs::write(&etc_marker, b"x").is_ok(), &format!("{}: root is writable", h.name), f);
        check(!Path::new("/etc").join(&marker).exists(), &format!("{}: root writes stay private", h.name), f);
        let cache = format!("/proc/{pid}/root{HOST_STATE_MOUNT}/cache-marker");
        check(std::fs::write(&cache, h.name.as_bytes()).is_ok(), &format!("{}: write to the state dir", h.name), f);
        let persistent = host_dir(&d.state, &h.name).join("state/cache-marker");
        check(persistent.exists(), &format!("{}: state dir is STATE/hosts/{}/state", h.name, h.name), f);
    }

    // Host to host: TCP h2 -> h1, multicast h1 -> h2 and h3. Each probe that waits says on stdout
    // when it is ready (listening, joined) before the other side starts.
    let (h1, h2, h3) = (&state.hosts[0], &state.hosts[1], &state.hosts[2]);
    let listener = spawn_ready(h1.boot_pid, "__probe-accept", "listening", f);
    let (ok, _) = in_host(h2.boot_pid, &[&me(), "__probe-connect", &format!("{}:{PROBE_PORT}", h1.ip)]);
    check(ok, "h2 reaches h1 over TCP", f);
    if let Some(listener) = listener {
        wait_child(listener, "h1 accepted the connection", f);
    }

    let mut receivers = Vec::new();
    for h in [h2, h3] {
        receivers.push((spawn_ready(h.boot_pid, "__probe-mcast-recv", "joined", f), h));
    }
    let (ok, _) = in_host(h1.boot_pid, &[&me(), "__probe-mcast-send"]);
    check(ok, "h1 sends multicast", f);
    for (r, h) in receivers {
        if let Some(r) = r {
            wait_child(r, &format!("{} received h1's multicast", h.name), f);
        }
    }

    // Crash one host, then tear down.
    let victim = h2.boot_pid;
    let _ = Command::new("kill").args(["-9", &victim.to_string()]).status();
    // Names that match nothing: down must take the real ones from cluster.json (and must not touch a real
    // cluster's default names on this machine).
    let unrelated = NetConfig {
        bridge: "sttnone0".into(),
        netns_prefix: "sttnone-".into(),
        veth_prefix: "sttnv-".into(),
        subnet: Ipv4Addr::new(10, 218, 0, 0),
    };
    let removed = down_with(&d.run, &d.state, &unrelated);
    check(removed.is_ok(), &format!("down after kill -9 of one host: {removed:?}"), f);
    let removed = removed.unwrap_or_default();
    check(
        removed.iter().any(|r| r.contains("deleted bridge sttbr0")),
        "down names the bridge (found via cluster.json)",
        f,
    );
    check(!d.run.join("cluster.json").exists(), "cluster.json removed", f);
    check(load_state(&d.run).is_none(), "load_state: no cluster after down", f);
    for h in &state.hosts {
        check(!procs::is_alive(h.boot_pid), &format!("{} (pid {}) is dead", h.name, h.boot_pid), f);
    }
    check(!procs::is_alive(state.head_pid), "head is dead", f);
    assert_clean(&d, f);
    check(host_dir(&d.state, "h1").join("state/cache-marker").exists(), "persistent cache survives down", f);
    let again = down_with(&d.run, &d.state, &cfg);
    check(again.as_ref().is_ok_and(|r| r.is_empty()), &format!("down is idempotent: {again:?}"), f);

    // The cache is there again after the next up.
    match up(&options(&d, 1)) {
        Ok(s) => {
            let cache = format!("/proc/{}/root{HOST_STATE_MOUNT}/cache-marker", s.hosts[0].boot_pid);
            check(std::fs::read(&cache).is_ok_and(|c| c == b"h1"), "cache visible in h1 after re-up", f);
        }
        Err(e) => check(false, &format!("re-up: {e:#}"), f),
    }
    check(down_with(&d.run, &d.state, &cfg).is_ok(), "second down", f);
    assert_clean(&d, f);
    let _ = std::fs::remove_dir_all(&d.base);
}

/// A crash that also lost cluster.json and killed the head: down still finds everything by name.
fn test_down_without_record(f: &mut Vec<String>) {
    let d = dirs("norecord");
    let cfg = test_net();
    let state = match up(&options(&d, 2)) {
        Ok(s) => s,
        Err(e) => return check(false, &format!("up: {e:#}"), f),
    };
    let _ = Command::new("kill").args(["-9", &state.head_pid.to_string()]).status();
    let _ = std::fs::remove_file(d.run.join("cluster.json"));
    check(wait_until(|| !procs::is_alive(state.head_pid)), "the head died of kill -9", f);
    check(load_state(&d.run).is_none(), "no running cluster without the record", f);
    let refused = up(&options(&d, 1));
    check(refused.as_ref().is_err_and(|e| format!("{e}").contains("leftovers")), "up refuses while leftovers exist", f);
    let removed = down_with(&d.run, &d.state, &cfg);
    check(removed.is_ok(), &format!("down without cluster.json: {removed:?}"), f);
    for h in &state.hosts {
        check(!procs::is_alive(h.boot_pid), &format!("{} (pid {}) is dead", h.name, h.boot_pid), f);
    }
    assert_clean(&d, f);
    let _ = std::fs::remove_dir_all(&d.base);
}

/// A head that cannot start makes up fail with its log, leaving nothing behind.
fn test_failed_up_cleans_up(f: &mut Vec<String>) {
    let d = dirs("fail");
    let mut opts = options(&d, 2);
    opts.exe = PathBuf::from("/bin/false");
    let result = up(&opts);
    let message = result.as_ref().err().map(|e| format!("{e:#}")).unwrap_or_default();
    check(message.contains("exited before listening"), &format!("up fails: {message}"), f);
    assert_clean(&d, f);
    let _ = std::fs::remove_dir_all(&d.base);
}

/// Without an override a host execs `exe agent --head ADDR --name NAME --state HOST_STATE_MOUNT --cache-mib N
/// --cgroup NETNS --owner emulated --auth=HOST_STATE_MOUNT/auth` in its own root (its guest cgroup named after
/// its network namespace, its owner the emulated one that `starling owner` drives, its credentials the copy
/// `up` gave the host).
fn test_default_agent_command(f: &mut Vec<String>) {
    let d = dirs("agent");
    let overrides = UpOverrides { host_command: None, ..sleeping_hosts() };
    match up_with(&options(&d, 1), &overrides) {
        Ok(s) => {
            let pid = s.hosts[0].boot_pid;
            let exe = me();
            let expected =
                [exe.as_str(), "agent", "--head", "10.219.0.1:7077", "--name", "h1", "--state", HOST_STATE_MOUNT];
            let argv = procs::cmdline(pid);
            // Then the cache bound `up` chose for the machine's free disk (256..=8192 MiB), then the host's
            // guest cgroup (its network namespace's name), the emulated owner and the host's credentials.
            let auth = format!("--auth={HOST_STATE_MOUNT}/auth");
            let cache_ok = argv.len() == expected.len() + 7
                && argv[expected.len()] == "--cache-mib"
                && argv[expected.len() + 1].parse::<u64>().is_ok_and(|m| (256..=8192).contains(&m))
                && argv[expected.len() + 2..] == ["--cgroup", "stt-h1", "--owner", "emulated", auth.as_str()];
            check(argv[..expected.len().min(argv.len())] == expected && cache_ok, &format!("agent command line {argv:?}"), f);
            let (_, hostname) = in_host(pid, &["hostname"]);
            check(hostname == "h1", "the agent runs in host h1", f);
        }
        Err(e) => check(false, &format!("up: {e:#}"), f),
    }
    let removed = down_with(&d.run, &d.state, &test_net());
    check(removed.as_ref().is_ok_and(|r| r.iter().any(|l| l.contains(" agent --head"))), "down kills the agent", f);
    assert_clean(&d, f);
    let _ = std::fs::remove_dir_all(&d.base);
}

/// A host whose boot fails (here: its command cannot be exec'd) makes up fail with the host's log, and up
/// removes everything it had made, including the running head and the other hosts.
fn test_failed_boot_cleans_up(f: &mut Vec<String>) {
    let d = dirs("bootfail");
    let overrides =
        UpOverrides { host_command: Some(vec!["/nonexistent/starling-test-program".into()]), ..sleeping_hosts() };
    let message = up_with(&options(&d, 2), &overrides).err().map(|e| format!("{e:#}")).unwrap_or_default();
    check(
        message.contains("did not boot") && message.contains("/nonexistent/starling-test-program"),
        &format!("up fails with the host's log: {message}"),
        f,
    );
    check(load_state(&d.run).is_none(), "no cluster recorded", f);
    assert_clean(&d, f);
    let _ = std::fs::remove_dir_all(&d.base);
}

/// Generous deadline of every wait here: it only bounds a hang (a 4x slower machine needs far less).
const HANG: Duration = Duration::from_secs(120);

/// Poll `done` until it holds or HANG passes; whether it held.
fn wait_until(mut done: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while !done() {
        if t0.elapsed() > HANG {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// Start probe `role` in host `pid` and return it once it printed `ready` (it is then listening or
/// joined), or record a failure and return None.
fn spawn_ready(pid: u32, role: &str, ready: &str, f: &mut Vec<String>) -> Option<Child> {
    let mut child = Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-m", "-u", "-n", "--", &me(), role])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn probe");
    let mut line = String::new();
    // The probe exits (closing stdout) if it cannot get ready, so this read cannot hang.
    let _ = BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line);
    if line.trim() == ready {
        Some(child)
    } else {
        let _ = child.kill();
        let _ = child.wait();
        check(false, &format!("{role} in pid {pid}'s host got ready (said {line:?})"), f);
        None
    }
}

fn wait_child(mut child: Child, what: &str, f: &mut Vec<String>) {
    let mut status = None;
    let ended = wait_until(|| {
        status = child.try_wait().ok().flatten();
        status.is_some()
    });
    if ended {
        return check(status.is_some_and(|s| s.success()), what, f);
    }
    let _ = child.kill();
    let _ = child.wait();
    check(false, &format!("{what} (no end within {HANG:?})"), f);
}

/// Roles this binary plays when started by `up` or by a test inside a host.
fn role(args: &[String]) -> Option<ExitCode> {
    let ok = |b: bool| Some(if b { ExitCode::SUCCESS } else { ExitCode::FAILURE });
    match args.get(1).map(String::as_str)? {
        "head" => {
            let addr = args.iter().position(|a| a == "--listen").and_then(|i| args.get(i + 1))?;
            let listener = TcpListener::bind(addr.as_str()).expect("bind head address");
            for conn in listener.incoming() {
                drop(conn);
            }
            ok(true)
        }
        "agent" => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
        "__host-boot" => starling_cluster::host_boot_main(&args[2..]),
        // A probe that cannot set up fails (it must never fall through to the tests below).
        "__probe-connect" => ok(args
            .get(2)
            .and_then(|a| a.parse().ok())
            .is_some_and(|addr| TcpStream::connect_timeout(&addr, Duration::from_secs(30)).is_ok())),
        "__probe-accept" => ok(TcpListener::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, PROBE_PORT)).is_ok_and(|l| {
            println!("listening");
            l.accept().is_ok()
        })),
        "__probe-mcast-recv" => {
            let joined = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, MCAST_PORT)).ok().filter(|sock| {
                sock.join_multicast_v4(&MCAST_GROUP, &Ipv4Addr::UNSPECIFIED).is_ok()
                    && sock.set_read_timeout(Some(Duration::from_secs(60))).is_ok()
            });
            ok(joined.is_some_and(|sock| {
                println!("joined");
                let mut buf = [0u8; 64];
                sock.recv(&mut buf).is_ok_and(|n| &buf[..n] == b"starling-mcast")
            }))
        }
        "__probe-mcast-send" => {
            // The receivers have joined; several sends in case one datagram is lost.
            ok(UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)).is_ok_and(|sock| {
                (0..10).all(|_| {
                    std::thread::sleep(Duration::from_millis(100));
                    sock.send_to(b"starling-mcast", SocketAddrV4::new(MCAST_GROUP, MCAST_PORT)).is_ok()
                })
            }))
        }
        _ => None,
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if let Some(code) = role(&args) {
        return code;
    }
    if !(require::root("the emulated cluster (namespaces, mounts, bridge)")
        && require::tool("nsenter", "--version", "util-linux")
        && require::tool("ip", "-V", "iproute2"))
    {
        return ExitCode::SUCCESS;
    }
    // Whatever an earlier, interrupted run of these tests left (found by the tests' names).
    let stale = dirs("stale");
    let _ = down_with(&stale.run, &stale.state, &test_net());
    let _ = std::fs::remove_dir_all(&stale.base);
    let mut failures = Vec::new();
    type Test = fn(&mut Vec<String>);
    let tests: [(&str, Test); 5] = [
        ("failed_up_cleans_up", test_failed_up_cleans_up),
        ("failed_boot_cleans_up", test_failed_boot_cleans_up),
        ("default_agent_command", test_default_agent_command),
        ("lifecycle", test_lifecycle),
        ("down_without_record", test_down_without_record),
    ];
    for (name, test) in tests {
        println!("test {name}");
        test(&mut failures);
    }
    if failures.is_empty() {
        println!("local_cluster: all checks passed");
        ExitCode::SUCCESS
    } else {
        println!("local_cluster: {} failed: {failures:#?}", failures.len());
        ExitCode::FAILURE
    }
}
