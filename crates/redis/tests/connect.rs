//! Connecting: a store that cannot be used is refused at connect, with an
//! error that says what to change, never at the first decision.

mod common;

use std::net::{Ipv4Addr, TcpListener};

use ratewarden_core::{StoreErrorKind, REFERENCE};
use ratewarden_redis::test_support::{free_port, RedisCluster, RedisServer};
use ratewarden_redis::{RedisOptions, RedisStore};

fn options(tag: &str) -> RedisOptions {
    RedisOptions {
        prefix: common::fresh_prefix(tag),
        timeout_ms: 5_000,
        connect_timeout_ms: 5_000,
        ..RedisOptions::default()
    }
}

/// Connects on a runtime of its own: only for stores that are not used
/// after (a store's connection lives on the runtime it was made on).
fn connect(url: &str) -> Result<RedisStore, ratewarden_core::StoreError> {
    common::runtime().block_on(RedisStore::connect(url, REFERENCE, options("connect")))
}

#[test]
fn a_redis_that_wants_a_password_is_refused_at_connect_saying_so() {
    let server = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let port = server.port();
    let e = connect(&server.url()).expect_err("no password given");
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    let text = e.to_string();
    assert!(text.contains("requires a password"), "{text}");
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(text.contains("redis://:PASSWORD@HOST:PORT"), "{text}");

    let e = connect(&format!("redis://:wrong@127.0.0.1:{port}")).expect_err("wrong password");
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(
        e.to_string().contains("refused the URL's user or password"),
        "{e}"
    );
    // A password given to a Redis that has none is refused as wrong: the
    // message says that this is a cause too.
    let open = RedisServer::start();
    let e = connect(&format!("redis://:s3cret@127.0.0.1:{}", open.port()))
        .expect_err("a password to a Redis without one");
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("no password set"), "{e}");
    drop(open);
    // A port that is none is named as the thing to change.
    for bad in ["0", "99999"] {
        let e = connect(&format!("redis://127.0.0.1:{bad}")).expect_err("no port");
        assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
        assert!(e.to_string().contains("1 to 65535"), "{e}");
    }

    // With a /DB, connecting selects it first; the refusal is the same.
    let e = connect(&format!("redis://127.0.0.1:{port}/1")).expect_err("no password given");
    assert!(e.to_string().contains("requires a password"), "{e}");
    // A database the server does not have says what to use.
    for db in ["999", "99999999999"] {
        let url = format!("redis://:s3cret@127.0.0.1:{port}/{db}");
        let e = connect(&url).expect_err("no such db");
        assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
        assert!(
            e.to_string().contains("below the server's `databases`"),
            "{e}"
        );
    }

    // The right password: decisions are made.
    let rt = common::runtime();
    let url = format!("redis://:s3cret@127.0.0.1:{port}");
    rt.block_on(async {
        let store = RedisStore::connect(&url, REFERENCE, options("auth"))
            .await
            .expect("right password");
        let decision = store.decide(1, None, 1).await.expect("decided");
        assert!(decision.allowed);
        // The password changed while connected, and the connection closed:
        // reconnecting is refused, and each call says why.
        server.cli(&["-a", "s3cret", "CONFIG", "SET", "requirepass", "changed"]);
        server.cli(&["-a", "changed", "CLIENT", "KILL", "TYPE", "normal"]);
        let e = store
            .decide(1, None, 1)
            .await
            .expect_err("the old password");
        assert!(
            e.detail().contains("refuses the URL's user or password"),
            "{e}"
        );
        // And so does a readiness probe.
        let e = store.ping().await.expect_err("the old password");
        assert!(
            e.detail().contains("refuses the URL's user or password"),
            "{e}"
        );
    });
}

