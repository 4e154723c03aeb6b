//! The provider's own security group: one per cluster and VPC, `egress-operator-<cluster>`, admitting exactly the
//! config's `allowedSources` on each port a Proxy listens on, and nothing else inbound. Created on the first launch
//! in a VPC; its rules for a port are made to match the config on the first launch on that port after the operator
//! starts (missing sources authorized, others revoked), so a changed `allowedSources` applies without a console.
//! It is kept when the last instance goes (a group costs nothing, and deleting it would race the next launch).

use std::collections::{BTreeSet, HashMap};

use egress_provider::{ProviderError, Tags};
use ipnet::IpNet;
use roxmltree::Node;
use tokio::sync::Mutex;
use tracing::info;

use crate::ec2::Ec2;
use crate::model::{self, child_text, items};

/// What has been made to match this process's config: the group of each (VPC, cluster), and the ports whose rules
/// were set.
#[derive(Debug, Default)]
pub struct Groups {
    known: Mutex<HashMap<GroupKey, KnownGroup>>,
}

/// A group's (VPC, cluster).
type GroupKey = (String, String);
/// A group's ID and the ports whose rules this process has set.
type KnownGroup = (String, BTreeSet<u16>);

/// The group's name for `cluster`.
pub fn group_name(cluster: &str) -> String {
    format!("egress-operator-{cluster}")
}

impl Groups {
    /// The ID of the cluster's group in `vpc`, with rules admitting `sources` on `port`; made or corrected as
    /// needed. Concurrent launches wait for one another here, so the group is created once.
    ///
    /// # Errors
    /// Any EC2 call failing.
    pub async fn ensure(
        &self,
        ec2: &Ec2,
        vpc: &str,
        tags: &Tags,
        port: u16,
        sources: &[IpNet],
    ) -> Result<String, ProviderError> {
        let cluster = tags.get(Tags::CLUSTER).unwrap_or("default").to_owned();
        let mut known = self.known.lock().await;
        let key = (vpc.to_owned(), cluster.clone());
        if let Some((id, ports)) = known.get(&key)
            && ports.contains(&port)
        {
            return Ok(id.clone());
        }
        let name = group_name(&cluster);
        let (id, present) = match find(ec2, vpc, &name).await? {
            Some(found) => found,
            None => (create(ec2, vpc, &name, tags).await?, Vec::new()),
        };
        set_rules(ec2, &id, port, sources, &present).await?;
        known.entry(key).or_insert_with(|| (id.clone(), BTreeSet::new())).1.insert(port);
        Ok(id)
    }
}

/// The group named `name` in `vpc` and its inbound rules as (port, network), when it exists.
async fn find(ec2: &Ec2, vpc: &str, name: &str) -> Result<Option<(String, Vec<(u16, IpNet)>)>, ProviderError> {
    let mut form = Ec2::form("DescribeSecurityGroups");
    form.filter("vpc-id", &[vpc]).filter("group-name", &[name]);
    let text = ec2.call(&form, name).await?;
    let document = model::parse(&text)?;
    let Some(group) = items(document.root_element(), "securityGroupInfo").next() else { return Ok(None) };
    let Some(id) = child_text(group, "groupId") else {
        return Err(ProviderError::transient(format!("DescribeSecurityGroups {name}: a group without an ID")));
    };
    Ok(Some((id.to_owned(), inbound_rules(group))))
}

/// The (port, network) pairs of a group's TCP ingress rules on single ports.
fn inbound_rules(group: Node<'_, '_>) -> Vec<(u16, IpNet)> {
    let mut rules = Vec::new();
    for permission in items(group, "ipPermissions") {
        let port = child_text(permission, "fromPort").and_then(|port| port.parse::<u16>().ok());
        let same = port.is_some() && child_text(permission, "toPort").and_then(|port| port.parse().ok()) == port;
        let (Some(port), true, Some("tcp")) = (port, same, child_text(permission, "ipProtocol")) else { continue };
        for (set, field) in [("ipRanges", "cidrIp"), ("ipv6Ranges", "cidrIpv6")] {
            for range in items(permission, set) {
                if let Some(network) = child_text(range, field).and_then(|text| text.parse().ok()) {
                    rules.push((port, network));
                }
            }
        }
    }
    rules
}

