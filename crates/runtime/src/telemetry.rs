//! Logging, and traces through OpenTelemetry when `--otlp-endpoint` is set.
//!
//! Traces go to an OTLP/HTTP (protobuf) receiver, such as an OpenTelemetry Collector, over the operator's own hyper
//! client, batched by the SDK's export thread. Every `tracing` span the operator opens (each reconcile, each health
//! transition, each provider call it instruments) becomes an OpenTelemetry span; the log filter (`RUST_LOG`) decides
//! which spans exist for both.
//!
//! The Compute Engine SDK's own tracing (a gcp provider with `wireLogging: true`) records whole requests, so its
//! targets never reach these layers: they go only to `egress_provider_gcp::wire_log`, which drops records about
//! credentials and elides large fields and anything holding user data. It is written in the same format, at debug,
//! whatever `RUST_LOG` says, because `wireLogging` is already the explicit switch.

use std::io::IsTerminal;
use std::time::Duration;

use anyhow::{Context as _, Result};
use http::Uri;
use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{BatchSpanProcessor, SdkTracerProvider};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer as _};

use egress_provider_gcp::wire_log::{self, WireFormat};

/// How long one export request may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long shutdown waits for the last spans to be exported.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// The OTLP/HTTP path for traces, appended to an endpoint given without a path.
const TRACES_PATH: &str = "/v1/traces";

/// Checks an `--otlp-endpoint` value and returns the URL traces are posted to.
///
/// `http://collector:4318` (no path) means `http://collector:4318/v1/traces`, as `OTEL_EXPORTER_OTLP_ENDPOINT` does;
/// a URL with a path is used as given.
pub fn traces_url(text: &str) -> Result<Uri, String> {
    let uri: Uri = text.parse().map_err(|error| format!("{text:?} is not a URL: {error}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(format!(
                "{text:?}: only http:// is supported; send traces to a collector agent beside the operator (for \
                 example an OpenTelemetry Collector sidecar on http://127.0.0.1:4318) and let it forward over TLS"
            ));
        }
        _ => return Err(format!("{text:?} must start with http:// (an OTLP/HTTP receiver, usually port 4318)")),
    }
    let Some(authority) = uri.authority() else {
        return Err(format!("{text:?} has no host"));
    };
    if authority.as_str().contains('@') {
        // Not echoed: the user part may hold a password.
        return Err("credentials in the URL are not supported".into());
    }
    if uri.query().is_some() {
        return Err(format!("{text:?}: a query string is not supported"));
    }
    let path = uri.path();
    if path.is_empty() || path == "/" {
        return format!("http://{authority}{TRACES_PATH}").parse().map_err(|error| format!("{text:?}: {error}"));
    }
    Ok(uri)
}

/// What must happen before the process exits: the last spans exported.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Exports the spans still buffered, waiting at most a few seconds; a no-op without `--otlp-endpoint`.
    pub async fn shutdown(self) {
        let Some(provider) = self.provider else { return };
        // The SDK's shutdown blocks until the batch task has exported; keep it off the runtime's workers.
        let flushed = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(FLUSH_TIMEOUT)).await;
        match flushed {
            Ok(Ok(())) => tracing::debug!("traces flushed"),
            Ok(Err(error)) => eprintln!("egress-operator: flushing traces failed: {error}"),
            Err(error) => eprintln!("egress-operator: flushing traces failed: {error}"),
        }
    }
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the global subscriber: logs in `format` to stdout, and spans to `otlp` when given, from `service`
/// (`egress-operator`, `egress-gateway`) of `cluster_id`.
///
/// Must run inside the Tokio runtime when `otlp` is set (export requests run on it).
pub fn init(
    format: LogFormat,
    otlp: Option<&Uri>,
    service: &'static str,
    cluster_id: Option<&str>,
) -> Result<Telemetry> {
    // Each layer gets its own copy of the filter: a global one would also silence the wire log.
    let filter =
        || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,kube=warn,hyper=warn,tower=warn"));
    let (fmt, wire) = match format {
        // Colours only on a terminal: a log file or collector gets plain text.
        LogFormat::Text => (
            tracing_subscriber::fmt::layer().with_ansi(std::io::stdout().is_terminal()).boxed(),
            wire_log::layer(std::io::stdout, WireFormat::Text),
        ),
        LogFormat::Json => {
            (tracing_subscriber::fmt::layer().json().boxed(), wire_log::layer(std::io::stdout, WireFormat::Json))
        }
    };
    let fmt = fmt.with_filter(filter()).with_filter(wire_log::not_sdk());
    let (otel, provider) = match otlp {
        Some(url) => {
            let provider = tracer_provider(url, service, cluster_id)?;
            let tracer = provider.tracer(service);
            let layer = tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(filter())
                .with_filter(wire_log::not_sdk());
            (Some(layer), Some(provider))
        }
        None => (None, None),
    };
    tracing_subscriber::registry().with(fmt).with(otel).with(wire).try_init().context("installing the logger")?;
    if let Some(url) = otlp {
        tracing::info!(endpoint = %url, "exporting traces over OTLP/HTTP");
    }
    Ok(Telemetry { provider })
}

