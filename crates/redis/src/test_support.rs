//! Real `redis-server` processes for tests: single nodes and 3-master
//! clusters on free loopback ports, stopped when dropped.
//!
//! Needs `redis-server` and `redis-cli` on `PATH` (Debian: `redis-server`
//! and `redis-tools`). Every wait here is bounded.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long a server may take to start answering.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// Fills the queue of connections to accept of `listener`, a loopback
/// listener that never accepts, and returns them: past the queue's length
/// (the listen backlog, 128 for std, plus one) a new connection is neither
/// accepted nor refused, since Linux drops its first packet.
pub fn fill_accept_queue(listener: &TcpListener) -> Vec<TcpStream> {
    let address = listener.local_addr().expect("the listener's address");
    let mut queued = Vec::new();
    loop {
        match TcpStream::connect_timeout(&address, Duration::from_millis(500)) {
            Ok(stream) => queued.push(stream),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => break,
            Err(e) => panic!("filling the port's queue: {e}"),
        }
        assert!(queued.len() <= 10_000, "the port never stopped accepting");
    }
    queued
}

/// A free loopback port; with `bus`, port + 10000 (a cluster node's bus)
/// is free too.
///
/// Taken below the system's range of ephemeral ports (Linux's
/// `ip_local_port_range`, 32768 and up by default), and never the same one
/// twice in a process: a port that a killed server frees for its restart
/// then stays free, where one from the ephemeral range could meanwhile be
/// handed to a concurrent test's `bind(0)`, or be an outgoing connection's
/// own port. Each process starts at its own place in the range, so that two
/// test processes at once seldom try the same ports. Where the ephemeral
/// range starts too low for that, the system picks (`bind(0)`).
pub fn free_port(bus: bool) -> u16 {
    /// The first port handed out; below it are well-known services' ports.
    const FIRST: u32 = 10_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let bindable = |port: u32| {
        u16::try_from(port).is_ok_and(|port| TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok())
    };
    // The ports and their buses stay below the ephemeral range.
    let end = u32::from(ephemeral_ports_start()).saturating_sub(u32::from(BUS_OFFSET));
    if end < FIRST + 1_000 {
        return free_port_from_the_system(bus);
    }
    let span = end - FIRST;
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id() % span,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..span {
        let port = FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % span;
        if bindable(port) && (!bus || bindable(port + u32::from(BUS_OFFSET))) {
            return u16::try_from(port).expect("below the ephemeral range");
        }
    }
    panic!("no free loopback port found from {FIRST} to {end}");
}

/// How far above its port a cluster node's bus listens.
const BUS_OFFSET: u16 = 10_000;

