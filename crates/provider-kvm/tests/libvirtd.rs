//! The kvm provider against a real libvirtd with a directory pool, locally and over SSH to an sshd on loopback.
//! No guest boots here (`boot.rs` boots real ones): images, overlays, seeds, the checker, connection handling and a
//! failed create's clean-up are what is tested here.

mod support;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;

use egress_provider::{Checker, CreateRequest, ErrorClass, Provider, ProviderError, Sensitive, Tags};
use egress_provider_kvm::conn::Host;
use egress_provider_kvm::images::{self, ImageCache};
use egress_provider_kvm::{KvmConfig, KvmHost, KvmImage, KvmSsh};
use egress_provider_kvm::{KvmProvider, names, seed};
use support::{ImageServer, Libvirtd, Sshd, exclusive, hex, pool_volumes};

const POOL: &str = "egress-test-pool";

fn image(url: &str, sha256: &str) -> KvmImage {
    KvmImage { url: url.into(), sha256: sha256.into(), format: "raw".into(), firmware: "bios".into() }
}

fn ssh(dir: Option<&Sshd>) -> KvmSsh {
    KvmSsh {
        user: "root".into(),
        private_key_file: dir.map_or_else(|| "/nonexistent/key".into(), |sshd| sshd.path("client_key")),
        known_hosts_file: dir.map_or_else(|| "/nonexistent/known_hosts".into(), |sshd| sshd.path("known_hosts")),
    }
}

fn local_host(daemon: &Libvirtd, pool: &str) -> KvmHost {
    KvmHost {
        name: "local".into(),
        address: "localhost".into(),
        port: 22,
        user: None,
        pool: pool.into(),
        bridge: "br0".into(),
        socket: None,
        uri: Some(daemon.uri()),
    }
}

fn ssh_host(daemon: &Libvirtd, sshd: &Sshd) -> KvmHost {
    KvmHost {
        name: "remote".into(),
        address: "127.0.0.1".into(),
        port: sshd.port,
        user: None,
        pool: POOL.into(),
        bridge: "br0".into(),
        socket: Some(daemon.socket().display().to_string()),
        uri: None,
    }
}

fn config(hosts: Vec<KvmHost>, ssh: KvmSsh, images: BTreeMap<String, KvmImage>) -> KvmConfig {
    KvmConfig {
        ssh,
        hosts,
        images,
        machine_types: BTreeMap::new(),
        default_host: None,
        default_image: None,
        default_machine_type: None,
        vendor_data: Some("#cloud-config\nntp: {enabled: true}\n".into()),
        domain_type: "kvm".into(),
    }
}

/// Deterministic bytes that are not all alike, so a truncated or shifted upload cannot match.
fn image_bytes(len: usize, seed: u8) -> Vec<u8> {
    let mut state = u32::from(seed) + 1;
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            state.to_be_bytes()[0]
        })
        .collect()
}

fn file_sha(path: &str) -> String {
    use sha2::Digest as _;
    hex(&sha2::Sha256::digest(std::fs::read(path).expect("read the volume file")))
}

