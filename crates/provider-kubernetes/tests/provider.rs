//! The kubernetes provider against the real test control plane, and with the local node agent, against real Squid.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use egress_provider::config::ProvidersConfig;
use egress_provider::destinations::DestinationPolicy;
use egress_provider::{
    Checker, CreateRequest, ErrorClass, Instance, InstanceState, Provider, ProxyCredentials, Sensitive, Tags,
    instance_name,
};
use egress_provider_kubernetes::{KubernetesConfig, KubernetesProvider};
use egress_testenv::{LocalOrigin, NodeAgent, TestNamespace, eventually, get_through_proxy};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, ResourceQuota, ResourceQuotaSpec, Secret};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::json;

const CLUSTER: &str = "test-cluster";

fn settings(namespace: &str) -> KubernetesConfig {
    let text = format!(
        "providers:\n  - name: pods\n    type: kubernetes\n    kubernetes:\n      namespace: {namespace}\n      fdLimit: 4096\n      \
         machineTypes:\n        small: {{ cpu: 10m, memory: 64Mi }}\n"
    );
    let config = ProvidersConfig::parse_as::<KubernetesConfig>(&text, "test").unwrap_or_else(|error| panic!("{error}"));
    config.providers[0].settings::<KubernetesConfig>().expect("a kubernetes block").clone()
}

fn provider(ns: &TestNamespace) -> KubernetesProvider {
    KubernetesProvider::new(ns.client(), settings(ns.name()))
}

/// A provider whose proxies may reach `origin` (loopback is denied by default).
fn provider_reaching(ns: &TestNamespace, origin: &LocalOrigin) -> KubernetesProvider {
    let rule = origin.allow_rule().parse().expect("the origin's rule");
    provider(ns).with_destinations(DestinationPolicy { allow: vec![rule], deny: Vec::new() })
}

/// A request as the reconciler would make it for the Proxy `uid`.
fn request(uid: &str) -> CreateRequest {
    let hash = "340e470e78ddee5a";
    CreateRequest::new(instance_name(uid, hash), 3128, Tags::gc_contract(CLUSTER, uid, hash))
}

/// Requests the destination policy denies, each with the class `X-Egress-Policy` names: `apiserver` is a loopback
/// port something listens on, `origin` the allowed origin's, `proxy` the proxy's own address.
fn denied_requests(
    apiserver: u16,
    origin: &LocalOrigin,
    proxy: SocketAddr,
) -> Vec<(&'static str, &'static str, String)> {
    vec![
        ("loopback", "GET", format!("http://127.0.0.1:{apiserver}/version")),
        ("loopback", "CONNECT", format!("127.0.0.1:{apiserver}")),
        // A name is checked by the address it resolves to.
        ("loopback", "GET", format!("http://localhost:{apiserver}/version")),
        // The origin's address on another port is not the allowed rule.
        ("loopback", "GET", format!("http://{}:{apiserver}/", origin.address().ip())),
        ("link-local", "GET", "http://169.254.169.254/computeMetadata/v1/".to_owned()),
        ("private", "GET", "http://10.99.0.1/".to_owned()),
        ("private", "CONNECT", "192.168.1.1:443".to_owned()),
        ("private", "GET", "http://172.16.0.1/".to_owned()),
        ("shared", "GET", "http://100.64.0.1/".to_owned()),
        ("unique-local", "GET", "http://[fd00:ec2::254]/latest/meta-data/".to_owned()),
        ("link-local", "GET", "http://[fe80::1]/".to_owned()),
        ("port", "CONNECT", "192.0.2.1:22".to_owned()),
        ("port", "GET", "http://192.0.2.1:8080/".to_owned()),
        // IPv6 forms that carry a private IPv4 address (loopback, the metadata server) are denied whole.
        ("ipv4-embedded", "GET", "http://[::127.0.0.1]/".to_owned()),
        ("ipv4-embedded", "GET", "http://[64:ff9b::a9fe:a9fe]/".to_owned()),
        ("ipv4-embedded", "CONNECT", "[64:ff9b:1::a9fe:a9fe]:443".to_owned()),
        ("ipv4-embedded", "GET", "http://[2002:a9fe:a9fe::1]/".to_owned()),
        ("ipv4-embedded", "GET", "http://[::ffff:0:a9fe:a9fe]/".to_owned()),
        ("ipv4-embedded", "GET", "http://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/".to_owned()),
        // An IPv4-mapped address is checked as the IPv4 address it is.
        ("link-local", "GET", "http://[::ffff:169.254.169.254]/".to_owned()),
        // Squid's cache manager answers from Squid itself, whatever address the URL names: refused to everyone.
        ("manager", "GET", "cache_object://198.51.100.7:443/active_requests".to_owned()),
        ("manager", "GET", "cache_object://198.51.100.7:443/ipcache".to_owned()),
        ("manager", "GET", "cache_object://198.51.100.7:443/info".to_owned()),
        ("manager", "GET", "cache_object://198.51.100.7:443/client_list".to_owned()),
        ("manager", "GET", "cache_object://198.51.100.7:443/fqdncache".to_owned()),
        ("manager", "GET", "cache_object://198.51.100.7:443/filedescriptors".to_owned()),
        ("manager", "GET", format!("http://{proxy}/squid-internal-mgr/active_requests")),
        ("manager", "GET", "http://198.51.100.7:443/squid-internal-mgr/info".to_owned()),
        // Schemes other than http and https make Squid a client of its own.
        ("protocol", "GET", "ftp://198.51.100.7:80/".to_owned()),
        ("protocol", "GET", "urn:isbn:0451450523".to_owned()),
        ("protocol", "GET", "whois://198.51.100.7:80/".to_owned()),
    ]
}

