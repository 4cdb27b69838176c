//! `vmnetd`: the whole `vmnet` command line, the agent (`serve`) and the IPAM commands included
//! (see the `vmnet` library's docs).

fn main() -> std::process::ExitCode {
    vmnet::full::main()
}
