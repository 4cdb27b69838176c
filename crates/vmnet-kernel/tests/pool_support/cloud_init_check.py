"""Reads a NoCloud seed directory with cloud-init's own code and prints what it understood.

Usage: python3 cloud_init_check.py SEED_DIR  (PYTHONPATH must hold cloud-init's modules)

Prints one JSON object: meta-data, user-data (after strict cloud-config schema validation),
and, when network-config exists, the parsed network state (interfaces with MAC and subnets,
nameservers), the systemd-networkd files cloud-init's renderer would write and the netplan
configuration its netplan renderer would write (read back as a mapping).
"""
import json
import sys

from cloudinit import util
from cloudinit.config import schema
from cloudinit.net import netplan, network_state, networkd

seed = util.pathprefix2dict(
    sys.argv[1], required=["meta-data", "user-data"], optional=["network-config"]
)
out = {"meta": util.load_yaml(seed["meta-data"])}
ud = seed["user-data"]
ud = ud.decode() if isinstance(ud, bytes) else ud
if not ud.startswith("#cloud-config\n"):
    raise SystemExit("user-data does not start with #cloud-config")
cfg = util.load_yaml(ud)
schema.validate_cloudconfig_schema(cfg, schema.get_schema(), strict=True)
out["user"] = cfg
if "network-config" in seed:
    ncfg = util.load_yaml(seed["network-config"])
    if not isinstance(ncfg, dict):
        raise SystemExit("network-config is not a mapping")
    state = network_state.parse_net_config_data(ncfg)
    out["interfaces"] = [
        {"name": i["name"], "mac": i.get("mac_address"), "subnets": i.get("subnets", [])}
        for i in state.iter_interfaces()
    ]
    out["dns"] = state.dns_nameservers
    out["networkd"] = networkd.Renderer({})._render_content(state)
    out["netplan"] = util.load_yaml(netplan.Renderer({})._render_content(state))
print(json.dumps(out, default=str))
