//! The health engine wired into the reconciler: a Managed Proxy on the kubernetes provider, run by the node agent as
//! a real Squid, becomes Ready through real probes, costs no status write while it stays healthy, and turns
//! Unhealthy when its Squid dies.

use std::sync::Arc;
use std::time::Duration;

use egress_api::{HealthCheck, Proxy, ProxyPhase, ProxySpec};
use egress_health::{EngineConfig, HealthEngine, HealthMetrics, tls_connector};
use egress_provider::Provider;
use egress_provider::config::ProvidersConfig;
use egress_provider_kubernetes::{KubernetesConfig, KubernetesProvider};
use egress_reconcile::health_feed::{HealthFeedConfig, run_health_feed};
use egress_reconcile::{
    Context, ControllerConfig, CredentialStore, ProxyFeed, ProxyVerdicts, ReconcileMetrics, StaticProviders,
};
use egress_testenv::{LocalOrigin, NodeAgent, eventually};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::wait::await_condition;

const WAIT: Duration = Duration::from_secs(90);

fn phase(proxy: &Proxy) -> Option<ProxyPhase> {
    proxy.status.as_ref().and_then(|status| status.phase)
}

/// The kubernetes provider `pods` in the test's namespace, its proxies allowed to reach `origin`.
fn pods_provider(ns: &egress_testenv::TestNamespace, origin: &LocalOrigin) -> Arc<dyn Provider> {
    let text = format!(
        "providers:\n  - name: pods\n    type: kubernetes\n    destinations: {}\n    kubernetes: {{ namespace: {} }}\n",
        origin.destinations_yaml(),
        ns.name()
    );
    let config = ProvidersConfig::parse_as::<KubernetesConfig>(&text, "test").expect("config");
    let settings = config.providers[0].settings::<KubernetesConfig>().expect("kubernetes").clone();
    Arc::new(KubernetesProvider::new(ns.client(), settings).with_destinations(config.providers[0].destinations.clone()))
}

#[tokio::test]
async fn real_probes_drive_ready_and_unhealthy_with_one_write_per_transition() {
    let ns = egress_testenv::namespace("rc-health").await;
    let agent = NodeAgent::start(ns.client(), &[ns.name()]).await.expect("node agent");
    let origin = LocalOrigin::start().await.expect("origin");

    let provider = pods_provider(&ns, &origin);
    // Composed as the operator does: one Proxy store for the controller and the health feed.
    let (proxies, watch) = ProxyFeed::start(ns.client(), Some(ns.name()));
    let (credentials, _secret_watch) = CredentialStore::start(ns.client(), Some(ns.name()), &proxies);
    let metrics = HealthMetrics::default();
    let start = || {
        Leader::start(
            &ns.client(),
            ns.name(),
            provider.clone(),
            proxies.clone(),
            credentials.clone(),
            origin.url(),
            metrics.clone(),
        )
    };
    let mut leader = start();

    let spec = ProxySpec::managed("pods", None).with_health_check(HealthCheck::every(5, 2, 1, 2));
    let proxies: Api<Proxy> = ns.api();
    proxies.create(&PostParams::default(), &Proxy::new("web", spec)).await.expect("create");
    let wait_phase = |wanted: ProxyPhase| {
        let proxies = proxies.clone();
        async move {
            let condition = move |object: Option<&Proxy>| object.and_then(phase) == Some(wanted);
            tokio::time::timeout(WAIT, await_condition(proxies, "web", condition))
                .await
                .unwrap_or_else(|_| panic!("timed out waiting for phase {wanted:?}"))
                .expect("watch")
                .expect("the Proxy exists")
        }
    };
    let ready = wait_phase(ProxyPhase::Ready).await;
    assert_eq!(ready.status.as_ref().and_then(|s| s.health.as_ref()).map(|h| h.healthy), Some(true));
    assert!(origin.requests() >= 1, "the verdict came from a real request through Squid");

    // Healthy for ten probe intervals: not a single write to the object.
    let version = ready.resource_version();
    let probes = metrics.probes_total();
    eventually("six more probes", WAIT, || async { (metrics.probes_total() >= probes + 6).then_some(()) }).await;
    let later = proxies.get("web").await.expect("get");
    assert_eq!(later.resource_version(), version, "a steady healthy proxy costs no status write");
    assert_eq!(phase(&later), Some(ProxyPhase::Ready));

    // A restart (fresh verdict store, engine, feed and controller, as a new leader has) keeps it Ready: the verdict
    // is seeded from the status, and the first probes confirm it without a write.
    leader.stop();
    let probes = metrics.probes_total();
    leader = start();
    eventually("probes after the restart", WAIT, || async { (metrics.probes_total() >= probes + 2).then_some(()) })
        .await;
    let restarted = proxies.get("web").await.expect("get");
    assert_eq!(restarted.resource_version(), version, "a restart does not take a Ready proxy out of Ready");

    assert!(
        agent
            .kill_squid(ns.name(), &later.status.as_ref().and_then(|s| s.instance.as_ref()).expect("instance").name)
            .await
    );
    let unhealthy = wait_phase(ProxyPhase::Unhealthy).await;
    let health = unhealthy.status.as_ref().and_then(|s| s.health.clone()).expect("health");
    assert!(!health.healthy);
    // The node agent freezes Squid (a killed one would be restarted by the pod's restart policy): the probe through
    // it times out.
    assert!(health.last_error.as_deref().is_some_and(|error| error.contains("timed out")), "{health:?}");

    leader.stop();
    watch.abort();
}