/// Waits until the instance runs; a pod the node agent reports Failed ends the wait with the agent's message.
async fn wait_running(ns: &TestNamespace, provider: &KubernetesProvider, provider_id: &str) -> Instance {
    let name = provider_id.split('/').nth(1).expect("namespace/name");
    eventually("the pod to run", Duration::from_secs(60), || async {
        let pod = ns.api::<Pod>().get(name).await.ok()?;
        let status = pod.status.unwrap_or_default();
        if status.phase.as_deref() == Some("Failed") {
            panic!("the pod failed: {}", status.message.unwrap_or_default());
        }
        let instance = provider.get(provider_id).await.ok()?;
        (instance.state == InstanceState::Running).then_some(instance)
    })
    .await
}

async fn pods(ns: &TestNamespace) -> Vec<Pod> {
    ns.api::<Pod>().list(&ListParams::default()).await.expect("list pods").items
}

#[tokio::test]
async fn lifecycle_create_get_list_delete() {
    let ns = egress_testenv::namespace("k8s-lifecycle").await;
    let provider = provider(&ns);
    let request = request("11111111-aaaa-bbbb-cccc-000000000001");

    let created = provider.create(&request).await.expect("create");
    assert_eq!(created.name, request.name);
    assert_eq!(created.provider_id, format!("{}/{}", ns.name(), request.name));
    assert_eq!(created.state, InstanceState::Provisioning, "an unscheduled pod is Provisioning");
    assert_eq!(created.tags, request.tags);
    assert!(ns.api::<ConfigMap>().get_opt(&request.name).await.expect("get ConfigMap").is_some(), "squid.conf exists");

    let got = provider.get(&created.provider_id).await.expect("get");
    assert_eq!(got, created);

    let listed = provider.list_by_tag(&Tags::owned_by_cluster(CLUSTER)).await.expect("list");
    assert!(listed.iter().any(|instance| instance.provider_id == created.provider_id), "{listed:?}");
    let other_cluster = provider.list_by_tag(&Tags::owned_by_cluster("another-cluster")).await.expect("list");
    assert!(other_cluster.iter().all(|instance| instance.provider_id != created.provider_id));

    provider.delete(&created.provider_id).await.expect("delete");
    // The pod was never bound to a node, so the apiserver removes it at once.
    let error = provider.get(&created.provider_id).await.expect_err("the pod is gone");
    assert_eq!(error.class(), ErrorClass::NotFound);
    assert!(
        ns.api::<ConfigMap>().get_opt(&request.name).await.expect("get ConfigMap").is_none(),
        "the ConfigMap is gone"
    );
    assert!(pods(&ns).await.is_empty());
}

