//! The discovery API over a real socket: every route's success, every error status, auth scopes and token reload,
//! malformed and oversized bodies, and random inputs that must never produce a 5xx.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use egress_discovery::{
    Auth, CooldownJournal, Discovery, DiscoveryMetrics, PoolId, ProxyCredentials, ProxyId, ProxyRecord, TokenFile,
    router, serve,
};
use egress_lease::{Cooldown, InMemoryLeaseStore, LeaseConfig, LeaseKey};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

const READ: &str = "read-token-0123456789";
const LEASE: &str = "lease-token-0123456789";
/// A second lease-scope token: it must not see the first one's leases.
const OTHER_LEASE: &str = "other-lease-token-0123456789";
/// An admin-scope token: it may clear cooldowns.
const ADMIN: &str = "admin-token-0123456789";

fn record(name: &str, max_leases: u32) -> ProxyRecord {
    ProxyRecord {
        id: ProxyId::new("crawl", name),
        host: "10.0.0.1".into(),
        port: 3128,
        // An address of its own per proxy (shared addresses share cooldowns: tested below).
        egress_ip: Some(format!("203.0.113.{}", name.bytes().map(u32::from).sum::<u32>() % 250)),
        labels: BTreeMap::from([("region".to_owned(), "eu".to_owned())]),
        zone: Some("europe-west1-b".into()),
        provider: Some("gcp-eu".into()),
        max_leases,
        healthy: true,
        credentials: Some(ProxyCredentials::new("crawler", "p@ss")),
        cooldowns: Vec::new(),
        pool: None,
        cooldown: None,
        pacing: None,
    }
}

struct Server {
    address: SocketAddr,
    state: Arc<Discovery>,
    records: Vec<ProxyRecord>,
    tokens: Option<tempfile::NamedTempFile>,
}

impl Server {
    async fn start(records: Vec<ProxyRecord>, auth: bool) -> Self {
        Self::start_with(records, auth, LeaseKey::ephemeral(), None).await
    }

    /// A server whose store signs with `key`, keeping cooldowns in `journal` when given.
    async fn start_with(
        records: Vec<ProxyRecord>,
        auth: bool,
        key: LeaseKey,
        journal: Option<Arc<dyn CooldownJournal>>,
    ) -> Self {
        // READ and LEASE are one tenant's; OTHER_LEASE is a tenant of its own, and so is ADMIN.
        let tokens = auth.then(|| {
            format!("read {READ} tenant=crawlers\nlease {LEASE} tenant=crawlers\nlease {OTHER_LEASE}\nadmin {ADMIN}\n")
        });
        Self::start_with_tokens(records, tokens.as_deref(), key, journal).await
    }

    /// A server with the token file `tokens` (no authentication without one).
    async fn start_with_tokens(
        records: Vec<ProxyRecord>,
        tokens: Option<&str>,
        key: LeaseKey,
        journal: Option<Arc<dyn CooldownJournal>>,
    ) -> Self {
        let (auth, tokens) = match tokens {
            Some(text) => {
                let file = tempfile::NamedTempFile::new().expect("token file");
                std::fs::write(file.path(), text).expect("write tokens");
                (Auth::Tokens(TokenFile::load(file.path()).expect("tokens")), Some(file))
            }
            None => (Auth::Disabled, None),
        };
        let store = Arc::new(InMemoryLeaseStore::with_key(LeaseConfig::default(), key));
        let mut state = Discovery::new(store, auth, DiscoveryMetrics::default());
        if let Some(journal) = journal {
            state = state.with_journal(journal);
        }
        let state = Arc::new(state);
        for record in &records {
            state.upsert(record.clone()).await;
        }
        state.mark_synced();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        tokio::spawn(serve(listener, router(state.clone()), std::future::pending()));
        Self { address, state, records, tokens }
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&str>,
    ) -> (u16, http::HeaderMap, Value) {
        self.raw(method, path, token, body.map(|body| (body.to_owned(), "application/json"))).await
    }

    async fn raw(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<(String, &str)>,
    ) -> (u16, http::HeaderMap, Value) {
        let authorization = token.map(|token| format!("Bearer {token}"));
        let mut headers = Vec::new();
        if let Some(authorization) = &authorization {
            headers.push(("authorization", authorization.as_str()));
        }
        if let Some((_, content_type)) = &body {
            headers.push(("content-type", *content_type));
        }
        self.exchange(method, path, &headers, body.map(|(body, _)| body)).await
    }

    /// One request with exactly `headers` (besides Host).
    async fn exchange(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<String>,
    ) -> (u16, http::HeaderMap, Value) {
        let stream = tokio::net::TcpStream::connect(self.address).await.expect("connect");
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
        tokio::spawn(connection);
        let mut request = http::Request::builder().method(method).uri(path).header(http::header::HOST, "discovery");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let body = Full::new(body.map(Bytes::from).unwrap_or_default());
        let response = sender.send_request(request.body(body).expect("request")).await.expect("response");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let bytes = response.into_body().collect().await.expect("body").to_bytes();
        let value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        (status, headers, value)
    }

    async fn lease(&self, body: Value) -> (u16, Value) {
        let (status, _, value) = self.call("POST", "/v1/leases", Some(LEASE), Some(&body.to_string())).await;
        (status, value)
    }
}

fn assert_problem(headers: &http::HeaderMap, body: &Value, status: u16) {
    assert_eq!(
        headers.get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()),
        Some("application/problem+json"),
        "{body}"
    );
    assert_eq!(body["status"], status, "{body}");
    assert!(body["type"].as_str().is_some_and(|t| t.starts_with("urn:egress-operator:problem:")), "{body}");
    assert!(body["title"].is_string() && body["detail"].is_string(), "{body}");
}

