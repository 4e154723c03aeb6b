//! The aws provider against moto's EC2 and STS emulator (`moto.server`, a real implementation of the Query API that
//! boto3 is tested against), over HTTP on loopback: every call is signed, encoded and parsed as it would be for AWS.
//! moto starts instances at once and gives them addresses it makes up; nothing is sent to them.

use std::sync::Arc;

use base64::Engine;
use egress_provider::{Checker, Instance};
use egress_provider::{CreateRequest, ErrorClass, InstanceState, Provider, ProviderError, Tags};
use egress_provider_aws::credentials::CredentialChain;
use egress_provider_aws::ec2::Ec2;
use egress_provider_aws::model::{self, child_text, items};
use egress_provider_aws::{AddressKind, AwsConfig, AwsProvider};
use egress_testenv::moto::MotoServer;

const REGION: &str = "us-east-1";
/// One of the AMIs moto knows.
const IMAGE: &str = "ami-12c6146b";
const KEY_ID: &str = "AKIAEGRESSTEST000001";
const SECRET: &str = "egress-test-secret-never-logged";

/// A moto server with a VPC and a subnet in it.
struct World {
    moto: MotoServer,
    subnet: String,
    vpc: String,
}

fn static_keys(http: reqwest::Client) -> Result<CredentialChain, ProviderError> {
    let env = |name: &str| match name {
        "AWS_ACCESS_KEY_ID" => Some(KEY_ID.to_owned()),
        "AWS_SECRET_ACCESS_KEY" => Some(SECRET.to_owned()),
        _ => None,
    };
    CredentialChain::discover(&env, None, "http://127.0.0.1:1".into(), http)
}

fn config(world: &World) -> AwsConfig {
    AwsConfig {
        default_image_id: Some(IMAGE.into()),
        endpoint: Some(world.moto.url()),
        sts_endpoint: Some(world.moto.url()),
        ..AwsConfig::new(REGION, world.subnet.clone(), vec!["198.51.100.0/24".parse().unwrap()])
    }
}

fn provider(config: AwsConfig) -> AwsProvider {
    AwsProvider::with_credentials(config, static_keys).expect("the provider builds")
}

/// The first `tag` in a creation answer.
fn created(text: &str, tag: &str) -> String {
    let document = model::parse(text).expect("XML");
    document
        .descendants()
        .find(|node| node.has_tag_name(tag))
        .and_then(|node| node.text())
        .unwrap_or_else(|| panic!("no {tag} in {text}"))
        .to_owned()
}

/// Starts moto with a VPC of `cidr` and a subnet of `subnet_cidr`.
async fn world_with(cidr: &str, subnet_cidr: &str) -> World {
    let moto = MotoServer::start().await.expect("moto starts");
    let (vpc, subnet) = moto.vpc_with_subnet(cidr, subnet_cidr).await.expect("a VPC and a subnet");
    World { moto, subnet, vpc }
}

async fn world() -> World {
    world_with("10.20.0.0/16", "10.20.1.0/24").await
}

fn request(name: &str, cluster: &str, port: u16) -> CreateRequest {
    CreateRequest::new(name, port, Tags::gc_contract(cluster, &format!("uid-{name}"), "hash1"))
}

/// Every instance moto holds, as the provider reads them, terminated ones included.
async fn all_instances(aws: &AwsProvider) -> Vec<Instance> {
    let text = aws.ec2().call(&Ec2::form("DescribeInstances"), "all").await.expect("DescribeInstances");
    let document = model::parse(&text).unwrap();
    model::instance_nodes(&document)
        .into_iter()
        .map(|node| model::instance_of(REGION, node, AddressKind::Public))
        .collect()
}

