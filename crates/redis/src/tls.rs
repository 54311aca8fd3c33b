//! TLS for the store: the certificate files of [`RedisOptions`], checked
//! before connecting so that a wrong file is named rather than met as a
//! failed handshake, and what a failed handshake means, in the user's
//! terms.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

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

/// Checks the TLS files of `options` for a connection to `url` as
/// connecting does (see [`RedisStore::connect`](crate::RedisStore::connect)),
/// without connecting: a caller that takes the files from a setting of its
/// own can name that setting in the error.
pub fn check_tls_files(url: &str, options: &RedisOptions) -> Result<(), StoreError> {
    certificates(options, url).map(|_| ())
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
    system_roots(options.tls_ca_file.is_none())?;
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

/// The certificates a store's new connections are made with: the files of
/// its options, read again for each one (a connection replacing one that
/// timed out or failed its TLS handshake), so that a CA or client
/// certificate replaced on disk under the same name takes effect without a
/// restart. Files that cannot be used at that moment (caught while being
/// rewritten, or a new key beside the old certificate) leave the last
/// certificates read in use, with a warning: a connection that may still
/// work is not given up for them.
pub(crate) struct CertificateFiles {
    /// The options' TLS files, and nothing else of them.
    files: RedisOptions,
    /// The URL, without its credentials: read for its scheme only.
    url: String,
    /// The certificates read last that could be used.
    last: Mutex<Option<TlsCertificates>>,
}

impl CertificateFiles {
    /// The files of `options` for `url`, whose certificates were just read
    /// as `read` (by [`certificates`]).
    pub(crate) fn new(
        options: &RedisOptions,
        url: &str,
        read: Option<TlsCertificates>,
    ) -> CertificateFiles {
        CertificateFiles {
            files: RedisOptions {
                tls_ca_file: options.tls_ca_file.clone(),
                tls_cert_file: options.tls_cert_file.clone(),
                tls_key_file: options.tls_key_file.clone(),
                ..RedisOptions::default()
            },
            url: crate::redact_url(url),
            last: Mutex::new(read),
        }
    }

    /// The certificates for a new connection, read from the files now; the
    /// last ones read, with a warning, when the files cannot be used.
    pub(crate) fn read_again(&self) -> Option<TlsCertificates> {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        match certificates(&self.files, &self.url) {
            Ok(now) => *last = now,
            Err(e) => tracing::warn!(
                "a new connection to {} is made with the TLS certificates read before: the \
                 files cannot be used now ({})",
                self.url,
                e.detail()
            ),
        }
        last.clone()
    }
}

/// The environment variables that replace the platform's roots with
/// files, and their values, when set.
fn root_variables() -> Vec<(&'static str, String)> {
    ["SSL_CERT_FILE", "SSL_CERT_DIR"]
        .into_iter()
        .filter_map(|name| Some((name, std::env::var(name).ok()?)))
        .filter(|(_, value)| !value.is_empty())
        .collect()
}

/// The system's roots, as the client loads them for each TLS connection:
/// from the platform, or from the files the environment variables
/// `SSL_CERT_FILE` and `SSL_CERT_DIR` name. A failure there fails every
/// TLS connection, whatever `tls_ca_file` says, so it is said here, naming
/// the variables, rather than as a dropped connection or an untrusted
/// server. When they are the roots Redis's certificate is checked against
/// (`only_roots`: no `tls_ca_file`), variables naming files that hold no
/// certificate (a DER file, an empty one, an empty folder) are refused too,
/// since no server could then be trusted.
fn system_roots(only_roots: bool) -> Result<(), StoreError> {
    let loaded = rustls_native_certs::load_native_certs();
    let variables = root_variables();
    let cause = match loaded.errors.first() {
        Some(e) => Some(e.to_string()),
        None if only_roots && loaded.certs.is_empty() && !variables.is_empty() => {
            let named: Vec<String> = variables
                .iter()
                .map(|(name, value)| format!("{name}={value:?}"))
                .collect();
            return Err(invalid(format!(
                "{} holds no PEM certificate (-----BEGIN CERTIFICATE-----), so no Redis \
                 certificate could be trusted: name a PEM bundle there (a DER file converts \
                 with openssl x509 -inform DER -in FILE -out FILE.pem), or unset it to use \
                 the system's certificates",
                named.join(" with ")
            )));
        }
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

/// How many PEM certificates the file at `path` holds; `None` when it
/// cannot be read.
fn pem_certificates(path: &Path) -> Option<usize> {
    let pem = std::fs::read(path).ok()?;
    Some(
        CertificateDer::pem_slice_iter(&pem)
            .filter(Result::is_ok)
            .count(),
    )
}

/// Reads `path`, naming the option `name` when it cannot be read.
fn read(name: &str, path: &Path) -> Result<Vec<u8>, StoreError> {
    std::fs::read(path).map_err(|e| {
        let tilde = if path.starts_with("~") {
            " (a leading ~ is not read as the home folder: write the whole path)"
        } else {
            ""
        };
        invalid(format!(
            "{name} {:?} cannot be read: {e}; name a readable PEM file{tilde}",
            path.display()
        ))
    })
}

/// What a file that holds no readable PEM certificate holds instead, in
/// words that say what to change; empty when it is nothing recognisable.
fn instead_of_certificate(name: &str, path: &Path, bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    if text.contains("PRIVATE KEY-----") && name == "tls_cert_file" {
        format!(
            ": it holds a private key (are tls_cert_file and tls_key_file swapped? {name} \
             takes the certificate)"
        )
    } else if text.contains("PRIVATE KEY-----") {
        format!(": it holds a private key, where {name} takes a certificate")
    } else if bytes.first() == Some(&0x30) {
        // DER starts with a SEQUENCE's tag.
        format!(
            ": it looks like DER, not PEM (convert it: openssl x509 -inform DER -in {0:?} \
             -out {0:?}.pem)",
            path.display()
        )
    } else {
        String::new()
    }
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
            "{name} {:?} holds no readable PEM certificate (-----BEGIN CERTIFICATE-----){}; \
             name the certificate's file",
            path.display(),
            instead_of_certificate(name, path, &pem),
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
                 passphrase (openssl pkey -in KEY -out PLAIN_KEY) and keep that file private",
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
            let (key, cert) = (key.display(), cert.display());
            invalid(match e {
                rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
                    format!(
                        "tls_key_file {key:?} is not the private key of the certificate in \
                         tls_cert_file {cert:?} ({e}); give the key made with that certificate \
                         (a chain in tls_cert_file lists the client's own certificate first)"
                    )
                }
                e if e.to_string().contains("UnsupportedCertVersion") => format!(
                    "tls_cert_file {cert:?} holds an X.509 version 1 certificate ({e}), which \
                     TLS here does not take: issue it as version 3 (openssl x509 -req makes \
                     version 3 when given -extfile with extendedKeyUsage = clientAuth)"
                ),
                e => format!(
                    "tls_cert_file {cert:?} and tls_key_file {key:?} cannot be used as a client \
                     certificate ({e}); give a PEM certificate and the key made with it"
                ),
            })
        })?;
    Ok(ClientTlsConfig {
        client_cert,
        client_key,
    })
}

