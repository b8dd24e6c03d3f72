//! Builds the real restorer (`src/restorer.rs`): a `no_std`, `no_main`,
//! static, libc-free executable. Cargo cannot build it as an ordinary bin
//! target on stable Rust because a `no_std` binary needs `panic = "abort"`,
//! which only the workspace root profile could set. So we invoke `rustc`
//! directly (the same compiler cargo uses) and embed the result in the
//! library (`RESTORER_ELF`).
//!
//! Link layout: PIC code (so no 32-bit absolute relocations) linked as a
//! static non-PIE executable at `abi::RESTORER_BASE`, far from where Linux
//! places PIE executables (0x55…/0x56…), non-PIE ones (0x400000), the mmap
//! area and stacks (0x7f…). Its address is therefore fixed and known before
//! restore; the restorer checks it against every region and refuses on
//! collision, and a capture leaves a previous restorer's pages there out.

// The abi layer below is shared with the image library, where `feature = "std"` adds serde; this
// build script has no such feature (cfg checking of early-expanded `mod` items ignores an outer allow).
#![allow(unexpected_cfgs)]

use std::path::PathBuf;
use std::process::Command;

#[path = "../image/src/abi/mod.rs"]
// The abi layer is shared with the library (`feature = "std"` adds serde there).
#[allow(dead_code)]
mod abi;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let src = manifest.join("src/restorer.rs");
    // The image's abi layer (compiled in here) keeps its serde derives behind the image crate's
    // `std` feature, which this crate does not have: declare the name so the cfg is checked, not unknown.
    println!("cargo::rustc-check-cfg=cfg(feature, values(\"std\"))");
    println!("cargo:rerun-if-changed={}", src.display());
    println!("cargo:rerun-if-changed={}", manifest.join("../image/src/abi").display());
    let bin = out.join("starling-restorer-static");
    let status = Command::new(&rustc)
        .args(["--edition", "2021", "--crate-type", "bin", "--crate-name", "starling_restorer_static"])
        .args(["-C", "panic=abort", "-C", "opt-level=2", "-C", "debuginfo=0", "-C", "relocation-model=pic"])
        .args(["-C", "target-cpu=x86-64", "-C", "codegen-units=1", "-C", "strip=symbols"])
        .args(["-C", "link-arg=-nostartfiles", "-C", "link-arg=-nostdlib", "-C", "link-arg=-static",
               "-C", "link-arg=-no-pie", "-C", "link-arg=-Wl,--build-id=none"])
        .arg("-C").arg(format!("link-arg=-Wl,--image-base={:#x}", abi::RESTORER_BASE))
        .arg("-o").arg(&bin)
        .arg(&src)
        .status()
        .expect("run rustc for the restorer");
    assert!(status.success(), "building the static restorer failed");
    println!("cargo:rustc-env=STARLING_RESTORER_ELF={}", bin.display());
}
