//! One module per subcommand.

pub mod bench;
pub mod bench_redis;
pub mod key;
pub mod serve;
pub mod simulate;
pub mod vectors;

use std::io::Write;

use ratewarden_server::StoreUrl;

/// `println!` into a `String` (which cannot fail), for output written at
/// once with [`print_out`].
macro_rules! outln {
    ($out:expr) => {
        $out.push('\n')
    };
    ($out:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($out, $($arg)*);
    }};
}
pub(crate) use outln;

/// `eprintln!` that never panics: a standard error whose reader went
/// away (`2>&1 | head -1`, a log shipper that restarted) makes the
/// message lost, not the command stopped with a panic, or a running
/// service with it.
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}
pub(crate) use errln;

/// Writes a command's output to standard output. A reader that stopped
/// reading (`| head -1`) is no failure: it read what it wanted, and the
/// command ends as it would have.
pub fn print_out(text: &str) -> std::io::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// A type of whole numbers a flag takes, with its largest value, which
/// is the only upper bound some flags have (`--seed`).
pub trait Whole: std::str::FromStr + std::fmt::Display + Default {
    const MAX: Self;
}

impl Whole for u64 {
    const MAX: Self = u64::MAX;
}

impl Whole for usize {
    const MAX: Self = usize::MAX;
}

/// Parses a count or a duration flag. The subcommands with such flags take
/// negative numbers as values (rather than as unknown flags, clap's default)
/// so that `--limit -1` is answered here, naming the flag, instead of with
/// "unexpected argument '-1' found".
pub fn whole<T: Whole>(s: &str) -> Result<T, String> {
    if let Some(digits) = s.strip_prefix('-') {
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            // `-0` is 0, however written.
            if digits.bytes().all(|b| b == b'0') {
                return Ok(T::default());
            }
            // No lower bound is named here: some flags start at 0, others
            // at 1, and each says its own when the value is below it.
            return Err(format!("must not be negative, not `{s}`"));
        }
    }
    s.parse().map_err(|_| {
        let digits = s.strip_prefix('+').unwrap_or(s);
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            // Digits alone that do not parse are too many of them. The
            // type's bound is the one every such flag has; --help gives a
            // lower one where the flag has its own.
            format!("`{s}` is too large; give at most {}", T::MAX)
        } else {
            format!("must be a whole number, written in digits alone, not `{s}`")
        }
    })
}

/// A whole number in SPEC's range, `0 ..= 2^53 - 1`, for the flags that
/// give a policy its numbers (`--limit`, `--window-ms`): a value past it
/// is told that bound, not `u64`'s, which would be refused in turn.
pub fn spec_number(s: &str) -> Result<u64, String> {
    const MAX: u64 = (1 << 53) - 1;
    let too_large = || format!("`{s}` is too large; give at most {MAX} (2^53 - 1)");
    match whole::<u64>(s) {
        Ok(value) if value <= MAX => Ok(value),
        Ok(_) => Err(too_large()),
        Err(e) if e.contains("is too large") => Err(too_large()),
        Err(e) => Err(e),
    }
}

/// A store URL given as text (`bench`, `bench-redis`), without the
/// whitespace around it, as [`StoreUrlParser`] takes one: a URL holds none
/// raw, and a secret mounted from a file often ends with a newline.
pub fn trimmed(s: &str) -> Result<String, String> {
    Ok(s.trim_matches(|c: char| c.is_ascii_whitespace()).to_owned())
}

/// Parses `--store` into a [`StoreUrl`]. clap's own message for a refused
/// value quotes the raw text, and a store URL can hold a password: this
/// parser's message shows only the redacted URL that [`StoreUrl`]'s own
/// error names.
#[derive(Clone)]
pub struct StoreUrlParser;

impl clap::builder::TypedValueParser for StoreUrlParser {
    type Value = StoreUrl;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<StoreUrl, clap::Error> {
        let name = arg.map_or_else(|| "--store".to_owned(), ToString::to_string);
        // clap takes the argument's environment variable without saying
        // so: name it, or the user looks for a --store that was not given.
        let from = match arg.and_then(clap::Arg::get_env) {
            Some(var) if std::env::var_os(var).as_deref() == Some(value) => {
                format!(" (from the environment variable {})", var.to_string_lossy())
            }
            _ => String::new(),
        };
        let refused = |kind, why: String| {
            clap::Error::raw(kind, format!("invalid value for '{name}'{from}: {why}\n"))
                .with_cmd(cmd)
        };
        let Some(text) = value.to_str() else {
            return Err(refused(
                clap::error::ErrorKind::InvalidUtf8,
                "not valid UTF-8; a store URL is text".to_owned(),
            ));
        };
        text.parse()
            .map_err(|why| refused(clap::error::ErrorKind::ValueValidation, why))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn negative_and_malformed_counts_are_named() {
        assert_eq!(super::whole::<u64>("12"), Ok(12));
        let e = super::whole::<usize>("-5").unwrap_err();
        assert_eq!(e, "must not be negative, not `-5`");
        // Zero with a sign is zero.
        assert_eq!(super::whole::<u64>("-0"), Ok(0));
        assert_eq!(super::whole::<usize>("-00"), Ok(0));
        let e = super::whole::<u64>("1.5").unwrap_err();
        assert!(e.contains("not `1.5`"), "{e}");
    }

    #[test]
    fn spec_numbers_are_bounded_by_2_to_the_53() {
        assert_eq!(super::spec_number("9007199254740991"), Ok(9007199254740991));
        for refused in ["9007199254740992", "18446744073709551616"] {
            assert_eq!(
                super::spec_number(refused).unwrap_err(),
                format!("`{refused}` is too large; give at most 9007199254740991 (2^53 - 1)")
            );
        }
        assert!(super::spec_number("-1")
            .unwrap_err()
            .contains("must not be negative"));
    }

    #[test]
    fn whole_says_why_a_number_is_refused() {
        assert_eq!(super::whole::<u64>("42"), Ok(42));
        assert_eq!(super::whole::<u64>("+42"), Ok(42));
        // The bound is given, not left to --help, which has none for
        // some flags (--seed).
        let too_large = super::whole::<u64>("18446744073709551616").unwrap_err();
        assert_eq!(
            too_large,
            "`18446744073709551616` is too large; give at most 18446744073709551615"
        );
        assert!(super::whole::<usize>("99999999999999999999999")
            .unwrap_err()
            .contains("is too large"));
        assert!(super::whole::<u64>("-1")
            .unwrap_err()
            .contains("must not be negative"));
        for refused in ["-1", "-5", "1.5", "ten", "18446744073709551616"] {
            let why = super::whole::<u64>(refused).unwrap_err();
            assert!(!why.contains("see --help"), "{refused}: {why}");
            // A negative number is a whole number: not called otherwise.
            if refused.starts_with('-') {
                assert!(!why.contains("whole number"), "{refused}: {why}");
            }
        }
        for bad in ["1.5", "", "+", "ten", "1e3"] {
            let why = super::whole::<u64>(bad).unwrap_err();
            assert!(why.contains("must be a whole number"), "{bad}: {why}");
        }
    }
}
