//! Checking the providers file's YAML tree against the JSON Schema that schemars derives from the Rust types it is
//! read into, so that every problem is reported in one pass with its path before serde reads the tree (serde stops
//! at the first).
//!
//! The checker knows the subset of JSON Schema those derives produce: `$ref` into `$defs`, `anyOf` of a value and
//! null, `type`, `properties`, `required`, `additionalProperties` (false, or the schema of a map's values),
//! `propertyNames`, `items`, `minItems`, `uniqueItems`, `enum`, `minimum`/`maximum`, `pattern`, and `format` for the two formats of
//! this crate (`destination-rule`, `cidr`). Other keywords (descriptions, defaults, integer formats) say nothing it
//! checks. `x-invalid` beside a `pattern` says what a value that does not match is not, for the message. A
//! string is never empty (nor only spaces) anywhere in the file.
//!
//! A value that cannot be read (of the wrong kind, out of range, not matching, missing a required field) is
//! replaced by its schema's default or removed: a property from its mapping, an entry from its map (a list with
//! such an item is itself unreadable, since removing the item would shift the paths of later problems); an unknown
//! field is removed too. Serde can then often still read what is left, and the checks a schema
//! cannot express (references between fields, duplicates) still run in the same pass.

use std::collections::HashMap;

use regex::Regex;
use schemars::Schema;
use serde_json::{Map, Value};

use super::Problem;
use crate::destinations::DestinationRule;

/// The `x-invalid` extension keyword.
const INVALID: &str = "x-invalid";

/// A schema transform for a string that must match `pattern`; `invalid` completes the message `"value" …`.
pub fn pattern(schema: &mut Schema, pattern: &str, invalid: &str) {
    schema.insert("pattern".into(), pattern.into());
    schema.insert(INVALID.into(), invalid.into());
}

/// Every problem of `value` against `schema` (a root schema, whose `$ref`s point into its own `$defs`), with paths
/// from the root (for tools that check a tree against a published schema, such as the providers file's).
pub fn problems(schema: &Value, mut value: Value) -> Vec<Problem> {
    let mut problems = Vec::new();
    strip_nulls(&mut value);
    Checker::new(schema, &mut problems).check(schema, &mut value, "");
    problems
}

/// What kind of YAML value this is, for messages.
pub(super) fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "empty",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

/// Removes every mapping entry whose value is empty (`key:` with nothing after it reads as absent).
pub(super) fn strip_nulls(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.retain(|_, value| !value.is_null());
            map.values_mut().for_each(strip_nulls);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

/// `key` under `path`.
pub(super) fn child(path: &str, key: &str) -> String {
    if path.is_empty() { key.to_owned() } else { format!("{path}.{key}") }
}

/// Checks trees against one schema, collecting problems.
pub(super) struct Checker<'a> {
    defs: Option<&'a Map<String, Value>>,
    problems: &'a mut Vec<Problem>,
    patterns: HashMap<String, Option<Regex>>,
}

/// The keywords of a schema and of the schemas it refers to, the referring one first.
struct Keywords<'s>(Vec<&'s Map<String, Value>>);

impl<'s> Keywords<'s> {
    fn get(&self, key: &str) -> Option<&'s Value> {
        self.0.iter().find_map(|map| map.get(key))
    }

    fn number(&self, key: &str) -> Option<i64> {
        self.get(key).and_then(Value::as_i64)
    }

    /// The `type` names, without `null` (nulls are stripped before checking).
    fn types(&self) -> Vec<&'s str> {
        match self.get("type") {
            Some(Value::String(name)) => vec![name.as_str()],
            Some(Value::Array(names)) => {
                names.iter().filter_map(Value::as_str).filter(|name| *name != "null").collect()
            }
            _ => Vec::new(),
        }
    }
}

impl<'a> Checker<'a> {
    /// A checker for `root` (whose `$defs` its `$ref`s point into), adding problems to `problems`.
    pub(super) fn new(root: &'a Value, problems: &'a mut Vec<Problem>) -> Self {
        Self { defs: root.get("$defs").and_then(Value::as_object), problems, patterns: HashMap::new() }
    }

