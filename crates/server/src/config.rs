//! The configuration file: TOML, validated once on load.
//!
//! TOML rather than YAML because its types are explicit (no value silently
//! turns into a boolean or a float, as YAML's `no` and `1e3` do), it is the
//! format Rust tools already use, and the `toml` crate reports the byte span
//! of every value, so each error names the file, the line and the field.
//!
//! The shape follows envoyproxy/ratelimit's: a domain holds a tree of
//! descriptors, each with a `key`, an optional `value` (absent or empty: any
//! value, each value counted on its own; ending in `*`: any value with that
//! prefix; a `*` anywhere else is refused) and optionally a limit (or
//! `unlimited = true`) and nested descriptors. See `docs/serve.md` and
//! `examples/ratewarden.toml`.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use ratewarden_core::{
    FailurePolicy, KeyHash, MemoryOptions, PolicyConfig, PolicyKind, MAX_SAFE, REFERENCE,
};
use serde::Deserialize;
use toml::Spanned;

/// The most descriptor nodes a configuration may hold, over all domains.
pub const MAX_RULE_NODES: usize = 100_000;

/// The deepest a descriptor tree may nest.
pub const MAX_DEPTH: usize = 16;

/// The largest configuration file read, in bytes.
pub const MAX_FILE_BYTES: u64 = 16 << 20;

/// A configuration that failed to load, with where and what to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigFileError {
    /// The file, or `<inline>` for text not read from a file.
    pub file: String,
    /// 1-based line of the offending value, when known.
    pub line: Option<usize>,
    /// 1-based column of the offending value, when known.
    pub column: Option<usize>,
    /// The field, as a dotted path (`domains[0].descriptors[1].limit`).
    pub field: String,
    /// What is wrong and what to change.
    pub message: String,
}

impl fmt::Display for ConfigFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(column) = self.column {
                write!(f, ":{column}")?;
            }
        }
        if self.field.is_empty() {
            write!(f, ": {}", self.message)
        } else {
            write!(f, ": {}: {}", self.field, self.message)
        }
    }
}

impl std::error::Error for ConfigFileError {}

/// What `serve` gives a request whose store failed: `[server]
/// failure_policy`, one of the limiters' [`FailurePolicy`] or `error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServeFailurePolicy {
    /// Decided by this policy: `open`, `closed` or `local`.
    Decide(FailurePolicy),
    /// `error`: not decided. The request fails (HTTP `503`, gRPC
    /// `UNAVAILABLE`), so that the caller's own failure handling decides,
    /// as Envoy's `failure_mode_deny` does for envoyproxy/ratelimit's
    /// errors.
    Error,
}

impl ServeFailurePolicy {
    /// Whether rules need an in-memory twin to decide on while a
    /// networked store is away.
    pub fn is_local(self) -> bool {
        self == ServeFailurePolicy::Decide(FailurePolicy::Local)
    }
}

impl fmt::Display for ServeFailurePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServeFailurePolicy::Decide(policy) => policy.fmt(f),
            ServeFailurePolicy::Error => f.write_str("error"),
        }
    }
}

impl std::str::FromStr for ServeFailurePolicy {
    type Err = ratewarden_core::ConfigError;

    /// `open`, `closed`, `local` or `error`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "error" {
            return Ok(ServeFailurePolicy::Error);
        }
        s.parse::<FailurePolicy>()
            .map(ServeFailurePolicy::Decide)
            .map_err(|_| ratewarden_core::ConfigError::UnknownName {
                setting: "failure policy",
                name: s.to_owned(),
                choices: "open, closed, local, error",
            })
    }
}

/// Server-wide settings: read once at start; a reload that changes them is
/// logged and they take effect at the next start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSettings {
    /// How the strings of HTTP `{"key": ...}` requests become integer keys.
    /// Descriptor counts always use XXH3-64 (see [`crate::rules`]).
    pub key_hash: KeyHash,
    /// What a failing store's requests get.
    pub failure_policy: ServeFailurePolicy,
    /// The longest one store call may take before it counts as failed.
    pub store_timeout_ms: u64,
    /// The most keys each rule's in-memory store holds.
    pub max_keys: usize,
    /// How often idle keys are forgotten.
    pub housekeeping_interval_ms: u64,
    /// How many keys one housekeeping pass looks at, per rule.
    pub housekeeping_max_scanned: usize,
    /// The most connections each interface (HTTP, gRPC) holds open at once.
    pub max_connections: usize,
    /// The most calls (HTTP/2 streams) one gRPC connection may have open at
    /// once, announced in its HTTP/2 settings.
    pub grpc_max_streams_per_connection: u32,
    /// What every Redis key name starts with, before the rule's hash: two
    /// deployments with different prefixes share one Redis without sharing
    /// a count.
    pub key_prefix: String,
    /// Whether a descriptor's `limit` override is applied (as Envoy's
    /// per-descriptor override is) or ignored, the configured rule
    /// applying: a caller that sends one chooses its own limit.
    pub limit_overrides: bool,
    /// The TLS files of a `rediss://` or `rediss-cluster://` store (the
    /// `[redis]` table).
    pub redis_tls: RedisTlsFiles,
}

/// The `[redis]` table: the files a TLS connection to Redis is made with,
/// as [`ratewarden_redis::RedisOptions`]' fields of the same names. A
/// relative path is taken from the configuration file's directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisTlsFiles {
    /// The CA certificates trusted to sign Redis's certificate, in place of
    /// the system's roots (or of the bundle `SSL_CERT_FILE` names).
    pub tls_ca_file: Option<PathBuf>,
    /// This client's certificate, for a Redis that asks for one.
    pub tls_cert_file: Option<PathBuf>,
    /// The client certificate's private key.
    pub tls_key_file: Option<PathBuf>,
}

/// The fewest keys a shard of a rule's in-memory store is given room for:
/// the core's floor for its automatic sharding, for the same reason.
const MIN_KEYS_PER_SHARD: usize = MemoryOptions::MIN_KEYS_PER_AUTO_SHARD;

impl ServerSettings {
    /// The options of every in-memory store of a rule (the store itself, a
    /// `local` failover twin, an override's): `max_keys`, over enough
    /// shards that a full shard holds about `housekeeping_max_scanned`
    /// keys or fewer. A housekeeping pass looks at whole shards until it
    /// has seen that many keys, and so does a full shard making room for a
    /// new key, each under one shard's lock: the shard's size bounds how
    /// long that lock is held. At least the core's automatic count (four
    /// per core), and no shard below room for 1,024 keys (512 once the core
    /// rounds the count up to a power of two).
    pub fn memory_options(&self) -> MemoryOptions {
        let for_pass = self
            .max_keys
            .div_ceil(self.housekeeping_max_scanned.max(1))
            .min(self.max_keys / MIN_KEYS_PER_SHARD);
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        MemoryOptions {
            max_keys: self.max_keys,
            // More than the automatic count's floor of 16, or automatic.
            shards: if for_pass > 16 {
                // Four per core, as the automatic count, within the floor.
                for_pass
                    .max(cores * 4)
                    .min(self.max_keys / MIN_KEYS_PER_SHARD)
            } else {
                0
            },
        }
    }

    /// The names of the settings that differ between `self` and `other`, as
    /// a configuration file spells them.
    pub fn changed(&self, other: &ServerSettings) -> Vec<&'static str> {
        // Destructured, so that a new setting cannot be left out here.
        let ServerSettings {
            key_hash,
            failure_policy,
            store_timeout_ms,
            max_keys,
            housekeeping_interval_ms,
            housekeeping_max_scanned,
            max_connections,
            grpc_max_streams_per_connection,
            key_prefix,
            limit_overrides,
            redis_tls,
        } = self;
        [
            ("key_hash", *key_hash != other.key_hash),
            ("failure_policy", *failure_policy != other.failure_policy),
            (
                "store_timeout_ms",
                *store_timeout_ms != other.store_timeout_ms,
            ),
            ("max_keys", *max_keys != other.max_keys),
            (
                "housekeeping_interval_ms",
                *housekeeping_interval_ms != other.housekeeping_interval_ms,
            ),
            (
                "housekeeping_max_scanned",
                *housekeeping_max_scanned != other.housekeeping_max_scanned,
            ),
            ("max_connections", *max_connections != other.max_connections),
            (
                "grpc_max_streams_per_connection",
                *grpc_max_streams_per_connection != other.grpc_max_streams_per_connection,
            ),
            ("key_prefix", *key_prefix != other.key_prefix),
            ("limit_overrides", *limit_overrides != other.limit_overrides),
            (
                "redis.tls_ca_file",
                redis_tls.tls_ca_file != other.redis_tls.tls_ca_file,
            ),
            (
                "redis.tls_cert_file",
                redis_tls.tls_cert_file != other.redis_tls.tls_cert_file,
            ),
            (
                "redis.tls_key_file",
                redis_tls.tls_key_file != other.redis_tls.tls_key_file,
            ),
        ]
        .into_iter()
        .filter_map(|(name, differs)| differs.then_some(name))
        .collect()
    }
}

impl Default for ServerSettings {
    fn default() -> Self {
        ServerSettings {
            // 64 bits: the count key is the rule's identity and the key
            // string, never SPEC's mix32(key) itself, so SPEC's default buys
            // no portability here, and 32 bits share budgets by chance at a
            // million users (see docs/serve.md).
            key_hash: KeyHash::Xxh3_64,
            failure_policy: ServeFailurePolicy::Decide(FailurePolicy::FailClosed),
            store_timeout_ms: 100,
            max_keys: MemoryOptions::default().max_keys,
            housekeeping_interval_ms: 1000,
            housekeeping_max_scanned: 65_536,
            // Well below common open-file limits once both interfaces are
            // full, and far above what Envoy (a few connections per proxy)
            // or a fleet of HTTP clients needs.
            max_connections: 10_000,
            // Far above what one Envoy worker's connection has in flight
            // (its requests per second times the call's time, 20 ms at
            // most by default): Envoy sends calls past the server's bound
            // unless its cluster sets `max_concurrent_streams`, and a call
            // refused so is an error to it. Each stream whose answer waits
            // on a client that opens no flow-control window holds about
            // 3 KB until its connection closes (see docs/serve.md).
            grpc_max_streams_per_connection: 1024,
            key_prefix: ratewarden_redis::RedisOptions::default().prefix,
            // As envoyproxy/ratelimit: Envoy's overrides are applied.
            limit_overrides: true,
            redis_tls: RedisTlsFiles::default(),
        }
    }
}

/// One limit: a policy configuration, a display name and the shadow flag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSpec {
    /// The name shown in responses, headers and metrics.
    pub name: String,
    /// The policy and its numbers.
    pub policy: PolicyConfig,
    /// Decide and count, but never refuse.
    pub shadow: bool,
}

/// A node of a domain's descriptor tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorSpec {
    /// The entry key this node matches.
    pub key: String,
    /// The entry value it matches; `None` matches any value, and a value
    /// ending in `*` matches every value starting with what precedes it
    /// (a `*` anywhere else is refused at load).
    pub value: Option<String>,
    /// The limit applied when a descriptor's entries end at this node.
    pub rule: Option<RuleSpec>,
    /// A descriptor ending here is matched but never limited (and the
    /// fallback does not apply to it).
    pub unlimited: bool,
    /// Nodes matching the next entry.
    pub children: Vec<DescriptorSpec>,
}

/// A domain and its descriptor tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainSpec {
    /// The domain name, as Envoy sends it.
    pub domain: String,
    /// The top-level nodes, matching a descriptor's first entry.
    pub descriptors: Vec<DescriptorSpec>,
}

/// A validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Where it was read from, for messages.
    pub source: String,
    /// Server-wide settings.
    pub server: ServerSettings,
    /// The rule for HTTP `{"key": ...}` requests; `None` refuses them as bad
    /// requests.
    pub keys: Option<RuleSpec>,
    /// The rule for any descriptor no configured rule matches, in any
    /// domain; `None` leaves such descriptors, and every descriptor of an
    /// unknown domain, unlimited.
    pub fallback: Option<RuleSpec>,
    /// The configured domains.
    pub domains: Vec<DomainSpec>,
}

