//! Store URLs: which forms are taken, and how one is shown without its
//! credentials.

/// Hides the credentials of a store URL, so that it can be logged or put in
/// an error message. What is shown is only what reads for sure as a host,
/// a port, a database number, a socket path of plain characters, or a
/// `db` or `protocol` query value: the user and password before `@` (in
/// each node of a `redis-cluster://` or `rediss-cluster://` URL) become
/// `***`, and so does every
/// other query value (a `redis+unix://` URL keeps the names `pass=` and
/// `user=` there). A URL that does not read for sure shows less: what
/// follows its last `@` when that is HOST:PORT (a list of them on a
/// cluster), or nothing but its scheme (a password whose `@` was escaped,
/// typed as another character or forgotten; a `,`, `/`, `?` or `#` in
/// credentials; seeds that carry credentials after seeds that do not). A
/// string that is no URL is shown whole only when it is a short lower-case
/// word (`memroy`), a Redis address with its scheme left out
/// (`127.0.0.1:6379`, `localhost:6379/2`, `a:7000,b:7001`: hosts of
/// lower-case letters, digits, `.` and `-`, or IP addresses, each with a
/// port from 1 to 65535), or a store's scheme and one such address with
/// its `//` mistyped (`redis:/127.0.0.1:6379`), so that a typo shows;
/// otherwise only a store's scheme before its `:`, or nothing.
///
/// What cannot be told apart, and so is shown: a password typed where the
/// host or the socket path goes (`redis://s3cret`, or a short lower-case
/// word given as the whole URL); an all-digit password with no host after
/// it (`redis://user:12345` reads as HOST:PORT, and so does `user:12345`
/// given as the whole URL; digits past 65535 or with a leading zero are no
/// port, and are hidden, except after an IP address, which names no
/// user); and, in a URL with no
/// host after its password, what follows an `@` inside that password
/// (it reads as USER:PASSWORD@HOST).
///
/// ```
/// use ratewarden_redis::redact_url;
/// assert_eq!(redact_url("redis://:s3cret@127.0.0.1:6379/2"), "redis://:***@127.0.0.1:6379/2");
/// assert_eq!(redact_url("redis://app:s3cret@h:1"), "redis://***:***@h:1");
/// assert_eq!(
///     redact_url("redis-cluster://:pw@a:7000,:pw@b:7001"),
///     "redis-cluster://:***@a:7000,:***@b:7001"
/// );
/// assert_eq!(redact_url("redis+unix:///run/r.sock?db=1&pass=pw"), "redis+unix:///run/r.sock?db=1&pass=***");
/// // After a password, a pair may be the rest of it (an unescaped `&`).
/// assert_eq!(redact_url("redis+unix:///run/r.sock?pass=pw&db=1"), "redis+unix:///run/r.sock?pass=***&***");
/// assert_eq!(redact_url("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
/// // A password holding an unescaped `,`, `/`, `?`, `#` or `@` makes the URL
/// // ambiguous: all before the last `@` is hidden, and what follows it is
/// // shown only when it reads as HOST:PORT and nothing could be a query.
/// assert_eq!(redact_url("redis-cluster://:pa,ss@a:1,b:2"), "redis-cluster://***@a:1,b:2");
/// assert_eq!(redact_url("redis://:ab/cd@127.0.0.1:6379"), "redis://***@127.0.0.1:6379");
/// assert_eq!(redact_url("redis://:pa?ss@h:1/2"), "redis://***");
/// assert_eq!(redact_url("redis://bob:p@ss:w/rd,x@h:1"), "redis://***@h:1");
/// assert_eq!(redact_url("redis://default:9876,x@h:1"), "redis://***@h:1");
/// // A Unix socket's credentials are in its query, where `@` and `&` may
/// // stand unescaped: only `db` and `protocol` values before them are shown.
/// assert_eq!(
///     redact_url("redis+unix:///run/r.sock?db=1&pass=s3cr@t&x&db=1"),
///     "redis+unix:///run/r.sock?db=1&pass=***&***&***"
/// );
/// // Not a URL, but maybe a mistyped one: nothing past its scheme when
/// // it could hold a password; all of it when it reads as a typo.
/// assert_eq!(redact_url("redis+unix:/run/r.sock?pass=pw"), "redis+unix:***");
/// assert_eq!(redact_url("redis:/:pw@127.0.0.1:6379"), "redis:***");
/// assert_eq!(redact_url("redis:/:pw"), "redis:***");
/// assert_eq!(redact_url("redis:/127.0.0.1:6379/2"), "redis:/127.0.0.1:6379/2");
/// // A node with no `@` that is no HOST[:PORT] may be a password whose
/// // `@` was escaped or forgotten: hidden whole. So is a secret given
/// // where the URL goes.
/// assert_eq!(redact_url("S3cr/3tPw+x"), "***");
/// assert_eq!(redact_url("redis://:pw%40127.0.0.1:6379"), "redis://***");
/// assert_eq!(redact_url("redis://localhost/1"), "redis://localhost/1");
/// // Digits after an IP address are a port, even one out of range: no
/// // user is named like an address.
/// assert_eq!(redact_url("redis://127.0.0.1:99999"), "redis://127.0.0.1:99999");
/// assert_eq!(redact_url("redis://[::1]:0"), "redis://[::1]:0");
/// assert_eq!(redact_url("redis://app:99999"), "redis://***");
/// // A fragment is hidden, and with it, where a password could be, the rest.
/// assert_eq!(redact_url("redis://127.0.0.1:6379#x"), "redis://127.0.0.1:6379#***");
/// assert_eq!(redact_url("redis://:pw@127.0.0.1:6379#x"), "redis://***");
/// ```
pub fn redact_url(url: &str) -> String {
    // A scheme is a letter, then letters, digits, `+`, `-` or `.`: a `://`
    // after anything else may be inside a password.
    let Some((scheme, rest)) = url.split_once("://").filter(|(s, _)| is_scheme(s)) else {
        return redact_not_a_url(url);
    };
    if scheme == "redis+unix" || scheme == "unix" {
        return redact_socket(scheme, rest);
    }
    // Shown only as far as it reads for sure: every part of what is shown
    // is a host, a port, a database number or a query value known to be
    // no secret. Anything else may be a password whose `@` was escaped,
    // typed as another character or forgotten, or whose `/`, `?`, `#` or
    // `,` moved where the URL seems to split.
    if let Some(shown) = redact_readable(scheme, rest) {
        return shown;
    }
    // A fragment in a URL with no `@` and no query, which could hold no
    // credentials: the address is shown when it reads as HOST:PORT (as a
    // password would not), the fragment hidden (what follows a `#` may be
    // a password put where the URL takes none).
    if let Some((address, _)) = rest.split_once('#') {
        if !rest.contains(['@', '?'])
            && host_ports_then_db(address, is_cluster_scheme(scheme), is_host)
        {
            return format!("{scheme}://{address}#***");
        }
    }
    // Not readable: what follows the last `@` is shown when it is a list
    // of HOST:PORT and nothing before it could have started a query.
    if let Some((hidden, after)) = rest.rsplit_once('@') {
        if !hidden.contains(['?', '#'])
            && host_ports_then_db(after, is_cluster_scheme(scheme), is_host)
        {
            return format!("{scheme}://***@{after}");
        }
    }
    format!("{scheme}://***")
}

