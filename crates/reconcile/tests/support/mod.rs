//! Test support for the reconciler: a scriptable in-memory provider and a harness that runs the controller against
//! the test control plane.
//!
//! The provider is the one test double in these tests: it stands for a backend whose every call can be told to
//! fail with a chosen class, to take a while, or to succeed, and it counts calls and live instances, which a real
//! backend cannot do on demand.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use egress_api::{Proxy, ProxySpec};
use egress_health::CurrentVerdict;
use egress_provider::{
    CreateRequest, ErrorClass, Instance, InstanceState, Provider, ProviderError, Tags, instance_name,
};
use egress_reconcile::{
    Context, ControllerConfig, CredentialStore, ProbeKey, ProxyFeed, ProxyVerdicts, ReconcileMetrics, StaticProviders,
    Trigger,
};
use egress_testenv::TestNamespace;
use futures::StreamExt;
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// A provider operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Create,
    Get,
    Delete,
    List,
}

/// What the next call of an operation does.
#[derive(Clone, Copy, Debug)]
pub enum Behavior {
    Succeed,
    Fail(ErrorClass),
    Delay(Duration),
}

#[derive(Clone, Debug)]
struct Stored {
    provider_id: String,
    state: InstanceState,
    ip: Option<IpAddr>,
    created_at: SystemTime,
    tags: Tags,
}

#[derive(Default)]
struct State {
    instances: BTreeMap<String, Stored>,
    /// Behaviors used once each, before the standing one.
    queued: HashMap<Op, VecDeque<Behavior>>,
    standing: HashMap<Op, Behavior>,
    calls: HashMap<Op, usize>,
    /// When each call of each kind began.
    call_times: HashMap<Op, Vec<Instant>>,
    next_ip: u32,
    /// The proxy credentials (user, password) of the last create request.
    last_credentials: Option<(String, String)>,
}

/// The scriptable in-memory provider. Instances run (with an address) as soon as they are created.
#[derive(Default)]
pub struct ScriptedProvider {
    state: Mutex<State>,
}

impl ScriptedProvider {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Every call of `op` behaves like this until changed.
    pub fn always(&self, op: Op, behavior: Behavior) {
        self.state.lock().unwrap().standing.insert(op, behavior);
    }

    /// The next call of `op` behaves like this, then the standing behavior applies again.
    pub fn next(&self, op: Op, behavior: Behavior) {
        self.state.lock().unwrap().queued.entry(op).or_default().push_back(behavior);
    }

    /// The proxy credentials (user, password) the last create request carried.
    pub fn last_credentials(&self) -> Option<(String, String)> {
        self.state.lock().unwrap().last_credentials.clone()
    }

    /// When each call of `op` began, in order.
    pub fn call_times(&self, op: Op) -> Vec<Instant> {
        self.state.lock().unwrap().call_times.get(&op).cloned().unwrap_or_default()
    }

    pub fn calls(&self, op: Op) -> usize {
        self.state.lock().unwrap().calls.get(&op).copied().unwrap_or(0)
    }

    /// Names of the instances that exist.
    pub fn live(&self) -> Vec<String> {
        self.state.lock().unwrap().instances.keys().cloned().collect()
    }

    /// Removes an instance behind the operator's back.
    pub fn remove(&self, name: &str) {
        self.state.lock().unwrap().instances.remove(name);
    }

    /// Changes an instance's state behind the operator's back (preemption).
    pub fn set_state(&self, name: &str, state: InstanceState) {
        if let Some(stored) = self.state.lock().unwrap().instances.get_mut(name) {
            stored.state = state;
        }
    }

    /// Adds an instance directly, as a crashed operator or another tool would have left it.
    pub fn insert(&self, name: &str, tags: Tags, created_at: SystemTime) {
        let mut state = self.state.lock().unwrap();
        let ip = Self::allocate(&mut state);
        state.instances.insert(
            name.to_owned(),
            Stored {
                provider_id: format!("scripted/{name}"),
                state: InstanceState::Running,
                ip: Some(ip),
                created_at,
                tags,
            },
        );
    }

    /// The tags of a live instance.
    pub fn tags(&self, name: &str) -> Option<Tags> {
        self.state.lock().unwrap().instances.get(name).map(|stored| stored.tags.clone())
    }

