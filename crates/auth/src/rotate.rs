//! Replacing the cluster's CA while the cluster runs (`starling ca rotate`).
//!
//! A rotation has a **window**: from `starling ca rotate` to `starling ca rotate --finish`,
//! certificates of both the previous and the new CA are accepted, so every holder can be
//! given a certificate of the new one without a connection being dropped or a task ended.
//! The files of the credentials directory involved:
//!
//! | path | what |
//! |---|---|
//! | `ca.pem` | the CAs trusted: the current one first, then, while a window is open, the previous one (what holders get as their `ca.pem`) |
//! | `ca.key` | the current CA's key (the previous one is deleted by the rotation) |
//! | `ca-cross.pem` | the current CA's key certified by the previous CA, sent after the CA in the head's (and every role certificate's) chain: a holder that still trusts only the previous CA verifies the head through it |
//! | `ca-retired.pem` | CAs whose window closed: a certificate they issued still completes the TLS handshake with the head, only to be refused in one line ([`Trust::issuer`]) |
//!
//! `rotate` makes the new CA, re-signs the shared role certificates (same keys) and the
//! credentials `starling user add` wrote on this machine (same keys; new serials added to the
//! users' records), and puts `ca.pem` last: the head, which watches it, then reloads its TLS and
//! re-issues a certificate of the new CA to every connected agent over its connection (the
//! agent's key never moves), and to an agent that connects later with a previous-CA
//! certificate. `finish` moves the previous CA to `ca-retired.pem`: from then on the head refuses
//! a new connection with one of its certificates, in one line. Connections made before go on
//! (and their tasks): a rotation replaces a CA, it does not distrust what it certified
//! (revocation does that).

use crate::ident::{hex, IdentError, Identity, P256PublicKey};
use crate::{AuthDir, AuthError, Role};
use rcgen::{CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, UnixTime};
use std::path::PathBuf;

/// Which of the cluster's CAs issued a certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Issuer {
    Current,
    /// The CA before the last rotation, while its window is open.
    Previous,
    /// A CA whose rotation window closed: its certificates are refused.
    Retired,
    /// None of this cluster's.
    Unknown,
}

/// The CAs a head knows: `trusted` (current first, then previous while a window is open)
/// and `retired`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trust {
    pub trusted: Vec<CertificateDer<'static>>,
    pub retired: Vec<CertificateDer<'static>>,
}

impl Trust {
    /// Which CA signed `leaf` (checked by its signature, with the CA as the only trust anchor).
    pub fn issuer(&self, leaf: &CertificateDer<'_>) -> Issuer {
        if let Some(i) = self.trusted.iter().position(|ca| signed_by(leaf, ca)) {
            return if i == 0 { Issuer::Current } else { Issuer::Previous };
        }
        if self.retired.iter().any(|ca| signed_by(leaf, ca)) {
            Issuer::Retired
        } else {
            Issuer::Unknown
        }
    }

    /// Whether a rotation's window is open (a previous CA is still trusted).
    pub fn window_open(&self) -> bool {
        self.trusted.len() > 1
    }
}

fn signed_by(leaf: &CertificateDer<'_>, ca: &CertificateDer<'_>) -> bool {
    let Ok(anchor) = webpki::anchor_from_trusted_cert(ca) else { return false };
    let Ok(ee) = webpki::EndEntityCert::try_from(leaf) else { return false };
    ee.verify_for_usage(webpki::ALL_VERIFICATION_ALGS, &[anchor], &[], UnixTime::now(), webpki::KeyUsage::client_auth(), None, None)
        .is_ok()
}

/// What a rotation did.
#[derive(Debug)]
pub struct Rotated {
    /// SHA-256 of the new CA's certificate (hex): what new join tokens carry.
    pub fingerprint: String,
    /// Users whose credentials on this machine were re-issued, with where.
    pub users: Vec<(String, PathBuf)>,
    /// Users with a certificate but no credentials here to re-issue (given elsewhere).
    pub users_elsewhere: Vec<String>,
}

fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> IdentError + '_ {
    move |source| IdentError::Io { path: path.to_path_buf(), source }
}

impl AuthDir {
    /// The previous CA's certificate of the current CA's key (see the module doc).
    pub fn cross_cert(&self) -> PathBuf {
        self.dir.join("ca-cross.pem")
    }

    /// CAs whose rotation window closed.
    pub fn retired_cas(&self) -> PathBuf {
        self.dir.join("ca-retired.pem")
    }

    /// The CAs of this directory.
    pub fn trust(&self) -> Result<Trust, AuthError> {
        crate::need(&self.ca_cert())?;
        Ok(Trust { trusted: crate::read_pem_bundle(&self.ca_cert())?, retired: crate::read_pem_bundle(&self.retired_cas())? })
    }

