//! One request without an async runtime: for a process that makes one call and exits (`vmnet vm
//! put`, `vmnet vm get`, `vmnet status`, …), which an orchestrator may run once per VM.
//!
//! # Design
//! hyper speaks HTTP/1.1 as it does for the async methods, over a socket whose reads and writes
//! block, polled on this thread by `futures`' `block_on`. A poll that reads or writes simply
//! waits for the socket, so no runtime is built (no epoll instance, timer wheel or waker
//! descriptors) and the process sleeps in one `read` while the agent works. The request asks
//! the agent to close the connection after its reply, so hyper never waits for a second one.
//!
//! The bound on the whole exchange is the client's (`Client::with_timeout`): each read and
//! write waits at most for what is left of it. The errors are those of the async methods, word
//! for word.
//!
//! # Limitations
//! One request per connection. Streams (the event stream) stay with the async methods
//! ([`Client::events_lines`]).

use std::io::{ErrorKind, Read as _};
use std::os::fd::AsRawFd as _;
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::{Either, select};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper::header::{CONNECTION, CONTENT_TYPE, HOST};
use hyper::{Method, Request, StatusCode};
use nix::errno::Errno;
use nix::sys::socket::{MsgFlags, recv, send};
use serde::Serialize;
use serde::de::DeserializeOwned;
use vmnet_model::Error;

use super::{
    Client, REPLY_LIMIT_BYTES, decode_error, decode_reply, encode_body, exchange_failed, no_answer,
    reply_failed, unbuildable, unreachable_agent,
};

/// How much one read asks for.
const READ_CHUNK: usize = 16 * 1024;

impl Client {
    /// Sends one request with an optional JSON body and waits for the whole reply, on this
    /// thread, without an async runtime.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the socket cannot be reached, the exchange fails or the agent does
    /// not answer within the client's bound; `INVALID_INPUT` for a path that makes no request
    /// (too long for a request line).
    pub fn send_raw_blocking(
        &self,
        method: &Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), Error> {
        let sock = self.socket.display().to_string();
        let deadline = Instant::now() + self.timeout;
        let unanswered = || no_answer(&sock, method, path, self.timeout);
        let mut req = Request::builder()
            .method(method.clone())
            .uri(path)
            .header(HOST, "vmnet-agent")
            .header(CONNECTION, "close");
        if body.is_some() {
            req = req.header(CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(Full::new(body.map(Bytes::from).unwrap_or_default()))
            .map_err(|e| unbuildable(path, &e))?;
        let stream = connect(&self.socket).map_err(|e| unreachable_agent(&sock, &e))?;
        let io = Blocking {
            stream,
            deadline,
            written: false,
            sent: false,
        };
        let failed = |e: &hyper::Error, what: &str| {
            if io_timed_out(e) {
                unanswered()
            } else {
                exchange_failed(&sock, what, e)
            }
        };
        futures::executor::block_on(async {
            let (mut tx, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| failed(&e, "handshake failed"))?;
            let exchange = async {
                let resp = tx
                    .send_request(req)
                    .await
                    .map_err(|e| failed(&e, &format!("request {path} failed")))?;
                let status = resp.status();
                let bytes = http_body_util::Limited::new(resp.into_body(), REPLY_LIMIT_BYTES)
                    .collect()
                    .await
                    .map_err(|e| match e.downcast_ref::<hyper::Error>() {
                        Some(h) if io_timed_out(h) => unanswered(),
                        _ => reply_failed(&sock, &*e),
                    })?
                    .to_bytes();
                Ok((status, bytes))
            };
            // The connection makes progress only while it is polled: poll it beside the
            // exchange until the exchange has its whole answer.
            match select(std::pin::pin!(exchange), conn).await {
                Either::Left((answer, _conn)) => answer,
                // The connection's own error says more than the request's "closed".
                Either::Right((Err(e), exchange)) => exchange
                    .await
                    .map_err(|_| failed(&e, &format!("request {path} failed"))),
                Either::Right((Ok(()), exchange)) => exchange.await,
            }
        })
    }

    /// [`Client::call`] without an async runtime ([`Client::send_raw_blocking`]).
    ///
    /// # Errors
    /// As [`Client::call`].
    pub fn call_blocking<T: DeserializeOwned>(
        &self,
        method: &Method,
        path: &str,
        body: Option<&(impl Serialize + ?Sized)>,
    ) -> Result<T, Error> {
        let body = body.map(|b| encode_body(path, b)).transpose()?;
        let (status, bytes) = self.send_raw_blocking(method, path, body)?;
        if !status.is_success() {
            return Err(decode_error(status, path, &bytes));
        }
        decode_reply(path, &bytes)
    }

    /// `GET path`, without an async runtime.
    ///
    /// # Errors
    /// As [`Client::call`].
    pub fn get_blocking<T: DeserializeOwned>(&self, path: &str) -> Result<T, Error> {
        self.call_blocking(&Method::GET, path, None::<&()>)
    }

    /// `PUT path` with a JSON body, without an async runtime.
    ///
    /// # Errors
    /// As [`Client::call`].
    pub fn put_blocking<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &(impl Serialize + ?Sized),
    ) -> Result<T, Error> {
        self.call_blocking(&Method::PUT, path, Some(body))
    }

    /// `POST path` with a JSON body (or none), without an async runtime.
    ///
    /// # Errors
    /// As [`Client::call`].
    pub fn post_blocking<T: DeserializeOwned>(
        &self,
        path: &str,
        body: Option<&(impl Serialize + ?Sized)>,
    ) -> Result<T, Error> {
        self.call_blocking(&Method::POST, path, body)
    }

    /// `DELETE path`, without an async runtime.
    ///
    /// # Errors
    /// As [`Client::call`].
    pub fn delete_blocking<T: DeserializeOwned>(&self, path: &str) -> Result<T, Error> {
        self.call_blocking(&Method::DELETE, path, None::<&()>)
    }
}

/// Connects to the unix socket at `path` without waiting for room in its queue: a stopped
/// agent whose queue of connections not yet accepted is full is `WouldBlock` at once, as for the
/// async methods, never a `connect` that waits without bound. The stream blocks afterwards.
fn connect(path: &std::path::Path) -> std::io::Result<UnixStream> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, socket};
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    let addr = UnixAddr::new(path)?;
    nix::sys::socket::connect(fd.as_raw_fd(), &addr)?;
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Whether hyper failed because a read or write ran out of the bound.
fn io_timed_out(e: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return matches!(io.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut);
        }
        source = s.source();
    }
    false
}

