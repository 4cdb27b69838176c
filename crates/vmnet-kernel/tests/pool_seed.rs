//! Seeds against the real cloud-init parser (Debian's `cloud-init` package, unpacked, run with
//! its Python modules on `PYTHONPATH`) and the seed image against `blkid -p`.
//!
//! cloud-init is taken from `$VMNET_CLOUD_INIT_ROOT` (an unpacked package root) or unpacked once
//! into the target directory with `apt-get download cloud-init` + `dpkg-deb -x`. Its Python
//! dependencies come from apt: python3-yaml python3-jinja2 python3-jsonschema python3-configobj
//! python3-requests python3-jsonpatch python3-netifaces. When any of it is missing the test fails
//! with that message (it never passes silently).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use vmnet_kernel::pool::seed_image::write_iso;
use vmnet_model::nic::{IfName, InstanceSpec, MacAddr, NetworkPolicy, NicSpec};
use vmnet_model::pool::{Family, IpRange, PoolRange};
use vmnet_plan::pool::nic::{Leases, instance_spec};
use vmnet_plan::pool::seed::{Seed, seed};

/// The unpacked cloud-init, fetched once per test binary: the tests run in parallel and would
/// otherwise download and unpack into the same directory at once.
fn cloud_init_root() -> PathBuf {
    static ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    ROOT.get_or_init(fetch_cloud_init_root).clone()
}

fn fetch_cloud_init_root() -> PathBuf {
    if let Some(p) = std::env::var_os("VMNET_CLOUD_INIT_ROOT") {
        return PathBuf::from(p);
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cloud-init");
    let root = dir.join("root");
    if root
        .join("usr/lib/python3/dist-packages/cloudinit")
        .is_dir()
    {
        return root;
    }
    std::fs::create_dir_all(&dir).unwrap();
    let dl = Command::new("apt-get")
        .args(["download", "cloud-init"])
        .current_dir(&dir)
        .output();
    let deb = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"));
    let Some(deb) = deb else {
        panic!(
            "cannot get Debian's cloud-init package (apt-get download cloud-init: {dl:?}); set VMNET_CLOUD_INIT_ROOT to an unpacked copy"
        );
    };
    let x = Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(&root)
        .status()
        .unwrap();
    assert!(x.success(), "dpkg-deb -x {} failed", deb.display());
    root
}

/// A fresh directory under the target's test tmp dir (removed when dropped).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("pool-seed-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn parse_with_cloud_init(s: &Seed) -> Result<Value, String> {
    let dir = TempDir::new("ci");
    for (name, contents) in s.files() {
        std::fs::write(dir.path().join(name), contents).unwrap();
    }
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pool_support/cloud_init_check.py");
    let out = Command::new("/usr/bin/python3")
        .arg(&script)
        .arg(dir.path())
        .env(
            "PYTHONPATH",
            cloud_init_root().join("usr/lib/python3/dist-packages"),
        )
        .output()
        .expect("run /usr/bin/python3");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(serde_json::from_slice(&out.stdout).expect("checker prints JSON"))
}

fn range() -> IpRange {
    IpRange {
        pool_id: "pool-1".into(),
        cidr: "10.0.0.0/29".parse().unwrap(),
        gateway: "10.0.0.1".parse().unwrap(),
        first_host: "10.0.0.2".parse().unwrap(),
        last_host: "10.0.0.6".parse().unwrap(),
        dns: vec!["10.0.0.1".parse().unwrap(), "2001:db8::53".parse().unwrap()],
    }
}

/// A public instance on `br0` with lease `lease` from [`range`].
fn leased(id: &str, alloc: &str, lease: &str) -> InstanceSpec {
    let br: IfName = "br0".parse().unwrap();
    instance_spec(
        id,
        alloc,
        &br,
        Leases::v4(Some((lease.parse().unwrap(), &range()))),
        NetworkPolicy::Public,
        false,
    )
    .unwrap()
}

#[test]
#[ignore = "needs root: runs cloud-init and mounts seed images (scripts/test.sh runs it)"]
fn cloud_init_reads_the_static_seed() {
    let inst = leased("inst-1", "alloc-1", "10.0.0.2");
    let v = parse_with_cloud_init(&seed(&inst, None).unwrap()).unwrap();
    assert_eq!(v["meta"]["instance-id"], "inst-1");
    let eth0 = &v["interfaces"][0];
    assert_eq!(eth0["name"], "eth0");
    assert_eq!(
        eth0["mac"], "02:81:bf:91:24:5c",
        "the MAC stays a string (no YAML 1.1 base-60 number)"
    );
    let sub = &eth0["subnets"][0];
    assert_eq!(sub["type"], "static");
    assert_eq!(sub["address"], "10.0.0.2");
    assert_eq!(sub["prefix"], 29);
    assert_eq!(sub["routes"][0]["gateway"], "10.0.0.1");
    assert_eq!(sub["routes"][0]["network"], "0.0.0.0");
    assert_eq!(
        sub["dns_nameservers"],
        serde_json::json!(["10.0.0.1", "2001:db8::53"])
    );
    let networkd = v["networkd"]["eth0"].as_str().unwrap();
    for line in [
        "Address=10.0.0.2/29",
        "MACAddress=02:81:bf:91:24:5c",
        "Gateway=10.0.0.1",
        "Destination=0.0.0.0/0",
    ] {
        assert!(networkd.contains(line), "{line} missing in\n{networkd}");
    }
}

