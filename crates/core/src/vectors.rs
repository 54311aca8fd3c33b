//! Conformance vectors: the file format of SPEC "Vector files", parsed with
//! errors that name the place, and run against any store.
//!
//! ```
//! use ratewarden_core::vectors::{parse, run_case, CaseOutcome};
//! use ratewarden_core::MemoryStore;
//! let file = parse(r#"{"cases": [{"description": "one fits", "policy": "fixed-window",
//!     "limit": 1, "window_ms": 1000, "steps": [
//!     {"key": "a", "now_ms": 0, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0},
//!     {"key": "a", "now_ms": 1, "cost": 1, "allowed": false, "retry_after_ms": 999, "remaining": 0}]}]}"#)
//!     .unwrap();
//! let case = &file.cases[0];
//! let store = MemoryStore::for_config(&case.config, Default::default()).unwrap();
//! let outcome = run_case(case, |key, now_ms, cost| store.decide(key, now_ms, cost));
//! assert_eq!(outcome, CaseOutcome::Passed);
//! ```

use std::fmt;

use serde_json::{Map, Value};

use crate::registry::{PolicyConfig, PolicyKind};
use crate::{mix32, Decision, StoreError, MAX_SAFE};

/// A parsed vector file.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VectorFile {
    /// Known mix32 values.
    pub mix32: Vec<Mix32Vector>,
    /// Cases, each starting from an empty store.
    pub cases: Vec<Case>,
}

/// One known mix32 value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mix32Vector {
    /// The string hashed.
    pub input: String,
    /// Its mix32.
    pub output: u32,
}

/// One case: a configuration and the steps run against a fresh store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Case {
    /// What the case shows.
    pub description: String,
    /// The policy configuration (validated when parsed).
    pub config: PolicyConfig,
    /// The requests in order, with what each must get.
    pub steps: Vec<Step>,
}

/// A key as a vector file writes it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum VectorKey {
    /// An integer key, used as is.
    Int(u64),
    /// A string key, hashed with mix32.
    Str(String),
}

impl VectorKey {
    /// The integer key a store sees.
    pub fn resolve(&self) -> u64 {
        match self {
            VectorKey::Int(k) => *k,
            VectorKey::Str(s) => u64::from(mix32(s)),
        }
    }
}

/// What a step must get: a [`Decision`]'s three fields, the wait exact in
/// 128 bits ([`Decision::retry_after_exact_ms`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expected {
    /// Admitted or refused.
    pub allowed: bool,
    /// `None` for `null`.
    pub retry_after_ms: Option<u128>,
    /// What is left.
    pub remaining: u64,
}

impl Expected {
    /// Whether `actual` matches in all three fields.
    pub fn matches(&self, actual: &Decision) -> bool {
        self.allowed == actual.allowed
            && self.retry_after_ms == actual.retry_after_exact_ms()
            && self.remaining == actual.remaining
    }
}

impl From<Decision> for Expected {
    fn from(d: Decision) -> Self {
        Expected {
            allowed: d.allowed,
            retry_after_ms: d.retry_after_exact_ms(),
            remaining: d.remaining,
        }
    }
}

/// One request of a case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// The key.
    pub key: VectorKey,
    /// When.
    pub now_ms: u64,
    /// How much.
    pub cost: u64,
    /// What it must get.
    pub expected: Expected,
}

/// A vector file that cannot be run, with where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VectorError {
    /// Where in the file, e.g. `cases[2].steps[7].now_ms`.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for VectorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

impl std::error::Error for VectorError {}

fn err(path: &str, message: impl Into<String>) -> VectorError {
    VectorError {
        path: path.to_owned(),
        message: message.into(),
    }
}

/// Parses a vector file, checking every field: a missing field, a number
/// outside `0 ..= 2^53 - 1`, an unknown policy or an invalid configuration
/// is an error naming its place. The first malformed case makes the whole
/// file an error; [`parse_each`] keeps the others.
pub fn parse(text: &str) -> Result<VectorFile, VectorError> {
    let each = parse_each(text)?;
    Ok(VectorFile {
        mix32: each.mix32,
        cases: each.cases.into_iter().collect::<Result<_, _>>()?,
    })
}

/// A vector file whose cases were parsed one by one.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EachCase {
    /// Known mix32 values.
    pub mix32: Vec<Mix32Vector>,
    /// Every case in file order: parsed, or why it cannot be run.
    pub cases: Vec<Result<Case, VectorError>>,
    /// Where the file holds a field the format does not have, case by
    /// case (`cases[0].brust`): ignored (SPEC's format names its fields
    /// and says nothing of others), but a misspelt field (`brust` for
    /// `burst`) changes what a case tests without a sign, so a runner
    /// should say so.
    pub unknown_fields: Vec<String>,
    /// Where an object of the file names a field twice
    /// (`cases[0].limit`): the last is taken, but JSON readers differ on
    /// which they take (RFC 8259 leaves it open), so another port may run
    /// a different case, and a runner should say so.
    pub duplicate_fields: Vec<String>,
    /// Where a case gives a `burst` to a policy without a bucket
    /// (`cases[0].burst`): SPEC's own example does, and the policy ignores
    /// it, but a case written for a bucket's burst then tests something
    /// else, so a runner should say so.
    pub ignored_bursts: Vec<String>,
}

