//! `ratewarden simulate`: drives policies with a traffic shape and draws
//! offered and admitted rates and the trailing-window count in one chart.

use super::errln;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{anyhow, bail, ensure, Context, Result};
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use ratewarden_core::{PolicyConfig, PolicyKind};

use crate::measure::accuracy::{decisions, series, Point};
use crate::measure::contender_policy;
use crate::measure::shapes::{
    Request, Shape, ShapeParams, TooManyRequests, MAX_GENERATED, MAX_REQUESTS,
};

/// The longest traffic a simulation generates: one hour.
const MAX_DURATION_MS: u64 = 3_600_000;
/// The most time buckets in a chart.
const MAX_BUCKETS: u64 = 20_000;

/// Arguments of `ratewarden simulate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Policies to compare, by registry name (fixed-window,
    /// sliding-window-counter, sliding-log, token-bucket, gcra), separated
    /// by commas, each once.
    #[arg(long, value_delimiter = ',', required = true)]
    pub policy: Vec<String>,
    /// The traffic shape: steady-0.8x, steady-2x, boundary-attack,
    /// poisson-bursts or heavy-tail-keys.
    #[arg(long)]
    pub shape: String,
    /// Requests admitted per window, 1 to 2^53 - 1.
    #[arg(long, default_value_t = 100, value_parser = crate::cmd::spec_number)]
    pub limit: u64,
    /// The window, in ms, 1 to 2^53 - 1.
    #[arg(long, default_value_t = 1000, value_parser = crate::cmd::spec_number)]
    pub window_ms: u64,
    /// How long the traffic lasts, in ms, 1 to 3,600,000 (one hour).
    #[arg(long, default_value_t = 10_000, value_parser = crate::cmd::whole::<u64>)]
    pub duration_ms: u64,
    /// The traffic's random seed.
    #[arg(long, default_value_t = 1, value_parser = crate::cmd::whole::<u64>)]
    pub seed: u64,
    /// The width of one time bucket of the chart, in ms, at most 20,000
    /// buckets in all [default: a twentieth of the window].
    #[arg(long, value_parser = crate::cmd::whole::<u64>)]
    pub bucket_ms: Option<u64>,
    /// Where to write the chart (SVG); replaced only when the run succeeds.
    #[arg(long)]
    pub out: PathBuf,
    /// Where to write the series as CSV.
    #[arg(long)]
    pub csv: Option<PathBuf>,
}

/// One policy's run.
struct Run {
    kind: PolicyKind,
    points: Vec<Point>,
}

/// A run the arguments describe, checked: the policies, the requests and
/// the files to write.
struct Prepared<'a> {
    shape: Shape,
    kinds: Vec<PolicyKind>,
    bucket_ms: u64,
    out: Output<'a>,
    csv: Option<Output<'a>>,
    requests: Vec<Request>,
}

