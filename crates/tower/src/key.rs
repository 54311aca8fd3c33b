//! Which budget a request draws on: a key taken from the request.
//!
//! A [`KeyExtractor`] reads the request's head ([`http::request::Parts`]) and
//! returns a [`RequestKey`]: an integer used as is, or a string hashed by the
//! layer's [`KeyHash`](ratewarden_core::KeyHash) (xxh3-64 unless configured).
//! When no key can be read the extractor answers with a [`KeyRejection`],
//! which becomes the response; [`KeyExtractorExt::or`] tries another
//! extractor first.
//!
//! Ready extractors: [`PeerIp`] (the client address, with opt-in trust of
//! `X-Forwarded-For` / `Forwarded`), [`HeaderKey`], [`ExtensionKey`] (for
//! example the authenticated user) and [`GlobalKey`]. Any closure
//! `Fn(&Parts) -> Result<RequestKey, KeyRejection>` is an extractor too.
//!
//! # Namespaces
//!
//! Each ready extractor writes its string keys with a prefix of its own, so
//! that what a client controls in one kind of key can never name a key of
//! another kind: with `HeaderKey::new(x_api_key).or(PeerIp::new())`, a client
//! that sends `x-api-key: 198.51.100.7` draws on `header:x-api-key:198.51.100.7`,
//! not on the budget of the client at 198.51.100.7 (`ip:198.51.100.7`).
//!
//! | extractor | string key |
//! |---|---|
//! | [`PeerIp`] | `ip:198.51.100.7`; IPv6 by network, `ip:2001:db8:1:2::/64`, or with prefix length 128 by address, `ip:2001:db8::7` |
//! | [`HeaderKey`] | `header:<lower-case header name>:<value>`, e.g. `header:x-api-key:k1` |
//! | [`ExtensionKey`] | `ext:<the closure's string>`; an integer from the closure is used as is |
//! | [`GlobalKey`] | `global:<id>`, e.g. `global:0` |
//! | a closure | the string as the closure wrote it: the closure chooses its own namespace |
//!
//! A [`RequestKey::Id`] is not hashed, so it shares the integer key space
//! with the hashes of string keys: a string whose hash equals the integer
//! draws on the same budget. Under xxh3-64 (the layer's default) hashes
//! are 64-bit, and finding a string that hashes to a given integer takes
//! about 2^64 tries; under mix32 hashes are below 2^32, and such a string
//! is found in seconds. Keep integer keys in layers whose keys are all
//! integers, or keep xxh3-64.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;
use std::net::{IpAddr, SocketAddr};

use axum::extract::ConnectInfo;
use http::header::{HeaderName, HeaderValue};
use http::request::Parts;
use http::StatusCode;
use ipnet::IpNet;

use crate::forwarded::{ForwardedHeader, ProxyTrust};

/// The key of one request, before hashing.
///
/// See [the namespaces](self#namespaces) the ready extractors write.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RequestKey {
    /// An integer key, used as is (it can meet the hash of a string key;
    /// see [the namespaces](self#namespaces)).
    Id(u64),
    /// A string key, hashed by the layer's key hash.
    Name(String),
}

impl From<u64> for RequestKey {
    fn from(id: u64) -> Self {
        RequestKey::Id(id)
    }
}

impl From<String> for RequestKey {
    fn from(name: String) -> Self {
        RequestKey::Name(name)
    }
}

impl From<&str> for RequestKey {
    fn from(name: &str) -> Self {
        RequestKey::Name(name.to_owned())
    }
}

