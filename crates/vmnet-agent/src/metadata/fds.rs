//! The service's sockets live at descriptor numbers of 1024 and above ([`FD_MIN`]), as
//! `vmnet_kernel::nftgen`'s kept sockets do: a host with 1,000 VMs holds a listener (and a
//! guest's keep-alive connection) per VM, and the numbers below `FD_SETSIZE` are left to
//! libnftables, which waits with `select(2)` and aborts (glibc's fortify check) on a
//! descriptor at or above it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The lowest descriptor number the service's sockets take, where the open-files limit allows
/// (`FD_SETSIZE`).
pub const FD_MIN: libc::c_int = 1024;

/// `t`'s socket under the lowest free descriptor number at or above `min` (close-on-exec; the
/// old descriptor is closed, the socket and its flags stay). Where that fails (e.g. `min` at or
/// above `RLIMIT_NOFILE`), `t` as it is.
pub fn move_above<T: AsRawFd + From<OwnedFd>>(t: T, min: libc::c_int) -> T {
    if t.as_raw_fd() >= min {
        return t;
    }
    // SAFETY: F_DUPFD_CLOEXEC only reads the descriptor `t` owns for the whole call.
    let fd = unsafe { libc::fcntl(t.as_raw_fd(), libc::F_DUPFD_CLOEXEC, min) };
    if fd < 0 {
        return t;
    }
    // SAFETY: `fd` is a descriptor fcntl(2) just made; nothing else owns it.
    T::from(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Accepts one connection on `listener`, its descriptor moved to [`FD_MIN`] or above (taken
/// off the runtime, moved, registered again: a few system calls more per connection, which lives
/// for up to [`super::limits::CONNECTION_LIFETIME_SECS`]).
///
/// # Errors
/// The accept's error (e.g. `EMFILE`), or the runtime's on registering the moved socket.
pub async fn accept(listener: &tokio::net::TcpListener) -> std::io::Result<tokio::net::TcpStream> {
    let (s, _) = listener.accept().await?;
    if s.as_raw_fd() >= FD_MIN {
        return Ok(s);
    }
    let s = s.into_std()?;
    tokio::net::TcpStream::from_std(move_above(s, FD_MIN))
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;

    /// Raises the soft open-files limit so that `FD_MIN` is usable (as `vmnet` does at start);
    /// whether it could.
    fn room_above_fd_min() -> bool {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit read and write the live struct `lim` only.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut lim) != 0 {
                return false;
            }
            let want = lim.rlim_max.min(4096);
            if lim.rlim_cur < want {
                lim.rlim_cur = want;
                let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim);
                let _ = libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut lim);
            }
        }
        lim.rlim_cur > 1100
    }

    #[test]
    fn listeners_and_connections_move_above_the_floor() {
        let room = room_above_fd_min();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let l = move_above(l, FD_MIN);
        assert_eq!(l.as_raw_fd() >= FD_MIN, room, "{}", l.as_raw_fd());
        l.set_nonblocking(true).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(l).unwrap();
            let client = std::thread::spawn(move || {
                let mut c = std::net::TcpStream::connect(addr).unwrap();
                c.write_all(b"ping").unwrap();
                let mut b = [0u8; 4];
                c.read_exact(&mut b).unwrap();
                b
            });
            let s = accept(&l).await.unwrap();
            assert_eq!(s.as_raw_fd() >= FD_MIN, room, "{}", s.as_raw_fd());
            let mut b = [0u8; 4];
            let mut s = s;
            tokio::io::AsyncReadExt::read_exact(&mut s, &mut b)
                .await
                .unwrap();
            tokio::io::AsyncWriteExt::write_all(&mut s, b"pong")
                .await
                .unwrap();
            assert_eq!(&b, b"ping");
            assert_eq!(&client.join().unwrap(), b"pong");
        });
    }

    #[test]
    fn a_floor_above_the_limit_keeps_the_socket() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let before = l.as_raw_fd();
        let l = move_above(l, libc::c_int::MAX);
        assert_eq!(l.as_raw_fd(), before);
        assert!(l.local_addr().is_ok());
    }
}