/// A Redis that answers `PING` and loads scripts but refuses every
/// decision is refused at connect, saying what to change; one that starts
/// refusing later is not ready, and says why.
#[test]
fn a_redis_that_refuses_every_decision_is_refused_at_connect_saying_why() {
    let master = RedisServer::start();
    let port = master.port().to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    let e = connect(&replica.url()).expect_err("a read-only replica");
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(e.detail().contains("read-only replica"), "{e}");
    assert!(e.detail().contains("point the URL at its master"), "{e}");
    // A writable replica takes the decisions, but counts apart from its
    // master and every other replica.
    let writable = RedisServer::start_with(&[
        "--replicaof",
        "127.0.0.1",
        &port,
        "--replica-read-only",
        "no",
    ]);
    let e = connect(&writable.url()).expect_err("a writable replica");
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(e.detail().contains("is a replica"), "{e}");
    assert!(e.detail().contains("point the URL at its master"), "{e}");

    // ACL users: one without EVALSHA, one without SCRIPT (refused at its
    // load), one without PING (refused at the first command), one whose
    // keys are elsewhere. A refused command is named, with what to grant.
    let users: [(&str, &[&str], &str); 4] = [
        (
            "noeval",
            &["~*", "+@all", "-evalsha"],
            "lacks the command evalsha, which the store needs: grant it +evalsha",
        ),
        (
            "noscript",
            &["~*", "+@all", "-script"],
            "lacks the command script|load, which the store needs: grant it +script|load",
        ),
        (
            "noping",
            &["~*", "+@all", "-ping"],
            "lacks the command ping, which the store needs: grant it +ping",
        ),
        (
            "elsewhere",
            &["~other:*", "+@all"],
            "lacks a command or a key the store needs",
        ),
    ];
    for (user, rules, says) in users {
        let mut args = vec!["ACL", "SETUSER", user, "on", ">pw"];
        args.extend(rules);
        assert_eq!(master.cli(&args).trim(), "OK");
        let url = format!("redis://{user}:pw@127.0.0.1:{port}");
        let e = connect(&url).expect_err(user);
        assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
        assert!(e.detail().contains(says), "{e}");
        assert!(e.detail().contains("+evalsha +eval +script|load"), "{e}");
        // A refused key is told how the prefix is stored, escaped.
        assert_eq!(
            e.detail()
                .contains("a key pattern must match the prefix as stored, escaped"),
            user == "elsewhere",
            "{e}"
        );
    }
    // A user without TIME is refused by default, named as such: decisions
    // by Redis's clock (the default, and serve's) need it.
    assert_eq!(
        master
            .cli(&["ACL", "SETUSER", "notime", "on", ">pw", "~*", "+@all", "-time"])
            .trim(),
        "OK"
    );
    let url = format!("redis://notime:pw@127.0.0.1:{port}");
    let e = connect(&url).expect_err("decisions by Redis's clock need TIME");
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(e.detail().contains("the command TIME"), "{e}");
    assert!(e.detail().contains("grant it +time"), "{e}");
    assert!(e.detail().contains("checks_by_redis_time false"), "{e}");
    // With checks by this machine's clock, it connects and decides by its
    // own clock; decisions by Redis's clock say what they need.
    common::runtime().block_on(async {
        let by_caller = RedisOptions {
            checks_by_redis_time: false,
            ..options("notime")
        };
        let store = RedisStore::connect(&url, REFERENCE, by_caller)
            .await
            .expect("no TIME needed to connect");
        store.ping().await.expect("ready by this machine's clock");
        store
            .decide(1, Some(1_000), 1)
            .await
            .expect("by its own clock");
        let e = store
            .decide(1, None, 1)
            .await
            .expect_err("by Redis's clock");
        assert!(e.detail().contains("+time"), "{e}");
        // Its decision's key, so that what the checks leave can be seen.
        master.cli(&["DEL", &store.key_name(1)]);

        // TIME taken away from a store's user once it is connected: not
        // ready, saying so.
        let store = RedisStore::connect(&master.url(), REFERENCE, options("losestime"))
            .await
            .expect("connect");
        let e = store.decide(1, None, 1).await;
        assert!(e.is_ok(), "{e:?}");
        master.cli(&["DEL", &store.key_name(1)]);
        assert_eq!(
            master.cli(&["ACL", "SETUSER", "default", "-time"]).trim(),
            "OK"
        );
        let e = store.ping().await.expect_err("no TIME");
        assert!(e.detail().contains("the command TIME"), "{e}");
        assert_eq!(
            master.cli(&["ACL", "SETUSER", "default", "+time"]).trim(),
            "OK"
        );
        store.ping().await.expect("ready again");
    });

    // Full (maxmemory below what it holds, and no eviction): refused at
    // connect; and a store connected before goes unready, then ready.
    let rt = common::runtime();
    rt.block_on(async {
        let store = RedisStore::connect(&master.url(), REFERENCE, options("full"))
            .await
            .expect("connect");
        store.ping().await.expect("ready");
        assert_eq!(
            master.cli(&["CONFIG", "SET", "maxmemory", "1"]).trim(),
            "OK"
        );
        let e = store.ping().await.expect_err("out of memory");
        assert_eq!(e.kind(), StoreErrorKind::Backend, "{e}");
        assert!(e.detail().contains("out of memory"), "{e}");
        let e = RedisStore::connect(&master.url(), REFERENCE, options("full"))
            .await
            .expect_err("out of memory");
        assert!(e.detail().contains("out of memory"), "{e}");
        let e = store.decide(1, None, 1).await.expect_err("out of memory");
        assert!(e.detail().contains("raise maxmemory"), "{e}");
        assert_eq!(
            master.cli(&["CONFIG", "SET", "maxmemory", "0"]).trim(),
            "OK"
        );
        store.ping().await.expect("ready again");
    });
    // The checks leave nothing behind.
    assert_eq!(master.cli(&["DBSIZE"]).trim(), "0");
}

