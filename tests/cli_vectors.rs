//! `ratewarden vectors` as a user runs it: exit statuses, the closing line,
//! failures named precisely, malformed files named with their problem.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn ratewarden(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ratewarden"))
        .args(args)
        .output()
        .unwrap()
}

/// Writes `text` to `name` in `dir`, a test's own temporary directory
/// (removed when the test ends).
fn scratch(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn the_project_vectors_pass_and_end_with_the_count_line() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = ratewarden(&["vectors", root.join("vectors").to_str().unwrap()]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let last = stdout(&out).lines().last().unwrap_or_default().to_owned();
    let passed: usize = last
        .strip_suffix(" passed, 0 failed")
        .expect(&last)
        .parse()
        .unwrap();
    assert!(passed > 600, "{last}");
}

#[test]
fn a_failing_case_is_named_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let path = scratch(
        &dir,
        "wrong.json",
        r#"{"cases": [
            {"description": "right", "policy": "fixed-window", "limit": 1, "window_ms": 10,
             "steps": [{"key": 1, "now_ms": 0, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0}]},
            {"description": "wrong wait", "policy": "fixed-window", "limit": 1, "window_ms": 10,
             "steps": [{"key": "user:42", "now_ms": 0, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0},
                       {"key": "user:42", "now_ms": 3, "cost": 1, "allowed": false, "retry_after_ms": 6, "remaining": 0}]}]}"#,
    );
    let out = ratewarden(&["vectors", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(text.contains("wrong.json case 1 (\"wrong wait\""), "{text}");
    // A string key is shown as written, with the number the store saw.
    assert!(
        text.contains("step 1 (key \"user:42\" = mix32 3349586805, now_ms 3, cost 1)"),
        "{text}"
    );
    assert!(
        text.contains("expected allowed=false retry_after_ms=6 remaining=0"),
        "{text}"
    );
    assert!(
        text.contains("got allowed=false retry_after_ms=7 remaining=0"),
        "{text}"
    );
    assert_eq!(text.lines().last(), Some("1 passed, 1 failed"));
}

#[test]
fn malformed_files_are_named_with_the_problem_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let bad_json = scratch(&dir, "bad.json", "{\"cases\": [");
    let bad_policy = scratch(
        &dir,
        "policy.json",
        r#"{"cases": [{"policy": "leaky-bucket", "limit": 1, "window_ms": 10, "steps": []}]}"#,
    );
    let negative = scratch(
        &dir,
        "negative.json",
        r#"{"cases": [{"policy": "gcra", "limit": 1, "window_ms": 10, "steps": [
            {"key": 1, "now_ms": -5, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0}]}]}"#,
    );
    for (path, needle) in [
        (&bad_json, "not valid JSON"),
        (
            &bad_policy,
            "cases[0].policy: unknown policy \"leaky-bucket\"",
        ),
        (
            &negative,
            "cases[0].steps[0].now_ms: must be a whole number",
        ),
    ] {
        let out = ratewarden(&["vectors", path.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains(path.file_name().unwrap().to_str().unwrap()),
            "{err}"
        );
        assert!(err.contains(needle), "{err}");
    }
    let out = ratewarden(&["vectors", "/nonexistent/vectors"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("/nonexistent/vectors: cannot read"),
        "{}",
        stderr(&out)
    );
    // A dangling link in a folder cannot be read: it is no malformed file.
    #[cfg(unix)]
    {
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("gone.json", dir.path().join("x.json")).unwrap();
        let out = ratewarden(&["vectors", dir.path().to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2));
        assert!(
            stderr(&out).contains("x.json: cannot read"),
            "{}",
            stderr(&out)
        );
    }
    // A directory with no vector file in it is not a pass.
    let empty = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(empty.path().join("nested")).unwrap();
    scratch(&empty, "notes.txt", "not a vector file");
    let out = ratewarden(&["vectors", empty.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("no vector files (*.json)"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_malformed_case_is_named_and_the_files_other_cases_still_run() {
    let dir = tempfile::tempdir().unwrap();
    let step = r#"{"key": 1, "now_ms": 0, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 1}"#;
    let path = scratch(
        &dir,
        "mixed.json",
        &format!(
            r#"{{"cases": [
                {{"description": "a burst the policy ignores, as in SPEC's example",
                  "policy": "sliding-window-counter", "limit": 2, "window_ms": 10, "burst": 2, "steps": [{step}]}},
                {{"description": "no window", "policy": "fixed-window", "limit": 2, "window_ms": 0, "steps": [{step}]}},
                {{"description": "numbers written as floats", "policy": "gcra", "limit": 2.0, "window_ms": 1e1, "steps": [{step}]}}
            ]}}"#
        ),
    );
    let out = ratewarden(&["vectors", path.to_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    assert!(
        stderr(&out).contains("mixed.json: malformed case, not run: cases[1]: window_ms is 0"),
        "{}",
        stderr(&out)
    );
    let text = stdout(&out);
    assert!(text.contains("1 malformed case not run"), "{text}");
    assert_eq!(text.lines().last(), Some("2 passed, 0 failed"), "{text}");
}

/// A file of many malformed cases names the first hundred, one line each,
/// and counts the rest in one line.
#[test]
fn many_malformed_cases_are_named_up_to_a_hundred() {
    let dir = tempfile::tempdir().unwrap();
    for (count, more) in [
        (150, "50 more malformed cases"),
        (101, "1 more malformed case"),
    ] {
        let cases = vec!["{}"; count].join(",");
        let path = scratch(&dir, "many.json", &format!(r#"{{"cases": [{cases}]}}"#));
        let out = ratewarden(&["vectors", path.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let err = stderr(&out);
        assert_eq!(
            err.matches("malformed case, not run: ").count(),
            100,
            "{err}"
        );
        assert!(
            err.contains(&format!("many.json: {more}, not run and not shown")),
            "{err}"
        );
        let text = stdout(&out);
        assert!(
            text.contains(&format!("{count} malformed cases not run")),
            "{text}"
        );
    }
}

#[test]
fn an_unknown_store_is_refused() {
    let out = ratewarden(&["vectors", "--store", "etcd://x", "vectors"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("unknown store \"etcd://x\""),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_wrong_mix32_value_is_named_and_fails_without_counting_as_a_case() {
    let dir = tempfile::tempdir().unwrap();
    let path = scratch(
        &dir,
        "mix32.json",
        r#"{"mix32": [{"input": "hello", "output": 613153351}, {"input": "hello", "output": 1}],
            "cases": []}"#,
    );
    let out = ratewarden(&["vectors", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(
        text.contains("mix32.json mix32[1] \"hello\": expected 1, got 613153351"),
        "{text}"
    );
    assert!(text.contains("mix32 values: 1 matched, 1 differ"), "{text}");
    // The last line alone shows the run failed.
    assert_eq!(
        text.lines().last(),
        Some("0 passed, 0 failed, and 1 mix32 value differs")
    );
}

/// A link back up the tree, or a second link to one file, runs each file
/// once: the count is of cases, not of ways to reach them.
#[cfg(unix)]
#[test]
fn links_run_each_file_once() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("in");
    std::fs::create_dir(&sub).unwrap();
    let case = r#"{"cases": [{"description": "one", "policy": "fixed-window", "limit": 1, "window_ms": 10,
        "steps": [{"now_ms": 0, "key": 1, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0}]}]}"#;
    std::fs::write(sub.join("a.json"), case).unwrap();
    std::os::unix::fs::symlink("..", sub.join("up")).unwrap();
    std::os::unix::fs::symlink("a.json", sub.join("again.json")).unwrap();
    let out = ratewarden(&["vectors", dir.path().to_str().unwrap()]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert_eq!(stdout(&out).lines().last(), Some("1 passed, 0 failed"));
    // Nor does naming it again, or its folder twice.
    let file = sub.join("a.json");
    let folder = dir.path().to_str().unwrap();
    let out = ratewarden(&["vectors", folder, file.to_str().unwrap(), folder]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert_eq!(stdout(&out).lines().last(), Some("1 passed, 0 failed"));
    // Nor folders that link to each other: each is walked once.
    for (from, to) in [("a", "b"), ("b", "a")] {
        let dir = sub.join(from);
        std::fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::symlink(sub.join(to), dir.join(format!("to-{to}"))).unwrap();
    }
    let out = ratewarden(&["vectors", folder]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert_eq!(stdout(&out).lines().last(), Some("1 passed, 0 failed"));
    // Nor a folder after the folder that holds it.
    let out = ratewarden(&["vectors", sub.to_str().unwrap(), folder]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert_eq!(stdout(&out).lines().last(), Some("1 passed, 0 failed"));
}

/// A directory's vector files are found by their extension in any case: a
/// failing `B.JSON` beside a passing `a.json` is run, not left out of a
/// run that would then pass. Other files are not read.
#[test]
fn a_directory_is_searched_for_json_in_any_case() {
    let dir = tempfile::tempdir().unwrap();
    let case = |allowed: bool| {
        format!(
            r#"{{"cases": [{{"description": "one", "policy": "fixed-window", "limit": 1, "window_ms": 10,
            "steps": [{{"now_ms": 0, "key": 1, "cost": 1, "allowed": {allowed}, "retry_after_ms": 0, "remaining": 0}}]}}]}}"#
        )
    };
    scratch(&dir, "a.json", &case(true));
    scratch(&dir, "B.JSON", &case(false));
    scratch(&dir, "notes.txt", "not a vector file");
    let out = ratewarden(&["vectors", dir.path().to_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    assert!(stdout(&out).contains("B.JSON case 0"), "{}", stdout(&out));
    assert_eq!(stdout(&out).lines().last(), Some("1 passed, 1 failed"));
}

/// A reader that stops early (`ratewarden vectors DIR | head`) is not a
/// failure: the run ends quietly, with the status its cases give, rather
/// than panicking on the broken pipe.
#[test]
fn a_closed_standard_output_ends_the_run_quietly() {
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    // A failing case, so that there are lines to write and the status the
    // run would have had is 1, not 0.
    let path = scratch(
        &dir,
        "fails.json",
        r#"{"cases": [
            {"description": "wrong wait", "policy": "fixed-window", "limit": 1, "window_ms": 10,
             "steps": [{"key": 1, "now_ms": 0, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0},
                       {"key": 1, "now_ms": 3, "cost": 1, "allowed": false, "retry_after_ms": 6, "remaining": 0}]}]}"#,
    );
    let path = path.to_str().unwrap();
    let expected = ratewarden(&["vectors", path]);
    assert_eq!(expected.status.code(), Some(1), "{}", stderr(&expected));
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratewarden"))
        .args(["vectors", path])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Closing the read end before the child has started up means its first
    // write finds no reader.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
    assert!(!stderr(&out).contains("Broken pipe"), "{}", stderr(&out));
}

/// Standard error whose reader went away (`2>&1 | head -1`) loses the
/// messages, not the exit status: a panic's 101 would read as a crash.
#[test]
fn a_closed_standard_error_keeps_the_exit_status() {
    let dir = tempfile::tempdir().unwrap();
    let bad = scratch(&dir, "bad.json", "{\"cases\": [");
    let (reader, writer) = std::io::pipe().unwrap();
    // No reader from the start: every write to standard error fails.
    drop(reader);
    let status = Command::new(env!("CARGO_BIN_EXE_ratewarden"))
        .args(["vectors", bad.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(writer)
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(2));
}

/// A field the format does not have is ignored and named on standard
/// error, so that a misspelt `burst` does not go unseen; so are a field
/// given twice and a burst its policy ignores. None changes the verdict.
#[test]
fn fields_the_format_does_not_have_are_named_on_standard_error() {
    let dir = tempfile::tempdir().unwrap();
    // The standard error of a passing run of one case with `fields`.
    let noted = |name: &str, fields: &str| {
        let case = format!(
            r#"{{"cases": [{{"description": "{name}", {fields}, "steps": [{{"key": 1,
            "now_ms": 0, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 4}}]}}]}}"#
        );
        let path = scratch(&dir, &format!("{name}.json"), &case);
        let out = ratewarden(&["vectors", path.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        assert_eq!(stdout(&out).lines().last(), Some("1 passed, 0 failed"));
        stderr(&out)
    };
    let typo = noted(
        "typo",
        r#""policy": "token-bucket", "limit": 5, "window_ms": 1000, "brust": 50"#,
    );
    assert!(
        typo.contains("typo.json: note: ignored fields the vector format does not have")
            && typo.contains("cases[0].brust"),
        "{typo}"
    );
    // A field given twice is named too: readers differ on which they take.
    let twice = noted(
        "twice",
        r#""policy": "token-bucket", "limit": 50, "window_ms": 1000, "limit": 5"#,
    );
    assert!(
        twice.contains("twice.json: note: fields given twice in one object")
            && twice.contains("keep one): cases[0].limit\n"),
        "{twice}"
    );
    // A burst on a policy without a bucket, as in SPEC's own example, is
    // ignored, and said: a case written for a bucket tests something else.
    let burst = noted(
        "burst",
        r#""policy": "fixed-window", "limit": 5, "window_ms": 1000, "burst": 50"#,
    );
    assert!(
        burst.contains("burst.json: note: bursts given to a policy without a bucket")
            && burst.contains("gcra take one): cases[0].burst\n"),
        "{burst}"
    );
    // The project's own files hold no such field.
    let out = ratewarden(&["vectors", concat!(env!("CARGO_MANIFEST_DIR"), "/vectors")]);
    assert!(!stderr(&out).contains("note:"), "{}", stderr(&out));
}

/// A case of no steps passes, as it tests nothing, and is named on
/// standard error: one a generator wrote empty, or left as a placeholder,
/// would otherwise pass without a sign.
#[test]
fn cases_of_no_steps_are_named_on_standard_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = scratch(
        &dir,
        "empty.json",
        r#"{"cases": [
            {"description": "one", "policy": "fixed-window", "limit": 5, "window_ms": 1000,
             "steps": [{"key": 1, "now_ms": 0, "cost": 1, "allowed": true,
                        "retry_after_ms": 0, "remaining": 4}]},
            {"description": "none", "policy": "fixed-window", "limit": 5, "window_ms": 1000,
             "steps": []}]}"#,
    );
    let out = ratewarden(&["vectors", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "empty.json: note: cases with no steps, which pass without testing anything: \
             cases[1]\n"
        ),
        "{}",
        stderr(&out)
    );
    assert!(
        stdout(&out).contains("2 passed, 0 failed"),
        "{}",
        stdout(&out)
    );
    // A file of no cases at all is named too.
    let path = scratch(&dir, "nothing.json", r#"{"cases": []}"#);
    let out = ratewarden(&["vectors", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "nothing.json: note: no cases and no mix32 entries: the file tests nothing\n"
        ),
        "{}",
        stderr(&out)
    );
}

