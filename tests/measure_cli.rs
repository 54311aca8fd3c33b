//! `ratewarden bench` and `ratewarden simulate` as a user runs them: the
//! real binary, small sizes, outputs parsed back.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ratewarden_redis::test_support::{free_port, RedisServer};

fn ratewarden(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ratewarden"))
        .args(args)
        .output()
        .expect("the ratewarden binary runs")
}

/// Fails the test, showing what the run said on stderr, unless `out` is
/// a run that succeeded.
fn assert_succeeded(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The path `name` in `dir`, a test's own temporary directory (removed
/// when the test ends).
fn scratch(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

/// Every speed workload of `ratewarden bench`, as its rows name them.
const SPEED_WORKLOADS: [&str; 5] = [
    "hot-key",
    "hot-key-every-ms",
    "uniform-1m",
    "zipf-1m",
    "uniform-1m-threads",
];

/// The shortest `bench` run: too few keys for `bytes_per_key`, and the
/// shortest accuracy run allowed.
const TINY_BENCH: [&str; 9] = [
    "bench",
    "--keys",
    "1000",
    "--decisions",
    "1000",
    "--reps",
    "1",
    "--accuracy-duration-ms",
    "1001",
];

/// A short `bench --json` run that still measures every column: enough
/// keys for `bytes_per_key`, and two threads for the threads row.
const SMALL_BENCH_JSON: [&str; 12] = [
    "bench",
    "--json",
    "--keys",
    "100000",
    "--decisions",
    "4000",
    "--reps",
    "1",
    "--threads",
    "2",
    "--accuracy-duration-ms",
    "5000",
];

#[test]
fn bench_json_rows_parse_with_the_named_fields() {
    let out = ratewarden(&SMALL_BENCH_JSON);
    assert_succeeded(&out);
    let rows: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let find = |policy: &str, workload: &str| {
        rows.iter()
            .find(|r| r["policy"] == policy && r["workload"] == workload)
            .unwrap_or_else(|| panic!("no row {policy} / {workload}"))
    };
    for policy in [
        "fixed-window",
        "sliding-window-counter",
        "sliding-log",
        "token-bucket",
        "gcra",
        "governor",
    ] {
        for workload in SPEED_WORKLOADS {
            let row = find(policy, workload);
            assert!(row["ns_per_decision"].as_f64().unwrap() > 0.0, "{row}");
            assert!(row["decisions_per_sec"].as_f64().unwrap() > 0.0, "{row}");
            assert_eq!(row["time_source"], "supplied", "{row}");
        }
        let uniform = find(policy, "uniform-1m");
        assert_eq!(uniform["entries_tracked"], 100000, "{uniform}");
        assert!(uniform["bytes_per_key"].is_number(), "{uniform}");
        assert_eq!(find(policy, "hot-key")["entries_tracked"], 1);
        assert_eq!(find(policy, "hot-key-every-ms")["entries_tracked"], 1);
        assert_eq!(find(policy, "uniform-1m-threads")["threads"], 2);
    }
    for workload in ["hot-key", "hot-key-every-ms", "uniform-1m", "zipf-1m"] {
        assert!(find("baseline-hashmap", workload)["ns_per_decision"].is_number());
    }
    for workload in SPEED_WORKLOADS {
        assert!(find("baseline-atomic", workload)["ns_per_decision"].is_number());
    }
    assert_eq!(
        find("baseline-atomic", "uniform-1m")["entries_tracked"],
        100000
    );
    // The first line says what the rows were measured with.
    let run = &rows[0];
    assert_eq!(run["workload"], "run", "{run}");
    assert_eq!(
        (
            &run["keys"],
            &run["decisions"],
            &run["reps"],
            &run["threads"],
            &run["accuracy_duration_ms"],
            &run["seed"],
            &run["limit"],
            &run["window_ms"],
        ),
        (
            &100000.into(),
            &4000.into(),
            &1.into(),
            &2.into(),
            &5000.into(),
            &1.into(),
            &100.into(),
            &1000.into(),
        ),
        "{run}"
    );
    assert_eq!(run["notes"], serde_json::json!([]), "{run}");
    // The rows come in the table's order: the published figure after the
    // accuracy rows, before the targets.
    let at = |workload: &str| rows.iter().position(|r| r["workload"] == workload);
    assert!(
        at("published") < at("target"),
        "published after the targets"
    );
    assert!(at("published") > at("run"));
    let published = find("sliding-window-counter", "published");
    assert_eq!(published["wrong_pct"], 0.003, "{published}");
    assert!(published["source"].as_str().unwrap().contains("Cloudflare"));
    for shape in [
        "steady-0.8x",
        "steady-2x",
        "boundary-attack",
        "poisson-bursts",
        "heavy-tail-keys",
    ] {
        let exact = find("sliding-log", shape);
        assert!(exact["requests"].as_u64().unwrap() > 0, "{exact}");
        assert_eq!(exact["false_admit_pct"], 0.0, "{exact}");
        assert_eq!(exact["false_reject_pct"], 0.0, "{exact}");
        assert!(
            exact["max_in_window_ratio"].as_f64().unwrap() <= 1.0,
            "{exact}"
        );
        assert!(find("sliding-window-counter", shape)["false_admit_pct"].is_number());
    }
    assert_eq!(
        find("fixed-window", "boundary-attack")["max_in_window_ratio"],
        2.0
    );
    assert!(rows
        .iter()
        .any(|r| r["workload"] == "target" && r["met"].is_boolean()));
    for (policy, check) in [
        ("baseline-hashmap", "uniform-1m ns / governor's"),
        (
            "baseline-atomic",
            "threads / single-thread decisions_per_sec",
        ),
    ] {
        let line = rows
            .iter()
            .find(|r| r["workload"] == "context" && r["policy"] == policy)
            .unwrap_or_else(|| panic!("no context line for {policy}"));
        assert_eq!(line["check"], check, "{line}");
        assert!(line["ratio"].as_f64().unwrap() > 0.0, "{line}");
    }
}

/// Sizes too small for `bytes_per_key` and the threads target leave
/// those out, and both outputs say why: a JSON reader as well as a
/// reader of the table.
#[test]
fn bench_says_in_both_outputs_what_small_sizes_leave_out() {
    let args = [&TINY_BENCH[..], &["--threads", "1"]].concat();
    let notes = [
        "bytes_per_key: not measured below --keys 100000 (resident memory moves in 4 KiB \
         pages, too coarse for 1000 keys)",
        "uniform-1m-threads ran on one thread (--threads 1): no threads target",
    ];
    let table = ratewarden(&args);
    assert_succeeded(&table);
    let table = String::from_utf8(table.stdout).unwrap();
    for note in notes {
        assert!(table.lines().any(|l| l == note), "{note:?} not in\n{table}");
    }
    let json = ratewarden(&[&args[..], &["--json"]].concat());
    assert_succeeded(&json);
    let rows = json_rows(&json);
    assert_eq!(rows[0]["workload"], "run", "{}", rows[0]);
    assert_eq!(rows[0]["notes"], serde_json::json!(notes), "{}", rows[0]);
    let uniform = rows
        .iter()
        .find(|r| r["policy"] == "gcra" && r["workload"] == "uniform-1m")
        .expect("a gcra uniform-1m row");
    assert_eq!(uniform.get("bytes_per_key"), None, "{uniform}");
}

/// A reader that stops reading (`| head -1`) ends neither command with a
/// panic: they end as they would have.
#[test]
fn bench_output_to_a_closed_pipe_is_no_failure() {
    for json in [false, true] {
        let mut args = TINY_BENCH.to_vec();
        if json {
            args.push("--json");
        }
        let mut child = spawn_ratewarden(&args, &[]);
        // Closed before the run writes anything: every write meets it.
        drop(child.stdout.take());
        let out = finish_within(child, Duration::from_secs(120), &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{:?}: {stderr}", out.status);
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// `bench`'s memory child stops once its standard input closes, as it
/// does when `bench`, which holds it open, is gone: it must not go on
/// filling memory for nobody.
#[test]
fn bench_memory_stops_when_its_parent_is_gone() {
    let args = [
        "bench-memory",
        "--contender",
        "fixed-window",
        "--keys",
        "4000000",
        "--while-stdin-open",
    ];
    // Its standard input reads nothing (as a pipe whose writer is gone).
    let child = spawn_ratewarden(&args, &[]);
    let out = finish_within(child, Duration::from_secs(120), &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it measured: {:?}", out.stdout);
    assert!(
        stderr.contains("bench, which started it, has gone"),
        "{stderr}"
    );
}

#[test]
fn simulate_writes_an_svg_chart_and_the_csv_series() {
    let dir = tempfile::tempdir().unwrap();
    let (svg, csv) = (scratch(&dir, "attack.svg"), scratch(&dir, "attack.csv"));
    let out = ratewarden(&[
        "simulate",
        "--policy",
        "fixed-window,sliding-window-counter,sliding-log",
        "--shape",
        "boundary-attack",
        "--duration-ms",
        "6000",
        "--out",
        svg.to_str().unwrap(),
        "--csv",
        csv.to_str().unwrap(),
    ]);
    assert_succeeded(&out);
    let chart = std::fs::read_to_string(&svg).unwrap();
    assert!(
        chart.starts_with("<svg") && chart.trim_end().ends_with("</svg>"),
        "not an SVG document"
    );
    for text in [
        "time (ms)",
        "requests/s",
        "fixed-window: admitted rate",
        "sliding-log",
        "limit: 100 per 1000 ms",
    ] {
        assert!(chart.contains(text), "the chart lacks `{text}`");
    }
    // Tick labels are written as numbers are read: `200`, never `200.0`.
    let labels: Vec<&str> = chart
        .split("</text>")
        .filter_map(|t| t.rsplit('>').next())
        .map(str::trim)
        .filter(|t| t.starts_with(|c: char| c.is_ascii_digit()))
        .collect();
    assert!(labels.contains(&"200"), "no tick 200 among {labels:?}");
    assert!(
        labels.iter().all(|t| !t.ends_with(".0")),
        "a tick ends in .0: {labels:?}"
    );
    let series = std::fs::read_to_string(&csv).unwrap();
    let mut lines = series.lines();
    assert_eq!(
        lines.next(),
        Some("policy,start_ms,offered_per_sec,admitted_per_sec,trailing_count,limit")
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    // Three policies, 6000 ms in 50 ms buckets.
    assert_eq!(rows.len(), 3 * 120);
    let peak = |policy: &str| {
        rows.iter()
            .filter(|r| r[0] == policy)
            .map(|r| r[4].parse::<u64>().unwrap())
            .max()
            .unwrap()
    };
    assert_eq!(
        (
            peak("fixed-window"),
            peak("sliding-window-counter"),
            peak("sliding-log")
        ),
        (200, 100, 100)
    );
    // Files with the mode of any file the user creates (0666 less the
    // umask), not a temporary file's owner-only one.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let reference = scratch(&dir, "mode-reference");
        std::fs::File::create(&reference).unwrap();
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&svg), mode(&reference));
        assert_eq!(mode(&csv), mode(&reference));
    }

    // A run that cannot write its CSV writes nothing: the chart from the
    // run above stays as it was, and no temporary file is left beside it.
    let before = std::fs::read_to_string(&svg).unwrap();
    let out = ratewarden(&[
        "simulate",
        "--policy",
        "gcra",
        "--shape",
        "steady-2x",
        "--out",
        svg.to_str().unwrap(),
        "--csv",
        "/nonexistent/dir/series.csv",
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(
            "--csv /nonexistent/dir/series.csv: the folder /nonexistent/dir does not exist"
        ),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read_to_string(&svg).unwrap(), before);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".ratewarden-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Paths are compared and checked as the files they name, before the run:
/// no spelling of one file gets both outputs, and a path that cannot be
/// written replaces nothing.
#[test]
fn simulate_checks_its_output_paths_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let svg = scratch(&dir, "chart.svg");
    std::fs::write(&svg, "old chart").unwrap();
    let folder = scratch(&dir, "folder");
    std::fs::create_dir(&folder).unwrap();
    let run = |out: &str, csv: &str| {
        ratewarden(&[
            "simulate",
            "--policy",
            "gcra",
            "--shape",
            "steady-2x",
            "--out",
            out,
            "--csv",
            csv,
        ])
    };
    // The run failed, saying `words`.
    let refused = |out: Output, words: &str| {
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(words), "{stderr}");
    };
    // A chart to `path` alone, which must be written.
    let chart = |path: &Path| {
        let out = ratewarden(&[
            "simulate",
            "--policy",
            "gcra",
            "--shape",
            "steady-2x",
            "--out",
            path.to_str().unwrap(),
        ]);
        assert_succeeded(&out);
    };
    let is_link = |path: &Path| {
        std::fs::symlink_metadata(path)
            .unwrap()
            .file_type()
            .is_symlink()
    };
    let svg_text = svg.to_str().unwrap();
    let dotted = format!("{}/./chart.svg", dir.path().display());
    refused(run(svg_text, &dotted), "are the same file");
    // A CSV path that is a folder: refused, and the old chart stays.
    refused(
        run(svg_text, folder.to_str().unwrap()),
        "is a folder; give a file path",
    );
    assert_eq!(std::fs::read_to_string(&svg).unwrap(), "old chart");
    fails_with(
        &[
            "simulate",
            "--policy",
            "gcra",
            "--shape",
            "steady-2x",
            "--out",
            &format!("{}/", folder.display()),
        ],
        &["names a folder; give a file path, such as"],
    );
    // The chart is SVG: another extension, or none, is refused, and no
    // file is made.
    for name in ["chart.png", "chart"] {
        let path = scratch(&dir, name);
        let out = run(
            path.to_str().unwrap(),
            scratch(&dir, "s.csv").to_str().unwrap(),
        );
        assert_eq!(out.status.code(), Some(2));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("give a path ending in .svg"), "{stderr}");
        assert!(!path.exists() && !scratch(&dir, "s.csv").exists());
    }
    // A series named as a chart is refused (the two paths swapped, most
    // likely), and neither file is made.
    let swapped = scratch(&dir, "b.svg");
    let out = run(
        scratch(&dir, "a.svg").to_str().unwrap(),
        swapped.to_str().unwrap(),
    );
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the series is CSV, not a chart"),
        "{stderr}"
    );
    assert!(stderr.contains("were --out and --csv swapped?"), "{stderr}");
    assert!(!swapped.exists() && !scratch(&dir, "a.svg").exists());
    // A folder that takes no new file is found before the run (a mistake
    // in the command line, exit 2), saying so.
    #[cfg(target_os = "linux")]
    {
        let out = run("/proc/ratewarden-chart.svg", svg_text);
        assert_eq!(out.status.code(), Some(2));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("cannot write a file in /proc: the folder takes no new files"),
            "{stderr}"
        );
        assert_eq!(std::fs::read_to_string(&svg).unwrap(), "old chart");
    }
    // A symbolic link is followed: the file it points to gets the chart.
    #[cfg(unix)]
    {
        let link = scratch(&dir, "link.svg");
        std::os::unix::fs::symlink(&svg, &link).unwrap();
        chart(&link);
        assert!(is_link(&link));
        assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));

        // A link to a file not made yet is followed too: the file is made
        // where it points, and the link stays a link.
        let charts = scratch(&dir, "charts");
        std::fs::create_dir(&charts).unwrap();
        let to_new = scratch(&dir, "latest.svg");
        std::os::unix::fs::symlink("charts/new.svg", &to_new).unwrap();
        chart(&to_new);
        assert!(is_link(&to_new));
        assert!(std::fs::read_to_string(charts.join("new.svg"))
            .unwrap()
            .starts_with("<svg"));

        // A link into a folder that does not exist is refused, as the
        // folder of a path given directly would be, and replaces nothing.
        let nowhere = scratch(&dir, "series.csv");
        std::os::unix::fs::symlink("nowhere/series.csv", &nowhere).unwrap();
        refused(
            run(to_new.to_str().unwrap(), nowhere.to_str().unwrap()),
            "in a folder that does not exist",
        );
        assert!(is_link(&nowhere));

        // A link to a folder not made yet names no file.
        let to_folder = scratch(&dir, "to-folder.svg");
        std::os::unix::fs::symlink("charts/later/", &to_folder).unwrap();
        refused(
            run(to_folder.to_str().unwrap(), nowhere.to_str().unwrap()),
            "is a link to the folder",
        );
        assert!(!charts.join("later").exists());

        // A link named .svg to a file that is not: the file's name is
        // the one to change, not the link's, which ends in .svg already.
        let png = scratch(&dir, "picture.png");
        std::fs::write(&png, "not a chart").unwrap();
        let to_png = scratch(&dir, "to-png.svg");
        std::os::unix::fs::symlink(&png, &to_png).unwrap();
        refused(
            run(to_png.to_str().unwrap(), nowhere.to_str().unwrap()),
            "picture.png, which does not end in .svg",
        );
        assert_eq!(std::fs::read_to_string(&png).unwrap(), "not a chart");

        // Two hard links to one file are one file.
        let hard = scratch(&dir, "hard.csv");
        std::fs::hard_link(&svg, &hard).unwrap();
        refused(run(svg_text, hard.to_str().unwrap()), "are the same file");
    }
}