impl Config {
    /// The configuration with no file: every key and every descriptor is
    /// limited by the reference configuration (sliding-window-counter, 100
    /// per 1000 ms).
    pub fn reference() -> Self {
        let rule = |name: &str| RuleSpec {
            name: name.to_owned(),
            policy: REFERENCE,
            shadow: false,
        };
        Config {
            source: "<built-in reference>".to_owned(),
            server: ServerSettings::default(),
            keys: Some(rule("keys")),
            fallback: Some(rule("fallback")),
            domains: Vec::new(),
        }
    }

    /// Reads and validates a configuration file.
    pub fn load(path: &Path) -> Result<Self, ConfigFileError> {
        let file = path.display().to_string();
        let whole = |message: String| ConfigFileError {
            file: file.clone(),
            line: None,
            column: None,
            field: String::new(),
            message,
        };
        let meta =
            std::fs::metadata(path).map_err(|e| whole(format!("cannot read the file: {e}")))?;
        if meta.len() > MAX_FILE_BYTES {
            return Err(whole(format!(
                "the file has {} bytes, more than the {MAX_FILE_BYTES} allowed; shorten it \
                 (one descriptor with a key alone, or a value ending in `*`, counts many values \
                 apart)",
                meta.len()
            )));
        }
        // Read through the bound too: a file that grows after the check,
        // or one whose size says nothing (/dev/zero, a pipe, a file under
        // /proc), stops at it instead of filling memory.
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| {
                use std::io::Read;
                f.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes)
            })
            .map_err(|e| whole(format!("cannot read the file: {e}")))?;
        if bytes.len() as u64 > MAX_FILE_BYTES {
            return Err(whole(format!(
                "the file holds more than the {MAX_FILE_BYTES} bytes allowed (its size as read, \
                 past what the file system said: it grew, or is no regular file); give a \
                 regular file of at most that"
            )));
        }
        let text = String::from_utf8(bytes).map_err(|e| {
            // Where the first bad byte is, as the parser's errors say it:
            // the line, and the column in characters, the bad byte counted.
            let bytes = e.as_bytes();
            let at = e.utf8_error().valid_up_to();
            let line_start = bytes[..at]
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1);
            // Everything before `at` is valid UTF-8.
            let column = std::str::from_utf8(&bytes[line_start..at])
                .map_or(1, |before| before.chars().count() + 1);
            ConfigFileError {
                line: Some(bytes[..at].iter().filter(|&&b| b == b'\n').count() + 1),
                column: Some(column),
                ..whole(format!(
                    "cannot read the file: it is not UTF-8 text (the first byte that is not \
                     is here, byte {at} of the file); save it as UTF-8"
                ))
            }
        })?;
        let mut config = Self::parse(&text, &file)?;
        // The `[redis]` files are found from the file's directory, not
        // from wherever the server was started.
        if let Some(dir) = path.parent() {
            let tls = &mut config.server.redis_tls;
            for file in [
                &mut tls.tls_ca_file,
                &mut tls.tls_cert_file,
                &mut tls.tls_key_file,
            ]
            .into_iter()
            .flatten()
            {
                if file.is_relative() {
                    *file = dir.join(&*file);
                }
            }
        }
        Ok(config)
    }

    /// Validates configuration text; `source` names it in errors.
    ///
    /// ```
    /// use ratewarden_server::Config;
    /// let config = Config::parse("[keys]\nlimit = 10\nunit = \"minute\"\n", "inline.toml").unwrap();
    /// assert_eq!(config.keys.unwrap().policy.window_ms, 60_000);
    ///
    /// let err = Config::parse("[keys]\nlimit = 10\nunit = \"fortnight\"\n", "inline.toml").unwrap_err();
    /// assert_eq!(err.line, Some(3));
    /// assert!(err.to_string().starts_with("inline.toml:3:8: keys.unit: unknown unit \"fortnight\""));
    /// ```
    pub fn parse(text: &str, source: &str) -> Result<Self, ConfigFileError> {
        let lines = LineIndex::new(text);
        let raw: RawConfig = toml::from_str(text).map_err(|e| {
            let missing = missing_field(e.message());
            let field = e
                .span()
                .map(|span| match missing {
                    // The span is the table that lacks it.
                    Some(name) => missing_field_path(text, span.start, name),
                    None => field_at(text, span.start),
                })
                .unwrap_or_default();
            // A header of the wrong shape (a single table written as a
            // list, a setting written as a table) gets messages in the
            // parser's own types; and one the parser calls a duplicate key
            // names no field: say which header it repeats or contradicts.
            let header = e
                .span()
                .and_then(|s| misshapen_header(text, s.start))
                .or_else(|| {
                    (e.message().trim() == "duplicate key")
                        .then(|| e.span().and_then(|s| duplicate_header(text, s.start)))
                        .flatten()
                })
                .or_else(|| {
                    e.message()
                        .contains("expected a sequence")
                        .then(|| {
                            e.span()
                                .and_then(|s| element_before_its_list(text, s.start))
                        })
                        .flatten()
                });
            let (field, mut message) = match (header, missing) {
                (Some((table, advice)), _) => (table, advice),
                (None, Some(name)) => (field, missing_field_advice(name)),
                (None, None) => (field, plain_message(e.message().trim())),
            };
            if looks_like_yaml(text) {
                message.push_str(
                    "; the file looks like YAML, but the configuration is TOML \
                     (see examples/ratewarden.toml, and docs/serve.md for \
                     envoyproxy/ratelimit's fields)",
                );
            }
            lines.error(source, e.span(), field, message)
        })?;
        let mut v = Validator {
            source,
            lines: &lines,
            nodes: 0,
            names: HashMap::new(),
        };
        v.config(raw)
    }
}

/// The parser's message in the file's terms: its Rust type names mean
/// nothing to someone writing TOML, and a table written with single
/// brackets where a list of tables belongs needs the fix said.
fn plain_message(message: &str) -> String {
    // An integer past i64 reaches serde as an i128, which the message
    // would name instead of saying that the number is too large.
    // One just past it (2^63) reaches serde as a u64, refused as a value.
    if let Some(number) = message
        .strip_prefix("invalid type: integer `")
        .and_then(|rest| rest.split_once("` as i128"))
        .or_else(|| {
            message
                .strip_prefix("invalid value: integer `")
                .and_then(|rest| rest.split_once("`, expected i64"))
        })
        .map(|(number, _)| number)
    {
        let what = if number.starts_with('-') {
            "is negative"
        } else {
            "is too large"
        };
        return format!(
            "{number} {what}; use a whole number from 0 to {MAX_SAFE} (some settings \
             allow less)"
        );
    }
    // The parser's own depth bounds, for tables named by very long dotted
    // keys (its message then has no position) and for nested values.
    if message.contains("recursion limit") || message.contains("cannot recurse further") {
        return format!(
            "{message}: the file nests too deeply for the parser; descriptors nest at most \
             {MAX_DEPTH} levels (flatten them), and no setting takes a nested list or table"
        );
    }
    let mut message = message.replace("expected i64", "expected a whole number");
    // The parser's names for the file's tables.
    for raw in [
        "RawConfig",
        "RawServer",
        "RawRedis",
        "RawRule",
        "RawDomain",
        "RawDescriptor",
    ] {
        message = message.replace(&format!("expected struct {raw}"), "expected a table");
    }
    if message.contains("invalid type: map, expected a sequence") {
        return format!(
            "{message}; domains and descriptors are lists of tables: write [[domains]] and \
             [[domains.descriptors]], with double brackets"
        );
    }
    // envoyproxy/ratelimit's names, met by anyone porting its YAML.
    for (field, hint) in [
        (
            "shadow_mode",
            "the setting here is shadow = true, on the descriptor",
        ),
        (
            "rate_limit",
            "limits sit on the descriptor itself: limit = N and unit = \"minute\" (or \
             window_ms) in place of rate_limit's requests_per_unit and unit",
        ),
        ("requests_per_unit", "the setting here is limit = N"),
        (
            "replaces",
            "replaces is not supported: every matched rule is decided, and a request is \
             refused when any is over its limit",
        ),
        (
            "detailed_metric",
            "detailed_metric is not supported: metrics are per rule name, never per value",
        ),
        (
            "value_to_metric",
            "value_to_metric is not supported: metrics are per rule name, never per request \
             value (a descriptor with its own value = \"...\" is a rule of its own, with its \
             own metrics)",
        ),
        (
            "quota_mode",
            "quota_mode is not supported: there are no soft limits, and a request is refused \
             when any matched rule is over its limit; shadow = true decides and counts a rule \
             without ever refusing",
        ),
        (
            "share_threshold",
            "share_threshold is not supported: each value a wildcard matches has its own \
             count; for one count shared by all of them, have Envoy send a constant value \
             (a generic_key action on the routes concerned) and match it with a key-only \
             descriptor",
        ),
        (
            "metadata",
            "metadata is not supported: answers never carry dynamic_metadata, where \
             envoyproxy/ratelimit puts it (with RESPONSE_DYNAMIC_METADATA); remove it",
        ),
    ] {
        if message.starts_with(&format!("unknown field `{field}`")) {
            return format!("{message}; {hint}");
        }
    }
    // A known setting in the wrong table: say which table takes it.
    if let Some(field) = message
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split_once('`'))
        .map(|(field, _)| field)
    {
        if let Some(home) = Home::of(field) {
            return format!("{message}; {field} is a setting of {home}");
        }
    }
    if message == "duplicate key" {
        return "written twice (a setting, or a [table] header); keep one, or for a list \
                of tables write [[double brackets]]"
            .to_owned();
    }
    message
}

/// The tables that are one table each, never a list.
const SINGLE_TABLES: [&str; 4] = ["server", "redis", "keys", "fallback"];

/// Where a setting is written, for the messages of one written elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Home {
    Server,
    Redis,
    /// A rule's: `[keys]`, `[fallback]` or a descriptor.
    Rule,
    Descriptor,
    Domain,
}

impl Home {
    /// The home of `setting`; `None` for a name that is no setting.
    fn of(setting: &str) -> Option<Home> {
        Some(match setting {
            "key_hash"
            | "failure_policy"
            | "store_timeout_ms"
            | "max_keys"
            | "housekeeping_interval_ms"
            | "housekeeping_max_scanned"
            | "max_connections"
            | "grpc_max_streams_per_connection"
            | "key_prefix"
            | "limit_overrides" => Home::Server,
            "tls_ca_file" | "tls_cert_file" | "tls_key_file" => Home::Redis,
            "name" | "policy" | "limit" | "window_ms" | "unit" | "burst" | "shadow" => Home::Rule,
            "key" | "value" | "unlimited" => Home::Descriptor,
            "domain" => Home::Domain,
            _ => return None,
        })
    }

    /// Whether the table a header names (`keys`, `domains.descriptors`)
    /// is this home.
    fn is(self, table: &str) -> bool {
        let descriptor = table
            .strip_prefix("domains.descriptors")
            .is_some_and(|rest| rest.split(".descriptors").all(str::is_empty));
        match self {
            Home::Server => table == "server",
            Home::Redis => table == "redis",
            Home::Rule => table == "keys" || table == "fallback" || descriptor,
            Home::Descriptor => descriptor,
            Home::Domain => table == "domains",
        }
    }
}

impl fmt::Display for Home {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Home::Server => "[server]",
            Home::Redis => "[redis]",
            Home::Rule => "[keys], [fallback] or a descriptor",
            Home::Descriptor => "a descriptor",
            Home::Domain => "[[domains]]",
        })
    }
}

