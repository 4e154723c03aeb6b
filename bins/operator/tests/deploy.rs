//! The shipped manifests: least-privilege RBAC, a hardened Deployment, and a kustomization whose files all exist.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|error| panic!("reading {}: {error}", path.display()));
    serde_saphyr::from_multiple::<Value>(&text).unwrap_or_else(|error| panic!("parsing {}: {error}", path.display()))
}

fn find<'a>(documents: &'a [Value], kind: &str) -> &'a Value {
    documents.iter().find(|document| document["kind"] == kind).unwrap_or_else(|| panic!("a {kind}"))
}

/// Every (API group, resource, verb) the operator calls, and nothing else.
const USED: &[(&str, &str, &[&str])] = &[
    ("crawl.example.com", "proxies", &["get", "list", "watch", "patch", "create", "delete"]),
    ("crawl.example.com", "proxies/status", &["patch"]),
    ("crawl.example.com", "proxypools", &["list", "watch"]),
    ("crawl.example.com", "proxypools/status", &["patch"]),
    ("crawl.example.com", "proxypools/scale", &["patch"]),
    ("crawl.example.com", "providerhealths", &["get", "list", "create", "delete"]),
    ("crawl.example.com", "providerhealths/status", &["patch"]),
    ("events.k8s.io", "events", &["create", "patch"]),
    ("", "secrets", &["get", "list", "watch", "create", "delete"]),
    ("", "pods", &["get", "list", "create", "delete"]),
    ("", "configmaps", &["create", "delete"]),
];

fn grants(role: &Value) -> BTreeSet<(String, String, String)> {
    let mut grants = BTreeSet::new();
    for rule in role["rules"].as_array().expect("rules") {
        for group in rule["apiGroups"].as_array().expect("apiGroups") {
            for resource in rule["resources"].as_array().expect("resources") {
                for verb in rule["verbs"].as_array().expect("verbs") {
                    let text = |value: &Value| value.as_str().expect("a string").to_owned();
                    grants.insert((text(group), text(resource), text(verb)));
                }
            }
        }
    }
    grants
}

#[test]
fn the_cluster_role_grants_exactly_what_the_operator_uses() {
    let rbac = documents(&deploy().join("default/rbac.yaml"));
    let granted = grants(find(&rbac, "ClusterRole"));
    let used: BTreeSet<(String, String, String)> = USED
        .iter()
        .flat_map(|(group, resource, verbs)| {
            verbs.iter().map(move |verb| ((*group).to_owned(), (*resource).to_owned(), (*verb).to_owned()))
        })
        .collect();
    let extra: Vec<_> = granted.difference(&used).collect();
    assert!(extra.is_empty(), "the ClusterRole grants what the operator never uses: {extra:?}");
    let missing: Vec<_> = used.difference(&granted).collect();
    assert!(missing.is_empty(), "the ClusterRole lacks what the operator uses: {missing:?}");
    assert!(
        granted.iter().all(|(group, resource, verb)| group != "*" && resource != "*" && verb != "*"),
        "no wildcards"
    );
    // In the operator's own namespace: the Lease (watched), its own Pod's leader label, the list of its peers for a
    // handover, and the ended-leases ConfigMap, nothing else.
    let leader = grants(find(&rbac, "Role"));
    let expected: BTreeSet<(String, String, String)> = ["get", "list", "watch", "update", "create"]
        .iter()
        .map(|verb| ("coordination.k8s.io".to_owned(), "leases".to_owned(), (*verb).to_owned()))
        .chain(["list", "patch"].iter().map(|verb| (String::new(), "pods".to_owned(), (*verb).to_owned())))
        .chain(
            ["get", "patch", "create"].iter().map(|verb| (String::new(), "configmaps".to_owned(), (*verb).to_owned())),
        )
        .collect();
    assert_eq!(leader, expected);
}

