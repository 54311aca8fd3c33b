//! `ratewarden vectors`: runs conformance vector files (SPEC "Vector files")
//! against a store and reports every case that differs.
//!
//! Exit status: 0 when every case passes, 1 when a case fails, 2 when the
//! report cannot be written (a full disk; a reader that stopped early is
//! no failure), when a file
//! cannot be read (a pipe, a device or a file over 256 MiB is not read) or
//! is malformed, or a case in it is (each is named, with
//! the problem, and a file's other cases still run), a directory holds no
//! `*.json` file, or the store cannot be used: it cannot be reached, or a
//! case's call to it times out or loses its connection, which stops the
//! run there, since the cases left would only wait on it in turn (any other
//! error of a store's call fails that case, and the run goes on).

use super::errln;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use ratewarden_core::vectors::{self, Case, CaseOutcome, EachCase, Expected, VectorKey};
use ratewarden_core::{mix32, Decision, MemoryOptions, MemoryStore, StoreErrorKind};
// The parser `serve --store` uses: one set of forms and messages for both.
use ratewarden_server::StoreUrl;

/// Arguments of `ratewarden vectors`.
#[derive(clap::Args)]
pub struct Args {
    /// The store to run the vectors on: `memory` (the embedded store),
    /// `redis://HOST:PORT[/DB]`, `redis+unix:///PATH` or
    /// `redis-cluster://HOST:PORT[,HOST:PORT...]`, or over TLS `rediss://`
    /// and `rediss-cluster://` (certificates checked against the
    /// system's roots, or the bundle `SSL_CERT_FILE` names); each case
    /// under its own fresh key prefix.
    #[arg(long, default_value = "memory", value_parser = super::StoreUrlParser)]
    pub store: StoreUrl,
    /// Vector files, or directories searched (recursively) for `*.json`
    /// (in any case).
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
}

/// Runs one case on a fresh, empty store.
trait CaseRunner {
    fn run(&mut self, case: &Case) -> CaseOutcome;
}

struct MemoryRunner;

impl CaseRunner for MemoryRunner {
    fn run(&mut self, case: &Case) -> CaseOutcome {
        // Parsing validated the configuration, so building it cannot fail;
        // a failure would still be reported, never a panic.
        match MemoryStore::for_config(&case.config, MemoryOptions::default()) {
            Ok(store) => {
                vectors::run_case(case, |key, now_ms, cost| store.decide(key, now_ms, cost))
            }
            Err(e) => CaseOutcome::StoreFailed {
                step: 0,
                error: ratewarden_core::StoreError::new(
                    StoreErrorKind::InvalidInput,
                    e.to_string(),
                ),
            },
        }
    }
}

/// Runs cases on Redis, each under a fresh prefix, with the vectors' own
/// times passed to the scripts, every case's store on one connection.
struct RedisRunner {
    /// Connected with [`redis_options`]; each case's store is made from
    /// it with the case's configuration and prefix.
    shared: ratewarden_redis::RedisStore,
    runtime: tokio::runtime::Runtime,
    /// Unique per run: the process id and the start time.
    run_id: String,
    cases_run: u64,
}

/// The options of every case's store.
fn redis_options() -> ratewarden_redis::RedisOptions {
    ratewarden_redis::RedisOptions {
        // Generous: conformance is checked here, not latency, and a busy
        // machine must not fail a case.
        timeout_ms: 10_000,
        connect_timeout_ms: 10_000,
        // The vectors' times are not Redis's, so a TTL computed from them
        // means nothing on Redis's clock. Every key lives exactly as long
        // as the grace after its last write, at most 1 ms more (max_ttl_ms
        // caps what the vectors' times give; 1 is its least): an hour in
        // all, as documented. No key of a case expires while the case runs
        // (its steps take milliseconds of real time, each write sets at
        // least the grace again), so the cap changes no decision, and a run
        // leaves nothing on a shared Redis for longer than an hour.
        ttl_grace_ms: 3_600_000 - 1,
        max_ttl_ms: 1,
        // Every case passes its own time, so the user needs no TIME.
        checks_by_redis_time: false,
        // Over TLS, the system's roots or the bundle SSL_CERT_FILE names:
        // the command has no flags for certificate files.
        ..ratewarden_redis::RedisOptions::default()
    }
}