/// Why no key could be read from a request, as the response to send.
///
/// The message is the response's body, so it is for the client: it names
/// what the client must change (a header to send) or is a generic phrase.
/// What the operator must change goes into the [detail](Self::with_detail),
/// which the layer logs and never sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRejection {
    status: StatusCode,
    message: Cow<'static, str>,
    detail: Option<Cow<'static, str>>,
    /// Few, and usually none: a list keeps the error small.
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl KeyRejection {
    /// A rejection answered with `status` and `message` as a plain-text body.
    pub fn new(status: StatusCode, message: impl Into<Cow<'static, str>>) -> Self {
        KeyRejection {
            status,
            message: message.into(),
            detail: None,
            headers: Vec::new(),
        }
    }

    /// Adds a header to the response, such as the `WWW-Authenticate`
    /// challenge that every `401` must carry (RFC 9110 §15.5.2).
    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.push((name, value));
        self
    }

    /// The headers the response carries besides the layer's own (a
    /// `Content-Type` here replaces the layer's `text/plain`).
    pub fn headers(&self) -> &[(HeaderName, HeaderValue)] {
        &self.headers
    }

    /// A rejection answered with `status` and a generic body fitting it
    /// (`401`: "authentication required", `500`: "internal server error",
    /// otherwise the status's reason phrase), with `detail` for the log.
    pub fn generic(status: StatusCode, detail: impl Into<Cow<'static, str>>) -> Self {
        let message = match status {
            StatusCode::UNAUTHORIZED => Cow::Borrowed("authentication required"),
            status => status
                .canonical_reason()
                .map_or(Cow::Borrowed("request refused"), |reason| {
                    Cow::Owned(reason.to_ascii_lowercase())
                }),
        };
        KeyRejection::new(status, message).with_detail(detail)
    }

    /// Adds what the operator needs to know, logged by the layer (at error
    /// level for a server error) and never sent to the client.
    pub fn with_detail(mut self, detail: impl Into<Cow<'static, str>>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// The response status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The message, sent as the body.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The detail for the log, if any; never sent.
    pub fn detail(&self) -> Option<&str> {
        self.detail.as_deref()
    }
}

impl fmt::Display for KeyRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status, self.message)?;
        if let Some(detail) = &self.detail {
            write!(f, " ({detail})")?;
        }
        Ok(())
    }
}

impl std::error::Error for KeyRejection {}

/// Reads the rate-limit key from a request's head.
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key for the request, or the response to send when there is none.
    fn extract(&self, parts: &Parts) -> Result<RequestKey, KeyRejection>;
}

impl<F> KeyExtractor for F
where
    F: Fn(&Parts) -> Result<RequestKey, KeyRejection> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Result<RequestKey, KeyRejection> {
        self(parts)
    }
}

/// Combinators for every [`KeyExtractor`].
pub trait KeyExtractorExt: KeyExtractor + Sized {
    /// This extractor, and `other` when this one finds no key: for example
    /// the user's API key, or else the client address.
    ///
    /// ```
    /// use http::{header::HeaderName, Request};
    /// use ratewarden_tower::key::{HeaderKey, KeyExtractor, KeyExtractorExt, GlobalKey, RequestKey};
    /// let key = HeaderKey::new(HeaderName::from_static("x-api-key")).or(GlobalKey::new(7));
    /// let (parts, ()) = Request::new(()).into_parts();
    /// assert_eq!(key.extract(&parts).unwrap(), RequestKey::from("global:7"));
    /// ```
    fn or<B: KeyExtractor>(self, other: B) -> Or<Self, B> {
        Or {
            first: self,
            second: other,
        }
    }
}

impl<K: KeyExtractor> KeyExtractorExt for K {}

/// Tries `first`, then `second`; made by [`KeyExtractorExt::or`].
#[derive(Debug, Clone)]
pub struct Or<A, B> {
    first: A,
    second: B,
}

impl<A: KeyExtractor, B: KeyExtractor> KeyExtractor for Or<A, B> {
    fn extract(&self, parts: &Parts) -> Result<RequestKey, KeyRejection> {
        self.first
            .extract(parts)
            .or_else(|_| self.second.extract(parts))
    }
}

/// One budget for every request: a global limit, under the string key
/// `global:<id>`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GlobalKey {
    id: u64,
}

impl GlobalKey {
    /// Every request draws on the key `global:<id>`; layers on one store
    /// with different ids keep separate global budgets.
    pub const fn new(id: u64) -> Self {
        GlobalKey { id }
    }
}

impl KeyExtractor for GlobalKey {
    fn extract(&self, _parts: &Parts) -> Result<RequestKey, KeyRejection> {
        Ok(RequestKey::Name(format!("global:{}", self.id)))
    }
}

/// The value of one request header as a string key (an API key, a tenant):
/// `header:<name>:<value>`, with the header's lower-case name.
///
/// A request without the header, with it twice, with an empty value, or with
/// a value holding bytes other than visible ASCII, space and tab is answered
/// `400 Bad Request` (or the status set with [`HeaderKey::missing_status`]):
/// a client must not be able to escape its budget by leaving the header out.
/// Spaces inside the value are kept: `Bearer k1` is one key.
///
/// Each distinct value is a key of its own in the store, so a client that
/// sends a fresh value on every request can fill a store's `max_keys`;
/// authenticate the values first, or limit by address outside this layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderKey {
    name: HeaderName,
    missing_status: StatusCode,
    missing_headers: Vec<(HeaderName, HeaderValue)>,
}