#[tokio::test]
async fn creating_twice_gives_one_pod() {
    let ns = egress_testenv::namespace("k8s-idempotent").await;
    let provider = provider(&ns);
    let request = request("11111111-aaaa-bbbb-cccc-000000000002");
    let first = provider.create(&request).await.expect("first create");
    let second = provider.create(&request).await.expect("second create adopts the pod");
    assert_eq!(first.provider_id, second.provider_id);
    assert_eq!(pods(&ns).await.len(), 1);
}

#[tokio::test]
async fn a_missing_config_map_is_recreated_by_the_next_create() {
    // A crash between creating the pod and its ConfigMap leaves a pod without configuration; the retry heals it.
    let ns = egress_testenv::namespace("k8s-heal").await;
    let provider = provider(&ns);
    let request = request("11111111-aaaa-bbbb-cccc-000000000003");
    provider.create(&request).await.expect("create");
    ns.api::<ConfigMap>().delete(&request.name, &Default::default()).await.expect("delete the ConfigMap");
    provider.create(&request).await.expect("create again");
    assert!(ns.api::<ConfigMap>().get_opt(&request.name).await.expect("get").is_some());
}

#[tokio::test]
async fn pod_phases_map_to_instance_states() {
    let ns = egress_testenv::namespace("k8s-states").await;
    let provider = provider(&ns);
    let request = request("11111111-aaaa-bbbb-cccc-000000000004");
    let created = provider.create(&request).await.expect("create");
    // (phase, pod IP, Ready condition, expected state). Kubelet reports Running as soon as the container starts;
    // only the Ready condition says Squid accepts connections.
    let cases: [(&str, Option<&str>, bool, InstanceState); 7] = [
        ("Pending", None, false, InstanceState::Provisioning),
        ("Running", None, true, InstanceState::Provisioning),
        ("Running", Some("10.1.2.3"), false, InstanceState::Provisioning),
        ("Running", Some("10.1.2.3"), true, InstanceState::Running),
        ("Succeeded", Some("10.1.2.3"), false, InstanceState::Terminated),
        ("Failed", None, false, InstanceState::Terminated),
        ("Unknown", None, false, InstanceState::Terminated),
    ];
    for (phase, ip, ready, expected) in cases {
        let ready = if ready { "True" } else { "False" };
        let status = json!({ "status": {
            "phase": phase, "podIP": ip, "podIPs": ip.map(|ip| vec![json!({ "ip": ip })]),
            "conditions": [{ "type": "Ready", "status": ready }],
        }});
        ns.api::<Pod>()
            .patch_status(&request.name, &PatchParams::default(), &Patch::Merge(status))
            .await
            .expect("patch pod status");
        let instance: Instance = provider.get(&created.provider_id).await.expect("get");
        assert_eq!(instance.state, expected, "phase {phase} with IP {ip:?}, Ready {ready}");
        let expected_ip =
            if expected == InstanceState::Running { ip.map(|ip| ip.parse().expect("ip")) } else { instance.ip };
        assert_eq!(instance.ip, expected_ip);
    }
}

