//! The spec hash: a short, stable digest of exactly the spec fields that change the instance.
//!
//! The hash names instances (through the instance name) and tags them (`spec-hash`), so it must stay the same
//! across operator versions for an unchanged spec: a changed hash replaces every instance of the fleet. That is why
//! it is computed over an explicit, versioned encoding of the fields rather than over the serialized spec, which
//! would change whenever a field is added to the type.

use sha2::{Digest, Sha256};

use crate::{CloudInit, ProxySpec};

/// Bumped only on purpose, knowing that every Managed instance is then replaced once.
const ENCODING_VERSION: &[u8] = b"egress-spec-hash-v1";

/// The number of hex characters kept: 64 bits, ample for the handful of specs one Proxy goes through, and short
/// enough for a label value.
const HASH_LEN: usize = 16;

/// A digest of the fields that change the instance: provider, placement, cloud-init content or reference, port,
/// auth reference and destination deny rules, plus the `rotate` annotation's token when one is set.
///
/// Fields that do not change the instance (`healthCheck`, `maxLeases`, `maxAge`, `endpoint`) do not change the
/// hash, so editing them never replaces an instance. The result is 16 lowercase hex characters, valid as a label
/// value and in instance names.
pub fn spec_hash(spec: &ProxySpec, rotate_token: Option<&str>) -> String {
    spec_hash_with(spec, rotate_token, None)
}

/// [`spec_hash`] with the provider's instance fingerprint (its destination policy's digest) mixed in when it has
/// one: instances bake the provider's policy in, so a changed policy must change the hash that names them. Without
/// a fingerprint the hash is [`spec_hash`]'s, so fleets of providers with the default policy keep theirs.
pub fn spec_hash_with(spec: &ProxySpec, rotate_token: Option<&str>, provider_fingerprint: Option<&str>) -> String {
    let mut encoder = Encoder(Sha256::new());
    encoder.0.update(ENCODING_VERSION);
    encoder.field("provider", spec.provider.as_deref());
    let placement = spec.placement.as_ref();
    encoder.field("placement.zone", placement.and_then(|p| p.zone.as_deref()));
    encoder.field("placement.machineType", placement.and_then(|p| p.machine_type.as_deref()));
    encoder.field("placement.image", placement.and_then(|p| p.image.as_deref()));
    let (inline, secret_ref) = match &spec.cloud_init {
        Some(CloudInit { inline, secret_ref }) => (inline.as_deref(), secret_ref.as_ref()),
        None => (None, None),
    };
    encoder.field("cloudInit.inline", inline);
    encoder.field("cloudInit.secretRef.name", secret_ref.map(|r| r.name.as_str()));
    encoder.field("cloudInit.secretRef.key", secret_ref.map(|r| r.key.as_str()));
    encoder.field("port", Some(&spec.port.to_string()));
    encoder.field("auth.secretRef.name", spec.auth.as_ref().map(|a| a.secret_ref.name.as_str()));
    encoder.field("rotate", rotate_token.filter(|token| !token.is_empty()));
    // Added after v1 shipped: encoded only when set, so every hash from before it stays the same.
    let deny = spec.destinations.as_ref().map(|destinations| destinations.deny.as_slice()).unwrap_or_default();
    if !deny.is_empty() {
        encoder.field("destinations.deny", Some(&deny.join("\n")));
    }
    if let Some(fingerprint) = provider_fingerprint {
        encoder.field("provider.fingerprint", Some(fingerprint));
    }
    let digest = encoder.0.finalize();
    let mut hex = String::with_capacity(HASH_LEN);
    for byte in &digest[..HASH_LEN / 2] {
        hex.push_str(&format!("{byte:02x}"));
    }
    hex
}

/// Writes tagged, length-prefixed fields, so that no two different specs encode to the same bytes (an absent field
/// differs from an empty one, and a value cannot spill into the next field).
struct Encoder(Sha256);

