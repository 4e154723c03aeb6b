//! The providers config file (`--providers-config`): a list of named provider instances, each with one
//! type-specific block.
//!
//! This module owns the frame (`name`, `type`, `destinations`, `cooldown`, `pacing`); each backend's crate owns its block: a
//! Rust type deriving `Deserialize` and `JsonSchema` that implements [`SettingsBlock`], registered in a
//! [`SettingsTypes`] (a new backend adds its crate and one registration line, and this module does not change).
//!
//! Parsing is strict and complete: the YAML is read into a plain tree, checked against the schemas schemars derives
//! from those types ([`schema`]), so that unknown keys, wrong kinds, missing fields, values out of range and
//! malformed identifiers are all reported in one pass, each with its path (`providers[2].kvm.hosts[0].name: must
//! match ...`); then serde reads the tree and each block checks what a schema cannot say (references between its
//! fields, duplicates). Serde alone stops at the first problem, which would make a user fix a file one mistake per
//! restart. [`SettingsTypes::schema`] is the whole file's JSON Schema, for editors.

use std::any::Any;
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use ipnet::IpNet;
use schemars::{JsonSchema, Schema, SchemaGenerator, generate::SchemaSettings};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::destinations::{Denial, DestinationPolicy};

pub mod schema;

use schema::{Checker, child, strip_nulls};

/// The pattern every name and key in the file must match: it keeps IDs, file names and label values parseable.
pub const IDENTIFIER_PATTERN: &str = "[a-z0-9]([a-z0-9-]*[a-z0-9])?";

/// [`IDENTIFIER_PATTERN`] anchored and at most 63 characters long, as the schema says it.
const IDENTIFIER_REGEX: &str = "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$";

/// A schema transform: the string is an identifier ([`IDENTIFIER_PATTERN`], at most 63 characters).
pub fn identifier(schema: &mut Schema) {
    schema::pattern(schema, IDENTIFIER_REGEX, &format!("must match {IDENTIFIER_PATTERN} (at most 63 characters)"));
}

/// A schema transform: a mapping whose keys are identifiers.
pub fn identifier_keys(schema: &mut Schema) {
    let mut names = Schema::default();
    identifier(&mut names);
    schema.insert("propertyNames".into(), names.to_value());
}

/// A schema transform: a list of distinct identifiers.
pub fn identifier_list(schema: &mut Schema) {
    let mut item = schemars::json_schema!({ "type": "string" });
    identifier(&mut item);
    schema.insert("items".into(), item.to_value());
    schema.insert("uniqueItems".into(), true.into());
}

/// A schema transform: the string is an `http://` or `https://` URL.
pub fn http_url(schema: &mut Schema) {
    schema::pattern(schema, r"^https?://[^/\s]\S*$", "must be an http:// or https:// URL");
}

/// A list of networks in CIDR notation (`10.244.0.0/16`), for `#[serde(with = "egress_provider::config::networks")]`
/// and `#[schemars(with = "Vec<String>", transform = egress_provider::config::networks::schema)]`.
pub mod networks {
    use ipnet::IpNet;
    use schemars::Schema;
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::destinations::DestinationRule;

    /// Reads the list, each item as a destination rule with a network and no ports.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<IpNet>, D::Error> {
        let texts = Vec::<String>::deserialize(deserializer)?;
        texts
            .iter()
            .map(|text| match text.parse::<DestinationRule>() {
                Ok(DestinationRule { network: Some(network), ports: None }) => Ok(network),
                _ => Err(serde::de::Error::custom(format!("{text:?} is not a network in CIDR notation"))),
            })
            .collect()
    }

    /// Writes the list as strings.
    pub fn serialize<S: Serializer>(networks: &[IpNet], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(networks.iter().map(ToString::to_string))
    }

    /// The items are strings of format `cidr`.
    pub fn schema(schema: &mut Schema) {
        schema.insert("items".into(), serde_json::json!({ "type": "string", "format": "cidr" }));
    }
}

