//! A minimal ISO 9660 image writer with Joliet names: one root directory of small files, which is all a NoCloud
//! seed (`cidata`) needs.
//!
//! The primary hierarchy carries 8.3 upper-case names (`USER_DAT.;1`); the Joliet hierarchy carries the real names
//! (`user-data`), which Linux's isofs (and so cloud-init) uses whenever it is present. The output is deterministic:
//! the same files give the same bytes, so an unchanged seed is recognisably unchanged.

const SECTOR: usize = 2048;
/// Sectors 0–15 are the system area.
const FIRST_DESCRIPTOR: usize = 16;
/// Primary, Joliet, terminator; then the four path tables and the two root directories.
const FIRST_DATA: usize = FIRST_DESCRIPTOR + 3 + 4 + 2;
const PATH_TABLE_SIZE: u32 = 10;

/// One file of the image's root directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct File {
    /// Its name: at most 64 characters, no `/`.
    pub name: String,
    /// Its content.
    pub data: Vec<u8>,
}

/// What can be wrong with the files given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IsoError {
    /// A name is empty, too long for Joliet, or has a `/` or a control character.
    #[error("{0:?} cannot be a file name in the seed image")]
    BadName(String),
    /// Two files would have the same primary (8.3) or Joliet name.
    #[error("{0:?} and {1:?} collide in the seed image")]
    Collision(String, String),
    /// The volume label is not 1–32 characters of A–Z, a–z, 0–9 and `_`.
    #[error("{0:?} cannot be a volume label")]
    BadLabel(String),
    /// The directory would need more than one sector.
    #[error("too many files for one directory sector")]
    TooManyFiles,
}

/// Builds the image of `files` with volume label `label`.
pub fn build(label: &str, files: &[File]) -> Result<Vec<u8>, IsoError> {
    if label.is_empty() || label.len() > 32 || !label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(IsoError::BadLabel(label.to_owned()));
    }
    let mut entries: Vec<Entry> = Vec::new();
    for file in files {
        let bad = file.name.is_empty()
            || file.name.chars().count() > 64
            || file.name.chars().any(|c| c == '/' || c.is_control() || c == ';');
        if bad {
            return Err(IsoError::BadName(file.name.clone()));
        }
        let entry = Entry {
            primary: primary_name(&file.name),
            joliet: file.name.encode_utf16().flat_map(u16::to_be_bytes).collect(),
            name: file.name.clone(),
            data: &file.data,
            sector: 0,
        };
        if let Some(other) = entries.iter().find(|e| e.primary == entry.primary || e.joliet == entry.joliet) {
            return Err(IsoError::Collision(other.name.clone(), entry.name.clone()));
        }
        entries.push(entry);
    }

    // File data starts after the root directories, each file at a sector boundary.
    let mut next = FIRST_DATA;
    for entry in &mut entries {
        entry.sector = next;
        next += entry.data.len().div_ceil(SECTOR).max(1);
    }
    let total_sectors = next;
    let (primary_root, joliet_root) = (FIRST_DATA - 2, FIRST_DATA - 1);

    let primary_dir = directory(primary_root, &entries, |entry| entry.primary.as_slice());
    let joliet_dir = directory(joliet_root, &entries, |entry| entry.joliet.as_slice());
    if primary_dir.len() > SECTOR || joliet_dir.len() > SECTOR {
        return Err(IsoError::TooManyFiles);
    }

    let mut image = vec![0u8; total_sectors * SECTOR];
    let mut put = |sector: usize, bytes: &[u8]| {
        image[sector * SECTOR..sector * SECTOR + bytes.len()].copy_from_slice(bytes);
    };
    let tables = FIRST_DESCRIPTOR + 3;
    put(FIRST_DESCRIPTOR, &descriptor(false, label, total_sectors, tables, primary_root));
    put(FIRST_DESCRIPTOR + 1, &descriptor(true, label, total_sectors, tables + 2, joliet_root));
    put(FIRST_DESCRIPTOR + 2, &terminator());
    put(tables, &path_table(primary_root, false));
    put(tables + 1, &path_table(primary_root, true));
    put(tables + 2, &path_table(joliet_root, false));
    put(tables + 3, &path_table(joliet_root, true));
    put(primary_root, &primary_dir);
    put(joliet_root, &joliet_dir);
    for entry in &entries {
        put(entry.sector, entry.data);
    }
    Ok(image)
}

/// A root directory at `sector`: `.`, `..`, then the entries sorted by the name `name` picks.
fn directory<'a>(sector: usize, entries: &'a [Entry<'a>], name: impl Fn(&'a Entry<'a>) -> &'a [u8]) -> Vec<u8> {
    let mut directory = Vec::new();
    directory.extend(record(sector, SECTOR, true, &[0]));
    directory.extend(record(sector, SECTOR, true, &[1]));
    let mut sorted: Vec<&'a Entry<'a>> = entries.iter().collect();
    sorted.sort_by(|a, b| name(a).cmp(name(b)));
    for entry in sorted {
        directory.extend(record(entry.sector, entry.data.len(), false, name(entry)));
    }
    directory
}

struct Entry<'a> {
    name: String,
    primary: Vec<u8>,
    joliet: Vec<u8>,
    data: &'a [u8],
    sector: usize,
}