#[tokio::test]
async fn list_by_tag_spans_namespaces() {
    let first = egress_testenv::namespace("k8s-list-a").await;
    let second = egress_testenv::namespace("k8s-list-b").await;
    let provider = provider(&first);
    let uid = "11111111-aaaa-bbbb-cccc-000000000005";
    let in_first = provider.create(&request(uid)).await.expect("create in the default namespace");
    let mut elsewhere = request("11111111-aaaa-bbbb-cccc-000000000006");
    elsewhere.zone = Some(second.name().to_owned());
    let in_second = provider.create(&elsewhere).await.expect("create in placement.zone's namespace");
    assert!(in_second.provider_id.starts_with(&format!("{}/", second.name())));

    let listed = provider.list_by_tag(&Tags::owned_by_cluster(CLUSTER)).await.expect("list");
    let ids: Vec<&str> = listed.iter().map(|instance| instance.provider_id.as_str()).collect();
    assert!(ids.contains(&in_first.provider_id.as_str()) && ids.contains(&in_second.provider_id.as_str()), "{ids:?}");

    let one = provider.list_by_tag(&Tags::owned_by_cluster(CLUSTER).with(Tags::PROXY_UID, uid)).await.expect("list");
    assert_eq!(one.iter().map(|instance| &instance.provider_id).collect::<Vec<_>>(), [&in_first.provider_id]);
}

#[tokio::test]
async fn a_resource_quota_gives_quota_exceeded() {
    let ns = egress_testenv::namespace("k8s-quota").await;
    let quota = ResourceQuota {
        metadata: ObjectMeta { name: Some("no-pods".into()), ..ObjectMeta::default() },
        spec: Some(ResourceQuotaSpec {
            hard: Some(BTreeMap::from([("pods".to_owned(), Quantity("0".into()))])),
            ..ResourceQuotaSpec::default()
        }),
        status: None,
    };
    let quotas: Api<ResourceQuota> = ns.api();
    quotas.create(&PostParams::default(), &quota).await.expect("create quota");
    // No controller-manager runs here to compute the quota's usage, so the test reports it as that controller would.
    let usage = json!({ "status": { "hard": { "pods": "0" }, "used": { "pods": "0" } } });
    quotas.patch_status("no-pods", &PatchParams::default(), &Patch::Merge(usage)).await.expect("quota status");

    let error = provider(&ns).create(&request("11111111-aaaa-bbbb-cccc-000000000007")).await.expect_err("over quota");
    assert_eq!(error.class(), ErrorClass::QuotaExceeded, "{}", error.chain());
    assert!(error.chain().contains("exceeded quota"), "the cause is kept: {}", error.chain());
}

#[tokio::test]
async fn invalid_requests_are_permanent() {
    let ns = egress_testenv::namespace("k8s-permanent").await;
    let provider = provider(&ns);
    let mut unknown_profile = request("11111111-aaaa-bbbb-cccc-000000000008");
    unknown_profile.machine_type = Some("huge".into());
    let error = provider.create(&unknown_profile).await.expect_err("unknown machine type");
    assert_eq!(error.class(), ErrorClass::Permanent);
    assert!(
        error.to_string().contains("unknown machine type \"huge\" for the kubernetes provider (configured: small)"),
        "{error}"
    );

    let mut bad_namespace = request("11111111-aaaa-bbbb-cccc-000000000009");
    bad_namespace.zone = Some("Not_A_Namespace".into());
    assert_eq!(provider.create(&bad_namespace).await.expect_err("invalid namespace").class(), ErrorClass::Permanent);

    assert_eq!(provider.get("no-slash").await.expect_err("bad id").class(), ErrorClass::Permanent);
}

#[tokio::test]
async fn deleting_a_missing_instance_succeeds() {
    let ns = egress_testenv::namespace("k8s-delete-missing").await;
    provider(&ns).delete(&format!("{}/px-doesnotexist0000", ns.name())).await.expect("idempotent delete");
    provider(&ns).delete("no-such-namespace/px-doesnotexist0000").await.expect("idempotent delete");
}

#[tokio::test]
async fn checker_reports_the_cluster_ready() {
    let ns = egress_testenv::namespace("k8s-check").await;
    let verdicts = provider(&ns).check().await;
    assert_eq!(verdicts.len(), 1);
    assert!(verdicts[0].ready, "{verdicts:?}");
    assert_eq!(verdicts[0].target, "cluster");
}

