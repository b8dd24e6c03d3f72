//! Certificates of one holder each: enrolled hosts and remote users, join
//! tokens, revocation.
//!
//! What the CA issues besides [`AuthDir::init`]'s shared role certificates,
//! and what the head keeps about it, all in the cluster's credentials
//! directory (0700, written only by root on the head's machine):
//!
//! | path | what |
//! |---|---|
//! | `tokens/SHA256` | a join token not yet used: the file is named by the SHA-256 of its secret (the secret itself is kept nowhere) and holds its expiry (Unix seconds) |
//! | `hosts/NAME` | the serials of the certificates host NAME holds: the one it enrolled with, then one a line re-issued at each CA rotation ([`crate::rotate`]) |
//! | `users/NAME` | the same for user NAME's certificate, and `creds PATH`: where `starling user add` wrote the user's credentials (a CA rotation re-issues them there) |
//! | `revoked` | one revoked certificate a line: `SERIAL KIND NAME` |
//!
//! A holder's name is written in its certificate as a URI subject
//! alternative name — `starling:host:NAME`, or `starling:user:NAME:UID:GID`
//! with `:G1,G2,...` after it when the user has supplementary groups —
//! next to its role's DNS name, and read back from a verified certificate by
//! [`Identity::of`]. The head refuses a certificate whose serial is in
//! `revoked` and drops its live connections when it appears there.

