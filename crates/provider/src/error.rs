//! Provider errors and their classes.
//!
//! Every backend classifies its failures once, where it knows the most (HTTP status, API reason, libvirt error
//! code); the reconciler only branches on the class. The source error is kept, so logs show the whole chain.

use std::error::Error as StdError;
use std::fmt;

/// What the caller should do about a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ErrorClass {
    /// The instance (or what the ID names) does not exist.
    NotFound,
    /// The backend refused for lack of quota or rate; retry much later.
    QuotaExceeded,
    /// Worth retrying soon: timeouts, 5xx, dropped connections, anything unclassified.
    Transient,
    /// Retrying the same request will fail the same way: bad input, missing permission, unknown image.
    Permanent,
}

impl ErrorClass {
    /// A stable short string, used as a metric label and an Event reason.
    pub fn kind(self) -> &'static str {
        match self {
            Self::NotFound => "not_found",
            Self::QuotaExceeded => "quota_exceeded",
            Self::Transient => "transient",
            Self::Permanent => "permanent",
        }
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind())
    }
}

type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// A classified provider failure with its cause.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ProviderError {
    class: ErrorClass,
    message: String,
    #[source]
    source: Option<BoxError>,
}

impl ProviderError {
    /// A failure of the given class.
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        Self { class, message: message.into(), source: None }
    }

    /// A failure nobody classified: it counts as `Transient`, the safe default (retry with backoff).
    pub fn unclassified(source: impl Into<BoxError>) -> Self {
        let source = source.into();
        Self { class: ErrorClass::Transient, message: source.to_string(), source: Some(source) }
    }

    /// `NotFound`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::NotFound, message)
    }

    /// `QuotaExceeded`.
    pub fn quota_exceeded(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::QuotaExceeded, message)
    }

    /// `Transient`.
    pub fn transient(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Transient, message)
    }

    /// `Permanent`.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Permanent, message)
    }

    /// Attaches the underlying error, kept as this error's `source()`.
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// The class that decides what the caller does.
    pub fn class(&self) -> ErrorClass {
        self.class
    }

    /// A stable short string for metrics and Events: the class's `kind()`.
    pub fn kind(&self) -> &'static str {
        self.class.kind()
    }

    /// Whether the class is `NotFound`.
    pub fn is_not_found(&self) -> bool {
        self.class == ErrorClass::NotFound
    }

    /// The message followed by every cause in the chain, `: `-separated.
    pub fn chain(&self) -> String {
        let mut text = self.message.clone();
        egress_fleet::errors::push_causes(
            &mut text,
            self.source.as_deref().map(|source| source as &(dyn StdError + 'static)),
        );
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unclassified_is_transient_and_keeps_the_source() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset by peer");
        let error = ProviderError::unclassified(io);
        assert_eq!(error.class(), ErrorClass::Transient);
        assert!(error.source().is_some());
        assert_eq!(error.to_string(), "connection reset by peer");
    }

    #[test]
    fn chain_lists_every_cause_once() {
        let io = std::io::Error::other("tls handshake eof");
        let error = ProviderError::transient("listing pods").with_source(io);
        assert_eq!(error.chain(), "listing pods: tls handshake eof");
        assert_eq!(error.kind(), "transient");
    }

    #[test]
    fn kinds_are_stable() {
        let kinds: Vec<&str> =
            [ErrorClass::NotFound, ErrorClass::QuotaExceeded, ErrorClass::Transient, ErrorClass::Permanent]
                .into_iter()
                .map(ErrorClass::kind)
                .collect();
        assert_eq!(kinds, ["not_found", "quota_exceeded", "transient", "permanent"]);
    }
}
