//! Who a request is from: the tenant of the token in its credentials, counted against the address's wrong tokens.

use std::time::Duration;

use http::{HeaderMap, header};

use super::{Gateway, Peer};
use crate::admission::credentials;
use crate::options::Options;
use crate::status::GatewayError;

impl Gateway {
    /// The tenant, token and options of a request's credentials; a connection that shows a valid token leaves the
    /// unauthenticated ones. An address out of wrong tokens to send is told to wait, its credentials unchecked.
    pub(super) fn authenticate(
        &self,
        headers: &HeaderMap,
        peer: &Peer,
    ) -> Result<(String, String, Options), GatewayError> {
        let offered = headers.contains_key(header::PROXY_AUTHORIZATION);
        let now = std::time::Instant::now();
        if offered && let Some(wait) = self.admission.throttled(peer.source, now) {
            self.metrics.throttled_credentials();
            return Err(GatewayError::quota(
                "this address sent too many wrong tokens; its credentials are checked again after Retry-After",
                Some(wait.max(Duration::from_secs(1))),
            ));
        }
        match credentials(headers, self.auth.as_ref()) {
            Ok(found) => {
                peer.unauthenticated.release();
                Ok(found)
            }
            Err(error) => {
                if offered && error.status == http::StatusCode::PROXY_AUTHENTICATION_REQUIRED {
                    self.admission.failed(peer.source, now);
                }
                Err(error)
            }
        }
    }
}
