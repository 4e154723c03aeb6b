//! What the gcp test binaries share: the project, a service-account key, the provider's config and requests.

#![allow(dead_code, reason = "each test binary uses its own subset")]

use std::path::PathBuf;
use std::sync::OnceLock;

use egress_provider::{CreateRequest, Tags};
use egress_provider_gcp::GcpConfig;
use egress_provider_gcp::GcpProvider;
use serde_json::json;

use crate::fake::FakeCompute;

pub const PROJECT: &str = "egress-test";
pub const ZONE: &str = "us-east1-b";
pub const EMAIL: &str = "egress-operator@egress-test.iam.gserviceaccount.com";

/// A service-account key file with a fresh RSA key (made once per test binary with `openssl`).
pub fn key_file(email: &str) -> PathBuf {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    static KEY: OnceLock<String> = OnceLock::new();
    let dir = DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"));
    let pem = KEY.get_or_init(|| {
        let path = dir.path().join("key.pem");
        let status = std::process::Command::new("openssl")
            .args(["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out"])
            .arg(&path)
            .stderr(std::process::Stdio::null())
            .status()
            .expect("openssl runs");
        assert!(status.success(), "openssl genpkey failed");
        std::fs::read_to_string(&path).expect("the key")
    });
    // A file per call: tests run in parallel, and one must never read another's half-written file.
    static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let count = COUNT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let path = dir.path().join(format!("{count}-{email}.json"));
    let key = json!({
        "type": "service_account",
        "project_id": PROJECT,
        "private_key_id": "0123456789abcdef",
        "private_key": pem,
        "client_email": email,
        "client_id": "1234567890",
        "token_uri": "https://oauth2.googleapis.com/token",
    });
    std::fs::write(&path, key.to_string()).expect("write the key file");
    path
}

pub fn config(fake: &FakeCompute) -> GcpConfig {
    GcpConfig {
        default_zone: Some(ZONE.into()),
        credentials_file: Some(key_file(EMAIL)),
        endpoint: Some(fake.url.clone()),
        ..GcpConfig::new(PROJECT)
    }
}

pub async fn provider(fake: &FakeCompute) -> GcpProvider {
    GcpProvider::new(config(fake)).await.expect("the provider builds")
}

pub fn request(name: &str, cluster: &str) -> CreateRequest {
    CreateRequest::new(name, 3128, Tags::gc_contract(cluster, &format!("uid-{name}"), "340e470e78ddee5a"))
}
