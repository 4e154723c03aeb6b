//! `cargo xtask guest-image`: builds the kvm boot test's Debian guest image from packages into the cache
//! (`egress_testenv::guest` holds the recipe and says what the image is).
//!
//! Nothing is mounted and no loop device is used: `mmdebstrap` fills a directory from the host's own apt sources,
//! `mkfs.ext4 -d` turns it into the root filesystem, mtools fill the FAT ESP, `syslinux` installs into the ESP's
//! image file, `sfdisk` writes the GPT, and `qemu-img` converts the assembled raw disk to qcow2. The build runs in a
//! scratch directory beside the image's and is renamed into place at the end, so an interrupted build never leaves
//! an image that looks finished. A built image is reused until the recipe's key changes.

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use egress_testenv::guest::{self, ESP_LABEL, ESP_MIB, IMAGE_FILE, ROOT_LABEL};
use sha2::{Digest, Sha256};

use crate::process::run;

/// The GPT partition types.
const ESP_TYPE: &str = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B";
const LINUX_TYPE: &str = "0FC63DAF-8483-4772-8E79-3D69D8477DE4";
/// The SYSLINUX MBR that boots the partition marked LegacyBIOSBootable.
const GPT_MBR: &str = "/usr/lib/syslinux/mbr/gptmbr.bin";
const MIB: u64 = 1 << 20;

/// The image, built if the cache does not hold it for this recipe; returns its path.
pub fn ensure_built() -> Result<PathBuf> {
    let path = guest::image_path();
    if guest::image_sha256().is_some() {
        eprintln!("guest image: {} is current (recipe {})", path.display(), guest::key());
        return Ok(path);
    }
    if !crate::packages::is_root() {
        bail!("building the guest image needs root (mmdebstrap installs packages into a directory as root)");
    }
    let sources = host_sources()?;
    let dir = guest::image_dir();
    let parent = dir.parent().context("the image directory has a parent")?;
    fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let scratch = parent.join(format!(".build-{}-{}", guest::key(), std::process::id()));
    if scratch.exists() {
        fs::remove_dir_all(&scratch)?;
    }
    fs::create_dir_all(&scratch)?;
    let started = Instant::now();
    let built = build(&scratch, &sources);
    let outcome = built.and_then(|()| {
        // Only the image and its checksum are kept.
        for entry in fs::read_dir(&scratch)? {
            let entry = entry?;
            let name = entry.file_name();
            if name != IMAGE_FILE && name != format!("{IMAGE_FILE}.sha256").as_str() {
                remove(&entry.path())?;
            }
        }
        if dir.exists() {
            fs::remove_dir_all(&dir)?;
        }
        fs::rename(&scratch, &dir).with_context(|| format!("moving the image to {}", dir.display()))?;
        Ok(())
    });
    if outcome.is_err() {
        let _ = remove(&scratch);
    }
    outcome?;
    eprintln!("guest image: built {} in {:.0} s", path.display(), started.elapsed().as_secs_f64());
    // Images of earlier recipes are not used again.
    for entry in fs::read_dir(parent)?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name != guest::key() && name.len() == 16 && name.chars().all(|c| c.is_ascii_hexdigit()) {
            eprintln!("guest image: removing the image of an earlier recipe, {name}");
            remove(&entry.path())?;
        }
    }
    Ok(path)
}

fn remove(path: &Path) -> Result<()> {
    if path.is_dir() { fs::remove_dir_all(path) } else { fs::remove_file(path) }
        .with_context(|| format!("removing {}", path.display()))
}

/// The host's apt sources file: the only package source the build uses (mmdebstrap pastes it into the chroot,
/// and the build removes it from the image again).
pub(crate) fn host_sources() -> Result<PathBuf> {
    let deb822 = Path::new("/etc/apt/sources.list.d/debian.sources");
    let classic = Path::new("/etc/apt/sources.list");
    for candidate in [deb822, classic] {
        if fs::read_to_string(candidate).is_ok_and(|text| text.lines().any(|line| line.contains(guest::SUITE))) {
            return Ok(candidate.to_path_buf());
        }
    }
    bail!(
        "the guest image is Debian {suite}, and neither {} nor {} names it: add {suite} to the host's apt sources",
        deb822.display(),
        classic.display(),
        suite = guest::SUITE
    )
}

