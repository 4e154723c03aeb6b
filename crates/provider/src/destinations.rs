//! Where a proxy may connect: the destination policy every Squid the operator renders enforces.
//!
//! By default a proxy reaches the public internet on the web's ports and nothing else: loopback, link-local (cloud
//! metadata servers among them), private, shared (CGNAT) and reserved networks are denied, CONNECT goes to port 443
//! only and plain HTTP to 80 and 443 only. The checks run on the address Squid resolved (`dst` ACLs), so a host name
//! that resolves to a private address is denied too. A provider's `destinations` block adds rules: `deny` first
//! (always wins), then `allow` (an exception to the defaults: a network rule lets that network, on the given ports or
//! all, past both the network and the port checks; a port-only rule adds a port to the web's ports, still subject to
//! the network checks).
//!
//! Only whoever writes the providers file can widen the policy; a Proxy can narrow it (its `deny` rules are added),
//! never widen it, so RBAC on Proxies never grants a way inside.

use std::borrow::Cow;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use ipnet::IpNet;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer};

/// A class of destinations denied by default: its name (in Squid's ACL names, the access log and the
/// `X-Egress-Policy` response header), what it is, and its networks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeniedClass {
    /// `loopback`, `link-local`, ...
    pub name: &'static str,
    /// What the networks are, for messages.
    pub description: &'static str,
    /// The networks, as CIDRs.
    pub networks: &'static [&'static str],
}

/// The destination classes every rendered proxy denies unless an `allow` rule makes an exception.
pub const DEFAULT_DENIED: [DeniedClass; 7] = [
    DeniedClass {
        name: "loopback",
        description: "loopback and this-host addresses",
        networks: &["127.0.0.0/8", "0.0.0.0/8", "::1/128", "::/128"],
    },
    DeniedClass {
        name: "link-local",
        description: "link-local addresses, cloud metadata servers among them (169.254.169.254, fd00:ec2::254)",
        networks: &["169.254.0.0/16", "fe80::/10"],
    },
    DeniedClass {
        name: "private",
        description: "private networks (RFC 1918)",
        networks: &["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"],
    },
    DeniedClass { name: "shared", description: "shared address space (CGNAT, RFC 6598)", networks: &["100.64.0.0/10"] },
    DeniedClass {
        name: "unique-local",
        description: "unique-local IPv6 addresses (fd00:ec2::254 among them)",
        networks: &["fc00::/7"],
    },
    DeniedClass {
        name: "reserved",
        description: "reserved, benchmarking, multicast and broadcast addresses",
        networks: &["192.0.0.0/24", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4", "ff00::/8"],
    },
    // IPv6 forms that carry an IPv4 address a gateway or the host's stack may turn back into IPv4
    // (`[64:ff9b::a9fe:a9fe]` is 169.254.169.254 through NAT64). They are denied whole: which IPv4 address is inside
    // is not something a `dst` ACL can test, and no public site needs to be reached through them. IPv4-mapped
    // addresses (`::ffff:0:0/96`) are not here: Squid and `check` compare them as the IPv4 address they are, so the
    // IPv4 classes decide.
    DeniedClass {
        name: "ipv4-embedded",
        description: "IPv6 addresses embedding IPv4 (IPv4-compatible ::/96, IPv4-translated ::ffff:0:0:0/96, NAT64 \
                      64:ff9b::/96 and 64:ff9b:1::/48, 6to4 2002::/16, Teredo 2001::/32)",
        networks: &["::/96", "::ffff:0:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48", "2002::/16", "2001::/32"],
    },
];

/// The ports CONNECT may reach by default.
pub const TLS_PORTS: [u16; 1] = [443];
/// The ports plain HTTP may reach by default.
pub const WEB_PORTS: [u16; 2] = [80, 443];

/// One rule: a network, a port range, or a network on a port range.
///
/// Written `10.0.0.0/8`, `10.1.2.3` (one address), `10.0.0.0/8:8000-8999`, `[fd00::/8]:443`, `[fd00::1]` or
/// `*:8443` (a port on any network).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DestinationRule {
    /// The network; `None` for a port-only rule.
    pub network: Option<IpNet>,
    /// The first and last port; `None` for every port.
    pub ports: Option<(u16, u16)>,
}

impl DestinationRule {
    /// Whether the rule covers `address`:`port`.
    pub fn matches(&self, address: IpAddr, port: u16) -> bool {
        self.network.is_none_or(|network| network.contains(&address))
            && self.ports.is_none_or(|(first, last)| (first..=last).contains(&port))
    }
}

