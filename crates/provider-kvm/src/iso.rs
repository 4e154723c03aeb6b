//! The NoCloud seed image: an ISO 9660 image with Joliet names holding one root directory of small files, written
//! by `hadris-iso`.
//!
//! The primary hierarchy carries 8.3 upper-case names (`USER_DAT.;1`, made unique by the writer when two collide);
//! the Joliet hierarchy carries the real names (`user-data`), which Linux's isofs (and so cloud-init) uses whenever it
//! is present. The output is deterministic: the writer reads no clock and dates the volume 1980-01-01, so the same
//! files give the same bytes and an unchanged seed is recognisably unchanged.

use hadris_fs::{Content, Node, Tree, WarningKind};
use hadris_iso::sync::write;
use hadris_iso::{IsoId, IsoOptions, plan};
use hadris_storage::{BlockSize, MemDevice};

/// The image's block size.
const SECTOR: usize = 2048;

/// Characters a Joliet name may not hold (ECMA-119's separators and Joliet's own list), besides control characters.
const NOT_IN_JOLIET: [char; 6] = ['*', '/', ':', ';', '?', '\\'];

/// One file of the image's root directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct File {
    /// Its name: at most 64 characters, none of `* / : ; ? \` or a control character.
    pub name: String,
    /// Its content.
    pub data: Vec<u8>,
}

/// What can be wrong with the files given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IsoError {
    /// A name is empty, too long for Joliet, or has a character Joliet cannot hold.
    #[error("{0:?} cannot be a file name in the seed image")]
    BadName(String),
    /// Two files have the same name.
    #[error("{0:?} and {1:?} collide in the seed image")]
    Collision(String, String),
    /// The volume label is not 1–32 characters of A–Z, a–z, 0–9 and `_`.
    #[error("{0:?} cannot be a volume label")]
    BadLabel(String),
    /// The writer could not store a file under its own name, or failed.
    #[error("the seed image cannot be written: {0}")]
    Image(String),
}

