//! The gcp provider with the real Compute Engine SDK, over HTTP, against the local fake Compute server.

mod common;
mod fake;

use std::time::Duration;

use common::{EMAIL, PROJECT, ZONE, config, key_file, provider, request};
use egress_provider::{Checker, ErrorClass, InstanceState, Provider, Tags};
use egress_provider_gcp::GcpProvider;
use fake::FakeCompute;
use serde_json::json;

#[tokio::test]
async fn full_lifecycle_create_provisioning_running_delete_not_found() {
    let fake = FakeCompute::start(Duration::from_millis(300)).await;
    let provider = provider(&fake).await;
    let created = provider.create(&request("px-life", "c1")).await.expect("create");
    assert_eq!(created.state, InstanceState::Provisioning);
    assert_eq!(created.provider_id, format!("projects/{PROJECT}/zones/{ZONE}/instances/px-life"));
    let first = provider.get(&created.provider_id).await.expect("get");
    assert_eq!(first.state, InstanceState::Provisioning);
    assert_eq!(first.ip, None);

    let mut running = first;
    for _ in 0..50 {
        if running.state == InstanceState::Running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        running = provider.get(&created.provider_id).await.expect("get");
    }
    assert_eq!(running.state, InstanceState::Running);
    let ip = running.ip.expect("a Running instance has its NAT IP").to_string();
    assert!(ip.starts_with("203.0.113."), "{ip}");
    assert_eq!(running.tags.get(Tags::CLUSTER), Some("c1"));
    assert!(running.created_at.is_some());

    provider.delete(&created.provider_id).await.expect("delete");
    let gone = provider.get(&created.provider_id).await.expect_err("gone");
    assert_eq!(gone.class(), ErrorClass::NotFound);
    provider.delete(&created.provider_id).await.expect("deleting a missing instance succeeds");

    let calls: Vec<&str> = fake.requests().iter().map(|request| request.operation).collect();
    assert!(calls.iter().all(|call| ["insert", "get", "delete"].contains(call)), "{calls:?}");
}

#[tokio::test]
async fn the_insert_body_carries_the_contract() {
    let fake = FakeCompute::start(Duration::ZERO).await;
    let provider = provider(&fake).await;
    let mut request = request("px-body", "c1");
    request.zone = Some("europe-west1-c".into());
    request.machine_type = Some("e2-small".into());
    let created = provider.create(&request).await.expect("create");
    let listed = provider.list_by_tag(&Tags::owned_by_cluster("c1")).await.expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].provider_id, created.provider_id);
    let body = fake.body("europe-west1-c", "px-body");
    assert_eq!(body["machineType"], "zones/europe-west1-c/machineTypes/e2-small");
    assert_eq!(body["tags"]["items"], json!(["egress-proxy"]));
    assert_eq!(body["labels"]["egress-cluster"], "c1");
    assert_eq!(body["labels"]["egress-managed-by"], "egress-operator");
    assert_eq!(body["networkInterfaces"][0]["network"], "global/networks/default");
    assert_eq!(body["networkInterfaces"][0]["accessConfigs"][0]["type"], "ONE_TO_ONE_NAT");
    assert_eq!(body["disks"][0]["boot"], true);
    assert_eq!(body["disks"][0]["autoDelete"], true);
    let user_data = body["metadata"]["items"][0]["value"].as_str().expect("user-data");
    assert_eq!(body["metadata"]["items"][0]["key"], "user-data");
    assert!(user_data.starts_with("#cloud-config\n") && user_data.contains("http_port 3128"), "{user_data}");
}

#[tokio::test]
async fn creating_twice_makes_one_instance() {
    let fake = FakeCompute::start(Duration::ZERO).await;
    let provider = provider(&fake).await;
    let first = provider.create(&request("px-twice", "c1")).await.expect("create");
    let second = provider.create(&request("px-twice", "c1")).await.expect("create again");
    assert_eq!(first.provider_id, second.provider_id);
    assert_eq!(fake.instance_count(), 1);
    // Another provider (a restarted operator) with the same request: still one.
    let again = GcpProvider::new(config(&fake)).await.expect("provider");
    again.create(&request("px-twice", "c1")).await.expect("create after a restart");
    assert_eq!(fake.instance_count(), 1);
}

#[tokio::test]
async fn an_existing_instance_is_adopted_on_conflict() {
    let fake = FakeCompute::start(Duration::ZERO).await;
    fake.seed(ZONE, "px-there", json!({"egress-cluster": "c1"}));
    let provider = provider(&fake).await;
    let adopted = provider.create(&request("px-there", "c1")).await.expect("adopted");
    assert_eq!(adopted.state, InstanceState::Running);
    assert_eq!(fake.instance_count(), 1);
}

#[tokio::test]
async fn list_by_tag_spans_zones_and_ignores_other_labels() {
    let fake = FakeCompute::start(Duration::ZERO).await;
    let provider = provider(&fake).await;
    let mut east = request("px-east", "c1");
    east.zone = Some("us-east1-b".into());
    let mut west = request("px-west", "c1");
    west.zone = Some("europe-west1-c".into());
    provider.create(&east).await.expect("create east");
    provider.create(&west).await.expect("create west");
    fake.seed("us-east1-b", "someone-elses", json!({"egress-cluster": "c2", "egress-managed-by": "egress-operator"}));
    fake.seed("us-east1-b", "unlabelled", json!({}));
    let mut listed: Vec<String> = provider
        .list_by_tag(&Tags::owned_by_cluster("c1"))
        .await
        .expect("list")
        .into_iter()
        .map(|instance| instance.provider_id)
        .collect();
    listed.sort();
    assert_eq!(
        listed,
        [
            format!("projects/{PROJECT}/zones/europe-west1-c/instances/px-west"),
            format!("projects/{PROJECT}/zones/us-east1-b/instances/px-east"),
        ]
    );
}

