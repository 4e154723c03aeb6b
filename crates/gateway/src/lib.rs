//! The gateway: one forward-proxy address for any crawler, in front of the fleet.
//!
//! A crawler sets `http://<options>:<token>@<gateway>:8080` as its proxy and needs nothing else: the password is a
//! tenant token, the user name carries options ([`options`]: a session, a pool, labels). Each request is routed to
//! an upstream proxy by a [`Router`] — through the lease store, so sessions stick, cooldowns and caps hold and
//! quotas count — and forwarded: an absolute-form `http://` request through the upstream with its answer streamed
//! back, a `CONNECT` as a tunnel through the upstream spliced to the client. Every answer the gateway makes itself
//! carries an RFC 9209 `Proxy-Status` ([`status`]).
//!
//! No `kube` in its contract: the router and the authenticator are traits.

pub mod admission;
pub mod autoanswer;
pub mod leases;
pub mod metrics;
pub mod options;
pub mod route;
pub mod server;
pub mod status;
pub mod tunnel;
mod upstream;

use http_body_util::combinators::BoxBody;
use hyper::body::Bytes;

pub use leases::{LeaseRouter, LeaseRouterConfig};
pub use metrics::GatewayMetrics;
pub use options::{OptionError, Options};
pub use route::{
    Authenticator, REPORT_HEADER, Report, RouteRequest, Routed, Router, StaticRouter, StaticTokens, TokenRefused,
    Upstream, Verdict,
};
pub use server::{Gateway, GatewayLimits};
pub use status::GatewayError;
pub use tunnel::Buffers;

/// The body of every request and answer the gateway passes on.
pub type Body = BoxBody<Bytes, hyper::Error>;