/// The first port of the system's ephemeral range: Linux's, or 32768 (the
/// lowest default of Linux and the BSDs) where it cannot be read.
fn ephemeral_ports_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// [`free_port`] as the system picks it.
fn free_port_from_the_system(bus: bool) -> u16 {
    for _ in 0..1000 {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a loopback port");
        let port = listener.local_addr().expect("local address").port();
        if !bus {
            return port;
        }
        if port < 55_000 && TcpListener::bind((Ipv4Addr::LOCALHOST, port + BUS_OFFSET)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port found in 1000 tries");
}

/// Sends one inline command over a raw socket and returns the reply text;
/// enough for PING and CLUSTER INFO without a client.
fn raw_command(port: u16, command: &str) -> Option<String> {
    let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_millis(500)))
        .ok()?;
    stream.write_all(format!("{command}\r\n").as_bytes()).ok()?;
    let mut buf = [0u8; 4096];
    let n = stream.read(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// Asks `ok` every 50 ms until it holds or `deadline` passes; whether it
/// held.
fn poll_until(deadline: Instant, mut ok: impl FnMut() -> bool) -> bool {
    loop {
        if ok() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A certificate made wrong on purpose, for a test of what a client says
/// about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertFlaw {
    /// The server certificate holds no subjectAltName, only the CN
    /// `127.0.0.1`.
    ServerWithoutNames,
    /// The client certificate's dates ended long ago.
    ClientExpired,
    /// The client certificate's extended key usage is server
    /// authentication only.
    ClientForServersOnly,
}

/// Certificates for TLS tests, as PEM files in a temporary directory
/// (removed when dropped): a CA of its own, a server certificate for
/// `127.0.0.1` and `localhost`, and a client certificate, both signed by
/// that CA. Each value has a CA of its own, so another one's CA does not
/// trust these certificates.
pub struct TestCerts {
    dir: tempfile::TempDir,
}

impl TestCerts {
    /// Makes the CA and the two certificates.
    #[allow(clippy::new_without_default)]
    pub fn new() -> TestCerts {
        Self::with_server(&["127.0.0.1", "localhost"], false)
    }

    /// As [`TestCerts::new`], with a server certificate for `names` only,
    /// and with `expired` one whose dates ended long ago.
    pub fn with_server(names: &[&str], expired: bool) -> TestCerts {
        Self::make(names, expired, None)
    }

    /// As [`TestCerts::new`], with one certificate made with `flaw`.
    pub fn with_flaw(flaw: CertFlaw) -> TestCerts {
        Self::make(&["127.0.0.1", "localhost"], false, Some(flaw))
    }

    fn make(names: &[&str], expired: bool, flaw: Option<CertFlaw>) -> TestCerts {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
            KeyUsagePurpose,
        };
        let dir = tempfile::tempdir().expect("temporary directory");
        let write = |name: &str, pem: String| {
            std::fs::write(dir.path().join(name), pem).expect("write a PEM file");
        };
        let ca_key = KeyPair::generate().expect("a CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        ca.distinguished_name
            .push(DnType::CommonName, "ratewarden test CA");
        let ca = ca.self_signed(&ca_key).expect("the CA certificate");
        write("ca.crt", ca.pem());
        for (stem, names, usages) in [
            // Client use too, as Redis's own TLS links between nodes (a
            // cluster's bus, a replica's) show it.
            (
                "server",
                names.iter().map(|n| n.to_string()).collect(),
                vec![
                    ExtendedKeyUsagePurpose::ServerAuth,
                    ExtendedKeyUsagePurpose::ClientAuth,
                ],
            ),
            (
                "client",
                vec!["client.test".to_owned()],
                vec![ExtendedKeyUsagePurpose::ClientAuth],
            ),
        ] {
            let key = KeyPair::generate().expect("a key");
            let server = stem == "server";
            let names = match flaw {
                Some(CertFlaw::ServerWithoutNames) if server => Vec::new(),
                _ => names,
            };
            let mut params = CertificateParams::new(names).expect("parameters");
            params.extended_key_usages = match flaw {
                Some(CertFlaw::ClientForServersOnly) if !server => {
                    vec![ExtendedKeyUsagePurpose::ServerAuth]
                }
                _ => usages,
            };
            if (expired && server) || (flaw == Some(CertFlaw::ClientExpired) && !server) {
                params.not_before = rcgen::date_time_ymd(2000, 1, 1);
                params.not_after = rcgen::date_time_ymd(2001, 1, 1);
            }
            // Without names, the server's address stands in its CN alone,
            // as in certificates made for TLS before subjectAltName.
            let common_name = if server && flaw == Some(CertFlaw::ServerWithoutNames) {
                "127.0.0.1"
            } else {
                stem
            };
            params
                .distinguished_name
                .push(DnType::CommonName, common_name);
            let cert = params.signed_by(&key, &ca, &ca_key).expect("a certificate");
            write(&format!("{stem}.crt"), cert.pem());
            write(&format!("{stem}.key"), key.serialize_pem());
        }
        TestCerts { dir }
    }

    /// The CA's certificate.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// The server's certificate (for `127.0.0.1` and `localhost`).
    pub fn server_cert_file(&self) -> PathBuf {
        self.dir.path().join("server.crt")
    }

    /// The server certificate's private key.
    pub fn server_key_file(&self) -> PathBuf {
        self.dir.path().join("server.key")
    }

    /// The client's certificate.
    pub fn client_cert_file(&self) -> PathBuf {
        self.dir.path().join("client.crt")
    }

    /// The client certificate's private key.
    pub fn client_key_file(&self) -> PathBuf {
        self.dir.path().join("client.key")
    }
}

/// `redis-server`'s arguments for TLS with `certs`' server certificate,
/// asking clients for certificates with `client_certs`.
fn tls_args(certs: &TestCerts, client_certs: bool) -> Vec<String> {
    let path = |p: PathBuf| p.display().to_string();
    vec![
        "--tls-cert-file".to_owned(),
        path(certs.server_cert_file()),
        "--tls-key-file".to_owned(),
        path(certs.server_key_file()),
        "--tls-ca-cert-file".to_owned(),
        path(certs.ca_file()),
        "--tls-auth-clients".to_owned(),
        if client_certs { "yes" } else { "no" }.to_owned(),
    ]
}

/// One `redis-server` on 127.0.0.1, killed when dropped.
pub struct RedisServer {
    port: u16,
    /// The TLS port, when it takes TLS (beside the plain `port`).
    tls_port: Option<u16>,
    child: Option<Child>,
    dir: tempfile::TempDir,
    cluster: bool,
    /// More `redis-server` arguments, such as `--requirepass`.
    extra: Vec<String>,
    /// While a killed cluster node is down: its bus port, held (see
    /// [`RedisServer::kill`]).
    bus_hold: Option<TcpListener>,
    /// While its host is gone: its port, held silent (see
    /// [`RedisServer::kill_host`]).
    port_hold: Option<(TcpListener, Vec<TcpStream>)>,
}

impl RedisServer {
    /// Starts a node on a free port and waits until it answers PING.
    pub fn start() -> RedisServer {
        Self::start_fresh(false, &[])
    }

    /// Starts a node with more `redis-server` arguments (for example
    /// `["--requirepass", "s3cret"]`) and waits until it answers.
    pub fn start_with(args: &[&str]) -> RedisServer {
        Self::start_fresh(false, args)
    }

    /// Starts a node that takes TLS on a port of its own (see
    /// [`RedisServer::tls_url`]) with `certs`' server certificate, besides
    /// plain connections on [`RedisServer::port`] (for the test's own
    /// checks). With `client_certs`, a TLS client must show a certificate
    /// that `certs`' CA signed (`tls-auth-clients yes`).
    pub fn start_tls(certs: &TestCerts, client_certs: bool) -> RedisServer {
        let args = tls_args(certs, client_certs);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Self::start_fresh_tls(false, &args, true)
    }

    /// Starts a node on a port found free, trying another port when a
    /// concurrent test took that one first.
    fn start_fresh(cluster: bool, extra: &[&str]) -> RedisServer {
        Self::start_fresh_tls(cluster, extra, false)
    }

    /// [`RedisServer::start_fresh`], with a TLS port of its own when `tls`.
    fn start_fresh_tls(cluster: bool, extra: &[&str], tls: bool) -> RedisServer {
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("temporary directory");
            let mut server = RedisServer {
                port: free_port(cluster),
                // A cluster node with TLS runs its bus over TLS, on the
                // TLS port + 10000.
                tls_port: tls.then(|| free_port(cluster)),
                child: None,
                dir,
                cluster,
                extra: extra.iter().map(|a| a.to_string()).collect(),
                bus_hold: None,
                port_hold: None,
            };
            if server.spawn() {
                return server;
            }
        }
        if tls {
            panic!(
                "redis-server could not start with TLS on a free port in 5 tries: is it built \
                 with TLS? (Debian's and Ubuntu's are; `redis-server --tls-port 1` says \
                 whether this one is)"
            );
        }
        panic!("redis-server could not start on a free port in 5 tries");
    }

    /// Starts the process and waits until it answers PING; false when the
    /// process exits first (its port was taken), so that a PING answered
    /// by some other server on that port never counts.
    fn spawn(&mut self) -> bool {
        self.bus_hold = None;
        self.port_hold = None;
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &self.port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--dir", &self.dir.path().display().to_string()])
        .args(
            self.tls_port
                .iter()
                .flat_map(|port| ["--tls-port".to_owned(), port.to_string()]),
        )
        .args(&self.extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        if self.cluster {
            cmd.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ]);
        }
        let mut child = cmd.spawn().expect("start redis-server (is it installed?)");
        let exited = |c: &mut Child| c.try_wait().ok().flatten().is_some();
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            if exited(&mut child) {
                return false;
            }
            // NOAUTH: a server started with --requirepass answers too.
            if raw_command(self.port, "PING")
                .is_some_and(|r| r.starts_with("+PONG") || r.starts_with("-NOAUTH"))
            {
                if exited(&mut child) {
                    return false;
                }
                self.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "redis-server on port {} did not answer within {START_TIMEOUT:?}",
            self.port
        );
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The TLS port, on a node started with [`RedisServer::start_tls`].
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// `rediss://127.0.0.1:TLS_PORT`, on a node started with
    /// [`RedisServer::start_tls`].
    pub fn tls_url(&self) -> Option<String> {
        self.tls_port
            .map(|port| format!("rediss://127.0.0.1:{port}"))
    }

    /// The process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Kills the server at once (SIGKILL), as a crash would. A cluster
    /// node's bus port (port + 10000) is then held, listening but never
    /// answered, until the node restarts or is dropped.
    ///
    /// Holding it keeps the other nodes' failure detection certain. Redis
    /// flags a node as failing only once a ping to it goes unanswered;
    /// a refused connect records no ping when the refusal comes after
    /// `connect` returned, as it can on a loaded machine, so a killed
    /// node's port alone might never be flagged. And a node that a
    /// concurrent test starts could take the freed ports: the others then
    /// drop the killed node's address on its first answer and stop
    /// checking it at all. Through the held port every ping is sent and
    /// none is answered, as with a crashed host. Should another process
    /// have taken the port in the instant since the kill, nothing is held.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            if self.cluster {
                let bus = self.tls_port.unwrap_or(self.port) + BUS_OFFSET;
                self.bus_hold = TcpListener::bind((Ipv4Addr::LOCALHOST, bus)).ok();
            }
        }
    }

    /// Kills the server (see [`RedisServer::kill`]) and holds its port
    /// (the plain one) silent, as a host that is gone: the connections made
    /// before are closed (as when the process dies before its host goes,
    /// or a container is deleted with its address), and new ones are
    /// neither accepted nor refused. The port listens and its queue of
    /// connections to accept is kept full, so Linux drops every new
    /// connection's first packet. Until [`RedisServer::restart`] or drop.
    pub fn kill_host(&mut self) {
        self.kill();
        let listener =
            TcpListener::bind((Ipv4Addr::LOCALHOST, self.port)).expect("hold the killed port");
        let queued = fill_accept_queue(&listener);
        self.port_hold = Some((listener, queued));
    }

    /// Starts the server again on the same port (with empty data).
    pub fn restart(&mut self) {
        self.kill();
        assert!(
            self.spawn(),
            "redis-server could not start again on port {}",
            self.port
        );
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a frozen server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        if let Some(pid) = self.pid() {
            let status = Command::new("kill")
                .args([sig, &pid.to_string()])
                .status()
                .expect("run kill");
            assert!(status.success(), "kill {sig} {pid} failed");
        }
    }

    /// Runs `redis-cli -p PORT args...` and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("run redis-cli (is redis-tools installed?)");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// How many connections clients hold to the server (`CLIENT LIST TYPE
    /// normal`), leaving out the `redis-cli` that asks.
    pub fn clients(&self) -> usize {
        self.cli(&["CLIENT", "LIST", "TYPE", "normal"])
            .lines()
            .filter(|line| line.starts_with("id=") && !line.contains("cmd=client|list"))
            .count()
    }

    /// Every key with its `PTTL` (SCAN, then PTTL of each): -1 for no TTL,
    /// -2 for a key gone since the scan.
    fn key_ttls(&self) -> Vec<(String, i64)> {
        let client = redis::Client::open(self.url()).expect("client");
        let mut conn = client
            .get_connection_with_timeout(Duration::from_secs(2))
            .expect("connect");
        let keys: Vec<String> = {
            use redis::Commands;
            conn.scan::<String>()
                .expect("SCAN")
                .collect::<Result<_, _>>()
                .expect("SCAN")
        };
        keys.into_iter()
            .map(|key| {
                let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut conn).expect("PTTL");
                (key, ttl)
            })
            .collect()
    }

    /// Keys that have no TTL, at most 100 listed.
    pub fn keys_without_ttl(&self) -> Vec<String> {
        self.key_ttls()
            .into_iter()
            .filter(|(_, ttl)| *ttl == -1)
            .map(|(key, _)| key)
            .take(100)
            .collect()
    }

    /// The longest TTL of any key, in ms; `None` when there is no key. A
    /// key without a TTL counts as `i64::MAX`.
    pub fn longest_ttl_ms(&self) -> Option<i64> {
        self.key_ttls()
            .into_iter()
            .map(|(_, ttl)| if ttl == -1 { i64::MAX } else { ttl })
            .max()
    }

    /// The directory the server runs in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A frozen server must be thawed to die promptly on some systems;
        // SIGKILL works on a stopped process too, so kill is enough.
        self.kill();
    }
}

