//! Who a kvrail sidecar is, and how it proves it to its peers.
//!
//! A cluster has one CA; each node has a certificate for its node name (a DNS
//! subject-alternative name) signed by that CA, valid for both TLS server and
//! client use, since every sidecar both dials and accepts. [`Identity`] loads a
//! node's files and builds the rustls configurations for mutually authenticated
//! QUIC, and signs and checks the challenges of the TCP handshake. [`generate`]
//! makes the files (`kvrail certs ...`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use rustls::client::danger::ServerCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, SignatureScheme};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

pub mod generate;

/// Longest node name (a DNS name's length; the wire allows as much).
pub const MAX_NODE_NAME_BYTES: usize = 253;

/// Checks a node name: it names the node's certificate files (`NAME.pem`,
/// `NAME.key` in the TLS directory) and its certificate's DNS name, so it is
/// 1 to 253 letters, digits, `-`, `_` and `.`, starting with a letter or
/// digit, and not `ca` (the cluster CA's files).
pub fn check_node_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NODE_NAME_BYTES {
        return Err(format!(
            "node name {name:?}: must be 1 to {MAX_NODE_NAME_BYTES} bytes"
        ));
    }
    if !name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(format!(
            "node name {name:?}: must start with a letter or a digit"
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!(
            "node name {name:?}: {c:?} is not allowed (letters, digits, '-', '_' and '.' only)"
        ));
    }
    if name.eq_ignore_ascii_case("ca") {
        return Err("node name \"ca\" is taken by the cluster CA's files".into());
    }
    Ok(())
}

/// SHA-256 of a certificate (DER), lower-case hex: what a membership record
/// or a pinned peer names (`sha256sum` of the DER file gives the same).
pub fn certificate_sha256(der: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, der)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// ALPN protocol of kvrail's QUIC connections.
pub const ALPN: &[u8] = b"kvrail/1";

/// Why an identity could not be loaded or a peer was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// A certificate or key file is missing or unreadable.
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file holds no usable PEM item of the kind needed.
    #[error("{path}: {what}")]
    Pem { path: PathBuf, what: String },
    /// Our own certificate does not name this node.
    #[error("certificate {path} is not valid for node name {node:?}: {reason}")]
    NotOurName {
        path: PathBuf,
        node: String,
        reason: String,
    },
    /// rustls refused the configuration (bad key, unsupported algorithm).
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    /// The peer's certificate chain, name or signature does not check out.
    #[error("peer {peer:?} not authenticated: {reason}")]
    Peer { peer: String, reason: String },
    /// Certificate generation failed.
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
}

/// Where a node's files live: `DIR/ca.pem`, `DIR/NODE.pem`, `DIR/NODE.key`.
#[derive(Debug, Clone)]
pub struct IdentityFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl IdentityFiles {
    /// The layout `kvrail certs` writes.
    pub fn in_dir(dir: &Path, node: &str) -> IdentityFiles {
        IdentityFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{node}.pem")),
            key: dir.join(format!("{node}.key")),
        }
    }
}