    fn problem(&mut self, path: &str, message: impl Into<String>) {
        self.problems.push(Problem { path: path.to_owned(), message: message.into() });
    }

    /// `schema`'s keywords, following `$ref`s and taking the non-null branch of an `anyOf`.
    fn keywords<'s>(&self, schema: &'s Value) -> Keywords<'s>
    where
        'a: 's,
    {
        let mut maps = Vec::new();
        let mut next = schema.as_object();
        while let Some(map) = next.take() {
            maps.push(map);
            if let Some(reference) = map.get("$ref").and_then(Value::as_str) {
                next = reference
                    .strip_prefix("#/$defs/")
                    .and_then(|name| self.defs.and_then(|defs| defs.get(name)))
                    .and_then(Value::as_object);
            } else if let Some(Value::Array(branches)) = map.get("anyOf").or_else(|| map.get("oneOf")) {
                next = branches
                    .iter()
                    .filter_map(Value::as_object)
                    .find(|branch| branch.get("type").and_then(Value::as_str) != Some("null"));
            }
            if maps.len() > 16 {
                break;
            }
        }
        Keywords(maps)
    }

    /// Checks `value` at `path` against `schema`, repairing the parts inside it that cannot be read; whether the
    /// value itself can be read (false: replace or remove it).
    pub(super) fn check(&mut self, schema: &Value, value: &mut Value, path: &str) -> bool {
        let keywords = self.keywords(schema);
        let types = keywords.types();
        if !types.is_empty() && !types.iter().any(|name| is_kind(name, value)) {
            let message = expected(&keywords, types[0], value);
            self.problem(path, message);
            return false;
        }
        if let Some(Value::Array(choices)) = keywords.get("enum")
            && !choices.contains(value)
        {
            let names: Vec<String> = choices.iter().map(|choice| shown(choice, false)).collect();
            self.problem(path, format!("{} is not one of: {}", shown(value, true), names.join(", ")));
            return false;
        }
        match value {
            Value::String(text) => self.string(&keywords, text, path),
            Value::Number(number) => self.number(&keywords, number.as_i64(), path),
            Value::Array(items) => self.list(&keywords, items, path),
            Value::Object(map) => self.mapping(&keywords, map, path),
            Value::Bool(_) | Value::Null => true,
        }
    }

    fn string(&mut self, keywords: &Keywords<'_>, text: &str, path: &str) -> bool {
        if text.trim().is_empty() {
            self.problem(path, "must not be empty");
            return false;
        }
        if let Some(pattern) = keywords.get("pattern").and_then(Value::as_str) {
            let regex = self.patterns.entry(pattern.to_owned()).or_insert_with(|| Regex::new(pattern).ok());
            if !regex.as_ref().is_some_and(|regex| regex.is_match(text)) {
                let message = match keywords.get(INVALID).and_then(Value::as_str) {
                    Some(invalid) => format!("{text:?} {invalid}"),
                    None => format!("{text:?} must match {pattern}"),
                };
                self.problem(path, message);
                return false;
            }
        }
        let message = match keywords.get("format").and_then(Value::as_str) {
            Some("destination-rule") => text.parse::<DestinationRule>().err().map(|error| error.to_string()),
            Some("cidr") => match text.parse::<DestinationRule>() {
                Ok(DestinationRule { network: Some(_), ports: None }) => None,
                _ => Some(format!("{text:?} is not a network in CIDR notation such as 10.244.0.0/16")),
            },
            _ => None,
        };
        message.map(|message| self.problem(path, message)).is_none()
    }

    fn number(&mut self, keywords: &Keywords<'_>, number: Option<i64>, path: &str) -> bool {
        let (min, max) = (keywords.number("minimum"), keywords.number("maximum"));
        let in_range =
            number.is_some_and(|number| min.is_none_or(|min| number >= min) && max.is_none_or(|max| number <= max));
        if !in_range && let Some(number) = number {
            let range = match (min, max) {
                (Some(min), Some(max)) => format!("{min} to {max}"),
                (Some(min), None) => format!("at least {min}"),
                (None, Some(max)) => format!("at most {max}"),
                (None, None) => String::new(),
            };
            self.problem(path, format!("{number} is out of range ({range})"));
        }
        in_range
    }

    fn list(&mut self, keywords: &Keywords<'_>, items: &mut [Value], path: &str) -> bool {
        if let Some(min) = keywords.number("minItems")
            && items.len() < usize::try_from(min).unwrap_or(usize::MAX)
        {
            self.problem(
                path,
                if min == 1 { "must not be empty".to_owned() } else { format!("needs at least {min} items") },
            );
        }
        // An unreadable item makes the list unreadable: removing the item would shift the paths later checks report.
        let mut keep = true;
        if let Some(schema) = keywords.get("items") {
            for (index, item) in items.iter_mut().enumerate() {
                keep &= self.check(schema, item, &format!("{path}[{index}]"));
            }
        }
        if keywords.get("uniqueItems") == Some(&Value::Bool(true)) {
            for (index, item) in items.iter().enumerate() {
                if items[..index].contains(item) {
                    self.problem(&format!("{path}[{index}]"), format!("{} is listed twice", shown(item, true)));
                }
            }
        }
        keep
    }

    fn mapping(&mut self, keywords: &Keywords<'_>, map: &mut Map<String, Value>, path: &str) -> bool {
        let properties = keywords.get("properties").and_then(Value::as_object);
        let extra = keywords.get("additionalProperties");
        if let Some(names) = keywords.get("propertyNames") {
            let keys: Vec<String> = map.keys().cloned().collect();
            for key in keys {
                if !self.check(names, &mut Value::String(key.clone()), &child(path, &key)) {
                    map.remove(&key);
                }
            }
        }
        if extra == Some(&Value::Bool(false)) {
            let allowed: Vec<&str> =
                properties.map(|known| known.keys().map(String::as_str).collect()).unwrap_or_default();
            let unknown: Vec<String> = map.keys().filter(|key| !allowed.contains(&key.as_str())).cloned().collect();
            for key in unknown {
                self.problem(&child(path, &key), format!("unknown field (expected one of: {})", allowed.join(", ")));
                map.remove(&key);
            }
        }
        let mut keep = true;
        if let Some(Value::Array(required)) = keywords.get("required") {
            for key in required.iter().filter_map(Value::as_str).filter(|key| !map.contains_key(*key)) {
                self.problem(&child(path, key), "is required");
                keep = false;
            }
        }
        let keys: Vec<String> = map.keys().cloned().collect();
        for key in keys {
            let schema = match properties.and_then(|known| known.get(&key)) {
                Some(schema) => schema,
                None => match extra {
                    Some(schema @ Value::Object(_)) => schema,
                    _ => continue,
                },
            };
            let Some(value) = map.get_mut(&key) else { continue };
            if !self.check(schema, value, &child(path, &key)) {
                match self.keywords(schema).get("default") {
                    Some(default) => *value = default.clone(),
                    None => {
                        map.remove(&key);
                        // A required property gone leaves the mapping unreadable.
                        keep &= !keywords
                            .get("required")
                            .and_then(Value::as_array)
                            .is_some_and(|required| required.contains(&Value::String(key.clone())));
                    }
                }
            }
        }
        keep
    }
}

