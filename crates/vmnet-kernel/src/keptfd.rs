//! Where descriptors kept by the thousand go (a socket or two per VM namespace): at or above
//! `FD_SETSIZE`, so they never take the numbers below it. libnftables waits for its answers
//! with `select(2)`, which takes descriptors below 1024 only (glibc's fortify check aborts the
//! process on any other), and it opens its sockets whenever the agent runs an nft batch.

use std::os::fd::{AsFd, FromRawFd};

/// The lowest descriptor number a kept socket moves to.
pub const KEPT_FD_MIN: i32 = 1024;

/// `t` under the lowest free descriptor at or above [`KEPT_FD_MIN`] (the same open file under
/// a new, close-on-exec descriptor; the old one is closed, which does not close the file).
/// Where that fails (the limit of open files at or below it) `t` stays where it is.
pub fn move_above<T: AsFd + FromRawFd>(t: T) -> T {
    use std::os::fd::AsRawFd;
    if t.as_fd().as_raw_fd() >= KEPT_FD_MIN {
        return t;
    }
    match nix::fcntl::fcntl(
        t.as_fd(),
        nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(KEPT_FD_MIN),
    ) {
        // SAFETY: `fd` is a descriptor fcntl(2) just made for this file; nothing else owns
        // it, and `t` (dropped here) closes only its own.
        Ok(fd) => unsafe { T::from_raw_fd(fd) },
        Err(_) => t,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_kept_socket_moves_above_the_select_range_and_still_works() {
        let (a, b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let a = move_above(a);
        assert!(
            a.as_raw_fd() >= KEPT_FD_MIN || a.as_raw_fd() < 3,
            "{}",
            a.as_raw_fd()
        );
        a.send(b"x").unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(b.recv(&mut buf).unwrap(), 1);
    }
}