/// A provider type's settings block (the `kvm:` in `type: kvm`), implemented by the type its backend's crate reads
/// the block into.
pub trait SettingsBlock: DeserializeOwned + JsonSchema + fmt::Debug + Send + Sync + 'static {
    /// The `type` value, which is also the block's key.
    const TYPE: &'static str;

    /// Checks what the schema cannot say (references between fields, duplicates), pushing each problem with its
    /// path under `at` (the block's own path); may fill values that depend on other fields. Called once the
    /// block's schema problems have been reported and serde could read it.
    fn check(&mut self, at: &str, problems: &mut Vec<Problem>) {
        let _ = (at, problems);
    }

    /// Networks this provider's proxies may never reach besides the default denials (a cluster's own).
    fn denied_networks(&self) -> &[IpNet] {
        &[]
    }
}

/// A parsed settings block of any type, as a [`ProviderConfig`] carries it.
pub trait ProviderSettings: fmt::Debug + Send + Sync {
    /// The `type` value it belongs to.
    fn type_name(&self) -> &'static str;
    /// See [`SettingsBlock::denied_networks`].
    fn denied_networks(&self) -> &[IpNet];
    /// For [`ProviderConfig::settings`].
    fn as_any(&self) -> &dyn Any;
}

impl<T: SettingsBlock> ProviderSettings for T {
    fn type_name(&self) -> &'static str {
        T::TYPE
    }

    fn denied_networks(&self) -> &[IpNet] {
        SettingsBlock::denied_networks(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A parsed and validated providers file.
#[derive(Clone, Debug)]
pub struct ProvidersConfig {
    /// The providers, in file order; names are unique.
    pub providers: Vec<ProviderConfig>,
}

/// One named provider instance.
#[derive(Clone, Debug)]
pub struct ProviderConfig {
    /// The name `Proxy.spec.provider` refers to.
    pub name: String,
    /// Where this provider's proxies may connect, beyond the defaults (`destinations: {allow, deny}`).
    pub destinations: DestinationPolicy,
    /// How long a site's ban cools its proxies down (`cooldown: {baseSeconds, factor, maxSeconds}`), where a Proxy
    /// sets nothing of its own.
    pub cooldown: CooldownSettings,
    /// How often a proxy's egress address is leased for one site (`pacing: {intervalMilliseconds, burst}`), where a
    /// Proxy sets no `spec.pacing` of its own; `None`: unpaced.
    pub pacing: Option<PacingSettings>,
    /// The type-specific settings; [`ProviderConfig::settings`] reads them as their type.
    pub block: Arc<dyn ProviderSettings>,
}

/// A ban cooldown policy, any part of which may be left to the next level (a Proxy's `spec.cooldown`, then its
/// provider's, then the operator's 600 s, doubling, at most 86,400 s).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CooldownSettings {
    /// The cooldown after the first ban in a row, in seconds (1 to 86,400).
    #[schemars(range(min = 1, max = 86_400))]
    pub base_seconds: Option<u32>,
    /// What each further ban in a row multiplies it by (1 to 10).
    #[schemars(range(min = 1, max = 10))]
    pub factor: Option<u32>,
    /// The longest cooldown, in seconds (1 to 604,800).
    #[schemars(range(min = 1, max = 604_800))]
    pub max_seconds: Option<u32>,
}

/// A pace per (egress address, site): `burst` leases at once, then one per `intervalMilliseconds` (a Proxy's
/// `spec.pacing` replaces it whole).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PacingSettings {
    /// The time between two leases for one site once the burst is spent, in milliseconds (1 to 86,400,000).
    #[schemars(range(min = 1, max = 86_400_000))]
    pub interval_milliseconds: u32,
    /// How many may go at once after a quiet spell (1 to 1,000; default 1).
    #[schemars(range(min = 1, max = 1000))]
    pub burst: Option<u32>,
}