async fn create(ec2: &Ec2, vpc: &str, name: &str, tags: &Tags) -> Result<String, ProviderError> {
    let mut form = Ec2::form("CreateSecurityGroup");
    form.push("GroupName", name)
        .push("GroupDescription", "Proxies of egress-operator: the proxy port from allowedSources only")
        .push("VpcId", vpc)
        .push("TagSpecification.1.ResourceType", "security-group");
    let owned = Tags::owned_by_cluster(tags.get(Tags::CLUSTER).unwrap_or("default"));
    for (index, (key, value)) in model::tag_pairs(&owned).into_iter().enumerate() {
        form.push(format!("TagSpecification.1.Tag.{}.Key", index + 1), key)
            .push(format!("TagSpecification.1.Tag.{}.Value", index + 1), value);
    }
    // Another operator (or this one before a restart) may have made it meanwhile.
    let Some(text) = ec2.call_expecting(&form, name, &["InvalidGroup.Duplicate"]).await? else {
        return match find(ec2, vpc, name).await? {
            Some((id, _)) => Ok(id),
            None => Err(ProviderError::transient(format!("CreateSecurityGroup {name}: exists, but is not found"))),
        };
    };
    let document = model::parse(&text)?;
    let id = child_text(document.root_element(), "groupId")
        .ok_or_else(|| ProviderError::transient(format!("CreateSecurityGroup {name}: the answer holds no group ID")))?;
    info!(group = name, id, vpc, "created the proxies' security group");
    Ok(id.to_owned())
}

/// Authorizes the sources missing on `port` and revokes the others there.
async fn set_rules(
    ec2: &Ec2,
    group: &str,
    port: u16,
    sources: &[IpNet],
    present: &[(u16, IpNet)],
) -> Result<(), ProviderError> {
    let on_port: BTreeSet<IpNet> = present.iter().filter(|(at, _)| *at == port).map(|(_, network)| *network).collect();
    let wanted: BTreeSet<IpNet> = sources.iter().copied().collect();
    let missing: Vec<IpNet> = wanted.difference(&on_port).copied().collect();
    let extra: Vec<IpNet> = on_port.difference(&wanted).copied().collect();
    for (action, networks) in [("AuthorizeSecurityGroupIngress", missing), ("RevokeSecurityGroupIngress", extra)] {
        if networks.is_empty() {
            continue;
        }
        let mut form = Ec2::form(action);
        form.push("GroupId", group)
            .push("IpPermissions.1.IpProtocol", "tcp")
            .push("IpPermissions.1.FromPort", port.to_string())
            .push("IpPermissions.1.ToPort", port.to_string());
        let (mut v4, mut v6) = (0, 0);
        for network in &networks {
            if network.addr().is_ipv4() {
                v4 += 1;
                form.push(format!("IpPermissions.1.IpRanges.{v4}.CidrIp"), network.to_string());
            } else {
                v6 += 1;
                form.push(format!("IpPermissions.1.Ipv6Ranges.{v6}.CidrIpv6"), network.to_string());
            }
        }
        // Two launches racing: the rule is there (or gone) either way.
        let expected = ["InvalidPermission.Duplicate", "InvalidPermission.NotFound"];
        if ec2.call_expecting(&form, group, &expected).await?.is_some() {
            info!(group, port, action, networks = ?networks, "security group rules changed");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ingress_rules_are_read_per_single_tcp_port() {
        let text = r#"<DescribeSecurityGroupsResponse><securityGroupInfo><item><groupId>sg-1</groupId>
<ipPermissions>
 <item><ipProtocol>tcp</ipProtocol><fromPort>3128</fromPort><toPort>3128</toPort>
  <ipRanges><item><cidrIp>198.51.100.0/24</cidrIp></item></ipRanges>
  <ipv6Ranges><item><cidrIpv6>2001:db8::/32</cidrIpv6></item></ipv6Ranges></item>
 <item><ipProtocol>tcp</ipProtocol><fromPort>1000</fromPort><toPort>2000</toPort>
  <ipRanges><item><cidrIp>10.0.0.0/8</cidrIp></item></ipRanges></item>
 <item><ipProtocol>udp</ipProtocol><fromPort>53</fromPort><toPort>53</toPort>
  <ipRanges><item><cidrIp>10.0.0.0/8</cidrIp></item></ipRanges></item>
</ipPermissions></item></securityGroupInfo></DescribeSecurityGroupsResponse>"#;
        let document = model::parse(text).unwrap();
        let group = items(document.root_element(), "securityGroupInfo").next().unwrap();
        assert_eq!(
            inbound_rules(group),
            vec![(3128, "198.51.100.0/24".parse().unwrap()), (3128, "2001:db8::/32".parse().unwrap())]
        );
        assert_eq!(group_name("prod-eu"), "egress-operator-prod-eu");
    }
}
