//! The end-to-end suite: the real `egress-operator` binary against the test control plane, under the RBAC shipped
//! in `deploy/` (it impersonates its ServiceAccount), with the node agent running proxy pods as real Squid processes.
//! Run by `cargo xtask e2e` and by `cargo xtask test`.
//!
//! Each test has its own namespace, operator (`--watch-namespace`), cluster ID and provider name, so they run in
//! parallel on one control plane.

use std::path::{Path, PathBuf};
use std::time::Duration;

use egress_api::{HealthCheck, ProviderHealth, Proxy, ProxyMode, ProxyPhase, ProxySpec};
use egress_client::{ClientError, DiscoveryClient, LeaseOptions, Outcome};
use egress_testenv::{LocalOrigin, NodeAgent, OperatorOptions, OperatorProcess, TestNamespace, eventually, http_get};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, any_value};
use prost::Message as _;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);
const SERVICE_ACCOUNT: &str = "system:serviceaccount:egress-system:egress-operator";

/// Applies the shipped RBAC: the ClusterRole and its binding, and the leader-election Role bound in `namespace`.
async fn install_rbac(client: &Client, namespace: &str) {
    let system = Namespace {
        metadata: ObjectMeta { name: Some("egress-system".into()), ..ObjectMeta::default() },
        ..Namespace::default()
    };
    let _ = Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &system).await;
    let account = ServiceAccount {
        metadata: ObjectMeta { name: Some("egress-operator".into()), ..ObjectMeta::default() },
        ..ServiceAccount::default()
    };
    let _ = Api::<ServiceAccount>::namespaced(client.clone(), "egress-system")
        .create(&PostParams::default(), &account)
        .await;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/default/rbac.yaml");
    let documents: Vec<Value> =
        serde_saphyr::from_multiple(&std::fs::read_to_string(&path).expect("rbac.yaml")).expect("parse rbac.yaml");
    let apply = PatchParams::apply("egress-e2e").force();
    for document in documents {
        let name = document["metadata"]["name"].as_str().expect("a name").to_owned();
        match document["kind"].as_str() {
            Some("ClusterRole") => {
                let role: ClusterRole = serde_json::from_value(document).expect("ClusterRole");
                Api::<ClusterRole>::all(client.clone())
                    .patch(&name, &apply, &Patch::Apply(&role))
                    .await
                    .expect("apply ClusterRole");
            }
            Some("ClusterRoleBinding") => {
                let binding: ClusterRoleBinding = serde_json::from_value(document).expect("ClusterRoleBinding");
                Api::<ClusterRoleBinding>::all(client.clone())
                    .patch(&name, &apply, &Patch::Apply(&binding))
                    .await
                    .expect("apply binding");
            }
            Some("Role") => {
                let role: Role = serde_json::from_value(document).expect("Role");
                Api::<Role>::namespaced(client.clone(), namespace)
                    .patch(&name, &apply, &Patch::Apply(&role))
                    .await
                    .expect("apply Role");
            }
            Some("RoleBinding") => {
                let binding: RoleBinding = serde_json::from_value(document).expect("RoleBinding");
                Api::<RoleBinding>::namespaced(client.clone(), namespace)
                    .patch(&name, &apply, &Patch::Apply(&binding))
                    .await
                    .expect("apply RoleBinding");
            }
            _ => {}
        }
    }
}

struct Env {
    ns: TestNamespace,
    agent: NodeAgent,
    origin: LocalOrigin,
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
    provider: String,
    token: String,
}

impl Env {
    async fn new(prefix: &str) -> Self {
        let ns = egress_testenv::namespace(prefix).await;
        install_rbac(&ns.client(), ns.name()).await;
        let dir = tempfile::tempdir().expect("temp dir");
        let kubeconfig = dir.path().join("kubeconfig");
        ns.control_plane()
            .write_kubeconfig_as(
                &kubeconfig,
                SERVICE_ACCOUNT,
                &["system:serviceaccounts", "system:serviceaccounts:egress-system", "system:authenticated"],
            )
            .expect("impersonating kubeconfig");
        let agent = NodeAgent::start(ns.client(), &[ns.name()]).await.expect("node agent");
        let origin = LocalOrigin::start().await.expect("origin");
        let provider = format!("pods-{}", ns.name());
        Self { token: format!("lease-token-{}", ns.name()), ns, agent, origin, kubeconfig, _dir: dir, provider }
    }