/// The frame of one entry of `providers`: what every provider has, whatever its type.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct Frame {
    /// The name `Proxy.spec.provider` refers to.
    #[schemars(transform = identifier)]
    name: String,
    /// The provider type; its settings go in the block of that name.
    #[serde(rename = "type")]
    #[expect(dead_code, reason = "read from the tree, so that a block is checked even when the frame is not valid")]
    type_name: String,
    /// Where this provider's proxies may connect, beyond the defaults.
    #[serde(default)]
    destinations: DestinationPolicy,
    /// How long a site's ban cools this provider's proxies down, where a Proxy sets nothing of its own.
    #[serde(default)]
    cooldown: CooldownSettings,
    /// How often a proxy's egress address is leased for one site, where a Proxy sets no pacing of its own.
    #[serde(default)]
    pacing: Option<PacingSettings>,
}

/// Reads one block: checks it against its schema, then lets serde read it and the block check itself.
type ReadBlock = fn(&mut Value, &str, &mut Vec<Problem>) -> Option<Arc<dyn ProviderSettings>>;

#[derive(Clone, Copy)]
struct SettingsType {
    name: &'static str,
    /// The block's schema alone, to check a block against.
    schema: fn() -> Value,
    /// The block's schema as part of a bigger one (a reference into the generator's definitions).
    subschema: fn(&mut SchemaGenerator) -> Schema,
    read: ReadBlock,
}

/// The settings blocks a build reads, in registration order.
#[derive(Clone, Default)]
pub struct SettingsTypes(Vec<SettingsType>);

/// The settings of the schemas the file is checked against: JSON Schema 2020-12, as schemars writes it.
fn schema_of<T: JsonSchema>() -> Value {
    SchemaGenerator::new(SchemaSettings::draft2020_12()).into_root_schema_for::<T>().to_value()
}

fn read_block<S: SettingsBlock>(
    value: &mut Value,
    at: &str,
    problems: &mut Vec<Problem>,
) -> Option<Arc<dyn ProviderSettings>> {
    let schema = schema_of::<S>();
    let before = problems.len();
    Checker::new(&schema, problems).check(&schema, value, at);
    let mut settings = match S::deserialize(&*value) {
        Ok(settings) => settings,
        Err(error) => {
            // With problems reported, what is left may not be readable; without, the schema missed something.
            if problems.len() == before {
                problems.push(Problem { path: at.to_owned(), message: error.to_string() });
            }
            return None;
        }
    };
    settings.check(at, problems);
    (problems.len() == before).then(|| Arc::new(settings) as Arc<dyn ProviderSettings>)
}

impl SettingsTypes {
    /// No block types.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the block type `S` (its `type` name is [`SettingsBlock::TYPE`]); a second registration of a name
    /// replaces the first.
    #[must_use]
    pub fn with<S: SettingsBlock>(mut self) -> Self {
        self.0.retain(|known| known.name != S::TYPE);
        self.0.push(SettingsType {
            name: S::TYPE,
            schema: schema_of::<S>,
            subschema: SchemaGenerator::subschema_for::<S>,
            read: read_block::<S>,
        });
        self
    }

    /// The type names, in registration order.
    pub fn names(&self) -> Vec<&'static str> {
        self.0.iter().map(|known| known.name).collect()
    }

    fn get(&self, name: &str) -> Option<&SettingsType> {
        self.0.iter().find(|known| known.name == name)
    }

    /// The whole file's JSON Schema (2020-12), with one block per registered type: for editors and linters. The
    /// operator checks files against the same schemas, with the checks schemas cannot express on top. One generator
    /// makes every part, so two blocks' types of the same name get distinct definitions.
    pub fn schema(&self) -> Value {
        let mut generator = SchemaGenerator::new(SchemaSettings::draft2020_12());
        let mut entry = generator.root_schema_for::<Frame>().to_value();
        entry["properties"]["type"]["enum"] = json!(self.names());
        let mut cases = Vec::new();
        for known in &self.0 {
            entry["properties"][known.name] = (known.subschema)(&mut generator).to_value();
            let others: Vec<Value> = self
                .names()
                .into_iter()
                .filter(|name| *name != known.name)
                .map(|name| json!({ "required": [name] }))
                .collect();
            cases.push(json!({
                "if": { "properties": { "type": { "const": known.name } } },
                "then": { "not": { "anyOf": others } },
            }));
        }
        entry["allOf"] = Value::Array(cases);
        if let Some(entry) = entry.as_object_mut() {
            entry.remove("$schema");
            entry.remove("$defs");
            entry.remove("title");
        }
        json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "egress-operator providers file",
            "type": "object",
            "additionalProperties": false,
            "required": ["providers"],
            "properties": { "providers": { "type": "array", "items": entry } },
            "$defs": generator.take_definitions(true),
        })
    }
}