impl CaseRunner for RedisRunner {
    fn run(&mut self, case: &Case) -> CaseOutcome {
        self.cases_run += 1;
        let prefix = format!("ratewarden-vectors:{}:{}", self.run_id, self.cases_run);
        let rt = &self.runtime;
        match rt.block_on(self.shared.with_config(case.config, prefix)) {
            Ok(store) => vectors::run_case(case, |key, now_ms, cost| {
                rt.block_on(store.decide(key, Some(now_ms), cost))
            }),
            Err(error) => CaseOutcome::StoreFailed { step: 0, error },
        }
    }
}

/// Runs the command.
pub fn run(args: Args) -> ExitCode {
    // The store as a message names it, without a password.
    let store = match &args.store {
        StoreUrl::Memory => "the memory store".to_owned(),
        StoreUrl::Redis(url) | StoreUrl::RedisCluster(url) => ratewarden_redis::redact_url(url),
    };
    let mut runner: Box<dyn CaseRunner> = match args.store {
        StoreUrl::Memory => Box::new(MemoryRunner),
        StoreUrl::Redis(url) | StoreUrl::RedisCluster(url) => {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    errln!("cannot start the async runtime: {e}");
                    return ExitCode::from(2);
                }
            };
            let started = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let run_id = format!("{}-{started}", std::process::id());
            // An unreachable store is a store that cannot be used (exit 2),
            // not a failure of every case. The connection made here is the
            // one every case uses; its connect check's key is under the
            // run's prefix too.
            let options = ratewarden_redis::RedisOptions {
                prefix: format!("ratewarden-vectors:{run_id}"),
                ..redis_options()
            };
            let connected = runtime.block_on(ratewarden_redis::RedisStore::connect(
                &url,
                ratewarden_core::REFERENCE,
                options,
            ));
            let shared = match connected {
                Ok(store) => store,
                Err(e) => {
                    let url = ratewarden_redis::redact_url(&url);
                    // The detail names the address and says what to change
                    // (as `serve` prints it); the error's kind would only
                    // repeat it.
                    if e.is_connection_dropped() && !ratewarden_redis::is_unresolved_host(&e) {
                        errln!(
                            "{url}: {}; start redis-server there or change --store to where \
                             it runs",
                            e.detail()
                        );
                    } else {
                        errln!("{url}: {}", e.detail());
                    }
                    return ExitCode::from(2);
                }
            };
            Box::new(RedisRunner {
                shared,
                runtime,
                run_id,
                cases_run: 0,
            })
        }
    };
    let mut files = Vec::new();
    let mut malformed = 0usize;
    // Shared by every argument: `vectors d d/a.json` reads a.json once.
    let mut seen = std::collections::HashSet::new();
    for path in &args.paths {
        match collect(path, &mut files, &mut seen, &mut Walk::default()) {
            Err(e) => {
                errln!("{}: {e}", path.display());
                malformed += 1;
            }
            // A directory without vector files is most likely the wrong
            // one: saying "0 passed" and succeeding would hide that.
            Ok(0) => {
                errln!(
                    "{}: no vector files (*.json) in this directory or below it",
                    path.display()
                );
                malformed += 1;
            }
            Ok(_) => {}
        }
    }
    let mut out = Out::new();
    let mut tally = Tally::default();
    let mut stopped = None;
    for path in &files {
        let text = match read_vector_file(path) {
            Ok(text) => text,
            Err(e) => {
                errln!("{}: {e}", path.display());
                malformed += 1;
                continue;
            }
        };
        let file = match vectors::parse_each(&text) {
            Ok(file) => file,
            Err(e) => {
                errln!("{}: malformed vector file: {e}", path.display());
                malformed += 1;
                continue;
            }
        };
        // Ignored (SPEC's format names its fields and says nothing of
        // others), but a misspelt one (`brust`) would change what a case
        // tests without a sign.
        note(
            path,
            "ignored fields the vector format does not have (check their spelling)",
            &file.unknown_fields,
        );
        note(
            path,
            "fields given twice in one object, where the last is taken (JSON readers differ \
             on which they take; keep one)",
            &file.duplicate_fields,
        );
        note(
            path,
            "bursts given to a policy without a bucket, which ignores them (only token-bucket \
             and gcra take one)",
            &file.ignored_bursts,
        );
        if let Err(at) = run_file(path, &file, runner.as_mut(), &mut tally, &mut out) {
            stopped = Some(at);
            break;
        }
    }
    if let Some(at) = &stopped {
        errln!(
            "{store}: {at}; the run stops here, the cases left not run: a store that fails \
             a call (one that stopped answering, say) cannot check them, and each would \
             wait its timeout; {} passed and {} failed before it",
            tally.passed,
            tally.failed
        );
    }
    if tally.malformed_cases > 0 {
        let noun = if tally.malformed_cases == 1 {
            "case"
        } else {
            "cases"
        };
        out.line(format_args!(
            "{} malformed {noun} not run",
            tally.malformed_cases
        ));
        malformed += tally.malformed_cases;
    }
    if tally.mix32_matched + tally.mix32_differ > 0 {
        out.line(format_args!(
            "mix32 values: {} matched, {} differ",
            tally.mix32_matched, tally.mix32_differ
        ));
    }
    // The closing line counts cases, and says so when a mix32 value
    // differs: a reader of the last line alone must not take a failed run
    // for a passed one.
    let mix32 = match tally.mix32_differ {
        0 => String::new(),
        1 => ", and 1 mix32 value differs".to_owned(),
        n => format!(", and {n} mix32 values differ"),
    };
    let stop = if stopped.is_some() {
        "; stopped at a store error, the cases left not run"
    } else {
        ""
    };
    out.line(format_args!(
        "{} passed, {} failed{mix32}{stop}",
        tally.passed, tally.failed
    ));
    let written = out.finish();
    if malformed > 0 || stopped.is_some() || !written {
        ExitCode::from(2)
    } else if tally.failed > 0 || tally.mix32_differ > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// The directories of one argument's walk, by canonical path.
