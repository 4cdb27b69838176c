//! The iperf3 server the throughput benches run in a namespace.

use std::net::IpAddr;
use std::process::{Child, Command, Stdio};

use vmnet_model::Error;

/// `iperf3 -s -B <addr> -p <port>` inside a namespace, killed by its pid on drop.
pub struct Server(Child);

impl Server {
    /// Starts the server in `ns`.
    ///
    /// # Errors
    /// `UNAVAILABLE` when `ip netns exec … iperf3` cannot start.
    pub fn start(ns: &str, addr: impl Into<IpAddr>, port: u16) -> Result<Self, Error> {
        Command::new("ip")
            .args(["netns", "exec", ns, "iperf3", "-s", "-B"])
            .arg(addr.into().to_string())
            .args(["-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map(Self)
            .map_err(|e| Error::unavailable(format!("iperf3 -s in {ns}: {e}")))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
