//! The provider's lifecycle against libvirt's `test:///default` driver (in-process; its state is shared by every
//! connection of this test binary, so each test uses instance names of its own).

use std::collections::BTreeMap;

use egress_provider::{Checker, CreateRequest, ErrorClass, InstanceState, Provider, Tags};
use egress_provider_kvm::{KvmConfig, KvmHost, KvmImage, KvmSsh};
use egress_provider_kvm::{KvmProvider, names, xml};
use virt::connect::Connect;
use virt::domain::Domain;
use virt::storage_pool::StoragePool;
use virt::storage_vol::StorageVol;

/// sha256 of the empty string: the preseeded base volume's configured checksum.
const SHA: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
const POOL: &str = "default-pool";

fn host(name: &str, pool: &str) -> KvmHost {
    KvmHost {
        name: name.into(),
        address: "localhost".into(),
        port: 22,
        user: None,
        pool: pool.into(),
        bridge: "br0".into(),
        socket: None,
        uri: Some("test:///default".into()),
    }
}

fn config(hosts: Vec<KvmHost>) -> KvmConfig {
    KvmConfig {
        ssh: KvmSsh {
            user: "root".into(),
            private_key_file: "/nonexistent/key".into(),
            known_hosts_file: "/nonexistent/known_hosts".into(),
        },
        hosts,
        images: BTreeMap::from([(
            "tiny".to_owned(),
            KvmImage {
                url: "http://127.0.0.1:9/never-fetched".into(),
                sha256: SHA.into(),
                format: "qcow2".into(),
                firmware: "uefi".into(),
            },
        )]),
        machine_types: BTreeMap::new(),
        default_host: None,
        default_image: None,
        default_machine_type: None,
        vendor_data: None,
        domain_type: "kvm".into(),
    }
}

/// The test driver cannot upload, so the cached image is put in place directly: base and marker.
fn preseed() -> Connect {
    // libvirt prints every error to stderr by default; the races below expect some.
    virt::error::clear_error_callback();
    let conn = Connect::open(Some("test:///default")).expect("the test driver");
    let pool = StoragePool::lookup_by_name(&conn, POOL).expect("the test driver's pool");
    for name in [names::base_volume("tiny", SHA), names::marker_volume("tiny", SHA)] {
        // Tests run in parallel on one shared driver: another may have made it first.
        match StorageVol::create_xml(&pool, &xml::volume(&name, 0, "raw", None), 0) {
            Ok(_) => {}
            Err(error) if StorageVol::lookup_by_name(&pool, &name).is_ok() => drop(error),
            Err(error) => panic!("preseed {name}: {error}"),
        }
    }
    conn
}

fn volumes(conn: &Connect) -> Vec<String> {
    let pool = StoragePool::lookup_by_name(conn, POOL).expect("pool");
    pool.list_all_volumes(0).expect("volumes").iter().map(|volume| volume.get_name().expect("name")).collect()
}

fn request(name: &str, cluster: &str) -> CreateRequest {
    CreateRequest {
        zone: Some("lab".into()),
        ..CreateRequest::new(name, 3128, Tags::gc_contract(cluster, &format!("uid-{name}"), "abc"))
    }
}

#[tokio::test]
async fn create_get_list_delete_leaves_nothing_behind() {
    let conn = preseed();
    let provider = KvmProvider::new(config(vec![host("lab", POOL)])).expect("provider");
    let created = provider.create(&request("px-life", "c-life")).await.expect("create");
    assert_eq!(created.provider_id, "hosts/lab/domains/px-life");
    assert_eq!(created.state, InstanceState::Running, "{created:?}");
    let ip = created.ip.expect("the test driver reports an address");
    assert!(ip.to_string().starts_with("192.168."), "the test driver's address: {ip}");
    assert!(created.created_at.is_some());

    let got = provider.get(&created.provider_id).await.expect("get");
    assert_eq!(
        (got.state, got.ip, &got.tags),
        (InstanceState::Running, created.ip, &request("px-life", "c-life").tags)
    );
    let owned = volumes(&conn);
    for volume in ["px-life.qcow2", "px-life-seed.iso"] {
        assert!(owned.iter().any(|name| name == volume), "{volume} in {owned:?}");
    }

    let listed = provider.list_by_tag(&Tags::owned_by_cluster("c-life")).await.expect("list");
    assert_eq!(listed.iter().map(|instance| instance.name.as_str()).collect::<Vec<_>>(), ["px-life"]);
    assert!(provider.list_by_tag(&Tags::owned_by_cluster("c-other")).await.expect("list").is_empty());

    provider.delete(&created.provider_id).await.expect("delete");
    provider.delete(&created.provider_id).await.expect("delete twice");
    let error = provider.get(&created.provider_id).await.expect_err("gone");
    assert_eq!(error.class(), ErrorClass::NotFound);
    let left = volumes(&conn);
    assert!(!left.iter().any(|name| name.starts_with("px-life")), "every volume it made is gone: {left:?}");
    assert!(left.contains(&names::base_volume("tiny", SHA)), "the shared base image stays: {left:?}");
}

