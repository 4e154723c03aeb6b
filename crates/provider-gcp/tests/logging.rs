//! What the gcp provider logs, at every level, never holds the user data, with the SDK's wire logging off and on.
//! A test binary of its own: the subscriber is the process-wide default, so every callsite (the SDK's, hyper's,
//! ours) is enabled and nothing depends on tracing's per-callsite interest cache, which tests on other threads with
//! scoped subscribers can poison.

mod common;
mod fake;

use std::time::Duration;

use common::{ZONE, config, request};
use egress_provider::{Provider, Sensitive};
use egress_provider_gcp::GcpProvider;
use egress_provider_gcp::wire_log::{self, WireFormat};
use egress_testenv::captured::Captured;
use fake::FakeCompute;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;

const SECRET: &str = "#cloud-config\nchpasswd: {list: 'root:the-user-data-marker-7f3a'}\n";

/// Creates, reads and deletes an instance with user data, plus an insert that fails.
async fn exercise(fake: &FakeCompute, wire_logging: bool, name: &str) {
    let provider = GcpProvider::new(egress_provider_gcp::GcpConfig { wire_logging, ..config(fake) })
        .await
        .expect("the provider builds");
    let mut request = request(name, "c1");
    request.cloud_init = Some(Sensitive::new(SECRET.as_bytes().to_vec()));
    let created = provider.create(&request).await.expect("create");
    provider.get(&created.provider_id).await.expect("get");
    fake.fail_next("insert", 400, "invalid");
    let mut other = request.clone();
    other.name = format!("{name}-2");
    provider.create(&other).await.expect_err("scripted failure");
    // It did reach Compute Engine, byte for byte (read before the delete removes it).
    assert_eq!(fake.sent_user_data(ZONE, name).as_deref(), Some(SECRET));
    provider.delete(&created.provider_id).await.expect("delete");
}

fn assert_no_user_data(text: &str, which: &str) {
    assert!(!text.contains("the-user-data-marker-7f3a"), "the user data reached the {which}:\n{text}");
    assert!(!text.contains("chpasswd"), "the user data reached the {which}:\n{text}");
}

#[tokio::test]
async fn the_user_data_never_reaches_a_log() {
    // As the operator installs it: the main log at TRACE without the SDK's targets, and the wire log for them.
    let (main, wire) = (Captured::default(), Captured::default());
    let (main_writer, wire_writer) = (main.clone(), wire.clone());
    let subscriber = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(move || main_writer.clone())
                .with_ansi(false)
                .with_filter(wire_log::not_sdk()),
        )
        .with(wire_log::layer(move || wire_writer.clone(), WireFormat::Text));
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber in this binary");
    let fake = FakeCompute::start(Duration::ZERO).await;

    // Wire logging off: the provider's own lines, and nothing from the SDK.
    exercise(&fake, false, "px-quiet").await;
    let text = main.text();
    assert!(text.contains("Compute Engine call"), "the calls were logged:\n{text}");
    assert!(text.contains("inserting an instance instance=px-quiet"), "the insert was traced:\n{text}");
    assert_no_user_data(&text, "log");
    assert_eq!(wire.text(), "", "the SDK traces nothing unless asked");

    // Wire logging on: the SDK's requests and responses, redacted.
    exercise(&fake, true, "px-wire").await;
    let wire_text = wire.text();
    assert!(wire_text.contains("google_cloud_compute_v1"), "the SDK's records are written:\n{wire_text}");
    assert!(wire_text.contains("insert{"), "the insert span is there:\n{wire_text}");
    assert!(wire_text.contains("holds user data"), "the request holding user data is elided:\n{wire_text}");
    assert!(wire_text.contains(r#"GetRequest { instance: "px-wire""#), "small fields are kept:\n{wire_text}");
    assert_no_user_data(&wire_text, "wire log");
    for credential in ["Bearer", "ya29.", "eyJ"] {
        assert!(!wire_text.contains(credential), "a credential ({credential}) reached the wire log:\n{wire_text}");
    }
    let text = main.text();
    assert_no_user_data(&text, "log");
    assert!(!text.contains("google_cloud_compute_v1"), "the SDK's spans stay out of the main log:\n{text}");
}
