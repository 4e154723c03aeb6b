//! Small MaxMind-format databases for the GeoIP tests, written with `mmdb-writer` (no download): each network
//! with the country and AS number a test wants its addresses to have.

use std::path::Path;

use anyhow::{Context, Result};
use mmdb_writer::{Value, Writer};

/// One network's answer.
#[derive(Clone, Debug)]
pub struct GeoEntry {
    /// The network (`127.1.0.5/32`).
    pub network: ipnet::IpNet,
    /// Its country's ISO 3166-1 alpha-2 code, as GeoIP2 Country and City databases hold it (`country.iso_code`).
    pub country: Option<String>,
    /// Its autonomous system number, as GeoLite2 ASN databases hold it (`autonomous_system_number`).
    pub asn: Option<u32>,
}

impl GeoEntry {
    /// `network` in `country` (and `asn`).
    pub fn new(network: &str, country: Option<&str>, asn: Option<u32>) -> Self {
        Self {
            network: network.parse().unwrap_or_else(|_| panic!("{network:?} is not a network")),
            country: country.map(str::to_owned),
            asn,
        }
    }
}

/// Writes a database of `entries` (type `GeoIP2-Country`, or `GeoLite2-ASN` when no entry has a country) to `path`.
pub fn write_database(path: &Path, entries: &[GeoEntry]) -> Result<()> {
    let kind = if entries.iter().any(|entry| entry.country.is_some()) { "GeoIP2-Country" } else { "GeoLite2-ASN" };
    let mut writer = Writer::new(kind);
    for entry in entries {
        let mut fields: Vec<(&str, Value)> = Vec::new();
        if let Some(country) = &entry.country {
            fields.push(("country", Value::map([("iso_code", Value::from(country.as_str()))])));
        }
        if let Some(asn) = entry.asn {
            fields.push(("autonomous_system_number", Value::from(asn)));
        }
        writer.insert_value(entry.network, Value::map(fields)).with_context(|| format!("inserting {entry:?}"))?;
    }
    let bytes = writer.to_bytes().context("writing the database")?;
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}