    fn allocate(state: &mut State) -> IpAddr {
        state.next_ip += 1;
        IpAddr::V4(Ipv4Addr::new(10, 200, (state.next_ip >> 8) as u8, (state.next_ip & 0xff) as u8))
    }

    async fn enter(&self, op: Op) -> Result<(), ProviderError> {
        let behavior = {
            let mut state = self.state.lock().unwrap();
            *state.calls.entry(op).or_default() += 1;
            state.call_times.entry(op).or_default().push(Instant::now());
            let queued = state.queued.get_mut(&op).and_then(VecDeque::pop_front);
            queued.or_else(|| state.standing.get(&op).copied()).unwrap_or(Behavior::Succeed)
        };
        match behavior {
            Behavior::Succeed => Ok(()),
            Behavior::Fail(class) => Err(ProviderError::new(class, format!("scripted {op:?} failure ({class})"))),
            Behavior::Delay(delay) => {
                tokio::time::sleep(delay).await;
                Ok(())
            }
        }
    }

    fn instance(name: &str, stored: &Stored) -> Instance {
        Instance::new(name, &stored.provider_id, stored.state, stored.ip, Some(stored.created_at), stored.tags.clone())
    }
}

#[async_trait]
impl Provider for ScriptedProvider {
    async fn create(&self, request: &CreateRequest) -> Result<Instance, ProviderError> {
        self.enter(Op::Create).await?;
        let mut state = self.state.lock().unwrap();
        state.last_credentials = request
            .credentials
            .as_ref()
            .map(|credentials| (credentials.username.clone(), credentials.password.expose().clone()));
        if let Some(existing) = state.instances.get(&request.name) {
            return Ok(Self::instance(&request.name, existing));
        }
        let ip = Self::allocate(&mut state);
        let stored = Stored {
            provider_id: format!("scripted/{}", request.name),
            state: InstanceState::Running,
            ip: Some(ip),
            created_at: SystemTime::now(),
            tags: request.tags.clone(),
        };
        let instance = Self::instance(&request.name, &stored);
        state.instances.insert(request.name.clone(), stored);
        Ok(instance)
    }

    async fn get(&self, provider_id: &str) -> Result<Instance, ProviderError> {
        self.enter(Op::Get).await?;
        let name = provider_id.strip_prefix("scripted/").unwrap_or(provider_id);
        let state = self.state.lock().unwrap();
        state
            .instances
            .get(name)
            .map(|stored| Self::instance(name, stored))
            .ok_or_else(|| ProviderError::not_found(format!("no instance {provider_id}")))
    }

    async fn delete(&self, provider_id: &str) -> Result<(), ProviderError> {
        self.enter(Op::Delete).await?;
        let name = provider_id.strip_prefix("scripted/").unwrap_or(provider_id);
        self.state.lock().unwrap().instances.remove(name);
        Ok(())
    }

    async fn list_by_tag(&self, tags: &Tags) -> Result<Vec<Instance>, ProviderError> {
        self.enter(Op::List).await?;
        let state = self.state.lock().unwrap();
        Ok(state
            .instances
            .iter()
            .filter(|(_, stored)| stored.tags.contains_all(tags))
            .map(|(name, stored)| Self::instance(name, stored))
            .collect())
    }
}

/// The controller running against one test namespace with one scripted provider called `scripted`.
pub struct Harness {
    pub ns: TestNamespace,
    pub provider: Arc<ScriptedProvider>,
    pub health: ProxyVerdicts,
    pub cluster_id: String,
    triggers: mpsc::UnboundedSender<Trigger>,
    receiver: Option<mpsc::UnboundedReceiver<Trigger>>,
    /// The Proxy watch, a second reader of its store (as the operator's health feed is), and the controller.
    tasks: Vec<JoinHandle<()>>,
    pub metrics: ReconcileMetrics,
    /// The controller's periodic resync (1 s unless a test sets it before a restart).
    pub resync: Duration,
    /// The Proxy store the controller reads (a pool controller reads the same one).
    pub feed: Option<ProxyFeed>,
    /// The GeoIP databases the controller looks egress addresses up in, if any.
    pub geoip: Option<Arc<egress_reconcile::geoip::GeoIp>>,
}