impl HeaderKey {
    /// The key is the value of header `name`.
    pub fn new(name: HeaderName) -> Self {
        HeaderKey {
            name,
            missing_status: StatusCode::BAD_REQUEST,
            missing_headers: Vec::new(),
        }
    }

    /// The status sent when the header is missing or unusable, for example
    /// `401 Unauthorized` for an API key (with its challenge: see
    /// [`HeaderKey::missing_header`]).
    pub fn missing_status(mut self, status: StatusCode) -> Self {
        self.missing_status = status;
        self
    }

    /// A header sent with that status, such as the `WWW-Authenticate`
    /// challenge a `401` must carry (RFC 9110 §15.5.2):
    /// `.missing_header(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"))`.
    pub fn missing_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.missing_headers.push((name, value));
        self
    }
}

impl KeyExtractor for HeaderKey {
    fn extract(&self, parts: &Parts) -> Result<RequestKey, KeyRejection> {
        let reject = |what: &str| KeyRejection {
            headers: self.missing_headers.clone(),
            ..KeyRejection::new(self.missing_status, format!("header {} {what}", self.name))
        };
        let mut values = parts.headers.get_all(&self.name).iter();
        let value = values.next().ok_or_else(|| reject("is missing"))?;
        if values.next().is_some() {
            return Err(reject("is sent more than once; send it once"));
        }
        let value = value
            .to_str()
            .map_err(|_| reject("holds bytes other than visible ASCII, space and tab"))?;
        if value.is_empty() {
            return Err(reject("is empty"));
        }
        // Header names cannot contain ':', so the name ends where the value
        // starts: two headers never share a key.
        Ok(RequestKey::Name(format!(
            "header:{}:{value}",
            self.name.as_str()
        )))
    }
}

/// A key computed from a request extension that an earlier layer inserted,
/// such as the authenticated user.
///
/// A string from the closure becomes the key `ext:<string>`; an integer
/// ([`RequestKey::Id`]) is used as is.
///
/// A request without the extension is answered `500 Internal Server Error`
/// (or the status set with [`ExtensionKey::missing_status`]) with a generic
/// body; the log says which extension is missing (at error level for a
/// `5xx`): the layer that inserts it does not run before this one.
pub struct ExtensionKey<T, F> {
    key: F,
    missing_status: StatusCode,
    missing_headers: Vec<(HeaderName, HeaderValue)>,
    _extension: PhantomData<fn(&T)>,
}

impl<T, F: Clone> Clone for ExtensionKey<T, F> {
    fn clone(&self) -> Self {
        ExtensionKey {
            key: self.key.clone(),
            missing_status: self.missing_status,
            missing_headers: self.missing_headers.clone(),
            _extension: PhantomData,
        }
    }
}

impl<T, F> fmt::Debug for ExtensionKey<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtensionKey")
            .field("extension", &std::any::type_name::<T>())
            .field("missing_status", &self.missing_status)
            .finish()
    }
}

impl<T, F> ExtensionKey<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> RequestKey + Send + Sync + 'static,
{
    /// The key is `key(extension)` for the request's extension of type `T`.
    pub fn new(key: F) -> Self {
        ExtensionKey {
            key,
            missing_status: StatusCode::INTERNAL_SERVER_ERROR,
            missing_headers: Vec::new(),
            _extension: PhantomData,
        }
    }

    /// The status sent when the extension is missing, for example
    /// `401 Unauthorized` when it is the authenticated user (with its
    /// challenge: see [`ExtensionKey::missing_header`]).
    pub fn missing_status(mut self, status: StatusCode) -> Self {
        self.missing_status = status;
        self
    }

    /// A header sent with that status, such as the `WWW-Authenticate`
    /// challenge a `401` must carry (RFC 9110 §15.5.2).
    pub fn missing_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.missing_headers.push((name, value));
        self
    }
}

