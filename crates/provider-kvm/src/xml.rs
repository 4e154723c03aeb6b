//! The XML this provider gives libvirt (domains, volumes), written with quick-xml, and reads back with roxmltree (the
//! GC contract in a domain's metadata).

use std::io;

use egress_provider::Tags;
use quick_xml::Writer;
use quick_xml::events::BytesText;

/// The namespace of the provider's `<metadata>` element.
pub const METADATA_NAMESPACE: &str = "https://egress-operator.dev/xmlns/kvm/1";
/// The prefix the element uses.
pub const METADATA_PREFIX: &str = "egress";

/// An XML writer into memory, indented by two spaces; quick-xml escapes every text and attribute value.
type Xml = Writer<Vec<u8>>;
type Written = io::Result<()>;

/// The document `write` writes, as text ending in a newline.
fn document(write: impl FnOnce(&mut Xml) -> Written) -> String {
    let mut xml = Writer::new_with_indent(Vec::new(), b' ', 2);
    write(&mut xml).expect("writing XML into memory cannot fail");
    let mut text = String::from_utf8(xml.into_inner()).expect("XML written from UTF-8 text is UTF-8");
    text.push('\n');
    text
}

/// `<name>value</name>`.
fn text(xml: &mut Xml, name: &str, value: &str) -> Written {
    xml.create_element(name).write_text_content(BytesText::new(value))?;
    Ok(())
}

/// `<name attribute="value"/>`.
fn empty(xml: &mut Xml, name: &str, attributes: &[(&str, &str)]) -> Written {
    xml.create_element(name).with_attributes(attributes.iter().copied()).write_empty()?;
    Ok(())
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
    let hardware = spec.domain_type != "test";
    document(|xml| {
        let domain = xml.create_element("domain").with_attribute(("type", spec.domain_type.as_str()));
        domain.write_inner_content(|xml| {
            text(xml, "name", &spec.name)?;
            xml.create_element("metadata")
                .write_inner_content(|xml| write_metadata(xml, &spec.tags, spec.port, spec.created_unix))?;
            let memory = spec.memory_mib.to_string();
            xml.create_element("memory").with_attribute(("unit", "MiB")).write_text_content(BytesText::new(&memory))?;
            text(xml, "vcpu", &spec.vcpus.to_string())?;
            let os = xml.create_element("os");
            let os =
                if hardware && spec.firmware == Firmware::Uefi { os.with_attribute(("firmware", "efi")) } else { os };
            os.write_inner_content(|xml| {
                let kind = xml.create_element("type");
                let kind = if hardware { kind.with_attributes([("arch", "x86_64"), ("machine", "q35")]) } else { kind };
                kind.write_text_content(BytesText::new("hvm"))?;
                empty(xml, "boot", &[("dev", "hd")])
            })?;
            if hardware {
                xml.create_element("features").write_inner_content(|xml| {
                    empty(xml, "acpi", &[])?;
                    empty(xml, "apic", &[])
                })?;
                if spec.domain_type == "kvm" {
                    empty(xml, "cpu", &[("mode", "host-passthrough")])?;
                }
            }
            empty(xml, "clock", &[("offset", "utc")])?;
            text(xml, "on_poweroff", "destroy")?;
            text(xml, "on_reboot", "restart")?;
            text(xml, "on_crash", "destroy")?;
            xml.create_element("devices").write_inner_content(|xml| devices(xml, spec, hardware))?;
            Ok(())
        })?;
        Ok(())
    })
}