    fn options(&self, leader_election: bool) -> OperatorOptions {
        OperatorOptions {
            providers_yaml: format!(
                "providers:\n  - name: {}\n    type: kubernetes\n    kubernetes: {{ namespace: {} }}\n",
                self.provider,
                self.ns.name()
            ),
            cluster_id: self.ns.name().to_owned(),
            lease_token: self.token.clone(),
            default_probe_url: self.origin.ip_url(),
            leader_election_namespace: leader_election.then(|| self.ns.name().to_owned()),
            extra_args: vec![format!("--watch-namespace={}", self.ns.name())],
        }
    }

    async fn operator(&self, leader_election: bool) -> OperatorProcess {
        OperatorProcess::start(&binary(), &self.kubeconfig, &self.options(leader_election))
            .await
            .expect("the operator starts")
    }

    async fn create(&self, name: &str) {
        let spec = ProxySpec {
            provider: Some(self.provider.clone()),
            health_check: HealthCheck {
                interval_seconds: 5,
                timeout_seconds: 3,
                healthy_threshold: 1,
                unhealthy_threshold: 2,
                probe_url: None,
            },
            ..ProxySpec::new(ProxyMode::Managed)
        };
        self.ns.api::<Proxy>().create(&PostParams::default(), &Proxy::new(name, spec)).await.expect("create Proxy");
    }

    async fn wait_phase(&self, names: &[&str], phase: ProxyPhase) -> Vec<Proxy> {
        let api = self.ns.api::<Proxy>();
        let deadline = tokio::time::Instant::now() + WAIT;
        let mut poll = tokio::time::interval(Duration::from_millis(250));
        loop {
            poll.tick().await;
            let mut found = Vec::new();
            let mut seen = Vec::new();
            for name in names {
                let proxy = api.get(name).await.expect("get Proxy");
                let current = proxy.status.as_ref().and_then(|status| status.phase);
                seen.push(format!("{name}={current:?}"));
                if current == Some(phase) {
                    found.push(proxy);
                }
            }
            if found.len() == names.len() {
                return found;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {phase:?}; phases: {}",
                seen.join(", ")
            );
        }
    }

    async fn pods(&self) -> Vec<String> {
        let pods = self
            .ns
            .api::<Pod>()
            .list(&ListParams::default().labels("app.kubernetes.io/name=egress-proxy"))
            .await
            .expect("pods");
        let mut names: Vec<String> = pods.items.iter().map(ResourceExt::name_any).collect();
        names.sort();
        names
    }

    /// A discovery client for the operator, once its discovery view has synced.
    /// A discovery client, once the operator's view lists `expected` proxies: a Proxy the API already shows Ready
    /// reaches the operator's store a moment later, and a lease taken before that sees fewer proxies.
    async fn discovery(&self, operator: &OperatorProcess, expected: usize) -> DiscoveryClient {
        let client = DiscoveryClient::new(&operator.discovery_url, Some(self.token.clone())).expect("client");
        let probe = client.clone();
        eventually(&format!("discovery to list {expected} proxies"), WAIT, || {
            let probe = probe.clone();
            async move { probe.proxies(None, None).await.ok().filter(|proxies| proxies.len() == expected).map(|_| ()) }
        })
        .await;
        client
    }
}

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_egress-operator"))
}

fn instance(proxy: &Proxy) -> String {
    proxy
        .status
        .as_ref()
        .and_then(|status| status.instance.as_ref())
        .map(|instance| instance.name.clone())
        .expect("an instance")
}

fn address(proxy: &Proxy) -> String {
    proxy
        .status
        .as_ref()
        .and_then(|status| status.endpoint.as_ref())
        .map(|endpoint| endpoint.address.clone())
        .expect("an endpoint")
}

