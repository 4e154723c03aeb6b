//! EC2's XML answers read into the provider contract's types.

use std::net::IpAddr;
use std::time::SystemTime;

use egress_provider::{Instance, InstanceState, ProviderError, Tags};
use roxmltree::{Document, Node};

use crate::config::AddressKind;

/// EC2 tag keys carrying the GC contract are the contract's keys with this prefix.
pub const TAG_PREFIX: &str = "egress-";
/// The tag the console shows as an instance's name; the operator's instance name.
pub const NAME_TAG: &str = "Name";

/// Parses an answer.
///
/// # Errors
/// A document that is not XML (Transient: a proxy or a load balancer answered, not EC2).
pub fn parse(text: &str) -> Result<Document<'_>, ProviderError> {
    Document::parse(text)
        .map_err(|error| ProviderError::transient("EC2 answered with XML that does not parse").with_source(error))
}

/// The text of the direct child `name` of `node`.
pub fn child_text<'a>(node: Node<'a, '_>, name: &str) -> Option<&'a str> {
    node.children().find(|child| child.has_tag_name(name)).and_then(|child| child.text())
}

/// The direct child `name` of `node`.
pub fn child<'a, 'input>(node: Node<'a, 'input>, name: &str) -> Option<Node<'a, 'input>> {
    node.children().find(|child| child.has_tag_name(name))
}

/// The `<item>` children of the direct child `set` of `node` (`instancesSet`, `tagSet`…).
pub fn items<'a, 'input>(node: Node<'a, 'input>, set: &str) -> impl Iterator<Item = Node<'a, 'input>> {
    child(node, set).into_iter().flat_map(|set| set.children().filter(|item| item.has_tag_name("item")))
}

/// Every instance in a RunInstances (`instancesSet`) or DescribeInstances (`reservationSet/item/instancesSet`)
/// answer.
pub fn instance_nodes<'a, 'input>(document: &'a Document<'input>) -> Vec<Node<'a, 'input>> {
    let root = document.root_element();
    let mut nodes: Vec<Node<'a, 'input>> = items(root, "instancesSet").collect();
    for reservation in items(root, "reservationSet") {
        nodes.extend(items(reservation, "instancesSet"));
    }
    nodes
}

/// The `nextToken` of a paged answer, when there is another page.
pub fn next_token<'a>(document: &'a Document<'_>) -> Option<&'a str> {
    child_text(document.root_element(), "nextToken").filter(|token| !token.is_empty())
}

/// The GC contract as EC2 tags (`egress-cluster` …).
pub fn tag_pairs(tags: &Tags) -> Vec<(String, String)> {
    tags.iter().map(|(key, value)| (format!("{TAG_PREFIX}{key}"), value.to_owned())).collect()
}

/// The provider ID of instance `id` in `region`.
pub fn provider_id(region: &str, id: &str) -> String {
    format!("regions/{region}/instances/{id}")
}

/// Splits `regions/<region>/instances/<id>`.
///
/// # Errors
/// Anything else (Permanent).
pub fn parse_provider_id(provider_id: &str) -> Result<(&str, &str), ProviderError> {
    match provider_id.split('/').collect::<Vec<_>>().as_slice() {
        ["regions", region, "instances", id] if !region.is_empty() && id.starts_with("i-") => Ok((region, id)),
        _ => Err(ProviderError::permanent(format!(
            "{provider_id:?} is not an aws provider ID (regions/<region>/instances/<instance id>)"
        ))),
    }
}

/// EC2's state name of one `instancesSet` item (`pending`, `running`, `terminated`…).
pub fn state_name<'a>(node: Node<'a, '_>) -> Option<&'a str> {
    child(node, "instanceState").and_then(|state| child_text(state, "name"))
}

