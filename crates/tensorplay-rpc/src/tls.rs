//! Job-scoped TLS: every worker generates a self-signed certificate at `init_rpc`, publishes
//! its SHA-256 fingerprint through the rendezvous store, and accepts a peer (as client or
//! server) only when the peer's certificate is one of the job's. Handshake signatures are still
//! verified with the certificate's key, so a process that copied a fingerprint cannot connect.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

use crate::{Error, Result};

/// The ALPN protocol id (a version bump refuses older peers at the handshake).
pub(crate) const ALPN: &[u8] = b"tensorplay-rpc/1";
/// The server name every worker's certificate carries.
pub(crate) const SERVER_NAME: &str = "tensorplay-worker";

/// This worker's certificate and key.
pub(crate) struct Identity {
    pub(crate) cert: CertificateDer<'static>,
    pub(crate) key: PrivatePkcs8KeyDer<'static>,
}

impl Identity {
    /// A fresh self-signed certificate.
    pub(crate) fn generate() -> Result<Identity> {
        let ck = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()])
            .map_err(|e| Error::Transport(format!("generating the certificate: {e}")))?;
        Ok(Identity {
            cert: ck.cert.der().clone(),
            key: PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()),
        })
    }

    pub(crate) fn fingerprint(&self) -> [u8; 32] {
        fingerprint(&self.cert)
    }
}

/// SHA-256 of a certificate's DER bytes.
pub(crate) fn fingerprint(cert: &CertificateDer<'_>) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, cert.as_ref());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Accepts exactly the certificates whose fingerprints are in `allowed`.
#[derive(Debug)]
pub(crate) struct JobVerifier {
    allowed: Vec<[u8; 32]>,
    algs: WebPkiSupportedAlgorithms,
}

impl JobVerifier {
    pub(crate) fn new(allowed: Vec<[u8; 32]>) -> Arc<JobVerifier> {
        Arc::new(JobVerifier {
            allowed,
            algs: provider().signature_verification_algorithms,
        })
    }

    fn check(&self, cert: &CertificateDer<'_>) -> std::result::Result<(), rustls::Error> {
        if self.allowed.contains(&fingerprint(cert)) {
            Ok(())
        } else {
            Err(rustls::Error::General(
                "the peer's certificate is not one of this job's workers".into(),
            ))
        }
    }
}

impl ServerCertVerifier for JobVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity)
            .map(|_| ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algs)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

impl ClientCertVerifier for JobVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity)
            .map(|_| ClientCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algs)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
    fn client_auth_mandatory(&self) -> bool {
        true
    }
}

fn tls_err(e: impl std::fmt::Display) -> Error {
    Error::Transport(format!("TLS configuration: {e}"))
}

/// The QUIC transport tuning for tensors between workers: large stream and connection windows
/// (quinn's defaults cap one stream at about 1.25 MB in flight), many concurrent streams (one
/// per call), keep-alives so that idle connections survive and a dead peer is noticed.
pub(crate) fn transport() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(quinn::VarInt::from_u32(64 << 20));
    t.receive_window(quinn::VarInt::from_u32(512 << 20));
    t.send_window(512 << 20);
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(16_384));
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(0));
    t.keep_alive_interval(Some(std::time::Duration::from_millis(500)));
    if let Ok(idle) = quinn::IdleTimeout::try_from(std::time::Duration::from_secs(5)) {
        t.max_idle_timeout(Some(idle));
    }
    Arc::new(t)
}

/// The server side: our certificate, peers must present one of the job's.
pub(crate) fn server_config(
    id: &Identity,
    verifier: Arc<JobVerifier>,
) -> Result<quinn::ServerConfig> {
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            vec![id.cert.clone()],
            PrivateKeyDer::Pkcs8(id.key.clone_key()),
        )
        .map_err(tls_err)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(tls_err)?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    cfg.transport_config(transport());
    Ok(cfg)
}

/// The client side: we present our certificate, the server must present one of the job's.
pub(crate) fn client_config(
    id: &Identity,
    verifier: Arc<JobVerifier>,
) -> Result<quinn::ClientConfig> {
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(
            vec![id.cert.clone()],
            PrivateKeyDer::Pkcs8(id.key.clone_key()),
        )
        .map_err(tls_err)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(tls_err)?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(transport());
    Ok(cfg)
}

/// Hex of a fingerprint (for the store and for messages).
pub(crate) fn hex(f: &[u8]) -> String {
    f.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses [`hex`].
pub(crate) fn unhex(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}