/// Every API call the operator made was allowed by the shipped RBAC.
fn assert_no_forbidden(operator: &OperatorProcess) {
    let log = operator.log();
    let denied: Vec<&str> = log.lines().filter(|line| line.to_lowercase().contains("forbidden")).collect();
    assert!(denied.is_empty(), "the operator was refused by the shipped RBAC:\n{}", denied.join("\n"));
}

#[tokio::test]
async fn proxies_serve_leases_survive_failures_and_are_cleaned_up() {
    let env = Env::new("e2e-main").await;
    let operator = env.operator(false).await;
    let names = ["web-1", "web-2", "web-3"];
    for name in names {
        env.create(name).await;
    }
    let ready = env.wait_phase(&names, ProxyPhase::Ready).await;
    assert_eq!(env.pods().await.len(), 3);

    // The provider's health object.
    let health: Api<ProviderHealth> = Api::all(env.ns.client());
    eventually("ProviderHealth 1/1", WAIT, || async {
        let object = health.get(&env.provider).await.ok()?;
        (object.status?.ready.as_deref() == Some("1/1")).then_some(())
    })
    .await;

    // A ban cools one proxy down for that site only.
    let discovery = env.discovery(&operator, names.len()).await;
    let banned_lease = discovery.lease(LeaseOptions::for_target("www.shop.example.com")).await.expect("lease");
    let banned = banned_lease.proxy();
    banned_lease.report(Outcome::Banned, Some(403)).await.expect("report");
    banned_lease.release().await.expect("release");
    for _ in 0..6 {
        let lease = discovery.lease(LeaseOptions::for_target("img.shop.example.com")).await.expect("lease");
        assert_ne!(lease.proxy(), banned, "the banned proxy is skipped for that site");
        lease.release().await.expect("release");
    }
    let other = discovery
        .lease(LeaseOptions::for_target("other.example.org").proxy(&banned))
        .await
        .expect("still leased for another site");
    other.release().await.expect("release");

    // A proxy whose Squid dies turns Unhealthy and is not handed out.
    let victim = &ready[1];
    assert!(env.agent.kill_squid(env.ns.name(), &instance(victim)).await);
    env.wait_phase(&[&victim.name_any()], ProxyPhase::Unhealthy).await;
    let victim_id = format!("{}/{}", env.ns.name(), victim.name_any());
    eventually("the unhealthy proxy to leave discovery", WAIT, || async {
        let proxies = discovery.proxies(None, None).await.ok()?;
        proxies.iter().all(|proxy| format!("{}/{}", proxy.namespace, proxy.name) != victim_id).then_some(())
    })
    .await;
    for _ in 0..8 {
        let lease = discovery.lease(LeaseOptions::for_target("news.example.net")).await.expect("lease");
        assert_ne!(lease.proxy(), victim_id, "no lease on an unhealthy proxy");
        lease.release().await.expect("release");
    }
    assert!(matches!(
        discovery.lease(LeaseOptions::for_target("news.example.net").proxy(&victim_id)).await.err(),
        Some(ClientError::Conflict { .. })
    ));

    // A spec change replaces the instance and switches the endpoint.
    let replaced = &ready[2];
    let (old_instance, old_address) = (instance(replaced), address(replaced));
    env.ns
        .api::<Proxy>()
        .patch(&replaced.name_any(), &PatchParams::default(), &Patch::Merge(json!({ "spec": { "port": 3129 } })))
        .await
        .expect("patch");
    let switched = eventually("the endpoint to switch to the new instance", WAIT, || async {
        let proxy = env.ns.api::<Proxy>().get(&replaced.name_any()).await.ok()?;
        let status = proxy.status.clone()?;
        (status.phase == Some(ProxyPhase::Ready)
            && status.previous_instance.is_none()
            && instance(&proxy) != old_instance)
            .then_some(proxy)
    })
    .await;
    assert_ne!(address(&switched), old_address);
    assert!(address(&switched).ends_with(":3129"));
    eventually("the old pod to be deleted", WAIT, || async {
        (!env.pods().await.contains(&old_instance)).then_some(())
    })
    .await;

    // Metrics cover every part.
    let (status, metrics) = http_get(&format!("{}/metrics", operator.metrics_url)).await.expect("metrics");
    assert_eq!(status, 200);
    for series in [
        "egress_reconcile_reconciles_total",
        "egress_provider_calls_total",
        "egress_health_probes_total",
        "egress_discovery_leases_granted_total",
        "egress_provider_health_up",
    ] {
        assert!(metrics.contains(series), "/metrics has {series}");
    }

    // Deleting the Proxies removes their pods.
    for name in names {
        env.ns.api::<Proxy>().delete(name, &DeleteParams::default()).await.expect("delete");
    }
    eventually("every Proxy and pod to be gone", WAIT, || async {
        let proxies = env.ns.api::<Proxy>().list(&ListParams::default()).await.ok()?;
        (proxies.items.is_empty() && env.pods().await.is_empty()).then_some(())
    })
    .await;
    assert_no_forbidden(&operator);
}

