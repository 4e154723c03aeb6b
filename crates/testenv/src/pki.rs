//! A throwaway certificate authority for tests: the control plane's serving and client certificates, and any other
//! TLS endpoint a test needs (an HTTPS origin behind a proxy, for example).

use std::net::IpAddr;

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};

/// A certificate (or, from [`key_pair_pem`], a bare public key) and its private key, both PEM-encoded.
#[derive(Clone, Debug)]
pub struct CertifiedPem {
    /// The certificate, or the public key.
    pub cert: String,
    /// The private key (PKCS#8).
    pub key: String,
}

/// A self-signed certificate authority that issues leaf certificates.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl TestCa {
    /// Creates a new CA with a fresh key; `name` becomes its common name.
    pub fn new(name: &str) -> Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?).context("self-signing the test CA")?;
        Ok(Self { issuer })
    }

    /// The CA certificate in PEM, for trust stores.
    pub fn cert_pem(&self) -> String {
        self.issuer.pem()
    }

    /// Issues a server certificate for the given DNS names and IP addresses.
    pub fn server_cert(&self, dns_names: &[&str], ips: &[IpAddr]) -> Result<CertifiedPem> {
        let mut params = CertificateParams::new(dns_names.iter().map(|name| (*name).to_owned()).collect::<Vec<_>>())?;
        params.subject_alt_names.extend(ips.iter().copied().map(SanType::IpAddress));
        params.distinguished_name.push(DnType::CommonName, dns_names.first().copied().unwrap_or("test-server"));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.issue(params)
    }

    /// Issues a client certificate; Kubernetes reads the common name as the user and organizations as groups.
    pub fn client_cert(&self, common_name: &str, organizations: &[&str]) -> Result<CertifiedPem> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, common_name);
        for organization in organizations {
            params.distinguished_name.push(DnType::OrganizationName, *organization);
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(params)
    }

    fn issue(&self, params: CertificateParams) -> Result<CertifiedPem> {
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer).context("signing a test certificate")?;
        Ok(CertifiedPem { cert: cert.pem(), key: key.serialize_pem() })
    }
}

/// A fresh key pair in PEM, for example to sign and verify service-account tokens.
pub fn key_pair_pem() -> Result<CertifiedPem> {
    let key = KeyPair::generate()?;
    Ok(CertifiedPem { cert: key.public_key_pem(), key: key.serialize_pem() })
}