/// The domain's devices: the overlay disk, the seed as a read-only disk, the bridged NIC, and on real hardware the
/// guest agent's channel, a serial console logged to a file, and a random number generator.
fn devices(xml: &mut Xml, spec: &DomainSpec, hardware: bool) -> Written {
    let disk = |xml: &mut Xml, format: &str, file: &str, device: &str, readonly: bool| -> Written {
        xml.create_element("disk").with_attributes([("type", "file"), ("device", "disk")]).write_inner_content(
            |xml| {
                empty(xml, "driver", &[("name", "qemu"), ("type", format)])?;
                empty(xml, "source", &[("file", file)])?;
                empty(xml, "target", &[("dev", device), ("bus", "virtio")])?;
                if readonly {
                    empty(xml, "readonly", &[])?;
                }
                Ok(())
            },
        )?;
        Ok(())
    };
    disk(xml, "qcow2", &spec.disk_path, "vda", false)?;
    disk(xml, "raw", &spec.seed_path, "vdb", true)?;
    xml.create_element("interface").with_attribute(("type", "bridge")).write_inner_content(|xml| {
        empty(xml, "source", &[("bridge", spec.bridge.as_str())])?;
        empty(xml, "model", &[("type", "virtio")])
    })?;
    if hardware {
        xml.create_element("channel").with_attribute(("type", "unix")).write_inner_content(|xml| {
            empty(xml, "target", &[("type", "virtio"), ("name", "org.qemu.guest_agent.0")])
        })?;
        // The serial console is also written to a file on the host, so a guest that never comes up can be read.
        let log = console_log(&spec.name);
        xml.create_element("serial")
            .with_attribute(("type", "pty"))
            .write_inner_content(|xml| empty(xml, "log", &[("file", log.as_str()), ("append", "off")]))?;
        empty(xml, "console", &[("type", "pty")])?;
        xml.create_element("rng").with_attribute(("model", "virtio")).write_inner_content(|xml| {
            xml.create_element("backend")
                .with_attribute(("model", "random"))
                .write_text_content(BytesText::new("/dev/urandom"))?;
            Ok(())
        })?;
    }
    Ok(())
}

/// Where the host keeps a guest's serial console output (libvirt's log directory; the file outlives the guest, like
/// libvirt's own log of it).
pub fn console_log(name: &str) -> String {
    format!("/var/log/libvirt/qemu/{name}-serial.log")
}

/// The provider's metadata element: every tag, the port and the creation time.
pub fn metadata(tags: &Tags, port: u16, created_unix: u64) -> String {
    document(|xml| write_metadata(xml, tags, port, created_unix))
}

fn write_metadata(xml: &mut Xml, tags: &Tags, port: u16, created_unix: u64) -> Written {
    let element = |name: &str| format!("{METADATA_PREFIX}:{name}");
    let namespace = format!("xmlns:{METADATA_PREFIX}");
    xml.create_element(element("instance"))
        .with_attribute((namespace.as_str(), METADATA_NAMESPACE))
        .write_inner_content(|xml| {
            for (key, value) in tags.iter() {
                xml.create_element(element("tag"))
                    .with_attribute(("key", key))
                    .write_text_content(BytesText::new(value))?;
            }
            text(xml, &element("port"), &port.to_string())?;
            text(xml, &element("created"), &created_unix.to_string())
        })?;
    Ok(())
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
    document(|xml| {
        xml.create_element("volume").write_inner_content(|xml| {
            text(xml, "name", name)?;
            let capacity = capacity_bytes.to_string();
            xml.create_element("capacity")
                .with_attribute(("unit", "bytes"))
                .write_text_content(BytesText::new(&capacity))?;
            xml.create_element("target").write_inner_content(|xml| empty(xml, "format", &[("type", format)]))?;
            if let Some((path, backing_format)) = backing {
                xml.create_element("backingStore").write_inner_content(|xml| {
                    text(xml, "path", path)?;
                    empty(xml, "format", &[("type", backing_format)])
                })?;
            }
            Ok(())
        })?;
        Ok(())
    })
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
    fn attribute_values_are_escaped() {
        let mut odd = spec("kvm", Firmware::Uefi);
        odd.disk_path = "/pool/a \"b\" & <c>.qcow2".into();
        let facts = domain_facts(&domain(&odd)).expect("well-formed");
        assert_eq!(facts.disk_paths[0], "/pool/a \"b\" & <c>.qcow2");
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
