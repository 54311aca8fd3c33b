//! The example as users run it: the compiled example server (built here as
//! `tower_axum_server`, from the root as `axum_server`, one source), started
//! with `--addr 127.0.0.1:0`, asked over real TCP, then stopped.
//!
//! `cargo test` builds the examples before running tests; the exact refusal
//! sequence is pinned by `tcp.rs` on a manual clock, so this test checks only
//! what does not depend on the system clock.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

const DEADLINE: Duration = Duration::from_secs(20);

fn example_binary() -> PathBuf {
    // Tests run from target/<profile>/deps; examples live in
    // target/<profile>/examples.
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = profile_dir
        .join("examples")
        .join(format!("tower_axum_server{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.exists(),
        "{} is missing: run the whole test suite (cargo test builds the examples) or \
         cargo build -p ratewarden-tower --example tower_axum_server",
        path.display()
    );
    path
}

/// Kills the server however the test ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_example_binary_serves_the_rate_limited_route() {
    // A name, as a newcomer writes it: resolved, and the address bound
    // printed (127.0.0.1 or ::1, both loopback).
    let mut child = Command::new(example_binary())
        .args(["--addr", "localhost:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let _server = Server(child);

    // The server prints the address it bound; read it on a thread so that
    // the wait is bounded.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(DEADLINE).expect("the server did not start");
    let addr = line
        .strip_prefix("listening on http://")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    assert!(
        line.contains("sliding-window-counter 100 per 1000 ms per client IP"),
        "{line}"
    );

    let exchange = async {
        let stream = TcpStream::connect(&addr).await.unwrap();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        let connection = tokio::spawn(connection);
        let request = Request::builder()
            .uri("/")
            .header("host", &addr)
            .body(Empty::<Bytes>::new())
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        // The first request of a fresh client leaves 99 whatever the time.
        assert_eq!(response.headers()["ratelimit"], "\"default\";r=99");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"hello; 99 left this second\n");

        let request = Request::builder()
            .uri("/elsewhere")
            .header("host", &addr)
            .body(Empty::<Bytes>::new())
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        drop(sender);
        let _ = connection.await;
    };
    tokio::time::timeout(DEADLINE, exchange)
        .await
        .expect("the exchange took too long");
}

#[test]
fn a_bad_address_is_refused_with_a_message() {
    let output = Command::new(example_binary())
        .args(["--addr", "localhost"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--addr"), "{stderr}");
}