/// `rest` (after `scheme://`) redacted, if it reads for sure as
/// `[USERINFO@]HOST[:PORT][,...][/DB][?QUERY]`: several nodes on a cluster
/// only, carrying the same credentials or none (redis-rs takes one set for
/// the whole cluster), and credentials holding none of `@ / ? # ,`.
fn redact_readable(scheme: &str, rest: &str) -> Option<String> {
    let (main, query) = match rest.split_once('?') {
        Some((main, query)) => (main, Some(query)),
        None => (rest, None),
    };
    // A `#`, or an `@` after the first `?`, may be inside credentials.
    if rest.contains('#') || query.is_some_and(|q| q.contains('@')) {
        return None;
    }
    let (nodes, db) = match main.split_once('/') {
        Some((nodes, db)) => (nodes, Some(db)),
        None => (main, None),
    };
    if db.is_some_and(|db| !db.bytes().all(|b| b.is_ascii_digit())) {
        return None;
    }
    let nodes: Vec<&str> = if is_cluster_scheme(scheme) {
        nodes.split(',').collect()
    } else {
        vec![nodes]
    };
    let cluster = nodes.len() > 1;
    let mut credentials = None;
    let mut bare_seen = false;
    let mut shown = Vec::with_capacity(nodes.len());
    for node in nodes {
        let (userinfo, host) = match node.rsplit_once('@') {
            Some((userinfo, host)) => (Some(userinfo), host),
            None => (None, node),
        };
        // A cluster's seeds each need a port.
        if !is_host_port(host) && (cluster || !is_host(host)) {
            return None;
        }
        match userinfo {
            // Credentials after a seed without them: the seeds before
            // may be pieces of a password holding `,`.
            Some(_) if bare_seen => return None,
            Some(userinfo) => {
                if userinfo.contains(['@', '/', '?', '#', ','])
                    || credentials.is_some_and(|c| c != userinfo)
                {
                    return None;
                }
                credentials = Some(userinfo);
            }
            None => bare_seen = true,
        }
        shown.push(match userinfo {
            Some(userinfo) => format!("{}@{host}", redact_userinfo(userinfo)),
            None => host.to_owned(),
        });
    }
    let mut out = format!("{scheme}://{}", shown.join(","));
    if let Some(db) = db {
        out.push('/');
        out.push_str(db);
    }
    if let Some(query) = query {
        out.push('?');
        out.push_str(&redact_query(query));
    }
    Some(out)
}

/// Whether `s` is HOST:PORT (a comma-separated `list` of them, if asked)
/// with at most a `/DB`, and nothing else, each host one `host` accepts.
fn host_ports_then_db(s: &str, list: bool, host: fn(&str) -> bool) -> bool {
    let (nodes, db) = s.split_once('/').unwrap_or((s, "0"));
    !db.is_empty()
        && db.bytes().all(|b| b.is_ascii_digit())
        && if list {
            nodes.split(',').all(|node| host_port_with(node, host))
        } else {
            host_port_with(nodes, host)
        }
}

/// A `redis+unix://` URL: its path when it holds only characters that no
/// credential needs (letters, digits, `.`, `_`, `-`, `~`, `/`), and its
/// query with every value but `db` and `protocol` hidden.
fn redact_socket(scheme: &str, rest: &str) -> String {
    let (path, query) = match rest.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (rest, None),
    };
    // One leading `/` (`redis+unix:///PATH`): anything between the `//`
    // and the path is an authority, which may hold user information.
    let plain = path.starts_with('/')
        && !path.starts_with("//")
        && path
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-~/".contains(&b));
    // Each query key a word: a key holding `@`, `:` or `?` may be the rest
    // of user information that a `?` in it cut off.
    let keys_plain = query.is_none_or(|q| {
        q.split('&').all(|pair| {
            let key = pair.split_once('=').map_or(pair, |(k, _)| k);
            key.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-%".contains(&b))
        })
    });
    if !plain || !keys_plain {
        return format!("{scheme}://***");
    }
    match query {
        Some(query) => format!("{scheme}://{path}?{}", redact_query(query)),
        None => format!("{scheme}://{path}"),
    }
}

/// A string that is no URL: maybe a mistyped one holding a password, or a
/// secret given by mistake. Shown whole only when it is a short word
/// (`memroy`), or a store's scheme and HOST:PORT[/DB] with its `//`
/// mistyped (`redis:/127.0.0.1:6379`), so that the typo shows; else only
/// a store's scheme before its first `:`, or nothing.
fn redact_not_a_url(url: &str) -> String {
    // A Redis address whose scheme was left out: hosts, ports and a
    // database number, no secret.
    if is_bare_address(url) {
        return url.to_owned();
    }
    let word = url.len() <= 24
        && url.starts_with(|c: char| c.is_ascii_lowercase())
        && url
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.".contains(&b));
    if word {
        return url.to_owned();
    }
    let Some((scheme, rest)) = url.split_once(':') else {
        return "***".to_owned();
    };
    if !STORE_SCHEMES.contains(&scheme) {
        return "***".to_owned();
    }
    // At least one `/` of the `//`: `redis:h:1` may be a password that
    // ran into the host, its `@` forgotten.
    let Some(rest) = rest.strip_prefix('/') else {
        return format!("{scheme}:***");
    };
    // Held to a bare address's narrower hosts: what follows may be
    // USER:PASSWORD.
    let rest = rest.trim_start_matches('/');
    if !rest.contains(',') && is_bare_address(rest) {
        return url.to_owned();
    }
    format!("{scheme}:***")
}

/// Schemes a store URL may have been meant to have: shown before `:***`
/// in a string that is no URL. Any other word there may be a user name.
const STORE_SCHEMES: &[&str] = &[
    "redis",
    "rediss",
    "redis+unix",
    "redis-cluster",
    "rediss-cluster",
    "unix",
    "valkey",
    "valkeys",
];

/// A Redis Cluster URL's scheme, over TCP or TLS.
fn is_cluster_scheme(scheme: &str) -> bool {
    scheme == "redis-cluster" || scheme == "rediss-cluster"
}

/// A URL scheme: a letter, then letters, digits, `+`, `-` or `.`.
fn is_scheme(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_alphabetic())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
}