#[tokio::test]
async fn squid_in_a_pod_serves_with_and_without_credentials() {
    let ns = egress_testenv::namespace("k8s-squid").await;
    let agent = NodeAgent::start(ns.client(), &[ns.name()]).await.expect("the node agent starts");
    let origin = LocalOrigin::start().await.expect("origin");
    let provider = provider_reaching(&ns, &origin);
    let mut request = request("11111111-aaaa-bbbb-cccc-00000000000a");
    request.machine_type = Some("small".into());
    request.credentials =
        Some(ProxyCredentials { username: "crawler".into(), password: Sensitive::new("s3cret pass".into()) });
    let created = provider.create(&request).await.expect("create");
    let secret = ns.api::<Secret>().get(&request.name).await.expect("the auth Secret exists");
    let stored = secret
        .data
        .expect("data")
        .values()
        .map(|value| String::from_utf8_lossy(&value.0).into_owned())
        .collect::<String>();
    assert!(!stored.contains("s3cret"), "only a hash of the password is stored");

    let running = wait_running(&ns, &provider, &created.provider_id).await;
    let ip = running.ip.expect("a running instance has an address");
    assert_eq!(Some(ip), agent.pod_ip(ns.name(), &request.name).map(Into::into));
    let proxy = std::net::SocketAddr::new(ip, 3128);

    assert_eq!(get_through_proxy(proxy, &origin.url(), None).await.expect("request"), 407);
    assert_eq!(get_through_proxy(proxy, &origin.url(), Some(("crawler", "wrong"))).await.expect("request"), 407);
    assert_eq!(get_through_proxy(proxy, &origin.url(), Some(("crawler", "s3cret pass"))).await.expect("request"), 200);
    assert_eq!(origin.requests(), 1, "only the authorised request reached the origin");

    let squid_pid = agent.squid_pid(ns.name(), &request.name).expect("a Squid process");
    provider.delete(&created.provider_id).await.expect("delete");
    eventually("the pod to be gone", Duration::from_secs(30), || async {
        provider.get(&created.provider_id).await.err().filter(|error| error.is_not_found())
    })
    .await;
    eventually("Squid to stop", Duration::from_secs(30), || async {
        (!std::path::Path::new(&format!("/proc/{squid_pid}")).exists()).then_some(())
    })
    .await;
    assert!(get_through_proxy(proxy, &origin.url(), None).await.is_err(), "nothing listens any more");
}

#[tokio::test]
async fn squid_without_credentials_is_open_to_local_clients() {
    let ns = egress_testenv::namespace("k8s-open").await;
    let _agent = NodeAgent::start(ns.client(), &[ns.name()]).await.expect("the node agent starts");
    let origin = LocalOrigin::start().await.expect("origin");
    let provider = provider_reaching(&ns, &origin);
    let created = provider.create(&request("11111111-aaaa-bbbb-cccc-00000000000b")).await.expect("create");
    let running = wait_running(&ns, &provider, &created.provider_id).await;
    let proxy = std::net::SocketAddr::new(running.ip.expect("address"), 3128);
    assert_eq!(get_through_proxy(proxy, &origin.url(), None).await.expect("request"), 200);
}