/// A lease outside its (replaced) range is a `/32` with the range's gateway: the default route
/// must be on-link, or the gateway is unreachable from the guest.
#[test]
#[ignore = "needs root: runs cloud-init and mounts seed images (scripts/test.sh runs it)"]
fn cloud_init_reads_an_on_link_default_route_for_a_32_lease() {
    let inst = leased("inst-4", "alloc-4", "10.0.1.2");
    let v = parse_with_cloud_init(&seed(&inst, None).unwrap()).unwrap();
    let sub = &v["interfaces"][0]["subnets"][0];
    assert_eq!(sub["address"], "10.0.1.2");
    assert_eq!(sub["prefix"], 32);
    assert_eq!(sub["routes"][0]["gateway"], "10.0.0.1");
    assert_eq!(sub["routes"][0]["network"], "0.0.0.0");
    // Netplan guests get the route as written: on-link through the gateway outside the /32.
    let eth0 = &v["netplan"]["network"]["ethernets"]["eth0"];
    assert_eq!(eth0["addresses"], serde_json::json!(["10.0.1.2/32"]));
    assert_eq!(
        eth0["routes"],
        serde_json::json!([{"to": "0.0.0.0/0", "via": "10.0.0.1", "on-link": true}]),
        "{v}"
    );
    let networkd = v["networkd"]["eth0"].as_str().unwrap();
    for line in ["Address=10.0.1.2/32", "Gateway=10.0.0.1"] {
        assert!(networkd.contains(line), "{line} missing in\n{networkd}");
    }

    // A lease inside its range: no on-link (the gateway is on the subnet).
    let inside = leased("inst-4", "alloc-4", "10.0.0.2");
    let v = parse_with_cloud_init(&seed(&inside, None).unwrap()).unwrap();
    assert_eq!(
        v["netplan"]["network"]["ethernets"]["eth0"]["routes"],
        serde_json::json!([{"to": "0.0.0.0/0", "via": "10.0.0.1"}])
    );
}

