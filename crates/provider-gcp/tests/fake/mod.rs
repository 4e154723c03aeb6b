//! A local fake of the Compute Engine REST API, for the real SDK to talk to over HTTP on loopback.
//!
//! It serves the four calls the provider makes plus zone operation get, at the SDK's real paths; keeps instances in
//! memory; moves them PROVISIONING → RUNNING (with a NAT IP) after a configurable time; answers a repeated request
//! ID with the first operation; checks the bearer token's issuer when told which one to accept; and can be told to
//! answer the next calls of an operation with a given HTTP status and error reason. Not shipped: tests only.

#![allow(dead_code, reason = "each test binary uses its own subset")]

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

/// One request as the fake received it.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub operation: &'static str,
    pub path: String,
    pub request_id: Option<String>,
}

struct Stored {
    zone: String,
    body: Value,
    created: Instant,
    nat_ip: String,
}

struct Failure {
    operation: &'static str,
    status: u16,
    reason: String,
}

#[derive(Default)]
struct Inner {
    instances: BTreeMap<(String, String), Stored>,
    requests: Vec<Recorded>,
    failures: VecDeque<Failure>,
    operations_by_request: HashMap<String, Value>,
    next_operation: u64,
    next_ip: u8,
    accepted_issuer: Option<String>,
}

/// The fake; cloning shares it.
#[derive(Clone)]
pub struct FakeCompute {
    inner: Arc<Mutex<Inner>>,
    provision_time: Duration,
    pub url: String,
}

fn error(status: u16, reason: &str, message: &str) -> Response {
    let body = json!({"error": {
        "code": status,
        "message": message,
        "errors": [{"message": message, "domain": "global", "reason": reason}],
    }});
    (StatusCode::from_u16(status).expect("a status"), axum::Json(body)).into_response()
}

/// The claims of a bearer JWT, unverified (the fake checks who signed in, not the signature).
fn token_issuer(headers: &HeaderMap) -> Option<String> {
    let token = headers.get("authorization")?.to_str().ok()?.strip_prefix("Bearer ")?;
    let payload = token.split('.').nth(1)?;
    let bytes = base64_url_decode(payload)?;
    let claims: Value = serde_json::from_slice(&bytes).ok()?;
    claims["iss"].as_str().map(str::to_owned)
}

fn base64_url_decode(text: &str) -> Option<Vec<u8>> {
    let alphabet = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'-' | b'+' => 62,
            b'_' | b'/' => 63,
            _ => return None,
        })
    };
    let mut out = Vec::new();
    let (mut buffer, mut bits) = (0_u32, 0);
    for &c in text.trim_end_matches('=').as_bytes() {
        buffer = (buffer << 6) | alphabet(c)?;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push(u8::try_from((buffer >> bits) & 0xff).ok()?);
        }
    }
    Some(out)
}

/// `(labels.k = "v") (labels.k2 = "v2")` → the pairs.
fn parse_filter(filter: &str) -> Vec<(String, String)> {
    filter
        .split(')')
        .filter_map(|term| {
            let term = term.trim().strip_prefix('(')?;
            let (key, value) = term.split_once('=')?;
            let key = key.trim().strip_prefix("labels.")?.to_owned();
            let value = value.trim().trim_matches('"').to_owned();
            Some((key, value))
        })
        .collect()
}

impl FakeCompute {
    /// Starts the fake on a free loopback port; instances turn RUNNING `provision_time` after insert.
    pub async fn start(provision_time: Duration) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the fake");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let fake = Self { inner: Arc::new(Mutex::new(Inner::default())), provision_time, url };
        let router = Router::new()
            .route("/compute/v1/projects/{project}/zones/{zone}/instances", axum::routing::post(insert))
            .route("/compute/v1/projects/{project}/zones/{zone}/instances/{name}", get(get_instance).delete(delete))
            .route("/compute/v1/projects/{project}/aggregated/instances", get(aggregated_list))
            .route("/compute/v1/projects/{project}/zones/{zone}/operations/{operation}", get(get_operation))
            .fallback(|method: Method, uri: Uri| async move {
                error(404, "notFound", &format!("the fake has no route for {method} {uri}"))
            })
            .with_state(fake.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        fake
    }

    /// Accept only tokens issued by `issuer` (a service account's email); others get 401.
    pub fn accept_only(&self, issuer: &str) {
        self.inner.lock().unwrap().accepted_issuer = Some(issuer.to_owned());
    }