    /// `starling ca rotate`: a new CA, trusted from now on together with the previous one
    /// until [`AuthDir::finish_rotation`] (see the module doc).
    pub fn rotate_ca(&self) -> Result<Rotated, IdentError> {
        let trust = self.trust()?;
        if trust.window_open() {
            return Err(IdentError::RotationOpen);
        }
        let (old_ca, old_key) = self.issuer()?;
        let new_key = KeyPair::generate().map_err(AuthError::from)?;
        let new_ca = crate::ca_params().self_signed(&new_key).map_err(AuthError::from)?;
        let cross = crate::ca_params().signed_by(&new_key, &old_ca, &old_key).map_err(AuthError::from)?;
        crate::replace_file(&self.cross_cert(), cross.pem().as_bytes(), 0o644)?;
        // From here on the new key signs (`issuer` reads ca.key); the old one is gone.
        crate::replace_file(&self.ca_key(), new_key.serialize_pem().as_bytes(), 0o600)?;
        let bundle = format!("{}{}", new_ca.pem(), std::fs::read_to_string(self.ca_cert()).map_err(io(&self.ca_cert()))?);
        for role in Role::SHARED {
            if !self.key(role).exists() {
                continue;
            }
            let key = read_key(&self.key(role))?;
            let (pem, _) = self.sign(crate::shared_role_params(role)?, &key)?;
            crate::replace_file(&self.cert(role), pem.as_bytes(), 0o644)?;
        }
        let mut users = Vec::new();
        let mut users_elsewhere = Vec::new();
        let users_dir = self.dir.join("users");
        let names: Vec<String> = match std::fs::read_dir(&users_dir) {
            Ok(rd) => rd.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|n| !n.ends_with(".new")).collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => return Err(IdentError::Io { path: users_dir, source }),
        };
        for name in names {
            let (serials, creds) = self.read_record("user", &name)?;
            let Some(dir) = creds.filter(|d| AuthDir::new(d).has(Role::Client)) else {
                users_elsewhere.push(name);
                continue;
            };
            let held = AuthDir::new(&dir);
            let cert = crate::read_pem_cert(&held.cert(Role::Client))?;
            let id = Identity::of(Some(&[cert])).filter(|id| serials.contains(&id.serial));
            let Some(id) = id else {
                users_elsewhere.push(name);
                continue;
            };
            let (pem, serial) = self.reissue(&id)?;
            crate::replace_file(&held.cert(Role::Client), pem.as_bytes(), 0o644)?;
            crate::replace_file(&held.ca_cert(), bundle.as_bytes(), 0o644)?;
            self.add_serial("user", &name, &serial)?;
            users.push((name, dir));
        }
        // Last: the head watches ca.pem, and reloads everything above when it changes.
        crate::replace_file(&self.ca_cert(), bundle.as_bytes(), 0o644)?;
        Ok(Rotated { fingerprint: self.ca_fingerprint()?, users, users_elsewhere })
    }

    /// `starling ca rotate --finish`: close the window; the previous CA's certificates are
    /// refused from now on.
    pub fn finish_rotation(&self) -> Result<(), IdentError> {
        let trust = self.trust()?;
        if !trust.window_open() {
            return Err(IdentError::NoRotation);
        }
        let trusted = pem_blocks(&self.ca_bundle()?);
        let retired = match std::fs::read_to_string(self.retired_cas()) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(source) => return Err(IdentError::Io { path: self.retired_cas(), source }),
        };
        let retired: String = pem_blocks(&retired).into_iter().chain(trusted[1..].iter().cloned()).collect();
        crate::replace_file(&self.retired_cas(), retired.as_bytes(), 0o644)?;
        crate::replace_file(&self.ca_cert(), trusted[0].as_bytes(), 0o644)?;
        Ok(())
    }

    /// A certificate of the current CA for the holder of `id`'s certificate: the same role,
    /// names and public key, a new serial (added to the holder's record). The certificate (PEM)
    /// and its serial.
    pub fn reissue(&self, id: &Identity) -> Result<(String, String), IdentError> {
        let ee = webpki::EndEntityCert::try_from(&id.cert).map_err(|_| IdentError::BadPublicKey)?;
        let key = P256PublicKey::from_spki(ee.subject_public_key_info().as_ref())?;
        let uris: Vec<String> = ee.valid_uri_names().map(str::to_string).collect();
        let params = match uris.first() {
            None => crate::shared_role_params(id.role)?,
            Some(first) => {
                let mut params = CertificateParams::new(vec![id.role.dns_name()]).map_err(AuthError::from)?;
                for uri in &uris {
                    params.subject_alt_names.push(SanType::URI(uri.as_str().try_into().map_err(AuthError::from)?));
                }
                params.distinguished_name = DistinguishedName::new();
                params.distinguished_name.push(DnType::CommonName, first.as_str());
                params.is_ca = IsCa::ExplicitNoCa;
                params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
                params
            }
        };
        let (pem, serial) = self.sign(params, &key)?;
        if let Some(host) = &id.host {
            if self.host_enrolled(host) {
                self.add_serial("host", host, &serial)?;
            }
        }
        Ok((pem, serial))
    }

    /// The agent's side of a re-issue: its new certificate and the CAs to trust, as the head
    /// sent them over their authenticated connection. Both replace this directory's only if the
    /// certificate certifies this directory's key and verifies against the first CA sent;
    /// `certificate: None` replaces only the CAs (at the end of a window).
    pub fn install(&self, role: Role, certificate: Option<&str>, ca: &str) -> Result<(), IdentError> {
        let bad = IdentError::BadCredentials;
        let cas = CertificateDer::pem_slice_iter(ca.as_bytes()).collect::<Result<Vec<_>, _>>().map_err(|_| bad("the CAs are not PEM certificates"))?;
        let current = cas.first().ok_or_else(|| bad("no CA"))?;
        if let Some(pem) = certificate {
            let cert = CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|_| bad("the certificate is not PEM"))?;
            let key = read_key(&self.key(role))?;
            let ee = webpki::EndEntityCert::try_from(&cert).map_err(|_| bad("the certificate does not parse"))?;
            if ee.subject_public_key_info().as_ref() != key.public_key_der().as_slice() {
                return Err(bad("the certificate is not for this host's key"));
            }
            if !signed_by(&cert, current) {
                return Err(bad("the certificate is not signed by the CA sent with it"));
            }
            crate::replace_file(&self.cert(role), pem.as_bytes(), 0o644)?;
        }
        crate::replace_file(&self.ca_cert(), ca.as_bytes(), 0o644)?;
        Ok(())
    }

    /// The CAs to trust, as holders get them (`ca.pem`).
    pub fn ca_bundle(&self) -> Result<String, IdentError> {
        std::fs::read_to_string(self.ca_cert()).map_err(io(&self.ca_cert()))
    }
}

