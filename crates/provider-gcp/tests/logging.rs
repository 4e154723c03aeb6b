//! What the gcp provider logs, at every level, never holds the user data. A test binary of its own: the subscriber
//! is the process-wide default, so every callsite (the SDK's, hyper's, ours) is enabled and nothing depends on
//! tracing's per-callsite interest cache, which tests on other threads with scoped subscribers can poison.

mod common;
mod fake;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{ZONE, provider, request};
use egress_provider::{Provider, Sensitive};
use fake::FakeCompute;

/// Collects everything written by a `tracing` subscriber.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn the_user_data_never_reaches_a_log() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber in this binary");

    let fake = FakeCompute::start(Duration::ZERO).await;
    let provider = provider(&fake).await;
    let secret = "#cloud-config\nchpasswd: {list: 'root:the-user-data-marker-7f3a'}\n";
    let mut request = request("px-secret", "c1");
    request.cloud_init = Some(Sensitive::new(secret.as_bytes().to_vec()));
    let created = provider.create(&request).await.expect("create");
    provider.get(&created.provider_id).await.expect("get");
    fake.fail_next("insert", 400, "invalid");
    let mut other = request.clone();
    other.name = "px-secret-2".into();
    provider.create(&other).await.expect_err("scripted failure");
    // It did reach Compute Engine, byte for byte (read before the delete removes it).
    assert_eq!(fake.sent_user_data(ZONE, "px-secret").as_deref(), Some(secret));
    provider.delete(&created.provider_id).await.expect("delete");

    let text = String::from_utf8(captured.0.lock().unwrap().clone()).expect("utf-8 logs");
    assert!(text.contains("Compute Engine call"), "the calls were logged:\n{text}");
    assert!(text.contains("inserting an instance instance=px-secret"), "the insert was traced:\n{text}");
    assert!(!text.contains("the-user-data-marker-7f3a"), "the user data reached the log:\n{text}");
    assert!(!text.contains("chpasswd"), "the user data reached the log:\n{text}");
}
