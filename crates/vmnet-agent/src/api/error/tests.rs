use vmnet_kernel::pool::guard::GuardError;
use vmnet_kernel::pool::libnft::LibNftError;
use vmnet_kernel::pool::tap::TapError;
use vmnet_model::nic::IfName;

use super::*;

fn json_error() -> serde_json::Error {
    serde_json::from_str::<serde_json::Value>("[").unwrap_err()
}

#[test]
fn every_ipam_error_maps_to_its_documented_code() {
    let io = || std::io::Error::from_raw_os_error(13);
    let cases: Vec<(IpamError, ErrorCode)> = vec![
        (
            IpamError::invalid("host h1: vcpus must be at least 1"),
            ErrorCode::InvalidInput,
        ),
        (
            IpamError::UnknownScheme {
                url: "mysql://x".into(),
            },
            ErrorCode::InvalidInput,
        ),
        (
            IpamError::Url {
                url: "sqlite://".into(),
                source: sqlx::Error::Configuration("no file".into()),
            },
            ErrorCode::InvalidInput,
        ),
        (IpamError::not_found("pool p1"), ErrorCode::NotFound),
        (
            IpamError::Conflict("host h1 already exists".into()),
            ErrorCode::Conflict,
        ),
        (
            IpamError::Exhausted("Pool p1 has no free IP address".into()),
            ErrorCode::CapacityUnavailable,
        ),
        (
            IpamError::Contended("instance i1 kept moving between hosts; try again".into()),
            ErrorCode::Unavailable,
        ),
        (IpamError::Busy, ErrorCode::Unavailable),
        (
            IpamError::Database {
                what: "the database is unreachable; try again".into(),
                source: sqlx::Error::PoolClosed,
            },
            ErrorCode::Unavailable,
        ),
        (
            IpamError::Connect(sqlx::Error::PoolTimedOut),
            ErrorCode::Unavailable,
        ),
        (
            IpamError::Migrate(sqlx::migrate::MigrateError::VersionMissing(7)),
            ErrorCode::Unavailable,
        ),
        (
            IpamError::Io {
                what: "cannot create database directory /x".into(),
                source: io(),
            },
            ErrorCode::Unavailable,
        ),
        (
            IpamError::Corrupt("stored address 5000000000 is out of range".into()),
            ErrorCode::Internal,
        ),
        (
            IpamError::Json {
                what: "stored dns \"[\"".into(),
                source: json_error(),
            },
            ErrorCode::Internal,
        ),
    ];
    for (e, code) in cases {
        let shown = format!("{e:?}");
        let wire = from_ipam(e);
        assert_eq!(wire.code, code, "{shown}");
        assert!(!wire.message.is_empty(), "{shown}");
    }
}

#[test]
fn messages_keep_their_wording_and_causes() {
    assert_eq!(
        from_ipam(IpamError::not_found("instance i-1")).message,
        "instance i-1 not found"
    );
    assert_eq!(
        from_ipam(IpamError::Connect(sqlx::Error::PoolTimedOut)).message,
        format!(
            "cannot connect to the database: {}",
            sqlx::Error::PoolTimedOut
        )
    );
    let json = IpamError::Invalid(ValidationError::Json {
        what: "vm: malformed JSON".into(),
        source: json_error(),
    });
    assert_eq!(
        from_ipam(json).message,
        format!("vm: malformed JSON: {}", json_error())
    );
}

#[test]
fn a_database_failure_answers_our_sentence_and_chains_its_source_once() {
    let e = IpamError::Database {
        what: "the database refused the request (SQLSTATE 23514); the details are logged".into(),
        source: sqlx::Error::Protocol("constraint ip_leases_check at execMain.c:2034".into()),
    };
    let logged = chain(&e);
    assert_eq!(logged.matches("execMain.c").count(), 1, "{logged}");
    assert!(
        logged.starts_with("the database refused the request (SQLSTATE 23514)"),
        "{logged}"
    );
    let wire = from_ipam(e);
    assert_eq!(wire.code, ErrorCode::Unavailable);
    assert_eq!(
        wire.message,
        "the database refused the request (SQLSTATE 23514); the details are logged"
    );
}

#[test]
fn namespace_driver_errors_map_to_invalid_input_or_unavailable() {
    let io = || std::io::Error::from_raw_os_error(1);
    let invalid = NsError::Invalid("name prefix vmx does not match vmn".into());
    assert_eq!(ns_code(&invalid), ErrorCode::InvalidInput);
    for e in [
        NsError::Tap {
            name: "vmnt0001".into(),
            op: "create",
            source: io(),
        },
        NsError::Sysctl {
            netns: "vmnn0001".into(),
            path: "net/ipv4/ip_forward".into(),
            source: io(),
        },
        NsError::Nft {
            netns: "host".into(),
            message: "Operation not permitted".into(),
        },
        NsError::Missing("link vmnh0001".into()),
        NsError::Many(vec![NsError::Missing("a".into())]),
        NsError::NoRuntime,
    ] {
        assert_eq!(ns_code(&e), ErrorCode::Unavailable, "{e:?}");
    }
    let tap = NsError::Tap {
        name: "vmnt0001".into(),
        op: "create",
        source: io(),
    };
    assert_eq!(
        from_ns(&tap).message,
        "tap vmnt0001: create: Operation not permitted (os error 1)"
    );
}

