//! Applying a [`GuestNet`] over rtnetlink alone, for images without networkd
//! (`--apply netlink`): the difference between what is asked for and what the kernel has
//! ([`crate::plan`]), nothing else. The routes vmnet-guest owns are those of its last apply in
//! this process (there is no drop-in to remember them across a restart); mesh addresses other
//! than the one asked for are deleted whatever put them there.

use crate::doc::GuestNet;
use crate::kernel::Kernel;
use crate::networkd::Applied;
use crate::plan;

/// Configures the interface through a [`Kernel`].
#[derive(Debug)]
pub struct Netlink<K> {
    kernel: K,
    last: Vec<ipnet::IpNet>,
}

impl<K: Kernel> Netlink<K> {
    /// An applier changing the interface through `kernel`.
    pub fn new(kernel: K) -> Self {
        Self {
            kernel,
            last: Vec::new(),
        }
    }

    /// Applies `net` (see the module docs).
    ///
    /// # Errors
    /// The first netlink request that fails; the next apply starts over.
    pub async fn apply(&mut self, net: &GuestNet) -> Result<Applied, String> {
        let seen = self.kernel.observe().await?;
        let changes = plan::plan(net, &seen, &self.last, &[]);
        self.kernel.apply(&changes).await?;
        self.last = plan::wanted_routes(net);
        Ok(Applied {
            changes,
            ..Applied::default()
        })
    }
}
