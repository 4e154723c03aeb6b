//! The guest image the kvm provider's boot test boots: Debian from packages, built by `cargo xtask guest-image`
//! (and by `cargo xtask test`) into the cache, keyed by this recipe.
//!
//! The recipe is data, here, so the builder (xtask) and the test agree on where the image is without either
//! computing anything the other does not: [`image_dir`] is `<cache>/guest/<key>`, and the key is a hash of
//! everything below. Changing a package, a file or the layout changes the key, and so rebuilds the image.
//!
//! What the image is: one disk with a GPT holding an EFI system partition (FAT, label `EGRESS-ESP`) and an ext4 root
//! (label `egress-root`). UEFI boots Debian's signed shim and GRUB from the ESP, so OVMF's Secure Boot firmware (the
//! one libvirt picks first for `firmware="efi"`) accepts it; BIOS boots SYSLINUX from the same ESP through the GPT
//! MBR, with a copy of the kernel and initrd there. The kernel is Debian's cloud kernel, as in Debian's own
//! `genericcloud` images. cloud-init reads only NoCloud (no network metadata services to wait for), systemd-networkd
//! configures every Ethernet link by DHCP, qemu-guest-agent and Squid are installed (Squid disabled until cloud-init
//! configures and starts it), and the image has no apt sources: everything the provider's cloud-config asks for is
//! installed already, and nothing is downloaded at boot. Nothing of the build machine stays in it: no resolver, no
//! machine id, no hostname.

use std::path::PathBuf;

use sha2::{Digest, Sha256};

use crate::assets::cache_dir;

/// The Debian release the guest runs; the host's own apt sources must serve it.
pub const SUITE: &str = "bookworm";

/// The packages installed into the root filesystem (beyond Debian's essential set and apt).
pub const PACKAGES: &[&str] = &[
    "linux-image-cloud-amd64",
    "initramfs-tools",
    "zstd",
    "systemd-sysv",
    "udev",
    "dbus",
    "e2fsprogs",
    "netbase",
    "iproute2",
    "procps",
    "cloud-init",
    "qemu-guest-agent",
    "squid",
];

/// The packages whose files make the ESP's UEFI boot chain, unpacked (never installed) during the build:
/// `(package, file in it, where it goes on the ESP)`.
pub const ESP_BINARIES: &[(&str, &str, &str)] = &[
    ("shim-signed", "usr/lib/shim/shimx64.efi.signed", "EFI/BOOT/BOOTX64.EFI"),
    ("grub-efi-amd64-signed", "usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed", "EFI/BOOT/grubx64.efi"),
];

/// The label of the root filesystem, which the kernel command line and `/etc/fstab` name.
pub const ROOT_LABEL: &str = "egress-root";
/// The label of the EFI system partition.
pub const ESP_LABEL: &str = "EGRESS-ESP";
/// The ESP's size in MiB: the boot chain and a copy of the kernel and initrd for SYSLINUX.
pub const ESP_MIB: u64 = 160;

const KERNEL_ARGS: &str = "root=LABEL=egress-root ro console=tty0 console=ttyS0,115200";

/// Files written into the root filesystem after the packages: `(path, mode, content)`.
pub const ROOT_FILES: &[(&str, u32, &str)] = &[
    ("etc/fstab", 0o644, "LABEL=egress-root / ext4 errors=remount-ro 0 1\n"),
    (
        "etc/systemd/network/80-egress-dhcp.network",
        0o644,
        "# Every Ethernet link by DHCP (egress-operator's test image).\n[Match]\nName=en* eth*\n\n[Network]\nDHCP=yes\n",
    ),
    (
        "etc/cloud/cloud.cfg.d/90-egress-image.cfg",
        0o644,
        "# egress-operator's test image: the seed ISO is the only datasource, systemd-networkd owns the network, and\n\
         # what the image lacks (locales, an SSH server) is not configured.\n\
         datasource_list: [NoCloud, None]\nnetwork: {config: disabled}\nlocale: false\nssh_genkeytypes: []\n",
    ),
];

