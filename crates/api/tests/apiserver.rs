//! The CRDs as the real kube-apiserver serves them: every CEL rule accepts and rejects, defaults are filled in,
//! an explicit `maxLeases: 0` survives, and the printer columns come back through the Table API. For `ProxyPool`
//! also the scale subresource, as `kubectl scale` and a HorizontalPodAutoscaler use it.
//!
//! Objects are sent as raw JSON with server-side apply where the point is what a user would type (`healthCheck: {}`)
//! and as Rust values where the point is the round trip through the Rust types.

use egress_api::{
    Autoscale, Endpoint, EndpointStatus, HealthStatus, ProviderHealth, ProviderHealthSpec, ProviderHealthStatus, Proxy,
    ProxyPhase, ProxyPool, ProxyPoolStatus, ProxySpec, ProxyStatus, Recycle, TargetHealth,
};
use egress_testenv::TestNamespace;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const MANAGER: &str = "egress-api-tests";

/// Applies `spec` as the Proxy `name` and returns the apiserver's error message, if it refused.
async fn apply(proxies: &Api<Proxy>, name: &str, spec: Value) -> Result<Proxy, String> {
    let body = json!({ "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy", "metadata": { "name": name }, "spec": spec });
    proxies.patch(name, &PatchParams::apply(MANAGER), &Patch::Apply(&body)).await.map_err(describe)
}

/// Merge-patches the Proxy's spec, the way `kubectl patch --type merge` would.
async fn merge(proxies: &Api<Proxy>, name: &str, spec: Value) -> Result<Proxy, String> {
    proxies.patch(name, &PatchParams::default(), &Patch::Merge(json!({ "spec": spec }))).await.map_err(describe)
}

fn describe(error: kube::Error) -> String {
    match error {
        kube::Error::Api(status) => format!("{} ({}): {}", status.code, status.reason, status.message),
        other => format!("not an API error: {other}"),
    }
}

#[track_caller]
fn assert_rejected<K: std::fmt::Debug>(result: Result<K, String>, message: &str) {
    match result {
        Ok(object) => panic!("the apiserver accepted {object:?}; expected a rejection saying {message:?}"),
        Err(error) => {
            assert!(error.starts_with("422"), "expected 422 Invalid, got {error}");
            assert!(error.contains(message), "expected {message:?} in the rejection, got {error}");
        }
    }
}

#[track_caller]
fn assert_accepted<K>(result: Result<K, String>) -> K {
    result.unwrap_or_else(|error| panic!("the apiserver rejected a valid object: {error}"))
}

fn external() -> Value {
    json!({ "mode": "External", "endpoint": { "host": "proxy.example", "port": 8080 } })
}

fn managed() -> Value {
    json!({ "mode": "Managed", "provider": "pods" })
}

fn with(mut base: Value, field: &str, value: Value) -> Value {
    base[field] = value;
    base
}

async fn proxies(prefix: &str) -> (TestNamespace, Api<Proxy>) {
    let ns = egress_testenv::namespace(prefix).await;
    let api = ns.api();
    (ns, api)
}

// Rule 1: mode is immutable.
#[tokio::test]
async fn rule_mode_is_immutable() {
    let (_ns, api) = proxies("cel-mode").await;
    assert_accepted(apply(&api, "p", external()).await);
    assert_accepted(merge(&api, "p", json!({ "endpoint": { "port": 9090 } })).await);
    assert_rejected(
        merge(&api, "p", json!({ "mode": "Managed", "provider": "pods", "endpoint": null })).await,
        "spec.mode is immutable",
    );
}

// Rule 2: provider is immutable, and setting or removing it counts as a change.
#[tokio::test]
async fn rule_provider_is_immutable() {
    let (_ns, api) = proxies("cel-provider").await;
    assert_accepted(apply(&api, "p", managed()).await);
    assert_accepted(merge(&api, "p", json!({ "placement": { "zone": "europe-west1-b" } })).await);
    assert_rejected(merge(&api, "p", json!({ "provider": "gcp-eu" })).await, "spec.provider is immutable");
    assert_rejected(merge(&api, "p", json!({ "provider": null })).await, "spec.provider is immutable");
}

