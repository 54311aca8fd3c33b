//! Store URLs: which forms are taken, and how one is shown without its
//! credentials.

/// Hides the credentials of a store URL, so that it can be logged or put in
/// an error message: the user and password before `@` (in each node of a
/// `redis-cluster://` URL) become `***`, and every query value but `db` and
/// `protocol` (a `redis+unix://` URL keeps `pass=` and `user=` there)
/// becomes `***`. A URL that cannot be read for sure shows less: what
/// follows its last `@` when that is a list of HOST:PORT, or nothing but
/// its scheme (a `redis+unix://` URL with anything before its absolute
/// path or `@` in it, a query typed without its `?`, seeds that carry
/// credentials beside seeds that do not, a node with no `@` that is not
/// HOST or HOST:PORT). A string that is no URL is shown whole only when it
/// holds none of `@ ? = & /`, or is a scheme and HOST:PORT[/DB] with the
/// `//` mistyped, so that a typo shows but a secret given by mistake does
/// not.
///
/// ```
/// use ratewarden_redis::redact_url;
/// assert_eq!(redact_url("redis://:s3cret@127.0.0.1:6379/2"), "redis://:***@127.0.0.1:6379/2");
/// assert_eq!(redact_url("redis://app:s3cret@h:1"), "redis://***:***@h:1");
/// assert_eq!(
///     redact_url("redis-cluster://:pw@a:7000,:pw@b:7001"),
///     "redis-cluster://:***@a:7000,:***@b:7001"
/// );
/// assert_eq!(redact_url("redis+unix:///run/r.sock?pass=pw&db=1"), "redis+unix:///run/r.sock?pass=***&db=1");
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
/// // stand unescaped: only `db` and `protocol` values are shown.
/// assert_eq!(
///     redact_url("redis+unix:///run/r.sock?pass=s3cr@t&x&db=1"),
///     "redis+unix:///run/r.sock?pass=***&***&db=1"
/// );
/// // Not a URL, but maybe a mistyped one: nothing past its scheme when
/// // it could hold a password, else all of it, so the typo shows.
/// assert_eq!(redact_url("redis+unix:/run/r.sock?pass=pw"), "redis+unix:***");
/// assert_eq!(redact_url("redis:/:pw@127.0.0.1:6379"), "redis:***");
/// assert_eq!(redact_url("redis:/:pw"), "redis:***");
/// assert_eq!(redact_url("redis:/127.0.0.1:6379/2"), "redis:/127.0.0.1:6379/2");
/// // A node with no `@` that is no HOST[:PORT] may be a password whose
/// // `@` was escaped or forgotten: hidden whole.
/// assert_eq!(redact_url("redis://:pw%40127.0.0.1:6379"), "redis://***");
/// assert_eq!(redact_url("redis://localhost/1"), "redis://localhost/1");
/// ```
pub fn redact_url(url: &str) -> String {
    // A scheme is a letter, then letters, digits, `+`, `-` or `.`: a `://`
    // after anything else may be inside a password.
    let is_scheme = |s: &str| {
        s.starts_with(|c: char| c.is_ascii_alphabetic())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
    };
    let Some((scheme, rest)) = url.split_once("://").filter(|(s, _)| is_scheme(s)) else {
        // Not a URL at all: it may still be a mistyped one holding a
        // password, or a secret given by mistake, so show none of what
        // could be one. Shown whole: a word such as `memroy`, and a
        // scheme with `://` mistyped before HOST:PORT[/DB], so the typo
        // shows.
        let typo_before_host = url.split_once(':').is_some_and(|(scheme, rest)| {
            let rest = rest.trim_start_matches('/');
            let (authority, db) = rest.split_once('/').unwrap_or((rest, "0"));
            is_scheme(scheme)
                && looks_like_host_port(authority)
                && db.bytes().all(|b| b.is_ascii_digit())
        });
        if typo_before_host || !url.contains(['@', '?', '=', '&', '/']) {
            return url.to_owned();
        }
        return match url.split_once(':') {
            Some((scheme, _)) if is_scheme(scheme) => format!("{scheme}:***"),
            _ => "***".to_owned(),
        };
    };
    if scheme == "redis+unix" || scheme == "unix" {
        // A socket's credentials are in the query; user information before
        // the path is no form the store takes, and may be a password.
        let (path, query) = match rest.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (rest, None),
        };
        // The path is absolute (`redis+unix:///PATH`): anything before it
        // is an authority, which may hold user information.
        // `=` or `&` in the path: a query typed without its `?`.
        if !path.starts_with('/') || path.contains(['@', '=', '&']) {
            return format!("{scheme}://***");
        }
        return match query {
            Some(query) => format!("{scheme}://{path}?{}", redact_query(query)),
            None => url.to_owned(),
        };
    }
    if let Some((hidden, after)) = rest.rsplit_once('@') {
        // Where one of these comes before the last `@`, the URL cannot be
        // read for sure, since a password may hold any of them unescaped:
        // `/`, `?` or `#` (as a path, query or fragment would start); a
        // `,` in a single node's URL; in a cluster's, a node before the
        // last `@` that is not `USERINFO@HOST:PORT`.
        // Seeds that carry credentials carry the same ones (redis-rs takes
        // one set for the whole cluster): others are a password's pieces.
        let nodes: Vec<&str> = hidden.split(',').collect();
        let userinfo = |n: &str| n.rsplit_once('@').map(|(u, _)| u.to_owned());
        let last_userinfo = nodes.last().map(|n| n.to_string());
        let ambiguous = hidden.contains(['/', '?', '#'])
            || (scheme != "redis-cluster" && nodes.len() > 1)
            || nodes[..nodes.len() - 1].iter().any(|n| {
                n.rsplit_once('@')
                    .is_none_or(|(_, host)| !looks_like_host_port(host))
                    || userinfo(n) != last_userinfo
            });
        if ambiguous {
            // A `?` or `#` before the `@` may have started a query whose
            // value runs past it: then nothing after it is sure either.
            let shown = !hidden.contains(['?', '#'])
                && !after.contains(['?', '#', '=', '&'])
                && after.split(',').all(looks_like_host_port);
            return if shown {
                format!("{scheme}://***@{after}")
            } else {
                format!("{scheme}://***")
            };
        }
    }
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    // A query typed without its `?` (`/0&password=...`).
    if rest.contains(['=', '&']) {
        return format!("{scheme}://***");
    }
    // A node with no `@` is shown whole: unless it is HOST or HOST:PORT,
    // it may be a password whose `@` was escaped, typed as another
    // character or forgotten.
    if rest
        .split(',')
        .any(|n| !n.contains('@') && !looks_like_host(n))
    {
        return format!("{scheme}://***");
    }
    let nodes: Vec<String> = rest.split(',').map(redact_userinfo).collect();
    let mut out = format!("{scheme}://{}", nodes.join(","));
    if let Some(query) = query {
        out.push('?');
        out.push_str(&redact_query(query));
    }
    out
}