/// One problem in the file, with the path to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Where: `providers[2].kvm.hosts[0].name`, or the empty string for the whole file.
    pub path: String,
    /// What is wrong and, where it helps, what is expected.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() { f.write_str(&self.message) } else { write!(f, "{}: {}", self.path, self.message) }
    }
}

/// Every problem found in a providers file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// Where the file came from, for the message (a path, or `<input>`).
    pub source_name: String,
    /// Every problem, in file order.
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count = self.problems.len();
        write!(f, "{} has {count} problem{}:", self.source_name, if count == 1 { "" } else { "s" })?;
        for problem in &self.problems {
            write!(f, "\n  - {problem}")?;
        }
        Ok(())
    }
}

impl ProviderConfig {
    /// The `type` of this provider.
    pub fn type_name(&self) -> &'static str {
        self.block.type_name()
    }

    /// Its settings block as the type `S`; `None` when it is of another type.
    pub fn settings<S: SettingsBlock>(&self) -> Option<&S> {
        self.block.as_any().downcast_ref()
    }

    /// Networks this provider's proxies may never reach besides the default denials (a cluster's own).
    pub fn provider_networks(&self) -> &[IpNet] {
        self.block.denied_networks()
    }

    /// Why this provider's proxies would refuse a request to `host`:`port` (a CONNECT tunnel when `connect`), when
    /// that is known without DNS (an IP literal or `localhost`); `None` when it is allowed or only DNS can tell.
    pub fn denies(&self, host: &str, port: u16, connect: bool) -> Option<Denial> {
        self.destinations.check_host(host, port, connect, self.provider_networks())
    }
}

impl ProvidersConfig {
    /// Parses and validates a providers file whose blocks are of the `types` given; `source_name` names it in the
    /// error (usually its path).
    pub fn parse(text: &str, source_name: &str, types: &SettingsTypes) -> Result<Self, ConfigError> {
        let fail = |problems| ConfigError { source_name: source_name.to_owned(), problems };
        let mut tree: Value = match serde_saphyr::from_str(text) {
            Ok(tree) => tree,
            Err(error) => {
                return Err(fail(vec![Problem { path: String::new(), message: format!("not valid YAML: {error}") }]));
            }
        };
        if tree.is_null() {
            let message = "the file is empty; expected a mapping with a `providers` list".to_owned();
            return Err(fail(vec![Problem { path: String::new(), message }]));
        }
        strip_nulls(&mut tree);
        let mut problems = Vec::new();
        let file = json!({
            "type": "object",
            "additionalProperties": false,
            "required": ["providers"],
            "properties": { "providers": { "type": "array", "items": { "type": "object" } } },
        });
        Checker::new(&file, &mut problems).check(&file, &mut tree, "");
        let entries = match tree.get_mut("providers") {
            Some(Value::Array(entries)) => std::mem::take(entries),
            _ => Vec::new(),
        };
        // The frame's schema, with the registered types as the values of `type` and the blocks as known keys.
        let mut frame_schema = schema_of::<Frame>();
        frame_schema["properties"]["type"]["enum"] = json!(types.names());
        for name in types.names() {
            frame_schema["properties"][name] = json!({});
        }
        let mut providers = Vec::new();
        let mut names = HashSet::new();
        for (index, entry) in entries.into_iter().enumerate() {
            let path = format!("providers[{index}]");
            if let Some(name) = entry.get("name").and_then(Value::as_str).filter(|name| is_identifier(name))
                && !names.insert(name.to_owned())
            {
                problems
                    .push(Problem { path: child(&path, "name"), message: format!("duplicate provider name {name:?}") });
            }
            providers.extend(read_entry(&path, entry, types, &frame_schema, &mut problems));
        }
        if problems.is_empty() { Ok(Self { providers }) } else { Err(fail(problems)) }
    }

