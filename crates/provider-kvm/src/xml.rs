//! The XML this provider gives libvirt (domains, volumes) and reads back (the GC contract in a domain's metadata).

use std::fmt::Write as _;

use egress_provider::Tags;

/// The namespace of the provider's `<metadata>` element.
pub const METADATA_NAMESPACE: &str = "https://egress-operator.dev/xmlns/kvm/1";
/// The prefix the element uses.
pub const METADATA_PREFIX: &str = "egress";

/// Escapes text for an XML element or a double-quoted attribute.
pub fn escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&apos;"),
            c => escaped.push(c),
        }
    }
    escaped
}

/// Firmware the guest boots with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Firmware {
    /// UEFI, with a per-domain NVRAM libvirt creates from its template (and removes on undefine).
    Uefi,
    /// SeaBIOS.
    Bios,
}

/// Everything a domain definition needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DomainSpec {
    /// The domain's name (the instance name).
    pub name: String,
    /// `kvm`, `qemu`, or `test` for libvirt's test driver.
    pub domain_type: String,
    /// Virtual CPUs.
    pub vcpus: u32,
    /// Memory in MiB.
    pub memory_mib: u32,
    /// Boot firmware.
    pub firmware: Firmware,
    /// The overlay disk's path on the host.
    pub disk_path: String,
    /// The seed ISO's path on the host.
    pub seed_path: String,
    /// The bridge the NIC attaches to.
    pub bridge: String,
    /// The GC contract and identity.
    pub tags: Tags,
    /// The proxy port (kept with the tags, for people reading the domain).
    pub port: u16,
    /// When the instance was created, in seconds since the Unix epoch.
    pub created_unix: u64,
}

/// The domain XML for `spec`: path-based file disks (AppArmor's libvirt profile grants those), a bridged virtio
/// NIC, the guest agent's channel, and the provider's metadata.
///
/// The seed ISO is a read-only virtio disk, not a CD-ROM: Debian's cloud kernel (the one in its `genericcloud`
/// images) has no ATA or SCSI CD-ROM drivers, and NoCloud finds the `cidata` label on any block device.
pub fn domain(spec: &DomainSpec) -> String {
    let mut xml = format!("<domain type=\"{}\">\n  <name>{}</name>\n", escape(&spec.domain_type), escape(&spec.name));
    xml.push_str("  <metadata>\n");
    xml.push_str(&metadata(&spec.tags, spec.port, spec.created_unix));
    xml.push_str("  </metadata>\n");
    let _ = writeln!(xml, "  <memory unit=\"MiB\">{}</memory>", spec.memory_mib);
    let _ = writeln!(xml, "  <vcpu>{}</vcpu>", spec.vcpus);
    let hardware = spec.domain_type != "test";
    match (hardware, spec.firmware) {
        (true, Firmware::Uefi) => xml.push_str("  <os firmware=\"efi\">\n"),
        _ => xml.push_str("  <os>\n"),
    }
    if hardware {
        xml.push_str("    <type arch=\"x86_64\" machine=\"q35\">hvm</type>\n");
    } else {
        xml.push_str("    <type>hvm</type>\n");
    }
    xml.push_str("    <boot dev=\"hd\"/>\n  </os>\n");
    if hardware {
        xml.push_str("  <features>\n    <acpi/>\n    <apic/>\n  </features>\n");
        if spec.domain_type == "kvm" {
            xml.push_str("  <cpu mode=\"host-passthrough\"/>\n");
        }
    }
    xml.push_str(
        "  <clock offset=\"utc\"/>\n  <on_poweroff>destroy</on_poweroff>\n  <on_reboot>restart</on_reboot>\n  \
         <on_crash>destroy</on_crash>\n  <devices>\n",
    );
    let _ = write!(
        xml,
        "    <disk type=\"file\" device=\"disk\">\n      <driver name=\"qemu\" type=\"qcow2\"/>\n      <source \
         file=\"{disk}\"/>\n      <target dev=\"vda\" bus=\"virtio\"/>\n    </disk>\n    <disk type=\"file\" \
         device=\"disk\">\n      <driver name=\"qemu\" type=\"raw\"/>\n      <source file=\"{seed}\"/>\n      \
         <target dev=\"vdb\" bus=\"virtio\"/>\n      <readonly/>\n    </disk>\n    <interface type=\"bridge\">\n      \
         <source bridge=\"{bridge}\"/>\n      <model type=\"virtio\"/>\n    </interface>\n",
        disk = escape(&spec.disk_path),
        seed = escape(&spec.seed_path),
        bridge = escape(&spec.bridge),
    );
    if hardware {
        // The serial console is also written to a file on the host, so a guest that never comes up can be read.
        let _ = write!(
            xml,
            "    <channel type=\"unix\">\n      <target type=\"virtio\" name=\"org.qemu.guest_agent.0\"/>\n    \
             </channel>\n    <serial type=\"pty\">\n      <log file=\"{log}\" append=\"off\"/>\n    </serial>\n    \
             <console type=\"pty\"/>\n    <rng model=\"virtio\">\n      <backend \
             model=\"random\">/dev/urandom</backend>\n    </rng>\n",
            log = escape(&console_log(&spec.name)),
        );
    }
    xml.push_str("  </devices>\n</domain>\n");
    xml
}