/// The 8.3 d-character name with version: `user-data` → `USER_DAT.;1`.
fn primary_name(name: &str) -> Vec<u8> {
    let (stem, extension) = match name.rsplit_once('.') {
        Some((stem, extension)) if !stem.is_empty() => (stem, extension),
        _ => (name, ""),
    };
    let clean = |text: &str, max: usize| -> String {
        text.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' }).take(max).collect()
    };
    format!("{}.{};1", clean(stem, 8), clean(extension, 3)).into_bytes()
}

fn both_u16(value: u16) -> [u8; 4] {
    let (le, be) = (value.to_le_bytes(), value.to_be_bytes());
    [le[0], le[1], be[0], be[1]]
}

fn both_u32(value: u32) -> [u8; 8] {
    let (le, be) = (value.to_le_bytes(), value.to_be_bytes());
    [le[0], le[1], le[2], le[3], be[0], be[1], be[2], be[3]]
}

fn as_u32(value: usize) -> u32 {
    u32::try_from(value).expect("a seed image is far below 4 GiB")
}

/// A directory record; `identifier` is `[0]` for `.`, `[1]` for `..`, else a name.
fn record(sector: usize, length: usize, directory: bool, identifier: &[u8]) -> Vec<u8> {
    let mut record = vec![0u8; 33];
    record[2..10].copy_from_slice(&both_u32(as_u32(sector)));
    record[10..18].copy_from_slice(&both_u32(as_u32(length)));
    // 1970-01-01 00:00:00 UTC: fixed, so the image is deterministic.
    record[18..25].copy_from_slice(&[70, 1, 1, 0, 0, 0, 0]);
    record[25] = if directory { 2 } else { 0 };
    record[28..32].copy_from_slice(&both_u16(1));
    record[32] = u8::try_from(identifier.len()).expect("identifiers are short");
    record.extend_from_slice(identifier);
    if record.len() % 2 == 1 {
        record.push(0);
    }
    record[0] = u8::try_from(record.len()).expect("records are short");
    record
}

/// A padded identifier field: ASCII padded with spaces, or for Joliet UCS-2 big-endian padded with U+0020.
fn text_field(joliet: bool, text: &str, length: usize) -> Vec<u8> {
    let mut field = Vec::with_capacity(length);
    if joliet {
        for unit in text.encode_utf16() {
            field.extend(unit.to_be_bytes());
        }
        while field.len() + 2 <= length {
            field.extend([0, b' ']);
        }
        field.resize(length, 0);
    } else {
        field.extend(text.bytes());
        field.resize(length, b' ');
    }
    field.truncate(length);
    field
}

fn descriptor(joliet: bool, label: &str, total_sectors: usize, path_tables: usize, root: usize) -> Vec<u8> {
    let mut d = vec![0u8; SECTOR];
    d[0] = if joliet { 2 } else { 1 };
    d[1..6].copy_from_slice(b"CD001");
    d[6] = 1;
    d[8..40].copy_from_slice(&text_field(joliet, "LINUX", 32));
    d[40..72].copy_from_slice(&text_field(joliet, label, 32));
    d[80..88].copy_from_slice(&both_u32(as_u32(total_sectors)));
    if joliet {
        // UCS-2 level 3.
        d[88..91].copy_from_slice(b"%/E");
    }
    d[120..124].copy_from_slice(&both_u16(1));
    d[124..128].copy_from_slice(&both_u16(1));
    d[128..132].copy_from_slice(&both_u16(2048));
    d[132..140].copy_from_slice(&both_u32(PATH_TABLE_SIZE));
    d[140..144].copy_from_slice(&as_u32(path_tables).to_le_bytes());
    d[148..152].copy_from_slice(&as_u32(path_tables + 1).to_be_bytes());
    d[156..190].copy_from_slice(&record(root, SECTOR, true, &[0]));
    for (start, length) in [(190, 128), (318, 128), (446, 128), (574, 128), (702, 37), (739, 37), (776, 37)] {
        d[start..start + length].copy_from_slice(&text_field(joliet, "", length));
    }
    d[574..574 + 128].copy_from_slice(&text_field(joliet, "EGRESS-OPERATOR", 128));
    // Creation, modification, expiration and effective dates: "not specified".
    for start in [813, 830, 847, 864] {
        d[start..start + 16].copy_from_slice(b"0000000000000000");
    }
    d[881] = 1;
    d
}

fn terminator() -> Vec<u8> {
    let mut d = vec![0u8; 7];
    d[0] = 255;
    d[1..6].copy_from_slice(b"CD001");
    d[6] = 1;
    d
}

fn path_table(root: usize, big_endian: bool) -> Vec<u8> {
    let mut table = vec![1u8, 0];
    let sector = as_u32(root);
    table.extend(if big_endian { sector.to_be_bytes() } else { sector.to_le_bytes() });
    table.extend(if big_endian { 1u16.to_be_bytes() } else { 1u16.to_le_bytes() });
    table.extend([0, 0]);
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, data: &str) -> File {
        File { name: name.into(), data: data.as_bytes().to_vec() }
    }

    #[test]
    fn names_become_eight_dot_three() {
        assert_eq!(primary_name("user-data"), b"USER_DAT.;1");
        assert_eq!(primary_name("meta-data"), b"META_DAT.;1");
        assert_eq!(primary_name("vendor-data"), b"VENDOR_D.;1");
        assert_eq!(primary_name("a.tar.gz"), b"A_TAR.GZ;1");
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
        assert_eq!(
            build("cidata", &[file("user-data1", ""), file("user-data2", "")]),
            Err(IsoError::Collision("user-data1".into(), "user-data2".into()))
        );
    }
}