/// A rolling restart or a drain is make-before-break: a surge pod first, never fewer than the replicas, one pod
/// disrupted at a time, and time to hand over.
#[test]
fn rollouts_and_drains_keep_a_replica_serving() {
    let deployment = documents(&deploy().join("default/deployment.yaml"));
    let spec = &find(&deployment, "Deployment")["spec"];
    assert_eq!(spec["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
    assert_eq!(spec["strategy"]["rollingUpdate"]["maxSurge"], 1);
    let grace = spec["template"]["spec"]["terminationGracePeriodSeconds"].as_u64().expect("a grace period");
    // The handover waits up to 20 s for a successor, then needs a few seconds more.
    assert!(grace >= 30, "{grace}");
    let budget = documents(&deploy().join("default/pdb.yaml"));
    let budget = find(&budget, "PodDisruptionBudget");
    assert_eq!(budget["spec"]["maxUnavailable"], 1);
    assert_eq!(budget["spec"]["selector"], spec["selector"]);
}

#[test]
fn the_deployment_is_hardened() {
    let deployment = documents(&deploy().join("default/deployment.yaml"));
    let pod = &find(&deployment, "Deployment")["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let container = &pod["containers"][0];
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(container["securityContext"]["allowPrivilegeEscalation"], false);
    assert!(container["resources"]["limits"]["memory"].is_string());
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/livez");
}

/// The example lease token has a quota: one tenant cannot take a whole shared fleet (regression: none, and one
/// token took 14 of 14 leases while a second tenant got 503).
#[test]
fn the_example_lease_token_has_a_quota() {
    let config = documents(&deploy().join("default/config.yaml"));
    let secret = config.iter().find(|document| document["kind"] == "Secret").expect("the tokens Secret");
    let tokens = secret["stringData"]["tokens"].as_str().expect("tokens");
    let lease = tokens.lines().find(|line| line.trim_start().starts_with("lease ")).expect("a lease token");
    assert!(lease.split_whitespace().any(|field| field == "maxLeases=100"), "{lease}");
}

/// The gateway runs as a uid of its own: on a node it cannot read the operator's files (its ServiceAccount token).
/// Regression: both ran as 65532.
#[test]
fn the_gateway_and_the_operator_run_as_different_users() {
    let user = |file: &str| {
        let documents = documents(&deploy().join(file));
        let context = find(&documents, "Deployment")["spec"]["template"]["spec"]["securityContext"].clone();
        assert_eq!(context["runAsNonRoot"], true, "{file}");
        (context["runAsUser"].as_u64().expect("runAsUser"), context["runAsGroup"].as_u64().expect("runAsGroup"))
    };
    let (operator, gateway) = (user("default/deployment.yaml"), user("default/gateway.yaml"));
    assert!(operator.0 != gateway.0 && operator.1 != gateway.1, "operator {operator:?}, gateway {gateway:?}");
}

/// Discovery reaches the leader only: the Service selects the label the leader sets on its own Pod.
#[test]
fn the_discovery_service_selects_the_leader() {
    let services = documents(&deploy().join("default/services.yaml"));
    let discovery = services.iter().find(|document| document["metadata"]["name"] == "egress-discovery").expect("it");
    assert_eq!(
        discovery["spec"]["selector"][egress_runtime::role_label::ROLE_LABEL],
        egress_runtime::role_label::LEADER
    );
    let metrics =
        services.iter().find(|document| document["metadata"]["name"] == "egress-operator-metrics").expect("it");
    assert!(
        metrics["spec"]["selector"].get(egress_runtime::role_label::ROLE_LABEL).is_none(),
        "metrics: every replica"
    );
}

/// `deploy/default` applies on a cluster without the Prometheus Operator; the ServiceMonitor is a component.
#[test]
fn the_service_monitor_is_optional() {
    let default = documents(&deploy().join("default/kustomization.yaml"));
    let resources: Vec<&str> =
        default[0]["resources"].as_array().expect("resources").iter().filter_map(Value::as_str).collect();
    assert!(resources.iter().all(|resource| !resource.contains("servicemonitor")), "{resources:?}");
    let component = documents(&deploy().join("prometheus/kustomization.yaml"));
    assert_eq!(component[0]["kind"], "Component");
    let monitor = documents(&deploy().join("prometheus/servicemonitor.yaml"));
    assert_eq!(monitor[0]["kind"], "ServiceMonitor");
    let monitored = documents(&deploy().join("monitored/kustomization.yaml"));
    assert_eq!(monitored[0]["resources"][0], "../default");
    assert_eq!(monitored[0]["components"][0], "../prometheus");
}

#[test]
fn every_kustomization_resource_exists_and_parses() {
    for dir in ["default", "samples", "monitored", "prometheus", "namespaced", "shared-state"] {
        let kustomization = documents(&deploy().join(dir).join("kustomization.yaml"));
        let patches = kustomization[0]["patches"].as_array().into_iter().flatten().map(|patch| &patch["path"]);
        let patches = patches.filter(|path| path.is_string());
        for resource in kustomization[0]["resources"].as_array().expect("resources").iter().chain(patches) {
            let path = deploy().join(dir).join(resource.as_str().expect("a path"));
            let file = if path.is_dir() { path.join("kustomization.yaml") } else { path };
            assert!(!documents(&file).is_empty(), "{} has documents", file.display());
        }
    }
}

/// The PrometheusRule's groups, as a plain rules file promtool reads.
fn alert_rules() -> (Value, BTreeSet<String>) {
    let rule = documents(&deploy().join("prometheus/prometheusrule.yaml"));
    assert_eq!(rule[0]["kind"], "PrometheusRule");
    let groups = rule[0]["spec"]["groups"].clone();
    let alerts = groups
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|group| group["rules"].as_array().expect("rules").iter())
        .filter_map(|rule| rule["alert"].as_str().map(str::to_owned))
        .collect();
    (serde_json::json!({ "groups": groups }), alerts)
}

fn promtool(args: &[&str]) -> String {
    let output = std::process::Command::new("promtool").args(args).output().unwrap_or_else(|error| {
        panic!("running promtool ({error}): `cargo xtask test` installs it with Debian's prometheus package")
    });
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

/// `promtool check rules` on the shipped alerts, and `promtool test rules` on their unit tests, in which every
/// alert has a case that fires and one that stays quiet.
#[test]
fn the_alert_rules_pass_promtool_and_every_alert_has_a_firing_and_a_quiet_case() {
    let (rules, alerts) = alert_rules();
    let dir = tempfile::tempdir().expect("temp dir");
    // JSON is YAML: promtool reads it as the rules file.
    std::fs::write(dir.path().join("rules.yaml"), serde_json::to_string_pretty(&rules).expect("json")).expect("write");
    let tests = deploy().join("prometheus/tests/alerts.test.yaml");
    std::fs::copy(&tests, dir.path().join("alerts.test.yaml")).expect("copy the tests");
    let checked = promtool(&["check", "rules", &dir.path().join("rules.yaml").to_string_lossy()]);
    assert!(checked.contains(&format!("SUCCESS: {} rules found", alerts.len())), "{checked}");
    let tested = promtool(&["test", "rules", &dir.path().join("alerts.test.yaml").to_string_lossy()]);
    assert!(tested.contains("SUCCESS"), "{tested}");

    let suite = documents(&tests);
    let (mut fires, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    for test in suite[0]["tests"].as_array().expect("tests") {
        for case in test["alert_rule_test"].as_array().expect("alert_rule_test") {
            let name = case["alertname"].as_str().expect("alertname").to_owned();
            if case["exp_alerts"].as_array().is_some_and(|expected| !expected.is_empty()) {
                fires.insert(name);
            } else {
                quiet.insert(name);
            }
        }
    }
    let missing: Vec<_> = alerts.iter().filter(|alert| !fires.contains(*alert) || !quiet.contains(*alert)).collect();
    assert!(missing.is_empty(), "alerts without a firing and a quiet case: {missing:?}");
    eprintln!("alerts: {} rules, each with a firing and a quiet promtool case: {alerts:?}", alerts.len());
}

/// The dashboard is Grafana's JSON with a datasource variable, and every panel but the rows has queries.
#[test]
fn the_dashboard_has_a_query_on_every_panel() {
    let text = std::fs::read_to_string(deploy().join("grafana/egress-operator.json")).expect("the dashboard");
    let dashboard: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(dashboard["uid"], "egress-operator");
    assert_eq!(dashboard["templating"]["list"][0]["type"], "datasource");
    for panel in dashboard["panels"].as_array().expect("panels") {
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{}", panel["title"]);
        assert!(panel["targets"].as_array().is_some_and(|targets| !targets.is_empty()), "{}", panel["title"]);
    }
    let queries = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|panel| panel["targets"].as_array().into_iter().flatten())
        .filter(|target| target["expr"].as_str().is_some_and(|expr| !expr.is_empty()))
        .count();
    assert!(queries >= 20, "{queries} queries");
}

/// `deploy/namespaced` grants the same calls, split: everything namespaced in the proxies' namespace, the
/// cluster-scoped ProviderHealths cluster-wide, and in the operator's namespace only the lease-key Secret; its
/// kustomization deletes deploy/default's ClusterRole and binding, watches the one namespace, and limits the
/// kubernetes provider to it.
#[test]
fn the_namespaced_overlay_grants_the_same_calls_with_nothing_cluster_wide_but_provider_healths() {
    let rbac = documents(&deploy().join("namespaced/rbac.yaml"));
    let named = |kind: &str, name: &str| {
        rbac.iter()
            .find(|document| document["kind"] == kind && document["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("a {kind} {name}"))
    };
    let cluster = grants(named("ClusterRole", "egress-operator-provider-health"));
    assert!(cluster.iter().all(|(_, resource, _)| resource.starts_with("providerhealths")), "{cluster:?}");
    let namespaced = named("Role", "egress-operator");
    assert_eq!(namespaced["metadata"]["namespace"], "egress-proxies");
    let granted: BTreeSet<_> = grants(namespaced).union(&cluster).cloned().collect();
    let used: BTreeSet<(String, String, String)> = USED
        .iter()
        .flat_map(|(group, resource, verbs)| {
            verbs.iter().map(move |verb| ((*group).to_owned(), (*resource).to_owned(), (*verb).to_owned()))
        })
        .collect();
    assert_eq!(granted, used, "the namespaced grants are the ClusterRole's calls");
    let lease_key = named("Role", "egress-operator-lease-key");
    assert_eq!(lease_key["metadata"]["namespace"], "egress-system");
    assert_eq!(lease_key["rules"][0]["resourceNames"][0], "egress-operator-lease-key");
    let kustomization = std::fs::read_to_string(deploy().join("namespaced/kustomization.yaml")).expect("read");
    for expected in [
        "target: { kind: ClusterRole, name: egress-operator }",
        "target: { kind: ClusterRoleBinding, name: egress-operator }",
        "$patch: delete",
        "--watch-namespace=egress-proxies",
        "namespaces: [egress-proxies]",
    ] {
        assert!(kustomization.contains(expected), "deploy/namespaced/kustomization.yaml lacks {expected:?}");
    }
}