/// A Redis Cluster of three masters, with or without a replica each,
/// killed when dropped.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

/// How long `redis-cli --cluster create` may take to bring every node to
/// `cluster_state:ok` (and every replica to its master).
const CLUSTER_START_TIMEOUT: Duration = Duration::from_secs(30);

impl RedisCluster {
    /// Starts three cluster-enabled nodes, joins them with
    /// `redis-cli --cluster create`, and waits until every node reports
    /// `cluster_state:ok`.
    pub fn start() -> RedisCluster {
        Self::start_nodes(3, 0, &[], None)
    }

    /// Three masters that take TLS on ports of their own (see
    /// [`RedisCluster::tls_url`]), with `certs`' server certificate, and
    /// talk to each other over TLS (`tls-cluster yes`), so that `CLUSTER
    /// SLOTS` asked over TLS names the TLS ports. Plain ports stay open
    /// for the test's own checks.
    pub fn start_tls(certs: &TestCerts) -> RedisCluster {
        let mut args = tls_args(certs, false);
        args.extend(["--tls-cluster", "yes", "--tls-replication", "yes"].map(str::to_owned));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Self::start_nodes(3, 0, &args, Some(certs))
    }

    /// Three masters and one replica of each (`--cluster-replicas 1`), with
    /// a `cluster-node-timeout` of `node_timeout_ms` (with 1000 a replica
    /// takes over a failed master in about 2 to 3 s; Redis's default is
    /// 15000). Waits until every node reports `cluster_state:ok`, every
    /// replica's link to its master is up, and every node lists every
    /// replica in `CLUSTER SLOTS` (Redis lists a replica only once it has
    /// replicated something). The first three nodes are the masters.
    pub fn start_with_replicas(node_timeout_ms: u64) -> RedisCluster {
        let node_timeout_ms = node_timeout_ms.to_string();
        Self::start_nodes(6, 1, &["--cluster-node-timeout", &node_timeout_ms], None)
    }

