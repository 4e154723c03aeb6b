//! The reconciler's errors, each with a stable `kind()` used as a metric label and an Event reason.

use egress_provider::{ErrorClass, ProviderError};

/// Why one reconcile failed; `error_policy` retries it with per-object exponential backoff.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A provider call failed transiently (or unclassified).
    #[error("provider call failed: {}", .0.chain())]
    Provider(#[source] ProviderError),
    /// A Kubernetes API call failed.
    #[error("Kubernetes API call failed: {0}")]
    Kube(#[source] kube::Error),
    /// The finalizer machinery failed (adding or removing the finalizer, or a wrapped apply/cleanup error).
    #[error("{0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    /// The object could not be read as a Proxy (it was created against an older or broken schema).
    #[error("the object is not a valid Proxy: {0}")]
    InvalidObject(String),
    /// Cleanup cannot proceed because the object's provider is not configured.
    #[error(
        "provider {0:?} is not configured, so its instances cannot be deleted; set crawl.example.com/skip-cleanup: \"true\" to release the Proxy without cleanup"
    )]
    ProviderMissing(String),
}

impl Error {
    /// Every [`Error::kind`], for metrics that show each from the start.
    pub const KINDS: [&'static str; 8] = [
        "provider_not_found",
        "provider_quota_exceeded",
        "provider_transient",
        "provider_permanent",
        "kube",
        "finalizer",
        "invalid_object",
        "provider_missing",
    ];

    /// A stable short string for metrics and Events (one of [`Error::KINDS`]).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Provider(error) => match error.class() {
                ErrorClass::NotFound => "provider_not_found",
                ErrorClass::QuotaExceeded => "provider_quota_exceeded",
                ErrorClass::Transient => "provider_transient",
                ErrorClass::Permanent => "provider_permanent",
            },
            Self::Kube(_) => "kube",
            Self::Finalizer(error) => match error.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(inner)
                | kube::runtime::finalizer::Error::CleanupFailed(inner) => inner.kind(),
                _ => "finalizer",
            },
            Self::InvalidObject(_) => "invalid_object",
            Self::ProviderMissing(_) => "provider_missing",
        }
    }
}

impl From<kube::Error> for Error {
    fn from(error: kube::Error) -> Self {
        Self::Kube(error)
    }
}

impl From<ProviderError> for Error {
    fn from(error: ProviderError) -> Self {
        Self::Provider(error)
    }
}
