//! One module per subcommand.

pub mod bench;
pub mod bench_redis;
pub mod serve;
pub mod simulate;
pub mod vectors;