/// The socket as hyper's transport. Until the request is out, a read takes only what has
/// already arrived (hyper reads before it writes, to notice a closed connection); after that,
/// every read and write blocks until it is done or `deadline` has passed.
struct Blocking {
    stream: UnixStream,
    deadline: Instant,
    /// Something was written since the last flush.
    written: bool,
    /// The request is out: hyper flushed after writing it.
    sent: bool,
}

impl Blocking {
    /// What is left of the bound, or a timed-out error once it has passed.
    fn remaining(&self) -> std::io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        Ok(left)
    }
}

impl hyper::rt::Read for Blocking {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let mut chunk = [0u8; READ_CHUNK];
        let want = buf.remaining().min(READ_CHUNK);
        let result = if this.sent {
            this.remaining().and_then(|left| {
                this.stream.set_read_timeout(Some(left))?;
                loop {
                    match this.stream.read(&mut chunk[..want]) {
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        other => return other,
                    }
                }
            })
        } else {
            match recv(
                this.stream.as_raw_fd(),
                &mut chunk[..want],
                MsgFlags::MSG_DONTWAIT,
            ) {
                Err(Errno::EAGAIN | Errno::EINTR) => {
                    // Polled again at once: hyper writes the request in this same poll.
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                other => other.map_err(std::io::Error::from),
            }
        };
        Poll::Ready(result.map(|n| buf.put_slice(&chunk[..n])))
    }
}

impl hyper::rt::Write for Blocking {
    /// `MSG_NOSIGNAL`: an agent that hangs up is an error here, not a `SIGPIPE` that ends the
    /// process without a word.
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        bytes: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let result = this.remaining().and_then(|left| {
            this.stream.set_write_timeout(Some(left))?;
            loop {
                match send(this.stream.as_raw_fd(), bytes, MsgFlags::MSG_NOSIGNAL) {
                    Err(Errno::EINTR) => {}
                    other => return other.map_err(std::io::Error::from),
                }
            }
        });
        this.written |= matches!(result, Ok(n) if n > 0);
        Poll::Ready(result)
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // hyper flushes once it has written all it has: the request's head and whole body.
        let this = self.get_mut();
        this.sent |= this.written;
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(self.stream.shutdown(std::net::Shutdown::Write))
    }
}
