//! TLS for the store: the certificate files of [`RedisOptions`], checked
//! before connecting so that a wrong file is named rather than met as a
//! failed handshake, and what a failed handshake means, in the user's
//! terms.

use std::path::Path;
use std::sync::Arc;

use ratewarden_core::{StoreError, StoreErrorKind};
use redis::{ClientTlsConfig, TlsCertificates};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::RootCertStore;

use crate::RedisOptions;

/// Whether `url` connects over TLS (`rediss://`, `rediss-cluster://`).
pub(crate) fn is_tls_url(url: &str) -> bool {
    url.starts_with("rediss://") || url.starts_with("rediss-cluster://")
}

fn invalid(what: String) -> StoreError {
    StoreError::new(StoreErrorKind::InvalidInput, what)
}

/// The certificates a connection to `url` is made with: `None` for the
/// client's defaults (the system's roots, no client certificate), and
/// always `None` without TLS.
///
/// Errors, each naming what to change: a TLS file given for a URL without
/// TLS (it would be ignored, and the link left plain); a file that cannot
/// be read, or holds no certificate (or no key, or an encrypted one); a CA
/// certificate that cannot be a trust anchor; a key that is not the client
/// certificate's; a certificate without its key or the other way round;
/// and the system's roots failing to load (the client loads them for every
/// TLS connection, even one given `tls_ca_file`, and fails on them).
pub(crate) fn certificates(
    options: &RedisOptions,
    url: &str,
) -> Result<Option<TlsCertificates>, StoreError> {
    let given = [
        ("tls_ca_file", &options.tls_ca_file),
        ("tls_cert_file", &options.tls_cert_file),
        ("tls_key_file", &options.tls_key_file),
    ];
    if !is_tls_url(url) {
        let Some((name, _)) = given.iter().find(|(_, file)| file.is_some()) else {
            return Ok(None);
        };
        let instead = if url.starts_with("redis-cluster://") {
            "write rediss-cluster:// for a cluster over TLS"
        } else if url.starts_with("redis+unix://") || url.starts_with("unix://") {
            "a Unix socket takes no TLS"
        } else {
            "write rediss:// for a TLS connection"
        };
        return Err(invalid(format!(
            "{name} is given, but the URL does not use TLS, so the link would stay plain: \
             {instead}, or leave {name} out"
        )));
    }
    system_roots()?;
    let root_cert = match &options.tls_ca_file {
        Some(path) => {
            let (pem, found) = certificate_file("tls_ca_file", path)?;
            let mut roots = RootCertStore::empty();
            for certificate in found {
                roots.add(certificate).map_err(|e| {
                    invalid(format!(
                        "tls_ca_file {:?} holds a certificate that cannot be a trust anchor \
                         ({e}); name the CA's own certificate",
                        path.display()
                    ))
                })?;
            }
            Some(pem)
        }
        None => None,
    };
    let client_tls = match (&options.tls_cert_file, &options.tls_key_file) {
        (Some(cert), Some(key)) => Some(client_pair(cert, key)?),
        (None, None) => None,
        (Some(_), None) => {
            return Err(invalid(
                "tls_cert_file is given without tls_key_file: a client certificate needs its \
                 private key; give both, or neither"
                    .to_owned(),
            ))
        }
        (None, Some(_)) => {
            return Err(invalid(
                "tls_key_file is given without tls_cert_file: give the client certificate \
                 with its key, or neither"
                    .to_owned(),
            ))
        }
    };
    if client_tls.is_none() && root_cert.is_none() {
        return Ok(None);
    }
    Ok(Some(TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// The system's roots, as the client loads them for each TLS connection:
/// from the platform, or from the files the environment variables
/// `SSL_CERT_FILE` and `SSL_CERT_DIR` name. A failure there fails every
/// TLS connection, whatever `tls_ca_file` says, so it is said here, naming
/// the variables, rather than as a dropped connection or an untrusted
/// server.
fn system_roots() -> Result<(), StoreError> {
    let loaded = rustls_native_certs::load_native_certs();
    let cause = match loaded.errors.first() {
        Some(e) => Some(e.to_string()),
        None => {
            let mut roots = RootCertStore::empty();
            loaded
                .certs
                .into_iter()
                .find_map(|c| roots.add(c).err())
                .map(|e| format!("a certificate among them cannot be used: {e}"))
        }
    };
    match cause {
        Some(cause) => Err(invalid(format!(
            "the system's CA certificates cannot be loaded ({cause}); every TLS connection \
             reads them, even one given tls_ca_file: fix or unset the environment variables \
             SSL_CERT_FILE and SSL_CERT_DIR if they are set, else the system's certificate \
             store"
        ))),
        None => Ok(()),
    }
}

/// Reads `path`, naming the option `name` when it cannot be read.
fn read(name: &str, path: &Path) -> Result<Vec<u8>, StoreError> {
    std::fs::read(path).map_err(|e| {
        invalid(format!(
            "{name} {:?} cannot be read: {e}; name a readable PEM file",
            path.display()
        ))
    })
}

/// The PEM text of a file of certificates, and the certificates in it.
fn certificate_file(
    name: &str,
    path: &Path,
) -> Result<(Vec<u8>, Vec<CertificateDer<'static>>), StoreError> {
    let pem = read(name, path)?;
    match CertificateDer::pem_slice_iter(&pem).collect::<Result<Vec<_>, _>>() {
        Ok(found) if !found.is_empty() => Ok((pem, found)),
        _ => Err(invalid(format!(
            "{name} {:?} holds no readable PEM certificate (-----BEGIN CERTIFICATE-----); \
             name the certificate's file",
            path.display()
        ))),
    }
}

/// The client certificate and its key, checked to belong together.
fn client_pair(cert: &Path, key: &Path) -> Result<ClientTlsConfig, StoreError> {
    let (client_cert, chain) = certificate_file("tls_cert_file", cert)?;
    let client_key = read("tls_key_file", key)?;
    let private = PrivateKeyDer::from_pem_slice(&client_key).map_err(|_| {
        let encrypted = String::from_utf8_lossy(&client_key).contains("ENCRYPTED");
        invalid(if encrypted {
            format!(
                "tls_key_file {:?} is encrypted, which is not supported: write it without a \
                 passphrase (openssl pkcs8 -in KEY -out PLAIN_KEY) and keep that file private",
                key.display()
            )
        } else {
            format!(
                "tls_key_file {:?} holds no readable PEM private key (-----BEGIN PRIVATE \
                 KEY-----, or an RSA or EC one); name the key's file",
                key.display()
            )
        })
    })?;
    // The check the client makes when it connects, made now so that a
    // mismatch names both files.
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(format!("TLS cannot be set up here: {e}")))?
        .with_root_certificates(RootCertStore::empty())
        .with_client_auth_cert(chain, private)
        .map_err(|e| {
            invalid(format!(
                "tls_key_file {:?} is not the private key of the certificate in tls_cert_file \
                 {:?} ({e}); give the key made with that certificate",
                key.display(),
                cert.display()
            ))
        })?;
    Ok(ClientTlsConfig {
        client_cert,
        client_key,
    })
}

/// What to change when connecting to the node at `address` failed in TLS,
/// from the client's error `text`; `None` for any other failure. `ca_file`:
/// a `tls_ca_file` was given (so the system's roots are not used);
/// `cluster`: the URL is a cluster's.
pub(crate) fn handshake_error(
    text: &str,
    address: &str,
    ca_file: bool,
    cluster: bool,
) -> Option<String> {
    let certificate = format!("the TLS certificate of Redis at {address}");
    let why = if text.contains("NotValidForName") || text.contains("not valid for name") {
        let announced = if cluster {
            " (on a cluster, each node's certificate must hold the address it announces in \
             CLUSTER SLOTS: its IP, unless cluster-preferred-endpoint-type is hostname)"
        } else {
            ""
        };
        format!(
            "{certificate} is not for that host ({text}): connect by a name or address the \
             certificate holds{announced}"
        )
    } else if ["Expired", "expired", "NotValidYet", "not valid yet"]
        .iter()
        .any(|w| text.contains(w))
    {
        format!(
            "{certificate} is out of its dates ({text}): renew it on Redis's side, or check \
             this machine's clock"
        )
    } else if text.contains("UnknownIssuer") || text.contains("BadSignature") {
        if ca_file {
            format!(
                "{certificate} is not signed by the CA in tls_ca_file ({text}): give the CA \
                 that signed it"
            )
        } else {
            format!(
                "{certificate} is not trusted ({text}): give the PEM file of the CA that \
                 signed it as tls_ca_file (in the [redis] table of `ratewarden serve`'s \
                 configuration), or name a bundle holding it in the environment variable \
                 SSL_CERT_FILE"
            )
        }
    } else if text.contains("invalid peer certificate") {
        format!("{certificate} was refused ({text})")
    } else if text.contains("CertificateRequired") {
        format!(
            "Redis at {address} asks for a client certificate (tls-auth-clients): give its PEM \
             file as tls_cert_file and its key as tls_key_file (in `ratewarden serve`, under \
             [redis])"
        )
    } else if text.contains("received fatal alert: BadCertificate")
        || text.contains("received fatal alert: UnknownCA")
        || text.contains("received fatal alert: DecryptError")
    {
        format!(
            "Redis at {address} refused the client certificate ({text}): give one signed by a \
             CA that its tls-ca-cert-file trusts, as tls_cert_file and tls_key_file"
        )
    } else {
        return None;
    };
    Some(why)
}
