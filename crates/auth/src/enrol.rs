//! Enrolling a host with a join token (`starling agent --join HEAD --token T`).
//!
//! The joining host knows only the token, `SECRET.FINGERPRINT`: a 32-byte
//! secret and the SHA-256 of the cluster CA's certificate (as kubeadm's
//! discovery hash). It dials the head's usual port with TLS and **no client
//! certificate**, accepting the head only if the head's chain holds a CA
//! certificate of that fingerprint and the head's certificate verifies
//! against it for the head's role name ([`PinnedCa`]). Over that connection:
//!
//! ```text
//! host → head   u32 BE length (≤ 16 KiB) | JSON {"token": hex secret, "host": NAME, "public_key": hex P-256 point}
//! head → host   u32 BE length (≤ 64 KiB) | JSON {"certificate": PEM, "ca": PEM} or {"refused": why}
//! ```
//!
//! The head checks the token (known, unused, not expired: [`AuthDir::enrol_host`]),
//! uses it up, and signs an agent certificate naming NAME for the public key;
//! the private key never leaves the host. A connection without a certificate
//! may do this and nothing else.

use crate::ident::{hex, sha256, unhex, IdentError, P256PublicKey};
use crate::{AuthDir, AuthError, Role};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const MAX_REQUEST: u32 = 16 << 10;
const MAX_REPLY: u32 = 64 << 10;