// Rule 3: Managed requires provider.
#[tokio::test]
async fn rule_managed_requires_provider() {
    let (_ns, api) = proxies("cel-managed-provider").await;
    assert_rejected(
        apply(&api, "without", json!({ "mode": "Managed" })).await,
        "spec.provider is required when spec.mode is Managed",
    );
    // An explicit null never passes for a provider: the spec schema has no nullable fields.
    assert_rejected(apply(&api, "null", json!({ "mode": "Managed", "provider": null })).await, "spec.provider");
    assert_accepted(apply(&api, "with", managed()).await);
}

// Rule 4: External requires endpoint.
#[tokio::test]
async fn rule_external_requires_endpoint() {
    let (_ns, api) = proxies("cel-external-endpoint").await;
    assert_rejected(
        apply(&api, "without", json!({ "mode": "External" })).await,
        "spec.endpoint is required when spec.mode is External",
    );
    assert_accepted(apply(&api, "with", external()).await);
}

// Rule 5: External forbids provider, placement, cloudInit and destinations.
#[tokio::test]
async fn rule_external_forbids_instance_fields() {
    let (_ns, api) = proxies("cel-external-forbids").await;
    let message = "spec.provider, spec.placement, spec.cloudInit and spec.destinations must not be set when spec.mode is External";
    assert_rejected(apply(&api, "provider", with(external(), "provider", json!("pods"))).await, message);
    assert_rejected(apply(&api, "placement", with(external(), "placement", json!({ "zone": "z" }))).await, message);
    assert_rejected(
        apply(&api, "cloudinit", with(external(), "cloudInit", json!({ "inline": "#cloud-config" }))).await,
        message,
    );
    assert_rejected(
        apply(&api, "destinations", with(external(), "destinations", json!({ "deny": ["10.0.0.0/8"] }))).await,
        message,
    );
    assert_accepted(
        apply(&api, "auth-only", with(external(), "auth", json!({ "secretRef": { "name": "creds" } }))).await,
    );
}

// Rule 6: Managed forbids endpoint.
#[tokio::test]
async fn rule_managed_forbids_endpoint() {
    let (_ns, api) = proxies("cel-managed-endpoint").await;
    assert_rejected(
        apply(&api, "endpoint", with(managed(), "endpoint", json!({ "host": "h", "port": 1 }))).await,
        "spec.endpoint must not be set when spec.mode is Managed",
    );
    assert_accepted(apply(&api, "plain", managed()).await);
}

// Rule 7: cloudInit needs exactly one of inline and secretRef.
#[tokio::test]
async fn rule_cloud_init_exactly_one_source() {
    let (_ns, api) = proxies("cel-cloudinit").await;
    let message = "spec.cloudInit needs exactly one of inline and secretRef";
    let both = json!({ "inline": "#cloud-config", "secretRef": { "name": "ci", "key": "user-data" } });
    assert_rejected(apply(&api, "both", with(managed(), "cloudInit", both)).await, message);
    assert_rejected(apply(&api, "neither", with(managed(), "cloudInit", json!({}))).await, message);
    assert_accepted(apply(&api, "inline", with(managed(), "cloudInit", json!({ "inline": "#cloud-config" }))).await);
    assert_accepted(
        apply(
            &api,
            "secret",
            with(managed(), "cloudInit", json!({ "secretRef": { "name": "ci", "key": "user-data" } })),
        )
        .await,
    );
}