fn read_key(path: &std::path::Path) -> Result<KeyPair, IdentError> {
    crate::need(path)?;
    let pem = std::fs::read_to_string(path).map_err(io(path))?;
    Ok(KeyPair::from_pem(&pem).map_err(AuthError::from)?)
}

/// The certificates of a PEM bundle as written (each up to and with its END line).
fn pem_blocks(text: &str) -> Vec<String> {
    const END: &str = "-----END CERTIFICATE-----";
    text.split_inclusive(END).filter(|b| b.contains(END)).map(|b| format!("{}\n", b.trim_start())).collect()
}

/// The fingerprint (SHA-256, hex) of a certificate, for logs.
pub fn fingerprint(cert: &CertificateDer<'_>) -> String {
    hex(&crate::ident::sha256(cert.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(pem: &str) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    }

    #[test]
    fn a_p256_spki_gives_back_its_point() {
        let key = KeyPair::generate().unwrap();
        let pk = P256PublicKey::from_spki(&key.public_key_der()).unwrap();
        assert_eq!(rcgen::PublicKeyData::der_bytes(&pk), key.public_key_raw());
        assert!(P256PublicKey::from_spki(&key.public_key_der()[1..]).is_err());
    }

    #[test]
    fn a_rotation_trusts_both_cas_until_finished_then_retires_the_old() {
        let t = tempfile::tempdir().unwrap();
        let a = AuthDir::new(t.path().join("auth"));
        a.init().unwrap();
        let alice = t.path().join("alice");
        a.add_user("alice", 1000, 1000, &[2001], &alice).unwrap();
        let old_alice = std::fs::read_to_string(AuthDir::new(&alice).cert(Role::Client)).unwrap();
        let old_head = crate::read_pem_cert(&a.cert(Role::Head)).unwrap();
        let before = a.trust().unwrap();
        assert_eq!(before.issuer(&old_head), Issuer::Current);

        let r = a.rotate_ca().unwrap();
        assert!(matches!(a.rotate_ca(), Err(IdentError::RotationOpen)));
        assert_eq!(r.users.len(), 1);
        let trust = a.trust().unwrap();
        assert_eq!(trust.trusted.len(), 2);
        assert_eq!(trust.trusted[1], before.trusted[0]);
        assert_eq!(fingerprint(&trust.trusted[0]), r.fingerprint);
        // Role certificates and the user's credentials are the new CA's; the old ones still pass.
        assert_eq!(trust.issuer(&crate::read_pem_cert(&a.cert(Role::Head)).unwrap()), Issuer::Current);
        assert_eq!(trust.issuer(&old_head), Issuer::Previous);
        let new_alice = std::fs::read_to_string(AuthDir::new(&alice).cert(Role::Client)).unwrap();
        assert_eq!(trust.issuer(&leaf(&new_alice)), Issuer::Current);
        assert_eq!(trust.issuer(&leaf(&old_alice)), Issuer::Previous);
        let id_new = Identity::of(Some(&[leaf(&new_alice)])).unwrap();
        assert_eq!(id_new.user, Identity::of(Some(&[leaf(&old_alice)])).unwrap().user);
        assert_eq!(id_new.user.unwrap().groups, [2001], "her groups are re-issued with her");
        assert_eq!(std::fs::read_to_string(AuthDir::new(&alice).ca_cert()).unwrap(), a.ca_bundle().unwrap());
        // Revoking alice revokes both her certificates.
        let (serials, _) = a.read_record("user", "alice").unwrap();
        assert_eq!(serials.len(), 2);

        a.finish_rotation().unwrap();
        assert!(matches!(a.finish_rotation(), Err(IdentError::NoRotation)));
        let after = a.trust().unwrap();
        assert_eq!(after.trusted, vec![trust.trusted[0].clone()]);
        assert_eq!(after.issuer(&leaf(&old_alice)), Issuer::Retired);
        assert_eq!(after.issuer(&leaf(&new_alice)), Issuer::Current);
        let other = AuthDir::new(t.path().join("other"));
        other.init().unwrap();
        assert_eq!(after.issuer(&crate::read_pem_cert(&other.cert(Role::Head)).unwrap()), Issuer::Unknown);
        a.revoke("user", "alice").unwrap();
        let revoked = a.revoked().unwrap();
        assert!(serials.iter().all(|s| revoked.contains(s)));
    }

    #[test]
    fn a_reissued_host_certificate_keeps_its_name_and_key_and_installs_only_for_its_key() {
        let t = tempfile::tempdir().unwrap();
        let a = AuthDir::new(t.path().join("auth"));
        a.init().unwrap();
        let node = AuthDir::new(t.path().join("node1"));
        a.issue_host_credentials("node1", &node.dir).unwrap();
        let old = Identity::of(Some(&[crate::read_pem_cert(&node.cert(Role::Agent)).unwrap()])).unwrap();
        a.rotate_ca().unwrap();
        let (pem, serial) = a.reissue(&old).unwrap();
        let new = Identity::of(Some(&[leaf(&pem)])).unwrap();
        assert_eq!((new.role, new.host.as_deref(), new.serial.as_str()), (Role::Agent, Some("node1"), serial.as_str()));
        assert_eq!(a.trust().unwrap().issuer(&new.cert), Issuer::Current);
        // Another host's key cannot take it.
        let node2 = AuthDir::new(t.path().join("node2"));
        a.issue_host_credentials("node2", &node2.dir).unwrap();
        assert!(matches!(node2.install(Role::Agent, Some(&pem), &a.ca_bundle().unwrap()), Err(IdentError::BadCredentials(_))));
        node.install(Role::Agent, Some(&pem), &a.ca_bundle().unwrap()).unwrap();
        assert_eq!(std::fs::read_to_string(node.cert(Role::Agent)).unwrap(), pem);
        // A TLS handshake between the re-issued host and a holder of the old CA only still works
        // during the window (the cross certificate), and with the new CA only.
        assert_eq!(a.read_record("host", "node1").unwrap().0.len(), 2);
    }

    /// The shared role certificates chain to either CA: through the cross certificate for a
    /// peer that trusts only the previous CA.
    #[tokio::test]
    async fn a_peer_trusting_only_the_previous_ca_still_verifies_the_head() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let t = tempfile::tempdir().unwrap();
        let a = AuthDir::new(t.path().join("auth"));
        a.init().unwrap();
        let old = AuthDir::new(t.path().join("old"));
        crate::create_private_dir(&old.dir).unwrap();
        for f in ["ca.pem", "agent.pem", "agent.key"] {
            std::fs::copy(a.dir.join(f), old.dir.join(f)).unwrap();
        }
        a.rotate_ca().unwrap();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let acceptor = a.head_acceptor().unwrap();
        let srv = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let mut tls = acceptor.accept(s).await.unwrap();
            let id = crate::ident::client_identity(&tls).unwrap();
            let mut b = [0u8; 2];
            tls.read_exact(&mut b).await.unwrap();
            id
        });
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut tls = old.connector(Role::Agent).unwrap().connect(crate::server_name(Role::Head), s).await.unwrap();
        tls.write_all(b"hi").await.unwrap();
        tls.flush().await.unwrap();
        let id = srv.await.unwrap();
        assert_eq!(a.trust().unwrap().issuer(&id.cert), Issuer::Previous);
    }
}