#[derive(Default)]
struct Walk {
    /// Being walked: a link back to one of them ends there.
    within: Vec<PathBuf>,
    /// Walked, with the vector files they reach: a directory reached again
    /// (through another link) is not walked again.
    done: std::collections::HashMap<PathBuf, usize>,
}

/// Adds `path` (a file), or every `*.json` below it (a directory, the
/// extension in any case), in a
/// stable order; each file once, however many links or arguments lead to
/// it (`seen` holds the canonical paths of the files added), and each
/// directory walked once per argument. Returns how many vector files the
/// path reaches, added now or before.
fn collect(
    path: &Path,
    out: &mut Vec<PathBuf>,
    seen: &mut std::collections::HashSet<PathBuf>,
    walk: &mut Walk,
) -> Result<usize, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?;
    // A path that cannot be resolved stays itself: reading it reports why.
    let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    // Neither file nor directory (a pipe, a device, a socket): added as a
    // file, so that reading it refuses it by name, in its folder's order,
    // rather than listing it as a directory or waiting on it.
    if meta.is_file() || !meta.is_dir() {
        if seen.insert(canonical) {
            out.push(path.to_owned());
        }
        return Ok(1);
    }
    if walk.within.contains(&canonical) {
        // A link back to a directory being walked: its files count there.
        return Ok(0);
    }
    if let Some(&found) = walk.done.get(&canonical) {
        return Ok(found);
    }
    let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| format!("cannot list directory: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    walk.within.push(canonical.clone());
    let mut found = 0;
    for entry in entries {
        if entry.is_dir() {
            found += collect(&entry, out, seen, walk)?;
        } else if entry
            .extension()
            .is_some_and(|x| x.eq_ignore_ascii_case("json"))
        {
            // In any case: a `B.JSON` skipped beside a passing `a.json`
            // would leave its failures out of a run that then passes.
            // A file that cannot be read (a dangling link) is run, and
            // reported with its reason, beside the folder's other files.
            found += collect(&entry, out, seen, walk).unwrap_or_else(|_| {
                out.push(entry.clone());
                1
            });
        }
    }
    walk.within.pop();
    walk.done.insert(canonical, found);
    Ok(found)
}