// Rule 8: timeoutSeconds < intervalSeconds, checked after defaults are filled in.
#[tokio::test]
async fn rule_timeout_below_interval() {
    let (_ns, api) = proxies("cel-timeout").await;
    let message = "spec.healthCheck.timeoutSeconds must be less than spec.healthCheck.intervalSeconds";
    let equal = json!({ "intervalSeconds": 30, "timeoutSeconds": 30 });
    assert_rejected(apply(&api, "equal", with(external(), "healthCheck", equal)).await, message);
    // The interval is not given: its default (30) is filled in before the rule runs.
    assert_rejected(
        apply(&api, "over-default", with(external(), "healthCheck", json!({ "timeoutSeconds": 40 }))).await,
        message,
    );
    // The timeout is not given: the message says its default, which is what a short interval meets.
    assert_rejected(
        apply(&api, "short-interval", with(external(), "healthCheck", json!({ "intervalSeconds": 5 }))).await,
        "(unset, they are 10 and 30)",
    );
    let below = json!({ "intervalSeconds": 30, "timeoutSeconds": 29 });
    assert_accepted(apply(&api, "below", with(external(), "healthCheck", below)).await);
}

#[tokio::test]
async fn a_cooldown_policy_is_bounded_and_its_maximum_not_below_its_base() {
    let (_ns, api) = proxies("cooldown").await;
    assert_rejected(
        apply(&api, "inverted", with(external(), "cooldown", json!({ "baseSeconds": 600, "maxSeconds": 60 }))).await,
        "cooldown.maxSeconds must be at least cooldown.baseSeconds",
    );
    assert_rejected(
        apply(&api, "zero", with(external(), "cooldown", json!({ "baseSeconds": 0 }))).await,
        "spec.cooldown.baseSeconds",
    );
    assert_rejected(
        apply(&api, "steep", with(external(), "cooldown", json!({ "factor": 11 }))).await,
        "spec.cooldown.factor",
    );
    let policy = json!({ "baseSeconds": 30, "factor": 1, "maxSeconds": 30 });
    let accepted = assert_accepted(apply(&api, "flat", with(external(), "cooldown", policy)).await);
    assert_eq!(accepted.spec.cooldown.and_then(|cooldown| cooldown.base_seconds), Some(30));
}

#[tokio::test]
async fn max_age_must_be_a_positive_duration() {
    let (_ns, api) = proxies("max-age").await;
    assert_rejected(
        apply(&api, "zero", with(managed(), "maxAge", json!("0s"))).await,
        "spec.maxAge must be a positive duration",
    );
    assert_rejected(apply(&api, "words", with(managed(), "maxAge", json!("one day"))).await, "spec.maxAge");
    // A malformed value gets the pattern's message only, not CEL's failure to parse it.
    let days = apply(&api, "days", with(managed(), "maxAge", json!("1d"))).await.map(|_| ()).expect_err("refused");
    assert!(days.contains("spec.maxAge") && !days.contains("google.protobuf.Duration"), "{days}");
    let accepted = assert_accepted(apply(&api, "ok", with(managed(), "maxAge", json!("1h30m"))).await);
    assert_eq!(accepted.spec.max_age().map(|age| age.as_secs()), Some(5400));
}

#[tokio::test]
async fn apiserver_fills_every_default() {
    let (_ns, api) = proxies("defaults").await;
    let proxy = assert_accepted(apply(&api, "empty-check", with(managed(), "healthCheck", json!({}))).await);
    let check = &proxy.spec.health_check;
    assert_eq!(
        (check.interval_seconds, check.timeout_seconds, check.healthy_threshold, check.unhealthy_threshold),
        (30, 10, 2, 3)
    );
    assert_eq!(check.probe_url, None);
    assert_eq!(proxy.spec.port, 3128);
    assert_eq!(proxy.spec.max_leases, Some(5), "the apiserver stores the default maxLeases");

    // Without healthCheck at all, the object-level default applies and the nested defaults with it.
    let bare = assert_accepted(apply(&api, "no-check", managed()).await);
    assert_eq!(bare.spec.health_check, egress_api::HealthCheck::default());

    // The raw object as stored, not as Rust reads it: the defaults are really in etcd.
    let raw: Value = serde_json::to_value(api.get("empty-check").await.expect("get")).expect("to json");
    assert_eq!(raw["spec"]["healthCheck"]["intervalSeconds"], 30);
    assert_eq!(raw["spec"]["maxLeases"], 5);
    assert_eq!(raw["spec"]["port"], 3128);
}