fn build(scratch: &Path, sources: &Path) -> Result<()> {
    let rootfs = scratch.join("rootfs");
    run(Command::new("mmdebstrap")
        .args(["--variant=apt", "--mode=root", "--quiet"])
        .arg(format!("--include={}", guest::PACKAGES.join(",")))
        // Documentation, manuals and translations are not needed to boot a proxy.
        .args([
            "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
            "--dpkgopt=path-exclude=/usr/share/info/*",
        ])
        .arg(guest::SUITE)
        .arg(&rootfs)
        .arg(sources))?;
    customise(&rootfs)?;

    // The UEFI boot chain, from the signed packages, unpacked without installing them.
    let unpacked = scratch.join("unpacked");
    fs::create_dir_all(&unpacked)?;
    let packages: Vec<&str> = guest::ESP_BINARIES.iter().map(|(package, _, _)| *package).collect();
    run(Command::new("apt-get").current_dir(&unpacked).args(["download", "-q"]).args(&packages))?;
    for deb in fs::read_dir(&unpacked)? {
        let deb = deb?.path();
        if deb.extension().is_some_and(|extension| extension == "deb") {
            run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(unpacked.join("files")))?;
        }
    }

    let esp = scratch.join("esp.img");
    run(Command::new("mkfs.vfat")
        .args(["-F", "32", "-n", ESP_LABEL, "-C"])
        .arg(&esp)
        .arg((ESP_MIB * 1024).to_string()))?;
    let mut made = std::collections::BTreeSet::new();
    let mut copy = |source: &Path, target: &str| -> Result<()> {
        let mut prefix = String::new();
        for part in
            target.split('/').collect::<Vec<_>>().split_last().map(|(_, dirs)| dirs.to_vec()).unwrap_or_default()
        {
            prefix = format!("{prefix}/{part}");
            if made.insert(prefix.clone()) {
                run(Command::new("mmd").arg("-i").arg(&esp).arg(format!("::{prefix}")))?;
            }
        }
        run(Command::new("mcopy").arg("-i").arg(&esp).arg(source).arg(format!("::/{target}")))
    };
    for (_, file, target) in guest::ESP_BINARIES {
        copy(&unpacked.join("files").join(file), target)?;
    }
    let staged = scratch.join("esp-files");
    fs::create_dir_all(&staged)?;
    for (index, (target, content)) in guest::esp_files().into_iter().enumerate() {
        let file = staged.join(index.to_string());
        fs::write(&file, content)?;
        copy(&file, target)?;
    }
    // SYSLINUX reads only FAT: the kernel and initrd the root's symlinks point at are copied to the ESP.
    for link in ["vmlinuz", "initrd.img"] {
        let target = fs::canonicalize(rootfs.join(link)).or_else(|_| {
            let pointed = fs::read_link(rootfs.join(link))?;
            Ok::<_, std::io::Error>(rootfs.join(pointed.strip_prefix("/").unwrap_or(&pointed)))
        });
        let target = target.with_context(|| format!("the root filesystem has no /{link}"))?;
        copy(&target, link)?;
    }
    run(Command::new("syslinux").arg("--install").arg(&esp))?;

    // The root filesystem: its content plus a third, and at least 512 MiB free.
    let used = directory_bytes(&rootfs)?;
    let root_mib = (used + used / 3).div_ceil(MIB) + 512;
    let root = scratch.join("root.img");
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", ROOT_LABEL, "-d"])
        .arg(&rootfs)
        .arg(&root)
        .arg(format!("{root_mib}M")))?;
    fs::remove_dir_all(&rootfs)?;

    // The disk: 1 MiB for the GPT, the ESP, the root, 1 MiB for the backup GPT.
    let raw = scratch.join("disk.raw");
    let total = MIB + ESP_MIB * MIB + root_mib * MIB + MIB;
    fs::File::create(&raw)?.set_len(total)?;
    let layout = format!(
        "label: gpt\nstart=2048, size={esp}, type={ESP_TYPE}, name=\"esp\", attrs=\"LegacyBIOSBootable\"\n\
         start={root_start}, size={root}, type={LINUX_TYPE}, name=\"root\"\n",
        esp = ESP_MIB * MIB / 512,
        root_start = (MIB + ESP_MIB * MIB) / 512,
        root = root_mib * MIB / 512,
    );
    let mut sfdisk = Command::new("sfdisk")
        .args(["--quiet", "--no-reread", "--no-tell-kernel"])
        .arg(&raw)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .context("starting sfdisk (install fdisk)")?;
    sfdisk.stdin.take().context("sfdisk's stdin")?.write_all(layout.as_bytes())?;
    if !sfdisk.wait()?.success() {
        bail!("sfdisk could not write the partition table:\n{layout}");
    }
    for (image, offset) in [(&esp, MIB), (&root, MIB + ESP_MIB * MIB)] {
        run(Command::new("dd")
            .arg(format!("if={}", image.display()))
            .arg(format!("of={}", raw.display()))
            .args(["bs=1M", "conv=notrunc,sparse", "status=none"])
            .arg(format!("seek={}", offset / MIB)))?;
    }
    run(Command::new("dd").arg(format!("if={GPT_MBR}")).arg(format!("of={}", raw.display())).args([
        "bs=440",
        "count=1",
        "conv=notrunc",
        "status=none",
    ]))?;
    let image = scratch.join(IMAGE_FILE);
    run(Command::new("qemu-img").args(["convert", "-q", "-f", "raw", "-O", "qcow2"]).arg(&raw).arg(&image))?;
    let sha = sha256_file(&image)?;
    fs::write(scratch.join(format!("{IMAGE_FILE}.sha256")), format!("{sha}  {IMAGE_FILE}\n"))?;
    Ok(())
}

