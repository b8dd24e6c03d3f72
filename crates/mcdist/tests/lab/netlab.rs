//! A throw-away test network: one bridge, a sender and N receivers, each in
//! its own network namespace (names `mcd-<tag>-*`, subnet 10.231.0.0/24).
//! Used by the tests and the bench; needs root and `ip` (iproute2); loss
//! injection needs `nft`. Dropping the [`Lab`] deletes every namespace,
//! which deletes the veths and the bridge with them — nothing is created in
//! the caller's namespace.
//!
//! Threads enter a namespace with [`enter`] (setns affects only the calling
//! thread; sockets stay in the namespace they were created in).

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::process::Command;

pub struct Lab {
    pub bridge_ns: String,
    pub sender_ns: String,
    pub receiver_ns: Vec<String>,
    pub sender_ip: Ipv4Addr,
    pub receiver_ips: Vec<Ipv4Addr>,
}

fn ip(args: &[&str]) -> std::io::Result<()> {
    run("ip", args)
}

fn run(cmd: &str, args: &[&str]) -> std::io::Result<()> {
    let out = Command::new(cmd).args(args).output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Is `tool` on PATH?
pub fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success())
}

/// Move the calling thread into network namespace `ns`.
pub fn enter(ns: &str) -> std::io::Result<()> {
    let f = std::fs::File::open(format!("/run/netns/{ns}"))?;
    // SAFETY: setns with an fd we hold; affects only this thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Lab {
    /// Build the network. `tag` must be short and unique among concurrent labs.
    pub fn new(tag: &str, receivers: usize) -> std::io::Result<Lab> {
        assert!(receivers <= 200, "one /24");
        let mut lab = Lab {
            bridge_ns: format!("mcd-{tag}-b"),
            sender_ns: format!("mcd-{tag}-s"),
            receiver_ns: (0..receivers).map(|i| format!("mcd-{tag}-r{i}")).collect(),
            sender_ip: Ipv4Addr::new(10, 231, 0, 1),
            receiver_ips: (0..receivers).map(|i| Ipv4Addr::new(10, 231, 0, 10 + u8::try_from(i).expect("a few receivers"))).collect(),
        };
        // Leftovers of an interrupted run with the same tag.
        lab.delete();
        let build = || -> std::io::Result<()> {
            let b = lab.bridge_ns.as_str();
            ip(&["netns", "add", b])?;
            ip(&["-n", b, "link", "set", "lo", "up"])?;
            // No IGMP snooping: the bridge floods the group to every port, so
            // the test does not depend on a querier.
            ip(&["-n", b, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0"])?;
            ip(&["-n", b, "link", "set", "br0", "up"])?;
            let mut ends: Vec<(String, String, Ipv4Addr)> = vec![(lab.sender_ns.clone(), "ps".into(), lab.sender_ip)];
            for (i, ns) in lab.receiver_ns.iter().enumerate() {
                ends.push((ns.clone(), format!("p{i}"), lab.receiver_ips[i]));
            }
            for (ns, port, addr) in &ends {
                ip(&["netns", "add", ns])?;
                ip(&["link", "add", "name", port, "netns", b, "type", "veth", "peer", "name", "eth0", "netns", ns])?;
                ip(&["-n", b, "link", "set", port, "master", "br0", "up"])?;
                ip(&["-n", ns, "link", "set", "lo", "up"])?;
                ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", "eth0"])?;
                ip(&["-n", ns, "link", "set", "eth0", "up"])?;
            }
            Ok(())
        };
        build()?;
        Ok(lab)
    }

    fn delete(&mut self) {
        for ns in std::iter::once(&self.bridge_ns).chain(std::iter::once(&self.sender_ns)).chain(self.receiver_ns.iter()) {
            if std::path::Path::new(&format!("/run/netns/{ns}")).exists() {
                let _ = ip(&["netns", "del", ns]);
            }
        }
    }

    fn nft(&self, script: &str) -> std::io::Result<()> {
        run("ip", &["netns", "exec", &self.bridge_ns, "nft", script])
    }

    fn ensure_table(&self) -> std::io::Result<()> {
        self.nft("add table bridge mcd")?;
        self.nft("add chain bridge mcd mcdfwd { type filter hook forward priority 0 ; }")
    }

    /// Drop `permille`/1000 of the multicast datagrams the bridge forwards
    /// (each receiver's copy independently).
    pub fn inject_loss(&self, permille: u32) -> std::io::Result<()> {
        self.ensure_table()?;
        self.nft(&format!("add rule bridge mcd mcdfwd ip daddr 224.0.0.0/4 numgen random mod 1000 < {permille} counter drop"))
    }

    /// Drop all multicast on the bridge (a network without multicast).
    pub fn block_multicast(&self) -> std::io::Result<()> {
        self.ensure_table()?;
        self.nft("add rule bridge mcd mcdfwd ip daddr 224.0.0.0/4 counter drop")
    }

    /// Remove loss/blocking rules.
    pub fn clear_rules(&self) -> std::io::Result<()> {
        self.nft("delete table bridge mcd")
    }

    /// Bytes the sender's interface transmitted (the kernel's own count).
    pub fn sender_tx_bytes(&self) -> std::io::Result<u64> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.sender_ns, "cat", "/sys/class/net/eth0/statistics/tx_bytes"])
            .output()?;
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .map_err(|e| std::io::Error::other(format!("tx_bytes: {e}")))
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.delete();
    }
}
