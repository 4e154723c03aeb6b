//! Turning Compute Engine errors into the provider contract's classes.

use egress_provider::{ErrorClass, ProviderError};
use google_cloud_gax::error::Error;
use google_cloud_gax::error::rpc::StatusDetails;
use tracing::debug;

/// What an error said, before classification: the HTTP status, the error reasons, and whether it was a transport
/// failure (no answer at all).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Raw {
    /// The HTTP status code, when the server answered.
    pub status: Option<u16>,
    /// The `errors[].reason` / `ErrorInfo.reason` values.
    pub reasons: Vec<String>,
    /// The server's message.
    pub message: String,
    /// The request never got an answer (connection, TLS, timeout).
    pub transport: bool,
    /// The credentials could not be turned into a token.
    pub authentication: bool,
}

impl Raw {
    /// Reads what a gax error carries.
    pub fn of(error: &Error) -> Self {
        let status = error.http_status_code();
        let mut reasons = Vec::new();
        let mut message = String::new();
        if let Some(rpc) = error.status() {
            message = rpc.message.clone();
            for detail in &rpc.details {
                if let StatusDetails::ErrorInfo(info) = detail
                    && !info.reason.is_empty()
                {
                    reasons.push(info.reason.clone());
                }
            }
        }
        if message.is_empty() {
            message = error.to_string();
        }
        Self {
            status,
            reasons,
            message,
            transport: status.is_none() && (error.is_io() || error.is_timeout() || error.is_transport()),
            authentication: error.is_authentication(),
        }
    }
}

fn is_quota_reason(reason: &str) -> bool {
    let normalized: String = reason.chars().filter(|c| c.is_ascii_alphanumeric()).collect::<String>().to_lowercase();
    matches!(normalized.as_str(), "quotaexceeded" | "ratelimitexceeded" | "userratelimitexceeded" | "resourceexhausted")
}

/// The class of an error: 404 → NotFound; a quota or rate-limit reason, or 429 → QuotaExceeded; other 4xx →
/// Permanent; 5xx, transport failures and anything unrecognised → Transient.
pub fn class_of(raw: &Raw) -> ErrorClass {
    match raw.status {
        Some(404) => ErrorClass::NotFound,
        Some(429) => ErrorClass::QuotaExceeded,
        Some(status) if (400..500).contains(&status) => {
            if raw.reasons.iter().any(|reason| is_quota_reason(reason)) {
                ErrorClass::QuotaExceeded
            } else {
                ErrorClass::Permanent
            }
        }
        Some(_) => ErrorClass::Transient,
        // No token at all: a key file that does not parse or is refused will not fix itself.
        None if raw.authentication && !raw.transport => ErrorClass::Permanent,
        None => ErrorClass::Transient,
    }
}

/// Classifies an error of `operation`, logging what it carried first.
pub fn classify(operation: &str, target: &str, error: Error) -> ProviderError {
    let raw = Raw::of(&error);
    debug!(
        operation,
        target,
        http_status = raw.status,
        reasons = ?raw.reasons,
        transport = raw.transport,
        message = %raw.message,
        "Compute Engine call failed"
    );
    let class = class_of(&raw);
    let status = raw.status.map_or_else(|| "no answer".to_owned(), |status| format!("HTTP {status}"));
    let reasons = if raw.reasons.is_empty() { String::new() } else { format!(" [{}]", raw.reasons.join(", ")) };
    ProviderError::new(class, format!("{operation} {target}: {status}{reasons}: {}", raw.message)).with_source(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(status: Option<u16>, reasons: &[&str]) -> Raw {
        Raw {
            status,
            reasons: reasons.iter().map(|reason| (*reason).to_owned()).collect(),
            transport: status.is_none(),
            ..Raw::default()
        }
    }

    #[test]
    fn the_error_table() {
        let table = [
            (raw(Some(404), &["notFound"]), ErrorClass::NotFound),
            (raw(Some(403), &["quotaExceeded"]), ErrorClass::QuotaExceeded),
            (raw(Some(403), &["rateLimitExceeded"]), ErrorClass::QuotaExceeded),
            (raw(Some(403), &["QUOTA_EXCEEDED"]), ErrorClass::QuotaExceeded),
            (raw(Some(429), &[]), ErrorClass::QuotaExceeded),
            (raw(Some(403), &["forbidden"]), ErrorClass::Permanent),
            (raw(Some(400), &["invalid"]), ErrorClass::Permanent),
            (raw(Some(401), &[]), ErrorClass::Permanent),
            (raw(Some(409), &["alreadyExists"]), ErrorClass::Permanent),
            (raw(Some(500), &["backendError"]), ErrorClass::Transient),
            (raw(Some(503), &[]), ErrorClass::Transient),
            (raw(None, &[]), ErrorClass::Transient),
        ];
        for (raw, class) in table {
            assert_eq!(class_of(&raw), class, "{raw:?}");
        }
    }

    #[test]
    fn a_credential_that_yields_no_token_is_permanent() {
        let raw = Raw { authentication: true, ..Raw::default() };
        assert_eq!(class_of(&raw), ErrorClass::Permanent);
    }
}