#[tokio::test]
async fn explicit_zero_max_leases_survives_the_round_trip() {
    let (_ns, api) = proxies("max-leases").await;
    let spec = ProxySpec { max_leases: Some(0), ..ProxySpec::external("127.0.0.1", 3128) };
    api.create(&PostParams::default(), &Proxy::new("drained", spec)).await.expect("create");
    let read = api.get("drained").await.expect("get");
    assert_eq!(read.spec.max_leases, Some(0));
    assert_eq!(read.spec.max_leases(), 0);

    // An update that leaves the field alone keeps the 0 too.
    let mut updated = read.clone();
    updated.spec.health_check.interval_seconds = 60;
    let replaced = api.replace("drained", &PostParams::default(), &updated).await.expect("replace");
    assert_eq!(replaced.spec.max_leases, Some(0));
}

/// Fetches the objects of `path` as a `meta.k8s.io/v1` Table, as kubectl does for `get`.
async fn table(client: &kube::Client, path: &str) -> Value {
    let request = http::Request::get(path)
        .header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
        .body(Vec::new())
        .expect("request");
    let text = client.request_text(request).await.expect("table request");
    serde_json::from_str(&text).expect("a JSON Table")
}

fn column_names(table: &Value) -> Vec<String> {
    table["columnDefinitions"]
        .as_array()
        .expect("columnDefinitions")
        .iter()
        .map(|column| column["name"].as_str().expect("column name").to_uppercase())
        .collect()
}

#[tokio::test]
async fn proxy_printer_columns_through_the_table_api() {
    let (ns, api) = proxies("columns").await;
    assert_accepted(apply(&api, "ext", external()).await);
    let status = ProxyStatus {
        phase: Some(ProxyPhase::Ready),
        endpoint: Some(EndpointStatus::from(&Endpoint { host: "proxy.example".into(), port: 8080 })),
        health: Some(HealthStatus { healthy: true, last_transition_time: None, last_error: None }),
        egress_country: Some("DE".into()),
        egress_asn: Some(64_500),
        ..ProxyStatus::default()
    };
    api.patch_status("ext", &PatchParams::default(), &Patch::Merge(json!({ "status": status })))
        .await
        .expect("the status subresource accepts a status patch");

    let table =
        table(&ns.client(), &format!("/apis/crawl.example.com/v1alpha1/namespaces/{}/proxies", ns.name())).await;
    // The table API returns every column; kubectl shows those of priority 1 (the country) with `-o wide` only.
    assert_eq!(column_names(&table), ["NAME", "MODE", "PROVIDER", "PHASE", "ENDPOINT", "HEALTHY", "COUNTRY", "AGE"]);
    assert_eq!(table["columnDefinitions"][6]["priority"], 1, "the country column is a wide one");
    let cells = table["rows"][0]["cells"].as_array().expect("one row").clone();
    assert_eq!(cells[0], "ext");
    assert_eq!(cells[1], "External");
    assert_eq!(cells[3], "Ready");
    assert_eq!(cells[4], "proxy.example:8080");
    assert_eq!(cells[5], true);
    assert_eq!(cells[6], "DE");
    let stored = api.get_status("ext").await.expect("the status").status.expect("a status");
    assert_eq!((stored.egress_country.as_deref(), stored.egress_asn), (Some("DE"), Some(64_500)));
}

#[tokio::test]
async fn status_is_a_subresource() {
    let (_ns, api) = proxies("subresource").await;
    assert_accepted(apply(&api, "p", external()).await);
    // A status sent to the main resource is ignored; only the subresource writes it.
    let ignored = api
        .patch("p", &PatchParams::default(), &Patch::Merge(json!({ "status": { "phase": "Ready" } })))
        .await
        .expect("patch");
    assert_eq!(ignored.status.and_then(|status| status.phase), None);
    let written = api
        .patch_status("p", &PatchParams::default(), &Patch::Merge(json!({ "status": { "phase": "Ready" } })))
        .await
        .expect("status patch");
    assert_eq!(written.status.and_then(|status| status.phase), Some(ProxyPhase::Ready));
}

