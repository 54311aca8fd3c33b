//! One module per subcommand.

pub mod bench_redis;
pub mod vectors;