/// The fields of SPEC's format: at the top, in a `mix32` entry, in a case
/// and in a step.
const ROOT_FIELDS: &[&str] = &["mix32", "cases"];
const MIX32_FIELDS: &[&str] = &["input", "output"];
const CASE_FIELDS: &[&str] = &[
    "description",
    "policy",
    "limit",
    "window_ms",
    "burst",
    "steps",
];
const STEP_FIELDS: &[&str] = &[
    "key",
    "now_ms",
    "cost",
    "allowed",
    "retry_after_ms",
    "remaining",
];

/// The places in `root` of fields the format does not have.
fn unknown_fields(root: &Map<String, Value>) -> Vec<String> {
    fn each<'v>(
        value: Option<&'v Value>,
        path: &str,
    ) -> impl Iterator<Item = (String, &'v Map<String, Value>)> {
        let path = path.to_owned();
        value
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
            .filter_map(move |(i, v)| Some((format!("{path}[{i}]"), v.as_object()?)))
    }
    fn unknown(obj: &Map<String, Value>, known: &[&str], path: &str, out: &mut Vec<String>) {
        for field in obj.keys().filter(|k| !known.contains(&k.as_str())) {
            out.push(if path.is_empty() {
                field.clone()
            } else {
                format!("{path}.{field}")
            });
        }
    }
    let mut out = Vec::new();
    unknown(root, ROOT_FIELDS, "", &mut out);
    for (path, entry) in each(root.get("mix32"), "mix32") {
        unknown(entry, MIX32_FIELDS, &path, &mut out);
    }
    for (path, case) in each(root.get("cases"), "cases") {
        unknown(case, CASE_FIELDS, &path, &mut out);
        for (path, step) in each(case.get("steps"), &format!("{path}.steps")) {
            unknown(step, STEP_FIELDS, &path, &mut out);
        }
    }
    out
}

/// The places in the JSON `text` (already known to parse) of fields an
/// object names twice, at any depth.
fn duplicate_fields(text: &str) -> Vec<String> {
    use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
    use std::collections::HashSet;

    /// Walks one value at `path`, adding the places of repeated fields to
    /// `found`. (With serde_json's `arbitrary_precision`, a number comes
    /// as an object of one field, which never repeats.)
    struct Walk<'a> {
        path: String,
        found: &'a mut Vec<String>,
    }
    impl<'de> DeserializeSeed<'de> for Walk<'_> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> Visitor<'de> for Walk<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let mut seen = HashSet::new();
            while let Some(field) = map.next_key::<String>()? {
                let path = if self.path.is_empty() {
                    field.clone()
                } else {
                    format!("{}.{field}", self.path)
                };
                if !seen.insert(field) {
                    self.found.push(path.clone());
                }
                map.next_value_seed(Walk {
                    path,
                    found: &mut *self.found,
                })?;
            }
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            for i in 0.. {
                let item = Walk {
                    path: format!("{}[{i}]", self.path),
                    found: &mut *self.found,
                };
                if seq.next_element_seed(item)?.is_none() {
                    break;
                }
            }
            Ok(())
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
    }

    let mut found = Vec::new();
    let mut reader = serde_json::Deserializer::from_str(text);
    // The text parsed as a `Value` already, so this walk cannot fail; if it
    // somehow did, the places found so far are still right.
    let _ = Walk {
        path: String::new(),
        found: &mut found,
    }
    .deserialize(&mut reader);
    found
}