/// Checks the arguments and makes the shape's requests: every mistake in
/// the command line shows here, before any policy runs or file is written.
fn prepare(args: &Args) -> Result<Prepared<'_>> {
    let shape: Shape = args.shape.parse().map_err(anyhow::Error::msg)?;
    let mut kinds = Vec::new();
    for name in &args.policy {
        // `--policy gcra,` or `--policy a,,b` has an empty name, which the
        // lookup would call "unknown policy ``".
        ensure!(
            !name.trim().is_empty(),
            "--policy {} has an empty name: remove the extra comma",
            args.policy.join(",")
        );
        let kind = contender_policy(name.trim())?;
        // Validate the configuration as a user would write it.
        PolicyConfig::new(kind, args.limit, args.window_ms)
            .build()
            .with_context(|| format!("--limit {} --window-ms {}", args.limit, args.window_ms))?;
        ensure!(
            !kinds.contains(&kind),
            "--policy names {kind} twice; name each policy once"
        );
        kinds.push(kind);
    }
    ensure!(
        (1..=MAX_DURATION_MS).contains(&args.duration_ms),
        "--duration-ms must be between 1 and {MAX_DURATION_MS} (one hour), not {}",
        args.duration_ms
    );
    let bucket_ms = args.bucket_ms.unwrap_or((args.window_ms / 20).max(1));
    ensure!(bucket_ms >= 1, "--bucket-ms must be at least 1");
    ensure!(
        args.duration_ms.div_ceil(bucket_ms) <= MAX_BUCKETS,
        "--duration-ms {} in buckets of {bucket_ms} ms is more than {MAX_BUCKETS} buckets; \
         give --bucket-ms {} or more",
        args.duration_ms,
        args.duration_ms.div_ceil(MAX_BUCKETS)
    );
    ensure!(
        args.limit >= 1,
        "--limit must be at least 1: every shape offers traffic in proportion to the limit, \
         so a limit of 0 offers none"
    );
    // Where the files go is checked before the run, so that a mistake in
    // a path costs no simulation and replaces no file.
    let out = Output::check("--out", &args.out)?;
    let csv = args
        .csv
        .as_ref()
        .map(|csv| Output::check("--csv", csv))
        .transpose()?;
    if let Some(csv) = &csv {
        // Two names of one file: the same path once links are followed,
        // or hard links to one file.
        let one_file = csv.target == out.target
            || same_file::is_same_file(&csv.target, &out.target).unwrap_or(false);
        ensure!(
            !one_file,
            "--csv {} and --out {} are the same file; give the series its own path",
            csv.given.display(),
            out.given.display()
        );
        // A series named .svg is most likely the chart's path given to
        // --csv: written, it would put CSV where a chart is looked for.
        ensure!(
            !is_svg(csv.given) && !is_svg(&csv.target),
            "--csv {}: the series is CSV, not a chart; give a path ending in .csv, such as {} \
             (were --out and --csv swapped?)",
            csv.given.display(),
            csv.given.with_extension("csv").display()
        );
    }
    let params = ShapeParams {
        limit: args.limit,
        window_ms: args.window_ms,
        duration_ms: args.duration_ms,
        seed: args.seed,
    };
    let expected = shape.expected_requests(&params);
    ensure!(
        expected <= MAX_REQUESTS as f64,
        "{shape} at --limit {} per --window-ms {} for --duration-ms {} is about {expected:.0} \
         requests, above the {MAX_REQUESTS} a simulation generates; lower --limit, raise \
         --window-ms or shorten --duration-ms",
        args.limit,
        args.window_ms,
        args.duration_ms
    );
    let requests = shape.generate(&params).map_err(|TooManyRequests| {
        anyhow!(
            "{shape} at --limit {} per --window-ms {} for --duration-ms {} with --seed {} drew \
             more than {MAX_GENERATED} requests, far above its mean of about {expected:.0} \
             (a burst holds about 0.6 times the limit, however rare bursts are); lower --limit",
            args.limit,
            args.window_ms,
            args.duration_ms,
            args.seed
        )
    })?;
    if requests.is_empty() {
        // Advice the bounds let the user follow.
        if shape == Shape::BoundaryAttack {
            let fix = if args.window_ms < MAX_DURATION_MS {
                format!("give --duration-ms {} or more", args.window_ms + 1)
            } else {
                format!(
                    "give --window-ms {} or less, so that the first edge falls within the \
                     longest run ({MAX_DURATION_MS} ms)",
                    MAX_DURATION_MS - 1
                )
            };
            bail!(
                "{shape} sends its first requests at ms {} and {}, at the first window edge; \
                 {fix}",
                args.window_ms - 1,
                args.window_ms,
            );
        }
        let longer = if args.duration_ms < MAX_DURATION_MS {
            format!("a longer --duration-ms (up to {MAX_DURATION_MS}), ")
        } else {
            String::new()
        };
        // What makes more requests: poisson-bursts starts about one burst a
        // window whatever the limit, which sizes the bursts only; the
        // other shapes send at rates in proportion to the limit's.
        let more = match shape {
            // At a limit this small, most bursts hold no request.
            Shape::PoissonBursts if args.limit < 5 => {
                "a shorter --window-ms (a burst starts about once a window) or a higher \
                 --limit (a burst holds about 0.6 times it)"
            }
            Shape::PoissonBursts => {
                "a shorter --window-ms (a burst starts about once a window, whatever the limit)"
            }
            _ => "a higher --limit or a shorter --window-ms",
        };
        bail!(
            "{shape} made no request in --duration-ms {} with --seed {}; give {longer}{more} \
             (or another --seed)",
            args.duration_ms,
            args.seed
        );
    }
    Ok(Prepared {
        shape,
        kinds,
        bucket_ms,
        out,
        csv,
        requests,
    })
}

