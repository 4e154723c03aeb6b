//! External-cluster mode (`EGRESS_TEST_KUBECONFIG`, used by `cargo xtask e2e --kind`), exercised against a local
//! control plane playing the external cluster: the CRDs are applied, clients work, an impersonating kubeconfig
//! authenticates as the named identity, and dropping the external handle leaves the cluster running.

use egress_testenv::ControlPlane;
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

async fn client_for(path: &std::path::Path) -> Client {
    let kubeconfig = Kubeconfig::read_from(path).expect("the kubeconfig parses");
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.expect("config");
    Client::try_from(config).expect("client")
}

async fn whoami(client: Client) -> (String, Vec<String>) {
    let review = Api::<SelfSubjectReview>::all(client)
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
        .expect("a SelfSubjectReview");
    let user = review.status.and_then(|status| status.user_info).expect("user info");
    (user.username.unwrap_or_default(), user.groups.unwrap_or_default())
}

#[tokio::test]
async fn an_external_cluster_gets_the_crds_and_impersonating_kubeconfigs() {
    let local = ControlPlane::start().await.expect("the local control plane starts");
    // Remove a CRD so the external start has to apply it again.
    let crds: Api<CustomResourceDefinition> = Api::all(local.client().await.expect("client"));
    let uid = crds.get("proxies.crawl.example.com").await.expect("the Proxy CRD").metadata.uid.expect("a uid");
    crds.delete("proxies.crawl.example.com", &Default::default()).await.expect("delete the Proxy CRD");
    // Wait for this very object to be gone: `is_deleted("")` holds at once for any object (its UID is never ""),
    // and applying the CRD again while the old one still terminates patches the dying object, which then never
    // becomes Established.
    kube::runtime::wait::await_condition(
        crds.clone(),
        "proxies.crawl.example.com",
        kube::runtime::wait::conditions::is_deleted(&uid),
    )
    .await
    .expect("the CRD goes");

    let external = ControlPlane::external(local.kubeconfig_path()).await.expect("the external cluster is usable");
    assert!(external.is_external());
    assert!(!local.is_external());
    assert_eq!(external.server_url(), local.server_url());
    assert!(crds.get_opt("proxies.crawl.example.com").await.expect("get").is_some(), "the CRDs are applied again");
    assert!(external.apiserver_log_tail(5).contains("external cluster"));

    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("impersonating");
    external
        .write_kubeconfig_as(&path, "system:serviceaccount:egress-system:egress-operator", &["system:authenticated"])
        .expect("write the kubeconfig");
    let (user, groups) = whoami(client_for(&path).await).await;
    assert_eq!(user, "system:serviceaccount:egress-system:egress-operator");
    assert!(groups.contains(&"system:authenticated".to_owned()), "{groups:?}");
    // kubectl reads it too.
    let output = std::process::Command::new("kubectl")
        .arg(format!("--kubeconfig={}", path.display()))
        .args(["auth", "whoami", "-o", "jsonpath={.status.userInfo.username}"])
        .output()
        .expect("kubectl runs");
    assert_eq!(String::from_utf8_lossy(&output.stdout), user, "{}", String::from_utf8_lossy(&output.stderr));

    drop(external);
    let (admin, _) = whoami(local.client().await.expect("client")).await;
    assert_eq!(admin, "egress-testenv-admin", "dropping the external handle leaves the cluster running");
}