/// Self-healing: a Managed Proxy whose Squid stops answering for good is replaced, make-before-break: the new
/// instance is started `replaceAfterSeconds` after the Proxy turned Unhealthy, and the dead one is deleted once the
/// new one is Ready.
#[tokio::test]
async fn a_dead_instance_is_replaced_after_replace_after_seconds() {
    let ns = egress_testenv::namespace("rc-heal").await;
    let agent = NodeAgent::start(ns.client(), &[ns.name()]).await.expect("node agent");
    let origin = LocalOrigin::start().await.expect("origin");
    let provider = pods_provider(&ns, &origin);
    let (feed, watch) = ProxyFeed::start(ns.client(), Some(ns.name()));
    let (credentials, _secret_watch) = CredentialStore::start(ns.client(), Some(ns.name()), &feed);
    let leader =
        Leader::start(&ns.client(), ns.name(), provider, feed, credentials, origin.url(), HealthMetrics::default());
    let replace_after = Duration::from_secs(5);
    let spec = ProxySpec {
        health_check: HealthCheck { replace_after_seconds: 5, ..HealthCheck::every(5, 2, 1, 1) },
        ..ProxySpec::managed("pods", None)
    };
    let proxies: Api<Proxy> = ns.api();
    let created = std::time::Instant::now();
    proxies.create(&PostParams::default(), &Proxy::new("healer", spec)).await.expect("create");
    let instance_of = |proxy: &Proxy| proxy.status.as_ref().and_then(|s| s.instance.as_ref()).map(|i| i.name.clone());
    let ready = eventually("the Proxy to turn Ready", WAIT, || async {
        let proxy = proxies.get("healer").await.ok()?;
        (phase(&proxy) == Some(ProxyPhase::Ready)).then_some(proxy)
    })
    .await;
    let provisioning = created.elapsed();
    let dead = instance_of(&ready).expect("an instance");
    assert!(agent.kill_squid(ns.name(), &dead).await, "the node agent froze the Squid");
    eventually("the Proxy to turn Unhealthy", WAIT, || async {
        let proxy = proxies.get("healer").await.ok()?;
        (phase(&proxy) == Some(ProxyPhase::Unhealthy)).then_some(())
    })
    .await;
    let unhealthy = std::time::Instant::now();
    let unhealthy_at = std::time::SystemTime::now();
    let healed = eventually("Ready on a new instance", WAIT, || async {
        let proxy = proxies.get("healer").await.ok()?;
        (phase(&proxy) == Some(ProxyPhase::Ready) && instance_of(&proxy).is_some_and(|name| name != dead))
            .then_some(proxy)
    })
    .await;
    let took = unhealthy.elapsed();
    let replacement = instance_of(&healed).expect("the new instance");
    let pods: Api<k8s_openapi::api::core::v1::Pod> = ns.api();
    let created_at = pods
        .get(&replacement)
        .await
        .expect("the new instance's pod")
        .metadata
        .creation_timestamp
        .map(|time| std::time::SystemTime::from(time.0))
        .expect("a creation time");
    // The replacement is started replaceAfterSeconds after the Proxy turned Unhealthy. Its own provisioning time is
    // the machine's (a pod started while the other test's pods start takes longer than the first did), so the bound
    // is on when it was started, not on when it turned Ready. The creation time has whole seconds, and Unhealthy was
    // seen up to one poll late: a second either way.
    let started = created_at.duration_since(unhealthy_at).unwrap_or_default();
    println!(
        "self-healing: {replacement} created {started:.1?} and Ready {took:.1?} after turning Unhealthy \
         (replaceAfterSeconds {}s; first provisioning {provisioning:.1?})",
        replace_after.as_secs()
    );
    assert!(started <= replace_after + Duration::from_secs(2), "the replacement started {started:?} after Unhealthy");
    assert!(
        unhealthy_at + replace_after <= created_at + Duration::from_secs(2),
        "the replacement waited replaceAfterSeconds: started {started:?} after Unhealthy"
    );
    assert_eq!(healed.status.as_ref().and_then(|s| s.replacements), Some(1));
    eventually("the dead instance to be deleted", WAIT, || async {
        let gone = pods.get_opt(&dead).await.ok()?.is_none();
        let proxy = proxies.get("healer").await.ok()?;
        (gone && proxy.status.as_ref().is_some_and(|s| s.previous_instance.is_none())).then_some(())
    })
    .await;
    let events: Api<k8s_openapi::api::core::v1::Event> = ns.api();
    let list =
        events.list(&kube::api::ListParams::default().fields("involvedObject.name=healer")).await.expect("events");
    assert!(
        list.items.iter().any(|event| event.reason.as_deref() == Some("SelfHealing")),
        "a SelfHealing Event: {:?}",
        list.items.iter().map(|event| event.reason.clone()).collect::<Vec<_>>()
    );
    leader.stop();
    watch.abort();
}