#[tokio::test]
async fn an_instance_is_launched_observed_listed_and_terminated() {
    let world = world().await;
    let aws = provider(config(&world));
    let launched = aws.create(&request("px-life", "c1", 3128)).await.expect("create");
    assert_eq!(launched.name, "px-life");
    let (region, id) = model::parse_provider_id(&launched.provider_id).expect("a provider ID");
    assert_eq!(region, REGION);
    assert!(id.starts_with("i-"), "{id}");
    assert_eq!(launched.tags, Tags::gc_contract("c1", "uid-px-life", "hash1"));

    let observed = aws.get(&launched.provider_id).await.expect("get");
    assert_eq!(observed.state, InstanceState::Running, "moto runs instances at once");
    assert!(observed.ip.is_some_and(|ip| !ip.is_loopback()), "a public address: {:?}", observed.ip);
    assert_eq!((observed.name.as_str(), &observed.tags), ("px-life", &launched.tags));
    assert!(observed.created_at.is_some());

    // A foreign instance in the same account and one of another cluster are never listed.
    let mut foreign = Ec2::form("RunInstances");
    foreign.push("ImageId", IMAGE).push("MinCount", "1").push("MaxCount", "1").push("SubnetId", world.subnet.as_str());
    aws.ec2().call(&foreign, "foreign").await.expect("a foreign instance");
    aws.create(&request("px-other", "c2", 3128)).await.expect("another cluster's");
    let listed = aws.list_by_tag(&Tags::owned_by_cluster("c1")).await.expect("list");
    assert_eq!(listed.iter().map(|i| i.provider_id.as_str()).collect::<Vec<_>>(), [launched.provider_id.as_str()]);

    aws.delete(&launched.provider_id).await.expect("delete");
    let gone = aws.get(&launched.provider_id).await.expect("a terminated instance is still described");
    assert_eq!((gone.state, gone.ip), (InstanceState::Terminated, None));
    aws.delete(&launched.provider_id).await.expect("deleting again succeeds");
    assert!(aws.list_by_tag(&Tags::owned_by_cluster("c1")).await.expect("list").is_empty(), "terminated: not listed");
    let missing = aws.get(&model::provider_id(REGION, "i-0123456789abcdef0")).await.expect_err("unknown");
    assert_eq!(missing.class(), ErrorClass::NotFound, "{missing}");
    aws.delete(&model::provider_id(REGION, "i-0123456789abcdef0")).await.expect("deleting an unknown instance");
}

#[tokio::test]
async fn a_second_create_adopts_the_first_instance() {
    let world = world().await;
    let aws = provider(config(&world));
    let first = aws.create(&request("px-twice", "c1", 3128)).await.expect("create");
    // As after a crash between the launch and recording its ID: a fresh provider asks again.
    let again = provider(config(&world)).create(&request("px-twice", "c1", 3128)).await.expect("create again");
    assert_eq!(again.provider_id, first.provider_id);
    let named: Vec<_> = all_instances(&aws).await.into_iter().filter(|i| i.name == "px-twice").collect();
    assert_eq!(named.len(), 1, "one instance: {named:?}");
    // A terminated instance of that name is not adopted: the next create launches a new one.
    aws.delete(&first.provider_id).await.expect("delete");
    let relaunched = aws.create(&request("px-twice", "c1", 3128)).await.expect("create after terminate");
    assert_ne!(relaunched.provider_id, first.provider_id);
}

/// The group's (port, CIDR) ingress rules and the groups on an instance's interface.
async fn group_rules(aws: &AwsProvider, vpc: &str, name: &str) -> (String, Vec<(String, String)>) {
    let mut form = Ec2::form("DescribeSecurityGroups");
    form.filter("vpc-id", &[vpc]).filter("group-name", &[name]);
    let text = aws.ec2().call(&form, name).await.expect("DescribeSecurityGroups");
    let document = model::parse(&text).unwrap();
    let group = items(document.root_element(), "securityGroupInfo").next().expect("the group exists");
    let mut rules = Vec::new();
    for permission in items(group, "ipPermissions") {
        let port = child_text(permission, "fromPort").unwrap_or_default().to_owned();
        for range in items(permission, "ipRanges") {
            rules.push((port.clone(), child_text(range, "cidrIp").unwrap_or_default().to_owned()));
        }
    }
    rules.sort();
    (child_text(group, "groupId").unwrap().to_owned(), rules)
}

