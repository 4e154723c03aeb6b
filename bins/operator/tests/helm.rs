//! The Helm chart (`deploy/helm/egress-operator`): it lints clean, renders with its default values exactly what
//! `kubectl apply -k deploy/default` applies (the Namespace aside: Helm installs into one), refuses bad values naming
//! the value, renders objects the real apiserver accepts, and installs, upgrades (replicas, and a changed CRD) and
//! uninstalls on the local control plane with the node agent running its pods, a lease through the Service after
//! each step.

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use egress_api::{Proxy, ProxyPhase};
use egress_client::{DiscoveryClient, LeaseOptions};
use egress_testenv::control_plane::ControlPlaneOptions;
use egress_testenv::install::{InstallOptions, Installation, Installer, SYSTEM_NAMESPACE};
use egress_testenv::{ControlPlane, LocalOrigin, assets};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, PostParams};
use serde_json::{Value, json};

const RELEASE: &str = "egress-operator";
const PROXIES_NAMESPACE: &str = "helm-proxies";
/// The labels Helm's conventions add to every object, which deploy/default does not carry.
const HELM_LABELS: [&str; 4] =
    ["helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "app.kubernetes.io/version"];

fn chart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/helm/egress-operator")
}

fn helm(args: &[&str]) -> Output {
    Command::new(assets::helm())
        .args(args)
        .output()
        .unwrap_or_else(|error| panic!("running {} (built by `cargo xtask test`): {error}", assets::helm().display()))
}

fn succeeded(output: Output, what: &str) -> String {
    assert!(output.status.success(), "{what} failed:\n{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).expect("UTF-8")
}

fn documents(text: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(text)
        .expect("YAML")
        .into_iter()
        .filter(|document| !document.is_null())
        .collect()
}

/// `helm template` of the chart into egress-system with `args`, as objects.
fn template(args: &[&str]) -> Vec<Value> {
    let chart = chart();
    let mut all = vec!["template", RELEASE, chart.to_str().expect("a UTF-8 path"), "--namespace", SYSTEM_NAMESPACE];
    all.extend_from_slice(args);
    documents(&succeeded(helm(&all), "helm template"))
}

fn kustomize(directory: &str) -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy").join(directory);
    let output = Command::new(assets::kubectl()).arg("kustomize").arg(&path).output().expect("kubectl kustomize");
    documents(&succeeded(output, "kubectl kustomize"))
}

/// Objects by (kind, namespace, name), with Helm's own labels, the chart's `checksum/` pod annotations and the
/// CRDs' keep policy taken out: what is left is what a cluster runs.
fn by_identity(objects: Vec<Value>) -> BTreeMap<(String, String, String), Value> {
    objects
        .into_iter()
        .map(|mut object| {
            let text = |value: &Value| value.as_str().unwrap_or_default().to_owned();
            let key =
                (text(&object["kind"]), text(&object["metadata"]["namespace"]), text(&object["metadata"]["name"]));
            strip(&mut object["metadata"], "labels", |label| HELM_LABELS.contains(&label));
            strip(&mut object["metadata"], "annotations", |annotation| annotation == "helm.sh/resource-policy");
            if object["kind"] == "Deployment" {
                strip(&mut object["spec"]["template"]["metadata"], "annotations", |annotation| {
                    annotation.starts_with("checksum/")
                });
            }
            (key, object)
        })
        .collect()
}

/// Removes the keys of `metadata[field]` that `drop` picks, and the field when nothing is left.
fn strip(metadata: &mut Value, field: &str, drop: impl Fn(&str) -> bool) {
    let Some(map) = metadata.get_mut(field).and_then(Value::as_object_mut) else { return };
    map.retain(|key, _| !drop(key));
    if map.is_empty() {
        metadata.as_object_mut().expect("an object").remove(field);
    }
}