impl<T, F> KeyExtractor for ExtensionKey<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> RequestKey + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Result<RequestKey, KeyRejection> {
        match parts.extensions.get::<T>() {
            Some(value) => Ok(match (self.key)(value) {
                RequestKey::Name(name) => RequestKey::Name(format!("ext:{name}")),
                id @ RequestKey::Id(_) => id,
            }),
            // The body must not name types or layers to a client (which
            // may be an anonymous user answered 401); the log does.
            None => Err(KeyRejection {
                headers: self.missing_headers.clone(),
                ..KeyRejection::generic(
                    self.missing_status,
                    format!(
                        "request extension {} is missing: the layer that inserts it must run \
                         before the rate limit",
                        std::any::type_name::<T>()
                    ),
                )
            }),
        }
    }
}

/// The client's IP address: an IPv4 client by address, as the string key
/// `ip:198.51.100.7` (IPv4-mapped IPv6 addresses are written as IPv4), an
/// IPv6 client by its /64 network, as `ip:2001:db8:1:2::/64`.
///
/// One IPv6 customer usually holds a whole /64 and can send from any of its
/// 2^64 addresses; counting each address apart would give it that many
/// budgets. [`PeerIp::ipv6_prefix_len`] changes the length (128 counts each
/// address, as `ip:2001:db8::7`).
///
/// The direct peer comes from axum's `ConnectInfo<SocketAddr>` (serve with
/// `into_make_service_with_connect_info::<SocketAddr>()`), or from a plain
/// `SocketAddr` extension for other servers. The `ConnectInfo` must be axum
/// 0.8's: one inserted by another axum version (0.7) is another type, and is
/// not found. A request with neither is answered `500 Internal Server
/// Error` with a generic body, and the log says what to change: the server
/// is not set up to tell clients apart.
///
/// Forwarding headers are ignored unless trust is configured with
/// [`PeerIp::trust_x_forwarded_for`] or [`PeerIp::trust_forwarded`]: any
/// client can write them. List only your proxies there: a client inside a
/// trusted range can write the header and choose its own key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIp {
    trust: Option<ProxyTrust>,
    ipv6_prefix_len: u8,
}

/// The IPv6 prefix length clients are counted by unless configured.
pub const DEFAULT_IPV6_PREFIX_LEN: u8 = 64;

impl Default for PeerIp {
    fn default() -> Self {
        PeerIp {
            trust: None,
            ipv6_prefix_len: DEFAULT_IPV6_PREFIX_LEN,
        }
    }
}

impl PeerIp {
    /// The direct peer's address, IPv6 by /64; forwarding headers are
    /// ignored.
    pub fn new() -> Self {
        PeerIp::default()
    }

    /// When the direct peer is in one of `proxies`, read the client from
    /// `X-Forwarded-For`: the right-most address that is not a trusted
    /// proxy.
    ///
    /// One header is read: this replaces an earlier
    /// [`trust_forwarded`](PeerIp::trust_forwarded), and a later one
    /// replaces this. Trust the header your proxies write; reading
    /// whichever a request carries would let a client choose its key by
    /// sending the other.
    pub fn trust_x_forwarded_for(mut self, proxies: impl IntoIterator<Item = IpNet>) -> Self {
        self.trust = Some(ProxyTrust::new(ForwardedHeader::XForwardedFor, proxies));
        self
    }

    /// When the direct peer is in one of `proxies`, read the client from the
    /// `for=` nodes of `Forwarded` (RFC 7239): the right-most address that is
    /// not a trusted proxy.
    ///
    /// One header is read: this replaces an earlier
    /// [`trust_x_forwarded_for`](PeerIp::trust_x_forwarded_for), and a
    /// later one replaces this.
    pub fn trust_forwarded(mut self, proxies: impl IntoIterator<Item = IpNet>) -> Self {
        self.trust = Some(ProxyTrust::new(ForwardedHeader::Forwarded, proxies));
        self
    }

    /// Counts IPv6 clients by networks of `len` bits (default
    /// [`DEFAULT_IPV6_PREFIX_LEN`], 64): 128 counts each address apart, a
    /// shorter length such as 56 or 48 counts a whole customer allocation as
    /// one client. Lengths above 128 are taken as 128. IPv4 clients are
    /// always counted by address.
    pub fn ipv6_prefix_len(mut self, len: u8) -> Self {
        self.ipv6_prefix_len = len.min(128);
        self
    }

    /// The direct peer's address, from `ConnectInfo<SocketAddr>` or a
    /// `SocketAddr` extension.
    pub fn peer(parts: &Parts) -> Option<IpAddr> {
        if let Some(ConnectInfo(addr)) = parts.extensions.get::<ConnectInfo<SocketAddr>>() {
            return Some(addr.ip());
        }
        parts.extensions.get::<SocketAddr>().map(|addr| addr.ip())
    }