    /// Parses a file whose providers are all of the one type `S` (for tests, and tools that embed one backend).
    pub fn parse_as<S: SettingsBlock>(text: &str, source_name: &str) -> Result<Self, ConfigError> {
        Self::parse(text, source_name, &SettingsTypes::new().with::<S>())
    }

    /// The provider with this name.
    pub fn get(&self, name: &str) -> Option<&ProviderConfig> {
        self.providers.iter().find(|provider| provider.name == name)
    }
}

/// One entry of `providers`: the frame, then the block of its type.
fn read_entry(
    path: &str,
    entry: Value,
    types: &SettingsTypes,
    frame_schema: &Value,
    problems: &mut Vec<Problem>,
) -> Option<ProviderConfig> {
    let Value::Object(mut map) = entry else { return None };
    let blocks: Vec<(&'static str, Value)> =
        types.names().into_iter().filter_map(|name| map.remove(name).map(|block| (name, block))).collect();
    let mut frame_value = Value::Object(map);
    let before = problems.len();
    Checker::new(frame_schema, problems).check(frame_schema, &mut frame_value, path);
    let frame = Frame::deserialize(&frame_value).ok();
    if let Some(CooldownSettings { base_seconds: Some(base), max_seconds: Some(max), .. }) =
        frame.as_ref().map(|frame| frame.cooldown)
        && max < base
    {
        let message = format!("{max} is less than baseSeconds ({base})");
        problems.push(Problem { path: format!("{path}.cooldown.maxSeconds"), message });
    }
    let type_name =
        frame_value.get("type").and_then(Value::as_str).and_then(|name| types.get(name)).map(|known| known.name);
    // A block of another type is a mistake even when the right block is present too.
    if let Some(type_name) = type_name {
        for (name, _) in blocks.iter().filter(|(name, _)| *name != type_name) {
            let message = format!("does not match type {type_name:?}; use a `{type_name}:` block");
            problems.push(Problem { path: child(path, name), message });
        }
    }
    let known = types.get(type_name?)?;
    let block_path = child(path, known.name);
    let mut block = match blocks.into_iter().find(|(name, _)| *name == known.name) {
        Some((_, block)) => block,
        // A type whose every field has a default can go without its block; the others need theirs.
        None if schema_requires_nothing(&(known.schema)()) => json!({}),
        None => {
            problems.push(Problem { path: block_path, message: format!("is required for type {:?}", known.name) });
            return None;
        }
    };
    let settings = (known.read)(&mut block, &block_path, problems);
    let frame = frame.filter(|_| problems.len() == before)?;
    Some(ProviderConfig {
        name: frame.name,
        destinations: frame.destinations,
        cooldown: frame.cooldown,
        pacing: frame.pacing,
        block: settings?,
    })
}

/// Whether an empty mapping satisfies `schema` at its top level (no required fields).
fn schema_requires_nothing(schema: &Value) -> bool {
    schema.get("required").and_then(Value::as_array).is_none_or(Vec::is_empty)
}

/// Whether `value` matches [`IDENTIFIER_PATTERN`] and fits a DNS label (63 characters).
pub fn is_identifier(value: &str) -> bool {
    egress_fleet::is_dns_label(value)
}

#[cfg(test)]
mod tests;