/// A query with its credentials hidden: a key the client reads as `pass`,
/// `password`, `user` or `username` (in any case, percent-encoded or not)
/// keeps its name; only `db=<digits>` and `protocol=` one of the versions
/// the client takes are shown whole, and only before the first credential:
/// a credential may hold an unescaped `&`, and then what follows it, a
/// `&protocol=Tr0ub4dor` or `&db=31337` as well, is the rest of it.
fn redact_query(query: &str) -> String {
    let mut after_credential = false;
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let decoded = percent_encoding::percent_decode_str(key)
                .decode_utf8_lossy()
                .to_ascii_lowercase();
            let shown = match decoded.as_str() {
                "pass" | "password" | "user" | "username" => {
                    after_credential = true;
                    return format!("{decoded}=***");
                }
                "db" => !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()),
                "protocol" => ["2", "3", "resp2", "resp3"]
                    .iter()
                    .any(|v| value.eq_ignore_ascii_case(v)),
                _ => false,
            };
            if shown && !after_credential {
                pair.to_owned()
            } else {
                "***".to_owned()
            }
        })
        .collect();
    pairs.join("&")
}

/// Whether `s` is `HOST:PORT` with a port from 1 to 65535, written
/// without a leading zero, and nothing else: digits that are no port
/// (`user:123456`) may be a password.
fn is_host_port(s: &str) -> bool {
    host_port_with(s, is_host)
}

/// Whether a message may show `node`, a cluster seed without its
/// credentials, as typed: a `HOST:PORT`, or a plain host alone, holds no
/// part of a password (a password holding `/` or `,` splits into what
/// looks like a seed and more).
pub(crate) fn is_showable_node(node: &str) -> bool {
    is_host_port(node) || is_plain_host(node)
}

/// [`is_host_port`], each host one `host` accepts.
fn host_port_with(s: &str, host: fn(&str) -> bool) -> bool {
    s.rsplit_once(':').is_some_and(|(name, port)| {
        host(name) && (is_port(port) || (is_ip_literal(name) && is_mistyped_port(port)))
    })
}

/// An IPv4 address, or an IPv6 address in brackets: no user name, so what
/// follows its `:` is a port, however mistyped.
fn is_ip_literal(host: &str) -> bool {
    let v6 = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
    match v6 {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => host.parse::<std::net::Ipv4Addr>().is_ok(),
    }
}

/// Digits that are no port (`0`, `99999`, `06379`) but read as one typed
/// wrong, to be shown in the message that says so.
fn is_mistyped_port(port: &str) -> bool {
    (1..=10).contains(&port.len()) && port.bytes().all(|b| b.is_ascii_digit())
}

/// A port from 1 to 65535, written without a leading zero.
fn is_port(port: &str) -> bool {
    !port.starts_with('0')
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u16>().is_ok_and(|p| p > 0)
}

/// A name or IPv4 address, or an IPv6 address in brackets.
fn is_host(host: &str) -> bool {
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => {
            !v6.is_empty()
                && v6
                    .chars()
                    .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.')
        }
        None => {
            !host.is_empty()
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
        }
    }
}

/// `user:password` to `***:***`, `:password` (or nothing) to `:***`, a
/// user alone to `***`.
fn redact_userinfo(userinfo: &str) -> &'static str {
    if userinfo.starts_with(':') || userinfo.is_empty() {
        ":***"
    } else if userinfo.contains(':') {
        "***:***"
    } else {
        "***"
    }
}

/// The forms [`RedisStore::connect`](crate::RedisStore::connect) takes, for
/// error messages.
pub(crate) const FORMS: &str = "redis://[[USER]:PASSWORD@]HOST:PORT[/DB], \
     redis+unix:///PATH[?db=DB&user=USER&pass=PASSWORD], \
     redis-cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...], or over TLS \
     rediss://[[USER]:PASSWORD@]HOST:PORT[/DB] and \
     rediss-cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]";

/// What is wrong with the query of a one-node URL, if anything. redis-rs
/// reads a few query fields (`protocol` on `redis://` and `rediss://`;
/// `db`, `user`, `pass` and `protocol` on `redis+unix://`) and ignores the
/// rest without a word, so `redis://HOST:PORT?db=3` would count in
/// database 0, and `?password=` would send no password. A `rediss://`
/// URL's fragment is refused too: `#insecure` would ask redis-rs to skip
/// the certificate checks, which this store never does; and so is any
/// other URL's, which redis-rs ignores. `shown`: the URL
/// without its credentials. A port that is no port is named
/// ([`port_error`]); any other URL that does not parse is left to
/// redis-rs's message. So is the path, but for a database that is no number
/// (`redis://HOST:PORT/x`), which redis-rs refuses only when connecting,
/// as an "invalid client config".
pub(crate) fn query_error(url: &str, shown: &str) -> Option<String> {
    if let Some(e) = port_error(url, shown) {
        return Some(e);
    }
    let parsed = ::url::Url::parse(url).ok()?;
    let scheme = parsed.scheme();
    let unix = scheme == "redis+unix";
    if let Some(e) = (!unix).then(|| db_error(url)).flatten() {
        return Some(e);
    }
    if scheme == "rediss" && parsed.fragment().is_some() {
        return Some(format!(
            "{shown:?}: a rediss:// URL takes no #fragment: the server's certificate is always \
             checked (#insecure is not taken); to trust a private CA, name its PEM file in \
             SSL_CERT_FILE (or tls_ca_file in the store's options)"
        ));
    }
    // redis-rs ignores it, so a part of the address typed after a `#`
    // (or a comment pasted with it) would go without a word.
    if parsed.fragment().is_some() {
        return Some(format!(
            "{shown:?}: a {scheme}:// URL takes no #fragment, and everything after the # would \
             be ignored: remove it (a password holding # is written %23)"
        ));
    }
    // A query reads `+` as a space (form encoding), so a base64-made
    // password would be sent with spaces in it and refused as wrong, with
    // nothing to point at the `+`.
    if let Some(field) = unix
        .then(|| parsed.query())
        .flatten()
        .into_iter()
        .flat_map(|query| query.split('&'))
        .filter(|pair| pair.contains('+'))
        .find_map(|pair| {
            ["user", "pass"].into_iter().find(|field| {
                pair.strip_prefix(field)
                    .is_some_and(|rest| rest.starts_with('='))
            })
        })
    {
        return Some(format!(
            "{shown:?}: the field {field:?} holds a +, which a query reads as a space: write \
             it %2B (and & as %26, / as %2F, % as %25)"
        ));
    }
    let taken: &[&str] = if unix {
        &["db", "user", "pass", "protocol"]
    } else {
        &["protocol"]
    };
    let (field, _) = parsed
        .query_pairs()
        .find(|(field, _)| !taken.contains(&field.as_ref()))?;
    // Only a field name a user would mean is echoed: anything else typed
    // after the `?` may be a secret.
    let named = match field.as_ref() {
        f @ ("db" | "user" | "username" | "pass" | "password") => format!("the field {f:?}"),
        _ => "a field".to_owned(),
    };
    let instead = match (unix, field.as_ref()) {
        (true, _) => "a redis+unix:// URL takes ?db=DB&user=USER&pass=PASSWORD".to_owned(),
        (false, "db") => format!("write the database as the path: {scheme}://HOST:PORT/DB"),
        (false, "user" | "username" | "pass" | "password") => format!(
            "write the credentials before the host: {scheme}://USER:PASSWORD@HOST:PORT, or \
             {scheme}://:PASSWORD@HOST:PORT"
        ),
        (false, _) => format!("write {scheme}://[[USER]:PASSWORD@]HOST:PORT[/DB], with no query"),
    };
    Some(format!(
        "{shown:?}: its query has {named} that is not read, so it would be ignored; {instead}"
    ))
}

