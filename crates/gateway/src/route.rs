//! Where a request goes: the [`Router`] picks the upstream proxy for a tenant's request to a site, and hears what
//! came of it; the [`Authenticator`] tells the tenant from the token in the proxy password.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use http::{HeaderValue, StatusCode};
use tokio::sync::watch;

use crate::options::Options;
use crate::status::GatewayError;

/// One request to route.
#[derive(Clone, Copy)]
pub struct RouteRequest<'a> {
    /// The tenant the token belongs to.
    pub tenant: &'a str,
    /// The crawler's token (the proxy password), for routers that act with it; never logged.
    pub token: &'a str,
    /// The site: the request's host, as the client wrote it.
    pub host: &'a str,
    /// The port of the request's target.
    pub port: u16,
    /// What the user name asked for.
    pub options: &'a Options,
    /// A `CONNECT` tunnel (true) or a plain HTTP request.
    pub connect: bool,
    /// What the crawler reports of its session's proxy with `X-Egress-Report` (a refusal the gateway could not see,
    /// inside a tunnel): the router reports it and moves the session before routing this request.
    pub report: Option<Report>,
}

/// The request header a crawler reports its session's proxy with: `banned`, or `throttled` with an optional
/// `; retry-after=<seconds>`.
pub const REPORT_HEADER: &str = "x-egress-report";

/// A refusal the crawler saw through its session's proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Report {
    /// The site banned the proxy.
    Banned,
    /// The site throttled the proxy, to be left alone this long when it said.
    Throttled(Option<Duration>),
}

impl Report {
    /// Parses an `X-Egress-Report` value.
    ///
    /// # Errors
    /// What is wrong with it, for a 400.
    pub fn parse(value: &str) -> Result<Self, String> {
        let mut parts = value.split(';').map(str::trim);
        let outcome = parts.next().unwrap_or_default().to_ascii_lowercase();
        let mut retry_after = None;
        for part in parts {
            let seconds = part
                .strip_prefix("retry-after=")
                .and_then(|seconds| seconds.parse::<u64>().ok())
                .filter(|seconds| (1..=86_400).contains(seconds))
                .ok_or_else(|| format!("{REPORT_HEADER}: {part:?} is not retry-after=<seconds from 1 to 86400>"))?;
            retry_after = Some(Duration::from_secs(seconds));
        }
        match outcome.as_str() {
            "banned" if retry_after.is_none() => Ok(Self::Banned),
            "throttled" => Ok(Self::Throttled(retry_after)),
            _ => Err(format!("{REPORT_HEADER} is `banned` or `throttled[; retry-after=<seconds>]`, not {value:?}")),
        }
    }
}

impl fmt::Debug for RouteRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouteRequest")
            .field("tenant", &self.tenant)
            .field("host", &self.host)
            .field("port", &self.port)
            .field("options", &self.options)
            .field("connect", &self.connect)
            .field("report", &self.report)
            .finish_non_exhaustive()
    }
}

/// The upstream proxy a request goes through.
#[derive(Clone)]
pub struct Upstream {
    /// Its `host:port`.
    pub address: String,
    /// The `Proxy-Authorization` it takes (Basic), when it needs credentials.
    pub authorization: Option<HeaderValue>,
    /// Which proxy it is, for the `X-Egress-Proxy` answer header (`namespace/name`).
    pub proxy: String,
    /// The lease the request is made under, for the `X-Egress-Lease` answer header, when there is one.
    pub lease: Option<String>,
    /// The lease of the request's own (one without a session), kept until the request's answer (or its tunnel)
    /// ends and released when dropped.
    pub hold: Option<Arc<egress_client::LeaseGuard>>,
    /// Turns `true` when the router takes this upstream back from the site (it now cools down for it): a tunnel
    /// through it closes then, so a crawler's kept-alive tunnel cannot go on reaching the site through a banned proxy.
    pub revoked: Option<watch::Receiver<bool>>,
}

impl fmt::Debug for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The authorization holds the proxy's password.
        f.debug_struct("Upstream")
            .field("address", &self.address)
            .field("authorization", &self.authorization.as_ref().map(|_| "<redacted>"))
            .field("proxy", &self.proxy)
            .field("lease", &self.lease)
            .finish()
    }
}

