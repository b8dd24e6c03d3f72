//! The CLI reads its settings at the edge: `--config FILE`, then the
//! environment, then flags. These need no cluster: they point the client at
//! a port nobody listens on, or give a bad value, and check what the user is
//! told.

use std::process::Command;

fn starling() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_starling"));
    // Nothing from the caller's environment or /etc may decide the outcome:
    // an empty config file stands in for /etc/starling/config.toml.
    c.env_clear().env("PATH", "/usr/bin:/bin").env("STARLING_CONFIG", "/dev/null");
    c
}

fn config_file(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("starling-cli-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A local port with nobody listening (bound, then closed).
fn dead_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn the_config_file_names_the_cluster_and_a_flag_overrides_it() {
    let (a, b) = (dead_port(), dead_port());
    let file = config_file("cluster.toml", &format!("[client]\ncluster = \"127.0.0.1:{a}\"\n"));
    let out = starling().arg("--config").arg(&file).args(["status"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(255), "{err}");
    assert!(err.contains(&format!("cannot reach the starling cluster at 127.0.0.1:{a}")), "{err}");

    let out = starling().arg("--config").arg(&file).args(["status", "--cluster", &format!("127.0.0.1:{b}")]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("at 127.0.0.1:{b}")), "the flag wins: {err}");

    let out = starling().env("STARLING_CLUSTER", format!("127.0.0.1:{b}")).arg("--config").arg(&file).arg("status").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("at 127.0.0.1:{b}")), "the environment wins over the file: {err}");
}

#[test]
fn bad_settings_are_refused_with_where_they_came_from() {
    let out = starling().env("STARLING_MCDIST", "sometimes").arg("status").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(255), "{err}");
    assert!(err.contains("STARLING_MCDIST") && err.contains("off, on or push"), "{err}");

    let file = config_file("typo.toml", "[agent]\ncache_mb = 5\n");
    let out = starling().arg("--config").arg(&file).arg("status").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("agent.cache_mb") && err.contains("typo.toml"), "{err}");

    let out = starling().arg("--config").arg("/nonexistent/starling.toml").arg("status").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/starling.toml"), "a named file must exist: {err}");
    assert_eq!(err.matches("No such file").count(), 1, "the cause once: {err}");
}