/// A short `simulate` of gcra on `steady-2x`, its chart written to `out`.
fn short_gcra_chart(out: &str) -> Vec<&str> {
    vec![
        "simulate",
        "--policy",
        "gcra",
        "--shape",
        "steady-2x",
        "--duration-ms",
        "2000",
        "--out",
        out,
    ]
}

/// A file replaced keeps its mode: a chart and series kept private stay
/// private, though the new files are made with the usual mode.
#[cfg(unix)]
#[test]
fn simulate_keeps_the_mode_of_the_files_it_replaces() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let svg = scratch(&dir, "private.svg");
    let csv = scratch(&dir, "private.csv");
    for (path, mode) in [(&svg, 0o600), (&csv, 0o640)] {
        std::fs::write(path, "old").unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    // And its owner and group, where the user may give them: root may give
    // the series to nobody; another user keeps its own.
    use std::os::unix::fs::MetadataExt as _;
    let _ = std::os::unix::fs::chown(&csv, Some(65534), Some(65534));
    let owner = |p: &std::path::Path| {
        let meta = std::fs::metadata(p).unwrap();
        (meta.uid(), meta.gid())
    };
    let csv_owner = owner(&csv);
    let mut args = short_gcra_chart(svg.to_str().unwrap());
    args.extend(["--csv", csv.to_str().unwrap()]);
    let out = ratewarden(&args);
    assert_succeeded(&out);
    for (path, mode) in [(&svg, 0o600), (&csv, 0o640)] {
        let meta = std::fs::metadata(path).unwrap();
        assert_eq!(
            meta.permissions().mode() & 0o7777,
            mode,
            "{}",
            path.display()
        );
        assert!(meta.len() > 3, "{} was not replaced", path.display());
    }
    assert_eq!(owner(&csv), csv_owner);
}