/// Where the host keeps a guest's serial console output (libvirt's log directory; the file outlives the guest, like
/// libvirt's own log of it).
pub fn console_log(name: &str) -> String {
    format!("/var/log/libvirt/qemu/{name}-serial.log")
}

/// The provider's metadata element: every tag, the port and the creation time.
pub fn metadata(tags: &Tags, port: u16, created_unix: u64) -> String {
    let mut xml = format!("    <{METADATA_PREFIX}:instance xmlns:{METADATA_PREFIX}=\"{METADATA_NAMESPACE}\">\n");
    for (key, value) in tags.iter() {
        let _ = writeln!(
            xml,
            "      <{METADATA_PREFIX}:tag key=\"{}\">{}</{METADATA_PREFIX}:tag>",
            escape(key),
            escape(value)
        );
    }
    let _ = writeln!(xml, "      <{METADATA_PREFIX}:port>{port}</{METADATA_PREFIX}:port>");
    let _ = writeln!(xml, "      <{METADATA_PREFIX}:created>{created_unix}</{METADATA_PREFIX}:created>");
    let _ = writeln!(xml, "    </{METADATA_PREFIX}:instance>");
    xml
}

/// What a domain's XML says about it, as far as this provider cares.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DomainFacts {
    /// The tags of the provider's metadata; empty when the domain has none (not ours).
    pub tags: Tags,
    /// Whether the provider's metadata element is present.
    pub ours: bool,
    /// The file paths of its disks, in order.
    pub disk_paths: Vec<String>,
    /// When the provider created it (seconds since the Unix epoch).
    pub created_unix: Option<u64>,
}

/// Reads the provider's metadata and disk paths out of a domain's XML.
pub fn domain_facts(xml: &str) -> Result<DomainFacts, String> {
    let document = roxmltree::Document::parse(xml).map_err(|error| format!("unreadable domain XML: {error}"))?;
    let mut facts = DomainFacts::default();
    for node in document.descendants() {
        if node.tag_name().namespace() == Some(METADATA_NAMESPACE) {
            match node.tag_name().name() {
                "instance" => facts.ours = true,
                "created" => facts.created_unix = node.text().and_then(|text| text.trim().parse().ok()),
                "tag" => {
                    if let Some(key) = node.attribute("key") {
                        facts.tags.insert(key, node.text().unwrap_or_default());
                    }
                }
                _ => {}
            }
        }
        if node.has_tag_name("disk")
            && let Some(source) = node.children().find(|child| child.has_tag_name("source"))
            && let Some(file) = source.attribute("file")
        {
            facts.disk_paths.push(file.to_owned());
        }
    }
    Ok(facts)
}

