//! Stand-in for the `starling` binary in this crate's tests.
//!
//! * `__sandbox-init`: the hidden subcommand, exactly as the agent routes it.
//! * `hold ROOT CMD...`: play a (tiny) agent: start CMD in a sandbox rooted
//!   at ROOT, print the sandbox's pid, then wait forever, so a test can
//!   `kill -9` this "agent" and check that its task dies with it.

use starling_sandbox::{init_main, spawn, SandboxSpec, INIT_SUBCOMMAND};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    match args.get(1).and_then(|a| a.to_str()) {
        Some(INIT_SUBCOMMAND) => init_main(),
        Some("hold") if args.len() >= 4 => hold(PathBuf::from(&args[2]), args[3..].iter().map(|a| a.as_bytes().to_vec()).collect()),
        _ => {
            eprintln!("usage: {} __sandbox-init | hold ROOT CMD...", args[0].to_string_lossy());
            std::process::exit(2)
        }
    }
}

fn hold(root: PathBuf, argv: Vec<Vec<u8>>) {
    let spec = SandboxSpec {
        root,
        argv,
        env: vec![(b"PATH".to_vec(), b"/usr/bin:/bin".to_vec())],
        cwd: b"/".to_vec(),
        umask: 0o022,
        ..Default::default()
    };
    let null = || -> OwnedFd { std::fs::File::options().read(true).write(true).open("/dev/null").expect("open /dev/null").into() };
    let exe = std::env::current_exe().expect("current_exe");
    let sandbox = spawn(&exe, &spec, null(), null(), null()).expect("spawn");
    println!("{}", sandbox.pid());
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
