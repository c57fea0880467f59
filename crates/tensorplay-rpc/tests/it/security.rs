//! A process outside the job cannot call a function: a QUIC client presenting a fresh
//! self-signed certificate (or none) is refused by a worker, and the function it asked for never
//! runs; the job's own calls keep working.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{TestResult, opts};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tensorplay_collectives::spawn::spawn;
use tensorplay_rpc as rpc;

static CALLS: AtomicUsize = AtomicUsize::new(0);

/// Accepts any server certificate: the foreign client wants to reach the worker's handler.
#[derive(Debug)]
struct AcceptAnything;

impl ServerCertVerifier for AcceptAnything {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }
    fn verify_tls13_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A client config presenting a fresh self-signed certificate, or none.
fn foreign_client(with_cert: bool) -> quinn::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAnything));
    let mut tls = if with_cert {
        let ck = rcgen::generate_simple_self_signed(vec!["tensorplay-worker".to_string()]).unwrap();
        builder
            .with_client_auth_cert(
                vec![ck.cert.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der())),
            )
            .unwrap()
    } else {
        builder.with_no_client_auth()
    };
    tls.alpn_protocols = vec![b"tensorplay-rpc/1".to_vec()];
    quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap(),
    ))
}

/// Connects to `addr` and tries to call `mark` as rank 0; returns what happened.
async fn attack(
    addr: std::net::SocketAddr,
    with_cert: bool,
    frame: Vec<u8>,
) -> Result<Vec<u8>, String> {
    let mut ep =
        quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).map_err(|e| e.to_string())?;
    ep.set_default_client_config(foreign_client(with_cert));
    let conn = ep
        .connect(addr, "tensorplay-worker")
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| format!("handshake: {e:?}"))?;
    // the client may consider the handshake done before the server checked its certificate
    let (mut send, mut recv) = conn
        .open_bi()
        .await
        .map_err(|e| format!("open: {e}: {:?}", conn.close_reason()))?;
    send.write_all(&frame)
        .await
        // the server may refuse the certificate while the frame is being written: the
        // handshake's reason is then in the connection's close reason, not the write error
        .map_err(|e| format!("write: {e}: {:?}", conn.close_reason()))?;
    let _ = send.finish();
    let resp = recv
        .read_to_end(1 << 20)
        .await
        .map_err(|e| format!("read: {e}: {:?}", conn.close_reason()))?;
    ep.close(0u32.into(), b"");
    Ok(resp)
}

#[test]
fn foreign_certificates_are_refused() -> TestResult {
    spawn(1, |_| -> TestResult {
        rpc::register("mark", |(): ()| {
            CALLS.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        rpc::init_rpc("me", 0, 1, opts(10, 2))?;
        // the job's own call reaches the function
        rpc::rpc_sync::<(), ()>("me", "mark", (), None)?;
        assert_eq!(CALLS.load(Ordering::SeqCst), 1);
        let addr = rpc::local_addr()?;
        // a well-formed call of `mark` as rank 0
        let sig = format!(
            "({}) -> {}",
            std::any::type_name::<()>(),
            std::any::type_name::<()>()
        );
        let frame = rpc::fuzz::encode_frame("mark", &sig, 0, &[0], &[])?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        for with_cert in [true, false] {
            let r = rt.block_on(async {
                tokio::time::timeout(
                    Duration::from_secs(10),
                    attack(addr, with_cert, frame.clone()),
                )
                .await
            });
            match r {
                Ok(Err(e)) => {
                    eprintln!("refused (certificate: {with_cert}): {e}");
                    // refused by the TLS handshake (a crypto error code), not later
                    assert!(e.contains("crypto"), "{e}");
                    if with_cert {
                        assert!(e.contains("not one of this job's workers"), "{e}");
                    }
                }
                Ok(Ok(resp)) => panic!("a foreign peer got an answer: {} bytes", resp.len()),
                Err(_) => panic!("the foreign peer was neither refused nor answered within 10 s"),
            }
        }
        assert_eq!(
            CALLS.load(Ordering::SeqCst),
            1,
            "the function ran for a foreign peer"
        );
        // the worker still serves the job
        rpc::rpc_sync::<(), ()>(0usize, "mark", (), None)?;
        assert_eq!(CALLS.load(Ordering::SeqCst), 2);
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}