/// A file the user may not write is refused before the run, as a shell's
/// `>` would refuse it, though its folder would let it be replaced.
#[cfg(unix)]
#[test]
fn simulate_refuses_to_replace_a_file_the_user_may_not_write() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let svg = scratch(&dir, "kept.svg");
    std::fs::write(&svg, "old").unwrap();
    std::fs::set_permissions(&svg, std::fs::Permissions::from_mode(0o444)).unwrap();
    let args = short_gcra_chart(svg.to_str().unwrap());
    // Root may write any file: it runs as nobody, whom the file's mode
    // refuses as it refuses its owner.
    let root = Command::new("id").arg("-u").output().unwrap().stdout == b"0\n";
    let out = if root {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(env!("CARGO_BIN_EXE_ratewarden"))
            .args(&args)
            .output()
            .expect("setpriv runs")
    } else {
        ratewarden(&args)
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("exists and is not writable by you; make it writable"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&svg).unwrap(), "old");
}

/// A series file that cannot be replaced (immutable, set with `chattr
/// +i`) fails the run after the chart's move, which is then undone: the
/// old chart stays. The flag needs root and a file system that keeps it;
/// without them the test says so and passes (the move's undoing is also
/// tested in the binary's own unit tests, with no such needs).
#[cfg(target_os = "linux")]
#[test]
fn simulate_puts_the_old_chart_back_when_the_series_cannot_be_replaced() {
    /// Clears the flag however the test ends, so the folder can be removed.
    struct Immutable<'a>(&'a Path);
    impl Drop for Immutable<'_> {
        fn drop(&mut self) {
            let _ = Command::new("chattr").arg("-i").arg(self.0).status();
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let svg = scratch(&dir, "keep.svg");
    let csv = scratch(&dir, "keep.csv");
    std::fs::write(&svg, "OLDCHART\n").unwrap();
    std::fs::write(&csv, "OLDCSV\n").unwrap();
    let flagged = Command::new("chattr")
        .arg("+i")
        .arg(&csv)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    let _guard = Immutable(&csv);
    if !flagged || std::fs::write(&csv, "x").is_ok() {
        eprintln!("note: chattr +i is not available here (it needs root); test skipped");
        return;
    }
    let out = ratewarden(&[
        "simulate",
        "--shape",
        "boundary-attack",
        "--policy",
        "fixed-window",
        "--duration-ms",
        "3000",
        "--out",
        svg.to_str().unwrap(),
        "--csv",
        csv.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("moving the new file into place"),
        "{stderr}"
    );
    // Compared whole, shown short: a new chart is tens of kilobytes.
    for (path, old) in [(&svg, "OLDCHART\n"), (&csv, "OLDCSV\n")] {
        let text = std::fs::read_to_string(path).unwrap();
        let start: String = text.chars().take(60).collect();
        assert!(text == old, "{} was replaced: {start}...", path.display());
    }
    let mut names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["keep.csv", "keep.svg"]);
}