#[tokio::test]
async fn every_route_succeeds() {
    let server = Server::start(vec![record("a", 2), record("b", 2)], true).await;
    let (status, _, body) = server.call("GET", "/v1/proxies?selector=region%3Deu", Some(READ), None).await;
    assert_eq!(status, 200);
    assert_eq!(body["proxies"].as_array().map(Vec::len), Some(2));
    assert_eq!(body["proxies"][0]["url"], "http://10.0.0.1:3128", "no credentials for a read token");
    assert_eq!(body["proxies"][0]["egressIP"], "203.0.113.97");

    let (status, headers, lease) = server
        .call(
            "POST",
            "/v1/leases",
            Some(LEASE),
            Some(r#"{"target":"https://www.shop.example.co.uk/x","ttlSeconds":60}"#),
        )
        .await;
    assert_eq!(status, 201, "{lease}");
    let id = lease["id"].as_str().expect("id").to_owned();
    assert_eq!(
        headers.get(http::header::LOCATION).and_then(|v| v.to_str().ok()),
        Some(format!("/v1/leases/{id}").as_str())
    );
    assert_eq!(lease["target"], "example.co.uk");
    assert_eq!(lease["proxy"]["url"], "http://crawler:p%40ss@10.0.0.1:3128", "credentials for a lease token");
    assert_eq!(
        lease["proxy"]["credentials"],
        serde_json::json!({ "username": "crawler", "password": "p@ss" }),
        "and as fields, not percent-encoded"
    );
    assert_eq!((lease["proxy"]["host"].as_str(), lease["proxy"]["port"].as_u64()), (Some("10.0.0.1"), Some(3128)));
    assert_eq!(lease["proxy"]["egressIP"], "203.0.113.97", "the address the site sees, for the holder's siblings");
    assert!(lease["expiresAt"].as_str().is_some_and(|t| t.ends_with('Z')));

    let (status, _, renewed) =
        server.call("POST", &format!("/v1/leases/{id}/renew"), Some(LEASE), Some(r#"{"ttlSeconds":120}"#)).await;
    assert_eq!(status, 200, "{renewed}");
    let (status, _, _) = server.call("POST", &format!("/v1/leases/{id}/renew"), Some(LEASE), None).await;
    assert_eq!(status, 200, "an empty renew body takes the default TTL");

    let (status, _, report) = server
        .call("POST", &format!("/v1/leases/{id}/report"), Some(LEASE), Some(r#"{"outcome":"banned","statusCode":403}"#))
        .await;
    assert_eq!(status, 200);
    assert!(report["cooldownUntil"].is_string(), "{report}");
    let (status, _, cooldowns) =
        server.call("GET", "/v1/cooldowns?target=img.shop.example.co.uk", Some(READ), None).await;
    assert_eq!(status, 200);
    assert_eq!(
        cooldowns["cooldowns"][0]["proxy"],
        lease["proxy"]["namespace"]
            .as_str()
            .map(|ns| format!("{ns}/{}", lease["proxy"]["name"].as_str().unwrap()))
            .unwrap()
    );

    // The banned proxy is skipped for that site but still leased for another.
    let banned = format!("crawl/{}", lease["proxy"]["name"].as_str().unwrap());
    let (_, other) = server.lease(json!({ "target": "example.co.uk" })).await;
    assert_ne!(format!("crawl/{}", other["proxy"]["name"].as_str().unwrap()), banned);
    let (status, _) = server.lease(json!({ "target": "another.org", "proxy": banned })).await;
    assert_eq!(status, 201);

    let (status, _, _) = server.call("DELETE", &format!("/v1/leases/{id}"), Some(LEASE), None).await;
    assert_eq!(status, 204);
    for path in ["/healthz", "/readyz"] {
        assert_eq!(server.call("GET", path, None, None).await.0, 200, "{path}");
    }
    let (status, _, openapi) = server.call("GET", "/openapi.json", None, None).await;
    assert_eq!(status, 200);
    assert_eq!(openapi["openapi"], "3.0.3");
}

#[tokio::test]
async fn every_error_status_is_a_problem_document() {
    let server = Server::start(vec![record("a", 1)], true).await;
    let cases: Vec<(&str, &str, Option<&str>, u16)> = vec![
        ("POST", "/v1/leases", Some("{not json"), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","colour":"blue"}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":""}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","ttlSeconds":0}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","ttlSeconds":99999}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","selector":"re gion=eu"}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"not a host"}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","proxy":"no-slash"}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","proxy":"crawl/a/b"}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","pool":"/eu"}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","sessionLifetimeSeconds":60}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","sessionMaxLeases":5}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","session":"s","sessionLifetimeSeconds":0}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","session":"s","sessionLifetimeSeconds":86401}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","session":"s","sessionMaxLeases":0}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","session":"s","sessionMaxLeases":1000001}"#), 400),
        ("POST", "/v1/leases", Some(r#"{"target":"x.com","proxy":"crawl/missing"}"#), 404),
        ("POST", "/v1/leases/l-unknown/renew", None, 404),
        ("DELETE", "/v1/leases/l-unknown", None, 404),
        ("POST", "/v1/leases/l-unknown/report", Some(r#"{"outcome":"ok"}"#), 404),
        ("POST", "/v1/leases/l-unknown/report", Some(r#"{"outcome":"meh"}"#), 400),
        ("POST", "/v1/leases/l-unknown/report", Some(r#"{"outcome":"ok","statusCode":42}"#), 400),
        ("POST", "/v1/leases/l-unknown/report", Some(r#"{}"#), 400),
        ("POST", "/v1/leases/l-unknown/report", Some(r#"{"ok":2000000}"#), 400),
        ("POST", "/v1/leases/l-unknown/report", Some(r#"{"ok":-1}"#), 400),
        ("POST", "/v1/leases/l-unknown/report", Some(r#"{"outcome":"banned","retryAfterSeconds":5}"#), 400),
        ("POST", "/v1/leases/l-unknown/report", Some(r#"{"outcome":"throttled","retryAfterSeconds":0}"#), 400),
        ("POST", "/v1/leases/l-unknown/report", Some(r#"{"ok":3,"failed":1}"#), 404),
        ("GET", "/v1/proxies?selector=%3D", None, 400),
        ("GET", "/v1/proxies?colour=blue", None, 400),
        ("GET", "/v1/cooldowns?target=not%20a%20host", None, 400),
        ("GET", "/v1/nothing", None, 404),
        ("PUT", "/v1/leases", None, 405),
    ];
    for (method, path, body, expected) in cases {
        let (status, headers, value) = server.call(method, path, Some(LEASE), body).await;
        assert_eq!(status, expected, "{method} {path} {body:?}: {value}");
        assert_problem(&headers, &value, expected);
    }
    let (_, _, why) =
        server.call("POST", "/v1/leases", Some(LEASE), Some(r#"{"target":"x.com","sessionMaxLeases":5}"#)).await;
    assert!(why["detail"].as_str().is_some_and(|detail| detail.contains("needs session")), "{why}");
    // 413 and 415.
    let huge = format!(r#"{{"target":"{}"}}"#, "a".repeat(20_000));
    let (status, headers, value) = server.call("POST", "/v1/leases", Some(LEASE), Some(&huge)).await;
    assert_eq!(status, 413, "{value}");
    assert_problem(&headers, &value, 413);
    let (status, headers, value) = server
        .raw("POST", "/v1/leases", Some(LEASE), Some(("target=x".into(), "application/x-www-form-urlencoded")))
        .await;
    assert_eq!(status, 415, "{value}");
    assert_problem(&headers, &value, 415);

    // 409: the named proxy is full, then cooling down; 503 with reasons and Retry-After.
    let (status, first) = server.lease(json!({ "target": "x.com" })).await;
    assert_eq!(status, 201);
    let (status, full) = server.lease(json!({ "target": "x.com", "proxy": "crawl/a" })).await;
    assert_eq!((status, full["reason"].as_str()), (409, Some("proxy-unavailable")), "{full}");
    let (status, _, capacity) = server.call("POST", "/v1/leases", Some(LEASE), Some(r#"{"target":"x.com"}"#)).await;
    assert_eq!((status, capacity["reason"].as_str()), (503, Some("all-at-capacity")));
    let id = first["id"].as_str().unwrap();
    server
        .call("POST", &format!("/v1/leases/{id}/report"), Some(LEASE), Some(r#"{"outcome":"banned","release":true}"#))
        .await;
    let (status, headers, cooling) =
        server.call("POST", "/v1/leases", Some(LEASE), Some(r#"{"target":"www.x.com"}"#)).await;
    assert_eq!((status, cooling["reason"].as_str()), (503, Some("all-cooling-down")), "{cooling}");
    assert!(headers.get(http::header::RETRY_AFTER).is_some());
    assert!(cooling["detail"].as_str().is_some_and(|d| d.contains("the first cooldown ends at")), "{cooling}");
    let (status, named) = server.lease(json!({ "target": "x.com", "proxy": "crawl/a" })).await;
    assert_eq!((status, named["reason"].as_str()), (409, Some("proxy-cooling-down")));

    // 410: the proxy turns unhealthy, its lease is revoked.
    let (_, other) = server.lease(json!({ "target": "y.com" })).await;
    let mut unhealthy = server.records[0].clone();
    unhealthy.healthy = false;
    server.state.upsert(unhealthy).await;
    let (status, headers, gone) =
        server.call("POST", &format!("/v1/leases/{}/renew", other["id"].as_str().unwrap()), Some(LEASE), None).await;
    assert_eq!(status, 410, "{gone}");
    assert_problem(&headers, &gone, 410);
    let (status, _, none) = server.call("POST", "/v1/leases", Some(LEASE), Some(r#"{"target":"y.com"}"#)).await;
    assert_eq!((status, none["reason"].as_str()), (503, Some("none-healthy")));
}

/// What a row sends (what it checks, method, path, headers, body) and the status it must get.
type Row<'a> = (&'a str, &'a str, &'a str, Vec<(&'a str, &'a str)>, Option<String>, u16);

/// The parsing holes a security review found, one row each: the request and the status it must get.
#[tokio::test]
async fn strict_parsing_of_schemes_media_types_paths_and_targets() {
    let server = Server::start(vec![record("a", 1000)], true).await;
    let lease_auth = format!("Bearer {LEASE}");
    let lower = format!("bearer {LEASE}");
    let upper = format!("BEARER {LEASE}");
    let json = "application/json";
    let lease = |target: &str| Some(json!({ "target": target }).to_string());
    let rows: Vec<Row<'_>> = vec![
        (
            "lowercase bearer scheme",
            "POST",
            "/v1/leases",
            vec![("authorization", &lower), ("content-type", json)],
            lease("x.com"),
            201,
        ),
        (
            "uppercase bearer scheme",
            "POST",
            "/v1/leases",
            vec![("authorization", &upper), ("content-type", json)],
            lease("x.com"),
            201,
        ),
        (
            "another scheme",
            "POST",
            "/v1/leases",
            vec![("authorization", "Basic bGVhc2U6eA=="), ("content-type", json)],
            lease("x.com"),
            401,
        ),
        ("a scheme without a token", "GET", "/v1/proxies", vec![("authorization", "Bearer")], None, 401),
        ("%FF in a renew path", "POST", "/v1/leases/%FF/renew", vec![("authorization", &lease_auth)], None, 400),
        ("%FF in a release path", "DELETE", "/v1/leases/%FF", vec![("authorization", &lease_auth)], None, 400),
        (
            "%FF in a report path",
            "POST",
            "/v1/leases/%FF/report",
            vec![("authorization", &lease_auth), ("content-type", json)],
            Some(r#"{"outcome":"ok"}"#.into()),
            400,
        ),
        (
            "a prefix of application/json",
            "POST",
            "/v1/leases",
            vec![("authorization", &lease_auth), ("content-type", "application/jsonfoo")],
            lease("x.com"),
            415,
        ),
        (
            "no Content-Type with a body",
            "POST",
            "/v1/leases",
            vec![("authorization", &lease_auth)],
            lease("x.com"),
            415,
        ),
        (
            "text/json",
            "POST",
            "/v1/leases",
            vec![("authorization", &lease_auth), ("content-type", "text/json")],
            lease("x.com"),
            415,
        ),
        (
            "application/+json",
            "POST",
            "/v1/leases",
            vec![("authorization", &lease_auth), ("content-type", "application/+json")],
            lease("x.com"),
            415,
        ),
        (
            "JSON with a charset",
            "POST",
            "/v1/leases",
            vec![("authorization", &lease_auth), ("content-type", "application/json; charset=utf-8")],
            lease("x.com"),
            201,
        ),
        (
            "a +json type",
            "POST",
            "/v1/leases",
            vec![("authorization", &lease_auth), ("content-type", "application/vnd.egress+json")],
            lease("x.com"),
            201,
        ),
        (
            "upper-case JSON",
            "POST",
            "/v1/leases",
            vec![("authorization", &lease_auth), ("content-type", "APPLICATION/JSON")],
            lease("x.com"),
            201,
        ),
        (
            "a javascript: target",
            "POST",
            "/v1/leases",
            vec![("authorization", &lease_auth), ("content-type", json)],
            lease("javascript:alert(1)"),
            400,
        ),
        (
            "a mailto: target",
            "POST",
            "/v1/leases",
            vec![("authorization", &lease_auth), ("content-type", json)],
            lease("mailto:a@b.com"),
            400,
        ),
        (
            "an ftp URL target",
            "POST",
            "/v1/leases",
            vec![("authorization", &lease_auth), ("content-type", json)],
            lease("ftp://example.com/"),
            400,
        ),
        (
            "an IDN target",
            "POST",
            "/v1/leases",
            vec![("authorization", &lease_auth), ("content-type", json)],
            lease("bücher.example.de"),
            201,
        ),
        (
            "an IDN URL target",
            "POST",
            "/v1/leases",
            vec![("authorization", &lease_auth), ("content-type", json)],
            lease("https://www.bücher.example.de/x"),
            201,
        ),
        (
            "an IDN cooldowns query",
            "GET",
            "/v1/cooldowns?target=b%C3%BCcher.example.de",
            vec![("authorization", &lease_auth)],
            None,
            200,
        ),
        (
            "a javascript: cooldowns query",
            "GET",
            "/v1/cooldowns?target=javascript%3Aalert(1)",
            vec![("authorization", &lease_auth)],
            None,
            400,
        ),
    ];
    for (what, method, path, headers, body, expected) in rows {
        let (status, response_headers, value) = server.exchange(method, path, &headers, body).await;
        assert_eq!(status, expected, "{what}: {value}");
        if status >= 400 {
            assert_problem(&response_headers, &value, expected);
        }
    }
}

#[tokio::test]
async fn unauthorized_differs_from_forbidden() {
    let server = Server::start(vec![record("a", 1)], true).await;
    let (status, headers, body) = server.call("GET", "/v1/proxies", None, None).await;
    assert_eq!(status, 401);
    assert!(headers.get(http::header::WWW_AUTHENTICATE).is_some());
    assert_problem(&headers, &body, 401);
    assert_eq!(server.call("GET", "/v1/proxies", Some("wrong-token-0123456789"), None).await.0, 401);
    let (status, headers, body) = server.call("POST", "/v1/leases", Some(READ), Some(r#"{"target":"x.com"}"#)).await;
    assert_eq!(status, 403);
    assert_problem(&headers, &body, 403);
    assert_eq!(server.call("GET", "/v1/proxies", Some(READ), None).await.0, 200);
    assert_eq!(server.call("GET", "/healthz", None, None).await.0, 200, "health endpoints need no token");
}

#[tokio::test]
async fn the_token_file_is_reloaded_when_it_changes() {
    let server = Server::start(vec![record("a", 1)], true).await;
    let path = server.tokens.as_ref().expect("token file").path().to_owned();
    let rotated = "rotated-lease-token-0123456789";
    std::fs::write(&path, format!("lease {rotated}\n")).expect("rewrite tokens");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut poll = tokio::time::interval(Duration::from_millis(200));
    loop {
        poll.tick().await;
        if server.call("GET", "/v1/proxies", Some(rotated), None).await.0 == 200 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the new token was never accepted");
    }
    assert_eq!(server.call("GET", "/v1/proxies", Some(LEASE), None).await.0, 401, "the old token is gone");
    // A broken file keeps the last good tokens.
    std::fs::write(&path, "nonsense\n").expect("break tokens");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < deadline {
        poll.tick().await;
        assert_eq!(server.call("GET", "/v1/proxies", Some(rotated), None).await.0, 200);
    }
}

#[tokio::test]
async fn readyz_waits_for_the_first_sync() {
    let store = Arc::new(InMemoryLeaseStore::new(LeaseConfig::default()));
    let state = Arc::new(Discovery::new(store, Auth::Disabled, DiscoveryMetrics::default()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(serve(listener, router(state.clone()), std::future::pending()));
    let server = Server { address, state: state.clone(), records: Vec::new(), tokens: None };
    let (status, headers, body) = server.call("GET", "/readyz", None, None).await;
    assert_eq!(status, 503);
    assert_problem(&headers, &body, 503);
    state.upsert(record("a", 1)).await;
    assert_eq!(server.call("GET", "/readyz", None, None).await.0, 503, "a proxy given is not the whole set");
    state.mark_synced();
    assert_eq!(server.call("GET", "/readyz", None, None).await.0, 200);
}

/// Reproducible random inputs: a seeded `fastrand` generator.
struct Rng(fastrand::Rng);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0.u64(..n.max(1))
    }
    fn text(&mut self) -> String {
        let alphabet = "ab/.-_:%?=&{}[]\"\\ é0";
        let chars: Vec<char> = alphabet.chars().collect();
        (0..self.below(12)).map(|_| chars[self.below(chars.len() as u64) as usize]).collect()
    }
    fn value(&mut self, depth: u32) -> Value {
        match self.below(if depth > 2 { 5 } else { 7 }) {
            0 => Value::Null,
            1 => json!(self.below(2) == 1),
            2 => json!(self.below(5000) as i64 - 100),
            3 => json!(self.text()),
            4 => json!(["ok", "banned", "failed", "x.com", "crawl/a"][self.below(5) as usize]),
            5 => Value::Array((0..self.below(3)).map(|_| self.value(depth + 1)).collect()),
            _ => {
                let keys =
                    ["target", "selector", "ttlSeconds", "proxy", "session", "outcome", "statusCode", "release", "x"];
                Value::Object(
                    (0..self.below(5))
                        .map(|_| (keys[self.below(keys.len() as u64) as usize].to_owned(), self.value(depth + 1)))
                        .collect(),
                )
            }
        }
    }
}

#[tokio::test]
async fn random_bodies_and_paths_never_get_a_5xx_other_than_503() {
    let server = Server::start(vec![record("a", 3), record("b", 0)], false).await;
    let mut rng = Rng(fastrand::Rng::with_seed(0x5eed_1234_9876_abcd));
    let (_, lease) = server.lease(json!({ "target": "x.com" })).await;
    let lease_id = lease["id"].as_str().unwrap().to_owned();
    let paths = [
        "/v1/leases".to_owned(),
        format!("/v1/leases/{lease_id}/renew"),
        format!("/v1/leases/{lease_id}/report"),
        "/v1/leases/x/report".to_owned(),
    ];
    for round in 0..400 {
        let (method, path, body) = match rng.below(4) {
            0 => ("POST", paths[rng.below(paths.len() as u64) as usize].clone(), Some(rng.value(0).to_string())),
            1 => ("GET", format!("/v1/proxies?selector={}&target={}", encode(&rng.text()), encode(&rng.text())), None),
            2 => (
                ["GET", "POST", "DELETE", "PATCH"][rng.below(4) as usize],
                format!("/v1/{}", encode(&rng.text())),
                Some(rng.text()),
            ),
            _ => ("DELETE", format!("/v1/leases/{}", encode(&rng.text())), None),
        };
        let (status, _, value) = server.call(method, &path, None, body.as_deref()).await;
        assert!(status < 500 || status == 503, "round {round}: {method} {path} {body:?} → {status} {value}");
    }
}

fn encode(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, percent_encoding::NON_ALPHANUMERIC).to_string()
}

#[test]
fn the_committed_openapi_document_is_current() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/discovery-openapi.json");
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    let current =
        format!("{}\n", serde_json::to_string_pretty(&egress_discovery::openapi::document()).expect("serialize"));
    assert!(committed == current, "{} is stale: run `cargo xtask crdgen` and commit the result", path.display());
}

#[tokio::test]
async fn leases_outlive_the_store_that_granted_them_and_belong_to_their_token() {
    // Two servers sharing a key: the leader before a restart or failover, and the one after.
    let key = LeaseKey::from_bytes(&[5; 32]).expect("key");
    let old = Server::start_with(vec![record("a", 1)], true, key.clone(), None).await;
    let new = Server::start_with(vec![record("a", 1)], true, key, None).await;
    let (status, lease) = old.lease(json!({ "target": "example.com", "ttlSeconds": 300 })).await;
    assert_eq!(status, 201, "{lease}");
    let id = lease["id"].as_str().expect("id").to_owned();

    // Another token sees nothing, exactly as for a lease that never existed.
    let (status, _, unknown) = new.call("POST", "/v1/leases/l1.AAAA.AAAA/renew", Some(LEASE), None).await;
    assert_eq!(status, 404);
    let (status, _, foreign) = new.call("POST", &format!("/v1/leases/{id}/renew"), Some(OTHER_LEASE), None).await;
    assert_eq!(status, 404);
    assert_eq!(
        (foreign["type"].clone(), foreign["title"].clone()),
        (unknown["type"].clone(), unknown["title"].clone())
    );
    assert_eq!(old.call("DELETE", &format!("/v1/leases/{id}"), Some(OTHER_LEASE), None).await.0, 404);

    // Its owner renews it on the new server: adopted, counted against the cap, with a fresh ID.
    let (status, _, renewed) =
        new.call("POST", &format!("/v1/leases/{id}/renew"), Some(LEASE), Some(r#"{"ttlSeconds":600}"#)).await;
    assert_eq!(status, 200, "{renewed}");
    assert_eq!((renewed["replaced"].as_bool(), renewed["proxy"]["name"].as_str()), (Some(false), Some("a")));
    let renewed_id = renewed["id"].as_str().expect("id").to_owned();
    assert_ne!(renewed_id, id, "the ID carries the new expiry");
    let (status, full) = new.lease(json!({ "target": "example.org" })).await;
    assert_eq!((status, full["reason"].as_str()), (503, Some("all-at-capacity")), "the adopted lease holds the slot");
    let (status, _, report) = new
        .call("POST", &format!("/v1/leases/{id}/report"), Some(LEASE), Some(r#"{"outcome":"banned","release":true}"#))
        .await;
    assert_eq!(status, 200, "the first ID still names the lease: {report}");
    let (status, leased) = new.lease(json!({ "target": "example.org" })).await;
    assert_eq!(status, 201, "the slot is free again: {leased}");
    let leased_id = leased["id"].as_str().expect("id");
    assert_eq!(new.call("DELETE", &format!("/v1/leases/{leased_id}"), Some(LEASE), None).await.0, 204);
    let (status, cooling) = new.lease(json!({ "target": "example.com", "proxy": "crawl/a" })).await;
    assert_eq!((status, cooling["reason"].as_str()), (409, Some("proxy-cooling-down")));
}

/// A journal that takes `delay` per write and remembers what it was given, or fails.
struct SlowJournal {
    delay: Duration,
    fail: std::sync::atomic::AtomicBool,
    writes: std::sync::Mutex<Vec<(String, Vec<Cooldown>, std::time::Instant)>>,
}

#[async_trait::async_trait]
impl CooldownJournal for SlowJournal {
    async fn write(&self, id: &ProxyId, cooldowns: &[Cooldown]) -> Result<(), String> {
        tokio::time::sleep(self.delay).await;
        if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("the apiserver said no".into());
        }
        self.writes.lock().expect("writes").push((id.to_string(), cooldowns.to_vec(), std::time::Instant::now()));
        Ok(())
    }
}

#[tokio::test]
async fn a_ban_is_answered_once_a_journal_write_holds_it_and_bursts_share_writes() {
    let journal = Arc::new(SlowJournal {
        delay: Duration::from_millis(200),
        fail: false.into(),
        writes: std::sync::Mutex::default(),
    });
    let server =
        Arc::new(Server::start_with(vec![record("a", 50)], true, LeaseKey::ephemeral(), Some(journal.clone())).await);
    let mut ids = Vec::new();
    for index in 0..12 {
        let (status, lease) = server.lease(json!({ "target": format!("site-{index}.example") })).await;
        assert_eq!(status, 201);
        ids.push(lease["id"].as_str().expect("id").to_owned());
    }
    let bans: Vec<_> = ids
        .into_iter()
        .enumerate()
        .map(|(index, id)| {
            let server = server.clone();
            tokio::spawn(async move {
                let (status, _, body) = server
                    .call("POST", &format!("/v1/leases/{id}/report"), Some(LEASE), Some(r#"{"outcome":"banned"}"#))
                    .await;
                assert_eq!(status, 200, "{body}");
                (format!("site-{index}.example"), std::time::Instant::now())
            })
        })
        .collect();
    let mut answered = Vec::new();
    for ban in bans {
        answered.push(ban.await.expect("ban"));
    }
    let writes = journal.writes.lock().expect("writes").clone();
    eprintln!("12 concurrent bans on one proxy: {} journal writes", writes.len());
    assert!(writes.len() <= 3, "a burst is coalesced: {} writes", writes.len());
    for (site, at) in &answered {
        assert!(
            writes.iter().any(|(id, cooldowns, written)| id == "crawl/a"
                && written <= at
                && cooldowns.iter().any(|cooldown| &cooldown.target == site)),
            "the ban on {site} was answered before a write held it"
        );
    }

    // A failing journal: the ban still holds and is answered; the write is retried until it succeeds.
    journal.fail.store(true, std::sync::atomic::Ordering::SeqCst);
    let (_, lease) = server.lease(json!({ "target": "late.example" })).await;
    let id = lease["id"].as_str().expect("id");
    let (status, _, _) =
        server.call("POST", &format!("/v1/leases/{id}/report"), Some(LEASE), Some(r#"{"outcome":"banned"}"#)).await;
    assert_eq!(status, 200);
    let before = journal.writes.lock().expect("writes").len();
    journal.fail.store(false, std::sync::atomic::Ordering::SeqCst);
    server.state.retry_journal().await;
    let writes = journal.writes.lock().expect("writes").clone();
    assert_eq!(writes.len(), before + 1, "retried once");
    assert!(writes.last().expect("write").1.iter().any(|cooldown| cooldown.target == "late.example"));
    server.state.retry_journal().await;
    assert_eq!(journal.writes.lock().expect("writes").len(), before + 1, "nothing left to retry");
}

#[tokio::test]
async fn kept_cooldowns_return_with_their_record_and_a_replacement_moves_leases_on_renew() {
    let server = Server::start(vec![record("a", 5), record("b", 5)], true).await;
    let until = std::time::SystemTime::now() + Duration::from_secs(600);
    let mut kept = record("a", 5);
    kept.cooldowns = vec![Cooldown {
        proxy: ProxyId::new("crawl", "a"),
        target: "example.com".into(),
        until,
        streak: 2,
        reporters: Vec::new(),
    }];
    server.state.upsert(kept).await;
    for _ in 0..4 {
        let (status, lease) = server.lease(json!({ "target": "www.example.com" })).await;
        assert_eq!((status, lease["proxy"]["name"].as_str()), (201, Some("b")), "a is cooling down: {lease}");
    }

    let (_, lease) = server.lease(json!({ "target": "example.org", "proxy": "crawl/a" })).await;
    let id = lease["id"].as_str().expect("id").to_owned();
    assert_eq!(server.state.leases_on(&ProxyId::new("crawl", "a"), "10.0.0.1:3128").await, 1);
    // The instance is replaced: a new address. The old one keeps its holder until it renews.
    server.state.upsert(ProxyRecord { host: "10.0.0.2".into(), ..record("a", 5) }).await;
    assert_eq!(server.state.leases_on(&ProxyId::new("crawl", "a"), "10.0.0.1:3128").await, 1);
    let (status, _, renewed) = server.call("POST", &format!("/v1/leases/{id}/renew"), Some(LEASE), None).await;
    assert_eq!(status, 200, "{renewed}");
    assert_eq!(renewed["replaced"], true);
    assert_eq!(renewed["proxy"]["url"], "http://crawler:p%40ss@10.0.0.2:3128");
    assert_eq!(
        server.state.leases_on(&ProxyId::new("crawl", "a"), "10.0.0.1:3128").await,
        0,
        "the old instance is drained"
    );
    let (_, _, again) = server.call("POST", &format!("/v1/leases/{id}/renew"), Some(LEASE), None).await;
    assert_eq!(again["replaced"], false);
}

#[tokio::test]
async fn throttles_cool_down_for_the_sites_retry_after_and_counts_feed_the_success_rate() {
    let server = Server::start(vec![record("a", 5), record("b", 5)], true).await;
    let (_, lease) = server.lease(json!({ "target": "shop.example.com", "proxy": "crawl/a" })).await;
    let id = lease["id"].as_str().expect("id").to_owned();
    let report = |body: &'static str| {
        let (server, id) = (&server, id.clone());
        async move { server.call("POST", &format!("/v1/leases/{id}/report"), Some(LEASE), Some(body)).await }
    };
    let (status, _, counted) = report(r#"{"ok":40,"failed":2}"#).await;
    assert_eq!((status, counted), (200, json!({})), "counts alone start no cooldown");
    let (status, _, throttled) = report(r#"{"outcome":"throttled","statusCode":429,"retryAfterSeconds":30}"#).await;
    assert_eq!(status, 200, "{throttled}");
    let until: jiff::Timestamp = throttled["cooldownUntil"].as_str().expect("until").parse().expect("RFC 3339");
    let wait = until.duration_since(jiff::Timestamp::now()).as_secs();
    assert!((28..=31).contains(&wait), "about 30 s: {wait}");
    let (status, cooling) = server.lease(json!({ "target": "shop.example.com", "proxy": "crawl/a" })).await;
    assert_eq!((status, cooling["reason"].as_str()), (409, Some("proxy-cooling-down")));
    assert!(cooling["retryAfterSeconds"].as_u64().is_some_and(|seconds| (28..=31).contains(&seconds)), "{cooling}");

    let (_, _, listed) = server.call("GET", "/v1/proxies?target=www.example.com", Some(READ), None).await;
    let a = listed["proxies"].as_array().expect("list").iter().find(|p| p["name"] == "a").expect("a").clone();
    assert_eq!(a["reported"], 43);
    assert!((a["successRate"].as_f64().expect("rate") - 40.0 / 43.0).abs() < 1e-9, "{a}");
    let (_, _, other) = server.call("GET", "/v1/proxies?target=other.org", Some(READ), None).await;
    assert!(other["proxies"][0].get("successRate").is_none(), "per site: {other}");
}

#[tokio::test]
async fn a_ban_reaches_every_proxy_behind_the_same_address_and_is_kept_for_each() {
    let journal = Arc::new(SlowJournal {
        delay: Duration::from_millis(10),
        fail: false.into(),
        writes: std::sync::Mutex::default(),
    });
    let shared = |name: &str| ProxyRecord { egress_ip: Some("198.51.100.7".into()), ..record(name, 5) };
    let server = Server::start_with(
        vec![shared("a"), shared("b"), record("c", 5)],
        true,
        LeaseKey::ephemeral(),
        Some(journal.clone()),
    )
    .await;
    let (_, lease) = server.lease(json!({ "target": "shop.example.com", "proxy": "crawl/a" })).await;
    let id = lease["id"].as_str().expect("id");
    let (status, _, _) =
        server.call("POST", &format!("/v1/leases/{id}/report"), Some(LEASE), Some(r#"{"outcome":"banned"}"#)).await;
    assert_eq!(status, 200);
    let mut written: Vec<String> = journal.writes.lock().expect("writes").iter().map(|(id, _, _)| id.clone()).collect();
    written.sort();
    assert_eq!(written, ["crawl/a", "crawl/b"], "kept for both before the answer");
    for _ in 0..4 {
        let (status, other) = server.lease(json!({ "target": "www.example.com" })).await;
        assert_eq!((status, other["proxy"]["name"].as_str()), (201, Some("c")), "b shares a's address: {other}");
    }
    let (_, _, cooldowns) = server.call("GET", "/v1/cooldowns?target=example.com", Some(READ), None).await;
    assert_eq!(cooldowns["cooldowns"].as_array().map(Vec::len), Some(2), "{cooldowns}");
}

/// Counts the wakes the API sends, by pool.
#[derive(Default)]
struct Wakes(std::sync::Mutex<Vec<String>>);

impl egress_discovery::PoolWaker for Wakes {
    fn wake(&self, pool: &PoolId) {
        self.0.lock().unwrap().push(pool.to_string());
    }
}

fn pool(namespace: &str, name: &str, replicas: u32, ready: u32, wakes: bool) -> egress_discovery::PoolRecord {
    egress_discovery::PoolRecord {
        id: PoolId::new(namespace, name),
        replicas,
        ready,
        wakes,
        provisioning: Duration::from_secs(42),
    }
}

#[tokio::test]
async fn leases_by_pool_wake_an_empty_pool_and_record_its_demand() {
    let member =
        |name: &str, pool: &str, max: u32| ProxyRecord { pool: Some(pool.parse().unwrap()), ..record(name, max) };
    let records = vec![member("eu-0", "crawl/eu", 1), member("us-0", "crawl/us", 1), record("loose", 5)];
    let store = Arc::new(InMemoryLeaseStore::new(LeaseConfig::default()));
    let wakes = Arc::new(Wakes::default());
    let state =
        Arc::new(Discovery::new(store, Auth::Disabled, DiscoveryMetrics::default()).with_pool_waker(wakes.clone()));
    for record in &records {
        state.upsert(record.clone()).await;
    }
    state.upsert_pool(pool("crawl", "eu", 1, 1, true));
    state.upsert_pool(pool("crawl", "us", 1, 1, false));
    state.upsert_pool(pool("crawl", "night", 0, 0, true));
    state.upsert_pool(pool("crawl", "off", 0, 0, false));
    state.upsert_pool(pool("crawl", "booting", 2, 0, true));
    state.upsert_pool(pool("crawl", "twice", 1, 1, false));
    state.upsert_pool(pool("other", "twice", 1, 1, false));
    state.mark_synced();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(serve(listener, router(state.clone()), std::future::pending()));
    let server = Server { address, state: state.clone(), records, tokens: None };

    // Listing: every entry says its pool; `pool` filters.
    let (status, _, body) = server.call("GET", "/v1/proxies", None, None).await;
    assert_eq!(status, 200);
    let pools: Vec<Value> = body["proxies"].as_array().expect("proxies").iter().map(|p| p["pool"].clone()).collect();
    assert_eq!(pools, [json!("eu"), json!(null), json!("us")], "{body}");
    let (_, _, body) = server.call("GET", "/v1/proxies?pool=crawl%2Feu", None, None).await;
    assert_eq!(body["proxies"].as_array().map(Vec::len), Some(1), "{body}");
    assert_eq!(body["proxies"][0]["name"], "eu-0");

    // Leasing by pool gives members only; the pool full is refused for its own capacity, and its demand noted.
    let (status, body) = server.lease(json!({ "target": "example.com", "pool": "eu" })).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["proxy"]["name"], "eu-0");
    let (status, body) = server.lease(json!({ "target": "example.com", "pool": "crawl/eu" })).await;
    assert_eq!((status, body["reason"].as_str()), (503, Some("all-at-capacity")), "{body}");
    assert!(state.pool_demand(&PoolId::new("crawl", "eu")).at_capacity.is_some());
    assert_eq!(state.active_leases(&ProxyId::new("crawl", "eu-0")).await, 1);

    // At zero, a pool that autoscales answers scaling-up with how long a member takes, and is woken.
    let (status, headers, body) = server
        .call("POST", "/v1/leases", None, Some(&json!({ "target": "example.com", "pool": "night" }).to_string()))
        .await;
    assert_eq!(status, 503, "{body}");
    assert_problem(&headers, &body, 503);
    assert_eq!(body["reason"], "scaling-up", "{body}");
    assert_eq!(headers.get("retry-after").and_then(|v| v.to_str().ok()), Some("42"));
    assert!(state.pool_demand(&PoolId::new("crawl", "night")).woken.is_some());
    // Members coming up: scaling-up as well.
    let (status, body) = server.lease(json!({ "target": "example.com", "pool": "booting" })).await;
    assert_eq!((status, body["reason"].as_str()), (503, Some("scaling-up")), "{body}");
    // Its members are on their way: no demand for more.
    assert_eq!(state.pool_demand(&PoolId::new("crawl", "booting")), egress_discovery::PoolDemand::default());
    assert_eq!(*wakes.0.lock().unwrap(), ["crawl/eu", "crawl/night"]);
    // A pool that does not autoscale has nothing to wake.
    let (status, body) = server.lease(json!({ "target": "example.com", "pool": "off" })).await;
    assert_eq!((status, body["reason"].as_str()), (503, Some("none-healthy")), "{body}");
    assert!(state.pool_demand(&PoolId::new("crawl", "off")).woken.is_none());

    // Unknown and ambiguous pools.
    let (status, body) = server.lease(json!({ "target": "example.com", "pool": "nope" })).await;
    assert_eq!((status, body["reason"].as_str()), (404, Some("unknown-pool")), "{body}");
    let (status, body) = server.lease(json!({ "target": "example.com", "pool": "twice" })).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["detail"].as_str().unwrap_or_default().contains("namespace/name"), "{body}");
    let (status, _, body) = server.call("GET", "/v1/proxies?pool=nope", None, None).await;
    assert_eq!(status, 404, "{body}");
}

/// One client's repeated bans cannot lengthen a cooldown; another token's ban counts once; an administrator clears
/// a cooldown (kept so in the journal, so it does not come back), and the site leases again at once.
#[tokio::test]
async fn one_token_cannot_escalate_a_ban_and_an_admin_clears_it() {
    let journal =
        Arc::new(SlowJournal { delay: Duration::ZERO, fail: false.into(), writes: std::sync::Mutex::default() });
    let server = Server::start_with(
        vec![record("a", 5), record("b", 5)],
        true,
        LeaseKey::ephemeral(),
        Some(journal.clone() as Arc<dyn CooldownJournal>),
    )
    .await;
    let (_, lease) = server.lease(json!({ "target": "shop.example.com", "proxy": "crawl/a" })).await;
    let id = lease["id"].as_str().expect("id").to_owned();
    let ban = |token: &'static str, id: String| {
        let server = &server;
        async move {
            let (status, _, body) = server
                .call("POST", &format!("/v1/leases/{id}/report"), Some(token), Some(r#"{"outcome":"banned"}"#))
                .await;
            assert_eq!(status, 200, "{body}");
            body["cooldownUntil"].as_str().expect("the running cooldown's end").to_owned()
        }
    };
    let first = ban(LEASE, id.clone()).await;
    let writes = journal.writes.lock().expect("writes").len();
    for _ in 0..20 {
        assert_eq!(ban(LEASE, id.clone()).await, first, "twenty more bans from one token change nothing");
    }
    assert_eq!(journal.writes.lock().expect("writes").len(), writes, "and need no journal write");
    let (_, _, cooldowns) = server.call("GET", "/v1/cooldowns?target=example.com", Some(READ), None).await;
    assert_eq!(
        (cooldowns["cooldowns"][0]["streak"].as_u64(), cooldowns["cooldowns"].as_array().map(Vec::len)),
        (Some(1), Some(1))
    );

    // Another token's ban on its own lease of the same proxy counts once.
    let (status, _, theirs) = server
        .call("POST", "/v1/leases", Some(OTHER_LEASE), Some(r#"{"target":"example.com","proxy":"crawl/b"}"#))
        .await;
    assert_eq!(status, 201, "{theirs}");
    // b is not cooling down: a's cooldown is a's (different egress IPs).
    let (_, _, cooldowns) = server.call("GET", "/v1/cooldowns?target=example.com", Some(READ), None).await;
    assert_eq!(cooldowns["cooldowns"].as_array().map(Vec::len), Some(1));

    // Only an admin may clear; a missing target or an unknown proxy is a clear error.
    for token in [READ, LEASE] {
        let (status, headers, body) =
            server.call("DELETE", "/v1/cooldowns?target=example.com", Some(token), None).await;
        assert_eq!(status, 403, "{body}");
        assert_problem(&headers, &body, 403);
        assert!(body["detail"].as_str().is_some_and(|detail| detail.contains("admin scope")), "{body}");
    }
    let (status, _, body) = server.call("DELETE", "/v1/cooldowns", Some(ADMIN), None).await;
    assert_eq!(status, 400, "{body}");
    let (status, _, body) =
        server.call("DELETE", "/v1/cooldowns?target=example.com&proxy=crawl/nope", Some(ADMIN), None).await;
    assert_eq!(status, 404, "{body}");
    let (status, _, body) = server.call("DELETE", "/v1/cooldowns?target=-a.com..", Some(ADMIN), None).await;
    assert_eq!(status, 400, "{body}");

    let (status, _, cleared) =
        server.call("DELETE", "/v1/cooldowns?target=www.example.com&proxy=crawl/a", Some(ADMIN), None).await;
    assert_eq!(status, 200, "{cleared}");
    assert_eq!(cleared["cleared"][0]["proxy"], "crawl/a");
    assert_eq!(cleared["cleared"].as_array().map(Vec::len), Some(1));
    let kept = journal.writes.lock().expect("writes").last().cloned().expect("a write");
    assert_eq!(kept.0, "crawl/a");
    assert!(
        kept.1.iter().all(|cooldown| cooldown.until <= std::time::SystemTime::now()),
        "kept as ended: {:?}",
        kept.1
    );
    let (status, leased) = server.lease(json!({ "target": "example.com", "proxy": "crawl/a" })).await;
    assert_eq!(status, 201, "the site leases a at once: {leased}");
    let (_, _, cooldowns) = server.call("GET", "/v1/cooldowns", Some(READ), None).await;
    assert_eq!(cooldowns["cooldowns"].as_array().map(Vec::len), Some(0));
}

/// Released means gone: 15 leases taken and released never renew (404), and the cap holds.
#[tokio::test]
async fn released_leases_answer_404_on_renew_and_never_pass_the_cap() {
    let server = Server::start(vec![record("a", 5)], true).await;
    let mut ids = Vec::new();
    for _ in 0..15 {
        let (status, lease) = server.lease(json!({ "target": "example.com" })).await;
        assert_eq!(status, 201, "{lease}");
        let id = lease["id"].as_str().expect("id").to_owned();
        assert_eq!(server.call("DELETE", &format!("/v1/leases/{id}"), Some(LEASE), None).await.0, 204);
        ids.push(id);
    }
    for id in &ids {
        let (status, headers, body) = server.call("POST", &format!("/v1/leases/{id}/renew"), Some(LEASE), None).await;
        assert_eq!(status, 404, "{body}");
        assert_problem(&headers, &body, 404);
    }
    let (_, _, listed) = server.call("GET", "/v1/proxies", Some(READ), None).await;
    assert_eq!(listed["proxies"][0]["activeLeases"], 0);
}

/// Two tenants share a fleet: each has its own leases, sessions, cooldowns and credentials, quotas bound each one
/// alone (429 with a problem type of its own), and an admin sees and clears everything.
#[tokio::test]
async fn tenants_have_their_own_leases_sessions_cooldowns_and_quotas() {
    const A_LEASE: &str = "tenant-a-lease-token-0123";
    const A_READ: &str = "tenant-a-read-token-01234";
    const B_LEASE: &str = "tenant-b-lease-token-0123";
    let tokens = format!(
        "lease {A_LEASE} tenant=team-a maxLeases=3 maxLeaseSeconds=60 reportsPerMinute=4\n\
         read {A_READ} tenant=team-a\nlease {B_LEASE} tenant=team-b\nadmin {ADMIN} tenant=ops\n"
    );
    let records = vec![record("a", 5), record("b", 5), record("c", 5), record("d", 5)];
    let server = Server::start_with_tokens(records, Some(&tokens), LeaseKey::ephemeral(), None).await;
    let lease = |token: &'static str, body: Value| {
        let server = &server;
        async move {
            let (status, headers, body) = server.call("POST", "/v1/leases", Some(token), Some(&body.to_string())).await;
            (status, headers, body)
        }
    };

    // A session is its tenant's: B naming A's session key gets a session of its own.
    let (status, _, a_first) = lease(A_LEASE, json!({ "target": "shop.example.com", "session": "s1" })).await;
    assert_eq!(status, 201, "{a_first}");
    let (_, _, b_first) = lease(B_LEASE, json!({ "target": "shop.example.com", "session": "s1" })).await;
    assert_ne!(b_first["proxy"]["name"], a_first["proxy"]["name"], "B does not get A's session's proxy");
    let (_, _, a_again) = lease(A_LEASE, json!({ "target": "shop.example.com", "session": "s1" })).await;
    assert_eq!(a_again["proxy"]["name"], a_first["proxy"]["name"], "A's session sticks");

    // The default TTL is capped by maxLeaseSeconds, and a longer one is refused.
    let expires = a_first["expiresAt"].as_str().expect("expiresAt");
    let expires: jiff::Timestamp = expires.parse().expect("a timestamp");
    assert!(expires.duration_since(jiff::Timestamp::now()).as_secs() <= 60, "{expires}");
    let (status, _, body) = lease(A_LEASE, json!({ "target": "x.example.com", "ttlSeconds": 120 })).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["detail"].as_str().is_some_and(|detail| detail.contains("maxLeaseSeconds (60)")), "{body}");
    // Named, with the limit, so a client can ask again within it (the gateway does).
    assert_eq!((body["reason"].as_str(), body["maxLeaseSeconds"].as_u64()), (Some("ttl-above-tenant-max"), Some(60)));

    // maxLeases: A's third lease is its last; the fourth is 429 quota-exceeded with Retry-After. B is unaffected.
    let (status, _, a_other) = lease(A_LEASE, json!({ "target": "other.example.org" })).await;
    assert_eq!(status, 201);
    let held_by_a =
        [a_first["proxy"]["name"].as_str(), a_again["proxy"]["name"].as_str(), a_other["proxy"]["name"].as_str()];
    let (status, headers, body) = lease(A_LEASE, json!({ "target": "more.example.org" })).await;
    assert_eq!(status, 429, "{body}");
    assert_problem(&headers, &body, 429);
    assert_eq!(
        (body["type"].as_str(), body["reason"].as_str()),
        (Some("urn:egress-operator:problem:quota-exceeded"), Some("quota-max-leases"))
    );
    assert!(headers.get(http::header::RETRY_AFTER).is_some());
    let mut held_by_b = vec![b_first["proxy"]["name"].as_str().expect("name").to_owned()];
    for index in 0..4 {
        let (status, _, body) = lease(B_LEASE, json!({ "target": format!("b{index}.example.org") })).await;
        assert_eq!(status, 201, "B leases on: {body}");
        held_by_b.push(body["proxy"]["name"].as_str().expect("name").to_owned());
    }

    // Credentials in a listing only on the caller's own leases.
    let (_, _, listed) = server.call("GET", "/v1/proxies", Some(A_LEASE), None).await;
    for proxy in listed["proxies"].as_array().expect("proxies") {
        let with_credentials = proxy["url"].as_str().is_some_and(|url| url.contains('@'));
        assert_eq!(with_credentials, held_by_a.contains(&proxy["name"].as_str()), "{proxy}");
    }
    let a_proxy = a_first["proxy"]["name"].as_str().expect("name");
    let (_, _, listed_b) = server.call("GET", "/v1/proxies", Some(B_LEASE), None).await;
    let seen_by_b = listed_b["proxies"].as_array().expect("proxies").iter().find(|p| p["name"] == a_proxy).cloned();
    let b_holds_it = held_by_b.iter().any(|name| name == a_proxy);
    assert_eq!(seen_by_b.expect("listed")["url"].as_str().is_some_and(|url| url.contains('@')), b_holds_it);
    let (_, _, listed_admin) = server.call("GET", "/v1/proxies", Some(ADMIN), None).await;
    assert!(
        listed_admin["proxies"]
            .as_array()
            .expect("proxies")
            .iter()
            .all(|p| p["url"].as_str().is_some_and(|u| u.contains('@')))
    );

    // Cooldowns: A's ban is A's to see (any of its tokens); B sees none; an admin sees it.
    let id = a_first["id"].as_str().expect("id");
    let (status, _, _) =
        server.call("POST", &format!("/v1/leases/{id}/report"), Some(A_LEASE), Some(r#"{"outcome":"banned"}"#)).await;
    assert_eq!(status, 200);
    let count = |token: &'static str| {
        let server = &server;
        async move {
            let (_, _, body) = server.call("GET", "/v1/cooldowns", Some(token), None).await;
            body["cooldowns"].as_array().map_or(0, Vec::len)
        }
    };
    assert_eq!((count(A_READ).await, count(A_LEASE).await, count(B_LEASE).await, count(ADMIN).await), (1, 1, 0, 1));
    // B's leases on other proxies still work for that site.
    let (status, _, body) = lease(B_LEASE, json!({ "target": "shop.example.com" })).await;
    assert_eq!(status, 201, "{body}");
    assert_ne!(body["proxy"]["name"].as_str(), Some(a_proxy));

    // reportsPerMinute: A's fifth report this minute is refused; B's are not.
    for _ in 0..3 {
        let (status, _, _) =
            server.call("POST", &format!("/v1/leases/{id}/report"), Some(A_LEASE), Some(r#"{"ok":1}"#)).await;
        assert_eq!(status, 200);
    }
    let (status, headers, body) =
        server.call("POST", &format!("/v1/leases/{id}/report"), Some(A_LEASE), Some(r#"{"ok":1}"#)).await;
    assert_eq!((status, body["reason"].as_str()), (429, Some("quota-reports-per-minute")), "{body}");
    assert!(headers.get(http::header::RETRY_AFTER).is_some());
    let b_id = b_first["id"].as_str().expect("id");
    let (status, _, _) =
        server.call("POST", &format!("/v1/leases/{b_id}/report"), Some(B_LEASE), Some(r#"{"ok":1}"#)).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn a_proxy_with_a_cooldown_policy_of_its_own_shows_it_and_a_ban_follows_it() {
    let policy =
        egress_lease::CooldownPolicy { base: Duration::from_secs(30), factor: 3, max: Duration::from_secs(300) };
    let server = Server::start(vec![ProxyRecord { cooldown: Some(policy), ..record("a", 2) }], true).await;
    let (status, _, body) = server.call("GET", "/v1/proxies", Some(READ), None).await;
    assert_eq!(status, 200);
    assert_eq!(body["proxies"][0]["cooldownPolicy"], json!({ "baseSeconds": 30, "factor": 3, "maxSeconds": 300 }));
    let (status, lease) = server.lease(json!({ "target": "shop.example" })).await;
    assert_eq!(status, 201, "{lease}");
    let id = lease["id"].as_str().expect("id");
    let (status, _, banned) =
        server.call("POST", &format!("/v1/leases/{id}/report"), Some(LEASE), Some(r#"{"outcome":"banned"}"#)).await;
    assert_eq!(status, 200, "{banned}");
    let until: jiff::Timestamp = banned["cooldownUntil"].as_str().expect("cooldownUntil").parse().expect("a time");
    let wait = until.duration_since(jiff::Timestamp::now()).as_secs();
    assert!((28..=31).contains(&wait), "a 30 s cooldown, not the default 600 s: {wait} s");
}

/// `DELETE /v1/sessions`: a tenant ends one of its sessions by name or all of them; their leases answer 404 on renew,
/// the proxies they kept are forgotten (the session's next lease is counted as a new one), and another tenant's
/// session of the same name, and leases without a session, stay. Bad input is refused naming it.
#[tokio::test]
async fn a_tenant_ends_its_sessions_by_name_or_all_at_once() {
    const A_LEASE: &str = "tenant-a-lease-token-0123";
    const A_READ: &str = "tenant-a-read-token-01234";
    const B_LEASE: &str = "tenant-b-lease-token-0123";
    let tokens = format!("lease {A_LEASE} tenant=team-a\nread {A_READ} tenant=team-a\nlease {B_LEASE} tenant=team-b\n");
    let server =
        Server::start_with_tokens(vec![record("a", 5), record("b", 5)], Some(&tokens), LeaseKey::ephemeral(), None)
            .await;
    let lease = |token: &'static str, body: Value| {
        let server = &server;
        async move {
            let (status, _, body) = server.call("POST", "/v1/leases", Some(token), Some(&body.to_string())).await;
            assert_eq!(status, 201, "{body}");
            body["id"].as_str().expect("an id").to_owned()
        }
    };
    let renews = |token: &'static str, id: String| {
        let server = &server;
        async move { server.call("POST", &format!("/v1/leases/{}/renew", encode(&id)), Some(token), Some("{}")).await.0 }
    };
    let s1 = [
        lease(A_LEASE, json!({ "target": "shop.example", "session": "s 1/ü" })).await,
        lease(A_LEASE, json!({ "target": "news.example", "session": "s 1/ü" })).await,
    ];
    let s2 = lease(A_LEASE, json!({ "target": "shop.example", "session": "s2" })).await;
    let plain = lease(A_LEASE, json!({ "target": "shop.example" })).await;
    let theirs = lease(B_LEASE, json!({ "target": "shop.example", "session": "s 1/ü" })).await;

    let (status, _, body) = server.call("DELETE", "/v1/sessions?session=s%201%2F%C3%BC", Some(A_LEASE), None).await;
    assert_eq!((status, body.clone()), (200, json!({ "sessions": 2, "releasedLeases": 2 })), "{body}");
    for id in s1 {
        assert_eq!(renews(A_LEASE, id).await, 404, "the session's leases are released");
    }
    for (token, id) in [(A_LEASE, s2.clone()), (A_LEASE, plain.clone()), (B_LEASE, theirs.clone())] {
        assert_eq!(renews(token, id).await, 200, "left alone");
    }

    // Bad input and scope, each named.
    for (path, token, status, says) in [
        ("/v1/sessions?session=", A_LEASE, 400, "1 to 256 characters"),
        ("/v1/sessions?name=s2", A_LEASE, 400, "unknown query parameter \"name\""),
        ("/v1/sessions", A_READ, 403, "lease scope"),
    ] {
        let (got, headers, body) = server.call("DELETE", path, Some(token), None).await;
        assert_eq!(got, status, "{path}: {body}");
        assert_problem(&headers, &body, status);
        assert!(body["detail"].as_str().is_some_and(|detail| detail.contains(says)), "{path}: {body}");
    }
    let long = format!("/v1/sessions?session={}", "x".repeat(257));
    assert_eq!(server.call("DELETE", &long, Some(A_LEASE), None).await.0, 400);

    // All of A's sessions: s2 (the other session's proxy was forgotten already), not the session-less lease.
    let (status, _, body) = server.call("DELETE", "/v1/sessions", Some(A_LEASE), None).await;
    assert_eq!((status, body.clone()), (200, json!({ "sessions": 1, "releasedLeases": 1 })), "{body}");
    assert_eq!(renews(A_LEASE, s2).await, 404);
    assert_eq!(renews(A_LEASE, plain).await, 200, "a lease without a session stays");
    assert_eq!(renews(B_LEASE, theirs).await, 200, "another tenant's session stays");
    let (_, _, body) = server.call("DELETE", "/v1/sessions", Some(A_LEASE), None).await;
    assert_eq!(body, json!({ "sessions": 0, "releasedLeases": 0 }), "nothing left to end");
}

/// A stopping replica hands the requests that still reach it to its successor: a lease sent while no successor is
/// known waits for one, is answered by it (the lease is the successor's: it renews there) and closes its connection
/// (the client's next request goes through the Service again); a successor handing off in turn passes it on; probes
/// stay local.
#[tokio::test]
async fn a_stopping_replica_hands_its_requests_to_its_successor() {
    let key = LeaseKey::ephemeral();
    let old = Server::start_with(vec![record("a", 5)], true, key.clone(), None).await;
    let new = Server::start_with(vec![record("a", 5)], true, key, None).await;
    old.state.hand_off();
    let (status, _, _) = old.call("GET", "/healthz", None, None).await;
    assert_eq!(status, 200, "probes are answered here");

    let started = std::time::Instant::now();
    let lease = old.call("POST", "/v1/leases", Some(LEASE), Some(r#"{"target":"example.com"}"#));
    let named = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        old.state.forward_to(new.address);
    };
    let ((status, headers, body), ()) = tokio::join!(lease, named);
    assert_eq!(status, 201, "{body}");
    assert!(started.elapsed() >= Duration::from_millis(300), "the lease waited for the successor");
    assert_eq!(headers.get(http::header::CONNECTION).map(|value| value.as_bytes()), Some(b"close".as_slice()));
    let id = body["id"].as_str().expect("an id");
    let (status, _, body) =
        new.call("POST", &format!("/v1/leases/{}/renew", encode(id)), Some(LEASE), Some("{}")).await;
    assert_eq!(status, 200, "the successor granted it: {body}");

    // A successor that hands off in turn passes the request on to its own.
    let third = Server::start_with(vec![record("a", 5)], true, LeaseKey::ephemeral(), None).await;
    new.state.hand_off();
    new.state.forward_to(third.address);
    let (status, _, body) = old.call("POST", "/v1/leases", Some(LEASE), Some(r#"{"target":"example.org"}"#)).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(third.state.active_leases(&ProxyId::new("crawl", "a")).await, 1, "granted by the third replica");
}