/// Parses a vector file as [`parse`] does, except that a malformed case is
/// kept as its error in its place and the file's other cases still parse:
/// a runner can run them and report that one. The file itself (its JSON,
/// `cases`, `mix32`) must still be well formed.
pub fn parse_each(text: &str) -> Result<EachCase, VectorError> {
    // A byte-order mark, which some editors write, says nothing of the
    // JSON after it (RFC 8259 lets a parser skip it).
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let root: Value = serde_json::from_str(text).map_err(|e| {
        // serde_json reads a lone surrogate escape as a cut-short one.
        let advice = if e.to_string().contains("hex escape") {
            "; a \\u escape from \\uD800 to \\uDFFF is half of a pair (\\uD83D\\uDE00 \
             is one character), and a string cannot hold one alone"
        } else {
            ""
        };
        err("", format!("not valid JSON: {e}{advice}"))
    })?;
    let root = root.as_object().ok_or_else(|| {
        err(
            "",
            "the file must be a JSON object with \"cases\" (or \"mix32\")",
        )
    })?;
    let mut file = EachCase {
        unknown_fields: unknown_fields(root),
        duplicate_fields: duplicate_fields(text),
        ..EachCase::default()
    };
    if let Some(mix) = root.get("mix32") {
        let mix = mix
            .as_array()
            .ok_or_else(|| err("mix32", "must be an array"))?;
        for (i, entry) in mix.iter().enumerate() {
            let path = format!("mix32[{i}]");
            let obj = object(entry, &path)?;
            let input = string_field(obj, &path, "input")?;
            let output = integer_field(obj, &path, "output", 0, u64::from(u32::MAX))? as u32;
            file.mix32.push(Mix32Vector { input, output });
        }
    }
    // SPEC marks only mix32 optional; a file of mix32 values alone is
    // still read, as a file of no cases, but a file with neither is no
    // vector file.
    let cases = match root.get("cases") {
        Some(cases) => cases
            .as_array()
            .ok_or_else(|| err("cases", "must be an array"))?,
        None if root.contains_key("mix32") => return Ok(file),
        None => return Err(err("", "missing field \"cases\"")),
    };
    for (i, case) in cases.iter().enumerate() {
        let path = format!("cases[{i}]");
        let parsed = parse_case(case, &path);
        if let Ok(c) = &parsed {
            let burst = case.get("burst").is_some_and(|b| !b.is_null());
            if burst && !c.config.policy.has_burst() {
                file.ignored_bursts.push(format!("{path}.burst"));
            }
        }
        file.cases.push(parsed);
    }
    Ok(file)
}

fn parse_case(value: &Value, path: &str) -> Result<Case, VectorError> {
    let obj = object(value, path)?;
    let description = match obj.get("description") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(err(&format!("{path}.description"), "must be a string")),
    };
    let name = string_field(obj, path, "policy")?;
    let policy: PolicyKind = name
        .parse()
        .map_err(|e: crate::ConfigError| err(&format!("{path}.policy"), e.to_string()))?;
    let limit = integer_field(obj, path, "limit", 0, MAX_SAFE)?;
    let window_ms = integer_field(obj, path, "window_ms", 1, MAX_SAFE)?;
    let burst = match obj.get("burst") {
        None | Some(Value::Null) => None,
        Some(_) => Some(integer_field(obj, path, "burst", 0, MAX_SAFE)?),
    };
    // SPEC's own example of the format gives a sliding-window counter a
    // burst: a policy without a bucket has no use for one and ignores it.
    let burst = burst.filter(|_| policy.has_burst());
    let config = PolicyConfig {
        policy,
        limit,
        window_ms,
        burst,
    };
    config.build().map_err(|e| err(path, e.to_string()))?;
    let steps = obj
        .get("steps")
        .ok_or_else(|| err(path, "missing field \"steps\""))?;
    let steps = steps
        .as_array()
        .ok_or_else(|| err(&format!("{path}.steps"), "must be an array"))?;
    let steps = steps
        .iter()
        .enumerate()
        .map(|(j, step)| parse_step(step, &format!("{path}.steps[{j}]")))
        .collect::<Result<_, _>>()?;
    Ok(Case {
        description,
        config,
        steps,
    })
}

fn parse_step(value: &Value, path: &str) -> Result<Step, VectorError> {
    let obj = object(value, path)?;
    let key = match obj.get("key") {
        Some(Value::String(s)) => VectorKey::Str(s.clone()),
        Some(Value::Number(_)) => VectorKey::Int(integer_field(obj, path, "key", 0, u64::MAX)?),
        Some(_) => {
            return Err(err(
                &format!("{path}.key"),
                "must be an integer or a string",
            ))
        }
        None => return Err(err(path, "missing field \"key\"")),
    };
    let now_ms = integer_field(obj, path, "now_ms", 0, MAX_SAFE)?;
    let cost = integer_field(obj, path, "cost", 0, MAX_SAFE)?;
    let allowed = match obj.get("allowed") {
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(err(&format!("{path}.allowed"), "must be true or false")),
        None => return Err(err(path, "missing field \"allowed\"")),
    };
    let retry_after_ms = match obj.get("retry_after_ms") {
        Some(Value::Null) => None,
        Some(Value::Number(n)) => Some(wide_integer(n).ok_or_else(|| {
            let why = if is_whole(n) {
                format!(
                    "{n} is above 2^128 - 1, or written as a float above 2^53 - 1 (where it \
                     may already be rounded); write a whole number of ms as an integer, or null"
                )
            } else {
                format!("must be a whole number of ms or null, found {n}")
            };
            err(&format!("{path}.retry_after_ms"), why)
        })?),
        Some(other) => {
            return Err(err(
                &format!("{path}.retry_after_ms"),
                format!("must be a whole number of ms or null, found {other}"),
            ))
        }
        None => return Err(err(path, "missing field \"retry_after_ms\"")),
    };
    let remaining = integer_field(obj, path, "remaining", 0, u64::MAX)?;
    Ok(Step {
        key,
        now_ms,
        cost,
        expected: Expected {
            allowed,
            retry_after_ms,
            remaining,
        },
    })
}

