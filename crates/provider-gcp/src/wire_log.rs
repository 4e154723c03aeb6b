//! The SDK's own request tracing, made safe to log: a `tracing` layer for `wireLogging: true`.
//!
//! With tracing on, the Compute Engine SDK opens a debug span per call whose fields are the whole request (`req`),
//! and records the whole response (`return`), besides OpenTelemetry-style info spans per HTTP request. Requests
//! carry the instance's metadata, so the user data (which may hold passwords) would be logged verbatim, and any
//! formatter that prints span fields would print it. This layer is the only place those records are written:
//!
//! - a record whose fields (its own or its spans') concern authentication or tokens is dropped whole;
//! - a field value over [`MAX_FIELD_BYTES`] is replaced by `<elided: N bytes>`;
//! - a value that mentions the `user-data` key is replaced by `<elided: N bytes, holds user data>`, whatever its
//!   size.
//!
//! Every other layer must not see the SDK's targets (see [`is_sdk_target`]): the operator gives its log and trace
//! layers a filter that excludes them, so SDK spans never reach their output or their span context.

use std::fmt::{self, Write as _};
use std::io::Write as _;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::{FilterFn, Filtered};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

/// Field values longer than this (in bytes, as formatted) are elided.
pub const MAX_FIELD_BYTES: usize = 1024;

/// Whether `target` belongs to the Google Cloud SDK's tracing: its crates' modules, and the event targets its
/// transport uses.
pub fn is_sdk_target(target: &str) -> bool {
    target.starts_with("google_cloud_")
        || target.starts_with("experimental.client.request")
        || target.starts_with("experimental.transport.request")
}

/// The operator's filter for every layer but the wire log: everything except the SDK's targets.
pub fn not_sdk() -> WireFilter {
    FilterFn::new(not_sdk_target)
}

fn not_sdk_target(metadata: &Metadata<'_>) -> bool {
    !is_sdk_target(metadata.target())
}

/// How the wire log writes a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireFormat {
    /// One line: time, level, target, spans with their fields, then the event's fields.
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `spans` (name and fields) and `fields`.
    Json,
}

/// The wire-log layer, filtered to the SDK's targets at debug and above, writing to `make_writer`.
pub fn layer<S, W>(make_writer: W, format: WireFormat) -> Filtered<WireLog<W>, WireFilter, S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + 'static,
{
    WireLog { make_writer, format }.with_filter(FilterFn::new(sdk_debug))
}