/// Runs each policy on the prepared requests and writes the files.
fn simulate(args: &Args, prepared: Prepared) -> Result<()> {
    let Prepared {
        shape,
        kinds,
        bucket_ms,
        out,
        csv,
        requests,
    } = prepared;
    let mut runs = Vec::new();
    for kind in kinds {
        let admitted = decisions(kind, args.limit, args.window_ms, &requests)?;
        let points = series(
            &requests,
            &admitted,
            args.window_ms,
            args.duration_ms,
            bucket_ms,
        );
        runs.push(Run { kind, points });
    }
    // Both files are made in memory and written only when both exist, so
    // a failed run leaves neither behind, nor half of an older one.
    let mut files = vec![(out, draw(shape, args, bucket_ms, &runs)?)];
    if let Some(csv) = csv {
        files.push((csv, csv_text(args, &runs)));
    }
    publish(&files)
}

/// A file to write: the path as given, and the file it names.
struct Output<'a> {
    flag: &'static str,
    given: &'a Path,
    /// The folder's canonical path joined with the file name, or, when
    /// the file exists, its own canonical path (a symbolic link is
    /// followed, so that the file it points to is replaced, not the link).
    target: PathBuf,
}

impl<'a> Output<'a> {
    /// Checks that `given` names a regular file, new or old, in a folder
    /// that exists, saying what to change if not.
    fn check(flag: &'static str, given: &'a Path) -> Result<Output<'a>> {
        let shown = given.display();
        let example = given.join(if flag == "--csv" {
            "series.csv"
        } else {
            "chart.svg"
        });
        let Some(name) = given
            .file_name()
            .filter(|_| !given.as_os_str().to_string_lossy().ends_with('/'))
        else {
            bail!(
                "{flag} {shown} names a folder; give a file path, such as {}",
                example.display()
            );
        };
        let folder = match given.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        let folder = std::fs::canonicalize(folder).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => anyhow::anyhow!(
                "{flag} {shown}: the folder {} does not exist; create it or give another path",
                folder.display()
            ),
            _ => anyhow::anyhow!(
                "{flag} {shown}: cannot reach the folder {}: {e}",
                folder.display()
            ),
        })?;
        ensure!(
            folder.is_dir(),
            "{flag} {shown}: {} is not a folder",
            folder.display()
        );
        let target = match std::fs::canonicalize(given) {
            Ok(existing) => {
                let meta =
                    std::fs::metadata(&existing).with_context(|| format!("{flag} {shown}"))?;
                ensure!(
                    !meta.is_dir(),
                    "{flag} {shown} is a folder; give a file path, such as {}",
                    example.display()
                );
                ensure!(
                    meta.is_file(),
                    "{flag} {shown} is not a regular file (a device, a pipe or a socket); \
                     give a file path"
                );
                // The file is replaced by a new one, which its folder allows
                // whatever the file's own mode: a file this user may not
                // write is refused, as a shell's `>` would refuse it. (Opened
                // without truncating it: nothing is changed. Only the mode's
                // refusal, EACCES: an immutable file's EPERM is met by the
                // move, after the run, and undone as any failed move is.)
                if let Err(e) = std::fs::OpenOptions::new().write(true).open(&existing) {
                    if e.raw_os_error() == Some(13) {
                        bail!(
                            "{flag} {shown} exists and is not writable by you; make it \
                             writable (chmod u+w) or give another path"
                        );
                    }
                }
                existing
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                match dangling_link_target(flag, given)? {
                    Some(target) => target,
                    None => folder.join(name),
                }
            }
            Err(e) => bail!("{flag} {shown}: {e}"),
        };
        // The chart is SVG text: a name that says otherwise would mislead
        // whatever opens the file by its extension.
        if flag == "--out" {
            // A link named .svg to another file: the name to change is the
            // file's it leads to.
            ensure!(
                is_svg(&target) || !is_svg(given),
                "{flag} {shown} is a link to {}, which does not end in .svg; the chart is SVG: \
                 give a path to a .svg file",
                target.display()
            );
            ensure!(
                is_svg(&target),
                "{flag} {shown}: the chart is SVG; give a path ending in .svg, such as {}",
                given.with_extension("svg").display()
            );
        }
        // A folder that takes no new file fails here, before the run,
        // rather than after it: the probe is a temporary file, removed.
        let dir = target.parent().unwrap_or(Path::new("."));
        temp_beside(dir).map_err(|e| {
            anyhow::anyhow!(
                "{flag} {shown}: cannot write a file in {}: {}",
                dir.display(),
                cannot_write(&e)
            )
        })?;
        Ok(Output {
            flag,
            given,
            target,
        })
    }
}