#[test]
fn simulate_refuses_what_would_draw_a_misleading_chart() {
    let dir = tempfile::tempdir().unwrap();
    let svg = scratch(&dir, "never.svg");
    let svg = svg.to_str().unwrap();
    fails_with(
        &[
            "simulate",
            "--policy",
            "gcra,sliding-log,gcra",
            "--shape",
            "steady-2x",
            "--out",
            svg,
        ],
        &["--policy names gcra twice"],
    );
    // A trailing or doubled comma: an empty name, said as such.
    fails_with(
        &[
            "simulate",
            "--policy",
            "gcra,",
            "--shape",
            "steady-2x",
            "--out",
            svg,
        ],
        &["--policy gcra, has an empty name: remove the extra comma"],
    );
    // The attack's first requests are at 999 and 1000 ms.
    fails_with(
        &[
            "simulate",
            "--policy",
            "gcra",
            "--shape",
            "boundary-attack",
            "--duration-ms",
            "1000",
            "--out",
            svg,
        ],
        &["give --duration-ms 1001 or more"],
    );
    // Past the longest run, the advice is the window's, not the run's.
    fails_with(
        &[
            "simulate",
            "--policy",
            "gcra",
            "--shape",
            "boundary-attack",
            "--window-ms",
            "3600000",
            "--duration-ms",
            "3600000",
            "--bucket-ms",
            "180",
            "--out",
            svg,
        ],
        &["give --window-ms 3599999 or less"],
    );
    fails_with(
        &[
            "simulate",
            "--policy",
            "gcra",
            "--shape",
            "steady-2x",
            "--window-ms",
            "9007199254740991",
            "--duration-ms",
            "3600000",
            "--bucket-ms",
            "180",
            "--out",
            svg,
        ],
        &["give a higher --limit or a shorter --window-ms"],
    );
    // An hour's window in 100 s makes no poisson burst: the refusal for
    // `limit`.
    let empty_bursts = |limit: &str| {
        let out = ratewarden(&[
            "simulate",
            "--policy",
            "sliding-log",
            "--shape",
            "poisson-bursts",
            "--limit",
            limit,
            "--window-ms",
            "3600000",
            "--duration-ms",
            "100000",
            "--out",
            svg,
        ]);
        assert_eq!(out.status.code(), Some(2));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // A higher limit makes bigger bursts, not more of them...
    let stderr = empty_bursts("10000000");
    assert!(
        stderr.contains("a shorter --window-ms (a burst starts about once a window")
            && !stderr.contains("--limit"),
        "{stderr}"
    );
    // ...except where bursts are mostly empty.
    let stderr = empty_bursts("1");
    assert!(
        stderr.contains("or a higher --limit (a burst holds about 0.6 times it)"),
        "{stderr}"
    );
    fails_with(
        &[
            "simulate",
            "--policy",
            "gcra",
            "--shape",
            "steady-2x",
            "--duration-ms",
            "3600000",
            "--out",
            svg,
        ],
        &["give --bucket-ms 180 or more"],
    );
    assert!(!std::path::Path::new(svg).exists());
}

/// The last bucket, cut short by the end of the run, is a rate over its
/// own length.
#[test]
fn simulate_rates_a_short_last_bucket_over_its_length() {
    let dir = tempfile::tempdir().unwrap();
    let (svg, csv) = (scratch(&dir, "s.svg"), scratch(&dir, "s.csv"));
    // The boundary attack for 1001 ms, in buckets of `bucket_ms`.
    let run = |bucket_ms: &str| {
        let out = ratewarden(&[
            "simulate",
            "--policy",
            "sliding-log",
            "--shape",
            "boundary-attack",
            "--duration-ms",
            "1001",
            "--bucket-ms",
            bucket_ms,
            "--out",
            svg.to_str().unwrap(),
            "--csv",
            csv.to_str().unwrap(),
        ]);
        assert_succeeded(&out);
        std::fs::read_to_string(&svg).unwrap()
    };
    let chart = run("500");
    let series = std::fs::read_to_string(&csv).unwrap();
    let last: Vec<&str> = series.lines().last().unwrap().split(',').collect();
    // 100 requests in the 1 ms from 1000 to 1001: 100,000 per second
    // offered, none admitted (the log is full from the 100 at 999).
    assert_eq!(&last[..4], ["sliding-log", "1000", "100000", "0"]);
    assert!(chart.contains("rates in 500 ms buckets"), "{chart}");

    // A bucket longer than the run is the run: the caption says so, not
    // a bucket length the rates were not taken over.
    let chart = run("20000");
    assert!(
        chart.contains("rates over the whole run (1001 ms)"),
        "{chart}"
    );
}

fn fails_with(args: &[&str], words: &[&str]) {
    let out = ratewarden(args);
    assert!(!out.status.success(), "{args:?} succeeded");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for word in words {
        assert!(stderr.contains(word), "{args:?}: `{word}` not in: {stderr}");
    }
}

/// A negative count is a value for its flag, not an unknown flag: the
/// answer names the flag and says what is wrong.
#[test]
fn negative_counts_name_their_flag() {
    let dir = tempfile::tempdir().unwrap();
    let svg = scratch(&dir, "never.svg");
    let svg = svg.to_str().unwrap();
    let simulate = [
        "simulate",
        "--policy",
        "gcra",
        "--shape",
        "steady-2x",
        "--out",
        svg,
    ];
    for flag in ["--limit", "--window-ms", "--duration-ms", "--bucket-ms"] {
        let args: Vec<&str> = simulate.iter().copied().chain([flag, "-1"]).collect();
        fails_with(&args, &[flag, "must not be negative"]);
    }
    fails_with(
        &["bench", "--keys", "-5"],
        &["--keys", "must not be negative"],
    );
    fails_with(
        &["bench", "--accuracy-duration-ms", "999"],
        &["--accuracy-duration-ms must reach past the first window edge"],
    );
    // At exactly one window the boundary attack would offer nothing.
    fails_with(
        &["bench", "--accuracy-duration-ms", "1000"],
        &["give 1001 or more"],
    );
    let help = ratewarden(&["bench", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("at least 1,001 (past the first window edge"),
        "{help}"
    );
    fails_with(
        &["bench", "--accuracy-duration-ms", "-1000"],
        &["--accuracy-duration-ms", "must not be negative"],
    );
    fails_with(
        &[
            "bench-redis",
            "--store",
            "redis://127.0.0.1:1",
            "--pipeline",
            "-2",
        ],
        &["--pipeline", "must not be negative"],
    );
}

#[test]
fn bad_arguments_exit_non_zero_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let svg = scratch(&dir, "never.svg");
    let svg = svg.to_str().unwrap();
    fails_with(
        &[
            "simulate",
            "--policy",
            "leaky-bucket",
            "--shape",
            "steady-2x",
            "--out",
            svg,
        ],
        &["unknown policy `leaky-bucket`", "sliding-window-counter"],
    );
    fails_with(
        &[
            "simulate", "--policy", "gcra", "--shape", "sawtooth", "--out", svg,
        ],
        &["unknown shape `sawtooth`", "boundary-attack"],
    );
    fails_with(
        &[
            "simulate",
            "--policy",
            "gcra",
            "--shape",
            "steady-2x",
            "--window-ms",
            "0",
            "--out",
            svg,
        ],
        &["window_ms is 0", "at least 1 ms"],
    );
    fails_with(
        &[
            "simulate",
            "--policy",
            "gcra",
            "--shape",
            "steady-2x",
            "--duration-ms",
            "0",
            "--out",
            svg,
        ],
        &["--duration-ms"],
    );
    fails_with(
        &[
            "simulate",
            "--policy",
            "gcra",
            "--shape",
            "heavy-tail-keys",
            "--limit",
            "0",
            "--out",
            svg,
        ],
        &["--limit must be at least 1"],
    );
    fails_with(
        &[
            "simulate",
            "--policy",
            "gcra",
            "--shape",
            "steady-2x",
            "--out",
            svg,
            "--csv",
            svg,
        ],
        &["are the same file; give the series its own path"],
    );
    // A shape of about 200 billion requests is refused before any is made.
    fails_with(
        &[
            "simulate",
            "--policy",
            "fixed-window",
            "--shape",
            "steady-2x",
            "--limit",
            "1000000000",
            "--duration-ms",
            "100000",
            "--out",
            svg,
        ],
        &["steady-2x", "about 200000000000 requests", "lower --limit"],
    );
    fails_with(&["bench", "--reps", "0"], &["--reps must be between 1 and"]);
    // Sizes that would not fit in memory are refused before anything is
    // allocated.
    fails_with(
        &["bench", "--keys", "1000000000000"],
        &["--keys must be between 1 and 16777216"],
    );
    fails_with(
        &["bench", "--threads", "100000"],
        &["--threads must be between 1 and 256"],
    );
    fails_with(
        &["bench", "--decisions", "100000000", "--threads", "8"],
        &["lower --decisions or --threads"],
    );
    fails_with(
        &[
            "bench-memory",
            "--contender",
            "gcra",
            "--keys",
            "1000000000000",
        ],
        &["--keys must be between 1 and 16777216"],
    );
    fails_with(
        &["bench", "--accuracy-duration-ms", "100000000000"],
        &["heavy-tail-keys", "use at most 275862"],
    );
    fails_with(
        &["bench", "--store", "etcd://127.0.0.1:2379"],
        &[
            "unknown store \"etcd://127.0.0.1:2379\"",
            "redis://HOST:PORT",
        ],
    );
    // Sizes of the in-memory bench are refused with a Redis store, not
    // silently dropped (no connection is tried first).
    fails_with(
        &[
            "bench",
            "--store",
            "redis://127.0.0.1:1",
            "--keys",
            "5",
            "--seed",
            "3",
        ],
        &[
            "--keys, --seed are options of the in-memory bench only",
            "`ratewarden bench-redis --store 'redis://127.0.0.1:1'`",
        ],
    );
    // Quoted, so that a query's `&` does not end the command in a shell.
    fails_with(
        &[
            "bench",
            "--store",
            "redis+unix:///tmp/r.sock?db=2&pass=secret",
            "--keys",
            "5",
        ],
        &["`ratewarden bench-redis --store 'redis+unix:///tmp/r.sock?"],
    );
    fails_with(
        &["bench", "--accuracy-duration-ms", "10"],
        &["--accuracy-duration-ms"],
    );
    assert!(
        !std::path::Path::new(svg).exists(),
        "a failed run left a chart behind"
    );
}

/// `bench-redis` measures one standalone server. Pointed at a cluster, by
/// URL or at one of its nodes, it says what it takes instead, without
/// sending the user to `redis-cluster://` and back, and without showing a
/// password.
#[test]
fn bench_redis_refuses_a_cluster_saying_what_it_takes() {
    let out = ratewarden(&[
        "bench-redis",
        "--store",
        "redis-cluster://:pw-not-shown@127.0.0.1:1",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("one standalone redis-server"), "{stderr}");
    assert!(stderr.contains(":***@127.0.0.1:1"), "{stderr}");
    assert!(!stderr.contains("pw-not-shown"), "{stderr}");

    let node =
        RedisServer::start_with(&["--cluster-enabled", "yes", "--requirepass", "pw-not-shown"]);
    let url = format!("redis://:pw-not-shown@127.0.0.1:{}", node.port());
    let out = ratewarden(&["bench-redis", "--store", &url, "--quick"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("is a cluster node"), "{stderr}");
    assert!(stderr.contains("without cluster-enabled"), "{stderr}");
    assert!(!stderr.contains("redis-cluster://"), "{stderr}");
    assert!(!stderr.contains("pw-not-shown"), "{stderr}");
}

/// A run of `ratewarden args...` with `env` set, to its end or at most
/// `within` (then killed, and the test fails): its output and process id,
/// the id naming the keys it writes (`ratewarden-bench%3A<pid>:`).
fn ratewarden_within(args: &[&str], env: &[(&str, &Path)], within: Duration) -> (Output, u32) {
    let child = spawn_ratewarden(args, env);
    let pid = child.id();
    (finish_within(child, within, args), pid)
}

/// `ratewarden args...` started with `env` set, its output piped (read it
/// with [`finish_within`]).
fn spawn_ratewarden(args: &[&str], env: &[(&str, &Path)]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ratewarden"))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the ratewarden binary runs")
}

/// Waits for `child` at most `within`, reading its output meanwhile.
fn finish_within(mut child: Child, within: Duration, args: &[&str]) -> Output {
    fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    }
    let (stdout, stderr) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for ratewarden") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{args:?} still ran after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

/// The sizes of a bench-redis run that takes seconds, but for
/// --round-trips: 5,000 requests per measurement (--quick takes a tenth),
/// enough that redis-benchmark's millisecond clock sees them take time.
const SMALL: [&str; 7] = [
    "--quick",
    "--requests",
    "50000",
    "--rounds",
    "1",
    "--keys",
    "50",
];

/// `text` with every run of white space made one space: help text as
/// clap wraps it, read as one line.
fn flat(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn json_rows(out: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// A small `bench-redis --json` run on `url` with `extra` flags, which
/// must succeed: its rows, and the five policies' rows among them.
fn small_json_run(url: &str, extra: &[&str]) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
    let args: Vec<&str> = ["bench-redis", "--store", url, "--json"]
        .into_iter()
        .chain(SMALL)
        .chain(extra.iter().copied())
        .collect();
    let (out, _) = ratewarden_within(&args, &[], Duration::from_secs(120));
    assert_succeeded(&out);
    let rows = json_rows(&out);
    let policies: Vec<_> = rows
        .iter()
        .filter(|r| r["workload"] == "policy")
        .cloned()
        .collect();
    assert_eq!(policies.len(), 5, "{rows:?}");
    (rows, policies)
}

/// A run that fails after the policies were measured (here the baseline
/// script, refused `HSET`, which the policies' scripts do not use) prints
/// what it ran with and their rows before it fails: they are not lost to
/// a later step, and read as a finished run's first lines do.
#[test]
fn bench_redis_prints_the_policies_measured_before_a_failure() {
    let server = RedisServer::start();
    server.cli(&[
        "ACL",
        "SETUSER",
        "nohset",
        "on",
        ">pw",
        "~ratewarden-bench*",
        "+@all",
        "-hset",
    ]);
    let url = format!("redis://nohset:pw@127.0.0.1:{}", server.port());
    for json in [true, false] {
        let mut args: Vec<&str> = ["bench-redis", "--store", &url]
            .into_iter()
            .chain(SMALL)
            .collect();
        if json {
            args.push("--json");
        }
        let (out, _) = ratewarden_within(&args, &[], Duration::from_secs(120));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("minimal-swc through this client")
                && stderr.contains("what was measured before it is printed"),
            "{stderr}"
        );
        if json {
            let rows = json_rows(&out);
            assert_eq!(rows.len(), 6, "{rows:?}");
            assert_eq!(rows[0]["workload"], "run", "{rows:?}");
            assert_eq!(
                rows[0]["store"],
                format!("redis://***:***@127.0.0.1:{}", server.port()),
                "{rows:?}"
            );
            assert!(
                rows[1..].iter().all(|r| r["workload"] == "policy"),
                "{rows:?}"
            );
        } else {
            let table = String::from_utf8_lossy(&out.stdout);
            let lines: Vec<&str> = table.lines().collect();
            assert_eq!(lines.len(), 8, "{table}");
            assert!(lines[0].starts_with("machine: "), "{table}");
            assert!(lines[1].starts_with("Redis at "), "{table}");
            assert!(lines[2].starts_with("policy "), "{table}");
        }
    }
}

/// The run writes under its own prefix only, and leaves no key without a
/// TTL: a user key named as redis-benchmark's default INCR key and any
/// other key stay as they were, and a user allowed only the prefix's keys
/// can run it. Its JSON says what it ran with and tells its rows apart.
#[test]
fn bench_redis_writes_only_under_its_prefix_and_leaves_no_key_without_a_ttl() {
    let server = RedisServer::start();
    server.cli(&["SET", "counter:__rand_int__", "41"]);
    server.cli(&["SET", "unrelated", "kept"]);
    // Refused every key outside the prefix (NOPERM).
    server.cli(&[
        "ACL",
        "SETUSER",
        "bench",
        "on",
        ">bench-pw",
        "~ratewarden-bench*",
        "+@all",
    ]);
    let url = format!("redis://bench:bench-pw@127.0.0.1:{}", server.port());
    let args: Vec<&str> = ["bench-redis", "--store", &url, "--json"]
        .into_iter()
        .chain(SMALL)
        .chain(["--round-trips", "100"])
        .collect();
    let (out, pid) = ratewarden_within(&args, &[], Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("bench-pw"), "{stderr}");

    assert_eq!(server.cli(&["GET", "counter:__rand_int__"]).trim(), "41");
    assert_eq!(server.cli(&["TTL", "counter:__rand_int__"]).trim(), "-1");
    assert_eq!(server.cli(&["GET", "unrelated"]).trim(), "kept");
    let mut without_ttl = server.keys_without_ttl();
    without_ttl.sort();
    assert_eq!(without_ttl, ["counter:__rand_int__", "unrelated"]);
    let prefix = format!("ratewarden-bench%3A{pid}:");
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .unwrap();
    let keys: Vec<String> = redis::Commands::scan(&mut conn)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    for key in keys {
        if key == "counter:__rand_int__" || key == "unrelated" {
            continue;
        }
        assert!(key.starts_with(&prefix), "{key} is outside {prefix}");
        // -2: expired since the scan.
        let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut conn).unwrap();
        assert!(ttl == -2 || (0..=2000).contains(&ttl), "{key}: PTTL {ttl}");
    }

    let rows = json_rows(&out);
    assert!(
        rows.iter().all(|r| r["workload"].is_string()),
        "a row without its kind: {rows:?}"
    );
    let kind = |k: &str| -> Vec<&serde_json::Value> {
        rows.iter().filter(|r| r["workload"] == k).collect()
    };
    let run = &rows[0];
    assert_eq!(run["workload"], "run", "{run}");
    assert_eq!(run["key_prefix"], prefix.as_str(), "{run}");
    assert_eq!(
        run["store"],
        format!("redis://***:***@127.0.0.1:{}", server.port()),
        "{run}"
    );
    for (field, value) in [
        ("requests", 5000),
        ("pipeline", 16),
        ("connections", 4),
        ("keys", 50),
        ("round_trips", 10),
        ("rounds", 1),
        ("limit", 100),
        ("window_ms", 1000),
    ] {
        assert_eq!(run[field], value, "{field}: {run}");
    }
    assert!(run["machine"].as_str().unwrap().contains("cores"), "{run}");
    assert!(run["redis_benchmark"]
        .as_str()
        .unwrap()
        .starts_with("redis-benchmark"));
    let policies = kind("policy");
    assert_eq!(policies.len(), 5, "{rows:?}");
    for row in policies {
        assert!(row["decisions_per_s"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["round_trip_us_p50"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["server_usec_per_call"].as_f64().unwrap() > 0.0, "{row}");
    }
    let baselines = kind("baseline");
    let minimal = baselines
        .iter()
        .find(|r| r["policy"] == "minimal-swc")
        .expect("the minimal script's row");
    assert!(
        minimal["server_usec_per_call"].as_f64().unwrap() > 0.0,
        "{minimal}"
    );
    let incr = baselines
        .iter()
        .find(|r| r["command"] == "INCR")
        .expect("the INCR row");
    assert!(incr["requests_per_s"].as_f64().unwrap() > 0.0, "{incr}");
    // Its keys were written (under the prefix, or NOPERM), then removed.
    let removed = incr["keys_removed"].as_u64().unwrap();
    assert!((1..=50).contains(&removed), "{incr}");
    assert_eq!(kind("round").len(), 1);
    assert_eq!(kind("target").len(), 2);
    let end = kind("end");
    assert!(end[0]["elapsed_s"].as_f64().unwrap() > 0.0, "{end:?}");
}

/// redis-benchmark's -r wraps above 2^31 - 1: a larger --keys would put
/// every request on one key.
#[test]
fn bench_redis_refuses_keys_redis_benchmark_would_wrap() {
    for keys in ["2147483648", "18446744073709551615"] {
        let out = ratewarden(&[
            "bench-redis",
            "--store",
            "redis://127.0.0.1:1",
            "--keys",
            keys,
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&format!(
                "--keys must be between 1 and 2147483647, not {keys}"
            )),
            "{stderr}"
        );
    }
    let help = ratewarden(&["bench-redis", "--help"]);
    let help = flat(&String::from_utf8_lossy(&help.stdout));
    assert!(help.contains("1 to 2,147,483,647"), "{help}");
}

/// Percentiles of no round trip are shown as missing, not as 0.
#[test]
fn bench_redis_shows_no_round_trip_figure_when_none_was_timed() {
    let server = RedisServer::start();
    let url = server.url();
    // --round-trips 5 with --quick times a tenth: none.
    let args: Vec<&str> = ["bench-redis", "--store", &url]
        .into_iter()
        .chain(SMALL)
        .chain(["--round-trips", "5"])
        .collect();
    let (out, _) = ratewarden_within(&args, &[], Duration::from_secs(120));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_succeeded(&out);
    assert!(stdout.contains("0 round trips per policy"), "{stdout}");
    for policy in [
        "fixed-window",
        "sliding-window-counter",
        "sliding-log",
        "token-bucket",
        "gcra",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{policy} ")))
            .unwrap_or_else(|| panic!("no row for {policy}: {stdout}"));
        let columns: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(&columns[2..4], ["-", "-"], "{line}");
        assert!(columns[1].parse::<f64>().unwrap() > 0.0, "{line}");
    }

    let (rows, policies) = small_json_run(&url, &["--round-trips", "0"]);
    assert_eq!(rows[0]["round_trips"], 0);
    for row in policies {
        assert!(row["round_trip_us_p50"].is_null(), "{row}");
        assert!(row["round_trip_us_p99"].is_null(), "{row}");
        assert!(row["decisions_per_s"].as_f64().unwrap() > 0.0, "{row}");
    }
}

/// A server on a Unix socket is measured there, redis-benchmark included
/// (`-s`): the server's TCP port is named nowhere, and its password, which
/// no server on Redis's default port has, makes any other server refuse.
#[test]
fn bench_redis_measures_a_server_on_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("redis.sock");
    let socket = socket.to_str().unwrap();
    let server = RedisServer::start_with(&[
        "--unixsocket",
        socket,
        "--unixsocketperm",
        "700",
        "--requirepass",
        "only-this-one",
    ]);
    let url = format!("redis+unix://{socket}?pass=only-this-one");
    let (_, policies) = small_json_run(&url, &[]);
    for row in &policies {
        assert!(row["decisions_per_s"].as_f64().unwrap() > 0.0, "{row}");
    }

    // A socket nothing listens on: said so, naming it.
    drop(server);
    let missing = dir.path().join("gone.sock");
    let url = format!("redis+unix://{}", missing.display());
    let (out, _) = ratewarden_within(
        &["bench-redis", "--store", &url, "--quick"],
        &[],
        Duration::from_secs(30),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("unix:{}", missing.display())),
        "{stderr}"
    );
}

/// 2: the command line cannot run; 1: the run failed.
#[test]
fn bench_redis_exit_status_tells_a_bad_command_line_from_a_failed_run() {
    let nobody = format!("redis://127.0.0.1:{}", free_port(false));
    let status = |args: &[&str]| {
        let out = ratewarden(args);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for bad in [
        vec!["bench-redis", "--store", &nobody, "--connections", "257"],
        vec!["bench-redis", "--store", "rediss://127.0.0.1:6379"],
        vec!["bench", "--store", &nobody, "--seed", "1"],
    ] {
        let (code, stderr) = status(&bad);
        assert_eq!(code, Some(2), "{bad:?}: {stderr}");
    }
    for args in [
        vec!["bench-redis", "--store", &nobody, "--quick"],
        vec!["bench", "--store", &nobody, "--quick"],
    ] {
        let (code, stderr) = status(&args);
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains("connection refused"), "{stderr}");
        // Named as the command typed.
        let typed = format!("ratewarden {}: ", args[0]);
        assert!(stderr.starts_with(&typed), "{stderr}");
        assert!(stderr.contains("start redis-server there"), "{stderr}");
    }
}

/// `bench` measures memory in a fresh copy of the program it runs, not of
/// the file at its path: a program removed (or rebuilt) while it runs,
/// here removed before its memory step, still gives every row.
#[cfg(target_os = "linux")]
#[test]
fn bench_measures_memory_in_its_own_program_when_its_file_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let copy = scratch(&dir, "ratewarden");
    std::fs::copy(env!("CARGO_BIN_EXE_ratewarden"), &copy).unwrap();
    let child = Command::new(&copy)
        .args(SMALL_BENCH_JSON)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Gone long before the memory step, which follows the key sequences
    // and the speed workloads.
    std::fs::remove_file(&copy).unwrap();
    let out = finish_within(child, Duration::from_secs(600), &["bench"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let measured = json_rows(&out)
        .iter()
        .filter(|row| row["bytes_per_key"].is_number())
        .count();
    assert!(
        measured >= 6,
        "{measured} rows with bytes_per_key; {stderr}"
    );
}

/// `bench`'s child process, `bench-memory`, is no command for users:
/// neither the help nor a misspelt command's suggestions name it, while
/// `bench` can still start it.
#[test]
fn bench_memory_is_named_by_no_help_or_suggestion() {
    let misspelt = ratewarden(&["benhc"]);
    let stderr = String::from_utf8_lossy(&misspelt.stderr);
    assert_eq!(misspelt.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("'bench'"), "{stderr}");
    assert!(!stderr.contains("bench-memory"), "{stderr}");
    let help = ratewarden(&["help", "bench-memory"]);
    assert!(!help.status.success());
    assert!(!String::from_utf8_lossy(&help.stdout).contains("memory"));
    let help = ratewarden(&["--help"]);
    assert!(!String::from_utf8_lossy(&help.stdout).contains("bench-memory"));
    let child = ratewarden(&["bench-memory", "--contender", "gcra", "--keys", "1000"]);
    let stdout = String::from_utf8_lossy(&child.stdout);
    assert!(child.status.success(), "{stdout}");
    assert!(stdout.contains("\"entries_tracked\":1000"), "{stdout}");
}

/// Flags each within its bounds whose batches in flight outnumber one
/// redis-benchmark run's requests are refused before anything starts (the
/// run would send far more than asked, and outlast its deadline), naming
/// both flags and what would do.
#[test]
fn bench_redis_refuses_more_requests_in_flight_than_a_run_sends() {
    let out = ratewarden(&[
        "bench-redis",
        "--store",
        "redis://127.0.0.1:1",
        "--requests",
        "4000",
        "--connections",
        "256",
        "--pipeline",
        "10000",
        "--rounds",
        "1",
        "--round-trips",
        "0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(
            "--connections 256 and --pipeline 10000 send 2560000 requests at once, more than \
             the 1000 of each redis-benchmark run"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("lower --connections or --pipeline, or give --requests 10240000 or more"),
        "{stderr}"
    );
}

/// Each flag out of its bounds is named alone, with its range and the
/// value given; the help says the bounds.
#[test]
fn bench_redis_names_the_flag_out_of_its_bounds() {
    for (flag, value, range) in [
        ("--connections", "257", "between 1 and 256"),
        ("--pipeline", "10001", "between 1 and 10000"),
        ("--round-trips", "1000001", "between 0 and 1000000"),
        ("--requests", "100000001", "between 4000 and 100000000"),
        ("--requests", "3999", "between 4000 and 100000000"),
        ("--rounds", "51", "between 1 and 50"),
        ("--rounds", "0", "between 1 and 50"),
    ] {
        let out = ratewarden(&["bench-redis", "--store", "redis://127.0.0.1:1", flag, value]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&format!("{flag} must be {range}, not {value}")),
            "{stderr}"
        );
        let others = [
            "--connections",
            "--pipeline",
            "--round-trips",
            "--requests",
            "--keys",
        ];
        for other in others.into_iter().filter(|o| *o != flag) {
            assert!(!stderr.contains(other), "{stderr}");
        }
    }
    let help = ratewarden(&["bench-redis", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    for bound in [
        "4,000 to 100,000,000; --quick takes a tenth of it (20,000 by default), so with --quick at least 40,000",
        "1 to 10,000",
        "1 to 256",
        "0 to 1,000,000",
        "1 to 50",
    ] {
        assert!(flat(&help).contains(bound), "`{bound}` not in {help}");
    }
}

/// What is wrong is said for what it is: the URL's scheme, the
/// credentials, a port held by another server or by one that never
/// answers.
#[test]
fn bench_redis_says_what_is_wrong_with_the_url_or_the_server() {
    let refused = |url: &str, code: i32, words: &[&str]| {
        let (out, _) = ratewarden_within(
            &["bench-redis", "--store", url, "--quick"],
            &[],
            Duration::from_secs(30),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{url}: {stderr}");
        for word in words {
            assert!(stderr.contains(word), "{url}: `{word}` not in {stderr}");
        }
        for never in ["cluster", "invalid input", "right-pw", "wrong-pw", "\n\n"] {
            assert!(!stderr.contains(never), "{url}: `{never}` in {stderr}");
        }
        stderr.into_owned()
    };
    refused(
        "rediss://:wrong-pw@127.0.0.1:6379",
        2,
        &["plain connections only", "redis://HOST:PORT"],
    );

    let server = RedisServer::start_with(&["--requirepass", "right-pw"]);
    let port = server.port();
    refused(
        &format!("redis://:wrong-pw@127.0.0.1:{port}"),
        1,
        &[&format!(
            "Redis at 127.0.0.1:{port} refused the URL's user or password"
        )],
    );
    let stderr = refused(
        &format!("redis://127.0.0.1:{port}"),
        1,
        &[&format!("Redis at 127.0.0.1:{port} requires a password")],
    );
    assert!(
        stderr.starts_with("ratewarden bench-redis: Redis at"),
        "{stderr}"
    );

    // Another protocol on the port.
    let http = TcpListener::bind("127.0.0.1:0").unwrap();
    let http_port = http.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in http.incoming() {
            let Ok(mut stream) = stream else { return };
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request);
            let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
            // Left open until the client closes it, so that the reply is
            // read rather than reset.
            let _ = stream.read(&mut request);
        }
    });
    refused(
        &format!("redis://127.0.0.1:{http_port}"),
        1,
        &["not Redis's protocol", "check the port"],
    );

    // A port that takes connections (the kernel's backlog) but never
    // answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    let stderr = refused(
        &format!("redis://127.0.0.1:{silent_port}"),
        1,
        &[&format!(
            "Redis at 127.0.0.1:{silent_port} did not answer in "
        )],
    );
    // The message gives the time waited: the 2 s timeout once for each
    // reply of redis-rs's connection set-up.
    let waited_s: f64 = stderr
        .split("did not answer in ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no time waited in {stderr}"));
    assert!((2.0..10.0).contains(&waited_s), "{stderr}");
    drop(silent);
}

