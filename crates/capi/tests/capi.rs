//! Builds C programs against `libstarling.so` with `include/starling.h`
//! and runs them: a partitioned computation and sf_kill/error reporting.

use std::path::{Path, PathBuf};
use std::process::Command;

fn target_profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf()
}

fn build_and_run(name: &str, args: &[&str]) -> String {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let libdir = target_profile_dir();
    assert!(libdir.join("libstarling.so").exists(), "libstarling.so missing");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("capi-bin-{name}"));
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-I"])
        .arg(manifest.join("../../include"))
        .arg(manifest.join(format!("tests/c/{name}.c")))
        .arg("-L").arg(&libdir)
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .args(["-lstarling", "-o"])
        .arg(&out)
        .status()
        .expect("cc");
    assert!(status.success());
    let o = Command::new(&out).args(args).env("STARLING_FORK_BACKEND", "local").output().expect("run");
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    println!("{stdout}{}", String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{name}: {:?}", o.status);
    stdout
}

#[test]
fn partitioned_sum_through_result_files() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("capi-partition");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let out = build_and_run("partition", &[dir.to_str().unwrap()]);
    assert!(out.contains("clones=3"), "{out}");
}

#[test]
fn kill_and_errors() {
    let out = build_and_run("kill", &[]);
    assert!(out.contains("killed"));
}