#[tokio::test]
async fn provider_health_shows_ready_over_total() {
    let ns = egress_testenv::namespace("provider-health").await;
    let api: Api<ProviderHealth> = Api::all(ns.client());
    // ProviderHealth is cluster-scoped, so the name carries the namespace to stay unique across tests.
    let name = format!("pods-{}", ns.name());
    let object = ProviderHealth::new(&name, ProviderHealthSpec {});
    api.create(&PostParams::default(), &object).await.expect("create ProviderHealth");
    let target =
        TargetHealth { name: "cluster".into(), ready: true, reason: None, message: None, last_transition_time: None };
    let status = ProviderHealthStatus::from_targets(vec![target], None);
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(json!({ "status": status })))
        .await
        .expect("status patch");

    let table = table(&ns.client(), "/apis/crawl.example.com/v1alpha1/providerhealths").await;
    assert_eq!(column_names(&table), ["NAME", "READY", "LAST CHECK", "AGE"]);
    let row = table["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .find(|row| row["cells"][0] == name.as_str())
        .expect("our ProviderHealth is listed")
        .clone();
    assert_eq!(row["cells"][1], "1/1");
}

/// Applies `spec` as the ProxyPool `name` and returns the apiserver's error message, if it refused.
async fn apply_pool(pools: &Api<ProxyPool>, name: &str, spec: Value) -> Result<ProxyPool, String> {
    let body = json!({ "apiVersion": "crawl.example.com/v1alpha1", "kind": "ProxyPool", "metadata": { "name": name }, "spec": spec });
    pools.patch(name, &PatchParams::apply(MANAGER), &Patch::Apply(&body)).await.map_err(describe)
}

fn pool(replicas: i32) -> Value {
    json!({ "replicas": replicas, "template": { "spec": { "provider": "pods" } } })
}

fn spread_pool(replicas: i32, spread: Value) -> Value {
    json!({ "replicas": replicas, "template": { "spec": {} }, "spread": spread })
}

#[tokio::test]
async fn a_pool_gets_every_default() {
    let ns = egress_testenv::namespace("pool-defaults").await;
    let api: Api<ProxyPool> = ns.api();
    let spec = json!({
        "replicas": 2,
        "template": { "spec": {} },
        "spread": [{ "provider": "gcp-eu", "zone": "europe-west1-b" }, { "provider": "kvm-home", "weight": 2 }],
        "recycle": { "maxAge": "24h" },
        "autoscale": { "max": 10 },
    });
    let created = assert_accepted(apply_pool(&api, "eu", spec).await);
    assert_eq!(created.spec.template.spec.port, 3128);
    assert_eq!(created.spec.template.spec.health_check.interval_seconds, 30);
    assert_eq!(created.spec.spread[0].weight, 1, "weight defaults to 1");
    assert_eq!(created.spec.spread[1].weight, 2);
    let recycle = created.spec.recycle.clone().expect("recycle");
    assert_eq!(recycle, Recycle { max_age: Some("24h".parse().expect("duration")), ..Recycle::default() });
    assert_eq!(created.spec.autoscale, Some(Autoscale::new(0, 10)));
    assert_eq!(created.spec.recycle_max_age().map(|age| age.as_secs()), Some(86_400));
}