/// Why enrolling failed (on the joining host).
#[derive(Debug, thiserror::Error)]
pub enum EnrolError {
    #[error(transparent)]
    Ident(#[from] IdentError),
    #[error("enrolling with {head}: {source}")]
    Io { head: String, #[source] source: std::io::Error },
    #[error("the head {head} refused the enrolment: {why}")]
    Refused { head: String, why: String },
    #[error("the head {head} answered the enrolment with something else than a certificate: {why}")]
    BadReply { head: String, why: String },
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Request {
    token: String,
    host: String,
    public_key: String,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
enum Reply {
    Certificate { certificate: String, ca: String },
    Refused { refused: String },
}

/// A join token: its secret, and the fingerprint of the CA it belongs to.
struct Token {
    secret: Vec<u8>,
    fingerprint: [u8; 32],
}

impl std::str::FromStr for Token {
    type Err = IdentError;

    fn from_str(s: &str) -> Result<Token, IdentError> {
        let (secret, fp) = s.trim().split_once('.').ok_or(IdentError::MalformedToken)?;
        let secret = unhex(secret).filter(|s| s.len() == 32).ok_or(IdentError::MalformedToken)?;
        let fingerprint = unhex(fp).and_then(|f| <[u8; 32]>::try_from(f).ok()).ok_or(IdentError::MalformedToken)?;
        Ok(Token { secret, fingerprint })
    }
}

/// Accepts a server whose chain carries the CA certificate of a known
/// fingerprint and whose own certificate that CA signed for the name dialled:
/// ordinary WebPKI verification, with the root found by its fingerprint.
#[derive(Debug)]
struct PinnedCa {
    fingerprint: [u8; 32],
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for PinnedCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ca = intermediates.iter().find(|c| sha256(c.as_ref()) == self.fingerprint).ok_or_else(|| {
            rustls::Error::General("the head shows no CA certificate of the token's fingerprint (not this cluster's head, or another token)".into())
        })?;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.clone().into_owned())?;
        let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        webpki.verify_server_cert(end_entity, &[], server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

async fn write_record<W: AsyncWrite + Unpin, T: serde::Serialize>(w: &mut W, value: &T) -> std::io::Result<()> {
    let body = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(std::io::Error::other)?;
    w.write_all(&len.to_be_bytes()).await?;
    w.write_all(&body).await?;
    w.flush().await
}

async fn read_record<R: AsyncRead + Unpin, T: serde::de::DeserializeOwned>(r: &mut R, max: u32) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len);
    if len > max {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("a record of {len} bytes (at most {max})")));
    }
    let mut body = vec![0u8; usize::try_from(len).map_err(std::io::Error::other)?];
    r.read_exact(&mut body).await?;
    serde_json::from_slice(&body).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Enrol this host as `host` with the head at `head` (HOST:PORT) using
/// `token`, and write its credentials into `dir` (ca.pem, agent.pem,
/// agent.key; made 0700) for `starling agent --auth DIR`.
pub async fn join(head: &str, token: &str, host: &str, dir: &AuthDir) -> Result<(), EnrolError> {
    let token: Token = token.parse()?;
    let io = |source| EnrolError::Io { head: head.to_string(), source };
    let provider = crate::provider();
    let verifier = Arc::new(PinnedCa { fingerprint: token.fingerprint, provider: provider.clone() });
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(AuthError::from)
        .map_err(IdentError::from)?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    let sock = tokio::net::TcpStream::connect(head).await.map_err(io)?;
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(crate::server_name(Role::Head), sock).await.map_err(io)?;
    let key = rcgen::KeyPair::generate().map_err(AuthError::from).map_err(IdentError::from)?;
    let req = Request { token: hex(&token.secret), host: host.to_string(), public_key: hex(key.public_key_raw()) };
    write_record(&mut tls, &req).await.map_err(io)?;
    let bad = |why: String| EnrolError::BadReply { head: head.to_string(), why };
    let (certificate, ca) = match read_record::<_, Reply>(&mut tls, MAX_REPLY).await.map_err(io)? {
        Reply::Refused { refused } => return Err(EnrolError::Refused { head: head.to_string(), why: refused }),
        Reply::Certificate { certificate, ca } => (certificate, ca),
    };
    let ca_der = CertificateDer::from_pem_slice(ca.as_bytes()).map_err(|e| bad(format!("its CA certificate: {e}")))?;
    if sha256(ca_der.as_ref()) != token.fingerprint {
        return Err(bad("a CA certificate that is not the token's".into()));
    }
    let cert_der = CertificateDer::from_pem_slice(certificate.as_bytes()).map_err(|e| bad(format!("the certificate: {e}")))?;
    match crate::ident::Identity::of(Some(&[cert_der])) {
        Some(id) if id.role == Role::Agent && id.host.as_deref() == Some(host) => {}
        _ => return Err(bad(format!("a certificate that does not name host {host}"))),
    }
    crate::ident::write_credentials(&dir.dir, Role::Agent, ca.as_bytes(), &certificate, &key.serialize_pem())?;
    Ok(())
}

/// The head's side: one enrolment request on a TLS connection whose peer
/// showed no certificate. Returns the host enrolled, or why it was refused
/// (the peer was told the same).
pub async fn serve<S: AsyncRead + AsyncWrite + Unpin>(tls: &mut S, auth: &AuthDir) -> Result<String, String> {
    let req: Request = match read_record(tls, MAX_REQUEST).await {
        Ok(r) => r,
        Err(e) => {
            let why = format!(
                "a connection without a certificate of this cluster may only enrol a host (`starling agent --join HEAD --token T`): {e}"
            );
            let _ = write_record(tls, &Reply::Refused { refused: why.clone() }).await;
            return Err(why);
        }
    };
    let res = (|| {
        let secret = unhex(&req.token).filter(|s| s.len() == 32).ok_or(IdentError::MalformedToken)?;
        let key = P256PublicKey::from_raw(unhex(&req.public_key).ok_or(IdentError::BadPublicKey)?)?;
        let cert = auth.enrol_host(&req.host, Some(&secret), &key)?;
        let ca = std::fs::read_to_string(auth.ca_cert()).map_err(|source| IdentError::Io { path: auth.ca_cert(), source })?;
        Ok::<_, IdentError>((cert, ca))
    })();
    match res {
        Ok((certificate, ca)) => {
            write_record(tls, &Reply::Certificate { certificate, ca }).await.map_err(|e| format!("sending host {} its certificate: {e}", req.host))?;
            Ok(req.host)
        }
        Err(e) => {
            let why = format!("host {}: {e}", req.host);
            let _ = write_record(tls, &Reply::Refused { refused: why.clone() }).await;
            Err(why)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_host_enrols_over_tls_once_and_only_with_the_right_ca() {
        let t = tempfile::tempdir().unwrap();
        let a = AuthDir::new(t.path().join("auth"));
        a.init().unwrap();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let acceptor = a.head_acceptor().unwrap();
        let head = a.clone();
        tokio::spawn(async move {
            loop {
                let (s, _) = l.accept().await.unwrap();
                if let Ok(mut tls) = acceptor.accept(s).await {
                    let _ = serve(&mut tls, &head).await;
                }
            }
        });
        let token = a.create_token(std::time::Duration::from_secs(600)).unwrap();
        let host = AuthDir::new(t.path().join("node1"));
        join(&addr, &token, "node1", &host).await.unwrap();
        assert!(host.has(Role::Agent) && a.host_enrolled("node1"));
        // The token was used up.
        let again = join(&addr, &token, "node2", &AuthDir::new(t.path().join("node2"))).await;
        assert!(matches!(&again, Err(EnrolError::Refused { why, .. }) if why.contains("already used")), "{again:?}");
        // A token whose fingerprint is another CA's does not reach the head's check at all.
        let other = AuthDir::new(t.path().join("other"));
        other.init().unwrap();
        let (secret, _) = a.create_token(std::time::Duration::from_secs(600)).unwrap().split_once('.').map(|(s, f)| (s.to_string(), f.to_string())).unwrap();
        let forged = format!("{secret}.{}", other.ca_fingerprint().unwrap());
        let r = join(&addr, &forged, "node3", &AuthDir::new(t.path().join("node3"))).await;
        assert!(matches!(&r, Err(EnrolError::Io { source, .. }) if source.to_string().contains("fingerprint")), "{r:?}");
        assert!(!a.host_enrolled("node3"));
    }
}