/// Why a rule string is not a rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a destination rule (expected a CIDR such as 10.0.0.0/8, an address, CIDR:PORT, CIDR:PORT-PORT, [IPv6 CIDR]:PORT or *:PORT)"
)]
pub struct RuleError(pub String);

impl FromStr for DestinationRule {
    type Err = RuleError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let error = || RuleError(text.to_owned());
        let text = text.trim();
        // Split off a port part: `[v6]:ports`, `*:ports`, `v4:ports`; a bare IPv6 network has several colons.
        let (network, ports) = if let Some(rest) = text.strip_prefix('[') {
            let (network, after) = rest.split_once(']').ok_or_else(error)?;
            match after {
                "" => (network, None),
                after => (network, Some(after.strip_prefix(':').ok_or_else(error)?)),
            }
        } else if let Some(ports) = text.strip_prefix("*:") {
            ("*", Some(ports))
        } else if text.matches(':').count() == 1 {
            let (network, ports) = text.split_once(':').ok_or_else(error)?;
            (network, Some(ports))
        } else {
            (text, None)
        };
        let network = match network {
            "*" => None,
            network => Some(parse_network(network).ok_or_else(error)?),
        };
        let ports = match ports {
            None => None,
            Some(ports) => Some(parse_ports(ports).ok_or_else(error)?),
        };
        if network.is_none() && ports.is_none() {
            return Err(error());
        }
        Ok(Self { network, ports })
    }
}

fn parse_network(text: &str) -> Option<IpNet> {
    if text.contains('/') {
        let network: IpNet = text.parse().ok()?;
        // `10.1.2.3/8` is almost always a typo for `10.0.0.0/8` or `10.1.2.3/32`: refuse it rather than guess.
        (network.network() == network.addr()).then_some(network)
    } else {
        text.parse::<IpAddr>().ok().map(IpNet::from)
    }
}

fn parse_ports(text: &str) -> Option<(u16, u16)> {
    let (first, last) = text.split_once('-').unwrap_or((text, text));
    let (first, last) = (first.parse::<u16>().ok()?, last.parse::<u16>().ok()?);
    (first >= 1 && first <= last).then_some((first, last))
}

impl<'de> Deserialize<'de> for DestinationRule {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer)?.parse().map_err(serde::de::Error::custom)
    }
}

impl JsonSchema for DestinationRule {
    fn schema_name() -> Cow<'static, str> {
        "DestinationRule".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "format": "destination-rule",
            "description": "A CIDR such as 10.0.0.0/8, an address, CIDR:PORT, CIDR:PORT-PORT, [IPv6 CIDR]:PORT or *:PORT.",
        })
    }
}

impl fmt::Display for DestinationRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.network, self.ports) {
            (Some(network), None) => write!(f, "{network}"),
            (network, Some((first, last))) => {
                match network {
                    None => f.write_str("*")?,
                    Some(IpNet::V6(network)) => write!(f, "[{network}]")?,
                    Some(network) => write!(f, "{network}")?,
                }
                if first == last { write!(f, ":{first}") } else { write!(f, ":{first}-{last}") }
            }
            (None, None) => f.write_str("*"),
        }
    }
}

/// A provider's (or a Proxy's) additions to the default policy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DestinationPolicy {
    /// Exceptions to the defaults.
    #[serde(default)]
    pub allow: Vec<DestinationRule>,
    /// Denied on top of the defaults; wins over `allow`.
    #[serde(default)]
    pub deny: Vec<DestinationRule>,
}

impl DestinationPolicy {
    /// A short digest (16 hex characters) of the rules, each list sorted and without duplicates, so reordering
    /// them changes nothing; `None` for the default policy (no rules), so instances of a provider that never set one
    /// keep the spec hash they had. Every instance a provider renders bakes its policy in: the reconciler mixes this
    /// into each Proxy's desired spec hash, and a change rolls the provider's proxies make-before-break.
    pub fn fingerprint(&self) -> Option<String> {
        use sha2::{Digest, Sha256};
        if self.allow.is_empty() && self.deny.is_empty() {
            return None;
        }
        let canonical = |rules: &[DestinationRule]| {
            let mut texts: Vec<String> = rules.iter().map(ToString::to_string).collect();
            texts.sort();
            texts.dedup();
            texts.join(",")
        };
        let digest = Sha256::digest(format!("allow={};deny={}", canonical(&self.allow), canonical(&self.deny)));
        Some(digest[..8].iter().map(|byte| format!("{byte:02x}")).collect())
    }
}