#[test]
fn a_cluster_node_named_by_redis_url_is_refused_at_connect() {
    let cluster = RedisCluster::start();
    let node = &cluster.nodes()[0];
    let e = connect(&node.url()).expect_err("a cluster node behind redis://");
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(
        e.to_string()
            .contains("is a cluster node: use redis-cluster://"),
        "{e}"
    );
    // With a /DB, whose SELECT the node refuses first: the same advice.
    let e = connect(&format!("{}/3", node.url())).expect_err("a /DB on a cluster node");
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("is a cluster node"), "{e}");
    assert!(e.to_string().contains("redis-cluster://"), "{e}");
    // Its own form works.
    connect(&cluster.url()).expect("redis-cluster:// connects");
}

/// A cluster user refused a command the store sends while connecting is
/// told which, and what to grant, wherever connecting meets it: the
/// client's slot map, `CLUSTER INFO`, or the `PING` sent with `ASKING`.
#[test]
fn a_cluster_user_refused_a_command_is_told_which_at_connect() {
    let cluster = RedisCluster::start();
    let users = [
        ("noslots", "-cluster|slots", "cluster|slots"),
        ("noclusterinfo", "-cluster|info", "cluster|info"),
        ("noping", "-ping", "ping"),
    ];
    for (user, rule, _) in users {
        for node in cluster.nodes() {
            let granted = node.cli(&["ACL", "SETUSER", user, "on", ">pw", "~*", "+@all", rule]);
            assert_eq!(granted.trim(), "OK");
        }
    }
    for (user, _, command) in users {
        let url = cluster.url().replacen("://", &format!("://{user}:pw@"), 1);
        let e = connect(&url).expect_err(user);
        assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{user}: {e}");
        assert!(
            e.detail().contains(&format!(
                "lacks the command {command}, which the store needs: grant it +{command} \
                 (ACL SETUSER USER +{command}, on every node of a cluster)"
            )),
            "{user}: {e}"
        );
    }
}

/// A cluster node behind `redis://` whose user may not run INFO (which
/// tells a cluster node at connect) is told apart by the MOVED it answers:
/// at connect, when the check's key is another node's, and at the first
/// decision of another node's key when it is its own.
#[test]
fn a_cluster_node_whose_user_may_not_run_info_is_told_by_its_moved() {
    let cluster = RedisCluster::start();
    for node in cluster.nodes() {
        let granted = node.cli(&[
            "ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "+@all", "-info",
        ]);
        assert_eq!(granted.trim(), "OK");
    }
    let rt = common::runtime();
    let options = options("noinfo");
    let mut connected = Vec::new();
    for node in cluster.nodes() {
        let url = format!("redis://noinfo:pw@127.0.0.1:{}", node.port());
        match rt.block_on(RedisStore::connect(&url, REFERENCE, options.clone())) {
            Ok(store) => connected.push(store),
            Err(e) => {
                assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
                let text = e.to_string();
                assert!(
                    text.contains("cannot decide: it is a cluster node: use redis-cluster://"),
                    "{text}"
                );
                assert!(text.contains("Moved"), "{text}");
            }
        }
    }
    // The check's one key is one node's: that node alone connects.
    assert_eq!(connected.len(), 1, "one node serves the check's key");
    let store = &connected[0];
    let e = rt
        .block_on(async {
            for key in 0..1_000 {
                store.decide(key, None, 1).await?;
            }
            Ok::<(), ratewarden_core::StoreError>(())
        })
        .expect_err("a third of the keys are another node's");
    assert!(
        e.detail()
            .contains("; it is a cluster node: use redis-cluster://"),
        "{e}"
    );
}

