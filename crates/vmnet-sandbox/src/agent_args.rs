//! `vmnet-lab up --agent-arg`: extra flags for every agent `up` starts, checked before anything
//! is built, and the agents' command lines as `up` prints them.
//!
//! An extra flag is one long flag, its value after `=` (`--firewall-audit-secs=5`), so each
//! `--agent-arg` stands alone and none can smuggle a value in for the flag before it. The flags
//! `up` sets on its agents itself ([`CONTROLLED`]: where the socket, state and database live,
//! the namespace and name prefix the sandbox's cleanup relies on, the uplink, the pool host and
//! bridge, the fleet's mesh) are refused, as are `--help` and `--version`, which would make the
//! agent exit at once.

use std::ffi::OsString;
use std::path::Path;

use vmnet_model::Error;

/// The flags `up` gives its agents itself: refused in `--agent-arg`.
pub const CONTROLLED: &[&str] = &[
    "--socket",
    "--state-dir",
    "--database-url",
    "--output",
    "--netns",
    "--name-prefix",
    "--uplink",
    "--public-neighbors",
    "--activity-root",
    "--wake-hold-secs",
    "--wake-deliver",
    "--host-id",
    "--bridge",
    "--mesh",
    "--wg-interface",
    "--mesh-address",
    "--mesh-bpf-root",
    "--mesh-registry",
    "--help",
    "--version",
];

/// Checks the `--agent-arg` values of `up` (see the module docs).
///
/// # Errors
/// `INVALID_INPUT` naming the first value that is not one long flag or that `up` controls.
pub fn check(args: &[String]) -> Result<(), Error> {
    for a in args {
        let flag = a.split_once('=').map_or(a.as_str(), |(f, _)| f);
        if !flag.starts_with("--") || flag.len() == 2 {
            return Err(Error::invalid(format!(
                "vmnet-lab up --agent-arg {a:?}: give one long flag of `vmnet serve`, its value after `=` (e.g. --agent-arg=--firewall-audit-secs=5)"
            )));
        }
        if CONTROLLED.contains(&flag) {
            return Err(Error::invalid(format!(
                "vmnet-lab up --agent-arg {a:?}: `up` sets {flag} on its agents itself; the flags it controls are {}",
                CONTROLLED.join(" ")
            )));
        }
    }
    Ok(())
}

/// One argument as a shell would need it: as it is when it holds only characters no shell
/// treats specially, else in single quotes.
#[must_use]
pub fn shell_word(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,@%+".contains(&b));
    if plain {
        arg.to_owned()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

/// The whole command line of an agent: `exe` and `args` ([`crate::agent::AgentOptions::command_args`]).
#[must_use]
pub fn command_line(exe: &Path, args: &[OsString]) -> Vec<String> {
    std::iter::once(exe.display().to_string())
        .chain(args.iter().map(|a| a.to_string_lossy().into_owned()))
        .collect()
}

/// `command` as one line to copy into a shell.
#[must_use]
pub fn shell_line(command: &[String]) -> String {
    command
        .iter()
        .map(|a| shell_word(a))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn long_flags_up_does_not_set_pass() {
        check(&strings(&[
            "--firewall-audit-secs=5",
            "--reconcile-interval-secs=2",
            "--no-metadata",
        ]))
        .unwrap();
        check(&[]).unwrap();
    }

    #[test]
    fn flags_up_sets_are_refused_with_or_without_a_value() {
        for a in [
            "--socket=/tmp/x.sock",
            "--state-dir",
            "--database-url=sqlite:///tmp/x.db",
            "--netns=other",
            "--name-prefix=abc",
            "--uplink=eth0",
            "--activity-root=/sys/fs/bpf/x",
            "--host-id=h",
            "--mesh",
            "--help",
        ] {
            let e = check(&strings(&["--no-metadata", a])).unwrap_err();
            assert_eq!(e.code, vmnet_model::ErrorCode::InvalidInput, "{a}");
            let flag = a.split('=').next().unwrap();
            assert!(
                e.message
                    .contains(&format!("`up` sets {flag} on its agents")),
                "{a}: {e}"
            );
        }
    }

    #[test]
    fn values_and_short_flags_are_refused() {
        for a in ["5", "-v", "--", "--=5", "", "serve"] {
            let e = check(&strings(&[a])).unwrap_err();
            assert!(e.message.contains("give one long flag"), "{a:?}: {e}");
        }
    }

    #[test]
    fn the_command_line_quotes_only_what_a_shell_needs() {
        let line = shell_line(&strings(&[
            "/usr/bin/vmnet",
            "--socket",
            "/run/s b/vmnet.sock",
            "--x=it's",
            "--firewall-audit-secs=5",
        ]));
        assert_eq!(
            line,
            r"/usr/bin/vmnet --socket '/run/s b/vmnet.sock' '--x=it'\''s' --firewall-audit-secs=5"
        );
        assert_eq!(shell_word(""), "''");
    }
}
