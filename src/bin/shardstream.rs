//! The `shardstream` command line.

fn main() {
    std::process::exit(shardstream::cli::run(std::env::args_os()));
}
