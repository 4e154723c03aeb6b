//! What the operator's and the gateway's processes serve and stop alike: `/metrics`, and the signals that stop them.

use std::sync::Arc;

use axum::Router;
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tracing::info;

/// `/metrics`: `registry` in the OpenMetrics text format.
pub(crate) fn metrics_router(registry: Arc<Registry>) -> Router {
    Router::new().route(
        "/metrics",
        get(move || {
            let registry = registry.clone();
            async move {
                let mut text = String::new();
                match prometheus_client::encoding::text::encode(&mut text, &registry) {
                    Ok(()) => ([("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")], text)
                        .into_response(),
                    Err(error) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
                }
            }
        }),
    )
}

/// Resolves when `flag` becomes true (or its sender is gone).
pub(crate) async fn until_true(mut flag: watch::Receiver<bool>) {
    let _ = flag.wait_for(|value| *value).await;
}

/// Resolves on SIGTERM or Ctrl-C.
pub(crate) async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => info!("interrupted; shutting down"),
        () = terminate => info!("SIGTERM; shutting down"),
    }
}