/// The most bytes read from one vector file: far above any written by hand
/// or generated here (the project's largest is under 100 KiB). It bounds
/// the memory one path can take, though not to its own size: the parsed
/// cases take more than their text, up to some 70 times for a file of
/// empty objects (about 17 GB at this bound); a file of real steps takes
/// about 15 times its size.
const MAX_FILE_BYTES: u64 = 256 << 20;

/// The text of the vector file at `path`, which must be a regular file
/// (links followed) of at most [`MAX_FILE_BYTES`]: a pipe would wait for a
/// writer and a device such as `/dev/zero` never ends, so neither is read.
fn read_vector_file(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?;
    if !meta.is_file() {
        return Err(format!(
            "not read: {}, not a regular file; save the vectors to a file and give its path",
            file_kind(&meta.file_type())
        ));
    }
    let too_large = |size: &str| {
        format!(
            "not read: {size}, more than the {MAX_FILE_BYTES} bytes (256 MiB) a vector file \
             may hold; split its cases over several files"
        )
    };
    if meta.len() > MAX_FILE_BYTES {
        return Err(too_large(&format!("{} bytes", meta.len())));
    }
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read: {e}"))?;
    // The bound holds for a file that grows while it is read, too.
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large("it grew while it was read"));
    }
    String::from_utf8(bytes).map_err(|_| "cannot read: stream did not contain valid UTF-8".into())
}

/// What a file that is neither a regular file nor a directory is, as a
/// user would name it.
fn file_kind(kind: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return "a pipe (FIFO)";
        }
        if kind.is_char_device() {
            return "a character device";
        }
        if kind.is_block_device() {
            return "a block device";
        }
        if kind.is_socket() {
            return "a socket";
        }
    }
    let _ = kind;
    "a special file"
}

/// Standard output that goes quiet once it cannot be written: a reader
/// that stopped early (`ratewarden vectors DIR | head`) is no failure of the
/// vectors, so the run goes on and exits with the status its cases give,
/// where `println!` would panic on the broken pipe. Any other error (a
/// full disk) loses the report, which the exit status must then say.
struct Out {
    stdout: std::io::StdoutLock<'static>,
    closed: bool,
    /// A line was lost to an error other than a reader gone.
    lost: bool,
}

impl Out {
    fn new() -> Self {
        Out {
            stdout: std::io::stdout().lock(),
            closed: false,
            lost: false,
        }
    }

    /// Writes out what is buffered; true when the whole report was
    /// written, or its reader stopped reading.
    fn finish(&mut self) -> bool {
        if !self.closed {
            if let Err(e) = self.stdout.flush() {
                self.failed(e);
            }
        }
        !self.lost
    }

    fn failed(&mut self, e: std::io::Error) {
        self.closed = true;
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            self.lost = true;
            errln!("cannot write to standard output: {e}");
        }
    }

    /// Writes one line, unless an earlier line could not be written.
    fn line(&mut self, args: std::fmt::Arguments<'_>) {
        if self.closed {
            return;
        }
        if let Err(e) = writeln!(self.stdout, "{args}") {
            self.failed(e);
        }
    }
}

/// What the files so far gave.
#[derive(Default)]
struct Tally {
    passed: usize,
    failed: usize,
    /// Cases that could not be parsed, so were not run.
    malformed_cases: usize,
    mix32_matched: usize,
    mix32_differ: usize,
}

/// Places shown in a note; the note counts the rest.
const NOTE_PLACES_SHOWN: usize = 5;

