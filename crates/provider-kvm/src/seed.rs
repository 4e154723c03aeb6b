//! The NoCloud seed a guest boots with: an ISO labelled `cidata` holding `user-data`, `meta-data` and
//! `vendor-data`.
//!
//! - `user-data` is the Proxy's cloud-init byte for byte, else a cloud-config that installs Squid
//!   ([`egress_provider::cloud_init`]).
//! - `meta-data` names the instance (`instance-id`, `local-hostname`).
//! - `vendor-data` is MIME multipart: a shell script that installs and starts qemu-guest-agent (so libvirt learns the
//!   guest's addresses), and the configured vendor-data, if any, as a second part. cloud-init runs vendor-data
//!   beside user-data; user-data can still turn it off (`vendor_data: {enabled: false}`).

use egress_provider::CreateRequest;
use egress_provider::destinations::DestinationPolicy;
use sha2::{Digest, Sha256};

use crate::iso::{self, File, IsoError};

/// The volume label NoCloud looks for.
pub const LABEL: &str = "cidata";

/// The script that installs and starts the guest agent, whatever the distribution's package manager.
pub const GUEST_AGENT_SCRIPT: &str = "#!/bin/sh\n\
# Added by egress-operator: qemu-guest-agent tells libvirt this guest's addresses.\n\
if ! command -v qemu-ga >/dev/null 2>&1; then\n\
  if command -v apt-get >/dev/null 2>&1; then\n\
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-guest-agent\n\
  elif command -v dnf >/dev/null 2>&1; then\n\
    dnf install -y qemu-guest-agent\n\
  elif command -v yum >/dev/null 2>&1; then\n\
    yum install -y qemu-guest-agent\n\
  elif command -v apk >/dev/null 2>&1; then\n\
    apk add qemu-guest-agent\n\
  elif command -v zypper >/dev/null 2>&1; then\n\
    zypper --non-interactive install qemu-guest-agent\n\
  fi\n\
fi\n\
systemctl enable --now qemu-guest-agent 2>/dev/null || service qemu-guest-agent start 2>/dev/null || \
rc-service qemu-guest-agent start 2>/dev/null || true\n";

/// The three files of the seed, by name; the default user-data enforces `destinations`.
pub fn files(request: &CreateRequest, vendor_data: Option<&str>, destinations: &DestinationPolicy) -> Vec<File> {
    vec![
        File { name: "user-data".into(), data: egress_provider::cloud_init::for_request(request, destinations) },
        File {
            name: "meta-data".into(),
            data: format!("instance-id: {name}\nlocal-hostname: {name}\n", name = request.name).into_bytes(),
        },
        File { name: "vendor-data".into(), data: vendor_multipart(vendor_data).into_bytes() },
    ]
}

/// The seed ISO for `request`.
pub fn image(
    request: &CreateRequest,
    vendor_data: Option<&str>,
    destinations: &DestinationPolicy,
) -> Result<Vec<u8>, IsoError> {
    iso::build(LABEL, &files(request, vendor_data, destinations))
}

/// The vendor-data document: the guest-agent script, then the configured vendor-data.
pub fn vendor_multipart(configured: Option<&str>) -> String {
    let mut parts = vec![("text/x-shellscript", "egress-guest-agent.sh", GUEST_AGENT_SCRIPT)];
    if let Some(configured) = configured {
        parts.push((content_type(configured), "vendor-data", configured));
    }
    // A boundary derived from the content cannot occur in it by accident.
    let mut digest = Sha256::new();
    for (_, _, body) in &parts {
        digest.update(body.as_bytes());
    }
    let boundary = format!("egress-{}", &hex(&digest.finalize())[..24]);
    let mut text = format!("Content-Type: multipart/mixed; boundary=\"{boundary}\"\nMIME-Version: 1.0\n\n");
    for (kind, file_name, body) in parts {
        text.push_str(&format!(
            "--{boundary}\nContent-Type: {kind}; charset=\"utf-8\"\nMIME-Version: 1.0\nContent-Transfer-Encoding: \
             8bit\nContent-Disposition: attachment; filename=\"{file_name}\"\n\n{body}"
        ));
        if !body.ends_with('\n') {
            text.push('\n');
        }
    }
    text.push_str(&format!("--{boundary}--\n"));
    text
}

/// The MIME type cloud-init expects for a part, from its first line (as cloud-init itself sniffs it).
fn content_type(body: &str) -> &'static str {
    let first = body.lines().next().unwrap_or_default();
    if first.starts_with("#cloud-config") {
        "text/cloud-config"
    } else if first.starts_with("#!") {
        "text/x-shellscript"
    } else if first.starts_with("#cloud-boothook") {
        "text/cloud-boothook"
    } else if first.starts_with("#include") {
        "text/x-include-url"
    } else {
        "text/plain"
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use egress_provider::{Sensitive, Tags};

    use super::*;

    fn request(cloud_init: Option<&str>) -> CreateRequest {
        CreateRequest {
            cloud_init: cloud_init.map(|text| Sensitive::new(text.as_bytes().to_vec())),
            ..CreateRequest::new("px-a", 3128, Tags::gc_contract("c1", "uid", "hash"))
        }
    }

    #[test]
    fn user_data_is_the_proxys_byte_for_byte() {
        let own = "#cloud-config\r\nruncmd: [ [echo, 'é'] ]\n\n";
        let files = files(&request(Some(own)), None, &DestinationPolicy::default());
        assert_eq!(files[0].name, "user-data");
        assert_eq!(files[0].data, own.as_bytes());
        assert_eq!(files[1].data, b"instance-id: px-a\nlocal-hostname: px-a\n");
    }

    #[test]
    fn without_cloud_init_the_guest_installs_squid() {
        let files = files(&request(None), None, &DestinationPolicy::default());
        let text = String::from_utf8(files[0].data.clone()).expect("utf-8");
        assert!(text.starts_with("#cloud-config\n") && text.contains("http_port 3128"), "{text}");
    }

    #[test]
    fn vendor_data_carries_the_agent_and_the_configured_part() {
        let alone = vendor_multipart(None);
        assert!(alone.contains("text/x-shellscript") && alone.contains("qemu-guest-agent"), "{alone}");
        assert_eq!(alone.matches("Content-Disposition").count(), 1);
        let both = vendor_multipart(Some("#cloud-config\nntp: {enabled: true}\n"));
        assert!(both.contains("Content-Type: text/cloud-config"), "{both}");
        assert!(both.contains("ntp: {enabled: true}"), "{both}");
        let boundary = both.split("boundary=\"").nth(1).and_then(|rest| rest.split('"').next()).expect("boundary");
        assert_eq!(both.matches(&format!("--{boundary}\n")).count(), 2);
        assert!(both.ends_with(&format!("--{boundary}--\n")));
    }

    #[test]
    fn parts_are_typed_like_cloud_init_sniffs_them() {
        assert_eq!(content_type("#!/bin/bash\necho"), "text/x-shellscript");
        assert_eq!(content_type("#cloud-boothook\n"), "text/cloud-boothook");
        assert_eq!(content_type("plain"), "text/plain");
    }
}