fn object<'a>(value: &'a Value, path: &str) -> Result<&'a Map<String, Value>, VectorError> {
    value
        .as_object()
        .ok_or_else(|| err(path, format!("must be an object, found {value}")))
}

fn string_field(obj: &Map<String, Value>, path: &str, field: &str) -> Result<String, VectorError> {
    match obj.get(field) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(err(
            &format!("{path}.{field}"),
            format!("must be a string, found {other}"),
        )),
        None => Err(err(path, format!("missing field \"{field}\""))),
    }
}

/// Reads `field` of `obj` as a whole number up to `max`. `min` is the
/// least value the field takes, named in the messages for values that are
/// no whole number; a whole number below it (a window of 0) is returned,
/// for the configuration's own check to refuse saying why.
fn integer_field(
    obj: &Map<String, Value>,
    path: &str,
    field: &str,
    min: u64,
    max: u64,
) -> Result<u64, VectorError> {
    let here = || format!("{path}.{field}");
    match obj.get(field) {
        Some(Value::Number(n)) => match n.as_u64().or_else(|| exact_whole(n)) {
            Some(v) if v <= max => Ok(v),
            Some(v) => Err(err(
                &here(),
                format!("{v} is out of range: the largest allowed is {max}"),
            )),
            // A whole float too large to be sure of (see `exact_whole`),
            // or an integer above 2^64 - 1, which JSON readers take as a
            // float too: the text no longer tells the two apart.
            None if is_whole(n) => Err(err(
                &here(),
                format!(
                    "{n} is above 2^64 - 1, or written as a float above 2^53 - 1 (where it \
                     may already be rounded); write a whole number from {min} to {max} as \
                     an integer"
                ),
            )),
            None => Err(err(
                &here(),
                format!("must be a whole number from {min} to {max}, found {n}"),
            )),
        },
        Some(other) => Err(err(
            &here(),
            format!("must be a whole number from {min} to {max}, found {other}"),
        )),
        None => Err(err(path, format!("missing field \"{field}\""))),
    }
}

/// A whole number written with a fraction or an exponent (`1000.0`,
/// `1e3`), when the value is exact: JSON does not tell integers from
/// other numbers, and a writer may print every number as a float. Above
/// 2^53 a float may already be rounded, so it is not taken.
fn exact_whole(n: &serde_json::Number) -> Option<u64> {
    // Whole by its text, so a float is exact below 2^53: `as_f64` alone
    // would round `2.00000000000000001` to 2 and take it.
    let f = n.as_f64()?;
    (is_whole(n) && f <= MAX_SAFE as f64).then_some(f as u64)
}

