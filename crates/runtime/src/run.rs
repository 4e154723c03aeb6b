//! Composition: builds every part from the settings, serves metrics, health and discovery on every replica, runs the
//! leader-only parts (Proxy controller, pool controller, health engine, orphan collector, provider monitor) while
//! this replica leads, and shuts everything down in order on SIGTERM.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, bail};
use axum::Router;
use axum::response::IntoResponse;
use axum::routing::get;
use egress_discovery::{Auth, Discovery, DiscoveryMetrics, Gate, ServerMetrics, TokenFile};
use egress_health::{EngineConfig, HealthEngine, HealthMetrics};
use egress_lease::{InMemoryLeaseStore, LeaseConfig, LeaseState};
use egress_provider::ProviderMetrics;
use egress_provider::registry::ProviderSet;

pub use crate::providers::provider_types;
use egress_reconcile::gc::OrphanCollector;
use egress_reconcile::health_feed::{HealthFeedConfig, run_health_feed};
use egress_reconcile::ids::{PoolId, pool_ref};
use egress_reconcile::monitor::{MonitorMetrics, ProviderMonitor};
use egress_reconcile::pool::{PoolContext, PoolMetrics, PoolSignals, PoolTrigger, run_pools};
use egress_reconcile::{
    Context as ReconcileContext, ControllerConfig, CredentialStore, LeaseDrain, PoolFeed, ProxyFeed, ProxyVerdicts,
    ReconcileMetrics,
};
use kube::{Api, Client};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::discovery_feed::{DiscoverySignals, PoolWakes, run_discovery_feed};
use crate::flags::Settings;
use crate::serving::{metrics_router, shutdown_signal, until_true};

/// A new target's first probe starts within this window (jittered), not within a whole interval: a new Proxy, or
/// every Proxy after a restart or a change of leader, is looked at within seconds, spread out.
const FIRST_PROBE_WITHIN: Duration = Duration::from_secs(2);

/// Refuses discovery routes while this replica does not lead or is shutting down.
struct LeaderGate {
    leader: watch::Receiver<bool>,
    stop: watch::Receiver<bool>,
    /// Whether the lease state is shared: then every replica serves, leader or not.
    shared: bool,
}

impl Gate for LeaderGate {
    fn refusal(&self) -> Option<String> {
        if *self.stop.borrow() {
            Some("the operator is shutting down".into())
        } else if !self.shared && !*self.leader.borrow() {
            Some("this replica is not the leader; leases are served by the leader".into())
        } else {
            None
        }
    }
}

/// The lease state on the shared store: opened at once, connected on first use, so a store that is not up yet
/// makes leases `503 state-unavailable` until it is, instead of keeping the operator from starting.
async fn shared_state(
    options: &egress_lease_redis::RedisOptions,
    key: egress_lease::LeaseKey,
) -> Result<Arc<dyn LeaseState>> {
    let state = egress_lease_redis::RedisLeaseState::open(options, LeaseConfig::default(), key)?;
    let shown = egress_lease_redis::redact(&options.url);
    match state.ping().await {
        Ok(()) => info!(store = %shown, "keeping leases, sessions and cooldowns in the shared state store"),
        Err(error) => warn!(
            store = %shown,
            %error,
            "the shared state store does not answer yet; leases are refused (503 state-unavailable) until it does"
        ),
    }
    Ok(Arc::new(state))
}

/// The pools named on `wakes`, as pool controller triggers; a lagging receiver skips what it missed (each pool is
/// looked at on its own schedule anyway).
fn pool_triggers(
    wakes: tokio::sync::broadcast::Receiver<PoolId>,
) -> impl futures::Stream<Item = PoolTrigger> + Send + 'static {
    futures::stream::unfold(wakes, |mut wakes| async move {
        loop {
            match wakes.recv().await {
                Ok(pool) => return Some((pool_ref(&pool), wakes)),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            }
        }
    })
}