/// What is wrong with a one-node TCP URL's port, if it is a number that
/// is no port (0, or above 65535): redis-rs's own message does not name
/// it. The host and port are what follows the last `@`, so a password
/// holding `/`, `:` or `@` unencoded (which has an error of its own) is
/// not mistaken for them.
fn port_error(url: &str, shown: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    if !matches!(scheme, "redis" | "rediss") {
        return None;
    }
    let host_port = rest.rsplit_once('@').map_or(rest, |(_, after)| after);
    let host_port = host_port.split(['/', '?', '#']).next()?;
    let (_, port) = host_port.rsplit_once(':')?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    match port.parse::<u32>() {
        Ok(1..=65535) => None,
        _ => Some(format!(
            "{shown:?}: its port is not a number from 1 to 65535; write {scheme}://HOST:PORT \
             with Redis's port (6379 by default)"
        )),
    }
}

/// What is wrong with a one-node URL's `/DB`, if it is no number. The
/// part after the `/` is not shown, nor is the URL when anything after
/// that `/` could be the rest of a password that holds a `/` (an `@`
/// there): a password typed where the database goes must not be echoed.
fn db_error(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    let main = rest.split(['?', '#']).next().unwrap_or(rest);
    let (authority, db) = main.split_once('/')?;
    // An `@` after the `/`: the `/` may be inside credentials.
    let in_credentials = rest
        .split_once('/')
        .is_some_and(|(_, after)| after.contains('@'));
    // Digits past i64 (redis-rs's type for it) would fail at connect.
    let number = db.bytes().all(|b| b.is_ascii_digit()) && db.parse::<i64>().is_ok();
    if db.is_empty() || number || in_credentials {
        return None;
    }
    let shown = redact_url(&format!("{scheme}://{authority}"));
    Some(format!(
        "\"{shown}/***\": what follows HOST:PORT/ must be a database number (0 to 15 on a \
         default Redis), or nothing for database 0; write {scheme}://HOST:PORT/DB (the part \
         after the / is not shown, in case it is a password)"
    ))
}

/// Whether `url` is of a form the store takes (by its scheme alone; the
/// rest is checked when connecting): for command-line parsers, so that a
/// wrong form is refused before anything runs, with [`url_form_error`].
pub fn is_store_url(url: &str) -> bool {
    [
        "redis://",
        "rediss://",
        "redis+unix://",
        "redis-cluster://",
        "rediss-cluster://",
    ]
    .iter()
    .any(|p| url.starts_with(p))
}

/// Whether `url` is a Redis Cluster URL (`redis-cluster://` or, over TLS,
/// `rediss-cluster://`).
pub fn is_cluster_url(url: &str) -> bool {
    url.starts_with("redis-cluster://") || url.starts_with("rediss-cluster://")
}

/// What is wrong with `url` that shows without connecting, if anything: a
/// form the store does not take ([`url_form_error`]), a query field
/// that a one-node URL would ignore (`redis://HOST:PORT?db=3` would count
/// in database 0), or an address that cannot be read (no host, a cluster
/// seed without a port). For command-line parsers, so that such a URL is refused
/// before anything runs; [`RedisStore::connect`](crate::RedisStore::connect)
/// refuses the same URLs.
///
/// ```
/// use ratewarden_redis::url_error;
/// assert_eq!(url_error("redis://127.0.0.1:6379/3"), None);
/// assert!(url_error("redis://127.0.0.1:6379?db=3").unwrap().contains("redis://HOST:PORT/DB"));
/// assert_eq!(url_error("rediss://redis.example.com:6380"), None);
/// assert!(url_error("redis+unix:///run/r.sock?pass=a+b").unwrap().contains("%2B"));
/// assert_eq!(url_error("redis+unix:///run/r.sock?pass=a%2Bb"), None);
/// assert!(url_error("redis://127.0.0.1:99999").unwrap().contains("1 to 65535"));
/// assert!(url_error("redis://127.0.0.1:0").unwrap().contains("1 to 65535"));
/// assert!(url_error("redis://:pw@127.0.0.1:99999").unwrap().contains("1 to 65535"));
/// assert_eq!(url_error("redis://:pw@127.0.0.1:6379"), None);
/// assert!(url_error("rediss://127.0.0.1:6380#insecure").unwrap().contains("SSL_CERT_FILE"));
/// assert!(url_error("redis://127.0.0.1:6379#2").unwrap().contains("takes no #fragment"));
/// assert!(url_error("redis+unix:///run/r.sock#x").unwrap().contains("takes no #fragment"));
/// assert!(url_error("http://127.0.0.1:6379").unwrap().contains("not a Redis address"));
/// assert!(url_error("redis://").unwrap().contains("not a Redis address"));
/// assert!(url_error("redis://h:1/0?protocol=4").unwrap().contains("protocol takes 2, 3, resp2"));
/// assert!(url_error("redis-cluster://").unwrap().contains("names no node"));
/// assert!(url_error("redis-cluster://127.0.0.1").unwrap().contains("needs a host and a port"));
/// assert!(url_error("redis-cluster://127.0.0.1:7000,,127.0.0.1:7001")
///     .unwrap()
///     .contains("seed 2 of the URL is empty"));
/// assert!(url_error("redis-cluster://127.0.0.1:7000,").unwrap().contains("seed 2 of the URL is empty"));
/// assert_eq!(url_error("rediss-cluster://:pw@127.0.0.1:7000,127.0.0.1:7001"), None);
/// assert!(url_error("redis-cluster://127.0.0.1:7000,:pw@127.0.0.1:7001")
///     .unwrap()
///     .contains("write them once, on the first seed"));
/// assert!(url_error("redis-cluster://:pw@127.0.0.1:7000,alice:pw@127.0.0.1:7001")
///     .unwrap()
///     .contains("seed 2 of the URL carries a user or password other than the first seed's"));
/// assert_eq!(url_error("redis-cluster://u:pw@127.0.0.1:7000,u:pw@127.0.0.1:7001"), None);
/// ```
pub fn url_error(url: &str) -> Option<String> {
    if !is_store_url(url) {
        return Some(url_form_error(url));
    }
    if is_cluster_url(url) {
        return crate::store::address_error(url);
    }
    query_error(url, &redact_url(url)).or_else(|| crate::store::address_error(url))
}

/// Whether `url` looks meant for Redis (a Redis-like scheme) though
/// [`is_store_url`] refuses it: such a URL gets [`url_form_error`], while
/// anything else is an unknown store to its caller.
pub fn is_redis_like_url(url: &str) -> bool {
    ["redis", "valkey", "unix://"]
        .iter()
        .any(|p| url.starts_with(p))
        || is_bare_address(url)
}