/// Resumes a paused server when the test ends, however it ends.
struct Resume<'a>(&'a RedisServer);

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        self.0.resume();
    }
}

/// Waits (at most `within`) until `key` exists on `server`.
fn wait_for_key(server: &RedisServer, key: &str, within: Duration) -> bool {
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .unwrap();
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        let exists: bool = redis::cmd("EXISTS").arg(key).query(&mut conn).unwrap();
        if exists {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

/// A server killed mid-run fails the run with the step it was in and the
/// server's URL, without its password.
#[test]
fn bench_redis_names_the_step_when_redis_dies_mid_run() {
    let mut server = RedisServer::start_with(&["--requirepass", "kill-pw"]);
    let port = server.port();
    let url = format!("redis://:kill-pw@127.0.0.1:{port}");
    let child = spawn_ratewarden(
        &[
            "bench-redis",
            "--store",
            &url,
            "--quick",
            // The most round trips (a tenth of them with --quick, some
            // seconds of them): the kill lands in that step even when this
            // test's thread is slow to see the first key.
            "--round-trips",
            "1000000",
        ],
        &[],
    );
    let pid = child.id();
    // The first key of the first policy's round trips.
    let key = format!("ratewarden-bench%3A{pid}:v2:fixed-window:100:1000:0");
    let client = redis::Client::open(format!("redis://:kill-pw@127.0.0.1:{port}")).unwrap();
    let mut conn = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !redis::cmd("EXISTS")
        .arg(&key)
        .query::<bool>(&mut conn)
        .unwrap()
    {
        assert!(Instant::now() < deadline, "the run never wrote {key}");
        std::thread::sleep(Duration::from_millis(1));
    }
    server.kill();
    let out = finish_within(child, Duration::from_secs(30), &["bench-redis"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("bench-redis: fixed-window, round trips, on Redis at"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("redis://:***@127.0.0.1:{port}: ")),
        "{stderr}"
    );
    assert!(!stderr.contains("kill-pw"), "{stderr}");
}

/// A server frozen while the minimal script runs through this client
/// fails the run within the batch timeout (10 s), naming the step, rather
/// than holding it for ever.
#[test]
fn bench_redis_fails_in_bounded_time_when_redis_freezes() {
    let server = RedisServer::start();
    let url = server.url();
    let child = spawn_ratewarden(
        &[
            "bench-redis",
            "--store",
            &url,
            "--quick",
            // Enough requests (a tenth of them with --quick) that the
            // minimal script's step lasts some seconds, so the freeze lands
            // in it even when this test's thread is slow to see its first
            // key or `kill` is slow to start. Not more: every policy's step
            // before it takes as many requests.
            "--requests",
            "1200000",
            "--round-trips",
            "0",
            "--keys",
            "1000",
        ],
        &[],
    );
    let key = format!("ratewarden-bench%3A{}:minimal:0", child.id());
    assert!(
        // The steps before take about 20 s on a quiet machine, minutes on
        // a loaded one.
        wait_for_key(&server, &key, Duration::from_secs(300)),
        "the run never reached the minimal script"
    );
    server.pause();
    let _resume = Resume(&server);
    let paused = Instant::now();
    let out = finish_within(child, Duration::from_secs(40), &["bench-redis"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "minimal-swc through this client, on Redis at {url}"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains("Redis did not answer a batch within 10 s"),
        "{stderr}"
    );
    assert!(
        paused.elapsed() < Duration::from_secs(30),
        "{:?}",
        paused.elapsed()
    );
}

/// Without redis-benchmark the run stops before measuring anything, saying
/// what to install.
#[test]
fn bench_redis_without_redis_benchmark_fails_at_once() {
    let empty = tempfile::tempdir().unwrap();
    let server = RedisServer::start();
    let (out, _) = ratewarden_within(
        &["bench-redis", "--store", &server.url(), "--quick"],
        &[("PATH", empty.path())],
        Duration::from_secs(30),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("redis-benchmark is not on PATH"),
        "{stderr}"
    );
    assert!(stderr.contains("redis-tools"), "{stderr}");
    // Nothing was measured: the server saw no key.
    assert_eq!(server.cli(&["DBSIZE"]).trim(), "0");
}

/// A memory measurement whose process is killed (as the out-of-memory
/// killer would) fails the run, saying so, but loses none of the rows
/// measured: they are printed, that row without its `bytes_per_key`.
#[test]
fn a_killed_memory_measurement_fails_the_run_but_keeps_its_rows() {
    let child = Command::new(env!("CARGO_BIN_EXE_ratewarden"))
        .args(SMALL_BENCH_JSON)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let parent = child.id().to_string();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Kills every `bench-memory` process the run starts.
    let killer = {
        let done = std::sync::Arc::clone(&done);
        std::thread::spawn(move || {
            let mut killed = std::collections::HashSet::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                for entry in std::fs::read_dir("/proc").unwrap().flatten() {
                    let pid = entry.file_name().to_string_lossy().into_owned();
                    let dir = entry.path();
                    let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
                    // The parent's pid is the second field after the name.
                    let ppid = stat.rsplit(')').next().and_then(|s| s.split(' ').nth(2));
                    let cmdline = std::fs::read(dir.join("cmdline")).unwrap_or_default();
                    if ppid == Some(parent.as_str())
                        && String::from_utf8_lossy(&cmdline).contains("bench-memory")
                        && killed.insert(pid.clone())
                    {
                        let _ = Command::new("kill").args(["-KILL", &pid]).status();
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let out = finish_within(child, Duration::from_secs(300), &SMALL_BENCH_JSON);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    killer.join().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "its process ended with signal: 9 (SIGKILL), most likely from the kernel's \
             out-of-memory killer: give --keys fewer than 100000"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("the rows above are without those bytes_per_key"),
        "{stderr}"
    );
    let rows: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        rows.iter()
            .any(|r| r["workload"] == "uniform-1m" && r["policy"] == "gcra"),
        "{rows:?}"
    );
    assert!(rows.iter().any(|r| r["workload"] == "boundary-attack"));
}

/// The process ids of `parent`'s children running `program`, from /proc.
#[cfg(target_os = "linux")]
fn children_running(parent: u32, program: &str) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            // "PID (COMM) STATE PPID ...": the name may hold spaces, so
            // read after its closing parenthesis.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let (_, rest) = stat.rsplit_once(") ")?;
            let ppid = rest.split(' ').nth(1)?.parse::<u32>().ok()?;
            let line = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let line = String::from_utf8_lossy(&line).replace('\0', " ");
            (ppid == parent && line.starts_with(program)).then_some((pid, line))
        })
        .collect()
}

/// Whether process `pid` is gone (or left only as a zombie, its run over).
#[cfg(target_os = "linux")]
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z')),
        Err(_) => true,
    }
}

/// A signal sent to `bench-redis` alone (`kill PID`, `timeout`, a job
/// runner's stop), not to its terminal's whole group, stops the
/// redis-benchmark it runs too, rather than leaving it loading the server;
/// bench-redis itself ends by the signal, as it would without a child.
#[test]
#[cfg(target_os = "linux")]
fn bench_redis_stopped_by_a_signal_stops_redis_benchmark() {
    let server = RedisServer::start();
    let url = server.url();
    let args = [
        "bench-redis",
        "--store",
        &url,
        "--quick",
        "--requests",
        "400000",
        "--rounds",
        "1",
        "--keys",
        "50",
        "--round-trips",
        "0",
    ];
    let child = spawn_ratewarden(&args, &[]);
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(120);
    let benchmark = loop {
        let measuring = children_running(pid, "redis-benchmark")
            .into_iter()
            .find(|(_, line)| !line.contains("--version"));
        if let Some((found, _)) = measuring {
            break found;
        }
        assert!(
            Instant::now() < deadline,
            "bench-redis started no redis-benchmark run within 120 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    // Held still, so that it could not end on its own before the check.
    server.cli(&["CLIENT", "PAUSE", "30000", "WRITE"]);
    let sent = Command::new("kill")
        .args(["-s", "TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let out = finish_within(child, Duration::from_secs(10), &args);
    let deadline = Instant::now() + Duration::from_secs(5);
    let stopped = loop {
        if gone(benchmark) {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    server.cli(&["CLIENT", "UNPAUSE"]);
    assert!(
        stopped,
        "redis-benchmark (pid {benchmark}) still ran 5 s after bench-redis stopped"
    );
    // It ended by the signal, as it would have without a child.
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(15), "{out:?}");
}

/// A chart of a few milliseconds labels its time ticks where they are
/// (1.5, not a rounded 2).
#[test]
fn simulate_labels_the_time_ticks_of_a_short_run_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let svg = scratch(&dir, "short.svg");
    let out = ratewarden(&[
        "simulate",
        "--policy",
        "gcra",
        "--shape",
        "steady-2x",
        "--limit",
        "50",
        "--window-ms",
        "10",
        "--duration-ms",
        "5",
        "--out",
        svg.to_str().unwrap(),
    ]);
    assert_succeeded(&out);
    let chart = std::fs::read_to_string(&svg).unwrap();
    for tick in ["0.5", "1.5", "4.5"] {
        assert!(
            chart.contains(&format!("\n{tick}\n</text>")),
            "no time tick labelled {tick}"
        );
    }
}

/// A policy is drawn in its own colour wherever it stands in `--policy`,
/// so two charts can be read side by side; and a one-hour run's time
/// ticks are all written alike.
#[test]
fn simulate_draws_a_policy_in_its_colour_and_long_runs_ticks_alike() {
    let dir = tempfile::tempdir().unwrap();
    let chart = |policy: &str, duration_ms: &str| -> String {
        let svg = scratch(&dir, "chart.svg");
        let out = ratewarden(&[
            "simulate",
            "--policy",
            policy,
            "--shape",
            "steady-2x",
            "--duration-ms",
            duration_ms,
            "--bucket-ms",
            "1000",
            "--out",
            svg.to_str().unwrap(),
        ]);
        assert_succeeded(&out);
        std::fs::read_to_string(&svg).unwrap()
    };
    // gcra's colour, and fixed-window's (the first of the palette).
    let (gcra, first) = ("stroke=\"#FF7F0E\"", "stroke=\"#D62728\"");
    for policies in ["gcra", "sliding-log,gcra"] {
        let svg = chart(policies, "3000");
        assert!(svg.contains(gcra), "{policies}: gcra not in its colour");
        assert!(
            !svg.contains(first),
            "{policies}: drawn in fixed-window's colour"
        );
    }
    let svg = chart("gcra", "3600000");
    for tick in ["5e5", "1e6", "1.5e6"] {
        assert!(
            svg.contains(&format!("\n{tick}\n</text>")),
            "no time tick labelled {tick}"
        );
    }
    assert!(!svg.contains("\n500000\n</text>"), "a tick written out");
}