impl Harness {
    pub async fn new(prefix: &str) -> Self {
        Self::with_geoip(prefix, None).await
    }

    /// As [`Harness::new`], the controller looking egress addresses up in `geoip`.
    pub async fn with_geoip(prefix: &str, geoip: Option<Arc<egress_reconcile::geoip::GeoIp>>) -> Self {
        let ns = egress_testenv::namespace(prefix).await;
        let (triggers, receiver) = mpsc::unbounded_channel();
        let cluster_id = ns.name().to_owned();
        let mut harness = Self {
            ns,
            provider: ScriptedProvider::new(),
            health: ProxyVerdicts::new(),
            cluster_id,
            triggers,
            receiver: Some(receiver),
            tasks: Vec::new(),
            metrics: ReconcileMetrics::default(),
            resync: Duration::from_secs(1),
            feed: None,
            geoip,
        };
        harness.start();
        harness
    }

    pub fn config(&self) -> ControllerConfig {
        let mut config = ControllerConfig::new(&self.cluster_id);
        config.namespace = Some(self.ns.name().to_owned());
        config.resync = self.resync;
        config
    }

    pub fn context(&self, credentials: CredentialStore) -> Arc<Context> {
        // One backend under two names, so a pool can spread over two providers.
        let providers = StaticProviders::new()
            .with("scripted", self.provider.clone() as Arc<dyn Provider>)
            .with("scripted-b", self.provider.clone() as Arc<dyn Provider>);
        let context = Context::new(
            self.ns.client(),
            Arc::new(providers),
            self.health.clone(),
            credentials,
            self.config(),
            self.metrics.clone(),
        );
        Arc::new(match &self.geoip {
            Some(geoip) => context.with_geoip(geoip.clone()),
            None => context,
        })
    }

    /// Starts (or restarts) the controller with a fresh context, as a restarted operator would have.
    pub fn start(&mut self) {
        let (feed, watch) = ProxyFeed::start(self.ns.client(), Some(self.ns.name()));
        let (credentials, secret_watch) = CredentialStore::start(self.ns.client(), Some(self.ns.name()), &feed);
        let context = self.context(credentials);
        let receiver = self.receiver.take().unwrap_or_else(|| {
            let (triggers, receiver) = mpsc::unbounded_channel();
            self.triggers = triggers;
            receiver
        });
        let stream = futures::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|item| (item, receiver))
        });
        // As in the operator: one shared store, read by the controller and by other tasks that wait on it too
        // (the health feed, the discovery view), started before and after it. The store's readiness once woke only
        // the last of its waiters, and a controller that lost that race never reconciled anything.
        let reader = |feed: ProxyFeed| {
            tokio::spawn(async move {
                let mut changes = feed.subscribe().boxed();
                while changes.next().await.is_some() {}
            })
        };
        let before = reader(feed.clone());
        let controller = tokio::spawn(egress_reconcile::run(context, feed.clone(), stream, futures::future::pending()));
        let after = reader(feed.clone());
        self.feed = Some(feed);
        self.tasks = vec![watch, secret_watch, before, controller, after];
    }

    /// Kills the controller mid-flight, as SIGKILL would.
    pub async fn crash(&mut self) {
        for handle in self.tasks.drain(..) {
            handle.abort();
            let _ = handle.await;
        }
    }

    pub fn proxies(&self) -> Api<Proxy> {
        self.ns.api()
    }

    /// Records a verdict for a Proxy's endpoint and triggers its reconcile, as the health engine does.
    pub fn feed_health(&self, name: &str, address: &str, healthy: bool) {
        self.feed_health_from(name, address, healthy, None);
    }

    /// As [`Harness::feed_health`], with the egress address the probe target saw.
    pub fn feed_health_from(&self, name: &str, address: &str, healthy: bool, egress_ip: Option<std::net::IpAddr>) {
        let key = self.probe_key(name, address);
        let verdict = CurrentVerdict {
            healthy,
            since: SystemTime::now(),
            last_error: (!healthy).then_some(egress_health::FailureReason::ConnectRefused),
            egress_ip,
        };
        let proxy = key.proxy.clone();
        self.health.set_as_engine(key, verdict);
        let _ = self.triggers.send(proxy);
    }

    /// Plays the health engine: every recorded instance's address is reported healthy once.
    pub async fn report_health(&self) {
        let Ok(list) = self.proxies().list(&ListParams::default()).await else { return };
        for proxy in list.items {
            let Some(ip) = proxy
                .status
                .as_ref()
                .and_then(|status| status.instance.as_ref())
                .and_then(|instance| instance.ip.clone())
            else {
                continue;
            };
            let name = proxy.name_any();
            let address = format!("{ip}:{}", proxy.spec.port);
            if self.health.get(&self.probe_key(&name, &address)).is_none() {
                self.feed_health(&name, &address, true);
            }
        }
    }

    /// The verdict key of `host:port` of the Proxy `name` in this namespace.
    pub fn probe_key(&self, name: &str, address: &str) -> ProbeKey {
        let (host, port) = address.rsplit_once(':').expect("host:port");
        let endpoint = egress_api::Endpoint {
            host: host.trim_start_matches('[').trim_end_matches(']').to_owned(),
            port: port.parse().expect("a port"),
        };
        ProbeKey::new(self.ns.name(), name, endpoint)
    }

    /// Reasons of the Events published about a Proxy.
    pub async fn event_reasons(&self, name: &str) -> Vec<String> {
        self.events(name).await.into_iter().map(|(reason, _)| reason).collect()
    }

    /// The (reason, note) of every Event about the object `name`.
    pub async fn events(&self, name: &str) -> Vec<(String, String)> {
        let events: Api<Event> = self.ns.api();
        let list = events.list(&ListParams::default()).await.expect("list Events");
        list.items
            .into_iter()
            .filter(|event| event.regarding.as_ref().and_then(|regarding| regarding.name.as_deref()) == Some(name))
            .filter_map(|event| Some((event.reason?, event.note.unwrap_or_default())))
            .collect()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        for handle in &self.tasks {
            handle.abort();
        }
    }
}