impl Encoder {
    fn field(&mut self, name: &str, value: Option<&str>) {
        self.0.update((name.len() as u64).to_le_bytes());
        self.0.update(name.as_bytes());
        match value {
            None => self.0.update([0]),
            Some(value) => {
                self.0.update([1]);
                self.0.update((value.len() as u64).to_le_bytes());
                self.0.update(value.as_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Endpoint, HealthCheck, Placement, ProxyAuth, ProxyMode, SecretKeyRef, SecretNameRef};

    fn base() -> ProxySpec {
        ProxySpec {
            provider: Some("gcp-eu".into()),
            placement: Some(Placement { zone: Some("europe-west1-b".into()), machine_type: None, image: None }),
            cloud_init: Some(CloudInit { inline: Some("#cloud-config\n".into()), secret_ref: None }),
            ..ProxySpec::new(ProxyMode::Managed)
        }
    }

    #[test]
    fn hash_is_sixteen_lowercase_hex_characters() {
        let hash = spec_hash(&base(), None);
        assert_eq!(hash.len(), 16);
        assert!(hash.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)), "{hash}");
    }

    /// Pins the encoding: if this fails, every Managed instance in every cluster would be replaced on upgrade.
    #[test]
    fn hash_is_stable_across_versions() {
        assert_eq!(spec_hash(&ProxySpec::new(ProxyMode::Managed), None), "340e470e78ddee5a");
        // An empty deny list is the spec from before the field existed.
        let empty =
            ProxySpec { destinations: Some(crate::ProxyDestinations::default()), ..ProxySpec::new(ProxyMode::Managed) };
        assert_eq!(spec_hash(&empty, None), "340e470e78ddee5a");
        assert_eq!(spec_hash(&base(), Some("2026-11-30")), spec_hash(&base(), Some("2026-11-30")));
    }

    #[test]
    fn fields_that_change_the_instance_change_the_hash() {
        type Edit = fn(&mut ProxySpec);
        let edits: [(&str, Edit); 12] = [
            ("provider", |s| s.provider = Some("gcp-us".into())),
            ("zone", |s| s.placement.as_mut().unwrap().zone = Some("europe-west1-c".into())),
            ("machine type", |s| s.placement.as_mut().unwrap().machine_type = Some("e2-small".into())),
            ("image", |s| s.placement.as_mut().unwrap().image = Some("debian-12".into())),
            ("placement removed", |s| s.placement = None),
            ("cloud-init content", |s| {
                s.cloud_init = Some(CloudInit { inline: Some("#cloud-config\nx: 1\n".into()), secret_ref: None })
            }),
            ("cloud-init reference", |s| {
                s.cloud_init = Some(CloudInit {
                    inline: None,
                    secret_ref: Some(SecretKeyRef { name: "ci".into(), key: "user-data".into() }),
                })
            }),
            ("cloud-init removed", |s| s.cloud_init = None),
            ("port", |s| s.port = 8080),
            ("auth added", |s| s.auth = Some(ProxyAuth { secret_ref: SecretNameRef { name: "creds".into() } })),
            ("empty zone differs from absent", |s| s.placement.as_mut().unwrap().zone = Some(String::new())),
            ("destinations denied", |s| {
                s.destinations = Some(crate::ProxyDestinations { deny: vec!["203.0.113.0/24".into()] })
            }),
        ];
        let original = spec_hash(&base(), None);
        for (name, edit) in edits {
            let mut spec = base();
            edit(&mut spec);
            assert_ne!(spec_hash(&spec, None), original, "{name} must change the hash");
        }
    }

    #[test]
    fn secret_key_change_changes_the_hash() {
        let with_key = |key: &str| ProxySpec {
            cloud_init: Some(CloudInit {
                inline: None,
                secret_ref: Some(SecretKeyRef { name: "ci".into(), key: key.into() }),
            }),
            ..base()
        };
        assert_ne!(spec_hash(&with_key("a"), None), spec_hash(&with_key("b"), None));
    }

    #[test]
    fn fields_that_do_not_change_the_instance_keep_the_hash() {
        type Edit = fn(&mut ProxySpec);
        let edits: [(&str, Edit); 4] = [
            ("health check", |s| {
                s.health_check =
                    HealthCheck { interval_seconds: 60, probe_url: Some("http://x/".into()), ..HealthCheck::default() }
            }),
            ("max leases", |s| s.max_leases = Some(0)),
            ("max age", |s| s.max_age = Some("24h".parse().unwrap())),
            ("endpoint", |s| s.endpoint = Some(Endpoint { host: "h".into(), port: 1 })),
        ];
        let original = spec_hash(&base(), None);
        for (name, edit) in edits {
            let mut spec = base();
            edit(&mut spec);
            assert_eq!(spec_hash(&spec, None), original, "{name} must not change the hash");
        }
    }

    #[test]
    fn rotate_token_changes_the_hash_and_empty_counts_as_none() {
        let plain = spec_hash(&base(), None);
        assert_ne!(spec_hash(&base(), Some("1")), plain);
        assert_ne!(spec_hash(&base(), Some("1")), spec_hash(&base(), Some("2")));
        assert_eq!(spec_hash(&base(), Some("")), plain);
    }
}