#[tokio::test]
async fn creating_twice_is_one_domain() {
    let conn = preseed();
    let provider = KvmProvider::new(config(vec![host("lab", POOL)])).expect("provider");
    let first = provider.create(&request("px-twice", "c-twice")).await.expect("create");
    let second = provider.create(&request("px-twice", "c-twice")).await.expect("create again");
    assert_eq!(first.provider_id, second.provider_id);
    let domains: Vec<String> =
        conn.list_all_domains(0).expect("domains").iter().map(|domain| domain.get_name().expect("name")).collect();
    assert_eq!(domains.iter().filter(|name| *name == "px-twice").count(), 1, "{domains:?}");
    provider.delete(&first.provider_id).await.expect("delete");
}

#[tokio::test]
async fn a_domain_not_made_by_the_operator_is_never_touched() {
    let conn = preseed();
    let foreign = "<domain type=\"test\"><name>hand-made</name><memory unit=\"MiB\">128</memory><os><type>hvm</type></os></domain>";
    Domain::define_xml(&conn, foreign).expect("define a foreign domain");
    let provider = KvmProvider::new(config(vec![host("lab", POOL)])).expect("provider");
    let error = provider.delete("hosts/lab/domains/hand-made").await.expect_err("refused");
    assert_eq!(error.class(), ErrorClass::Permanent);
    assert!(error.to_string().contains("not made by egress-operator"), "{error}");
    assert!(Domain::lookup_by_name(&conn, "hand-made").is_ok(), "still there");
    assert!(provider.list_by_tag(&Tags::new()).await.expect("list").iter().all(|i| i.name != "hand-made"));
}

#[tokio::test]
async fn unknown_hosts_images_and_ids_are_permanent_and_delete_elsewhere_is_a_no_op() {
    preseed();
    let provider = KvmProvider::new(config(vec![host("lab", POOL)])).expect("provider");
    let mut elsewhere = request("px-where", "c1");
    elsewhere.zone = Some("mars".into());
    let error = provider.create(&elsewhere).await.expect_err("unknown host");
    assert_eq!(error.class(), ErrorClass::Permanent);
    assert!(error.to_string().contains("\"mars\" is not configured (hosts: lab)"), "{error}");
    let mut image = request("px-what", "c1");
    image.image = Some("gentoo".into());
    assert!(provider.create(&image).await.expect_err("unknown image").to_string().contains("images: tiny"));
    assert_eq!(provider.get("hosts/mars/domains/px-a").await.expect_err("unknown").class(), ErrorClass::Permanent);
    assert_eq!(provider.get("ns/pod").await.expect_err("not ours").class(), ErrorClass::Permanent);
    provider.delete("hosts/mars/domains/px-a").await.expect("an unconfigured host has nothing to delete");
}

#[tokio::test]
async fn the_checker_reports_a_running_pool_and_a_missing_one() {
    preseed();
    let provider = KvmProvider::new(config(vec![host("lab", POOL), host("empty", "no-such-pool")])).expect("provider");
    let verdicts = provider.check().await;
    let lab = verdicts.iter().find(|verdict| verdict.target == "hosts/lab").expect("lab");
    assert!(lab.ready, "{lab:?}");
    let empty = verdicts.iter().find(|verdict| verdict.target == "hosts/empty").expect("empty");
    assert!(!empty.ready);
    assert_eq!(empty.reason.as_deref(), Some("PoolMissing"), "{empty:?}");
}