/// Prints `what` and the first [`NOTE_PLACES_SHOWN`] of `places` as a note
/// on standard error, when there are any. A note never changes the
/// verdict.
fn note(path: &Path, what: &str, places: &[String]) {
    if places.is_empty() {
        return;
    }
    let shown = places[..places.len().min(NOTE_PLACES_SHOWN)].join(", ");
    let more = match places.len().saturating_sub(NOTE_PLACES_SHOWN) {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    errln!("{}: note: {what}: {shown}{more}", path.display());
}

/// Runs every mix32 value and case of one file, printing each failure;
/// stops at the first case whose store call fails, returning where and
/// why.
fn run_file(
    path: &Path,
    file: &EachCase,
    runner: &mut dyn CaseRunner,
    tally: &mut Tally,
    out: &mut Out,
) -> Result<(), String> {
    for (i, m) in file.mix32.iter().enumerate() {
        let actual = mix32(&m.input);
        if actual == m.output {
            tally.mix32_matched += 1;
        } else {
            tally.mix32_differ += 1;
            out.line(format_args!(
                "FAIL {} mix32[{i}] {:?}: expected {}, got {actual}",
                path.display(),
                m.input,
                m.output
            ));
        }
    }
    // A file of no cases (`{"cases": []}`) passes without testing
    // anything, as a case of no steps does (below): named for the same
    // reason. A file of mix32 entries alone tests the hash.
    if file.cases.is_empty() && file.mix32.is_empty() {
        errln!(
            "{}: note: no cases and no mix32 entries: the file tests nothing",
            path.display()
        );
    }
    // A case of no steps passes; one a generator wrote empty, or left as
    // a placeholder, would otherwise pass without a sign.
    let mut empty = Vec::new();
    let mut malformed = 0usize;
    for (i, case) in file.cases.iter().enumerate() {
        let case = match case {
            Ok(case) => case,
            Err(e) => {
                tally.malformed_cases += 1;
                malformed += 1;
                if malformed <= MAX_MALFORMED_SHOWN {
                    errln!("{}: malformed case, not run: {e}", path.display());
                }
                continue;
            }
        };
        if case.steps.is_empty() {
            empty.push(format!("cases[{i}]"));
        }
        match runner.run(case) {
            CaseOutcome::Passed => tally.passed += 1,
            CaseOutcome::Mismatch {
                step,
                expected,
                actual,
            } => {
                tally.failed += 1;
                let s = &case.steps[step];
                out.line(format_args!(
                    "FAIL {} case {i} ({:?}, {}): step {step} (key {}, now_ms {}, cost {}): expected {}, got {}",
                    path.display(),
                    case.description,
                    case.config,
                    show_key(&s.key),
                    s.now_ms,
                    s.cost,
                    show_expected(&expected),
                    show_actual(&actual)
                ));
            }
            // A store that stopped answering, or lost its connection: no
            // decision to judge, and each case left would wait on it in
            // turn, so the run stops.
            CaseOutcome::StoreFailed { step, error }
                if matches!(
                    error.kind(),
                    StoreErrorKind::Timeout | StoreErrorKind::ConnectionDropped
                ) =>
            {
                return Err(format!(
                    "store error at {} case {i} ({:?}, {}), step {step}: {error}",
                    path.display(),
                    case.description,
                    case.config
                ));
            }
            // Any other error is this case's own (a value the store refuses,
            // a full store): a failure, and the run goes on.
            CaseOutcome::StoreFailed { step, error } => {
                tally.failed += 1;
                out.line(format_args!(
                    "FAIL {} case {i} ({:?}, {}): step {step}: store error: {error}",
                    path.display(),
                    case.description,
                    case.config
                ));
            }
        }
    }
    if malformed > MAX_MALFORMED_SHOWN {
        let more = malformed - MAX_MALFORMED_SHOWN;
        errln!(
            "{}: {more} more malformed {}, not run and not shown",
            path.display(),
            if more == 1 { "case" } else { "cases" }
        );
    }
    note(
        path,
        "cases with no steps, which pass without testing anything",
        &empty,
    );
    Ok(())
}

/// The most malformed cases of one file named on standard error, one line
/// each: a file of millions (generated wrong) would otherwise bury the
/// rest of the run; the others are counted in one line.
const MAX_MALFORMED_SHOWN: usize = 100;

/// A step's key as the file writes it: a string with the number the store
/// saw, so a failure can be found in the file and in the store.
fn show_key(key: &VectorKey) -> String {
    match key {
        VectorKey::Int(k) => k.to_string(),
        VectorKey::Str(s) => format!("{s:?} = mix32 {}", key.resolve()),
    }
}

fn show_expected(e: &Expected) -> String {
    let retry = e
        .retry_after_ms
        .map_or("null".to_owned(), |r| r.to_string());
    format!(
        "allowed={} retry_after_ms={retry} remaining={}",
        e.allowed, e.remaining
    )
}

fn show_actual(d: &Decision) -> String {
    show_expected(&Expected::from(*d))
}