#[tokio::test]
async fn the_security_group_admits_the_allowed_sources_on_each_proxy_port_only() {
    let world = world().await;
    let mut extra = Ec2::form("CreateSecurityGroup");
    extra.push("GroupName", "team-extra").push("GroupDescription", "the user's own").push("VpcId", world.vpc.as_str());
    let aws = provider(config(&world));
    let extra = created(&aws.ec2().call(&extra, "extra").await.expect("CreateSecurityGroup"), "groupId");
    let aws = provider(AwsConfig { security_group_ids: vec![extra.clone()], ..config(&world) });
    let a = aws.create(&request("px-sg-a", "c1", 3128)).await.expect("create");
    aws.create(&request("px-sg-b", "c1", 8080)).await.expect("create on another port");
    let (group, rules) = group_rules(&aws, &world.vpc, "egress-operator-c1").await;
    assert_eq!(
        rules,
        [("3128".to_owned(), "198.51.100.0/24".to_owned()), ("8080".to_owned(), "198.51.100.0/24".to_owned())]
    );
    // The instance's interface carries the provider's group and the user's.
    let mut form = Ec2::form("DescribeInstances");
    form.push("InstanceId.1", model::parse_provider_id(&a.provider_id).unwrap().1);
    let text = aws.ec2().call(&form, "a").await.unwrap();
    let document = model::parse(&text).unwrap();
    let node = model::instance_nodes(&document)[0];
    let mut groups: Vec<String> = items(node, "networkInterfaceSet")
        .flat_map(|interface| items(interface, "groupSet"))
        .filter_map(|item| child_text(item, "groupId").map(str::to_owned))
        .collect();
    groups.sort();
    let mut expected = vec![group.clone(), extra];
    expected.sort();
    assert_eq!(groups, expected);

    // A changed allowedSources: after a restart, the next launch on the port sets its rules to the new list.
    let changed = provider(AwsConfig {
        allowed_sources: vec!["203.0.113.0/24".parse().unwrap(), "192.0.2.8/32".parse().unwrap()],
        ..config(&world)
    });
    changed.create(&request("px-sg-c", "c1", 3128)).await.expect("create");
    let (same, rules) = group_rules(&aws, &world.vpc, "egress-operator-c1").await;
    assert_eq!(same, group, "one group per cluster and VPC");
    assert_eq!(
        rules,
        [
            ("3128".to_owned(), "192.0.2.8/32".to_owned()),
            ("3128".to_owned(), "203.0.113.0/24".to_owned()),
            ("8080".to_owned(), "198.51.100.0/24".to_owned()),
        ]
    );
}

#[tokio::test]
async fn the_launch_carries_the_cloud_init_tags_type_and_image() {
    let world = world().await;
    let aws = provider(config(&world));
    let mut proxy = request("px-body", "c1", 3130);
    proxy.machine_type = Some("t3.small".into());
    let launched = aws.create(&proxy).await.expect("create");
    let id = model::parse_provider_id(&launched.provider_id).unwrap().1.to_owned();
    let mut form = Ec2::form("DescribeInstanceAttribute");
    form.push("InstanceId", id.as_str()).push("Attribute", "userData");
    let text = aws.ec2().call(&form, "userData").await.expect("userData");
    let encoded = created(&text, "value");
    let user_data = String::from_utf8(base64::engine::general_purpose::STANDARD.decode(encoded).unwrap()).unwrap();
    assert!(user_data.starts_with("#cloud-config"), "{user_data}");
    assert!(user_data.contains("http_port 3130"), "Squid listens on the Proxy's port: {user_data}");

    let mut form = Ec2::form("DescribeInstances");
    form.push("InstanceId.1", id.as_str());
    let text = aws.ec2().call(&form, "body").await.unwrap();
    assert_eq!(created(&text, "instanceType"), "t3.small");
    assert_eq!(created(&text, "imageId"), IMAGE);
    let document = model::parse(&text).unwrap();
    let node = model::instance_nodes(&document)[0];
    let tags: Vec<(String, String)> = items(node, "tagSet")
        .map(|item| (child_text(item, "key").unwrap().to_owned(), child_text(item, "value").unwrap().to_owned()))
        .collect();
    for expected in [("Name", "px-body"), ("egress-cluster", "c1"), ("egress-managed-by", "egress-operator")] {
        assert!(tags.iter().any(|(key, value)| (key.as_str(), value.as_str()) == expected), "{expected:?} in {tags:?}");
    }
}

