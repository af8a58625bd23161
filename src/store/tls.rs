//! The TLS setup every HTTP(S) client of the crate shares: rustls over the
//! crypto provider aws-sdk-s3 builds on too, with the system's roots.

use std::sync::Arc;

use hyper_rustls::builderstates::WantsSchemes;
use hyper_rustls::HttpsConnectorBuilder;

/// An HTTPS connector builder with the system's roots; with none found,
/// `http://` still works and `https://` fails to verify.
pub(super) fn connector_builder() -> Result<HttpsConnectorBuilder<WantsSchemes>, String> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    match HttpsConnectorBuilder::new().with_provider_and_native_roots(provider.clone()) {
        Ok(builder) => Ok(builder),
        Err(_) => Ok(HttpsConnectorBuilder::new().with_tls_config(
            rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("no TLS setup: {e}"))?
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth(),
        )),
    }
}
