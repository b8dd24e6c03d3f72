//! starling's cluster authentication.
//!
//! A cluster has one certificate authority (an ECDSA P-256 key and a
//! self-signed certificate, made with `rcgen`). Every daemon and privileged
//! client holds a certificate that CA issued for one **role**:
//!
//! | role | file stem | who holds it |
//! |---|---|---|
//! | head | `head` | the head (server to clients and agents, client when it dials `agent --listen`) |
//! | agent | `agent` | every agent (client when it dials the head, server under `--listen`) |
//! | relay | `relay` | the WAN link relay (speaks for the local users it accepted) |
//! | client | `client` | an administrator's client on another machine (trusted with any uid) |
//! | user | `client` (in the user's own directory) | one remote user (`starling user add`): runs tasks as its uid only |
//!
//! Besides the shared role certificates made by [`AuthDir::init`], the CA
//! issues certificates to one holder each ([`ident`]): a host enrolled with a
//! join token (`starling agent --join`, [`enrol`]) gets an agent certificate
//! naming its host, a user added by `starling user add` a user certificate
//! naming its uid; either can be revoked by its serial.
//!
//! The role is written into the certificate as a DNS name,
//! `ROLE.role.starling` ([`Role::dns_name`]): a server's role is checked by
//! the ordinary name verification of the dialling side, a client's role by
//! [`peer_role`] on the accepting side. Every connection is mutual TLS 1.3
//! (or 1.2) with `rustls`, using only this CA as trust root.
//!
//! Files live in one directory ([`AuthDir`]), created 0700 and owned by
//! the user who made it (root for a real cluster); every key is written
//! 0600. `ca.key` is needed only where certificates are issued (the head's
//! machine); a host that only runs an agent needs `ca.pem`, `agent.pem` and
//! `agent.key`.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub mod enrol;
pub mod ident;
pub mod rotate;

pub use ident::{Identity, IdentError, UserId};
pub use rotate::{Issuer, Trust};
pub use tokio_rustls::{client::TlsStream as ClientTls, server::TlsStream as ServerTls, TlsAcceptor, TlsConnector};

/// What can go wrong making, reading or using the cluster's credentials.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, #[source] source: std::io::Error },
    #[error("{} is missing: {hint}", path.display())]
    Missing { path: PathBuf, hint: &'static str },
    #[error("{}: not a PEM {what}: {source}", path.display())]
    Pem { path: PathBuf, what: &'static str, #[source] source: rustls::pki_types::pem::Error },
    #[error("making a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("building the TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error("building the certificate verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("{} already holds a cluster CA (ca.key); remove the directory to make a new one", dir.display())]
    Exists { dir: PathBuf },
    #[error("the system's random generator failed")]
    Random,
    #[error("{} is readable or writable by other users (mode {mode:o}); it must be 0700", dir.display())]
    Permissions { dir: PathBuf, mode: u32 },
}

/// A certificate's role in the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Head,
    Agent,
    Relay,
    Client,
    /// One remote user's certificate (`starling user add`): its uid is in it.
    User,
}

impl Role {
    pub const ALL: [Role; 5] = [Role::Head, Role::Agent, Role::Relay, Role::Client, Role::User];
    /// The shared role certificates [`AuthDir::init`] makes (a user's is made per user).
    pub const SHARED: [Role; 4] = [Role::Head, Role::Agent, Role::Relay, Role::Client];

    /// File stem of its certificate (`STEM.pem`) and key (`STEM.key`).
    pub fn stem(self) -> &'static str {
        match self {
            Role::Head => "head",
            Role::Agent => "agent",
            Role::Relay => "relay",
            Role::Client => "client",
            Role::User => "user",
        }
    }

    /// The DNS name its certificate is valid for.
    pub fn dns_name(self) -> String {
        format!("{}.role.starling", self.stem())
    }
}

const CA_NAME: &str = "starling cluster CA";

/// The directory holding a cluster's CA and certificates.
#[derive(Clone, Debug)]
pub struct AuthDir {
    pub dir: PathBuf,
}