/// Whether `path`'s name ends in `.svg`, in any case.
fn is_svg(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"))
}

/// Why a file cannot be made in a folder, saying what to do.
fn cannot_write(e: &std::io::Error) -> String {
    use std::io::ErrorKind;
    match e.kind() {
        ErrorKind::PermissionDenied => {
            "permission denied; choose a folder you can write to".to_owned()
        }
        ErrorKind::ReadOnlyFilesystem => {
            "the file system is read-only; choose another folder".to_owned()
        }
        // What /proc and /sys answer: they take no new files.
        ErrorKind::NotFound => "the folder takes no new files; choose another folder".to_owned(),
        // The temporary file's own name would only confuse: the error
        // without it.
        kind => e.raw_os_error().map_or_else(
            || std::io::Error::from(kind).to_string(),
            |code| std::io::Error::from_raw_os_error(code).to_string(),
        ),
    }
}

/// The most links followed from one path, as Linux's own bound.
const MAX_LINKS: usize = 40;

/// Where `given` points when it is a symbolic link whose file does not
/// exist yet (a link to a new file: the file is made, the link kept), its
/// folder checked as a path's own would be; `None` when `given` is no
/// link.
fn dangling_link_target(flag: &str, given: &Path) -> Result<Option<PathBuf>> {
    let shown = given.display();
    let mut path = given.to_path_buf();
    for _ in 0..MAX_LINKS {
        match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let to = std::fs::read_link(&path).with_context(|| format!("{flag} {shown}"))?;
                // A link to `name/` names a folder, even one not made yet.
                ensure!(
                    !to.as_os_str().to_string_lossy().ends_with('/'),
                    "{flag} {shown} is a link to the folder {}; give a file path",
                    to.display()
                );
                path = path.parent().unwrap_or(Path::new(".")).join(to);
            }
            Ok(_) => bail!("{flag} {shown}: it changed while it was read; give it again"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if path == given {
                    return Ok(None);
                }
                let name = path.file_name().ok_or_else(|| {
                    anyhow::anyhow!(
                        "{flag} {shown} is a link to {}, which names no file; \
                         give a file path",
                        path.display()
                    )
                })?;
                let folder = match path.parent() {
                    Some(dir) if !dir.as_os_str().is_empty() => dir,
                    _ => Path::new("."),
                };
                let folder = std::fs::canonicalize(folder)
                    .ok()
                    .filter(|f| f.is_dir())
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "{flag} {shown} is a link to {}, in a folder that does not exist; \
                             create {} or give another path",
                            path.display(),
                            folder.display()
                        )
                    })?;
                return Ok(Some(folder.join(name)));
            }
            Err(e) => bail!("{flag} {shown}: {e}"),
        }
    }
    bail!("{flag} {shown}: more than {MAX_LINKS} links in a row; give the file's own path")
}

