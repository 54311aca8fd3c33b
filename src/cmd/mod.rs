//! One module per subcommand.

pub mod bench_redis;
pub mod serve;
pub mod vectors;