#[tokio::test]
async fn the_orphan_listing_pages_through_every_instance() {
    let world = world().await;
    let aws = provider(config(&world)).with_page_size(5);
    let mut made = Vec::new();
    for index in 0..7 {
        made.push(aws.create(&request(&format!("px-page-{index}"), "c1", 3128)).await.expect("create").provider_id);
    }
    made.sort();
    let listed: Vec<String> = aws
        .list_by_tag(&Tags::owned_by_cluster("c1"))
        .await
        .expect("list")
        .into_iter()
        .map(|i| i.provider_id)
        .collect();
    assert_eq!(listed, made);
}

#[tokio::test]
async fn mistakes_are_permanent_errors_that_say_what_to_fix() {
    let world = world().await;
    let aws = provider(config(&world));
    let mut zone = request("px-zone", "c1", 3128);
    zone.zone = Some("us-east-1a".into());
    let error = aws.create(&zone).await.expect_err("a zone is not a subnet");
    assert_eq!(error.class(), ErrorClass::Permanent);
    assert!(error.to_string().contains("not a subnet ID"), "{error}");

    let mut subnet = request("px-subnet", "c1", 3128);
    subnet.zone = Some("subnet-0123456789abcdef0".into());
    let error = aws.create(&subnet).await.expect_err("an unknown subnet");
    assert_eq!(error.class(), ErrorClass::Permanent, "{error}");
    assert!(error.to_string().contains("InvalidSubnetID.NotFound"), "{error}");

    let no_image = provider(AwsConfig { default_image_id: None, ..config(&world) });
    let error = no_image.create(&request("px-image", "c1", 3128)).await.expect_err("no AMI");
    assert!(error.to_string().contains("aws.defaultImageId"), "{error}");

    let error = aws.get("regions/eu-west-1/instances/i-0123456789abcdef0").await.expect_err("another region");
    assert_eq!(error.class(), ErrorClass::Permanent);
    assert!(error.to_string().contains("this provider manages us-east-1"), "{error}");
    let error = aws.get("projects/p/zones/z/instances/x").await.expect_err("not an aws ID");
    assert_eq!(error.class(), ErrorClass::Permanent);
}

#[tokio::test]
async fn the_checker_reports_a_working_region_a_missing_subnet_and_no_answer() {
    let world = world().await;
    let verdicts = provider(config(&world)).check().await;
    assert_eq!(verdicts.len(), 1);
    assert!(verdicts[0].ready, "{verdicts:?}");
    assert_eq!(verdicts[0].target, "regions/us-east-1");

    let missing = provider(AwsConfig { subnet_id: "subnet-0123456789abcdef0".into(), ..config(&world) }).check().await;
    assert_eq!(missing[0].reason.as_deref(), Some("SubnetNotFound"), "{missing:?}");

    // A closed port: nothing listens there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let nowhere = provider(AwsConfig { endpoint: Some(format!("http://{closed}")), ..config(&world) });
    let verdicts = nowhere.check().await;
    assert_eq!(verdicts[0].reason.as_deref(), Some("Unreachable"), "{verdicts:?}");
    let error = nowhere.get(&model::provider_id(REGION, "i-0123456789abcdef0")).await.expect_err("no answer");
    assert_eq!(error.class(), ErrorClass::Transient, "{error}");
}