/// Writes each file's text to a temporary file beside its target and,
/// once every one is written, moves each into place, each new file with
/// the mode of the one it replaces. The targets were
/// checked before the run, so a move fails only if one changed since (or
/// cannot be replaced, as an immutable file): then the files already moved are put back as
/// they were, from their old content kept aside beside them.
///
/// What this guarantees: a run that fails leaves every path as it was,
/// unless putting one back fails too, which the error says, naming where
/// the old file is kept. What it cannot: a kill between two moves leaves
/// the first file new and the second old, and the old first kept aside
/// as a `.ratewarden-` file beside it; no file is ever half written.
fn publish(files: &[(Output, String)]) -> Result<()> {
    let mut written = Vec::with_capacity(files.len());
    for (output, text) in files {
        let dir = output.target.parent().unwrap_or(Path::new("."));
        let temp = temp_beside(dir)
            .and_then(|mut temp| {
                // A file that is replaced keeps its mode, and its owner
                // and group where this user may give them (root may): a
                // chart kept private stays private, and readable by whom
                // it was.
                match std::fs::metadata(&output.target) {
                    Ok(old) => {
                        temp.as_file().set_permissions(old.permissions())?;
                        #[cfg(unix)]
                        {
                            use std::os::unix::fs::MetadataExt as _;
                            let _ = std::os::unix::fs::fchown(
                                temp.as_file(),
                                Some(old.uid()),
                                Some(old.gid()),
                            );
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
                temp.write_all(text.as_bytes())?;
                temp.flush()?;
                // On disk before it takes the old file's name, so that a
                // power cut after the move finds the new file whole.
                temp.as_file().sync_all()?;
                Ok(temp)
            })
            // Say what could not be written, and where.
            .map_err(|e| {
                anyhow::anyhow!(
                    "{} {}: cannot write a file in {}: {}",
                    output.flag,
                    output.given.display(),
                    dir.display(),
                    cannot_write(&e)
                )
            })?;
        written.push((temp, output));
    }
    // Every file but the last may have to be put back: its old content
    // is kept aside first (the last's is replaced by the last move, which
    // has nothing after it to fail).
    let mut asides = Vec::with_capacity(written.len());
    for (i, (_, output)) in written.iter().enumerate() {
        let aside = if i + 1 < written.len() {
            keep_aside(&output.target).with_context(|| {
                format!(
                    "{} {}: keeping the old file aside until the new ones are in place",
                    output.flag,
                    output.given.display()
                )
            })?
        } else {
            None
        };
        asides.push(aside);
    }
    let mut placed: Vec<(&Output, Option<tempfile::TempPath>)> = Vec::new();
    for ((temp, output), aside) in written.into_iter().zip(asides) {
        if let Err(e) = temp.persist(&output.target) {
            let mut message = format!(
                "{} {}: moving the new file into place: {}",
                output.flag,
                output.given.display(),
                e.error
            );
            for (earlier, aside) in placed.into_iter().rev() {
                if let Err(undo) = put_back(earlier, aside) {
                    message.push_str(&format!("; {undo}"));
                }
            }
            bail!(message);
        }
        placed.push((output, aside));
    }
    // The old files kept aside are removed as their paths drop.
    Ok(())
}

/// A hard link to the file at `target` beside it (a copy where the file
/// system refuses the link), removed when dropped; `None` when there is
/// no file there yet.
fn keep_aside(target: &Path) -> std::io::Result<Option<tempfile::TempPath>> {
    if let Err(e) = std::fs::symlink_metadata(target) {
        return match e.kind() {
            std::io::ErrorKind::NotFound => Ok(None),
            _ => Err(e),
        };
    }
    let dir = target.parent().unwrap_or(Path::new("."));
    let linked = tempfile::Builder::new()
        .prefix(".ratewarden-old-")
        .make_in(dir, |path| std::fs::hard_link(target, path));
    let aside = match linked {
        Ok(link) => link.into_temp_path(),
        Err(_) => {
            let copy = temp_beside(dir)?.into_temp_path();
            std::fs::copy(target, &copy)?;
            copy
        }
    };
    Ok(Some(aside))
}

/// Puts `output`'s old file back from where it was kept aside, or removes
/// the new one when there was none; the error says where the old file
/// is kept when it could not be put back.
fn put_back(output: &Output, aside: Option<tempfile::TempPath>) -> Result<(), String> {
    let shown = format!("{} {}", output.flag, output.given.display());
    match aside {
        Some(aside) => aside.persist(&output.target).map_err(|e| {
            let error = e.error;
            match e.path.keep() {
                Ok(kept) => format!(
                    "{shown} is new, and its old file could not be put back ({error}); \
                     it is kept as {}",
                    kept.display()
                ),
                Err(_) => format!("{shown} is new, and its old file is lost: {error}"),
            }
        }),
        None => std::fs::remove_file(&output.target)
            .map_err(|e| format!("{shown} is new and could not be removed: {e}")),
    }
}

/// One colour per policy, in [`PolicyKind::ALL`]'s order.
const PALETTE: [RGBColor; 5] = [
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0xff, 0x7f, 0x0e),
];
const _: () = assert!(PALETTE.len() == PolicyKind::ALL.len());

/// A temporary file in `dir`, removed unless persisted, with the
/// permissions a file the user creates gets (0666 less the umask; a
/// temporary file would otherwise be its owner's only).
fn temp_beside(dir: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    let mut builder = tempfile::Builder::new();
    builder.prefix(".ratewarden-");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    builder.tempfile_in(dir)
}

/// A series drawn as steps: each bucket's value held from its start to
/// its end, so that a line shows the bucket it stands for.
fn steps(points: &[Point], value: impl Fn(&Point) -> f64) -> Vec<(f64, f64)> {
    points
        .iter()
        .flat_map(|p| {
            let v = value(p);
            [(p.start_ms as f64, v), (p.end_ms as f64, v)]
        })
        .collect()
}

/// An axis tick as a reader writes it: `3000`, not `3000.0`; `0.25`, not
/// `0.25000000000000006`; on an axis reaching a million (`axis_top`),
/// every tick but 0 as `1.6e16`, whose digits would run past the 80 px
/// beside the axis, over its title (all of them, so that `500000` and
/// `1e6` do not stand side by side on one axis).
fn tick_label(v: f64, axis_top: f64) -> String {
    if axis_top >= 1e6 && v != 0.0 {
        let text = format!("{v:.2e}");
        let (mantissa, exponent) = text.split_once('e').unwrap_or((&text, "0"));
        let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
        return format!("{mantissa}e{exponent}");
    }
    let text = format!("{v:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text == "-0" {
        "0".to_string()
    } else {
        text.to_string()
    }
}

/// The chart, as SVG text.
fn draw(shape: Shape, args: &Args, bucket_ms: u64, runs: &[Run]) -> Result<String> {
    let points = || runs.iter().flat_map(|r| r.points.iter());
    // Headroom above the highest line keeps the legend clear of the data.
    let rate_top = points()
        .map(|p| p.offered_per_sec().max(p.admitted_per_sec()))
        .fold(1.0, f64::max)
        * 1.7;
    let count_top = points()
        .map(|p| p.trailing_count as f64)
        .fold(args.limit as f64, f64::max)
        .max(1.0)
        * 1.9;
    let end_ms = args.duration_ms as f64;
    let mut svg = String::new();
    let root = SVGBackend::with_string(&mut svg, (1200, 720)).into_drawing_area();
    let result = (|| -> Result<(), Box<dyn std::error::Error>> {
        root.fill(&WHITE)?;
        // The boundary attack draws no random numbers: no seed to name.
        let seed = if shape.is_seeded() {
            format!(", seed {}", args.seed)
        } else {
            String::new()
        };
        // A bucket as long as the run or longer is the run: its rate is
        // taken over the run's length.
        let buckets = if bucket_ms >= args.duration_ms {
            format!("rates over the whole run ({} ms)", args.duration_ms)
        } else {
            format!("rates in {bucket_ms} ms buckets")
        };
        let caption = format!(
            "{}: limit {} per {} ms{seed}; {buckets}",
            shape, args.limit, args.window_ms
        );
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 22))
            .margin(15)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .right_y_label_area_size(80)
            .build_cartesian_2d(0f64..end_ms, 0f64..rate_top)?
            .set_secondary_coord(0f64..end_ms, 0f64..count_top);
        chart
            .configure_mesh()
            .x_desc("time (ms)")
            .y_desc("offered and admitted rate (requests/s), solid")
            .x_label_formatter(&|ms| tick_label(*ms, end_ms))
            .y_label_formatter(&|v| tick_label(*v, rate_top))
            .label_style(("sans-serif", 15))
            .draw()?;
        chart
            .configure_secondary_axes()
            .y_desc(format!(
                "admitted in the trailing {} ms (requests), dashed",
                args.window_ms
            ))
            .y_label_formatter(&|v| tick_label(*v, count_top))
            .label_style(("sans-serif", 15))
            .draw()?;
        let grey = RGBColor(0x99, 0x99, 0x99);
        if let Some(first) = runs.first() {
            chart
                .draw_series(LineSeries::new(
                    steps(&first.points, Point::offered_per_sec),
                    grey.stroke_width(1),
                ))?
                .label("offered rate")
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], grey.stroke_width(1))
                });
        }
        let limit = args.limit as f64;
        chart
            .draw_secondary_series(DashedLineSeries::new(
                [(0.0, limit), (end_ms, limit)],
                3,
                3,
                BLACK.stroke_width(2),
            ))?
            .label(format!("limit: {} per {} ms", args.limit, args.window_ms))
            .legend(|(x, y)| {
                DashedPathElement::new([(x, y), (x + 20, y)], 3, 3, BLACK.stroke_width(2))
            });
        for (i, run) in runs.iter().enumerate() {
            // By policy, not by place in --policy: a policy keeps its
            // colour from one chart to the next.
            let color = PALETTE[PolicyKind::ALL
                .iter()
                .position(|k| *k == run.kind)
                .unwrap_or(i)
                % PALETTE.len()];
            // Earlier policies are drawn wider, so a policy that decides
            // exactly like another still shows under it.
            let width = 2 * (runs.len() - i) as u32;
            chart
                .draw_series(LineSeries::new(
                    steps(&run.points, Point::admitted_per_sec),
                    color.stroke_width(width),
                ))?
                .label(format!("{}: admitted rate", run.kind))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], color.stroke_width(3))
                });
            chart
                .draw_secondary_series(DashedLineSeries::new(
                    steps(&run.points, |p| p.trailing_count as f64),
                    8,
                    4,
                    color.stroke_width(width),
                ))?
                .label(format!(
                    "{}: admitted in trailing window, busiest key",
                    run.kind
                ))
                .legend(move |(x, y)| {
                    DashedPathElement::new([(x, y), (x + 20, y)], 6, 3, color.stroke_width(3))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
        root.present()?;
        Ok(())
    })();
    if let Err(e) = result {
        bail!("drawing the chart: {e}");
    }
    drop(root);
    Ok(svg)
}

