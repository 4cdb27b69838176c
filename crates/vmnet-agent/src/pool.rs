//! Pool mode in the agent: the root helper for nftables, the drift audit.