/// The table and the advice for a header at `offset` of a shape its table
/// does not take, whatever the parser's message (it speaks of maps,
/// strings and sequences): a single table written as a list, `[[keys]]`
/// (or as `[keys]` after a `[[keys]]`), or a setting written as a table,
/// `[keys.limit]` or `[[domains.descriptors.limit]]`. `None` for any other
/// line.
fn misshapen_header(text: &str, offset: usize) -> Option<(String, String)> {
    let offset = offset.min(text.len());
    let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let (name, list) = header(text[line_start..].lines().next()?)?;
    if SINGLE_TABLES.contains(&name) {
        let listed = || {
            text[..line_start]
                .lines()
                .position(|line| header(line) == Some((name, true)))
        };
        let advice = if list {
            format!("[{name}] is one table, not a list: write [{name}], with single brackets, once")
        } else {
            let at = listed()? + 1;
            format!(
                "line {at} writes [[{name}]], but [{name}] is one table, not a list: write \
                 [{name}] there, with single brackets, once"
            )
        };
        return Some((name.to_owned(), advice));
    }
    let (table, setting) = name.rsplit_once('.')?;
    let setting = setting.trim();
    let home = Home::of(setting)?;
    // TOML allows space around a dotted key's dots.
    let table = table
        .split('.')
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(".");
    let table = table.as_str();
    let advice = if !home.is(table) {
        format!("{setting} is a setting of {home}, not a table: write {setting} = VALUE there")
    } else if SINGLE_TABLES.contains(&table) {
        format!("{setting} is a setting, not a table: write {setting} = VALUE under [{table}]")
    } else {
        format!(
            "{setting} is a setting, not a table: write {setting} = VALUE under the \
             [[{table}]] it belongs to"
        )
    };
    Some((name.to_owned(), advice))
}

/// The table and the advice for a header at `offset` that the parser
/// refuses as a duplicate key, when an earlier header explains it: the
/// same `[table]` opened twice, a table opened both as `[name]` and as
/// `[[name]]`, or a `[[name.sub]]` element written before any `[[name]]`
/// (which makes `name` a table, not a list). `None` when it is none of
/// these, for the parser's own message.
fn duplicate_header(text: &str, offset: usize) -> Option<(String, String)> {
    let offset = offset.min(text.len());
    let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let (name, list) = header(text[line_start..].lines().next()?)?;
    // The 1-based line of the earlier header that `found` accepts nearest
    // to this one, or with `first`, the first.
    let earlier = |found: &dyn Fn(&str, bool) -> bool, first: bool| {
        let mut lines = text[..line_start]
            .lines()
            .enumerate()
            .filter_map(|(i, line)| header(line).filter(|&(n, l)| found(n, l)).map(|_| i + 1));
        if first {
            lines.next()
        } else {
            lines.last()
        }
    };
    let nested = format!("{name}.");
    let advice = if let Some(at) = earlier(&|n, l| n == name && !l, false) {
        if list {
            format!(
                "[[{name}]] is a list of tables, but line {at} opens it as one table, \
                 [{name}]; write [[{name}]] there too"
            )
        } else {
            format!(
                "[{name}] is written twice (also at line {at}); merge the two into one \
                 [{name}] table"
            )
        }
    } else if let Some(at) = earlier(&|n, l| n == name && l, false) {
        format!(
            "line {at} makes {name} a list of tables, [[{name}]]; write [[{name}]] here \
             too, for one more element"
        )
    } else if let Some(at) = list
        .then(|| earlier(&|n, _| n.starts_with(&nested), true))
        .flatten()
    {
        let child = match header(text.lines().nth(at - 1)?)? {
            (child, true) => format!("[[{child}]]"),
            (child, false) => format!("[{child}]"),
        };
        format!(
            "line {at}, {child}, comes before any [[{name}]], which makes {name} one \
             table rather than a list; move it below the [[{name}]] it belongs to"
        )
    } else {
        return None;
    };
    Some((name.to_owned(), advice))
}

/// The table and the advice for a list's element at `offset`
/// (`[[domains.descriptors]]`) written where no element of the list
/// holding it was opened before (no `[[domains]]`): that makes the holder
/// one table, which the parser then calls a map where a sequence belongs,
/// and no bracket is wrong. `None` for any other header.
fn element_before_its_list(text: &str, offset: usize) -> Option<(String, String)> {
    let offset = offset.min(text.len());
    let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let (name, true) = header(text[line_start..].lines().next()?)? else {
        return None;
    };
    let (holder, _) = name.rsplit_once('.')?;
    let holder = holder
        .split('.')
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(".");
    if text[..line_start]
        .lines()
        .any(|line| header(line).is_some_and(|(n, _)| n == holder))
    {
        return None;
    }
    let line = text[..line_start].lines().count() + 1;
    let advice = format!(
        "line {line}, [[{name}]], comes before any [[{holder}]], which makes {holder} one \
         table rather than a list; open the element it belongs to with [[{holder}]] above it"
    );
    Some((holder, advice))
}

/// The table a header line opens, and whether it is an element of a list
/// of tables (`[[name]]`) rather than a table (`[name]`).
fn header(line: &str) -> Option<(&str, bool)> {
    let line = line.trim();
    if let Some(rest) = line.strip_prefix("[[") {
        return Some((rest.split_once("]]")?.0.trim(), true));
    }
    Some((line.strip_prefix('[')?.split_once(']')?.0.trim(), false))
}

/// The field a table lacks, from the parser's "missing field `NAME`".
fn missing_field(message: &str) -> Option<&str> {
    message
        .trim()
        .strip_prefix("missing field `")?
        .strip_suffix('`')
}

/// The dotted name of the field `name` that the table at `offset` lacks:
/// `domains[0].descriptors[1].key`.
fn missing_field_path(text: &str, offset: usize, name: &str) -> String {
    let offset = offset.min(text.len());
    let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
    // An inline table (`descriptors = [{ ... }]`) lacks it, not the table
    // whose header is above: the setting holding it is named, without an
    // index the parser does not give.
    if !text[line_start..].trim_start().starts_with('[') {
        let holder = field_at(text, offset);
        if !holder.is_empty() {
            return format!("{holder}[...].{name}");
        }
    }
    match table_at(&text[..line_end]) {
        Some(t) if !t.is_empty() => format!("{t}.{name}"),
        _ => name.to_owned(),
    }
}

/// What to add for a required field that is missing.
fn missing_field_advice(name: &str) -> String {
    let add = match name {
        "key" => "add key = \"NAME\", the descriptor entry's key this rule matches",
        "domain" => {
            "add domain = \"NAME\", the domain these descriptors belong to (Envoy's \
                     domain)"
        }
        _ => "add it",
    };
    format!("missing: this table needs {name}; {add}")
}

/// Whether the first setting of a file that TOML refused is written
/// `key: value`, as in envoyproxy/ratelimit's YAML files.
fn looks_like_yaml(text: &str) -> bool {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#') && l != &"---")
        .is_some_and(|l| {
            let l = l.strip_prefix("- ").unwrap_or(l);
            l.split_once(':').is_some_and(|(key, _)| {
                !key.is_empty()
                    && !key.contains('=')
                    && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            })
        })
}

/// The dotted name of the `key = value` line holding `offset`, under the
/// nearest table header above it, with the index of each list of tables
/// as validation errors give it (`keys.limit`,
/// `domains[0].descriptors[2].window_ms`); empty when the line is not
/// one. The parser's own messages name the type problem; this names the
/// field.
fn field_at(text: &str, offset: usize) -> String {
    let offset = offset.min(text.len());
    let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line = text[line_start..].lines().next().unwrap_or("");
    if line.trim_start().starts_with('[') {
        // A header: the table it opens (`[keys.extra]` is `keys.extra`).
        let line_end = line_start + line.len();
        return table_at(&text[..line_end]).unwrap_or_default();
    }
    let Some((key, _)) = line.split_once('=') else {
        return String::new();
    };
    // A dotted key (`keys.limit = 5` under `[keys]`) names a field of
    // nested tables: `keys.keys.limit`.
    let key: String = key.split('.').map(str::trim).collect::<Vec<_>>().join(".");
    if key.split('.').any(|part| {
        part.is_empty()
            || !part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    }) {
        return String::new();
    }
    match table_at(&text[..line_start]) {
        Some(t) if !t.is_empty() => format!("{t}.{key}"),
        _ => key.to_owned(),
    }
}

