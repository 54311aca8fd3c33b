//! Test support for the end-to-end tests of `ratewarden serve`: the real
//! binary on loopback ports, and configuration files in temporary
//! directories.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ratewarden_server::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use ratewarden_server::proto::envoy::service::ratelimit::v3::RateLimitRequest;

pub const BIN: &str = env!("CARGO_BIN_EXE_ratewarden");

/// `child`'s exit status, waited for at most `within`; `None`, with the
/// child killed, when it has not exited by then.
pub fn exit_within(child: &mut Child, within: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until just past the next window edge when it is nearer than
/// `margin`; returns at once otherwise. `serve` decides on the real clock,
/// and its windows start at multiples of `window_ms` since the Unix epoch
/// (an hour's window on the hour, UTC). A sliding-window counter weights
/// the previous window's count rounded down, so just after an edge a full
/// count counts one less and one more request is admitted: a test that
/// asserts an exact total must not have an edge fall among its requests.
/// Called just before the counted part, with a margin longer than that
/// part can take on a busy machine.
pub async fn clear_of_window_edge(window_ms: u64, margin: Duration) {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let to_edge = window_ms - now_ms % window_ms;
    if u128::from(to_edge) < margin.as_millis() {
        // A little past it, so that the requests all fall in the next
        // window, a whole window away from the one after.
        tokio::time::sleep(Duration::from_millis(to_edge + 50)).await;
    }
}

/// Waits (at most `within`) until process `pid` catches SIGTERM, as
/// `/proc/PID/status` shows in its `SigCgt` mask: until then a SIGTERM
/// would kill it outright rather than stop it cleanly. Panics, saying so,
/// when it does not by then.
pub fn wait_until_it_catches_sigterm(pid: u32, within: Duration) {
    // SIGTERM is signal 15: bit 14 of the mask.
    const SIGTERM_BIT: u64 = 1 << 14;
    let deadline = Instant::now() + within;
    loop {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_else(|e| panic!("process {pid}'s status: {e}"));
        let caught = status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .unwrap_or_else(|| panic!("no SigCgt in process {pid}'s status:\n{status}"));
        if caught & SIGTERM_BIT != 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "process {pid} did not catch SIGTERM within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The first line `child` prints on its standard output (piped), waited
/// for at most 30 s: where `serve` says it listens.
pub fn first_line(child: &mut Child) -> Result<String, std::sync::mpsc::RecvTimeoutError> {
    let stdout = child.stdout.take().expect("standard output is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    rx.recv_timeout(Duration::from_secs(30))
}

/// A `ratewarden serve` process, stopped when dropped.
pub struct Server {
    pub child: Child,
    pub http: SocketAddr,
    pub grpc: SocketAddr,
    /// Where `/metrics` is served, when `--metrics` gave it a port of
    /// its own.
    pub metrics: Option<SocketAddr>,
}

impl Server {
    pub fn start(args: &[&str]) -> Server {
        Self::start_with_stderr(args, Stdio::null())
    }

    /// As [`Server::start`], with the server's log (standard error) going
    /// to `stderr`.
    pub fn start_with_stderr(args: &[&str], stderr: Stdio) -> Server {
        Self::start_with_env(args, &[], stderr)
    }

    /// As [`Server::start_with_stderr`], with `env` set for the server.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)], stderr: Stdio) -> Server {
        let mut child = Command::new(BIN)
            .arg("serve")
            .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("the ratewarden binary starts");
        let line = first_line(&mut child).expect("serve prints where it listens");
        if line.is_empty() {
            // Its standard output closed unwritten: it ended at start.
            let status = exit_within(&mut child, Duration::from_secs(5));
            panic!(
                "serve {args:?} ended before it listened ({status:?}): on a store, its start-up \
                 checks failed (a busy machine can make them miss a short store_timeout_ms)"
            );
        }
        // "ratewarden serve: HTTP on http://ADDR/v1/check, gRPC on ADDR",
        // with ", metrics on http://ADDR/metrics" before the gRPC address
        // under --metrics.
        let http = line
            .split("http://")
            .nth(1)
            .and_then(|s| s.split('/').next())
            .expect(&line);
        let grpc = line.trim().rsplit(' ').next().expect(&line);
        let metrics = line
            .split("metrics on http://")
            .nth(1)
            .map(|s| s.split('/').next().expect(&line).parse().expect(&line));
        Server {
            child,
            http: http.parse().expect(&line),
            grpc: grpc.parse().expect(&line),
            metrics,
        }
    }

    /// As [`Server::start`], with the server's log lines read as they
    /// come.
    pub fn start_logged(args: &[&str]) -> (Server, Log) {
        let mut server = Self::start_with_stderr(args, Stdio::piped());
        let stderr = server.child.stderr.take().expect("standard error is piped");
        let (lines, received) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        (server, Log(received))
    }

    pub fn url(&self) -> String {
        format!("http://{}/v1/check", self.http)
    }

    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args(["-s", name, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Sends SIGTERM and waits (bounded) for a clean exit.
    pub fn stop(mut self) {
        self.signal("TERM");
        let status = exit_within(&mut self.child, Duration::from_secs(20))
            .expect("serve stops within 20 s of SIGTERM");
        assert!(status.success(), "serve exits cleanly on SIGTERM: {status}");
    }

    pub async fn grpc(&self) -> RateLimitServiceClient<tonic::transport::Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A server's log, line by line (see [`Server::start_logged`]).
pub struct Log(std::sync::mpsc::Receiver<String>);

impl Log {
    /// The next line that contains `needle`, waited for at most 20 s;
    /// the lines before it are passed over.
    pub fn next_containing(&self, needle: &str) -> String {
        let mut through = self.through_containing(needle);
        through.pop().expect("the line that contains the needle")
    }

    /// Every line up to and including the next that contains `needle`,
    /// waited for at most 20 s.
    pub fn through_containing(&self, needle: &str) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut lines = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.0.recv_timeout(left) {
                Ok(line) => {
                    let last = line.contains(needle);
                    lines.push(line);
                    if last {
                        return lines;
                    }
                }
                Err(e) => panic!("no log line with {needle:?} within 20 s: {e}\n{lines:#?}"),
            }
        }
    }
}

impl Log {
    /// Every line until the server's standard error closes (it has
    /// exited), waited for at most 20 s.
    pub fn to_the_end(&self) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut lines = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.0.recv_timeout(left) {
                Ok(line) => lines.push(line),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return lines,
                Err(e) => panic!("the log did not end within 20 s: {e}\n{lines:#?}"),
            }
        }
    }
}

/// The whole number a log line gives its field `name` (`name=N`).
pub fn log_field(line: &str, name: &str) -> u64 {
    line.split(&format!("{name}="))
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no whole number {name}= in {line}"))
}

/// A configuration file in a fresh temporary directory.
pub struct ConfigFile {
    dir: PathBuf,
    path: PathBuf,
}

impl ConfigFile {
    pub fn new(text: &str) -> ConfigFile {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ratewarden-serve-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ratewarden.toml");
        std::fs::write(&path, text).unwrap();
        ConfigFile { dir, path }
    }

    pub fn write(&self, text: &str) {
        // Write then rename, so a reload never reads half a file.
        let tmp = self.dir.join("next.toml");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &self.path).unwrap();
    }

    pub fn path(&self) -> &str {
        self.path.to_str().unwrap()
    }

    /// The file's directory, where its relative paths point.
    #[allow(dead_code)]
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The service's `/metrics` page, as Prometheus would read it.
pub async fn metrics(client: &reqwest::Client, http: SocketAddr) -> String {
    client
        .get(format!("http://{http}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of `series` (a metric name with its labels, as `/metrics`
/// writes it) in the text of `/metrics`; panics, showing the text, when
/// there is no such line.
pub fn metric_value(text: &str, series: &str) -> u64 {
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
}

/// The value of `series` on the server at `http` now.
pub async fn metric(client: &reqwest::Client, http: SocketAddr, series: &str) -> u64 {
    metric_value(&metrics(client, http).await, series)
}

/// The head of a `ShouldRateLimit` call to `addr`, for a raw HTTP/2
/// client, with `grpc-timeout` when given.
pub fn raw_rls_head(addr: SocketAddr, grpc_timeout: Option<&str>) -> http::Request<()> {
    let mut head = http::Request::builder()
        .method("POST")
        .uri(format!(
            "http://{addr}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(timeout) = grpc_timeout {
        head = head.header("grpc-timeout", timeout);
    }
    head.body(()).unwrap()
}

/// `request` as a gRPC message on the wire: uncompressed, its length, its
/// bytes.
pub fn grpc_message(request: &RateLimitRequest) -> Vec<u8> {
    use prost::Message;
    let encoded = request.encode_to_vec();
    let mut message = vec![0u8];
    message.extend_from_slice(&u32::try_from(encoded.len()).unwrap().to_be_bytes());
    message.extend_from_slice(&encoded);
    message
}

/// One `ShouldRateLimit` call over a raw HTTP/2 client, which sends the
/// `grpc-timeout` header as given (tonic's client writes its own): the
/// whole message, or half of it and then nothing. Returns the answer's
/// `grpc-status` and `grpc-message` (from its headers, or its trailers) and
/// when it came.
pub async fn raw_should(
    addr: SocketAddr,
    grpc_timeout: &str,
    request: &RateLimitRequest,
    whole: bool,
) -> (String, String, Instant) {
    let mut message = grpc_message(request);
    if !whole {
        message.truncate(message.len() / 2);
    }
    raw_should_bytes(addr, grpc_timeout, message, whole).await
}

/// As [`raw_should`], with the message's bytes as given (`whole`: the
/// stream ends with them).
pub async fn raw_should_bytes(
    addr: SocketAddr,
    grpc_timeout: &str,
    message: Vec<u8>,
    whole: bool,
) -> (String, String, Instant) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let (response, mut stream) = client
        .send_request(raw_rls_head(addr, Some(grpc_timeout)), false)
        .unwrap();
    stream.send_data(message.into(), whole).unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(15), response)
        .await
        .expect("answered within 15 s")
        .unwrap();
    let answered = Instant::now();
    let (parts, mut body) = answer.into_parts();
    let headers = match parts.headers.get("grpc-status") {
        Some(_) => parts.headers,
        None => {
            while let Some(chunk) = body.data().await {
                chunk.unwrap();
            }
            body.trailers().await.unwrap().unwrap()
        }
    };
    // Percent-decoded, as gRPC sends its message.
    let text = |name: &str| {
        let raw = headers.get(name).map_or(&b""[..], |v| v.as_bytes());
        let mut decoded = Vec::new();
        let mut i = 0;
        while i < raw.len() {
            if raw[i] == b'%' && i + 2 < raw.len() {
                let hex = std::str::from_utf8(&raw[i + 1..i + 3]).unwrap();
                decoded.push(u8::from_str_radix(hex, 16).unwrap());
                i += 3;
            } else {
                decoded.push(raw[i]);
                i += 1;
            }
        }
        String::from_utf8(decoded).unwrap()
    };
    let status = (text("grpc-status"), text("grpc-message"), answered);
    drop(stream);
    driver.abort();
    status
}
