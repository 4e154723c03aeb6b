//! One EC2 region as a client: signed Query calls with retries, one debug line per call.

use std::time::{Duration, Instant};

use egress_provider::ProviderError;
use tracing::{debug, trace};

use crate::credentials::CredentialChain;
use crate::query::{self, CallError, Form};

/// The EC2 API version every call names.
pub const API_VERSION: &str = "2016-11-15";
/// Attempts per call for throttling and failures that pass by themselves; every call the provider makes is safe to
/// repeat (reads, a launch with a client token, a terminate, a tag or rule that exists already).
pub const ATTEMPTS: u32 = 3;
/// The pause before the second attempt, doubled before each further one.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);

/// A region's EC2 endpoint with the credentials to sign for it.
#[derive(Debug)]
pub struct Ec2 {
    http: reqwest::Client,
    credentials: CredentialChain,
    region: String,
    endpoint: String,
}

impl Ec2 {
    /// A client of `endpoint` signing for `region`.
    pub fn new(http: reqwest::Client, credentials: CredentialChain, region: String, endpoint: String) -> Self {
        Self { http, credentials, region, endpoint }
    }

    /// The region calls are signed for.
    pub fn region(&self) -> &str {
        &self.region
    }

    /// Where the credentials come from.
    pub fn credentials(&self) -> &CredentialChain {
        &self.credentials
    }

    /// A form for `action` at the EC2 API version.
    pub fn form(action: &str) -> Form {
        Form::new(action, API_VERSION)
    }

    /// Sends `form`, retrying throttling and passing failures up to [`ATTEMPTS`] times; `target` names what the
    /// call is about in logs and errors.
    ///
    /// # Errors
    /// The last failure, classified.
    pub async fn call(&self, form: &Form, target: &str) -> Result<String, ProviderError> {
        self.send(form, target).await.map_err(|error| error.into_provider_error(action_of(form), target))
    }

    /// As [`Self::call`], with `None` for an answer with one of the error codes in `expected` (a rule or group that
    /// exists already, an instance that is gone).
    ///
    /// # Errors
    /// Any other failure, classified.
    pub async fn call_expecting(
        &self,
        form: &Form,
        target: &str,
        expected: &[&str],
    ) -> Result<Option<String>, ProviderError> {
        match self.send(form, target).await {
            Ok(text) => Ok(Some(text)),
            Err(error) if error.code.as_deref().is_some_and(|code| expected.contains(&code)) => Ok(None),
            Err(error) => Err(error.into_provider_error(action_of(form), target)),
        }
    }

    async fn send(&self, form: &Form, target: &str) -> Result<String, CallError> {
        let action = action_of(form);
        let body = form.encode();
        let mut backoff = FIRST_BACKOFF;
        let mut attempt = 1;
        loop {
            let credentials = self.credentials.current().await.map_err(CallError::credentials)?;
            let started = Instant::now();
            trace!(action = %action, target, parameters = ?form, attempt, "EC2 call");
            let result =
                query::post(&self.http, &self.endpoint, body.clone(), Some((&credentials, &self.region)), "ec2").await;
            let duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            match result {
                Ok(text) => {
                    debug!(action = %action, target, outcome = "ok", attempt, duration_ms, "EC2 call");
                    return Ok(text);
                }
                Err(error) => {
                    debug!(
                        action = %action,
                        target,
                        outcome = "failed",
                        attempt,
                        duration_ms,
                        http_status = error.status,
                        code = error.code.as_deref().unwrap_or(""),
                        message = %error.message,
                        "EC2 call"
                    );
                    if attempt < ATTEMPTS && error.is_retryable() {
                        tokio::time::sleep(backoff).await;
                        backoff *= 2;
                        attempt += 1;
                        continue;
                    }
                    return Err(error);
                }
            }
        }
    }
}

fn action_of(form: &Form) -> &str {
    form.get("Action").unwrap_or("?")
}
