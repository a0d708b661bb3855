//! The rustls client configuration shared by the link (wss://) and the built-in kinds (https):
//! the web PKI roots compiled in (webpki-roots; a static binary has no system store to rely on)
//! plus the PEM bundle in `CA_FILE`. ring is the only crypto provider. No sockets here.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use rustls::{ClientConfig, RootCertStore};

use crate::Error;

/// Reads every certificate of a PEM bundle; a file with none is an error.
pub fn load_ca_file(path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let iter = CertificateDer::pem_file_iter(path).map_err(|e| Error::new(e.to_string()))?;
    let certs: Vec<CertificateDer<'static>> = iter.collect::<Result<_, _>>().map_err(|e| Error::new(e.to_string()))?;
    if certs.is_empty() {
        return Err(Error::new("no PEM certificates in it"));
    }
    Ok(certs)
}

pub fn client_config(ca_file: Option<&Path>) -> Result<Arc<ClientConfig>, Error> {
    let mut roots = RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
    if let Some(path) = ca_file {
        let certs =
            load_ca_file(path).map_err(|e| Error::new(format!("CA_FILE={:?}: {e}", path.display().to_string())))?;
        for cert in certs {
            roots.add(cert).map_err(|e| Error::new(format!("CA_FILE: unusable certificate: {e}")))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::new(format!("TLS setup: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}
