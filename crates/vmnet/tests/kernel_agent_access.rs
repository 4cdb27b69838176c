//! Who may drive the agent (root required: makes throwaway users and a group, and a sandbox):
//! `vmnet serve --socket-group G` makes its socket `root:G` mode 0660; a member of G (by a
//! supplementary group of its user) is served; a user outside G cannot connect, and when the
//! socket's mode is loosened by hand it connects but is refused by its peer credentials, and the
//! refusal is logged.

mod agent_support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

use agent_support::{options, start};
use vmnet_testkit::{Sandbox, require_root};

/// Test users and a group, deleted on drop.
struct Users {
    group: String,
    users: Vec<String>,
}

impl Drop for Users {
    fn drop(&mut self) {
        for u in &self.users {
            let _ = Command::new("userdel").arg(u).output();
        }
        let _ = Command::new("groupdel").arg(&self.group).output();
    }
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn ids(user: &str) -> (u32, u32) {
    let u = nix::unistd::User::from_name(user).unwrap().unwrap();
    (u.uid.as_raw(), u.gid.as_raw())
}

/// One `GET /v1/status` on `sock` as `uid:gid` with supplementary groups `groups`: the status
/// line, `NO ANSWER` when the agent closed the connection without answering (a reset
/// included), or the error's name.
fn get_as(sock: &std::path::Path, uid: u32, gid: u32, groups: Vec<u32>) -> String {
    let script = format!(
        "import socket\ntry:\n s=socket.socket(socket.AF_UNIX)\n s.settimeout(5)\n s.connect({:?})\n \
         s.sendall(b'GET /v1/status HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n')\n \
         d=s.recv(200)\n print(d.split(b'\\r\\n')[0].decode() if d else 'NO ANSWER')\nexcept (ConnectionResetError, BrokenPipeError):\n print('NO ANSWER')\nexcept Exception as e:\n print(type(e).__name__)\n",
        sock.display().to_string()
    );
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.arg("-c").arg(script);
    // SAFETY: the closure runs in the forked child before exec and calls only setgroups,
    // setgid and setuid, which are async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            let g: Vec<libc::gid_t> = groups.clone();
            if libc::setgroups(g.len(), g.as_ptr()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: makes users and a sandbox (scripts/test.sh runs it)"]
async fn only_root_and_the_socket_group_drive_the_agent() {
    require_root();
    let tag = std::process::id() % 100_000;
    let users = Users {
        group: format!("vmntg{tag}"),
        users: vec![format!("vmnti{tag}"), format!("vmnto{tag}")],
    };
    run(Command::new("groupadd").args(["--system", &users.group]));
    run(Command::new("useradd").args([
        "--system",
        "--user-group",
        "--no-create-home",
        "--shell",
        "/usr/sbin/nologin",
        "--groups",
        &users.group,
        &users.users[0],
    ]));
    run(Command::new("useradd").args([
        "--system",
        "--user-group",
        "--no-create-home",
        "--shell",
        "/usr/sbin/nologin",
        &users.users[1],
    ]));
    let group = nix::unistd::Group::from_name(&users.group)
        .unwrap()
        .unwrap()
        .gid
        .as_raw();
    let (in_uid, in_gid) = ids(&users.users[0]);
    let (out_uid, out_gid) = ids(&users.users[1]);

    let sb = Sandbox::new("ac").expect("sandbox");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let agent = start(&options(&sb, &dir, 60).args(["--socket-group", &users.group])).await;
    let sock = dir.join("vmnet.sock");
    let meta = std::fs::metadata(&sock).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o660, "mode");
    assert_eq!(
        (meta.uid(), meta.gid()),
        (0, group),
        "owner root, group the socket group"
    );

    // Root, and a member of the group (a session carries its supplementary groups).
    assert_eq!(get_as(&sock, 0, 0, vec![]), "HTTP/1.1 200 OK");
    assert_eq!(
        get_as(&sock, in_uid, in_gid, vec![in_gid, group]),
        "HTTP/1.1 200 OK"
    );
    // Outside the group: the file mode keeps it out.
    assert_eq!(
        get_as(&sock, out_uid, out_gid, vec![out_gid]),
        "PermissionError"
    );
    // The mode loosened by hand: it connects, and the agent refuses it by its credentials.
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(get_as(&sock, out_uid, out_gid, vec![out_gid]), "NO ANSWER");
    // The member is served by its user's supplementary groups even when its process does not
    // carry the group.
    assert_eq!(
        get_as(&sock, in_uid, in_gid, vec![in_gid]),
        "HTTP/1.1 200 OK"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = agent.log_text();
    assert!(
        log.lines().any(|l| l.contains("API connection refused")
            && l.contains(&format!("peer.uid={out_uid}"))
            && l.contains(&format!("not a member of the socket group (gid {group})"))),
        "the refusal is logged with the peer:\n{log}"
    );
    assert!(
        !log.lines()
            .any(|l| l.contains("API connection refused")
                && l.contains(&format!("peer.uid={in_uid}"))),
        "{log}"
    );
    drop(agent);
    drop(sb);
    drop(users);
}