use crate::{AuthDir, AuthError, Role};
use rcgen::{CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType};
use rustls::pki_types::CertificateDer;
use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Why a token, an enrolment, a user or a revocation was refused.
#[derive(Debug, thiserror::Error)]
pub enum IdentError {
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, #[source] source: std::io::Error },
    #[error("this join token is unknown or was already used (a token enrols one host, once; make another with `starling token create`)")]
    UnknownToken,
    #[error("this join token expired {0} s ago (make another with `starling token create`)")]
    ExpiredToken(u64),
    #[error("a join token is SECRET.FINGERPRINT (64 hex digits each), as `starling token create` prints it")]
    MalformedToken,
    #[error("{kind} name {name:?} is not allowed: 1 to 64 of letters, digits, '.', '_' and '-', not starting with '.' or '-'")]
    BadName { kind: &'static str, name: String },
    #[error("host {0} is already enrolled; revoke its certificate first (`starling host revoke {0}`)")]
    HostEnrolled(String),
    #[error("user {0} already has a certificate; revoke it first (`starling user revoke {0}`)")]
    UserExists(String),
    #[error("{0} supplementary groups: a process can have at most 65536")]
    TooManyGroups(usize),
    #[error("no {kind} named {name} has a certificate of this cluster")]
    NotIssued { kind: &'static str, name: String },
    #[error("the public key sent is not an uncompressed ECDSA P-256 point")]
    BadPublicKey,
    #[error("a CA rotation is under way: finish it first (`starling ca rotate --finish`)")]
    RotationOpen,
    #[error("no CA rotation is under way (start one with `starling ca rotate`)")]
    NoRotation,
    #[error("the credentials sent are refused: {0}")]
    BadCredentials(&'static str),
}

/// A remote user as their certificate names them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserId {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups besides `gid` (sorted, without duplicates; empty in a certificate
    /// issued before groups were carried).
    pub groups: Vec<u32>,
}

impl UserId {
    /// The supplementary groups this user's tasks run with: the gid and the certified groups,
    /// as `initgroups` would list them for a local user.
    pub fn task_groups(&self) -> Vec<u32> {
        let mut all = vec![self.gid];
        all.extend(self.groups.iter().copied().filter(|&g| g != self.gid));
        all
    }

    /// The URI naming this user in their certificate.
    fn uri(&self) -> String {
        let UserId { name, uid, gid, groups } = self;
        if groups.is_empty() {
            format!("{USER_URI}{name}:{uid}:{gid}")
        } else {
            let list: Vec<String> = groups.iter().map(u32::to_string).collect();
            format!("{USER_URI}{name}:{uid}:{gid}:{}", list.join(","))
        }
    }

    /// Read back what [`UserId::uri`] wrote (the part after `starling:user:`).
    fn parse(rest: &str) -> Option<UserId> {
        let mut parts = rest.split(':');
        let (Some(name), Some(uid), Some(gid), groups, None) = (parts.next(), parts.next(), parts.next(), parts.next(), parts.next()) else {
            return None;
        };
        let groups = match groups {
            None => Vec::new(),
            Some(list) => list.split(',').map(|g| g.parse().ok()).collect::<Option<Vec<u32>>>()?,
        };
        Some(UserId { name: name.to_string(), uid: uid.parse().ok()?, gid: gid.parse().ok()?, groups })
    }
}

/// At most as many supplementary groups as Linux lets a process have (`NGROUPS_MAX`).
const MAX_GROUPS: usize = 65536;

/// What a verified certificate says about its holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub role: Role,
    /// The host an agent certificate was issued to (`starling agent --join`,
    /// or `starling up`'s emulated hosts); `None`: the shared agent certificate.
    pub host: Option<String>,
    /// The user a user certificate was issued to (`starling user add`).
    pub user: Option<UserId>,
    /// The certificate's serial number (hex): what revocation names.
    pub serial: String,
    /// The certificate itself (DER): which CA issued it ([`crate::Trust::issuer`]), and its
    /// public key for a re-issue at a CA rotation.
    pub cert: CertificateDer<'static>,
}

const HOST_URI: &str = "starling:host:";
const USER_URI: &str = "starling:user:";
/// A record's line naming where the holder's credentials were written.
const CREDS: &str = "creds ";

impl Identity {
    /// The identity in a peer's certificate chain, already verified against
    /// the CA by the TLS handshake; `None` if its leaf names none of our roles,
    /// or is a user certificate that names no user.
    pub fn of(certs: Option<&[CertificateDer<'_>]>) -> Option<Identity> {
        let leaf = certs?.first()?;
        let ee = webpki::EndEntityCert::try_from(leaf).ok()?;
        let role = Role::ALL.into_iter().find(|r| ee.verify_is_valid_for_subject_name(&crate::server_name(*r)).is_ok())?;
        let mut host = None;
        let mut user = None;
        for uri in ee.valid_uri_names() {
            if let Some(name) = uri.strip_prefix(HOST_URI) {
                host = Some(name.to_string());
            } else if let Some(rest) = uri.strip_prefix(USER_URI) {
                user = Some(UserId::parse(rest)?);
            }
        }
        if role == Role::User && user.is_none() {
            return None;
        }
        Some(Identity { role, host, user, serial: hex(ee.serial()), cert: leaf.clone().into_owned() })
    }
}

/// The identity of the client on a server-side TLS stream.
pub fn client_identity<S>(tls: &crate::ServerTls<S>) -> Option<Identity> {
    Identity::of(tls.get_ref().1.peer_certificates())
}

/// The identity of the server on a client-side TLS stream.
pub fn server_identity<S>(tls: &crate::ClientTls<S>) -> Option<Identity> {
    Identity::of(tls.get_ref().1.peer_certificates())
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect()
}

pub(crate) fn sha256(data: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, data);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Host and user names: what fits in a file name and a URI without escaping.
fn check_name(kind: &'static str, name: &str) -> Result<(), IdentError> {
    let ok = (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && !name.starts_with(['.', '-']);
    if ok {
        Ok(())
    } else {
        Err(IdentError::BadName { kind, name: name.to_string() })
    }
}

/// A P-256 public key as the uncompressed point (what [`KeyPair::public_key_raw`] gives).
pub struct P256PublicKey(Vec<u8>);

/// The DER of a SubjectPublicKeyInfo up to its key bits, for an id-ecPublicKey on prime256v1 (RFC 5480):
/// every key of a starling cluster (rcgen's default, which enrolment insists on).
const P256_SPKI_PREFIX: [u8; 26] =
    [0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00];

impl P256PublicKey {
    pub fn from_raw(raw: Vec<u8>) -> Result<P256PublicKey, IdentError> {
        if raw.len() == 65 && raw[0] == 4 {
            Ok(P256PublicKey(raw))
        } else {
            Err(IdentError::BadPublicKey)
        }
    }

    /// The key a certificate certifies (its SubjectPublicKeyInfo, DER).
    pub fn from_spki(spki: &[u8]) -> Result<P256PublicKey, IdentError> {
        P256PublicKey::from_raw(spki.strip_prefix(&P256_SPKI_PREFIX[..]).ok_or(IdentError::BadPublicKey)?.to_vec())
    }
}

impl rcgen::PublicKeyData for P256PublicKey {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }

    fn algorithm(&self) -> &rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ECDSA_P256_SHA256
    }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl AuthDir {
    fn tokens(&self) -> PathBuf {
        self.dir.join("tokens")
    }

    pub(crate) fn record(&self, kind: &str, name: &str) -> PathBuf {
        self.dir.join(format!("{kind}s")).join(name)
    }

    /// The revocation list (`SERIAL KIND NAME` lines).
    pub fn revoked_path(&self) -> PathBuf {
        self.dir.join("revoked")
    }

    /// SHA-256 of the CA's certificate (hex): what a join token carries so a
    /// joining host can check it reached this cluster's head.
    pub fn ca_fingerprint(&self) -> Result<String, AuthError> {
        Ok(hex(&sha256(crate::read_pem_cert(&self.ca_cert())?.as_ref())))
    }

    /// Make a join token valid for `ttl` and one enrolment: `SECRET.FINGERPRINT`.
    pub fn create_token(&self, ttl: Duration) -> Result<String, IdentError> {
        let fingerprint = self.ca_fingerprint()?;
        let mut secret = [0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret).map_err(|_| AuthError::Random)?;
        crate::create_private_dir(&self.tokens())?;
        let path = self.tokens().join(hex(&sha256(&secret)));
        let expiry = now_secs().saturating_add(ttl.as_secs());
        crate::write_private(&path, format!("{expiry}\n").as_bytes())?;
        Ok(format!("{}.{fingerprint}", hex(&secret)))
    }

    /// Use a join token up: `Ok` once, for a token made here and not expired.
    pub(crate) fn redeem_token(&self, secret: &[u8]) -> Result<(), IdentError> {
        let path = self.tokens().join(hex(&sha256(secret)));
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(IdentError::UnknownToken),
            Err(source) => return Err(IdentError::Io { path, source }),
        };
        // Removing it is what uses it: of two enrolments racing with one token, one removes it.
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(IdentError::UnknownToken),
            Err(source) => return Err(IdentError::Io { path, source }),
        }
        let expiry: u64 = text.trim().parse().map_err(|_| IdentError::UnknownToken)?;
        let now = now_secs();
        if now >= expiry {
            return Err(IdentError::ExpiredToken(now - expiry));
        }
        Ok(())
    }

