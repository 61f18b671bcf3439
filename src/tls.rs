//! TLS for `rediss://` URLs beyond fred's default (the system's roots, no client certificate): a
//! rustls configuration that trusts a private CA and/or presents a client certificate.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};

use crate::config::Config;
use crate::error::{Error, Result};

/// The TLS settings of `config` for fred, or `None` when the defaults fred derives from the URL
/// apply. The same settings go to every client of a component (the pipelined one, the blocking
/// ones cloned from it, the subscriber).
pub(crate) fn connector(config: &Config) -> Result<Option<fred::types::config::TlsConnector>> {
    if config.tls_ca_file.is_none() && config.tls_client_cert.is_none() {
        return Ok(None);
    }
    let roots = match &config.tls_ca_file {
        Some(path) => ca_roots(path)?,
        None => system_roots()?,
    };
    // The ring provider named outright: the process-wide default is ambiguous when another crate
    // in the build enables a second provider.
    let builder = ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(format!("TLS set-up failed: {e}")))?
        .with_root_certificates(roots);
    let client = match &config.tls_client_cert {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = certificates(cert, "TLS client certificate file")?;
            let bytes = read(key, "TLS client key file")?;
            let key_der = PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| {
                Error::Config(format!(
                    "TLS client key file {} holds no usable private key: {e}",
                    key.display()
                ))
            })?;
            builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                Error::Config(format!(
                    "TLS client certificate {} and key {} do not go together: {e}",
                    cert.display(),
                    key.display()
                ))
            })?
        }
    };
    Ok(Some(client.into()))
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::Config(format!("cannot read the {what} {}: {e}", path.display())))
}

fn certificates(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let bytes = read(path, what)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Config(format!("the {what} {} is not valid PEM: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(Error::Config(format!("the {what} {} holds no PEM certificate", path.display())));
    }
    Ok(certs)
}

fn ca_roots(path: &Path) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in certificates(path, "TLS CA file")? {
        roots.add(cert).map_err(|e| {
            Error::Config(format!(
                "the TLS CA file {} holds a certificate rustls refuses: {e}",
                path.display()
            ))
        })?;
    }
    Ok(roots)
}

fn system_roots() -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found.errors.first().map(|e| format!(": {e}")).unwrap_or_default();
        return Err(Error::Config(format!(
            "no system CA certificates found{why}; name a CA file (tls_ca_file)"
        )));
    }
    Ok(roots)
}