/// The generated tokens file: one read and one lease token of 32 letters and digits, tenant `crawlers`, the lease
/// token with a quota (regression: none, and one tenant took a whole fleet).
fn assert_generated_tokens(tokens: &str) {
    let lines: Vec<Vec<&str>> = tokens.lines().map(|line| line.split_whitespace().collect()).collect();
    assert_eq!(lines.len(), 2, "{tokens}");
    for (line, (scope, quota)) in lines.iter().zip([("read", None), ("lease", Some("maxLeases=100"))]) {
        assert_eq!(line.len(), 3 + usize::from(quota.is_some()), "{line:?}");
        assert_eq!(line[0], scope);
        assert!(line[1].len() == 32 && line[1].bytes().all(|byte| byte.is_ascii_alphanumeric()), "{line:?}");
        assert_eq!(line[2], "tenant=crawlers");
        assert_eq!(line.get(3).copied(), quota);
    }
}

#[test]
fn the_chart_lints_clean_with_its_defaults_and_with_every_toggle() {
    let chart = chart();
    let chart = chart.to_str().expect("a UTF-8 path");
    succeeded(helm(&["lint", "--strict", chart]), "helm lint");
    succeeded(
        helm(&[
            "lint",
            "--strict",
            chart,
            "--set",
            "serviceMonitor.enabled=true,prometheusRule.enabled=true,networkPolicy.enabled=true,crds.install=false",
            "--set",
            "podDisruptionBudget.enabled=false,discoveryTokens.existingSecret=mine,leaseKey.secretName=my-key",
        ]),
        "helm lint with toggles",
    );
}

#[test]
fn with_default_values_the_chart_renders_what_deploy_default_applies() {
    let mut chart = by_identity(template(&[]));
    let mut kustomized = by_identity(kustomize("default"));
    // Helm installs into a namespace (`--create-namespace`, or one made beforehand with its pod-security label, as
    // docs/install.md says); deploy/default makes its own.
    let namespace = ("Namespace".to_owned(), String::new(), SYSTEM_NAMESPACE.to_owned());
    assert!(kustomized.remove(&namespace).is_some());
    // The chart generates its tokens where deploy/default ships examples to replace: compared apart.
    let tokens = ("Secret".to_owned(), SYSTEM_NAMESPACE.to_owned(), "egress-operator-discovery-tokens".to_owned());
    let generated = chart.get_mut(&tokens).expect("the chart's tokens Secret");
    let text = generated["stringData"]["tokens"].as_str().expect("tokens").to_owned();
    assert_generated_tokens(&text);
    let again = template(&[]);
    let again = again.iter().find(|object| object["kind"] == "Secret").expect("a Secret");
    assert_ne!(again["stringData"]["tokens"].as_str(), Some(text.as_str()), "tokens are random per install");
    generated["stringData"]["tokens"] = kustomized[&tokens]["stringData"]["tokens"].clone();

    let chart_keys: Vec<_> = chart.keys().collect();
    let kustomized_keys: Vec<_> = kustomized.keys().collect();
    assert_eq!(chart_keys, kustomized_keys, "the same objects");
    for (key, object) in &kustomized {
        assert_eq!(&chart[key], object, "{key:?} differs between the chart and deploy/default");
    }
    println!("the chart renders deploy/default's {} objects (its Namespace aside)", kustomized.len());
}

#[test]
fn the_monitoring_toggles_render_deploy_prometheus_objects() {
    let chart = by_identity(template(&["--set", "serviceMonitor.enabled=true,prometheusRule.enabled=true"]));
    let monitored = by_identity(kustomize("monitored"));
    for kind in ["ServiceMonitor", "PrometheusRule"] {
        let key = (kind.to_owned(), SYSTEM_NAMESPACE.to_owned(), "egress-operator".to_owned());
        assert_eq!(chart.get(&key), monitored.get(&key), "{kind}");
    }
    let defaults = template(&[]);
    assert!(defaults.iter().all(|object| object["kind"] != "ServiceMonitor" && object["kind"] != "PrometheusRule"));
}