    /// The CA, to sign with (only where `ca.key` is: the head's machine).
    pub(crate) fn issuer(&self) -> Result<(rcgen::Certificate, KeyPair), AuthError> {
        let kpath = self.ca_key();
        crate::need(&kpath)?;
        let pem = std::fs::read_to_string(&kpath).map_err(|source| AuthError::Io { path: kpath.clone(), source })?;
        let key = KeyPair::from_pem(&pem)?;
        // The same name, key and key identifier as `ca.pem`: what it signs chains to `ca.pem`.
        let ca = crate::ca_params().self_signed(&key)?;
        Ok((ca, key))
    }

    /// A certificate for `role` naming its holder by `uri`, for `public_key`; and its serial (hex).
    pub(crate) fn issue(&self, role: Role, uri: &str, public_key: &impl rcgen::PublicKeyData) -> Result<(String, String), AuthError> {
        let mut params = CertificateParams::new(vec![role.dns_name()])?;
        params.subject_alt_names.push(SanType::URI(uri.try_into()?));
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, uri);
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params, public_key)
    }

    /// Sign `params` for `public_key` with the current CA under a fresh random serial: the
    /// certificate (PEM) and its serial (hex).
    pub(crate) fn sign(&self, mut params: CertificateParams, public_key: &impl rcgen::PublicKeyData) -> Result<(String, String), AuthError> {
        let (ca, ca_key) = self.issuer()?;
        let mut serial = [0u8; 16];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut serial).map_err(|_| AuthError::Random)?;
        // A positive DER integer with no leading zero byte to strip: the serial reads back as written.
        serial[0] = (serial[0] & 0x7f) | 0x40;
        params.serial_number = Some(rcgen::SerialNumber::from_slice(&serial));
        let cert = params.signed_by(public_key, &ca, &ca_key)?;
        Ok((cert.pem(), hex(&serial)))
    }

    /// Whether host `name` holds a certificate of its own.
    pub fn host_enrolled(&self, name: &str) -> bool {
        self.record("host", name).exists()
    }

    /// Issue host `name` its agent certificate, once: a name already enrolled
    /// is refused until its certificate is revoked. The token (if any) is used
    /// up only when the name may be enrolled.
    pub(crate) fn enrol_host(&self, name: &str, token: Option<&[u8]>, public_key: &P256PublicKey) -> Result<String, IdentError> {
        check_name("host", name)?;
        if self.host_enrolled(name) {
            return Err(IdentError::HostEnrolled(name.to_string()));
        }
        if let Some(secret) = token {
            self.redeem_token(secret)?;
        }
        let (pem, serial) = self.issue(Role::Agent, &format!("{HOST_URI}{name}"), public_key)?;
        self.write_record("host", name, &serial)?;
        Ok(pem)
    }

    fn write_record(&self, kind: &'static str, name: &str, text: &str) -> Result<(), IdentError> {
        let path = self.record(kind, name);
        crate::create_private_dir(path.parent().expect("a record is in a directory"))?;
        match crate::write_private(&path, format!("{text}\n").as_bytes()) {
            Err(AuthError::Io { source, .. }) if source.kind() == std::io::ErrorKind::AlreadyExists => Err(match kind {
                "host" => IdentError::HostEnrolled(name.to_string()),
                _ => IdentError::UserExists(name.to_string()),
            }),
            r => Ok(r?),
        }
    }

    /// Give host `name` a key and a certificate of its own in `dir` (ca.pem,
    /// agent.pem, agent.key), as enrolling would: `starling up`'s emulated hosts.
    pub fn issue_host_credentials(&self, name: &str, dir: &Path) -> Result<(), IdentError> {
        let key = KeyPair::generate().map_err(AuthError::from)?;
        let pem = self.enrol_host(name, None, &P256PublicKey::from_raw(key.public_key_raw().to_vec())?)?;
        write_credentials(dir, Role::Agent, &std::fs::read(self.ca_cert()).map_err(|source| IdentError::Io { path: self.ca_cert(), source })?, &pem, &key.serialize_pem())
    }

    /// `starling user add`: a key and a user certificate naming `uid`, `gid`
    /// and supplementary `groups` in `out` (ca.pem, client.pem, client.key: what
    /// a client reads from `STARLING_AUTH`); the user's serial is recorded for
    /// revocation.
    pub fn add_user(&self, name: &str, uid: u32, gid: u32, groups: &[u32], out: &Path) -> Result<(), IdentError> {
        check_name("user", name)?;
        let mut groups: Vec<u32> = groups.iter().copied().filter(|&g| g != gid).collect();
        groups.sort_unstable();
        groups.dedup();
        if groups.len() >= MAX_GROUPS {
            return Err(IdentError::TooManyGroups(groups.len() + 1));
        }
        if self.record("user", name).exists() {
            return Err(IdentError::UserExists(name.to_string()));
        }
        let key = KeyPair::generate().map_err(AuthError::from)?;
        let user = UserId { name: name.to_string(), uid, gid, groups };
        let (pem, serial) = self.issue(Role::User, &user.uri(), &key)?;
        let out = std::path::absolute(out).map_err(|source| IdentError::Io { path: out.to_path_buf(), source })?;
        let ca = std::fs::read(self.ca_cert()).map_err(|source| IdentError::Io { path: self.ca_cert(), source })?;
        write_credentials(&out, Role::Client, &ca, &pem, &key.serialize_pem())?;
        self.write_record("user", name, &format!("{serial}\n{CREDS}{}", out.display()))
    }

    /// The serials a record lists (every certificate its holder was issued), and where its
    /// credentials were written, if it says.
    pub(crate) fn read_record(&self, kind: &'static str, name: &str) -> Result<(Vec<String>, Option<PathBuf>), IdentError> {
        let path = self.record(kind, name);
        let text = match std::fs::read_to_string(&path) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(IdentError::NotIssued { kind, name: name.to_string() });
            }
            Err(source) => return Err(IdentError::Io { path, source }),
        };
        let creds = text.lines().find_map(|l| l.strip_prefix(CREDS)).map(PathBuf::from);
        let serials = text.lines().filter(|l| !l.starts_with(CREDS) && !l.trim().is_empty()).map(|l| l.trim().to_string()).collect();
        Ok((serials, creds))
    }

    /// Add a re-issued certificate's serial to its holder's record (revoking the holder
    /// revokes it too).
    pub(crate) fn add_serial(&self, kind: &'static str, name: &str, serial: &str) -> Result<(), IdentError> {
        let path = self.record(kind, name);
        let io = |source| IdentError::Io { path: path.clone(), source };
        let mut f = std::fs::OpenOptions::new().append(true).open(&path).map_err(io)?;
        f.write_all(format!("{serial}\n").as_bytes()).map_err(io)?;
        f.sync_all().map_err(io)
    }

    /// `starling host revoke` / `starling user revoke`: add the holder's serials
    /// (its certificate, and those re-issued to it at CA rotations) to the
    /// revocation list and forget its record (the name may be given a new
    /// certificate). Returns the latest serial.
    pub fn revoke(&self, kind: &'static str, name: &str) -> Result<String, IdentError> {
        check_name(kind, name)?;
        let (serials, _) = self.read_record(kind, name)?;
        let latest = serials.last().cloned().ok_or_else(|| IdentError::NotIssued { kind, name: name.to_string() })?;
        let list = self.revoked_path();
        let io = |source| IdentError::Io { path: list.clone(), source };
        let mut f = std::fs::OpenOptions::new().append(true).create(true).open(&list).map_err(io)?;
        let lines: String = serials.iter().map(|s| format!("{s} {kind} {name}\n")).collect();
        f.write_all(lines.as_bytes()).map_err(io)?;
        f.sync_all().map_err(io)?;
        let path = self.record(kind, name);
        std::fs::remove_file(&path).map_err(|source| IdentError::Io { path, source })?;
        Ok(latest)
    }

    /// On a host: the revocation list its head last sent (`Msg::Revoked`), serials one a line,
    /// so a restarted agent refuses revoked peers before it reaches the head.
    pub fn seen_revocations_path(&self) -> PathBuf {
        self.dir.join("revoked-seen")
    }

    /// Keep `serials` as the last revocation list seen (replaced at once, mode 0600, in this
    /// root-only directory).
    pub fn save_seen_revocations(&self, serials: &[String]) -> Result<(), IdentError> {
        let text: String = serials.iter().filter(|s| !s.is_empty() && !s.contains(char::is_whitespace)).map(|s| format!("{s}\n")).collect();
        crate::replace_file(&self.seen_revocations_path(), text.as_bytes(), 0o600)?;
        Ok(())
    }

    /// The last revocation list seen (empty if none was ever saved).
    pub fn seen_revocations(&self) -> Result<Vec<String>, IdentError> {
        let path = self.seen_revocations_path();
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok(text.lines().map(str::trim).filter(|l| !l.is_empty()).map(str::to_string).collect()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(source) => Err(IdentError::Io { path, source }),
        }
    }

    /// The serials of revoked certificates.
    pub fn revoked(&self) -> Result<HashSet<String>, IdentError> {
        let path = self.revoked_path();
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok(text.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_string).collect()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(HashSet::new()),
            Err(source) => Err(IdentError::Io { path, source }),
        }
    }
}