fn is_kind(name: &str, value: &Value) -> bool {
    match name {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "boolean" => value.is_boolean(),
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        _ => true,
    }
}

/// The message for a value of the wrong kind.
fn expected(keywords: &Keywords<'_>, name: &str, value: &Value) -> String {
    let found = kind_of(value);
    match name {
        "object" => format!("must be a mapping, found {found}"),
        "array" => format!("must be a list, found {found}"),
        "string" => format!("must be a string, found {found}"),
        "boolean" => format!("must be true or false, found {found}"),
        "integer" => match (keywords.number("minimum"), keywords.number("maximum")) {
            (Some(min), Some(max)) => {
                format!("must be a whole number from {min} to {max}, found {}", shown(value, true))
            }
            _ => format!("must be a whole number, found {}", shown(value, true)),
        },
        other => format!("must be {other}, found {found}"),
    }
}

/// A value as a message shows it: a string quoted when `quoted`, anything else as YAML would write it.
fn shown(value: &Value, quoted: bool) -> String {
    match value {
        Value::String(text) if quoted => format!("{text:?}"),
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn problems(schema: &Value, mut value: Value) -> (Vec<String>, Value) {
        let mut found = Vec::new();
        Checker::new(schema, &mut found).check(schema, &mut value, "at");
        (found.iter().map(ToString::to_string).collect(), value)
    }

    #[test]
    fn every_problem_is_reported_and_the_tree_repaired() {
        let schema = json!({
            "type": "object",
            "additionalProperties": false,
            "required": ["name", "size"],
            "properties": {
                "name": { "type": "string", "pattern": "^[a-z]+$", "x-invalid": "is not lowercase" },
                "size": { "type": "integer", "minimum": 1, "maximum": 9 },
                "mode": { "type": ["string", "null"], "enum": ["a", "b"], "default": "a" },
                "tags": { "type": "array", "minItems": 1, "uniqueItems": true, "items": { "$ref": "#/$defs/Tag" } },
                "sizes": { "type": "object", "additionalProperties": { "type": "integer" }, "propertyNames": { "pattern": "^[a-z]+$" } },
            },
            "$defs": { "Tag": { "type": "string", "format": "cidr" } },
        });
        let (found, repaired) = problems(
            &schema,
            json!({ "name": "Big", "mode": "c", "tags": ["10.0.0.0/8", "x", 3, "10.0.0.0/8"], "sizes": { "ok": 1, "Bad": 2, "no": "x" }, "colour": 1 }),
        );
        assert_eq!(
            found,
            [
                "at.colour: unknown field (expected one of: mode, name, size, sizes, tags)",
                "at.size: is required",
                "at.mode: \"c\" is not one of: a, b",
                "at.name: \"Big\" is not lowercase",
                "at.sizes.Bad: \"Bad\" must match ^[a-z]+$",
                "at.sizes.no: must be a whole number, found \"x\"",
                "at.tags[1]: \"x\" is not a network in CIDR notation such as 10.244.0.0/16",
                "at.tags[2]: must be a string, found a number",
                "at.tags[3]: \"10.0.0.0/8\" is listed twice",
            ]
        );
        assert_eq!(repaired, json!({ "mode": "a", "sizes": { "ok": 1 } }), "the list with an unreadable item is gone");
    }

    #[test]
    fn kinds_ranges_and_empty_strings_have_their_messages() {
        let schema = json!({ "type": "object", "properties": {
            "port": { "type": "integer", "minimum": 1, "maximum": 65535 },
            "on": { "type": "boolean" },
            "list": { "type": "array", "minItems": 1 },
            "text": { "type": "string" },
            "map": { "type": "object" },
        }});
        let (found, _) = problems(&schema, json!({ "port": 70000, "on": "yes", "list": [], "text": "  ", "map": [1] }));
        assert_eq!(
            found,
            [
                "at.list: must not be empty",
                "at.map: must be a mapping, found a list",
                "at.on: must be true or false, found a string",
                "at.port: 70000 is out of range (1 to 65535)",
                "at.text: must not be empty",
            ]
        );
        let (found, _) = problems(&schema, json!({ "port": 1.5 }));
        assert_eq!(found, ["at.port: must be a whole number from 1 to 65535, found 1.5"]);
    }

    #[test]
    fn empty_values_read_as_absent() {
        let mut tree = json!({ "a": null, "b": [null, { "c": null, "d": 1 }] });
        strip_nulls(&mut tree);
        assert_eq!(tree, json!({ "b": [null, { "d": 1 }] }));
    }
}
