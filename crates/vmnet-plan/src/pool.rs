//! Pool mode planning: NICs, guest network-config, runtime NIC configs and the bcd nftables tables.