/// One node's identity: its certificate chain and key, and the cluster CA it trusts.
#[derive(Debug, Clone)]
pub struct Identity {
    node: String,
    chain: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
    roots: Arc<RootCertStore>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

fn read(path: &Path) -> Result<Vec<u8>, AuthError> {
    std::fs::read(path).map_err(|source| AuthError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn certs_of(path: &Path) -> Result<Vec<CertificateDer<'static>>, AuthError> {
    let pem = read(path)?;
    let certs = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| AuthError::Pem {
            path: path.to_path_buf(),
            what: format!("malformed PEM: {e}"),
        })?;
    if certs.is_empty() {
        return Err(AuthError::Pem {
            path: path.to_path_buf(),
            what: "no CERTIFICATE in it".into(),
        });
    }
    Ok(certs)
}

/// Checks that `cert` (DER) is valid for `name`; the reason if not.
pub fn check_name(cert: &[u8], name: &str) -> Result<(), String> {
    let der = CertificateDer::from(cert);
    let ee = webpki::EndEntityCert::try_from(&der).map_err(|e| format!("unparsable: {e}"))?;
    let server_name =
        ServerName::try_from(name).map_err(|_| format!("{name:?} is not a DNS name"))?;
    ee.verify_is_valid_for_subject_name(&server_name)
        .map_err(|e| format!("certificate is not for {name:?} ({e})"))
}

/// ring's provider with AES-128-GCM preferred: QUIC encrypts every packet, and
/// AES-128 (10 rounds) costs less CPU per byte than the default first choice,
/// AES-256 (14 rounds), at a security level TLS 1.3 requires every peer to accept.
fn provider() -> rustls::crypto::CryptoProvider {
    use rustls::crypto::ring::cipher_suite;
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites = vec![
        cipher_suite::TLS13_AES_128_GCM_SHA256,
        cipher_suite::TLS13_AES_256_GCM_SHA384,
        cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
    ];
    provider
}

impl Identity {
    /// Loads `files` for `node` and checks that its certificate names it.
    pub fn load(node: &str, files: &IdentityFiles) -> Result<Identity, AuthError> {
        let provider = Arc::new(provider());
        let mut roots = RootCertStore::empty();
        for ca in certs_of(&files.ca)? {
            roots.add(ca).map_err(|e| AuthError::Pem {
                path: files.ca.clone(),
                what: format!("not a usable CA certificate: {e}"),
            })?;
        }
        let chain = certs_of(&files.cert)?;
        let key_pem = read(&files.key)?;
        let key = rustls_pemfile::private_key(&mut key_pem.as_slice())
            .map_err(|e| AuthError::Pem {
                path: files.key.clone(),
                what: format!("malformed PEM: {e}"),
            })?
            .ok_or_else(|| AuthError::Pem {
                path: files.key.clone(),
                what: "no PRIVATE KEY in it".into(),
            })?;
        check_name(&chain[0], node).map_err(|reason| AuthError::NotOurName {
            path: files.cert.clone(),
            node: node.to_string(),
            reason,
        })?;
        let identity = Identity {
            node: node.to_string(),
            chain,
            key: Arc::new(key),
            roots: Arc::new(roots),
            provider,
        };
        // Fail at startup, not at the first peer, on a key rustls cannot use.
        identity.server_config()?;
        Ok(identity)
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Our end-entity certificate (DER), sent in the TCP handshake.
    pub fn certificate(&self) -> &[u8] {
        &self.chain[0]
    }

    /// TLS server side: our certificate; peers must present one from our CA.
    pub fn server_config(&self) -> Result<rustls::ServerConfig, AuthError> {
        let verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), self.provider.clone())
                .build()
                .map_err(|e| rustls::Error::General(e.to_string()))?;
        let mut config = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }

    /// TLS client side: the server must prove the name we dial (the peer's node
    /// name) with a certificate from our CA; we present ours.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, AuthError> {
        let mut config = rustls::ClientConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }

    /// Signs `message` with our key (the TCP handshake's challenge answer).
    pub fn sign(&self, message: &[u8]) -> Result<Vec<u8>, AuthError> {
        let key = self
            .provider
            .key_provider
            .load_private_key(self.key.clone_key())?;
        let signer = key
            .choose_scheme(&[
                SignatureScheme::ECDSA_NISTP256_SHA256,
                SignatureScheme::ED25519,
                SignatureScheme::RSA_PSS_SHA256,
            ])
            .ok_or_else(|| {
                rustls::Error::General("no usable signature scheme for our key".into())
            })?;
        Ok(signer.sign(message)?)
    }

    /// Checks that `cert` chains to our CA, is valid now, names `peer`, and made
    /// `signature` over `message`.
    pub fn verify_peer(
        &self,
        peer: &str,
        cert: &[u8],
        message: &[u8],
        signature: &[u8],
    ) -> Result<(), AuthError> {
        self.verify_certificate(peer, cert)?;
        self.verify_signature(peer, cert, message, signature)
    }

    /// Checks that the key of `cert` (already checked with
    /// [`Identity::verify_certificate`]) made `signature` over `message`.
    pub fn verify_signature(
        &self,
        peer: &str,
        cert: &[u8],
        message: &[u8],
        signature: &[u8],
    ) -> Result<(), AuthError> {
        let fail = |reason: String| AuthError::Peer {
            peer: peer.to_string(),
            reason,
        };
        let der = CertificateDer::from(cert);
        let ee = webpki::EndEntityCert::try_from(&der).map_err(|e| fail(e.to_string()))?;
        let algs = self.provider.signature_verification_algorithms.all;
        if algs
            .iter()
            .any(|alg| ee.verify_signature(*alg, message, signature).is_ok())
        {
            Ok(())
        } else {
            Err(fail("signature does not match its certificate".into()))
        }
    }

    /// Checks that `cert` chains to our CA, is valid now and names `peer`.
    pub fn verify_certificate(&self, peer: &str, cert: &[u8]) -> Result<(), AuthError> {
        let fail = |reason: String| AuthError::Peer {
            peer: peer.to_string(),
            reason,
        };
        let der = CertificateDer::from(cert.to_vec());
        let name = ServerName::try_from(peer)
            .map_err(|_| fail(format!("{peer:?} is not a DNS name")))?
            .to_owned();
        // The same chain, validity and name checks as a TLS client makes.
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            self.roots.clone(),
            self.provider.clone(),
        )
        .build()
        .map_err(|e| fail(e.to_string()))?;
        let now = UnixTime::since_unix_epoch(
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default(),
        );
        verifier
            .verify_server_cert(&der, &[], &name, &[], now)
            .map_err(|e| fail(format!("certificate: {e}")))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn node_names_are_file_and_dns_safe() {
        for ok in ["prefill", "decode-0", "node_a.rack1", "7"] {
            assert!(super::check_node_name(ok).is_ok(), "{ok}");
        }
        let long = "a".repeat(super::MAX_NODE_NAME_BYTES + 1);
        for bad in [
            "",
            "ca",
            "CA",
            "../evil",
            "a/b",
            ".hidden",
            "-x",
            "a b",
            long.as_str(),
        ] {
            assert!(super::check_node_name(bad).is_err(), "{bad}");
        }
    }
    use super::*;
    use crate::generate::{self, Validity};

    fn cluster(dir: &Path, nodes: &[&str]) -> Vec<Identity> {
        generate::cluster(dir, nodes, Validity::days(30)).unwrap();
        nodes
            .iter()
            .map(|n| Identity::load(n, &IdentityFiles::in_dir(dir, n)).unwrap())
            .collect()
    }

    #[test]
    fn a_signed_challenge_checks_out_only_for_the_right_name_and_message() {
        let dir = tempfile::tempdir().unwrap();
        let ids = cluster(dir.path(), &["prefill", "decode"]);
        let sig = ids[0].sign(b"nonce").unwrap();
        ids[1]
            .verify_peer("prefill", ids[0].certificate(), b"nonce", &sig)
            .unwrap();
        let wrong_name = ids[1].verify_peer("decode", ids[0].certificate(), b"nonce", &sig);
        assert!(
            matches!(wrong_name, Err(AuthError::Peer { .. })),
            "{wrong_name:?}"
        );
        let wrong_msg = ids[1].verify_peer("prefill", ids[0].certificate(), b"other", &sig);
        assert!(wrong_msg.unwrap_err().to_string().contains("signature"));
    }

    #[test]
    fn another_ca_or_an_expired_certificate_is_refused() {
        let ours = tempfile::tempdir().unwrap();
        let theirs = tempfile::tempdir().unwrap();
        let us = cluster(ours.path(), &["decode"]);
        let stranger = cluster(theirs.path(), &["prefill"]);
        let sig = stranger[0].sign(b"n").unwrap();
        let e = us[0]
            .verify_peer("prefill", stranger[0].certificate(), b"n", &sig)
            .unwrap_err();
        assert!(e.to_string().contains("certificate"), "{e}");

        generate::node(ours.path(), "old", Validity::expired()).unwrap();
        let old = Identity::load("old", &IdentityFiles::in_dir(ours.path(), "old")).unwrap();
        let sig = old.sign(b"n").unwrap();
        let e = us[0]
            .verify_peer("old", old.certificate(), b"n", &sig)
            .unwrap_err();
        assert!(e.to_string().to_lowercase().contains("expired"), "{e}");
    }

    #[test]
    fn a_certificate_for_another_node_does_not_load() {
        let dir = tempfile::tempdir().unwrap();
        cluster(dir.path(), &["prefill"]);
        let mut files = IdentityFiles::in_dir(dir.path(), "prefill");
        files.key = dir.path().join("prefill.key");
        let e = Identity::load("decode", &files).unwrap_err();
        assert!(matches!(e, AuthError::NotOurName { .. }), "{e}");
        let e = Identity::load("x", &IdentityFiles::in_dir(dir.path(), "x")).unwrap_err();
        assert!(matches!(e, AuthError::Read { .. }), "{e}");
    }
}