/// A query with its credentials hidden: a key the client reads as `pass`,
/// `password`, `user` or `username` (in any case, percent-encoded or not)
/// keeps its name; only `db=<digits>` and `protocol=<letters and digits>`
/// are shown whole, since a value may hold an unescaped `&` or `=`.
fn redact_query(query: &str) -> String {
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let decoded = percent_encoding::percent_decode_str(key)
                .decode_utf8_lossy()
                .to_ascii_lowercase();
            let plain = |f: fn(u8) -> bool| !value.is_empty() && value.bytes().all(f);
            match decoded.as_str() {
                "pass" | "password" | "user" | "username" => format!("{decoded}=***"),
                "db" if plain(|b| b.is_ascii_digit()) => pair.to_owned(),
                "protocol" if plain(|b| b.is_ascii_alphanumeric()) => pair.to_owned(),
                _ => "***".to_owned(),
            }
        })
        .collect();
    pairs.join("&")
}

/// Whether `node` (up to its first `/`) is `HOST:PORT` with a numeric port.
fn looks_like_host_port(node: &str) -> bool {
    let authority = node.split('/').next().unwrap_or_default();
    authority.rsplit_once(':').is_some_and(|(host, port)| {
        is_host(host) && !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit())
    })
}

/// Whether `node` (up to its first `/`) is `HOST:PORT`, `HOST` or empty.
fn looks_like_host(node: &str) -> bool {
    let authority = node.split('/').next().unwrap_or_default();
    authority.is_empty() || is_host(authority) || looks_like_host_port(authority)
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

/// `user:password@host...` to `***:***@host...`, `:password@` to `:***@`.
fn redact_userinfo(node: &str) -> String {
    // The authority ends at the first `/`; its userinfo at its last `@`.
    let (authority, path) = match node.find('/') {
        Some(i) => node.split_at(i),
        None => (node, ""),
    };
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let hidden = if userinfo.starts_with(':') || userinfo.is_empty() {
                ":***"
            } else if userinfo.contains(':') {
                "***:***"
            } else {
                "***"
            };
            format!("{hidden}@{host}{path}")
        }
        None => node.to_owned(),
    }
}
/// The forms [`RedisStore::connect`](crate::RedisStore::connect) takes, for
/// error messages.
pub(crate) const FORMS: &str = "redis://[[USER]:PASSWORD@]HOST:PORT[/DB], \
     redis+unix:///PATH[?db=DB&user=USER&pass=PASSWORD] or \
     redis-cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]";

