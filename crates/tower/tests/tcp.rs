//! The example server's router, served over real TCP on 127.0.0.1 and asked
//! by a real HTTP/1.1 client: the peer address travels through
//! `ConnectInfo`, and the 101st request in a second is refused.

use std::sync::Arc;
use std::time::Duration;

use http::header::RETRY_AFTER;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use ratewarden_core::{LocalLimiter, ManualClock, REFERENCE};
use ratewarden_tower::headers::{RATELIMIT, RATELIMIT_POLICY};
use tokio::net::{TcpListener, TcpStream};

// The example is compiled into this test so that the test serves exactly
// the example's router; its `main` is not used here.
#[allow(dead_code)]
#[path = "../examples/axum_server.rs"]
mod axum_server;

/// The whole exchange must finish within this time, or the test fails.
const DEADLINE: Duration = Duration::from_secs(20);

struct Reply {
    status: StatusCode,
    retry_after: Option<String>,
    ratelimit: Option<String>,
    policy: Option<String>,
    body: String,
}

async fn get(sender: &mut hyper::client::conn::http1::SendRequest<Empty<Bytes>>) -> Reply {
    send(sender, "GET", "/").await
}

async fn send(
    sender: &mut hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
    method: &str,
    uri: &str,
) -> Reply {
    sender.ready().await.expect("connection ready");
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .header("host", "127.0.0.1")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let response = sender.send_request(request).await.expect("response");
    let header = |name| {
        response
            .headers()
            .get(name)
            .map(|v: &http::HeaderValue| v.to_str().unwrap().to_owned())
    };
    let (status, retry_after, ratelimit, policy) = (
        response.status(),
        header(&RETRY_AFTER),
        header(&RATELIMIT),
        header(&RATELIMIT_POLICY),
    );
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    Reply {
        status,
        retry_after,
        ratelimit,
        policy,
        body: String::from_utf8(body.to_vec()).unwrap(),
    }
}

#[tokio::test]
async fn example_server_limits_a_real_client_over_tcp() {
    let clock = ManualClock::new(0);
    let limiter = LocalLimiter::with_clock(REFERENCE, Default::default(), clock.clone()).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(axum_server::serve(
        listener,
        axum_server::app(Arc::new(limiter)),
        async {
            let _ = stopped.await;
        },
    ));

    let exchange = async {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        let connection = tokio::spawn(connection);

        for i in 0..100u64 {
            let reply = get(&mut sender).await;
            assert_eq!(reply.status, StatusCode::OK, "request {i}");
            let remaining = 99 - i;
            assert_eq!(reply.body, format!("hello; {remaining} left this second\n"));
            assert_eq!(
                reply.ratelimit.as_deref(),
                Some(format!("\"default\";r={remaining}").as_str())
            );
            assert_eq!(reply.policy.as_deref(), Some("\"default\";q=100;w=1"));
        }
        let refused = get(&mut sender).await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.retry_after.as_deref(), Some("2"));
        assert_eq!(refused.ratelimit.as_deref(), Some("\"default\";r=0;t=2"));
        assert_eq!(refused.policy.as_deref(), Some("\"default\";q=100;w=1"));

        // Waiting the advertised two seconds admits the client again.
        clock.advance_ms(2000);
        assert_eq!(get(&mut sender).await.status, StatusCode::OK);

        // A second connection comes from the same address: the same client.
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut other, other_connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .unwrap();
        let other_connection = tokio::spawn(other_connection);
        assert_eq!(get(&mut other).await.body, "hello; 98 left this second\n");

        // The layer wraps the whole router: a path that is no route (404)
        // and a method the route does not take (405) spend budget too.
        let missing = send(&mut other, "GET", "/missing").await;
        assert_eq!(missing.status, StatusCode::NOT_FOUND);
        assert_eq!(missing.ratelimit.as_deref(), Some("\"default\";r=97"));
        let post = send(&mut other, "POST", "/").await;
        assert_eq!(post.status, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(post.ratelimit.as_deref(), Some("\"default\";r=96"));
        assert_eq!(get(&mut other).await.body, "hello; 95 left this second\n");

        drop((sender, other));
        let _ = connection.await;
        let _ = other_connection.await;
    };
    tokio::time::timeout(DEADLINE, exchange)
        .await
        .expect("the exchange took too long");

    let _ = stop.send(());
    tokio::time::timeout(DEADLINE, server)
        .await
        .expect("the server did not stop")
        .unwrap()
        .unwrap();
}
