//! Debian packages the tests need, installed by `cargo xtask test` when missing (and the two that compiling xtask
//! needs, installed before it compiles).
//!
//! Only what is absent is installed, so a warm machine spends one `dpkg-query` here. Without root (or without
//! apt-get) nothing is installed and the error names the command that would.

use std::process::Command;

use anyhow::{Result, bail};

use crate::process::{output, run};

/// The packages xtask's own build needs (the kvm provider's `virt-sys` finds libvirt with pkg-config), installed by
/// `cargo xtask` before it compiles xtask.
pub const TO_BUILD_XTASK: &[&str] = &["pkg-config", "libvirt-dev"];

/// The packages, and why each is needed.
pub const REQUIRED: &[(&str, &str)] = &[
    ("squid", "real Squid proxies for the kubernetes provider and the node agent"),
    ("openssl", "RSA service-account keys for the gcp provider's tests, and the https test sites' certificates"),
    ("pkg-config", "locating libvirt when building the kvm provider"),
    ("libvirt-dev", "the libvirt client library the kvm provider links"),
    ("libvirt-daemon-system", "a real libvirtd with directory pools for the kvm provider's tests"),
    ("qemu-utils", "qemu-img, which libvirt runs to create qcow2 overlays"),
    ("openssh-server", "sshd on loopback for the kvm provider's SSH tests"),
    ("netcat-openbsd", "nc, which libvirt runs on the far side of SSH to reach the daemon's socket"),
    ("genisoimage", "isoinfo, which reads the kvm provider's seed ISOs back in tests"),
    ("iproute2", "ip, which creates the network namespace and pod network the tests run in"),
    ("qemu-system-x86", "QEMU, which boots the kvm provider's guests (KVM when /dev/kvm opens, TCG otherwise)"),
    ("ovmf", "the UEFI firmware the guests boot with"),
    ("mmdebstrap", "building the guest image and the operator's image from Debian packages"),
    ("umoci", "assembling the operator's OCI image without a registry or a Docker daemon"),
    ("binutils", "strip, which takes the symbol table out of the binary the operator's image ships"),
    ("crun", "the OCI runtime that runs the operator's image in its test"),
    ("dosfstools", "mkfs.vfat for the guest image's EFI system partition"),
    ("mtools", "filling the guest image's EFI system partition without mounting it"),
    ("syslinux", "the guest image's BIOS boot loader"),
    ("syslinux-common", "the GPT MBR that starts SYSLINUX"),
    ("fdisk", "sfdisk, which writes the guest image's partition table"),
    ("e2fsprogs", "mkfs.ext4 -d, which makes the guest image's root filesystem from a directory"),
    ("dnsmasq-base", "DHCP for the guests on the boot test's own bridge"),
    ("util-linux", "unshare, nsenter and setpriv, with which the node agent gives pods mounts and users"),
    (
        "redis-server",
        "a real Redis for the shared lease state's tests (Valkey speaks the same protocol; Debian 12 has no Valkey)",
    ),
    ("prometheus", "promtool for the alert rules' unit tests, and a real Prometheus that scrapes the operator"),
];

fn installed(package: &str) -> bool {
    output(Command::new("dpkg-query").args(["-W", "-f=${Status}", package]))
        .is_some_and(|status| status.trim() == "install ok installed")
}

/// Whether this process runs as root (so it can install packages and run what needs root).
pub fn is_root() -> bool {
    output(Command::new("id").arg("-u")).is_some_and(|uid| uid.trim() == "0")
}

/// Installs every missing package of [`REQUIRED`] with apt-get when running as root.
pub fn ensure_installed() -> Result<()> {
    ensure(&REQUIRED.iter().map(|(name, _)| *name).collect::<Vec<_>>())
}

/// Installs those of `packages` (names from [`REQUIRED`]) that are missing, with apt-get when running as root.
pub fn ensure(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages.iter().copied().filter(|name| !installed(name)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let command = format!("apt-get install -y {}", missing.join(" "));
    if !is_root() || output(Command::new("apt-get").arg("--version")).is_none() {
        let reasons: Vec<String> = REQUIRED
            .iter()
            .filter(|(name, _)| missing.contains(name))
            .map(|(name, why)| format!("{name} ({why})"))
            .collect();
        bail!("missing Debian packages: {}; install them with `{command}` as root", reasons.join(", "));
    }
    eprintln!("installing missing Debian packages: {}", missing.join(" "));
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_building_xtask_needs_is_listed_with_its_reason() {
        for name in TO_BUILD_XTASK {
            assert!(REQUIRED.iter().any(|(listed, _)| listed == name), "{name} is not in REQUIRED");
        }
    }
}