#[tokio::test]
async fn pool_rules_each_refuse_with_their_message() {
    let ns = egress_testenv::namespace("pool-cel").await;
    let api: Api<ProxyPool> = ns.api();
    assert_rejected(
        apply_pool(&api, "no-provider", json!({ "replicas": 1, "template": { "spec": {} } })).await,
        "a ProxyPool needs a provider",
    );
    assert_rejected(
        apply_pool(
            &api,
            "both-providers",
            json!({ "replicas": 1, "template": { "spec": { "provider": "pods" } }, "spread": [{ "provider": "gcp" }] }),
        )
        .await,
        "spec.template.spec.provider must not be set when spec.spread lists providers",
    );
    assert_rejected(
        apply_pool(
            &api,
            "twice",
            spread_pool(2, json!([{ "provider": "gcp", "zone": "a" }, { "provider": "gcp", "zone": "a" }])),
        )
        .await,
        "spec.spread lists a provider and zone twice",
    );
    assert_rejected(
        apply_pool(
            &api,
            "twice-unzoned",
            spread_pool(2, json!([{ "provider": "gcp" }, { "provider": "gcp", "weight": 3 }])),
        )
        .await,
        "spec.spread lists a provider and zone twice",
    );
    assert_accepted(
        apply_pool(
            &api,
            "two-zones",
            spread_pool(2, json!([{ "provider": "gcp", "zone": "a" }, { "provider": "gcp", "zone": "b" }])),
        )
        .await,
    );
    assert_rejected(
        apply_pool(&api, "zero-weight", spread_pool(2, json!([{ "provider": "gcp", "weight": 0 }]))).await,
        "spec.spread[0].weight",
    );
    assert_rejected(
        apply_pool(&api, "min-over-max", with(pool(2), "autoscale", json!({ "min": 5, "max": 3 }))).await,
        "spec.autoscale.min must not exceed spec.autoscale.max",
    );
    // The recycling floor is capped at the count, as a PodDisruptionBudget's is: above it is no error.
    assert_accepted(
        apply_pool(&api, "floor-over-replicas", with(pool(2), "recycle", json!({ "minAvailable": 3 }))).await,
    );
    assert_accepted(
        apply_pool(
            &api,
            "floor-over-min",
            with(with(pool(4), "recycle", json!({ "minAvailable": 2 })), "autoscale", json!({ "min": 0, "max": 8 })),
        )
        .await,
    );
    assert_rejected(
        apply_pool(&api, "zero-surge", with(pool(2), "recycle", json!({ "maxSurge": 0 }))).await,
        "spec.recycle.maxSurge",
    );
    assert_rejected(
        apply_pool(&api, "bad-age", with(pool(2), "recycle", json!({ "maxAge": "1d" }))).await,
        "spec.recycle.maxAge",
    );
    assert_rejected(apply_pool(&api, "too-many", pool(1001)).await, "spec.replicas");
    let labelled = json!({ "replicas": 1, "template": { "metadata": { "labels": { "crawl.example.com/pool": "other" } }, "spec": { "provider": "pods" } } });
    assert_rejected(
        apply_pool(&api, "own-label", labelled).await,
        "spec.template.metadata.labels must not set crawl.example.com/pool",
    );
    let long = "p".repeat(59);
    assert_rejected(apply_pool(&api, &long, pool(1)).await, "at most 58 characters");
    // With the field it is about, not `<nil>`.
    assert_rejected(apply_pool(&api, &long, pool(1)).await, "metadata.name: Invalid value");
    assert_accepted(apply_pool(&api, &"p".repeat(58), pool(1)).await);
    // A template carries no mode, endpoint or maxAge: created as kubectl does (strict field validation), the
    // apiserver names the field it does not know.
    for (field, value) in
        [("endpoint", json!({ "host": "h", "port": 1 })), ("mode", json!("External")), ("maxAge", json!("1h"))]
    {
        let body = json!({
            "apiVersion": "crawl.example.com/v1alpha1",
            "kind": "ProxyPool",
            "metadata": { "name": format!("with-{}", field.to_lowercase()) },
            "spec": { "replicas": 1, "template": { "spec": { "provider": "pods", field: value } } },
        });
        let request = http::Request::post(format!(
            "/apis/crawl.example.com/v1alpha1/namespaces/{}/proxypools?fieldValidation=Strict",
            ns.name()
        ))
        .header("Content-Type", "application/json")
        .body(serde_json::to_vec(&body).expect("serializes"))
        .expect("request");
        let refused = ns.client().request_text(request).await.map_err(describe);
        let error = refused.expect_err("an unknown template field is refused");
        assert!(error.contains(&format!("unknown field \"spec.template.spec.{field}\"")), "{error}");
    }
}