/// The leader-only parts, as one term of leadership runs them.
struct Leader {
    controller: tokio::task::JoinHandle<()>,
    feed: tokio::task::JoinHandle<()>,
}

impl Leader {
    fn start(
        client: &kube::Client,
        namespace: &str,
        provider: Arc<dyn Provider>,
        proxies: ProxyFeed,
        credentials: CredentialStore,
        probe_url: String,
        metrics: HealthMetrics,
    ) -> Self {
        let verdicts = ProxyVerdicts::new();
        let mut controller_config = ControllerConfig::new(namespace);
        controller_config.namespace = Some(namespace.to_owned());
        let context = Arc::new(Context::new(
            client.clone(),
            Arc::new(StaticProviders::new().with("pods", provider)),
            verdicts.clone(),
            credentials.clone(),
            controller_config,
            ReconcileMetrics::default(),
        ));
        let (triggers, trigger_stream) = egress_reconcile::trigger_channel();
        let controller =
            tokio::spawn(egress_reconcile::run(context, proxies.clone(), trigger_stream, futures::future::pending()));
        let (engine, transitions) =
            HealthEngine::start_with(EngineConfig::default(), tls_connector(b"").expect("TLS"), metrics, verdicts);
        let feed = tokio::spawn(run_health_feed(
            proxies,
            credentials,
            HealthFeedConfig { default_probe_url: probe_url },
            Arc::new(engine),
            transitions,
            triggers,
            futures::future::pending(),
        ));
        Self { controller, feed }
    }

    fn stop(&self) {
        self.controller.abort();
        self.feed.abort();
    }
}