#[test]
fn a_server_that_is_not_redis_is_refused_at_connect() {
    // A listener that accepts and closes every connection without a word:
    // not Redis. Bounded: it serves 10 connections at most, then the
    // test's end drops it.
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(10) {
            drop(stream);
        }
    });
    let e = connect(&format!("redis://127.0.0.1:{port}")).expect_err("not Redis");
    assert_ne!(e.kind(), StoreErrorKind::Timeout, "{e}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");

    // One that answers in another protocol (HTTP) is named as such, in
    // one line, rather than with the parser's byte codes.
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for mut stream in listener.incoming().take(10).flatten() {
            let mut request = [0u8; 512];
            let _ = stream.read(&mut request);
            let _ = stream.write_all(
                b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            );
        }
    });
    let e = connect(&format!("redis://127.0.0.1:{port}")).expect_err("not Redis");
    assert!(
        e.to_string().contains("not Redis's protocol") && !e.to_string().contains('\n'),
        "{e}"
    );
}

/// Connecting with the default `connect_timeout_ms` (1 s): the cause of a
/// failure is reported, not a timeout that hides it.
fn connect_by_default(url: &str) -> ratewarden_core::StoreError {
    let options = RedisOptions {
        prefix: common::fresh_prefix("default"),
        ..RedisOptions::default()
    };
    common::runtime()
        .block_on(RedisStore::connect(url, REFERENCE, options))
        .expect_err("the store cannot be used")
}

#[test]
fn a_failed_connection_reports_its_cause_not_a_timeout() {
    let e = connect_by_default(&format!("redis://127.0.0.1:{}", free_port(false)));
    assert_eq!(e.kind(), StoreErrorKind::ConnectionDropped, "{e}");
    assert!(
        e.detail().ends_with("cannot be used: connection refused"),
        "{e}"
    );
    // The kind is said once, by the error's own prefix.
    assert_eq!(
        e.to_string().matches("connection dropped").count(),
        1,
        "{e}"
    );

    // A name that does not resolve (`.invalid` never does, RFC 6761) is
    // said to be one, not guessed to be a TLS-only port.
    let e = connect_by_default("redis://nohost.invalid:6379");
    assert!(
        e.detail().contains("the host's name did not resolve"),
        "{e}"
    );
    assert!(!e.detail().contains("TLS only"), "{e}");

    let server = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let e = connect_by_default(&format!("redis://:wrong@127.0.0.1:{}", server.port()));
    assert!(
        e.to_string().contains("refused the URL's user or password"),
        "{e}"
    );

    let e = connect_by_default(&format!("redis://:s3cret@127.0.0.1:{}/99", server.port()));
    assert_ne!(e.kind(), StoreErrorKind::Timeout, "{e}");
    assert!(e.to_string().contains("DB index is out of range"), "{e}");
}

#[test]
fn errors_never_show_the_password() {
    let server = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let port = server.port();
    for url in [
        // Not a URL the client takes.
        "redis://:pw-not-shown@127.0.0.1:notaport".to_owned(),
        // Refused credentials.
        format!("redis://:pw-not-shown@127.0.0.1:{port}"),
        format!("redis://app:pw-not-shown@127.0.0.1:{port}"),
        // Nothing listens.
        format!("redis://:pw-not-shown@127.0.0.1:{}", free_port(false)),
        // Unescaped characters that split a cluster URL into odd seeds.
        format!("redis-cluster://u:pw-not/shown,x@127.0.0.1:{port}"),
        format!("redis-cluster://:pw-not-shown?x,y@127.0.0.1:{port}"),
        format!("redis-cluster://:pw-not@shown,x@127.0.0.1:{port}"),
        // Credentials where a Unix socket takes none.
        "redis+unix://u:pw-not-shown@localhost/run/r.sock".to_owned(),
    ] {
        let e = connect(&url).expect_err("unusable");
        let text = e.to_string();
        for part in ["pw-not", "shown"] {
            assert!(!text.contains(part), "{url}: {e}");
        }
    }
}