/// The series as CSV text, one line per policy and bucket.
fn csv_text(args: &Args, runs: &[Run]) -> String {
    let mut text =
        String::from("policy,start_ms,offered_per_sec,admitted_per_sec,trailing_count,limit\n");
    for run in runs {
        for p in &run.points {
            text.push_str(&format!(
                "{},{},{},{},{},{}\n",
                run.kind,
                p.start_ms,
                p.offered_per_sec(),
                p.admitted_per_sec(),
                p.trailing_count,
                args.limit
            ));
        }
    }
    text
}

/// Runs `ratewarden simulate`.
pub fn run(args: Args) -> ExitCode {
    // A mistake in the command line exits 2, as clap's own refusals do; a
    // run that fails (a file that cannot be written) exits 1.
    let prepared = match prepare(&args) {
        Ok(prepared) => prepared,
        Err(e) => {
            errln!("ratewarden simulate: {e:#}");
            return ExitCode::from(2);
        }
    };
    match simulate(&args, prepared) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            errln!("ratewarden simulate: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ticks say where they are, on a chart of a few ms (0.5, not a
    /// rounded 0 or 1) as on one of huge rates (in a few characters).
    #[test]
    fn tick_labels_are_exact_and_short() {
        for (v, label) in [
            (0.0, "0"),
            (0.5, "0.5"),
            (1.5, "1.5"),
            (3000.0, "3000"),
            (0.25000000000000006, "0.25"),
            (999_999.0, "999999"),
        ] {
            assert_eq!(tick_label(v, 999_999.0), label, "{v}");
        }
        // On an axis reaching a million, every tick alike.
        for (v, label) in [
            (0.0, "0"),
            (500_000.0, "5e5"),
            (1e6, "1e6"),
            (2_500_000.0, "2.5e6"),
            (16_000_000_000_000_000.0, "1.6e16"),
            (9_007_199_254_740_991.0, "9.01e15"),
        ] {
            assert_eq!(tick_label(v, 3.6e6), label, "{v}");
        }
    }

    /// The names in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// A second file that cannot be moved into place (a folder has taken
    /// its name since the check) leaves the first as it was: its old
    /// content put back, or, when it was new, no file.
    #[test]
    fn a_failed_second_move_puts_the_first_file_back() {
        let dir = tempfile::tempdir().unwrap();
        let chart = dir.path().join("chart.svg");
        std::fs::write(&chart, "old chart").unwrap();
        let series = dir.path().join("series.csv");
        std::fs::create_dir(&series).unwrap();
        std::fs::write(series.join("in-the-way"), "").unwrap();
        let files = [
            (
                Output {
                    flag: "--out",
                    given: &chart,
                    target: chart.clone(),
                },
                "new chart".to_owned(),
            ),
            (
                Output {
                    flag: "--csv",
                    given: &series,
                    target: series.clone(),
                },
                "new series".to_owned(),
            ),
        ];
        let e = format!("{:#}", publish(&files).unwrap_err());
        assert!(
            e.contains("--csv") && e.contains("moving the new file into place"),
            "{e}"
        );
        assert_eq!(std::fs::read_to_string(&chart).unwrap(), "old chart");
        // Neither a new file nor the old one kept aside is left behind.
        assert_eq!(names(dir.path()), ["chart.svg", "series.csv"]);

        std::fs::remove_file(&chart).unwrap();
        let e = format!("{:#}", publish(&files).unwrap_err());
        assert!(e.contains("--csv"), "{e}");
        assert_eq!(names(dir.path()), ["series.csv"]);
    }
}