impl AuthDir {
    pub fn new(dir: impl Into<PathBuf>) -> AuthDir {
        AuthDir { dir: dir.into() }
    }

    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    pub fn ca_key(&self) -> PathBuf {
        self.dir.join("ca.key")
    }

    pub fn cert(&self, role: Role) -> PathBuf {
        self.dir.join(format!("{}.pem", role.stem()))
    }

    pub fn key(&self, role: Role) -> PathBuf {
        self.dir.join(format!("{}.key", role.stem()))
    }

    /// Whether the directory has what `role` needs to connect.
    pub fn has(&self, role: Role) -> bool {
        self.ca_cert().exists() && self.cert(role).exists() && self.key(role).exists()
    }

    /// Make a new CA and one certificate per role (`starling up`,
    /// `starling head --init`). The directory is created 0700; an existing
    /// CA is never replaced.
    pub fn init(&self) -> Result<(), AuthError> {
        create_private_dir(&self.dir)?;
        if self.ca_key().exists() {
            return Err(AuthError::Exists { dir: self.dir.clone() });
        }
        let ca_key = KeyPair::generate()?;
        let ca = ca_params().self_signed(&ca_key)?;
        write_private(&self.ca_key(), ca_key.serialize_pem().as_bytes())?;
        write_public(&self.ca_cert(), ca.pem().as_bytes())?;
        for role in Role::SHARED {
            let key = KeyPair::generate()?;
            let cert = shared_role_params(role)?.signed_by(&key, &ca, &ca_key)?;
            write_private(&self.key(role), key.serialize_pem().as_bytes())?;
            write_public(&self.cert(role), cert.pem().as_bytes())?;
        }
        Ok(())
    }

    /// Every CA a handshake accepts: those of `ca.pem` (the current one, and the previous one
    /// while a rotation's window is open) and the retired ones of `ca-retired.pem` (only the
    /// head's directory has any: their certificates complete the handshake only to be refused
    /// by the head in one line, [`Trust::issuer`]).
    fn roots(&self) -> Result<Arc<rustls::RootCertStore>, AuthError> {
        let trust = self.trust()?;
        let mut roots = rustls::RootCertStore::empty();
        for ca in trust.trusted.into_iter().chain(trust.retired) {
            roots.add(ca)?;
        }
        Ok(Arc::new(roots))
    }

    /// The role's certificate followed by the current CA's (so that a host enrolling with a
    /// join token, which knows only the CA's fingerprint, can check the chain) and, after a
    /// rotation, the current CA's key certified by the previous CA (`ca-cross.pem`: a holder
    /// that trusts only the previous CA still verifies this one), and its key.
    fn chain(&self, role: Role) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), AuthError> {
        let cert = read_pem_cert(&self.cert(role))?;
        let ca = read_pem_cert(&self.ca_cert())?;
        let mut chain = vec![cert, ca];
        if self.cross_cert().exists() {
            chain.push(read_pem_cert(&self.cross_cert())?);
        }
        let kpath = self.key(role);
        need(&kpath)?;
        let key = PrivateKeyDer::from_pem_file(&kpath).map_err(|source| AuthError::Pem { path: kpath, what: "private key", source })?;
        Ok((chain, key))
    }

    /// TLS for a side that accepts connections as `role`: its certificate,
    /// and a client certificate from this CA required of every peer.
    pub fn acceptor(&self, role: Role) -> Result<TlsAcceptor, AuthError> {
        let provider = provider();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(self.roots()?, provider.clone()).build()?;
        let (chain, key) = self.chain(role)?;
        let cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)?;
        Ok(TlsAcceptor::from(Arc::new(cfg)))
    }

    /// The head's TLS: like [`AuthDir::acceptor`], but a peer may also come without a
    /// certificate, to enrol with a join token ([`enrol::serve`]) and nothing else;
    /// a certificate it shows must still be of this CA.
    pub fn head_acceptor(&self) -> Result<TlsAcceptor, AuthError> {
        let provider = provider();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(self.roots()?, provider.clone())
            .allow_unauthenticated()
            .build()?;
        let (chain, key) = self.chain(Role::Head)?;
        let cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)?;
        Ok(TlsAcceptor::from(Arc::new(cfg)))
    }

    /// TLS for a side that dials as `role` (presenting its certificate).
    /// Dial with [`server_name`] of the role expected on the other side.
    pub fn connector(&self, role: Role) -> Result<TlsConnector, AuthError> {
        let provider = provider();
        let (chain, key) = self.chain(role)?;
        let cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(chain, key)?;
        Ok(TlsConnector::from(Arc::new(cfg)))
    }
}