#[test]
fn a_unix_socket_url_connects_and_other_forms_are_checked_saying_so() {
    let socket = std::env::temp_dir().join(format!("ratewarden-test-{}.sock", std::process::id()));
    let path = socket.display().to_string();
    let server = RedisServer::start_with(&["--unixsocket", &path, "--unixsocketperm", "700"]);
    let rt = common::runtime();
    let decision = rt.block_on(async {
        let store =
            RedisStore::connect(&format!("redis+unix://{path}"), REFERENCE, options("unix"))
                .await
                .expect("redis+unix:// connects");
        store.decide(1, None, 1).await.expect("decided")
    });
    assert!(decision.allowed);
    drop(server);
    let _ = std::fs::remove_file(&socket);

    // No file there (redis-rs calls it a refused connection), a file or a
    // folder that is no socket: each is named for what it is.
    let e = connect(&format!("redis+unix://{path}")).expect_err("no socket");
    assert_eq!(e.kind(), StoreErrorKind::ConnectionDropped, "{e}");
    assert!(
        e.detail()
            .contains("no such file: no redis-server listens there"),
        "{e}"
    );
    std::fs::write(&socket, b"").expect("a plain file");
    let e = connect(&format!("redis+unix://{path}")).expect_err("a plain file");
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(e.detail().contains("it is not a socket but a file"), "{e}");
    std::fs::remove_file(&socket).expect("remove the file");
    let folder = std::env::temp_dir().display().to_string();
    let e = connect(&format!("redis+unix://{folder}")).expect_err("a folder");
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(
        e.detail().contains("it is not a socket but a folder"),
        "{e}"
    );

    // A socket whose Redis wants a password: the advice is the socket's
    // form, with the password in the query.
    let server = RedisServer::start_with(&[
        "--unixsocket",
        &path,
        "--unixsocketperm",
        "700",
        "--requirepass",
        "s3cret",
    ]);
    let e = connect(&format!("redis+unix://{path}")).expect_err("no password given");
    assert!(
        e.to_string().contains("redis+unix:///PATH?pass=PASSWORD"),
        "{e}"
    );
    let e = connect(&format!("redis+unix://{path}?pass=wrong")).expect_err("wrong password");
    assert!(
        e.to_string().contains("redis+unix:///PATH?pass=PASSWORD"),
        "{e}"
    );
    // The socket form names its database in the query.
    let e = connect(&format!("redis+unix://{path}?pass=s3cret&db=999")).expect_err("no such db");
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("the URL's ?db= names"), "{e}");
    assert!(e.to_string().contains("such as ?db=0"), "{e}");
    drop(server);
    let _ = std::fs::remove_file(&socket);

    // TLS is taken (tests/tls.rs), but never without its certificate
    // check: `#insecure` is refused before connecting.
    let e = connect("rediss://127.0.0.1:6379#insecure").expect_err("no unchecked TLS");
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("#insecure is not taken"), "{e}");
    let e = connect("http://127.0.0.1:6379").expect_err("not Redis");
    assert!(e.to_string().contains("redis+unix:///PATH"), "{e}");

    // redis-rs ignores the query fields it does not read: `?db=3` would
    // count in database 0, `?password=` would send none. Refused before
    // connecting, saying where the value goes, and showing no secret.
    for (url, says) in [
        ("redis://127.0.0.1:1?db=3", "write the database as the path"),
        (
            "redis://127.0.0.1:1?password=s3cret",
            "write the credentials before the host",
        ),
        ("redis://127.0.0.1:1/0?s3cret", "with no query"),
        (
            "redis+unix:///tmp/ratewarden-none.sock?password=s3cret",
            "takes ?db=DB&user=USER&pass=PASSWORD",
        ),
        // A fragment is ignored by redis-rs too.
        ("redis://127.0.0.1:1#s3cret", "takes no #fragment"),
        ("redis://127.0.0.1:1/2#s3cret", "takes no #fragment"),
        (
            "redis+unix:///tmp/ratewarden-none.sock#s3cret",
            "takes no #fragment",
        ),
    ] {
        let e = connect(url).expect_err(url);
        assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
        assert!(e.to_string().contains(says), "{e}");
        assert!(!e.to_string().contains("s3cret"), "{e}");
    }
}

