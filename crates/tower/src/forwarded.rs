//! Reading the client address from `X-Forwarded-For` or `Forwarded`
//! (RFC 7239) behind proxies the operator trusts.
//!
//! Each proxy appends the address it received the request from, so the list
//! is read from the right: the right-most address that is not a trusted
//! proxy is the client. Everything left of it was written by the client or
//! by proxies nobody vouches for, and is ignored.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use http::HeaderMap;
use ipnet::{IpNet, Ipv4Net};

/// The most list entries read from the right before giving up. Honest chains
/// are a handful of proxies long; the bound keeps a padded header from
/// costing more than a few comparisons. Empty elements do not count.
pub const MAX_HOPS: usize = 32;

/// The most list elements looked at, empty ones included, before giving up:
/// RFC 9110 §5.6.1.2 asks a recipient to skip "a reasonable number" of empty
/// elements, and this bounds what a header of commas costs.
pub const MAX_ELEMENTS: usize = 4 * MAX_HOPS;

/// Which header the trusted proxies write.
///
/// Only one is read: a proxy that writes one header usually passes the other
/// through untouched, so trusting both would let a client forge the one the
/// proxy does not write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2`.
    XForwardedFor,
    /// `Forwarded: for=client, for=proxy1` (RFC 7239).
    Forwarded,
}

impl ForwardedHeader {
    fn name(self) -> &'static str {
        match self {
            ForwardedHeader::XForwardedFor => "x-forwarded-for",
            ForwardedHeader::Forwarded => "forwarded",
        }
    }
}

/// One entry of a forwarding list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hop {
    Ip(IpAddr),
    /// `unknown`, an obfuscated identifier, a missing or repeated `for=`, or
    /// text that is not an address.
    Unknown,
}

/// The proxies whose forwarding header is believed, and which header that is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyTrust {
    header: ForwardedHeader,
    proxies: Vec<IpNet>,
}

impl ProxyTrust {
    /// Trust `header` when the direct peer lies in one of `proxies`.
    ///
    /// Addresses are compared in canonical form, IPv4-mapped IPv6 as IPv4,
    /// so a network written mapped (`::ffff:10.0.0.0/104`) is taken as the
    /// IPv4 network it maps (`10.0.0.0/8`).
    pub fn new(header: ForwardedHeader, proxies: impl IntoIterator<Item = IpNet>) -> Self {
        ProxyTrust {
            header,
            proxies: proxies.into_iter().map(canonical_net).collect(),
        }
    }

    /// The header read.
    pub fn header(&self) -> ForwardedHeader {
        self.header
    }