#[test]
fn a_state_store_url_renders_deploy_shared_state_over_deploy_default() {
    let url = "redis://valkey.egress-system.svc:6379/0";
    let mut chart = by_identity(template(&["--set", &format!("stateStore.url={url}")]));
    // deploy/default with the component, as an overlay of the user's would have it.
    let overlay = tempfile::tempdir().expect("temp dir");
    let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    let deploy = deploy.canonicalize().expect("deploy/");
    std::fs::write(
        overlay.path().join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: {SYSTEM_NAMESPACE}\n\
             resources:\n  - {default}\n\
             components:\n  - {component}\n",
            default = pathdiff(overlay.path(), &deploy.join("default")),
            component = pathdiff(overlay.path(), &deploy.join("shared-state")),
        ),
    )
    .expect("write the overlay");
    let output = Command::new(assets::kubectl()).arg("kustomize").arg(overlay.path()).output().expect("kustomize");
    let mut kustomized = by_identity(documents(&succeeded(output, "kubectl kustomize")));
    let namespace = ("Namespace".to_owned(), String::new(), SYSTEM_NAMESPACE.to_owned());
    assert!(kustomized.remove(&namespace).is_some());
    let tokens = ("Secret".to_owned(), SYSTEM_NAMESPACE.to_owned(), "egress-operator-discovery-tokens".to_owned());
    chart.get_mut(&tokens).expect("tokens")["stringData"] = kustomized[&tokens]["stringData"].clone();
    // A strategic merge puts the component's env, mounts and volumes first: the order means nothing here.
    for objects in [&mut chart, &mut kustomized] {
        let deployment = objects
            .get_mut(&("Deployment".to_owned(), SYSTEM_NAMESPACE.to_owned(), "egress-operator".to_owned()))
            .expect("the operator's Deployment");
        let pod = &mut deployment["spec"]["template"]["spec"];
        for field in ["env", "volumeMounts"] {
            let list = pod["containers"][0][field].as_array_mut().expect("a list");
            list.sort_by_key(|item| item["name"].as_str().unwrap_or_default().to_owned());
        }
        let volumes = pod["volumes"].as_array_mut().expect("volumes");
        volumes.sort_by_key(|item| item["name"].as_str().unwrap_or_default().to_owned());
    }
    for (kind, name) in [
        ("ConfigMap", "egress-operator-state-store"),
        ("Deployment", "egress-operator"),
        ("Service", "egress-discovery"),
    ] {
        let key = (kind.to_owned(), SYSTEM_NAMESPACE.to_owned(), name.to_owned());
        assert_eq!(chart.get(&key), kustomized.get(&key), "{kind} {name}");
    }
    let service = &kustomized[&("Service".to_owned(), SYSTEM_NAMESPACE.to_owned(), "egress-discovery".to_owned())];
    assert_eq!(
        service["spec"]["selector"].as_object().map(|selector| selector.len()),
        Some(1),
        "every operator pod serves: {service}"
    );
    let chart_keys: Vec<_> = chart.keys().collect();
    let kustomized_keys: Vec<_> = kustomized.keys().collect();
    assert_eq!(chart_keys, kustomized_keys, "the same objects");
}

/// `to` relative to `from` (kustomize refuses absolute paths).
fn pathdiff(from: &std::path::Path, to: &std::path::Path) -> String {
    let from = from.canonicalize().expect("from");
    let up = from.components().count() - 1;
    format!("{}{}", "../".repeat(up), to.strip_prefix("/").expect("absolute").display())
}