/// The filters [`layer`] and [`not_sdk`] return.
pub type WireFilter = FilterFn<fn(&Metadata<'_>) -> bool>;

fn sdk_debug(metadata: &Metadata<'_>) -> bool {
    is_sdk_target(metadata.target()) && *metadata.level() <= tracing::Level::DEBUG
}

/// The layer; see the module documentation. Build it with [`layer`].
pub struct WireLog<W> {
    make_writer: W,
    format: WireFormat,
}

/// A span's or event's fields after redaction.
#[derive(Clone, Debug, Default)]
struct Redacted {
    fields: Vec<(&'static str, String)>,
    /// Set when any field concerns authentication or tokens: the record is not written.
    sensitive: bool,
}

impl Redacted {
    fn push(&mut self, field: &Field, value: String) {
        let name = field.name();
        if is_sensitive_name(name) || is_sensitive_value(&value) {
            self.sensitive = true;
            return;
        }
        let value = if value.contains("user-data") {
            format!("<elided: {} bytes, holds user data>", value.len())
        } else if value.len() > MAX_FIELD_BYTES {
            format!("<elided: {} bytes>", value.len())
        } else {
            value
        };
        match self.fields.iter_mut().find(|(existing, _)| *existing == name) {
            Some(slot) => slot.1 = value,
            None => self.fields.push((name, value)),
        }
    }
}

impl Visit for Redacted {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.push(field, value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.push(field, format!("{value:?}"));
    }
}

fn is_sensitive_name(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    let token = name.ends_with("token") && !name.ends_with("page_token") && !name.ends_with("pagetoken");
    token
        || ["auth", "credential", "password", "secret", "private_key", "api_key"].iter().any(|part| name.contains(part))
}

fn is_sensitive_value(value: &str) -> bool {
    let value = value.to_ascii_lowercase();
    ["bearer ", "authorization", "access_token", "id_token", "refresh_token", "private_key", "x-goog-api-key", "ya29."]
        .iter()
        .any(|marker| value.contains(marker))
}

impl<S, W> Layer<S> for WireLog<W>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + 'static,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Redacted::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(fields) = span.extensions_mut().get_mut::<Redacted>()
        {
            values.record(fields);
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Redacted::default();
        event.record(&mut fields);
        if fields.sensitive {
            return;
        }
        let mut spans = Vec::new();
        if let Some(scope) = ctx.event_scope(event) {
            for span in scope.from_root() {
                let extensions = span.extensions();
                let redacted = extensions.get::<Redacted>().cloned().unwrap_or_default();
                if redacted.sensitive {
                    return;
                }
                spans.push((span.name(), redacted.fields));
            }
        }
        let mut time = String::new();
        let _ = SystemTime.format_time(&mut Writer::new(&mut time));
        let metadata = event.metadata();
        let line = match self.format {
            WireFormat::Text => text_line(&time, metadata, &spans, &fields.fields),
            WireFormat::Json => json_line(&time, metadata, &spans, &fields.fields),
        };
        let _ = self.make_writer.make_writer_for(metadata).write_all(line.as_bytes());
    }
}

type Fields = Vec<(&'static str, String)>;

fn text_line(time: &str, metadata: &Metadata<'_>, spans: &[(&str, Fields)], fields: &Fields) -> String {
    let mut line = format!("{time} {:>5} {}: ", metadata.level(), metadata.target());
    for (name, span_fields) in spans {
        line.push_str(name);
        if !span_fields.is_empty() {
            let joined: Vec<String> = span_fields.iter().map(|(key, value)| format!("{key}={value}")).collect();
            let _ = write!(line, "{{{}}}", joined.join(" "));
        }
        line.push_str(": ");
    }
    let joined: Vec<String> = fields
        .iter()
        .map(|(key, value)| if *key == "message" { value.clone() } else { format!("{key}={value}") })
        .collect();
    line.push_str(&joined.join(" "));
    line.push('\n');
    line
}

fn json_line(time: &str, metadata: &Metadata<'_>, spans: &[(&str, Fields)], fields: &Fields) -> String {
    let object = |fields: &Fields| {
        serde_json::Value::Object(
            fields.iter().map(|(key, value)| ((*key).to_owned(), serde_json::Value::from(value.as_str()))).collect(),
        )
    };
    let spans: Vec<serde_json::Value> = spans
        .iter()
        .map(|(name, span_fields)| serde_json::json!({ "name": name, "fields": object(span_fields) }))
        .collect();
    let record = serde_json::json!({
        "timestamp": time,
        "level": metadata.level().as_str(),
        "target": metadata.target(),
        "spans": spans,
        "fields": object(fields),
    });
    format!("{record}\n")
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).expect("utf-8")
        }
    }

    /// Runs `emit` under a subscriber with only the wire log, in `format`, and returns what it wrote.
    fn capture(format: WireFormat, emit: impl FnOnce()) -> String {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::registry().with(layer(move || writer.clone(), format));
        tracing::subscriber::with_default(subscriber, emit);
        captured.text()
    }

    #[test]
    fn sdk_targets_are_recognised() {
        assert!(is_sdk_target("google_cloud_compute_v1::tracing"));
        assert!(is_sdk_target("google_cloud_gax_internal::observability::http_tracing"));
        assert!(is_sdk_target("experimental.client.request"));
        assert!(!is_sdk_target("egress_provider_gcp"));
        assert!(!is_sdk_target("hyper_util::client"));
    }

    #[test]
    fn big_fields_and_user_data_are_elided_and_small_ones_kept() {
        let big = "x".repeat(MAX_FIELD_BYTES + 1);
        let text = capture(WireFormat::Text, || {
            let span = tracing::debug_span!(target: "google_cloud_compute_v1::tracing", "insert", req = %big);
            let _entered = span.enter();
            tracing::debug!(
                target: "google_cloud_compute_v1::tracing",
                metadata = "Items { key: Some(\"user-data\"), value: Some(\"root:pw\") }",
                zone = "us-east1-b",
                "returned"
            );
        });
        assert!(text.contains(&format!("insert{{req=<elided: {} bytes>}}", big.len())), "{text}");
        assert!(text.contains("holds user data"), "{text}");
        assert!(text.contains("zone=us-east1-b"), "{text}");
        assert!(text.contains("returned"), "{text}");
        assert!(!text.contains("root:pw"), "{text}");
        assert!(!text.contains(&big), "{text}");
    }

    #[test]
    fn records_about_auth_or_tokens_are_dropped_whole() {
        let text = capture(WireFormat::Text, || {
            tracing::debug!(target: "google_cloud_auth::x", access_token = "abc", "a token");
            tracing::debug!(target: "google_cloud_gax_internal::x", header = "Authorization: Bearer ya29.abc", "h");
            let span = tracing::debug_span!(target: "google_cloud_compute_v1::tracing", "call", authorization = "x");
            let _entered = span.enter();
            tracing::debug!(target: "google_cloud_compute_v1::tracing", "inside an auth span");
        });
        assert!(text.is_empty(), "{text}");
        let kept = capture(WireFormat::Text, || {
            tracing::debug!(target: "google_cloud_compute_v1::tracing", page_token = "p2", "a page");
        });
        assert!(kept.contains("page_token=p2"), "a page token is not a credential: {kept}");
    }

    #[test]
    fn other_targets_and_trace_level_are_not_written() {
        let text = capture(WireFormat::Text, || {
            tracing::debug!(target: "egress_provider_gcp", "ours");
            tracing::trace!(target: "google_cloud_compute_v1::tracing", "too fine");
        });
        assert!(text.is_empty(), "{text}");
    }

    #[test]
    fn json_lines_parse_and_carry_spans_and_fields() {
        let text = capture(WireFormat::Json, || {
            let span = tracing::info_span!(target: "google_cloud_gax_internal::http", "http_request", method = "POST");
            span.record("method", "GET");
            let _entered = span.enter();
            tracing::info!(target: "google_cloud_gax_internal::http", status = 200_u64, "done");
        });
        let record: serde_json::Value = serde_json::from_str(text.trim()).expect("one JSON object");
        assert_eq!(record["level"], "INFO");
        assert_eq!(record["spans"][0]["name"], "http_request");
        assert_eq!(record["spans"][0]["fields"]["method"], "GET", "values recorded later replace the first");
        assert_eq!(record["fields"]["status"], "200");
        assert_eq!(record["fields"]["message"], "done");
    }
}
