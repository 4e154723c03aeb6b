//! The `user-data` a VM boots with: the Proxy's own cloud-init, or one that installs and configures Squid. Shared
//! by the VM backends (gcp, kvm).

use crate::CreateRequest;
use crate::destinations::DestinationPolicy;
use crate::squid::{self, Layout, SquidConfig};

/// Where the default cloud-init writes the password file on the VM.
const PASSWORD_FILE: &str = "/etc/squid/egress-passwd";

/// The user data for `request`: its cloud-init byte for byte when it has one (the Squid it sets up, and so its
/// destination policy, are then the user's), else [`default_cloud_init`] enforcing `destinations`.
pub fn for_request(request: &CreateRequest, destinations: &DestinationPolicy) -> Vec<u8> {
    match &request.cloud_init {
        Some(cloud_init) => cloud_init.expose().clone(),
        None => default_cloud_init(request, destinations).into_bytes(),
    }
}

/// A cloud-config that installs Squid from the image's packages and configures it with the shared renderer
/// ([`squid::render`], VM layout): listening on the request's port, requiring the request's credentials when it has
/// any, enforcing `destinations`. The network decides who may connect (a firewall rule on GCP, the bridge's network
/// on KVM).
pub fn default_cloud_init(request: &CreateRequest, destinations: &DestinationPolicy) -> String {
    let conf = squid::render(&SquidConfig {
        instance: &request.name,
        port: request.port,
        password_file: request.credentials.as_ref().map(|_| PASSWORD_FILE),
        policy: destinations,
        provider_networks: &[],
        layout: Layout::Vm,
    });
    let mut text = String::from("#cloud-config\npackage_update: true\npackages:\n  - squid\nwrite_files:\n");
    text.push_str(&file_entry("/etc/squid/squid.conf", "0644", &conf));
    if let Some(credentials) = &request.credentials {
        text.push_str(&file_entry(PASSWORD_FILE, "0640", &squid::password_line(&request.name, credentials)));
    }
    text.push_str("runcmd:\n");
    if request.credentials.is_some() {
        text.push_str(&format!("  - [chgrp, proxy, {PASSWORD_FILE}]\n"));
    }
    text.push_str("  - [systemctl, enable, squid]\n  - [systemctl, restart, squid]\n");
    text
}

fn file_entry(path: &str, permissions: &str, content: &str) -> String {
    let mut entry = format!("  - path: {path}\n    permissions: '{permissions}'\n    content: |\n");
    for line in content.lines() {
        entry.push_str("      ");
        entry.push_str(line);
        entry.push('\n');
    }
    entry
}

#[cfg(test)]
mod tests {
    use crate::{ProxyCredentials, Sensitive, Tags};

    use super::*;

    fn request() -> CreateRequest {
        CreateRequest::new("px-a", 3128, Tags::new())
    }

    #[test]
    fn a_proxy_cloud_init_is_passed_byte_for_byte() {
        let mut request = request();
        request.cloud_init = Some(Sensitive::new(b"#cloud-config\nruncmd: [echo hi]\n\xff".to_vec()));
        assert_eq!(for_request(&request, &DestinationPolicy::default()), b"#cloud-config\nruncmd: [echo hi]\n\xff");
    }

    #[test]
    fn the_default_installs_squid_on_the_port() {
        let text = default_cloud_init(&request(), &DestinationPolicy::default());
        assert!(text.starts_with("#cloud-config\n"));
        assert!(text.contains("packages:\n  - squid\n"));
        assert!(text.contains("      http_port 3128\n"));
        assert!(text.contains("      http_access allow all\n"));
        assert!(!text.contains("auth_param"));
    }

    /// The VM backends get the same destination policy as the pods, from the same renderer.
    #[test]
    fn the_default_embeds_the_shared_renderer_output_with_the_policy() {
        let policy = DestinationPolicy { allow: vec!["*:8443".parse().expect("a rule")], deny: Vec::new() };
        let text = default_cloud_init(&request(), &policy);
        let rendered = squid::render(&SquidConfig {
            instance: "px-a",
            port: 3128,
            password_file: None,
            policy: &policy,
            provider_networks: &[],
            layout: Layout::Vm,
        });
        let embedded: String = text
            .lines()
            .skip_while(|line| !line.starts_with("    content: |"))
            .skip(1)
            .take_while(|line| line.starts_with("      ") || line.is_empty())
            .map(|line| format!("{}\n", line.strip_prefix("      ").unwrap_or(line).trim_end()))
            .collect();
        assert_eq!(embedded, rendered.lines().map(|line| format!("{line}\n")).collect::<String>());
        for class in crate::destinations::DEFAULT_DENIED {
            let name = class.name.replace('-', "_");
            assert!(text.contains(&format!("      http_access deny egress_{name} egress_denied_{name}\n")), "{name}");
        }
        assert!(text.contains("      acl egress_tls_ports port 443 8443\n"));
    }

    #[test]
    fn the_default_with_credentials_requires_them_and_stores_only_a_hash() {
        let mut request = request();
        request.credentials =
            Some(ProxyCredentials { username: "crawler".into(), password: Sensitive::new("s3cret-pw".into()) });
        let text = default_cloud_init(&request, &DestinationPolicy::default());
        assert!(text.contains("      http_access deny !authenticated\n"));
        assert!(text.contains("      crawler:$6$"));
        assert!(!text.contains("s3cret-pw"), "the password is stored hashed only");
    }
}