    /// Answer the next call of `operation` (`insert`, `get`, `delete`, `aggregatedList`) with `status` and `reason`.
    pub fn fail_next(&self, operation: &'static str, status: u16, reason: &str) {
        self.inner.lock().unwrap().failures.push_back(Failure { operation, status, reason: reason.to_owned() });
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.inner.lock().unwrap().requests.clone()
    }

    /// How many instances exist.
    pub fn instance_count(&self) -> usize {
        self.inner.lock().unwrap().instances.len()
    }

    /// The body an instance was inserted with.
    pub fn body(&self, zone: &str, name: &str) -> Value {
        self.inner.lock().unwrap().instances[&(zone.to_owned(), name.to_owned())].body.clone()
    }

    /// The `user-data` metadata an instance was inserted with.
    pub fn sent_user_data(&self, zone: &str, name: &str) -> Option<String> {
        let body = self.body(zone, name);
        body["metadata"]["items"]
            .as_array()?
            .iter()
            .find(|item| item["key"] == "user-data")
            .and_then(|item| item["value"].as_str())
            .map(str::to_owned)
    }

    /// Puts an instance in place as if someone else created it, with these labels.
    pub fn seed(&self, zone: &str, name: &str, labels: Value) {
        let mut inner = self.inner.lock().unwrap();
        let body = json!({"name": name, "labels": labels});
        let nat_ip = inner.next_address();
        inner.instances.insert(
            (zone.to_owned(), name.to_owned()),
            Stored { zone: zone.to_owned(), body, created: Instant::now(), nat_ip },
        );
    }

    /// Checks the token and the failure script; `Some` is the response to send instead of doing the call.
    fn gate(
        &self,
        operation: &'static str,
        headers: &HeaderMap,
        path: &str,
        request_id: Option<String>,
    ) -> Option<Response> {
        let mut inner = self.inner.lock().unwrap();
        inner.requests.push(Recorded { operation, path: path.to_owned(), request_id });
        if let Some(accepted) = &inner.accepted_issuer
            && token_issuer(headers).as_deref() != Some(accepted.as_str())
        {
            return Some(error(401, "authError", "Request had invalid authentication credentials."));
        }
        if let Some(position) = inner.failures.iter().position(|failure| failure.operation == operation) {
            let failure = inner.failures.remove(position).expect("present");
            return Some(error(failure.status, &failure.reason, &format!("scripted {} failure", failure.status)));
        }
        None
    }

    fn view(&self, project: &str, stored: &Stored) -> Value {
        let mut body = stored.body.clone();
        let running = stored.created.elapsed() >= self.provision_time;
        let name = body["name"].as_str().unwrap_or_default().to_owned();
        body["status"] = json!(if running { "RUNNING" } else { "PROVISIONING" });
        body["zone"] = json!(format!("{}/compute/v1/projects/{project}/zones/{}", self.url, stored.zone));
        body["selfLink"] =
            json!(format!("{}/compute/v1/projects/{project}/zones/{}/instances/{name}", self.url, stored.zone));
        body["creationTimestamp"] = json!("2026-11-30T10:00:00.000-08:00");
        body["kind"] = json!("compute#instance");
        if running {
            let interfaces = body["networkInterfaces"].as_array().cloned().unwrap_or_default();
            let mut interfaces = if interfaces.is_empty() { vec![json!({})] } else { interfaces };
            interfaces[0]["accessConfigs"] =
                json!([{"name": "External NAT", "type": "ONE_TO_ONE_NAT", "natIP": stored.nat_ip}]);
            body["networkInterfaces"] = json!(interfaces);
        }
        body
    }
}

impl Inner {
    fn next_address(&mut self) -> String {
        self.next_ip = self.next_ip.wrapping_add(1);
        format!("203.0.113.{}", self.next_ip)
    }

    fn operation(&mut self, kind: &str, project: &str, zone: &str, name: &str) -> Value {
        self.next_operation += 1;
        json!({
            "kind": "compute#operation",
            "name": format!("operation-{}-{kind}", self.next_operation),
            "operationType": kind,
            "status": "RUNNING",
            "zone": format!("projects/{project}/zones/{zone}"),
            "targetLink": format!("projects/{project}/zones/{zone}/instances/{name}"),
        })
    }
}