#[test]
fn a_cluster_that_wants_a_password_is_refused_at_connect_saying_so() {
    let cluster = RedisCluster::start();
    // Set after the cluster is formed: the nodes talk over the cluster
    // bus, which needs no password.
    for node in cluster.nodes() {
        assert_eq!(
            node.cli(&["CONFIG", "SET", "requirepass", "s3cret"]).trim(),
            "OK"
        );
    }
    let first = format!("127.0.0.1:{}", cluster.nodes()[0].port());
    let names_a_node = |text: &str| {
        cluster
            .nodes()
            .iter()
            .any(|n| text.contains(&format!("Redis at 127.0.0.1:{} ", n.port())))
    };

    let e = connect_by_default(&cluster.url());
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    let text = e.to_string();
    assert!(text.contains("requires a password"), "{text}");
    assert!(
        text.contains("redis-cluster://:PASSWORD@HOST:PORT"),
        "{text}"
    );
    assert!(names_a_node(&text), "{text}");

    let wrong = cluster
        .url()
        .replacen("redis-cluster://", "redis-cluster://:pw-not-shown@", 1);
    let e = connect_by_default(&wrong);
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    let text = e.to_string();
    assert!(
        text.contains("refused the URL's user or password"),
        "{text}"
    );
    assert!(!text.contains("pw-not-shown"), "{text}");
    assert!(!text.contains("redis-server"), "{text}");
    assert!(names_a_node(&text), "{text}");

    let right = format!("redis-cluster://:s3cret@{first}");
    let decision = common::runtime().block_on(async {
        let store = RedisStore::connect(&right, REFERENCE, options("cluster-auth"))
            .await
            .expect("right password");
        store.decide(1, None, 1).await.expect("decided")
    });
    assert!(decision.allowed);
}

#[test]
fn a_single_node_behind_a_cluster_url_is_refused_saying_so() {
    let server = RedisServer::start();
    let port = server.port();
    let e = connect_by_default(&format!("redis-cluster://127.0.0.1:{port}"));
    assert_eq!(e.kind(), StoreErrorKind::InvalidInput, "{e}");
    assert!(
        e.to_string().contains(&format!(
            "Redis at 127.0.0.1:{port} is not a cluster node (cluster_enabled:0): \
             use redis://127.0.0.1:{port}"
        )),
        "{e}"
    );
}

/// A seed that answers but serves no slot (never joined, or removed with
/// `del-node`, which leaves it an empty cluster of its own) is said to be
/// one: it is no Redis to start.
#[test]
fn a_cluster_seed_that_serves_no_slot_is_refused_saying_so() {
    let server = RedisServer::start_with(&[
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
    ]);
    let e = connect_by_default(&format!("redis-cluster://127.0.0.1:{}", server.port()));
    assert_eq!(e.kind(), StoreErrorKind::Backend, "{e}");
    assert!(
        e.to_string().contains(
            "the seeds answered, but their slot map names no node (redis-cli -p PORT CLUSTER \
             SLOTS on a seed shows it): give seeds that are members of the cluster"
        ),
        "{e}"
    );
}

#[test]
fn a_cluster_url_where_nothing_listens_says_which_nodes_refused() {
    let (a, b) = (free_port(false), free_port(false));
    let e = connect_by_default(&format!(
        "redis-cluster://:pw-not-shown@127.0.0.1:{a},127.0.0.1:{b}"
    ));
    assert_eq!(e.kind(), StoreErrorKind::ConnectionDropped, "{e}");
    let text = e.to_string();
    for port in [a, b] {
        assert!(
            text.contains(&format!(
                "Redis at 127.0.0.1:{port} cannot be used: connection refused"
            )),
            "{text}"
        );
    }
    assert!(!text.contains("pw-not-shown"), "{text}");
}