/// Why the policy denies a destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Denial {
    /// A `deny` rule matched.
    Rule(DestinationRule),
    /// A default class matched and no `allow` rule made an exception.
    Class(&'static DeniedClass),
    /// The port is not one of the ports this kind of request may reach.
    Port {
        /// The port.
        port: u16,
        /// Whether the request was a CONNECT (TLS) tunnel.
        connect: bool,
    },
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Rule(rule) => write!(f, "the deny rule {rule}"),
            Self::Class(class) => {
                write!(f, "{} ({}) are denied by default", class.description, class.networks.join(", "))
            }
            Self::Port { port, connect: true } => write!(f, "CONNECT may reach port 443 only, not {port}"),
            Self::Port { port, connect: false } => write!(f, "plain HTTP may reach ports 80 and 443 only, not {port}"),
        }
    }
}

impl DestinationPolicy {
    /// This policy with `other`'s deny rules added (a Proxy may narrow its provider's policy, never widen it).
    pub fn narrowed_by(&self, deny: &[DestinationRule]) -> Self {
        let mut policy = self.clone();
        policy.deny.extend(deny.iter().copied());
        policy
    }

    /// [`DestinationPolicy::check`] for a URL's host, when its address is known without DNS
    /// ([`literal_address`]); `None` when allowed or when only DNS can tell.
    pub fn check_host(&self, host: &str, port: u16, connect: bool, extra_denied: &[IpNet]) -> Option<Denial> {
        self.check(literal_address(host)?, port, connect, extra_denied)
    }

    /// What the rendered Squid does with a request to `address`:`port` (a CONNECT tunnel when `connect`), given
    /// the networks the provider denies besides the defaults (`extra_denied`, for example a cluster's own).
    /// `None` when it is allowed.
    pub fn check(&self, address: IpAddr, port: u16, connect: bool, extra_denied: &[IpNet]) -> Option<Denial> {
        let address = canonical(address);
        if let Some(rule) = self.deny.iter().find(|rule| rule.matches(address, port)) {
            return Some(Denial::Rule(*rule));
        }
        if self.allow.iter().any(|rule| rule.network.is_some() && rule.matches(address, port)) {
            return None;
        }
        if let Some(class) = DEFAULT_DENIED.iter().find(|class| {
            class.networks.iter().any(|network| network.parse::<IpNet>().is_ok_and(|net| net.contains(&address)))
        }) {
            return Some(Denial::Class(class));
        }
        if extra_denied.iter().any(|network| network.contains(&address)) {
            return Some(Denial::Class(&PROVIDER_NETWORKS));
        }
        let defaults: &[u16] = if connect { &TLS_PORTS } else { &WEB_PORTS };
        let extra_port = self.allow.iter().any(|rule| rule.network.is_none() && rule.matches(address, port));
        (!defaults.contains(&port) && !extra_port).then_some(Denial::Port { port, connect })
    }
}

/// The class of a provider's own networks (a cluster's pod and service networks).
pub static PROVIDER_NETWORKS: DeniedClass = DeniedClass {
    name: "provider-network",
    description: "the provider's own networks (for kubernetes, its clusterNetworks)",
    networks: &[],
};

/// An IPv4-mapped IPv6 address as the IPv4 address it is (Squid compares them so).
fn canonical(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(address, IpAddr::V4),
        v4 => v4,
    }
}