/// Whether `s` is a Redis address with its scheme left out:
/// `HOST:PORT[/DB]`, or a cluster's `HOST:PORT,HOST:PORT...`. Narrower
/// than a URL's hosts, since such a string is shown whole: each host an IP
/// address or a name of lower-case letters, digits, `.` and `-` (no
/// `USER:PASSWORD` of mixed case or `_`), each port 1 to 65535 written
/// without a leading zero.
fn is_bare_address(s: &str) -> bool {
    // Digits past i64 (redis-rs's type for a database) are no database.
    let db_fits = s
        .split_once('/')
        .is_none_or(|(_, db)| db.parse::<i64>().is_ok());
    !s.contains("://") && db_fits && host_ports_then_db(s, true, is_plain_host)
}

/// A host a bare address may show: an IP address, or a name of lower-case
/// letters, digits, `.` and `-`.
fn is_plain_host(host: &str) -> bool {
    host.strip_prefix('[')
        .is_some_and(|h| h.ends_with(']') && is_host(host))
        || (!host.is_empty()
            && host
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.".contains(&b)))
}

/// What is wrong with a store URL whose scheme is not taken, saying what
/// to write instead.
///
/// ```
/// use ratewarden_redis::url_form_error;
/// assert!(url_form_error("127.0.0.1:6379").contains("write redis://127.0.0.1:6379"));
/// assert!(url_form_error("a:7000,b:7001").contains("write redis-cluster://a:7000,b:7001"));
/// ```
pub fn url_form_error(url: &str) -> String {
    if is_bare_address(url) {
        let (seeds, db) = url.split_once('/').unwrap_or((url, ""));
        let instead = if seeds.contains(',') {
            let db_note = if db.is_empty() {
                ""
            } else {
                ", with no /DB: a cluster has only database 0"
            };
            format!(
                "write redis-cluster://{seeds} for a Redis Cluster (rediss-cluster:// over \
                 TLS){db_note}"
            )
        } else if db.is_empty() {
            format!(
                "write redis://{url} for one Redis (rediss:// over TLS), or \
                 redis-cluster://{url} for a Redis Cluster"
            )
        } else {
            format!("write redis://{url} (rediss:// over TLS)")
        };
        return format!("{url:?} has no scheme; {instead}");
    }
    let shown = quoted_or_hidden(&redact_url(url), "the address given");
    format!("{shown} is not a Redis address; write {FORMS}")
}

/// A URL redacted by [`redact_url`] as an error names it: quoted, or, when
/// none of it could be shown, as `what` said to be hidden (a bare `"***"`
/// reads as what the user wrote); `what` may be empty, where the message
/// names the value already.
///
/// ```
/// use ratewarden_redis::quoted_or_hidden;
/// assert_eq!(quoted_or_hidden("redis://***@h:1", "it"), "\"redis://***@h:1\"");
/// assert!(quoted_or_hidden("***", "the store given").starts_with("the store given (not shown"));
/// assert!(quoted_or_hidden("***", "").starts_with("(not shown"));
/// ```
pub fn quoted_or_hidden(redacted: &str, what: &str) -> String {
    if redacted == "***" {
        let hidden = "(not shown: text that does not read as a URL may hold a password)";
        if what.is_empty() {
            hidden.to_owned()
        } else {
            format!("{what} {hidden}")
        }
    } else {
        format!("{redacted:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    /// Passwords holding every character a URL gives a meaning to, in
    /// every form the store takes: no part of one is ever shown.
    #[test]
    fn no_part_of_a_password_is_ever_shown() {
        let specials = [
            "/",
            "?",
            "#",
            "@",
            ",",
            "&",
            ":",
            "=",
            "%",
            ";",
            "",
            "://",
            "@x:1,",
            "@[::1]:2,",
            "?pass=",
            "&db=",
            ",h:1,",
        ];
        let hidden = |url: &str| {
            // The messages about a URL's form show it too.
            let messages = [
                redact_url(url),
                super::url_error(url).unwrap_or_default(),
                super::url_form_error(url),
            ];
            for shown in messages {
                for part in ["qqq", "zzz", "xxx"] {
                    assert!(!shown.contains(part), "{url} shown as {shown}");
                }
            }
        };
        let mut tried = 0;
        for a in specials {
            for b in specials {
                let password = format!("qqq{a}zzz{b}xxx");
                for url in [
                    format!("redis://:{password}@127.0.0.1:6379/2"),
                    format!("redis://app:{password}@h:1"),
                    format!("redis://{password}:pw@h:1"),
                    format!("redis://:{password}@[::1]:6379"),
                    format!("redis:/:{password}@h:1"),
                    format!("redis-cluster://:{password}@a:1,b:2"),
                    format!("redis-cluster://u:{password}@a:1,u:{password}@b:2"),
                    format!("redis-cluster://{password}@a:1,b:2"),
                    format!("redis+unix:///run/r.sock?pass={password}&db=1"),
                    format!("redis+unix:///run/r.sock?user=u&pass={password}"),
                    format!("redis+unix:///run/r.sock?PASS={password}"),
                    format!("redis+unix:///run/r.sock?pa%73s={password}"),
                    format!("redis+unix:///run/a?b/r.sock?pass={password}"),
                    format!("redis+unix://u:{password}@localhost/run/r.sock"),
                    format!("redis+unix:/run/r.sock?pass={password}"),
                    format!("redis+unix:///run/r.sock&pass={password}"),
                    format!("redis://h:1/0&password={password}"),
                    format!("redis://:a/b@h:1/0&password={password}"),
                    // A password holding `&protocol=!` (or `?protocol=!`),
                    // whose rest redis-rs names in its error.
                    format!("redis+unix:///run/r.sock?pass=a&protocol=!{password}"),
                    format!("redis://:a@h:1/0?protocol=!{password}"),
                    format!("redis-cluster://:a@h:1,h:2?protocol=!{password}"),
                    // Or the rest of one, letters and digits alone.
                    "redis+unix:///run/r.sock?pass=a&protocol=qqq0zzz1xxx".to_owned(),
                    "redis+unix:///run/r.sock?user=qqq&db=0&protocol=zzz&db=1xxx".to_owned(),
                    "redis+unix:///run/r.sock?pass=a&db=31337&qqq=zzz&xxx".to_owned(),
                ] {
                    tried += 1;
                    hidden(&url);
                }
                // With no real `@` before the host (escaped, typed as
                // another character, or forgotten), or no host at all, or
                // a secret given where the URL goes. A password holding an
                // `@` and no host after it reads as USER:PASSWORD@HOST, so
                // these forms take the others only.
                if password.contains('@') {
                    continue;
                }
                for url in [
                    format!("redis://:{password}"),
                    format!("redis://default:{password}"),
                    format!("redis://:{password}%40127.0.0.1:6379"),
                    format!("redis://default:{password}\u{ff20}127.0.0.1:6379"),
                    format!("redis-cluster://:{password}%40a:1,b:2"),
                    format!("redis:/:{password}"),
                    format!("redis:/default:{password}"),
                    format!("redis:/:{password}%40h:1"),
                    format!("redis:/:{password}\u{ff20}h:1"),
                    format!("redis:h:1/{password}"),
                    format!("x/{password}"),
                    // Typed where the database goes, or with no scheme.
                    format!("redis://h:1/{password}"),
                    format!("rediss://u:pw@h:1/{password}"),
                    format!("h:1/{password}"),
                ] {
                    tried += 1;
                    hidden(&url);
                }
            }
        }
        assert!(tried > 6000);
    }

    /// A Redis address with its scheme left out is shown, with the URL to
    /// write; a USER:PASSWORD given as the whole store is not.
    #[test]
    fn bare_addresses_are_shown_and_credentials_are_not() {
        for shown in [
            "127.0.0.1:6379",
            "localhost:6379/2",
            "redis-1.internal:7000,redis-2.internal:7001",
            "[::1]:6379",
        ] {
            assert_eq!(redact_url(shown), shown);
            assert!(
                super::url_form_error(shown).contains(&format!("://{shown}")),
                "{shown}"
            );
        }
        // With a mistyped `//`, or as a URL's host, digits that are no
        // port are hidden too.
        for (url, shown) in [
            ("redis:/default:123456", "redis:***"),
            ("redis:/S3cr3t_Pa55.word:2024", "redis:***"),
            ("valkey:/Secret_1:70000", "valkey:***"),
            ("redis://default:123456", "redis://***"),
            ("redis://user:06379", "redis://***"),
            ("redis:/127.0.0.1:6379/2", "redis:/127.0.0.1:6379/2"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
        assert!(!super::url_form_error("pw:1/99999999999999999999").contains("pw"));
        let e = super::url_form_error("a:7000,b:7001/2");
        assert!(
            e.contains("write redis-cluster://a:7000,b:7001 for") && e.contains("no /DB"),
            "{e}"
        );
        for hidden in [
            "default:123456",
            "S3cr3t_Pa55.word:2024",
            "Admin:6379",
            "user:06379",
            "pw:0",
            "host:65536",
        ] {
            assert_eq!(redact_url(hidden), "***", "{hidden}");
            assert!(!super::url_form_error(hidden).contains(hidden), "{hidden}");
        }
        // Hidden whole, the text is said to be hidden rather than quoted
        // as "***", which reads as what the user wrote.
        let e = super::url_form_error("not a url");
        assert!(
            e.starts_with("the address given (not shown: text that does not read as a URL")
                && !e.contains("***"),
            "{e}"
        );
    }

    /// Well-formed URLs stay readable: only their credentials go.
    #[test]
    fn well_formed_urls_keep_their_nodes() {
        for (url, shown) in [
            ("redis://127.0.0.1:6379/2", "redis://127.0.0.1:6379/2"),
            ("redis://:p%2Fw@[::1]:6379", "redis://:***@[::1]:6379"),
            ("redis://u:p%40w@h:1/3", "redis://***:***@h:1/3"),
            (
                "redis-cluster://u:p@a:1,u:p@b:2,c:3",
                "redis-cluster://***:***@a:1,***:***@b:2,c:3",
            ),
            (
                "redis+unix:///run/r.sock?db=2",
                "redis+unix:///run/r.sock?db=2",
            ),
            (
                "redis+unix:///run/r.sock?db=2&pass=x&protocol=resp3",
                "redis+unix:///run/r.sock?db=2&pass=***&***",
            ),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    /// Deterministic xorshift64*.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            self.0 = x;
            x.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn pick<'a, T: ?Sized>(&mut self, xs: &'a [&'a T]) -> &'a T {
            xs[self.below(xs.len())]
        }
        fn chance(&mut self, percent: u64) -> bool {
            self.next() % 100 < percent
        }
    }

    /// Marker runs: password chunks. None appears in any template.
    const CHUNKS: [&str; 4] = ["qqq", "zzz", "xxx", "jjj"];
    /// Marker for a user name (a credential too, reported apart).
    const USER_MARK: &str = "www";

    const SPECIALS: &[&str] = &[
        "!",
        "\"",
        "#",
        "$",
        "%",
        "&",
        "'",
        "(",
        ")",
        "*",
        "+",
        ",",
        "-",
        ".",
        "/",
        ":",
        ";",
        "<",
        "=",
        ">",
        "?",
        "@",
        "[",
        "\\",
        "]",
        "^",
        "_",
        "`",
        "{",
        "|",
        "}",
        "~",
        " ",
        "\t",
        "\n",
        "\r",
        "\u{ff20}",
        "\u{fe6b}",
        "\u{ff0f}",
        "\u{ff1a}",
        "%40",
        "%3A",
        "%2F",
        "%3F",
        "%25",
        "%3D",
        "%26",
        "://",
        "@h:1,",
        "@[::1]:2,",
        "?pass=",
        "&db=",
        ",h:1,",
        "123",
        "",
        "",
        "",
    ];

    fn password(rng: &mut Rng) -> String {
        let mut p = String::new();
        if rng.chance(15) {
            p.push_str(rng.pick(&["123", "6379", "0", "9876"]));
            p.push_str(rng.pick(SPECIALS));
        } else if rng.chance(20) {
            p.push_str(rng.pick(SPECIALS));
        }
        let n = 1 + rng.below(3);
        for i in 0..n {
            p.push_str(CHUNKS[(i + rng.below(4)) % 4]);
            if i + 1 < n || rng.chance(25) {
                p.push_str(rng.pick(SPECIALS));
                if rng.chance(25) {
                    p.push_str(rng.pick(SPECIALS));
                }
            }
        }
        p
    }

    fn user(rng: &mut Rng) -> String {
        match rng.below(6) {
            0 => format!("{USER_MARK}{}", rng.pick(SPECIALS)),
            1 => USER_MARK.to_owned(),
            2 => "app".to_owned(),
            3 => "default".to_owned(),
            4 => format!("{USER_MARK}.ops"),
            _ => "".to_owned(),
        }
    }

    const SCHEMES: &[&str] = &[
        "redis",
        "redis",
        "redis+unix",
        "redis-cluster",
        "rediss",
        "unix",
        "valkey",
        "REDIS",
        "Redis+Unix",
        "redis-sentinel",
        "valkeys",
    ];
    /// `://` as typed or mistyped.
    const SEPS: &[&str] = &[
        "://",
        "://",
        "://",
        ":/",
        ":",
        ":///",
        ":////",
        ":\\\\",
        "//",
        ":://",
        " ://",
        ":/ /",
        "\u{ff1a}//",
        ":\u{ff0f}\u{ff0f}",
        ": //",
    ];
    const HOSTS: &[&str] = &[
        "127.0.0.1:6379",
        "h:1",
        "[::1]:6379",
        "::1:6379",
        "localhost",
        "a:1,b:2",
        "h:1/2",
        "/run/r.sock",
        "my-redis.example.com:6379/0",
        "10.0.0.1:6379?protocol=resp3",
        "",
    ];
    const AT: &[&str] = &[
        "@", "@", "%40", "\u{ff20}", "\u{fe6b}", "", " ", "@@", "#", "/",
    ];

    struct Case {
        input: String,
        shape: &'static str,
        /// No host follows the password (for the accepted `@`-in-password limit).
        no_host_after: bool,
        password: String,
        user: String,
    }

    fn url_case(rng: &mut Rng) -> Case {
        let scheme = rng.pick(SCHEMES);
        let sep = rng.pick(SEPS);
        let p = password(rng);
        let u = user(rng);
        let h = rng.pick(HOSTS);
        let at = rng.pick(AT);
        let q = rng.pick(&[
            "password",
            "pass",
            "user",
            "username",
            "PASSWORD",
            "Pass",
            "pa%73s",
            "auth",
            "token",
            "requirepass",
        ]);
        let (body, shape, no_host_after): (String, &'static str, bool) = match rng.below(26) {
            0 => (
                format!(":{p}{at}{h}"),
                ":P@H",
                h.is_empty() || at != "@" && at != "@@",
            ),
            1 => (
                format!("{u}:{p}{at}{h}"),
                "U:P@H",
                h.is_empty() || at != "@" && at != "@@",
            ),
            2 => (
                format!("{p}{at}{h}"),
                "P@H",
                h.is_empty() || at != "@" && at != "@@",
            ),
            3 => (format!(":{p}"), ":P", true),
            4 => (format!("{u}:{p}"), "U:P", true),
            5 => (p.to_string(), "P", true),
            6 => (format!(":{p}@@{h}"), ":P@@H", h.is_empty()),
            7 => (format!("{u}:{p}@x@{h}"), "U:P@x@H", h.is_empty()),
            8 => (format!("{h}?{q}={p}"), "H?q=P", false),
            9 => (format!("{h}?db=0&{q}={p}"), "H?db&q=P", false),
            10 => (format!("{h}/0&{q}={p}"), "H/0&q=P", false),
            11 => (format!("{h}#{p}"), "H#P", false),
            12 => (format!("{h}?{q}={p}#frag"), "H?q=P#", false),
            13 => (format!(":{p}@a:1,b:2"), "cl :P@a,b", false),
            14 => (format!("a:1,:{p}@b:2"), "cl a,:P@b", false),
            15 => (format!(":{p}@a:1,:{p}zzz@b:2"), "cl mixed", false),
            16 => (format!("{u}:{p}@a:1,{u}:{p}@b:2"), "cl same", false),
            17 => (format!(":{p}@a:1,:{p}{at}b:2"), "cl esc2", at != "@"),
            18 => (format!("/run/r.sock?{q}={p}"), "unix ?q=P", false),
            19 => (format!("/run/r.sock&{q}={p}"), "unix &q=P", false),
            20 => (format!("{u}:{p}@/run/r.sock"), "unix U:P@/path", false),
            21 => (
                format!(
                    "/run/r.sock{}{q}{}{p}",
                    rng.pick(&["#", ";", "%3F", " ", "\u{ff1f}"]),
                    rng.pick(&["=", "%3D", ":", " "])
                ),
                "unix mistyped ?",
                false,
            ),
            22 => (
                format!("/run/r.sock?db=1&{q}={p}&protocol=resp3"),
                "unix db&q=P",
                false,
            ),
            23 => (
                format!("{h}{}{p}", rng.pick(&[" ", "\t", "\n", ",", ";", "|"])),
                "H sepP",
                false,
            ),
            24 => (format!("{h}?{p}"), "H?P", false),
            _ => (format!("{u}@{h}?{q}={p}"), "U@H?q=P", false),
        };
        let mut input = format!("{scheme}{sep}{body}");
        if rng.chance(10) {
            input = format!("{}{input}", rng.pick(&[" ", "\t", "\n", "  "]));
        }
        if rng.chance(10) {
            input.push_str(rng.pick(&[" ", "\t", "\n", "\r\n"]));
        }
        Case {
            input,
            shape,
            no_host_after,
            password: p,
            user: u,
        }
    }

    const B64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const B64URL: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    const HEX: &[u8] = b"0123456789abcdef";
    const PRINT: &[u8] =
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789!#$%*+,-./:;<=>?@[]^_{|}~";

    fn token(rng: &mut Rng, alphabet: &[u8], len: usize) -> String {
        (0..len)
            .map(|_| alphabet[rng.below(alphabet.len())] as char)
            .collect()
    }
    fn tok(rng: &mut Rng, alphabet: &[u8], base: usize, extra: usize, mul: usize) -> String {
        let n = base + mul * rng.below(extra);
        token(rng, alphabet, n)
    }

    /// A secret given where a URL goes: (input, secret, shape).
    fn bare_case(rng: &mut Rng) -> (String, String, &'static str) {
        let (secret, shape) = match rng.below(9) {
            0 => {
                let t = tok(rng, B64, 12, 10, 4);
                (t, "base64")
            }
            1 => {
                let n = 4 * (3 + rng.below(10)) - 1 - rng.below(2);
                let mut t = token(rng, B64, n);
                while !t.len().is_multiple_of(4) {
                    t.push('=');
                }
                (t, "base64 padded")
            }
            2 => {
                let a = token(rng, B64URL, 20);
                let b = token(rng, B64URL, 40);
                let c = token(rng, B64URL, 43);
                (format!("eyJ{a}.eyJ{b}.{c}"), "jwt")
            }
            3 => (tok(rng, HEX, 32, 2, 32), "hex"),
            4 => (
                format!(
                    "{}{}",
                    rng.pick(&["sk-", "ghp_", "xoxb-", "AKIA", "glpat-", "sk_live_"]),
                    token(rng, B64URL, 24)
                ),
                "api key",
            ),
            5 => (tok(rng, PRINT, 12, 20, 1), "printable"),
            6 => (
                format!("{}:{}", token(rng, B64URL, 8), token(rng, PRINT, 16)),
                "user:pass",
            ),
            7 => (
                format!("{}%40{}", token(rng, PRINT, 12), token(rng, HEX, 4)),
                "escaped",
            ),
            _ => (
                token(rng, b"abcdefghijklmnopqrstuvwxyz0123456789", 16),
                "alnum",
            ),
        };
        let input = match rng.below(5) {
            0 => format!(" {secret}"),
            1 => format!("{secret}\n"),
            _ => secret.clone(),
        };
        (input, secret, shape)
    }

    fn shown_run(shown: &str, secret: &str, n: usize) -> Option<String> {
        let cs: Vec<char> = secret.chars().collect();
        if cs.len() < n {
            return None;
        }
        cs.windows(n)
            .map(|w| w.iter().collect::<String>())
            .find(|w| w.chars().any(|c| c.is_alphanumeric()) && shown.contains(w.as_str()))
    }

    /// What a store URL of a form the store takes, or a common typo of one,
    /// is shown as.
    #[test]
    fn readable_urls_are_shown_as_far_as_they_are_sure() {
        for (url, shown) in [
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
            ("redis://localhost", "redis://localhost"),
            ("redis://h:1/", "redis://h:1/"),
            ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
            ("redis://h:1?protocol=resp3", "redis://h:1?protocol=resp3"),
            ("redis://h:1/2?db=3", "redis://h:1/2?db=3"),
            ("redis://app:pw@h:1/2", "redis://***:***@h:1/2"),
            ("redis://app@h:1", "redis://***@h:1"),
            ("redis-cluster://a:1,b:2", "redis-cluster://a:1,b:2"),
            (
                "redis-cluster://:pw@a:1,b:2",
                "redis-cluster://:***@a:1,b:2",
            ),
            (
                "redis+unix:///run/redis.sock",
                "redis+unix:///run/redis.sock",
            ),
            (
                "redis+unix:///run/r.sock?db=1&user=u&pass=pw",
                "redis+unix:///run/r.sock?db=1&user=***&pass=***",
            ),
            ("rediss://h:6379", "rediss://h:6379"),
            ("etcd://127.0.0.1:2379", "etcd://127.0.0.1:2379"),
            ("memroy", "memroy"),
            ("redis:/127.0.0.1:6379", "redis:/127.0.0.1:6379"),
            ("redis:///h:1/2", "redis://***"),
            ("redis:h:1", "redis:***"),
            ("app:pw@h:1", "***"),
            ("S3cr/3tPw+x", "***"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    /// Each check of what reads for sure, held by a case only it decides:
    /// anything that fails one is hidden.
    #[test]
    fn only_what_reads_for_sure_is_shown() {
        for (url, shown) in [
            // A cluster's seeds each need a port: one without may be a
            // password whose `@` was forgotten.
            ("redis-cluster://S3cretPw,h:1", "redis-cluster://***"),
            // Credentials after a seed without them: `app:6379` may be a
            // user and the start of a password holding `,`.
            (
                "redis-cluster://app:6379,:tail@b:2",
                "redis-cluster://***@b:2",
            ),
            // A `,` splits seeds on a cluster only: on one node,
            // `app:9876,a` may be USER:PASSWORD with its `@` forgotten.
            ("redis://app:9876,a:6379", "redis://***"),
            ("rediss://app:9876,a:6379", "rediss://***"),
            // Brackets hold an IPv6 address (IPv4-mapped too), nothing else,
            // in a URL or in a bare address.
            (
                "redis://[::ffff:127.0.0.1]:6379",
                "redis://[::ffff:127.0.0.1]:6379",
            ),
            ("redis://[S3cret]:6379", "redis://***"),
            ("[S3cret]:6379", "***"),
            // A short lower-case word may hold digits: shown, so that a
            // typo reads.
            ("memory2", "memory2"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    /// A database that is no number (a negative one, or one past i64,
    /// redis-rs's type for it) is refused before connecting, with that
    /// part hidden: redis-rs would refuse it only at connect.
    #[test]
    fn a_database_that_is_no_number_is_refused_hidden() {
        for url in [
            "redis://h:1/x",
            "redis://h:1/-1",
            "redis://h:1/99999999999999999999",
        ] {
            let e = super::url_error(url).unwrap_or_default();
            assert!(
                e.starts_with("\"redis://h:1/***\": what follows HOST:PORT/ must be a database"),
                "{url}: {e}"
            );
        }
        assert_eq!(super::url_error("redis://h:1/15"), None);
    }

    /// A query field a one-node URL would ignore is named when it is one
    /// a user would mean, and only then: anything else may be a secret.
    #[test]
    fn an_ignored_query_field_is_named_only_when_it_is_no_secret() {
        let e = super::url_error("redis://h:1?password=pw").unwrap_or_default();
        assert!(
            e.contains("its query has the field \"password\" that is not read"),
            "{e}"
        );
        let e = super::url_error("redis://h:1?S3cret").unwrap_or_default();
        assert!(
            e.contains("its query has a field that is not read") && !e.contains("S3cret"),
            "{e}"
        );
    }

    /// A Redis-like scheme or a bare address gets the URL forms to write;
    /// anything else is another store's name.
    #[test]
    fn redis_like_urls_are_told_from_other_stores() {
        for url in [
            "valkey://h:1",
            "redis-sentinel://h:1",
            "unix:///run/r.sock",
            "127.0.0.1:6379",
        ] {
            assert!(super::is_redis_like_url(url), "{url}");
        }
        for url in ["memory", "etcd://h:1", "unix"] {
            assert!(!super::is_redis_like_url(url), "{url}");
        }
    }

    /// Many generated store strings holding marked secrets, typed and
    /// mistyped every way the generator knows (schemes, separators, escaped
    /// or look-alike `@`, credentials in queries and fragments, cluster seed
    /// lists, bare tokens given where the URL goes): no run of a secret is
    /// ever shown, but for the limits `redact_url` documents.
    #[test]
    fn no_secret_is_shown_however_the_url_is_mistyped() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut leaks = Vec::new();
        for _ in 0..60_000 {
            let c = url_case(&mut rng);
            let shown = redact_url(&c.input);
            let password = CHUNKS
                .iter()
                .any(|m| c.password.contains(m) && shown.contains(m));
            let user = c.user.contains(USER_MARK) && shown.contains(USER_MARK);
            // The documented limits: a word of letters and digits alone (so
            // typos read), and a password holding `@` with no host after it
            // (it reads as USER:PASSWORD@HOST).
            // A user name or password typed where the host or the
            // socket's path goes reads as one: shown as the host, right
            // after `://`.
            let as_host = shown.split_once("://").is_some_and(|(_, rest)| {
                let host = rest.trim_start_matches('/');
                let host = host
                    .split(['?', '/', ',', ':', '@'])
                    .next()
                    .unwrap_or_default();
                !host.is_empty()
                    && host
                        .chars()
                        .all(|ch| ch.is_ascii_alphanumeric() || "-._".contains(ch))
                    && CHUNKS.iter().chain([&USER_MARK]).any(|m| host.contains(m))
            });
            let word = c.input.chars().all(|ch| ch.is_ascii_alphanumeric()) || as_host;
            let at_no_host = c.password.contains('@')
                && (c.no_host_after || c.input.trim_end().ends_with(c.password.trim_end()));
            if (user && !as_host) || (password && !word && !at_no_host) {
                leaks.push((c.shape, c.input, shown));
            }
        }
        for _ in 0..20_000 {
            let (input, secret, shape) = bare_case(&mut rng);
            let shown = redact_url(&input);
            let word = input.trim().chars().all(|ch| ch.is_ascii_alphanumeric());
            if shown_run(&shown, &secret, 4).is_some() && !word {
                leaks.push((shape, input, shown));
            }
        }
        assert!(
            leaks.is_empty(),
            "{} shown, e.g. {:?}",
            leaks.len(),
            &leaks[..leaks.len().min(5)]
        );
    }
}