#[tokio::test]
async fn web_identity_credentials_come_from_sts() {
    let world = world().await;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "eyJhbGciOiJSUzI1NiJ9.e30.c2lnbmF0dXJl\n").unwrap();
    let token_path = token.display().to_string();
    let sts = world.moto.url();
    let aws = Arc::new(
        AwsProvider::with_credentials(config(&world), |http| {
            let env = |name: &str| match name {
                "AWS_WEB_IDENTITY_TOKEN_FILE" => Some(token_path.clone()),
                "AWS_ROLE_ARN" => Some("arn:aws:iam::123456789012:role/egress-operator".to_owned()),
                _ => None,
            };
            CredentialChain::discover(&env, None, sts.clone(), http)
        })
        .expect("the provider builds"),
    );
    assert!(format!("{aws:?}").contains("web identity"), "{aws:?}");
    let launched = aws.create(&request("px-irsa", "c1", 3128)).await.expect("create with assumed-role keys");
    assert_eq!(aws.get(&launched.provider_id).await.expect("get").state, InstanceState::Running);

    // A token file that is gone is a permanent error naming the file, not the token.
    std::fs::remove_file(&token).unwrap();
    let fresh = AwsProvider::with_credentials(config(&world), |http| {
        let env = |name: &str| match name {
            "AWS_WEB_IDENTITY_TOKEN_FILE" => Some(token_path.clone()),
            "AWS_ROLE_ARN" => Some("arn:aws:iam::123456789012:role/egress-operator".to_owned()),
            _ => None,
        };
        CredentialChain::discover(&env, None, world.moto.url(), http)
    })
    .expect("the provider builds");
    let error = fresh.get(&launched.provider_id).await.expect_err("no token");
    assert_eq!(error.class(), ErrorClass::Permanent, "{error}");
    assert!(error.to_string().contains("reading the web identity token"), "{error}");
    let verdicts = fresh.check().await;
    assert_eq!(verdicts[0].reason.as_deref(), Some("CredentialsUnusable"), "{verdicts:?}");
}

#[tokio::test]
async fn a_private_address_is_the_instances_own_in_the_vpc() {
    // A VPC on loopback, so the address moto gives is one a local Squid could listen on.
    let world = world_with("127.0.0.0/16", "127.0.42.0/24").await;
    let aws = provider(AwsConfig { address: AddressKind::Private, ..config(&world) });
    let launched = aws.create(&request("px-private", "c1", 3128)).await.expect("create");
    let observed = aws.get(&launched.provider_id).await.expect("get");
    let ip = observed.ip.expect("an address");
    assert!(ip.to_string().starts_with("127.0.42."), "{ip}");
    assert_eq!(observed.state, InstanceState::Running);
}

/// The IAM policy of docs/providers/aws.md: its first JSON block.
fn documented_policy() -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/providers/aws.md");
    let text = std::fs::read_to_string(path).expect("docs/providers/aws.md");
    let block = text.split("```json\n").nth(1).and_then(|rest| rest.split("\n```").next()).expect("a JSON block");
    serde_json::from_str(block).expect("the policy is JSON")
}

/// The policy's actions only, with `Resource: *` and no conditions: what moto evaluates.
fn actions_of(policy: &serde_json::Value, without: &str) -> serde_json::Value {
    let mut actions: Vec<String> = Vec::new();
    for statement in policy["Statement"].as_array().expect("statements") {
        assert_eq!(statement["Effect"], "Allow");
        match &statement["Action"] {
            serde_json::Value::String(action) => actions.push(action.clone()),
            serde_json::Value::Array(list) => actions.extend(list.iter().filter_map(|a| a.as_str().map(str::to_owned))),
            other => panic!("an Action of {other}"),
        }
    }
    actions.retain(|action| action != without);
    actions.sort();
    actions.dedup();
    serde_json::json!({ "Version": "2012-10-17", "Statement": [{ "Effect": "Allow", "Action": actions, "Resource": "*" }] })
}