/// The Squid directives that enforce `policy` (plus `extra_denied`): ACL definitions and `http_access` lines, to go
/// after the client and authentication checks and before the final allow. Each denial is annotated with its class,
/// which the access log (`%{egress-policy}note`) and the `X-Egress-Policy` response header carry.
pub(crate) fn squid_rules(policy: &DestinationPolicy, extra_denied: &[IpNet]) -> String {
    let mut acls = String::from("acl CONNECT method CONNECT\n");
    let mut access = String::new();
    let mark = |acls: &mut String, class: &str| {
        let name = format!("egress_denied_{}", class.replace('-', "_"));
        acls.push_str(&format!("acl {name} annotate_transaction egress-policy={class}\n"));
        name
    };
    // Squid's own cache manager (`cache_object://`, `/squid-internal-mgr/`) answers from Squid itself whatever the
    // destination, and shows other clients' requests; every scheme but http and https (ftp, urn, whois, ...) is
    // Squid's own client too. Both are refused before any rule can allow them.
    let marker = mark(&mut acls, "manager");
    access.push_str(&format!("http_access deny manager {marker}\n"));
    acls.push_str("acl egress_web_protocols proto HTTP HTTPS\n");
    let marker = mark(&mut acls, "protocol");
    access.push_str(&format!("http_access deny !CONNECT !egress_web_protocols {marker}\n"));
    for (index, rule) in policy.deny.iter().enumerate() {
        let matchers = rule_acls(&mut acls, &format!("egress_deny_{index}"), rule);
        let marker = mark(&mut acls, &format!("rule-{index}"));
        access.push_str(&format!("http_access deny {matchers} {marker}\n"));
    }
    for (index, rule) in policy.allow.iter().enumerate().filter(|(_, rule)| rule.network.is_some()) {
        let matchers = rule_acls(&mut acls, &format!("egress_allow_{index}"), rule);
        access.push_str(&format!("http_access allow {matchers}\n"));
    }
    let mut classes: Vec<(&str, Vec<String>)> = DEFAULT_DENIED
        .iter()
        .map(|class| (class.name, class.networks.iter().map(|network| (*network).to_owned()).collect()))
        .collect();
    if !extra_denied.is_empty() {
        classes.push((PROVIDER_NETWORKS.name, extra_denied.iter().map(ToString::to_string).collect()));
    }
    for (class, networks) in classes {
        let name = format!("egress_{}", class.replace('-', "_"));
        acls.push_str(&format!("acl {name} dst {}\n", networks.join(" ")));
        let marker = mark(&mut acls, class);
        access.push_str(&format!("http_access deny {name} {marker}\n"));
    }
    let extra_ports: Vec<String> = policy
        .allow
        .iter()
        .filter(|rule| rule.network.is_none())
        .filter_map(|rule| rule.ports)
        .map(|(first, last)| if first == last { first.to_string() } else { format!("{first}-{last}") })
        .collect();
    let port_list = |defaults: &[u16]| {
        defaults.iter().map(ToString::to_string).chain(extra_ports.iter().cloned()).collect::<Vec<_>>().join(" ")
    };
    acls.push_str(&format!("acl egress_tls_ports port {}\n", port_list(&TLS_PORTS)));
    acls.push_str(&format!("acl egress_web_ports port {}\n", port_list(&WEB_PORTS)));
    let marker = mark(&mut acls, "port");
    access.push_str(&format!("http_access deny CONNECT !egress_tls_ports {marker}\n"));
    access.push_str(&format!("http_access deny !egress_web_ports {marker}\n"));
    acls.push_str("acl egress_policy_denied note egress-policy\n");
    format!(
        "# Destination policy: a proxy reaches the public internet on the web's ports only. Every check runs on the\n\
         # resolved address; a denial answers 403 with X-Egress-Policy naming the rule or class, and is logged so.\n\
         {acls}{access}reply_header_add X-Egress-Policy \"denied %{{egress-policy}}note\" egress_policy_denied\n\
         cachemgr_passwd disable all\n"
    )
}

/// Defines the ACLs matching `rule` under `prefix`; returns them as `http_access` operands.
fn rule_acls(acls: &mut String, prefix: &str, rule: &DestinationRule) -> String {
    let mut operands = Vec::new();
    if let Some(network) = rule.network {
        acls.push_str(&format!("acl {prefix}_dst dst {network}\n"));
        operands.push(format!("{prefix}_dst"));
    }
    if let Some((first, last)) = rule.ports {
        let ports = if first == last { first.to_string() } else { format!("{first}-{last}") };
        acls.push_str(&format!("acl {prefix}_port port {ports}\n"));
        operands.push(format!("{prefix}_port"));
    }
    operands.join(" ")
}

/// The address a URL's host names without DNS: an IP literal (`[v6]` included), or 127.0.0.1 for `localhost` and
/// its subdomains (RFC 6761); `None` for any other name.
pub fn literal_address(host: &str) -> Option<IpAddr> {
    let host = host.strip_prefix('[').and_then(|rest| rest.strip_suffix(']')).unwrap_or(host);
    let lower = host.trim_end_matches('.').to_ascii_lowercase();
    if lower == "localhost" || lower.ends_with(".localhost") {
        return Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    host.parse::<Ipv4Addr>().map(IpAddr::V4).or_else(|_| host.parse::<Ipv6Addr>().map(IpAddr::V6)).ok()
}

#[cfg(test)]
mod tests;
