//! `vmnet`: the client commands, run here; every other command runs in `vmnetd` beside it
//! (see the `vmnet` library's docs).

fn main() -> std::process::ExitCode {
    vmnet::thin::main()
}