/// A volume in a directory pool: `format` is `qcow2` or `raw`; a qcow2 volume may sit on a backing file.
pub fn volume(name: &str, capacity_bytes: u64, format: &str, backing: Option<(&str, &str)>) -> String {
    let mut xml = format!(
        "<volume>\n  <name>{}</name>\n  <capacity unit=\"bytes\">{capacity_bytes}</capacity>\n  <target>\n    \
         <format type=\"{}\"/>\n  </target>\n",
        escape(name),
        escape(format)
    );
    if let Some((path, backing_format)) = backing {
        let _ = write!(
            xml,
            "  <backingStore>\n    <path>{}</path>\n    <format type=\"{}\"/>\n  </backingStore>\n",
            escape(path),
            escape(backing_format)
        );
    }
    xml.push_str("</volume>\n");
    xml
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(domain_type: &str, firmware: Firmware) -> DomainSpec {
        DomainSpec {
            name: "px-a".into(),
            domain_type: domain_type.into(),
            vcpus: 2,
            memory_mib: 1024,
            firmware,
            disk_path: "/var/lib/libvirt/images/px-a.qcow2".into(),
            seed_path: "/var/lib/libvirt/images/px-a-seed.iso".into(),
            bridge: "br0".into(),
            tags: Tags::gc_contract("c1", "uid-1", "hash<&>"),
            port: 3128,
            created_unix: 1_700_000_000,
        }
    }

    #[test]
    fn a_kvm_domain_has_file_disks_a_bridge_uefi_and_the_agent_channel() {
        let xml = domain(&spec("kvm", Firmware::Uefi));
        roxmltree::Document::parse(&xml).expect("well-formed");
        for part in [
            "<domain type=\"kvm\">",
            "<os firmware=\"efi\">",
            "<type arch=\"x86_64\" machine=\"q35\">hvm</type>",
            "<cpu mode=\"host-passthrough\"/>",
            "<disk type=\"file\" device=\"disk\">",
            "<source file=\"/var/lib/libvirt/images/px-a.qcow2\"/>",
            "<source file=\"/var/lib/libvirt/images/px-a-seed.iso\"/>",
            "<target dev=\"vdb\" bus=\"virtio\"/>",
            "<interface type=\"bridge\">",
            "<source bridge=\"br0\"/>",
            "org.qemu.guest_agent.0",
            "<memory unit=\"MiB\">1024</memory>",
            "<vcpu>2</vcpu>",
            "<log file=\"/var/log/libvirt/qemu/px-a-serial.log\" append=\"off\"/>",
        ] {
            assert!(xml.contains(part), "{part} in\n{xml}");
        }
    }

    /// Found booting Debian's cloud kernel: it has no ATA, so a seed on a SATA CD-ROM is never read and the guest
    /// comes up without its Squid.
    #[test]
    fn the_seed_is_a_read_only_virtio_disk_every_cloud_kernel_sees() {
        let xml = domain(&spec("kvm", Firmware::Uefi));
        let document = roxmltree::Document::parse(&xml).expect("well-formed");
        let seed = document
            .descendants()
            .filter(|node| node.has_tag_name("disk"))
            .find(|disk| {
                disk.children().any(|child| {
                    child.has_tag_name("source")
                        && child.attribute("file").is_some_and(|file| file.ends_with("seed.iso"))
                })
            })
            .expect("the seed disk");
        assert_eq!(seed.attribute("device"), Some("disk"));
        let target = seed.children().find(|child| child.has_tag_name("target")).expect("target");
        assert_eq!(target.attribute("bus"), Some("virtio"));
        assert!(seed.children().any(|child| child.has_tag_name("readonly")));
        assert!(!xml.contains("sata") && !xml.contains("cdrom"), "{xml}");
    }

    #[test]
    fn bios_and_emulation_change_only_their_parts() {
        let xml = domain(&spec("qemu", Firmware::Bios));
        assert!(xml.contains("<domain type=\"qemu\">") && xml.contains("  <os>\n"), "{xml}");
        assert!(!xml.contains("host-passthrough") && !xml.contains("firmware="), "{xml}");
        let test = domain(&spec("test", Firmware::Uefi));
        assert!(test.contains("<type>hvm</type>") && !test.contains("firmware="), "{test}");
    }

    #[test]
    fn the_metadata_round_trips_with_escaping() {
        let xml = domain(&spec("kvm", Firmware::Uefi));
        let facts = domain_facts(&xml).expect("parses");
        assert!(facts.ours);
        assert_eq!(facts.tags, Tags::gc_contract("c1", "uid-1", "hash<&>"));
        assert_eq!(facts.created_unix, Some(1_700_000_000));
        assert_eq!(facts.disk_paths, ["/var/lib/libvirt/images/px-a.qcow2", "/var/lib/libvirt/images/px-a-seed.iso"]);
        let foreign = domain_facts("<domain><name>x</name></domain>").expect("parses");
        assert!(!foreign.ours && foreign.tags.is_empty());
        assert!(domain_facts("<domain>").is_err());
    }

    #[test]
    fn volumes_may_have_a_backing_file() {
        let overlay = volume("px-a.qcow2", 4 << 30, "qcow2", Some(("/pool/base", "qcow2")));
        let document = roxmltree::Document::parse(&overlay).expect("well-formed");
        let path = document.descendants().find(|node| node.has_tag_name("path")).and_then(|node| node.text());
        assert_eq!(path, Some("/pool/base"));
        assert!(overlay.contains("<capacity unit=\"bytes\">4294967296</capacity>"));
        assert!(!volume("seed", 2048, "raw", None).contains("backingStore"));
    }
}