/// What is wrong with the query of a one-node URL, if anything. redis-rs
/// reads a few query fields (`protocol` on `redis://`; `db`, `user`,
/// `pass` and `protocol` on `redis+unix://`) and ignores the rest without a
/// word, so `redis://HOST:PORT?db=3` would count in database 0, and
/// `?password=` would send no password. `shown`: the URL without its
/// credentials. A URL that does not parse is left to redis-rs's message.
pub(crate) fn query_error(url: &str, shown: &str) -> Option<String> {
    let parsed = ::url::Url::parse(url).ok()?;
    let unix = parsed.scheme() == "redis+unix";
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
        (true, _) => "a redis+unix:// URL takes ?db=DB&user=USER&pass=PASSWORD",
        (false, "db") => "write the database as the path: redis://HOST:PORT/DB",
        (false, "user" | "username" | "pass" | "password") => {
            "write the credentials before the host: redis://USER:PASSWORD@HOST:PORT, or \
             redis://:PASSWORD@HOST:PORT"
        }
        (false, _) => "write redis://[[USER]:PASSWORD@]HOST:PORT[/DB], with no query",
    };
    Some(format!(
        "{shown:?}: its query has {named} that is not read, so it would be ignored; {instead}"
    ))
}

/// Whether `url` is of a form the store takes (by its scheme alone; the
/// rest is checked when connecting): for command-line parsers, so that a
/// wrong form is refused before anything runs, with [`url_form_error`].
pub fn is_store_url(url: &str) -> bool {
    ["redis://", "redis+unix://", "redis-cluster://"]
        .iter()
        .any(|p| url.starts_with(p))
}

/// What is wrong with `url` that shows without connecting, if anything: a
/// form the store does not take ([`url_form_error`]), or a query field
/// that a one-node URL would ignore (`redis://HOST:PORT?db=3` would count
/// in database 0). For command-line parsers, so that such a URL is refused
/// before anything runs; [`RedisStore::connect`](crate::RedisStore::connect)
/// refuses the same URLs.
///
/// ```
/// use ratewarden_redis::url_error;
/// assert_eq!(url_error("redis://127.0.0.1:6379/3"), None);
/// assert!(url_error("redis://127.0.0.1:6379?db=3").unwrap().contains("redis://HOST:PORT/DB"));
/// assert!(url_error("rediss://127.0.0.1:6379").unwrap().contains("TLS"));
/// ```
pub fn url_error(url: &str) -> Option<String> {
    if !is_store_url(url) {
        return Some(url_form_error(url));
    }
    if url.starts_with("redis-cluster://") {
        return None;
    }
    query_error(url, &redact_url(url))
}

/// Whether `url` looks meant for Redis (a Redis-like scheme) though
/// [`is_store_url`] refuses it: such a URL gets [`url_form_error`], while
/// anything else is an unknown store to its caller.
pub fn is_redis_like_url(url: &str) -> bool {
    ["redis", "valkey", "unix://"]
        .iter()
        .any(|p| url.starts_with(p))
}

/// What is wrong with a store URL whose scheme is not taken, saying what
/// to write instead.
pub fn url_form_error(url: &str) -> String {
    let shown = redact_url(url);
    if url.starts_with("rediss://") {
        format!(
            "{shown:?}: TLS (rediss://) is not supported by this build; connect with \
             redis:// (through a TLS tunnel such as stunnel if the link must be encrypted)"
        )
    } else {
        format!("{shown:?} is not a Redis address; write {FORMS}")
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
                ] {
                    tried += 1;
                    let shown = redact_url(&url);
                    for part in ["qqq", "zzz", "xxx"] {
                        assert!(!shown.contains(part), "{url} shown as {shown}");
                    }
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
                ] {
                    tried += 1;
                    let shown = redact_url(&url);
                    for part in ["qqq", "zzz", "xxx"] {
                        assert!(!shown.contains(part), "{url} shown as {shown}");
                    }
                }
            }
        }
        assert!(tried > 6000);
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
                "redis+unix:///run/r.sock?db=2&pass=***&protocol=resp3",
            ),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }
}