#[tokio::test]
async fn list_by_tag_follows_pages() {
    let fake = FakeCompute::start(Duration::ZERO).await;
    for index in 0..1100 {
        fake.seed(
            "us-east1-b",
            &format!("px-{index:04}"),
            json!({"egress-cluster": "big", "egress-managed-by": "egress-operator"}),
        );
    }
    let provider = provider(&fake).await;
    let listed = provider.list_by_tag(&Tags::owned_by_cluster("big")).await.expect("list");
    assert_eq!(listed.len(), 1100);
    let pages = fake.requests().iter().filter(|request| request.operation == "aggregatedList").count();
    assert_eq!(pages, 3, "500 per page");
}

#[tokio::test]
async fn every_row_of_the_error_mapping() {
    let fake = FakeCompute::start(Duration::ZERO).await;
    let provider = provider(&fake).await;
    let id = format!("projects/{PROJECT}/zones/{ZONE}/instances/px-errors");
    let rows: [(u16, &str, ErrorClass, usize); 8] = [
        (404, "notFound", ErrorClass::NotFound, 1),
        (403, "quotaExceeded", ErrorClass::QuotaExceeded, 1),
        (403, "rateLimitExceeded", ErrorClass::QuotaExceeded, 1),
        (429, "rateLimitExceeded", ErrorClass::QuotaExceeded, 1),
        (403, "forbidden", ErrorClass::Permanent, 1),
        (400, "invalid", ErrorClass::Permanent, 1),
        (500, "backendError", ErrorClass::Transient, 1),
        // 503 is retried by the SDK: it must fail every attempt to reach the provider.
        (503, "backendError", ErrorClass::Transient, 3),
    ];
    for (status, reason, class, times) in rows {
        for _ in 0..times {
            fake.fail_next("get", status, reason);
        }
        let error = provider.get(&id).await.expect_err("scripted failure");
        assert_eq!(error.class(), class, "{status} {reason}: {error}");
        assert!(error.to_string().contains(&format!("HTTP {status}")), "{error}");
    }

    // No answer at all: a closed port.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("address").port()
    };
    let mut unreachable = config(&fake);
    unreachable.endpoint = Some(format!("http://127.0.0.1:{closed}"));
    let provider = GcpProvider::new(unreachable).await.expect("provider");
    let error = provider.get(&id).await.expect_err("nothing listens");
    assert_eq!(error.class(), ErrorClass::Transient, "{error}");
}

#[tokio::test]
async fn a_transient_insert_failure_is_retried_with_the_same_request_id() {
    let fake = FakeCompute::start(Duration::ZERO).await;
    let provider = provider(&fake).await;
    fake.fail_next("insert", 503, "backendError");
    provider.create(&request("px-retry", "c1")).await.expect("the retry succeeds");
    let inserts: Vec<_> = fake.requests().into_iter().filter(|request| request.operation == "insert").collect();
    assert_eq!(inserts.len(), 2, "{inserts:?}");
    let id = inserts[0].request_id.clone().expect("a request ID");
    assert_eq!(inserts[1].request_id.as_deref(), Some(id.as_str()));
    assert_eq!(fake.instance_count(), 1);
}

#[tokio::test]
async fn the_checker_says_ready_for_good_credentials_and_why_not_for_rejected_ones() {
    let fake = FakeCompute::start(Duration::ZERO).await;
    fake.accept_only(EMAIL);
    let provider = provider(&fake).await;
    let verdicts = provider.check().await;
    assert_eq!(verdicts.len(), 1);
    assert!(verdicts[0].ready, "{verdicts:?}");
    assert_eq!(verdicts[0].target, format!("projects/{PROJECT}"));

    let mut stranger = config(&fake);
    stranger.credentials_file = Some(key_file("someone-else@other.iam.gserviceaccount.com"));
    let rejected = GcpProvider::new(stranger).await.expect("provider");
    let verdicts = rejected.check().await;
    assert!(!verdicts[0].ready);
    assert_eq!(verdicts[0].reason.as_deref(), Some("Unauthenticated"), "{verdicts:?}");
    assert!(verdicts[0].message.as_deref().unwrap_or_default().contains("HTTP 401"), "{verdicts:?}");
    let lists = fake.requests().iter().filter(|request| request.operation == "aggregatedList").count();
    assert_eq!(lists, 2, "one list per check");
}

#[tokio::test]
async fn a_credentials_file_that_is_not_a_key_is_a_permanent_error() {
    let fake = FakeCompute::start(Duration::ZERO).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("key.json");
    std::fs::write(&path, "{\"private_key\": \"very-secret-not-a-key\"}").expect("write");
    let mut config = config(&fake);
    config.credentials_file = Some(path);
    let error = GcpProvider::new(config).await.expect_err("not a key");
    assert_eq!(error.class(), ErrorClass::Permanent);
    assert!(!error.chain().contains("very-secret-not-a-key"), "{}", error.chain());
}