/// The destination policy, through a real Squid this provider rendered: each internal class answers 403 naming
/// itself in `X-Egress-Policy` (and in the access log), before Squid connects anywhere; the one allowed origin
/// answers 200.
#[tokio::test]
async fn the_rendered_squid_denies_internal_destinations_and_reaches_the_allowed_origin() {
    let ns = egress_testenv::namespace("k8s-policy").await;
    let agent = NodeAgent::start(ns.client(), &[ns.name()]).await.expect("the node agent starts");
    let origin = LocalOrigin::start().await.expect("origin");
    let provider = provider_reaching(&ns, &origin);
    let created = provider.create(&request("11111111-aaaa-bbbb-cccc-00000000000c")).await.expect("create");
    let running = wait_running(&ns, &provider, &created.provider_id).await;
    let proxy = std::net::SocketAddr::new(running.ip.expect("address"), 3128);
    let apiserver = ns.control_plane().server_address().map_or(6443, |address| address.port());

    let cases = denied_requests(apiserver, &origin, proxy);
    for (class, method, target) in &cases {
        let answer = egress_testenv::through_proxy(proxy, method, target, None).await.expect("an answer");
        assert_eq!(answer.status, 403, "{method} {target}: {}", answer.head);
        assert_eq!(answer.header("x-egress-policy"), Some(format!("denied {class}").as_str()), "{method} {target}");
        assert!(answer.body.contains("Access control configuration prevents"), "{method} {target}: {}", answer.body);
    }
    assert_eq!(origin.requests(), 0, "no denied request reached anything");
    // The health engine's probe names the policy, so a Proxy probing a denied URL says why it is not Ready.
    let tls = egress_health::tls_connector(b"").expect("TLS");
    for (url, class) in [
        (format!("http://127.0.0.1:{apiserver}/version"), "loopback"),
        ("https://169.254.169.254/".to_owned(), "link-local"),
    ] {
        let url = egress_health::ProbeUrl::parse(&url).expect("a probe URL");
        let failure = egress_health::probe(&proxy.ip().to_string(), 3128, None, &url, Duration::from_secs(5), &tls)
            .await
            .expect_err("a denied probe fails");
        assert_eq!(failure, egress_health::FailureReason::DestinationDenied(class.into()), "{}", url.as_str());
        assert!(failure.to_string().contains("destination policy refuses the probe URL"), "{failure}");
    }
    let allowed = egress_testenv::through_proxy(proxy, "GET", &origin.url(), None).await.expect("an answer");
    assert_eq!((allowed.status, allowed.header("x-egress-policy")), (200, None), "{}", allowed.head);

    // Each denial is one access-log line naming its class.
    let pod = created.provider_id.split('/').nth(1).expect("namespace/name").to_owned();
    let denials = cases.len();
    let log = eventually("the access log to show every denial", Duration::from_secs(10), || {
        let log = agent.squid_access_log(ns.name(), &pod);
        async move { (log.matches("TCP_DENIED/403").count() >= denials).then_some(log) }
    })
    .await;
    for class in
        ["loopback", "link-local", "private", "shared", "unique-local", "port", "ipv4-embedded", "manager", "protocol"]
    {
        assert!(
            log.lines().any(|line| line.contains("TCP_DENIED/403") && line.ends_with(&format!(" {class}"))),
            "{class}:\n{log}"
        );
    }
}