/// A Redis still loading its data at start (a service started beside a
/// Redis restarted with much data) is refused saying so, and what to do:
/// start again once it has loaded.
#[test]
fn a_redis_still_loading_is_refused_saying_to_start_again_once_loaded() {
    let dir = tempfile::tempdir().expect("a folder");
    let dir_arg = dir.path().display().to_string();
    let port = free_port(false);
    let port_arg = port.to_string();
    let start = |slow: bool| {
        let mut cmd = std::process::Command::new("redis-server");
        cmd.args(["--port", &port_arg, "--bind", "127.0.0.1", "--save", ""])
            .args(["--dir", &dir_arg])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        if slow {
            // 2 ms a key, and clients answered (LOADING) between keys:
            // some 6 s of loading for the 3,000 keys below.
            cmd.args(["--key-load-delay", "2000"])
                .args(["--loading-process-events-interval-bytes", "1024"]);
        }
        cmd.spawn().expect("start redis-server")
    };
    let cli = |args: &[&str]| {
        let out = std::process::Command::new("redis-cli")
            .args(["-p", &port_arg])
            .args(args)
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let until = |answer: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !cli(&["PING"]).contains(answer) {
            assert!(
                std::time::Instant::now() < deadline,
                "no {answer} within 20 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    let mut first = start(false);
    until("PONG");
    let fill = "for i = 1, 3000 do redis.call('SET', 'k' .. i, string.rep('x', 2000)) end";
    cli(&["EVAL", fill, "0"]);
    assert_eq!(cli(&["SAVE"]).trim(), "OK");
    let _ = first.kill();
    let _ = first.wait();
    let mut loading = start(true);
    until("LOADING");
    let url = format!("redis://127.0.0.1:{port}");
    let e = connect(&url).expect_err("a Redis still loading");
    let _ = loading.kill();
    let _ = loading.wait();
    assert!(
        e.detail().contains("still loading its data set")
            && e.detail().contains("start again once it has"),
        "{e}"
    );
}

/// A Redis at its `maxclients` answers a new connection with an error and
/// closes it, which the client reports as a broken pipe: the store says
/// what Redis said, and what to change, not to start a Redis there.
#[test]
fn a_redis_at_maxclients_is_refused_saying_so() {
    let server = RedisServer::start_with(&["--maxclients", "1"]);
    let held =
        std::net::TcpStream::connect((Ipv4Addr::LOCALHOST, server.port())).expect("one client");
    let e = connect(&server.url()).expect_err("no connection left");
    drop(held);
    assert!(
        e.detail().contains("max number of clients reached") && e.detail().contains("maxclients"),
        "{e}"
    );
    assert!(!e.detail().contains("start redis-server"), "{e}");
}

/// A command the store needs, disabled on the server (`rename-command X
/// ""`), is named at connect with what to change, as a command the ACL
/// refuses is: Redis's "unknown command" alone does not say why.
#[test]
fn a_command_renamed_away_is_named_at_connect() {
    for (command, named) in [
        ("EVALSHA", "the command evalsha"),
        ("SCRIPT", "the command script"),
        ("TIME", "a command its scripts run"),
    ] {
        let server = RedisServer::start_with(&["--rename-command", command, ""]);
        let e = connect(&server.url()).expect_err("a command the store needs is disabled");
        assert!(
            e.detail().contains(named) && e.detail().contains("rename-command"),
            "{command}: {e}"
        );
    }
}

/// A URL that names a user but no password (for a user with `nopass`,
/// say) sends no `AUTH` at all: the redis crate authenticates only with a
/// password. Refused saying so, and how to write it, not only that Redis
/// "requires a password".
#[test]
fn a_user_without_a_password_is_told_to_write_one() {
    let server = RedisServer::start();
    let nopass = server.cli(&["ACL", "SETUSER", "np", "on", "nopass", "~*", "+@all"]);
    assert_eq!(nopass.trim(), "OK");
    assert_eq!(
        server.cli(&["ACL", "SETUSER", "default", "off"]).trim(),
        "OK"
    );
    for url in [
        format!("redis://np@127.0.0.1:{}", server.port()),
        format!("redis://np:@127.0.0.1:{}", server.port()),
    ] {
        let e = connect(&url).expect_err("no AUTH is sent");
        assert!(
            e.detail().contains("names the user but no password")
                && e.detail().contains("redis://USER:PASSWORD@"),
            "{url}: {e}"
        );
    }
    let url = format!("redis://np:anything@127.0.0.1:{}", server.port());
    connect(&url).expect("a nopass user takes any password");
}