    /// The client address this extractor keys the request by: for IPv6, the
    /// first address of the client's network.
    pub fn client_ip(&self, parts: &Parts) -> Option<IpAddr> {
        let peer = Self::peer(parts)?;
        let ip = match &self.trust {
            Some(trust) => trust.client_ip(peer, &parts.headers),
            None => peer.to_canonical(),
        };
        Some(match ip {
            IpAddr::V6(v6) => {
                // The length was capped at 128, so the network is always valid.
                ipnet::Ipv6Net::new(v6, self.ipv6_prefix_len)
                    .map(|n| IpAddr::V6(n.network()))
                    .unwrap_or(ip)
            }
            IpAddr::V4(_) => ip,
        })
    }
}

impl KeyExtractor for PeerIp {
    fn extract(&self, parts: &Parts) -> Result<RequestKey, KeyRejection> {
        match self.client_ip(parts) {
            // A network carries its length, so that a /64 never shares a key
            // with the single address `2001:db8:1:2::`.
            Some(IpAddr::V6(v6)) if self.ipv6_prefix_len < 128 => Ok(RequestKey::Name(format!(
                "ip:{v6}/{}",
                self.ipv6_prefix_len
            ))),
            Some(ip) => Ok(RequestKey::Name(format!("ip:{ip}"))),
            None => Err(KeyRejection::generic(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the peer address is unknown: serve the router with axum 0.8's \
                 into_make_service_with_connect_info::<SocketAddr>() (a ConnectInfo \
                 inserted by another axum version, such as 0.7, is another type and is \
                 not found), or, under plain hyper or tower, insert the peer's SocketAddr \
                 as a request extension",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(build: impl FnOnce(http::request::Builder) -> http::request::Builder) -> Parts {
        build(Request::builder()).body(()).unwrap().into_parts().0
    }

    #[test]
    fn header_key_rejects_missing_repeated_and_empty_values() {
        let key = HeaderKey::new(HeaderName::from_static("x-api-key"));
        let ok = parts(|b| b.header("x-api-key", "k1"));
        assert_eq!(
            key.extract(&ok).unwrap(),
            RequestKey::Name("header:x-api-key:k1".into())
        );
        let missing = key.extract(&parts(|b| b)).unwrap_err();
        assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
        assert_eq!(missing.message(), "header x-api-key is missing");
        let twice = parts(|b| b.header("x-api-key", "a").header("x-api-key", "b"));
        assert!(key
            .extract(&twice)
            .unwrap_err()
            .message()
            .contains("more than once"));
        let empty = parts(|b| b.header("x-api-key", ""));
        assert!(key.extract(&empty).unwrap_err().message().contains("empty"));
        let spaced = parts(|b| b.header("x-api-key", "Bearer k1"));
        assert_eq!(
            key.extract(&spaced).unwrap(),
            RequestKey::Name("header:x-api-key:Bearer k1".into())
        );
        let binary = parts(|b| {
            b.header(
                "x-api-key",
                http::HeaderValue::from_bytes(b"k\xff1").expect("obs-text is a valid value"),
            )
        });
        assert!(key
            .extract(&binary)
            .unwrap_err()
            .message()
            .contains("other than visible ASCII, space and tab"));
        let key = key.missing_status(StatusCode::UNAUTHORIZED).missing_header(
            http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static("ApiKey"),
        );
        let err = key.extract(&parts(|b| b)).unwrap_err();
        assert_eq!(err.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(
            err.headers(),
            [(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("ApiKey")
            )]
        );
    }

    #[test]
    fn peer_ip_groups_ipv6_by_prefix() {
        let addr: SocketAddr = "[2001:db8:1:2:3:4:5:6]:443".parse().unwrap();
        let p = parts(|b| b.extension(ConnectInfo(addr)));
        // By default a whole /64 is one client.
        let grouped = PeerIp::new();
        assert_eq!(
            grouped.extract(&p).unwrap(),
            RequestKey::from("ip:2001:db8:1:2::/64")
        );
        assert_eq!(
            PeerIp::new().ipv6_prefix_len(128).extract(&p).unwrap(),
            RequestKey::from("ip:2001:db8:1:2:3:4:5:6")
        );
        assert_eq!(
            PeerIp::new().ipv6_prefix_len(48).extract(&p).unwrap(),
            RequestKey::from("ip:2001:db8:1::/48")
        );
        // IPv4 addresses are not affected by the IPv6 prefix.
        let v4: SocketAddr = "198.51.100.7:80".parse().unwrap();
        let p = parts(|b| b.extension(v4));
        assert_eq!(
            grouped.extract(&p).unwrap(),
            RequestKey::from("ip:198.51.100.7")
        );
    }

    #[test]
    fn each_extractor_kind_has_its_own_namespace() {
        // The same text through every extractor: four different keys.
        let p = parts(|b| {
            b.header("x-api-key", "198.51.100.7")
                .extension("198.51.100.7:1".parse::<SocketAddr>().unwrap())
                .extension(String::from("198.51.100.7"))
        });
        let keys = [
            PeerIp::new().extract(&p).unwrap(),
            HeaderKey::new(HeaderName::from_static("x-api-key"))
                .extract(&p)
                .unwrap(),
            ExtensionKey::new(|s: &String| RequestKey::from(s.as_str()))
                .extract(&p)
                .unwrap(),
            GlobalKey::new(0).extract(&p).unwrap(),
        ];
        assert_eq!(
            keys,
            [
                RequestKey::from("ip:198.51.100.7"),
                RequestKey::from("header:x-api-key:198.51.100.7"),
                RequestKey::from("ext:198.51.100.7"),
                RequestKey::from("global:0"),
            ]
        );
        // An integer from an extension is used as is.
        let p = parts(|b| b.extension(7u64));
        let id = ExtensionKey::new(|n: &u64| RequestKey::Id(*n));
        assert_eq!(id.extract(&p).unwrap(), RequestKey::Id(7));
    }

    #[test]
    fn peer_ip_without_a_peer_is_a_server_error() {
        let err = PeerIp::new().extract(&parts(|b| b)).unwrap_err();
        assert_eq!(err.status(), StatusCode::INTERNAL_SERVER_ERROR);
        // The client is told nothing about the server; the log is.
        assert_eq!(err.message(), "internal server error");
        assert!(err
            .detail()
            .unwrap()
            .contains("into_make_service_with_connect_info"));
        // An app on axum 0.7 serves with that call too: the log says why its
        // ConnectInfo is not found.
        assert!(err.detail().unwrap().contains("axum 0.8"));
        // Without axum, the extension PeerIp also reads.
        assert!(err
            .detail()
            .unwrap()
            .contains("insert the peer's SocketAddr as a request extension"));
    }

    #[test]
    fn a_missing_extension_names_the_type_in_the_log_only() {
        struct User;
        let key = ExtensionKey::new(|_: &User| RequestKey::Id(1));
        let err = key.extract(&parts(|b| b)).unwrap_err();
        assert_eq!(err.message(), "internal server error");
        let detail = err.detail().unwrap();
        assert!(detail.contains("User"), "{detail}");
        assert!(
            detail.contains("must run before the rate limit"),
            "{detail}"
        );
        let err = key
            .missing_status(StatusCode::UNAUTHORIZED)
            .missing_header(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer"),
            )
            .extract(&parts(|b| b))
            .unwrap_err();
        assert_eq!(err.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(err.message(), "authentication required");
        assert_eq!(
            err.headers(),
            [(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer")
            )]
        );
        let err = KeyRejection::generic(StatusCode::FORBIDDEN, "no role");
        assert_eq!(err.message(), "forbidden");
    }

    #[test]
    fn a_rejection_as_an_error_shows_status_message_and_detail() {
        // Shown as a std::error::Error (in a log, a `?` chain) it carries
        // the detail too; the body is the message alone.
        let err = KeyRejection::generic(StatusCode::FORBIDDEN, "no role");
        assert_eq!(err.to_string(), "403 Forbidden: forbidden (no role)");
        let err = KeyRejection::new(StatusCode::BAD_REQUEST, "send x-api-key");
        assert_eq!(err.to_string(), "400 Bad Request: send x-api-key");
    }

    #[test]
    fn an_extension_key_debugs_as_its_extension_type() {
        // The closure has no Debug; the type it reads and the status say
        // which extractor this is.
        struct User;
        let key = ExtensionKey::new(|_: &User| RequestKey::Id(1));
        let text = format!("{key:?}");
        assert!(text.starts_with("ExtensionKey"), "{text}");
        assert!(text.contains("User") && text.contains("500"), "{text}");
    }
}