#[tokio::test]
async fn the_scale_subresource_moves_replicas_within_the_rules() {
    let ns = egress_testenv::namespace("pool-scale").await;
    let api: Api<ProxyPool> = ns.api();
    assert_accepted(apply_pool(&api, "eu", with(pool(6), "recycle", json!({ "minAvailable": 4 }))).await);
    let status = ProxyPoolStatus {
        replicas: 6,
        ready_replicas: 5,
        leased_replicas: 2,
        selector: ProxyPool::selector("eu"),
        ..ProxyPoolStatus::default()
    };
    api.patch_status("eu", &PatchParams::default(), &Patch::Merge(json!({ "status": status })))
        .await
        .expect("status patch");

    // What `kubectl scale` reads and writes.
    let scale = api.get_scale("eu").await.expect("the scale subresource");
    assert_eq!(scale.spec.and_then(|spec| spec.replicas), Some(6));
    let scale_status = scale.status.expect("scale status");
    assert_eq!(scale_status.replicas, 6);
    assert_eq!(scale_status.selector.as_deref(), Some("crawl.example.com/pool=eu"));
    api.patch_scale("eu", &PatchParams::default(), &Patch::Merge(json!({ "spec": { "replicas": 9 } })))
        .await
        .expect("scaling to 9");
    assert_eq!(api.get("eu").await.expect("get").spec.replicas, 9);
    // Below the recycling floor is allowed (an HPA may go there too); the pool's own rules still hold through the
    // scale subresource.
    api.patch_scale("eu", &PatchParams::default(), &Patch::Merge(json!({ "spec": { "replicas": 3 } })))
        .await
        .expect("scaling below minAvailable");
    let refused = api
        .patch_scale("eu", &PatchParams::default(), &Patch::Merge(json!({ "spec": { "replicas": 1001 } })))
        .await
        .map(|_| ())
        .map_err(describe);
    let error = refused.expect_err("scaling above the schema's bound is refused");
    assert!(error.contains("spec.replicas"), "{error}");
    api.patch_scale("eu", &PatchParams::default(), &Patch::Merge(json!({ "spec": { "replicas": 9 } })))
        .await
        .expect("scaling back to 9");

    let table =
        table(&ns.client(), &format!("/apis/crawl.example.com/v1alpha1/namespaces/{}/proxypools", ns.name())).await;
    assert_eq!(column_names(&table), ["NAME", "DESIRED", "READY", "LEASED", "AGE"]);
    let cells = table["rows"][0]["cells"].as_array().expect("one row").clone();
    assert_eq!(cells[0], "eu");
    assert_eq!(cells[1], 9);
    assert_eq!(cells[2], 5);
    assert_eq!(cells[3], 2);
}

#[tokio::test]
async fn the_sample_pool_applies_as_shipped() {
    let ns = egress_testenv::namespace("pool-sample").await;
    let api: Api<ProxyPool> = ns.api();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/samples/pool.yaml");
    let text = std::fs::read_to_string(&path).expect("the sample");
    let sample: Value = serde_saphyr::from_str(&text).expect("the sample parses");
    let name = sample["metadata"]["name"].as_str().expect("a name").to_owned();
    let applied = api
        .patch(&name, &PatchParams::apply(MANAGER), &Patch::Apply(&sample))
        .await
        .map_err(describe)
        .unwrap_or_else(|error| panic!("deploy/samples/pool.yaml is refused: {error}"));
    assert_eq!(applied.spec.replicas, 3);
    assert!(applied.spec.autoscale.is_some() && applied.spec.recycle.is_some());
}
