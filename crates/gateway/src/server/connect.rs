//! `CONNECT`: a tunnel through the upstream proxy, answered `200` once the upstream agreed, then the client's own
//! TCP stream spliced to the upstream's until either side closes or the site refuses the proxy.

use http::{Request, Response};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tracing::debug;

use super::forward::identify;
use super::{Gateway, TenantSlot, Who};
use crate::Body;
use crate::autoanswer::ClientIo;
use crate::metrics::TunnelGauge;
use crate::route::{RouteRequest, Routed, Upstream};
use crate::status::{GatewayError, full};
use crate::tunnel::{Buffers, splice};
use crate::upstream::open_tunnel;

impl Gateway {
    pub(super) async fn tunnel(
        &self,
        request: Request<Incoming>,
        who: Who<'_>,
        tenant_slot: TenantSlot,
    ) -> Result<Response<Body>, GatewayError> {
        let authority = request
            .uri()
            .authority()
            .filter(|authority| request.uri().scheme().is_none() && authority.port_u16().is_some_and(|port| port != 0))
            .cloned()
            .ok_or_else(|| GatewayError::bad_request("CONNECT takes host:port, with a port from 1 to 65535"))?;
        let port = authority.port_u16().unwrap_or_default();
        tracing::Span::current().record("host", authority.host());
        // The tunnel outlives the client connection's slot (which is given back once the connection is upgraded).
        let slot = self.slots.clone().try_acquire_owned().map_err(|_| {
            self.metrics.refused_connection();
            GatewayError::busy("the gateway has as many connections and tunnels open as it takes")
        })?;
        let route = RouteRequest {
            tenant: who.tenant,
            token: who.token,
            host: authority.host(),
            port,
            options: who.options,
            connect: true,
            report: who.report,
        };
        let upstream = self.router.route(&route).await?;
        tracing::Span::current().record("proxy", upstream.proxy.as_str());
        let opened =
            tokio::time::timeout(self.limits.connect_timeout, open_tunnel(&upstream, authority.as_str())).await;
        let (stream, leftover) = match opened {
            Ok(Ok(opened)) => opened,
            Ok(Err(error)) => {
                self.router.outcome(&route, &upstream, Routed::Failed).await;
                return Err(error);
            }
            Err(_) => {
                self.router.outcome(&route, &upstream, Routed::Failed).await;
                return Err(GatewayError::upstream_timeout(format!(
                    "proxy {} did not open the tunnel in time",
                    upstream.proxy
                )));
            }
        };
        self.router.outcome(&route, &upstream, Routed::Tunnelled).await;
        let buffers = self.limits.tunnel_buffers;
        let upgrade = hyper::upgrade::on(request);
        // Kept until the tunnel closes (a lease of the tunnel's own is released then).
        let hold = upstream.hold.clone();
        let revoked = upstream.clone();
        let mut gauge = self.metrics.tunnel(who.tenant, &upstream.proxy);
        tokio::spawn(async move {
            let _hold = hold;
            let _slot = slot;
            let _tenant_slot = tenant_slot;
            let upgraded = match upgrade.await {
                Ok(upgraded) => upgraded,
                Err(error) => {
                    debug!(%error, "the client left before its tunnel opened");
                    return;
                }
            };
            // The client's own TCP stream, out of hyper's wrapping (a boxed stream behind a buffer of what was read
            // past the CONNECT head, behind the rewriting of hyper's own answers, which a tunnel never needs): each
            // read and write of the tunnel goes through three layers fewer.
            match upgraded.downcast::<TokioIo<ClientIo<TcpStream>>>() {
                Ok(parts) => {
                    let client = parts.io.into_inner().into_inner();
                    carry(client, &parts.read_buf, stream, &leftover, buffers, &revoked, &mut gauge).await;
                }
                Err(upgraded) => {
                    carry(TokioIo::new(upgraded), &[], stream, &leftover, buffers, &revoked, &mut gauge).await;
                }
            }
        });
        let mut response = Response::new(full(Bytes::new()));
        // What proxies (and RFC 9110's examples) answer a CONNECT with, and what the docs show.
        response.extensions_mut().insert(hyper::ext::ReasonPhrase::from_static(b"Connection established"));
        identify(response.headers_mut(), &upstream);
        Ok(response)
    }
}

/// Carries a tunnel between `client` and the proxy's `upstream` until either side ends it or the site refuses the
/// proxy: first what the client sent past its CONNECT head (`early`) and what the proxy sent past its answer
/// (`leftover`), then both ways.
async fn carry<C>(
    mut client: C,
    early: &[u8],
    mut upstream: TcpStream,
    leftover: &[u8],
    buffers: Buffers,
    revoked: &Upstream,
    gauge: &mut TunnelGauge,
) where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    if !early.is_empty() && upstream.write_all(early).await.is_err() {
        return;
    }
    if !leftover.is_empty() && client.write_all(leftover).await.is_err() {
        return;
    }
    tokio::select! {
        copied = splice(&mut client, &mut upstream, buffers) => match copied {
            Ok((up, down)) => gauge.carried(up, down),
            Err(error) => debug!(%error, "tunnel ended with an error"),
        },
        () = revoked.revocation() => {
            debug!(proxy = %revoked.proxy, "closing a tunnel: its proxy was refused by the site");
            gauge.revoked();
        }
    }
}