/// A dual-stack lease: cloud-init reads both addresses and both default routes, and the
/// renderers write both (and no router advertisements for the IPv6 address).
#[test]
#[ignore = "needs root: runs cloud-init and mounts seed images (scripts/test.sh runs it)"]
fn cloud_init_reads_both_leases_and_both_default_routes() {
    let br: IfName = "br0".parse().unwrap();
    let r6 = PoolRange {
        pool_id: "pool-1".into(),
        family: Family::Ipv6,
        cidr: "2001:db8:10::/64".parse().unwrap(),
        gateway: "2001:db8:10::1".parse().unwrap(),
        first_host: "2001:db8:10::2".parse().unwrap(),
        last_host: "2001:db8:10::6".parse().unwrap(),
    };
    let leases = Leases {
        v4: Some(("10.0.0.2".parse().unwrap(), &range())),
        v6: Some(("2001:db8:10::2".parse().unwrap(), &r6)),
    };
    let inst = instance_spec(
        "inst-5",
        "alloc-5",
        &br,
        leases,
        NetworkPolicy::Public,
        false,
    )
    .unwrap();
    let v = parse_with_cloud_init(&seed(&inst, None).unwrap()).unwrap();
    let subs = v["interfaces"][0]["subnets"].as_array().unwrap();
    // The IPv4 subnet with its 0.0.0.0/0 route, the IPv6 subnet with its gateway (the
    // default route; a `::/0` route would be read as `::/64`).
    assert_eq!(subs.len(), 2, "{v}");
    assert_eq!(
        (&subs[0]["address"], &subs[0]["prefix"]),
        (&"10.0.0.2".into(), &29.into())
    );
    let r4 = &subs[0]["routes"];
    assert_eq!(r4.as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(
        (&r4[0]["network"], &r4[0]["prefix"]),
        (&"0.0.0.0".into(), &0.into())
    );
    assert_eq!(r4[0]["gateway"], "10.0.0.1");
    assert_eq!(
        (&subs[1]["address"], &subs[1]["prefix"], &subs[1]["gateway"]),
        (
            &"2001:db8:10::2".into(),
            &64.into(),
            &"2001:db8:10::1".into()
        ),
        "{v}"
    );
    let eth0 = &v["netplan"]["network"]["ethernets"]["eth0"];
    assert_eq!(
        eth0["addresses"],
        serde_json::json!(["10.0.0.2/29", "2001:db8:10::2/64"])
    );
    assert_eq!(
        eth0["routes"],
        serde_json::json!([{"to": "0.0.0.0/0", "via": "10.0.0.1"}])
    );
    assert_eq!(eth0["gateway6"], "2001:db8:10::1", "{v}");
    assert_eq!(eth0["accept-ra"], false, "{v}");
    // systemd-networkd: both addresses, the IPv4 default route and a gateway-only route (the
    // IPv6 default route), nothing to ::/64.
    let networkd = v["networkd"]["eth0"].as_str().unwrap();
    for line in [
        "Address=10.0.0.2/29",
        "Address=2001:db8:10::2/64",
        "Destination=0.0.0.0/0",
        "Gateway=10.0.0.1",
        "Gateway=2001:db8:10::1",
    ] {
        assert!(networkd.contains(line), "{line} missing in\n{networkd}");
    }
    assert!(!networkd.contains("Destination=::"), "{networkd}");
}

#[test]
#[ignore = "needs root: runs cloud-init and mounts seed images (scripts/test.sh runs it)"]
fn cloud_init_keeps_dhcp_and_reads_ipv6_default_route() {
    let inst = InstanceSpec {
        id: "inst-2".into(),
        allocation_id: "alloc-2".into(),
        policy: NetworkPolicy::Private,
        sandbox: false,
        nics: vec![
            NicSpec {
                network: Some("br0".parse().unwrap()),
                mac: MacAddr::for_instance("inst-2"),
                addresses: vec!["2001:db8:5::7/64".parse().unwrap()],
                gateway: Some("2001:db8:5::1".parse().unwrap()),
                gateway6: None,
                nameservers: vec![],
            },
            NicSpec {
                network: Some("br1".parse().unwrap()),
                mac: "02:00:00:00:00:42".parse().unwrap(),
                addresses: vec![],
                gateway: None,
                gateway6: None,
                nameservers: vec![],
            },
        ],
    };
    let v = parse_with_cloud_init(&seed(&inst, None).unwrap()).unwrap();
    // The IPv6 gateway is the subnet's gateway (the default route in every renderer), not a
    // route cloud-init would read as ::/64.
    let subs0 = &v["interfaces"][0]["subnets"][0];
    assert_eq!(subs0["gateway"], "2001:db8:5::1", "{v}");
    assert_eq!(subs0["routes"], serde_json::json!([]), "{v}");
    let networkd = v["networkd"]["eth0"].as_str().unwrap();
    assert!(networkd.contains("Gateway=2001:db8:5::1"), "{networkd}");
    assert!(!networkd.contains("Destination=::"), "{networkd}");
    assert_eq!(v["interfaces"][1]["name"], "eth1");
    assert_eq!(v["interfaces"][1]["subnets"][0]["type"], "dhcp4");
}

#[test]
#[ignore = "needs root: runs cloud-init and mounts seed images (scripts/test.sh runs it)"]
fn no_static_nic_writes_no_network_config() {
    let br: IfName = "br0".parse().unwrap();
    let inst = instance_spec(
        "inst-3",
        "alloc-3",
        &br,
        Leases::default(),
        NetworkPolicy::Public,
        false,
    )
    .unwrap();
    let s = seed(&inst, None).unwrap();
    assert!(s.network_config.is_none());
    let v = parse_with_cloud_init(&s).unwrap();
    assert!(v.get("interfaces").is_none());
}

#[test]
#[ignore = "needs root: runs cloud-init and mounts seed images (scripts/test.sh runs it)"]
fn the_checker_rejects_a_yaml_seed_that_reads_a_mac_as_a_number() {
    // Control: the checker is strict enough to fail a broken seed (a YAML emitter's unquoted
    // MAC, as serde_yaml writes it), so the passes above mean something.
    let bad = Seed {
        meta_data: "instance-id: x\n".into(),
        user_data: "#cloud-config\n{}\n".into(),
        network_config: Some(
            "version: 2\nethernets:\n  eth0:\n    match:\n      macaddress: 52:54:00:12:34:56\n    addresses: [10.0.0.2/29]\n"
                .into(),
        ),
    };
    assert!(parse_with_cloud_init(&bad).is_err());
}

#[test]
#[ignore = "needs root: runs cloud-init and mounts seed images (scripts/test.sh runs it)"]
fn seed_iso_has_the_cidata_label_and_the_files() {
    let inst = leased("inst-4", "alloc-4", "10.0.0.5");
    let s = seed(&inst, None).unwrap();
    let dir = TempDir::new("iso");
    let iso = dir.path().join("seed.iso");
    write_iso(&s, &iso).unwrap();
    let out = Command::new("blkid")
        .arg("-p")
        .arg("-o")
        .arg("export")
        .arg(&iso)
        .output()
        .expect("blkid");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("LABEL=cidata"), "{text}");
    assert!(text.contains("TYPE=iso9660"), "{text}");
    let list = Command::new("isoinfo")
        .args(["-R", "-f", "-i"])
        .arg(&iso)
        .output()
        .expect("isoinfo");
    let files = String::from_utf8_lossy(&list.stdout);
    for f in ["/meta-data", "/user-data", "/network-config"] {
        assert!(files.lines().any(|l| l == f), "{f} missing: {files}");
    }
    let nc = Command::new("isoinfo")
        .args(["-R", "-x", "/network-config", "-i"])
        .arg(&iso)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&nc.stdout),
        s.network_config.unwrap()
    );
}
