//! What the aws provider logs, at every level, never holds the user data, the secret key or a session token. A test
//! binary of its own: the subscriber is the process-wide default, so every callsite (ours, reqwest's, hyper's) is
//! enabled whatever other tests' scoped subscribers cached.

use base64::Engine;
use egress_provider::{CreateRequest, Provider, Sensitive, Tags};
use egress_provider_aws::credentials::CredentialChain;
use egress_provider_aws::{AwsConfig, AwsProvider};
use egress_testenv::captured::Captured;
use egress_testenv::moto::MotoServer;

const USER_DATA: &str = "#cloud-config\nchpasswd: {list: 'root:the-user-data-marker-5e1b'}\n";
const SECRET_KEY: &str = "the-secret-key-marker-93c2";
const SESSION_TOKEN: &str = "the-session-token-marker-41d0";

#[tokio::test]
async fn no_secret_reaches_a_log() {
    let captured = Captured::default();
    let writer = captured.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::TRACE)
            .finish(),
    )
    .expect("the only subscriber in this binary");

    let moto = MotoServer::start().await.expect("moto");
    let aws = |config: AwsConfig| {
        AwsProvider::with_credentials(config, |http| {
            let env = |name: &str| match name {
                "AWS_ACCESS_KEY_ID" => Some("AKIAEGRESSLOG0000001".to_owned()),
                "AWS_SECRET_ACCESS_KEY" => Some(SECRET_KEY.to_owned()),
                "AWS_SESSION_TOKEN" => Some(SESSION_TOKEN.to_owned()),
                _ => None,
            };
            CredentialChain::discover(&env, None, moto.url(), http)
        })
        .expect("the provider builds")
    };
    let base = |subnet: &str| AwsConfig {
        default_image_id: Some("ami-12c6146b".into()),
        endpoint: Some(moto.url()),
        ..AwsConfig::new("us-east-1", subnet, vec!["198.51.100.0/24".parse().unwrap()])
    };
    let (_, subnet) = moto.vpc_with_subnet("10.30.0.0/16", "10.30.1.0/24").await.expect("a VPC and a subnet");
    let provider = aws(base(&subnet));
    let mut request = CreateRequest::new("px-logged", 3128, Tags::gc_contract("c1", "uid-1", "hash1"));
    request.cloud_init = Some(Sensitive::new(USER_DATA.as_bytes().to_vec()));
    let created = provider.create(&request).await.expect("create");
    provider.get(&created.provider_id).await.expect("get");
    let mut failing = request.clone();
    failing.name = "px-logged-2".into();
    failing.image = Some("not-an-ami".into());
    let _ = provider.create(&failing).await;
    provider.delete(&created.provider_id).await.expect("delete");

    let text = captured.text();
    assert!(text.contains("EC2 call"), "the calls are logged:\n{text}");
    assert!(text.contains("RunInstances"), "{text}");
    let encoded = base64::engine::general_purpose::STANDARD.encode(USER_DATA);
    for secret in ["the-user-data-marker-5e1b", "chpasswd", &encoded[..40], SECRET_KEY, SESSION_TOKEN] {
        assert!(!text.contains(secret), "{secret:?} reached the log:\n{text}");
    }
}