#[tokio::test]
async fn a_killed_operator_restarts_without_duplicates_or_leaks() {
    let env = Env::new("e2e-crash").await;
    let mut operator = env.operator(false).await;
    let names = ["c-1", "c-2", "c-3", "c-4", "c-5"];
    for name in names {
        env.create(name).await;
    }
    // Kill it while it is creating: as soon as the first pod exists.
    eventually("the first pod", WAIT, || async { (!env.pods().await.is_empty()).then_some(()) }).await;
    operator.kill();
    assert_no_forbidden(&operator);
    let restarted = env.operator(false).await;
    let ready = tokio::time::timeout(WAIT + Duration::from_secs(5), env.wait_phase(&names, ProxyPhase::Ready))
        .await
        .unwrap_or_else(|_| {
            panic!("the restarted operator did not settle; its log ends with:\n{}", restarted.log_tail())
        });
    let mut expected: Vec<String> = ready.iter().map(instance).collect();
    expected.sort();
    let settled = eventually("exactly one pod per Proxy", WAIT, || async {
        let pods = env.pods().await;
        (pods == expected).then_some(pods)
    })
    .await;
    assert_eq!(settled.len(), names.len());
    for name in names {
        env.ns.api::<Proxy>().delete(name, &DeleteParams::default()).await.expect("delete");
    }
    eventually("no leaked pod", WAIT, || async { env.pods().await.is_empty().then_some(()) }).await;
    assert_no_forbidden(&restarted);
}

async fn role(operator: &OperatorProcess) -> Option<&'static str> {
    let (status, body) = http_get(&format!("{}/readyz", operator.health_url)).await.ok()?;
    match status {
        200 if body.contains("leader") && !body.contains("follower") => Some("leader"),
        200 => Some("follower"),
        _ => None,
    }
}

#[tokio::test]
async fn two_replicas_elect_one_leader_and_hand_over() {
    let env = Env::new("e2e-leader").await;
    let mut first = env.operator(true).await;
    let mut second = env.operator(true).await;
    env.create("l-1").await;
    let (leader_is_first, _) = eventually("one leader and one follower", WAIT, || async {
        match (role(&first).await, role(&second).await) {
            (Some("leader"), Some("follower")) => Some((true, ())),
            (Some("follower"), Some("leader")) => Some((false, ())),
            _ => None,
        }
    })
    .await;
    env.wait_phase(&["l-1"], ProxyPhase::Ready).await;
    let (leader, follower) = if leader_is_first { (&mut first, &mut second) } else { (&mut second, &mut first) };

    // The follower refuses leases with 503 and a reason.
    let refused = DiscoveryClient::new(&follower.discovery_url, Some(env.token.clone())).expect("client");
    match refused.lease(LeaseOptions::for_target("example.com")).await {
        Err(ClientError::Unavailable { reason, .. }) => assert_eq!(reason, "not-serving"),
        other => panic!("the follower must refuse leases, got {:?}", other.map(|lease| lease.id().to_owned())),
    }
    let serving = env.discovery(leader, 1).await;
    serving
        .lease(LeaseOptions::for_target("example.com"))
        .await
        .expect("the leader leases")
        .release()
        .await
        .expect("release");

    // Leadership moves when the leader stops.
    assert!(leader.terminate(Duration::from_secs(30)).await, "the leader stops on SIGTERM");
    eventually("the follower to take over", WAIT, || async { (role(follower).await == Some("leader")).then_some(()) })
        .await;
    let taken_over = env.discovery(follower, 1).await;
    taken_over
        .lease(LeaseOptions::for_target("example.com"))
        .await
        .expect("the new leader leases")
        .release()
        .await
        .expect("release");
    assert_no_forbidden(follower);
    assert_no_forbidden(leader);
}