/// Where a program gives the store's TLS files: `what` names them.
fn given_as(what: &str) -> String {
    format!("as {what} (under [redis] in `ratewarden serve`'s configuration, or in RedisOptions)")
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
    // An alert from Redis: it refused this client's certificate (or its
    // lack of one), whatever it thought of the rest.
    if let Some((_, alert)) = text.split_once("received fatal alert: ") {
        let alert = alert.split(|c: char| !c.is_ascii_alphanumeric()).next()?;
        let why = match alert {
            "CertificateRequired" => {
                return Some(format!(
                    "Redis at {address} asks for a client certificate (tls-auth-clients): give \
                     its PEM file and its key {}; `ratewarden vectors` shows none, so run it \
                     against a Redis with tls-auth-clients no or optional",
                    given_as("tls_cert_file and tls_key_file")
                ))
            }
            "CertificateExpired" => {
                "it is out of its dates: renew it, or check this machine's clock".to_owned()
            }
            "UnsupportedCertificate" => "its key usages do not allow a client certificate: \
                 issue it with extendedKeyUsage = clientAuth"
                .to_owned(),
            "CertificateRevoked" => "it is revoked: issue a new one".to_owned(),
            "BadCertificate" | "UnknownCA" | "DecryptError" | "CertificateUnknown" => format!(
                "give one signed by a CA that its tls-ca-cert-file trusts (followed, in the \
                 same file, by any intermediate CA's certificate) {}",
                given_as("tls_cert_file and tls_key_file")
            ),
            _ => return None,
        };
        return Some(format!(
            "Redis at {address} refused the client certificate ({text}): {why}"
        ));
    }
    let certificate = format!("the TLS certificate of Redis at {address}");
    let address_hint = if cluster {
        " (on a cluster, each node's certificate must hold the address it announces in \
         CLUSTER SLOTS: its IP, unless cluster-preferred-endpoint-type is hostname)"
    } else {
        ""
    };
    let why = if text.contains("UnsupportedCertVersion") {
        format!(
            "{certificate} is an X.509 version 1 certificate ({text}), which TLS here does not \
             take: issue it as version 3, with a subjectAltName for the address in the URL \
             (openssl x509 -req makes version 3 when given -extfile with subjectAltName = \
             IP:ADDRESS or DNS:NAME){address_hint}"
        )
    } else if text.contains("not valid for any names") {
        format!(
            "{certificate} holds no subjectAltName ({text}); the name in its CN is not read: \
             issue it with a subjectAltName for the address in the URL (IP:ADDRESS or \
             DNS:NAME){address_hint}"
        )
    } else if text.contains("NotValidForName") || text.contains("not valid for name") {
        format!(
            "{certificate} is not for that host ({text}): connect by a name or address the \
             certificate holds{address_hint}"
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
        let variables = root_variables();
        if ca_file {
            format!(
                "{certificate} is not signed by the CA in tls_ca_file ({text}): give the CA \
                 that signed it"
            )
        } else if let Some((name, value)) = variables.first() {
            // A bundle of no PEM certificate beside a folder that has some
            // passes the start-up check, and explains the refusal.
            let empty = *name == "SSL_CERT_FILE" && pem_certificates(Path::new(value)) == Some(0);
            let held = if empty {
                format!(
                    "{name}={value:?} holds no PEM certificate (a DER file converts with \
                     openssl x509 -inform DER -in FILE -out FILE.pem); name a PEM bundle \
                     holding the CA that signed it there"
                )
            } else {
                format!(
                    "no CA certificate in {name}={value:?} signed it; add the CA that did there"
                )
            };
            format!(
                "{certificate} is not trusted ({text}): {held}, or give its PEM file {}",
                given_as("tls_ca_file")
            )
        } else {
            format!(
                "{certificate} is not trusted ({text}): give the PEM file of the CA that \
                 signed it {}, or name a bundle holding it in the environment variable \
                 SSL_CERT_FILE",
                given_as("tls_ca_file")
            )
        }
    } else if text.contains("invalid peer certificate") {
        format!("{certificate} was refused ({text})")
    } else {
        return None;
    };
    Some(why)
}

#[cfg(test)]
mod tests {
    use super::{handshake_error, CertificateFiles};
    use crate::test_support::TestCerts;
    use crate::RedisOptions;

    #[test]
    fn handshake_failures_say_whose_certificate_and_what_to_change() {
        let at = "127.0.0.1:6380";
        // (the client's error, words the message holds)
        let cases: [(&str, &[&str]); 8] = [
            (
                "invalid peer certificate: Other(OtherError(UnsupportedCertVersion))",
                &["Redis at 127.0.0.1:6380", "version 1", "version 3"],
            ),
            (
                "invalid peer certificate: certificate not valid for name \"127.0.0.1\"; \
                 certificate is not valid for any names (according to its subjectAltName \
                 extension)",
                &["holds no subjectAltName", "CN is not read", "IP:ADDRESS"],
            ),
            (
                "invalid peer certificate: Expired",
                &["TLS certificate of Redis", "renew it on Redis's side"],
            ),
            // Redis refusing ours, never said to be Redis's own.
            (
                "received fatal alert: CertificateExpired",
                &["refused the client certificate", "out of its dates"],
            ),
            (
                "received fatal alert: UnsupportedCertificate",
                &["refused the client certificate", "clientAuth"],
            ),
            (
                "received fatal alert: UnknownCA",
                &["refused the client certificate", "intermediate"],
            ),
            (
                "received fatal alert: CertificateRequired",
                &[
                    "asks for a client certificate",
                    "RedisOptions",
                    "ratewarden vectors",
                ],
            ),
            (
                "invalid peer certificate: UnknownIssuer",
                &["not signed by the CA in tls_ca_file"],
            ),
        ];
        for (text, words) in cases {
            let message = handshake_error(text, at, true, false).expect(text);
            for word in words {
                assert!(message.contains(word), "`{word}` not in: {message}");
            }
            assert!(!message.contains("renew it on Redis's side") || !text.contains("alert"));
        }
        assert_eq!(
            handshake_error("Connection refused", at, false, false),
            None
        );
        assert_eq!(
            handshake_error("received fatal alert: NoRenegotiation", at, false, false),
            None
        );
    }

    /// The client certificate of `read`, as PEM.
    fn client_certificate(read: Option<redis::TlsCertificates>) -> Vec<u8> {
        read.and_then(|c| c.client_tls)
            .expect("a client certificate")
            .client_cert
    }

    #[test]
    fn files_are_read_again_and_the_last_usable_ones_kept() {
        let first = TestCerts::new();
        let dir = tempfile::tempdir().unwrap();
        let options = RedisOptions {
            tls_cert_file: Some(dir.path().join("client.crt")),
            tls_key_file: Some(dir.path().join("client.key")),
            ..RedisOptions::default()
        };
        let write = |certs: &TestCerts| {
            std::fs::copy(certs.client_cert_file(), dir.path().join("client.crt")).unwrap();
            std::fs::copy(certs.client_key_file(), dir.path().join("client.key")).unwrap();
        };
        write(&first);
        let url = "rediss://127.0.0.1:6380";
        let files = CertificateFiles::new(&options, url, None);
        let pem = |certs: &TestCerts| std::fs::read(certs.client_cert_file()).unwrap();
        assert_eq!(client_certificate(files.read_again()), pem(&first));
        let second = TestCerts::new();
        write(&second);
        assert_eq!(client_certificate(files.read_again()), pem(&second));
        // Caught while being rewritten: the last certificates read stay.
        std::fs::write(dir.path().join("client.key"), "half written").unwrap();
        assert_eq!(client_certificate(files.read_again()), pem(&second));
        std::fs::remove_file(dir.path().join("client.crt")).unwrap();
        assert_eq!(client_certificate(files.read_again()), pem(&second));
        write(&first);
        assert_eq!(client_certificate(files.read_again()), pem(&first));
    }
}