/// The name a dialling side checks the server's certificate against: the
/// server must hold a certificate of `role`.
pub fn server_name(role: Role) -> ServerName<'static> {
    ServerName::try_from(role.dns_name()).expect("role names are valid DNS names")
}

/// The role of the certificate a TLS peer presented (already verified
/// against the CA by the handshake); `None` if it names none of ours.
pub fn peer_role(certs: Option<&[CertificateDer<'_>]>) -> Option<Role> {
    let leaf = certs?.first()?;
    let ee = webpki::EndEntityCert::try_from(leaf).ok()?;
    Role::ALL.into_iter().find(|r| {
        let name = server_name(*r);
        ee.verify_is_valid_for_subject_name(&name).is_ok()
    })
}

/// The role of the client on a server-side TLS stream.
pub fn client_role<S>(tls: &ServerTls<S>) -> Option<Role> {
    peer_role(tls.get_ref().1.peer_certificates())
}

/// A local user, as the kernel names the process on the other end of a Unix
/// socket: what it was when it connected (`SO_PEERCRED`, `SO_PEERGROUPS`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cred {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// The credentials of the peer of a connected Unix socket.
pub fn unix_peer(sock: &tokio::net::UnixStream) -> std::io::Result<Cred> {
    use std::os::fd::AsRawFd;
    let uc = sock.peer_cred()?;
    let fd = sock.as_raw_fd();
    let mut groups = vec![0u32; 64];
    loop {
        let mut len = libc::socklen_t::try_from(groups.len() * std::mem::size_of::<u32>()).unwrap_or(libc::socklen_t::MAX);
        // SAFETY: `fd` is an open socket we borrow for the call; the kernel writes at most `len` bytes
        // into `groups`, which has room for exactly `len` bytes, and updates `len`.
        let r = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERGROUPS, groups.as_mut_ptr().cast(), &mut len) };
        let n = usize::try_from(len).unwrap_or(0) / std::mem::size_of::<u32>();
        if r == 0 {
            groups.truncate(n);
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ERANGE) && n > groups.len() && n <= 65536 {
            groups.resize(n, 0);
            continue;
        }
        return Err(e);
    }
    Ok(Cred { uid: uc.uid(), gid: uc.gid(), groups })
}

pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A shared role certificate's parameters ([`AuthDir::init`], and again at a CA rotation).
pub(crate) fn shared_role_params(role: Role) -> Result<CertificateParams, AuthError> {
    let mut params = CertificateParams::new(vec![role.dns_name()])?;
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, format!("starling {}", role.stem()));
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    Ok(params)
}

pub(crate) fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, CA_NAME);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    params
}

pub(crate) fn need(path: &Path) -> Result<(), AuthError> {
    if path.exists() {
        Ok(())
    } else {
        Err(AuthError::Missing {
            path: path.to_path_buf(),
            hint: "make the cluster's credentials with `starling head --init --auth DIR` and copy the role's files (see README, Authentication)",
        })
    }
}

/// The first certificate of a PEM file.
pub(crate) fn read_pem_cert(path: &Path) -> Result<CertificateDer<'static>, AuthError> {
    need(path)?;
    CertificateDer::from_pem_file(path).map_err(|source| AuthError::Pem { path: path.to_path_buf(), what: "certificate", source })
}