/// Write one holder's credentials into `dir` (made 0700): the CA's
/// certificate, and `role`'s certificate and key.
pub(crate) fn write_credentials(dir: &Path, role: Role, ca_pem: &[u8], cert_pem: &str, key_pem: &str) -> Result<(), IdentError> {
    crate::create_private_dir(dir)?;
    let to = AuthDir::new(dir);
    crate::write_public(&to.ca_cert(), ca_pem)?;
    crate::write_public(&to.cert(role), cert_pem.as_bytes())?;
    crate::write_private(&to.key(role), key_pem.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seen_revocation_list_survives_and_is_replaced_whole() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let a = AuthDir::new(tmp.path());
        assert!(a.seen_revocations().unwrap().is_empty(), "nothing saved yet");
        a.save_seen_revocations(&["0a1b".into(), "ff02".into()]).unwrap();
        assert_eq!(a.seen_revocations().unwrap(), ["0a1b", "ff02"]);
        assert_eq!(std::fs::metadata(a.seen_revocations_path()).unwrap().permissions().mode() & 0o777, 0o600);
        a.save_seen_revocations(&["ff02".into()]).unwrap();
        assert_eq!(a.seen_revocations().unwrap(), ["ff02"], "a later list replaces the earlier one");
    }

    fn leaf(pem: &str) -> CertificateDer<'static> {
        use rustls::pki_types::pem::PemObject;
        CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    }

    #[test]
    fn a_token_enrols_once_and_names_its_host() {
        let t = tempfile::tempdir().unwrap();
        let a = AuthDir::new(t.path().join("auth"));
        a.init().unwrap();
        let token = a.create_token(Duration::from_secs(3600)).unwrap();
        let (secret, fp) = token.split_once('.').unwrap();
        assert_eq!(fp, a.ca_fingerprint().unwrap());
        let secret = unhex(secret).unwrap();
        let key = KeyPair::generate().unwrap();
        let pk = || P256PublicKey::from_raw(key.public_key_raw().to_vec()).unwrap();
        let pem = a.enrol_host("node1", Some(&secret), &pk()).unwrap();
        let id = Identity::of(Some(&[leaf(&pem)])).unwrap();
        assert_eq!((id.role, id.host.as_deref()), (Role::Agent, Some("node1")));
        assert!(matches!(a.enrol_host("node2", Some(&secret), &pk()), Err(IdentError::UnknownToken)));
        // A second token cannot take a name already enrolled, and is not used up trying.
        let token2 = a.create_token(Duration::from_secs(3600)).unwrap();
        let secret2 = unhex(token2.split_once('.').unwrap().0).unwrap();
        assert!(matches!(a.enrol_host("node1", Some(&secret2), &pk()), Err(IdentError::HostEnrolled(_))));
        assert_eq!(a.revoke("host", "node1").unwrap(), id.serial);
        assert!(a.revoked().unwrap().contains(&id.serial));
        a.enrol_host("node1", Some(&secret2), &pk()).unwrap();
    }

    #[test]
    fn an_expired_token_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let a = AuthDir::new(t.path().join("auth"));
        a.init().unwrap();
        let token = a.create_token(Duration::ZERO).unwrap();
        let secret = unhex(token.split_once('.').unwrap().0).unwrap();
        let key = KeyPair::generate().unwrap();
        let pk = P256PublicKey::from_raw(key.public_key_raw().to_vec()).unwrap();
        assert!(matches!(a.enrol_host("node1", Some(&secret), &pk), Err(IdentError::ExpiredToken(_))));
        assert!(!a.host_enrolled("node1"));
    }

    #[test]
    fn a_user_certificate_names_its_uid() {
        let t = tempfile::tempdir().unwrap();
        let a = AuthDir::new(t.path().join("auth"));
        a.init().unwrap();
        let out = t.path().join("alice");
        a.add_user("alice", 1000, 1001, &[], &out).unwrap();
        let pem = std::fs::read_to_string(AuthDir::new(&out).cert(Role::Client)).unwrap();
        let id = Identity::of(Some(&[leaf(&pem)])).unwrap();
        assert_eq!(id.role, Role::User);
        assert_eq!(id.user, Some(UserId { name: "alice".into(), uid: 1000, gid: 1001, groups: vec![] }));
        assert_eq!(id.user.unwrap().task_groups(), [1001]);
        assert!(matches!(a.add_user("alice", 1000, 1000, &[], &t.path().join("again")), Err(IdentError::UserExists(_))));
        assert!(matches!(a.add_user("../x", 1, 1, &[], &t.path().join("x")), Err(IdentError::BadName { .. })));
        // The shared role certificates name no holder.
        let shared = Identity::of(Some(&[crate::read_pem_cert(&a.cert(Role::Agent)).unwrap()])).unwrap();
        assert_eq!((shared.role, shared.host, shared.user), (Role::Agent, None, None));
    }

    #[test]
    fn a_user_certificate_names_its_groups() {
        let t = tempfile::tempdir().unwrap();
        let a = AuthDir::new(t.path().join("auth"));
        a.init().unwrap();
        let out = t.path().join("bob");
        // Given unsorted, repeated and with the gid among them.
        a.add_user("bob", 1002, 1003, &[2002, 1003, 2001, 2002], &out).unwrap();
        let pem = std::fs::read_to_string(AuthDir::new(&out).cert(Role::Client)).unwrap();
        let user = Identity::of(Some(&[leaf(&pem)])).unwrap().user.unwrap();
        assert_eq!(user, UserId { name: "bob".into(), uid: 1002, gid: 1003, groups: vec![2001, 2002] });
        assert_eq!(user.task_groups(), [1003, 2001, 2002]);
        // What the certificate says, as written there.
        let der = leaf(&pem);
        let ee = webpki::EndEntityCert::try_from(&der).unwrap();
        assert_eq!(ee.valid_uri_names().collect::<Vec<_>>(), ["starling:user:bob:1002:1003:2001,2002"]);
    }

    #[test]
    fn a_malformed_user_uri_names_nobody() {
        for rest in ["bob:1:2:", "bob:1:2:3,,4", "bob:1:2:x", "bob:1:2:3:4", "bob:1"] {
            assert_eq!(UserId::parse(rest), None, "{rest}");
        }
        assert_eq!(UserId::parse("bob:1:2:3").unwrap().groups, [3]);
    }
}