/// An HTTP client whose requests run on the operator's Tokio runtime.
///
/// The SDK's batch processor exports from a thread of its own, outside any runtime, while the hyper client needs
/// Tokio's reactor: each request is spawned onto the runtime and its result awaited from the exporter's thread.
#[derive(Debug)]
struct OnRuntime {
    runtime: tokio::runtime::Handle,
    client: std::sync::Arc<opentelemetry_http::hyper::HyperClient>,
}

#[async_trait::async_trait]
impl HttpClient for OnRuntime {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        self.runtime.spawn(async move { client.send_bytes(request).await }).await?
    }
}

fn tracer_provider(url: &Uri, service: &'static str, cluster_id: Option<&str>) -> Result<SdkTracerProvider> {
    let client = OnRuntime {
        runtime: tokio::runtime::Handle::try_current().context("traces need the Tokio runtime")?,
        client: std::sync::Arc::new(opentelemetry_http::hyper::HyperClient::with_default_connector(
            EXPORT_TIMEOUT,
            None,
        )),
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url.to_string())
        .with_timeout(EXPORT_TIMEOUT)
        .with_http_client(client)
        .build()
        .context("building the OTLP trace exporter")?;
    let processor = BatchSpanProcessor::builder(exporter).build();
    let mut attributes: Vec<KeyValue> =
        cluster_id.map(|id| KeyValue::new("egress.cluster_id", id.to_owned())).into_iter().collect();
    if let Ok(pod) = std::env::var("POD_NAME") {
        attributes.push(KeyValue::new("service.instance.id", pod));
    }
    let resource = Resource::builder()
        .with_service_name(service)
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .with_attributes(attributes)
        .build();
    Ok(SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource).build())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_without_a_path_get_the_traces_path() {
        for (given, expected) in [
            ("http://collector:4318", "http://collector:4318/v1/traces"),
            ("http://collector:4318/", "http://collector:4318/v1/traces"),
            ("http://127.0.0.1:4318/custom/traces", "http://127.0.0.1:4318/custom/traces"),
            ("http://[::1]:4318", "http://[::1]:4318/v1/traces"),
        ] {
            assert_eq!(traces_url(given).expect(given).to_string(), expected);
        }
    }

    #[test]
    fn unusable_endpoints_say_why() {
        for (given, why) in [
            ("collector:4318", "must start with http://"),
            ("https://collector:4318", "only http:// is supported"),
            ("ftp://collector", "must start with http://"),
            ("http://user:secret@collector:4318", "credentials"),
            ("http://collector:4318/?x=1", "query"),
            ("http://exa mple", "not a URL"),
        ] {
            let error = traces_url(given).expect_err(given);
            assert!(error.contains(why), "{given}: {error}");
            assert!(!error.contains("secret"), "a password in the URL is echoed: {error}");
        }
    }
}