/// One case that passes.
const PASSING: &str = r#"{"cases": [
    {"description": "right", "policy": "fixed-window", "limit": 1, "window_ms": 10,
     "steps": [{"key": 1, "now_ms": 0, "cost": 1, "allowed": true, "retry_after_ms": 0, "remaining": 0}]}]}"#;

/// Runs `ratewarden` with `args` and nothing to read on standard input,
/// killed if it has not ended within two minutes. These runs take well
/// under a second; the bound is there only so that a run waiting for ever
/// fails the test rather than hanging it.
#[cfg(unix)]
fn ratewarden_bounded(args: &[&str]) -> Output {
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratewarden"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("ratewarden {args:?} was still running after two minutes");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// A pipe or a device is no vector file: one in a folder, however it is
/// reached, is named with what it is (exit 2) and not waited on or read
/// without end, while the folder's files still run; one given directly is
/// named so too, not taken for a directory.
#[cfg(unix)]
#[test]
fn pipes_and_devices_are_named_and_never_read() {
    let dir = tempfile::tempdir().unwrap();
    let fifos = dir.path().join("fifos");
    std::fs::create_dir(&fifos).unwrap();
    let fifo = fifos.join("p.json");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    std::fs::write(fifos.join("ok.json"), PASSING).unwrap();
    let devices = dir.path().join("devices");
    std::fs::create_dir(&devices).unwrap();
    std::os::unix::fs::symlink("/dev/null", devices.join("null.json")).unwrap();
    std::fs::write(devices.join("ok.json"), PASSING).unwrap();
    for (folder, entry, kind) in [
        (&fifos, "p.json", "a pipe (FIFO)"),
        (&devices, "null.json", "a character device"),
    ] {
        let out = ratewarden_bounded(&["vectors", folder.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&format!("{entry}: not read: {kind}, not a regular file")),
            "{err}"
        );
        assert_eq!(stdout(&out).lines().last(), Some("1 passed, 0 failed"));
    }
    for path in [fifo.to_str().unwrap(), "/dev/stdin"] {
        let out = ratewarden_bounded(&["vectors", path]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains(&format!("{path}: not read: a pipe (FIFO)")),
            "{err}"
        );
        assert!(!err.contains("directory"), "{err}");
    }
}

/// A file past the bound is refused before it is read, saying the bound.
#[test]
fn a_file_larger_than_256_mib_is_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.json");
    // Sparse: no disk space is taken.
    let file = std::fs::File::create(&path).unwrap();
    file.set_len((256 << 20) + 1).unwrap();
    let out = ratewarden(&["vectors", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains(
            "huge.json: not read: 268435457 bytes, more than the 268435456 bytes (256 MiB)"
        ),
        "{err}"
    );
}

/// A report that cannot be written (to a full disk, here /dev/full) is a
/// run whose outcome nobody sees: it exits 2, not 0, saying why.
#[cfg(target_os = "linux")]
#[test]
fn a_report_that_cannot_be_written_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = scratch(&dir, "ok.json", PASSING);
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ratewarden"))
        .args(["vectors", path.to_str().unwrap()])
        .stdout(full)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cannot write to standard output: No space left on device"),
        "{}",
        stderr(&out)
    );
}
