//! Where a proxy's traffic appears to come from: the country and autonomous system of its egress address, looked up
//! in MaxMind-format databases the user provides (`--geoip-database`, given once per file: a Country or City
//! database, an ASN database, or one holding both). The reconciler writes what it finds to `status.egressCountry`
//! and `status.egressASN` and to the Proxy's labels [`egress_fleet::labels::EGRESS_COUNTRY`] and
//! [`egress_fleet::labels::EGRESS_ASN`], which discovery selectors and the gateway's `country-xx` select by.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use maxminddb::Reader;
use serde::Deserialize;
use tracing::info;

/// What the databases say about one address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Geo {
    /// ISO 3166-1 alpha-2, upper case (`DE`): the country the address is located in, else the one it is
    /// registered in.
    pub country: Option<String>,
    /// The autonomous system number.
    pub asn: Option<u32>,
}

/// The databases, read into memory once.
pub struct GeoIp {
    readers: Vec<(PathBuf, Reader<Vec<u8>>)>,
}

impl std::fmt::Debug for GeoIp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.readers.iter().map(|(path, reader)| (path, &reader.metadata().database_type)))
            .finish()
    }
}

/// A database that cannot be used, with the file it is about.
#[derive(Debug, thiserror::Error)]
#[error("the GeoIP database {path}: {problem}")]
pub struct GeoIpError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub problem: String,
}

#[derive(Deserialize)]
struct Record {
    country: Option<Country>,
    registered_country: Option<Country>,
    autonomous_system_number: Option<u32>,
}

#[derive(Deserialize)]
struct Country {
    iso_code: Option<String>,
}

impl GeoIp {
    /// Reads every file in `paths`.
    ///
    /// # Errors
    /// A file that cannot be read or is not a MaxMind DB.
    pub fn open(paths: &[PathBuf]) -> Result<Self, GeoIpError> {
        let mut readers = Vec::new();
        for path in paths {
            let reader = Reader::open_readfile(path)
                .map_err(|error| GeoIpError { path: path.clone(), problem: error.to_string() })?;
            info!(
                path = %path.display(),
                database_type = %reader.metadata().database_type,
                build_epoch = reader.metadata().build_epoch,
                "GeoIP database loaded"
            );
            readers.push((path.clone(), reader));
        }
        Ok(Self { readers })
    }

    /// The files, in the order they are asked.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.readers.iter().map(|(path, _)| path.as_path())
    }

    /// The country and AS number of `ip`: each from the first database that knows it.
    pub fn lookup(&self, ip: IpAddr) -> Geo {
        let mut geo = Geo::default();
        for (_, reader) in &self.readers {
            let Ok(Some(record)) = reader.lookup(ip).and_then(|found| found.decode::<Record>()) else { continue };
            if geo.country.is_none() {
                geo.country = record
                    .country
                    .and_then(|country| country.iso_code)
                    .or_else(|| record.registered_country.and_then(|country| country.iso_code))
                    .map(|code| code.to_ascii_uppercase());
            }
            if geo.asn.is_none() {
                geo.asn = record.autonomous_system_number;
            }
        }
        geo
    }
}
