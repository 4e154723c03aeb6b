//! Labels the operator sets on Proxies and that discovery selectors and the gateway's options select by.

/// The country of a proxy's egress address (ISO 3166-1 alpha-2, upper case: `DE`), set from `status.egressCountry`
/// when the operator has a GeoIP database (`--geoip-database`); the gateway's `country-de` selects `DE`.
pub const EGRESS_COUNTRY: &str = "crawl.example.com/egress-country";

/// The autonomous system number of a proxy's egress address (`64500`), set from `status.egressASN` when the
/// operator has a GeoIP database with AS numbers; the gateway's `asn-64500` selects it.
pub const EGRESS_ASN: &str = "crawl.example.com/egress-asn";

/// The labels only a GeoIP database sets: selecting by one of them without a database is refused.
pub const GEO: [&str; 2] = [EGRESS_COUNTRY, EGRESS_ASN];
