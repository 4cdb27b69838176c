//! Small rtnetlink helpers shared by namespace mode and the mesh interface.

use futures::TryStreamExt;
use netlink_packet_route::link::LinkMessage;
use rtnetlink::Handle;

/// The errno of a netlink error answer (positive, e.g. `libc::ENODEV`), if it is one.
pub(crate) fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| -c.get()),
        _ => None,
    }
}

/// The kernel's message for the link called `name` in `h`'s namespace, or `None` when there is
/// no such link (ENODEV/ENOENT).
///
/// # Errors
/// Any other failure of the request.
pub(crate) async fn link_by_name(
    h: &Handle,
    name: &str,
) -> Result<Option<LinkMessage>, rtnetlink::Error> {
    let res: Result<Vec<LinkMessage>, _> = h
        .link()
        .get()
        .match_name(name.to_owned())
        .execute()
        .try_collect()
        .await;
    match res {
        Ok(v) => Ok(v.into_iter().next()),
        Err(e) if matches!(errno(&e), Some(libc::ENODEV | libc::ENOENT)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Runs the dump `f` makes, again (up to 20 times, 5 ms apart) while the kernel refuses it with
/// EBUSY: a netlink socket runs one dump at a time, and a handle is shared by tasks.
///
/// # Errors
/// The dump's last error.
pub(crate) async fn retry_busy<T, F, Fut>(mut f: F) -> Result<T, rtnetlink::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, rtnetlink::Error>>,
{
    let mut tries = 0;
    loop {
        match f().await {
            Err(e) if tries < 20 && errno(&e) == Some(libc::EBUSY) => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            res => return res,
        }
    }
}