/// The image's own changes to the root filesystem: the recipe's files and units, no apt sources, no identity
/// (each guest makes its own machine id, and cloud-init names it).
fn customise(rootfs: &Path) -> Result<()> {
    for (path, mode, content) in guest::ROOT_FILES {
        let file = rootfs.join(path);
        fs::create_dir_all(file.parent().context("a file in a directory")?)?;
        fs::write(&file, content).with_context(|| format!("writing {}", file.display()))?;
        fs::set_permissions(&file, fs::Permissions::from_mode(*mode))?;
    }
    for unit in guest::ENABLE_UNITS {
        run(Command::new("chroot").arg(rootfs).args(["systemctl", "enable", unit]))?;
    }
    for unit in guest::DISABLE_UNITS {
        run(Command::new("chroot").arg(rootfs).args(["systemctl", "disable", unit]))?;
    }
    let _ = fs::remove_file(rootfs.join("etc/apt/sources.list"));
    if let Ok(entries) = fs::read_dir(rootfs.join("etc/apt/sources.list.d")) {
        for entry in entries.flatten() {
            fs::remove_file(entry.path())?;
        }
    }
    // mmdebstrap copies the build host's resolv.conf in; a guest must not inherit the build machine's resolver (seen
    // in the first boot: the guests' Squid queried it). Whatever serves the guest's network sets its own.
    let resolv = rootfs.join("etc/resolv.conf");
    if resolv.symlink_metadata().is_ok() {
        fs::remove_file(&resolv)?;
    }
    fs::write(&resolv, "")?;
    fs::write(rootfs.join("etc/machine-id"), "")?;
    let _ = fs::remove_file(rootfs.join("var/lib/dbus/machine-id"));
    let _ = fs::remove_file(rootfs.join("etc/hostname"));
    // apt's downloaded lists and packages are not part of an image.
    for dir in ["var/lib/apt/lists", "var/cache/apt/archives"] {
        if let Ok(entries) = fs::read_dir(rootfs.join(dir)) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|kind| kind.is_file()) {
                    fs::remove_file(entry.path())?;
                }
            }
        }
    }
    Ok(())
}

fn directory_bytes(dir: &Path) -> Result<u64> {
    let out = crate::process::output(Command::new("du").args(["-s", "-B1", "-x"]).arg(dir))
        .with_context(|| format!("measuring {}", dir.display()))?;
    out.split_whitespace().next().and_then(|bytes| bytes.parse().ok()).context("du's answer")
}

pub(crate) fn sha256_file(path: &Path) -> Result<String> {
    use std::io::Read as _;
    let mut file = fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut digest = Sha256::new();
    let mut buffer = vec![0; 1 << 20];
    loop {
        let read = file.read(&mut buffer)?;
        if read == 0 {
            break;
        }
        digest.update(&buffer[..read]);
    }
    Ok(digest.finalize().iter().map(|byte| format!("{byte:02x}")).collect())
}