#[test]
fn the_other_values_render_what_they_say() {
    let objects = template(&[
        "--set",
        "discoveryTokens.existingSecret=my-tokens,leaseKey.secretName=my-key,replicaCount=3,image.tag=v9",
        "--set",
        "crds.install=false,podDisruptionBudget.enabled=false,networkPolicy.enabled=true",
        "--set",
        "networkPolicy.discoveryFrom[0].namespaceSelector.matchLabels.crawlers=yes",
        "--set",
        "extraArgs[0]=--probe-concurrency=8,otlpEndpoint=http://127.0.0.1:4318",
        "--set",
        "gateway.replicaCount=4,gateway.extraArgs[0]=--sticky=1m",
        "--set",
        "networkPolicy.gatewayFrom[0].namespaceSelector.matchLabels.crawlers=yes",
    ]);
    let named = |kind: &str, name: &str| {
        objects
            .iter()
            .find(|object| object["kind"] == kind && object["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("a {kind} {name}"))
    };
    let kinds: Vec<&str> = objects.iter().filter_map(|object| object["kind"].as_str()).collect();
    assert!(!kinds.contains(&"Secret"), "an existing tokens Secret: none rendered ({kinds:?})");
    assert!(!kinds.contains(&"CustomResourceDefinition") && !kinds.contains(&"PodDisruptionBudget"), "{kinds:?}");
    let deployment = named("Deployment", "egress-operator");
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(deployment["spec"]["replicas"], 3);
    assert_eq!(pod["containers"][0]["image"], "egress-operator:v9");
    let args: Vec<&str> =
        pod["containers"][0]["args"].as_array().expect("args").iter().flat_map(Value::as_str).collect();
    assert!(args.contains(&"--lease-key-secret=my-key") && args.contains(&"--probe-concurrency=8"), "{args:?}");
    let env = &pod["containers"][0]["env"];
    assert!(env.as_array().expect("env").iter().any(|var| var["name"] == "EGRESS_OTLP_ENDPOINT"), "{env}");
    let tokens = pod["volumes"].as_array().expect("volumes").iter().find(|volume| volume["name"] == "tokens");
    assert_eq!(tokens.expect("a tokens volume")["secret"]["secretName"], "my-tokens");
    let policy = named("NetworkPolicy", "egress-operator");
    let ingress = policy["spec"]["ingress"].as_array().expect("ingress");
    assert_eq!(ingress.len(), 3, "discovery from the peers and from the gateway, metrics; never health");
    assert_eq!(ingress[0]["ports"][0]["port"], "discovery");
    assert_eq!(ingress[0]["from"][0]["namespaceSelector"]["matchLabels"]["crawlers"], "yes");
    assert_eq!(ingress[1]["ports"][0]["port"], "discovery");
    assert_eq!(ingress[1]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"], "egress-gateway");
    assert_eq!(ingress[2]["ports"][0]["port"], "metrics");
    assert!(!policy.to_string().contains("health"), "no Pod reaches the health port: {policy}");

    // The gateway: its own replicas and flags, the operator's image, tokens and telemetry.
    let gateway = named("Deployment", "egress-gateway");
    let pod = &gateway["spec"]["template"]["spec"];
    assert_eq!(gateway["spec"]["replicas"], 4);
    assert_eq!(pod["containers"][0]["image"], "egress-operator:v9");
    assert_eq!(pod["automountServiceAccountToken"], false, "the gateway needs no Kubernetes API access");
    let operator_user = &deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"];
    assert_eq!(
        (&pod["securityContext"]["runAsUser"], operator_user),
        (&serde_json::json!(65533), &serde_json::json!(65532)),
        "uids of their own"
    );
    let args: Vec<&str> =
        pod["containers"][0]["args"].as_array().expect("args").iter().flat_map(Value::as_str).collect();
    assert_eq!(args.first(), Some(&"gateway"), "{args:?}");
    assert!(args.contains(&"--sticky=1m"), "{args:?}");
    assert!(
        pod["containers"][0]["env"].as_array().expect("env").iter().any(|var| var["name"] == "EGRESS_OTLP_ENDPOINT")
    );
    let tokens = pod["volumes"].as_array().expect("volumes").iter().find(|volume| volume["name"] == "tokens");
    assert_eq!(tokens.expect("a tokens volume")["secret"]["secretName"], "my-tokens");
    let policy = named("NetworkPolicy", "egress-gateway");
    let ingress = policy["spec"]["ingress"].as_array().expect("ingress");
    assert_eq!(ingress.len(), 2, "the gateway port and metrics; never health");
    assert_eq!(ingress[0]["ports"][0]["port"], "gateway");
    assert_eq!(ingress[0]["from"][0]["namespaceSelector"]["matchLabels"]["crawlers"], "yes");
    assert_eq!(ingress[1]["ports"][0]["port"], "metrics");

    let without = template(&["--set", "gateway.enabled=false,networkPolicy.enabled=true"]);
    assert!(
        without
            .iter()
            .all(|object| !object["metadata"]["name"].as_str().is_some_and(|name| name.starts_with("egress-gateway"))),
        "gateway.enabled=false renders no gateway object"
    );
}

#[test]
fn bad_values_are_refused_naming_the_value() {
    let chart = chart();
    let chart = chart.to_str().expect("a UTF-8 path");
    for (value, expected) in [
        ("replicaCount=two", "/replicaCount"),
        ("replicas=3", "'replicas' not allowed"),
        ("logFormat=xml", "/logFormat"),
        ("terminationGracePeriodSeconds=5", "/terminationGracePeriodSeconds"),
        ("clusterId=-bad-", "/clusterId"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("crds.keeep=true", "'keeep' not allowed"),
        ("gateway.replicas=3", "'replicas' not allowed"),
        ("gateway.replicaCount=-1", "/gateway/replicaCount"),
    ] {
        let output = helm(&["template", RELEASE, chart, "--set", value]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{value} was accepted");
        assert!(stderr.contains(expected), "{value}: {stderr}");
    }
    for (providers, expected) in
        [("a: [", "values.providers is not YAML"), ("a: 1", "values.providers must hold a `providers:` list")]
    {
        let output = helm(&["template", RELEASE, chart, "--set-string", &format!("providers={providers}")]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success() && stderr.contains(expected), "{providers}: {stderr}");
    }
}

fn kubectl(plane: &ControlPlane, args: &[&str], input: Option<&str>) -> String {
    let mut child = Command::new(assets::kubectl())
        .arg(format!("--kubeconfig={}", plane.kubeconfig_path().display()))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(input.unwrap_or_default().as_bytes()).expect("writing to kubectl");
    drop(stdin);
    succeeded(child.wait_with_output().expect("kubectl"), &format!("kubectl {}", args.join(" ")))
}

/// The lease token of the installed tokens Secret, as a user reads it.
async fn lease_token(client: &kube::Client) -> String {
    let secret = Api::<Secret>::namespaced(client.clone(), SYSTEM_NAMESPACE)
        .get("egress-operator-discovery-tokens")
        .await
        .expect("the tokens Secret");
    let tokens = String::from_utf8(secret.data.expect("data")["tokens"].0.clone()).expect("UTF-8");
    assert_generated_tokens(&tokens);
    tokens
        .lines()
        .find_map(|line| line.strip_prefix("lease "))
        .and_then(|rest| rest.split_whitespace().next())
        .expect("a lease token")
        .to_owned()
}

/// A lease through the discovery Service, given back at once; returns the proxy's URL.
async fn lease_through_the_service(installation: &Installation, token: &str) -> String {
    let discovery = DiscoveryClient::new(&installation.discovery.url(), Some(token.to_owned())).expect("client");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match discovery.lease(LeaseOptions::for_target("example.com")).await {
            Ok(lease) => {
                let url = lease.proxy_url().to_string();
                lease.release().await.expect("release");
                return url;
            }
            // A new leader may still be reading the fleet after a rollout.
            Err(error) if Instant::now() < deadline => {
                eprintln!("helm: lease not granted yet: {error}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(error) => {
                panic!("no lease through the Service within 60 s: {error}\n{}", installation.operator_logs().await)
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_installs_upgrades_and_uninstalls_with_a_lease_through_the_service_after_each() {
    // A control plane of its own, without the workspace's CRDs: the chart brings them.
    let no_crds = tempfile::tempdir().expect("a temp dir");
    let plane =
        ControlPlane::start_with(ControlPlaneOptions { crds: no_crds.path().to_path_buf(), ..Default::default() })
            .await
            .expect("a control plane");
    let client = plane.client().await.expect("client");
    for (name, labels) in [
        (SYSTEM_NAMESPACE, Some([("pod-security.kubernetes.io/enforce".to_owned(), "restricted".to_owned())].into())),
        (PROXIES_NAMESPACE, None),
    ] {
        let namespace = Namespace {
            metadata: ObjectMeta { name: Some(name.into()), labels, ..ObjectMeta::default() },
            ..Namespace::default()
        };
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &namespace).await.expect("namespace");
    }
    let origin = LocalOrigin::start().await.expect("origin");
    let providers = format!(
        "providers:\n  - name: pods\n    type: kubernetes\n    destinations: {}\n    kubernetes: {{ namespace: {PROXIES_NAMESPACE}, image: \"ubuntu/squid:latest\" }}\n",
        origin.destinations_yaml()
    );

    // The rendered chart, every toggle the apiserver can check on (not the Prometheus Operator's kinds, which this
    // cluster does not have; they are compared with deploy/prometheus above), passes a server-side dry run.
    let chart = chart();
    let rendered = succeeded(
        helm(&[
            "template",
            RELEASE,
            chart.to_str().expect("a UTF-8 path"),
            "--namespace",
            SYSTEM_NAMESPACE,
            "--set",
            "networkPolicy.enabled=true,networkPolicy.metricsFrom[0].podSelector.matchLabels.app=prometheus",
        ]),
        "helm template",
    );
    let accepted = kubectl(&plane, &["apply", "--dry-run=server", "-f", "-"], Some(&rendered));
    println!("helm template, server-side dry run:\n{accepted}");

    let options = InstallOptions {
        operator_binary: env!("CARGO_BIN_EXE_egress-operator").into(),
        providers_yaml: providers,
        proxy_namespaces: vec![PROXIES_NAMESPACE.to_owned()],
        default_probe_url: origin.ip_url(),
        discovery_tokens: None,
        shared_state: false,
    };
    let started = Instant::now();
    let installer = Installer::Helm { chart: chart.clone(), release: RELEASE.to_owned(), args: Vec::new() };
    let installation = Installation::install(&plane, &options, &installer)
        .await
        .unwrap_or_else(|error| panic!("helm install: {error:#}"));
    println!("helm install: Available with 2 Ready replicas in {:.1?}", started.elapsed());

    let proxies: Api<Proxy> = Api::namespaced(client.clone(), PROXIES_NAMESPACE);
    proxies.create(&PostParams::default(), &Proxy::new("p", common::managed("pods", None))).await.expect("a Proxy");
    let ready = match common::wait_phase(&proxies, &["p"], ProxyPhase::Ready, Duration::from_secs(120)).await {
        Ok(ready) => ready,
        Err(error) => panic!("{error}\n{}", installation.operator_logs().await),
    };
    let token = lease_token(&client).await;
    let url = lease_through_the_service(&installation, &token).await;
    let endpoint = ready[0].status.as_ref().and_then(|status| status.endpoint.clone()).expect("an endpoint");
    assert!(url.contains(&endpoint.host), "leased {url}, the Proxy is at {endpoint:?}");
    println!("after install: leased {url} through the Service");

    // The upgrade a new chart version makes: more replicas, and a CRD with a field changed (a printer column).
    let upgraded = tempfile::tempdir().expect("a temp dir");
    copy_tree(&chart, upgraded.path());
    let crd_path = upgraded.path().join("files/crds/crawl.example.com_proxies.yaml");
    let mut crd: Value = serde_saphyr::from_str(&std::fs::read_to_string(&crd_path).expect("read")).expect("a CRD");
    for version in crd["spec"]["versions"].as_array_mut().expect("versions") {
        version["additionalPrinterColumns"]
            .as_array_mut()
            .expect("printer columns")
            .push(json!({ "name": "Upgraded", "type": "string", "jsonPath": ".metadata.labels.upgraded" }));
    }
    // JSON is YAML.
    std::fs::write(&crd_path, serde_json::to_string_pretty(&crd).expect("JSON")).expect("write");
    let kubeconfig = format!("--kubeconfig={}", plane.kubeconfig_path().display());
    let started = Instant::now();
    succeeded(
        helm(&[
            &kubeconfig,
            "upgrade",
            RELEASE,
            upgraded.path().to_str().expect("a UTF-8 path"),
            "--namespace",
            SYSTEM_NAMESPACE,
            "--reuse-values",
            "--set",
            "replicaCount=3",
        ]),
        "helm upgrade",
    );
    installation.wait_available(Duration::from_secs(180)).await.expect("Available after the upgrade");
    println!("helm upgrade: Available with 3 Ready replicas in {:.1?}", started.elapsed());
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let served = crds.get("proxies.crawl.example.com").await.expect("the Proxy CRD");
    let columns: Vec<String> = served
        .spec
        .versions
        .iter()
        .flat_map(|version| version.additional_printer_columns.iter().flatten())
        .map(|column| column.name.clone())
        .collect();
    assert!(columns.contains(&"Upgraded".to_owned()), "the CRD was not upgraded: {columns:?}");
    assert_eq!(lease_token(&client).await, token, "the generated tokens survive an upgrade");
    let url = lease_through_the_service(&installation, &token).await;
    println!("after upgrade: leased {url} through the Service");

    // Uninstall: every object of the release goes but the CRDs, which the chart keeps (deleting a CRD deletes every
    // Proxy and ProxyPool). The Proxy is deleted first, while the operator can still release its instance.
    let manifest = succeeded(
        helm(&[&kubeconfig, "get", "manifest", RELEASE, "--namespace", SYSTEM_NAMESPACE]),
        "helm get manifest",
    );
    proxies.delete("p", &Default::default()).await.expect("delete the Proxy");
    egress_testenv::eventually("the Proxy deleted", Duration::from_secs(60), || async {
        proxies.get_opt("p").await.ok()?.is_none().then_some(())
    })
    .await;
    succeeded(helm(&[&kubeconfig, "uninstall", RELEASE, "--namespace", SYSTEM_NAMESPACE, "--wait"]), "helm uninstall");
    let left = kubectl(&plane, &["get", "--ignore-not-found", "-o", "name", "-f", "-"], Some(&manifest));
    let mut left: Vec<&str> = left.lines().collect();
    left.sort_unstable();
    assert_eq!(
        left,
        [
            "customresourcedefinition.apiextensions.k8s.io/providerhealths.crawl.example.com",
            "customresourcedefinition.apiextensions.k8s.io/proxies.crawl.example.com",
            "customresourcedefinition.apiextensions.k8s.io/proxypools.crawl.example.com",
        ],
        "what helm uninstall left"
    );
    println!("helm uninstall: nothing of the release left but its 3 CRDs (kept by helm.sh/resource-policy)");
}

fn copy_tree(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).expect("read_dir") {
        let entry = entry.expect("an entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("a type").is_dir() {
            std::fs::create_dir_all(&target).expect("mkdir");
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

/// The shell block of docs/install.md's section `heading`, as a user copies it.
fn docs_commands(heading: &str) -> String {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/install.md"))
        .expect("docs/install.md");
    let section = &text[text.find(heading).unwrap_or_else(|| panic!("docs/install.md has no {heading:?}"))..];
    let block = section.split("```sh\n").nth(1).expect("a ```sh block in the section");
    block.split("```").next().expect("the block's end").to_owned()
}

/// docs/install.md's "Switching from `kubectl apply -k` to Helm", run as written over a `kubectl apply -k` install
/// with a Ready Proxy: Helm then owns every object of the chart, the Proxy and the tokens are the same, and a lease
/// through the Service works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_takes_over_a_kustomize_installation_as_the_docs_say() {
    let no_crds = tempfile::tempdir().expect("a temp dir");
    let plane =
        ControlPlane::start_with(ControlPlaneOptions { crds: no_crds.path().to_path_buf(), ..Default::default() })
            .await
            .expect("a control plane");
    let client = plane.client().await.expect("client");
    let namespace = Namespace {
        metadata: ObjectMeta { name: Some(PROXIES_NAMESPACE.into()), ..ObjectMeta::default() },
        ..Namespace::default()
    };
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &namespace).await.expect("namespace");
    let origin = LocalOrigin::start().await.expect("origin");
    let providers = format!(
        "providers:\n  - name: pods\n    type: kubernetes\n    destinations: {}\n    kubernetes: {{ namespace: {PROXIES_NAMESPACE}, image: \"ubuntu/squid:latest\" }}\n",
        origin.destinations_yaml()
    );
    let token = "takeover-lease-token-0123456789abcdef";
    let options = InstallOptions {
        operator_binary: env!("CARGO_BIN_EXE_egress-operator").into(),
        providers_yaml: providers,
        proxy_namespaces: vec![PROXIES_NAMESPACE.to_owned()],
        default_probe_url: origin.ip_url(),
        discovery_tokens: Some(format!("lease {token} tenant=crawlers maxLeases=100\n")),
        shared_state: false,
    };
    let installation =
        Installation::apply(&plane, &options).await.unwrap_or_else(|error| panic!("apply -k: {error:#}"));
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), PROXIES_NAMESPACE);
    proxies.create(&PostParams::default(), &Proxy::new("p", common::managed("pods", None))).await.expect("a Proxy");
    let ready = match common::wait_phase(&proxies, &["p"], ProxyPhase::Ready, Duration::from_secs(120)).await {
        Ok(ready) => ready,
        Err(error) => panic!("{error}\n{}", installation.operator_logs().await),
    };
    let uid = ready[0].metadata.uid.clone().expect("a UID");
    let secrets = Api::<Secret>::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let tokens_before = secrets.get("egress-operator-discovery-tokens").await.expect("the tokens Secret").data;

    // The docs' commands, in a directory of their own (they write providers.yaml) that sees the checkout's deploy/.
    let work = tempfile::tempdir().expect("a temp dir");
    std::os::unix::fs::symlink(chart().join("../.."), work.path().join("deploy")).expect("a symlink to deploy/");
    let path = format!(
        "{}:{}:{}",
        assets::kubectl().parent().expect("kubectl's directory").display(),
        assets::helm().parent().expect("helm's directory").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let deployments = Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let generation = |deployment: k8s_openapi::api::apps::v1::Deployment| deployment.metadata.generation;
    let before = generation(deployments.get("egress-operator").await.expect("the Deployment"));
    let started = Instant::now();
    let commands = docs_commands("### Switching from `kubectl apply -k` to Helm");
    let output = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &commands])
        .current_dir(work.path())
        .env("PATH", path)
        .env("KUBECONFIG", plane.kubeconfig_path())
        .output()
        .expect("bash");
    assert!(
        output.status.success(),
        "the docs' takeover commands failed:\n{commands}\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    installation.wait_available(Duration::from_secs(180)).await.expect("Available after the takeover");
    let after = generation(deployments.get("egress-operator").await.expect("the Deployment"));
    println!(
        "helm takeover: the docs' commands in {:.1?}, the operator's Deployment at generation {after:?} (was {before:?})",
        started.elapsed()
    );

    let kubeconfig = format!("--kubeconfig={}", plane.kubeconfig_path().display());
    let manifest = succeeded(
        helm(&[&kubeconfig, "get", "manifest", RELEASE, "--namespace", SYSTEM_NAMESPACE]),
        "helm get manifest",
    );
    let installed = kubectl(&plane, &["get", "-o", "json", "-f", "-"], Some(&manifest));
    let installed: Value = serde_json::from_str(&installed).expect("JSON");
    let objects = installed["items"].as_array().cloned().unwrap_or_else(|| vec![installed.clone()]);
    // Every object deploy/default applied but its Namespace (which stays the user's).
    let mut expected: Vec<_> = kustomize("default")
        .iter()
        .filter(|object| object["kind"] != "Namespace")
        .map(|object| {
            format!("{}/{}", object["kind"].as_str().unwrap_or("?"), object["metadata"]["name"].as_str().unwrap_or("?"))
        })
        .collect();
    let mut released: Vec<_> = objects
        .iter()
        .map(|object| {
            format!("{}/{}", object["kind"].as_str().unwrap_or("?"), object["metadata"]["name"].as_str().unwrap_or("?"))
        })
        .collect();
    expected.sort();
    released.sort();
    assert_eq!(released, expected, "the release holds what kubectl apply -k applied");
    for object in &objects {
        let name = format!(
            "{}/{}",
            object["kind"].as_str().unwrap_or("?"),
            object["metadata"]["name"].as_str().unwrap_or("?")
        );
        assert_eq!(
            object["metadata"]["annotations"]["meta.helm.sh/release-name"], RELEASE,
            "{name} is not the release's"
        );
        assert_eq!(object["metadata"]["labels"]["app.kubernetes.io/managed-by"], "Helm", "{name}");
    }
    let proxy = proxies.get("p").await.expect("the Proxy is still there");
    assert_eq!(proxy.metadata.uid.as_deref(), Some(uid.as_str()), "the Proxy was not recreated");
    let tokens_after = secrets.get("egress-operator-discovery-tokens").await.expect("the tokens Secret").data;
    assert_eq!(tokens_after, tokens_before, "the tokens did not change");
    let url = lease_through_the_service(&installation, token).await;
    println!(
        "helm takeover: Helm owns {} objects, the Proxy kept its UID, leased {url} through the Service",
        objects.len()
    );
}