/// Builds the image of `files` with volume label `label`.
pub fn build(label: &str, files: &[File]) -> Result<Vec<u8>, IsoError> {
    if label.is_empty() || label.len() > 32 || !label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(IsoError::BadLabel(label.to_owned()));
    }
    let mut tree = Tree::new();
    for (index, file) in files.iter().enumerate() {
        let bad = file.name.is_empty()
            || file.name.chars().count() > 64
            || file.name.chars().any(|c| c.is_control() || NOT_IN_JOLIET.contains(&c));
        if bad {
            return Err(IsoError::BadName(file.name.clone()));
        }
        if let Some(other) = files[..index].iter().find(|other| other.name == file.name) {
            return Err(IsoError::Collision(other.name.clone(), file.name.clone()));
        }
        tree.insert(&file.name, Node::file(Content::bytes(file.data.clone())))
            .map_err(|error| IsoError::Image(format!("{}: {error}", file.name)))?;
    }
    let options = IsoOptions::new().with_id(IsoId::Volume, label).with_joliet();
    let planned = plan(&tree, &options).map_err(|error| IsoError::Image(error.to_string()))?;
    // Primary (8.3) names are mapped by design; a Joliet name changed or a file left out is a seed cloud-init
    // would read differently, so it fails.
    if let Some(warning) = planned.warnings().iter().find(|warning| {
        warning.kind() == WarningKind::Skipped
            || (warning.kind() == WarningKind::Renamed && warning.message().to_lowercase().contains("joliet"))
    }) {
        let path = warning.path().map(String::from_utf8_lossy).unwrap_or_default();
        return Err(IsoError::Image(format!("{path}: {}", warning.message())));
    }
    let size = usize::try_from(planned.size()).map_err(|_| IsoError::Image("the image is too large".to_owned()))?;
    let block = BlockSize::new(SECTOR as u32).ok_or_else(|| IsoError::Image("a 2048-byte block".to_owned()))?;
    let mut device = MemDevice::new(vec![0_u8; size], block);
    write(&mut device, &tree, &options).map_err(|error| IsoError::Image(error.to_string()))?;
    Ok(device.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, data: &str) -> File {
        File { name: name.into(), data: data.as_bytes().to_vec() }
    }

    /// The names of the root directory's records in the directory at `sector` (primary: d-characters; Joliet: UCS-2).
    fn names(image: &[u8], sector: usize, joliet: bool) -> Vec<String> {
        let directory = &image[sector * SECTOR..(sector + 1) * SECTOR];
        let mut found = Vec::new();
        let mut at = 0;
        while at < directory.len() && directory[at] != 0 {
            let length = usize::from(directory[at]);
            let name = &directory[at + 33..at + 33 + usize::from(directory[at + 32])];
            if name != [0] && name != [1] {
                found.push(if joliet {
                    String::from_utf16_lossy(
                        &name.chunks_exact(2).map(|pair| u16::from_be_bytes([pair[0], pair[1]])).collect::<Vec<_>>(),
                    )
                } else {
                    String::from_utf8_lossy(name).into_owned()
                });
            }
            at += length;
        }
        found
    }

    /// The sector of the root directory a volume descriptor at `descriptor` points to.
    fn root(image: &[u8], descriptor: usize) -> usize {
        let at = descriptor * SECTOR + 156 + 2;
        u32::from_le_bytes(image[at..at + 4].try_into().expect("four bytes")) as usize
    }

    #[test]
    fn names_become_eight_dot_three() {
        let files = ["user-data", "meta-data", "vendor-data", "a.tar.gz"]
            .map(|name| file(name, "x"))
            .into_iter()
            .collect::<Vec<_>>();
        let image = build("cidata", &files).expect("builds");
        let mut primary = names(&image, root(&image, 16), false);
        primary.sort();
        assert_eq!(primary, ["A_TAR.GZ;1", "META_DAT.;1", "USER_DAT.;1", "VENDOR_D.;1"]);
        let mut joliet = names(&image, root(&image, 17), true);
        joliet.sort();
        assert_eq!(joliet, ["a.tar.gz", "meta-data", "user-data", "vendor-data"]);
    }

    #[test]
    fn the_layout_is_deterministic_and_holds_the_data() {
        let files = [file("user-data", "#cloud-config\n"), file("meta-data", "instance-id: a\n")];
        let image = build("cidata", &files).expect("builds");
        assert_eq!(image, build("cidata", &files).expect("builds"), "same input, same bytes");
        assert_eq!(image.len() % SECTOR, 0);
        assert_eq!(&image[16 * SECTOR + 1..16 * SECTOR + 6], b"CD001");
        assert_eq!(&image[16 * SECTOR + 40..16 * SECTOR + 46], b"cidata");
        assert_eq!(&image[17 * SECTOR + 88..17 * SECTOR + 91], b"%/E");
        assert_eq!(image[18 * SECTOR], 255);
        let text = String::from_utf8_lossy(&image);
        assert!(text.contains("#cloud-config\n") && text.contains("instance-id: a\n"));
    }

    #[test]
    fn bad_input_is_refused() {
        assert_eq!(build("ci data", &[]), Err(IsoError::BadLabel("ci data".into())));
        assert_eq!(build("cidata", &[file("a/b", "")]), Err(IsoError::BadName("a/b".into())));
        assert_eq!(build("cidata", &[file("a:b", "")]), Err(IsoError::BadName("a:b".into())));
        assert_eq!(build("cidata", &[file(&"n".repeat(65), "")]), Err(IsoError::BadName("n".repeat(65))));
        assert_eq!(
            build("cidata", &[file("user-data", "1"), file("user-data", "2")]),
            Err(IsoError::Collision("user-data".into(), "user-data".into()))
        );
    }

    #[test]
    fn names_that_share_an_eight_dot_three_form_both_keep_their_joliet_names() {
        let image = build("cidata", &[file("user-data1", "1"), file("user-data2", "2")]).expect("builds");
        let primary = names(&image, root(&image, 16), false);
        assert_eq!(primary.len(), 2);
        assert_ne!(primary[0], primary[1], "the writer makes the 8.3 names unique");
        let mut joliet = names(&image, root(&image, 17), true);
        joliet.sort();
        assert_eq!(joliet, ["user-data1", "user-data2"]);
    }
}