    /// Whether `ip` is one of the trusted proxies.
    pub fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.proxies.iter().any(|net| net.contains(&ip))
    }

    /// The client address for a request received from `peer`.
    ///
    /// - A peer that is not a trusted proxy is the client; its headers are
    ///   ignored.
    /// - Otherwise the list is read from the right, and the first address
    ///   that is not a trusted proxy is the client.
    /// - An entry that is not an address (`unknown`, an obfuscated name,
    ///   garbage) ends the walk: the trusted proxy that wrote it is taken as
    ///   the client, because nothing left of it can be believed.
    /// - Empty list elements are skipped (RFC 9110 §5.6.1.2).
    /// - When every entry is a trusted proxy (or the header is absent), the
    ///   left-most trusted address is the client.
    /// - Past [`MAX_HOPS`] entries or [`MAX_ELEMENTS`] elements the walk
    ///   stops at the last trusted address reached.
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let mut current = peer.to_canonical();
        if !self.is_trusted(current) {
            return current;
        }
        let lines: Vec<&[u8]> = headers
            .get_all(self.header.name())
            .iter()
            .map(|v| v.as_bytes())
            .collect();
        // Every element looked at, and the non-empty ones among them.
        let (mut scanned, mut hops) = (0, 0);
        for line in lines.iter().rev() {
            // Header values are visible ASCII in practice. A byte that is not
            // UTF-8 makes its own element unreadable (unknown), not the whole
            // line: a proxy appends the client's address to the line the
            // client sent, and a client's stray byte must not hide it.
            let line = String::from_utf8_lossy(line);
            let line: &str = &line;
            // Only the right-most elements can be read before a bound is
            // reached: keep those (one more than the budget, to see it
            // exceeded) rather than collect a padded line whole.
            let keep = MAX_ELEMENTS - scanned + 1;
            let mut tail = VecDeque::with_capacity(keep.min(8));
            // `X-Forwarded-For` has no quoted strings, and in a `Forwarded`
            // line a quote that never closes is not one: either way every
            // comma splits. Otherwise a client's stray `"` would swallow
            // the elements its proxies appended after it, and its own
            // `for=` would be read as theirs.
            let quotes = match self.header {
                ForwardedHeader::XForwardedFor => false,
                ForwardedHeader::Forwarded => quotes_close(line),
            };
            for element in SplitUnquoted::new(line, b',', quotes) {
                if tail.len() == keep {
                    tail.pop_front();
                }
                tail.push_back(element);
            }
            for element in tail.into_iter().rev() {
                scanned += 1;
                if scanned > MAX_ELEMENTS {
                    return current;
                }
                // Empty elements (`a,,b`, a trailing comma, an empty line)
                // are skipped, as RFC 9110 §5.6.1.2 requires.
                let element = element.trim();
                if element.is_empty() {
                    continue;
                }
                hops += 1;
                if hops > MAX_HOPS {
                    return current;
                }
                let hop = match self.header {
                    ForwardedHeader::XForwardedFor => parse_node(element),
                    ForwardedHeader::Forwarded => forwarded_for(element),
                };
                match hop {
                    Hop::Ip(ip) => {
                        let ip = ip.to_canonical();
                        if !self.is_trusted(ip) {
                            return ip;
                        }
                        current = ip;
                    }
                    Hop::Unknown => return current,
                }
            }
        }
        current
    }
}

/// `net` as the peers it must match are written: a network of IPv4-mapped
/// addresses (`::ffff:a.b.c.d/n`, n >= 96) as the IPv4 network it maps.
/// A shorter IPv6 prefix covers more than the mapped range and stays IPv6.
fn canonical_net(net: IpNet) -> IpNet {
    if let IpNet::V6(v6) = net {
        if let (Some(v4), Some(len)) = (v6.addr().to_ipv4_mapped(), v6.prefix_len().checked_sub(96))
        {
            if let Ok(v4) = Ipv4Net::new(v4, len) {
                return IpNet::V4(v4.trunc());
            }
        }
    }
    net.trunc()
}

/// The elements of a list, split at `sep` outside double-quoted strings
/// (which may contain backslash escapes), as RFC 7239 and RFC 9110 lists
/// require, or at every `sep` when `quotes` is false; left to right,
/// without allocating.
struct SplitUnquoted<'a> {
    rest: Option<&'a str>,
    sep: u8,
    quotes: bool,
}

impl<'a> SplitUnquoted<'a> {
    fn new(s: &'a str, sep: u8, quotes: bool) -> Self {
        SplitUnquoted {
            rest: Some(s),
            sep,
            quotes,
        }
    }
}

/// Where the bytes of a list stand against its double-quoted strings
/// (which may contain backslash escapes), fed left to right: the one
/// reading of quotes that splitting and [`quotes_close`] share.
#[derive(Default)]
struct Quoting {
    quoted: bool,
    escaped: bool,
}

impl Quoting {
    /// Reads `b`: true when it is a quote or lies within a quoted string,
    /// so that it cannot separate elements.
    fn quoted(&mut self, b: u8) -> bool {
        if self.escaped {
            self.escaped = false;
            return true;
        }
        if self.quoted && b == b'\\' {
            self.escaped = true;
            return true;
        }
        if b == b'"' {
            self.quoted = !self.quoted;
            return true;
        }
        self.quoted
    }
}

/// Whether every double-quoted string in `s` ends.
fn quotes_close(s: &str) -> bool {
    let mut quoting = Quoting::default();
    for b in s.bytes() {
        quoting.quoted(b);
    }
    !quoting.quoted
}