impl Upstream {
    /// An upstream at `address` with Basic credentials `user:password`, when given.
    pub fn new(address: impl Into<String>, credentials: Option<(&str, &str)>, proxy: impl Into<String>) -> Self {
        let authorization = credentials.and_then(|(user, password)| {
            let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
            let mut value = HeaderValue::from_str(&format!("Basic {token}")).ok()?;
            value.set_sensitive(true);
            Some(value)
        });
        Self { address: address.into(), authorization, proxy: proxy.into(), lease: None, hold: None, revoked: None }
    }

    /// Resolves once the router has taken this upstream back; never when it cannot (no [`Upstream::revoked`], or
    /// its sender gone without revoking).
    pub async fn revocation(&self) {
        if let Some(mut revoked) = self.revoked.clone()
            && revoked.wait_for(|revoked| *revoked).await.is_ok()
        {
            return;
        }
        std::future::pending().await
    }
}

/// What came of a routed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routed {
    /// The upstream answered a plain HTTP request with this status (and `Retry-After`, in seconds, when given).
    Answered(StatusCode, Option<Duration>),
    /// The tunnel was set up (its traffic is the client's to judge).
    Tunnelled,
    /// The upstream could not be reached, or failed the request.
    Failed,
}

/// What the router made of an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The answer is the site's to give: it is passed on.
    Accepted,
    /// The site refused this proxy (a ban or a throttle): another proxy may get a better answer, so an idempotent
    /// request without a body is tried again elsewhere, a bounded number of times.
    Blocked,
}

/// Picks upstreams.
#[async_trait]
pub trait Router: Send + Sync + 'static {
    /// The upstream for `request`.
    ///
    /// # Errors
    /// A [`GatewayError`] the gateway answers with (no proxy for the site, a quota, a denied destination).
    async fn route(&self, request: &RouteRequest<'_>) -> Result<Upstream, GatewayError>;

    /// What came of a request routed to `upstream` (bans and throttles are reported from here), and whether the
    /// site blocked the proxy.
    async fn outcome(&self, request: &RouteRequest<'_>, upstream: &Upstream, outcome: Routed) -> Verdict {
        let _ = (request, upstream, outcome);
        Verdict::Accepted
    }

    /// Reports `report` on the proxy the session of `request` holds for its site, without routing anything through
    /// it (`POST /report` on the gateway); returns that proxy (`namespace/name`).
    ///
    /// # Errors
    /// The router keeps no sessions, or the session's proxy cannot be found or reported.
    async fn report(&self, request: &RouteRequest<'_>, report: Report) -> Result<String, GatewayError> {
        let _ = (request, report);
        Err(GatewayError::bad_request("this gateway routes every request to one proxy: there is nothing to report"))
    }
}

/// Tells tenants from tokens.
pub trait Authenticator: Send + Sync + 'static {
    /// The tenant `token` belongs to, when it may use the gateway; else why not.
    ///
    /// # Errors
    /// The token is unknown, or known without the scope the gateway needs.
    fn tenant(&self, token: &str) -> Result<String, TokenRefused>;
}

/// Why a token may not use the gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenRefused {
    /// No such token.
    Unknown,
    /// A valid token whose scope (named) does not include `lease`.
    Scope(&'static str),
}

impl TokenRefused {
    /// What the crawler is told.
    pub fn explain(self) -> String {
        match self {
            Self::Unknown => "the password is not a valid token".to_owned(),
            Self::Scope(scope) => {
                format!("the token is valid but has the {scope} scope: the gateway needs a token with the lease scope")
            }
        }
    }
}

/// Every request through one upstream (for benchmarks, tests and a single proxy).
#[derive(Clone, Debug)]
pub struct StaticRouter(pub Upstream);

#[async_trait]
impl Router for StaticRouter {
    async fn route(&self, _request: &RouteRequest<'_>) -> Result<Upstream, GatewayError> {
        Ok(self.0.clone())
    }
}

/// A fixed token → tenant map, compared in constant time.
#[derive(Clone, Debug, Default)]
pub struct StaticTokens(HashMap<String, String>);

impl StaticTokens {
    /// No tokens.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `token` for `tenant`.
    #[must_use]
    pub fn with(mut self, token: impl Into<String>, tenant: impl Into<String>) -> Self {
        self.0.insert(token.into(), tenant.into());
        self
    }
}

impl Authenticator for StaticTokens {
    fn tenant(&self, token: &str) -> Result<String, TokenRefused> {
        use subtle::ConstantTimeEq;
        let mut found = None;
        for (known, tenant) in &self.0 {
            if bool::from(known.as_bytes().ct_eq(token.as_bytes())) {
                found = Some(tenant.clone());
            }
        }
        found.ok_or(TokenRefused::Unknown)
    }
}
