//! Makes a cluster CA and node certificates (`kvrail certs init|node`), with rcgen.
//!
//! Keys are ECDSA P-256. Files: `ca.pem`, `ca.key`, `NODE.pem`, `NODE.key`; keys
//! are written with mode 0600.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

use crate::AuthError;

/// When a certificate is valid.
#[derive(Debug, Clone, Copy)]
pub struct Validity {
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
}

impl Validity {
    /// From an hour ago (clock skew) to `days` from now.
    pub fn days(days: i64) -> Validity {
        let now = OffsetDateTime::now_utc();
        Validity {
            not_before: now - Duration::hours(1),
            not_after: now + Duration::days(days),
        }
    }

    /// Expired yesterday (for tests of refusal).
    pub fn expired() -> Validity {
        let now = OffsetDateTime::now_utc();
        Validity {
            not_before: now - Duration::days(30),
            not_after: now - Duration::days(1),
        }
    }
}

fn write(path: &Path, contents: &str, secret: bool) -> Result<(), AuthError> {
    let io = |source| AuthError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(path)
        .map_err(io)?;
    f.write_all(contents.as_bytes()).map_err(io)
}

fn ca_params() -> Result<CertificateParams, AuthError> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "kvrail cluster CA");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let v = Validity::days(3650);
    params.not_before = v.not_before;
    params.not_after = v.not_after;
    Ok(params)
}

/// Creates `DIR/ca.pem` and `DIR/ca.key`; refuses to overwrite an existing CA.
pub fn ca(dir: &Path) -> Result<PathBuf, AuthError> {
    let cert_path = dir.join("ca.pem");
    if cert_path.exists() {
        return Err(AuthError::Pem {
            path: cert_path,
            what: "a CA already exists here; remove it to make a new cluster".into(),
        });
    }
    std::fs::create_dir_all(dir).map_err(|source| AuthError::Read {
        path: dir.to_path_buf(),
        source,
    })?;
    let key = KeyPair::generate()?;
    let cert = ca_params()?.self_signed(&key)?;
    write(&dir.join("ca.key"), &key.serialize_pem(), true)?;
    write(&cert_path, &cert.pem(), false)?;
    Ok(cert_path)
}

/// Creates `DIR/NODE.pem` and `DIR/NODE.key`, signed by the CA in `dir`.
pub fn node(dir: &Path, name: &str, validity: Validity) -> Result<PathBuf, AuthError> {
    crate::check_node_name(name).map_err(|what| AuthError::Pem {
        path: dir.to_path_buf(),
        what,
    })?;
    let ca_key_path = dir.join("ca.key");
    let ca_pem = std::fs::read_to_string(&ca_key_path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => AuthError::Pem {
            path: ca_key_path.clone(),
            what: format!(
                "no CA key here: run `kvrail certs init --dir {}` first",
                dir.display()
            ),
        },
        _ => AuthError::Read {
            path: ca_key_path.clone(),
            source,
        },
    })?;
    let ca_key = KeyPair::from_pem(&ca_pem)?;
    // The same subject and key as the stored CA certificate, so the issuer matches.
    let ca_cert = ca_params()?.self_signed(&ca_key)?;
    let mut params = CertificateParams::new(vec![name.to_string()])?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    // Every sidecar both dials (client) and accepts (server).
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.not_before = validity.not_before;
    params.not_after = validity.not_after;
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &ca_cert, &ca_key)?;
    let cert_path = dir.join(format!("{name}.pem"));
    write(&dir.join(format!("{name}.key")), &key.serialize_pem(), true)?;
    write(&cert_path, &cert.pem(), false)?;
    Ok(cert_path)
}

/// A new cluster in `dir`: its CA, and a certificate for each of `nodes`.
pub fn cluster(dir: &Path, nodes: &[&str], validity: Validity) -> Result<(), AuthError> {
    ca(dir)?;
    for name in nodes {
        node(dir, name, validity)?;
    }
    Ok(())
}
