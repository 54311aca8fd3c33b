//! One module per subcommand.

pub mod bench;
pub mod bench_redis;
pub mod serve;
pub mod simulate;
pub mod vectors;

/// Parses a count or a duration flag. The subcommands with such flags take
/// negative numbers as values (rather than as unknown flags, clap's default)
/// so that `--limit -1` is answered here, naming the flag, instead of with
/// "unexpected argument '-1' found".
pub fn whole<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    if s.starts_with('-') && s[1..].parse::<u128>().is_ok() {
        return Err("must be a whole number, 0 or more, not a negative one".into());
    }
    s.parse()
        .map_err(|_| format!("must be a whole number, 0 or more, not `{s}`"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn negative_and_malformed_counts_are_named() {
        assert_eq!(super::whole::<u64>("12"), Ok(12));
        let e = super::whole::<usize>("-5").unwrap_err();
        assert!(e.contains("not a negative one"), "{e}");
        let e = super::whole::<u64>("1.5").unwrap_err();
        assert!(e.contains("not `1.5`"), "{e}");
    }
}
