//! The head's side of an enrolment (`starling agent --join`): the bytes a peer without a certificate
//! sends after the TLS handshake — a length-prefixed JSON request, decoded and checked (token, host
//! name, public key) by `enrol::serve` against a real credentials directory. Whatever the bytes, no
//! host is enrolled (a token's secret is never guessed) and the head answers or closes, never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_auth::AuthDir;
use std::sync::OnceLock;

struct Head {
    _dir: tempfile::TempDir,
    auth: AuthDir,
    rt: tokio::runtime::Runtime,
}

fn head() -> &'static Head {
    static HEAD: OnceLock<Head> = OnceLock::new();
    HEAD.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let auth = AuthDir::new(dir.path().join("auth"));
        auth.init().expect("a cluster CA");
        // A live token, so a request reaches the token check with a real one on file.
        auth.create_token(std::time::Duration::from_secs(3600)).expect("a token");
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("a runtime");
        Head { _dir: dir, auth, rt }
    })
}

fuzz_target!(|data: &[u8]| {
    let h = head();
    let mut peer = tokio::io::join(data, tokio::io::sink());
    let res = h.rt.block_on(starling_auth::enrol::serve(&mut peer, &h.auth));
    assert!(res.is_err(), "enrolled {res:?} without the token's secret");
});
