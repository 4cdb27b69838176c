//! Pool mode kernel drivers: taps on the host bridge and the bcd nftables tables.