/// Every certificate of a PEM file (a bundle); none if it does not exist.
pub(crate) fn read_pem_bundle(path: &Path) -> Result<Vec<CertificateDer<'static>>, AuthError> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let pem = |source| AuthError::Pem { path: path.to_path_buf(), what: "certificate bundle", source };
    CertificateDer::pem_file_iter(path).map_err(pem)?.collect::<Result<Vec<_>, _>>().map_err(pem)
}

/// Create `dir` (and parents) with the last component 0700; an existing
/// directory open to others is refused.
pub(crate) fn create_private_dir(dir: &Path) -> Result<(), AuthError> {
    let io = |source| AuthError::Io { path: dir.to_path_buf(), source };
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let mode = std::fs::metadata(dir).map_err(io)?.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(AuthError::Permissions { dir: dir.to_path_buf(), mode });
            }
        }
        Err(e) => return Err(io(e)),
    }
    Ok(())
}

fn write_file(path: &Path, data: &[u8], mode: u32) -> Result<(), AuthError> {
    let io = |source| AuthError::Io { path: path.to_path_buf(), source };
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(path).map_err(io)?;
    f.write_all(data).map_err(io)?;
    f.sync_all().map_err(io)
}

pub(crate) fn write_private(path: &Path, data: &[u8]) -> Result<(), AuthError> {
    write_file(path, data, 0o600)
}

pub(crate) fn write_public(path: &Path, data: &[u8]) -> Result<(), AuthError> {
    write_file(path, data, 0o644)
}

/// Replace `path` with `data` (mode `mode`) at once: a reader sees the old file or the new one.
pub(crate) fn replace_file(path: &Path, data: &[u8], mode: u32) -> Result<(), AuthError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".new");
    let tmp = PathBuf::from(tmp);
    let io = |source| AuthError::Io { path: tmp.clone(), source };
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(e)),
        _ => {}
    }
    write_file(&tmp, data, mode)?;
    std::fs::rename(&tmp, path).map_err(|source| AuthError::Io { path: path.to_path_buf(), source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn init_writes_private_keys_and_refuses_a_second_ca() {
        let t = tempfile::tempdir().unwrap();
        let a = AuthDir::new(t.path().join("auth"));
        a.init().unwrap();
        assert_eq!(std::fs::metadata(&a.dir).unwrap().permissions().mode() & 0o777, 0o700);
        for role in Role::SHARED {
            assert_eq!(std::fs::metadata(a.key(role)).unwrap().permissions().mode() & 0o777, 0o600);
        }
        assert_eq!(std::fs::metadata(a.ca_key()).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(matches!(a.init(), Err(AuthError::Exists { .. })));
    }

    async fn handshake(server: &AuthDir, client: &AuthDir, as_role: Role) -> Result<Option<Role>, std::io::Error> {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let acceptor = server.acceptor(Role::Head).unwrap();
        let srv = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let mut tls = acceptor.accept(s).await?;
            let role = client_role(&tls);
            let mut b = [0u8; 2];
            tls.read_exact(&mut b).await?;
            Ok::<_, std::io::Error>(role)
        });
        let conn = client.connector(as_role).unwrap();
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        if let Ok(mut tls) = conn.connect(server_name(Role::Head), s).await {
            let _ = tls.write_all(b"hi").await;
            let _ = tls.flush().await;
        }
        srv.await.unwrap()
    }

    #[tokio::test]
    async fn mutual_tls_names_the_role_and_refuses_another_ca() {
        let t = tempfile::tempdir().unwrap();
        let a = AuthDir::new(t.path().join("a"));
        a.init().unwrap();
        let b = AuthDir::new(t.path().join("b"));
        b.init().unwrap();
        assert_eq!(handshake(&a, &a, Role::Agent).await.unwrap(), Some(Role::Agent));
        assert_eq!(handshake(&a, &a, Role::Relay).await.unwrap(), Some(Role::Relay));
        assert!(handshake(&a, &b, Role::Client).await.is_err(), "a certificate of another CA was accepted");
    }
}
