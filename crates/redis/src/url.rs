//! Store URLs: which forms are taken, and how one is shown without its
//! credentials.

/// Hides the credentials of a store URL, so that it can be logged or put in
/// an error message: the user and password before `@` (in each node of a
/// `redis-cluster://` URL) become `***`, and a `pass=` or `user=` query
/// value (the form `redis+unix://` takes) becomes `***`.
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
/// // A password with an unescaped `,`, `/`, `?` or `@` is not shown in part
/// // either: all before the last `@` is hidden.
/// assert_eq!(redact_url("redis-cluster://:pa,ss@a:1,b:2"), "redis-cluster://***,***@a:1,b:2");
/// assert_eq!(redact_url("redis://:ab/cd@127.0.0.1:6379"), "redis://***@127.0.0.1:6379");
/// assert_eq!(redact_url("redis://:pa?ss@h:1/2"), "redis://***@h:1/2");
/// assert_eq!(redact_url("redis://bob:p@ss:w/rd,x@h:1"), "redis://***@h:1");
/// ```
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        // Not a URL at all: it may still be a mistyped one holding a
        // password, so show none of what could be one.
        return if url.contains('@') {
            "***".to_owned()
        } else {
            url.to_owned()
        };
    };
    // Where a `/`, `?` or `#` comes before an `@`, the URL cannot be read
    // for sure (a password holding one of them unescaped, or an `@` in a
    // query value): everything up to the last `@` is hidden, which may
    // hide more than the credentials but never shows part of them.
    if let Some((hidden, after)) = rest.rsplit_once('@') {
        if hidden.contains(['/', '?', '#']) {
            return redact_url(&format!("{scheme}://***@{after}"));
        }
    }
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    // A password holding an unescaped `,` splits into two "nodes", the
    // first without `@`: in a URL with credentials, such a node that is not
    // HOST:PORT[/...] is hidden whole.
    let has_credentials = rest.contains('@');
    let nodes: Vec<String> = rest
        .split(',')
        .map(|node| {
            if has_credentials && !node.contains('@') && !looks_like_host_port(node) {
                "***".to_owned()
            } else {
                redact_userinfo(node)
            }
        })
        .collect();
    let mut out = format!("{scheme}://{}", nodes.join(","));
    if let Some(query) = query {
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((k, _)) if matches!(k, "pass" | "password" | "user" | "username") => {
                    format!("{k}=***")
                }
                _ => pair.to_owned(),
            })
            .collect();
        out.push('?');
        out.push_str(&pairs.join("&"));
    }
    out
}

/// Whether `node` (up to its first `/`) is `HOST:PORT` with a numeric port.
fn looks_like_host_port(node: &str) -> bool {
    let authority = node.split('/').next().unwrap_or_default();
    authority.rsplit_once(':').is_some_and(|(host, port)| {
        !host.is_empty() && !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit())
    })
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
pub(crate) const FORMS: &str = "redis://[:PASSWORD@]HOST:PORT[/DB], \
     redis+unix:///PATH[?db=DB&pass=PASSWORD] or \
     redis-cluster://[:PASSWORD@]HOST:PORT[,HOST:PORT...]";

/// Whether `url` is of a form the store takes (by its scheme alone; the
/// rest is checked when connecting): for command-line parsers, so that a
/// wrong form is refused before anything runs, with [`url_form_error`].
pub fn is_store_url(url: &str) -> bool {
    ["redis://", "redis+unix://", "redis-cluster://"]
        .iter()
        .any(|p| url.starts_with(p))
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