    /// `tls`: the nodes take TLS with these certificates, and are joined
    /// through their TLS ports.
    fn start_nodes(
        count: usize,
        replicas: usize,
        extra: &[&str],
        tls: Option<&TestCerts>,
    ) -> RedisCluster {
        let mut nodes: Vec<RedisServer> = Vec::new();
        while nodes.len() < count {
            let node = RedisServer::start_fresh_tls(true, extra, tls.is_some());
            let ports_of = |n: &RedisServer| [Some(n.port), n.tls_port].into_iter().flatten();
            let clash = nodes
                .iter()
                .flat_map(ports_of)
                .any(|p| ports_of(&node).any(|q| q == p));
            if !clash {
                nodes.push(node);
            }
        }
        let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.tls_port.unwrap_or(n.port)))
            .collect();
        let tls_cli: Vec<String> = match tls {
            Some(certs) => vec![
                "--tls".to_owned(),
                "--cacert".to_owned(),
                certs.ca_file().display().to_string(),
            ],
            None => Vec::new(),
        };
        let out = Command::new("redis-cli")
            .args(&tls_cli)
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let deadline = Instant::now() + CLUSTER_START_TIMEOUT;
        let ok = poll_until(deadline, || {
            ports.iter().all(|&p| {
                raw_command(p, "CLUSTER INFO").is_some_and(|r| r.contains("cluster_state:ok"))
                    && raw_command(p, "INFO replication").is_some_and(|r| {
                        r.contains("role:master") || r.contains("master_link_status:up")
                    })
            })
        });
        assert!(
            ok,
            "cluster did not reach cluster_state:ok in {CLUSTER_START_TIMEOUT:?}"
        );
        if replicas > 0 {
            // A write on each master (FLUSHALL of an empty node) gives its
            // replica a replication offset, without which Redis leaves the
            // replica out of CLUSTER SLOTS, so clients would never see it.
            for node in &nodes {
                if raw_command(node.port, "ROLE").is_some_and(|r| r.contains("master")) {
                    raw_command(node.port, "FLUSHALL");
                }
            }
            let listed = poll_until(deadline, || {
                ports.iter().all(|&p| {
                    raw_command(p, "CLUSTER SLOTS")
                        .is_some_and(|r| ports.iter().all(|q| r.contains(&format!(":{q}\r\n"))))
                })
            });
            assert!(
                listed,
                "CLUSTER SLOTS did not list every replica in {CLUSTER_START_TIMEOUT:?}"
            );
        }
        RedisCluster { nodes }
    }

    /// The node id of the node at `index` (`CLUSTER MYID`).
    pub fn node_id(&self, index: usize) -> String {
        self.nodes[index]
            .cli(&["CLUSTER", "MYID"])
            .trim()
            .to_owned()
    }

    /// Whether the node at `index` is a master (`ROLE`).
    pub fn is_master(&self, index: usize) -> bool {
        self.nodes[index].cli(&["ROLE"]).lines().next() == Some("master")
    }

    /// The index of the replica of the master at `master`, as the node at
    /// `asked` sees it (`CLUSTER NODES`).
    pub fn replica_of(&self, master: usize, asked: usize) -> Option<usize> {
        let id = self.node_id(master);
        let listing = self.nodes[asked].cli(&["CLUSTER", "NODES"]);
        listing.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(3) != Some(&id.as_str()) || !fields.get(2)?.contains("slave") {
                return None;
            }
            let port: u16 = fields.get(1)?.split(['@', ':']).nth(1)?.parse().ok()?;
            self.nodes.iter().position(|n| n.port == port)
        })
    }

    /// Kills the node at `index` (SIGKILL), as a crash would.
    pub fn kill_node(&mut self, index: usize) {
        self.nodes[index].kill();
    }

    /// Kills the node at `index` and makes its host gone (see
    /// [`RedisServer::kill_host`]).
    pub fn kill_host(&mut self, index: usize) {
        self.nodes[index].kill_host();
    }

    /// Kills the node at `index` and starts it again on its port and
    /// folder, so that it rejoins the cluster from its `nodes.conf`.
    pub fn restart_node(&mut self, index: usize) {
        self.nodes[index].restart();
    }

    /// Waits until the node at `index` is a master, at most `within`;
    /// whether it became one.
    pub fn wait_until_master(&self, index: usize, within: Duration) -> bool {
        poll_until(Instant::now() + within, || self.is_master(index))
    }

    /// `rediss-cluster://127.0.0.1:T1,127.0.0.1:T2,127.0.0.1:T3`, the TLS
    /// ports, on a cluster started with [`RedisCluster::start_tls`].
    pub fn tls_url(&self) -> Option<String> {
        let addrs: Option<Vec<String>> = self
            .nodes
            .iter()
            .map(|n| n.tls_port.map(|p| format!("127.0.0.1:{p}")))
            .collect();
        Some(format!("rediss-cluster://{}", addrs?.join(",")))
    }

    /// `redis-cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`.
    pub fn url(&self) -> String {
        let addrs: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        format!("redis-cluster://{}", addrs.join(","))
    }

    /// The nodes.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Starts one more node (plain, no TLS), a master that serves no slot,
    /// joins it to the cluster with `CLUSTER MEET`, and waits (at most
    /// 30 s) until every node knows every other and reports
    /// `cluster_state:ok`; its index in
    /// [`RedisCluster::nodes`].
    pub fn add_empty_master(&mut self) -> usize {
        let node = loop {
            let node = RedisServer::start_fresh_tls(true, &[], false);
            if self.nodes.iter().all(|n| n.port != node.port) {
                break node;
            }
        };
        let port = node.port.to_string();
        assert_eq!(
            self.nodes[0]
                .cli(&["CLUSTER", "MEET", "127.0.0.1", &port])
                .trim(),
            "OK"
        );
        self.nodes.push(node);
        let known = self.nodes.len();
        let deadline = Instant::now() + CLUSTER_START_TIMEOUT;
        for node in &self.nodes {
            let joined = poll_until(deadline, || {
                let nodes = node.cli(&["CLUSTER", "NODES"]);
                nodes.lines().count() == known
                    && nodes
                        .lines()
                        .all(|l| l.contains("connected") && !l.contains("handshake"))
                    && node.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok")
            });
            assert!(
                joined,
                "the new node did not join the cluster: {}",
                node.cli(&["CLUSTER", "NODES"])
            );
        }
        known - 1
    }

    /// Removes the node at `index`, which must serve no slot, with
    /// `redis-cli --cluster del-node`: every other node forgets it, and it
    /// runs on as an empty cluster of its own (the tool resets it). Waits
    /// (at most 30 s) until no other node lists it. It keeps its index.
    pub fn remove_node(&mut self, index: usize) {
        let id = self.node_id(index);
        let other = self
            .nodes
            .iter()
            .enumerate()
            .find(|&(i, _)| i != index)
            .map(|(_, n)| format!("127.0.0.1:{}", n.port))
            .expect("another node");
        let out = Command::new("redis-cli")
            .args(["--cluster", "del-node", &other, &id])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster del-node");
        assert!(
            out.status.success(),
            "del-node failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let deadline = Instant::now() + CLUSTER_START_TIMEOUT;
        for (i, node) in self.nodes.iter().enumerate() {
            if i == index {
                continue;
            }
            let forgotten = poll_until(deadline, || !node.cli(&["CLUSTER", "NODES"]).contains(&id));
            assert!(forgotten, "node {i} still lists the removed node");
        }
    }

    /// The longest TTL of any key on any node, in ms, as
    /// [`RedisServer::longest_ttl_ms`] gives it.
    pub fn longest_ttl_ms(&self) -> Option<i64> {
        self.nodes.iter().filter_map(|n| n.longest_ttl_ms()).max()
    }

    /// Keys without a TTL on any node.
    pub fn keys_without_ttl(&self) -> Vec<String> {
        self.nodes
            .iter()
            .flat_map(|n| n.keys_without_ttl())
            .collect()
    }
}