/// A span as the collector received it: its resource's `service.name`, its name, and its string attributes.
#[derive(Debug)]
struct ReceivedSpan {
    service: String,
    name: String,
    attributes: Vec<(String, String)>,
}

/// An OTLP/HTTP receiver on loopback that keeps every trace export request it is sent.
struct Collector {
    url: String,
    requests: std::sync::Arc<std::sync::Mutex<Vec<ExportTraceServiceRequest>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Collector {
    async fn start() -> Self {
        let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = requests.clone();
        let router = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let kept = kept.clone();
                async move {
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(request) => {
                            kept.lock().expect("requests").push(request);
                            (axum::http::StatusCode::OK, [("content-type", "application/x-protobuf")], Vec::new())
                        }
                        Err(_) => (axum::http::StatusCode::BAD_REQUEST, [("content-type", "text/plain")], Vec::new()),
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the collector");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Self { url, requests, task }
    }

    /// Every span received.
    fn spans(&self) -> Vec<ReceivedSpan> {
        let text = |value: &Option<AnyValue>| match value.as_ref().and_then(|value| value.value.as_ref()) {
            Some(any_value::Value::StringValue(text)) => text.clone(),
            _ => String::new(),
        };
        let mut spans = Vec::new();
        for request in self.requests.lock().expect("requests").iter() {
            for resource_spans in &request.resource_spans {
                let service = resource_spans
                    .resource
                    .iter()
                    .flat_map(|resource| &resource.attributes)
                    .find(|attribute| attribute.key == "service.name")
                    .map(|attribute| text(&attribute.value))
                    .unwrap_or_default();
                for span in resource_spans.scope_spans.iter().flat_map(|scope| &scope.spans) {
                    let attributes = span
                        .attributes
                        .iter()
                        .map(|attribute| (attribute.key.clone(), text(&attribute.value)))
                        .collect();
                    spans.push(ReceivedSpan { service: service.clone(), name: span.name.clone(), attributes });
                }
            }
        }
        spans
    }
}

#[tokio::test]
async fn traces_reach_an_otlp_collector() {
    let env = Env::new("e2e-otlp").await;
    let collector = Collector::start().await;
    let mut options = env.options(false);
    options.extra_args.push(format!("--otlp-endpoint={}", collector.url));
    let mut operator = OperatorProcess::start(&binary(), &env.kubeconfig, &options).await.expect("the operator starts");
    env.create("traced").await;
    env.wait_phase(&["traced"], ProxyPhase::Ready).await;
    // SIGTERM: the operator exports the spans still buffered before it exits.
    assert!(operator.terminate(Duration::from_secs(30)).await, "the operator stops on SIGTERM");

    let spans = collector.spans();
    let reconciles: Vec<_> = spans
        .iter()
        .filter(|span| {
            span.name == "reconcile" && span.attributes.iter().any(|(key, value)| key == "proxy" && value == "traced")
        })
        .collect();
    assert!(
        !reconciles.is_empty(),
        "no reconcile span for the Proxy among {} spans; names: {:?}\noperator log:\n{}",
        spans.len(),
        spans.iter().map(|span| span.name.as_str()).collect::<std::collections::BTreeSet<_>>(),
        operator.log_tail()
    );
    assert!(
        reconciles.iter().all(|span| span.service == "egress-operator"),
        "spans carry the service name: {reconciles:?}"
    );
    collector.task.abort();
    assert_no_forbidden(&operator);
}