/// Makes an IAM user allowed `policy` and returns its keys; moto answers unsigned IAM calls until auth is on.
async fn iam_user(moto: &MotoServer, name: &str, policy: &serde_json::Value) -> (String, String) {
    let http = reqwest::Client::new();
    let keys = aws_credential_types::Credentials::new(KEY_ID, SECRET, None, None, "test");
    let iam = |form: egress_provider_aws::query::Form| {
        let (http, url, keys) = (http.clone(), moto.url(), keys.clone());
        async move {
            egress_provider_aws::query::post(&http, &url, form.encode(), Some((&keys, REGION)), "iam")
                .await
                .unwrap_or_else(|error| panic!("IAM: {error:?}"))
        }
    };
    let form = |action: &str| egress_provider_aws::query::Form::new(action, "2010-05-08");
    let mut user = form("CreateUser");
    user.push("UserName", name);
    iam(user).await;
    let mut attach = form("PutUserPolicy");
    attach.push("UserName", name).push("PolicyName", "egress-operator").push("PolicyDocument", policy.to_string());
    iam(attach).await;
    let mut key = form("CreateAccessKey");
    key.push("UserName", name);
    let answer = iam(key).await;
    (created(&answer, "AccessKeyId"), created(&answer, "SecretAccessKey"))
}

/// From now on moto checks every request's signature and the caller's policy.
async fn enforce_auth(moto: &MotoServer) {
    let answer = reqwest::Client::new()
        .post(format!("{}/moto-api/reset-auth", moto.url()))
        .body("0")
        .send()
        .await
        .expect("reset-auth");
    assert!(answer.status().is_success(), "{answer:?}");
}

fn keyed(config: AwsConfig, (key, secret): (String, String)) -> AwsProvider {
    AwsProvider::with_credentials(config, move |http| {
        let env = move |name: &str| match name {
            "AWS_ACCESS_KEY_ID" => Some(key.clone()),
            "AWS_SECRET_ACCESS_KEY" => Some(secret.clone()),
            _ => None,
        };
        CredentialChain::discover(&env, None, "http://127.0.0.1:1".into(), http)
    })
    .expect("the provider builds")
}

#[tokio::test]
async fn the_documented_iam_policy_is_enough_and_every_call_is_signed_correctly() {
    let world = world().await;
    let policy = documented_policy();
    let allowed = iam_user(&world.moto, "egress-operator", &actions_of(&policy, "")).await;
    let no_subnets = iam_user(&world.moto, "no-subnets", &actions_of(&policy, "ec2:DescribeSubnets")).await;
    let no_launch = iam_user(&world.moto, "no-launch", &actions_of(&policy, "ec2:RunInstances")).await;
    enforce_auth(&world.moto).await;

    let allowed_key = allowed.0.clone();
    let aws = keyed(config(&world), allowed.clone());
    let verdicts = aws.check().await;
    assert!(verdicts[0].ready, "{verdicts:?}");
    let launched = aws.create(&request("px-iam", "c1", 3128)).await.expect("create under the documented policy");
    assert_eq!(aws.get(&launched.provider_id).await.expect("get").state, InstanceState::Running);
    assert_eq!(aws.list_by_tag(&Tags::owned_by_cluster("c1")).await.expect("list").len(), 1);
    // A changed allowedSources revokes as well as authorizes, under the same policy.
    let moved =
        keyed(AwsConfig { allowed_sources: vec!["203.0.113.0/24".parse().unwrap()], ..config(&world) }, allowed);
    moved.create(&request("px-iam-2", "c1", 3128)).await.expect("a second launch, rules changed");
    aws.delete(&launched.provider_id).await.expect("delete");

    // A wrong secret: moto checks the signature.
    let forged = keyed(config(&world), (allowed_key, "not-the-secret".to_owned()));
    let error = forged.get(&launched.provider_id).await.expect_err("a bad signature");
    assert_eq!(error.class(), ErrorClass::Permanent, "{error}");
    assert!(!error.to_string().contains("not-the-secret"), "{error}");

    let verdicts = keyed(config(&world), no_subnets).check().await;
    assert_eq!(verdicts[0].reason.as_deref(), Some("PermissionDenied"), "{verdicts:?}");
    let error = keyed(config(&world), no_launch).create(&request("px-denied", "c1", 3128)).await.expect_err("denied");
    assert_eq!(error.class(), ErrorClass::Permanent, "{error}");
    // EC2 says UnauthorizedOperation; moto says AccessDenied, as IAM would.
    assert!(error.to_string().contains("not authorized to perform: ec2:RunInstances"), "{error}");
}