impl<'a> Iterator for SplitUnquoted<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        let s = self.rest?;
        let mut quoting = Quoting::default();
        // The separators and quotes are ASCII, so every split falls on a
        // character boundary.
        for (i, b) in s.bytes().enumerate() {
            if self.quotes && quoting.quoted(b) {
                continue;
            }
            if b == self.sep {
                self.rest = Some(&s[i + 1..]);
                return Some(&s[..i]);
            }
        }
        self.rest = None;
        Some(s)
    }
}

/// The `for=` node of one `Forwarded` element (`for=192.0.2.60;proto=http`).
///
/// An element without `for`, or with `for` more than once, is unknown: RFC
/// 7239 §4 allows each parameter at most once per element, and of two
/// values neither can be believed.
fn forwarded_for(element: &str) -> Hop {
    // A quote that never closes (the line was split at every comma
    // because of it): the element cannot be read.
    if !quotes_close(element) {
        return Hop::Unknown;
    }
    let mut value = None;
    for pair in SplitUnquoted::new(element, b';', true) {
        let Some((name, v)) = pair.split_once('=') else {
            continue;
        };
        if name.trim().eq_ignore_ascii_case("for") {
            if value.is_some() {
                return Hop::Unknown;
            }
            value = Some(v.trim());
        }
    }
    match value.and_then(unquote) {
        Some(node) => forwarded_node(&node),
        None => Hop::Unknown,
    }
}

/// A parameter value: a token as is, or a quoted-string (RFC 9110 §5.6.4)
/// without its quotes and with its quoted-pairs (`\x`) unescaped. `None`
/// for a quoted-string that does not end where the value ends.
fn unquote(value: &str) -> Option<Cow<'_, str>> {
    let Some(quoted) = value.strip_prefix('"') else {
        return Some(Cow::Borrowed(value));
    };
    let mut out = String::with_capacity(quoted.len());
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.push(chars.next()?),
            '"' => return chars.as_str().is_empty().then_some(Cow::Owned(out)),
            c => out.push(c),
        }
    }
    None
}

/// An RFC 7239 node: [`parse_node`], and also an address followed by an
/// obfuscated port (`192.0.2.43:_p1`, `[2001:db8::1]:_p1`). The proxy hid
/// the port, not the address, so the address is the client's.
fn forwarded_node(node: &str) -> Hop {
    if let Some((name, port)) = node.rsplit_once(':') {
        if is_obfport(port) {
            if let Ok(v4) = name.parse::<Ipv4Addr>() {
                return Hop::Ip(IpAddr::V4(v4));
            }
            let v6 = name.strip_prefix('[').and_then(|n| n.strip_suffix(']'));
            return match v6.map(str::parse::<Ipv6Addr>) {
                Some(Ok(v6)) => Hop::Ip(IpAddr::V6(v6)),
                _ => Hop::Unknown,
            };
        }
    }
    parse_node(node)
}

/// `obfport = "_" 1*(ALPHA / DIGIT / "." / "_" / "-")` (RFC 7239 §6.3).
fn is_obfport(port: &str) -> bool {
    port.strip_prefix('_').is_some_and(|rest| {
        !rest.is_empty()
            && rest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    })
}