async fn insert(
    State(fake): State<FakeCompute>,
    Path((project, zone)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    axum::Json(body): axum::Json<Value>,
) -> Response {
    let request_id = query.get("requestId").cloned();
    let path = format!("projects/{project}/zones/{zone}/instances");
    if let Some(response) = fake.gate("insert", &headers, &path, request_id.clone()) {
        return response;
    }
    let mut inner = fake.inner.lock().unwrap();
    if let Some(operation) = request_id.as_ref().and_then(|id| inner.operations_by_request.get(id)) {
        return axum::Json(operation.clone()).into_response();
    }
    let Some(name) = body["name"].as_str().map(str::to_owned) else {
        return error(400, "required", "Required field 'resource.name' not specified");
    };
    if inner.instances.contains_key(&(zone.clone(), name.clone())) {
        return error(
            409,
            "alreadyExists",
            &format!("The resource 'projects/{project}/zones/{zone}/instances/{name}' already exists"),
        );
    }
    let nat_ip = inner.next_address();
    inner
        .instances
        .insert((zone.clone(), name.clone()), Stored { zone: zone.clone(), body, created: Instant::now(), nat_ip });
    let operation = inner.operation("insert", &project, &zone, &name);
    if let Some(id) = request_id {
        inner.operations_by_request.insert(id, operation.clone());
    }
    axum::Json(operation).into_response()
}

async fn get_instance(
    State(fake): State<FakeCompute>,
    Path((project, zone, name)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let path = format!("projects/{project}/zones/{zone}/instances/{name}");
    if let Some(response) = fake.gate("get", &headers, &path, None) {
        return response;
    }
    let inner = fake.inner.lock().unwrap();
    match inner.instances.get(&(zone, name)) {
        Some(stored) => axum::Json(fake.view(&project, stored)).into_response(),
        None => error(404, "notFound", &format!("The resource '{path}' was not found")),
    }
}

async fn delete(
    State(fake): State<FakeCompute>,
    Path((project, zone, name)): Path<(String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let path = format!("projects/{project}/zones/{zone}/instances/{name}");
    if let Some(response) = fake.gate("delete", &headers, &path, query.get("requestId").cloned()) {
        return response;
    }
    let mut inner = fake.inner.lock().unwrap();
    if inner.instances.remove(&(zone.clone(), name.clone())).is_none() {
        return error(404, "notFound", &format!("The resource '{path}' was not found"));
    }
    let operation = inner.operation("delete", &project, &zone, &name);
    axum::Json(operation).into_response()
}

async fn aggregated_list(
    State(fake): State<FakeCompute>,
    Path(project): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let path = format!("projects/{project}/aggregated/instances");
    if let Some(response) = fake.gate("aggregatedList", &headers, &path, None) {
        return response;
    }
    let wanted = query.get("filter").map(|filter| parse_filter(filter)).unwrap_or_default();
    let page_size: usize = query.get("maxResults").and_then(|size| size.parse().ok()).unwrap_or(500);
    let start: usize = query.get("pageToken").and_then(|token| token.parse().ok()).unwrap_or(0);
    let inner = fake.inner.lock().unwrap();
    let matching: Vec<&Stored> = inner
        .instances
        .values()
        .filter(|stored| wanted.iter().all(|(key, value)| stored.body["labels"][key].as_str() == Some(value.as_str())))
        .collect();
    let mut items: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for stored in matching.iter().skip(start).take(page_size) {
        items.entry(format!("zones/{}", stored.zone)).or_default().push(fake.view(&project, stored));
    }
    let items: serde_json::Map<String, Value> =
        items.into_iter().map(|(scope, instances)| (scope, json!({"instances": instances}))).collect();
    let mut page = json!({"kind": "compute#instanceAggregatedList", "items": items});
    if start + page_size < matching.len() {
        page["nextPageToken"] = json!((start + page_size).to_string());
    }
    axum::Json(page).into_response()
}

async fn get_operation(
    State(fake): State<FakeCompute>,
    Path((project, zone, operation)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let path = format!("projects/{project}/zones/{zone}/operations/{operation}");
    if let Some(response) = fake.gate("operationGet", &headers, &path, None) {
        return response;
    }
    axum::Json(json!({"kind": "compute#operation", "name": operation, "status": "DONE", "zone": zone})).into_response()
}