fn isoinfo(args: &[&str], path: &str) -> Vec<u8> {
    let output = Command::new("isoinfo").args(args).args(["-i", path]).output().expect("isoinfo runs (genisoimage)");
    assert!(output.status.success(), "isoinfo {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    output.stdout
}

fn request(name: &str) -> CreateRequest {
    CreateRequest {
        cloud_init: Some(Sensitive::new(b"#cloud-config\nhostname: from-the-proxy\n".to_vec())),
        ..CreateRequest::new(name, 3128, Tags::gc_contract("c1", &format!("uid-{name}"), "hash"))
    }
}

/// Calls `create` every 50 ms, for at most 30 s, until its error satisfies `done`; returns that error.
async fn until<F, Fut>(create: F, done: impl Fn(&ProviderError) -> bool) -> ProviderError
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<egress_provider::Instance, ProviderError>>,
{
    for _ in 0..600 {
        match create().await {
            Ok(instance) => panic!("no guest can start here (there is no bridge br0), yet {instance:?}"),
            Err(error) if done(&error) => return error,
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
        }
    }
    panic!("the create still waited for its image after 30 s");
}

#[tokio::test]
async fn images_overlays_seeds_and_redial_on_a_real_daemon() {
    let _serial = exclusive().await;
    let mut daemon = Libvirtd::start();
    let uri = daemon.uri();
    let pool_dir = daemon.dir_pool(POOL);
    let server = ImageServer::start().await;
    let (good_url, good_sha) = server.put("good.img", image_bytes(3 << 20, 1));
    let (bad_url, _) = server.put("bad.img", image_bytes(1 << 20, 2));
    let bad_sha = "0".repeat(64);
    let host_config = local_host(&daemon, POOL);
    let host = Arc::new(Host::new(&host_config, &ssh(None)));
    let cache = ImageCache::new(egress_provider_kvm::http_client().expect("client"));
    let good = image(&good_url, &good_sha);
    let base_name = names::base_volume("good", &good_sha);
    let marker_name = names::marker_volume("good", &good_sha);

    // Downloaded once, verified, marked; the second call uses the cache.
    let base = cache.ensure(&host, "good", &good).await.expect("the image is cached");
    assert_eq!(file_sha(&base), good_sha, "the volume holds the image byte for byte");
    assert_eq!(pool_volumes(&uri, POOL), [base_name.clone(), marker_name.clone()]);
    assert_eq!(cache.ensure(&host, "good", &good).await.expect("cached"), base);
    assert_eq!(server.hits("good.img"), 1);

    // No marker and no guest on it: fetched again.
    images::delete_volume(&host, &marker_name).await.expect("remove the marker");
    cache.ensure(&host, "good", &good).await.expect("re-fetched");
    assert_eq!(server.hits("good.img"), 2);

    // An overlay on it makes it in use: without its marker it is re-verified in place, never replaced.
    let overlay = images::create_overlay(&host, "px-one.qcow2", &base, "raw", 1 << 30).await.expect("overlay");
    let info = Command::new("qemu-img").args(["info", "--output=json", &overlay]).output().expect("qemu-img");
    let info = String::from_utf8_lossy(&info.stdout);
    assert!(info.contains(&format!("\"backing-filename\": \"{base}\"")), "{info}");
    images::delete_volume(&host, &marker_name).await.expect("remove the marker");
    cache.ensure(&host, "good", &good).await.expect("re-verified");
    assert_eq!(server.hits("good.img"), 2, "an image in use is not downloaded again");
    assert!(pool_volumes(&uri, POOL).contains(&marker_name), "the marker is back");

    // A checksum mismatch is Permanent and leaves no partial base.
    let error = cache.ensure(&host, "bad", &image(&bad_url, &bad_sha)).await.expect_err("mismatch");
    assert_eq!(error.class(), ErrorClass::Permanent, "{error}");
    assert!(error.to_string().contains("sha256"), "{error}");
    assert!(!pool_volumes(&uri, POOL).iter().any(|name| name.starts_with("egress-image-bad")), "no partial base");
    // A missing image is Permanent too.
    let missing = format!("http://{}/missing.img", server.address);
    let error = cache.ensure(&host, "gone", &image(&missing, &good_sha)).await.expect_err("404");
    assert_eq!(error.class(), ErrorClass::Permanent, "{error}");

    // The seed: a cidata ISO with the Proxy's user data byte for byte, meta-data and vendor-data.
    let seeded = request("px-seed");
    let seed_path = images::put_volume(
        &host,
        "px-seed-seed.iso",
        seed::image(
            &seeded,
            Some("#!/bin/sh\necho hi\n"),
            &egress_provider::destinations::DestinationPolicy::default(),
        )
        .expect("iso"),
    )
    .await
    .expect("the seed volume");
    let header = String::from_utf8_lossy(&isoinfo(&["-d"], &seed_path)).into_owned();
    assert!(header.contains("Volume id: cidata"), "{header}");
    assert!(header.contains("Joliet"), "{header}");
    assert_eq!(
        isoinfo(&["-J", "-x", "/user-data"], &seed_path),
        seeded.cloud_init.as_ref().expect("set").expose().as_slice()
    );
    let meta = String::from_utf8(isoinfo(&["-J", "-x", "/meta-data"], &seed_path)).expect("utf-8");
    assert_eq!(meta, "instance-id: px-seed\nlocal-hostname: px-seed\n");
    let vendor = String::from_utf8(isoinfo(&["-J", "-x", "/vendor-data"], &seed_path)).expect("utf-8");
    assert!(vendor.contains("qemu-guest-agent") && vendor.contains("echo hi"), "{vendor}");

    // A create on a host without its image starts a background download and says so, as a Transient error; once
    // the image is cached the create goes past it (and here fails at the guest's start, see below). A background
    // download that fails hands its error to the next create.
    // Held until the first create has answered, so it always finds the download still going.
    let (late_url, late_sha, release_late) = server.put_held("late.img", image_bytes(2 << 20, 4));
    let background = KvmProvider::new(config(
        vec![local_host(&daemon, POOL)],
        ssh(None),
        BTreeMap::from([
            ("late".to_owned(), image(&late_url, &late_sha)),
            ("wrong".to_owned(), image(&bad_url, &bad_sha)),
        ]),
    ))
    .expect("provider");
    let late = CreateRequest { image: Some("late".into()), ..request("px-late") };
    let first = background.create(&late).await.expect_err("not cached yet");
    assert_eq!(first.class(), ErrorClass::Transient, "{first}");
    assert!(first.to_string().contains("image late is being downloaded to host local"), "{first}");
    release_late.send(true).expect("the server holds the image");
    let past = until(|| background.create(&late), |error| !error.to_string().contains("being downloaded")).await;
    assert!(!past.to_string().contains("image"), "{past}");
    assert!(pool_volumes(&uri, POOL).contains(&names::marker_volume("late", &late_sha)));
    assert_eq!(server.hits("late.img"), 1);
    let wrong = CreateRequest { image: Some("wrong".into()), ..request("px-wrong") };
    assert_eq!(background.create(&wrong).await.expect_err("started").class(), ErrorClass::Transient);
    let failed = until(|| background.create(&wrong), |error| error.class() != ErrorClass::Transient).await;
    assert_eq!(failed.class(), ErrorClass::Permanent, "{failed}");
    assert!(failed.to_string().contains("sha256"), "{failed}");

    // A delete collects older checksums of the provider's images once no guest uses them, and nothing else.
    let stale = names::base_volume("late", &"1".repeat(64));
    let stale_in_use = names::base_volume("late", &"2".repeat(64));
    let foreign = names::base_volume("other", &"3".repeat(64));
    for name in [&stale, &stale_in_use, &foreign] {
        images::put_volume(&host, name, vec![7; 4096]).await.expect("a stale base");
        images::put_volume(&host, &format!("{name}.done"), Vec::new()).await.expect("its marker");
    }
    let in_use_path = pool_dir.join(&stale_in_use).display().to_string();
    images::create_overlay(&host, "px-keep.qcow2", &in_use_path, "raw", 1 << 20).await.expect("an overlay on it");
    background.delete("hosts/local/domains/px-nothing").await.expect("delete");
    let left = pool_volumes(&uri, POOL);
    assert!(!left.contains(&stale) && !left.contains(&format!("{stale}.done")), "the outdated base goes: {left:?}");
    for kept in [&stale_in_use, &foreign, &names::base_volume("late", &late_sha), &base_name] {
        assert!(left.contains(kept), "{kept} stays: {left:?}");
    }

    // A create that cannot start a guest (no KVM here) leaves neither a domain nor its volumes.
    let provider = KvmProvider::new(config(
        vec![local_host(&daemon, POOL)],
        ssh(None),
        BTreeMap::from([("good".to_owned(), good.clone())]),
    ))
    .expect("provider");
    let error = provider.create(&seeded).await.expect_err("no guest can be defined or started here");
    assert_ne!(error.class(), ErrorClass::NotFound, "{error}");
    let left = pool_volumes(&uri, POOL);
    assert!(!left.iter().any(|name| name.starts_with("px-seed.")), "no overlay left: {left:?}");
    assert_eq!(provider.get("hosts/local/domains/px-seed").await.expect_err("no domain").class(), ErrorClass::NotFound);
    provider.delete("hosts/local/domains/px-seed").await.expect("deleting what is not there succeeds");
    assert!(!pool_volumes(&uri, POOL).contains(&"px-seed-seed.iso".to_owned()), "delete removes the seed volume");

    // The checker, then a dropped connection: the daemon restarts and the next call dials again.
    let verdicts = provider.check().await;
    assert!(verdicts[0].ready, "{verdicts:?}");
    let version = host.call("getLibVersion", "", |conn| conn.get_lib_version()).await.expect("version");
    daemon.restart();
    let again = host.call("getLibVersion", "", |conn| conn.get_lib_version()).await.expect("redialled");
    assert_eq!(again, version);
    // libvirtd reloads a running transient pool after a restart, so the checker still says ready; a host whose pool
    // does not exist is reported as such.
    assert!(provider.check().await[0].ready);
    let missing =
        KvmProvider::new(config(vec![local_host(&daemon, "absent")], ssh(None), BTreeMap::new())).expect("provider");
    let verdicts = missing.check().await;
    assert_eq!(verdicts[0].reason.as_deref(), Some("PoolMissing"), "{verdicts:?}");
}

#[tokio::test]
async fn over_ssh_with_a_checked_host_key() {
    let _serial = exclusive().await;
    let mut daemon = Libvirtd::start();
    daemon.dir_pool(POOL);
    let sshd = Sshd::start();
    let server = ImageServer::start().await;
    let (url, sha) = server.put("ssh.img", image_bytes(1 << 20, 3));
    let images = BTreeMap::from([("ssh".to_owned(), image(&url, &sha))]);

    let provider =
        KvmProvider::new(config(vec![ssh_host(&daemon, &sshd)], ssh(Some(&sshd)), images.clone())).expect("provider");
    let verdicts = provider.check().await;
    assert!(verdicts[0].ready, "{verdicts:?}\nsshd: {}\nlibvirtd: {}", sshd.log(), daemon.log());

    // The image travels through the SSH connection into the pool.
    let host = Arc::new(Host::new(&ssh_host(&daemon, &sshd), &ssh(Some(&sshd))));
    let base = ImageCache::new(egress_provider_kvm::http_client().expect("client"))
        .ensure(&host, "ssh", &image(&url, &sha))
        .await
        .expect("over ssh");
    assert_eq!(file_sha(&base), sha);

    // A host key that is not the one in known_hosts is refused.
    let mut wrong = ssh(Some(&sshd));
    wrong.known_hosts_file = sshd.path("wrong_known_hosts");
    let provider = KvmProvider::new(config(vec![ssh_host(&daemon, &sshd)], wrong, images.clone())).expect("provider");
    let verdicts = provider.check().await;
    assert!(!verdicts[0].ready, "{verdicts:?}");
    let error = provider.get("hosts/remote/domains/px-a").await.expect_err("refused");
    assert_eq!(error.class(), ErrorClass::Permanent, "{error}");

    // A host missing from known_hosts altogether is refused as well: nothing is accepted unchecked.
    std::fs::write(sshd.path("empty_known_hosts"), "").expect("an empty known_hosts");
    let mut unknown = ssh(Some(&sshd));
    unknown.known_hosts_file = sshd.path("empty_known_hosts");
    let provider = KvmProvider::new(config(vec![ssh_host(&daemon, &sshd)], unknown, images.clone())).expect("provider");
    let error = provider.get("hosts/remote/domains/px-a").await.expect_err("refused");
    assert_eq!(error.class(), ErrorClass::Permanent, "{error}");
    assert!(error.to_string().contains("knownHostsFile"), "{error}");

    // No key file yet: Transient, naming the file (a Secret mounted later heals it).
    let mut keyless = ssh(Some(&sshd));
    keyless.private_key_file = sshd.path("not-yet");
    let provider = KvmProvider::new(config(vec![ssh_host(&daemon, &sshd)], keyless, images)).expect("provider");
    let error = provider.get("hosts/remote/domains/px-a").await.expect_err("no key");
    assert_eq!(error.class(), ErrorClass::Transient);
    assert!(error.to_string().contains("not-yet"), "{error}");
}