/// A Managed spec on the scripted provider.
pub fn managed(zone: &str) -> ProxySpec {
    ProxySpec::managed("scripted", Some(zone))
}

/// The seed of a crash test: `EGRESS_CRASH_SEED`, else the clock; printed so a failure can be replayed.
pub fn crash_seed() -> u64 {
    let seed = std::env::var("EGRESS_CRASH_SEED").ok().and_then(|seed| seed.parse().ok()).unwrap_or_else(|| {
        SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1
    });
    eprintln!("crash-safety seed {seed} (replay with EGRESS_CRASH_SEED={seed})");
    seed
}

/// A seeded `fastrand` generator, to pick operations reproducibly.
pub struct Rng(fastrand::Rng);

impl Rng {
    pub fn seeded(seed: u64) -> Self {
        Self(fastrand::Rng::with_seed(seed))
    }
    pub fn next(&mut self) -> u64 {
        self.0.u64(..)
    }
    pub fn below(&mut self, n: usize) -> usize {
        self.0.usize(..n)
    }
}

/// What is wrong with the world now, or nothing.
pub async fn violations(harness: &Harness) -> Vec<String> {
    let mut problems = Vec::new();
    let proxies: Vec<Proxy> = harness.proxies().list(&ListParams::default()).await.expect("list Proxies").items;
    let mut wanted = BTreeSet::new();
    for proxy in &proxies {
        let name = proxy.name_any();
        if proxy.metadata.deletion_timestamp.is_some() {
            problems.push(format!("{name} is still being deleted"));
            continue;
        }
        let desired = instance_name(&proxy.uid().expect("uid"), &proxy.desired_spec_hash());
        let status = proxy.status.clone().unwrap_or_default();
        if status.instance.as_ref().map(|instance| &instance.name) != Some(&desired) {
            problems.push(format!(
                "{name} records {:?}, not its desired instance {desired}",
                status.instance.map(|i| i.name)
            ));
        }
        if let Some(previous) = status.previous_instance {
            problems.push(format!("{name} still has a previous instance {}", previous.name));
        }
        wanted.insert(desired);
    }
    let live: BTreeSet<String> = harness.provider.live().into_iter().collect();
    for extra in live.difference(&wanted) {
        problems.push(format!("instance {extra} belongs to no live Proxy's desired state"));
    }
    for missing in wanted.difference(&live) {
        problems.push(format!("desired instance {missing} does not exist"));
    }
    problems
}