#[test]
fn seed_errors_map_to_invalid_input_or_internal() {
    let invalid = SeedError::Invalid(ValidationError::rule(
        "instance i-1: nics: 9 NICs, at most 8",
    ));
    let wire = from_seed(invalid);
    assert_eq!(wire.code, ErrorCode::InvalidInput);
    assert_eq!(wire.message, "instance i-1: nics: 9 NICs, at most 8");
    let encode = SeedError::Encode {
        instance: "i-1".into(),
        source: json_error(),
    };
    let wire = from_seed(encode);
    assert_eq!(wire.code, ErrorCode::Internal);
    assert_eq!(
        wire.message,
        format!("instance i-1: seed: {}", json_error())
    );
}

#[test]
fn server_errors_map_to_conflict_invalid_input_or_unavailable() {
    let in_use =
        ServerError::InUse("socket /run/vmnet.sock: another agent is listening on it".into());
    assert_eq!(server_code(&in_use), ErrorCode::Conflict);
    let group = ServerError::BadGroup("--socket-group nope: no such group".into());
    assert_eq!(server_code(&group), ErrorCode::InvalidInput);
    let io = ServerError::Io {
        what: "socket /run/vmnet.sock: bind failed".into(),
        source: std::io::Error::from_raw_os_error(13),
    };
    let wire = from_server(io);
    assert_eq!(wire.code, ErrorCode::Unavailable);
    assert_eq!(
        wire.message,
        "socket /run/vmnet.sock: bind failed: Permission denied (os error 13)"
    );
}

#[test]
fn validation_errors_are_invalid_input() {
    let ApiError(e) = ApiError::from(ValidationError::rule("vm v1: user_id 70000 is outside"));
    assert_eq!(e.code, ErrorCode::InvalidInput);
    assert_eq!(e.message, "vm v1: user_id 70000 is outside");
}

#[test]
fn pool_firewall_errors_keep_their_codes_and_wording() {
    let plan = FirewallError::Plan(ValidationError::rule("instance i-1: no NIC"));
    assert_eq!(from_firewall(&plan).code, ErrorCode::InvalidInput);
    assert_eq!(from_firewall(&plan).message, "instance i-1: no NIC");
    let dup = FirewallError::Duplicate("i-1".into());
    assert_eq!(
        from_firewall(&dup),
        Error::conflict("instance i-1: its taps have rules on this host already")
    );
    let nft = FirewallError::Nft(LibNftError::Context);
    assert_eq!(
        from_firewall(&nft),
        Error::unavailable("pool firewall: nftables: libnftables: cannot create a context")
    );
    for e in [
        FirewallError::Helper("connection refused".into()),
        FirewallError::ReadBack("listing is not JSON".into()),
    ] {
        assert_eq!(firewall_code(&e), ErrorCode::Unavailable, "{e:?}");
        assert!(
            from_firewall(&e).message.starts_with("pool firewall: "),
            "{e:?}"
        );
    }
}

/// A task failure as tokio reports it (a task cancelled before it finished).
fn join_error() -> tokio::task::JoinError {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let task = tokio::spawn(std::future::pending::<()>());
        task.abort();
        task.await.unwrap_err()
    })
}

#[test]
fn every_pool_host_error_maps_to_its_documented_code() {
    let tap: IfName = "bc0123456789a0".parse().unwrap();
    let cases: Vec<(PoolHostError, ErrorCode, &str)> = vec![
        (
            PoolHostError::Invalid(ValidationError::rule("instance i-1: no NIC")),
            ErrorCode::InvalidInput,
            "instance i-1: no NIC",
        ),
        (
            PoolHostError::Firewall(FirewallError::Duplicate("i-1".into())),
            ErrorCode::Conflict,
            "instance i-1: its taps have rules on this host already",
        ),
        (
            PoolHostError::Firewall(FirewallError::Helper("refused".into())),
            ErrorCode::Unavailable,
            "pool firewall: root helper: refused",
        ),
        (
            PoolHostError::FirewallTask(join_error()),
            ErrorCode::Internal,
            "pool firewall task: ",
        ),
        (
            PoolHostError::Tap(TapError::NoBridge {
                tap: tap.to_string(),
                bridge: "br9".into(),
            }),
            ErrorCode::Unavailable,
            "tap bc0123456789a0: bridge br9 does not exist",
        ),
        (
            PoolHostError::Guard {
                tap: tap.clone(),
                source: GuardError::NoTap(tap.to_string()),
            },
            ErrorCode::Unavailable,
            "tap bc0123456789a0: tap bc0123456789a0: no such device",
        ),
        (
            PoolHostError::GuardTask {
                tap: tap.clone(),
                source: join_error(),
            },
            ErrorCode::Internal,
            "tap bc0123456789a0: guard task: ",
        ),
    ];
    for (e, code, start) in cases {
        assert_eq!(pool_code(&e), code, "{e:?}");
        let wire = from_pool(&e);
        assert_eq!(wire.code, code, "{e:?}");
        assert!(wire.message.starts_with(start), "{wire:?}");
        // Wrapped in its instance: the same code, the message named by the instance.
        let named = PoolHostError::Instance {
            id: "i-1".into(),
            source: Box::new(e),
        };
        assert_eq!(pool_code(&named), code);
        let wire_named = from_pool(&named);
        assert_eq!(wire_named.code, code);
        assert_eq!(
            wire_named.message,
            format!("instance i-1: {}", wire.message)
        );
    }
}

#[test]
fn wireguard_errors_are_unavailable_with_their_wording() {
    let e = WgError::Protocol("errno=-22".into());
    assert_eq!(from_wg(e), Error::unavailable("wireguard uapi: errno=-22"));
}