/// Files written onto the ESP: `(path, content)`. GRUB finds its configuration at `/EFI/debian/grub.cfg` (the signed
/// image's prefix) and SYSLINUX at `/syslinux.cfg`.
pub fn esp_files() -> Vec<(&'static str, String)> {
    let grub = format!(
        "set timeout=0\nsearch --no-floppy --label --set=root {ROOT_LABEL}\nlinux /vmlinuz {KERNEL_ARGS}\n\
         initrd /initrd.img\nboot\n"
    );
    let syslinux = format!(
        "DEFAULT egress\nPROMPT 0\nTIMEOUT 0\nLABEL egress\n  LINUX /vmlinuz\n  INITRD /initrd.img\n  APPEND \
         {KERNEL_ARGS}\n"
    );
    vec![("EFI/debian/grub.cfg", grub.clone()), ("EFI/BOOT/grub.cfg", grub), ("syslinux.cfg", syslinux)]
}

/// Units enabled and disabled in the root filesystem.
pub const ENABLE_UNITS: &[&str] = &["systemd-networkd"];
/// Squid starts only once cloud-init has written its configuration.
pub const DISABLE_UNITS: &[&str] = &["squid"];

/// Bumped when the build steps change in a way the data above does not show.
const LAYOUT: &str = "gpt esp+ext4 v2, no resolv.conf";

/// The file name of the image in [`image_dir`].
pub const IMAGE_FILE: &str = "egress-guest.qcow2";

/// The recipe's key: the first 16 hex digits of a hash over everything that goes into the image.
pub fn key() -> String {
    let mut digest = Sha256::new();
    for part in [SUITE, LAYOUT, KERNEL_ARGS, ROOT_LABEL, ESP_LABEL] {
        digest.update(part.as_bytes());
        digest.update([0]);
    }
    digest.update(ESP_MIB.to_le_bytes());
    for package in PACKAGES {
        digest.update(package.as_bytes());
        digest.update([0]);
    }
    for (package, file, target) in ESP_BINARIES {
        digest.update(format!("{package}\0{file}\0{target}\0").as_bytes());
    }
    for (path, mode, content) in ROOT_FILES {
        digest.update(format!("{path}\0{mode:o}\0{content}\0").as_bytes());
    }
    for (path, content) in esp_files() {
        digest.update(format!("{path}\0{content}\0").as_bytes());
    }
    for unit in ENABLE_UNITS.iter().chain(DISABLE_UNITS) {
        digest.update(unit.as_bytes());
        digest.update([1]);
    }
    digest.finalize().iter().take(8).map(|byte| format!("{byte:02x}")).collect()
}

/// Where the built image lives: `<cache>/guest/<key>`.
pub fn image_dir() -> PathBuf {
    cache_dir().join("guest").join(key())
}

/// The image itself.
pub fn image_path() -> PathBuf {
    image_dir().join(IMAGE_FILE)
}

/// The image's sha256 (hex), as the build recorded it; `None` until the image is built.
pub fn image_sha256() -> Option<String> {
    let recorded = std::fs::read_to_string(image_dir().join(format!("{IMAGE_FILE}.sha256"))).ok()?;
    let sha = recorded.split_whitespace().next()?.to_owned();
    (sha.len() == 64 && image_path().is_file()).then_some(sha)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_stable_and_short() {
        assert_eq!(key(), key());
        assert_eq!(key().len(), 16);
        assert!(image_path().ends_with(format!("{}/{IMAGE_FILE}", key())));
    }

    #[test]
    fn both_boot_paths_name_the_root_by_label() {
        for (_, content) in esp_files() {
            assert!(content.contains(&format!("root=LABEL={ROOT_LABEL}")), "{content}");
        }
        assert!(ROOT_FILES[0].2.starts_with(&format!("LABEL={ROOT_LABEL} / ")));
    }
}