/// Runs the operator with `settings` until SIGTERM (or Ctrl-C), then shuts down in order.
pub async fn run(settings: Settings) -> Result<()> {
    let client = Client::try_default().await.context("connecting to the Kubernetes API (in-cluster or kubeconfig)")?;
    let mut registry = Registry::with_prefix("egress");
    let provider_metrics = ProviderMetrics::register(&mut registry);
    let reconcile_metrics = ReconcileMetrics::register(&mut registry);
    let health_metrics = HealthMetrics::register(&mut registry);
    let discovery_metrics = DiscoveryMetrics::register(&mut registry);
    let server_metrics = ServerMetrics::register(&mut registry);
    let monitor_metrics = MonitorMetrics::register(&mut registry);
    let pool_metrics = PoolMetrics::register(&mut registry);
    let leader_gauge = prometheus_client::metrics::gauge::Gauge::<i64>::default();
    registry.register(
        "leader",
        "1 while this replica leads (runs the controllers and grants leases), else 0; every replica reports it, so \
         a sum below 1 means no replica leads",
        leader_gauge.clone(),
    );
    let registry = Arc::new(registry);

    let providers =
        match ProviderSet::build(&settings.providers, &provider_types(), Some(provider_metrics.clone())).await {
            Ok(providers) => Arc::new(providers),
            Err(unsupported) => bail!("{}", unsupported.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n")),
        };
    reconcile_metrics.expect_providers(providers.names().chain(["external"]));
    provider_metrics.expect_providers(providers.names());

    // `stop`: discovery refuses and the leader's label goes; `servers_stop`: the servers stop, last of all.
    let (stop_sender, stop) = watch::channel(false);
    let (servers_stop_sender, servers_stop) = watch::channel(false);
    let (leader_sender, leader) = watch::channel(!settings.leader_elect);
    tokio::spawn(follow_leadership(leader.clone(), leader_gauge));

    // The one Proxy store, the one credential store and the one verdict store, kept on every replica: discovery
    // reads them, and while this replica leads the controller, the health engine and its feed do too.
    let verdicts = ProxyVerdicts::new();
    let (feed, _watch) = ProxyFeed::start(client.clone(), settings.watch_namespace.as_deref());
    let (pools, _pool_watch) = PoolFeed::start(client.clone(), settings.watch_namespace.as_deref());
    // Leases refused for a pool's lack of members or capacity wake the pool controller of the current term.
    let (pool_wakes, _) = tokio::sync::broadcast::channel::<PoolId>(1024);
    let (credentials, _secret_watch) =
        CredentialStore::start(client.clone(), settings.watch_namespace.as_deref(), &feed);

    let auth = match &settings.discovery_tokens {
        Some(path) => {
            let tokens = TokenFile::load(path)?;
            discovery_metrics.expect_tenants(tokens.tenants().keys().map(String::as_str));
            Auth::Tokens(tokens)
        }
        None => {
            warn!(
                "discovery authentication is off (--discovery-auth=none): anyone who reaches the port can lease proxies"
            );
            Auth::Disabled
        }
    };
    // Every replica signs lease IDs with the same key, so a lease outlives the leader that granted it; bans are
    // kept in the Proxies' status, so cooldowns do too.
    let lease_key =
        crate::durable::lease_key(&client, &settings.leader_election_namespace, &settings.lease_key_secret).await?;
    let (lease_store, ended): (Arc<dyn LeaseState>, _) = match &settings.state_store {
        None => {
            let store = Arc::new(InMemoryLeaseStore::with_key(LeaseConfig::default(), lease_key));
            // Released and revoked leases are kept too, so the next leader refuses their IDs instead of adopting
            // them.
            let ended = Arc::new(crate::durable::EndedLeases::new(
                client.clone(),
                &settings.leader_election_namespace,
                store.clone(),
            ));
            if !settings.leader_elect {
                restore_ended(&ended).await;
            }
            tokio::spawn(ended.clone().run(leader.clone(), stop.clone()));
            (store, Some(ended))
        }
        Some(options) => (shared_state(options, lease_key).await?, None),
    };
    let shared = settings.state_store.is_some();
    let discovery = Discovery::new(lease_store, auth, discovery_metrics)
        .with_gate(Arc::new(LeaderGate { leader: leader.clone(), stop: stop.clone(), shared }))
        .with_journal(Arc::new(crate::durable::StatusCooldownJournal::new(client.clone())))
        .with_pool_waker(Arc::new(PoolWakes(pool_wakes.clone())));
    let discovery = Arc::new(if settings.geoip.is_some() { discovery.with_geoip() } else { discovery });
    let provider_leasing: crate::discovery_feed::ProviderLeasing = settings
        .providers
        .providers
        .iter()
        .map(|provider| (provider.name.clone(), crate::discovery_feed::LeasingDefaults::of(provider)))
        .collect();
    tokio::spawn(run_discovery_feed(
        feed.clone(),
        pools.clone(),
        verdicts.clone(),
        Arc::new(provider_leasing),
        credentials.clone(),
        discovery.clone(),
        pool_metrics.clone(),
    ));
    let pool_signals: Arc<dyn PoolSignals> = Arc::new(DiscoverySignals(discovery.clone()));
    tokio::spawn(egress_discovery::run_expiry(discovery.clone(), Duration::from_secs(1), until_true(stop.clone())));

    let drain: Arc<dyn LeaseDrain> = Arc::new(crate::discovery_feed::DiscoveryDrain(discovery.clone()));
    let servers =
        serve_all(&settings, registry, server_metrics, discovery.clone(), leader.clone(), servers_stop.clone()).await?;

    // The leader's Pod carries the label the discovery Service selects; a restarted process first removes the one
    // its previous incarnation may have left. A stopping one removes it once its successor's pod has it
    // (`unlabel`), so the Service always has an endpoint.
    let (unlabel_sender, unlabel) = watch::channel(false);
    let labeller = match crate::role_label::PodIdentity::from_env() {
        Some(pod) => Some(tokio::spawn(crate::role_label::run(
            client.clone(),
            pod,
            leader.clone(),
            stop.clone(),
            unlabel.clone(),
        ))),
        None => {
            info!("POD_NAME or POD_NAMESPACE is not set: not running in a pod, so no pod is labelled as the leader");
            None
        }
    };

    let election = if settings.leader_elect {
        let pod_name = std::env::var("POD_NAME").ok().filter(|name| !name.is_empty());
        if let Some(pod_name) = &pod_name {
            yield_after_crash(
                &client,
                &settings.leader_election_namespace,
                pod_name,
                settings.lease_duration,
                stop.clone(),
            )
            .await;
        }
        let identity = election_identity(pod_name);
        let config = crate::election::ElectionConfig {
            name: crate::election::LEASE_NAME.into(),
            namespace: settings.leader_election_namespace.clone(),
            identity: identity.clone(),
            lease_duration: settings.lease_duration,
        };
        // A candidate competes only once it can serve: its stores synced, so a takeover answers at once.
        let synced = discovery_ready(discovery.clone());
        let election = crate::election::Election::start(client.clone(), config, synced);
        let mut changes = election.leading();
        let forward = leader_sender.clone();
        let ended = ended.clone();
        tokio::spawn(async move {
            // Until the election ends (its sender is dropped): after a release, it says so.
            while changes.changed().await.is_ok() {
                let leading = *changes.borrow_and_update();
                info!(identity = %identity, leading, "leadership changed");
                if leading && let Some(ended) = &ended {
                    // The previous leader's ended leases first, so none of their IDs is adopted.
                    restore_ended(ended).await;
                }
                let _ = forward.send(leading);
            }
            let _ = forward.send(false);
        });
        Some(election)
    } else {
        None
    };

    let parts = Leading {
        client: client.clone(),
        feed,
        credentials,
        providers,
        verdicts,
        reconcile_metrics,
        health_metrics,
        monitor_metrics,
        drain,
        pools,
        pool_metrics,
        pool_signals,
        pool_wakes,
    };
    let (retire_sender, retire) = watch::channel(false);
    let handoff = (settings.handoff_timeout, settings.peer_selector.clone());
    let settings_discovery_port = settings.discovery_addr.port();
    let lease_namespace = settings.leader_election_namespace.clone();
    let leading_now = leader.clone();
    let leading_loop = lead_while_elected(parts, settings, leader, retire);
    let leading = tokio::spawn(leading_loop);

    // Until SIGTERM, unless the leader election dies first: then this replica could never lead again while still
    // looking healthy, so it stops everything and exits non-zero for the Deployment to restart it.
    let mut election = election;
    let failure = election_failure(&mut election, shutdown_signal()).await;
    if let Some(failure) = &failure {
        tracing::error!("{failure}; stopping so that the process is restarted");
        election = None;
    }
    // Make-before-break: a stopping leader keeps serving until another replica is Ready to take over. Whether one
    // will (for a follower: the leader) decides whether the requests that still reach this pod are handed on.
    let pod = crate::role_label::PodIdentity::from_env();
    let mut successor = election.is_some() && pod.is_some() && !*leading_now.borrow();
    if election.is_some()
        && *leading_now.borrow()
        && let Some(pod) = &pod
        && !handoff.0.is_zero()
    {
        info!("stopping while leading: serving until another replica is ready to take over");
        successor = crate::handoff::wait_for_successor(&client, pod, &handoff.1, handoff.0).await;
    }
    // The controllers and probes stop first (their reconciles finish); discovery keeps serving meanwhile.
    let _ = retire_sender.send(true);
    let _ = leading.await;
    // Now discovery stops answering here, and the leases ended so far go to the next leader before the Lease does.
    // With another replica to take over, the requests that still arrive wait for it and are handed on to it
    // (`egress_discovery::Discovery::hand_off`); without, they are refused (each refusal closes its connection, so
    // a client's retry goes through the Service).
    let _ = stop_sender.send(true);
    if successor {
        discovery.hand_off();
    } else {
        let _ = unlabel_sender.send(true);
    }
    if let Some(ended) = &ended {
        match tokio::time::timeout(ENDED_FLUSH_TIMEOUT, ended.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => warn!("{error:#}"),
            Err(_) => {
                warn!("writing the ended leases took over {ENDED_FLUSH_TIMEOUT:?}; the next leader may adopt some");
            }
        }
    }
    // Released (no holder), so a waiting replica takes it within milliseconds instead of at its expiry.
    let own_identity = election.as_ref().filter(|_| successor).map(|election| election.identity().to_owned());
    if let Some(election) = election
        && let Err(error) = election.release().await
    {
        warn!(%error, "the leader election task failed");
    }
    // Hand the requests that still reach this pod to the next leader; this pod's label goes once the next leader's
    // pod has its own, and requests are handed on while the Service still routes here.
    let mut forwarding = false;
    if let Some(own_identity) = &own_identity {
        let (port, selector) = (settings_discovery_port, &handoff.1);
        forwarding = crate::handoff::hand_to_successor(
            &client,
            &discovery,
            &lease_namespace,
            own_identity,
            pod.as_ref(),
            selector,
            port,
        )
        .await;
    }
    let _ = unlabel_sender.send(true);
    if let Some(labeller) = labeller
        && tokio::time::timeout(crate::role_label::REMOVE_TIMEOUT, labeller).await.is_err()
    {
        warn!("the leader label could not be removed in time; the next leader's start-up replaces the endpoint");
    }
    if forwarding {
        crate::handoff::linger_until_quiet(&discovery, std::time::Instant::now()).await;
    }
    let _ = servers_stop_sender.send(true);
    for server in servers {
        let _ = server.await;
    }
    match failure {
        Some(failure) => bail!("{failure}"),
        None => {
            info!("stopped");
            Ok(())
        }
    }
}

/// Resolves once discovery's stores have synced.
async fn discovery_ready(discovery: Arc<Discovery>) {
    while !discovery.ready() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How long a new leader waits to read the ended leases before serving without them, and a stopping one to write
/// them.
const ENDED_RESTORE_TIMEOUT: Duration = Duration::from_secs(5);
const ENDED_FLUSH_TIMEOUT: Duration = Duration::from_secs(3);

/// Reads the kept ended leases into the store, waiting at most [`ENDED_RESTORE_TIMEOUT`]; on failure the store's
/// writer keeps trying (and writes nothing until it has read them).
async fn restore_ended(ended: &crate::durable::EndedLeases) {
    match tokio::time::timeout(ENDED_RESTORE_TIMEOUT, ended.restore()).await {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => warn!("{error:#}; serving without them until they can be read"),
        Err(_) => warn!(
            "reading the ended leases took over {ENDED_RESTORE_TIMEOUT:?}; serving without them until they can be read"
        ),
    }
}

/// Waits for `shutdown` or for the leader-election task to die. Returns why the process must stop with an error
/// (this replica could never lead again), or `None` for a shutdown.
async fn election_failure(
    election: &mut Option<crate::election::Election>,
    shutdown: impl Future<Output = ()>,
) -> Option<String> {
    let died = async {
        match election.as_mut() {
            Some(election) => election.failed().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        () = shutdown => None,
        error = died => Some(format!("the leader election task died: {error}")),
    }
}

/// When this pod's previous process held the Lease (it crashed: the container was restarted), waits until that
/// Lease has expired and a little more before competing for it, so a healthy peer takes over rather than the process
/// that just crashed. With no peer this costs nothing: nobody could have taken the Lease sooner.
async fn yield_after_crash(
    client: &Client,
    namespace: &str,
    pod_name: &str,
    lease_duration: Duration,
    stop: watch::Receiver<bool>,
) {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(client.clone(), namespace);
    let Ok(Some(lease)) = leases.get_opt(crate::election::LEASE_NAME).await else { return };
    let Some(spec) = lease.spec else { return };
    if !spec.holder_identity.as_deref().is_some_and(|holder| holder.starts_with(&format!("{pod_name}_"))) {
        return;
    }
    let renewed = spec.renew_time.map(|time| SystemTime::from(time.0)).unwrap_or_else(SystemTime::now);
    let duration = spec.lease_duration_seconds.map_or(lease_duration, |s| Duration::from_secs(s.max(0) as u64));
    let expires_in = (renewed + duration).duration_since(SystemTime::now()).unwrap_or(Duration::ZERO);
    // The peer wakes at the expiry and takes the Lease within about a second.
    let wait = expires_in.min(duration) + Duration::from_secs(3);
    info!(
        holder = spec.holder_identity.as_deref().unwrap_or_default(),
        wait_seconds = wait.as_secs(),
        "this pod's previous process held the leader Lease and is gone; letting another replica take it first"
    );
    tokio::select! {
        () = tokio::time::sleep(wait) => {}
        () = until_true(stop) => {}
    }
}

/// The leader-election identity: the pod's name (or `egress-operator`) and a suffix of its own per process, as
/// client-go's leader election does. A container restarted in the same pod is a new candidate, not the holder of the
/// Lease its crashed predecessor held, so the other replica takes over instead of waiting on a dead leader's term.
fn election_identity(pod_name: Option<String>) -> String {
    let base = pod_name.filter(|name| !name.is_empty()).unwrap_or_else(|| "egress-operator".into());
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |since| since.subsec_nanos());
    format!("{base}_{:08x}", nanos ^ std::process::id().rotate_left(16))
}

/// Serves /metrics, /livez and /readyz, and the discovery API; each stops gracefully on `stop`.
async fn serve_all(
    settings: &Settings,
    registry: Arc<Registry>,
    server_metrics: ServerMetrics,
    discovery: Arc<Discovery>,
    leader: watch::Receiver<bool>,
    stop: watch::Receiver<bool>,
) -> Result<Vec<tokio::task::JoinHandle<()>>> {
    let metrics = metrics_router(registry);
    let ready_discovery = discovery.clone();
    let health = Router::new().route("/livez", get(|| async { "ok" })).route(
        "/readyz",
        get(move || {
            let discovery = ready_discovery.clone();
            let leading = *leader.borrow();
            async move {
                if !discovery.ready() {
                    (axum::http::StatusCode::SERVICE_UNAVAILABLE, "the Proxy store has not synced yet").into_response()
                } else if leading {
                    "ok: leader".into_response()
                } else {
                    // A follower is ready to take over; it says so, and its discovery port refuses leases.
                    "ok: follower (not the leader: discovery refuses leases here)".into_response()
                }
            }
        }),
    );
    let mut handles = Vec::new();
    for (name, address, router) in [
        ("metrics", settings.metrics_addr, metrics),
        ("health", settings.health_addr, health),
        ("discovery", settings.discovery_addr, egress_discovery::router(discovery)),
    ] {
        let listener =
            egress_discovery::bind(address).with_context(|| format!("binding the {name} address {address}"))?;
        info!(%address, "{name} listening");
        let stop = stop.clone();
        let (limits, metrics) = (settings.http_limits, server_metrics.clone());
        handles.push(tokio::spawn(async move {
            if let Err(error) =
                egress_discovery::serve_with(listener, router, limits, name, metrics, until_true(stop)).await
            {
                warn!(%error, "{name} server failed");
            }
        }));
    }
    Ok(handles)
}

/// What the leader-only parts are built from.
struct Leading {
    client: Client,
    feed: ProxyFeed,
    credentials: CredentialStore,
    providers: Arc<ProviderSet>,
    verdicts: ProxyVerdicts,
    reconcile_metrics: ReconcileMetrics,
    health_metrics: HealthMetrics,
    monitor_metrics: MonitorMetrics,
    /// Where the controller asks whether a replaced instance still has leases on it.
    drain: Arc<dyn LeaseDrain>,
    /// The ProxyPool store.
    pools: PoolFeed,
    pool_metrics: PoolMetrics,
    /// Where the pool controller reads lease counts and refused leases.
    pool_signals: Arc<dyn PoolSignals>,
    /// Pools whose leases were refused, from the discovery API.
    pool_wakes: tokio::sync::broadcast::Sender<PoolId>,
}

/// Runs the leader-only parts for each term of leadership, until `stop`.
async fn lead_while_elected(
    parts: Leading,
    settings: Settings,
    mut leader: watch::Receiver<bool>,
    stop: watch::Receiver<bool>,
) {
    let Leading {
        client,
        feed,
        credentials,
        providers,
        verdicts,
        reconcile_metrics,
        health_metrics,
        monitor_metrics,
        drain,
        pools,
        pool_metrics,
        pool_signals,
        pool_wakes,
    } = parts;
    loop {
        tokio::select! {
            result = leader.wait_for(|leading| *leading) => if result.is_err() { return },
            () = until_true(stop.clone()) => return,
        }
        info!("leading: starting the controllers, health engine, orphan collector and provider monitor");
        let (term_sender, term) = watch::channel(false);
        let mut tasks = Vec::new();

        let mut config = ControllerConfig::new(&settings.cluster_id);
        // More in flight only adds contention on a busy apiserver (measured: 64 made a ramp of 1,000 slower).
        config.concurrency = 16;
        config.namespace = settings.watch_namespace.clone();
        config.drain_timeout = settings.drain_timeout;
        let context = ReconcileContext::new(
            client.clone(),
            providers.clone(),
            verdicts.clone(),
            credentials.clone(),
            config,
            reconcile_metrics.clone(),
        )
        .with_drain(drain.clone());
        let context = Arc::new(match &settings.geoip {
            Some(geoip) => context.with_geoip(geoip.clone()),
            None => context,
        });
        let (triggers, trigger_stream) = egress_reconcile::trigger_channel();
        tasks.push(tokio::spawn(egress_reconcile::run(
            context,
            feed.clone(),
            trigger_stream,
            until_true(term.clone()),
        )));

        let pool_context =
            Arc::new(PoolContext::new(client.clone(), &feed, pool_signals.clone(), pool_metrics.clone()));
        let wakes = pool_triggers(pool_wakes.subscribe());
        tasks.push(tokio::spawn(run_pools(pool_context, pools.clone(), feed.clone(), wakes, until_true(term.clone()))));

        match egress_health::tls_connector(&settings.probe_ca_pem) {
            Ok(tls) => {
                let engine_config = EngineConfig {
                    concurrency: settings.probe_concurrency,
                    first_probe_within: Some(FIRST_PROBE_WITHIN),
                    ..EngineConfig::default()
                };
                // The store is empty (an engine forgets its verdicts when its term ends): the health feed seeds each
                // target from its status, through the engine.
                let (engine, transitions) =
                    HealthEngine::start_with(engine_config, tls, health_metrics.clone(), verdicts.clone());
                let feed_config = HealthFeedConfig { default_probe_url: settings.default_probe_url.clone() };
                tasks.push(tokio::spawn(run_health_feed(
                    feed.clone(),
                    credentials.clone(),
                    feed_config,
                    Arc::new(engine),
                    transitions,
                    triggers,
                    until_true(term.clone()),
                )));
            }
            Err(error) => warn!(%error, "health probes are off: the TLS client could not be set up"),
        }

        let collector = OrphanCollector::new(
            client.clone(),
            providers.clone(),
            &settings.cluster_id,
            settings.gc_grace,
            reconcile_metrics.clone(),
        )
        .with_store(feed.store());
        tasks.push(tokio::spawn(collector.run(settings.gc_interval, until_true(term.clone()))));

        let monitor = ProviderMonitor::new(
            client.clone(),
            providers.clone(),
            settings.provider_check_timeout,
            monitor_metrics.clone(),
        );
        match settings.provider_check_interval {
            Some(interval) => tasks.push(tokio::spawn(monitor.run(interval, until_true(term.clone())))),
            None => {
                if let Err(error) = monitor.prune(true).await {
                    warn!(%error, "deleting ProviderHealth objects (checks are off) failed");
                }
            }
        }

        // Lead until the term ends: leadership lost or shutdown.
        tokio::select! {
            _ = leader.wait_for(|leading| !*leading) => warn!("leadership lost: stopping the leader-only parts"),
            () = until_true(stop.clone()) => {}
        }
        let _ = term_sender.send(true);
        for task in tasks {
            let _ = task.await;
        }
        if *stop.borrow() {
            return;
        }
    }
}

/// Keeps `gauge` at 1 while `leader` says this replica leads, else 0, until the sender is gone.
async fn follow_leadership(mut leader: watch::Receiver<bool>, gauge: prometheus_client::metrics::gauge::Gauge<i64>) {
    loop {
        gauge.set(i64::from(*leader.borrow_and_update()));
        if leader.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use egress_provider::config::ProvidersConfig;

    use super::*;

    #[tokio::test]
    async fn without_an_election_only_a_shutdown_ends_the_wait() {
        assert_eq!(election_failure(&mut None, async {}).await, None);
    }

    #[test]
    fn each_process_is_a_candidate_of_its_own() {
        let first = election_identity(Some("egress-operator-7d9-abc".into()));
        assert!(first.starts_with("egress-operator-7d9-abc_"), "{first}");
        assert!(election_identity(None).starts_with("egress-operator_"));
        assert!(election_identity(Some(String::new())).starts_with("egress-operator_"));
    }

    #[tokio::test]
    async fn a_gcp_provider_is_accepted_and_a_broken_one_reports_why() {
        assert_eq!(provider_types().types(), ["aws", "gcp", "kubernetes", "kvm"]);
        let text = "providers:\n  - name: gcp-eu\n    type: gcp\n    gcp:\n      project: my-project\n      \
                    defaultZone: europe-west1-b\n      credentialsFile: /nonexistent/key.json\n";
        let config =
            ProvidersConfig::parse(text, "providers.yaml", provider_types().settings()).expect("a valid config");
        let providers = ProviderSet::build(&config, &provider_types(), None).await.expect("gcp is a supported type");
        let verdicts = providers.check("gcp-eu").await;
        assert_eq!(verdicts.len(), 1);
        assert!(!verdicts[0].ready);
        assert_eq!(verdicts[0].reason.as_deref(), Some("ConstructionFailed"));
        assert!(verdicts[0].message.as_deref().unwrap_or_default().contains("/nonexistent/key.json"), "{verdicts:?}");
    }

    #[tokio::test]
    async fn a_kvm_provider_is_accepted_and_checked_per_host() {
        let text = "providers:\n  - name: lab\n    type: kvm\n    kvm:\n      ssh: { privateKeyFile: /nonexistent/key, \
                    knownHostsFile: /nonexistent/known_hosts }\n      hosts:\n        - { name: rack1, address: 192.0.2.10 }\n      \
                    images:\n        debian12: { url: \"https://images.example/d.qcow2\", sha256: \
                    \"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\" }\n";
        let config =
            ProvidersConfig::parse(text, "providers.yaml", provider_types().settings()).expect("a valid config");
        let providers = ProviderSet::build(&config, &provider_types(), None).await.expect("kvm is a supported type");
        let verdicts = providers.check("lab").await;
        assert_eq!(verdicts.len(), 1, "{verdicts:?}");
        assert_eq!(verdicts[0].target, "hosts/rack1");
        assert!(!verdicts[0].ready);
        // The key file is read at dial time: its absence is reported, and a Secret mounted later heals it.
        assert!(verdicts[0].message.as_deref().unwrap_or_default().contains("/nonexistent/key"), "{verdicts:?}");
    }
}