/// The table that the last header in `text` opens, each list of tables
/// (`[[domains]]`, `[[domains.descriptors]]`) with its index within its
/// parent: `domains[1].descriptors[0]`. A header opens a new element of
/// its list, and the lists nested under that path start counting again.
fn table_at(text: &str) -> Option<String> {
    // The number of elements of each list of tables seen so far, within
    // the current element of its parent.
    let mut counts: HashMap<String, usize> = HashMap::new();
    let mut last: Option<String> = None;
    for line in text.lines().map(str::trim) {
        if let Some(path) = line
            .strip_prefix("[[")
            .and_then(|l| l.split_once("]]"))
            .map(|(p, _)| p.trim())
        {
            let nested = format!("{path}.");
            counts.retain(|p, _| !p.starts_with(&nested));
            *counts.entry(path.to_owned()).or_default() += 1;
            last = Some(path.to_owned());
        } else if let Some(path) = line
            .strip_prefix('[')
            .and_then(|l| l.split_once(']'))
            .map(|(p, _)| p.trim())
        {
            last = Some(path.to_owned());
        }
    }
    let last = last?;
    let mut out = String::new();
    let mut prefix = String::new();
    for part in last.split('.') {
        if !prefix.is_empty() {
            prefix.push('.');
            out.push('.');
        }
        prefix.push_str(part);
        out.push_str(part);
        if let Some(n) = counts.get(&prefix) {
            out.push_str(&format!("[{}]", n - 1));
        }
    }
    Some(out)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    server: Option<RawServer>,
    redis: Option<RawRedis>,
    keys: Option<Spanned<RawRule>>,
    fallback: Option<Spanned<RawRule>>,
    #[serde(default)]
    domains: Vec<Spanned<RawDomain>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    key_hash: Option<Spanned<String>>,
    failure_policy: Option<Spanned<String>>,
    store_timeout_ms: Option<Spanned<i64>>,
    max_keys: Option<Spanned<i64>>,
    housekeeping_interval_ms: Option<Spanned<i64>>,
    housekeeping_max_scanned: Option<Spanned<i64>>,
    max_connections: Option<Spanned<i64>>,
    grpc_max_streams_per_connection: Option<Spanned<i64>>,
    key_prefix: Option<Spanned<String>>,
    limit_overrides: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRedis {
    tls_ca_file: Option<Spanned<String>>,
    tls_cert_file: Option<Spanned<String>>,
    tls_key_file: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Option<Spanned<String>>,
    policy: Option<Spanned<String>>,
    limit: Option<Spanned<i64>>,
    window_ms: Option<Spanned<i64>>,
    unit: Option<Spanned<String>>,
    burst: Option<Spanned<i64>>,
    shadow: Option<Spanned<bool>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDomain {
    domain: Spanned<String>,
    #[serde(default)]
    descriptors: Vec<Spanned<RawDescriptor>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptor {
    key: Spanned<String>,
    value: Option<Spanned<String>>,
    #[serde(default)]
    descriptors: Vec<Spanned<RawDescriptor>>,
    // The rule's fields sit on the node itself, as in a flattened table;
    // serde's `flatten` would lose the spans, so they are repeated here.
    name: Option<Spanned<String>>,
    policy: Option<Spanned<String>>,
    limit: Option<Spanned<i64>>,
    window_ms: Option<Spanned<i64>>,
    unit: Option<Spanned<String>>,
    burst: Option<Spanned<i64>>,
    shadow: Option<Spanned<bool>>,
    unlimited: Option<Spanned<bool>>,
}

impl RawDescriptor {
    fn take_rule(&mut self) -> Option<RawRule> {
        let any = self.name.is_some()
            || self.policy.is_some()
            || self.limit.is_some()
            || self.window_ms.is_some()
            || self.unit.is_some()
            || self.burst.is_some()
            || self.shadow.is_some();
        any.then(|| RawRule {
            name: self.name.take(),
            policy: self.policy.take(),
            limit: self.limit.take(),
            window_ms: self.window_ms.take(),
            unit: self.unit.take(),
            burst: self.burst.take(),
            shadow: self.shadow.take(),
        })
    }
}

/// Byte offsets to 1-based lines and columns.
struct LineIndex {
    starts: Vec<usize>,
}

impl LineIndex {
    fn new(text: &str) -> Self {
        let mut starts = vec![0];
        starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        LineIndex { starts }
    }

    fn position(&self, offset: usize) -> (usize, usize) {
        let line = self.starts.partition_point(|&s| s <= offset).max(1);
        (line, offset - self.starts[line - 1] + 1)
    }

    fn error(
        &self,
        source: &str,
        span: Option<Range<usize>>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> ConfigFileError {
        let position = span.map(|s| self.position(s.start));
        ConfigFileError {
            file: source.to_owned(),
            line: position.map(|p| p.0),
            column: position.map(|p| p.1),
            field: field.into(),
            message: message.into(),
        }
    }
}

struct Validator<'a> {
    source: &'a str,
    lines: &'a LineIndex,
    nodes: usize,
    /// Every rule's name so far, with the field that gave it: names label
    /// metrics and headers, so two rules may not share one.
    names: HashMap<String, String>,
}

impl Validator<'_> {
    fn err(&self, span: Range<usize>, field: &str, message: impl Into<String>) -> ConfigFileError {
        self.lines.error(self.source, Some(span), field, message)
    }

    fn config(&mut self, raw: RawConfig) -> Result<Config, ConfigFileError> {
        let mut server = match raw.server {
            Some(s) => self.server(s)?,
            None => ServerSettings::default(),
        };
        if let Some(redis) = raw.redis {
            server.redis_tls = self.redis(redis)?;
        }
        let keys = raw.keys.map(|r| self.rule(r, "keys", "keys")).transpose()?;
        let fallback = raw
            .fallback
            .map(|r| self.rule(r, "fallback", "fallback"))
            .transpose()?;
        let mut domains: Vec<DomainSpec> = Vec::with_capacity(raw.domains.len());
        // Each domain's index and where its table starts, to name the first
        // of two with one name.
        let mut seen: HashMap<String, (usize, usize)> = HashMap::with_capacity(raw.domains.len());
        for (i, raw_domain) in raw.domains.into_iter().enumerate() {
            let field = format!("domains[{i}]");
            let span = raw_domain.span();
            let raw_domain = raw_domain.into_inner();
            let name_span = raw_domain.domain.span();
            let name = raw_domain.domain.into_inner();
            if name.is_empty() {
                return Err(self.err(
                    name_span,
                    &format!("{field}.domain"),
                    "the domain is empty; name it",
                ));
            }
            if let Some(&(first, at)) = seen.get(&name) {
                let (line, _) = self.lines.position(at);
                return Err(self.err(
                    span,
                    &format!("{field}.domain"),
                    format!(
                        "domain {name:?} is configured twice (first as domains[{first}], at \
                         line {line}); merge the two into one"
                    ),
                ));
            }
            seen.insert(name.clone(), (i, span.start));
            if raw_domain.descriptors.is_empty() {
                // A domain with no descriptors limits nothing: most likely a
                // file cut short after its header while being rewritten.
                return Err(self.err(
                    span,
                    &format!("{field}.descriptors"),
                    format!(
                        "domain {name:?} has no descriptors, so it would limit nothing; add \
                         [[domains.descriptors]] with a key and a limit, or remove the domain"
                    ),
                ));
            }
            let descriptors = self.descriptors(raw_domain.descriptors, &field, &name, 1)?;
            domains.push(DomainSpec {
                domain: name,
                descriptors,
            });
        }
        if keys.is_none() && fallback.is_none() && domains.is_empty() {
            // Most likely a file caught empty while being written: serving
            // it would answer every request with a 400.
            return Err(self.lines.error(
                self.source,
                None,
                "",
                "the configuration has no rules; add [keys], [fallback] or [[domains]] \
                 (see examples/ratewarden.toml)",
            ));
        }
        Ok(Config {
            source: self.source.to_owned(),
            server,
            keys,
            fallback,
            domains,
        })
    }

    fn server(&mut self, raw: RawServer) -> Result<ServerSettings, ConfigFileError> {
        let mut s = ServerSettings::default();
        if let Some(v) = raw.key_hash {
            s.key_hash = v
                .get_ref()
                .parse::<KeyHash>()
                .map_err(|e| self.err(v.span(), "server.key_hash", e.to_string()))?;
        }
        if let Some(v) = raw.failure_policy {
            s.failure_policy = v
                .get_ref()
                .parse::<ServeFailurePolicy>()
                .map_err(|e| self.err(v.span(), "server.failure_policy", e.to_string()))?;
        }
        if let Some(v) = raw.store_timeout_ms {
            // A gRPC call has 10 s in all, and a stop waits 30 s for the
            // requests in flight: a longer store call could only be cut.
            s.store_timeout_ms = self.positive(&v, "server.store_timeout_ms", 10_000)?;
        }
        if let Some(v) = raw.max_keys {
            s.max_keys = self.positive(&v, "server.max_keys", 1 << 32)? as usize;
        }
        if let Some(v) = raw.housekeeping_interval_ms {
            s.housekeeping_interval_ms =
                self.positive(&v, "server.housekeeping_interval_ms", 86_400_000)?;
        }
        if let Some(v) = raw.housekeeping_max_scanned {
            s.housekeeping_max_scanned =
                self.positive(&v, "server.housekeeping_max_scanned", 1 << 32)? as usize;
        }
        if let Some(v) = raw.max_connections {
            s.max_connections = self.positive(&v, "server.max_connections", 1 << 20)? as usize;
        }
        if let Some(v) = raw.grpc_max_streams_per_connection {
            s.grpc_max_streams_per_connection =
                self.positive(&v, "server.grpc_max_streams_per_connection", 100_000)? as u32;
        }
        if let Some(v) = raw.key_prefix {
            let prefix = v.get_ref();
            // Printable ASCII without spaces: it shows as typed in
            // redis-cli and in a shell (SCAN patterns still need `*?[]\`
            // escaped, as any pattern does).
            if prefix.is_empty()
                || prefix.len() > 64
                || !prefix.bytes().all(|b| b.is_ascii_graphic())
            {
                return Err(self.err(
                    v.span(),
                    "server.key_prefix",
                    format!(
                        "{prefix:?} is not a key prefix; use 1 to 64 printable ASCII characters \
                         without spaces, such as \"ratewarden-staging\""
                    ),
                ));
            }
            s.key_prefix = prefix.clone();
        }
        if let Some(v) = raw.limit_overrides {
            s.limit_overrides = v;
        }
        Ok(s)
    }

    /// The `[redis]` table. The files are read when the store connects
    /// (at start), which refuses one it cannot use, naming it.
    fn redis(&self, raw: RawRedis) -> Result<RedisTlsFiles, ConfigFileError> {
        let path = |v: Option<Spanned<String>>, field: &str| match v {
            Some(v) if v.get_ref().trim().is_empty() => Err(self.err(
                v.span(),
                field,
                "an empty path; name a PEM file, or leave the field out",
            )),
            Some(v) => Ok(Some(PathBuf::from(v.into_inner()))),
            None => Ok(None),
        };
        Ok(RedisTlsFiles {
            tls_ca_file: path(raw.tls_ca_file, "redis.tls_ca_file")?,
            tls_cert_file: path(raw.tls_cert_file, "redis.tls_cert_file")?,
            tls_key_file: path(raw.tls_key_file, "redis.tls_key_file")?,
        })
    }

    fn positive(&self, v: &Spanned<i64>, field: &str, max: u64) -> Result<u64, ConfigFileError> {
        let n = *v.get_ref();
        if n < 1 || n as u64 > max {
            return Err(self.err(
                v.span(),
                field,
                format!("{n} is out of range; use a whole number from 1 to {max}"),
            ));
        }
        Ok(n as u64)
    }

    /// A number of a rule, `0 ..= 2^53 - 1`; the message names `least`, the
    /// smallest the field takes (a window of 0 is refused after this, with
    /// its own message).
    fn number(&self, v: &Spanned<i64>, field: &str, least: u64) -> Result<u64, ConfigFileError> {
        let n = *v.get_ref();
        if n < 0 || n as u64 > MAX_SAFE {
            return Err(self.err(
                v.span(),
                field,
                format!(
                    "{n} is out of range; use a whole number from {least} to {MAX_SAFE} \
                     (2^53 - 1)"
                ),
            ));
        }
        Ok(n as u64)
    }

    fn rule(
        &mut self,
        raw: Spanned<RawRule>,
        field: &str,
        default_name: &str,
    ) -> Result<RuleSpec, ConfigFileError> {
        let span = raw.span();
        self.rule_fields(raw.into_inner(), span, field, default_name)
    }

    fn rule_fields(
        &mut self,
        raw: RawRule,
        span: Range<usize>,
        field: &str,
        default_name: &str,
    ) -> Result<RuleSpec, ConfigFileError> {
        let f = |name: &str| format!("{field}.{name}");
        // Errors about the name point at it when it is written, else at
        // the rule whose default it is.
        let (name, name_span) = match raw.name {
            Some(n) if n.get_ref().is_empty() => {
                return Err(self.err(
                    n.span(),
                    &f("name"),
                    "the name is empty; remove it or name the rule",
                ))
            }
            Some(n) => (n.get_ref().clone(), n.span()),
            None => (default_name.to_owned(), span.clone()),
        };
        if name.ends_with(".override") {
            return Err(self.err(
                name_span,
                &f("name"),
                format!(
                    "the rule's name {name:?} ends in \".override\", which names the limits that \
                     Envoy's per-descriptor overrides make; choose another name"
                ),
            ));
        }
        if let Some(other) = self.names.get(&name) {
            return Err(self.err(
                name_span,
                &f("name"),
                format!(
                    "the rule's name {name:?} is already the name of {other}; every rule needs a \
                     name of its own (it labels the rule's metrics and headers): set name = \"...\" \
                     on one of them"
                ),
            ));
        }
        self.names.insert(name.clone(), field.to_owned());
        let kind = match raw.policy {
            Some(p) => p
                .get_ref()
                .parse::<PolicyKind>()
                .map_err(|e| self.err(p.span(), &f("policy"), e.to_string()))?,
            None => REFERENCE.policy,
        };
        let Some(limit) = raw.limit else {
            return Err(self.err(
                span,
                &f("limit"),
                "the rule has no limit; add limit = <permits per window>",
            ));
        };
        let limit = self.number(&limit, &f("limit"), 0)?;
        let window_ms = match (raw.window_ms, raw.unit) {
            (Some(w), None) => {
                // Below 1 (0 or negative) gets the window's own message,
                // rather than the general one's "from 0".
                if *w.get_ref() < 1 {
                    return Err(self.err(w.span(), &f("window_ms"), format!("{} is not a window: a window must last at least 1 ms; set window_ms to 1 or more", w.get_ref())));
                }
                self.number(&w, &f("window_ms"), 1)?
            }
            (None, Some(u)) => unit_ms(u.get_ref()).map_err(|m| self.err(u.span(), &f("unit"), m))?,
            (Some(w), Some(_)) => {
                return Err(self.err(w.span(), &f("window_ms"), "both window_ms and unit are given; keep one"))
            }
            (None, None) => {
                return Err(self.err(
                    span,
                    &f("window_ms"),
                    "the rule has no window; add window_ms = <ms> or unit = \"second\" (or minute, hour, day, week, month, year)",
                ))
            }
        };
        let mut policy = PolicyConfig::new(kind, limit, window_ms);
        if let Some(b) = raw.burst {
            policy = policy.with_burst(self.number(&b, &f("burst"), 0)?);
            if !kind.has_burst() {
                return Err(self.err(
                    b.span(),
                    &f("burst"),
                    format!("{kind} has no bucket; remove burst, or use token-bucket or gcra"),
                ));
            }
        }
        policy
            .build()
            .map_err(|e| self.err(span.clone(), field, e.to_string()))?;
        let shadow = raw.shadow.is_some_and(|s| s.into_inner());
        Ok(RuleSpec {
            name,
            policy,
            shadow,
        })
    }

    fn descriptors(
        &mut self,
        raw: Vec<Spanned<RawDescriptor>>,
        parent_field: &str,
        parent_name: &str,
        depth: usize,
    ) -> Result<Vec<DescriptorSpec>, ConfigFileError> {
        let mut out: Vec<DescriptorSpec> = Vec::with_capacity(raw.len());
        // The (key, value) pairs seen at this level: a set, since a level
        // may hold up to MAX_RULE_NODES nodes, and comparing each with all
        // before it took a minute at that size.
        // Each pair's index, and where its table starts, to name the first
        // of two.
        let mut seen: HashMap<(String, Option<String>), (usize, usize)> =
            HashMap::with_capacity(raw.len());
        for (i, node) in raw.into_iter().enumerate() {
            let field = format!("{parent_field}.descriptors[{i}]");
            let span = node.span();
            if depth > MAX_DEPTH {
                return Err(self.err(
                    span,
                    &field,
                    format!("descriptors nest deeper than {MAX_DEPTH} levels; flatten them"),
                ));
            }
            self.nodes += 1;
            if self.nodes > MAX_RULE_NODES {
                return Err(self.err(
                    span,
                    &field,
                    format!(
                        "more than {MAX_RULE_NODES} descriptors; use fewer (one descriptor with \
                         a key alone, or a value ending in `*`, counts many values apart)"
                    ),
                ));
            }
            let mut node = node.into_inner();
            let key_span = node.key.span();
            let key = node.key.get_ref().clone();
            if key.is_empty() {
                return Err(self.err(
                    key_span,
                    &format!("{field}.key"),
                    "the key is empty; every descriptor entry has a key",
                ));
            }
            // An empty value means any value, as envoyproxy/ratelimit reads it.
            let value = node.value.take().filter(|v| !v.get_ref().is_empty());
            if let Some(v) = &value {
                if let Some(message) = inner_star(v.get_ref()) {
                    return Err(self.err(v.span(), &format!("{field}.value"), message));
                }
            }
            let value = value.map(Spanned::into_inner);
            if let Some(&(first, at)) = seen.get(&(key.clone(), value.clone())) {
                let what = match &value {
                    Some(v) => format!("key {key:?} with value {v:?}"),
                    None => format!("key {key:?} with any value"),
                };
                let (line, _) = self.lines.position(at);
                return Err(self.err(
                    span,
                    &field,
                    format!(
                        "{what} appears twice at this level (first as \
                         {parent_field}.descriptors[{first}], at line {line}); merge the two"
                    ),
                ));
            }
            seen.insert((key.clone(), value.clone()), (i, span.start));
            // `*` matches every value, the empty one too, before a node of
            // the key alone is looked at: that node would never be reached.
            let star = Some("*".to_owned());
            let shadowed = match &value {
                None => seen.get(&(key.clone(), star)),
                Some(v) if *v == "*" => seen.get(&(key.clone(), None)),
                Some(_) => None,
            };
            if let Some(&(other, at)) = shadowed {
                let (line, _) = self.lines.position(at);
                return Err(self.err(
                    span,
                    &field,
                    format!(
                        "key {key:?} has a node with value \"*\" and a node with any value at \
                         this level (the other is {parent_field}.descriptors[{other}], at line \
                         {line}): \"*\" matches every value first, so the other is never \
                         reached; keep one (both count each value on its own)"
                    ),
                ));
            }
            let path = match &value {
                Some(v) => format!("{parent_name}.{key}_{v}"),
                None => format!("{parent_name}.{key}"),
            };
            let unlimited = node.unlimited.take();
            let rule = match (node.take_rule(), &unlimited) {
                (Some(_), Some(u)) if *u.get_ref() => return Err(self.err(
                    u.span(),
                    &format!("{field}.unlimited"),
                    "unlimited = true and limit fields (limit, window_ms, unit, policy, burst, \
                         shadow, name) on one descriptor; keep unlimited or the limit, not both",
                )),
                (Some(r), _) => Some(self.rule_fields(r, span.clone(), &field, &path)?),
                (None, _) => None,
            };
            let unlimited = unlimited.is_some_and(|u| u.into_inner());
            let children_raw = std::mem::take(&mut node.descriptors);
            if rule.is_none() && !unlimited && children_raw.is_empty() {
                return Err(self.err(
                    span,
                    &field,
                    "the descriptor has neither a limit nor nested descriptors; add limit and window_ms (or unlimited = true), or remove it",
                ));
            }
            let children = self.descriptors(children_raw, &field, &path, depth + 1)?;
            out.push(DescriptorSpec {
                key,
                value,
                rule,
                unlimited,
                children,
            });
        }
        Ok(out)
    }
}

/// What to write instead of a descriptor value with a `*` before its last
/// character; `None` for any other value. Only a trailing `*` is a
/// wildcard here. A `*` elsewhere would be matched literally, where
/// envoyproxy/ratelimit (since envoyproxy/ratelimit#1085) reads every `*`
/// as a glob, so a ported `"/api/*/users"` would silently limit none of
/// the values it limited there.
fn inner_star(value: &str) -> Option<String> {
    let star = value.find('*')?;
    if star + 1 == value.len() {
        return None;
    }
    let prefix = &value[..star];
    let example = if prefix.is_empty() {
        "\"*\" matches every value".to_owned()
    } else {
        format!("\"{prefix}*\" matches every value starting with {prefix:?}")
    };
    Some(format!(
        "{value:?} has a * before its end; only a trailing * is a wildcard here, a prefix \
         match ({example}); envoyproxy/ratelimit's glob, a * in the middle, is not \
         supported, and a * anywhere but at the end cannot be written, even to be matched \
         literally"
    ))
}

/// The length of a named unit, as envoyproxy/ratelimit names them, in any
/// case (its files write `SECOND`; it reads units case-insensitively).
pub(crate) fn unit_ms(unit: &str) -> Result<u64, String> {
    match unit.to_ascii_lowercase().as_str() {
        "second" => Ok(1000),
        "minute" => Ok(60_000),
        "hour" => Ok(3_600_000),
        "day" => Ok(86_400_000),
        "week" => Ok(7 * 86_400_000),
        // Fixed lengths, as envoyproxy/ratelimit's UnitToDivider has them.
        "month" => Ok(30 * 86_400_000),
        "year" => Ok(365 * 86_400_000),
        _ => Err(format!(
            "unknown unit {unit:?}; use second, minute, hour, day, week, month (30 days) or year \
             (365 days), or window_ms for any length"
        )),
    }
}

/// The path of a configuration file given on the command line, kept for
/// reloads.
#[derive(Debug, Clone)]
pub struct ConfigSource {
    /// The file, or `None` for the built-in reference configuration.
    pub path: Option<PathBuf>,
}

impl ConfigSource {
    /// Loads the configuration afresh.
    pub fn load(&self) -> Result<Config, ConfigFileError> {
        match &self.path {
            Some(p) => Config::load(p),
            None => Ok(Config::reference()),
        }
    }

    /// [`ConfigSource::load`] on a thread of its own, so that a read that
    /// blocks (a pipe no one writes to, a hung network mount) holds up
    /// no task of the caller's runtime: a server stays able to stop
    /// meanwhile.
    pub async fn load_in_background(&self) -> Result<Config, ConfigFileError> {
        let source = self.clone();
        tokio::task::spawn_blocking(move || source.load())
            .await
            .unwrap_or_else(|e| {
                Err(ConfigFileError {
                    file: self
                        .path
                        .as_ref()
                        .map_or_else(String::new, |p| p.display().to_string()),
                    line: None,
                    column: None,
                    field: String::new(),
                    message: format!("reading the file failed: {e}"),
                })
            })
    }

    /// [`ConfigSource::load_in_background`], waited for at most `within`:
    /// a read that blocks is left (it cannot be stopped) and the error
    /// says so, so that a start, `serve --check` or `ratewarden key` ends
    /// with a message rather than hang in silence. The caller's runtime
    /// must then not wait for its blocking threads as it shuts down.
    pub async fn load_within(&self, within: std::time::Duration) -> anyhow::Result<Config> {
        match tokio::time::timeout(within, self.load_in_background()).await {
            Ok(loaded) => Ok(loaded?),
            Err(_) => {
                let shown = self.path.as_ref().map_or_else(
                    || "the reference configuration".to_owned(),
                    |p| p.display().to_string(),
                );
                anyhow::bail!(
                    "reading {shown} did not finish within {} s (a pipe no one writes to, or a \
                     hung network mount?)",
                    within.as_secs()
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full shard holds about `housekeeping_max_scanned` keys or fewer,
    /// so that a housekeeping pass, or a full shard making room, holds one
    /// shard's lock over about that many keys.
    #[test]
    fn memory_stores_get_shards_no_larger_than_a_housekeeping_pass() {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let settings = |max_keys, housekeeping_max_scanned| ServerSettings {
            max_keys,
            housekeeping_max_scanned,
            ..ServerSettings::default()
        };
        // The defaults: 4,194,304 keys, 65,536 per pass: 64 shards.
        let options = ServerSettings::default().memory_options();
        assert_eq!(options.max_keys, 1 << 22);
        assert_eq!(options.shards, 64.max(cores * 4));
        // Few keys: the core's automatic count.
        assert_eq!(settings(2000, 65_536).memory_options().shards, 0);
        assert_eq!(settings(1 << 20, 65_536).memory_options().shards, 0);
        // A tiny pass: shards of room for 1,024 keys, no fewer.
        assert_eq!(settings(1 << 22, 1).memory_options().shards, 4096);
        // Many cores do not push shards below the floor.
        let options = settings(100_000, 4_096).memory_options();
        assert!(options.shards <= 100_000 / 1024, "{options:?}");
        // Whatever the numbers, the store is made.
        for (max_keys, scanned) in [(1, 1), (usize::MAX, 1), (usize::MAX, usize::MAX)] {
            let options = settings(max_keys, scanned).memory_options();
            ratewarden_core::MemoryStore::for_config(&REFERENCE, options).unwrap();
        }
    }

    fn parse_err(text: &str) -> ConfigFileError {
        Config::parse(text, "test.toml").unwrap_err()
    }

    #[test]
    fn the_reference_limits_keys_and_everything_else() {
        let c = Config::reference();
        assert_eq!(c.keys.unwrap().policy, REFERENCE);
        assert_eq!(c.fallback.unwrap().policy, REFERENCE);
    }

    #[test]
    fn units_are_read_in_any_case() {
        for unit in ["minute", "MINUTE", "Minute"] {
            let c = Config::parse(&format!("[keys]\nlimit = 1\nunit = {unit:?}\n"), "t").unwrap();
            assert_eq!(c.keys.unwrap().policy.window_ms, 60_000, "{unit}");
        }
        let e = parse_err("[keys]\nlimit = 1\nunit = \"MINUTES\"\n");
        assert!(e.message.starts_with("unknown unit \"MINUTES\""), "{e}");
    }

    #[test]
    fn a_nested_tree_loads() {
        let c = Config::parse(
            r#"
[server]
key_hash = "mix32"
failure_policy = "open"

[keys]
limit = 10
unit = "minute"

[[domains]]
domain = "api"

[[domains.descriptors]]
key = "remote_address"
limit = 5
window_ms = 1000

[[domains.descriptors]]
key = "path"
value = "/login"

[[domains.descriptors.descriptors]]
key = "user"
policy = "token-bucket"
limit = 3
window_ms = 60000
burst = 6
shadow = true
"#,
            "t.toml",
        )
        .unwrap();
        assert_eq!(c.server.key_hash, KeyHash::Mix32);
        assert_eq!(ServerSettings::default().key_hash, KeyHash::Xxh3_64);
        assert_eq!(
            c.server.failure_policy,
            ServeFailurePolicy::Decide(FailurePolicy::FailOpen)
        );
        assert_eq!(c.keys.unwrap().policy.window_ms, 60_000);
        let d = &c.domains[0];
        assert_eq!(d.descriptors.len(), 2);
        assert_eq!(
            d.descriptors[0].rule.as_ref().unwrap().name,
            "api.remote_address"
        );
        let login = &d.descriptors[1];
        assert!(login.rule.is_none());
        let user = login.children[0].rule.as_ref().unwrap();
        assert_eq!(user.name, "api.path_/login.user");
        assert!(user.shadow);
        assert_eq!(user.policy.burst, Some(6));
    }

    #[test]
    fn errors_name_the_file_line_and_field() {
        let e = parse_err("[[domains]]\ndomain = \"api\"\n[[domains.descriptors]]\nkey = \"a\"\nlimit = -5\nwindow_ms = 10\n");
        assert_eq!((e.file.as_str(), e.line), ("test.toml", Some(5)));
        assert_eq!(e.field, "domains[0].descriptors[0].limit");
        assert!(
            e.to_string()
                .starts_with("test.toml:5:9: domains[0].descriptors[0].limit: -5 is out of range"),
            "{e}"
        );

        let e = parse_err("[keys]\nlimit = 5\nwindow_ms = 0\n");
        assert_eq!((e.line, e.field.as_str()), (Some(3), "keys.window_ms"));
        // A header repeated or contradicted names its table and the line
        // that explains it.
        for (text, line, advice) in [
            (
                "[keys]\nlimit = 5\nwindow_ms = 10\n[keys]\nlimit = 6\n",
                4,
                "[keys] is written twice (also at line 1); merge the two into one [keys] table",
            ),
            (
                "[[domains.descriptors]]\nkey = \"k\"\nlimit = 1\n[[domains]]\ndomain = \"d\"\n",
                4,
                "line 1, [[domains.descriptors]], comes before any [[domains]], which makes \
                 domains one table rather than a list; move it below the [[domains]] it belongs to",
            ),
            // With no [[domains]] at all (the parser calls domains a map
            // where a sequence belongs), and one level down.
            (
                "[[domains.descriptors]]\nkey = \"k\"\nlimit = 1\nwindow_ms = 1000\n",
                1,
                "line 1, [[domains.descriptors]], comes before any [[domains]], which makes \
                 domains one table rather than a list; open the element it belongs to with \
                 [[domains]] above it",
            ),
            (
                "[[domains]]\ndomain = \"d\"\n[[domains.descriptors.descriptors]]\nkey = \"k\"\n\
                 limit = 1\nwindow_ms = 1000\n",
                3,
                "line 3, [[domains.descriptors.descriptors]], comes before any \
                 [[domains.descriptors]], which makes domains.descriptors one table rather than \
                 a list; open the element it belongs to with [[domains.descriptors]] above it",
            ),
            (
                "[domains]\ndomain = \"d\"\n[[domains]]\ndomain = \"e\"\n",
                3,
                "[[domains]] is a list of tables, but line 1 opens it as one table, [domains]; \
                 write [[domains]] there too",
            ),
            // The nearest earlier header is named, in the element it repeats.
            (
                "[[domains]]\n[domains.x]\n[[domains]]\n[domains.x]\n[domains.x]\n",
                5,
                "[domains.x] is written twice (also at line 4); merge the two into one \
                 [domains.x] table",
            ),
            (
                "[[domains]]\ndomain = \"d\"\n[domains]\ndomain = \"e\"\n",
                3,
                "line 1 makes domains a list of tables, [[domains]]; write [[domains]] here too, \
                 for one more element",
            ),
        ] {
            let e = parse_err(text);
            assert_eq!(e.line, Some(line), "{e}");
            let table = if text.contains("keys") {
                "keys"
            } else if text.contains("[domains.x]") {
                "domains.x"
            } else if text.contains("[[domains.descriptors.descriptors]]") {
                "domains.descriptors"
            } else {
                "domains"
            };
            assert_eq!(
                (e.field.as_str(), e.message.as_str()),
                (table, advice),
                "{text}"
            );
        }
        // A header of a shape its table does not take says so, whatever the
        // parser's own words (maps, strings, sequences, duplicate keys).
        for (text, line, field, advice) in [
            (
                "[[keys]]\nlimit = 5\nwindow_ms = 10\n",
                1,
                "keys",
                "[keys] is one table, not a list: write [keys], with single brackets, once",
            ),
            (
                "[[server]]\nmax_keys = 10\n",
                1,
                "server",
                "[server] is one table, not a list: write [server], with single brackets, once",
            ),
            (
                "[keys]\nlimit = 5\nwindow_ms = 10\n\n[[keys]]\nlimit = 6\n",
                5,
                "keys",
                "[keys] is one table, not a list: write [keys], with single brackets, once",
            ),
            (
                "[[fallback]]\nlimit = 5\n[fallback]\nlimit = 6\n",
                3,
                "fallback",
                "line 1 writes [[fallback]], but [fallback] is one table, not a list: write \
                 [fallback] there, with single brackets, once",
            ),
            (
                "[keys]\nwindow_ms = 10\n[keys.limit]\nx = 1\n",
                3,
                "keys.limit",
                "limit is a setting, not a table: write limit = VALUE under [keys]",
            ),
            (
                "[[domains]]\ndomain = \"d\"\n[[domains.descriptors]]\nkey = \"k\"\n\
                 [[domains.descriptors.limit]]\nx = 1\n",
                5,
                "domains.descriptors.limit",
                "limit is a setting, not a table: write limit = VALUE under the \
                 [[domains.descriptors]] it belongs to",
            ),
            // The same, with the space TOML allows around the dots.
            (
                "[[domains]]\ndomain = \"d\"\n[[domains.descriptors]]\nkey = \"k\"\n\
                 [[ domains . descriptors . limit ]]\nx = 1\n",
                5,
                "domains . descriptors . limit",
                "limit is a setting, not a table: write limit = VALUE under the \
                 [[domains.descriptors]] it belongs to",
            ),
            // A setting under a table that does not take it: its own named.
            (
                "[server.name]\nx = 1\n",
                1,
                "server.name",
                "name is a setting of [keys], [fallback] or a descriptor, not a table: write \
                 name = VALUE there",
            ),
            (
                "[keys.key_prefix]\nx = 1\n",
                1,
                "keys.key_prefix",
                "key_prefix is a setting of [server], not a table: write key_prefix = VALUE \
                 there",
            ),
            (
                "[[domains]]\ndomain = \"d\"\n[domains.limit]\nx = 1\n",
                3,
                "domains.limit",
                "limit is a setting of [keys], [fallback] or a descriptor, not a table: write \
                 limit = VALUE there",
            ),
        ] {
            let e = parse_err(text);
            assert_eq!(
                (e.line, e.field.as_str(), e.message.as_str()),
                (Some(line), field, advice),
                "{text}"
            );
        }
        // A setting in the wrong table is sent to its own.
        let e = parse_err("[keys]\nlimit = 5\nwindow_ms = 10\nfailure_policy = \"open\"\n");
        assert_eq!((e.line, e.field.as_str()), (Some(4), "keys.failure_policy"));
        assert!(
            e.message
                .ends_with("; failure_policy is a setting of [server]"),
            "{e}"
        );
        let e = parse_err("[server]\nlimit = 5\n");
        assert!(
            e.message
                .ends_with("; limit is a setting of [keys], [fallback] or a descriptor"),
            "{e}"
        );
        // A value where a table belongs is named in the file's terms.
        let e = parse_err("keys = \"a\"\n");
        assert_eq!(e.field, "keys", "{e}");
        assert!(e.message.ends_with("expected a table"), "{e}");

        let e = parse_err("[keys]\nlimit = 5\nlimit = 6\nwindow_ms = 10\n");
        assert_eq!((e.line, e.field.as_str()), (Some(3), "keys.limit"), "{e}");
        assert!(e.message.contains("written twice"), "{e}");
        let e = parse_err("[keys]\nlimit = 5\nwindow_ms = -1\n");
        assert!(e.message.contains("-1 is not a window"), "{e}");
        assert!(e.message.contains("at least 1 ms"), "{e}");

        let e = parse_err("[keys]\nlimit = 5\nwindow_ms = 10\npolicy = \"leaky\"\n");
        assert_eq!((e.line, e.field.as_str()), (Some(4), "keys.policy"));
        assert!(e.message.contains("sliding-window-counter"), "{e}");

        let e = parse_err("[keys]\nlimit = 5\nwindow_ms = 10\nburst = 7\n");
        assert_eq!((e.line, e.field.as_str()), (Some(4), "keys.burst"));

        let e = parse_err("[keys]\nlimit = 1.5\nwindow_ms = 10\n");
        assert_eq!((e.line, e.field.as_str()), (Some(2), "keys.limit"));
        assert!(e.message.contains("float"), "{e}");

        let e = parse_err("[keys]\nlimt = 5\n");
        assert_eq!((e.line, e.field.as_str()), (Some(2), "keys.limt"));
        assert!(e.message.contains("limt"), "{e}");

        let e = parse_err("[keys]\nlimit = 5\n");
        assert!(e.message.contains("no window"), "{e}");

        let e = parse_err("[[domains]]\ndomain = \"a\"\n[[domains.descriptors]]\nkey = \"k\"\n");
        assert!(e.message.contains("neither a limit nor nested"), "{e}");

        let e = parse_err(
            "[[domains]]\ndomain = \"a\"\n[[domains.descriptors]]\nkey = \"k\"\nunlimited = true\n\
             [[domains]]\ndomain = \"a\"\n",
        );
        assert_eq!(e.line, Some(6));
        assert!(e.message.contains("twice"), "{e}");

        let e = parse_err("[server]\nfailure_policy = \"maybe\"\n");
        assert_eq!(
            (e.line, e.field.as_str()),
            (Some(2), "server.failure_policy")
        );
        assert!(
            e.message.ends_with(
                "unknown failure policy \"maybe\"; use one of: open, closed, local, error"
            ),
            "{e}"
        );
        let c = Config::parse(
            "[server]\nfailure_policy = \"error\"\n[keys]\nlimit = 1\nwindow_ms = 10\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.server.failure_policy, ServeFailurePolicy::Error);

        let e = parse_err("[keys]\nlimit = 9007199254740992\nunit = \"second\"\n");
        assert_eq!(e.field, "keys.limit");
        assert!(e.message.contains("from 0 to 9007199254740991"), "{e}");
        // A window's range starts at 1 ms.
        let e = parse_err("[keys]\nlimit = 1\nwindow_ms = 9007199254740992\n");
        assert_eq!(e.field, "keys.window_ms");
        assert!(e.message.contains("from 1 to 9007199254740991"), "{e}");
    }

    #[test]
    fn every_rule_has_a_name_of_its_own() {
        let e = parse_err("[keys]\nname = \"same\"\nlimit = 1\nwindow_ms = 10\n[fallback]\nname = \"same\"\nlimit = 2\nwindow_ms = 10\n");
        // At the second name as written.
        assert_eq!((e.line, e.field.as_str()), (Some(6), "fallback.name"));
        assert!(e.message.contains("already the name of keys"), "{e}");
        // Default names can clash too: a_b + c and a + b_c.
        let e = parse_err(
            "[[domains]]\ndomain = \"api\"\n\
             [[domains.descriptors]]\nkey = \"a\"\nvalue = \"b_c\"\nlimit = 3\nwindow_ms = 10\n\
             [[domains.descriptors]]\nkey = \"a_b\"\nvalue = \"c\"\nlimit = 4\nwindow_ms = 10\n",
        );
        assert_eq!(e.field, "domains[0].descriptors[1].name");
        assert!(
            e.message
                .contains("\"api.a_b_c\" is already the name of domains[0].descriptors[0]"),
            "{e}"
        );
    }

    #[test]
    fn names_of_overrides_are_reserved() {
        let e = parse_err("[keys]\nname = \"api.x.override\"\nlimit = 1\nwindow_ms = 10\n");
        assert_eq!(e.field, "keys.name");
        // At the name as written, not at the table.
        assert_eq!(e.line, Some(2));
        assert!(e.message.contains("ends in \".override\""), "{e}");
    }

    #[test]
    fn type_errors_are_said_in_toml_terms() {
        let e = parse_err("[keys]\nlimit = \"ten\"\nwindow_ms = 10\n");
        assert_eq!((e.line, e.field.as_str()), (Some(2), "keys.limit"));
        assert!(e.message.contains("expected a whole number"), "{e}");
        let e = parse_err("[domains]\ndomain = \"api\"\n");
        assert!(e.message.contains("write [[domains]]"), "{e}");
    }

    /// The parser's own depth bounds say what to change too: a table named
    /// by a very long dotted key (whose error has no position) and a
    /// nested value.
    #[test]
    fn nesting_past_the_parser_s_bounds_says_what_to_change() {
        let mut deep = String::from("[[domains]]\ndomain = \"d\"\n");
        let mut path = String::from("domains");
        for _ in 0..100 {
            path.push_str(".descriptors");
            deep.push_str(&format!("[[{path}]]\nkey = \"k\"\n"));
        }
        let nested = format!("[keys]\nlimit = {}1{}\n", "[".repeat(500), "]".repeat(500));
        for text in [deep, nested] {
            let e = parse_err(&text);
            assert!(
                e.message.contains("descriptors nest at most 16 levels"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_configuration_with_no_rule_is_refused() {
        for text in ["", "# nothing yet\n", "[server]\nkey_hash = \"xxh3-64\"\n"] {
            let e = parse_err(text);
            assert!(
                e.message.starts_with("the configuration has no rules"),
                "{text:?}: {e}"
            );
        }
        // A domain without descriptors limits nothing: most likely a file
        // cut short after its header.
        let e = parse_err("[keys]\nlimit = 1\nwindow_ms = 10\n[[domains]]\ndomain = \"api\"\n");
        assert_eq!(
            (e.line, e.field.as_str()),
            (Some(4), "domains[0].descriptors")
        );
        assert!(
            e.message.contains("domain \"api\" has no descriptors"),
            "{e}"
        );
        // One domain with a descriptor is a configuration.
        Config::parse(
            "[[domains]]\ndomain = \"api\"\n[[domains.descriptors]]\nkey = \"k\"\nunlimited = true\n",
            "test.toml",
        )
        .unwrap();
    }

    #[test]
    fn envoyproxy_fields_get_a_hint() {
        let node = "[[domains]]\ndomain = \"d\"\n[[domains.descriptors]]\nkey = \"k\"\n";
        for (extra, hint) in [
            (
                "shadow_mode = true\nlimit = 1\nunit = \"second\"\n",
                "shadow = true",
            ),
            (
                "[domains.descriptors.rate_limit]\nunit = \"second\"\n",
                "limit = N and unit",
            ),
            ("requests_per_unit = 5\n", "limit = N"),
            (
                "replaces = []\nlimit = 1\nunit = \"second\"\n",
                "replaces is not supported",
            ),
            (
                "detailed_metric = true\nlimit = 1\nunit = \"second\"\n",
                "per rule name",
            ),
            (
                "value_to_metric = true\nlimit = 1\nunit = \"second\"\n",
                "value_to_metric is not supported: metrics are per rule name",
            ),
            (
                "quota_mode = true\nlimit = 1\nunit = \"second\"\n",
                "quota_mode is not supported: there are no soft limits",
            ),
            (
                "value = \"files/*\"\nshare_threshold = true\nlimit = 1\nunit = \"second\"\n",
                "share_threshold is not supported: each value a wildcard matches has its own \
                 count; for one count shared by all of them, have Envoy send a constant value",
            ),
            (
                "limit = 1\nunit = \"second\"\n[domains.descriptors.metadata]\nteam = \"a\"\n",
                "metadata is not supported: answers never carry dynamic_metadata",
            ),
            (
                "limit = 1\nunit = \"second\"\nmetadata = { team = \"a\" }\n",
                "metadata is not supported",
            ),
        ] {
            let e = parse_err(&format!("{node}{extra}"));
            assert!(e.message.contains(hint), "{extra:?}: {e}");
        }
        let yaml = "# rules\n---\ndomain: api\ndescriptors:\n  - key: remote_address\n";
        let e = parse_err(yaml);
        assert!(e.message.contains("looks like YAML"), "{e}");
        // A TOML mistake is not called YAML.
        let e = parse_err("[keys]\nlimit 5\n");
        assert!(!e.message.contains("YAML"), "{e}");
    }

    #[test]
    fn envoyproxy_forms_load() {
        let c = Config::parse(
            "[[domains]]\ndomain = \"d\"\n\
             [[domains.descriptors]]\nkey = \"k\"\nvalue = \"\"\nlimit = 5\nunit = \"month\"\n\
             [[domains.descriptors]]\nkey = \"u\"\nunlimited = true\n\
             [[domains.descriptors]]\nkey = \"y\"\nvalue = \"a*\"\nlimit = 5\nunit = \"year\"\n",
            "t.toml",
        )
        .unwrap();
        let d = &c.domains[0].descriptors;
        assert_eq!(d[0].value, None, "an empty value is any value");
        assert_eq!(d[0].rule.as_ref().unwrap().policy.window_ms, 2_592_000_000);
        assert!(d[1].unlimited && d[1].rule.is_none());
        assert_eq!(d[2].rule.as_ref().unwrap().policy.window_ms, 31_536_000_000);

        let e = parse_err("[[domains]]\ndomain = \"d\"\n[[domains.descriptors]]\nkey = \"k\"\nunlimited = true\nlimit = 5\nunit = \"minute\"\n");
        assert_eq!(e.field, "domains[0].descriptors[0].unlimited");
        assert!(e.message.contains("keep unlimited or the limit"), "{e}");
        let e = parse_err("[[domains]]\ndomain = \"d\"\n[[domains.descriptors]]\nkey = \"k\"\nunlimited = true\n[[domains.descriptors]]\nkey = \"k\"\nvalue = \"\"\nlimit = 1\nunit = \"minute\"\n");
        assert!(e.message.contains("twice"), "{e}");
    }

    /// A `*` node and a node of the key alone, side by side: the second is
    /// never reached, in either order, so the file is refused.
    #[test]
    fn a_star_node_beside_a_key_only_node_is_refused() {
        let star =
            "[[domains.descriptors]]\nkey = \"k\"\nvalue = \"*\"\nlimit = 1\nunit = \"hour\"\n";
        let any = "[[domains.descriptors]]\nkey = \"k\"\nlimit = 5\nunit = \"hour\"\n";
        // The second node's header: after the first's 5 or 4 lines.
        for (first, second, line) in [(star, any, 8), (any, star, 7)] {
            let e = parse_err(&format!("[[domains]]\ndomain = \"d\"\n{first}{second}"));
            assert_eq!(
                (e.line, e.field.as_str()),
                (Some(line), "domains[0].descriptors[1]"),
                "{e}"
            );
            assert!(
                e.message
                    .contains("\"*\" matches every value first, so the other is never reached"),
                "{e}"
            );
        }
        // Under different parents, or beside a prefix, both are reached.
        Config::parse(
            &format!(
                "[[domains]]\ndomain = \"d\"\n{any}\
                 [[domains.descriptors]]\nkey = \"k\"\nvalue = \"a*\"\nlimit = 1\nunit = \"hour\"\n\
                 [[domains]]\ndomain = \"e\"\n{star}"
            ),
            "t",
        )
        .unwrap();
    }

    #[test]
    fn a_star_before_the_end_is_refused() {
        let node = |value: &str| {
            format!(
                "[[domains]]\ndomain = \"d\"\n[[domains.descriptors]]\nkey = \"k\"\n\
                 value = {value:?}\nlimit = 1\nunit = \"hour\"\n"
            )
        };
        // A trailing `*` is a prefix match, and `*` alone matches every
        // value: these load unchanged.
        for value in ["*", "foo*", "/api/*"] {
            let c = Config::parse(&node(value), "t.toml").unwrap();
            assert_eq!(
                c.domains[0].descriptors[0].value.as_deref(),
                Some(value),
                "{value}"
            );
        }
        for (value, example) in [
            ("a*b", "(\"a*\" matches every value starting with \"a\")"),
            (
                "/api/*/users",
                "(\"/api/*\" matches every value starting with \"/api/\")",
            ),
            ("/api/*/resource/*", "(\"/api/*\" matches"),
            ("a**", "(\"a*\" matches"),
            ("*a", "(\"*\" matches every value)"),
            ("**", "(\"*\" matches every value)"),
        ] {
            let e = parse_err(&node(value));
            assert_eq!(
                (e.line, e.field.as_str()),
                (Some(5), "domains[0].descriptors[0].value"),
                "{value}: {e}"
            );
            assert!(
                e.message.starts_with(&format!(
                    "{value:?} has a * before its end; only a trailing * is a wildcard here, \
                     a prefix match {example}"
                )),
                "{value}: {e}"
            );
            assert!(
                e.message
                    .contains("envoyproxy/ratelimit's glob, a * in the middle, is not supported"),
                "{value}: {e}"
            );
            assert!(e.message.contains("cannot be written"), "{value}: {e}");
        }
        // Nested, and in an inline table, the value is named where it is.
        let e = parse_err(
            "[[domains]]\ndomain = \"d\"\n[[domains.descriptors]]\nkey = \"p\"\n\
             [[domains.descriptors.descriptors]]\nkey = \"k\"\nvalue = \"a*b\"\nunlimited = true\n",
        );
        assert_eq!(
            (e.line, e.field.as_str()),
            (Some(7), "domains[0].descriptors[0].descriptors[0].value"),
            "{e}"
        );
        let e = parse_err(
            "[[domains]]\ndomain = \"d\"\n\
             descriptors = [{ key = \"k\", value = \"a*b\", unlimited = true }]\n",
        );
        assert_eq!(
            (e.line, e.field.as_str()),
            (Some(3), "domains[0].descriptors[0].value"),
            "{e}"
        );
        assert!(e.to_string().starts_with("test.toml:3:"), "{e}");
    }

    #[test]
    fn missing_files_are_named() {
        let e = Config::load(Path::new("/nonexistent/ratewarden.toml")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("/nonexistent/ratewarden.toml: cannot read the file"),
            "{e}"
        );
    }

    /// A file whose size says nothing (an endless device, here) is read
    /// only up to the bound, and refused; one that is not UTF-8 says so.
    #[cfg(target_os = "linux")]
    #[test]
    fn reading_stops_at_the_bound_whatever_the_size_says() {
        let e = Config::load(Path::new("/dev/zero")).unwrap_err();
        assert!(
            e.to_string()
                .contains("holds more than the 16777216 bytes allowed"),
            "{e}"
        );
        let file = std::env::temp_dir().join(format!("ratewarden-utf8-{}", std::process::id()));
        // The bad byte follows two characters of two bytes each.
        std::fs::write(
            &file,
            "[keys]\n# \u{e9}\u{e9}"
                .bytes()
                .chain(*b"\xff\n")
                .collect::<Vec<_>>(),
        )
        .unwrap();
        let e = Config::load(&file).unwrap_err();
        let _ = std::fs::remove_file(&file);
        assert!(e.to_string().contains("it is not UTF-8 text"), "{e}");
        assert_eq!((e.line, e.column), (Some(2), Some(5)), "{e}");
    }

    /// A second domain, or descriptor, of one name says where the first
    /// is: in a long file, the line of the second alone leaves the user
    /// searching for the first.
    #[test]
    fn a_repeated_domain_or_descriptor_names_the_first() {
        let rule = "limit = 1\nwindow_ms = 10\n";
        let e = parse_err(&format!(
            "[[domains]]\ndomain = \"a\"\n[[domains.descriptors]]\nkey = \"k\"\n{rule}\
             [[domains]]\ndomain = \"b\"\n[[domains.descriptors]]\nkey = \"k\"\n{rule}\
             [[domains]]\ndomain = \"a\"\n[[domains.descriptors]]\nkey = \"k\"\n{rule}"
        ));
        assert_eq!((e.line, e.field.as_str()), (Some(13), "domains[2].domain"));
        assert!(
            e.message.contains("(first as domains[0], at line 1)"),
            "{e}"
        );

        let e = parse_err(&format!(
            "[[domains]]\ndomain = \"a\"\n[[domains.descriptors]]\nkey = \"j\"\n{rule}\
             [[domains.descriptors]]\nkey = \"k\"\nvalue = \"v\"\n{rule}\
             [[domains.descriptors]]\nkey = \"k\"\nvalue = \"v\"\n{rule}"
        ));
        assert_eq!(e.field, "domains[0].descriptors[2]", "{e}");
        assert!(
            e.message
                .contains("(first as domains[0].descriptors[1], at line 7)"),
            "{e}"
        );

        let e = parse_err(&format!(
            "[[domains]]\ndomain = \"a\"\n[[domains.descriptors]]\nkey = \"k\"\n{rule}\
             [[domains.descriptors]]\nkey = \"k\"\nvalue = \"*\"\n{rule}"
        ));
        assert!(
            e.message
                .contains("(the other is domains[0].descriptors[0], at line 3)"),
            "{e}"
        );
    }

    /// A parser error on a table header, or on a dotted key, names the
    /// table or field, as one on a plain `key = value` line does.
    #[test]
    fn an_unknown_table_or_dotted_key_is_named_in_full() {
        let e = parse_err("[keys]\nlimit = 1\nwindow_ms = 10\n[keys.extra]\nx = 1\n");
        assert_eq!((e.line, e.field.as_str()), (Some(4), "keys.extra"), "{e}");
        assert!(e.message.contains("unknown field `extra`"), "{e}");

        let e = parse_err("[keys]\nwindow_ms = 10\nkeys.limit = 1\n");
        assert_eq!(
            (e.line, e.field.as_str()),
            (Some(3), "keys.keys.limit"),
            "{e}"
        );

        let e = parse_err("server . max_keys = \"x\"\n");
        assert_eq!(e.field, "server.max_keys", "{e}");

        let e = parse_err("[domains]\ndomain = \"a\"\n");
        assert_eq!(e.field, "domains", "{e}");
        assert!(e.message.contains("double brackets"), "{e}");
    }

    #[test]
    fn a_missing_required_field_is_named_with_its_table() {
        let e = Config::parse(
            "[[domains]]\ndomain = \"api\"\n[[domains.descriptors]]\nvalue = \"x\"\nlimit = 1\n\
             window_ms = 10\n",
            "t.toml",
        )
        .unwrap_err();
        assert_eq!(e.field, "domains[0].descriptors[0].key", "{e}");
        assert_eq!(e.line, Some(3), "{e}");
        assert!(e.message.contains("add key = \"NAME\""), "{e}");
        let e = Config::parse(
            "[[domains]]\ndomain = \"a\"\n[[domains.descriptors]]\nkey = \"k\"\nlimit = 1\n\
             window_ms = 10\n[[domains]]\n[[domains.descriptors]]\nkey = \"k\"\nlimit = 1\n\
             window_ms = 10\n",
            "t.toml",
        )
        .unwrap_err();
        assert_eq!(e.field, "domains[1].domain", "{e}");
        assert!(e.message.contains("add domain = \"NAME\""), "{e}");
        // In an inline table, the setting that holds it is named.
        let e = Config::parse(
            "[[domains]]\ndomain = \"a\"\ndescriptors = [{ value = \"x\", limit = 1, \
             window_ms = 10 }]\n",
            "t.toml",
        )
        .unwrap_err();
        assert_eq!(e.field, "domains[0].descriptors[...].key", "{e}");
    }

    #[test]
    fn redis_tls_files_are_found_from_the_files_directory() {
        let dir = std::env::temp_dir().join(format!("rw-redis-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ratewarden.toml");
        std::fs::write(
            &path,
            "[redis]\ntls_ca_file = \"ca.crt\"\ntls_cert_file = \"/etc/c.crt\"\n\
             tls_key_file = \"keys/c.key\"\n[keys]\nlimit = 1\nwindow_ms = 10\n",
        )
        .unwrap();
        let c = Config::load(&path).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let tls = &c.server.redis_tls;
        assert_eq!(tls.tls_ca_file, Some(dir.join("ca.crt")));
        assert_eq!(tls.tls_cert_file, Some(PathBuf::from("/etc/c.crt")));
        assert_eq!(tls.tls_key_file, Some(dir.join("keys/c.key")));
        assert_eq!(
            c.server.changed(&ServerSettings::default()),
            [
                "redis.tls_ca_file",
                "redis.tls_cert_file",
                "redis.tls_key_file"
            ]
        );
        let e = Config::parse(
            "[redis]\ntls_ca_file = \"\"\n[keys]\nlimit = 1\nwindow_ms = 10\n",
            "t.toml",
        )
        .unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (Some(2), "redis.tls_ca_file"));
        let e = Config::parse(
            "[redis]\ntls_ca = \"x\"\n[keys]\nlimit = 1\nwindow_ms = 10\n",
            "t.toml",
        )
        .unwrap_err();
        assert!(e.to_string().contains("tls_ca"), "{e}");
    }

    #[test]
    fn a_store_timeout_past_the_grpc_deadline_is_refused() {
        let text = |ms: i64| {
            format!("[server]\nstore_timeout_ms = {ms}\n[keys]\nlimit = 1\nwindow_ms = 10\n")
        };
        let c = Config::parse(&text(10_000), "t").unwrap();
        assert_eq!(c.server.store_timeout_ms, 10_000);
        for ms in [0, 10_001, 3_600_000] {
            let e = parse_err(&text(ms));
            assert_eq!(
                (e.line, e.field.as_str()),
                (Some(2), "server.store_timeout_ms")
            );
            assert!(
                e.message.contains("use a whole number from 1 to 10000"),
                "{e}"
            );
        }
    }

    #[test]
    fn grpc_streams_per_connection_are_bounded_as_configured() {
        let text = |n: i64| {
            format!(
                "[server]\ngrpc_max_streams_per_connection = {n}\n[keys]\nlimit = 1\nwindow_ms = 10\n"
            )
        };
        assert_eq!(
            ServerSettings::default().grpc_max_streams_per_connection,
            1024
        );
        let c = Config::parse(&text(100_000), "t").unwrap();
        assert_eq!(c.server.grpc_max_streams_per_connection, 100_000);
        for n in [0, 100_001] {
            let e = parse_err(&text(n));
            assert_eq!(
                (e.line, e.field.as_str()),
                (Some(2), "server.grpc_max_streams_per_connection")
            );
            assert!(
                e.message.contains("use a whole number from 1 to 100000"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_reload_names_the_server_settings_that_changed() {
        let old = ServerSettings::default();
        assert!(old.changed(&old).is_empty());
        let new = ServerSettings {
            max_keys: 5,
            failure_policy: ServeFailurePolicy::Error,
            key_prefix: "staging".to_owned(),
            ..ServerSettings::default()
        };
        assert_eq!(
            old.changed(&new),
            ["failure_policy", "max_keys", "key_prefix"]
        );
        let c = Config::parse(
            "[server]\nkey_prefix = \"rw-staging\"\n[keys]\nlimit = 1\nwindow_ms = 10\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.server.key_prefix, "rw-staging");
        for bad in ["", "a b", "ünï"] {
            let e = parse_err(&format!(
                "[server]\nkey_prefix = {bad:?}\n[keys]\nlimit = 1\nwindow_ms = 10\n"
            ));
            assert_eq!(e.field, "server.key_prefix", "{e}");
            assert!(e.message.contains("printable ASCII"), "{e}");
        }
    }
}

#[cfg(test)]
mod example {
    use super::*;

    /// docs/serve.md shows the example without its comments: the two
    /// must not drift apart.
    #[test]
    fn the_guide_shows_the_example_as_it_is() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let example = std::fs::read_to_string(root.join("examples/ratewarden.toml")).unwrap();
        let guide = std::fs::read_to_string(root.join("docs/serve.md")).unwrap();
        let settings = |text: &str| -> Vec<String> {
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(str::to_owned)
                .collect()
        };
        let shown = guide
            .split("```toml\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("docs/serve.md shows the example in its first toml block");
        assert_eq!(settings(shown), settings(&example));
    }

    #[test]
    fn the_documented_example_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/ratewarden.toml");
        let c = Config::load(&path).unwrap();
        assert_eq!(c.keys.as_ref().unwrap().policy, REFERENCE);
        assert_eq!(c.domains[0].domain, "api");
        assert_eq!(c.domains[0].descriptors.len(), 4);
        let login = &c.domains[0].descriptors[2].children[0];
        assert_eq!(login.rule.as_ref().unwrap().name, "login-per-user");
        assert!(c.domains[0].descriptors[3].rule.as_ref().unwrap().shadow);
        assert!(c.fallback.is_none());
    }
}

#[cfg(test)]
mod field_names {
    use super::*;

    #[test]
    fn a_number_past_64_bits_is_said_to_be_too_large() {
        let e = Config::parse(
            "[keys]\nlimit = 99999999999999999999\nwindow_ms = 1000\n",
            "t.toml",
        )
        .unwrap_err();
        assert!(
            e.message.starts_with(
                "99999999999999999999 is too large; use a whole number from 0 to 9007199254740991"
            ),
            "{e}"
        );
        assert!(!e.message.contains("i128"), "{e}");
        // 2^63, just past i64, and a number below i64's range.
        for (number, what) in [
            ("9223372036854775808", "is too large"),
            ("-9223372036854775809", "is negative"),
        ] {
            let text = format!("[keys]\nlimit = 5\nwindow_ms = {number}\n");
            let e = Config::parse(&text, "t.toml").unwrap_err();
            assert!(
                e.message
                    .starts_with(&format!("{number} {what}; use a whole number")),
                "{e}"
            );
        }
    }

    #[test]
    fn type_errors_name_the_field_under_its_table() {
        let text =
            "[[domains]]\ndomain = \"a\"\n[[domains.descriptors]]\nkey = \"k\"\nlimit = \"ten\"\n";
        let e = Config::parse(text, "t.toml").unwrap_err();
        assert_eq!(
            (e.line, e.field.as_str()),
            (Some(5), "domains[0].descriptors[0].limit")
        );
        assert!(
            e.to_string()
                .starts_with("t.toml:5:9: domains[0].descriptors[0].limit: invalid type"),
            "{e}"
        );
        // Each list counts within its parent's current element, as the
        // validation's own messages do.
        let text = "[server]\nmax_keys = 5\n\
            [[domains]]\ndomain = \"a\"\n[[domains.descriptors]]\nkey = \"k\"\nlimit = 1\nunit = \"second\"\n\
            [[domains]]\ndomain = \"b\"\n[[domains.descriptors]]\nkey = \"k\"\nlimit = 1\nunit = \"second\"\n\
            [[domains.descriptors]]\nkey = \"j\"\n[[domains.descriptors.descriptors]]\nkey = \"x\"\nshadow = 1\n";
        let e = Config::parse(text, "t.toml").unwrap_err();
        assert_eq!(
            e.field, "domains[1].descriptors[1].descriptors[0].shadow",
            "{e}"
        );
        assert_eq!(table_at("[server]\nx = 1\n").as_deref(), Some("server"));
        assert_eq!(table_at("x = 1\n"), None);
        assert_eq!(field_at("shadow = 1\n", 9), "shadow");
        assert_eq!(field_at("[keys\n", 2), "");
    }
}