/// The contract's view of one `instancesSet` item; `address` picks which address is the proxy's.
pub fn instance_of(region: &str, node: Node<'_, '_>, address: AddressKind) -> Instance {
    let id = child_text(node, "instanceId").unwrap_or_default();
    let mut name = String::new();
    let mut tags = Tags::new();
    for item in items(node, "tagSet") {
        let (Some(key), value) = (child_text(item, "key"), child_text(item, "value").unwrap_or_default()) else {
            continue;
        };
        if key == NAME_TAG {
            value.clone_into(&mut name);
        } else if let Some(key) = key.strip_prefix(TAG_PREFIX) {
            tags.insert(key, value);
        }
    }
    let ip: Option<IpAddr> = match address {
        AddressKind::Public => child_text(node, "ipAddress"),
        AddressKind::Private => child_text(node, "privateIpAddress"),
    }
    .and_then(|text| text.parse().ok());
    let state = match state_name(node) {
        Some("running") if ip.is_some() => InstanceState::Running,
        Some("shutting-down" | "terminated" | "stopping" | "stopped") => InstanceState::Terminated,
        // pending, running without the address yet, and states this build does not know.
        _ => InstanceState::Provisioning,
    };
    let created_at =
        child_text(node, "launchTime").and_then(|text| text.parse::<jiff::Timestamp>().ok()).map(SystemTime::from);
    let ip = if state == InstanceState::Running { ip } else { None };
    Instance::new(name, provider_id(region, id), state, ip, created_at, tags)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DESCRIBED: &str = r#"<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">
 <reservationSet><item><instancesSet>
  <item><instanceId>i-0a</instanceId><instanceState><code>16</code><name>running</name></instanceState>
   <privateIpAddress>10.0.1.7</privateIpAddress><ipAddress>203.0.113.7</ipAddress>
   <launchTime>2026-12-07T10:00:00.000Z</launchTime>
   <networkInterfaceSet><item><privateIpAddress>10.0.1.99</privateIpAddress></item></networkInterfaceSet>
   <tagSet><item><key>Name</key><value>px-a</value></item><item><key>egress-cluster</key><value>c1</value></item>
    <item><key>team</key><value>crawl</value></item></tagSet></item>
  <item><instanceId>i-0b</instanceId><instanceState><name>pending</name></instanceState></item>
 </instancesSet></item></reservationSet><nextToken>page2</nextToken></DescribeInstancesResponse>"#;

    #[test]
    fn described_instances_carry_name_tags_state_and_the_chosen_address() {
        let document = parse(DESCRIBED).unwrap();
        let nodes = instance_nodes(&document);
        assert_eq!(nodes.len(), 2);
        let public = instance_of("eu-west-1", nodes[0], AddressKind::Public);
        assert_eq!(public.name, "px-a");
        assert_eq!(public.provider_id, "regions/eu-west-1/instances/i-0a");
        assert_eq!(public.state, InstanceState::Running);
        assert_eq!(public.ip, Some("203.0.113.7".parse().unwrap()));
        assert_eq!(public.tags, Tags::new().with("cluster", "c1"), "only prefixed tags are the contract's");
        assert!(public.created_at.is_some());
        let private = instance_of("eu-west-1", nodes[0], AddressKind::Private);
        assert_eq!(private.ip, Some("10.0.1.7".parse().unwrap()), "the instance's own, not an interface's");
        let pending = instance_of("eu-west-1", nodes[1], AddressKind::Public);
        assert_eq!((pending.state, pending.ip), (InstanceState::Provisioning, None));
        assert_eq!(next_token(&document), Some("page2"));
    }

    #[test]
    fn states_map_like_the_docs_say() {
        for (state, address, expected) in [
            ("pending", true, InstanceState::Provisioning),
            ("running", false, InstanceState::Provisioning),
            ("running", true, InstanceState::Running),
            ("stopping", true, InstanceState::Terminated),
            ("stopped", false, InstanceState::Terminated),
            ("shutting-down", false, InstanceState::Terminated),
            ("terminated", false, InstanceState::Terminated),
        ] {
            let ip = if address { "<ipAddress>203.0.113.9</ipAddress>" } else { "" };
            let text = format!(
                "<RunInstancesResponse><instancesSet><item><instanceId>i-1</instanceId>\
                 <instanceState><name>{state}</name></instanceState>{ip}</item></instancesSet></RunInstancesResponse>"
            );
            let document = parse(&text).unwrap();
            let instance = instance_of("us-east-1", instance_nodes(&document)[0], AddressKind::Public);
            assert_eq!(instance.state, expected, "{state} {address}");
        }
    }

    #[test]
    fn provider_ids_round_trip_and_reject_others() {
        let id = provider_id("eu-west-1", "i-0123456789abcdef0");
        assert_eq!(parse_provider_id(&id).unwrap(), ("eu-west-1", "i-0123456789abcdef0"));
        for bad in ["", "i-1", "regions//instances/i-1", "regions/r/instances/x-1", "projects/p/zones/z/instances/i"] {
            assert!(parse_provider_id(bad).is_err(), "{bad:?}");
        }
    }
}