/// Whether `n` is a whole number at least 0, read from its text (kept as
/// written: serde_json's `arbitrary_precision`), however it is written:
/// `5`, `5.0`, `0.5e1`, `1e400` are; `5.5`, `2.00000000000000001`, `-1`
/// are not.
fn is_whole(n: &serde_json::Number) -> bool {
    let text = n.as_str();
    let (mantissa, exponent) = match text.split_once(['e', 'E']) {
        Some((m, e)) => (m, e),
        None => (text, "0"),
    };
    let (negative, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let (int, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{int}{fraction}");
    let significant = digits.trim_end_matches('0');
    if significant.trim_start_matches('0').is_empty() {
        return true; // zero, whatever its sign
    }
    if negative {
        return false;
    }
    // The place of the last significant digit, in powers of ten: whole
    // when it is not below the units. An exponent too long for i64 is
    // past any fraction's digits (or below all of them) either way.
    let trimmed_zeros = (digits.len() - significant.len()) as i64;
    let exponent: i64 = match exponent.trim_start_matches('+').parse() {
        Ok(e) => e,
        Err(_) => return !exponent.starts_with('-'),
    };
    exponent.saturating_add(trimmed_zeros) >= fraction.len() as i64
}

/// A non-negative whole number, also above `u64::MAX`: exact when written
/// as an integer (up to `u128::MAX`), and as a float (`1e3`) only up to
/// 2^53 - 1, as every other field (see [`exact_whole`]): a larger float
/// may be rounded already, and a larger wait must be written as an
/// integer to be compared exactly.
fn wide_integer(n: &serde_json::Number) -> Option<u128> {
    n.as_u128().or_else(|| exact_whole(n).map(u128::from))
}

/// How one case went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaseOutcome {
    /// Every step matched.
    Passed,
    /// Step `step` (0-based) got `actual` instead of `expected`.
    Mismatch {
        /// Index of the first failing step.
        step: usize,
        /// What the file expects.
        expected: Expected,
        /// What the store decided.
        actual: Decision,
    },
    /// The store failed at step `step`.
    StoreFailed {
        /// Index of the step.
        step: usize,
        /// The store's error.
        error: StoreError,
    },
}

/// Runs a case's steps in order through `decide(key, now_ms, cost)`, which
/// must start from a store holding nothing for the case; stops at the first
/// step that differs.
pub fn run_case(
    case: &Case,
    mut decide: impl FnMut(u64, u64, u64) -> Result<Decision, StoreError>,
) -> CaseOutcome {
    for (i, step) in case.steps.iter().enumerate() {
        match decide(step.key.resolve(), step.now_ms, step.cost) {
            Ok(actual) if step.expected.matches(&actual) => {}
            Ok(actual) => {
                return CaseOutcome::Mismatch {
                    step: i,
                    expected: step.expected,
                    actual,
                }
            }
            Err(error) => return CaseOutcome::StoreFailed { step: i, error },
        }
    }
    CaseOutcome::Passed
}

/// Writes a vector file in the format `parse` reads, one step per line so
/// that a change to a generated file reads well in a diff.
pub fn write(file: &VectorFile) -> String {
    let mut out = String::from("{\n");
    if !file.mix32.is_empty() {
        out.push_str("  \"mix32\": [\n");
        let rows: Vec<String> = file
            .mix32
            .iter()
            .map(|m| {
                format!(
                    "    {{\"input\": {}, \"output\": {}}}",
                    Value::from(m.input.clone()),
                    m.output
                )
            })
            .collect();
        out.push_str(&rows.join(",\n"));
        out.push_str("\n  ],\n");
    }
    out.push_str("  \"cases\": [\n");
    let cases: Vec<String> = file.cases.iter().map(write_case).collect();
    out.push_str(&cases.join(",\n"));
    out.push_str("\n  ]\n}\n");
    out
}

fn write_case(case: &Case) -> String {
    let c = &case.config;
    let mut head = format!(
        "    {{\"description\": {}, \"policy\": \"{}\", \"limit\": {}, \"window_ms\": {}",
        Value::from(case.description.clone()),
        c.policy.name(),
        c.limit,
        c.window_ms
    );
    if let Some(b) = c.burst {
        head.push_str(&format!(", \"burst\": {b}"));
    }
    head.push_str(", \"steps\": [\n");
    let steps: Vec<String> = case
        .steps
        .iter()
        .map(|s| {
            let key = match &s.key {
                VectorKey::Int(k) => k.to_string(),
                VectorKey::Str(k) => Value::from(k.clone()).to_string(),
            };
            let retry = s.expected.retry_after_ms.map_or("null".to_owned(), |r| r.to_string());
            format!(
                "      {{\"key\": {key}, \"now_ms\": {}, \"cost\": {}, \"allowed\": {}, \"retry_after_ms\": {retry}, \"remaining\": {}}}",
                s.now_ms, s.cost, s.expected.allowed, s.expected.remaining
            )
        })
        .collect();
    head.push_str(&steps.join(",\n"));
    head.push_str("\n    ]}");
    head
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD_STEP: &str = r#"{"key": 1, "now_ms": 0, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0}"#;

    fn case_with(fields: &str, step: &str) -> String {
        format!(r#"{{"cases": [{{"description": "d", {fields}, "steps": [{step}]}}]}}"#)
    }

    #[test]
    fn round_trips_through_write() {
        let text = case_with(
            r#""policy": "gcra", "limit": 1, "window_ms": 10, "burst": 2"#,
            GOOD_STEP,
        );
        let file = parse(&text).unwrap();
        assert_eq!(parse(&write(&file)).unwrap(), file);
    }

    #[test]
    fn a_byte_order_mark_and_a_file_of_mix32_values_alone_are_read() {
        let text = case_with(
            r#""policy": "fixed-window", "limit": 1, "window_ms": 10"#,
            GOOD_STEP,
        );
        assert_eq!(
            parse(&format!("\u{feff}{text}")).unwrap(),
            parse(&text).unwrap()
        );
        let file = parse(r#"{"mix32": [{"input": "hello", "output": 613153351}]}"#).unwrap();
        assert_eq!(file.mix32.len(), 1);
        assert!(file.cases.is_empty());
    }

    #[test]
    fn a_burst_on_a_policy_without_a_bucket_is_ignored() {
        // As in SPEC's own example of the format.
        let text = case_with(
            r#""policy": "sliding-window-counter", "limit": 1, "window_ms": 10, "burst": 5"#,
            GOOD_STEP,
        );
        let file = parse(&text).unwrap();
        assert_eq!(
            file.cases[0].config,
            PolicyConfig::new(PolicyKind::SlidingWindowCounter, 1, 10)
        );
        let bucket = case_with(
            r#""policy": "token-bucket", "limit": 1, "window_ms": 10, "burst": 5"#,
            GOOD_STEP,
        );
        assert_eq!(parse(&bucket).unwrap().cases[0].config.burst, Some(5));
        // Ignored, but said: the window case is named, the bucket's and a
        // null burst are not.
        assert_eq!(
            parse_each(&text).unwrap().ignored_bursts,
            ["cases[0].burst"]
        );
        assert!(parse_each(&bucket).unwrap().ignored_bursts.is_empty());
        let null = case_with(
            r#""policy": "fixed-window", "limit": 1, "window_ms": 10, "burst": null"#,
            GOOD_STEP,
        );
        assert!(parse_each(&null).unwrap().ignored_bursts.is_empty());
    }

    #[test]
    fn whole_numbers_written_as_floats_are_read_exactly() {
        let text = case_with(
            r#""policy": "fixed-window", "limit": 1.0, "window_ms": 1e1"#,
            r#"{"key": 7.0, "now_ms": 0.0, "cost": 1, "allowed": true, "retry_after_ms": 0.0, "remaining": 0}"#,
        );
        let file = parse(&text).unwrap();
        assert_eq!(
            file.cases[0].config,
            PolicyConfig::new(PolicyKind::FixedWindow, 1, 10)
        );
        assert_eq!(file.cases[0].steps[0].key, VectorKey::Int(7));
        // Past 2^53 a float may be rounded already: written so, it is refused.
        let rounded = case_with(
            r#""policy": "fixed-window", "limit": 1, "window_ms": 10"#,
            r#"{"key": 1e17, "now_ms": 0, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0}"#,
        );
        let e = parse(&rounded).unwrap_err().to_string();
        assert!(
            e.contains("cases[0].steps[0].key: 1e+17 is above 2^64 - 1, or written as a float"),
            "{e}"
        );
        // An integer key past 2^64 - 1 reads as a float too: the message
        // names both causes.
        let too_big = case_with(
            r#""policy": "fixed-window", "limit": 1, "window_ms": 10"#,
            r#"{"key": 18446744073709551616, "now_ms": 0, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0}"#,
        );
        let e = parse(&too_big).unwrap_err().to_string();
        assert!(e.contains("is above 2^64 - 1"), "{e}");
        assert!(e.contains("from 0 to 18446744073709551615"), "{e}");
        // A fraction too small for a float to hold is still a fraction,
        // in every field; the whole number written every other way is not.
        for (field, number) in [
            ("limit", "2.00000000000000001"),
            ("limit", "0.25e+1"),
            ("window_ms", "1e-1"),
            ("now_ms", "4503599627370496.5"),
            ("cost", "1.0000000000000000000000001"),
            ("retry_after_ms", "0.0000000000000000001"),
            ("retry_after_ms", "2.00000000000000001"),
        ] {
            let step = |now, cost, retry| {
                format!(
                    r#"{{"key": 1, "now_ms": {now}, "cost": {cost}, "allowed": true, "retry_after_ms": {retry}, "remaining": 0}}"#
                )
            };
            let (limit, window) = match field {
                "limit" => (number, "10"),
                "window_ms" => ("1", number),
                _ => ("1", "10"),
            };
            let step = match field {
                "now_ms" => step(number, "1", "0"),
                "cost" => step("0", number, "0"),
                "retry_after_ms" => step("0", "1", number),
                _ => step("0", "1", "0"),
            };
            let text = case_with(
                &format!(r#""policy": "fixed-window", "limit": {limit}, "window_ms": {window}"#),
                &step,
            );
            let e = parse(&text).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{field}: must be a whole number")),
                "{field} {number}: {e}"
            );
        }
        for number in ["100.000", "0.1e+3", "1000e-1", "-0.0e+2"] {
            let text = case_with(
                &format!(r#""policy": "fixed-window", "limit": {number}, "window_ms": 10"#),
                r#"{"key": 1, "now_ms": 0, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0}"#,
            );
            let want = if number.starts_with('-') { 0 } else { 100 };
            match parse(&text) {
                Ok(file) => assert_eq!(file.cases[0].config.limit, want, "{number}"),
                Err(e) => panic!("{number}: {e}"),
            }
        }
    }

    #[test]
    fn fields_the_format_does_not_have_are_named() {
        let text = format!(
            r#"{{"version": 2, "mix32": [{{"input": "a", "output": 1, "why": "x"}}], "cases": [
                {{"policy": "token-bucket", "limit": 1, "window_ms": 10, "brust": 5, "steps": [{GOOD_STEP}]}},
                {{"policy": "fixed-window", "limit": 1, "window_ms": 0, "note": "", "steps": [
                    {GOOD_STEP},
                    {{"key": 1, "now_ms": 0, "cost": 1, "allowed": false, "retry_after": 1,
                      "retry_after_ms": null, "remaining": 0}}]}}
            ]}}"#
        );
        let each = parse_each(&text).unwrap();
        assert_eq!(
            each.unknown_fields,
            [
                "version",
                "mix32[0].why",
                "cases[0].brust",
                "cases[1].note",
                "cases[1].steps[1].retry_after",
            ]
        );
        // Ignored, as the format allows: the first case still runs.
        assert!(each.cases[0].is_ok());
        let clean = format!(
            r#"{{"cases": [{{"description": "", "policy": "gcra", "limit": 1, "window_ms": 10, "burst": 2, "steps": [{GOOD_STEP}]}}]}}"#
        );
        assert!(parse_each(&clean).unwrap().unknown_fields.is_empty());
    }

    #[test]
    fn fields_given_twice_are_named() {
        let text = format!(
            r#"{{"cases": [
                {{"policy": "fixed-window", "limit": 5, "limit": 1, "window_ms": 10,
                  "steps": [{GOOD_STEP}]}},
                {{"policy": "fixed-window", "limit": 1, "window_ms": 10, "steps": [
                    {GOOD_STEP},
                    {{"key": 1, "key": 2, "now_ms": 9007199254740991, "cost": 1,
                      "allowed": false, "retry_after_ms": 340282366920938463463374607431768211455,
                      "remaining": 0, "remaining": 0}}]}}
            ], "cases": []}}"#
        );
        let each = parse_each(&text).unwrap();
        assert_eq!(
            each.duplicate_fields,
            [
                "cases[0].limit",
                "cases[1].steps[1].key",
                "cases[1].steps[1].remaining",
                "cases",
            ]
        );
        // As serde_json reads it, the last is taken.
        assert!(each.cases.is_empty());
        let clean = format!(
            r#"{{"cases": [{{"description": "", "policy": "gcra", "limit": 1, "window_ms": 10, "burst": 2, "steps": [{GOOD_STEP}, {GOOD_STEP}]}}]}}"#
        );
        assert!(parse_each(&clean).unwrap().duplicate_fields.is_empty());
    }

    #[test]
    fn one_malformed_case_leaves_the_others_to_run() {
        let text = format!(
            r#"{{"cases": [
                {{"policy": "fixed-window", "limit": 1, "window_ms": 10, "steps": [{GOOD_STEP}]}},
                {{"policy": "fixed-window", "limit": 1, "window_ms": 0, "steps": [{GOOD_STEP}]}},
                {{"policy": "gcra", "limit": 1, "window_ms": 10, "steps": [{GOOD_STEP}]}}
            ]}}"#
        );
        let each = parse_each(&text).unwrap();
        assert_eq!(each.cases.len(), 3);
        assert!(each.cases[0].is_ok() && each.cases[2].is_ok());
        let e = each.cases[1].as_ref().unwrap_err().to_string();
        assert!(e.starts_with("cases[1]: window_ms is 0"), "{e}");
        // `parse` makes the first malformed case the file's error.
        assert_eq!(parse(&text).unwrap_err().to_string(), e);
        // A file that is not even a list of cases is an error either way.
        assert!(parse_each(r#"{"cases": 3}"#).is_err());
    }

    #[test]
    fn malformed_files_name_the_place_and_the_problem() {
        let fw = r#""policy": "fixed-window", "limit": 1, "window_ms": 10"#;
        let cases = [
            ("{".to_owned(), "not valid JSON"),
            (
                r#"{"mix32": [{"input": "\ud800", "output": 0}], "cases": []}"#.to_owned(),
                "and a string cannot hold one alone",
            ),
            ("[]".to_owned(), "JSON object"),
            ("{}".to_owned(), "missing field \"cases\""),
            (r#"{"mix32": 3}"#.to_owned(), "mix32: must be an array"),
            (
                case_with(
                    r#""policy": "leaky", "limit": 1, "window_ms": 10"#,
                    GOOD_STEP,
                ),
                "cases[0].policy: unknown policy \"leaky\"",
            ),
            (
                case_with(r#""policy": "fixed-window", "window_ms": 10"#, GOOD_STEP),
                "cases[0]: missing field \"limit\"",
            ),
            (
                case_with(
                    r#""policy": "fixed-window", "limit": 1, "window_ms": 0"#,
                    GOOD_STEP,
                ),
                "window_ms is 0",
            ),
            (
                case_with(
                    r#""policy": "fixed-window", "limit": -1, "window_ms": 10"#,
                    GOOD_STEP,
                ),
                "cases[0].limit: must be a whole number from 0 to 9007199254740991, found -1",
            ),
            (
                // A window's range starts at 1.
                case_with(
                    r#""policy": "fixed-window", "limit": 1, "window_ms": -1000"#,
                    GOOD_STEP,
                ),
                "cases[0].window_ms: must be a whole number from 1 to 9007199254740991, found -1000",
            ),
            (
                case_with(
                    r#""policy": "fixed-window", "limit": 1.5, "window_ms": 10"#,
                    GOOD_STEP,
                ),
                "cases[0].limit: must be a whole number",
            ),
            (
                case_with(
                    r#""policy": "fixed-window", "limit": 9007199254740992, "window_ms": 10"#,
                    GOOD_STEP,
                ),
                "cases[0].limit: 9007199254740992 is out of range",
            ),
            (
                case_with(
                    r#""policy": "sliding-log", "limit": 1, "window_ms": 10, "burst": -3"#,
                    GOOD_STEP,
                ),
                "cases[0].burst: must be a whole number",
            ),
            (
                case_with(
                    fw,
                    r#"{"key": 1, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0}"#,
                ),
                "cases[0].steps[0]: missing field \"now_ms\"",
            ),
            (
                case_with(
                    fw,
                    r#"{"key": 1, "now_ms": 9007199254740992, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0}"#,
                ),
                "steps[0].now_ms: 9007199254740992 is out of range",
            ),
            (
                case_with(
                    fw,
                    r#"{"key": 1, "now_ms": 0, "cost": "1", "allowed": true, "retry_after_ms": 0, "remaining": 0}"#,
                ),
                "steps[0].cost: must be a whole number",
            ),
            (
                case_with(
                    fw,
                    r#"{"key": true, "now_ms": 0, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0}"#,
                ),
                "steps[0].key: must be an integer or a string",
            ),
            (
                case_with(
                    fw,
                    r#"{"key": 1, "now_ms": 0, "cost": 1, "allowed": 1, "retry_after_ms": 0, "remaining": 0}"#,
                ),
                "steps[0].allowed: must be true or false",
            ),
            (
                case_with(
                    fw,
                    r#"{"key": 1, "now_ms": 0, "cost": 1, "allowed": true, "retry_after_ms": -2, "remaining": 0}"#,
                ),
                "steps[0].retry_after_ms",
            ),
            (
                case_with(
                    fw,
                    r#"{"key": 1, "now_ms": 0, "cost": 1, "allowed": false, "retry_after_ms": 1e40, "remaining": 0}"#,
                ),
                "steps[0].retry_after_ms: 1e+40 is above 2^128 - 1, or written as a float",
            ),
            (
                case_with(
                    fw,
                    r#"{"key": 1, "now_ms": 0, "cost": 1, "allowed": false, "retry_after_ms": 9007199254740993.0, "remaining": 0}"#,
                ),
                "written as a float above 2^53 - 1",
            ),
            (
                case_with(
                    fw,
                    r#"{"key": 1, "now_ms": 0, "cost": 1, "allowed": false, "retry_after_ms": 400000000000000000000000000000000000000, "remaining": 0}"#,
                ),
                "is above 2^128 - 1",
            ),
            (
                case_with(
                    fw,
                    r#"{"key": 1, "now_ms": 0, "cost": 1, "allowed": true, "remaining": 0}"#,
                ),
                "missing field \"retry_after_ms\"",
            ),
            (
                r#"{"mix32": [{"input": "a", "output": 4294967296}], "cases": []}"#.to_owned(),
                "mix32[0].output",
            ),
        ];
        for (text, needle) in cases {
            let e = parse(&text).unwrap_err().to_string();
            assert!(e.contains(needle), "expected {needle:?} in {e:?}");
        }
    }

    #[test]
    fn waits_beyond_u64_are_read_exactly() {
        // (2^53 - 1)^2: the wait of a full token bucket of 2^53 - 1 per
        // 2^53 - 1 ms refilled at 1 per 2^53 - 1 ms.
        let wait = u128::from(MAX_SAFE) * u128::from(MAX_SAFE);
        let decide =
            |retry: u128| move |_: u64, _: u64, _: u64| Ok(Decision::refused_exact(Some(retry), 0));
        let config = r#""policy": "token-bucket", "limit": 1, "window_ms": 9007199254740991"#;
        let exact = format!(
            r#"{{"key": 1, "now_ms": 0, "cost": 1, "allowed": false, "retry_after_ms": {wait}, "remaining": 0}}"#
        );
        let file = parse(&case_with(config, &exact)).unwrap();
        assert_eq!(file.cases[0].steps[0].expected.retry_after_ms, Some(wait));
        assert_eq!(run_case(&file.cases[0], decide(wait)), CaseOutcome::Passed);
        let outcome = run_case(&file.cases[0], decide(wait + 1));
        assert!(
            matches!(outcome, CaseOutcome::Mismatch { step: 0, .. }),
            "{outcome:?}"
        );
        // Written with an exponent, a wait past 2^53 - 1 may be rounded
        // already: the file is malformed, as for every other field, rather
        // than compared with a number it does not hold.
        let rounded = r#"{"key": 1, "now_ms": 0, "cost": 1, "allowed": false, "retry_after_ms": 1e30, "remaining": 0}"#;
        let e = parse(&case_with(config, rounded)).unwrap_err().to_string();
        assert!(e.contains("written as a float above 2^53 - 1"), "{e}");
        // Up to 2^53 - 1, a float is read as the whole number it is.
        let small = r#"{"key": 1, "now_ms": 0, "cost": 1, "allowed": false, "retry_after_ms": 1e3, "remaining": 0}"#;
        let file = parse(&case_with(config, small)).unwrap();
        assert_eq!(file.cases[0].steps[0].expected.retry_after_ms, Some(1000));
    }

    #[test]
    fn string_keys_hash_with_mix32() {
        assert_eq!(VectorKey::Str("hello".into()).resolve(), 0x248bfa47);
        assert_eq!(VectorKey::Int(7).resolve(), 7);
    }
}
