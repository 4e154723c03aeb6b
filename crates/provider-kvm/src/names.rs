//! Provider IDs and the names of the volumes the provider makes. Host and image keys are plain identifiers
//! (checked by the config), and instance names are the operator's, so every name parses back unambiguously.

use egress_provider::ProviderError;
use egress_provider::config::is_identifier;

/// `hosts/<host>/domains/<name>`.
pub fn provider_id(host: &str, name: &str) -> String {
    format!("hosts/{host}/domains/{name}")
}

/// The host and domain name of a provider ID; anything else is a Permanent error (it was never this provider's).
pub fn parse_provider_id(provider_id: &str) -> Result<(&str, &str), ProviderError> {
    let parts: Vec<&str> = provider_id.split('/').collect();
    match parts.as_slice() {
        ["hosts", host, "domains", name] if is_identifier(host) && is_identifier(name) => Ok((host, name)),
        _ => Err(ProviderError::permanent(format!(
            "{provider_id:?} is not a kvm provider ID (hosts/<host>/domains/<name>)"
        ))),
    }
}

/// The instance's qcow2 overlay.
pub fn overlay_volume(name: &str) -> String {
    format!("{name}.qcow2")
}

/// The instance's NoCloud seed.
pub fn seed_volume(name: &str) -> String {
    format!("{name}-seed.iso")
}

/// What every cached base image's volume name starts with.
pub const BASE_PREFIX: &str = "egress-image-";
/// What a base's marker volume adds to the base's name.
pub const MARKER_SUFFIX: &str = ".done";

/// The cached base image for an image key and checksum: the checksum is in the name, so a changed checksum is a
/// new volume and a base in use is never overwritten.
pub fn base_volume(key: &str, sha256: &str) -> String {
    format!("{BASE_PREFIX}{key}-{}", &sha256[..16.min(sha256.len())])
}

/// The marker that says the base volume is complete and verified.
pub fn marker_volume(key: &str, sha256: &str) -> String {
    format!("{}{MARKER_SUFFIX}", base_volume(key, sha256))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_ids_round_trip_and_reject_others() {
        let id = provider_id("rack1", "px-a");
        assert_eq!(id, "hosts/rack1/domains/px-a");
        assert_eq!(parse_provider_id(&id).expect("parses"), ("rack1", "px-a"));
        for bad in ["hosts/rack1/domains", "hosts/rack/1/domains/a", "ns/pod", "hosts/Rack1/domains/a", ""] {
            assert!(parse_provider_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn volume_names_carry_the_instance_or_the_checksum() {
        assert_eq!(overlay_volume("px-a"), "px-a.qcow2");
        assert_eq!(seed_volume("px-a"), "px-a-seed.iso");
        let sha = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        assert_eq!(base_volume("debian12", sha), "egress-image-debian12-0123456789abcdef");
        assert_eq!(marker_volume("debian12", sha), "egress-image-debian12-0123456789abcdef.done");
    }
}