/// An address with an optional port: `192.0.2.1`, `192.0.2.1:80`,
/// `2001:db8::1`, `[2001:db8::1]`, `[2001:db8::1]:80`.
fn parse_node(node: &str) -> Hop {
    if let Ok(ip) = node.parse::<IpAddr>() {
        return Hop::Ip(ip);
    }
    if let Ok(addr) = node.parse::<SocketAddr>() {
        return Hop::Ip(addr.ip());
    }
    if let Some(ip) = node.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
        if let Ok(ip) = ip.parse::<IpAddr>() {
            return Hop::Ip(ip);
        }
    }
    Hop::Unknown
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn headers(name: &'static str, values: &[&'static str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(name, HeaderValue::from_static(v));
        }
        h
    }

    fn trust(header: ForwardedHeader) -> ProxyTrust {
        ProxyTrust::new(
            header,
            ["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()],
        )
    }

    #[test]
    fn untrusted_peer_is_the_client_whatever_it_claims() {
        let t = trust(ForwardedHeader::XForwardedFor);
        let h = headers("x-forwarded-for", &["1.2.3.4"]);
        assert_eq!(t.client_ip(ip("203.0.113.9"), &h), ip("203.0.113.9"));
    }

    #[test]
    fn right_most_untrusted_address_wins() {
        let t = trust(ForwardedHeader::XForwardedFor);
        // The client forged "6.6.6.6"; the trusted proxy 10.0.0.2 appended
        // the real client 198.51.100.7, then 10.0.0.3 appended 10.0.0.2.
        let h = headers("x-forwarded-for", &["6.6.6.6, 198.51.100.7, 10.0.0.2"]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("198.51.100.7"));
        // The same list split over two lines reads the same.
        let h = headers("x-forwarded-for", &["6.6.6.6", "198.51.100.7,10.0.0.2"]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("198.51.100.7"));
    }

    #[test]
    fn all_trusted_or_absent_falls_back_to_the_left_most_trusted() {
        let t = trust(ForwardedHeader::XForwardedFor);
        let h = headers("x-forwarded-for", &["10.1.1.1, 10.0.0.2"]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("10.1.1.1"));
        assert_eq!(
            t.client_ip(ip("10.0.0.3"), &HeaderMap::new()),
            ip("10.0.0.3")
        );
    }

    #[test]
    fn garbage_stops_at_the_proxy_that_wrote_it() {
        let t = trust(ForwardedHeader::XForwardedFor);
        let h = headers("x-forwarded-for", &["198.51.100.7, not-an-ip, 10.0.0.2"]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("10.0.0.2"));
    }

    #[test]
    fn a_byte_that_is_not_utf8_cannot_hide_what_the_proxy_appended() {
        // The client sent one bad byte; the trusted proxy appended the real
        // client on the same line. Before, the whole line was unknown and
        // the client took the proxy's own budget.
        for (name, header) in [
            ("x-forwarded-for", ForwardedHeader::XForwardedFor),
            ("forwarded", ForwardedHeader::Forwarded),
        ] {
            let t = trust(header);
            let appended = match header {
                ForwardedHeader::XForwardedFor => ", 198.51.100.7".to_owned(),
                ForwardedHeader::Forwarded => ", for=198.51.100.7".to_owned(),
            };
            let mut h = HeaderMap::new();
            let value = [b"\xff".as_slice(), appended.as_bytes()].concat();
            h.append(name, HeaderValue::from_bytes(&value).unwrap());
            assert_eq!(
                t.client_ip(ip("10.0.0.3"), &h),
                ip("198.51.100.7"),
                "{name}"
            );
            // The bad element itself is unknown: the walk stops there, at
            // the trusted proxy that wrote it.
            let proxy = appended.replace("198.51.100.7", "10.0.0.2");
            let mut h = HeaderMap::new();
            let value = [b"198.51.100.7, \xff".as_slice(), proxy.as_bytes()].concat();
            h.append(name, HeaderValue::from_bytes(&value).unwrap());
            assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("10.0.0.2"), "{name}");
        }
    }

    #[test]
    fn a_stray_quote_cannot_swallow_what_the_proxy_appended() {
        // The client wrote up to the stray quote; the trusted proxy
        // appended ", for=<peer>" (or ", <peer>") on the same line.
        let t = trust(ForwardedHeader::Forwarded);
        let h = headers("forwarded", &[r#"for=6.6.6.6;host="a, for=198.51.100.7"#]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("198.51.100.7"));
        // Reached only through trusted hops, the unreadable element stops
        // the walk at the proxy that wrote it.
        let h = headers("forwarded", &[r#"for=6.6.6.6;host="a, for=10.0.0.2"#]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("10.0.0.2"));
        // Quoted commas in a well-formed line still do not split.
        let h = headers(
            "forwarded",
            &[r#"for=198.51.100.8;host="a,b", for=10.0.0.2"#],
        );
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("198.51.100.8"));

        let t = trust(ForwardedHeader::XForwardedFor);
        let h = headers("x-forwarded-for", &[r#"", 198.51.100.9"#]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("198.51.100.9"));
        let h = headers("x-forwarded-for", &[r#"6.6.6.6 "x, 198.51.100.9"#]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("198.51.100.9"));
    }

    #[test]
    fn ports_brackets_and_mapped_addresses() {
        let t = trust(ForwardedHeader::XForwardedFor);
        let h = headers("x-forwarded-for", &["198.51.100.7:5555"]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("198.51.100.7"));
        let h = headers("x-forwarded-for", &["[2001:db8::7]:443"]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("2001:db8::7"));
        // An IPv4 peer seen through an IPv6 socket is still trusted.
        let h = headers("x-forwarded-for", &["198.51.100.7"]);
        assert_eq!(t.client_ip(ip("::ffff:10.0.0.3"), &h), ip("198.51.100.7"));
        let h = headers("x-forwarded-for", &["::ffff:198.51.100.7"]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("198.51.100.7"));
    }

    #[test]
    fn forwarded_header_syntax() {
        let t = trust(ForwardedHeader::Forwarded);
        let h = headers(
            "forwarded",
            &[
                "for=6.6.6.6, for=\"[2001:db8:cafe::17]:4711\";proto=https;host=\"a,b\", \
                 For=10.0.0.2;by=10.0.0.3",
            ],
        );
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("2001:db8:cafe::17"));
        let h = headers("forwarded", &["for=192.0.2.43:47011;proto=http"]);
        assert_eq!(t.client_ip(ip("fd00::1"), &h), ip("192.0.2.43"));
        let h = headers("forwarded", &["for=192.0.2.43, for=unknown"]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("10.0.0.3"));
        let h = headers("forwarded", &["for=192.0.2.43, for=_hidden"]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("10.0.0.3"));
        let h = headers("forwarded", &["proto=https"]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("10.0.0.3"));
    }

    #[test]
    fn forwarded_obfuscated_ports_quoted_pairs_and_repeated_for() {
        let t = trust(ForwardedHeader::Forwarded);
        let peer = ip("10.0.0.3");
        let client = |value: &'static str| t.client_ip(peer, &headers("forwarded", &[value]));
        // An obfuscated port hides the port; the address is real.
        assert_eq!(client("for=\"192.0.2.43:_p1\""), ip("192.0.2.43"));
        assert_eq!(client("for=\"[2001:db8::1]:_p1\""), ip("2001:db8::1"));
        assert_eq!(client("for=192.0.2.43:_a.b-c_9"), ip("192.0.2.43"));
        // Not an obfuscated port, or not an address before it: unknown.
        assert_eq!(client("for=\"192.0.2.43:_\""), peer);
        assert_eq!(client("for=\"192.0.2.43:_p!\""), peer);
        assert_eq!(client("for=\"2001:db8::1:_p1\""), peer);
        assert_eq!(client("for=\"_hidden:_p1\""), peer);
        // Quoted-pairs are unescaped.
        assert_eq!(client("for=\"\\198.51.100.7\""), ip("198.51.100.7"));
        assert_eq!(client("for=\"[2001:db8::\\1]\""), ip("2001:db8::1"));
        assert_eq!(client("for=\"198.51.100.7\\\""), peer);
        assert_eq!(client("for=\"198.51.100.7\"x"), peer);
        // `for` twice in one element: neither value is believed.
        assert_eq!(client("for=6.6.6.6;for=198.51.100.7"), peer);
        assert_eq!(client("for=198.51.100.7;proto=http;FOR=6.6.6.6"), peer);
        assert_eq!(
            client("for=198.51.100.7;proto=http;by=10.0.0.3"),
            ip("198.51.100.7")
        );
    }

    #[test]
    fn trusted_networks_written_as_mapped_ipv6_match() {
        let t = ProxyTrust::new(
            ForwardedHeader::XForwardedFor,
            ["::ffff:10.0.0.0/104".parse().unwrap()],
        );
        let h = headers("x-forwarded-for", &["198.51.100.7"]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("198.51.100.7"));
        assert_eq!(t.client_ip(ip("::ffff:10.0.0.3"), &h), ip("198.51.100.7"));
        assert!(!t.is_trusted(ip("11.0.0.3")));
        // A single mapped address.
        let t = ProxyTrust::new(
            ForwardedHeader::XForwardedFor,
            ["::ffff:10.0.0.3/128".parse().unwrap()],
        );
        assert!(t.is_trusted(ip("10.0.0.3")));
        assert!(!t.is_trusted(ip("10.0.0.4")));
    }

    #[test]
    fn only_the_configured_header_is_read() {
        let t = trust(ForwardedHeader::Forwarded);
        let h = headers("x-forwarded-for", &["198.51.100.7"]);
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("10.0.0.3"));
    }

    #[test]
    fn empty_list_elements_are_skipped() {
        let peer = ip("10.0.0.3");
        let t = trust(ForwardedHeader::XForwardedFor);
        let xff = |lines: &[&'static str]| t.client_ip(peer, &headers("x-forwarded-for", lines));
        assert_eq!(xff(&["198.51.100.7, "]), ip("198.51.100.7"));
        assert_eq!(xff(&["198.51.100.7,,10.0.0.2"]), ip("198.51.100.7"));
        assert_eq!(xff(&["198.51.100.7, 10.0.0.2,"]), ip("198.51.100.7"));
        assert_eq!(xff(&["198.51.100.7", ""]), ip("198.51.100.7"));
        assert_eq!(xff(&[" , ,"]), peer);
        let t = trust(ForwardedHeader::Forwarded);
        let fwd = |lines: &[&'static str]| t.client_ip(peer, &headers("forwarded", lines));
        assert_eq!(
            fwd(&["for=198.51.100.7, , for=10.0.0.2"]),
            ip("198.51.100.7")
        );
        assert_eq!(fwd(&["for=198.51.100.7,"]), ip("198.51.100.7"));
        assert_eq!(fwd(&["for=198.51.100.7", ""]), ip("198.51.100.7"));
    }

    #[test]
    fn empty_elements_are_bounded_too() {
        let t = trust(ForwardedHeader::XForwardedFor);
        let mut h = HeaderMap::new();
        // Within the bound the client is found behind the empty elements...
        let few = format!("198.51.100.7{}", ",".repeat(MAX_ELEMENTS - 1));
        h.insert("x-forwarded-for", HeaderValue::try_from(few).unwrap());
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("198.51.100.7"));
        // ...beyond it the walk stops at the proxy, however long the line.
        let many = format!("198.51.100.7{}", ",".repeat(100_000));
        h.insert("x-forwarded-for", HeaderValue::try_from(many).unwrap());
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("10.0.0.3"));
        // The bound counts elements over every line.
        let mut h = HeaderMap::new();
        h.append("x-forwarded-for", HeaderValue::from_static("198.51.100.7"));
        for _ in 0..MAX_ELEMENTS {
            h.append("x-forwarded-for", HeaderValue::from_static(""));
        }
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("10.0.0.3"));
    }

    #[test]
    fn padded_lists_are_bounded() {
        let t = trust(ForwardedHeader::XForwardedFor);
        let padded = format!(
            "198.51.100.7, {}",
            vec!["10.0.0.9"; MAX_HOPS + 5].join(", ")
        );
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::try_from(padded).unwrap());
        assert_eq!(t.client_ip(ip("10.0.0.3"), &h), ip("10.0.0.9"));
    }

    #[test]
    fn the_documented_bounds_are_read_up_to_the_last_entry() {
        // docs/middleware.md promises 32 non-empty entries and 128 elements,
        // written out here rather than through the constants, so that a
        // bound that shrinks (or stops one short) is seen.
        let t = trust(ForwardedHeader::XForwardedFor);
        let xff = |value: String| {
            let mut h = HeaderMap::new();
            h.insert("x-forwarded-for", HeaderValue::try_from(value).unwrap());
            t.client_ip(ip("10.0.0.3"), &h)
        };
        // The client behind 31 trusted proxies is the 32nd entry: read.
        let chain =
            |proxies: usize| format!("198.51.100.7, {}", vec!["10.0.0.9"; proxies].join(", "));
        assert_eq!(xff(chain(31)), ip("198.51.100.7"));
        // Behind 32 it is the 33rd: the walk stops at the last proxy read.
        assert_eq!(xff(chain(32)), ip("10.0.0.9"));
        // The client behind 127 empty elements is the 128th element: read.
        assert_eq!(
            xff(format!("198.51.100.7{}", ",".repeat(127))),
            ip("198.51.100.7")
        );
    }
}