/// The proxy pod as this provider writes it (its command, its ConfigMap and Secret at their mount paths, read back
/// from the apiserver), run from the Squid image `cargo xtask image` builds (Debian trixie's Squid 6, the major
/// version of the `ubuntu/squid` image the providers file names by default) under crun, as a container runtime
/// runs a pod that asks for nothing: root with the default capabilities, so Squid drops to its `proxy` user. Every
/// other Squid test runs the host's Squid 5; this one shows the rendered configuration means the same to Squid 6:
/// credentials required, every internal class denied and named, the allowed origin reached.
#[tokio::test]
async fn the_rendered_pod_runs_in_the_squid_6_image() {
    use egress_testenv::image::{Container, ContainerOptions, DEFAULT_CAPABILITIES, squid_layout};

    let ns = egress_testenv::namespace("k8s-squid-image").await;
    let origin = LocalOrigin::start().await.expect("origin");
    let provider = provider_reaching(&ns, &origin);
    // The container shares this process's network (there is no pod network here), so it gets a port of its own.
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("a port").local_addr().expect("an address").port();
    let mut request = request("11111111-aaaa-bbbb-cccc-00000000000f");
    request.port = port;
    request.credentials =
        Some(ProxyCredentials { username: "crawler".into(), password: Sensitive::new("s3cret pass".into()) });
    provider.create(&request).await.expect("create");

    // What the pod mounts, from the objects the provider created.
    let pod = ns.api::<Pod>().get(&request.name).await.expect("the pod");
    let spec = pod.spec.expect("a pod spec");
    let container = &spec.containers[0];
    let mut files = Vec::new();
    for mount in container.volume_mounts.as_deref().unwrap_or_default() {
        let volume = spec.volumes.iter().flatten().find(|volume| volume.name == mount.name).expect("a volume");
        if let Some(source) = &volume.config_map {
            let map = ns.api::<ConfigMap>().get(&source.name).await.expect("the ConfigMap");
            for (key, value) in map.data.unwrap_or_default() {
                files.push((format!("{}/{key}", mount.mount_path), value));
            }
        }
        if let Some(source) = &volume.secret {
            let name = source.secret_name.as_deref().expect("a Secret name");
            let secret = ns.api::<Secret>().get(name).await.expect("the auth Secret");
            for (key, value) in secret.data.unwrap_or_default() {
                files.push((format!("{}/{key}", mount.mount_path), String::from_utf8(value.0).expect("text")));
            }
        }
    }
    assert_eq!(files.len(), 2, "squid.conf and the password file: {files:?}");
    // The files a kubelet gives every container.
    files.push(("/etc/hosts".into(), "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n".into()));
    // No name server: every name the test sends resolves from /etc/hosts, and no query may leave loopback.
    files.push(("/etc/resolv.conf".into(), "nameserver 127.0.0.1\n".into()));

    let mut squid = Container::run(
        &squid_layout(),
        &ContainerOptions {
            command: container.command.clone(),
            args: container.args.clone().unwrap_or_default(),
            files,
            capabilities: DEFAULT_CAPABILITIES.iter().map(|capability| (*capability).to_owned()).collect(),
            ..ContainerOptions::default()
        },
    )
    .expect("the container starts");
    let proxy = SocketAddr::from(([127, 0, 0, 1], port));
    eventually("Squid 6 to listen", Duration::from_secs(30), || async {
        assert!(squid.alive(), "Squid stopped:\n{}", squid.log());
        tokio::net::TcpStream::connect(proxy).await.ok()
    })
    .await;
    let log = squid.log();
    let version = log.lines().find(|line| line.contains("Starting Squid Cache version")).unwrap_or_default();
    assert!(version.contains("version 6."), "not Squid 6:\n{log}");
    println!("squid image: {}", version.trim());

    let credentials = Some(("crawler", "s3cret pass"));
    assert_eq!(get_through_proxy(proxy, &origin.url(), None).await.expect("request"), 407);
    assert_eq!(get_through_proxy(proxy, &origin.url(), Some(("crawler", "wrong"))).await.expect("request"), 407);
    let apiserver = ns.control_plane().server_address().map_or(6443, |address| address.port());
    let cases = denied_requests(apiserver, &origin, proxy);
    for (class, method, target) in &cases {
        let answer = egress_testenv::through_proxy(proxy, method, target, credentials).await.expect("an answer");
        assert_eq!(answer.status, 403, "{method} {target}: {}", answer.head);
        assert_eq!(answer.header("x-egress-policy"), Some(format!("denied {class}").as_str()), "{method} {target}");
    }
    assert_eq!(origin.requests(), 0, "no refused request reached anything");
    let allowed = egress_testenv::through_proxy(proxy, "GET", &origin.url(), credentials).await.expect("an answer");
    assert_eq!((allowed.status, allowed.header("x-egress-policy")), (200, None), "{}", allowed.head);
    assert_eq!(origin.requests(), 1);
    println!("squid image: 2 unauthenticated requests refused (407), {} denied (403), the origin reached", cases.len());

    // Each denial is an access-log line (on the container's output) naming its class.
    let denials = cases.len();
    let log = eventually("the access log to show every denial", Duration::from_secs(10), || {
        let log = squid.log();
        async move { (log.matches("TCP_DENIED/403").count() >= denials).then_some(log) }
    })
    .await;
    assert!(log.lines().any(|line| line.contains("TCP_DENIED/403") && line.ends_with(" manager")), "{log}");
    squid.stop();
    assert!(!squid.alive());
}
